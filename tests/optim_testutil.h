/* optim_testutil.h — AdamW and gradient clipping over host arrays, the reference the tests check
 * the backends' optimizer against (tkd_adamw_step_model, tkd_optim_clip_model): the product updates
 * on a model's backend only, so these live with the tests and call kernels/cpu/adamw.h's loops
 * directly. State from tkd_adamw_init (host moments). */
#ifndef TKD_OPTIM_TESTUTIL_H
#define TKD_OPTIM_TESTUTIL_H

#include <stddef.h>

#include "common/status.h"
#include "model/optim.h"

/* One update of params (n) from grads (n) at learning rate lr, tensor by tensor from info (weight
 * decay where info[i].decay), with o's moments as they are kept (fp32 or bf16). Increments o->step
 * first (bias correction uses the new count). */
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

#endif /* TKD_OPTIM_TESTUTIL_H */
