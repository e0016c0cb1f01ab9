// ---- gated attention, one token, before the scores --------------------------------------------------
// attn_prep: blocks [0, nh): query head h of qg (per head [q (D) | gate (D)]) -> q_out (nh, D) fp32.
// Blocks [nh, nh + n_kv): key head h of k -> cache row `row` (or *row_ptr inside a captured graph), and
// its v row, both stored in the cache's own type through kv_store1 (fp32 here, f16 or q8_0 where
// kv_f16.cu / kv_q8_0.cu come first in the module: kernels/build.py), so the decode step writes an f16
// or q8_0 cache without an fp32 copy or a second append kernel.
// Each: RMSNorm with weight (D,), then NEOX RoPE of the first n_rot dims as rope_neox (elementwise.cu)
// for T == 1: pos (3,) position components, comp[i] the component of pair i.
// blockDim.x is a multiple of 32 and D, DV are multiples of 32, so every warp stores whole 32-value
// runs (what the q8_0 store, a warp-wide block quantization, needs).

__device__ __forceinline__ void attn_prep_body(
        const float* __restrict__ qg, const float* __restrict__ k, const float* __restrict__ v,
        const float* __restrict__ q_norm, const float* __restrict__ k_norm, float* __restrict__ q_out,
        KV_ELEM* __restrict__ kc, KV_ELEM* __restrict__ vc, const int* __restrict__ row_ptr, int row,
        const int* __restrict__ pos, const int* __restrict__ comp, const float* __restrict__ inv_freq, int nh,
        int n_kv, int D, int DV, int n_rot, float inv_scale, float eps) {
    __shared__ float hs[256];
    __shared__ float scratch[32];
    int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    bool is_q = b < nh;
    int h = is_q ? b : b - nh;
    const float* src = is_q ? qg + (i64)h * 2 * D : k + (i64)h * D;
    const float* w = is_q ? q_norm : k_norm;
    float ss = 0.0f;
    for (int i = tid; i < D; i += blockDim.x) {
        float x = src[i];
        hs[i] = x;
        ss += x * x;
    }
    ss = block_sum(ss, scratch);  // also makes hs visible to the whole block
    float inv = rsqrtf(ss / (float)D + eps);
    if (row_ptr != 0) row = *row_ptr;
    i64 kbase = ((i64)row * n_kv + h) * D;
    int half = n_rot >> 1;
    for (int jd = tid; jd < D; jd += blockDim.x) {
        float r;
        if (jd >= n_rot) {
            r = (hs[jd] * inv) * w[jd];
        } else {
            int i = jd < half ? jd : jd - half;
            float p = (float)pos[comp[i]] * inv_scale;
            float sn, cs;
            sincosf(p * inv_freq[i], &sn, &cs);
            float x0 = (hs[i] * inv) * w[i], x1 = (hs[i + half] * inv) * w[i + half];
            r = jd < half ? (x0 * cs - x1 * sn) : (x0 * sn + x1 * cs);
        }
        if (is_q)
            q_out[(i64)h * D + jd] = r;
        else
            kv_store1(kc, kbase + jd, r, lane);
    }
    if (!is_q)
        for (int i = tid; i < DV; i += blockDim.x)
            kv_store1(vc, ((i64)row * n_kv + h) * DV + i, v[(i64)h * DV + i], lane);
}

// Before the wait: ask L2 for the head's norm weights and the rotary tables (no kernel writes them), which
// the body reads after the head's sum of squares.
__device__ __forceinline__ void attn_prep_prefetch(const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                                   const int* __restrict__ comp, const float* __restrict__ inv_freq,
                                                   int nh, int D, int n_rot) {
    const int t32 = threadIdx.x * 32;
    if (t32 < D) prefetch_line((blockIdx.x < nh ? q_norm : k_norm) + t32);
    if (t32 < n_rot / 2) prefetch_line(inv_freq + t32), prefetch_line(comp + t32);
}

extern "C" __global__ void attn_prep(const float* __restrict__ qg, const float* __restrict__ k,
                                     const float* __restrict__ v, const float* __restrict__ q_norm,
                                     const float* __restrict__ k_norm, float* __restrict__ q_out,
                                     KV_ELEM* __restrict__ kc, KV_ELEM* __restrict__ vc,
                                     const int* __restrict__ row_ptr, int row, const int* __restrict__ pos,
                                     const int* __restrict__ comp, const float* __restrict__ inv_freq, int nh,
                                     int n_kv, int D, int DV, int n_rot, float inv_scale, float eps) {
    attn_prep_prefetch(q_norm, k_norm, comp, inv_freq, nh, D, n_rot);
    pdl_entry();
    attn_prep_body(qg, k, v, q_norm, k_norm, q_out, kc, vc, row_ptr, row, pos, comp, inv_freq, nh, n_kv, D, DV,
                   n_rot, inv_scale, eps);
}

// attn_prep for one token of each of B sequences, grid (nh + n_kv, B): blockIdx.y is the sequence s, whose
// qg, k, v and q_out rows are row s of (B, nh, 2 D), (B, n_kv, D), (B, n_kv, DV) and (B, nh, D), whose
// cache is kcs[s] / vcs[s] (device pointer tables, in the module's KV_ELEM type), whose new row is
// rows[s] (its length before the append) and whose (t, h, w) position is pos[3 s .. 3 s + 2].
extern "C" __global__ void attn_prep_batch(const float* __restrict__ qg, const float* __restrict__ k,
                                           const float* __restrict__ v, const float* __restrict__ q_norm,
                                           const float* __restrict__ k_norm, float* __restrict__ q_out,
                                           KV_ELEM* const* __restrict__ kcs, KV_ELEM* const* __restrict__ vcs,
                                           const int* __restrict__ rows, const int* __restrict__ pos,
                                           const int* __restrict__ comp, const float* __restrict__ inv_freq,
                                           int nh, int n_kv, int D, int DV, int n_rot, float inv_scale, float eps) {
    attn_prep_prefetch(q_norm, k_norm, comp, inv_freq, nh, D, n_rot);
    pdl_entry();
    i64 s = blockIdx.y;
    attn_prep_body(qg + s * 2 * nh * D, k + s * n_kv * D, v + s * n_kv * DV, q_norm, k_norm, q_out + s * nh * D,
                   kcs[s], vcs[s], rows + s, 0, pos + 3 * s, comp, inv_freq, nh, n_kv, D, DV, n_rot, inv_scale,
                   eps);
}
