// Gated DeltaNet pieces: causal depthwise conv + SiLU with its rolling state, and the delta-rule
// recurrence over a run of tokens (decode is the T = 1 case).
//
// gdn_scan keeps the recurrent state in registers: a warp owns 32 value columns of one value head, each
// lane one column S[:, c] (DK floats), so e = S^T k and o = S^T q need no cross-lane reduction; a second
// warp of the block stages the inputs 16 tokens at a time. Per
// token (all fp32):  e' = S^T k,  r = S^T q,  a = exp(g),  d = beta (v - a e'),
//                    S <- a S + k d^T,  o = a r + (k . q) d
// which is the recurrence of docs/qwen35.md 3.4 step 5 rearranged (decay folded in). State layout (n_v, DK, DV) as
// the Backend protocol fixes it (value index fastest: a warp's loads of a state row are coalesced).

// out[t, c] = silu(sum_k X[t + k, c] w[c, k]) over X = [state (KW-1 rows); x (T rows)], the fp32 FMA chain in
// k order from 0. A thread per channel c and run of CONV_RUN tokens (grid (ceil(C / 256), ceil(T /
// CONV_RUN))): its KW weights and a window of KW rows of X in registers, so each X value is read once per
// run (before: a thread per output, KW loads each and a 64-bit division). KW <= CONV_KW_MAX (ops.py checks).
// The output is cut at columns s1 <= s2 (C, C: uncut) into pieces [0, s1), [s1, s2), [s2, C), each written as a
// contiguous (T, width) block at T * (its first column): the Gated DeltaNet's q, k and v, apart.
#define CONV_RUN 16
#define CONV_KW_MAX 8
extern "C" __global__ void conv1d_silu(const float* __restrict__ x, const float* __restrict__ state,
                                       const float* __restrict__ w, float* __restrict__ out,
                                       int T, int C, int KW, int s1, int s2) {
    pdl_entry();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t0 = blockIdx.y * CONV_RUN;
    if (c >= C) return;
    const int lo = c < s1 ? 0 : c < s2 ? s1 : s2, width = (c < s1 ? s1 : c < s2 ? s2 : C) - lo;
    float* dst = out + (i64)T * lo + (c - lo);  // this column of its piece; rows width apart
    auto xrow = [&](int r) {  // row r of X, column c
        return r < KW - 1 ? state[(i64)r * C + c] : x[(i64)(r - (KW - 1)) * C + c];
    };
    float wk[CONV_KW_MAX], win[CONV_KW_MAX];
#pragma unroll
    for (int k = 0; k < CONV_KW_MAX; k++) {
        wk[k] = k < KW ? w[c * KW + k] : 0.0f;
        win[k] = k < KW - 1 ? xrow(t0 + k) : 0.0f;
    }
    const int n = min(CONV_RUN, T - t0);
    for (int u = 0; u < n; u++) {
#pragma unroll
        for (int k = 0; k < CONV_KW_MAX; k++)
            if (k == KW - 1) win[k] = xrow(t0 + u + k);
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < CONV_KW_MAX; k++)
            if (k < KW) acc = fmaf(win[k], wk[k], acc);
        dst[(i64)(t0 + u) * width] = silu_f(acc);
#pragma unroll
        for (int k = 0; k + 1 < CONV_KW_MAX; k++) win[k] = win[k + 1];
    }
}

// New state = last KW-1 rows of X. One thread per channel, rows in increasing order, so reading old
// state rows (index t + T > t) before they are overwritten is safe.
extern "C" __global__ void conv_state_update(const float* __restrict__ x, float* __restrict__ state,
                                             int T, int C, int KW) {
    pdl_entry();
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
    pdl_entry();
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

// ---- chunked (WY / UT-transform) form for prefill, docs/qwen35.md 3.4.1, chunk 64 ------------------
//
// Two launches per segment of tokens (kernels/gdn_chunk.py): gdn_chunk_prep works on all chunks and
// value heads at once and reduces each chunk to five matrices; gdn_chunk_state then walks the chunks in
// order for one value head and 32 value columns per block, doing two small matmuls per chunk with
// register tiles. Per chunk (rows i of the chunk, gamma = cumulative log decay, S0 = incoming state):
//   A = strict_lower(beta_i k_i.k_j e^(gamma_i - gamma_j)),  P = lower(q_i.k_j e^(gamma_i - gamma_j))
//   Tm = (I + A)^-1 (forward substitution),  R = P Tm,  X = [beta e^gamma K | beta V]
//   [W | U] = Tm X,  Mq = e^gamma Q - (R X)_K = e^gamma Q - P W,  PU = (R X)_V = P U,
//   Kd = e^(gamma_C - gamma) K,  decay = e^gamma_C
// and then  Vnew = U - W S0,  O = Mq S0 + PU,  S = decay S0 + Kd^T Vnew.
// (O = e^gamma Q S0 + P Vnew of 3.4.1 with Vnew expanded, so the sequential kernel needs no P.)
// Tokens past the end are zero rows with g = 0, beta = 0, which change nothing. All fp32, FMA only.
//
// Scratch layout: W, Mq, Kd (n_v, nch, 64, DK); U, PU (n_v, nch, 64, DV); decay (n_v, nch).

#define GDN_CH 64  // tokens per chunk

// component i (0..3, known at compile time after unrolling) of a float4
__device__ __forceinline__ float f4_at(const float4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int DK>
__global__ void __launch_bounds__(256, 3) gdn_chunk_prep(
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
        const float* __restrict__ g, const float* __restrict__ beta,
        float* __restrict__ W, float* __restrict__ Mq, float* __restrict__ Kd, float* __restrict__ U,
        float* __restrict__ PU, float* __restrict__ decay, int t_begin, int T, int n_k, int n_v, int DV) {
    pdl_entry();
    constexpr int KS = DK < 64 ? DK : 64;  // key dims staged per pass for the dot products
    constexpr int KLD = KS + 4;            // staging row stride: 16-byte row reads, 8 rows over all banks
    constexpr int LD = GDN_CH + 4;         // row stride of the 64 x 64 matrices (16-byte row reads)
    // slot 0: K slice, then A, then P, then R = P Tm; slot 1: Q slice, then Tm; slot 2: 32 columns of X
    __shared__ __align__(16) float s0m[GDN_CH * LD], s1m[GDN_CH * LD];
    __shared__ float xs[GDN_CH * 33];
    __shared__ float gam[GDN_CH], bet[GDN_CH], eg[GDN_CH], ed[GDN_CH];
    const int tid = threadIdx.x;
    const int c = blockIdx.x, nch = gridDim.x, j = blockIdx.y, kh = j % n_k;
    const int t0 = t_begin + c * GDN_CH;
    const int n = min(GDN_CH, T - t0);  // valid tokens of this chunk (>= 1)
    if (tid < GDN_CH) {
        gam[tid] = tid < n ? g[(i64)(t0 + tid) * n_v + j] : 0.0f;
        bet[tid] = tid < n ? beta[(i64)(t0 + tid) * n_v + j] : 0.0f;
    }
    __syncthreads();
    if (tid == 0) {
        float s = 0.0f;
        for (int i = 0; i < GDN_CH; i++) {
            s += gam[i];
            gam[i] = s;
        }
        decay[(i64)j * nch + c] = expf(s);
    }
    __syncthreads();
    if (tid < GDN_CH) {
        eg[tid] = expf(gam[tid]);
        ed[tid] = expf(gam[GDN_CH - 1] - gam[tid]);
    }

    // K K^T and Q K^T: thread (ty, tx) owns rows ty + 16a, columns tx + 16b (a, b < 4).
    const int tx = tid & 15, ty = tid >> 4;
    float aK[4][4], aQ[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) aK[a][b] = aQ[a][b] = 0.0f;
    for (int k0 = 0; k0 < DK; k0 += KS) {
        for (int e = tid; e < GDN_CH * KS / 4; e += 256) {
            int r = e / (KS / 4), kq = e % (KS / 4);
            i64 src = ((i64)(t0 + r) * n_k + kh) * DK + k0 + 4 * kq;
            const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);
            *(float4*)&s0m[r * KLD + 4 * kq] = r < n ? *(const float4*)&k[src] : z4;
            *(float4*)&s1m[r * KLD + 4 * kq] = r < n ? *(const float4*)&q[src] : z4;
        }
        __syncthreads();
#pragma unroll 1
        for (int kk = 0; kk < KS; kk += 4) {
            float4 ki[4], kj[4], qi[4];
#pragma unroll
            for (int a = 0; a < 4; a++) {
                ki[a] = *(const float4*)&s0m[(ty + 16 * a) * KLD + kk];
                qi[a] = *(const float4*)&s1m[(ty + 16 * a) * KLD + kk];
                kj[a] = *(const float4*)&s0m[(tx + 16 * a) * KLD + kk];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int b = 0; b < 4; b++) {
                        aK[a][b] = fmaf(f4_at(ki[a], i), f4_at(kj[b], i), aK[a][b]);
                        aQ[a][b] = fmaf(f4_at(qi[a], i), f4_at(kj[b], i), aQ[a][b]);
                    }
        }
        __syncthreads();
    }
    // A into slot 0; P stays in registers (aQ) until A is no longer needed.
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int i = ty + 16 * a, jj = tx + 16 * b;
            float d = jj <= i ? expf(gam[i] - gam[jj]) : 0.0f;  // masked before exp
            s0m[i * LD + jj] = jj < i ? bet[i] * aK[a][b] * d : 0.0f;
            aQ[a][b] *= d;
        }
    __syncthreads();
    // Tm = (I + A)^-1 into slot 1: thread m solves column m by forward substitution (columns are
    // independent: Tm[i][m] = -sum_{m <= jj < i} A[i][jj] Tm[jj][m] for i > m).
    if (tid < GDN_CH) {
        const int m = tid;
        for (int i = 0; i <= m; i++) s1m[i * LD + m] = i == m ? 1.0f : 0.0f;
        for (int i = m + 1; i < GDN_CH; i++) {
            // four partial sums: eight independent shared loads in flight per step
            float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
            int jj = m;
            for (; jj + 3 < i; jj += 4) {
                p0 = fmaf(s0m[i * LD + jj], s1m[jj * LD + m], p0);
                p1 = fmaf(s0m[i * LD + jj + 1], s1m[(jj + 1) * LD + m], p1);
                p2 = fmaf(s0m[i * LD + jj + 2], s1m[(jj + 2) * LD + m], p2);
                p3 = fmaf(s0m[i * LD + jj + 3], s1m[(jj + 3) * LD + m], p3);
            }
            for (; jj < i; jj++) p0 = fmaf(s0m[i * LD + jj], s1m[jj * LD + m], p0);
            s1m[i * LD + m] = -((p0 + p1) + (p2 + p3));
        }
    }
    __syncthreads();
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) s0m[(ty + 16 * a) * LD + tx + 16 * b] = aQ[a][b];
    __syncthreads();
    // R = P Tm (registers, then over P in slot 0)
    float rr[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) rr[a][b] = 0.0f;
#pragma unroll 2
    for (int kk = 0; kk < GDN_CH; kk += 4) {
        float4 pi[4];
#pragma unroll
        for (int a = 0; a < 4; a++) pi[a] = *(const float4*)&s0m[(ty + 16 * a) * LD + kk];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float tj[4];
#pragma unroll
            for (int b = 0; b < 4; b++) tj[b] = s1m[(kk + i) * LD + tx + 16 * b];
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 4; b++) rr[a][b] = fmaf(f4_at(pi[a], i), tj[b], rr[a][b]);
        }
    }
    __syncthreads();
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) s0m[(ty + 16 * a) * LD + tx + 16 * b] = rr[a][b];
    // (the first staging barrier below publishes R)

    // X = [beta e^gamma K | beta V], 32 columns at a time: [W | U] = Tm X, R X = [P W | P U].
    // Thread (ty, tx) owns rows ty + 16a (a < 4), columns tx + 16b (b < 2) of the 64 x 32 tile.
    const i64 rb = ((i64)j * nch + c) * GDN_CH;  // first scratch row of this chunk
    for (int col0 = 0; col0 < DK + DV; col0 += 32) {
        const bool isk = col0 < DK;  // DK is a multiple of 32: a tile is all K or all V
        for (int e = tid; e < GDN_CH * 32; e += 256) {
            int r = e >> 5, cc = e & 31, col = col0 + cc;
            float x = 0.0f;
            if (r < n) {
                if (isk) x = bet[r] * eg[r] * k[((i64)(t0 + r) * n_k + kh) * DK + col];
                else if (col < DK + DV) x = bet[r] * v[((i64)(t0 + r) * n_v + j) * DV + (col - DK)];
            }
            xs[r * 33 + cc] = x;
        }
        __syncthreads();
        float at[4][2], ar[4][2];
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 2; b++) at[a][b] = ar[a][b] = 0.0f;
#pragma unroll 2
        for (int kk = 0; kk < GDN_CH; kk += 4) {
            float4 ti[4], ri[4];
#pragma unroll
            for (int a = 0; a < 4; a++) {
                ti[a] = *(const float4*)&s1m[(ty + 16 * a) * LD + kk];
                ri[a] = *(const float4*)&s0m[(ty + 16 * a) * LD + kk];
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float xj[2] = {xs[(kk + i) * 33 + tx], xs[(kk + i) * 33 + tx + 16]};
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int b = 0; b < 2; b++) {
                        at[a][b] = fmaf(f4_at(ti[a], i), xj[b], at[a][b]);
                        ar[a][b] = fmaf(f4_at(ri[a], i), xj[b], ar[a][b]);
                    }
            }
        }
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 2; b++) {
                int i = ty + 16 * a, col = col0 + tx + 16 * b;
                if (isk) {
                    float qv = 0.0f, kv = 0.0f;
                    if (i < n) {
                        i64 src = ((i64)(t0 + i) * n_k + kh) * DK + col;
                        qv = q[src];
                        kv = k[src];
                    }
                    W[(rb + i) * DK + col] = at[a][b];
                    Mq[(rb + i) * DK + col] = fmaf(eg[i], qv, -ar[a][b]);
                    Kd[(rb + i) * DK + col] = kv * ed[i];
                } else if (col < DK + DV) {
                    U[(rb + i) * DV + (col - DK)] = at[a][b];
                    PU[(rb + i) * DV + (col - DK)] = ar[a][b];
                }
            }
        __syncthreads();
    }
}

// Sequential part: block = (value head j, 32 value columns c0..c0+31), 256 threads, chunks in order.
// Each chunk is DK / 32 tiles of [W; Mq] (128 rows x 32 keys) for [W; Mq] S0, then two tiles of Kd
// (32 tokens x DK) for the state update; every tile is staged through shared memory with 16-byte
// loads, and the next tile's loads (the next chunk's first one after the last) are in flight in
// registers while the current one is used, so the walk does not wait on memory at each tile.
// Thread (ty = tid / 8, tx = tid % 8) owns columns 4 tx .. 4 tx + 3: rows ty + 32a (a < 4) of [W; Mq] S0
// (a < 2: W, a >= 2: Mq) and state rows RA ty .. RA ty + RA - 1 (RA = DK / 32) in registers; a copy of the
// state slice in shared memory (row-major DK x 32) feeds [W; Mq] S0. The sums run in the same order as
// the emulation's (tests/kernels/test_gdn_chunk_emulation.py): keys ascending, then tokens ascending.
template <int RA> __device__ __forceinline__ void ld_rows(const float* p, float (&v)[RA]) {
    if constexpr (RA == 4) {
        float4 t = *(const float4*)p;
        v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
    } else if constexpr (RA == 2) {
        float2 t = *(const float2*)p;
        v[0] = t.x; v[1] = t.y;
    } else {
        v[0] = p[0];
    }
}

template <int DK>
__global__ void __launch_bounds__(256, 1) gdn_chunk_state(
        const float* __restrict__ W, const float* __restrict__ Mq, const float* __restrict__ Kd,
        const float* __restrict__ U, const float* __restrict__ PU, const float* __restrict__ decay,
        float* __restrict__ state, float* __restrict__ out, int nch, int t_begin, int T, int n_v, int DV) {
    pdl_entry();
    constexpr int RA = DK / 32;            // state rows a thread
    constexpr int NKT = DK / 32;           // [W; Mq] key tiles a chunk
    constexpr int NTILE = NKT + 2;         // and two Kd token tiles
    constexpr int LDW = 36;                // row stride of a staged [W; Mq] tile: 4 rows' float4 in distinct banks
    constexpr int LDK = DK + 4;            // row stride of a staged Kd tile
    constexpr int LDV = 36;                // row stride of Vs
    constexpr int STAGE = 128 * LDW > 32 * LDK ? 128 * LDW : 32 * LDK;
    constexpr int KQ = DK / 4;             // float4 in a Kd row
    constexpr int KDL = 32 * KQ / 256;     // float4 a thread loads of a Kd tile (DK / 32: 1, 2 or 4)
    __shared__ __align__(16) float Ss[DK * 32];    // state slice, row-major (DK x 32)
    __shared__ __align__(16) float Vs[GDN_CH * LDV];  // corrected values of the chunk (64 x 32)
    __shared__ __align__(16) float St[STAGE];      // the staged tile
    const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
    const int slices = (DV + 31) / 32;
    const int j = blockIdx.x / slices, c0 = (blockIdx.x % slices) * 32;
    float* sp = state + (i64)j * DK * DV;
    float Sr[RA][4];
#pragma unroll
    for (int a = 0; a < RA; a++) {
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int col = c0 + 4 * tx + b;
            Sr[a][b] = col < DV ? sp[(i64)(RA * ty + a) * DV + col] : 0.0f;
        }
        *(float4*)&Ss[(RA * ty + a) * 32 + 4 * tx] = make_float4(Sr[a][0], Sr[a][1], Sr[a][2], Sr[a][3]);
    }

    float4 pf[4];  // the next tile, in flight
    // a [W; Mq] tile: float4 i of a thread is row wr + 32 i (i < 2: W, else Mq), keys 4 wk ..;
    // a Kd tile: float4 i is token kt + (256 / KQ) i, keys 4 kk4 ..
    const int wr = tid >> 3, wk = tid & 7, kt = tid / KQ, kk4 = tid % KQ;
    auto fetch = [&](int c, int q) {
        const i64 rb = ((i64)j * nch + c) * GDN_CH;
        if (q < NKT) {
            const float* w0 = W + (rb + wr) * DK + 32 * q + 4 * wk;
            const float* m0 = Mq + (rb + wr) * DK + 32 * q + 4 * wk;
            pf[0] = *(const float4*)w0;
            pf[1] = *(const float4*)(w0 + 32 * DK);
            pf[2] = *(const float4*)m0;
            pf[3] = *(const float4*)(m0 + 32 * DK);
        } else {
            const float* k0 = Kd + (rb + 32 * (q - NKT) + kt) * DK + 4 * kk4;
#pragma unroll
            for (int i = 0; i < KDL; i++) pf[i] = *(const float4*)(k0 + (i64)(256 / KQ) * i * DK);
        }
    };
    auto stash = [&](int q) {
        if (q < NKT) {
#pragma unroll
            for (int i = 0; i < 4; i++) *(float4*)&St[(wr + 32 * i) * LDW + 4 * wk] = pf[i];
        } else {
#pragma unroll
            for (int i = 0; i < KDL; i++) *(float4*)&St[(kt + (256 / KQ) * i) * LDK + 4 * kk4] = pf[i];
        }
    };

    if (nch > 0) fetch(0, 0);
    for (int c = 0; c < nch; c++) {
        const i64 rb = ((i64)j * nch + c) * GDN_CH;
        // this thread's U and PU entries and the chunk decay, loaded before the matmul needs them
        float uu[2][4], pp[2][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) {
                int r = ty + 32 * a, col = c0 + 4 * tx + b;
                uu[a][b] = col < DV ? U[(rb + r) * DV + col] : 0.0f;
                pp[a][b] = col < DV ? PU[(rb + r) * DV + col] : 0.0f;
            }
        const float dc = decay[(i64)j * nch + c];
        float acc[4][4];
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) acc[a][b] = 0.0f;
        const int t0 = t_begin + c * GDN_CH;
        const int n = min(GDN_CH, T - t0);
#pragma unroll 1
        for (int q = 0; q < NTILE; q++) {
            if (q == NKT) {
                // [W; Mq] S0 is complete: Vnew = U - W S0 into shared (published by the barrier below),
                // outputs O = Mq S0 + PU for the valid rows, and the state decays before its update.
#pragma unroll
                for (int a = 0; a < 2; a++) {
                    int r = ty + 32 * a;
                    *(float4*)&Vs[r * LDV + 4 * tx] = make_float4(uu[a][0] - acc[a][0], uu[a][1] - acc[a][1],
                                                                 uu[a][2] - acc[a][2], uu[a][3] - acc[a][3]);
#pragma unroll
                    for (int b = 0; b < 4; b++) {
                        int col = c0 + 4 * tx + b;
                        if (r < n && col < DV) out[((i64)(t0 + r) * n_v + j) * DV + col] = acc[2 + a][b] + pp[a][b];
                    }
                }
#pragma unroll
                for (int a = 0; a < RA; a++)
#pragma unroll
                    for (int b = 0; b < 4; b++) Sr[a][b] *= dc;
            }
            __syncthreads();  // the staging buffer is free (and Ss, Vs written before are published)
            stash(q);
            if (q + 1 < NTILE) fetch(c, q + 1);
            else if (c + 1 < nch) fetch(c + 1, 0);
            __syncthreads();
            if (q < NKT) {
                // [W; Mq] (128 x 32 keys) times S0's rows 32q.. (32 x 32), four keys a step
                const int s0 = 32 * q;
#pragma unroll 1
                for (int kk = 0; kk < 32; kk += 4) {
                    float4 w[4], s[4];
#pragma unroll
                    for (int a = 0; a < 4; a++) w[a] = *(const float4*)&St[(ty + 32 * a) * LDW + kk];
#pragma unroll
                    for (int i = 0; i < 4; i++) s[i] = *(const float4*)&Ss[(s0 + kk + i) * 32 + 4 * tx];
#pragma unroll
                    for (int a = 0; a < 4; a++) {
                        const float wa[4] = {w[a].x, w[a].y, w[a].z, w[a].w};
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            acc[a][0] = fmaf(wa[i], s[i].x, acc[a][0]);
                            acc[a][1] = fmaf(wa[i], s[i].y, acc[a][1]);
                            acc[a][2] = fmaf(wa[i], s[i].z, acc[a][2]);
                            acc[a][3] = fmaf(wa[i], s[i].w, acc[a][3]);
                        }
                    }
                }
            } else {
                // S += Kd^T Vnew over 32 tokens of the chunk
                const int h = 32 * (q - NKT);
#pragma unroll 8
                for (int tt = 0; tt < 32; tt++) {
                    float kv[RA];
                    ld_rows<RA>(&St[tt * LDK + RA * ty], kv);
                    const float4 vv = *(const float4*)&Vs[(h + tt) * LDV + 4 * tx];
#pragma unroll
                    for (int a = 0; a < RA; a++) {
                        Sr[a][0] = fmaf(kv[a], vv.x, Sr[a][0]);
                        Sr[a][1] = fmaf(kv[a], vv.y, Sr[a][1]);
                        Sr[a][2] = fmaf(kv[a], vv.z, Sr[a][2]);
                        Sr[a][3] = fmaf(kv[a], vv.w, Sr[a][3]);
                    }
                }
            }
        }
        // the updated state into shared for the next chunk's [W; Mq] S0 (read after two barriers)
#pragma unroll
        for (int a = 0; a < RA; a++)
            *(float4*)&Ss[(RA * ty + a) * 32 + 4 * tx] = make_float4(Sr[a][0], Sr[a][1], Sr[a][2], Sr[a][3]);
    }
#pragma unroll
    for (int a = 0; a < RA; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int col = c0 + 4 * tx + b;
            if (col < DV) sp[(i64)(RA * ty + a) * DV + col] = Sr[a][b];
        }
}
