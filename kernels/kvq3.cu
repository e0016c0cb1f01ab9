// q3 KV cache kernels: quantize-on-append and rotated-space decode attention.
// The format and its NumPy specification are engine/kvquant.py (read its docstring first):
//   row x (D values, after RoPE) -> y = H_D diag(s) x (normalized Walsh-Hadamard, fixed +-1 signs),
//   32-value blocks, scale = least-squares fit after nearest-level coding against the block RMS,
//   stored fp16; codes 0..7 into the 8-level Lloyd-Max codebook of N(0,1), 8 codes per 3 bytes
//   (code i of a group at bits 3i..3i+2 of the little-endian 24-bit word).
// Cache layout: codes (capacity, n_kv, 3D/8) u8, scales (capacity, n_kv, D/32) fp16 bits (u16).
//
// kvq3_quantize<D>: one block of D threads per (token, KV head) row; writes rows start..start+T-1.
//   start_ptr (CUDA-graph decode): a device int32 that replaces `start`.
// kvq3_dequant<D>: rows [0, kv_len) back to fp32 in the model's space (for the fp32 attention kernels).
// kvq3_rotate<D> / kvq3_unrotate<D>: y = H diag(s) x / x = diag(s) H y, one block of D threads per row.
// kvq3_decode<D>: one query token, one block per query head; q must already be rotated (kvq3_rotate)
//   and the output is in the rotated space (kvq3_unrotate it): q.k = (Rq).(Rk) and
//   sum p v = R^T sum p (R v), so keys and values are only dequantized, never inverse-rotated.
//   Softmax in fp32 with a running max and sum.
//
// Used by CupyQ3KVCache (engine/backends/cupy_backend.py): kvq3_quantize on append, kvq3_dequant into
// an fp32 scratch that the fp32 attention kernels read; kvq3_flash_decode (end of file) for T = 1 when
// MINECART_Q3_DECODE=rotated. kvq3_decode (no context split) is a test reference only.
// tests/gpu/test_kvq3.py compares every kernel with engine/kvquant.py;
// tests/kernels/test_kvq3_emulation.py checks a NumPy emulation of this file's loops on the CPU.
// No tensor-core instructions: fp32 FMA and shuffles only.

#define KVQ3_BLOCK 32
#define KVQ3_TILE 32

__device__ __constant__ float KVQ3_LEVELS[8] = {
    -2.151945705e+00f, -1.343909279e+00f, -7.560052812e-01f, -2.450941789e-01f,
    2.450941789e-01f, 7.560052812e-01f, 1.343909279e+00f, 2.151945705e+00f};
__device__ __constant__ float KVQ3_THRESHOLDS[7] = {
    -1.747927492e+00f, -1.049957280e+00f, -5.005497301e-01f, 0.000000000e+00f,
    5.005497301e-01f, 1.049957280e+00f, 1.747927492e+00f};

// +-1 per dimension: bit 31 of a murmur3-style finalizer of (i + 1), as kvquant.rotation_signs.
__device__ __forceinline__ float kvq3_sign(u32 i) {
    u32 h = (i + 1u) * 0x9E3779B1u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    return (h >> 31) ? -1.0f : 1.0f;
}

__device__ __forceinline__ u16 f2h_rn(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// In-place normalized Walsh-Hadamard transform of x[0..D) in shared memory; every thread of the
// D-thread block calls it.
template <int D>
__device__ __forceinline__ void kvq3_fwht(float* x) {
    int tid = threadIdx.x;
    __syncthreads();
#pragma unroll
    for (int h = 1; h < D; h <<= 1) {
        if (tid < D / 2) {
            int i = (tid / h) * 2 * h + (tid % h);
            float a = x[i], b = x[i + h];
            x[i] = a + b;
            x[i + h] = a - b;
        }
        __syncthreads();
    }
    x[tid] *= 1.0f / sqrtf((float)D);  // IEEE sqrt and division (NVRTC defaults), not rsqrtf
    __syncthreads();
}

// Code c of a packed row: group c/8 is 3 bytes, code c%8 at bits 3(c%8)..
__device__ __forceinline__ int kvq3_code(const u8* row, int c) {
    const u8* g = row + 3 * (c >> 3);
    u32 w = (u32)g[0] | ((u32)g[1] << 8) | ((u32)g[2] << 16);
    return (int)((w >> (3 * (c & 7))) & 7u);
}

template <int D>
__global__ void __launch_bounds__(D) kvq3_quantize(
        const float* __restrict__ x, u8* __restrict__ codes, u16* __restrict__ scales,
        int T, int n_kv, int start, const int* __restrict__ start_ptr) {
    __shared__ float y[D];
    __shared__ u8 cs[D];
    int row = blockIdx.x;  // t * n_kv + head, within the T new tokens
    int tid = threadIdx.x, lane = tid & 31;
    if (start_ptr != nullptr) start = *start_ptr;  // CUDA-graph decode: the cache length lives on the device
    y[tid] = x[(i64)row * D + tid] * kvq3_sign((u32)tid);
    kvq3_fwht<D>(y);
    // warp w holds scale block w (coordinates 32w..32w+31)
    float v = y[tid];
    float rms = sqrtf(warp_sum(v * v) * (1.0f / KVQ3_BLOCK));
    float t = v / (rms > 0.0f ? rms : 1.0f);
    int code = 0;
#pragma unroll
    for (int i = 0; i < 7; i++) code += (t > KVQ3_THRESHOLDS[i]) ? 1 : 0;  // ties go down, as searchsorted
    float c = KVQ3_LEVELS[code];
    float num = warp_sum(v * c), den = warp_sum(c * c);
    i64 dst = (i64)start * n_kv + row;  // destination row in the cache
    if (lane == 0) scales[dst * (D / KVQ3_BLOCK) + (tid >> 5)] = f2h_rn(fminf(num / den, 65504.0f));
    cs[tid] = (u8)code;
    __syncthreads();
    if (tid < D / 8) {
        u32 w = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) w |= ((u32)cs[8 * tid + j]) << (3 * j);
        u8* out = codes + dst * (3 * D / 8) + 3 * tid;
        out[0] = (u8)(w & 0xFFu);
        out[1] = (u8)((w >> 8) & 0xFFu);
        out[2] = (u8)((w >> 16) & 0xFFu);
    }
}

template <int D>
__global__ void __launch_bounds__(D) kvq3_rotate(const float* __restrict__ x, float* __restrict__ y) {
    __shared__ float s[D];
    int tid = threadIdx.x;
    i64 off = (i64)blockIdx.x * D;
    s[tid] = x[off + tid] * kvq3_sign((u32)tid);
    kvq3_fwht<D>(s);
    y[off + tid] = s[tid];
}

template <int D>
__global__ void __launch_bounds__(D) kvq3_unrotate(const float* __restrict__ y, float* __restrict__ x) {
    __shared__ float s[D];
    int tid = threadIdx.x;
    i64 off = (i64)blockIdx.x * D;
    s[tid] = y[off + tid];
    kvq3_fwht<D>(s);
    x[off + tid] = s[tid] * kvq3_sign((u32)tid);
}

// Rows [0, kv_len) of a q3 cache back to the model's space: out (rows, n_kv, D) float32 =
// diag(s) H (LEVELS[code] * scale), one block of D threads per (row, KV head); the grid covers
// `rows` cache rows and blocks at or past kv_len return at once. len_ptr (CUDA-graph decode): a device
// int32 holding the length before this step's append, so kv_len = *len_ptr + 1.
template <int D>
__global__ void __launch_bounds__(D) kvq3_dequant(
        const u8* __restrict__ codes, const u16* __restrict__ scales, float* __restrict__ out,
        int n_kv, int kv_len, const int* __restrict__ len_ptr) {
    __shared__ float s[D];
    if (len_ptr != nullptr) kv_len = *len_ptr + 1;
    i64 row = blockIdx.x;  // cache row * n_kv + head
    if (row >= (i64)kv_len * n_kv) return;  // whole block leaves before any barrier
    int tid = threadIdx.x;
    const u8* crow = codes + row * (3 * D / 8);
    s[tid] = KVQ3_LEVELS[kvq3_code(crow, tid)] * h2f(scales[row * (D / KVQ3_BLOCK) + (tid >> 5)]);
    kvq3_fwht<D>(s);
    out[row * D + tid] = s[tid] * kvq3_sign((u32)tid);
}

// Dequantized (still rotated) row r of a cache into dst[0..D), by the threads of a 128-thread block.
template <int D>
__device__ __forceinline__ void kvq3_load_row(float* dst, const u8* codes, const u16* scales, i64 r,
                                              int n_kv, int kvh) {
    const u8* crow = codes + ((r * n_kv) + kvh) * (3 * D / 8);
    const u16* srow = scales + ((r * n_kv) + kvh) * (D / KVQ3_BLOCK);
    for (int c = threadIdx.x; c < D; c += 128) dst[c] = KVQ3_LEVELS[kvq3_code(crow, c)] * h2f(srow[c / KVQ3_BLOCK]);
}

template <int D>
__global__ void __launch_bounds__(128) kvq3_decode(
        const float* __restrict__ q_rot, const u8* __restrict__ k_codes, const u16* __restrict__ k_scales,
        const u8* __restrict__ v_codes, const u16* __restrict__ v_scales, float* __restrict__ out_rot,
        int nh, int n_kv, int kv_len, float scale, int window) {
    __shared__ float qs[D];
    __shared__ float R[KVQ3_TILE][D + 1];
    __shared__ float P[KVQ3_TILE];
    __shared__ float s_alpha;
    int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    int h = blockIdx.x, kvh = h / (nh / n_kv);
    for (int c = tid; c < D; c += 128) qs[c] = q_rot[(i64)h * D + c];
    int p = kv_len - 1;  // the query's position: the last cached row
    int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int NU = (D + 127) / 128;
    float o[NU];
#pragma unroll
    for (int u = 0; u < NU; u++) o[u] = 0.0f;
    float m_run = NEG_BIG, l_run = 0.0f;  // meaningful in warp 0
    __syncthreads();
    for (int kt = lo; kt < kv_len; kt += KVQ3_TILE) {
        for (int r = 0; r < KVQ3_TILE; r++) {
            if (kt + r < kv_len) kvq3_load_row<D>(R[r], k_codes, k_scales, kt + r, n_kv, kvh);
        }
        __syncthreads();
        if (w == 0) {
            bool valid = kt + lane < kv_len;
            float s = 0.0f;
            if (valid) {
                for (int c = 0; c < D; c++) s = fmaf(qs[c], R[lane][c], s);
            }
            s *= scale;
            float m_new = fmaxf(m_run, warp_max(valid ? s : NEG_BIG));
            float alpha = __expf(m_run - m_new);
            float pv = valid ? __expf(s - m_new) : 0.0f;
            l_run = l_run * alpha + warp_sum(pv);
            m_run = m_new;
            P[lane] = pv;
            if (lane == 0) s_alpha = alpha;
        }
        __syncthreads();
        for (int r = 0; r < KVQ3_TILE; r++) {
            if (kt + r < kv_len) kvq3_load_row<D>(R[r], v_codes, v_scales, kt + r, n_kv, kvh);
        }
        __syncthreads();
        float alpha = s_alpha;
#pragma unroll
        for (int u = 0; u < NU; u++) {
            int c = tid + 128 * u;
            if (c < D) {
                float acc = o[u] * alpha;
                for (int r = 0; r < KVQ3_TILE && kt + r < kv_len; r++) acc = fmaf(P[r], R[r][c], acc);
                o[u] = acc;
            }
        }
        __syncthreads();
    }
    if (w == 0 && lane == 0) s_alpha = 1.0f / l_run;  // reuse: the normalizer, broadcast
    __syncthreads();
    float inv_l = s_alpha;
#pragma unroll
    for (int u = 0; u < NU; u++) {
        int c = tid + 128 * u;
        if (c < D) out_rot[(i64)h * D + c] = o[u] * inv_l;
    }
}

// Rows [kt, hi) of a q3 cache, dequantized but still rotated, into a KVQ3_TILE x (D+1) shared tile
// (rows past hi are zero): one 3-byte group (8 codes, one scale) per thread and step.
template <int D>
__device__ __forceinline__ void kvq3_load_tile(float* KV, const u8* __restrict__ codes,
                                               const u16* __restrict__ scales, int kt, int hi, int n_kv,
                                               int kvh) {
    for (int i = threadIdx.x; i < KVQ3_TILE * (D / 8); i += blockDim.x) {
        int r = i / (D / 8), g = i % (D / 8);
        float* dst = KV + r * (D + 1) + 8 * g;
        if (kt + r < hi) {
            i64 row = (i64)(kt + r) * n_kv + kvh;
            const u8* b = codes + row * (3 * D / 8) + 3 * g;
            u32 w = (u32)b[0] | ((u32)b[1] << 8) | ((u32)b[2] << 16);
            float s = h2f(scales[row * (D / KVQ3_BLOCK) + (8 * g) / KVQ3_BLOCK]);
#pragma unroll
            for (int j = 0; j < 8; j++) dst[j] = KVQ3_LEVELS[(w >> (3 * j)) & 7u] * s;
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) dst[j] = 0.0f;
        }
    }
}

#define KVQ3_G 8

// kvq3_flash_decode<D>: flash_decode (attention.cu) over a q3 cache, in the rotated space. One block
// per (KV head, context split) handles the G = nh / n_kv <= 8 query heads of that KV head over cache
// rows [split * split_len, min(kv_len, that + split_len)) (and inside the window); writes the split's
// unnormalized rotated output po (n_splits, nh, D), running max pm and sum pl (n_splits, nh) for
// attention.cu's flash_merge. q_rot: the query already rotated (kvq3_rotate); the merged output is
// rotated too (kvq3_unrotate it). kv_len_ptr (CUDA-graph decode): device int32, kv_len = *ptr + 1.
template <int D>
__global__ void __launch_bounds__(128) kvq3_flash_decode(
        const float* __restrict__ q_rot, const u8* __restrict__ k_codes, const u16* __restrict__ k_scales,
        const u8* __restrict__ v_codes, const u16* __restrict__ v_scales,
        float* __restrict__ po, float* __restrict__ pm, float* __restrict__ pl,
        int nh, int n_kv, int kv_len, const int* __restrict__ kv_len_ptr, int split_len, float scale,
        int window) {
    if (kv_len_ptr != nullptr) kv_len = *kv_len_ptr + 1;
    __shared__ float qs[KVQ3_G][D];
    __shared__ float KV[KVQ3_TILE * (D + 1)];
    __shared__ float P[KVQ3_G][KVQ3_TILE];
    __shared__ float s_alpha[KVQ3_G];
    int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    int kvh = blockIdx.x, split = blockIdx.y;
    int G = nh / n_kv;
    int h0 = kvh * G;
    for (int i = tid; i < G * D; i += 128) qs[i / D][i % D] = q_rot[(i64)h0 * D + i];
    int p = kv_len - 1;
    int lo = split * split_len, hi = min(kv_len, lo + split_len);
    if (window > 0) lo = max(lo, p - window + 1);
    const int NU = (D + 127) / 128;
    float o[KVQ3_G][NU];
#pragma unroll
    for (int g = 0; g < KVQ3_G; g++)
#pragma unroll
        for (int u = 0; u < NU; u++) o[g][u] = 0.0f;
    float m_run[2] = {NEG_BIG, NEG_BIG}, l_run[2] = {0.0f, 0.0f};  // query heads w and w + 4
    __syncthreads();
    for (int kt = lo; kt < hi; kt += KVQ3_TILE) {
        kvq3_load_tile<D>(KV, k_codes, k_scales, kt, hi, n_kv, kvh);
        __syncthreads();
        bool valid = kt + lane < hi;
#pragma unroll
        for (int a = 0; a < 2; a++) {
            int g = w + 4 * a;
            if (g < G) {
                float s = 0.0f;
#pragma unroll 8
                for (int c = 0; c < D; c++) s = fmaf(qs[g][c], KV[lane * (D + 1) + c], s);
                s *= scale;
                float m_new = fmaxf(m_run[a], warp_max(valid ? s : NEG_BIG));
                float alpha = __expf(m_run[a] - m_new);
                float pv = valid ? __expf(s - m_new) : 0.0f;
                l_run[a] = l_run[a] * alpha + warp_sum(pv);
                m_run[a] = m_new;
                P[g][lane] = pv;
                if (lane == 0) s_alpha[g] = alpha;
            }
        }
        __syncthreads();
        kvq3_load_tile<D>(KV, v_codes, v_scales, kt, hi, n_kv, kvh);
        __syncthreads();
        decode_pv_tile<D, NU, KVQ3_G, KVQ3_TILE>(o, P, s_alpha, KV, G, tid);
        __syncthreads();
    }
    decode_store_partials<D, NU, KVQ3_G>(o, m_run, l_run, po, pm, pl, (i64)split * nh + h0, G, tid, w, lane);
}
