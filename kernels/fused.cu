// Fused kernels of the single-token decode path: each replaces a chain of small launches between two
// matmuls. Their specification is the composition of basic ops in engine/backends/base.py
// (FusedOpsMixin) and numpy_backend.py; each computes the same fp32 arithmetic as the kernels it
// replaces (only reduction orders differ).
//
// rms_norm_q8      rms_norm (MODE 0) or add_rms_norm (MODE 1) of rows of N values (N % 32 == 0), also
//                  writing the q8_1 quantization of the output (the next DP4A matmul's input).
// swiglu_q8        silu(gate) * up, with its q8_1 quantization.
// gdn_decode       one token of a Gated DeltaNet mixer, a block per value head: conv1d + SiLU with the
//                  conv state update, L2 norms of q and k, q scale, gates, the delta-rule step on the
//                  state in place, gated RMSNorm, and the q8_1 quantization of the output.
// (attn_prep, the step before the scores, lives in attn_prep.cu: it writes the cache in its own type.)
// attn_merge_gate  flash_decode's split merge (attention.cu flash_merge) times sigmoid(gate), with q8_1.
// *_batch          the same for one token of each of B sequences in one launch (a grid dimension more;
//                  each sequence's states or cache found through a device table of pointers).
//
// q8_1 blocks are written with q8_1_block (common.cuh), so they equal quantize_q8_1 of the fp32 output.

template <int MODE>
__global__ void __launch_bounds__(256) rms_norm_q8(const float* __restrict__ x, const float* __restrict__ delta,
                            const float* __restrict__ w, float* __restrict__ out, float* __restrict__ s_out,
                            i8* __restrict__ xq, float* __restrict__ xd, float* __restrict__ xs, int N,
                            float eps) {
    // The weight of this thread's value in the block's first slice (a decode row's only one), read before
    // the wait: no kernel writes it, and read after the row's sum it put a DRAM round trip on every
    // norm's critical path.
    const int i0 = blockIdx.y * 256 + threadIdx.x;
    const float w0 = (w != 0 && i0 < N) ? w[i0] : 1.0f;
    pdl_entry();
    // Row blockIdx.x. Every block sums the squares of the whole row itself (in the same order in every
    // block: each thread's float4 chunks in turn, then block_sum, so all get the same bits), then
    // normalizes the 256-value slices blockIdx.y, blockIdx.y + gridDim.y, ... of it, a warp per q8_1
    // block. A decode row is spread over N / 256 blocks that wait for no one (one block of a row was a
    // serial chain: 4.5 us a norm inside the 9B decode graph, tools/profile_decode.py --ablate); prefill
    // rows take one block each (gridDim.y = 1), so the row is read from L2 once per row, not per slice.
    // N % 32 == 0; x, delta and their rows 16-byte aligned (float4 loads).
    __shared__ float scratch[32];
    const int tid = threadIdx.x, lane = tid & 31;
    const i64 base = (i64)blockIdx.x * N;
    const float4* x4 = (const float4*)(x + base);
    const float4* d4 = (const float4*)(delta + base);
    const int n4 = N >> 2;
    // this thread's value of its first slice, asked for beside the row's sum, not after it (an L2 round
    // trip less on the norm's chain)
    float v0 = 0.0f;
    if (i0 < N) {
        v0 = x[base + i0];
        if (MODE == 1) v0 += delta[base + i0];
    }
    float ss = 0.0f;
#pragma unroll 4
    for (int i = tid; i < n4; i += 256) {
        float4 a = x4[i];
        if (MODE == 1) {
            float4 b = d4[i];
            a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
        }
        ss += a.x * a.x;
        ss += a.y * a.y;
        ss += a.z * a.z;
        ss += a.w * a.w;
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)N + eps);
    for (int s0 = blockIdx.y * 256; s0 < N; s0 += gridDim.y * 256) {
        int i = s0 + tid;
        if (i < N) {  // whole warps: N % 32 == 0
            float v = v0;
            if (i != i0) {
                v = x[base + i];
                if (MODE == 1) v += delta[base + i];
            }
            if (MODE == 1) s_out[base + i] = v;
            float o = v * inv;
            if (w != 0) o *= i == i0 ? w0 : w[i];
            out[base + i] = o;
            i64 b = (base + i) >> 5;
            q8_1_block(o, xq + b * 32, xd + b, xs + b, lane);
        }
    }
}

extern "C" __global__ void swiglu_q8(const float* __restrict__ gate, const float* __restrict__ up,
                                     float* __restrict__ out, i8* __restrict__ xq, float* __restrict__ xd,
                                     float* __restrict__ xs, i64 n_blocks) {
    pdl_entry();
    i64 blk = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= n_blocks) return;  // whole warps leave together
    int lane = threadIdx.x & 31;
    i64 i = blk * 32 + lane;
    float r = silu_f(gate[i]) * up[i];
    out[i] = r;
    q8_1_block(r, xq + blk * 32, xd + blk, xs + blk, lane);
}

// ---- Gated DeltaNet, one token ----------------------------------------------------------------------
// Grid (n_v): block j of 128 ceil(DV / 32) threads serves value head j, whose key head is kh = j % n_k.
// Lane l of warp w owns value column c = 32 (w / 4) + l and state rows (w % 4) DK/4 .. (w % 4 + 1) DK/4 - 1
// (registers; each warp reads and writes whole 128-byte row segments):
//   e = S^T k, r = S^T q (4 partial sums over the row quarters), a = exp(g), d = beta (v - a e),
//   S <- a S + k d^T, o = a r + (k . q) d,
// then the gated RMSNorm over the head's DV outputs and their q8_1 blocks, all inside the block: no block
// waits for another, and no output makes a round trip through memory before it is normalized.
// One sequence (gdn_decode, LATE false): the state loads are issued first, before the kernel's wait for
// the one ahead of it, and the norm's z and weights next, so their latency overlaps the conv, the norms
// and the gates, which every block recomputes for its key head (q, k) and its own v channels; 98-102
// registers a thread (88-100 with the loads after the wait), one block a multiprocessor, and only n_v
// blocks in all. A batch (gdn_decode_batch, LATE true: n_v x B blocks) loads the state after the conv
// instead: 64 registers, so two blocks share a multiprocessor and one block's state stream overlaps the
// other's conv and delta-rule step. H200, 9B shape, states out of L2 (tools/bench_gdn_decode.py,
// docs/BENCHMARKS.md v37): 8 sequences 18.8 -> 13.7 us (44 -> 60% of the copy bandwidth), 32 sequences
// 63.8 -> 43.8 us (52 -> 76%); one sequence keeps the early loads (6.9 us either way).
// Conv state: the v channels of head j belong to block j alone and are shifted in place. The q/k
// channels of key head kh are read by every block with j % n_k == kh, so they must be shifted only after
// all of those blocks have read them: each block counts itself in counters[kh] once its reads are done
// (their values are in shared memory), and the block that counts last writes the shifted rows (kept in
// shared memory) at its end and resets the counter to 0 for the next launch. The count's result is first
// needed at the block's end, so its round trip overlaps the delta-rule step.

#define GDN_MAX_KW 8
#define GDN_MAX_DV 128  // fused.py GDN_MAX_DV: 4 column warps of 4 row-quarter warps, 512 threads

// block_sum of three values at once, behind one barrier: every warp adds the warps' partial sums itself, in
// the same order, so every thread gets the same sums (scratch is written once: one call per kernel)
__device__ __forceinline__ void block_sum3(float& a, float& b, float& c, float (*scratch)[32]) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    c = warp_sum(c);
    if (lane == 0) scratch[0][wid] = a, scratch[1][wid] = b, scratch[2][wid] = c;
    __syncthreads();
    a = lane < nw ? scratch[0][lane] : 0.0f;
    b = lane < nw ? scratch[1][lane] : 0.0f;
    c = lane < nw ? scratch[2][lane] : 0.0f;
    a = warp_sum(a);
    b = warp_sum(b);
    c = warp_sum(c);
}

// The first of the state rows that thread (w, l) of block j updates: value column c = 32 (w / 4) + l,
// rows (w % 4) DK/4 .. of value head j (state: (n_v, DK, DV) fp32).
template <int DK>
__device__ __forceinline__ float* gdn_state_rows(float* state, int DV) {
    const int tid = threadIdx.x, wq = (tid >> 5) & 3, c = (tid >> 7) * 32 + (tid & 31);
    return state + (i64)blockIdx.x * DK * DV + (i64)(wq * (DK / 4)) * DV + c;
}

// The channel of conv index idx of block j (key head kh) in a row of `mixed`: idx < DK the head's q
// channels, then its k channels, then value head j's DV channels.
template <int DK>
__device__ __forceinline__ int gdn_conv_channel(int idx, int kh, int j, int key_dim, int DV) {
    return idx < DK ? kh * DK + idx : (idx < 2 * DK ? key_dim + kh * DK + (idx - DK) : 2 * key_dim + j * DV + (idx - 2 * DK));
}

// This thread's DK/4 state values (zeros for a column past DV).
template <int DK>
__device__ __forceinline__ void gdn_load_state(const float* sp, int DV, float (&S)[DK / 4]) {
    const bool col = (threadIdx.x >> 7) * 32 + (threadIdx.x & 31) < DV;
#pragma unroll
    for (int i = 0; i < DK / 4; i++) S[i] = col ? sp[(i64)i * DV] : 0.0f;
}

// Before the wait, ask L2 for what the block reads that no kernel ahead of it writes: its conv channel's
// taps and history (thread tid's first channel of the conv loop below; only this kernel writes the conv
// state, and its launch for the token before has ended), the head's gate constants and norm weights, and
// with `state` the thread's state rows (a warp's rows are whole 128-byte lines, one a lane). Those loads,
// after the wait, then come from L2, not DRAM: the conv's and (for a batch, LATE) the state's round trip
// leave the chain that runs after the projections' matmul.
template <int DK>
__device__ __forceinline__ void gdn_prefetch(const float* __restrict__ conv_state, const float* __restrict__ conv_w,
                                             const float* __restrict__ ssm_a, const float* __restrict__ dt_bias,
                                             const float* __restrict__ norm_w, const float* __restrict__ state,
                                             int n_k, int n_v, int DV, int KW) {
    const int tid = threadIdx.x, j = blockIdx.x, kh = j % n_k;
    const int key_dim = n_k * DK, C = 2 * key_dim + n_v * DV;
    if (tid < 2 * DK + DV) {
        const int ch = gdn_conv_channel<DK>(tid, kh, j, key_dim, DV);
        prefetch_line(conv_w + (i64)ch * KW);
        for (int r = 0; r < KW - 1; r++) prefetch_line(conv_state + (i64)r * C + ch);
    }
    if (tid == 0) prefetch_line(ssm_a + j), prefetch_line(dt_bias + j);
    if (tid < DV && (tid & 31) == 0) prefetch_line(norm_w + tid);
    if (state != 0) {
        const int lane = tid & 31, wq = (tid >> 5) & 3, c0 = (tid >> 7) * 32;
        if (c0 < DV)
            for (int i = lane; i < DK / 4; i += 32)
                prefetch_line(state + (i64)j * DK * DV + (i64)(wq * (DK / 4) + i) * DV + c0);
    }
}

template <int DK, bool LATE>
__device__ __forceinline__ void gdn_decode_body(
        const float* __restrict__ mixed, const float* __restrict__ z, const float* __restrict__ bet,
        const float* __restrict__ alpha, float* __restrict__ conv_state, const float* __restrict__ conv_w,
        const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, const float* __restrict__ norm_w,
        float* __restrict__ state, float* __restrict__ y, i8* __restrict__ xq, float* __restrict__ xd,
        float* __restrict__ xs, int* __restrict__ counters, int n_k, int n_v, int DV, int KW, float q_scale,
        float eps, const float (&S0)[DK / 4]) {
    constexpr int RW = DK / 4;                        // state rows per warp
    __shared__ __align__(16) float qs[DK];
    __shared__ __align__(16) float ks[DK];
    __shared__ float vs[GDN_MAX_DV];
    __shared__ float newst[(GDN_MAX_KW - 1) * 2 * DK];
    __shared__ float pe[4][GDN_MAX_DV], pr[4][GDN_MAX_DV];
    __shared__ float os[GDN_MAX_DV];
    __shared__ float scratch[32];
    __shared__ float scratch3[3][32];
    __shared__ int s_last;
    const int tid = threadIdx.x, lane = tid & 31, wq = (tid >> 5) & 3;
    const int c = (tid >> 7) * 32 + lane;
    const int j = blockIdx.x, kh = j % n_k;
    const int key_dim = n_k * DK;
    const int C = 2 * key_dim + n_v * DV;
    const bool col = c < DV;

    // 0. the gate inputs and the norm's inputs for column tid (this thread's state rows of column c: in S
    //    already, read by gdn_decode before its wait, or read below after the conv, LATE)
    float* sp = state + (i64)j * DK * DV + (i64)(wq * RW) * DV + c;  // = gdn_state_rows
    float S[RW];
    if constexpr (!LATE) {
#pragma unroll
        for (int i = 0; i < RW; i++) S[i] = S0[i];
    }
    const float a_raw = ssm_a[j], al = alpha[j], dtb = dt_bias[j], braw = bet[j];
    const float zt = tid < DV ? z[(i64)j * DV + tid] : 0.0f;
    const float nw = tid < DV ? norm_w[tid] : 0.0f;

    // 1. causal depthwise conv + SiLU of the 2 DK q/k channels and the DV v channels
    const int nconv = 2 * DK + DV;
    for (int idx = tid; idx < nconv; idx += blockDim.x) {
        const int ch = gdn_conv_channel<DK>(idx, kh, j, key_dim, DV);
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
    if constexpr (LATE) {
#pragma unroll
        for (int i = 0; i < RW; i++) S[i] = col ? sp[(i64)i * DV] : 0.0f;
    }
    int prev = 0;
    if (tid == 0) prev = atomicAdd(&counters[kh], 1);  // used at the end

    // 2. L2 norms of q and k, q scaled by 1/sqrt(DK) (l2_norm then scale), and k . q of the normalized
    //    vectors from the same sums: (k_raw . q_raw) rk rq q_scale (one block reduction for all three)
    float sq = 0.0f, sk = 0.0f, sqk = 0.0f;
    for (int i = tid; i < DK; i += blockDim.x) {
        float qv = qs[i], kv = ks[i];
        sq = fmaf(qv, qv, sq);
        sk = fmaf(kv, kv, sk);
        sqk = fmaf(qv, kv, sqk);
    }
    block_sum3(sq, sk, sqk, scratch3);
    float rq = rsqrtf(sq + eps), rk = rsqrtf(sk + eps);
    const float kq = ((sqk * rk) * rq) * q_scale;
    for (int i = tid; i < DK; i += blockDim.x) {
        qs[i] = (qs[i] * rq) * q_scale;
        ks[i] = ks[i] * rk;
    }
    __syncthreads();

    // 3. gates (gdn_gates)
    float g = a_raw * softplus_f(al + dtb);
    float beta = sigmoid_f(braw);

    // 4. delta-rule step on rows wq RW.. of column c
    const float* kw_ = ks + wq * RW;
    const float* qw_ = qs + wq * RW;
    float e2[2] = {0.f, 0.f}, r2[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < RW; i++) {
        e2[i & 1] = fmaf(S[i], kw_[i], e2[i & 1]);
        r2[i & 1] = fmaf(S[i], qw_[i], r2[i & 1]);
    }
    if (col) {
        pe[wq][c] = e2[0] + e2[1];
        pr[wq][c] = r2[0] + r2[1];
    }
    __syncthreads();
    if (col) {
        float e = (pe[0][c] + pe[1][c]) + (pe[2][c] + pe[3][c]);
        float r = (pr[0][c] + pr[1][c]) + (pr[2][c] + pr[3][c]);
        float a = __expf(g);
        float d = beta * (vs[c] - a * e);
#pragma unroll
        for (int i = 0; i < RW; i++) sp[(i64)i * DV] = fmaf(a, S[i], kw_[i] * d);
        if (wq == 0) os[c] = fmaf(a, r, kq * d);
    }
    __syncthreads();

    // 5. gated RMSNorm over the head: rms_norm(o) * w * silu(z), then the q8_1 blocks
    //    (DV % 32 == 0 when xq is given: warps below DV are whole blocks)
    float ov = tid < DV ? os[tid] : 0.0f;
    float ss = block_sum(ov * ov, scratch);
    float inv = rsqrtf(ss / (float)DV + eps);
    float out = 0.0f;
    if (tid < DV) {
        out = ov * inv;
        out *= nw;
        out *= silu_f(zt);
        y[(i64)j * DV + tid] = out;
    }
    if (xq != 0 && (tid >> 5) * 32 < DV) {
        i64 b = ((i64)j * DV >> 5) + (tid >> 5);
        q8_1_block(out, xq + b * 32, xd + b, xs + b, lane);
    }

    // 6. the block that counted last among the readers of key head kh shifts its q/k conv state
    if (tid == 0) {
        int readers = (n_v - 1 - kh) / n_k + 1;  // blocks j' with j' % n_k == kh
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
}

// The kernel reads its state rows first, before the wait: only this kernel writes a layer's state, and its
// launch for the token before has ended (graphs and eager steps follow each other in the stream), so they
// are read while the projections' GEMV ahead of it finishes (programmatic dependent launch).
template <int DK>
__global__ void __launch_bounds__(512) gdn_decode(
        const float* __restrict__ mixed, const float* __restrict__ z, const float* __restrict__ bet,
        const float* __restrict__ alpha, float* __restrict__ conv_state, const float* __restrict__ conv_w,
        const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, const float* __restrict__ norm_w,
        float* __restrict__ state, float* __restrict__ y, i8* __restrict__ xq, float* __restrict__ xd,
        float* __restrict__ xs, int* __restrict__ counters, int n_k, int n_v, int DV, int KW, float q_scale,
        float eps) {
    float S[DK / 4];
    gdn_prefetch<DK>(conv_state, conv_w, ssm_a, dt_bias, norm_w, 0, n_k, n_v, DV, KW);
    gdn_load_state<DK>(gdn_state_rows<DK>(state, DV), DV, S);
    pdl_entry();
    gdn_decode_body<DK, false>(mixed, z, bet, alpha, conv_state, conv_w, ssm_a, dt_bias, norm_w, state, y, xq, xd, xs,
                        counters, n_k, n_v, DV, KW, q_scale, eps, S);
}

// gdn_decode for one token of each of B sequences in one launch, grid (n_v, B): blockIdx.y is the
// sequence s, whose rows of mixed (B, C), z and y (B, n_v DV), bet and alpha (B, n_v) sit at row s, whose
// conv and delta-rule states are conv_states[s] and states[s] (device pointer tables: each sequence's
// states stay where its session allocated them), and whose counters are the n_k at counters + s n_k.
// The q8_1 blocks of row s follow those of row s - 1 (quantize_q8_1 of (B, n_v DV)).
template <int DK>
__global__ void __launch_bounds__(512, 2) gdn_decode_batch(
        const float* __restrict__ mixed, const float* __restrict__ z, const float* __restrict__ bet,
        const float* __restrict__ alpha, float* const* __restrict__ conv_states, const float* __restrict__ conv_w,
        const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, const float* __restrict__ norm_w,
        float* const* __restrict__ states, float* __restrict__ y, i8* __restrict__ xq, float* __restrict__ xd,
        float* __restrict__ xs, int* __restrict__ counters, int n_k, int n_v, int DV, int KW, float q_scale,
        float eps) {
    i64 s = blockIdx.y;
    gdn_prefetch<DK>(conv_states[s], conv_w, ssm_a, dt_bias, norm_w, states[s], n_k, n_v, DV, KW);
    pdl_entry();
    const float none[DK / 4] = {};  // the state is loaded after the conv (LATE), from L2
    i64 C = 2 * (i64)n_k * DK + (i64)n_v * DV, HV = (i64)n_v * DV;
    gdn_decode_body<DK, true>(mixed + s * C, z + s * HV, bet + s * n_v, alpha + s * n_v, conv_states[s], conv_w, ssm_a,
                        dt_bias, norm_w, states[s], y + s * HV, xq != 0 ? xq + s * HV : xq,
                        xd != 0 ? xd + s * (HV >> 5) : xd, xs != 0 ? xs + s * (HV >> 5) : xs,
                        counters + s * n_k, n_k, n_v, DV, KW, q_scale, eps, none);
}

// Grid (nh, D / MERGE_COLS) of MERGE_THREADS threads (ops.py merge_grid), a block per head h and
// MERGE_COLS columns: o = the merge of the splits (common.cuh merge_head_splits, as flash_merge), times
// sigmoid(gate) with gate = qg[h, D:2D]; xq given: the q8_1 quantization of the (nh * D) output row.
// Only the splits that hold keys are read (common.cuh fd_live_splits).
__device__ __forceinline__ void attn_merge_gate_body(
        const float* __restrict__ po, const float* __restrict__ pm, const float* __restrict__ pl,
        const float* __restrict__ qg, float* __restrict__ out, i8* __restrict__ xq, float* __restrict__ xd,
        float* __restrict__ xs, int n_splits, int nh, int D, int kv_len, const int* __restrict__ kv_len_ptr,
        int split_len) {
    const int h = blockIdx.x, c = blockIdx.y * MERGE_COLS + threadIdx.x;
    const int ns = fd_live_splits(n_splits, kv_len, kv_len_ptr, split_len);
    float r = merge_head_splits(po, pm, pl, ns, nh, h, D, blockIdx.y * MERGE_COLS);
    if (threadIdx.x >= MERGE_COLS) return;
    r *= sigmoid_f(qg[(i64)h * 2 * D + D + c]);
    const i64 i = (i64)h * D + c;
    out[i] = r;
    if (xq != 0) {
        const i64 b = i >> 5;
        q8_1_block(r, xq + b * 32, xd + b, xs + b, threadIdx.x & 31);
    }
}

extern "C" __global__ __launch_bounds__(MERGE_THREADS) void attn_merge_gate(
                                           const float* __restrict__ po, const float* __restrict__ pm,
                                           const float* __restrict__ pl, const float* __restrict__ qg,
                                           float* __restrict__ out, i8* __restrict__ xq, float* __restrict__ xd,
                                           float* __restrict__ xs, int n_splits, int nh, int D, int kv_len,
                                           const int* __restrict__ kv_len_ptr, int split_len) {
    pdl_entry();
    attn_merge_gate_body(po, pm, pl, qg, out, xq, xd, xs, n_splits, nh, D, kv_len, kv_len_ptr, split_len);
}

// attn_merge_gate for one token of each of B sequences, grid (nh, D / MERGE_COLS, B): blockIdx.z is the
// sequence s, whose partials are the (n_splits, nh) slab s of flash_decode_batch's po / pm / pl, whose
// qg, out and q8_1 blocks sit at row s, and whose context length is kv_lens[s] + 1 (the length before this
// token's append, as in a captured graph: the splits were sized on the device, split_len 0).
extern "C" __global__ __launch_bounds__(MERGE_THREADS) void attn_merge_gate_batch(
                                                 const float* __restrict__ po, const float* __restrict__ pm,
                                                 const float* __restrict__ pl, const float* __restrict__ qg,
                                                 float* __restrict__ out, i8* __restrict__ xq,
                                                 float* __restrict__ xd, float* __restrict__ xs, int n_splits,
                                                 int nh, int D, const int* __restrict__ kv_lens) {
    pdl_entry();
    i64 s = blockIdx.z;
    i64 P = (i64)n_splits * nh, HD = (i64)nh * D;
    attn_merge_gate_body(po + s * P * D, pm + s * P, pl + s * P, qg + s * 2 * HD, out + s * HD,
                         xq != 0 ? xq + s * HD : xq, xd != 0 ? xd + s * (HD >> 5) : xd,
                         xs != 0 ? xs + s * (HD >> 5) : xs, n_splits, nh, D, 0, kv_lens + s, 0);
}
