// Activation quantization to int8 blocks (Q8_1 style), the input of every DP4A kernel.
// Per block of 32 fp32 values: d = max|x| / 127 (fp32), q = round(x / d) (int8), s = d * sum(q) (fp32).
// Keeping d and s in fp32 (llama.cpp keeps fp16) costs 4 bytes per block and removes one rounding.
// One warp per block of 32 values; the arithmetic is q8_1_block (common.cuh), shared with the fused
// producers of fused.cu.

extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, i8* __restrict__ xq,
                                         float* __restrict__ xd, float* __restrict__ xs, i64 n_blocks) {
    pdl_entry();
    i64 blk = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= n_blocks) return;
    int lane = threadIdx.x & 31;
    q8_1_block(x[blk * 32 + lane], xq + blk * 32, xd + blk, xs + blk, lane);
}
