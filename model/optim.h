/* optim.h — AdamW with decoupled weight decay, a warmup + cosine learning-rate schedule, global-norm
 * gradient clipping and gradient-accumulation helpers, over the flat parameter arrays of a model
 * (model/model.h). The update follows torch.optim.AdamW (single-tensor path) operation by
 * operation, so a training run can be checked against PyTorch step for step
 * (tests/test_hf_parity.c).
 */
#ifndef TKD_OPTIM_H
#define TKD_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "model/model.h"

typedef struct tkd_optim_config {
    double lr;           /* peak learning rate */
    double min_lr;       /* floor the cosine decays to */
    int64_t warmup_steps;
    int64_t total_steps; /* steps of warmup + cosine; later steps stay at min_lr */
    double beta1, beta2, eps;
    double weight_decay; /* decoupled: p ← p·(1 − lr·wd), only on tensors with decay = 1 */
    double clip_norm;    /* global L2 norm cap; <= 0 disables clipping */
} tkd_optim_config;

/* AdamW state: the moments share one allocation laid out like the parameters. Public so that
 * checkpoints can save and restore it (m, v: n floats each; step: updates taken so far). */
typedef struct tkd_adamw {
    tkd_optim_config cfg;
    size_t n;
    float *m; // (n) first moment
    float *v; // (n) second moment
    int64_t step;
} tkd_adamw;

/* Fills the defaults: lr 3e-4, min_lr 3e-5, no warmup, 1000 steps, betas (0.9, 0.95), eps 1e-8,
 * weight decay 0.1, clip 1.0. */
void tkd_optim_config_defaults(tkd_optim_config *c);

/* Learning rate of step s (0-based): lr·(s+1)/warmup during warmup, then
 * min_lr + ½(lr − min_lr)(1 + cos(π·(s − warmup)/(total − warmup))), min_lr after total. */
double tkd_optim_lr(const tkd_optim_config *c, int64_t step);

/* State for n parameters, moments zeroed. *out owned by the caller (tkd_adamw_free). */
tkd_status tkd_adamw_init(const tkd_optim_config *c, size_t n, tkd_adamw **out);
void tkd_adamw_free(tkd_adamw *o); /* NULL is a no-op */

/* One update of params (n) from grads (n) at learning rate lr, tensor by tensor from info (weight
 * decay where info[i].decay). Increments o->step first (bias correction uses the new count). */
void tkd_adamw_step(tkd_adamw *o, float *params, const float *grads, const tkd_param_info *info,
                    int n_info, double lr);

/* Global L2 norm of g (n), accumulated in double. */
double tkd_optim_grad_norm(const float *g, size_t n);

/* Clips g (n) to global norm max_norm as torch.nn.utils.clip_grad_norm_ does (coefficient
 * max_norm / (norm + 1e-6), applied only when below 1). Returns the norm before clipping; a
 * non-finite norm is TKD_ERR_NUMERIC (nothing is scaled), so a blown-up step is never taken. */
tkd_status tkd_optim_clip(float *g, size_t n, double max_norm, double *norm_out);

/* Gradient accumulation: g ← g·s (e.g. s = 1/micro_steps when losses were summed), and g ← 0. */
void tkd_optim_scale(float *g, size_t n, float s);
void tkd_optim_zero(float *g, size_t n);

#endif /* TKD_OPTIM_H */
