/* topk_cuda.h — the CUDA top-k + LSE of a chunk of logits already on the device.
 *
 * Same contract as kernels/topk.h (sorted by logit, ties by the smaller id; raw fp32 values;
 * lse = log Σ exp(t/τ)) and exactly the same ids and values as tkd_topk_cpu; lse agrees to ~1e-7
 * relative (float exps, double sums). One block per row: a 4-pass radix select over the order-
 * preserving integer keys of the logits finds the k-th largest key exactly (the first pass also
 * makes the online max/sum LSE and checks finiteness), one ordered pass collects the k winners
 * (ties at the threshold by smallest id), and a rank sort orders them.
 *
 * Launchers are asynchronous on the given stream (a cudaStream_t passed as void *, NULL = default
 * stream). A non-finite logit cannot be reported from inside a kernel: it sets a flag in the
 * workspace, and tkd_topk_cuda_sync() waits for the stream and turns the flag into
 * TKD_ERR_NUMERIC naming the first bad row. The tail draws (kernels/tail_sample_cuda.h) share the
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
 * fields belong to kernels/topk_cuda.cu and kernels/tail_sample_cuda.cu. */
typedef struct tkd_topk_cuda_ws {
    unsigned long long *d_flags; /* (2) device: first non-finite row, first bad-id row; ~0 = none */
    unsigned long long *h_flags; /* (2) pinned host copy read by tkd_topk_cuda_sync */
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
