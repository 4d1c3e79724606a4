/* optim.h — AdamW with decoupled weight decay, a warmup + cosine learning-rate schedule, global-norm
 * gradient clipping and gradient-accumulation helpers, over the flat parameter arrays of a model
 * (model/model.h). The update follows torch.optim.AdamW (single-tensor path) operation by
 * operation, so a training run can be checked against PyTorch step for step
 * (tests/test_hf_parity.c).
 *
 * Two ways to hold the state: tkd_adamw_init keeps the moments in host memory (checkpoint tests;
 * tests/optim_testutil.h steps it over host arrays); tkd_adamw_init_on keeps them in a model's backend memory for
 * tkd_adamw_step_model and tkd_optim_clip_model, which run on the model's backend (the CPU: the same
 * loops, kernels/cpu/adamw.h; CUDA: one fused multi-tensor kernel over the master weights held as the
 * bf16 compute copy plus an int16 residual, model/model.h). Both give the same bits on the CPU.
 *
 * The moments are fp32 (8 bytes a parameter) or, with state_dtype TKD_ADAMW_DTYPE_BF16
 * (optim.state_dtype: bf16), bf16 (4 bytes a parameter): each update then loads them to fp32, takes
 * the same fp32 update and stores them back rounded to nearest even bf16 (kernels/cpu/adamw.h), so
 * the run is no longer torch's fp32 AdamW bit for bit. Both backends give the same bits either way.
 */
#ifndef TKD_OPTIM_H
#define TKD_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/cpu/adamw.h"
#include "model/model.h"

typedef struct tkd_optim_config {
    double lr;           /* peak learning rate */
    double min_lr;       /* floor the cosine decays to */
    int64_t warmup_steps;
    int64_t total_steps; /* steps of warmup + cosine; later steps stay at min_lr */
    double beta1, beta2, eps;
    double weight_decay; /* decoupled: p ← p·(1 − lr·wd), only on tensors with decay = 1 */
    double clip_norm;    /* global L2 norm cap; <= 0 disables clipping */
    tkd_adamw_dtype state_dtype; /* how the moments are kept: fp32 (default) or bf16 */
} tkd_optim_config;

/* AdamW state: the moments share one allocation laid out like the parameters. Public so that
 * checkpoints can save and restore it (m, v: n values each, kept as cfg.state_dtype, read and
 * written on the host as fp32 through tkd_adamw_moments_get / _set; step: updates taken so far).
 * Exactly one pair of moment pointers is set: m, v with fp32 state, m_bf16, v_bf16 with bf16. */
typedef struct tkd_adamw {
    tkd_optim_config cfg;
    size_t n;
    float *m; // (n) first moment, fp32 state (host, or backend memory with tkd_adamw_init_on); else NULL
    float *v; // (n) second moment
    uint16_t *m_bf16; // (n) first moment as bf16 bits, bf16 state (where m would be); else NULL
    uint16_t *v_bf16; // (n) second moment
    int64_t step;
    size_t begin;              /* the first parameter the state covers (tkd_adamw_init_shard; else 0):
                                * m and v hold parameters [begin, begin + n) */
    tkd_backend *be;           /* NULL: host state (tkd_adamw_init); else the model's backend */
    tkd_backend_adamw *table;  /* the model's tensors as the backend's segment table */
} tkd_adamw;

/* Fills the defaults: lr 3e-4, min_lr 3e-5, no warmup, 1000 steps, betas (0.9, 0.95), eps 1e-8,
 * weight decay 0.1, clip 1.0, fp32 moments. */
void tkd_optim_config_defaults(tkd_optim_config *c);

/* Learning rate of step s (0-based): lr·(s+1)/warmup during warmup, then
 * min_lr + ½(lr − min_lr)(1 + cos(π·(s − warmup)/(total − warmup))), min_lr after total. */
double tkd_optim_lr(const tkd_optim_config *c, int64_t step);

/* State for n parameters, moments zeroed. *out owned by the caller (tkd_adamw_free). */
tkd_status tkd_adamw_init(const tkd_optim_config *c, size_t n, tkd_adamw **out);
void tkd_adamw_free(tkd_adamw *o); /* NULL is a no-op */

/* State for model m's parameters in m's backend memory, moments zeroed (m->be must outlive it). */
tkd_status tkd_adamw_init_on(const tkd_optim_config *c, const tkd_model *m, tkd_adamw **out);

/* ZeRO-1: state for the shard [begin, end) of m's parameters only (common/dist.h's tkd_zero_range),
 * so each rank keeps the moments of its own shard: o->n = end − begin, o->begin = begin.
 * tkd_adamw_step_model then updates only those elements of the master and compute weights (the
 * caller all-gathers the rest); the moments functions move n values. */
tkd_status tkd_adamw_init_shard(const tkd_optim_config *c, const tkd_model *m, size_t begin, size_t end,
                                tkd_adamw **out);

/* One update of m's fp32 master weights from m->grads on m's backend (o from tkd_adamw_init_on for
 * m), as tkd_adamw_step: weight decay where the tensor's decay is set, o->step incremented first.
 * The compute weights are refreshed (CUDA: they are the master's high half). Enqueued. */
tkd_status tkd_adamw_step_model(tkd_adamw *o, tkd_model *m, double lr);

/* The same with the gradients read as g · grad_scale (the clip coefficient: data parallelism
 * computes it from every rank's shard; bit-identical to scaling g first). */
tkd_status tkd_adamw_step_model_scaled(tkd_adamw *o, tkd_model *m, double lr, float grad_scale);

/* tkd_optim_clip over m->grads on m's backend (waits for the gradients to get the norm). */
tkd_status tkd_optim_clip_model(tkd_model *m, double max_norm, double *norm_out);

/* tkd_optim_clip_model then tkd_adamw_step_model, with the same bits, but the clip coefficient is
 * applied inside the update (g·s formed and rounded per element as the scale pass would) instead of
 * a pass that scales m->grads in place: the gradients are read twice per step (norm, update)
 * instead of three times and written never (they keep their unclipped values). A non-finite norm
 * is TKD_ERR_NUMERIC and no update is taken. Per parameter and step on CUDA this moves 4 (norm) +
 * 28 (update: bf16 + residual master, g, m, v) bytes, plus the 4 of zeroing the gradients for the
 * next step: 36, against 4 + 8 (scale) + 30 (fp32 master and a bf16 copy) + 4 = 46 before.
 * Zeroing stays tkd_model_zero_grad's own pass: writing 0 from the update would move the same 4
 * bytes, an update over one shard of the parameters (ZeRO-1) would leave the others unzeroed, and
 * the gradients stay readable after the step. */
tkd_status tkd_adamw_clip_step_model(tkd_adamw *o, tkd_model *m, double lr, double max_norm, double *norm_out);

/* The moments as host fp32 arrays m and v (o->n floats each), and back (checkpoints). bf16 state is
 * widened on the way out (exact) and rounded to nearest even on the way in, so values that came out
 * go back in unchanged. */
tkd_status tkd_adamw_moments_get(const tkd_adamw *o, float *m, float *v);
tkd_status tkd_adamw_moments_set(tkd_adamw *o, const float *m, const float *v);

#endif /* TKD_OPTIM_H */
