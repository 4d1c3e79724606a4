/* cuda_mem.h — device memory for every .cu file: allocation with an out-of-memory message a user
 * can act on, and freeing that tolerates NULL. Header usable from C; defined only in CUDA builds. */
#ifndef TKD_CUDA_MEM_H
#define TKD_CUDA_MEM_H

#include <stddef.h>

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

#ifdef __cplusplus
}
#endif

#endif /* TKD_CUDA_MEM_H */
