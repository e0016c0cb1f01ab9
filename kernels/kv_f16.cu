// The f16 KV cache (CupyF16KVCache in engine/backends/cupy_backend.py): rows (capacity, n_kv, D) of IEEE
// half values, rounded to nearest even from fp32 (the NumPy twin: NumpyF16KVCache, `x.astype(float16)`).
//
// kernels/build.py puts this file before attention.cu in the module "attention_f16": KV_ELEM and the two
// loads below make attention.cu's flash_prefill_g and flash_decode read the cache as it is stored, each
// value widened to fp32 in registers as it is loaded (no fp32 copy of the cache; products, softmax and
// sums stay fp32). kv_append_f16 writes appended rows.

#define KV_ELEM u16

// Values i..i+3 of the cache (i a multiple of 4, so the 8-byte load is aligned: rows are D >= 64 values),
// as stored (kv_raw4: what flash_decode keeps in flight) and widened to fp32 (kv_widen4).
typedef uint2 kv_raw4_t;
__device__ __forceinline__ kv_raw4_t kv_raw4(const u16* __restrict__ p, i64 i) { return *(const uint2*)(p + i); }
__device__ __forceinline__ kv_raw4_t kv_raw4_zero() { return make_uint2(0u, 0u); }
__device__ __forceinline__ float4 kv_widen4(kv_raw4_t w) {
    return make_float4(h2f((u16)(w.x & 0xffffu)), h2f((u16)(w.x >> 16)), h2f((u16)(w.y & 0xffffu)),
                       h2f((u16)(w.y >> 16)));
}
__device__ __forceinline__ float4 kv_load4(const u16* __restrict__ p, i64 i) { return kv_widen4(kv_raw4(p, i)); }

__device__ __forceinline__ float kv_load1(const u16* __restrict__ p, i64 i) { return h2f(p[i]); }

__device__ __forceinline__ void kv_store1(u16* __restrict__ p, i64 i, float x, int lane) { p[i] = f2h_rn(x); }

// Rows start..start+T-1 of the K and V caches (start = *start_ptr when start_ptr is given: a captured
// decode step) get T rows of row_k (K) and row_v (V) fp32 values, rounded to half.
extern "C" __global__ void kv_append_f16(const float* __restrict__ k, const float* __restrict__ v,
                                         u16* __restrict__ kc, u16* __restrict__ vc, int start,
                                         const int* __restrict__ start_ptr, int T, int row_k, int row_v) {
    pdl_entry();
    i64 s = start_ptr != 0 ? *start_ptr : start;
    i64 n_k = (i64)T * row_k, n_v = (i64)T * row_v;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n_k || i < n_v; i += (i64)gridDim.x * blockDim.x) {
        if (i < n_k) kc[s * row_k + i] = f2h_rn(k[i]);
        if (i < n_v) vc[s * row_v + i] = f2h_rn(v[i]);
    }
}
