// Routed experts in host RAM asked of the CPU from inside the stream (engine/expert_pool.py): one block
// writes the tokens' rows (values, then their routing) into page-locked host memory, posts a request into
// the pool's control block, waits for the pool's answer there, and copies the output rows back. In a
// captured decode graph this is one kernel node per MoE layer, where copies and a driver host function
// took three (and the rows' packing three more launches).
//
// x (T, H), ids (T, k) int32, wts (T, k): a row of hx is [x | ids as float32 | wts] (W = H + 2k floats;
// expert ids < 2^24 are exact in float32).
// ctrl: the channel's first word (int64 words: REQ 0, ENTRY 1, T 2, X 3, Y 4, W 5, DONE 8, TIMEOUT 11,
// and %globaltimer stamps the pool's leader adds up: NOW 6, this call's start, written with the request;
// then, written together as the call ends, its START 12, POSTED 13 once REQ was written, SEEN 14 when
// DONE was read, END 15 once the rows were back).
// seq: this channel's last request number, kept on the device (a graph replays the same arguments).
// Memory order: every thread's stores to hx are fenced at system scope before the block's barrier, and
// REQ is written after the other words and a second fence; DONE is read volatile, then a fence, then the
// output rows (volatile loads, so nothing cached before the answer is used). After timeout_ns without an
// answer the output is NaN and TIMEOUT holds the request's number.

#define EXPERT_CALL_UNROLL 4

__device__ __forceinline__ unsigned long long expert_call_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void expert_call(const float* __restrict__ x, const int* __restrict__ ids,
                                       const float* __restrict__ wts, float* __restrict__ out,
                                       long long* ctrl, float* hx, const float* hy,
                                       unsigned long long* seq, long long entry, int T, int k, int H,
                                       unsigned long long timeout_ns) {
    pdl_entry();
    volatile long long* c = ctrl;
    const unsigned long long start = expert_call_now();
    unsigned long long posted = 0, seen = 0;
    const int W = H + 2 * k;
    const int n = T * W;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int t = i / W;
        const int j = i - t * W;
        hx[i] = j < H ? x[t * H + j] : (j < H + k ? (float)ids[t * k + (j - H)] : wts[t * k + (j - H - k)]);
    }
    __threadfence_system();
    __syncthreads();
    __shared__ int answered;
    if (threadIdx.x == 0) {
        const long long s = (long long)(*seq + 1ull);
        *seq = (unsigned long long)s;
        c[1] = entry;
        c[2] = T;
        c[3] = (long long)hx;
        c[4] = (long long)hy;
        c[5] = W;
        c[6] = (long long)start;
        __threadfence_system();
        c[0] = s;
        __threadfence_system();
        posted = expert_call_now();
        int ok = 1;
        while (c[8] != s) {
            if (expert_call_now() - posted > timeout_ns) {
                ok = 0;
                c[11] = s;
                break;
            }
        }
        __threadfence_system();
        seen = expert_call_now();
        answered = ok;
    }
    __syncthreads();
    const volatile float* y = hy;
    const int m = T * H;
    const float nan = __int_as_float(0x7fc00000);
    const int step = EXPERT_CALL_UNROLL * blockDim.x;
    for (int base = threadIdx.x; base < m; base += step) {
        float v[EXPERT_CALL_UNROLL];
#pragma unroll
        for (int j = 0; j < EXPERT_CALL_UNROLL; ++j) {  // the loads first: several bus reads in flight
            const int i = base + j * blockDim.x;
            v[j] = i < m ? y[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < EXPERT_CALL_UNROLL; ++j) {
            const int i = base + j * blockDim.x;
            if (i < m) out[i] = answered ? v[j] : nan;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        c[12] = (long long)start;
        c[13] = (long long)posted;
        c[14] = (long long)seen;
        c[15] = (long long)expert_call_now();
        __threadfence_system();
    }
}
