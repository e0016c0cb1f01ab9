// Matrix-vector products for decode (a few tokens): y[t, r] = sum_k x[t, k] * W[r, k].
// One warp per weight row, each lane one 32-value block at a time, so a warp streams 32 consecutive
// blocks of its row; NT tokens (1..8) share every weight load, which is what makes decode cheap.
//
// gemv_dp4a: weights stay int8/int4, activations come from quantize_q8_1, int32 dot products by DP4A,
//            fp32 scaling and accumulation.
// gemv_fma:  weights dequantized to fp32 in registers, fp32 FMA against fp32 activations (the fallback
//            for cards whose DP4A is throttled, and the path of F32/F16/BF16 weights).
// Both take optional `ids` for mixture-of-experts: then grid.y enumerates (token, slot) pairs p, the
// weight is expert ids[p] of a stack of experts with R rows each, and the input row is p / x_div.
// Optional `res` (same shape as y) is added to the result: the residual add of a layer in the epilogue.

struct WBlock {
    int q[8];      // 32 signed int8 weights, 4 per int
    float dlo, dhi;  // scale of values 0..15 and 16..31
    float m;       // constant added per unit of the activation sum (Q4_0 -8d, Q4_K -dmin*m, Q4_1/Q5_1 m)
};

template <int QT>
__device__ __forceinline__ void load_wblock(const u8* wrow, const u16* wdrow, int b, WBlock& w) {
    if (QT == QT_Q8_0) {
        const int4* p = (const int4*)(wrow) + b * 2;
        int4 a = p[0], c = p[1];
        w.q[0] = a.x; w.q[1] = a.y; w.q[2] = a.z; w.q[3] = a.w;
        w.q[4] = c.x; w.q[5] = c.y; w.q[6] = c.z; w.q[7] = c.w;
        w.dlo = w.dhi = h2f(wdrow[b]);
        w.m = 0.0f;
    } else if (QT == QT_Q4_0) {
        int4 a = ((const int4*)(wrow))[b];
        int v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w.q[i] = v[i] & 0x0f0f0f0f;
            w.q[4 + i] = (v[i] >> 4) & 0x0f0f0f0f;
        }
        float d = h2f(wdrow[b]);
        w.dlo = w.dhi = d;
        w.m = -8.0f * d;
    } else if (q32_format(QT)) {  // Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS (common.cuh q32_block)
        Q32Block k;
        q32_block<QT>(wrow, wdrow, b, k);
#pragma unroll
        for (int i = 0; i < 8; i++) w.q[i] = k.q[i];
        w.dlo = w.dhi = k.d;
        w.m = k.m;
    } else {  // Q4_K, Q5_K, Q6_K: the repacked layout (common.cuh kq_load)
        kq_load<QT>(wrow, wdrow, b, w.q, w.dlo, w.dhi, w.m);
    }
}

// acc += weight block w times the quantized activation block xb (32 int8 values xq[32 xb..], scale
// xd[xb], sum xs[xb]): two DP4A chains of 16 values (one per scale half), scaled and added in fp32.
__device__ __forceinline__ void wblock_dot_acc(float& acc, const WBlock& w, const i8* __restrict__ xq,
                                               const float* __restrict__ xd, const float* __restrict__ xs,
                                               i64 xb) {
    const int4* xp = (const int4*)(xq + xb * 32);
    int4 a = xp[0], c = xp[1];
    int lo = dp4a(w.q[0], a.x, 0);
    lo = dp4a(w.q[1], a.y, lo);
    lo = dp4a(w.q[2], a.z, lo);
    lo = dp4a(w.q[3], a.w, lo);
    int hi = dp4a(w.q[4], c.x, 0);
    hi = dp4a(w.q[5], c.y, hi);
    hi = dp4a(w.q[6], c.z, hi);
    hi = dp4a(w.q[7], c.w, hi);
    acc += xd[xb] * (w.dlo * (float)lo + w.dhi * (float)hi) + w.m * xs[xb];
}

template <int QT, int NT>
__global__ void gemv_dp4a(const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
                          const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y,
                          int R, int K, const int* __restrict__ ids, int x_div,
                          const float* __restrict__ res) {
    pdl_entry();
    int warps = blockDim.x >> 5;
    int row = blockIdx.x * warps + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= R) return;
    int nb = K >> 5;
    i64 wrow_idx = row;
    int xt0 = 0, yt0 = 0;
    if (ids != 0) {
        int p = blockIdx.y;
        wrow_idx = (i64)ids[p] * R + row;
        xt0 = p / x_div;
        yt0 = p;
    }
    const u8* wrow = wq + wrow_idx * row_bytes<QT>(K);
    const u16* wdrow = wd + wrow_idx * nb;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    // Four blocks per lane are loaded before any is used, so each warp keeps 4 KB of weights in
    // flight: decode GEMVs are short (a 4096-wide row is 4 blocks per lane) and latency-bound otherwise.
    for (int b0 = lane; b0 < nb; b0 += 32 * 4) {
        WBlock w[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (b0 + 32 * u < nb) load_wblock<QT>(wrow, wdrow, b0 + 32 * u, w[u]);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int b = b0 + 32 * u;
            if (b >= nb) break;
#pragma unroll
            for (int t = 0; t < NT; t++) {
                wblock_dot_acc(acc[t], w[u], xq, xd, xs, (i64)(xt0 + t) * nb + b);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = warp_sum(acc[t]);
        i64 yi = (i64)(yt0 + t) * R + row;
        if (lane == 0) y[yi] = res != 0 ? v + res[yi] : v;
    }
}

template <int QT, int NT>
__global__ void gemv_fma(const u8* __restrict__ wq, const u16* __restrict__ wd, const float* __restrict__ x,
                         float* __restrict__ y, int R, int K, const int* __restrict__ ids, int x_div,
                         const float* __restrict__ res) {
    pdl_entry();
    int warps = blockDim.x >> 5;
    int row = blockIdx.x * warps + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= R) return;
    int nb = K >> 5;
    i64 wrow_idx = row;
    int xt0 = 0, yt0 = 0;
    if (ids != 0) {
        int p = blockIdx.y;
        wrow_idx = (i64)ids[p] * R + row;
        xt0 = p / x_div;
        yt0 = p;
    }
    const u8* wrow = wq + wrow_idx * row_bytes<QT>(K);
    const u16* wdrow = wd + wrow_idx * nb;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        float w[32];
        deq_block32<QT>(wrow, wdrow, b, w);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float4* xp = (const float4*)(x + (i64)(xt0 + t) * K + 32 * b);
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float4 v = xp[i];
                s = fmaf(w[4 * i], v.x, s);
                s = fmaf(w[4 * i + 1], v.y, s);
                s = fmaf(w[4 * i + 2], v.z, s);
                s = fmaf(w[4 * i + 3], v.w, s);
            }
            acc[t] += s;
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = warp_sum(acc[t]);
        i64 yi = (i64)(yt0 + t) * R + row;
        if (lane == 0) y[yi] = res != 0 ? v + res[yi] : v;
    }
}

// gemv_dp4a_split: the decode (few-token) DP4A GEMV with WPR warps per row and at most 64 registers
// (__launch_bounds__(128, 8): 8 blocks of 4 warps resident per SM). A block of 4 warps takes 4 / WPR
// rows; warp `sub` of a row reads the row's blocks sub*32 + lane, + 32 * WPR, ... (4 per lane in flight),
// and the WPR warp sums are added in warp order through shared memory (deterministic, fp32). Splitting
// a row gives R * WPR warp tasks instead of R, so the last wave of a short GEMV (4096 rows) is not left
// mostly empty. PF: each lane also asks L2 for its next round's 4 blocks (prefetch.global.L2, a hint
// that holds no registers) before waiting on the current round, for rows of several rounds (long K).
// No expert ids (matmul_experts keeps gemv_dp4a); optional residual `res` as gemv_dp4a.
template <int QT, int NT, int WPR, int PF>
__global__ void __launch_bounds__(128, 8)
gemv_dp4a_split(const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
                const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y,
                int R, int K, const float* __restrict__ res) {
    pdl_entry();
    constexpr int RPB = 4 / WPR;  // rows per block (blockDim.x must be 128)
    __shared__ float part[4][NT];
    int warp = threadIdx.x >> 5;
    int lane = threadIdx.x & 31;
    int sub = warp % WPR;
    int row = blockIdx.x * RPB + warp / WPR;
    bool live = row < R;  // no early return: the block meets at __syncthreads below
    int nb = K >> 5;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    if (live) {
        const u8* wrow = wq + (i64)row * row_bytes<QT>(K);
        const u16* wdrow = wd + (i64)row * nb;
        const int bpb = (int)(row_bytes<QT>(K) / nb);  // bytes per 32-value block (Q6_K: rounded down)
        for (int b0 = sub * 32 + lane; b0 < nb; b0 += 32 * WPR * 4) {
            WBlock w[4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (b0 + 32 * WPR * u < nb) load_wblock<QT>(wrow, wdrow, b0 + 32 * WPR * u, w[u]);
            if (PF) {
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    int bn = b0 + 32 * WPR * (4 + u);  // the same lane's block one round ahead
                    if (bn < nb) {  // its bytes start about bn / nb of the way along the row
                        const u8* a = wrow + (i64)bn * bpb;
                        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                int b = b0 + 32 * WPR * u;
                if (b >= nb) break;
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    wblock_dot_acc(acc[t], w[u], xq, xd, xs, (i64)t * nb + b);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = warp_sum(acc[t]);
        if (WPR == 1) {
            i64 yi = (i64)t * R + row;
            if (live && lane == 0) y[yi] = res != 0 ? v + res[yi] : v;
        } else if (lane == 0) {
            part[warp][t] = v;
        }
    }
    if (WPR > 1) {
        __syncthreads();
        // thread i < RPB * NT: row i / NT of the block, token i % NT
        int i = threadIdx.x;
        if (i < RPB * NT) {
            int r = i / NT, t = i % NT;
            int orow = blockIdx.x * RPB + r;
            if (orow < R) {
                float v = part[r * WPR][t];
#pragma unroll
                for (int s = 1; s < WPR; s++) v += part[r * WPR + s][t];
                i64 yi = (i64)t * R + orow;
                y[yi] = res != 0 ? v + res[yi] : v;
            }
        }
    }
}

// acc += block b of a K-quant row (held raw in w, as kq_load_raw left it) dotted with activation block
// b (q8_1: xq, xd, xs). Every lane of the warp calls it (kq_raw_scales shuffles); lanes with b >= nb
// add nothing. Q4_K / Q5_K: one DP4A chain over the 32 values (one scale); Q6_K: one per half (a scale
// each).
template <int QT>
__device__ __forceinline__ void kq_block_dot(const KqRaw& w, int ddsh, int b, int nb, const i8* __restrict__ xq,
                                             const float* __restrict__ xd, const float* __restrict__ xs,
                                             float& acc) {
    float dlo, dhi, m;
    kq_raw_scales<QT>(w, ddsh, dlo, dhi, m);
    if (b < nb) {
        const int4* xp = (const int4*)(xq + (i64)b * 32);
        int4 a = xp[0], c = xp[1];
        int xa[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        u32 vv[4] = {w.v.x, w.v.y, w.v.z, w.v.w};
        int q[8];
#pragma unroll
        for (int k = 0; k < 4; k++) kq_expand<QT>(vv[k], w.h0, w.h1, k, q[k], q[4 + k]);
        if (QT == QT_Q6_K) {
            int lo = 0, hi = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                lo = dp4a(q[k], xa[k], lo);
                hi = dp4a(q[4 + k], xa[4 + k], hi);
            }
            acc += xd[b] * (dlo * (float)lo + dhi * (float)hi);
        } else {
            int sum = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) sum = dp4a(q[k], xa[k], sum);
            acc = fmaf(xd[b] * dlo, (float)sum, acc);
            acc = fmaf(m, xs[b], acc);
        }
    }
}

// gemv_kq: the single-token DP4A GEMV of the K-quants (Q4_K, Q5_K, Q6_K) in their repacked layout
// (common.cuh), gemv_dp4a_split's geometry: blocks of 4 warps, WPR warps per row (warp sums added in
// warp order through shared memory), 8 blocks per SM (64 registers) for NU = 4, 5 (96 registers, no
// spills on sm_61..sm_90 per ptxas) for NU = 8. Each lane has NU blocks in flight,
// held as they arrive (Q4_K: 16 nibble bytes + its u16 wd entry = 5 registers; Q5_K + one high-bit
// word; Q6_K + two and its d) and expanded to int8 one block at a time, so twice the blocks of
// gemv_dp4a_split fit in the same registers. Loads are 16-byte (nibbles), 4/8-byte (high bits) and
// 2-byte (wd entry), all coalesced across the warp. Q4_K / Q5_K: the super-block's d and dmin are
// gathered from the top nibbles of its 8 lanes' wd entries by three xor-shuffles (lanes 8g..8g+7 hold
// one super-block's 8 blocks, as b & 7 == lane & 7), so no lane re-reads or re-decodes a scale field.
// The loop is uniform over the warp (the shuffles need every lane); lanes past the row end load
// nothing and add nothing. Optional residual `res` (1, R) as gemv_dp4a.
template <int QT, int WPR, int NU>
__global__ void __launch_bounds__(128, NU > 4 ? 5 : 8)
gemv_kq(const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
        const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y, int R, int K,
        const float* __restrict__ res) {
    constexpr int RPB = 4 / WPR;  // rows per block (blockDim.x must be 128)
    pdl_entry_prefetch(wq + (i64)blockIdx.x * RPB * row_bytes<QT>(K),
                       (i64)max(0, min(RPB, R - (int)blockIdx.x * RPB)) * row_bytes<QT>(K));
    __shared__ float part[4];
    int warp = threadIdx.x >> 5;
    int lane = threadIdx.x & 31;
    int sub = warp % WPR;
    int row = blockIdx.x * RPB + warp / WPR;
    int nb = K >> 5;
    float acc = 0.0f;
    if (row < R) {  // uniform over the warp
        const u8* wrow = wq + (i64)row * row_bytes<QT>(K);
        const u16* wdrow = wd + (i64)row * nb;
        const int ddsh = kq_dd_shift(lane & 7);
        for (int base = sub * 32; base < nb; base += 32 * WPR * NU) {
            KqRaw w[NU];
#pragma unroll
            for (int u = 0; u < NU; u++) {
                int b = base + 32 * WPR * u + lane;
                kq_load_raw<QT>(wrow, wdrow, b, b < nb, w[u]);
            }
#pragma unroll
            for (int u = 0; u < NU; u++) kq_block_dot<QT>(w[u], ddsh, base + 32 * WPR * u + lane, nb, xq, xd, xs, acc);
        }
    }
    float s = warp_sum(acc);
    if (WPR == 1) {
        if (row < R && lane == 0) y[row] = res != 0 ? s + res[row] : s;
    } else {
        if (lane == 0) part[warp] = s;
        __syncthreads();
        int i = threadIdx.x;
        if (i < RPB) {
            int orow = blockIdx.x * RPB + i;
            if (orow < R) {
                float v = part[i * WPR];
#pragma unroll
                for (int k = 1; k < WPR; k++) v += part[i * WPR + k];
                y[orow] = res != 0 ? v + res[orow] : v;
            }
        }
    }
}

// Streaming single-token GEMVs (gemv_kq_stream for the repacked K-quants, gemv_dp4a_stream for the other
// DP4A formats): the arithmetic of a warp per row (gemv_kq<QT, 1, NU>, gemv_dp4a_split<QT, 1, 1, PF>:
// lane l adds blocks l, l + 32, l + 64, ... in that order, then the warp sum), so the outputs equal
// theirs bit for bit, but each warp streams a list of tasks, one round of NU blocks a lane of one row
// each (rows gw, gw + nw, ... for warp gw of nw, each in ceil(nb / (32 NU)) rounds), with the next
// task's loads issued before the current one is computed: a warp keeps its loads in flight through its
// compute, its warp sum and its change of row. Launched with at most as many blocks as the card holds
// at once (ops._resident_blocks), so no block waits for its slowest warp before the next can start, and
// a row of several rounds (the 12288-wide down projection) no longer waits a memory latency per round.
// The loop takes two tasks a pass with two register sets (the loads of one land in the set the other
// has just used), so no task's blocks are copied from one set to the other.
// Optional residual `res` (1, R) as gemv_kq. S: how a block is held and dotted (KqStream, WbStream).
template <int QT>
struct KqStream {  // the K-quants' raw blocks (kq_load_raw), d/dmin by kq_block_dot's shuffles
    typedef KqRaw Raw;
    static __device__ __forceinline__ int ctx(int lane) { return kq_dd_shift(lane & 7); }
    static __device__ __forceinline__ void load(const u8* wrow, const u16* wdrow, int b, int nb, Raw& r) {
        kq_load_raw<QT>(wrow, wdrow, b, b < nb, r);
    }
    static __device__ __forceinline__ void dot(const Raw& r, int ctx, int b, int nb, const i8* __restrict__ xq,
                                               const float* __restrict__ xd, const float* __restrict__ xs,
                                               float& acc) {
        kq_block_dot<QT>(r, ctx, b, nb, xq, xd, xs, acc);
    }
};

template <int QT>
struct WbStream {  // every other DP4A format: expanded blocks (load_wblock), as gemv_dp4a_split
    typedef WBlock Raw;
    static __device__ __forceinline__ int ctx(int) { return 0; }
    static __device__ __forceinline__ void load(const u8* wrow, const u16* wdrow, int b, int nb, Raw& r) {
        if (b < nb) load_wblock<QT>(wrow, wdrow, b, r);
    }
    static __device__ __forceinline__ void dot(const Raw& r, int, int b, int nb, const i8* __restrict__ xq,
                                               const float* __restrict__ xd, const float* __restrict__ xs,
                                               float& acc) {
        if (b < nb) wblock_dot_acc(acc, r, xq, xd, xs, b);
    }
};

// One task of gemv_stream_body: issue the loads of the task after (row, rd) into nxt, dot cur (the task's
// blocks) into acc, and at a row's last round write the row's sum; (row, rd) become the next task.
template <int QT, int NU, class S>
__device__ __forceinline__ void gemv_stream_task(const u8* __restrict__ wq, const u16* __restrict__ wd,
                                                 const i8* __restrict__ xq, const float* __restrict__ xd,
                                                 const float* __restrict__ xs, float* __restrict__ y, int R,
                                                 const float* __restrict__ res, int nb, i64 rb, int rounds,
                                                 int nw, int lane, int ctx, const typename S::Raw (&cur)[NU],
                                                 typename S::Raw (&nxt)[NU], int& row, int& rd, float& acc) {
    int nrow = row, nrd = rd + 1;
    if (nrd == rounds) {
        nrd = 0;
        nrow = row + nw;
    }
    if (nrow < R) {
#pragma unroll
        for (int u = 0; u < NU; u++) S::load(wq + nrow * rb, wd + (i64)nrow * nb, 32 * (nrd * NU + u) + lane, nb, nxt[u]);
    }
#pragma unroll
    for (int u = 0; u < NU; u++) S::dot(cur[u], ctx, 32 * (rd * NU + u) + lane, nb, xq, xd, xs, acc);
    if (nrd == 0) {
        float s = warp_sum(acc);
        if (lane == 0) y[row] = res != 0 ? s + res[row] : s;
        acc = 0.0f;
    }
    row = nrow;
    rd = nrd;
}

template <int QT, int NU, class S>
__device__ __forceinline__ void gemv_stream_body(const u8* __restrict__ wq, const u16* __restrict__ wd,
                                                 const i8* __restrict__ xq, const float* __restrict__ xd,
                                                 const float* __restrict__ xs, float* __restrict__ y, int R,
                                                 int K, const float* __restrict__ res) {
    int lane = threadIdx.x & 31;
    const int nw = gridDim.x * (blockDim.x >> 5);
    const int nb = K >> 5;
    const int rounds = (nb + 32 * NU - 1) / (32 * NU);
    int ctx = S::ctx(lane);
    keep_reg(lane);  // not read again from the thread index each task
    keep_reg(ctx);
    const i64 rb = row_bytes<QT>(K);
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);  // uniform over the warp
    int rd = 0;
    typename S::Raw a[NU], b[NU];
    if (row < R) {
#pragma unroll
        for (int u = 0; u < NU; u++) S::load(wq + row * rb, wd + (i64)row * nb, 32 * u + lane, nb, a[u]);
    }
    pdl_entry();  // the first weights are on their way; the activations are read after the wait
    float acc = 0.0f;
    while (row < R) {
        gemv_stream_task<QT, NU, S>(wq, wd, xq, xd, xs, y, R, res, nb, rb, rounds, nw, lane, ctx, a, b, row, rd, acc);
        if (row >= R) break;
        gemv_stream_task<QT, NU, S>(wq, wd, xq, xd, xs, y, R, res, nb, rb, rounds, nw, lane, ctx, b, a, row, rd, acc);
    }
}

template <int QT, int NU>
__global__ void __launch_bounds__(128, 6)
gemv_kq_stream(const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
               const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y, int R, int K,
               const float* __restrict__ res) {
    gemv_stream_body<QT, NU, KqStream<QT>>(wq, wd, xq, xd, xs, y, R, K, res);
}

template <int QT, int NU>
__global__ void __launch_bounds__(128, 6)
gemv_dp4a_stream(const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
                 const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y, int R, int K,
                 const float* __restrict__ res) {
    gemv_stream_body<QT, NU, WbStream<QT>>(wq, wd, xq, xd, xs, y, R, K, res);
}

// gemv_kq_mt: the multi-token DP4A GEMV of the K-quants (Q4_K, Q5_K, Q6_K, repacked layout) for a
// batched decode step: NT = 2..8 tokens (one per sequence) share every weight load; y and `res` (NT, R),
// activations as gemv_dp4a (token t's q8_1 blocks at t * nb). Eight lanes per row: a warp takes 4 rows,
// and each group of 8 lanes reads one super-block of its row per step (lane s its block 8 j + s; Q4_K:
// 128 contiguous bytes), so the 4 groups of a warp ask for the same activation blocks at the same time
// and each activation load is one L1 request serving 4 rows. (With a lane per block of one row, as in
// gemv_dp4a, 8 tokens read about 17x the weight bytes from L1 per weight byte: the L1, not the DRAM,
// set the pace.) WPR (2 or 4) warps split a row group's super-blocks (j = sub, sub + WPR, ...), their
// sums added in warp order through shared memory (deterministic, fp32); with one warp per row group
// ptxas spilled from NT = 4 on. Each lane holds NU blocks in flight raw, as
// gemv_kq does, expands each to int8 once and dots it with the NT tokens: Q4_K / Q5_K one DP4A chain of
// 32 values (one scale per block), Q6_K two (a scale per 16 values). Q4_K / Q5_K take d and dmin by
// gemv_kq's three xor-shuffles inside the 8 lanes of a super-block. The loop is uniform over the warp;
// rows past R load nothing (all their terms are 0) and write nothing. Registers: 64 (8 blocks per SM)
// for NT <= 4, 96 (5 blocks) above. ptxas -v (NVRTC 12, sm_61..sm_90; the compiler fills either budget
// by hoisting activation loads): NU = 2 spills nothing except Q4_K / Q5_K at NT = 7 (16-52 bytes on
// sm_70..sm_90); NU = 4 spills 8-128 bytes at some NT on some architectures (Q4_K NT = 3, 4, 7, 8; Q5_K 7;
// Q6_K 8), which is why ops._gemv_kq_mt picks NU = 2 by default.
template <int QT, int NT, int WPR, int NU>
__global__ void __launch_bounds__(128, NT > 4 ? 5 : 8)
gemv_kq_mt(const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
           const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y, int R, int K,
           const float* __restrict__ res) {
    pdl_entry();
    static_assert(WPR == 2 || WPR == 4, "gemv_kq_mt: 2 or 4 warps per row group");
    constexpr int RPB = 16 / WPR;  // rows per block (blockDim.x must be 128)
    __shared__ float part[4][4][NT];  // (warp, row group, token) sums
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int grp = lane >> 3, s = lane & 7;
    const int sub = warp % WPR;
    const int row = blockIdx.x * RPB + (warp / WPR) * 4 + grp;
    const bool live = row < R;
    const int nb = K >> 5, nsb = K >> 8;
    const u8* wrow = wq + (i64)(live ? row : 0) * row_bytes<QT>(K);
    const u16* wdrow = wd + (i64)(live ? row : 0) * nb;
    const int ddsh = kq_dd_shift(s);
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
#pragma unroll 1  // unrolled, the loads of the next round would compete with the NT accumulators
    for (int j0 = sub; j0 < nsb; j0 += WPR * NU) {
        KqRaw w[NU];
#pragma unroll
        for (int u = 0; u < NU; u++)
            kq_load_raw<QT>(wrow, wdrow, 8 * (j0 + WPR * u) + s, live && j0 + WPR * u < nsb, w[u]);
#pragma unroll
        for (int u = 0; u < NU; u++) {
            const int j = j0 + WPR * u;
            if (j >= nsb) break;  // uniform over the warp (the shuffles below need every lane)
            const int b = 8 * j + s;
            float dlo, dhi, m;
            kq_raw_scales<QT>(w[u], ddsh, dlo, dhi, m);
            int q[8];
            const u32 vv[4] = {w[u].v.x, w[u].v.y, w[u].v.z, w[u].v.w};
#pragma unroll
            for (int k = 0; k < 4; k++) kq_expand<QT>(vv[k], w[u].h0, w[u].h1, k, q[k], q[4 + k]);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const i64 xb = (i64)t * nb + b;
                const int4* xp = (const int4*)(xq + xb * 32);
                const int4 a = xp[0], c = xp[1];
                if (QT == QT_Q6_K) {
                    int lo = dp4a(q[0], a.x, 0);
                    lo = dp4a(q[1], a.y, lo);
                    lo = dp4a(q[2], a.z, lo);
                    lo = dp4a(q[3], a.w, lo);
                    int hi = dp4a(q[4], c.x, 0);
                    hi = dp4a(q[5], c.y, hi);
                    hi = dp4a(q[6], c.z, hi);
                    hi = dp4a(q[7], c.w, hi);
                    acc[t] = fmaf(xd[xb], dlo * (float)lo + dhi * (float)hi, acc[t]);
                } else {  // one scale for the block's 32 values: one chain
                    int sum = dp4a(q[0], a.x, 0);
                    sum = dp4a(q[1], a.y, sum);
                    sum = dp4a(q[2], a.z, sum);
                    sum = dp4a(q[3], a.w, sum);
                    sum = dp4a(q[4], c.x, sum);
                    sum = dp4a(q[5], c.y, sum);
                    sum = dp4a(q[6], c.z, sum);
                    sum = dp4a(q[7], c.w, sum);
                    acc[t] = fmaf(xd[xb] * dlo, (float)sum, acc[t]);
                    acc[t] = fmaf(m, xs[xb], acc[t]);
                }
            }
        }
    }
    // the row group's sum over its 8 lanes (every lane ends with all NT sums)
#pragma unroll
    for (int t = 0; t < NT; t++) {
        acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], 1);
        acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], 2);
        acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], 4);
    }
    if (s == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++) part[warp][grp][t] = acc[t];
    }
    __syncthreads();
    // thread i < RPB * NT: row r = i / NT of the block (warps (r / 4) * WPR.., group r % 4), token i % NT
    const int i = threadIdx.x;
    if (i < RPB * NT) {
        const int r = i / NT, t = i % NT;
        const int w0 = (r >> 2) * WPR, g = r & 3;
        const int orow = blockIdx.x * RPB + r;
        if (orow < R) {
            float v = part[w0][g][t];
#pragma unroll
            for (int k = 1; k < WPR; k++) v += part[w0 + k][g][t];
            i64 yi = (i64)t * R + orow;
            y[yi] = res != 0 ? v + res[yi] : v;
        }
    }
}

// gemv_mt: gemv_kq_mt's geometry for the other DP4A formats (build.GEMV_MT_TYPES; Q8_0 first): NT = 2..8
// tokens, 8 lanes per row (lane s reads blocks 8 j + s, so a row group reads 8 consecutive blocks, Q8_0
// 256 contiguous bytes, and the 4 row groups of a warp share every activation load), WPR (2 or 4) warps
// per row group added through shared memory, NU rounds of 8 blocks per lane in flight as expanded
// WBlocks (load_wblock, the loads of gemv_dp4a). Rows need not be whole rounds: lanes past the row end
// load and add nothing (no shuffles in the loop, so lanes may diverge there). y / res (NT, R) as
// gemv_kq_mt. Registers as gemv_kq_mt (64 for NT <= 4, 96 above); ptxas -v: NU = 1 spills nothing on
// sm_61..sm_90, NU = 2 16-20 bytes at NT = 7 on sm_86 only.
template <int QT, int NT, int WPR, int NU>
__global__ void __launch_bounds__(128, NT > 4 ? 5 : 8)
gemv_mt(const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
        const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y, int R, int K,
        const float* __restrict__ res) {
    pdl_entry();
    static_assert(WPR == 2 || WPR == 4, "gemv_mt: 2 or 4 warps per row group");
    constexpr int RPB = 16 / WPR;  // rows per block (blockDim.x must be 128)
    __shared__ float part[4][4][NT];  // (warp, row group, token) sums
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int grp = lane >> 3, s = lane & 7;
    const int sub = warp % WPR;
    const int row = blockIdx.x * RPB + (warp / WPR) * 4 + grp;
    const bool live = row < R;
    const int nb = K >> 5, n8 = (nb + 7) >> 3;  // rounds of 8 blocks (the last may be partial)
    const u8* wrow = wq + (i64)(live ? row : 0) * row_bytes<QT>(K);
    const u16* wdrow = wd + (i64)(live ? row : 0) * nb;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
#pragma unroll 1
    for (int j0 = sub; j0 < n8; j0 += WPR * NU) {
        WBlock w[NU];
#pragma unroll
        for (int u = 0; u < NU; u++) {
            const int b = 8 * (j0 + WPR * u) + s;
            if (live && b < nb) load_wblock<QT>(wrow, wdrow, b, w[u]);
        }
#pragma unroll
        for (int u = 0; u < NU; u++) {
            const int b = 8 * (j0 + WPR * u) + s;
            if (live && b < nb) {
#pragma unroll
                for (int t = 0; t < NT; t++) wblock_dot_acc(acc[t], w[u], xq, xd, xs, (i64)t * nb + b);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], 1);
        acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], 2);
        acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], 4);
    }
    if (s == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++) part[warp][grp][t] = acc[t];
    }
    __syncthreads();
    const int i = threadIdx.x;  // thread i < RPB * NT: row i / NT of the block, token i % NT
    if (i < RPB * NT) {
        const int r = i / NT, t = i % NT;
        const int w0 = (r >> 2) * WPR, g = r & 3;
        const int orow = blockIdx.x * RPB + r;
        if (orow < R) {
            float v = part[w0][g][t];
#pragma unroll
            for (int k = 1; k < WPR; k++) v += part[w0 + k][g][t];
            i64 yi = (i64)t * R + orow;
            y[yi] = res != 0 ? v + res[yi] : v;
        }
    }
}
