/* topk.h — per-row top-k and log-sum-exp of a chunk of teacher logits (CPU paths).
 *
 * teacher-dump runs the LM head chunk by chunk; for each chunk of logits (C, V) it keeps, per row,
 * the k largest logits with their token ids and the full-vocabulary log-sum-exp at temperature τ:
 *   lse = log Σ_v exp(t_v / τ)
 * Outputs per row are sorted by logit, largest first; equal logits are ordered by the smaller token
 * id first (-0.0 and +0.0 count as equal). That total order makes every path (reference, fast CPU,
 * CUDA in kernels/cuda/topk_cuda.h) return exactly the same ids and the same raw fp32 values.
 * Logits are stored raw (not divided by τ).
 *
 *   tkd_topk_ref — scalar reference: a full sort of each row, LSE in double.
 *   tkd_topk_cpu — the fast path: one pass per row keeping a size-k min-heap (in the output row
 *                  itself, so nothing is allocated), LSE in double, OpenMP over rows.
 */
#ifndef TKD_TOPK_H
#define TKD_TOPK_H

#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest k any path accepts (the CUDA kernel keeps k candidates per row in shared memory). */
#define TKD_TOPK_MAX_K 128

/* Checks the shared preconditions: C ≥ 0, 1 ≤ k ≤ TKD_TOPK_MAX_K, k ≤ V ≤ INT32_MAX, τ finite > 0.
 * TKD_ERR_INVALID_ARG with a message otherwise. */
tkd_status tkd_topk_check_args(int64_t C, int64_t V, int k, float tau);

/* The first non-finite value of logits (C, V) in row-major order: returns 1 and sets *row, *col, or
 * returns 0. For the message of a caller that knows what the rows are (sequence, position). */
int tkd_topk_first_nonfinite(const float *logits, int64_t C, int64_t V, int64_t *row, int64_t *col);

/* Scalar reference. logits (C, V) fp32 rows; out_idx (C, k), out_val (C, k), out_lse (C), all
 * caller-owned. A NaN or ±Inf logit is TKD_ERR_NUMERIC naming the (first) row and column; the
 * outputs are then unspecified. Allocates one (V) index array per call (tests only). */
tkd_status tkd_topk_ref(const float *logits, int64_t C, int64_t V, int k, float tau,
                        uint32_t *out_idx, float *out_val, float *out_lse);

/* Fast path; same contract and exactly the same ids and values as tkd_topk_ref, lse equal up to
 * the order of a double sum. No allocation; OpenMP over rows. */
tkd_status tkd_topk_cpu(const float *logits, int64_t C, int64_t V, int k, float tau,
                        uint32_t *out_idx, float *out_val, float *out_lse);

#ifdef __cplusplus
}
#endif

#endif /* TKD_TOPK_H */
