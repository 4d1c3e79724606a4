/* topk_cuda_internal.h — the CUDA top-k's launch shape and selection paths, for bench/ and tests/
 * only. The product API is kernels/cuda/topk_cuda.h; nothing in teacher_cache/, student_train/ or model/
 * includes this header.
 *
 * tkd_topk_cuda picks one of three paths per row (topk_cuda.h says how); the tests build rows that
 * must take each path and check, through tkd_topk_cuda_paths, that they did; the benchmark prints
 * how many rows of realistic logits took the fast path. Header usable from C; CUDA builds only.
 */
#ifndef TKD_TOPK_CUDA_INTERNAL_H
#define TKD_TOPK_CUDA_INTERNAL_H

#include "common/status.h"
#include "kernels/cuda/topk_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TKD_TOPK_CUDA_THREADS 256 /* one block per row, 4 blocks per SM */
#define TKD_TOPK_CUDA_BIN_BITS 12 /* pass 1 bins keys by their top 12 bits */
#define TKD_TOPK_CUDA_CAP 4096    /* candidate slots per row in shared memory */

/* The selection paths, indices of the counters below. */
enum {
    TKD_TOPK_CUDA_PATH_ONE_PASS = 0, /* candidates of pass 1 sorted */
    TKD_TOPK_CUDA_PATH_REFINED = 1,  /* overflowed; one refinement pass, one collection pass */
    TKD_TOPK_CUDA_PATH_EXACT = 2,    /* overflowed; two refinement passes, the ordered collection */
    TKD_TOPK_CUDA_PATHS = 3,
};

/* Waits for the stream and copies out (then zeroes) how many rows took each path since the last
 * call; rows with a non-finite logit are counted nowhere. */
tkd_status tkd_topk_cuda_paths(tkd_topk_cuda_ws *ws, void *stream,
                               unsigned long long counts[TKD_TOPK_CUDA_PATHS]);

#ifdef __cplusplus
}
#endif

#endif /* TKD_TOPK_CUDA_INTERNAL_H */
