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
#define QT_Q4_1 3
#define QT_Q5_0 6
#define QT_Q5_1 7
#define QT_Q8_0 8
#define QT_Q4_K 12
#define QT_Q5_K 13
#define QT_Q6_K 14
#define QT_IQ4_NL 20
#define QT_IQ4_XS 23
#define QT_BF16 30

#define WARP 32
#define NEG_BIG (-1.0e30f)
#define INFINITY (__int_as_float(0x7f800000))

// Programmatic dependent launch (sm_90 and later; build.Kernel launches with it where the card has it and
// MINECART_PDL allows): the first statement of every kernel (the single-token GEMVs first touch their
// weights, which no kernel writes: gemv_stream_body, pdl_entry_prefetch). The wait returns once the kernels before
// this one in its stream have finished and their writes are visible, so nothing of this kernel runs
// before its inputs are ready. Then it lets the next kernel launch: that one's blocks take free slots and
// wait in their own pdl_entry, instead of being launched only after this kernel has ended. Without the
// launch attribute, and on older cards (not compiled there), it does nothing.
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Ask L2 for the 128-byte line holding p, before pdl_entry's wait, so that its DRAM round trip runs while
// the kernel ahead is still finishing. A hint, not a read: nothing reaches a register, and a line a kernel
// ahead still writes is only fetched in vain (L2 keeps the latest bytes). Worth it for what no kernel
// ahead writes: weights, a recurrent state only this kernel writes. Only where the wait exists (sm_90 and
// later): without it the line is asked for just before it is read, which buys nothing.
__device__ __forceinline__ void prefetch_line(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// pdl_entry for a kernel whose block streams `bytes` of weights from `p` (which no kernel writes): the
// block first asks L2 for them (128-byte lines over its threads), then waits.
__device__ __forceinline__ void pdl_entry_prefetch(const void* p, long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const char* c = (const char*)p;
    for (long long off = (long long)threadIdx.x * 128; off < bytes; off += (long long)blockDim.x * 128)
        prefetch_line(c + off);
#endif
    pdl_entry();
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// fp32 -> fp16 bits, rounded to nearest even (the KV caches' stores, the HFMA2 operands, requant_q8_0's scales)
__device__ __forceinline__ u16 f2h_rn(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf2f(u16 h) { return __int_as_float(((u32)h) << 16); }

// a . b over four signed bytes, added to c (DP4A: full rate on sm_61 and newer).
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Exact int32 block sums, scaled into fp32 (gemm_dp4a, gemm_batch, moe_gemm_dp4a). A sum starts at
// MAGIC_I, the bits of the float 1.5 * 2^23, and DP4A adds the block's products s to it as an integer;
// while |s| < 2^22 (a 32-value block sums at most 32 * 127 * 127 = 516,128) those bits read as a float
// are 1.5 * 2^23 + s exactly, so no int -> float conversion (a quarter-rate I2F) is needed.
// magic_scale(a, dw, magic_off(dw)) = (1.5 * 2^23 + s) * dw - 1.5 * 2^23 * dw in one FMA: s * dw rounded
// once, in place of a subtraction and a multiply. It is exact because magic_off(dw) is: every block
// scale of a DP4A format is an fp16 value times an integer of at most 8 bits (at most 19 significant
// bits) and 1.5 * 2^23 adds at most 2 (tests/kernels/test_magic_scale.py checks every such product).
#define MAGIC_I 0x4B400000
#define MAGIC_F 12582912.0f

__device__ __forceinline__ float magic_off(float dw) { return -MAGIC_F * dw; }

__device__ __forceinline__ float magic_scale(int a, float dw, float off) { return fmaf(__int_as_float(a), dw, off); }

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

// max |v| over the warp. On sm_80 and later one redux.sync: |v| read as an unsigned integer orders as the
// float does (a non-negative float's bits grow with it), so the result is the same float as warp_max's,
// without its five dependent shuffles (a NaN wins here, where fmaxf drops it).
__device__ __forceinline__ float warp_max_abs(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(fabsf(v))));
#else
    return warp_max(fabsf(v));
#endif
}

// Sum over the warp of small ints (|sum| < 2^24, so exact in float), as a float: one redux.sync on sm_80
// and later, the float shuffles of warp_sum before (the code older cards ran before redux).
__device__ __forceinline__ float warp_sum_small_int(int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return (float)__reduce_add_sync(0xffffffffu, v);
#else
    return warp_sum((float)v);
#endif
}

// ggml's Q8_0 rule (quantize_row_q8_0_ref) for a block of 32 values whose largest magnitude is amax: the
// scale d = amax / 127 (returned; stored as fp16 by the callers) and `id`, what each value is multiplied by
// before roundf (0 for an all-zero block). The weights' requantization (gemm.cu requant_q8_0) and the q8_0
// KV cache (kv_q8_0.cu kv_store1) both use it; NumPy twin: engine/kvquant.py quantize_q8_0.
__device__ __forceinline__ float q8_0_scale(float amax, float& id) {
    float d = amax / 127.0f;
    id = d != 0.0f ? 1.0f / d : 0.0f;
    return d;
}

// q8_1 quantization of one block of 32 values held one per lane (all 32 lanes of the warp call it):
// d = max|v| / 127, q = round(v / d) (int8, 0 when the block is all zero), s = d * sum(q). Every producer
// of DP4A activations (quantize_q8_1 and the fused kernels that publish their output quantized) uses
// this one function, so their blocks are bit-identical.
__device__ __forceinline__ void q8_1_block(float v, i8* __restrict__ xq, float* __restrict__ xd,
                                           float* __restrict__ xs, int lane) {
    float amax = warp_max_abs(v);
    float d = amax / 127.0f;
    int q = (amax > 0.0f) ? __float2int_rn(v / d) : 0;
    xq[lane] = (i8)q;
    float qs = warp_sum_small_int(q);  // |sum| <= 32 x 127
    if (lane == 0) {
        *xd = d;
        *xs = d * qs;
    }
}

// Keys per slice of flash_decode (attention.cu): split_len, or with split_len == 0 (graph replay: the
// length is only known on the device) ceil(kv_len / n_splits) rounded up to 32, at least 32.
__device__ __forceinline__ int fd_split_len(int split_len, int kv_len, int n_splits) {
    return split_len > 0 ? split_len : max(32, (kv_len + 32 * n_splits - 1) / (32 * n_splits) * 32);
}

// The slices of a flash_decode launch that hold keys, the ones its merge reads: those below the context
// length (kv_len, or *kv_len_ptr + 1 inside a captured graph), of fd_split_len keys each.
__device__ __forceinline__ int fd_live_splits(int n_splits, int kv_len, const int* __restrict__ kv_len_ptr,
                                              int split_len) {
    if (kv_len_ptr != 0) kv_len = *kv_len_ptr + 1;
    split_len = fd_split_len(split_len, kv_len, n_splits);
    return min(n_splits, (kv_len + split_len - 1) / split_len);
}

// The merge of one head's context-split partials of flash_decode (po (splits, nh, D), pm and pl (splits,
// nh)) over splits [0, ns), for MERGE_COLS columns c0 .. c0 + MERGE_COLS - 1 of head h (D % MERGE_COLS
// == 0): a block of MERGE_THREADS threads (ops.MERGE_THREADS; grids of D / MERGE_COLS blocks a head).
// M, the maxima's maximum, and L = sum e^(m_s - M) l_s are block reductions (each thread strides over
// the splits); the weights e^(m_s - M) are staged in shared memory. Thread tid takes 4 columns (c0 + 4
// (tid % 16) ..., one 16-byte load a split) for part tid / 16 of the MERGE_THREADS / 16 parts: part p adds
// w_s o_s over the splits p, p + P, ... in order, MERGE_LOADS loads in flight (all issued before the
// first is used: one round up to 64 splits), and the parts' sums are added in part order through shared
// memory (deterministic). Returns the column's o / L to the threads tid < MERGE_COLS (column c0 + tid: two
// whole warps) and 0 to the others; every thread calls it. po 16-byte aligned.
// One block of D threads a head, each thread a column over all the splits, left the merge a serial chain
// of ns / 8 rounds of L2 loads: at 16K context (61 splits for the 9B's heads) it took 20.65 us under
// Nsight Compute against flash_decode's 35.86; this form 7.18 (H100, docs/BENCHMARKS.md v44).
#define MERGE_COLS 64
#define MERGE_THREADS 256
#define MERGE_LOADS 4
__device__ __forceinline__ float merge_head_splits(const float* __restrict__ po, const float* __restrict__ pm,
                                                   const float* __restrict__ pl, int ns, int nh, int h, int D,
                                                   int c0) {
    constexpr int NT = MERGE_THREADS, TPR = MERGE_COLS / 4, P = NT / TPR;  // threads a split's row; parts
    __shared__ float red[32];
    __shared__ float wsh[NT];
    __shared__ __align__(16) float4 sacc[P][TPR];
    const int tid = threadIdx.x, lane = tid & 31;
    const int c4 = tid % TPR, part = tid / TPR;
    float m = NEG_BIG;
    for (int s = tid; s < ns; s += NT) m = fmaxf(m, pm[(i64)s * nh + h]);
    m = warp_max(m);
    if (lane == 0) red[tid >> 5] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int w = 1; w < NT / 32; w++) m = fmaxf(m, red[w]);
    float l = 0.0f;
    for (int s = tid; s < ns; s += NT) l += __expf(pm[(i64)s * nh + h] - m) * pl[(i64)s * nh + h];
    l = block_sum(l, red);  // its first barrier also orders the reads of red above before its writes
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const i64 stride = (i64)nh * D / 4, step = (i64)P * stride;  // in float4: a split's partials; P splits'
    for (int s0 = 0; s0 < ns; s0 += NT) {
        __syncthreads();
        if (s0 + tid < ns) wsh[tid] = __expf(pm[(i64)s0 * nh + (i64)tid * nh + h] - m);
        __syncthreads();
        const int n = min(NT, ns - s0);
        const float4* p = (const float4*)(po + ((i64)s0 * nh + h) * D + c0) + c4;
        for (int s1 = part; s1 < n; s1 += MERGE_LOADS * P) {
            float4 v[MERGE_LOADS];
            const float4* q = p + s1 * stride;
#pragma unroll
            for (int k = 0; k < MERGE_LOADS; k++, q += step)
                v[k] = s1 + k * P < n ? *q : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int k = 0; k < MERGE_LOADS; k++) {
                if (s1 + k * P < n) {
                    const float w = wsh[s1 + k * P];
                    acc.x += w * v[k].x;
                    acc.y += w * v[k].y;
                    acc.z += w * v[k].z;
                    acc.w += w * v[k].w;
                }
            }
        }
    }
    sacc[part][c4] = acc;
    __syncthreads();
    if (tid >= MERGE_COLS) return 0.0f;
    const float* sa = (const float*)sacc;
    float r = sa[tid];
#pragma unroll
    for (int k = 1; k < P; k++) r += sa[k * MERGE_COLS + tid];
    return r * (l > 0.0f ? 1.0f / l : 0.0f);
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
// Q4_K, Q5_K and Q6_K are repacked at upload (kernels/kquant_layout.py; the K-quant section below).
// F32/F16/BF16 are plain rows.

// Row stride in bytes of `wq` for each format.
template <int QT> __device__ __forceinline__ i64 row_bytes(int K) {
    if (QT == QT_F32) return (i64)K * 4;
    if (QT == QT_F16 || QT == QT_BF16) return (i64)K * 2;
    if (QT == QT_Q8_0) return K;
    if (QT == QT_Q4_0) return K / 2;
    if (QT == QT_Q4_K) return (i64)(K / 256) * 128;  // K-quants: the quants only (kquant_layout.py)
    if (QT == QT_Q5_K) return (i64)(K / 256) * 160;
    if (QT == QT_Q6_K) return (i64)(K / 256) * 192 + 16 * (i64)((K / 256 + 7) / 8);
    if (QT == QT_Q4_1 || QT == QT_Q5_0) return (i64)(K / 32) * 20;  // Q32 formats: see q32_block
    if (QT == QT_Q5_1) return (i64)(K / 32) * 24;
    if (QT == QT_IQ4_NL) return K / 2;
    if (QT == QT_IQ4_XS) return (i64)(K / 256) * 136;
    return 0;  // no other format
}

// Keeps x in a register from where it is called: an empty asm the compiler cannot see through, so ptxas
// cannot work the value out again at each use. (In gemm_batch's stage loop it recomputed the lanes' row
// pointers and activation positions every stage, about 40 instructions a stage.)
__device__ __forceinline__ void keep_reg(int& x) { asm("" : "+r"(x)); }
template <class T>
__device__ __forceinline__ void keep_reg(const T*& p) { asm("" : "+l"(p)); }

// ---- K-quants (Q4_K, Q5_K, Q6_K) --------------------------------------------------------------------
// Device layout (kernels/kquant_layout.py is its specification, made by ops.upload_weight): per row,
// `wq` holds the quants only, each 32-value block's nibbles as 16 aligned bytes (byte i: value i in the
// low nibble, value 16 + i in the high one), Q5_K / Q6_K with the block's high bits after the super-
// block's nibbles (Q5_K: a u32 per block, Q6_K: two), Q6_K in groups of 8 super-blocks behind a
// 16-byte header of their fp16 d. `wd` holds one u16 per block: Q4_K / Q5_K the 6-bit scale (bits 0-5)
// and min (6-11) and a nibble of the super-block's d or dmin (12-15, see kq_dd); Q6_K the block's two
// int8 scales (values 0..15, 16..31). The bytes are the file's (Q6_K: plus padding of a tail group).
__host__ __device__ constexpr bool kq_format(int qt) { return qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q6_K; }

#define KQ6_GROUP_BYTES (16 + 8 * 192)  // Q6_K: 8 super-blocks and their header

// The 16 nibble bytes of block b (values 32b..32b+31) of a row.
template <int QT> __device__ __forceinline__ const u8* kq_quants(const u8* wrow, int b) {
    if (QT == QT_Q4_K) return wrow + 16 * (i64)b;
    if (QT == QT_Q5_K) return wrow + 160 * (i64)(b >> 3) + 16 * (b & 7);
    return wrow + (i64)(b >> 6) * KQ6_GROUP_BYTES + 16 + 192 * ((b >> 3) & 7) + 16 * (b & 7);  // Q6_K
}

// Block b's high bits: Q5_K one u32 (4-aligned), Q6_K two (8-aligned).
template <int QT> __device__ __forceinline__ const u8* kq_high(const u8* wrow, int b) {
    if (QT == QT_Q5_K) return wrow + 160 * (i64)(b >> 3) + 128 + 4 * (b & 7);
    return wrow + (i64)(b >> 6) * KQ6_GROUP_BYTES + 16 + 192 * ((b >> 3) & 7) + 128 + 8 * (b & 7);
}

// Q6_K: the fp16 d of block b's super-block.
__device__ __forceinline__ u16 kq6_d(const u8* wrow, int b) {
    return *(const u16*)(wrow + (i64)(b >> 6) * KQ6_GROUP_BYTES + 2 * ((b >> 3) & 7));
}

// Q4_K / Q5_K: d | dmin << 16 (fp16 bits) from the super-block's 8 wd entries as 4 words (entries 2i,
// 2i + 1 in word i). Entries 2, 0, 3, 1 hold d's bits 0-3, 4-7, 8-11, 12-15 in their top nibbles
// (entries 6, 4, 7, 5 dmin's), so one bit-select puts d's low byte in byte 1 and its high byte in
// byte 3, and one byte permute gathers both halves.
__device__ __forceinline__ u32 kq_dd(u32 w0, u32 w1, u32 w2, u32 w3) {
    u32 xd = (w0 & 0xF0F0F0F0u) | ((w1 >> 4) & 0x0F0F0F0Fu);
    u32 xm = (w2 & 0xF0F0F0F0u) | ((w3 >> 4) & 0x0F0F0F0Fu);
    return __byte_perm(xd, xm, 0x7531);
}

// Where block j's (j = b & 7) nibble of dd goes: d bits (4, 12, 0, 8) for j = 0..3, dmin's (+16) for 4..7.
__device__ __forceinline__ int kq_dd_shift(int j) { return ((0x80C4 >> (4 * (j & 3))) & 15) + 4 * (j & 4); }

// Exact int -> float of 0 <= x < 2^23 without the quarter-rate I2F: x under the exponent of 2^23.
__device__ __forceinline__ float u23_to_f(u32 x) { return __fsub_rn(__int_as_float(0x4B000000u | x), 8388608.0f); }
// The signed byte in bits 0-7 of x, exactly, the same way.
__device__ __forceinline__ float s8_to_f(u32 x) {
    return __fsub_rn(__int_as_float(0x4B000000u | ((x ^ 0x80u) & 0xFFu)), 8388736.0f);
}

// Q4_K / Q5_K scale and offset of a block from its wd entry e and dd: x = dl * q + m, m = -(dmin * min),
// both products rounded as the file format's fp32 dequantization rounds them.
__device__ __forceinline__ void kq_affine(u32 e, u32 dd, float& dl, float& m) {
    dl = __fmul_rn(h2f((u16)(dd & 0xFFFFu)), u23_to_f(e & 63u));
    m = -__fmul_rn(h2f((u16)(dd >> 16)), u23_to_f((e >> 6) & 63u));
}

// Q6_K q - 32 from a 6-bit q in each byte, as signed bytes without borrows: bit 5 set -> clear it;
// clear -> add 0xE0.
__device__ __forceinline__ u32 kq6_signed(u32 q) { return (q ^ 0x20202020u) | (((~q) & 0x20202020u) * 6u); }

// Word k (0..3) of a block's nibble bytes and its high-bit words -> lo = values 4k..4k+3, hi = values
// 16+4k..16+4k+3, one per byte (Q4_K/Q5_K unsigned, Q6_K q - 32 signed). k must be a constant.
template <int QT>
__device__ __forceinline__ void kq_expand(u32 v, u32 h0, u32 h1, int k, int& lo, int& hi) {
    u32 l = v & 0x0F0F0F0Fu, h = (v >> 4) & 0x0F0F0F0Fu;
    if (QT == QT_Q5_K) {
        l |= (h0 << (4 - k)) & 0x10101010u;
        h |= (h0 >> k) & 0x10101010u;
    } else if (QT == QT_Q6_K) {
        l = kq6_signed(l | ((k < 3 ? h0 << (4 - 2 * k) : h0 >> 2) & 0x30303030u));
        h = kq6_signed(h | ((k < 3 ? h1 << (4 - 2 * k) : h1 >> 2) & 0x30303030u));
    }
    lo = (int)l;
    hi = (int)h;
}

// Block b of a K-quant row as the warp-cooperative kernels hold it between load and use (gemv_kq,
// gemv_kq_mt, gemm_batch): its 16 nibble bytes, its wd entry (Q6_K: | the super-block's fp16 d << 16)
// and its high-bit words (Q5_K h0, Q6_K h0 and h1; 0 otherwise). kq_load_raw leaves zeros (all of
// whose terms are 0) where the caller passes ok = false.
struct KqRaw {
    uint4 v;
    u32 e, h0, h1;
};

template <int QT>
__device__ __forceinline__ void kq_load_raw(const u8* wrow, const u16* wdrow, int b, bool ok, KqRaw& r) {
    r.v = make_uint4(0u, 0u, 0u, 0u);
    r.e = r.h0 = r.h1 = 0u;
    if (ok) {
        r.v = *(const uint4*)kq_quants<QT>(wrow, b);
        r.e = wdrow[b];
        if (QT == QT_Q5_K) r.h0 = *(const u32*)kq_high<QT>(wrow, b);
        if (QT == QT_Q6_K) {
            uint2 h = *(const uint2*)kq_high<QT>(wrow, b);
            r.h0 = h.x;
            r.h1 = h.y;
            r.e |= (u32)kq6_d(wrow, b) << 16;  // the two scales below d
        }
    }
}

// Its scales (value = dlo * q + m for values 0..15, dhi * q + m for 16..31). Q4_K / Q5_K: d and dmin
// are gathered from the top nibbles of the super-block's 8 wd entries, held by 8 lanes with
// lane & 7 == b & 7 (ddsh = kq_dd_shift(lane & 7)), by three xor-shuffles: every lane of the warp calls
// it, uniformly.
template <int QT>
__device__ __forceinline__ void kq_raw_scales(const KqRaw& r, int ddsh, float& dlo, float& dhi, float& m) {
    if (QT == QT_Q6_K) {
        float d = h2f((u16)(r.e >> 16));
        dlo = __fmul_rn(d, s8_to_f(r.e));
        dhi = __fmul_rn(d, s8_to_f(r.e >> 8));
        m = 0.0f;
    } else {
        u32 dd = ((r.e >> 12) & 15u) << ddsh;
        dd |= __shfl_xor_sync(0xffffffffu, dd, 1);
        dd |= __shfl_xor_sync(0xffffffffu, dd, 2);
        dd |= __shfl_xor_sync(0xffffffffu, dd, 4);
        kq_affine(r.e, dd, dlo, m);
        dhi = dlo;
    }
}

// Block b of a K-quant row, self-contained (one thread): q[i] holds values 4i..4i+3 as bytes (value
// = dlo * q + m for 0..15, dhi * q + m for 16..31). Loads: 16 nibble bytes, the high bits (Q5_K 4,
// Q6_K 8 bytes), the wd entry and, Q4_K/Q5_K, the super-block's 16 wd bytes for dd (a broadcast among
// the threads of one super-block), Q6_K its d.
template <int QT>
__device__ __forceinline__ void kq_load(const u8* wrow, const u16* wdrow, int b, int* q, float& dlo,
                                        float& dhi, float& m) {
    uint4 v = *(const uint4*)kq_quants<QT>(wrow, b);
    u32 h0 = 0u, h1 = 0u;
    if (QT == QT_Q5_K) h0 = *(const u32*)kq_high<QT>(wrow, b);
    if (QT == QT_Q6_K) {
        uint2 h = *(const uint2*)kq_high<QT>(wrow, b);
        h0 = h.x;
        h1 = h.y;
    }
    u32 e = wdrow[b];
    if (QT == QT_Q6_K) {
        float d = h2f(kq6_d(wrow, b));
        dlo = __fmul_rn(d, s8_to_f(e));
        dhi = __fmul_rn(d, s8_to_f(e >> 8));
        m = 0.0f;
    } else {
        uint4 w = *(const uint4*)(wdrow + (b & ~7));
        kq_affine(e, kq_dd(w.x, w.y, w.z, w.w), dlo, m);
        dhi = dlo;
    }
    u32 vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) kq_expand<QT>(vv[k], h0, h1, k, q[k], q[4 + k]);
}

// ---- Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS ("Q32" formats: one scale per 32 values) ----------------------
// Device layouts (kernels/ops.py upload_weight): Q4_1 (20 B) and Q5_1 (24 B) keep their GGUF blocks,
// 4- and 8-byte aligned. Q5_0 is split at upload as Q4_0 is: the fp16 scales go to `wd`, `wq` keeps
// [qh u32][qs 16 B] per block (20 B, 4-byte aligned). IQ4_NL is split exactly as Q4_0 (`wq`: 16 B of
// codes per block, `wd`: d). IQ4_XS keeps its 136-byte GGUF super-blocks (8-byte aligned); its 32-value
// sub-block b & 7 of super-block b >> 3 is "block b" here.
__host__ __device__ constexpr bool q32_format(int qt) {
    return qt == QT_Q4_1 || qt == QT_Q5_0 || qt == QT_Q5_1 || qt == QT_IQ4_NL || qt == QT_IQ4_XS;
}

// The formats whose weight blocks carry an offset (gemv.cu WBlock.m, added times the activation block
// sum xs). The one list of them: a kernel that skips the offset term for other formats asks this.
__host__ __device__ constexpr bool qt_has_offset(int qt) {
    return qt == QT_Q4_0 || qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q4_1 || qt == QT_Q5_1;
}

// The 16 IQ4 levels (-127 ... 113) as signed bytes, four per word: IQ4_Wn holds levels 4n..4n+3.
#define IQ4_W0 0xbfad9881u
#define IQ4_W1 0xf6eaddcfu
#define IQ4_W2 0x26190d01u
#define IQ4_W3 0x71594535u

// Four 4-bit codes (nibble k of the low 16 bits of s) -> their levels (byte k). Two byte permutes look
// the codes' low 3 bits up in levels 0..7 and 8..15; a third takes byte k from the second when bit 3
// of code k is set (selector k + 4). Selector nibbles stay below 8, so PRMT's sign mode is never used.
__device__ __forceinline__ u32 iq4_lookup4(u32 s) {
    u32 sel = s & 0x7777u;
    u32 lo = __byte_perm(IQ4_W0, IQ4_W1, sel);
    u32 hi = __byte_perm(IQ4_W2, IQ4_W3, sel);
    return __byte_perm(lo, hi, 0x3210u | ((s & 0x8888u) >> 1));
}

// One word of 4 code bytes (low nibble: value j, high nibble: value j + 16) -> the levels of the low
// nibbles (`lo`, byte k = value of byte k's low nibble) and of the high nibbles (`hi`).
__device__ __forceinline__ void iq4_levels(u32 v, int& lo, int& hi) {
    u32 a = iq4_lookup4(v);        // levels of lo0, hi0, lo1, hi1
    u32 b = iq4_lookup4(v >> 16);  // levels of lo2, hi2, lo3, hi3
    lo = (int)__byte_perm(a, b, 0x6420u);
    hi = (int)__byte_perm(a, b, 0x7531u);
}

// Bits 0..3 of x -> bit 0 of bytes 0..3 (the four shifted copies of x do not overlap, so no carries).
__device__ __forceinline__ u32 spread4(u32 x) { return ((x & 15u) * 0x00204081u) & 0x01010101u; }

// Block b of a Q32 format as bytes: value 4i + k in byte k of q[i]; x = d * q + m. The bytes are
// unsigned 0..31 for Q4_1 / Q5_1 (m = the block's offset), signed for Q5_0 (q - 16, m = 0) and the
// IQ4 formats (levels, m = 0). IQ4_XS: d = d_super * (ls - 32) (exact in fp32: 11 x 6 bits).
struct Q32Block {
    int q[8];
    float d, m;
};

template <int QT>
__device__ __forceinline__ void q32_block(const u8* wrow, const u16* wdrow, int b, Q32Block& r) {
    u32 qs[4], qh = 0u;
    r.m = 0.0f;
    if (QT == QT_Q4_1) {
        const u32* p = (const u32*)(wrow + (i64)b * 20);
        u32 dm = p[0];
        r.d = h2f((u16)(dm & 0xffffu));
        r.m = h2f((u16)(dm >> 16));
        qs[0] = p[1]; qs[1] = p[2]; qs[2] = p[3]; qs[3] = p[4];
    } else if (QT == QT_Q5_0) {
        const u32* p = (const u32*)(wrow + (i64)b * 20);
        qh = p[0];
        qs[0] = p[1]; qs[1] = p[2]; qs[2] = p[3]; qs[3] = p[4];
        r.d = h2f(wdrow[b]);
    } else if (QT == QT_Q5_1) {
        const uint2* p = (const uint2*)(wrow + (i64)b * 24);
        uint2 a = p[0], c = p[1], e = p[2];
        r.d = h2f((u16)(a.x & 0xffffu));
        r.m = h2f((u16)(a.x >> 16));
        qh = a.y;
        qs[0] = c.x; qs[1] = c.y; qs[2] = e.x; qs[3] = e.y;
    } else if (QT == QT_IQ4_NL) {
        uint4 v = ((const uint4*)wrow)[b];
        qs[0] = v.x; qs[1] = v.y; qs[2] = v.z; qs[3] = v.w;
        r.d = h2f(wdrow[b]);
    } else {  // IQ4_XS
        const u8* p = wrow + (i64)(b >> 3) * 136;
        int ib = b & 7;
        u32 sh = *(const u16*)(p + 2);
        u32 sl = p[4 + (ib >> 1)];
        int ls = (int)(((sl >> (4 * (ib & 1))) & 15u) | (((sh >> (2 * ib)) & 3u) << 4));
        r.d = h2f(*(const u16*)p) * (float)(ls - 32);
        const uint2* q = (const uint2*)(p + 8 + 16 * ib);
        uint2 a = q[0], c = q[1];
        qs[0] = a.x; qs[1] = a.y; qs[2] = c.x; qs[3] = c.y;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (QT == QT_IQ4_NL || QT == QT_IQ4_XS) {
            iq4_levels(qs[i], r.q[i], r.q[4 + i]);
        } else {
            u32 lo = qs[i] & 0x0f0f0f0fu, hi = (qs[i] >> 4) & 0x0f0f0f0fu;
            if (QT == QT_Q5_0) {  // q - 16 as a signed byte: the nibble, with 0xF0 where bit 4 is clear
                lo |= spread4(~qh >> (4 * i)) * 0xF0u;
                hi |= spread4(~qh >> (16 + 4 * i)) * 0xF0u;
            } else if (QT == QT_Q5_1) {
                lo |= spread4(qh >> (4 * i)) << 4;
                hi |= spread4(qh >> (16 + 4 * i)) << 4;
            }
            r.q[i] = (int)lo;
            r.q[4 + i] = (int)hi;
        }
    }
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
    } else if (q32_format(QT)) {
        Q32Block k;
        q32_block<QT>(wrow, wdrow, b, k);
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) out[4 * i + j] = fmaf(k.d, (float)(i8)((k.q[i] >> (8 * j)) & 0xff), k.m);
    } else if (kq_format(QT)) {  // Q4_K, Q5_K, Q6_K: products rounded as engine/quants.py rounds them
        int q[8];
        float dlo, dhi, m;
        kq_load<QT>(wrow, wdrow, b, q, dlo, dhi, m);
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float p = __fmul_rn(i < 4 ? dlo : dhi, s8_to_f((u32)q[i] >> (8 * j)));
                out[4 * i + j] = (QT == QT_Q6_K) ? p : __fadd_rn(p, m);
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
