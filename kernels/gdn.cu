// Gated DeltaNet pieces: causal depthwise conv + SiLU with its rolling state, and the delta-rule
// recurrence over a run of tokens (decode is the T = 1 case).
//
// gdn_scan keeps the recurrent state in registers: a warp owns 32 value columns of one value head, each
// lane one column S[:, c] (DK floats), so e = S^T k and o = S^T q need no cross-lane reduction; a second
// warp of the block stages the inputs 16 tokens at a time. Per
// token (all fp32):  e' = S^T k,  r = S^T q,  a = exp(g),  d = beta (v - a e'),
//                    S <- a S + k d^T,  o = a r + (k . q) d
// which is the recurrence of qwen35-architecture.md 3.4 step 6 rearranged (decay folded in). State layout (n_v, DK, DV) as
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

#define GDN_TC 16  // tokens per staged chunk

template <int DK>
__global__ void __launch_bounds__(64) gdn_scan(
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
        const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
        float* __restrict__ out, int T, int n_k, int n_v, int DV) {
    // Warp 0 computes; warp 1 stages the next GDN_TC tokens' q, k, v, g, beta into the other half
    // of a double buffer, so the global-memory latency is paid once per chunk, off the critical path.
    __shared__ __align__(16) float ks[2][GDN_TC][DK], qs[2][GDN_TC][DK];
    __shared__ float vs[2][GDN_TC][32], gs[2][GDN_TC], bs[2][GDN_TC];
    const int PER = (DK + 31) / 32;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int slices = (DV + 31) / 32;
    int j = blockIdx.x / slices;
    int c0 = (blockIdx.x % slices) * 32;
    int c = c0 + lane;
    bool active = c < DV;
    int kh = j % n_k;
    float* sp = state + (i64)j * DK * DV;
    int nch = (T + GDN_TC - 1) / GDN_TC;

    auto stage = [&](int ch, int buf) {
        int t0 = ch * GDN_TC, n = min(GDN_TC, T - t0);
        for (int idx = lane; idx < n * (DK / 4); idx += 32) {
            int tt = idx / (DK / 4), i4 = idx % (DK / 4);
            i64 base = ((i64)(t0 + tt) * n_k + kh) * DK;
            *(float4*)&ks[buf][tt][4 * i4] = ((const float4*)(k + base))[i4];
            *(float4*)&qs[buf][tt][4 * i4] = ((const float4*)(q + base))[i4];
        }
        for (int tt = 0; tt < n; tt++)
            vs[buf][tt][lane] = active ? v[((i64)(t0 + tt) * n_v + j) * DV + c] : 0.0f;
        if (lane < n) {
            gs[buf][lane] = g[(i64)(t0 + lane) * n_v + j];
            bs[buf][lane] = beta[(i64)(t0 + lane) * n_v + j];
        }
    };

    float S[DK];
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < DK; i++) S[i] = active ? sp[(i64)i * DV + c] : 0.0f;
    } else if (nch > 0) {
        stage(0, 0);
    }
    __syncthreads();
    for (int ch = 0; ch < nch; ch++) {
        int buf = ch & 1;
        if (warp == 1) {
            if (ch + 1 < nch) stage(ch + 1, buf ^ 1);
        } else {
            int t0 = ch * GDN_TC, n = min(GDN_TC, T - t0);
            for (int tt = 0; tt < n; tt++) {
                float kq = 0.0f;
#pragma unroll
                for (int u = 0; u < PER; u++) {
                    int i = lane + 32 * u;
                    if (i < DK) kq += ks[buf][tt][i] * qs[buf][tt][i];
                }
                kq = warp_sum(kq);
                // Four partial sums per dot product: one chain of DK dependent FMAs is too long.
                float e4[4] = {0.f, 0.f, 0.f, 0.f}, r4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < DK; i += 4) {
                    float4 kk = *(const float4*)&ks[buf][tt][i];
                    float4 qq = *(const float4*)&qs[buf][tt][i];
                    e4[0] = fmaf(S[i], kk.x, e4[0]); e4[1] = fmaf(S[i + 1], kk.y, e4[1]);
                    e4[2] = fmaf(S[i + 2], kk.z, e4[2]); e4[3] = fmaf(S[i + 3], kk.w, e4[3]);
                    r4[0] = fmaf(S[i], qq.x, r4[0]); r4[1] = fmaf(S[i + 1], qq.y, r4[1]);
                    r4[2] = fmaf(S[i + 2], qq.z, r4[2]); r4[3] = fmaf(S[i + 3], qq.w, r4[3]);
                }
                float e = (e4[0] + e4[1]) + (e4[2] + e4[3]);
                float r = (r4[0] + r4[1]) + (r4[2] + r4[3]);
                float a = __expf(gs[buf][tt]);
                float d = bs[buf][tt] * (vs[buf][tt][lane] - a * e);
#pragma unroll
                for (int i = 0; i < DK; i += 4) {
                    float4 kk = *(const float4*)&ks[buf][tt][i];
                    S[i] = fmaf(a, S[i], kk.x * d); S[i + 1] = fmaf(a, S[i + 1], kk.y * d);
                    S[i + 2] = fmaf(a, S[i + 2], kk.z * d); S[i + 3] = fmaf(a, S[i + 3], kk.w * d);
                }
                if (active) out[((i64)(t0 + tt) * n_v + j) * DV + c] = fmaf(a, r, kq * d);
            }
        }
        __syncthreads();
    }
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < DK; i++)
            if (active) sp[(i64)i * DV + c] = S[i];
    }
}
