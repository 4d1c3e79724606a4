/* tail_sample_cuda.h — the CUDA tail draws; the very same draws as tkd_tail_sample_cpu.
 *
 * The algorithm and why it is exact across devices are in kernels/cpu/tail_sample.h: integer weights
 * from tkd_tail_weight(), targets from the Philox stream of common/ctr_rng.h, inverse CDF over
 * integer prefix sums (associative, so a block scan equals the CPU's sequential sum). One block
 * per row: top-k ids into a shared bitmap; the tail max (float4 loads, 4 in flight per thread, when
 * V % 4 == 0 and the chunk is 16-byte aligned); the weight sum of each 256-logit segment, one warp
 * per segment; W and the segments' offsets by a scan; S targets rank-sorted in shared memory; then
 * only the segments that hold a target compute their weights again, and a warp scan hands each
 * target to the token holding it (for S = 80 and V = 152k, 80 of 594 segments at most).
 * Header usable from C; requires a build with the CUDA backend.
 */
#ifndef TKD_TAIL_SAMPLE_CUDA_H
#define TKD_TAIL_SAMPLE_CUDA_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/cuda/topk_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Enqueues S draws per row on stream (a cudaStream_t as void *). All arrays are device memory:
 * d_logits (C, V) fp32 raw logits; d_topk_idx (C, k); d_seq_index (C) global sequence index per
 * row; d_pos (C) position per row; d_out (C, S) draw order, caller-owned. Argument errors
 * (tkd_tail_sample_check_args) return at once; a non-finite logit or a top-k id ≥ V is flagged
 * in ws and reported by tkd_topk_cuda_sync(). */
tkd_status tkd_tail_sample_cuda(tkd_topk_cuda_ws *ws, const float *d_logits, int64_t C, int64_t V,
                                const uint32_t *d_topk_idx, int k, float tau, int S, uint64_t seed,
                                const int64_t *d_seq_index, const int32_t *d_pos, uint32_t *d_out,
                                void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TKD_TAIL_SAMPLE_CUDA_H */
