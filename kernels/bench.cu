// Ceiling measurements for the probe and `minecart bench`: memory copy bandwidth, and peak rates of
// DP4A and fp32 FMA on register-resident data (no memory traffic). The loops are long chains of
// independent accumulators so latency is hidden; results are written so the compiler keeps the work.

extern "C" __global__ void copy_f4(const float4* __restrict__ src, float4* __restrict__ dst, i64 n) {
    pdl_entry();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

extern "C" __global__ void peak_dp4a(int* out, int iters, int seed) {
    pdl_entry();
    int a[8], acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) { a[i] = seed * (i + 1) + threadIdx.x; acc[i] = i; }
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int r = 0; r < 16; r++)
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = dp4a(a[i], a[(i + r) & 7], acc[i]);
    }
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) s += acc[i];
    if (s == 0x7fffffff) out[0] = s;  // practically never; keeps the loop alive
}

extern "C" __global__ void peak_fma(float* out, int iters, float seed) {
    pdl_entry();
    float a[8], acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) { a[i] = seed * (i + 1) + threadIdx.x; acc[i] = (float)i; }
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int r = 0; r < 16; r++)
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = fmaf(a[i], acc[i], a[(i + r) & 7]);
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) s += acc[i];
    if (s == 1.2345f) out[0] = s;
}
