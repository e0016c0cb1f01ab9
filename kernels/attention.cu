// Flash attention over an fp32 KV cache laid out (capacity, n_kv, D). Causal GQA: query head h reads KV
// head h / (nh / n_kv). Query t sits at position start + t; keys 0..kv_len-1 are in the cache.
// window > 0 keeps only keys > p - window. Softmax in fp32 with running max and sum (one pass).
//
// flash_prefill_g (default prefill, described at the kernel): 64 rows of a GQA group x key tiles of 64
//   per block, register-blocked micro-tiles for both products.
// flash_prefill (the older prefill, kept for comparison: ops.flash_prefill kernel="rows"): 32 queries x
//   one head per block, key tiles of 32; scores from D-chunks of 32 staged in shared memory, then P @ V
//   with each thread owning one query row and D/4 output columns.
// flash_decode:  one query token; a block per (KV head, slice of the context) serves all G query heads
//   of that KV head (K and V read once, the next keys in flight while these compute), writing fp32
//   partials (o unnormalized, running max m, sum l);
//   flash_merge combines the slices: m = max m_s, l = sum e^(m_s - m) l_s, o = sum e^(m_s - m) o_s / l.
//   fp32 partials are deliberate (fp16 partials drift and flip argmax within ~30 tokens).

// The cache's element type and its loads: fp32 here. The modules attention_f16 and attention_q8_0
// (kernels/build.py) put kv_f16.cu or kv_q8_0.cu first, which define them for an f16 or a q8_0 cache,
// so flash_prefill_g and flash_decode read those caches as stored (dequantized in registers).
#ifndef KV_ELEM
#define KV_ELEM float
typedef float4 kv_raw4_t;
__device__ __forceinline__ kv_raw4_t kv_raw4(const float* __restrict__ p, i64 i) { return *(const float4*)(p + i); }
__device__ __forceinline__ kv_raw4_t kv_raw4_zero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ float4 kv_widen4(kv_raw4_t r) { return r; }
__device__ __forceinline__ float4 kv_load4(const float* __restrict__ p, i64 i) { return kv_raw4(p, i); }
__device__ __forceinline__ float kv_load1(const float* __restrict__ p, i64 i) { return p[i]; }
// Store value i of the cache (attn_prep.cu; `lane` is for the q8_0 store, a warp-wide operation).
__device__ __forceinline__ void kv_store1(float* __restrict__ p, i64 i, float x, int lane) { p[i] = x; }
#endif

#define FA_BQ 32
#define FA_BK 32
#define FA_PAD 36

template <int D>
__global__ void __launch_bounds__(128) flash_prefill(
        const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
        float* __restrict__ out, int T, int nh, int n_kv, int start, int kv_len, float scale, int window) {
    pdl_entry();
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

// flash_prefill_g (the default prefill): register-blocked tiles over one KV head. A block takes 64 query
//   rows R = t * G + g (position t, query head g of the GQA group, so all G heads of a position share
//   the block and every K/V tile in shared memory serves the whole group) and walks key tiles of 64
//   from the first key any of its rows may see (window) to the last (causal); fully masked tiles are
//   never visited. 256 threads. Scores: Q and K staged in head-dim chunks, transposed in shared memory;
//   each thread owns a 4x4 micro-tile (rows 4ty.., keys 4tx..). Online softmax in fp32 in the log2
//   domain (exp2f, scale pre-multiplied by log2 e); the 16 threads of a row reduce by shuffles. P goes
//   to shared memory transposed; P @ V streams V in chunks of 16 KB (8 KB on sm_75), each thread
//   owning 8 rows x D/32 columns (vectors of 4, or 2 for D = 64) of the output accumulator. The next Q/K chunk and V
//   chunk are loaded into registers while the current one is used. Heaviest blocks launch first.

#define FG_BQ 64
#define FG_BK 64
#define FG_LD 68
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
#define FG_SMALL 1      // Turing: 64 KB of shared memory per SM; 27 KB per block keeps two blocks resident
#else
#define FG_SMALL 0
#endif
#define FG_VBUF (FG_SMALL ? 2048 : 4096)

template <int D>
__global__ void __launch_bounds__(256, 2) flash_prefill_g(
        const float* __restrict__ q, const KV_ELEM* __restrict__ kc, const KV_ELEM* __restrict__ vc,
        float* __restrict__ out, int T, int nh, int n_kv, int start, int kv_len, float scale, int window) {
    pdl_entry();
    constexpr int DC = D >= 256 || FG_SMALL ? 16 : 32;     // head-dim chunk of the score product
    constexpr int NL = DC / 16;                 // float4 loads per thread per chunk (Q and K each)
    constexpr int KC = FG_VBUF / D;             // keys per V chunk
    constexpr int NC = D / 32;                  // output columns per thread
    constexpr int VW = NC >= 4 ? 4 : 2;         // ... as NC / VW vectors: columns VW * lane + 32 * VW * u
    constexpr int BUF = 2 * DC * FG_LD > FG_VBUF ? 2 * DC * FG_LD : FG_VBUF;
    __shared__ __align__(16) float buf[BUF];             // Q/K chunks, then V chunks
    __shared__ __align__(16) float Ps[FG_BK * FG_LD];    // probabilities, transposed: Ps[key][row]
    __shared__ __align__(16) float s_alpha[FG_BQ];
    __shared__ float s_l[FG_BQ];
    float* Qs = buf;                   // Qs[d][row]
    float* Ks = buf + DC * FG_LD;      // Ks[d][key]
    float* Vs = buf;                   // Vs[key][D]

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int G = nh / n_kv;
    const int n_rows = T * G;
    const int nbx = (n_rows + FG_BQ - 1) / FG_BQ;
    const int kvh = blockIdx.x % n_kv;
    const int R0 = (nbx - 1 - (int)(blockIdx.x / n_kv)) * FG_BQ;
    const int ty = tid >> 4, tx = tid & 15;     // score micro-tile: rows 4ty + a, keys 4tx + b
    const int lr = tid & 63, ls = tid >> 6;     // loader: row/key lr, head-dim floats ls*DC/4 ..

    // this thread's Q row for the loader
    const float* qp = q;
    bool qval = R0 + lr < n_rows;
    if (qval) {
        int t = (R0 + lr) / G, g = (R0 + lr) - t * G;
        qp = q + ((i64)t * nh + (i64)kvh * G + g) * D + ls * (DC / 4);
    }
    int t_first = R0 / G, t_last = (min(R0 + FG_BQ, n_rows) - 1) / G;
    int kv_hi = min(kv_len, start + t_last + 1);
    int kv_lo = window > 0 ? max(0, start + t_first - window + 1) : 0;

    float o[8][NC];
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int u = 0; u < NC; u++) o[r][u] = 0.0f;
    float m_run[4], l_run[4];
#pragma unroll
    for (int a = 0; a < 4; a++) { m_run[a] = NEG_BIG; l_run[a] = 0.0f; }
    const float sc = scale * 1.4426950408889634f;
    const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);

    for (int kt = kv_lo; kt < kv_hi; kt += FG_BK) {
        // ---- S = Q K^T over head-dim chunks, next chunk prefetched into registers
        bool kval = kt + lr < kv_len;
        const i64 ko = kval ? ((i64)(kt + lr) * n_kv + kvh) * D + ls * (DC / 4) : 0;
        float4 pq[NL], pk[NL];
#pragma unroll
        for (int i = 0; i < NL; i++) {
            pq[i] = qval ? ((const float4*)qp)[i] : z4;
            pk[i] = kval ? kv_load4(kc, ko + 4 * i) : z4;
        }
        float s[4][4];
#pragma unroll
        for (int a = 0; a < 4; a++) s[a][0] = s[a][1] = s[a][2] = s[a][3] = 0.0f;
#pragma unroll 1
        for (int dc = 0; dc < D; dc += DC) {
            __syncthreads();    // the previous chunk (or the previous tile's V) is no longer read
#pragma unroll
            for (int i = 0; i < NL; i++) {
                int d = ls * (DC / 4) + 4 * i;
                Qs[(d + 0) * FG_LD + lr] = pq[i].x; Qs[(d + 1) * FG_LD + lr] = pq[i].y;
                Qs[(d + 2) * FG_LD + lr] = pq[i].z; Qs[(d + 3) * FG_LD + lr] = pq[i].w;
                Ks[(d + 0) * FG_LD + lr] = pk[i].x; Ks[(d + 1) * FG_LD + lr] = pk[i].y;
                Ks[(d + 2) * FG_LD + lr] = pk[i].z; Ks[(d + 3) * FG_LD + lr] = pk[i].w;
            }
            __syncthreads();
            if (dc + DC < D) {
#pragma unroll
                for (int i = 0; i < NL; i++) {
                    pq[i] = qval ? ((const float4*)(qp + dc + DC))[i] : z4;
                    pk[i] = kval ? kv_load4(kc, ko + dc + DC + 4 * i) : z4;
                }
            }
#pragma unroll
            for (int d = 0; d < DC; d++) {
                float4 qa = *(const float4*)&Qs[d * FG_LD + 4 * ty];
                float4 kb = *(const float4*)&Ks[d * FG_LD + 4 * tx];
                s[0][0] = fmaf(qa.x, kb.x, s[0][0]); s[0][1] = fmaf(qa.x, kb.y, s[0][1]);
                s[0][2] = fmaf(qa.x, kb.z, s[0][2]); s[0][3] = fmaf(qa.x, kb.w, s[0][3]);
                s[1][0] = fmaf(qa.y, kb.x, s[1][0]); s[1][1] = fmaf(qa.y, kb.y, s[1][1]);
                s[1][2] = fmaf(qa.y, kb.z, s[1][2]); s[1][3] = fmaf(qa.y, kb.w, s[1][3]);
                s[2][0] = fmaf(qa.z, kb.x, s[2][0]); s[2][1] = fmaf(qa.z, kb.y, s[2][1]);
                s[2][2] = fmaf(qa.z, kb.z, s[2][2]); s[2][3] = fmaf(qa.z, kb.w, s[2][3]);
                s[3][0] = fmaf(qa.w, kb.x, s[3][0]); s[3][1] = fmaf(qa.w, kb.y, s[3][1]);
                s[3][2] = fmaf(qa.w, kb.z, s[3][2]); s[3][3] = fmaf(qa.w, kb.w, s[3][3]);
            }
        }
        // V chunk 0 of this tile, loaded into registers while the softmax runs
        constexpr int NV = KC * D / 4 / 256;
        float4 pv[NV];
        auto load_v = [&](int k0) {
#pragma unroll
            for (int i = 0; i < NV; i++) {
                int r = (tid + 256 * i) / (D / 4), c4 = (tid + 256 * i) % (D / 4), key = kt + k0 + r;
                pv[i] = key < kv_len ? kv_load4(vc, ((i64)key * n_kv + kvh) * D + 4 * c4) : z4;
            }
        };
        load_v(0);
        // ---- mask, online softmax (log2 domain), P to shared memory
#pragma unroll
        for (int a = 0; a < 4; a++) {
            int p = start + (R0 + 4 * ty + a) / G;     // this row's position
            float mx = NEG_BIG;
            bool valid[4];
#pragma unroll
            for (int b = 0; b < 4; b++) {
                int j = kt + 4 * tx + b;
                valid[b] = (j < kv_len) && (j <= p) && (window <= 0 || j > p - window);
                s[a][b] *= sc;
                if (valid[b]) mx = fmaxf(mx, s[a][b]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
            float m_new = fmaxf(m_run[a], mx);
            float alpha = exp2f(m_run[a] - m_new);
            float ps = 0.0f;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                s[a][b] = valid[b] ? exp2f(s[a][b] - m_new) : 0.0f;
                ps += s[a][b];
            }
            ps += __shfl_xor_sync(0xffffffffu, ps, 1);
            ps += __shfl_xor_sync(0xffffffffu, ps, 2);
            ps += __shfl_xor_sync(0xffffffffu, ps, 4);
            ps += __shfl_xor_sync(0xffffffffu, ps, 8);
            l_run[a] = l_run[a] * alpha + ps;
            m_run[a] = m_new;
            if (tx == 0) s_alpha[4 * ty + a] = alpha;
        }
#pragma unroll
        for (int b = 0; b < 4; b++)
            *(float4*)&Ps[(4 * tx + b) * FG_LD + 4 * ty] = make_float4(s[0][b], s[1][b], s[2][b], s[3][b]);
        __syncthreads();    // P and alpha visible; Q/K chunks no longer read (V overwrites them)

        // ---- O = alpha O + P V, V streamed in chunks of KC keys
        {
            float4 a0 = *(const float4*)&s_alpha[8 * w], a1 = *(const float4*)&s_alpha[8 * w + 4];
            float al[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
            for (int r = 0; r < 8; r++)
#pragma unroll
                for (int u = 0; u < NC; u++) o[r][u] *= al[r];
        }
        int n_keys = min(FG_BK, kv_hi - kt);
#pragma unroll 1
        for (int k0 = 0; k0 < n_keys; k0 += KC) {
            if (k0 > 0) __syncthreads();    // the previous V chunk is no longer read
#pragma unroll
            for (int i = 0; i < NV; i++) {
                int r = (tid + 256 * i) / (D / 4), c4 = (tid + 256 * i) % (D / 4);
                *(float4*)&Vs[r * D + 4 * c4] = pv[i];
            }
            __syncthreads();
            if (k0 + KC < n_keys) load_v(k0 + KC);    // next chunk in flight during this one
#pragma unroll 2
            for (int j = 0; j < KC; j++) {
                float4 p0 = *(const float4*)&Ps[(k0 + j) * FG_LD + 8 * w];
                float4 p1 = *(const float4*)&Ps[(k0 + j) * FG_LD + 8 * w + 4];
#pragma unroll
                for (int u = 0; u < NC / VW; u++) {
                    const float* vp = &Vs[j * D + VW * lane + 32 * VW * u];
                    float v[VW];
                    if constexpr (VW == 4) {
                        float4 t4 = *(const float4*)vp;
                        v[0] = t4.x; v[1] = t4.y; v[2] = t4.z; v[3] = t4.w;
                    } else {
                        float2 t2 = *(const float2*)vp;
                        v[0] = t2.x; v[1] = t2.y;
                    }
#pragma unroll
                    for (int e = 0; e < VW; e++) {
                        const int c = u * VW + e;
                        o[0][c] = fmaf(p0.x, v[e], o[0][c]); o[1][c] = fmaf(p0.y, v[e], o[1][c]);
                        o[2][c] = fmaf(p0.z, v[e], o[2][c]); o[3][c] = fmaf(p0.w, v[e], o[3][c]);
                        o[4][c] = fmaf(p1.x, v[e], o[4][c]); o[5][c] = fmaf(p1.y, v[e], o[5][c]);
                        o[6][c] = fmaf(p1.z, v[e], o[6][c]); o[7][c] = fmaf(p1.w, v[e], o[7][c]);
                    }
                }
            }
        }
    }
    if (tx == 0) {
#pragma unroll
        for (int a = 0; a < 4; a++) s_l[4 * ty + a] = l_run[a];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 8; r++) {
        int R = R0 + 8 * w + r;
        if (R < n_rows) {
            int t = R / G, g = R - t * G;
            float l = s_l[8 * w + r];
            float inv = l > 0.0f ? 1.0f / l : 0.0f;
            float* op = out + ((i64)t * nh + (i64)kvh * G + g) * D;
#pragma unroll
            for (int u = 0; u < NC / VW; u++) {
                float* dst = op + VW * lane + 32 * VW * u;
                const float* src = o[r] + u * VW;
                if constexpr (VW == 4)
                    *(float4*)dst = make_float4(src[0] * inv, src[1] * inv, src[2] * inv, src[3] * inv);
                else
                    *(float2*)dst = make_float2(src[0] * inv, src[1] * inv);
            }
        }
    }
}


#define FD_WARPS 4

// The 4-value chunks of a D-wide head each lane holds in flash_decode (D = 64: lanes 16..31 hold none).
template <int D>
__device__ constexpr int fd_chunks() {
    return (D / 4 + 31) / 32;
}

// The end of a flash_decode block: its FD_WARPS warps' (m, l, o) merged in warp order through shared
// memory (M = the maxima's maximum, each warp's o and l scaled by e^(m_w - M)) into the slice's partials.
template <int D, int GM>
__device__ __forceinline__ void fd_merge_warps(float4 (&o)[GM][fd_chunks<D>()], float (&m_run)[GM],
                                               float (&l_run)[GM], float (&s_m)[FD_WARPS][GM],
                                               float (&s_l)[FD_WARPS][GM], float (&s_o)[GM][D],
                                               float* __restrict__ po, float* __restrict__ pm,
                                               float* __restrict__ pl, int split, int nh, int h0, int G, int tid,
                                               int lane, int w) {
    constexpr int NCH = fd_chunks<D>();
    // merge the 4 warps: M = max of their maxima, each warp's o and l scaled by e^(m_w - M), summed in
    // warp order
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GM; g++) {
            s_m[w][g] = m_run[g];
            s_l[w][g] = l_run[g];
        }
    }
    __syncthreads();
    float f[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) {
        float M = s_m[0][g];
#pragma unroll
        for (int j = 1; j < FD_WARPS; j++) M = fmaxf(M, s_m[j][g]);
        f[g] = __expf(m_run[g] - M);
    }
#pragma unroll
    for (int j = 0; j < FD_WARPS; j++) {
        if (w == j) {
#pragma unroll
            for (int g = 0; g < GM; g++) {
#pragma unroll
                for (int c = 0; c < NCH; c++) {
                    int c4 = lane + 32 * c;
                    if (g < G && c4 < D / 4) {
                        float4 v = o[g][c];
                        float* d = &s_o[g][4 * c4];
                        if (j == 0) {
                            d[0] = v.x * f[g]; d[1] = v.y * f[g]; d[2] = v.z * f[g]; d[3] = v.w * f[g];
                        } else {
                            d[0] += v.x * f[g]; d[1] += v.y * f[g]; d[2] += v.z * f[g]; d[3] += v.w * f[g];
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
    i64 base = (i64)split * nh + h0;
    for (int i = tid; i < G * D; i += 128) po[base * D + i] = s_o[i / D][i % D];
    if (tid < G) {
        float M = s_m[0][tid];
        for (int j = 1; j < FD_WARPS; j++) M = fmaxf(M, s_m[j][tid]);
        float L = 0.0f;
        for (int j = 0; j < FD_WARPS; j++) L += s_l[j][tid] * __expf(s_m[j][tid] - M);
        pm[base + tid] = M;
        pl[base + tid] = L;
    }
}

// Sum each of a[0..N) over the warp, scattered: on return a[0] of lane l is the full sum of value
// (l >> (5 - log2 N)) & (N - 1) (N a power of two <= 32; 2 lanes or more hold each value).
template <int N, int OFF>
__device__ __forceinline__ void scatter_sum(float* a, int lane) {
    if constexpr (OFF > 0) {
        if constexpr (N > 1) {
            const bool up = (lane & OFF) != 0;
#pragma unroll
            for (int i = 0; i < N / 2; i++) {
                float send = up ? a[i] : a[i + N / 2];
                float keep = up ? a[i + N / 2] : a[i];
                a[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
            }
            scatter_sum<N / 2, OFF / 2>(a, lane);
        } else {
            a[0] += __shfl_xor_sync(0xffffffffu, a[0], OFF);
            scatter_sum<1, OFF / 2>(a, lane);
        }
    }
}

template <int N>
__device__ constexpr int ilog2() {
    if constexpr (N <= 1)
        return 0;
    else
        return 1 + ilog2<N / 2>();
}

template <int U, int D>
__device__ __forceinline__ void fd_load(const KV_ELEM* __restrict__ kc, const KV_ELEM* __restrict__ vc, int t0,
                                        int hi, i64 row_stride, int kvh, int lane,
                                        kv_raw4_t (&kr)[U][fd_chunks<D>()], kv_raw4_t (&vr)[U][fd_chunks<D>()]) {
    constexpr int NCH = fd_chunks<D>();
#pragma unroll
    for (int u = 0; u < U; u++) {
#pragma unroll
        for (int c = 0; c < NCH; c++) {
            int c4 = lane + 32 * c;
            bool ok = t0 + u < hi && c4 < D / 4;
            i64 e = (i64)(t0 + u) * row_stride + (i64)kvh * D + 4 * c4;
            kr[u][c] = ok ? kv_raw4(kc, e) : kv_raw4_zero();
            vr[u][c] = ok ? kv_raw4(vc, e) : kv_raw4_zero();
        }
    }
}

// flash_decode<D, GM>: one block of 4 warps per (KV head, context slice), serving the G <= GM query
// heads of that KV head, so each K/V row is read once for the whole GQA group. Each warp takes U keys at a
// time (fd_keys: 4, 2 with 8 heads), groups of keys interleaved over the warps; lane l holds the values
// 4l..4l+3 (+128 per chunk) of a row, so a warp's load is one contiguous run of the row, loaded in the
// cache's own type (kv_raw4: 16-byte fp32, 8-byte f16 or a q8_0 block's scale and 4 bytes) and widened to
// fp32 in registers where used (kv_widen4). The next step's keys are loaded, as stored, while this step
// computes, so the cache streams with no barrier in the key loop. The G x U partial dot products of a step
// are summed over the warp by one reduce-scatter (scatter_sum: log2(G U) halving exchanges, then plain
// sums) that leaves each (head, key) score with a pair of lanes; a head's max over its keys is log2(U)
// shuffles, each lane exps its own score once, and G + G U shuffles hand every lane the heads' maxima and
// the probabilities for P V (fp32 throughout). The kernel before (v19) summed each (key, head) with its
// own warp sum and repeated the softmax in every lane, with no load in flight during the compute: 46.2
// us at 16K for the 9B's heads against 37.5 now (BENCHMARKS.md v20). Each warp keeps its own running max
// m, sum l and unnormalized output o (G x D/32 values per lane); at the end the 4 warps' (m, l, o) are
// merged in warp order through shared memory (deterministic) into the slice's partials po, pm, pl.
//
// fd_keys: keys a warp takes at a time, 4, or 2 with 8 heads a KV head (168 registers either way, so 3
// blocks an SM).
template <int GM>
__device__ constexpr int fd_keys() { return GM >= 8 ? 2 : 4; }


// EARLY (the single-token kernel): the block issues its warps' first loads of keys and values before its
// programmatic-dependent-launch wait (pdl_entry), so their DRAM round trip overlaps the kernels before it
// (attn_prep or the append). Those rows were written by earlier steps, inside earlier graph launches,
// which have ended; this step writes only row kv_len - 1, its token's own, so that row is left out of the
// early loads and the warp whose first keys hold it loads them again after the wait. q and everything
// else are read after the wait. The length on the device (kv_len_ptr) is written before the step's graph
// runs. Without EARLY the caller has waited already.
template <int D, int GM, bool EARLY>
__device__ __forceinline__ void flash_decode_body(
        const float* __restrict__ q, const KV_ELEM* __restrict__ kc, const KV_ELEM* __restrict__ vc,
        float* __restrict__ po, float* __restrict__ pm, float* __restrict__ pl,
        int nh, int n_kv, int kv_len, const int* __restrict__ kv_len_ptr, int split_len, float scale,
        int window) {
    // Inside a captured decode graph the context length is read from the device (length before this
    // token's append, + 1), so one graph serves every step; split_len == 0 then sizes the slices for that
    // length over the grid's splits (fd_split_len), and splits past the length leave at once (the merge
    // reads only the splits below the length).
    if (kv_len_ptr != 0) kv_len = *kv_len_ptr + 1;
    split_len = fd_split_len(split_len, kv_len, gridDim.y);
    if (blockIdx.y * split_len >= kv_len) return;
    constexpr int U = fd_keys<GM>();
    constexpr int NCH = fd_chunks<D>();
    constexpr int N = GM * U;  // partial dot products a warp step: value g * U + u
    constexpr int L = ilog2<N>();
    static_assert((N & (N - 1)) == 0 && N <= 32, "GM * U must be a power of two <= 32");
    constexpr int SH = 5 - L;  // lane l holds value l >> SH after scatter_sum
    __shared__ float4 qs[GM][D / 4];
    __shared__ float s_m[FD_WARPS][GM], s_l[FD_WARPS][GM];
    __shared__ float s_o[GM][D];
    int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    int kvh = blockIdx.x, split = blockIdx.y;
    int G = nh / n_kv;
    int h0 = kvh * G;
    int p = kv_len - 1;
    int lo = split * split_len, hi = min(kv_len, lo + split_len);
    if (window > 0) lo = max(lo, p - window + 1);
    const i64 row_stride = (i64)n_kv * D;
    kv_raw4_t kn[U][NCH], vn[U][NCH];  // the next step's keys, in flight while this step computes
    int t0 = lo + w * U;
    fd_load<U, D>(kc, vc, t0, EARLY ? min(hi, p) : hi, row_stride, kvh, lane, kn, vn);
    if (EARLY) {
        pdl_entry();
        if (t0 < hi && t0 + U > p) fd_load<U, D>(kc, vc, t0, hi, row_stride, kvh, lane, kn, vn);
    }
    for (int i = tid; i < GM * (D / 4); i += 128) {
        int g = i / (D / 4), c4 = i % (D / 4);
        qs[g][c4] = g < G ? *(const float4*)(q + (i64)(h0 + g) * D + 4 * c4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float4 o[GM][NCH];
    float m_run[GM], l_run[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) {
        m_run[g] = NEG_BIG;
        l_run[g] = 0.0f;
#pragma unroll
        for (int c = 0; c < NCH; c++) o[g][c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __syncthreads();
    const int my_v = lane >> SH, my_g = my_v / U, my_u = my_v % U;
    for (; t0 < hi; t0 += FD_WARPS * U) {
        kv_raw4_t kr[U][NCH], vr[U][NCH];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int c = 0; c < NCH; c++) {
                kr[u][c] = kn[u][c];
                vr[u][c] = vn[u][c];
            }
        fd_load<U, D>(kc, vc, t0 + FD_WARPS * U, hi, row_stride, kvh, lane, kn, vn);
        float a[N];
#pragma unroll
        for (int i = 0; i < N; i++) a[i] = 0.0f;
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int c = 0; c < NCH; c++) {
                int c4 = lane + 32 * c;
                if (c4 < D / 4) {
                    float4 kk = kv_widen4(kr[u][c]);
#pragma unroll
                    for (int g = 0; g < GM; g++) {
                        if (g < G) {
                            float4 qq = qs[g][c4];
                            float x = a[g * U + u];
                            x = fmaf(qq.x, kk.x, x);
                            x = fmaf(qq.y, kk.y, x);
                            x = fmaf(qq.z, kk.z, x);
                            x = fmaf(qq.w, kk.w, x);
                            a[g * U + u] = x;
                        }
                    }
                }
            }
        }
        scatter_sum<N, 16>(a, lane);
        float s = t0 + my_u < hi ? a[0] * scale : NEG_BIG;
        float mx = s;
#pragma unroll
        for (int j = 0; j < ilog2<U>(); j++) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, (1 << SH) << j));
        float alpha[GM], m_mine = NEG_BIG;
#pragma unroll
        for (int g = 0; g < GM; g++) {
            float m_new = fmaxf(m_run[g], __shfl_sync(0xffffffffu, mx, (g * U) << SH));
            alpha[g] = __expf(m_run[g] - m_new);
            m_run[g] = m_new;
            if (g == my_g) m_mine = m_new;
        }
        float pme = t0 + my_u < hi ? __expf(s - m_mine) : 0.0f;
        float pv[N];
#pragma unroll
        for (int i = 0; i < N; i++) pv[i] = __shfl_sync(0xffffffffu, pme, i << SH);
#pragma unroll
        for (int g = 0; g < GM; g++) {
            float ls = 0.0f;
#pragma unroll
            for (int u = 0; u < U; u++) ls += pv[g * U + u];
            l_run[g] = l_run[g] * alpha[g] + ls;
#pragma unroll
            for (int c = 0; c < NCH; c++) {
                o[g][c].x *= alpha[g];
                o[g][c].y *= alpha[g];
                o[g][c].z *= alpha[g];
                o[g][c].w *= alpha[g];
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int c = 0; c < NCH; c++) {
                if (lane + 32 * c < D / 4) {
                    float4 vv = kv_widen4(vr[u][c]);
#pragma unroll
                    for (int g = 0; g < GM; g++) {
                        if (g < G) {
                            float pu = pv[g * U + u];
                            o[g][c].x = fmaf(pu, vv.x, o[g][c].x);
                            o[g][c].y = fmaf(pu, vv.y, o[g][c].y);
                            o[g][c].z = fmaf(pu, vv.z, o[g][c].z);
                            o[g][c].w = fmaf(pu, vv.w, o[g][c].w);
                        }
                    }
                }
            }
        }
    }
    fd_merge_warps<D, GM>(o, m_run, l_run, s_m, s_l, s_o, po, pm, pl, split, nh, h0, G, tid, lane, w);
}

template <int D, int GM>
__global__ void __launch_bounds__(128, 3) flash_decode(
        const float* __restrict__ q, const KV_ELEM* __restrict__ kc, const KV_ELEM* __restrict__ vc,
        float* __restrict__ po, float* __restrict__ pm, float* __restrict__ pl,
        int nh, int n_kv, int kv_len, const int* __restrict__ kv_len_ptr, int split_len, float scale,
        int window) {
    flash_decode_body<D, GM, true>(q, kc, vc, po, pm, pl, nh, n_kv, kv_len, kv_len_ptr, split_len, scale, window);
}

// flash_decode for one query token of each of B sequences, grid (n_kv, n_splits, B): blockIdx.z is the
// sequence s, with its query at row s of q (B, nh, D), its own cache kcs[s] / vcs[s] (device pointer
// tables) and context length kv_lens[s] + 1 (the length before this token's append, on the device), over
// which the n_splits slices are sized as in a captured graph (split_len 0); its partials are the slab s of
// po (B, n_splits, nh, D), pm and pl (B, n_splits, nh).
template <int D, int GM>
__global__ void __launch_bounds__(128, 3) flash_decode_batch(
        const float* __restrict__ q, const KV_ELEM* const* __restrict__ kcs, const KV_ELEM* const* __restrict__ vcs,
        float* __restrict__ po, float* __restrict__ pm, float* __restrict__ pl, int nh, int n_kv,
        const int* __restrict__ kv_lens, float scale, int window) {
    pdl_entry();
    i64 s = blockIdx.z;
    i64 P = (i64)gridDim.y * nh;
    flash_decode_body<D, GM, false>(q + s * nh * D, kcs[s], vcs[s], po + s * P * D, pm + s * P, pl + s * P, nh,
                                    n_kv, 0, kv_lens + s, 0, scale, window);
}

// The merge of a head's splits, grid (nh, D / MERGE_COLS) of MERGE_THREADS threads (ops.py
// merge_grid): common.cuh merge_head_splits.
__device__ __forceinline__ void merge_splits(const float* __restrict__ po, const float* __restrict__ pm,
                                             const float* __restrict__ pl, float* __restrict__ out,
                                             int n_splits, int nh, int D) {
    const int c0 = blockIdx.y * MERGE_COLS;
    const float r = merge_head_splits(po, pm, pl, n_splits, nh, blockIdx.x, D, c0);
    if (threadIdx.x < MERGE_COLS) out[(i64)blockIdx.x * D + c0 + threadIdx.x] = r;
}

extern "C" __global__ __launch_bounds__(MERGE_THREADS) void flash_merge(
        const float* __restrict__ po, const float* __restrict__ pm, const float* __restrict__ pl,
        float* __restrict__ out, int n_splits, int nh, int D) {
    pdl_entry();
    merge_splits(po, pm, pl, out, n_splits, nh, D);
}

// flash_merge after a flash_decode launched with the same kv_len / kv_len_ptr / split_len: splits s with
// s * split_len >= kv_len hold no keys (flash_decode left them unwritten) and are skipped.
extern "C" __global__ __launch_bounds__(MERGE_THREADS) void flash_merge_len(
        const float* __restrict__ po, const float* __restrict__ pm, const float* __restrict__ pl,
        float* __restrict__ out, int n_splits, int nh, int D, int kv_len, const int* __restrict__ kv_len_ptr,
        int split_len) {
    pdl_entry();
    merge_splits(po, pm, pl, out, fd_live_splits(n_splits, kv_len, kv_len_ptr, split_len), nh, D);
}

// Append one token's K and V (n values each) at the row given on the device (graph-captured decode).
extern "C" __global__ void kv_append(const float* __restrict__ k, const float* __restrict__ v,
                                     float* __restrict__ kc, float* __restrict__ vc,
                                     const int* __restrict__ row_ptr, int n_k, int n_v) {
    pdl_entry();
    i64 row = *row_ptr;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_k || i < n_v; i += gridDim.x * blockDim.x) {
        if (i < n_k) kc[row * n_k + i] = k[i];
        if (i < n_v) vc[row * n_v + i] = v[i];
    }
}
