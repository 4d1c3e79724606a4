/* cuda_mem.cu — see cuda_mem.h. */
#include "kernels/cuda/cuda_mem.h"

#include "kernels/cuda/cuda_check.h"

extern "C" tkd_status tkd_cuda_malloc(void **out, size_t bytes, const char *what, const char *hint)
{
    *out = NULL;
    cudaError_t e = cudaMalloc(out, bytes ? bytes : 1);
    if (e == cudaSuccess)
        return TKD_OK;
    *out = NULL;
    (void)cudaGetLastError();
    if (e != cudaErrorMemoryAllocation)
        return tkd_error_set(TKD_ERR_DEVICE, "%s: cudaMalloc of %.1f MiB failed: %s", what,
                             bytes / 1048576.0, cudaGetErrorString(e));
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    tkd_error_set(TKD_ERR_DEVICE_OOM, "%s: out of device memory asking for %.1f MiB (%.1f of %.1f GiB free)",
                  what, bytes / 1048576.0, free_b / 1073741824.0, total_b / 1073741824.0);
    return hint ? tkd_error_hint(TKD_ERR_DEVICE_OOM, "%s", hint) : TKD_ERR_DEVICE_OOM;
}

extern "C" tkd_status tkd_cuda_malloc_host(void **out, size_t bytes, const char *what)
{
    *out = NULL;
    cudaError_t e = cudaMallocHost(out, bytes ? bytes : 1);
    if (e == cudaSuccess)
        return TKD_OK;
    *out = NULL;
    (void)cudaGetLastError();
    return tkd_error_set(e == cudaErrorMemoryAllocation ? TKD_ERR_NOMEM : TKD_ERR_DEVICE,
                         "%s: pinned host allocation of %.1f MiB failed: %s", what, bytes / 1048576.0,
                         cudaGetErrorString(e));
}

extern "C" void tkd_cuda_free(void *p)
{
    if (p)
        (void)cudaFree(p);
}

extern "C" void tkd_cuda_free_host(void *p)
{
    if (p)
        (void)cudaFreeHost(p);
}

extern "C" tkd_status tkd_cuda_to_device(void *dst, const void *src, size_t bytes)
{
    TKD_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_to_host(void *dst, const void *src, size_t bytes)
{
    TKD_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_memzero(void *p, size_t bytes)
{
    TKD_CUDA_CHECK(cudaMemset(p, 0, bytes));
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_mem_info(size_t *free_bytes, size_t *total_bytes)
{
    TKD_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
    return TKD_OK;
}
