// Mixture-of-experts kernels of the DP4A path (kernels/moe.py launches them; needs gemv.cu for WBlock,
// load_wblock and wblock_dot_acc). A layer's routing gives P = T * k (token, slot) pairs p, pair p
// using expert ids[p] on token p / k.
//
// Prefill (many tokens), grouped by expert:
//   moe_sort         one block: a stable counting sort of the pairs by expert (per-expert counts and
//                    offsets, `perm` = the pairs in expert order) and the list of row tiles of the
//                    grouped GEMM (expert, first sorted row), all on the device.
//   moe_gemm_dp4a    one launch for all experts of a layer: a block per (row tile of one expert,
//                    128 output columns), 64 sorted rows x 128 weight rows, the activation rows gathered
//                    through `perm` (gate/up: x row p / k) and the output rows scattered back through it
//                    (down: row p), so each tile reads its expert's weights once. gemm.cu gemm_dp4a's
//                    arithmetic: exact int32 DP4A per quant block, scaled into fp32 accumulators.
//   moe_swiglu_q8    silu(gate) * up of the sorted rows, written as q8_1 blocks (the down GEMM's input).
// Decode (a few tokens), two launches for all k experts of every token:
//   moe_gate_up_q8   a block per (32 columns of h, pair p): gate and up rows of expert ids[p] against the
//                    token's q8_1 activation, SwiGLU, and the q8_1 block of those 32 h values.
//   moe_down_sum     a warp per (output column, token): the down rows of the token's k experts against
//                    their h blocks, weighted by the routing weights and summed in a fixed order.
// Every sum is deterministic (no atomics on values): a (token, slot) output never depends on which
// other pairs share its tile.

#define MOE_BM 64    // sorted rows (pairs) per tile of moe_gemm_dp4a
#define MOE_BN 128   // weight rows (output columns) per tile

// Lanes of the warp whose `key` equals this lane's (keys in [0, 2^nbits)); lanes with !valid take part
// in the ballots but match nobody. sm_61 has no match.any, so the mask is built one key bit at a time.
__device__ __forceinline__ unsigned moe_match(int key, bool valid, int nbits) {
    unsigned m = __ballot_sync(0xffffffffu, valid);
    for (int b = 0; b < nbits; b++) {
        bool bit = (key >> b) & 1;
        unsigned bal = __ballot_sync(0xffffffffu, bit);
        m &= bit ? bal : ~bal;
    }
    return m;
}

// Grid (1), block 32 * NW threads, dynamic shared memory 4 * (E * (NW + 3) + 2) bytes.
// Warp w owns the pairs [w * seg, (w + 1) * seg) (seg = ceil(P / NW)): it counts its pairs per expert,
// then (after a scan over warps and experts) places them in order, so `perm` is the stable sort of the
// pairs by expert (np.argsort(ids, kind="stable")). Outputs: counts[E], offsets[E + 1] (exclusive scan
// of counts), perm[P], the tiles (tile_e[i], tile_r0[i]) for i < n_tiles[0]: expert e's sorted rows
// offsets[e] + r0 .. + min(MOE_BM, counts[e] - r0), in expert order. max_tiles >= P / MOE_BM + min(E, P)
// holds every tile (moe.py sizes it so).
extern "C" __global__ void moe_sort(const int* __restrict__ ids, int P, int E, int nbits, int max_tiles,
                                    int* __restrict__ counts, int* __restrict__ offsets, int* __restrict__ perm,
                                    int* __restrict__ tile_e, int* __restrict__ tile_r0,
                                    int* __restrict__ n_tiles) {
    pdl_entry();
    extern __shared__ int sm_sort[];
    int NW = blockDim.x >> 5;
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int* hist = sm_sort;              // [NW][E]: counts, then each warp's first rank per expert
    int* scnt = hist + NW * E;        // [E]
    int* soff = scnt + E;             // [E + 1]
    int* stile = soff + E + 1;        // [E + 1]
    for (int i = threadIdx.x; i < NW * E; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    int seg = (P + NW - 1) / NW;
    int s0 = min(P, w * seg), s1 = min(P, s0 + seg);
    unsigned lt = (1u << lane) - 1u;
    // 1. per-warp counts
    for (int base = s0; base < s1; base += 32) {
        int i = base + lane;
        bool valid = i < s1;
        int e = valid ? ids[i] : 0;
        unsigned m = moe_match(e, valid, nbits);
        if (valid && (m & lt) == 0) hist[w * E + e] += __popc(m);
        __syncwarp();
    }
    __syncthreads();
    // 2. per expert: each warp's first rank within the expert, and the expert's count
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int run = 0;
        for (int v = 0; v < NW; v++) {
            int h = hist[v * E + e];
            hist[v * E + e] = run;
            run += h;
        }
        scnt[e] = run;
        counts[e] = run;
    }
    __syncthreads();
    // 3. warp 0: exclusive scans of the counts (offsets) and of the tiles per expert
    if (w == 0) {
        int carry = 0, tcarry = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            int e = e0 + lane;
            int c = e < E ? scnt[e] : 0;
            int nt = (c + MOE_BM - 1) / MOE_BM;
            int inc = c, tinc = nt;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int a = __shfl_up_sync(0xffffffffu, inc, o);
                int b = __shfl_up_sync(0xffffffffu, tinc, o);
                if (lane >= o) { inc += a; tinc += b; }
            }
            if (e < E) { soff[e] = carry + inc - c; stile[e] = tcarry + tinc - nt; }
            carry += __shfl_sync(0xffffffffu, inc, 31);
            tcarry += __shfl_sync(0xffffffffu, tinc, 31);
        }
        if (lane == 0) {
            soff[E] = carry;
            stile[E] = tcarry;
            n_tiles[0] = min(tcarry, max_tiles);
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += blockDim.x) offsets[e] = soff[e];
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int nt = (scnt[e] + MOE_BM - 1) / MOE_BM;
        for (int j = 0; j < nt; j++) {
            int t = stile[e] + j;
            if (t < max_tiles) { tile_e[t] = e; tile_r0[t] = j * MOE_BM; }
        }
    }
    // 4. placement, each warp over its pairs in order
    for (int base = s0; base < s1; base += 32) {
        int i = base + lane;
        bool valid = i < s1;
        int e = valid ? ids[i] : 0;
        unsigned m = moe_match(e, valid, nbits);
        if (valid) {
            int first = hist[w * E + e];
            perm[soff[e] + first + __popc(m & lt)] = i;
        }
        __syncwarp();
        if (valid && (m & lt) == 0) hist[w * E + e] += __popc(m);
        __syncwarp();
    }
}

// Grid (max_tiles, ceil(R / MOE_BN)), 256 threads. Tile i = blockIdx.x (blocks past n_tiles[0] leave at
// once), columns c0 = MOE_BN * blockIdx.y: sorted rows s = offsets[e] + r0 + m (m < MOE_BM,
// s < offsets[e + 1]) of expert e = tile_e[i], against weight rows e * R + c0 .. c0 + MOE_BN - 1 of
// the stack (R rows of K values per expert).
// Activation row of s: perm[s] / x_div when gather, else s; output row: perm[s] when scatter, else s
// (y has R columns). Threads 0..127 stage one weight row's quant blocks, 128..191 one activation row's;
// each thread computes 4 rows x 8 columns (rows 4 ty + i, columns 4 tx + j and 64 + 4 tx + j).
template <int QT, int NBLK>
__global__ void __launch_bounds__(256) moe_gemm_dp4a(
        const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
        const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y, int R, int K,
        const int* __restrict__ perm, const int* __restrict__ offsets, const int* __restrict__ tile_e,
        const int* __restrict__ tile_r0, const int* __restrict__ n_tiles, int x_div, int gather,
        int scatter) {
    pdl_entry();
    __shared__ int4 As4[2][NBLK][8][MOE_BM / 4];
    __shared__ int4 Bs4[2][NBLK][8][MOE_BN / 4];
    __shared__ float sxd[2][NBLK][MOE_BM], sxs[2][NBLK][MOE_BM];
    __shared__ float sdlo[2][NBLK][MOE_BN], sdhi[2][NBLK][MOE_BN], smw[2][NBLK][MOE_BN];
    const bool split = (QT == QT_Q6_K);
    const bool has_m = qt_has_offset(QT);  // formats with an offset term (common.cuh)

    int tile = blockIdx.x;
    if (tile >= n_tiles[0]) return;  // the whole block leaves together
    int e = tile_e[tile];
    int s_base = offsets[e] + tile_r0[tile];
    int nrows = min(MOE_BM, offsets[e + 1] - s_base);
    int tid = threadIdx.x;
    int c0 = blockIdx.y * MOE_BN;
    int nb = K >> 5;
    int nst = (nb + NBLK - 1) / NBLK;
    i64 wstride = row_bytes<QT>(K);

    bool loads_w = tid < MOE_BN;
    bool loads_x = tid >= MOE_BN && tid < MOE_BN + MOE_BM;
    int lrow = loads_w ? tid : tid - MOE_BN;
    i64 widx = (i64)e * R + min(c0 + lrow, R - 1);
    const u8* wrow = wq + widx * wstride;
    const u16* wdrow = wd + widx * nb;
    i64 xrow = 0;
    if (loads_x) {
        int s = s_base + min(lrow, nrows - 1);
        xrow = gather ? (i64)(perm[s] / x_div) : (i64)s;
    }

    WBlock wb[NBLK];
    int4 xa[NBLK], xc[NBLK];
    float fxd[NBLK], fxs[NBLK];
    auto gload = [&](int st) {
#pragma unroll
        for (int u = 0; u < NBLK; u++) {
            int b = st * NBLK + u;
            bool ok = b < nb;
            if (loads_w) {
                if (ok) load_wblock<QT>(wrow, wdrow, b, wb[u]);
                else { for (int q = 0; q < 8; q++) wb[u].q[q] = 0; wb[u].dlo = wb[u].dhi = wb[u].m = 0.0f; }
            } else if (loads_x) {
                if (ok) {
                    i64 xb = xrow * nb + b;
                    const int4* p = (const int4*)(xq + xb * 32);
                    xa[u] = p[0]; xc[u] = p[1];
                    fxd[u] = xd[xb]; fxs[u] = xs[xb];
                } else {
                    xa[u] = xc[u] = make_int4(0, 0, 0, 0);
                    fxd[u] = fxs[u] = 0.0f;
                }
            }
        }
    };
    auto sstore = [&](int buf) {
#pragma unroll
        for (int u = 0; u < NBLK; u++) {
            if (loads_w) {
                int* B = (int*)Bs4[buf][u];
#pragma unroll
                for (int q = 0; q < 8; q++) B[q * MOE_BN + lrow] = wb[u].q[q];
                sdlo[buf][u][lrow] = wb[u].dlo; sdhi[buf][u][lrow] = wb[u].dhi; smw[buf][u][lrow] = wb[u].m;
            } else if (loads_x) {
                int* A = (int*)As4[buf][u];
                A[0 * MOE_BM + lrow] = xa[u].x; A[1 * MOE_BM + lrow] = xa[u].y;
                A[2 * MOE_BM + lrow] = xa[u].z; A[3 * MOE_BM + lrow] = xa[u].w;
                A[4 * MOE_BM + lrow] = xc[u].x; A[5 * MOE_BM + lrow] = xc[u].y;
                A[6 * MOE_BM + lrow] = xc[u].z; A[7 * MOE_BM + lrow] = xc[u].w;
                sxd[buf][u][lrow] = fxd[u]; sxs[buf][u][lrow] = fxs[u];
            }
        }
    };

    int tx = tid & 15, ty = tid >> 4;
    float acc[4][8];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;

    gload(0);
    sstore(0);
    __syncthreads();
    for (int st = 0; st < nst; st++) {
        int buf = st & 1;
        if (st + 1 < nst) gload(st + 1);
#pragma unroll
        for (int u = 0; u < NBLK; u++) {
            int ai[4][8];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 8; j++) ai[i][j] = MAGIC_I;
#pragma unroll
            for (int half = 0; half < 2; half++) {
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    int k4 = half * 4 + kk;
                    int4 a0 = As4[buf][u][k4][ty];
                    int4 b0 = Bs4[buf][u][k4][tx], b1 = Bs4[buf][u][k4][16 + tx];
                    int av[4] = {a0.x, a0.y, a0.z, a0.w};
                    int bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                    for (int i = 0; i < 4; i++)
#pragma unroll
                        for (int j = 0; j < 8; j++) ai[i][j] = dp4a(av[i], bv[j], ai[i][j]);
                }
                if (split || half == 1) {
                    // a weight row's scale at a time (column j outer): fewer live registers
                    float dx[4], sx[4];
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        dx[i] = sxd[buf][u][ty * 4 + i];
                        sx[i] = sxs[buf][u][ty * 4 + i];
                    }
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        int rj = (j < 4) ? tx * 4 + j : 64 + tx * 4 + j - 4;
                        const float dw = (split && half == 0) ? sdlo[buf][u][rj] : sdhi[buf][u][rj];
                        const float dwo = magic_off(dw), mw = smw[buf][u][rj];
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            acc[i][j] = fmaf(magic_scale(ai[i][j], dw, dwo), dx[i], acc[i][j]);
                            if (has_m) acc[i][j] = fmaf(mw, sx[i], acc[i][j]);
                            if (split) ai[i][j] = MAGIC_I;
                        }
                    }
                }
            }
        }
        if (st + 1 < nst) sstore(buf ^ 1);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int m = ty * 4 + i;
        if (m >= nrows) continue;
        int s = s_base + m;
        i64 yrow = scatter ? (i64)perm[s] : (i64)s;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int c = c0 + ((j < 4) ? tx * 4 + j : 64 + tx * 4 + j - 4);
            if (c < R) y[yrow * R + c] = acc[i][j];
        }
    }
}

// silu(g) * u for rows s < n_rows of F values (F % 32 == 0): g[s * ld + j], u[s * ld + j] (the fused
// gate/up output passes u = g + F, ld = 2F). Writes the q8_1 blocks of the result (hq (n_rows, F), hd and
// hs (n_rows, F / 32)) and, when h is not null, the fp32 values (n_rows, F). A warp per 32 values.
extern "C" __global__ void moe_swiglu_q8(const float* __restrict__ g, const float* __restrict__ u, int ld,
                                         int F, i64 n_blocks, i8* __restrict__ hq, float* __restrict__ hd,
                                         float* __restrict__ hs, float* __restrict__ h) {
    pdl_entry();
    i64 blk = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= n_blocks) return;  // whole warps leave together
    int lane = threadIdx.x & 31;
    int nbf = F >> 5;
    i64 s = blk / nbf;
    int j = (int)(blk % nbf) * 32 + lane;
    float r = silu_f(g[s * ld + j]) * u[s * ld + j];
    if (h != 0) h[s * F + j] = r;
    q8_1_block(r, hq + blk * 32, hd + blk, hs + blk, lane);
}

// Grid (F / 32, P), 256 threads: block (cb, p) computes h[p, 32 cb + l] = silu(gate . x) * (up . x) for
// l < 32 with expert e = ids[p] and x = the q8_1 row p / x_div; warp w takes columns 4 w .. 4 w + 3,
// two at a time (gate and up rows, two blocks of each per lane in flight). Gate row j of expert e is row
// e * RG + j of the gate stack; up row j is row e * RU + up0 + j of the up stack (fused gate/up: the
// same stack with RG = RU = 2F and up0 = F). Writes the q8_1 block of the 32 values (and fp32 h when not
// null), laid out as moe_swiglu_q8 writes its rows.
template <int QG, int QU>
__global__ void __launch_bounds__(256) moe_gate_up_q8(
        const u8* __restrict__ gq, const u16* __restrict__ gd, const u8* __restrict__ uq,
        const u16* __restrict__ ud, int RG, int RU, int up0, int F, int K, const i8* __restrict__ xq,
        const float* __restrict__ xd, const float* __restrict__ xs, const int* __restrict__ ids, int x_div,
        i8* __restrict__ hq, float* __restrict__ hd, float* __restrict__ hs, float* __restrict__ h) {
    pdl_entry();
    __shared__ float sh[32];
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = blockIdx.y;
    int cb = blockIdx.x;
    i64 e = ids[p];
    int nb = K >> 5;
    i64 xrow = p / x_div;
    i64 gstride = row_bytes<QG>(K), ustride = row_bytes<QU>(K);
#pragma unroll
    for (int jj = 0; jj < 4; jj += 2) {
        int j0 = cb * 32 + w * 4 + jj;  // columns j0 and j0 + 1
        i64 gr0 = e * RG + j0, ur0 = e * RU + up0 + j0;
        const u8* g0 = gq + gr0 * gstride;
        const u8* g1 = g0 + gstride;
        const u8* u0 = uq + ur0 * ustride;
        const u8* u1 = u0 + ustride;
        const u16* gd0 = gd + gr0 * nb;
        const u16* ud0 = ud + ur0 * nb;
        float ag0 = 0.0f, ag1 = 0.0f, au0 = 0.0f, au1 = 0.0f;
        for (int b0 = lane; b0 < nb; b0 += 64) {
            int b1 = b0 + 32;
            bool two = b1 < nb;
            WBlock wg0[2], wg1[2], wu0[2], wu1[2];
            load_wblock<QG>(g0, gd0, b0, wg0[0]);
            load_wblock<QG>(g1, gd0 + nb, b0, wg1[0]);
            load_wblock<QU>(u0, ud0, b0, wu0[0]);
            load_wblock<QU>(u1, ud0 + nb, b0, wu1[0]);
            if (two) {
                load_wblock<QG>(g0, gd0, b1, wg0[1]);
                load_wblock<QG>(g1, gd0 + nb, b1, wg1[1]);
                load_wblock<QU>(u0, ud0, b1, wu0[1]);
                load_wblock<QU>(u1, ud0 + nb, b1, wu1[1]);
            }
            i64 xb = xrow * nb + b0;
            wblock_dot_acc(ag0, wg0[0], xq, xd, xs, xb);
            wblock_dot_acc(ag1, wg1[0], xq, xd, xs, xb);
            wblock_dot_acc(au0, wu0[0], xq, xd, xs, xb);
            wblock_dot_acc(au1, wu1[0], xq, xd, xs, xb);
            if (two) {
                wblock_dot_acc(ag0, wg0[1], xq, xd, xs, xb + 32);
                wblock_dot_acc(ag1, wg1[1], xq, xd, xs, xb + 32);
                wblock_dot_acc(au0, wu0[1], xq, xd, xs, xb + 32);
                wblock_dot_acc(au1, wu1[1], xq, xd, xs, xb + 32);
            }
        }
        ag0 = warp_sum(ag0);
        ag1 = warp_sum(ag1);
        au0 = warp_sum(au0);
        au1 = warp_sum(au1);
        if (lane == 0) {
            sh[w * 4 + jj] = silu_f(ag0) * au0;
            sh[w * 4 + jj + 1] = silu_f(ag1) * au1;
        }
    }
    __syncthreads();
    if (w == 0) {
        float v = sh[lane];
        i64 blk = (i64)p * (F >> 5) + cb;
        if (h != 0) h[(i64)p * F + cb * 32 + lane] = v;
        q8_1_block(v, hq + blk * 32, hd + blk, hs + blk, lane);
    }
}

// Grid (ceil(H / 4), T), 128 threads: warp w of block (bx, t) computes out[t, c] (c = 4 bx + w) =
// sum over slots s < k of wts[p] * (down row c of expert ids[p]) . h[p], p = t * k + s (h: q8_1 rows
// of F values, as moe_gate_up_q8 writes them). The lanes walk the k * F / 32 (slot, block) items in
// order, 4 in flight, each item's dot product weighted into the lane's fp32 sum; then one warp sum.
template <int QT>
__global__ void __launch_bounds__(128) moe_down_sum(
        const u8* __restrict__ wq, const u16* __restrict__ wd, int H, int F, const i8* __restrict__ hq,
        const float* __restrict__ hd, const float* __restrict__ hs, const int* __restrict__ ids,
        const float* __restrict__ wts, int k, float* __restrict__ out) {
    pdl_entry();
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int c = blockIdx.x * 4 + w;
    int t = blockIdx.y;
    if (c >= H) return;
    int nb = F >> 5;
    int n = k * nb;
    i64 stride = row_bytes<QT>(F);
    float acc = 0.0f;
    for (int i0 = lane; i0 < n; i0 += 128) {
        WBlock wb[4];
        int pp[4], bb[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = i0 + 32 * u;
            pp[u] = t * k + i / nb;
            bb[u] = i % nb;
            if (i < n) {
                i64 r = (i64)ids[pp[u]] * H + c;
                load_wblock<QT>(wq + r * stride, wd + r * nb, bb[u], wb[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            if (i0 + 32 * u >= n) break;
            float part = 0.0f;
            wblock_dot_acc(part, wb[u], hq, hd, hs, (i64)pp[u] * nb + bb[u]);
            acc = fmaf(wts[pp[u]], part, acc);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) out[(i64)t * H + c] = acc;
}

// ---- decode block: a whole MoE block of a few tokens (T <= 8) in three launches ------------------------
//   moe_dec_router   logits of the E router rows and of the shared expert's gate row (fp32 weights,
//                    fp32 activations), and the shared expert's SwiGLU h_s (q8_1 blocks, optional fp32)
//   moe_dec_gate_up  per (32 columns of h, pair p = t k + s): the top-k of token t's logits (warp 0, in
//                    every block: no routing launch), then gate/up of expert ids[p], SwiGLU, q8_1 h
//   moe_dec_down     per (output column, token): the k routed down rows weighted by the routing, the
//                    shared expert's down row (same format as the routed one) or its output computed
//                    apart, times sigmoid(its gate logit), plus the residual
// Logits rows have E + 1 entries: the E router logits, then the shared expert's gate logit.

#define MOE_DEC_MAXK 32  // top-k the decode block selects at most

// silu(gate row j) * (up row j) for the two columns j0, j0 + 1 (rows g0, g0 + gstride; u0, u0 + ustride)
// against activation row xrow: four rows, two quant blocks of each per lane in flight. All lanes return
// the two values.
template <int QG, int QU>
__device__ __forceinline__ float2 moe_dec_pair(const u8* g0, const u16* gd0, const u8* u0, const u16* ud0,
                                               i64 gstride, i64 ustride, int nb, const i8* __restrict__ xq,
                                               const float* __restrict__ xd, const float* __restrict__ xs,
                                               i64 xrow, int lane) {
    const u8* g1 = g0 + gstride;
    const u8* u1 = u0 + ustride;
    float ag0 = 0.0f, ag1 = 0.0f, au0 = 0.0f, au1 = 0.0f;
    for (int b0 = lane; b0 < nb; b0 += 64) {
        int b1 = b0 + 32;
        bool two = b1 < nb;
        WBlock wg0[2], wg1[2], wu0[2], wu1[2];
        load_wblock<QG>(g0, gd0, b0, wg0[0]);
        load_wblock<QG>(g1, gd0 + nb, b0, wg1[0]);
        load_wblock<QU>(u0, ud0, b0, wu0[0]);
        load_wblock<QU>(u1, ud0 + nb, b0, wu1[0]);
        if (two) {
            load_wblock<QG>(g0, gd0, b1, wg0[1]);
            load_wblock<QG>(g1, gd0 + nb, b1, wg1[1]);
            load_wblock<QU>(u0, ud0, b1, wu0[1]);
            load_wblock<QU>(u1, ud0 + nb, b1, wu1[1]);
        }
        i64 xb = xrow * nb + b0;
        wblock_dot_acc(ag0, wg0[0], xq, xd, xs, xb);
        wblock_dot_acc(ag1, wg1[0], xq, xd, xs, xb);
        wblock_dot_acc(au0, wu0[0], xq, xd, xs, xb);
        wblock_dot_acc(au1, wu1[0], xq, xd, xs, xb);
        if (two) {
            wblock_dot_acc(ag0, wg0[1], xq, xd, xs, xb + 32);
            wblock_dot_acc(ag1, wg1[1], xq, xd, xs, xb + 32);
            wblock_dot_acc(au0, wu0[1], xq, xd, xs, xb + 32);
            wblock_dot_acc(au1, wu1[1], xq, xd, xs, xb + 32);
        }
    }
    ag0 = warp_sum(ag0);
    ag1 = warp_sum(ag1);
    au0 = warp_sum(au0);
    au1 = warp_sum(au1);
    return make_float2(silu_f(ag0) * au0, silu_f(ag1) * au1);
}

// Grid (nrb + (sgate ? Fs / 32 : 0), T), 512 threads (16 warps).
// Blocks bx < nrb (nrb = ceil((E + (sgate != 0)) / 4)): logit rows r = 4 bx + w / 4, four warps each
// (warp w the float4 columns 32 (w % 4) + lane + 128 j, its partial sums added in a fixed order): router
// row r (r < E) or the shared gate row sgate (r = E), dotted with x[t] (fp32, H % 4 == 0) ->
// logits[t (E + 1) + r].
// Blocks bx >= nrb (shared expert, cb = bx - nrb): warp w computes h_s[t, 32 cb + 2 w + {0, 1}] =
// silu(gate . x) * (up . x) from the shared gate / up matrices (Fs rows each, format QS, against the
// q8_1 row t of x), and warp 0 writes the q8_1 block (t, cb) of h_s (and the fp32 values when hsf).
template <int QS>
__global__ void __launch_bounds__(512) moe_dec_router(
        const float* __restrict__ x, int H, const float* __restrict__ router, int E,
        const float* __restrict__ sgate, float* __restrict__ logits, int nrb,
        const u8* __restrict__ sgq, const u16* __restrict__ sgd, const u8* __restrict__ suq,
        const u16* __restrict__ sud, int Fs, const i8* __restrict__ xq, const float* __restrict__ xd,
        const float* __restrict__ xs, i8* __restrict__ hsq, float* __restrict__ hsd, float* __restrict__ hss,
        float* __restrict__ hsf) {
    pdl_entry();
    __shared__ float sh[32];
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.y;
    if ((int)blockIdx.x < nrb) {  // the whole block takes this branch
        int r = blockIdx.x * 4 + (w >> 2), part = w & 3;  // four warps per row, each a quarter of it
        int nr = E + (sgate != 0 ? 1 : 0);
        float acc = 0.0f;
        if (r < nr) {
            const float4* wr = (const float4*)(r < E ? router + (i64)r * H : sgate);
            const float4* xr = (const float4*)(x + (i64)t * H);
            int n4 = H >> 2;
            for (int i0 = part * 32 + lane; i0 < n4; i0 += 128 * 4) {
                float4 wv[4], xv[4];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    int i = i0 + 128 * u;
                    if (i < n4) { wv[u] = wr[i]; xv[u] = xr[i]; }
                }
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    if (i0 + 128 * u >= n4) break;
                    acc = fmaf(wv[u].x, xv[u].x, acc);
                    acc = fmaf(wv[u].y, xv[u].y, acc);
                    acc = fmaf(wv[u].z, xv[u].z, acc);
                    acc = fmaf(wv[u].w, xv[u].w, acc);
                }
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) sh[w] = acc;
        __syncthreads();
        if (w == 0 && lane < 4) {
            int rr = blockIdx.x * 4 + lane;
            if (rr < nr) logits[(i64)t * (E + 1) + rr] = (sh[4 * lane] + sh[4 * lane + 1]) +
                                                          (sh[4 * lane + 2] + sh[4 * lane + 3]);
        }
        return;
    }
    int cb = blockIdx.x - nrb;
    int nb = H >> 5;
    int j0 = cb * 32 + 2 * w;
    i64 gstride = row_bytes<QS>(H);
    float2 v = moe_dec_pair<QS, QS>(sgq + (i64)j0 * gstride, sgd + (i64)j0 * nb, suq + (i64)j0 * gstride,
                                    sud + (i64)j0 * nb, gstride, gstride, nb, xq, xd, xs, t, lane);
    if (lane == 0) { sh[2 * w] = v.x; sh[2 * w + 1] = v.y; }
    __syncthreads();
    if (w == 0) {
        float hv = sh[lane];
        i64 blk = (i64)t * (Fs >> 5) + cb;
        if (hsf != 0) hsf[(i64)t * Fs + cb * 32 + lane] = hv;
        q8_1_block(hv, hsq + blk * 32, hsd + blk, hss + blk, lane);
    }
}

// The rank of value v (index i) in the routing order among n (value, index) pairs: how many pairs rank
// before it (a larger value, or an equal one at a lower index, as a stable sort puts them). NaN entries
// rank before nothing (every comparison with them is false).
__device__ __forceinline__ int moe_dec_rank(float v, int i, const float* cv, const int* ci, int n) {
    int r = 0;
    for (int j = 0; j < n; j++) {
        float c = cv[j];
        r += (c > v) | ((c == v) & (ci[j] < i));
    }
    return r;
}

// Grid (F / 32, T k), 512 threads (16 warps), dynamic shared memory 4 E bytes (E <= 512: one logit a thread).
// Routing (in every block, so no launch of its own): token t = p / k of pair p = blockIdx.y, softmax over
// logits[t (E + 1) + e] (e < E), the k largest logits (ties to the lower expert index, as a stable sort),
// weights p_e / max(sum of the k selected p, 6.1e-5). In three parallel steps: each thread loads one logit
// and finds its rank within its warp (32 shuffles); each warp's first k become candidates (a top-k entry
// is always among its warp's top k); the candidates' ranks among themselves are their global ranks below
// k. Warp 0 meanwhile takes the softmax's max and sum (lane-strided, then over the warp). NaN logits are
// never selected; ranks no logit fills (fewer than k that are not NaN) take expert E - 1 with weight 0.
// Every block computes the same routing from the same logits; block (0, t k) writes ids[t k + j] and
// wts[t k + j] for j < k (what moe_dec_down reads). Then the block computes h[p, 32 cb + l] =
// silu(gate . x) * (up . x) with expert e = the (p % k)-th selected, x the q8_1 row t (gate row j of e:
// row e RG + j of the gate stack; up row j: row e RU + up0 + j of the up stack, as moe_gate_up_q8), warp w
// columns 2 w and 2 w + 1, and warp 0 writes its q8_1 block (p, cb).
template <int QG, int QU>
__global__ void __launch_bounds__(512) moe_dec_gate_up(
        const float* __restrict__ logits, int E, int k, const u8* __restrict__ gq, const u16* __restrict__ gd,
        const u8* __restrict__ uq, const u16* __restrict__ ud, int RG, int RU, int up0, int F, int K,
        const i8* __restrict__ xq, const float* __restrict__ xd, const float* __restrict__ xs,
        int* __restrict__ ids, float* __restrict__ wts, i8* __restrict__ hq, float* __restrict__ hd,
        float* __restrict__ hs) {
    pdl_entry();
    extern __shared__ float sp_route[];
    __shared__ int ssel[MOE_DEC_MAXK];
    __shared__ float sselv[MOE_DEC_MAXK];
    __shared__ float cand_v[16 * MOE_DEC_MAXK];
    __shared__ int cand_i[16 * MOE_DEC_MAXK];
    __shared__ float sh[32];
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = blockIdx.y;
    int t = p / k, slot = p - t * k;
    int cb = blockIdx.x;
    int e0 = threadIdx.x;
    float lv = e0 < E ? logits[(i64)t * (E + 1) + e0] : __int_as_float(0x7fffffff);
    if (e0 < E) sp_route[e0] = lv;
    if (e0 < k) {
        ssel[e0] = E - 1;
        sselv[e0] = -INFINITY;
    }
    int nw = (E + 31) >> 5;
    if (w < nw) {
        int r = 0;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            float c = __shfl_sync(0xffffffffu, lv, j);
            r += (c > lv) | ((c == lv) & (j < lane));
        }
        if (lane < k) cand_v[w * k + lane] = __int_as_float(0x7fffffff);  // slots no entry fills stay NaN
        __syncwarp();
        if (r < k && lv == lv) {
            cand_v[w * k + r] = lv;
            cand_i[w * k + r] = e0;
        }
    }
    __syncthreads();
    float mx = -INFINITY, s = 0.0f;
    if (w == 0) {
        for (int e = lane; e < E; e += 32) mx = fmaxf(mx, sp_route[e]);
        mx = warp_max(mx);
        for (int e = lane; e < E; e += 32) s += __expf(sp_route[e] - mx);
        s = warp_sum(s);
    } else {
        for (int c = threadIdx.x - 32; c < nw * k; c += blockDim.x - 32) {
            float cv = cand_v[c];
            if (!(cv == cv)) continue;
            int r = moe_dec_rank(cv, cand_i[c], cand_v, cand_i, nw * k);
            if (r < k) {
                ssel[r] = cand_i[c];
                sselv[r] = cv;
            }
        }
    }
    __syncthreads();
    if (w == 0) {
        float my_p = lane < k ? __expf(sselv[lane] - mx) / s : 0.0f;
        float sel_sum = 0.0f;
        for (int r = 0; r < k; r++) sel_sum += __shfl_sync(0xffffffffu, my_p, r);  // in rank order
        if (cb == 0 && slot == 0 && lane < k) {
            ids[t * k + lane] = ssel[lane];
            wts[t * k + lane] = my_p * (1.0f / fmaxf(sel_sum, 6.1e-5f));
        }
    }
    __syncthreads();
    i64 e = ssel[slot];
    int nb = K >> 5;
    int j0 = cb * 32 + 2 * w;
    i64 gstride = row_bytes<QG>(K), ustride = row_bytes<QU>(K);
    i64 gr0 = e * RG + j0, ur0 = e * RU + up0 + j0;
    float2 v = moe_dec_pair<QG, QU>(gq + gr0 * gstride, gd + gr0 * nb, uq + ur0 * ustride, ud + ur0 * nb,
                                    gstride, ustride, nb, xq, xd, xs, t, lane);
    if (lane == 0) { sh[2 * w] = v.x; sh[2 * w + 1] = v.y; }
    __syncthreads();
    if (w == 0) {
        float hv = sh[lane];
        i64 blk = (i64)p * (F >> 5) + cb;
        q8_1_block(hv, hq + blk * 32, hd + blk, hs + blk, lane);
    }
}

// Grid (ceil(H / 4), T), 128 threads: warp w of block (bx, t) computes, for c = 4 bx + w,
//   out[t, c] = res[t, c] + (sum_s wts[p] (down row c of expert ids[p]) . h[p]
//                            + sigmoid(logits[t (E + 1) + E]) * shared[t, c])      (p = t k + s)
// where shared[t, c] = (row c of sdown (H x Fs, format QD)) . h_s[t] when sdown is given, else ys[t, c]
// when ys is given, and the shared term is left out when neither is; res may be null. The lanes walk
// the k F / 32 routed (slot, block) items and then the Fs / 32 shared blocks in order, MOE_DEC_DOWN_U in
// flight (5: the 35B-A3B's 8 x 16 routed and 16 shared blocks in one round; a lane sums its items in the
// same order whatever the round); routed items are weighted into one fp32 sum, shared ones into another,
// each then summed over the warp.
#define MOE_DEC_DOWN_U 5
template <int QD>
__global__ void __launch_bounds__(128) moe_dec_down(
        const u8* __restrict__ wq, const u16* __restrict__ wd, int H, int F, const i8* __restrict__ hq,
        const float* __restrict__ hd, const float* __restrict__ hs, const int* __restrict__ ids,
        const float* __restrict__ wts, int k, const float* __restrict__ logits, int E,
        const u8* __restrict__ sq, const u16* __restrict__ sd, int Fs, const i8* __restrict__ hsq,
        const float* __restrict__ hsd, const float* __restrict__ hss, const float* __restrict__ ys,
        const float* __restrict__ res, float* __restrict__ out) {
    pdl_entry();
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int c = blockIdx.x * 4 + w;
    int t = blockIdx.y;
    if (c >= H) return;
    int nb = F >> 5;
    int nbs = sq != 0 ? (Fs >> 5) : 0;
    int nr = k * nb;
    int n = nr + nbs;
    i64 stride = row_bytes<QD>(F), sstride = row_bytes<QD>(Fs);
    float acc = 0.0f, acc_s = 0.0f;
    for (int i0 = lane; i0 < n; i0 += 32 * MOE_DEC_DOWN_U) {
        WBlock wb[MOE_DEC_DOWN_U];
        int pp[MOE_DEC_DOWN_U], bb[MOE_DEC_DOWN_U];
#pragma unroll
        for (int u = 0; u < MOE_DEC_DOWN_U; u++) {
            int i = i0 + 32 * u;
            pp[u] = -1;
            bb[u] = 0;
            if (i < nr) {
                pp[u] = t * k + i / nb;
                bb[u] = i % nb;
                i64 r = (i64)ids[pp[u]] * H + c;
                load_wblock<QD>(wq + r * stride, wd + r * nb, bb[u], wb[u]);
            } else if (i < n) {
                bb[u] = i - nr;
                load_wblock<QD>(sq + (i64)c * sstride, sd + (i64)c * (Fs >> 5), bb[u], wb[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < MOE_DEC_DOWN_U; u++) {
            int i = i0 + 32 * u;
            if (i >= n) break;
            float part = 0.0f;
            if (i < nr) {
                wblock_dot_acc(part, wb[u], hq, hd, hs, (i64)pp[u] * nb + bb[u]);
                acc = fmaf(wts[pp[u]], part, acc);
            } else {
                wblock_dot_acc(part, wb[u], hsq, hsd, hss, (i64)t * nbs + bb[u]);
                acc_s += part;
            }
        }
    }
    acc = warp_sum(acc);
    acc_s = warp_sum(acc_s);
    if (lane == 0) {
        i64 o = (i64)t * H + c;
        float v = acc;
        if (sq != 0 || ys != 0) {
            float sv = sq != 0 ? acc_s : ys[o];
            v = v + sv * sigmoid_f(logits[(i64)t * (E + 1) + E]);
        }
        if (res != 0) v = res[o] + v;
        out[o] = v;
    }
}
