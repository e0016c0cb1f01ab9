// Fused kernels of the single-token decode path: each replaces a chain of small launches between two
// matmuls. Their specification is the composition of basic ops in engine/backends/base.py
// (FusedOpsMixin) and numpy_backend.py; each computes the same fp32 arithmetic as the kernels it
// replaces (only reduction orders differ).
//
// rms_norm_q8      rms_norm (MODE 0) or add_rms_norm (MODE 1) of rows of N values (N % 32 == 0), also
//                  writing the q8_1 quantization of the output (the next DP4A matmul's input).
// swiglu_q8        silu(gate) * up, with its q8_1 quantization.
// gdn_decode       one token of a Gated DeltaNet mixer, one block per value head: conv1d + SiLU with the
//                  conv state update, L2 norms of q and k, q scale, gates, the delta-rule step on the
//                  state in place, gated RMSNorm, and the q8_1 quantization of the output.
// attn_prep        one token of gated attention before the scores: q/gate split, q and k RMSNorm,
//                  partial NEOX (M-)RoPE, K/V append to the cache.
// attn_merge_gate  flash_decode's split merge (attention.cu flash_merge) times sigmoid(gate), with q8_1.
//
// q8_1 blocks are written with q8_1_block (common.cuh), so they equal quantize_q8_1 of the fp32 output.

#define RMS_MAXV 16  // values per thread kept in registers: rows up to 1024 * 16 = 16384 values

template <int MODE>
__global__ void __launch_bounds__(1024) rms_norm_q8(const float* __restrict__ x, const float* __restrict__ delta,
                            const float* __restrict__ w, float* __restrict__ out, float* __restrict__ s_out,
                            i8* __restrict__ xq, float* __restrict__ xd, float* __restrict__ xs, int N,
                            float eps) {
    // One block per row; blockDim and N are multiples of 32, so value i = k * blockDim + tid puts whole
    // 32-value q8 blocks in each warp. Rows of up to RMS_MAXV * blockDim values stay in registers between
    // the sum of squares and the output (every load is issued before the first reduction); longer rows
    // re-read global memory in a second pass.
    __shared__ float scratch[32];
    int tid = threadIdx.x, nth = blockDim.x, lane = tid & 31;
    i64 base = (i64)blockIdx.x * N;
    bool in_regs = N <= RMS_MAXV * nth;
    float v[RMS_MAXV], wv[RMS_MAXV];
    float ss = 0.0f;
    if (in_regs) {
#pragma unroll
        for (int k = 0; k < RMS_MAXV; k++) {
            int i = k * nth + tid;
            v[k] = 0.0f;
            wv[k] = 1.0f;
            if (i < N) {
                v[k] = x[base + i];
                if (MODE == 1) v[k] += delta[base + i];
                if (w != 0) wv[k] = w[i];
            }
        }
#pragma unroll
        for (int k = 0; k < RMS_MAXV; k++) {
            int i = k * nth + tid;
            if (i < N) {
                if (MODE == 1) s_out[base + i] = v[k];
                ss += v[k] * v[k];
            }
        }
    } else {
        for (int i = tid; i < N; i += nth) {
            float t = x[base + i];
            if (MODE == 1) {
                t += delta[base + i];
                s_out[base + i] = t;
            }
            ss += t * t;
        }
    }
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / (float)N + eps);
    if (in_regs) {
#pragma unroll
        for (int k = 0; k < RMS_MAXV; k++) {
            int i = k * nth + tid;
            if (i < N) {  // the same for all 32 lanes of a warp
                float o = v[k] * inv;
                if (w != 0) o *= wv[k];
                out[base + i] = o;
                i64 b = (base + i) >> 5;
                q8_1_block(o, xq + b * 32, xd + b, xs + b, lane);
            }
        }
    } else {
        for (int i = tid; i < N; i += nth) {
            float t = (MODE == 1) ? s_out[base + i] : x[base + i];
            float o = t * inv;
            if (w != 0) o *= w[i];
            out[base + i] = o;
            i64 b = (base + i) >> 5;
            q8_1_block(o, xq + b * 32, xd + b, xs + b, lane);
        }
    }
}

extern "C" __global__ void swiglu_q8(const float* __restrict__ gate, const float* __restrict__ up,
                                     float* __restrict__ out, i8* __restrict__ xq, float* __restrict__ xd,
                                     float* __restrict__ xs, i64 n_blocks) {
    i64 blk = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= n_blocks) return;  // whole warps leave together
    int lane = threadIdx.x & 31;
    i64 i = blk * 32 + lane;
    float r = silu_f(gate[i]) * up[i];
    out[i] = r;
    q8_1_block(r, xq + blk * 32, xd + blk, xs + blk, lane);
}

// ---- Gated DeltaNet, one token ----------------------------------------------------------------------
// Block j (128 threads) serves value head j and its key head kh = j % n_k. Thread c < DV owns column c of
// the head's state S (DK floats in registers, as gdn_scan in gdn.cu):
//   e = S^T k, r = S^T q, a = exp(g), d = beta (v - a e), S <- a S + k d^T, o = a r + (k . q) d.
// Conv state: the v channels of head j belong to block j alone and are shifted in place. The q/k channels
// of key head kh are read by every block with j % n_k == kh, so they must be shifted only after all of
// those blocks have read them: each block counts itself in counters[kh] after its reads, and the last one
// writes the shifted rows (kept in shared memory) and resets the counter to 0 for the next launch. No
// block waits for another.

#define GDN_MAX_KW 8

template <int DK>
__global__ void __launch_bounds__(128) gdn_decode(
        const float* __restrict__ mixed, const float* __restrict__ z, const float* __restrict__ bet,
        const float* __restrict__ alpha, float* __restrict__ conv_state, const float* __restrict__ conv_w,
        const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, const float* __restrict__ norm_w,
        float* __restrict__ state, float* __restrict__ y, i8* __restrict__ xq, float* __restrict__ xd,
        float* __restrict__ xs, int* __restrict__ counters, int n_k, int n_v, int DV, int KW, float q_scale,
        float eps) {
    __shared__ __align__(16) float qs[DK];
    __shared__ __align__(16) float ks[DK];
    __shared__ float vs[128];
    __shared__ float newst[(GDN_MAX_KW - 1) * 2 * DK];
    __shared__ float scratch[32];
    __shared__ int s_last;
    int tid = threadIdx.x, lane = tid & 31;
    int j = blockIdx.x, kh = j % n_k;
    int key_dim = n_k * DK;
    int C = 2 * key_dim + n_v * DV;

    // 1. causal depthwise conv + SiLU of this head's 2 DK + DV channels (taps in the order of conv1d_silu)
    for (int idx = tid; idx < 2 * DK + DV; idx += blockDim.x) {
        int ch = idx < DK ? kh * DK + idx
                          : (idx < 2 * DK ? key_dim + kh * DK + (idx - DK) : 2 * key_dim + j * DV + (idx - 2 * DK));
        float hist[GDN_MAX_KW];
        float acc = 0.0f;
#pragma unroll
        for (int r = 0; r < GDN_MAX_KW - 1; r++) {
            if (r < KW - 1) {
                hist[r] = conv_state[(i64)r * C + ch];
                acc = fmaf(hist[r], conv_w[(i64)ch * KW + r], acc);
            }
        }
        float xin = mixed[ch];
        acc = fmaf(xin, conv_w[(i64)ch * KW + KW - 1], acc);
        float u = silu_f(acc);
        if (idx < DK) qs[idx] = u;
        else if (idx < 2 * DK) ks[idx - DK] = u;
        else vs[idx - 2 * DK] = u;
        // shifted state: row r <- old row r + 1, last row <- this token's input
#pragma unroll
        for (int r = 0; r < GDN_MAX_KW - 1; r++) {
            if (r < KW - 1) {
                float nv = (r + 1 < KW - 1) ? hist[r + 1] : xin;
                if (idx >= 2 * DK) conv_state[(i64)r * C + ch] = nv;
                else newst[r * 2 * DK + idx] = nv;
            }
        }
    }
    __syncthreads();  // every read of the q/k conv state of this block is done (values in shared memory)
    if (tid == 0) {
        int readers = (n_v - 1 - kh) / n_k + 1;  // blocks j' < n_v with j' % n_k == kh
        __threadfence();
        int prev = atomicAdd(&counters[kh], 1);
        s_last = (prev == readers - 1);
        if (s_last) atomicExch(&counters[kh], 0);
    }
    __syncthreads();
    if (s_last) {
        for (int idx = tid; idx < 2 * DK; idx += blockDim.x) {
            int ch = idx < DK ? kh * DK + idx : key_dim + kh * DK + (idx - DK);
            for (int r = 0; r < KW - 1; r++) conv_state[(i64)r * C + ch] = newst[r * 2 * DK + idx];
        }
    }

    // 2. L2 norms of q and k, q scaled by 1/sqrt(DK) (l2_norm then scale)
    float sq = 0.0f, sk = 0.0f;
    for (int i = tid; i < DK; i += blockDim.x) {
        sq += qs[i] * qs[i];
        sk += ks[i] * ks[i];
    }
    sq = block_sum(sq, scratch);
    sk = block_sum(sk, scratch);
    float rq = rsqrtf(sq + eps), rk = rsqrtf(sk + eps);
    for (int i = tid; i < DK; i += blockDim.x) {
        qs[i] = (qs[i] * rq) * q_scale;
        ks[i] = ks[i] * rk;
    }
    __syncthreads();

    // 3. gates (gdn_gates)
    float g = ssm_a[j] * softplus_f(alpha[j] + dt_bias[j]);
    float beta = sigmoid_f(bet[j]);

    // 4. delta-rule step, thread c owns column c
    int c = tid;
    bool active = c < DV;
    float o = 0.0f;
    if (active) {
        float* sp = state + (i64)j * DK * DV;
        float S[DK];
#pragma unroll
        for (int i = 0; i < DK; i++) S[i] = sp[(i64)i * DV + c];
        float e4[4] = {0.f, 0.f, 0.f, 0.f}, r4[4] = {0.f, 0.f, 0.f, 0.f}, kq4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < DK; i += 4) {
            float4 kk = *(const float4*)&ks[i];
            float4 qq = *(const float4*)&qs[i];
            e4[0] = fmaf(S[i], kk.x, e4[0]); e4[1] = fmaf(S[i + 1], kk.y, e4[1]);
            e4[2] = fmaf(S[i + 2], kk.z, e4[2]); e4[3] = fmaf(S[i + 3], kk.w, e4[3]);
            r4[0] = fmaf(S[i], qq.x, r4[0]); r4[1] = fmaf(S[i + 1], qq.y, r4[1]);
            r4[2] = fmaf(S[i + 2], qq.z, r4[2]); r4[3] = fmaf(S[i + 3], qq.w, r4[3]);
            kq4[0] = fmaf(kk.x, qq.x, kq4[0]); kq4[1] = fmaf(kk.y, qq.y, kq4[1]);
            kq4[2] = fmaf(kk.z, qq.z, kq4[2]); kq4[3] = fmaf(kk.w, qq.w, kq4[3]);
        }
        float e = (e4[0] + e4[1]) + (e4[2] + e4[3]);
        float r = (r4[0] + r4[1]) + (r4[2] + r4[3]);
        float kq = (kq4[0] + kq4[1]) + (kq4[2] + kq4[3]);
        float a = __expf(g);
        float d = beta * (vs[c] - a * e);
#pragma unroll
        for (int i = 0; i < DK; i += 4) {
            float4 kk = *(const float4*)&ks[i];
            S[i] = fmaf(a, S[i], kk.x * d); S[i + 1] = fmaf(a, S[i + 1], kk.y * d);
            S[i + 2] = fmaf(a, S[i + 2], kk.z * d); S[i + 3] = fmaf(a, S[i + 3], kk.w * d);
        }
#pragma unroll
        for (int i = 0; i < DK; i++) sp[(i64)i * DV + c] = S[i];
        o = fmaf(a, r, kq * d);
    }

    // 5. gated RMSNorm over the head: rms_norm(o) * w * silu(z)
    float ss = block_sum(active ? o * o : 0.0f, scratch);
    float inv = rsqrtf(ss / (float)DV + eps);
    float out = 0.0f;
    if (active) {
        out = o * inv;
        out *= norm_w[c];
        out *= silu_f(z[(i64)j * DV + c]);
        y[(i64)j * DV + c] = out;
    }
    // 6. q8_1 of the output (DV % 32 == 0 when xq is given: warps below DV are whole blocks)
    if (xq != 0 && (tid >> 5) * 32 < DV) {
        i64 b = ((i64)j * DV >> 5) + (tid >> 5);
        q8_1_block(out, xq + b * 32, xd + b, xs + b, lane);
    }
}

// ---- gated attention, one token ---------------------------------------------------------------------
// Blocks [0, nh): query head h of qg (per head [q (D) | gate (D)]) -> q_out (nh, D). Blocks [nh, nh + n_kv):
// key head h of k -> cache row `row` (or *row_ptr inside a captured graph), and its v row copied.
// Each: RMSNorm with weight (D,), then NEOX RoPE of the first n_rot dims as rope_neox (elementwise.cu)
// for T == 1: pos (3,) position components, comp[i] the component of pair i.

extern "C" __global__ void attn_prep(const float* __restrict__ qg, const float* __restrict__ k,
                                     const float* __restrict__ v, const float* __restrict__ q_norm,
                                     const float* __restrict__ k_norm, float* __restrict__ q_out,
                                     float* __restrict__ kc, float* __restrict__ vc,
                                     const int* __restrict__ row_ptr, int row, const int* __restrict__ pos,
                                     const int* __restrict__ comp, const float* __restrict__ inv_freq, int nh,
                                     int n_kv, int D, int DV, int n_rot, float inv_scale, float eps) {
    __shared__ float hs[256];
    __shared__ float scratch[32];
    int b = blockIdx.x, tid = threadIdx.x;
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
    float* dst = is_q ? q_out + (i64)h * D : kc + ((i64)row * n_kv + h) * D;
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
        dst[jd] = r;
    }
    if (!is_q)
        for (int i = tid; i < DV; i += blockDim.x) vc[((i64)row * n_kv + h) * DV + i] = v[(i64)h * DV + i];
}

// One block of D threads (D % 32 == 0) per head h: o = merge of the splits (as flash_merge), times
// sigmoid(gate) with gate = qg[h, D:2D]; xq given: the q8_1 quantization of the (nh * D) output row.
extern "C" __global__ void attn_merge_gate(const float* __restrict__ po, const float* __restrict__ pm,
                                           const float* __restrict__ pl, const float* __restrict__ qg,
                                           float* __restrict__ out, i8* __restrict__ xq, float* __restrict__ xd,
                                           float* __restrict__ xs, int n_splits, int nh, int D) {
    int h = blockIdx.x, c = threadIdx.x;
    float m = NEG_BIG;
    for (int s = 0; s < n_splits; s++) m = fmaxf(m, pm[(i64)s * nh + h]);
    float l = 0.0f;
    for (int s = 0; s < n_splits; s++) l += __expf(pm[(i64)s * nh + h] - m) * pl[(i64)s * nh + h];
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float acc = 0.0f;
    for (int s = 0; s < n_splits; s++) acc += __expf(pm[(i64)s * nh + h] - m) * po[((i64)s * nh + h) * D + c];
    float r = (acc * inv) * sigmoid_f(qg[(i64)h * 2 * D + D + c]);
    i64 i = (i64)h * D + c;
    out[i] = r;
    if (xq != 0) {
        i64 b = i >> 5;
        q8_1_block(r, xq + b * 32, xd + b, xs + b, threadIdx.x & 31);
    }
}
