/* cuda_mem.h — device memory for every .cu file (and the tests and benchmarks that drive them):
 * allocation with an out-of-memory message a user can act on, freeing that tolerates NULL, and the
 * plain synchronous copies. Header usable from C; defined only in CUDA builds. */
#ifndef TKD_CUDA_MEM_H
#define TKD_CUDA_MEM_H

#include <stddef.h>
#include <stdlib.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cudaMalloc of `bytes` on the current device. Out of memory is TKD_ERR_DEVICE_OOM with a message
 * naming `what`, the size asked and the device's free/total memory, and `hint` (what to lower, e.g.
 * "lower run.batch_size"; NULL for none). Other failures are TKD_ERR_DEVICE. */
tkd_status tkd_cuda_malloc(void **out, size_t bytes, const char *what, const char *hint);

/* Pinned host memory (cudaMallocHost), same messages. */
tkd_status tkd_cuda_malloc_host(void **out, size_t bytes, const char *what);

void tkd_cuda_free(void *p);      /* NULL is a no-op; teardown errors are not actionable */
void tkd_cuda_free_host(void *p); /* NULL is a no-op */

/* Synchronous copies and zero-fill of `bytes` on the legacy default stream, so they are ordered
 * with the kernels launched there. TKD_ERR_DEVICE names the failing call. */
tkd_status tkd_cuda_to_device(void *dst, const void *src, size_t bytes); /* host -> device */
tkd_status tkd_cuda_to_host(void *dst, const void *src, size_t bytes);   /* device -> host */
tkd_status tkd_cuda_memzero(void *p, size_t bytes);                      /* device */

/* Free and total memory of the current device (cudaMemGetInfo). */
tkd_status tkd_cuda_mem_info(size_t *free_bytes, size_t *total_bytes);

/* The ledger of live device memory by the `what` of tkd_cuda_malloc (every device allocation of
 * topkd goes through it): bytes live now and at most since the process started, and the live
 * allocations, per name; what the device uses beyond their sum is the CUDA context, cuBLAS's and
 * cuDNN's own workspaces and allocator rounding (bench/student_bench.c --memory prints it).
 * Process-wide and thread-safe; all devices together. */
typedef struct tkd_cuda_mem_use {
    const char *what; /* the name (owned by the ledger) */
    size_t live;      /* bytes allocated under it and not freed */
    size_t peak;      /* the most live at once */
    int count;        /* live allocations */
} tkd_cuda_mem_use;

/* Up to cap names into out, most live bytes first; returns how many names the ledger holds. */
int tkd_cuda_mem_ledger(tkd_cuda_mem_use *out, int cap);

/* The sum of live bytes over every name. */
size_t tkd_cuda_mem_live(void);

#ifdef __cplusplus
}

/* The create function every CUDA workspace shares: *out = a new zeroed T that setup(T *) (returning
 * tkd_status) makes ready; when it fails, the half-made T goes to destroy (the workspace's free
 * function, which takes one) and *out stays NULL. nomem: the out-of-host-memory message. C++ only. */
template <class T, class Setup>
inline tkd_status tkd_cuda_ws_create(T **out, void (*destroy)(T *), const char *nomem, Setup setup)
{
    *out = NULL;
    T *x = (T *)calloc(1, sizeof *x);
    if (!x)
        return tkd_error_set(TKD_ERR_NOMEM, "%s", nomem);
    const tkd_status st = setup(x);
    if (st != TKD_OK) {
        destroy(x);
        return st;
    }
    *out = x;
    return TKD_OK;
}

/* Teardown call f(x) (cudaStreamDestroy, cudaEventSynchronize, cublasDestroy, ...) when x is set:
 * NULL is a no-op and errors are not actionable, as for tkd_cuda_free. C++ only. */
template <class T, class R> inline void tkd_cuda_release(R (*f)(T), T x)
{
    if (x)
        (void)f(x);
}

/* tkd_cuda_free of each pointer in turn (NULL ones skipped): a workspace's device buffers. C++ only. */
template <class... P> inline void tkd_cuda_free_all(P *...p)
{
    (tkd_cuda_free(p), ...);
}

/* The free function every CUDA workspace shares, the mirror of tkd_cuda_ws_create: release(ws)
 * frees what ws holds, then ws goes; NULL is a no-op. C++ only. */
template <class T, class Release> inline void tkd_cuda_ws_free(T *ws, Release release)
{
    if (!ws)
        return;
    release(ws);
    free(ws);
}
#endif

#endif /* TKD_CUDA_MEM_H */
