// Matrix-matrix products for prefill: Y (T, R) = X (T, K) @ W (R, K)^T.
//
// gemm_dp4a<QT, NBLK>: 128 tokens x 128 weight rows per block of 256 threads, each thread an 8 x 8 tile; the K
//   loop walks one 32-value quant block at a time (one scale per block), staged through double-buffered
//   shared memory with the next block prefetched into registers. Inside a block the products are exact
//   int32 (DP4A); at the block's end they are scaled into fp32 accumulators. The int32 accumulators
//   start at 0x4B400000 (the float 1.5 * 2^23), so the int -> float conversion is one fp32 subtraction
//   (exact while |sum| < 2^22; a block sums at most 32 * 127 * 127 = 516,128) instead of a quarter-rate
//   I2F. Weights: any format load_wblock (gemv.cu) reads; Q6_K's two scales per block are applied at
//   the two half-blocks.
// gemm_fma: 64 x 64 tiles, fp32 FMA on weights dequantized to fp32 in shared memory (fallback path and
//   F32/F16/BF16 weights).

#define GB_M 128
#define GB_N 128
#define MAGIC_I 0x4B400000
#define MAGIC_F 12582912.0f

template <int QT, int NBLK>
__global__ void __launch_bounds__(256) gemm_dp4a(
        const u8* __restrict__ wq, const u16* __restrict__ wd, const i8* __restrict__ xq,
        const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y,
        int T, int R, int K) {
    // NBLK quant blocks (32 values each) per shared-memory stage: 2 halves the barriers per K.
    __shared__ int4 As4[2][NBLK][8][GB_M / 4];
    __shared__ int4 Bs4[2][NBLK][8][GB_N / 4];
    __shared__ float sxd[2][NBLK][GB_M], sxs[2][NBLK][GB_M];
    __shared__ float sdlo[2][NBLK][GB_N], sdhi[2][NBLK][GB_N], sm[2][NBLK][GB_N];
    const bool split = (QT == QT_Q6_K);
    const bool has_m = qt_has_offset(QT);

    int tid = threadIdx.x;
    int t0 = blockIdx.y * GB_M, r0 = blockIdx.x * GB_N;
    int nb = K >> 5;
    int nst = (nb + NBLK - 1) / NBLK;
    i64 wstride = row_bytes<QT>(K);

    // Loader roles: threads 0..127 load one weight row's blocks, 128..255 one token's blocks.
    int lrow = tid & 127;
    bool loads_w = tid < 128;
    int wr = min(r0 + lrow, R - 1);
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
                    float dw[8], mw[8];
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        int rj = (j < 4) ? tx * 4 + j : 64 + tx * 4 + j - 4;
                        dw[j] = (split && half == 0) ? sdlo[buf][u][rj] : sdhi[buf][u][rj];
                        mw[j] = sm[buf][u][rj];
                    }
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        int ti = (i < 4) ? ty * 4 + i : 64 + ty * 4 + i - 4;
                        float dx = sxd[buf][u][ti], sx = sxs[buf][u][ti];
#pragma unroll
                        for (int j = 0; j < 8; j++) {
                            float v = __int_as_float(ai[i][j]) - MAGIC_F;
                            acc[i][j] = fmaf(v, dx * dw[j], acc[i][j]);
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
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int t = t0 + ((i < 4) ? ty * 4 + i : 64 + ty * 4 + i - 4);
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int r = r0 + ((j < 4) ? tx * 4 + j : 64 + tx * 4 + j - 4);
            if (r < R) y[(i64)t * R + r] = acc[i][j];
        }
    }
}

#define GF_M 64
#define GF_N 64

template <int QT>
__global__ void __launch_bounds__(256) gemm_fma(
        const u8* __restrict__ wq, const u16* __restrict__ wd, const float* __restrict__ x,
        float* __restrict__ y, int T, int R, int K) {
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
