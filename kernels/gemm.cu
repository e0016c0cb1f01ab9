// Matrix-matrix products for prefill: Y (T, R) = X (T, K) @ W (R, K)^T.
//
// gemm_dp4a<QT, NBLK>: 128 tokens x 128 weight rows per block of 256 threads, each thread an 8 x 8 tile; the K
//   loop walks one 32-value quant block at a time (one scale per block), staged through double-buffered
//   shared memory with the next block prefetched into registers. Inside a block the products are exact
//   int32 (DP4A); at the block's end they are scaled into fp32 accumulators. The int32 accumulators
//   start at MAGIC_I (the float 1.5 * 2^23), so a block's sum times the weight's scale is one FMA
//   (common.cuh magic_scale: no int -> float conversion, no subtraction), then one more FMA with the
//   activation's scale. Weights: any format load_wblock (gemv.cu) reads; Q6_K's two scales per block are
//   applied at the two half-blocks. The epilogue adds the residual `res` (T, R) when given and writes a
//   fused group's members apart with `seg` (the output layout below), as gemm_batch does. It computes the
//   output rows [rlo, rhi) from `wq` / `wd` holding the matrix's rows from rlo on (the whole matrix: 0, R;
//   a window: the rows requant_q8_0 wrote, with the output and residual still laid out for all R rows).
// requant_q8_0<QT>: rows of a matrix in format QT rewritten in Q8_0's device layout, so that a K-quant
//   prefill runs gemm_dp4a<Q8_0> (ops.matmul's path "dp4a_rq": kernels/ops.py REQUANT_TYPES).
// gemm_fma: 64 x 64 tiles, fp32 FMA on weights dequantized to fp32 in shared memory (fallback path and
//   F32/F16/BF16 weights).

// Output layout (gemm_dp4a, gemm_batch and splitk_sum): with `seg` (nseg + 1 increasing row bounds, seg[0] = 0,
// seg[nseg] = R, nseg <= 8) row r of segment j (seg[j] <= r < seg[j+1]) and token t go to
// y[T * seg[j] + t * (seg[j+1] - seg[j]) + r - seg[j]]: each segment a contiguous (T, rows) block (a fused
// group's outputs, split); without it y[t * R + r]. The residual is read at t * R + r.
__device__ __forceinline__ void seg_range(const int* bounds, int r, int R, int& lo, int& hi) {
    lo = 0;
    hi = R;
    for (int k = 1; k < 9; k++) {
        if (r < bounds[k]) {
            hi = bounds[k];
            break;
        }
        lo = bounds[k];
    }
}
__device__ __forceinline__ i64 seg_index(const int* bounds, int T, int t, int r, int R) {
    int lo, hi;
    seg_range(bounds, r, R, lo, hi);
    return (i64)T * lo + (i64)t * (hi - lo) + (r - lo);
}

// seg_bounds: the 9 bounds seg_range reads, in shared memory (rows past nseg at R; without seg one segment)
__device__ __forceinline__ void seg_bounds(int* bounds, const int* seg, int nseg, int R, int tid) {
    if (tid < 9) bounds[tid] = tid == 0 ? 0 : (seg != nullptr && tid <= nseg) ? seg[tid] : R;
}

#define GB_M 128
#define GB_N 128

// gemm_dp4a's PAIR epilogue (ops.matmul_swiglu): the thread's columns j < 4 are gate rows f .. f + 3 and
// columns j >= 4 the up rows of the same f, so it writes h = silu(gate) * up for its 8 tokens and 4 f to
// `h` (T, F) and h's q8_1 blocks to hq / hd / hs (the down projection's int8 input), as swiglu_q8 does
// (silu_f, then q8_1_block's rule: d = max|h| / 127, q = round(h / d), s = d * sum(q)), so the results are
// the same bits as the two-matrix GEMM followed by swiglu_q8. A 32-value block is 8 consecutive lanes
// (tx 8m .. 8m + 7: 4 values each); every lane takes part in the shuffles, out-of-range ones with zeros.
__device__ __forceinline__ void gemm_swiglu_epilogue(const float (&acc)[8][8], float* __restrict__ h,
                                                     i8* __restrict__ hq, float* __restrict__ hd,
                                                     float* __restrict__ hs, int T, int F, int t0, int f,
                                                     int fhi, int ty, int tx) {
    const bool fok = f < fhi;  // F is a multiple of 32, so a block's 8 lanes agree
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int t = t0 + ((i < 4) ? ty * 4 + i : 64 + ty * 4 + i - 4);
        float v[4], amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            v[j] = silu_f(acc[i][j]) * acc[i][j + 4];
            amax = fmaxf(amax, fabsf(v[j]));
        }
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
        const float d = amax / 127.0f;
        int qs = 0;
        u32 packed = 0u;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int q = (amax > 0.0f) ? __float2int_rn(v[j] / d) : 0;
            qs += q;
            packed |= ((u32)q & 0xffu) << (8 * j);
        }
        qs += __shfl_xor_sync(0xffffffffu, qs, 1);
        qs += __shfl_xor_sync(0xffffffffu, qs, 2);
        qs += __shfl_xor_sync(0xffffffffu, qs, 4);
        if (t < T && fok) {
            const i64 o = (i64)t * F + f;
            *(float4*)(h + o) = make_float4(v[0], v[1], v[2], v[3]);
            *(u32*)(hq + o) = packed;
            if ((tx & 7) == 0) {
                hd[o >> 5] = d;
                hs[o >> 5] = d * (float)qs;
            }
        }
    }
}

template <int QT, int NBLK, bool PAIR = false>
__global__ void __launch_bounds__(256) gemm_dp4a(
        const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
        const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y,
        int T, int R, int K, const float* __restrict__ res, const int* __restrict__ seg, int nseg, int rlo,
        int rhi, int uoff, i8* __restrict__ hq, float* __restrict__ hd, float* __restrict__ hs) {
    pdl_entry();
    // NBLK quant blocks (32 values each) per shared-memory stage: 2 halves the barriers per K.
    __shared__ int4 As4[2][NBLK][8][GB_M / 4];
    __shared__ int4 Bs4[2][NBLK][8][GB_N / 4];
    __shared__ float sxd[2][NBLK][GB_M], sxs[2][NBLK][GB_M];
    __shared__ float sdlo[2][NBLK][GB_N], sdhi[2][NBLK][GB_N], sm[2][NBLK][GB_N];
    const bool split = (QT == QT_Q6_K);
    const bool has_m = qt_has_offset(QT);

    __shared__ int bounds[9];
    int tid = threadIdx.x;
    seg_bounds(bounds, seg, nseg, R, tid);  // read by the epilogue, many barriers later
    // PAIR: the block's 128 rows are 64 gate rows f0.. and the same 64 up rows (below)
    int t0 = blockIdx.y * GB_M, r0 = rlo + blockIdx.x * (PAIR ? GB_N / 2 : GB_N);
    int nb = K >> 5;
    int nst = (nb + NBLK - 1) / NBLK;
    i64 wstride = row_bytes<QT>(K);

    // Loader roles: threads 0..127 load one weight row's blocks, 128..255 one token's blocks.
    int lrow = tid & 127;
    bool loads_w = tid < 128;
    // wq / wd hold rows rlo.. (a window of the matrix, or all of it); PAIR: the up row of gate row f at
    // f - rlo + uoff
    int wr = PAIR ? min(r0 + (lrow & 63), rhi - 1) - rlo + (lrow < 64 ? 0 : uoff) : min(r0 + lrow, rhi - 1) - rlo;
    int xt = min(t0 + lrow, T - 1);
    const u8* wrow = wq + (i64)wr * wstride;
    const u16* wdrow = wd + (i64)wr * nb;

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
                else { for (int k = 0; k < 8; k++) wb[u].q[k] = 0; wb[u].dlo = wb[u].dhi = wb[u].m = 0.0f; }
            } else {
                if (ok) {
                    i64 xb = (i64)xt * nb + b;
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
            int* A = (int*)As4[buf][u];
            int* B = (int*)Bs4[buf][u];
            if (loads_w) {
#pragma unroll
                for (int k = 0; k < 8; k++) B[k * GB_N + lrow] = wb[u].q[k];
                sdlo[buf][u][lrow] = wb[u].dlo; sdhi[buf][u][lrow] = wb[u].dhi; sm[buf][u][lrow] = wb[u].m;
            } else {
                A[0 * GB_M + lrow] = xa[u].x; A[1 * GB_M + lrow] = xa[u].y; A[2 * GB_M + lrow] = xa[u].z; A[3 * GB_M + lrow] = xa[u].w;
                A[4 * GB_M + lrow] = xc[u].x; A[5 * GB_M + lrow] = xc[u].y; A[6 * GB_M + lrow] = xc[u].z; A[7 * GB_M + lrow] = xc[u].w;
                sxd[buf][u][lrow] = fxd[u]; sxs[buf][u][lrow] = fxs[u];
            }
        }
    };

    int tx = tid & 15, ty = tid >> 4;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; i++)
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
            int ai[8][8];
#pragma unroll
            for (int i = 0; i < 8; i++)
#pragma unroll
                for (int j = 0; j < 8; j++) ai[i][j] = MAGIC_I;
#pragma unroll
            for (int half = 0; half < 2; half++) {
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    int k4 = half * 4 + kk;
                    int4 a0 = As4[buf][u][k4][ty], a1 = As4[buf][u][k4][16 + ty];
                    int4 b0 = Bs4[buf][u][k4][tx], b1 = Bs4[buf][u][k4][16 + tx];
                    int av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                    int bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                    for (int i = 0; i < 8; i++)
#pragma unroll
                        for (int j = 0; j < 8; j++) ai[i][j] = dp4a(av[i], bv[j], ai[i][j]);
                }
                if (split || half == 1) {
                    // Scale this (half-)block's exact int sums into the fp32 accumulators.
                    float dw[8], dwo[8], mw[8];
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        int rj = (j < 4) ? tx * 4 + j : 64 + tx * 4 + j - 4;
                        dw[j] = (split && half == 0) ? sdlo[buf][u][rj] : sdhi[buf][u][rj];
                        dwo[j] = magic_off(dw[j]);
                        mw[j] = sm[buf][u][rj];
                    }
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        int ti = (i < 4) ? ty * 4 + i : 64 + ty * 4 + i - 4;
                        float dx = sxd[buf][u][ti], sx = sxs[buf][u][ti];
#pragma unroll
                        for (int j = 0; j < 8; j++) {
                            acc[i][j] = fmaf(magic_scale(ai[i][j], dw[j], dwo[j]), dx, acc[i][j]);
                            if (has_m) acc[i][j] = fmaf(mw[j], sx, acc[i][j]);
                            if (split) ai[i][j] = MAGIC_I;
                        }
                    }
                }
            }
        }
        if (st + 1 < nst) sstore(buf ^ 1);
        __syncthreads();
    }
    if constexpr (PAIR) {
        gemm_swiglu_epilogue(acc, y, hq, hd, hs, T, R, t0, r0 + tx * 4, rhi, ty, tx);
        return;
    }
    // each column's place in y: its segment's start plus its offset there, and the segment's width (one
    // segment of R rows without seg, so token t's row starts at t * R)
    i64 col0[8];
    int width[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int r = r0 + ((j < 4) ? tx * 4 + j : 64 + tx * 4 + j - 4), lo, hi;
        seg_range(bounds, r, R, lo, hi);
        col0[j] = (i64)T * lo + (r - lo);
        width[j] = hi - lo;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int t = t0 + ((i < 4) ? ty * 4 + i : 64 + ty * 4 + i - 4);
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int r = r0 + ((j < 4) ? tx * 4 + j : 64 + tx * 4 + j - 4);
            if (r >= rhi) continue;
            y[col0[j] + (i64)t * width[j]] = res != nullptr ? acc[i][j] + res[(i64)t * R + r] : acc[i][j];
        }
    }
}

// Rows rlo..rlo+rows-1 of a matrix in format QT (`wq`, `wd` as its kernels read them) -> those rows in Q8_0's
// device layout: `oq` (rows, K) int8, `od` (rows, K/32) fp16 bits. Each 32-value block is dequantized as
// deq_block32 does (engine/quants.py's values) and quantized as ggml's quantize_row_q8_0_ref quantizes:
// d = max|x| / 127, q = roundf(x * (1 / d)) (0 for an all-zero block), d stored as fp16 (rounded to nearest
// even; q from the fp32 d): common.cuh q8_0_scale, as for kv_q8_0.cu's cache blocks (NumPy twin:
// engine/kvquant.py quantize_q8_0). A thread a block.
template <int QT>
__global__ void __launch_bounds__(256) requant_q8_0(const u8* __restrict__ wq, const u16* __restrict__ wd, int K,
                                                    int rlo, int rows, i8* __restrict__ oq, u16* __restrict__ od) {
    pdl_entry();
    int nb = K >> 5;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)rows * nb) return;
    i64 r = rlo + i / nb;
    int b = (int)(i % nb);
    float v[32];
    deq_block32<QT>(wq + r * row_bytes<QT>(K), wd + r * nb, b, v);
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(v[k]));
    float id;
    float d = q8_0_scale(amax, id);
    int q[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        u32 w = 0u;
#pragma unroll
        for (int j = 0; j < 4; j++) w |= ((u32)(int)roundf(v[4 * k + j] * id) & 0xffu) << (8 * j);
        q[k] = (int)w;
    }
    int4* dst = (int4*)(oq + i * 32);
    dst[0] = make_int4(q[0], q[1], q[2], q[3]);
    dst[1] = make_int4(q[4], q[5], q[6], q[7]);
    od[i] = f2h_rn(d);
}

#define GF_M 64
#define GF_N 64

template <int QT>
__global__ void __launch_bounds__(256) gemm_fma(
        const u8* __restrict__ wq, const u16* __restrict__ wd, const float* __restrict__ x,
        float* __restrict__ y, int T, int R, int K) {
    pdl_entry();
    __shared__ float4 As4[32][GF_M / 4];
    __shared__ float4 Bs4[32][GF_N / 4];
    int tid = threadIdx.x;
    int t0 = blockIdx.y * GF_M, r0 = blockIdx.x * GF_N;
    int nb = K >> 5;
    i64 wstride = row_bytes<QT>(K);
    int tx = tid & 15, ty = tid >> 4;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    float* A = (float*)As4;
    float* B = (float*)Bs4;
    int arow = tid >> 2, aseg = tid & 3;
    int xt = min(t0 + arow, T - 1);
    int wr = min(r0 + (tid & 63), R - 1);
    for (int b = 0; b < nb; b++) {
        const float4* xp = (const float4*)(x + (i64)xt * K + 32 * b + 8 * aseg);
        float4 u = xp[0], v = xp[1];
        float av[8] = {u.x, u.y, u.z, u.w, v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 8; i++) A[(aseg * 8 + i) * GF_M + arow] = av[i];
        if (tid < 64) {
            float w[32];
            deq_block32<QT>(wq + (i64)wr * wstride, wd + (i64)wr * nb, b, w);
#pragma unroll
            for (int k = 0; k < 32; k++) B[k * GF_N + tid] = w[k];
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < 32; k++) {
            float4 a = As4[k][ty], c = Bs4[k][tx];
            float ar[4] = {a.x, a.y, a.z, a.w}, br[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int t = t0 + ty * 4 + i;
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = r0 + tx * 4 + j;
            if (r < R) y[(i64)t * R + r] = acc[i][j];
        }
    }
}

// gemm_batch<QT, TT>: Y (T, R) = X (T, K) @ W (R, K)^T for a batched decode step, T <= TT tokens (TT = 8,
// 16 or 32: one sequence's token each), DP4A on every format load_wblock reads (K-quants in their
// repacked layout). The weights are streamed once for all T tokens. Two thread maps:
//
// The rows map (8 and 16 tokens, gb_rows): a block of 128 threads computes 32 weight rows x TT tokens.
// Lane s of each group of 8 lanes (lanes 8 g .. 8 g + 7 of warp w) takes block s of every stage of 8
// quant blocks (256 values: one K-quant super-block) of the group's 2 rows (8 w + g and 8 w + 4 + g),
// so the 8 lanes of a row read its stage's 128+ contiguous bytes in one coalesced load straight into
// their registers (K-quants: the super-block's d and dmin gathered by gemv_kq's three xor-shuffles inside
// the group), expand each block to int8 once and dot it with all TT tokens. The stage's activations (TT
// tokens x 8 blocks, q8_1) are staged in shared memory, double-buffered (one barrier a stage): a lane
// reads its block of token t as two 16-byte loads and one 8-byte (xd, xs) load, one address for the 4
// groups of a warp and 8 contiguous ones over its 8 lanes (one wavefront), used for both rows. The next
// stage's weights and activations are loaded into registers while the current one is computed. At the
// end each lane holds 2 x TT partial sums (its block of every stage); the 8 lanes of a group add them in
// a fixed tree of xor-shuffles that halves the values each round (lane s keeps flat entries VL s ..
// VL s + VL - 1 of the row-major 2 x TT tile, VL = TT / 4), deterministic.
// - Against the K-parts map it replaced at 8 tokens (loader threads expanded the weights into shared
//   memory for the lanes that dot them) and the row quads at 16, H200, bench_gemv --multi, the 9B step's
//   matmuls (docs/BENCHMARKS.md v32): 8 tokens Q4_K 3.158 -> 2.799 ms, Q6_K 3.954 -> 3.632, Q8_0 3.414 ->
//   3.395; 16 tokens Q4_K 5.215 -> 4.446, Q6_K 5.791 -> 5.150, Q8_0 5.423 -> 5.315.
// - 4 rows a lane (64-row blocks) was faster for Q4_K at 8 tokens (2.758) but slower for Q8_0 (4.120) and
//   Q6_K (3.988): 146-168 registers, 3 blocks a multiprocessor and one wave of 384 blocks for the
//   24576-row matrix; capping it at 128 registers spilled. At 32 tokens (one row a lane, 16-row blocks)
//   every block re-reads the stage's 32 tokens of activations for 16 rows: about twice the row quads'
//   time (Q4_K 24576 x 4096: 169 against 93 us).
// - What limits it (Nsight Compute, Q4_K 24576 x 4096, 8 tokens, 4 rows a lane): 2.46 instructions a
//   cycle (issue slots 56% busy), stalls mostly fixed-latency dependencies and the math pipe's
//   throttle, achieved occupancy 15%; DRAM 38% of its peak. Executed instructions 8% fewer than the
//   K-parts map's.
//
// The row-quad map (32 tokens, gb_quads): thread (tx, ty) holds rows 4 tx .. 4 tx + 3 and tokens 4 ty ..
// 4 ty + 3 (tx = tid % 16) of a 64-row tile: one 128-bit weight load (4 wavefronts) per 16 DP4A. Weight
// loads: the 8 lanes of a group read the 8 blocks of one row's stage, 4 passes of 16 rows, expanded to
// int8 once into shared memory; activations: 16 threads read one token's 256 stage bytes. Software
// pipelined as above (one barrier pair a stage), shared layouts padded free of bank conflicts.
//
// Inside a block the products are exact int32 started at MAGIC_I; per block they are scaled into fp32
// accumulators as gemm_dp4a does (magic_scale, then the activation's scale): acc += xd * (dlo * lo) +
// xd * (dhi * hi) + m * xs (Q6_K: lo and hi chains of 16 values; the other formats one chain, dlo = dhi).
//
// Split K: gridDim.y blocks share a row tile, each `stages` stages of K; with gridDim.y > 1 each writes its
// partial sums to `part + blockIdx.y * T * R` (a (splits, T, R) scratch) and splitk_sum adds them in split
// order (deterministic) with the residual into y; with one split the block writes y (+ res) itself. Rows
// past R load row R - 1 and write nothing; tokens past T and blocks past K/32 load zeros.
// One round of gemm_batch's group sum: v[0 .. N) becomes the half of v[0 .. 2 N) named by `hi` plus the
// partner lane's (lane ^ o) copy of that half.
template <int N>
__device__ __forceinline__ void gb_halve(float* v, int o, bool hi) {
#pragma unroll
    for (int k = 0; k < N; k++) {
        const float send = hi ? v[k] : v[N + k];
        const float keep = hi ? v[N + k] : v[k];
        v[k] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
}

// A block of a row as a lane holds it from its load to its use: K-quants raw (KqRaw, expanded at use),
// the other formats expanded at load (WBlock).
template <int QT, bool KQ = kq_format(QT)> struct GbRaw { typedef WBlock T; };
template <int QT> struct GbRaw<QT, true> { typedef KqRaw T; };

// Block b of a row into w, as both maps load it: K-quants raw (K % 256 == 0: every block of a stage
// exists), the other formats expanded, zeros past the row's nb blocks.
template <int QT>
__device__ __forceinline__ void gb_load_w(const u8* wrow, const u16* wdrow, int b, int nb, typename GbRaw<QT>::T& w) {
    if constexpr (kq_format(QT)) {
        kq_load_raw<QT>(wrow, wdrow, b, true, w);
    } else if (b < nb) {
        load_wblock<QT>(wrow, wdrow, b, w);
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) w.q[k] = 0;
        w.dlo = w.dhi = w.m = 0.0f;
    }
}

// Thread tid's share of a stage's activations (TT tokens x 8 blocks of q8_1), as both maps load them:
// int4 j holds half idx % 2 of block (idx % 16) / 2 of token idx / 16 (idx = tid + 128 j); (xd, xs) j
// those of block idx % 8 of token idx / 8. GbX holds where they sit at stage 0 (q: int4 index, c: element
// index) and the stages that have them (st * 8 < lim: past T tokens and nb blocks lim is at most 0);
// a thread works it out once (gb_x_pos) and each stage is then an add and a compare a load.
template <int TT>
struct GbX {
    int q[TT / 8], qlim[TT / 8], c[(TT + 15) / 16], clim[(TT + 15) / 16];
};

template <int TT>
__device__ __forceinline__ GbX<TT> gb_x_pos(int T, int nb, int tid) {
    GbX<TT> p;
#pragma unroll
    for (int j = 0; j < TT / 8; j++) {
        const int idx = tid + 128 * j;
        const int t = idx >> 4, bo = (idx & 15) >> 1;
        p.q[j] = 2 * (t * nb + bo) + (idx & 1);
        p.qlim[j] = t < T ? nb - bo : 0;
    }
#pragma unroll
    for (int j = 0; j < (TT + 15) / 16; j++) {
        const int idx = tid + 128 * j;
        const int t = idx >> 3, bo = idx & 7;
        p.c[j] = t * nb + bo;
        p.clim[j] = idx < TT * 8 && t < T ? nb - bo : 0;
    }
    return p;
}

// Keeps a thread's positions in registers (keep_reg).
template <int TT>
__device__ __forceinline__ void gb_keep_x(GbX<TT>& p) {
#pragma unroll
    for (int j = 0; j < TT / 8; j++) {
        keep_reg(p.q[j]);
        keep_reg(p.qlim[j]);
    }
#pragma unroll
    for (int j = 0; j < (TT + 15) / 16; j++) {
        keep_reg(p.c[j]);
        keep_reg(p.clim[j]);
    }
}

// Stage st's share (zeros where the thread has none).
template <int TT>
__device__ __forceinline__ void gb_load_x(const i8* __restrict__ xq, const float* __restrict__ xd,
                                          const float* __restrict__ xs, const GbX<TT>& p, int st,
                                          int4 (&xv)[TT / 8], float2 (&xc)[(TT + 15) / 16]) {
#pragma unroll
    for (int j = 0; j < TT / 8; j++) {
        xv[j] = make_int4(0, 0, 0, 0);
        if (st * 8 < p.qlim[j]) xv[j] = ((const int4*)xq)[p.q[j] + 16 * st];
    }
#pragma unroll
    for (int j = 0; j < (TT + 15) / 16; j++) {
        xc[j] = make_float2(0.0f, 0.0f);
        if (st * 8 < p.clim[j]) xc[j] = make_float2(xd[p.c[j] + 8 * st], xs[p.c[j] + 8 * st]);
    }
}

template <int QT, int TT>
__device__ __forceinline__ void gb_rows(
        const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
        const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y,
        float* __restrict__ part, int T, int R, int K, int stages, const float* __restrict__ res,
        const int* __restrict__ seg, int nseg) {
    static_assert(TT == 8 || TT == 16, "gemm_batch's rows map: 8 or 16 tokens");
    constexpr int RL = 2;                   // rows a lane (32 a block: ops.GEMM_BATCH_ROWS)
    constexpr int V = RL * TT, VL = V / 8;  // a lane's sums; what it keeps of them after the group sum
    constexpr int XJ = TT / 8;   // activation int4 loads a thread a stage
    constexpr int XC = (TT + 15) / 16;  // activation (xd, xs) loads a thread a stage
    constexpr bool KQ = kq_format(QT);
    constexpr bool SPLIT = (QT == QT_Q6_K);  // two scales per block
    constexpr bool HAS_M = qt_has_offset(QT);
    static_assert(!(SPLIT && HAS_M), "gemm_batch: a block has a second scale or an offset, not both");
    typedef typename GbRaw<QT>::T Raw;
    __shared__ __align__(16) int4 sxv[2][2][TT][8];  // [buffer][half][token][block]: values 16 h .. 16 h + 15
    __shared__ __align__(16) float2 sxc[2][TT][8];   // (xd, xs): [buffer][token][block]
    __shared__ int bounds[9];

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 3, s = lane & 7;
    const int r0 = blockIdx.x * 16 * RL;
    const int nb = K >> 5;
    const int nst = (nb + 7) >> 3;
    const int st0 = blockIdx.y * stages;
    const int st1 = min(nst, st0 + stages);
    const i64 wstride = row_bytes<QT>(K);
    const u8* wrow[RL];  // the lane's rows (clamped to R - 1), worked out once
    const u16* wdrow[RL];
#pragma unroll
    for (int i = 0; i < RL; i++) {
        const int r = min(r0 + 4 * RL * warp + 4 * i + g, R - 1);
        wrow[i] = wq + (i64)r * wstride;
        wdrow[i] = wd + (i64)r * nb;
        keep_reg(wrow[i]);  // in registers from here on, not worked out again each stage
        keep_reg(wdrow[i]);
    }
    GbX<TT> xpos = gb_x_pos<TT>(T, nb, tid);
    int ddsh = kq_dd_shift(s);
    keep_reg(ddsh);
    gb_keep_x(xpos);

    Raw wa[RL], wb[RL];  // two register sets: a stage's weights, and the next stage's on their way
    int4 xv[XJ];
    float2 xcv[XC];
    auto load_w = [&](int st, Raw (&w)[RL]) {
#pragma unroll
        for (int i = 0; i < RL; i++) gb_load_w<QT>(wrow[i], wdrow[i], st * 8 + s, nb, w[i]);
    };
    auto load_x = [&](int st) { gb_load_x<TT>(xq, xd, xs, xpos, st, xv, xcv); };
    auto store_x = [&](int buf) {
#pragma unroll
        for (int j = 0; j < XJ; j++) {
            const int idx = tid + 128 * j;
            sxv[buf][idx & 1][idx >> 4][(idx & 15) >> 1] = xv[j];
        }
#pragma unroll
        for (int j = 0; j < XC; j++) {
            const int idx = tid + 128 * j;
            if (idx < TT * 8) sxc[buf][idx >> 3][idx & 7] = xcv[j];
        }
    };

    float acc[RL][TT];
#pragma unroll
    for (int i = 0; i < RL; i++)
#pragma unroll
        for (int j = 0; j < TT; j++) acc[i][j] = 0.0f;

    // stage st from cur (its activations in buffer (st - st0) & 1), the next stage's loads into nxt
    auto stage = [&](int st, const Raw (&cur)[RL], Raw (&nxt)[RL]) {
        const int buf = (st - st0) & 1;
        __syncthreads();  // this stage's activations are stored; every warp is done with the other buffer
        const bool more = st + 1 < st1;
        if (more) {  // in flight while this stage computes
            load_x(st + 1);
            load_w(st + 1, nxt);
        }
        int q[RL][8];
        float dlo[RL], e[RL];  // e: dhi (Q6_K) or m
        float dlo_off[RL], dhi_off[RL];  // magic_off of dlo and of the second half-block's scale
#pragma unroll
        for (int i = 0; i < RL; i++) {
            if constexpr (KQ) {
                float dhi, m;
                kq_raw_scales<QT>(cur[i], ddsh, dlo[i], dhi, m);
                e[i] = SPLIT ? dhi : m;
                const u32 vv[4] = {cur[i].v.x, cur[i].v.y, cur[i].v.z, cur[i].v.w};
#pragma unroll
                for (int k = 0; k < 4; k++) kq_expand<QT>(vv[k], cur[i].h0, cur[i].h1, k, q[i][k], q[i][4 + k]);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) q[i][k] = cur[i].q[k];
                dlo[i] = cur[i].dlo;
                e[i] = SPLIT ? cur[i].dhi : cur[i].m;
            }
            dlo_off[i] = magic_off(dlo[i]);
            dhi_off[i] = SPLIT ? magic_off(e[i]) : dlo_off[i];
        }
#pragma unroll
        for (int j = 0; j < TT; j++) {
            const int4 x0 = sxv[buf][0][j][s], x1 = sxv[buf][1][j][s];
            const float2 xc = sxc[buf][j][s];  // (xd, xs)
#pragma unroll
            for (int i = 0; i < RL; i++) {
                int a = MAGIC_I;
                a = dp4a(q[i][0], x0.x, a);
                a = dp4a(q[i][1], x0.y, a);
                a = dp4a(q[i][2], x0.z, a);
                a = dp4a(q[i][3], x0.w, a);
                if (SPLIT) {  // the first half-block's exact sum, with its own scale
                    acc[i][j] = fmaf(magic_scale(a, dlo[i], dlo_off[i]), xc.x, acc[i][j]);
                    a = MAGIC_I;
                }
                a = dp4a(q[i][4], x1.x, a);
                a = dp4a(q[i][5], x1.y, a);
                a = dp4a(q[i][6], x1.z, a);
                a = dp4a(q[i][7], x1.w, a);
                acc[i][j] = fmaf(magic_scale(a, SPLIT ? e[i] : dlo[i], dhi_off[i]), xc.x, acc[i][j]);
                if (HAS_M) acc[i][j] = fmaf(e[i], xc.y, acc[i][j]);
            }
        }
        if (more) store_x(buf ^ 1);
    };

    // The first stage's weights are asked for before the wait (their round trip overlaps the kernel
    // ahead's end and this one's activation loads); everything the kernels ahead write is read after it.
    if (st0 < st1) load_w(st0, wa);
    pdl_entry();
    seg_bounds(bounds, seg, nseg, R, tid);
    if (st0 < st1) {
        load_x(st0);
        store_x(0);
    }
    // two stages a pass, so no stage's weights are copied from one register set to the other
    for (int st = st0; st < st1; st += 2) {
        stage(st, wa, wb);
        if (st + 1 < st1) stage(st + 1, wb, wa);
    }
    // The group's 8 lanes add their blocks' sums: three xor-shuffle rounds, each keeping half the values
    // (the half named by the lane's bit) and adding the partner's copy of that half.
    float v[V];
#pragma unroll
    for (int f = 0; f < V; f++) v[f] = acc[f / TT][f % TT];
    gb_halve<V / 2>(v, 4, (s & 4) != 0);
    gb_halve<V / 4>(v, 2, (s & 2) != 0);
    gb_halve<V / 8>(v, 1, (s & 1) != 0);
    __syncthreads();  // bounds[] is written
    // lane s holds the sums of flat entries VL s .. VL s + VL - 1 (row i = f / TT, token j = f % TT)
    const bool split = gridDim.y > 1;
    float* out = split ? part + (i64)blockIdx.y * T * R : y;
#pragma unroll
    for (int k = 0; k < VL; k++) {
        const int f = VL * s + k;
        const int t = f % TT, r = r0 + 4 * RL * warp + 4 * (f / TT) + g;
        if (t >= T || r >= R) continue;
        const i64 at = (i64)t * R + r;
        if (split) out[at] = v[k];
        else out[seg != nullptr ? seg_index(bounds, T, t, r, R) : at] = res != nullptr ? v[k] + res[at] : v[k];
    }
}

template <int QT, int TT>
__device__ __forceinline__ void gb_quads(
        const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
        const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y,
        float* __restrict__ part, int T, int R, int K, int stages, const float* __restrict__ res,
        const int* __restrict__ seg, int nseg) {
    constexpr int ROWS = 64;          // weight rows a block (ops.GEMM_BATCH_ROWS)
    constexpr int PASSES = ROWS / 16;  // weight load passes a stage
    constexpr int XJ = TT / 8;         // activation int4 loads a thread a stage (gb_load_x)
    constexpr int XC = (TT + 15) / 16;  // activation (xd, xs) loads a thread a stage
    constexpr int TM = TT / 8;         // tokens a thread
    constexpr int RQ = 16;             // threads over the rows
    constexpr bool KQ = kq_format(QT);
    constexpr bool SPLIT = (QT == QT_Q6_K);  // two scales per block
    constexpr bool HAS_M = qt_has_offset(QT);
    static_assert(!(SPLIT && HAS_M), "gemm_batch: a block has a second scale or an offset, not both");
    __shared__ __align__(16) int sw[8][8 * ROWS + 4];      // [block][int k * ROWS + row]
    __shared__ __align__(16) float swc[2][8][ROWS + 4];    // dlo; dhi (Q6_K) or m: [block][row]
    __shared__ __align__(16) int sx[8][TT][12];            // [block][token][int k] (+4 pad)
    __shared__ __align__(16) float2 sxc[8][TT];            // (xd, xs): [block][token]

    const int tid = threadIdx.x;
    const int tx = tid % RQ, ty = tid / RQ;  // rows 4 tx .., tokens TM ty ..
    const int r0 = blockIdx.x * ROWS;
    const int nb = K >> 5;
    const int nst = (nb + 7) >> 3;
    const int st0 = blockIdx.y * stages;
    const int st1 = min(nst, st0 + stages);
    const i64 wstride = row_bytes<QT>(K);

    // weight loads: pass p -> row p * 16 + tid / 8 of the tile, block s = tid % 8 of the stage
    const int s = tid & 7;
    const int ddsh = kq_dd_shift(s);
    typename GbRaw<QT>::T w[PASSES];
    int4 xv[XJ];
    float2 xcv[XC];
    const GbX<TT> xpos = gb_x_pos<TT>(T, nb, tid);

    auto wload = [&](int st) {
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const int r = min(r0 + p * 16 + (tid >> 3), R - 1);
            gb_load_w<QT>(wq + (i64)r * wstride, wd + (i64)r * nb, st * 8 + s, nb, w[p]);
        }
    };
    auto gload = [&](int st) {
        wload(st);
        gb_load_x<TT>(xq, xd, xs, xpos, st, xv, xcv);
    };
    auto sstore = [&]() {
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const int r = p * 16 + (tid >> 3);
            int q[8];
            float dlo, dhi, m;
            if constexpr (KQ) {
                kq_raw_scales<QT>(w[p], ddsh, dlo, dhi, m);
                const u32 vv[4] = {w[p].v.x, w[p].v.y, w[p].v.z, w[p].v.w};
#pragma unroll
                for (int k = 0; k < 4; k++) kq_expand<QT>(vv[k], w[p].h0, w[p].h1, k, q[k], q[4 + k]);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) q[k] = w[p].q[k];
                dlo = w[p].dlo;
                dhi = w[p].dhi;
                m = w[p].m;
            }
#pragma unroll
            for (int k = 0; k < 8; k++) sw[s][k * ROWS + r] = q[k];
            swc[0][s][r] = dlo;
            if (SPLIT) swc[1][s][r] = dhi;
            if (HAS_M) swc[1][s][r] = m;
        }
#pragma unroll
        for (int j = 0; j < XJ; j++) {
            const int idx = tid + 128 * j;
            *(int4*)&sx[(idx & 15) >> 1][idx >> 4][4 * (idx & 1)] = xv[j];
        }
#pragma unroll
        for (int j = 0; j < XC; j++) {
            const int idx = tid + 128 * j;
            if (idx < TT * 8) sxc[idx & 7][idx >> 3] = xcv[j];
        }
    };

    float acc[4][TM];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < TM; j++) acc[i][j] = 0.0f;

    // the first stage's weights before the wait (as gb_rows), its activations after it
    if (st0 < st1) wload(st0);
    pdl_entry();
    if (st0 < st1) gb_load_x<TT>(xq, xd, xs, xpos, st0, xv, xcv);
    for (int st = st0; st < st1; st++) {
        __syncthreads();  // the previous stage's compute is done with shared memory
        sstore();
        __syncthreads();
        if (st + 1 < st1) gload(st + 1);  // in flight while this stage computes
        {
#pragma unroll 2
            for (int u = 0; u < 8; u++) {
                int ai[4][TM];
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < TM; j++) ai[i][j] = MAGIC_I;
                const float4 d4 = *(const float4*)&swc[0][u][4 * tx];
                float4 e4 = d4;
                if (SPLIT || HAS_M) e4 = *(const float4*)&swc[1][u][4 * tx];
                const float dlo[4] = {d4.x, d4.y, d4.z, d4.w};
                const float e[4] = {e4.x, e4.y, e4.z, e4.w};  // dhi (Q6_K) or m
                float2 xc[TM];  // (xd, xs)
#pragma unroll
                for (int j = 0; j < TM; j++) xc[j] = sxc[u][TM * ty + j];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int4 xa[TM];
#pragma unroll
                    for (int j = 0; j < TM; j++) xa[j] = *(const int4*)&sx[u][TM * ty + j][4 * h];
#pragma unroll
                    for (int kk = 0; kk < 4; kk++) {
                        const int4 w4 = *(const int4*)&sw[u][(4 * h + kk) * ROWS + 4 * tx];
                        const int wv[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
                        for (int j = 0; j < TM; j++) {
                            const int a = kk == 0 ? xa[j].x : kk == 1 ? xa[j].y : kk == 2 ? xa[j].z : xa[j].w;
#pragma unroll
                            for (int i = 0; i < 4; i++) ai[i][j] = dp4a(wv[i], a, ai[i][j]);
                        }
                    }
                    if (SPLIT || h == 1) {  // scale this (half-)block's exact sums into the accumulators
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            const float dw = (SPLIT && h == 1) ? e[i] : dlo[i];
                            const float dwo = magic_off(dw);
#pragma unroll
                            for (int j = 0; j < TM; j++) {
                                acc[i][j] = fmaf(magic_scale(ai[i][j], dw, dwo), xc[j].x, acc[i][j]);
                                if (HAS_M && h == 1) acc[i][j] = fmaf(e[i], xc[j].y, acc[i][j]);
                                if (SPLIT) ai[i][j] = MAGIC_I;
                            }
                        }
                    }
                }
            }
        }
    }
    __shared__ int bounds[9];
    seg_bounds(bounds, seg, nseg, R, tid);
    __syncthreads();  // bounds[] is written
    // write out: the thread's rows 4 tx .. and tokens TM ty ..
    const bool split = gridDim.y > 1;
    float* out = split ? part + (i64)blockIdx.y * T * R : y;
#pragma unroll
    for (int j = 0; j < TM; j++) {
        const int t = TM * ty + j;
        if (t >= T) continue;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = r0 + 4 * tx + i;
            if (r >= R) continue;
            const i64 at = (i64)t * R + r;
            if (split) out[at] = acc[i][j];
            else out[seg != nullptr ? seg_index(bounds, T, t, r, R) : at] = res != nullptr ? acc[i][j] + res[at] : acc[i][j];
        }
    }
}


// No pdl_entry first: each map asks for its first stage's weights (no kernel writes them), then waits.
template <int QT, int TT>
__global__ void __launch_bounds__(128, 3) gemm_batch(
        const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
        const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y,
        float* __restrict__ part, int T, int R, int K, int stages, const float* __restrict__ res,
        const int* __restrict__ seg, int nseg) {
    static_assert(TT == 8 || TT == 16 || TT == 32, "gemm_batch: 8, 16 or 32 tokens");
    if constexpr (TT == 32) gb_quads<QT, TT>(wq, wd, xq, xd, xs, y, part, T, R, K, stages, res, seg, nseg);
    else gb_rows<QT, TT>(wq, wd, xq, xd, xs, y, part, T, R, K, stages, res, seg, nseg);
}

// splitk_sum: y = the sum over s < splits of part[s] (T, R) (+ res), in split order: gemm_batch's split-K
// partial sums, added deterministically, written in gemm_batch's output layout (seg: see above).
extern "C" __global__ void splitk_sum(const float* __restrict__ part, int splits, int T, int R,
                                      float* __restrict__ y, const float* __restrict__ res,
                                      const int* __restrict__ seg, int nseg) {
    pdl_entry();
    __shared__ int bounds[9];
    seg_bounds(bounds, seg, nseg, R, (int)threadIdx.x);
    __syncthreads();
    const i64 n = (i64)T * R;
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = part[i];
    for (int s = 1; s < splits; s++) v += part[(i64)s * n + i];
    if (res != nullptr) v += res[i];
    const int t = (int)(i / R), r = (int)(i - (i64)t * R);
    y[seg != nullptr ? seg_index(bounds, T, t, r, R) : i] = v;
}

