/* cuda_check.h — the one check macro for every CUDA, cuBLAS and cuDNN call (CUDA translation units
 * only). On failure it records "expr failed: <error> (func file:line)" and returns TKD_ERR_DEVICE, or
 * TKD_ERR_DEVICE_OOM for an out-of-memory, from the enclosing function (which returns tkd_status).
 * TKD_CUDNN_CHECK (builds with TKD_HAVE_CUDNN) also gives cuDNN's own last message and returns
 * TKD_ERR_UNSUPPORTED for cuDNN's NOT_SUPPORTED family (a graph or shape no engine takes). */
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

#ifdef TKD_HAVE_CUDNN
#include <cudnn_graph.h> /* cuDNN 9's graph API: CMake looks for this header, so no cuDNN 8 */

/* Records "expr failed: CUDNN_STATUS_... (code): <cuDNN's last message> (func file:line)" and
 * returns the status for it. Out of line of the macro so that a caller that must carry on (trying
 * the next engine) can record a failure the same way. */
static inline tkd_status tkd_cudnn_fail(cudnnStatus_t e, const char *expr, const char *func,
                                        const char *file, int line)
{
    char last[512] = "";
    cudnnGetLastErrorString(last, sizeof last); /* "" when cuDNN left no message */
    for (char *c = last; *c; c++) /* cuDNN's traceback is several lines: make it one */
        if (*c == '\n' || *c == '\r')
            *c = c[1] ? '|' : '\0';
    tkd_status st = TKD_ERR_DEVICE;
    if (e == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)
        st = TKD_ERR_DEVICE_OOM;
    else if ((int)e / 1000 * 1000 == (int)CUDNN_STATUS_NOT_SUPPORTED)
        st = TKD_ERR_UNSUPPORTED;
    return tkd_error_set(st, "%s failed: %s (%d)%s%s (%s %s:%d)", expr, cudnnGetErrorString(e), (int)e,
                         last[0] ? ": " : "", last, func, file, line);
}

#define TKD_CUDNN_CHECK(expr)                                                                  \
    do {                                                                                       \
        cudnnStatus_t tkd_de_ = (expr);                                                        \
        if (tkd_de_ != CUDNN_STATUS_SUCCESS)                                                   \
            return tkd_cudnn_fail(tkd_de_, #expr, __func__, __FILE__, __LINE__);               \
    } while (0)
#endif /* TKD_HAVE_CUDNN */

#endif /* TKD_CUDA_CHECK_H */
