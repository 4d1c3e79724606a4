/* topk_bench_cuda.cu — see topk_bench_cuda.h. Benchmark code only. */
#include "bench/topk_bench_cuda.h"

#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"

namespace {

/* splitmix64: a 64-bit hash of the element's index, so every element is filled independently. */
__device__ uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* One logit per thread (grid-stride): Box–Muller normal(0, 2), the bump, then the rounding. */
__global__ void fill_kernel(float *x, int64_t n, int f, uint64_t seed)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const uint64_t a = mix64(seed ^ (uint64_t)i * 2), b = mix64(seed ^ ((uint64_t)i * 2 + 1));
        const float u1 = ((a >> 40) + 0.5f) * (1.0f / 16777216.0f);
        const float u2 = (b >> 40) * (1.0f / 16777216.0f);
        float v = 2.0f * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
        if ((b & 0xffff) % 1000 == 0)
            v += 4.0f + 12.0f * (((a >> 8) & 0xffff) / 65536.0f);
        if (f == TKD_TOPK_BENCH_FILL_BF16)
            v = __bfloat162float(__float2bfloat16(v));
        else if (f == TKD_TOPK_BENCH_FILL_FLOOR)
            v = floorf(v);
        x[i] = v;
    }
}

} // namespace

extern "C" tkd_status tkd_topk_bench_fill_logits(float *d_logits, int64_t C, int64_t V,
                                                 tkd_topk_bench_fill f, uint64_t seed)
{
    fill_kernel<<<4096, 256>>>(d_logits, C * V, (int)f, seed);
    TKD_CUDA_CHECK(cudaGetLastError());
    TKD_CUDA_CHECK(cudaDeviceSynchronize());
    return TKD_OK;
}
