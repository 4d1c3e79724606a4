/* moe_bench_cuda.cu — moe_bench's device side: random bf16 tensors and bytes (MXFP4 codes and
 * scales) drawn on the device (a counter hash, Box–Muller), the plain cuBLAS GEMMs of the floor,
 * and a probe of which type combinations this cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx)
 * takes. */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__global__ void randn_kernel(__nv_bfloat16 *p, size_t n, float std, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint64_t r = mix(seed + 0x9e3779b97f4a7c15ull * (i + 1));
        const float u1 = ((uint32_t)r + 1.0f) * 2.3283064e-10f, u2 = (uint32_t)(r >> 32) * 2.3283064e-10f;
        p[i] = __float2bfloat16_rn(std * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
    }
}

__global__ void bytes_kernel(uint8_t *p, size_t n, unsigned lo, unsigned span, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (uint8_t)(lo + mix(seed + 0x9e3779b97f4a7c15ull * (i + 1)) % span);
}

} // namespace

/* n bytes lo + (a uniform draw mod span) at p (device); 0 on success. */
extern "C" int moe_bench_bytes(uint8_t *p, size_t n, unsigned lo, unsigned span, uint64_t seed)
{
    bytes_kernel<<<1024, 256>>>(p, n, lo, span, seed);
    return cudaDeviceSynchronize() != cudaSuccess;
}

/* n bf16 values N(0, std²) at p (device); 0 on success. */
extern "C" int moe_bench_randn(uint16_t *p, size_t n, float std, uint64_t seed)
{
    randn_kernel<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16 *>(p), n, std, seed);
    return cudaDeviceSynchronize() != cudaSuccess;
}

/* c (m, n) fp32 = a (m, kd) bf16 · b (n, kd) bf16ᵀ, row-major, on the legacy stream; 0 on success. */
extern "C" int moe_bench_gemm(void *blas, const uint16_t *a, const uint16_t *b, int m, int n, int kd, float *c)
{
    const float one = 1.0f, zero = 0.0f;
    return cublasGemmEx((cublasHandle_t)blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, kd, &one, b, CUDA_R_16BF, kd, a,
                        CUDA_R_16BF, kd, &zero, c, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) !=
           CUBLAS_STATUS_SUCCESS;
}

/* The cublasStatus_t of a two-group grouped GEMM (64×64×64 each) with A and B of type ab and C of
 * type c (0: bf16, 1: fp16, 2: fp32), compute 32F. */
extern "C" int moe_bench_grouped_probe(void *blas, int ab, int c)
{
    static const cudaDataType_t kT[3] = {CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
    const int n = 64, groups = 2;
    void *buf = nullptr, **ptrs = nullptr;
    if (cudaMalloc(&buf, 3 * (size_t)groups * n * n * 4) != cudaSuccess || cudaMalloc((void **)&ptrs, 6 * sizeof(void *)))
        return -1;
    void *h[6];
    for (int i = 0; i < 6; i++)
        h[i] = (char *)buf + (size_t)i * n * n * 4;
    cudaMemcpy(ptrs, h, sizeof h, cudaMemcpyHostToDevice);
    cublasOperation_t ta[2] = {CUBLAS_OP_T, CUBLAS_OP_T}, tb[2] = {CUBLAS_OP_N, CUBLAS_OP_N};
    int dims[2] = {n, n}, size[2] = {1, 1};
    float alpha[2] = {1, 1}, beta[2] = {0, 0};
    cublasStatus_t st = cublasGemmGroupedBatchedEx((cublasHandle_t)blas, ta, tb, dims, dims, dims, alpha,
                                                   (const void *const *)ptrs, kT[ab], dims, (const void *const *)ptrs + 2,
                                                   kT[ab], dims, beta, ptrs + 4, kT[c], dims, groups, size,
                                                   CUBLAS_COMPUTE_32F);
    cudaDeviceSynchronize();
    cudaFree(ptrs);
    cudaFree(buf);
    return (int)st;
}
