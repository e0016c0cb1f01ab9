// Embedding rows of any weight format: out (T, H) = table[ids[t]]. One thread per 32-value block.
template <int QT>
__global__ void embed_rows(const u8* __restrict__ wq, const u16* __restrict__ wd, const int* __restrict__ ids,
                           float* __restrict__ out, int T, int H) {
    pdl_entry();
    int nb = H >> 5;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)T * nb) return;
    int t = (int)(i / nb), b = (int)(i % nb);
    i64 r = ids[t];
    float w[32];
    deq_block32<QT>(wq + r * row_bytes<QT>(H), wd + r * nb, b, w);
    float4* o = (float4*)(out + (i64)t * H + 32 * b);
#pragma unroll
    for (int k = 0; k < 8; k++) o[k] = make_float4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
}
