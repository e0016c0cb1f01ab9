// Top-k of logit rows on the device (k = 1 is greedy argmax), and mixture-of-experts routing.
//
// topk_stage1: a block per (slice of TOPK_SLICE logits, row); the slice sits in shared memory and k
//   rounds of block argmax (ties -> lower index) pull out its k largest.
// topk_stage2: a block per row over the slices' candidates, the same k rounds.
// penalize:    a thread per token of one row: a sampler's repetition / presence / frequency penalties,
//   from a table of one int32 a token that the step first updates with the token it embeds, as
//   engine/sampling.py apply_penalties does (float64 arithmetic on each penalized entry).
// pick_top:    a warp per row draws a token from the row's k largest logits (topk_stage2's output),
//   as engine/sampling.py draw_from_top does: float64 tempered weights, the top-p prefix, the min-p
//   cut, the inverse CDF at the row's uniform number.
// moe_route:   a block per token: fp32 softmax over E router logits, top-k, renormalized weights.
// moe_combine: out[t] = sum_s w[t, s] * y[t * k + s].

#define TOPK_SLICE 4096
#define TOPK_THREADS 256

__device__ __forceinline__ void block_argmax(float v, int i, float* sv, int* si, float& best_v, int& best_i) {
    // (v, i) of every thread -> the block's best, in best_v / best_i for all threads.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) { sv[wid] = v; si[wid] = i; }
    __syncthreads();
    if (wid == 0) {
        int nw = blockDim.x >> 5;
        v = lane < nw ? sv[lane] : -INFINITY;
        i = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
        }
        if (lane == 0) { sv[0] = v; si[0] = i; }
    }
    __syncthreads();
    best_v = sv[0];
    best_i = si[0];
    __syncthreads();
}

// Local (value, position) maximum over buf[0..n) strided by thread.
__device__ __forceinline__ void local_max(const float* buf, int n, float& v, int& i) {
    v = -INFINITY;
    i = 0x7fffffff;
    for (int p = threadIdx.x; p < n; p += blockDim.x)
        if (buf[p] > v) { v = buf[p]; i = p; }
}

extern "C" __global__ void topk_stage1(const float* __restrict__ logits, int V, int k,
                                       float* __restrict__ cand_v, int* __restrict__ cand_i) {
    pdl_entry();
    __shared__ float buf[TOPK_SLICE];
    __shared__ float sv[32];
    __shared__ int si[32];
    int row = blockIdx.y, slice = blockIdx.x, n_slices = gridDim.x;
    int base = slice * TOPK_SLICE;
    int n = min(TOPK_SLICE, V - base);
    for (int p = threadIdx.x; p < TOPK_SLICE; p += blockDim.x)
        buf[p] = p < n ? logits[(i64)row * V + base + p] : -INFINITY;
    __syncthreads();
    for (int r = 0; r < k; r++) {
        float v; int i;
        local_max(buf, TOPK_SLICE, v, i);
        float bv; int bi;
        block_argmax(v, i, sv, si, bv, bi);
        i64 o = ((i64)row * n_slices + slice) * k + r;
        if (threadIdx.x == 0) {
            cand_v[o] = bv;
            cand_i[o] = (bi < n) ? base + bi : -1;
            if (bi < TOPK_SLICE) buf[bi] = -INFINITY;
        }
        __syncthreads();
    }
}

extern "C" __global__ void topk_stage2(const float* __restrict__ cand_v, const int* __restrict__ cand_i,
                                       int n_cand, int k, float* __restrict__ out_v, int* __restrict__ out_i) {
    pdl_entry();
    extern __shared__ float cbuf[];
    __shared__ float sv[32];
    __shared__ int si[32];
    int row = blockIdx.x;
    for (int p = threadIdx.x; p < n_cand; p += blockDim.x) {
        int id = cand_i[(i64)row * n_cand + p];
        cbuf[p] = id >= 0 ? cand_v[(i64)row * n_cand + p] : -INFINITY;
    }
    __syncthreads();
    for (int r = 0; r < k; r++) {
        float v; int i;
        // ties between candidates: prefer the lower vocabulary id (candidate order is not id order)
        v = -INFINITY; i = 0x7fffffff;
        int best_id = 0x7fffffff;
        for (int p = threadIdx.x; p < n_cand; p += blockDim.x) {
            float c = cbuf[p];
            int id = cand_i[(i64)row * n_cand + p];
            if (c > v || (c == v && c != -INFINITY && id < best_id)) { v = c; i = p; best_id = id; }
        }
        float bv; int bi;
        block_argmax(v, best_id, sv, si, bv, bi);  // reduce on (value, vocabulary id)
        if (threadIdx.x == 0) {
            out_v[(i64)row * k + r] = bv;
            out_i[(i64)row * k + r] = bi;
        }
        // the thread holding the winner removes it
        if (i != 0x7fffffff && best_id == bi && v == bv) cbuf[i] = -INFINITY;
        __syncthreads();
    }
}

// The same top-k in four passes whatever k (ops.top_k picks by k: the rounds above cost more the larger k,
// these passes do not):
// topk_group_max: the largest key of each group of G consecutive logits (a warp a group);
// topk_threshold: a block per row finds t, the k-th largest of the groups' largest keys, by radix select
//   (four 8-bit digits, histograms in shared memory). The k groups at or above t hold k distinct logits
//   >= t, so every logit of the row's top k is >= t;
// topk_gather:    the logits with key >= t, appended to the row's candidates (a count per row, warp-aggregated);
// topk_select:    a block per row sorts its candidates best first (bitonic, in shared memory) and writes the
//   first k; a row with more than TOPK_CAND candidates (a run of equal logits) takes its k by rounds over
//   the whole row instead: slow, and right.
// Order: larger value first, equal values by lower id (NaN counts as -inf, -0 as +0), so the order is
// engine/sampling.py top_logits's.

#define TOPK_GROUPS_MAX 8192
#define TOPK_CAND 4096

__device__ __forceinline__ float topk_clean(float x) { return isnan(x) ? -INFINITY : (x == 0.0f ? 0.0f : x); }

__device__ __forceinline__ unsigned topk_key(float x) {
    // order-preserving: a larger float gets a larger key; every key is > 0
    unsigned u = __float_as_uint(topk_clean(x));
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ bool topk_before(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}

__device__ __forceinline__ void bitonic_best_first(float* v, int* id, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < (n >> 1); t += blockDim.x) {
                int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
                bool up = (lo & size) == 0;  // this run ends best first (the last run: all of it)
                float a = v[lo], b = v[hi];
                int ia = id[lo], ib = id[hi];
                if (topk_before(b, ib, a, ia) == up) {
                    v[lo] = b; v[hi] = a;
                    id[lo] = ib; id[hi] = ia;
                }
            }
            __syncthreads();
        }
    }
}

extern "C" __global__ void topk_group_max(const float* __restrict__ logits, int V, int G, int n_groups,
                                          unsigned* __restrict__ gmax) {
    pdl_entry();
    // grid (ceil(n_groups / 8), rows), 256 threads: warp w of block b takes group 8 b + w
    int row = blockIdx.y, g = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (g >= n_groups) return;
    const float* x = logits + (i64)row * V;
    int end = min(V, (g + 1) * G);
    unsigned m = 0;
    for (int p = g * G + lane; p < end; p += 32) m = max(m, topk_key(x[p]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) gmax[(i64)row * n_groups + g] = m;
}

extern "C" __global__ __launch_bounds__(1024) void topk_threshold(const unsigned* __restrict__ gmax, int n_groups,
                                                                   int k, unsigned* __restrict__ thresh,
                                                                   int* __restrict__ count) {
    pdl_entry();
    // a block per row; n_groups <= TOPK_GROUPS_MAX. k > n_groups: t = 0 (every logit a candidate).
    __shared__ unsigned keys[TOPK_GROUPS_MAX];
    __shared__ int hist[256];
    __shared__ unsigned s_prefix;
    __shared__ int s_left;
    int row = blockIdx.x, tid = threadIdx.x;
    for (int i = tid; i < n_groups; i += blockDim.x) keys[i] = gmax[(i64)row * n_groups + i];
    unsigned prefix = 0, mask = 0;
    int left = k;  // how many of the keys matching prefix under mask are still to be passed, the last one t
    if (k <= n_groups) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            if (tid < 256) hist[tid] = 0;
            __syncthreads();
            for (int i = tid; i < n_groups; i += blockDim.x) {
                unsigned key = keys[i];
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
            }
            __syncthreads();
            if (tid < 32) {
                // lane l holds digits 255 - 8 l down to 248 - 8 l; a prefix sum over lanes from the top
                int c[8], sum = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) { c[j] = hist[255 - 8 * tid - j]; sum += c[j]; }
                int incl = sum;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    int nb = __shfl_up_sync(0xffffffffu, incl, o);
                    if (tid >= o) incl += nb;
                }
                int acc = incl - sum;  // keys in digits above this lane's
                if (acc < left && left <= incl) {  // the digit of the left-th largest is this lane's
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        if (acc < left && left <= acc + c[j]) {
                            s_prefix = prefix | ((unsigned)(255 - 8 * tid - j) << shift);
                            s_left = left - acc;
                        }
                        acc += c[j];
                    }
                }
            }
            __syncthreads();
            prefix = s_prefix;
            left = s_left;
            mask |= 255u << shift;
            __syncthreads();
        }
    }
    if (tid == 0) {
        thresh[row] = prefix;
        count[row] = 0;
    }
}

extern "C" __global__ void topk_gather(const float* __restrict__ logits, int V, const unsigned* __restrict__ thresh,
                                       int* __restrict__ count, float* __restrict__ cand_v, int* __restrict__ cand_i) {
    pdl_entry();
    // grid (ceil(V / 256), rows), 256 threads: a logit a thread
    int row = blockIdx.y, p = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x & 31;
    float x = p < V ? logits[(i64)row * V + p] : -INFINITY;
    bool in = p < V && topk_key(x) >= thresh[row];
    unsigned ballot = __ballot_sync(0xffffffffu, in);
    if (!ballot) return;
    int base = 0;
    if (lane == 0) base = atomicAdd(&count[row], __popc(ballot));
    base = __shfl_sync(0xffffffffu, base, 0);
    int at = base + __popc(ballot & ((1u << lane) - 1));
    if (in && at < TOPK_CAND) {
        cand_v[(i64)row * TOPK_CAND + at] = x;
        cand_i[(i64)row * TOPK_CAND + at] = p;
    }
}

extern "C" __global__ __launch_bounds__(256) void topk_select(const float* __restrict__ logits, int V, int k,
                                                              const int* __restrict__ count,
                                                              const float* __restrict__ cand_v,
                                                              const int* __restrict__ cand_i,
                                                              float* __restrict__ out_v, int* __restrict__ out_i) {
    pdl_entry();
    __shared__ float sv[TOPK_CAND];
    __shared__ int si[TOPK_CAND];
    __shared__ float bvs[32];
    __shared__ int bis[32];
    int row = blockIdx.x, n = count[row];
    if (n <= TOPK_CAND) {
        int n2 = 1;
        while (n2 < n) n2 <<= 1;
        for (int p = threadIdx.x; p < n2; p += blockDim.x) {
            sv[p] = p < n ? topk_clean(cand_v[(i64)row * TOPK_CAND + p]) : -INFINITY;
            si[p] = p < n ? cand_i[(i64)row * TOPK_CAND + p] : 0x7fffffff;
        }
        __syncthreads();
        bitonic_best_first(sv, si, n2);
        for (int r = threadIdx.x; r < k; r += blockDim.x) {
            // the original value (a -0 stays -0); padding (fewer logits than k) as -inf, id -1
            bool real = r < n;
            out_v[(i64)row * k + r] = real ? logits[(i64)row * V + si[r]] : -INFINITY;
            out_i[(i64)row * k + r] = real ? si[r] : -1;
        }
        return;
    }
    // more candidates than fit: k rounds over the whole row, each the best logit after the last one taken
    const float* x = logits + (i64)row * V;
    float lv = INFINITY;
    int li = -1;
    for (int r = 0; r < k; r++) {
        float v = -INFINITY;
        int i = 0x7fffffff;
        for (int p = threadIdx.x; p < V; p += blockDim.x) {
            float c = topk_clean(x[p]);
            if (topk_before(lv, li, c, p) && topk_before(c, p, v, i)) { v = c; i = p; }
        }
        float bv; int bi;
        block_argmax(v, i, bvs, bis, bv, bi);
        if (threadIdx.x == 0) {
            out_v[(i64)row * k + r] = bi < V ? x[bi] : -INFINITY;
            out_i[(i64)row * k + r] = bi < V ? bi : -1;
        }
        lv = bv;
        li = bi;
    }
}

#define PROMPT_BIT (1 << 30)  // engine/sampling.py PROMPT_BIT

extern "C" __global__ void penalize(float* __restrict__ logits, int V, const int* __restrict__ token,
                                    int* __restrict__ table, const double* __restrict__ prm) {
    pdl_entry();
    // logits (V,) in place. table (V,): PROMPT_BIT for a prompt token, plus the times it was generated;
    // *token (the token this step embeds, the last one generated) is counted first. prm: repetition,
    // presence, frequency. A token in the table: its logit divided by the repetition penalty when
    // positive, else multiplied; one generated n > 0 times then loses presence + frequency * n. The
    // _rn intrinsics keep the compiler from fusing what the host rounds step by step.
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= V) return;
    int h = table[i];
    if (i == *token) {
        h += 1;
        table[i] = h;
    }
    if (h == 0) return;
    double rep = prm[0], pres = prm[1], freq = prm[2];
    int n = h & (PROMPT_BIT - 1);
    float x = logits[i];
    if (rep != 1.0) {
        double d = (double)x;
        x = (float)(d > 0.0 ? __ddiv_rn(d, rep) : __dmul_rn(d, rep));
    }
    if ((pres != 0.0 || freq != 0.0) && n > 0)
        x = (float)__dsub_rn((double)x, __dadd_rn(pres, __dmul_rn(freq, (double)n)));
    logits[i] = x;
}

#define PICK_PER_LANE 4  // k <= 32 * PICK_PER_LANE (ops.TOPK_MAX)
#define PICK_PRM 8       // float64 values a row of prm (engine/sampling.py PickSpec.as_array)

extern "C" __global__ void pick_top(const float* __restrict__ vals, const int* __restrict__ ids, int cols,
                                    const double* __restrict__ prm, int* __restrict__ out) {
    pdl_entry();
    // One warp a row. vals/ids (rows, cols): descending, equal values in ascending id order. prm (rows,
    // PICK_PRM): u, temperature (<= 0: the first id), top_p, min_p, k (> 0: the first k of the row, else
    // all cols), then the penalties (not read here). Lane l holds entries [l * e, l * e + e), so a
    // prefix over lanes is a prefix over the entries in order.
    int row = blockIdx.x, lane = threadIdx.x;
    const float* v = vals + (i64)row * cols;
    const int* id = ids + (i64)row * cols;
    const double* q = prm + (i64)row * PICK_PRM;
    double u = q[0], t = q[1], top_p = q[2], min_p = q[3];
    int k = q[4] > 0.0 && q[4] < (double)cols ? (int)q[4] : cols;
    if (t <= 0.0 || k == 1) {
        if (lane == 0) out[row] = id[0];
        return;
    }
    int e = (k + 31) >> 5;
    double v0 = (double)v[0];
    double w[PICK_PER_LANE], c[PICK_PER_LANE];  // weights exp((v - v0) / t), their running sums
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < PICK_PER_LANE; j++) {
        int at = lane * e + j;
        w[j] = (j < e && at < k) ? exp(((double)v[at] - v0) / t) : 0.0;
        s += w[j];
        c[j] = s;
    }
    double incl = s;  // inclusive prefix of the lanes' sums
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        double n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    double before = incl - s, total = __shfl_sync(0xffffffffu, incl, 31);
    // kept: the smallest prefix whose probability reaches top_p (the crossing entry included), then
    // of those the entries with probability >= min_p * the largest (w[0] of lane 0 is exp(0) = 1)
    int below = 0, under_min = 0;
#pragma unroll
    for (int j = 0; j < PICK_PER_LANE; j++) {
        int at = lane * e + j;
        c[j] += before;
        bool real = j < e && at < k;
        below += real && top_p < 1.0 && c[j] / total < top_p;
        under_min += real && w[j] / total < min_p * (1.0 / total);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        below += __shfl_xor_sync(0xffffffffu, below, o);
        under_min += __shfl_xor_sync(0xffffffffu, under_min, o);
    }
    int n = top_p < 1.0 ? min(k, below + 1) : k;
    n = min(n, k - under_min);  // min-p cuts a suffix (the weights descend); the first entry stays
    double kept = 0.0;  // the kept entries' sum: the running sum at entry n - 1
#pragma unroll
    for (int j = 0; j < PICK_PER_LANE; j++) {
        double cj = __shfl_sync(0xffffffffu, c[j], (n - 1) / e);
        if (j == (n - 1) % e) kept = cj;
    }
    // the pick: the number of kept entries whose renormalized running sum is <= u
    int at_or_below = 0;
#pragma unroll
    for (int j = 0; j < PICK_PER_LANE; j++) {
        int at = lane * e + j;
        at_or_below += j < e && at < n && c[j] / kept <= u;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) at_or_below += __shfl_xor_sync(0xffffffffu, at_or_below, o);
    if (lane == 0) out[row] = id[min(at_or_below, n - 1)];
}

extern "C" __global__ void moe_route(const float* __restrict__ logits, int E, int k, int* __restrict__ ids,
                                     float* __restrict__ wts) {
    pdl_entry();
    extern __shared__ float p[];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float scratch[32];
    int t = blockIdx.x;
    const float* l = logits + (i64)t * E;
    float mx = -INFINITY;
    for (int e = threadIdx.x; e < E; e += blockDim.x) mx = fmaxf(mx, l[e]);
    mx = warp_max(mx);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = scratch[0];
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, scratch[w]);
        scratch[0] = m;
    }
    __syncthreads();
    mx = scratch[0];
    __syncthreads();
    float s = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) { float v = __expf(l[e] - mx); p[e] = v; s += v; }
    s = block_sum(s, scratch);
    float sel_sum = 0.0f;
    for (int r = 0; r < k; r++) {
        float v; int i;
        local_max(p, E, v, i);
        float bv; int bi;
        block_argmax(v, i, sv, si, bv, bi);
        if (threadIdx.x == 0) {
            ids[t * k + r] = bi;
            wts[t * k + r] = bv / s;
            p[bi] = -INFINITY;
        }
        sel_sum += bv / s;
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float norm = 1.0f / fmaxf(sel_sum, 6.1e-5f);
        for (int r = 0; r < k; r++) wts[t * k + r] *= norm;
    }
}

extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ wts,
                                       float* __restrict__ out, int T, int k, int H) {
    pdl_entry();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)T * H) return;
    int t = (int)(i / H), c = (int)(i % H);
    float acc = 0.0f;
    for (int s = 0; s < k; s++) acc = fmaf(wts[t * k + s], y[((i64)t * k + s) * H + c], acc);
    out[i] = acc;
}
