/* cuda_check.h — the one check macro for every CUDA and cuBLAS call (CUDA translation units only).
 * On failure it records "expr failed: <error> (func file:line)" and returns TKD_ERR_DEVICE, or
 * TKD_ERR_DEVICE_OOM for an out-of-memory, from the enclosing function (which returns tkd_status). */
#ifndef TKD_CUDA_CHECK_H
#define TKD_CUDA_CHECK_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/status.h"

static inline tkd_status tkd_cuda_status(cudaError_t e)
{
    return e == cudaErrorMemoryAllocation ? TKD_ERR_DEVICE_OOM : TKD_ERR_DEVICE;
}

static inline tkd_status tkd_cublas_status(cublasStatus_t e)
{
    return e == CUBLAS_STATUS_ALLOC_FAILED ? TKD_ERR_DEVICE_OOM : TKD_ERR_DEVICE;
}

#define TKD_CUDA_CHECK(expr)                                                                   \
    do {                                                                                       \
        cudaError_t tkd_ce_ = (expr);                                                          \
        if (tkd_ce_ != cudaSuccess)                                                            \
            return tkd_error_set(tkd_cuda_status(tkd_ce_), "%s failed: %s (%s %s:%d)", #expr, \
                                 cudaGetErrorString(tkd_ce_), __func__, __FILE__, __LINE__);   \
    } while (0)

#define TKD_CUBLAS_CHECK(expr)                                                                 \
    do {                                                                                       \
        cublasStatus_t tkd_be_ = (expr);                                                       \
        if (tkd_be_ != CUBLAS_STATUS_SUCCESS)                                                  \
            return tkd_error_set(tkd_cublas_status(tkd_be_), "%s failed: cublas status %d (%s %s:%d)", \
                                 #expr, (int)tkd_be_, __func__, __FILE__, __LINE__);           \
    } while (0)

#endif /* TKD_CUDA_CHECK_H */
