// fp16 HFMA2 matmuls: Y (T, R) = X (T, K) @ W (R, K)^T with fp16 products and fp32 accumulation, for
// cards whose DP4A and fp32 FMA are throttled but whose fp16 runs at full (2x fp32) rate. Built after
// gemv.cu (WBlock / load_wblock) in the same module; all half maths is inline PTX on packed f16x2
// registers (sm_53+), so no fp16 header is needed.
//
// Activations: quantize_h16 scales each 32-value block of x by its absmax: x' = x / amax (stored as
//   fp16, |x'| <= 1), xd = amax, xs = sum(x) (fp32, for the Q4_0 / Q4_K offset term).
// Weights: dequantized on the fly to fp16 integers q (Q8_0 / Q6_K / Q5_0 / IQ4_NL / IQ4_XS: signed bytes,
//   |q| <= 128; Q4_0 / Q4_K: 0..15; Q4_1 / Q5_1: 0..31), their fp32 block scales applied afterwards; F16
//   rows are used as they are (scale 1).
// Why the fp16 partial cannot overflow: a partial is one f16x2 register, each lane summing at most 16
//   products q * x' over one 32-value block (GEMM: 16 k-pairs, GEMV: 8 k-pairs per half-block), so
//   |partial| <= 16 * 128 * 1 = 2048 < 65504 for every quantized format, whatever the range of x (the
//   fp32 amax carries it). Each partial is converted to fp32 and scaled by xd * d (+ m * xs) into fp32
//   accumulators. F16 rows have no such bound (|w| up to 65504): a partial that comes out non-finite is
//   recomputed for that block with fp32 products, so the result is right, only slower, for such rows.
// Blocks whose absmax is below 1e-30 (fp32 subnormal territory) read as zero.

#define H2_1152 0x64806480u  // 1152.0 in both fp16 lanes (1024 + 128)

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// Sum of the two fp16 lanes in fp32.
__device__ __forceinline__ float fold_h2(u32 p) { return h2f((u16)(p & 0xffffu)) + h2f((u16)(p >> 16)); }

// fp32 dot product of n f16x2 words a[i * as] . b[i * bs] (the overflow fallback of F16 rows).
__device__ __forceinline__ float dot_h2_f32(const u32* a, int as, const u32* b, int bs, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) {
        u32 x = a[i * as], y = b[i * bs];
        s = fmaf(h2f((u16)(x & 0xffffu)), h2f((u16)(y & 0xffffu)), s);
        s = fmaf(h2f((u16)(x >> 16)), h2f((u16)(y >> 16)), s);
    }
    return s;
}

__device__ __forceinline__ bool finite_f(float v) { return fabsf(v) < INFINITY; }

// x (nb blocks of 32 fp32, i.e. (T, K) flattened) -> xh (fp16, same layout), xd = amax, xs = sum.
// One warp per block.
extern "C" __global__ void quantize_h16(const float* __restrict__ x, u32* __restrict__ xh,
                                        float* __restrict__ xd, float* __restrict__ xs, i64 nb) {
    pdl_entry();
    i64 b = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (b >= nb) return;  // the whole warp shares b
    float v = x[b * 32 + lane];
    float amax = warp_max_abs(v);
    float s = warp_sum(v);
    float inv = amax > 1.0e-30f ? 1.0f / amax : 0.0f;
    u32 h = (u32)f2h_rn(v * inv);  // |v * inv| <= 1 (+ one fp32 rounding, which fp16 rounding removes)
    u32 up = __shfl_down_sync(0xffffffffu, h, 1);
    if ((lane & 1) == 0) xh[b * 16 + (lane >> 1)] = h | (up << 16);
    if (lane == 0) {
        xd[b] = amax > 1.0e-30f ? amax : 0.0f;
        xs[b] = s;
    }
}

// One 32-value weight block as loaded from memory (converted to fp16 later, so loads stay in flight).
struct HRaw {
    int q[16];  // F16: 16 fp16 pairs; quantized formats: 32 bytes in q[0..7] (load_wblock's layout)
    float dlo, dhi, m;
};

template <int QT>
__device__ __forceinline__ void load_hraw(const u8* wrow, const u16* wdrow, int b, HRaw& r) {
    if constexpr (QT == QT_F16) {
        const int4* p = (const int4*)(wrow) + b * 4;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int4 v = p[i];
            r.q[4 * i] = v.x; r.q[4 * i + 1] = v.y; r.q[4 * i + 2] = v.z; r.q[4 * i + 3] = v.w;
        }
        r.dlo = r.dhi = 1.0f;
        r.m = 0.0f;
    } else {
        WBlock w;
        load_wblock<QT>(wrow, wdrow, b, w);
#pragma unroll
        for (int i = 0; i < 8; i++) r.q[i] = w.q[i];
        r.dlo = w.dlo; r.dhi = w.dhi; r.m = w.m;
    }
}

// The block's 32 values as 16 f16x2 words (h[i] = values 2i, 2i+1, the even one in the low half).
// Signed byte q -> fp16: the byte q + 128 placed under the exponent of 1024 reads as 1024 + q + 128
// (exact: fp16 has unit spacing in [1024, 2048)), minus 1152 gives q. Formats with unsigned 0..15
// bytes (Q4_0, Q4_K) read the same way, as non-negative signed bytes.
template <int QT>
__device__ __forceinline__ void hraw_to_h2(const HRaw& r, u32* h) {
    if constexpr (QT == QT_F16) {
#pragma unroll
        for (int i = 0; i < 16; i++) h[i] = (u32)r.q[i];
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 u = (u32)r.q[i] ^ 0x80808080u;
            h[2 * i] = hsub2(__byte_perm(u, 0x64646464u, 0x4140), H2_1152);
            h[2 * i + 1] = hsub2(__byte_perm(u, 0x64646464u, 0x4342), H2_1152);
        }
    }
}

// Decode GEMV, NT tokens per launch: one warp per weight row, each lane one block at a time, four
// blocks loaded before any is used (as gemv_dp4a). Per block and token two f16x2 partials (values
// 0..15 and 16..31, so Q6_K's two scales apply), each lane summing 8 products.
// Optional `res` (same shape as y) is added to the result (a layer's residual add).
template <int QT, int NT>
__global__ void gemv_hfma2(const u8* __restrict__ wq, const u16* __restrict__ wd, const u32* __restrict__ xh,
                           const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y,
                           int R, int K, const float* __restrict__ res) {
    pdl_entry();
    int warps = blockDim.x >> 5;
    int row = blockIdx.x * warps + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= R) return;
    int nb = K >> 5;
    const u8* wrow = wq + (i64)row * row_bytes<QT>(K);
    const u16* wdrow = wd + (i64)row * nb;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    for (int b0 = lane; b0 < nb; b0 += 32 * 4) {
        HRaw w[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (b0 + 32 * u < nb) load_hraw<QT>(wrow, wdrow, b0 + 32 * u, w[u]);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int b = b0 + 32 * u;
            if (b >= nb) break;
            u32 h[16];
            hraw_to_h2<QT>(w[u], h);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                i64 xb = (i64)t * nb + b;
                const uint4* xp = (const uint4*)(xh + xb * 16);
                uint4 a0 = xp[0], a1 = xp[1], a2 = xp[2], a3 = xp[3];
                u32 xv[16] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w,
                              a2.x, a2.y, a2.z, a2.w, a3.x, a3.y, a3.z, a3.w};
                u32 plo = 0u, phi = 0u;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    plo = hfma2(h[i], xv[i], plo);
                    phi = hfma2(h[8 + i], xv[8 + i], phi);
                }
                float lo = fold_h2(plo), hi = fold_h2(phi);
                if (QT == QT_F16 && !(finite_f(lo) && finite_f(hi))) {
                    lo = dot_h2_f32(h, 1, xv, 1, 8);
                    hi = dot_h2_f32(h + 8, 1, xv + 8, 1, 8);
                }
                acc[t] += xd[xb] * (w[u].dlo * lo + w[u].dhi * hi);
                if (qt_has_offset(QT)) acc[t] += w[u].m * xs[xb];  // (xs may be inf elsewhere)
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = warp_sum(acc[t]);
        i64 yi = (i64)t * R + row;
        if (lane == 0) y[yi] = res != 0 ? v + res[yi] : v;
    }
}

// Prefill GEMM: 128 tokens x 128 weight rows per block of 256 threads, each thread an 8 x 8 tile (the
// layout of gemm_dp4a). The K loop walks one 32-value block per stage through double-buffered shared
// memory (16 f16x2 k-pairs per token and per row), the next block prefetched into registers. Per
// output an f16x2 partial over the block (Q6_K: per half-block), then fp32 scaling and accumulation.
#define GH_M 128
#define GH_N 128

template <int QT>
__global__ void __launch_bounds__(256) gemm_hfma2(
        const u8* __restrict__ wq, const u16* __restrict__ wd, const u32* __restrict__ xh,
        const float* __restrict__ xd, const float* __restrict__ xs, float* __restrict__ y,
        int T, int R, int K) {
    pdl_entry();
    __shared__ uint4 As4[2][16][GH_M / 4];  // [buffer][k-pair][token / 4]
    __shared__ uint4 Bs4[2][16][GH_N / 4];  // [buffer][k-pair][row / 4]
    __shared__ float sxd[2][GH_M], sxs[2][GH_M];
    __shared__ float sdlo[2][GH_N], sdhi[2][GH_N], sm[2][GH_N];
    const bool split = (QT == QT_Q6_K);
    const bool has_m = qt_has_offset(QT);

    int tid = threadIdx.x;
    int t0 = blockIdx.y * GH_M, r0 = blockIdx.x * GH_N;
    int nb = K >> 5;
    i64 wstride = row_bytes<QT>(K);

    // Loader roles: threads 0..127 load one weight row's block, 128..255 one token's block.
    int lrow = tid & 127;
    bool loads_w = tid < 128;
    int wr = min(r0 + lrow, R - 1);
    int xt = min(t0 + lrow, T - 1);
    const u8* wrow = wq + (i64)wr * wstride;
    const u16* wdrow = wd + (i64)wr * nb;

    // One prefetch register set for both roles (fewer live registers next to the 8 x 8 tiles):
    // weight rows as load_hraw fills it, tokens as 16 f16x2 words of x' with dlo = xd, dhi = xs.
    HRaw pre;
    auto gload = [&](int b) {
        if (loads_w) {
            load_hraw<QT>(wrow, wdrow, b, pre);
        } else {
            i64 xb = (i64)xt * nb + b;
            const uint4* p = (const uint4*)(xh + xb * 16);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                uint4 v = p[i];
                pre.q[4 * i] = (int)v.x; pre.q[4 * i + 1] = (int)v.y;
                pre.q[4 * i + 2] = (int)v.z; pre.q[4 * i + 3] = (int)v.w;
            }
            pre.dlo = xd[xb]; pre.dhi = xs[xb];
        }
    };
    auto sstore = [&](int buf) {
        if (loads_w) {
            u32 h[16];
            hraw_to_h2<QT>(pre, h);
            u32* B = (u32*)Bs4[buf];
#pragma unroll
            for (int k = 0; k < 16; k++) B[k * GH_N + lrow] = h[k];
            sdlo[buf][lrow] = pre.dlo; sdhi[buf][lrow] = pre.dhi; sm[buf][lrow] = pre.m;
        } else {
            u32* A = (u32*)As4[buf];
#pragma unroll
            for (int k = 0; k < 16; k++) A[k * GH_M + lrow] = (u32)pre.q[k];
            sxd[buf][lrow] = pre.dlo; sxs[buf][lrow] = pre.dhi;
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
    for (int b = 0; b < nb; b++) {
        int buf = b & 1;
        if (b + 1 < nb) gload(b + 1);
        u32 p[8][8];
#pragma unroll
        for (int half = 0; half < 2; half++) {
            if (half == 0 || split) {
#pragma unroll
                for (int i = 0; i < 8; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) p[i][j] = 0u;
            }
#pragma unroll
            for (int kk = 0; kk < 8; kk++) {
                int k = half * 8 + kk;
                uint4 a0 = As4[buf][k][ty], a1 = As4[buf][k][16 + ty];
                uint4 b0 = Bs4[buf][k][tx], b1 = Bs4[buf][k][16 + tx];
                u32 av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                u32 bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                for (int i = 0; i < 8; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) p[i][j] = hfma2(av[i], bv[j], p[i][j]);
            }
            if (split || half == 1) {
                float dw[8], mw[8];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    int rj = (j < 4) ? tx * 4 + j : 64 + tx * 4 + j - 4;
                    dw[j] = (split && half == 0) ? sdlo[buf][rj] : sdhi[buf][rj];
                    mw[j] = sm[buf][rj];
                }
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    int ti = (i < 4) ? ty * 4 + i : 64 + ty * 4 + i - 4;
                    float dx = sxd[buf][ti], sx = sxs[buf][ti];
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        float v = fold_h2(p[i][j]);
                        if (QT == QT_F16 && !finite_f(v)) {
                            int rj = (j < 4) ? tx * 4 + j : 64 + tx * 4 + j - 4;
                            v = dot_h2_f32((const u32*)As4[buf] + ti, GH_M, (const u32*)Bs4[buf] + rj, GH_N, 16);
                        }
                        acc[i][j] = fmaf(v, dx * dw[j], acc[i][j]);
                        if (has_m) acc[i][j] = fmaf(mw[j], sx, acc[i][j]);
                    }
                }
            }
        }
        if (b + 1 < nb) sstore(buf ^ 1);
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
