// Activation quantization to int8 blocks (Q8_1 style), the input of every DP4A kernel.
// Per block of 32 fp32 values: d = max|x| / 127 (fp32), q = round(x / d) (int8), s = d * sum(q) (fp32).
// Keeping d and s in fp32 (llama.cpp keeps fp16) costs 4 bytes per block and removes one rounding.
// One warp per block of 32 values.

extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, i8* __restrict__ xq,
                                         float* __restrict__ xd, float* __restrict__ xs, i64 n_blocks) {
    i64 blk = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= n_blocks) return;
    int lane = threadIdx.x & 31;
    float v = x[blk * 32 + lane];
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    int q = (amax > 0.0f) ? __float2int_rn(v / d) : 0;
    xq[blk * 32 + lane] = (i8)q;
    float qs = warp_sum((float)q);
    if (lane == 0) {
        xd[blk] = d;
        xs[blk] = d * qs;
    }
}
