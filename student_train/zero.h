/* zero.h — student-train's data-parallel side (ZeRO-1 over NCCL, one process per GPU): the
 * communicator, this rank's shard of the flat parameter arrays, the gradient reductions that start
 * during the backward pass, and the collectives of a step, an evaluation and a checkpoint.
 *
 * A step on every rank: forward and backward of its part of the global batch, the loss scaled by
 * its label tokens over the global count (tkd_zero_sum before the backward), so the summed
 * gradient is the one-process gradient of the global batch up to summation order. The model's
 * gradient hook (tkd_model_set_grad_hook) reduce-scatters each block's gradients into their
 * owners' shards as soon as that block's backward is enqueued, while the earlier blocks' backward
 * runs (the last micro-step only: before it the gradients are not final). Then the norm of the
 * shards (all-reduced), clipping and AdamW on this rank's shard (tkd_adamw_init_shard), and the
 * all-gather of the bf16 compute weights.
 *
 * Memory per parameter per rank: bf16 compute weights 2 B, fp32 gradients 4 B (the backward
 * accumulates whole tensors), the int16 residual that makes the compute copy the exact fp32 master
 * 2 B (the model's buffer is whole: only the shard is kept current, and tkd_zero_gather_master
 * makes it whole before a save), AdamW moments 8 B / world (4 B / world with optim.state_dtype bf16).
 */
#ifndef TKD_ZERO_H
#define TKD_ZERO_H

#include <stddef.h>
#include <stdint.h>

#include "common/dist.h"
#include "common/status.h"
#include "model/model.h"
#include "model/optim.h"

typedef struct tkd_zero tkd_zero;

/* Joins the ranks of d: rank 0 makes the NCCL id, tkd_rdzv_share hands it out (rc, whose
 * timeout_s also bounds every collective), heartbeats go to beat_dir (one file per rank, named by
 * tkd_dist_late_ranks when a collective times out). m (CUDA, trainable) gets the gradient hook.
 * *out owned by the caller (tkd_zero_close, before m is freed). */
tkd_status tkd_zero_open(const tkd_dist_info *d, const tkd_rdzv_config *rc, const char *beat_dir, tkd_model *m,
                         tkd_zero **out);
void tkd_zero_close(tkd_zero *z); /* NULL is a no-op */

/* This rank's shard [*begin, *end) of the m->n_params parameters. */
void tkd_zero_shard(const tkd_zero *z, size_t *begin, size_t *end);

/* v[0..n) = the sum over the ranks (n <= 16); `what` names it in errors. */
tkd_status tkd_zero_sum(tkd_zero *z, double *v, int n, const char *what);

/* The step now running (heartbeats and error messages); beats at most once a second (a lost beat
 * only weakens a later message, so it is not an error). */
void tkd_zero_begin_step(tkd_zero *z, int64_t step);

/* Arms the hook for the next backward (the last micro-step's: its gradients are final). */
void tkd_zero_arm(tkd_zero *z);

/* The step's update after the last micro-step's backward: the gradient reductions the hook did not
 * issue, the global norm (*norm_out) and clip coefficient, AdamW on this rank's shard (o from
 * tkd_adamw_init_shard) with the coefficient inside, then every rank's shard of the bf16 compute
 * weights gathered. */
tkd_status tkd_zero_update(tkd_zero *z, tkd_adamw *o, double lr, double max_norm, double *norm_out);

/* Every rank's shard of the master weights' residuals gathered (the compute copy is gathered after
 * every step), so that the whole fp32 master is current (a save or tkd_model_get_params reads it). */
tkd_status tkd_zero_gather_master(tkd_zero *z);

#endif /* TKD_ZERO_H */
