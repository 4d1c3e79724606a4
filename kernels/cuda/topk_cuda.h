/* topk_cuda.h — the CUDA top-k + LSE of a chunk of logits already on the device.
 *
 * Same contract as kernels/cpu/topk.h (sorted by logit, ties by the smaller id; raw fp32 values;
 * lse = log Σ exp(t/τ)) and exactly the same ids and values as tkd_topk_cpu; lse agrees to ~1e-7
 * relative (fp32 exps of 16 logits summed in fp32, then in double). One block of 256 threads per
 * row, float4 loads when V % 4 == 0 and the chunk is 16-byte aligned (scalar loads otherwise).
 *   Pass 1, the only full read in the common case: the online max/sum LSE, finiteness, a histogram
 *   of the top 12 bits of the order-preserving keys, and a shared-memory buffer of candidates
 *   (key, id) at or above a threshold: the bin of the k-th largest key seen so far (first set from
 *   the first 4096 logits, raised whenever the buffer fills), so every key of the row at or above
 *   the final k-th bin is in the buffer. A bitonic sort of those candidates by (key desc, id asc)
 *   gives the k winners (path 0).
 *   A row with more than 4096 keys at or above a threshold bin (a plateau of near-equal logits)
 *   overflows the buffer and takes refinement passes: the next 12 bits of the k-th bin; if the keys
 *   at or above that sub-bin fit, one pass collects them for the sort (path 1); otherwise the last 8
 *   bits give the exact k-th key and an ordered pass takes the ties at it by id (path 2).
 *
 * Launchers are asynchronous on the given stream (a cudaStream_t passed as void *, NULL = default
 * stream). A non-finite logit cannot be reported from inside a kernel: it sets a flag in the
 * workspace, and tkd_topk_cuda_sync() waits for the stream and turns the flag into
 * TKD_ERR_NUMERIC naming the first bad row. The tail draws (kernels/cuda/tail_sample_cuda.h) share the
 * workspace and its flags. Header usable from C; requires a build with the CUDA backend.
 */
#ifndef TKD_TOPK_CUDA_H
#define TKD_TOPK_CUDA_H

#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Device flags + a pinned host copy; one per stream, made once, reused for every chunk. The
 * fields belong to kernels/cuda/topk_cuda.cu and kernels/cuda/tail_sample_cuda.cu. */
typedef struct tkd_topk_cuda_ws {
    unsigned long long *d_flags; /* (2) device: first non-finite row, first bad-id row; ~0 = none */
    unsigned long long *h_flags; /* (2) pinned host copy read by tkd_topk_cuda_sync */
    unsigned long long *d_paths; /* (3) device: rows per selection path (topk_cuda_internal.h) */
} tkd_topk_cuda_ws;

/* Allocates a workspace on the current device; the caller frees it with tkd_topk_cuda_ws_free. */
tkd_status tkd_topk_cuda_ws_create(tkd_topk_cuda_ws **out);

/* Frees it; NULL is a no-op. */
void tkd_topk_cuda_ws_free(tkd_topk_cuda_ws *ws);

/* Enqueues the top-k of each row. d_logits (C, V) fp32 device rows; d_idx (C, k), d_val (C, k),
 * d_lse (C) device outputs, caller-owned. Argument errors (tkd_topk_check_args) return at once;
 * launch failures return TKD_ERR_DEVICE. */
tkd_status tkd_topk_cuda(tkd_topk_cuda_ws *ws, const float *d_logits, int64_t C, int64_t V, int k,
                         float tau, uint32_t *d_idx, float *d_val, float *d_lse, void *stream);

/* Waits for the stream, then reports (and clears) what the kernels flagged since the last call:
 * TKD_ERR_NUMERIC for a non-finite logit, TKD_ERR_INVALID_ARG for a top-k id ≥ V given to the
 * tail draws, each naming the first such row of the chunk; TKD_ERR_DEVICE for a kernel fault. */
tkd_status tkd_topk_cuda_sync(tkd_topk_cuda_ws *ws, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TKD_TOPK_CUDA_H */
