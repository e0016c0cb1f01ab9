// Gated DeltaNet pieces: causal depthwise conv + SiLU with its rolling state, and the delta-rule
// recurrence over a run of tokens (decode is the T = 1 case).
//
// gdn_scan keeps the recurrent state in registers: a warp owns 32 value columns of one value head, each
// lane one column S[:, c] (DK floats), so e = S^T k and o = S^T q need no cross-lane reduction. Per
// token (all fp32):  e' = S^T k,  r = S^T q,  a = exp(g),  d = beta (v - a e'),
//                    S <- a S + k d^T,  o = a r + (k . q) d
// which is the recurrence of qwen35-architecture.md 3.4 step 6 rearranged (decay folded in). The next
// token's q, k, v, g, beta are fetched while the current one is computed. State layout (n_v, DK, DV) as
// the Backend protocol fixes it (value index fastest: a warp's loads of a state row are coalesced).

extern "C" __global__ void conv1d_silu(const float* __restrict__ x, const float* __restrict__ state,
                                       const float* __restrict__ w, float* __restrict__ out,
                                       int T, int C, int KW) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)T * C) return;
    int t = (int)(i / C), c = (int)(i % C);
    float acc = 0.0f;
    for (int k = 0; k < KW; k++) {
        int src = t + k;  // row of X = [state (KW-1 rows); x (T rows)]
        float v = src < KW - 1 ? state[(i64)src * C + c] : x[(i64)(src - (KW - 1)) * C + c];
        acc = fmaf(v, w[c * KW + k], acc);
    }
    out[i] = silu_f(acc);
}

// New state = last KW-1 rows of X. One thread per channel, rows in increasing order, so reading old
// state rows (index t + T > t) before they are overwritten is safe.
extern "C" __global__ void conv_state_update(const float* __restrict__ x, float* __restrict__ state,
                                             int T, int C, int KW) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int r = 0; r < KW - 1; r++) {
        int src = T + r;
        float v = src < KW - 1 ? state[(i64)src * C + c] : x[(i64)(src - (KW - 1)) * C + c];
        state[(i64)r * C + c] = v;
    }
}

template <int DK>
__global__ void __launch_bounds__(32) gdn_scan(
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
        const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
        float* __restrict__ out, int T, int n_k, int n_v, int DV) {
    __shared__ __align__(16) float ks[2][DK], qs[2][DK];
    const int PER = (DK + 31) / 32;
    int lane = threadIdx.x;
    int slices = (DV + 31) / 32;
    int j = blockIdx.x / slices;
    int c = (blockIdx.x % slices) * 32 + lane;
    bool active = c < DV;
    int kh = j % n_k;
    float S[DK];
    float* sp = state + (i64)j * DK * DV;
#pragma unroll
    for (int i = 0; i < DK; i++) S[i] = active ? sp[(i64)i * DV + c] : 0.0f;

    float kr[PER], qr[PER], vr = 0.0f, gr = 0.0f, br = 0.0f;
    auto fetch = [&](int t) {
#pragma unroll
        for (int u = 0; u < PER; u++) {
            int i = lane + 32 * u;
            kr[u] = (i < DK) ? k[((i64)t * n_k + kh) * DK + i] : 0.0f;
            qr[u] = (i < DK) ? q[((i64)t * n_k + kh) * DK + i] : 0.0f;
        }
        vr = active ? v[((i64)t * n_v + j) * DV + c] : 0.0f;
        gr = g[(i64)t * n_v + j];
        br = beta[(i64)t * n_v + j];
    };
    auto stash = [&](int buf) {
#pragma unroll
        for (int u = 0; u < PER; u++) {
            int i = lane + 32 * u;
            if (i < DK) { ks[buf][i] = kr[u]; qs[buf][i] = qr[u]; }
        }
    };
    if (T > 0) { fetch(0); stash(0); }
    __syncwarp();
    for (int t = 0; t < T; t++) {
        int buf = t & 1;
        float vt = vr, gt = gr, bt = br;
        float kq = 0.0f;
#pragma unroll
        for (int u = 0; u < PER; u++) kq += kr[u] * qr[u];
        kq = warp_sum(kq);
        if (t + 1 < T) fetch(t + 1);
        // Four partial sums per dot product: a single chain of DK dependent FMAs was the critical path.
        float e4[4] = {0.f, 0.f, 0.f, 0.f}, r4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < DK; i += 4) {
            float4 kk = *(const float4*)&ks[buf][i];
            float4 qq = *(const float4*)&qs[buf][i];
            e4[0] = fmaf(S[i], kk.x, e4[0]); e4[1] = fmaf(S[i + 1], kk.y, e4[1]);
            e4[2] = fmaf(S[i + 2], kk.z, e4[2]); e4[3] = fmaf(S[i + 3], kk.w, e4[3]);
            r4[0] = fmaf(S[i], qq.x, r4[0]); r4[1] = fmaf(S[i + 1], qq.y, r4[1]);
            r4[2] = fmaf(S[i + 2], qq.z, r4[2]); r4[3] = fmaf(S[i + 3], qq.w, r4[3]);
        }
        float e = (e4[0] + e4[1]) + (e4[2] + e4[3]);
        float r = (r4[0] + r4[1]) + (r4[2] + r4[3]);
        float a = __expf(gt);
        float d = bt * (vt - a * e);
#pragma unroll
        for (int i = 0; i < DK; i += 4) {
            float4 kk = *(const float4*)&ks[buf][i];
            S[i] = fmaf(a, S[i], kk.x * d); S[i + 1] = fmaf(a, S[i + 1], kk.y * d);
            S[i + 2] = fmaf(a, S[i + 2], kk.z * d); S[i + 3] = fmaf(a, S[i + 3], kk.w * d);
        }
        if (active) out[((i64)t * n_v + j) * DV + c] = fmaf(a, r, kq * d);
        if (t + 1 < T) stash(buf ^ 1);
        __syncwarp();
    }
#pragma unroll
    for (int i = 0; i < DK; i++)
        if (active) sp[(i64)i * DV + c] = S[i];
}
