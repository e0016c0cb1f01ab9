// Shared helpers for every minecart kernel. Textually prepended to each .cu file by kernels/build.py
// (NVRTC gets no include path), so it must stay self-contained: no system headers.
//
// Not here: anything that touches tensor cores. The only integer dot product is DP4A (PTX dp4a), the
// only half-precision maths is a conversion to fp32.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// GGML type ids, used as template arguments so one kernel source serves every format.
#define QT_F32 0
#define QT_F16 1
#define QT_Q4_0 2
#define QT_Q8_0 8
#define QT_Q4_K 12
#define QT_Q6_K 14
#define QT_BF16 30

#define WARP 32
#define NEG_BIG (-1.0e30f)
#define INFINITY (__int_as_float(0x7f800000))

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf2f(u16 h) { return __int_as_float(((u32)h) << 16); }

// a . b over four signed bytes, added to c (DP4A: full rate on sm_61 and newer).
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024). `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[wid] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    v = (threadIdx.x < nw) ? scratch[threadIdx.x] : 0.0f;
    if (wid == 0) v = warp_sum(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    return scratch[0];
}

// q8_1 quantization of one block of 32 values held one per lane (all 32 lanes of the warp call it):
// d = max|v| / 127, q = round(v / d) (int8, 0 when the block is all zero), s = d * sum(q). Every producer
// of DP4A activations (quantize_q8_1 and the fused kernels that publish their output quantized) uses
// this one function, so their blocks are bit-identical.
__device__ __forceinline__ void q8_1_block(float v, i8* __restrict__ xq, float* __restrict__ xd,
                                           float* __restrict__ xs, int lane) {
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    int q = (amax > 0.0f) ? __float2int_rn(v / d) : 0;
    xq[lane] = (i8)q;
    float qs = warp_sum((float)q);
    if (lane == 0) {
        *xd = d;
        *xs = d * qs;
    }
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + __expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }

// Unaligned-safe 32-bit read of 2-byte aligned data (Q6_K blocks are 210 bytes).
__device__ __forceinline__ int ld_u16x2(const u8* p) {
    const u16* q = (const u16*)p;
    return (int)((u32)q[0] | ((u32)q[1] << 16));
}

// ---- weight formats on the device ------------------------------------------------------------------
// Q8_0 and Q4_0 are re-laid out at upload (same bytes, no precision change): quants of a row are
// contiguous (`wq`, Q8_0: K int8; Q4_0: K/2 bytes, each block's 16 bytes in GGUF order) and the fp16
// block scales sit in a separate (rows, K/32) array (`wd`), so kernels can use aligned 16-byte loads.
// Q4_K and Q6_K keep their GGUF blocks (`wq` = raw bytes, `wd` unused). F32/F16/BF16 are plain rows.

// Row stride in bytes of `wq` for each format.
template <int QT> __device__ __forceinline__ i64 row_bytes(int K) {
    if (QT == QT_F32) return (i64)K * 4;
    if (QT == QT_F16 || QT == QT_BF16) return (i64)K * 2;
    if (QT == QT_Q8_0) return K;
    if (QT == QT_Q4_0) return K / 2;
    if (QT == QT_Q4_K) return (i64)(K / 256) * 144;
    return (i64)(K / 256) * 210;  // Q6_K
}

// Sub-block b (values 32b..32b+31 of a row) of a K-quant row (GGUF blocks of 256): where its quants
// are and how they scale. Shared by the fp32 dequantization below and the DP4A loads (gemv.cu).
struct KSub {
    const u8* q;   // Q4_K: 32 bytes, value = nibble at `shl`; Q6_K: the low nibbles (ql), at `shl`
    const u8* qh;  // Q6_K: the high 2-bit pairs, at `shh`
    int shl, shh;
    float d0, d1;  // scale of values 0..15 and 16..31 (Q4_K: d * s for both)
    float dm;      // Q4_K: dmin * m, subtracted from every value; Q6_K: 0 (values are q - 32)
};

template <int QT>
__device__ __forceinline__ KSub ksub(const u8* wrow, int b) {
    KSub r;
    int j = b & 7;
    if (QT == QT_Q4_K) {
        const u8* p = wrow + (b >> 3) * 144;
        float d = h2f(*(const u16*)p), dmin = h2f(*(const u16*)(p + 2));
        const u8* sc = p + 4;
        int s, m;
        if (j < 4) { s = sc[j] & 63; m = sc[j + 4] & 63; }
        else { s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4); m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4); }
        r.q = p + 16 + 32 * (j >> 1);
        r.qh = p;
        r.shl = 4 * (j & 1);
        r.shh = 0;
        r.d0 = r.d1 = d * (float)s;
        r.dm = dmin * (float)m;
    } else {  // Q6_K
        const u8* p = wrow + (b >> 3) * 210;
        int n = j >> 2, s = j & 3;
        const i8* sc = (const i8*)(p + 192 + 8 * n + 2 * s);
        float d = h2f(*(const u16*)(p + 208));
        r.q = p + 64 * n + 32 * (s & 1);
        r.qh = p + 128 + 32 * n;
        r.shl = 4 * (s >> 1);
        r.shh = 2 * s;
        r.d0 = d * (float)sc[0];
        r.d1 = d * (float)sc[1];
        r.dm = 0.0f;
    }
    return r;
}

// Dequantize the 32 values of block b (values 32b..32b+31) of one row to fp32.
// wrow: start of the row in `wq`; wdrow: start of the row's scales in `wd` (Q8_0/Q4_0 only).
template <int QT>
__device__ __forceinline__ void deq_block32(const u8* wrow, const u16* wdrow, int b, float* out) {
    if (QT == QT_F32) {
        const float4* p = (const float4*)(wrow) + b * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 v = p[i];
            out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
        }
    } else if (QT == QT_F16 || QT == QT_BF16) {
        const uint4* p = (const uint4*)(wrow) + b * 4;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint4 v = p[i];
            u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                u16 lo = (u16)(w[j] & 0xffffu), hi = (u16)(w[j] >> 16);
                out[8 * i + 2 * j] = (QT == QT_F16) ? h2f(lo) : bf2f(lo);
                out[8 * i + 2 * j + 1] = (QT == QT_F16) ? h2f(hi) : bf2f(hi);
            }
        }
    } else if (QT == QT_Q8_0) {
        float d = h2f(wdrow[b]);
        const int4* p = (const int4*)(wrow) + b * 2;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int4 v = p[i];
            int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int k = 0; k < 4; k++) out[16 * i + 4 * j + k] = d * (float)(i8)((w[j] >> (8 * k)) & 0xff);
        }
    } else if (QT == QT_Q4_0) {
        float d = h2f(wdrow[b]);
        int4 v = ((const int4*)(wrow))[b];
        int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int byte = (w[j] >> (8 * k)) & 0xff;
                out[4 * j + k] = d * (float)((byte & 15) - 8);
                out[16 + 4 * j + k] = d * (float)((byte >> 4) - 8);
            }
    } else if (QT == QT_Q4_K) {
        KSub k = ksub<QT>(wrow, b);
#pragma unroll
        for (int l = 0; l < 32; l++) out[l] = k.d0 * (float)((k.q[l] >> k.shl) & 15) - k.dm;
    } else {  // Q6_K
        KSub k = ksub<QT>(wrow, b);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int q = ((k.q[l] >> k.shl) & 15) | (((k.qh[l] >> k.shh) & 3) << 4);
            out[l] = (l < 16 ? k.d0 : k.d1) * (float)(q - 32);
        }
    }
}

// Split flash-decode (attention.cu flash_decode, kvq3.cu rotated-space decode): a block of 128 threads
// owns up to GM query heads of one KV head; thread tid holds output columns tid + 128 u (u < NU) of each.
// decode_pv_tile: o[g] = o[g] * alpha[g] + P[g] . V-tile (TILE rows of D values, row stride D + 1), one
// fp32 FMA chain per column in key order.
template <int D, int NU, int GM, int TILE>
__device__ __forceinline__ void decode_pv_tile(float (&o)[GM][NU], const float (*P)[TILE],
                                               const float* s_alpha, const float* KV, int G, int tid) {
#pragma unroll
    for (int u = 0; u < NU; u++) {
        int c = tid + 128 * u;
        if (c < D) {
#pragma unroll
            for (int g = 0; g < GM; g++) {
                if (g < G) {
                    float acc = o[g][u] * s_alpha[g];
#pragma unroll 8
                    for (int j = 0; j < TILE; j++) acc = fmaf(P[g][j], KV[j * (D + 1) + c], acc);
                    o[g][u] = acc;
                }
            }
        }
    }
}

// decode_store_partials: the split's unnormalized outputs po, running maxima pm and sums pl of query
// heads h0 + g (warp w's lane 0 holds heads w and w + 4), for merge_splits.
template <int D, int NU, int GM>
__device__ __forceinline__ void decode_store_partials(const float (&o)[GM][NU], const float (&m_run)[2],
                                                      const float (&l_run)[2], float* po, float* pm,
                                                      float* pl, i64 base, int G, int tid, int w,
                                                      int lane) {
#pragma unroll
    for (int u = 0; u < NU; u++) {
        int c = tid + 128 * u;
        if (c < D)
#pragma unroll
            for (int g = 0; g < GM; g++)
                if (g < G) po[(base + g) * D + c] = o[g][u];
    }
    if (lane == 0) {
#pragma unroll
        for (int a = 0; a < 2; a++) {
            int g = w + 4 * a;
            if (g < G) { pm[base + g] = m_run[a]; pl[base + g] = l_run[a]; }
        }
    }
}
