// The q8_0 KV cache (CupyQ8KVCache in engine/backends/cupy_backend.py): every row of n_kv * D values in
// ggml's Q8_0 blocks, as llama.cpp stores its q8_0 cache: per 32 values an fp16 scale d then 32 int8
// q (34 bytes), value = d * q. The bytes are those gguf-py's Q8_0 quantizer writes (the NumPy twin,
// engine/kvquant.py quantize_q8_0, is checked against it; NumpyQ8KVCache keeps the same values and
// scales in two arrays).
//
// kernels/build.py puts this file before attention.cu in the module "attention_q8_0": KV_ELEM and the two
// loads below make flash_prefill_g and flash_decode read the blocks directly, dequantizing in registers
// (d * q in fp32, the NumPy twin's product) with no fp32 copy of the cache. Element i of the cache (its
// index in the (capacity, n_kv, D) value layout) is value i % 32 of block i / 32: D is a multiple of 32,
// so a block never crosses a row. kv_append_q8_0 quantizes appended rows.

#define KV_ELEM u8
#define KVQ8_BLOCK 34

// Values i..i+3 (i a multiple of 4: one block). 34 * b + 2 + 4j is even, so two 16-bit loads. kv_raw4
// is what flash_decode keeps in flight (the block's scale and the four bytes), kv_widen4 the values.
struct kv_raw4_t {
    u16 d;
    int w;
};
__device__ __forceinline__ kv_raw4_t kv_raw4(const u8* __restrict__ p, i64 i) {
    const u8* b = p + (i >> 5) * KVQ8_BLOCK;
    kv_raw4_t r;
    r.d = *(const u16*)b;
    r.w = ld_u16x2(b + 2 + (i & 31));
    return r;
}
__device__ __forceinline__ kv_raw4_t kv_raw4_zero() {
    kv_raw4_t r;
    r.d = 0;
    r.w = 0;
    return r;
}
__device__ __forceinline__ float4 kv_widen4(kv_raw4_t r) {
    float d = h2f(r.d);
    int w = r.w;
    return make_float4(d * (float)(i8)(w & 0xff), d * (float)(i8)((w >> 8) & 0xff),
                       d * (float)(i8)((w >> 16) & 0xff), d * (float)(i8)((w >> 24) & 0xff));
}
__device__ __forceinline__ float4 kv_load4(const u8* __restrict__ p, i64 i) { return kv_widen4(kv_raw4(p, i)); }

__device__ __forceinline__ float kv_load1(const u8* __restrict__ p, i64 i) {
    const u8* b = p + (i >> 5) * KVQ8_BLOCK;
    return h2f(*(const u16*)b) * (float)(i8)b[2 + (i & 31)];
}

// Store value i of the cache, quantized with the 31 other values of its block: the 32 lanes of a warp
// call it together with i % 32 == lane (attn_prep.cu, kv_append_q8_0). ggml's quantize_row_q8_0_ref:
// d = max|x| / 127, q = roundf(x * (1 / d)) (0 for an all-zero block), d stored as fp16 (rounded to
// nearest even); the quantization uses the fp32 d.
__device__ __forceinline__ void kv_store1(u8* __restrict__ p, i64 i, float v, int lane) {
    float amax = warp_max_abs(v);
    float id;
    float d = q8_0_scale(amax, id);
    int q = (int)roundf(v * id);
    u8* dst = p + (i >> 5) * KVQ8_BLOCK;
    if (lane == 0) *(u16*)dst = f2h_rn(d);
    dst[2 + lane] = (u8)(i8)q;
}

// Quantize T rows of `row` fp32 values (x, contiguous) into cache rows start..start+T-1 (start =
// *start_ptr when given: a captured decode step). One warp per block of 32 values (kv_store1).
extern "C" __global__ void kv_append_q8_0(const float* __restrict__ x, u8* __restrict__ cache, int start,
                                          const int* __restrict__ start_ptr, int T, int row) {
    pdl_entry();
    i64 s = start_ptr != 0 ? *start_ptr : start;
    int lane = threadIdx.x & 31;
    i64 blk = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    i64 n_blocks = (i64)T * (row / 32);
    if (blk >= n_blocks) return;
    kv_store1(cache, s * row + blk * 32 + lane, x[blk * 32 + lane], lane);
}
