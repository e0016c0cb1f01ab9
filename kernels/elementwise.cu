// Row norms and elementwise ops on fp32 activations. Reductions are fp32, one warp per row when a row
// is at most 1024 values (per-head norms), one block of 256 threads per row otherwise (hidden size).

template <bool WARP_ROW>
__device__ __forceinline__ float row_sum(float v, float* scratch) {
    if (WARP_ROW) return warp_sum(v);
    return block_sum(v, scratch);
}

// mode 0: out = rms_norm(x) * w; mode 1: s = x + delta (written to s_out), out = rms_norm(s) * w;
// mode 2: out = x / sqrt(sum x^2 + eps) (L2); mode 3: out = rms_norm(x) * w * silu(z) (gated).
// w == nullptr means no weight. w has N values (broadcast over rows).
template <bool WARP_ROW, int MODE>
__global__ void row_norm(const float* __restrict__ x, const float* __restrict__ other, const float* __restrict__ w,
                         float* __restrict__ out, float* __restrict__ s_out, int n_rows, int N, float eps) {
    pdl_entry();
    __shared__ float scratch[32];
    int row, tid, nth;
    if (WARP_ROW) {
        row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
        tid = threadIdx.x & 31;
        nth = 32;
        if (row >= n_rows) return;
    } else {
        row = blockIdx.x;
        tid = threadIdx.x;
        nth = blockDim.x;
    }
    const float* xr = x + (i64)row * N;
    float ss = 0.0f;
    for (int i = tid; i < N; i += nth) {
        float v = xr[i];
        if (MODE == 1) {
            v += other[(i64)row * N + i];
            s_out[(i64)row * N + i] = v;
        }
        ss += v * v;
    }
    ss = row_sum<WARP_ROW>(ss, scratch);
    float inv = (MODE == 2) ? rsqrtf(ss + eps) : rsqrtf(ss / (float)N + eps);
    for (int i = tid; i < N; i += nth) {
        float v = (MODE == 1) ? s_out[(i64)row * N + i] : xr[i];
        float o = v * inv;
        if (MODE != 2 && w != 0) o *= w[i];
        if (MODE == 3) o *= silu_f(other[(i64)row * N + i]);
        out[(i64)row * N + i] = o;
    }
}

// Elementwise binary/unary ops. b is broadcast when it is shorter (n_b divides n).
// op: 0 add, 1 mul, 2 scale (by s), 3 sigmoid, 4 silu, 5 swiglu silu(a)*b, 6 geglu gelu_tanh(a)*b,
//     7 a * sigmoid(b) (attention output gate)
template <int OP>
__global__ void ewise(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
                      i64 n, i64 n_b, float s) {
    pdl_entry();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = a[i];
    float y = (OP == 0 || OP == 1 || OP >= 5) ? b[n_b == n ? i : i % n_b] : 0.0f;
    float r;
    if (OP == 0) r = x + y;
    else if (OP == 1) r = x * y;
    else if (OP == 2) r = x * s;
    else if (OP == 3) r = sigmoid_f(x);
    else if (OP == 4) r = silu_f(x);
    else if (OP == 5) r = silu_f(x) * y;
    else if (OP == 6) {
        float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        r = 0.5f * x * (1.0f + tanhf(u)) * y;
    } else r = x * sigmoid_f(y);
    out[i] = r;
}

// Gated DeltaNet gates: g = ssm_a * softplus(alpha + dt_bias) (log decay), b = sigmoid(beta); (T, n_v).
extern "C" __global__ void gdn_gates(const float* __restrict__ alpha, const float* __restrict__ beta,
                                     const float* __restrict__ ssm_a, const float* __restrict__ dt_bias,
                                     float* __restrict__ g, float* __restrict__ b, int n, int n_v) {
    pdl_entry();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int j = i % n_v;
    g[i] = ssm_a[j] * softplus_f(alpha[i] + dt_bias[j]);
    b[i] = sigmoid_f(beta[i]);
}

// Partial NEOX rotary embedding: pairs (i, i + n_rot/2) for i < n_rot/2, dims >= n_rot copied.
// pos: (3, T) int32 position components; comp[i] picks the component of pair i (M-RoPE sections; all 0
// for text). inv_freq[i] = base^(-2i/n_rot) computed on the host in float64. Angle in fp32 as
// transformers does: (pos / scale) * inv_freq.
extern "C" __global__ void rope_neox(const float* __restrict__ x, float* __restrict__ out,
                                     const int* __restrict__ pos, const int* __restrict__ comp,
                                     const float* __restrict__ inv_freq, int T, int nh, int d, int n_rot,
                                     float inv_scale) {
    pdl_entry();
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    i64 n = (i64)T * nh * d;
    if (idx >= n) return;
    int j = (int)(idx % d);
    i64 head = idx / d;
    int t = (int)(head / nh);
    const float* xh = x + head * d;
    int half = n_rot >> 1;
    if (j >= n_rot) { out[idx] = xh[j]; return; }
    int i = (j < half) ? j : j - half;
    float p = (float)pos[comp[i] * T + t] * inv_scale;
    float sn, cs;
    sincosf(p * inv_freq[i], &sn, &cs);
    float x0 = xh[i], x1 = xh[i + half];
    out[idx] = (j < half) ? (x0 * cs - x1 * sn) : (x0 * sn + x1 * cs);
}

// split_cols: the column ranges [a_j, a_{j+1}) of y (T, R) as consecutive row-major blocks of `out`
// (range j: a (T, a_{j+1} - a_j) block at offset T * a_j), in one launch: the outputs of a fused group's
// matmul for a batch of rows (one copy a range before). a_0 = 0 < a_1 < ... < a_n = R, n <= 8 (a_k
// past n unused).
extern "C" __global__ void split_cols(const float* __restrict__ y, float* __restrict__ out, long long T,
                                      int R, int n, int a1, int a2, int a3, int a4, int a5, int a6, int a7,
                                      int a8) {
    pdl_entry();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * R) return;
    const int a[9] = {0, a1, a2, a3, a4, a5, a6, a7, a8};
    int j = 0;
#pragma unroll
    for (int k = 1; k < 8; k++)
        if (k < n && i >= T * a[k]) j = k;
    const int lo = a[j], w = a[j + 1] - lo;
    const long long local = i - T * lo;
    const long long t = local / w;
    out[i] = y[t * R + lo + (local - t * w)];
}
