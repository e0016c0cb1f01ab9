// q3 KV cache kernels: quantize-on-append and attention read straight from the codes (decode and prefill).
// The format and its NumPy specification are engine/kvquant.py (read its docstring first):
//   row x (D values, after RoPE) -> y = H_D diag(s) x (normalized Walsh-Hadamard, fixed +-1 signs),
//   64-value blocks, scale = least-squares fit after nearest-level coding against the block RMS,
//   stored fp16; K: 3-bit codes into the 8-level Lloyd-Max codebook of N(0,1), V: 2-bit codes into the
//   4-level one. A group of 8 codes is BITS bytes, code j at bits BITS*j.. of the little-endian word
//   (3-bit: 3 bytes per 8 codes; 2-bit: a byte per 4 codes).
// Cache layout: codes (capacity, n_kv, BITS*D/8) u8, scales (capacity, n_kv, D/64) fp16 bits (u16).
//
// kvq3_quantize<D, BITS>: one block of D threads per (token, KV head) row; writes rows start..start+T-1.
//   start_ptr (CUDA-graph decode): a device int32 that replaces `start`. ref (keys; nullptr for values):
//   the cache's reference row per KV head (n_kv, D), subtracted in fp32 before the rotation (keys are
//   stored centred; attention needs no correction, softmax ignores the per-query shift q . ref).
// kvq3_rotate<D> / kvq3_unrotate<D>: y = H diag(s) x / x = diag(s) H y, one block of D threads per row.
// Attention works in the rotated space: q.k = (Rq).(Rk) and sum p v = R^T sum p (R v), so the caller
// rotates q once (kvq3_rotate), the kernels score against dequantized-but-rotated keys and accumulate
// rotated values, and the caller inverse-rotates the output rows (kvq3_unrotate). No fp32 copy of the
// cache exists: tiles of codes are dequantized into shared memory inside the attention kernels.
// kvq3_flash_decode<D>: one query token, a block per (KV head, context split) serving the G <= 8 query
//   heads of that KV head (K and V read once), fp32 partials merged by attention.cu's flash_merge.
// kvq3_prefill<D>: T query tokens at positions start.., a block per (32 queries, query head), key
//   tiles of 32 (the structure of attention.cu's flash_prefill, loads replaced by code dequantization).
//
// Used by CupyQ3KVCache / CupyBackend._attention_q3 (engine/backends/cupy_backend.py) through
// kernels/kvq3.py. tests/gpu/test_kvq3.py compares every kernel with engine/kvquant.py;
// tests/kernels/test_kvq3_emulation.py checks a NumPy emulation of this file's loops on the CPU.
// No tensor-core instructions: fp32 FMA and shuffles only.

#define KVQ3_BLOCK 64
#define KVQ3_TILE 32

__device__ __constant__ float KVQ3_LEVELS3[8] = {
    -2.151945705e+00f, -1.343909279e+00f, -7.560052812e-01f, -2.450941789e-01f,
    2.450941789e-01f, 7.560052812e-01f, 1.343909279e+00f, 2.151945705e+00f};
__device__ __constant__ float KVQ3_THRESHOLDS3[7] = {
    -1.747927492e+00f, -1.049957280e+00f, -5.005497301e-01f, 0.000000000e+00f,
    5.005497301e-01f, 1.049957280e+00f, 1.747927492e+00f};
__device__ __constant__ float KVQ3_LEVELS2[4] = {
    -1.510417608e+00f, -4.527800346e-01f, 4.527800346e-01f, 1.510417608e+00f};
__device__ __constant__ float KVQ3_THRESHOLDS2[3] = {
    -9.815988215e-01f, 0.000000000e+00f, 9.815988215e-01f};

template <int BITS>
__device__ __forceinline__ float kvq3_level(u32 code) {
    return BITS == 3 ? KVQ3_LEVELS3[code] : KVQ3_LEVELS2[code];
}

// +-1 per dimension: bit 31 of a murmur3-style finalizer of (i + 1), as kvquant.rotation_signs.
__device__ __forceinline__ float kvq3_sign(u32 i) {
    u32 h = (i + 1u) * 0x9E3779B1u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    return (h >> 31) ? -1.0f : 1.0f;
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

// The little-endian word of group g (8 codes) of a packed row: BITS bytes.
template <int BITS>
__device__ __forceinline__ u32 kvq3_group(const u8* __restrict__ row, int g) {
    const u8* b = row + BITS * g;
    u32 w = (u32)b[0] | ((u32)b[1] << 8);
    if (BITS == 3) w |= (u32)b[2] << 16;
    return w;
}

// Quantize T rows of D values (x (T, n_kv, D) fp32, contiguous) into cache rows start.. of (codes, scales).
// Thread tid owns coordinate tid; scale block b (64 coordinates) is warps 2b and 2b+1, whose two warp
// sums meet in shared memory.
template <int D, int BITS>
__global__ void __launch_bounds__(D) kvq3_quantize(
        const float* __restrict__ x, u8* __restrict__ codes, u16* __restrict__ scales,
        int T, int n_kv, int start, const int* __restrict__ start_ptr, const float* __restrict__ ref) {
    pdl_entry();
    __shared__ float y[D];
    __shared__ u8 cs[D];
    __shared__ float red[D / 32], red2[D / 32];
    int row = blockIdx.x;  // t * n_kv + head, within the T new tokens
    int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    if (start_ptr != nullptr) start = *start_ptr;  // CUDA-graph decode: the cache length lives on the device
    float xv = x[(i64)row * D + tid];
    if (ref != nullptr) xv -= ref[(row % n_kv) * D + tid];
    y[tid] = xv * kvq3_sign((u32)tid);
    kvq3_fwht<D>(y);
    float v = y[tid];
    float ss = warp_sum(v * v);
    if (lane == 0) red[w] = ss;
    __syncthreads();
    float rms = sqrtf((red[w & ~1] + red[w | 1]) * (1.0f / KVQ3_BLOCK));
    float t = v / (rms > 0.0f ? rms : 1.0f);
    int code = 0;
    if (BITS == 3) {
#pragma unroll
        for (int i = 0; i < 7; i++) code += (t > KVQ3_THRESHOLDS3[i]) ? 1 : 0;  // ties go down, as searchsorted
    } else {
#pragma unroll
        for (int i = 0; i < 3; i++) code += (t > KVQ3_THRESHOLDS2[i]) ? 1 : 0;
    }
    float c = kvq3_level<BITS>((u32)code);
    float num = warp_sum(v * c), den = warp_sum(c * c);
    __syncthreads();  // every warp has read red[] for the RMS
    if (lane == 0) { red[w] = num; red2[w] = den; }
    cs[tid] = (u8)code;
    __syncthreads();
    i64 dst = (i64)start * n_kv + row;  // destination row in the cache
    if ((tid & 63) == 0) {
        int b0 = w & ~1;
        float n2 = red[b0] + red[b0 + 1], d2 = red2[b0] + red2[b0 + 1];
        scales[dst * (D / KVQ3_BLOCK) + (tid >> 6)] = f2h_rn(fminf(n2 / d2, 65504.0f));
    }
    if (tid < D / 8) {
        u32 word = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) word |= ((u32)cs[8 * tid + j]) << (BITS * j);
        u8* out = codes + dst * (BITS * D / 8) + BITS * tid;
#pragma unroll
        for (int b = 0; b < BITS; b++) out[b] = (u8)((word >> (8 * b)) & 0xFFu);
    }
}

template <int D>
__global__ void __launch_bounds__(D) kvq3_rotate(const float* __restrict__ x, float* __restrict__ y) {
    pdl_entry();
    __shared__ float s[D];
    int tid = threadIdx.x;
    i64 off = (i64)blockIdx.x * D;
    s[tid] = x[off + tid] * kvq3_sign((u32)tid);
    kvq3_fwht<D>(s);
    y[off + tid] = s[tid];
}

template <int D>
__global__ void __launch_bounds__(D) kvq3_unrotate(const float* __restrict__ y, float* __restrict__ x) {
    pdl_entry();
    __shared__ float s[D];
    int tid = threadIdx.x;
    i64 off = (i64)blockIdx.x * D;
    s[tid] = y[off + tid];
    kvq3_fwht<D>(s);
    x[off + tid] = s[tid] * kvq3_sign((u32)tid);
}

// Eight rotated values of group g of cache row `row` (row = cache row * n_kv + KV head) into dst[0..8):
// level[code] * scale in fp32, as kvquant.dequantize_rotated; zeros when !valid.
template <int D, int BITS>
__device__ __forceinline__ void kvq3_group8(float* dst, const u8* __restrict__ codes,
                                            const u16* __restrict__ scales, i64 row, int g, bool valid) {
    if (valid) {
        u32 w = kvq3_group<BITS>(codes + row * (BITS * D / 8), g);
        float s = h2f(scales[row * (D / KVQ3_BLOCK) + g / (KVQ3_BLOCK / 8)]);
#pragma unroll
        for (int j = 0; j < 8; j++) dst[j] = kvq3_level<BITS>((w >> (BITS * j)) & ((1u << BITS) - 1u)) * s;
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) dst[j] = 0.0f;
    }
}

// Rows [kt, hi) of one KV head, dequantized but still rotated, into a KVQ3_TILE x (D+1) shared tile
// (rows past hi are zero): one group (8 codes, one scale) per thread and step.
template <int D, int BITS>
__device__ __forceinline__ void kvq3_load_tile(float* KV, const u8* __restrict__ codes,
                                               const u16* __restrict__ scales, int kt, int hi, int n_kv,
                                               int kvh) {
    for (int i = threadIdx.x; i < KVQ3_TILE * (D / 8); i += blockDim.x) {
        int r = i / (D / 8), g = i % (D / 8);
        kvq3_group8<D, BITS>(KV + r * (D + 1) + 8 * g, codes, scales, (i64)(kt + r) * n_kv + kvh, g, kt + r < hi);
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
    pdl_entry();
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
        kvq3_load_tile<D, 3>(KV, k_codes, k_scales, kt, hi, n_kv, kvh);
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
        kvq3_load_tile<D, 2>(KV, v_codes, v_scales, kt, hi, n_kv, kvh);
        __syncthreads();
        decode_pv_tile<D, NU, KVQ3_G, KVQ3_TILE>(o, P, s_alpha, KV, G, tid);
        __syncthreads();
    }
    decode_store_partials<D, NU, KVQ3_G>(o, m_run, l_run, po, pm, pl, (i64)split * nh + h0, G, tid, w, lane);
}

#define KVQ3_BQ 32
#define KVQ3_PAD 36

// kvq3_prefill<D>: causal GQA attention of q_rot (T, nh, D) (rotated queries at positions start..) over
// q3 cache rows [0, kv_len), output out_rot (T, nh, D) rotated. A block of 128 threads per (32 queries,
// query head); key tiles of 32: scores from head-dim chunks of 32 (Q from global, K dequantized from
// its codes into shared memory), then the tile's V dequantized into shared memory and P @ V with each
// thread owning one query row and D/4 output columns. Softmax in fp32 with running max and sum.
template <int D>
__global__ void __launch_bounds__(128) kvq3_prefill(
        const float* __restrict__ q, const u8* __restrict__ k_codes, const u16* __restrict__ k_scales,
        const u8* __restrict__ v_codes, const u16* __restrict__ v_scales,
        float* __restrict__ out, int T, int nh, int n_kv, int start, int kv_len, float scale, int window) {
    pdl_entry();
    __shared__ __align__(16) float Qc[KVQ3_BQ][KVQ3_PAD];
    __shared__ __align__(16) float Kc[KVQ3_TILE][KVQ3_PAD];
    __shared__ __align__(16) float Vs[KVQ3_TILE][D];
    __shared__ float P[KVQ3_BQ][KVQ3_TILE + 1];
    __shared__ float s_alpha[KVQ3_BQ], s_l[KVQ3_BQ];

    int tid = threadIdx.x;
    int h = blockIdx.y, kvh = h / (nh / n_kv);
    int t0 = blockIdx.x * KVQ3_BQ;
    int tr = tid >> 3, tc = tid & 7;        // score tile: rows 2tr, 2tr+1; cols 4tc..4tc+3
    int orow = tid >> 2, oc = tid & 3;      // output: row orow, cols 4oc + 16u + 0..3
    const int NU = D / 16;
    float o[NU][4];
#pragma unroll
    for (int u = 0; u < NU; u++) o[u][0] = o[u][1] = o[u][2] = o[u][3] = 0.0f;
    float m_run[2] = {NEG_BIG, NEG_BIG}, l_run[2] = {0.0f, 0.0f};

    int t_last = min(t0 + KVQ3_BQ, T) - 1;
    int kv_hi = min(kv_len, start + t_last + 1);
    int kv_lo = 0;
    if (window > 0) kv_lo = max(0, start + t0 - window + 1) & ~(KVQ3_TILE - 1);
    int lrow = tid >> 2, lseg = tid & 3;    // loader: one row, 8 of 32 values (one code group)

    for (int kt = kv_lo; kt < kv_hi; kt += KVQ3_TILE) {
        float s[2][4];
#pragma unroll
        for (int a = 0; a < 2; a++) s[a][0] = s[a][1] = s[a][2] = s[a][3] = 0.0f;
        for (int dc = 0; dc < D; dc += 32) {
            int qt = t0 + lrow, kr = kt + lrow;
            float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
            const float4* qp = (const float4*)(q + ((i64)qt * nh + h) * D + dc + 8 * lseg);
            float4 q0 = qt < T ? qp[0] : z, q1 = qt < T ? qp[1] : z;
            *(float4*)&Qc[lrow][8 * lseg] = q0; *(float4*)&Qc[lrow][8 * lseg + 4] = q1;
            kvq3_group8<D, 3>(&Kc[lrow][8 * lseg], k_codes, k_scales, (i64)kr * n_kv + kvh, (dc >> 3) + lseg,
                              kr < kv_len);
            __syncthreads();
#pragma unroll
            for (int c = 0; c < 32; c += 4) {
                float4 qa = *(float4*)&Qc[2 * tr][c], qb = *(float4*)&Qc[2 * tr + 1][c];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    float4 kk = *(float4*)&Kc[4 * tc + u][c];
                    s[0][u] += qa.x * kk.x + qa.y * kk.y + qa.z * kk.z + qa.w * kk.w;
                    s[1][u] += qb.x * kk.x + qb.y * kk.y + qb.z * kk.z + qb.w * kk.w;
                }
            }
            __syncthreads();
        }
        // V tile for this key tile: one code group (8 values) per thread and step.
        for (int idx = tid; idx < KVQ3_TILE * (D / 8); idx += 128) {
            int r = idx / (D / 8), g = idx % (D / 8);
            int kr = kt + r;
            kvq3_group8<D, 2>(&Vs[r][8 * g], v_codes, v_scales, (i64)kr * n_kv + kvh, g, kr < kv_len);
        }
        // Mask, running max, probabilities.
#pragma unroll
        for (int a = 0; a < 2; a++) {
            int row = 2 * tr + a;
            int p = start + t0 + row;
            float mx = NEG_BIG;
            bool valid[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                int j = kt + 4 * tc + u;
                valid[u] = (j < kv_len) && (j <= p) && (window <= 0 || j > p - window);
                s[a][u] *= scale;
                if (valid[u]) mx = fmaxf(mx, s[a][u]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            float m_new = fmaxf(m_run[a], mx);
            float alpha = __expf(m_run[a] - m_new);
            float ps = 0.0f;
#pragma unroll
            for (int u = 0; u < 4; u++) {
                float pv = valid[u] ? __expf(s[a][u] - m_new) : 0.0f;
                P[row][4 * tc + u] = pv;
                ps += pv;
            }
            ps += __shfl_xor_sync(0xffffffffu, ps, 1);
            ps += __shfl_xor_sync(0xffffffffu, ps, 2);
            ps += __shfl_xor_sync(0xffffffffu, ps, 4);
            l_run[a] = l_run[a] * alpha + ps;
            m_run[a] = m_new;
            if (tc == 0) s_alpha[row] = alpha;
        }
        __syncthreads();
        float al = s_alpha[orow];
#pragma unroll
        for (int u = 0; u < NU; u++) { o[u][0] *= al; o[u][1] *= al; o[u][2] *= al; o[u][3] *= al; }
#pragma unroll 4
        for (int j = 0; j < KVQ3_TILE; j++) {
            float pj = P[orow][j];
#pragma unroll
            for (int u = 0; u < NU; u++) {
                float4 v = *(float4*)&Vs[j][4 * oc + 16 * u];
                o[u][0] = fmaf(pj, v.x, o[u][0]); o[u][1] = fmaf(pj, v.y, o[u][1]);
                o[u][2] = fmaf(pj, v.z, o[u][2]); o[u][3] = fmaf(pj, v.w, o[u][3]);
            }
        }
        __syncthreads();
    }
    if (tc == 0) { s_l[2 * tr] = l_run[0]; s_l[2 * tr + 1] = l_run[1]; }
    __syncthreads();
    int t = t0 + orow;
    if (t < T) {
        float l = s_l[orow];
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float* op = out + ((i64)t * nh + h) * D;
#pragma unroll
        for (int u = 0; u < NU; u++)
            *(float4*)(op + 4 * oc + 16 * u) = make_float4(o[u][0] * inv, o[u][1] * inv, o[u][2] * inv, o[u][3] * inv);
    }
}
