// Flash attention over an fp32 KV cache laid out (capacity, n_kv, D). Causal GQA: query head h reads KV
// head h / (nh / n_kv). Query t sits at position start + t; keys 0..kv_len-1 are in the cache.
// window > 0 keeps only keys > p - window. Softmax in fp32 with running max and sum (one pass).
//
// flash_prefill: 32 queries x one head per block, key tiles of 32; scores from D-chunks of 32 staged in
//   shared memory, then P @ V with each thread owning one query row and D/4 output columns.
// flash_decode:  one query token; a block per (KV head, slice of the context) serves all G query heads
//   of that KV head (K and V read once), writing fp32 partials (o unnormalized, running max m, sum l);
//   flash_merge combines the slices: m = max m_s, l = sum e^(m_s - m) l_s, o = sum e^(m_s - m) o_s / l.
//   fp32 partials are deliberate (fp16 partials drift and flip argmax within ~30 tokens).

#define FA_BQ 32
#define FA_BK 32
#define FA_PAD 36

template <int D>
__global__ void __launch_bounds__(128) flash_prefill(
        const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
        float* __restrict__ out, int T, int nh, int n_kv, int start, int kv_len, float scale, int window) {
    __shared__ __align__(16) float Qc[FA_BQ][FA_PAD];
    __shared__ __align__(16) float Kc[FA_BK][FA_PAD];
    __shared__ __align__(16) float Vs[FA_BK][D];
    __shared__ float P[FA_BQ][FA_BK + 1];
    __shared__ float s_alpha[FA_BQ], s_l[FA_BQ];

    int tid = threadIdx.x;
    int h = blockIdx.y, kvh = h / (nh / n_kv);
    int t0 = blockIdx.x * FA_BQ;
    int tr = tid >> 3, tc = tid & 7;        // score tile: rows 2tr, 2tr+1; cols 4tc..4tc+3
    int orow = tid >> 2, oc = tid & 3;      // output: row orow, cols 4oc + 16u + 0..3
    const int NU = D / 16;
    float o[NU][4];
#pragma unroll
    for (int u = 0; u < NU; u++) o[u][0] = o[u][1] = o[u][2] = o[u][3] = 0.0f;
    float m_run[2] = {NEG_BIG, NEG_BIG}, l_run[2] = {0.0f, 0.0f};

    int t_last = min(t0 + FA_BQ, T) - 1;
    int kv_hi = min(kv_len, start + t_last + 1);
    int kv_lo = 0;
    if (window > 0) kv_lo = max(0, start + t0 - window + 1) & ~(FA_BK - 1);
    int lrow = tid >> 2, lseg = tid & 3;    // loader: one row, 8 of 32 values

    for (int kt = kv_lo; kt < kv_hi; kt += FA_BK) {
        float s[2][4];
#pragma unroll
        for (int a = 0; a < 2; a++) s[a][0] = s[a][1] = s[a][2] = s[a][3] = 0.0f;
        for (int dc = 0; dc < D; dc += 32) {
            int qt = t0 + lrow, kr = kt + lrow;
            float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
            const float4* qp = (const float4*)(q + ((i64)qt * nh + h) * D + dc + 8 * lseg);
            const float4* kp = (const float4*)(kc + ((i64)kr * n_kv + kvh) * D + dc + 8 * lseg);
            float4 q0 = qt < T ? qp[0] : z, q1 = qt < T ? qp[1] : z;
            float4 k0 = kr < kv_len ? kp[0] : z, k1 = kr < kv_len ? kp[1] : z;
            *(float4*)&Qc[lrow][8 * lseg] = q0; *(float4*)&Qc[lrow][8 * lseg + 4] = q1;
            *(float4*)&Kc[lrow][8 * lseg] = k0; *(float4*)&Kc[lrow][8 * lseg + 4] = k1;
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
        // V tile for this key tile.
        for (int idx = tid; idx < FA_BK * D / 4; idx += 128) {
            int r = idx / (D / 4), c4 = idx % (D / 4);
            int kr = kt + r;
            float4 v = kr < kv_len ? ((const float4*)(vc + ((i64)kr * n_kv + kvh) * D))[c4]
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
            *(float4*)&Vs[r][4 * c4] = v;
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
        for (int j = 0; j < FA_BK; j++) {
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

#define FD_G 8
#define FD_BK 32

template <int D>
__global__ void __launch_bounds__(128) flash_decode(
        const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
        float* __restrict__ po, float* __restrict__ pm, float* __restrict__ pl,
        int nh, int n_kv, int kv_len, const int* __restrict__ kv_len_ptr, int split_len, float scale,
        int window) {
    // Inside a captured decode graph the context length is read from the device (length before this
    // token's append, + 1), so one graph serves every step.
    if (kv_len_ptr != 0) kv_len = *kv_len_ptr + 1;
    __shared__ float qs[FD_G][D];
    __shared__ float KV[FD_BK * (D + 1)];
    __shared__ float P[FD_G][FD_BK];
    __shared__ float s_alpha[FD_G];
    int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    int kvh = blockIdx.x, split = blockIdx.y;
    int G = nh / n_kv;
    int h0 = kvh * G;
    for (int i = tid; i < G * D; i += 128) qs[i / D][i % D] = q[(i64)h0 * D + i];
    int p = kv_len - 1;
    int lo = split * split_len, hi = min(kv_len, lo + split_len);
    if (window > 0) lo = max(lo, p - window + 1);
    const int NU = (D + 127) / 128;
    float o[FD_G][NU];
#pragma unroll
    for (int g = 0; g < FD_G; g++)
#pragma unroll
        for (int u = 0; u < NU; u++) o[g][u] = 0.0f;
    float m_run[2] = {NEG_BIG, NEG_BIG}, l_run[2] = {0.0f, 0.0f};
    __syncthreads();
    for (int kt = lo; kt < hi; kt += FD_BK) {
        for (int i = tid; i < FD_BK * D; i += 128) {
            int r = i / D, c = i % D;
            KV[r * (D + 1) + c] = (kt + r < hi) ? kc[((i64)(kt + r) * n_kv + kvh) * D + c] : 0.0f;
        }
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
                float mx = warp_max(valid ? s : NEG_BIG);
                float m_new = fmaxf(m_run[a], mx);
                float alpha = __expf(m_run[a] - m_new);
                float pv = valid ? __expf(s - m_new) : 0.0f;
                l_run[a] = l_run[a] * alpha + warp_sum(pv);
                m_run[a] = m_new;
                P[g][lane] = pv;
                if (lane == 0) s_alpha[g] = alpha;
            }
        }
        __syncthreads();
        for (int i = tid; i < FD_BK * D; i += 128) {
            int r = i / D, c = i % D;
            KV[r * (D + 1) + c] = (kt + r < hi) ? vc[((i64)(kt + r) * n_kv + kvh) * D + c] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < NU; u++) {
            int c = tid + 128 * u;
            if (c < D) {
#pragma unroll
                for (int g = 0; g < FD_G; g++) {
                    if (g < G) {
                        float acc = o[g][u] * s_alpha[g];
#pragma unroll 8
                        for (int j = 0; j < FD_BK; j++) acc = fmaf(P[g][j], KV[j * (D + 1) + c], acc);
                        o[g][u] = acc;
                    }
                }
            }
        }
        __syncthreads();
    }
    i64 base = (i64)split * nh + h0;
#pragma unroll
    for (int u = 0; u < NU; u++) {
        int c = tid + 128 * u;
        if (c < D)
#pragma unroll
            for (int g = 0; g < FD_G; g++)
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

extern "C" __global__ void flash_merge(const float* __restrict__ po, const float* __restrict__ pm,
                                       const float* __restrict__ pl, float* __restrict__ out,
                                       int n_splits, int nh, int D) {
    int h = blockIdx.x;
    float m = NEG_BIG;
    for (int s = 0; s < n_splits; s++) m = fmaxf(m, pm[(i64)s * nh + h]);
    float l = 0.0f;
    for (int s = 0; s < n_splits; s++) l += __expf(pm[(i64)s * nh + h] - m) * pl[(i64)s * nh + h];
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < n_splits; s++)
            acc += __expf(pm[(i64)s * nh + h] - m) * po[((i64)s * nh + h) * D + c];
        out[(i64)h * D + c] = acc * inv;
    }
}

// Append one token's K and V (n values each) at the row given on the device (graph-captured decode).
extern "C" __global__ void kv_append(const float* __restrict__ k, const float* __restrict__ v,
                                     float* __restrict__ kc, float* __restrict__ vc,
                                     const int* __restrict__ row_ptr, int n_k, int n_v) {
    i64 row = *row_ptr;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_k || i < n_v; i += gridDim.x * blockDim.x) {
        if (i < n_k) kc[row * n_k + i] = k[i];
        if (i < n_v) vc[row * n_v + i] = v[i];
    }
}
