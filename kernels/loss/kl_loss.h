/* kl_loss.h — the fused chunked LM-head + top-K distillation loss (CPU paths).
 *
 * Student logits s = H Wᵀ over the full vocabulary are never held for more than one chunk of rows:
 * forward computes per-row statistics (log-sum-exps, and Q for `tail`) and the loss chunk by chunk;
 * backward recomputes each chunk's logits, turns them into ∂loss/∂s in place, then dH = dS W and
 * dW += dSᵀ H. The maths is in docs/loss.md. Rows whose label equals ignore_index are skipped;
 * the loss is the mean over kept rows of alpha·KD + (1 − alpha)·CE.
 *
 * Three implementations share these structs:
 *   tkd_kl_ref_f64   — dense float64 reference (tests only; holds N x V doubles);
 *   tkd_kl_cpu_*     — the chunked OpenBLAS + OpenMP path;
 *   tkd_kl_cuda_*    — the CUDA path (kernels/loss/kl_loss_cuda.h), bf16 GEMMs with fp32 accumulation.
 */
#ifndef TKD_KL_LOSS_H
#define TKD_KL_LOSS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tkd_kl_variant {
    TKD_KL_VARIANT_RENORM = 0,  /* softmax(t/τ) over the k' stored tokens */
    TKD_KL_VARIANT_TAIL = 1,    /* exact p on top-k', the tail mass r matched to 1 − Q */
    TKD_KL_VARIANT_SAMPLED = 2, /* exact p on top-k' plus r/S per tail draw (unbiased) */
} tkd_kl_variant;

/* NULL-terminated, indexed by tkd_kl_variant: the one list of the variants' names (kd.variant's
 * allowed values, messages). */
extern const char *const tkd_kl_variant_names[];

/* Parses "renorm" | "tail" | "sampled"; -1 when unknown. And the reverse. */
int tkd_kl_variant_parse(const char *name);
const char *tkd_kl_variant_name(tkd_kl_variant v);

/* The divergence KD takes between the teacher's distribution p (formed by the variant) and the
 * student's q over the same buckets (docs/loss.md, "Divergences"). fkl is the loss as it always was;
 * the others are taken over the variant's buckets: renorm's k' tokens (q restricted to them and
 * renormalised), tail's k' tokens plus the tail bucket, sampled's target over V. */
typedef enum tkd_kl_divergence {
    TKD_KL_DIVERGENCE_FKL = 0,  /* forward KL(p ‖ q) */
    TKD_KL_DIVERGENCE_RKL = 1,  /* reverse KL(q ‖ p) */
    TKD_KL_DIVERGENCE_JSD = 2,  /* generalised JSD (TRL's GKD): β KL(p‖m) + (1−β) KL(q‖m), m = βp + (1−β)q */
    TKD_KL_DIVERGENCE_SKL = 3,  /* skew forward KL(p ‖ αp + (1 − α)q) (DistiLLM) */
    TKD_KL_DIVERGENCE_SRKL = 4, /* skew reverse KL(q ‖ αq + (1 − α)p) (DistiLLM) */
    TKD_KL_DIVERGENCE_TVD = 5,  /* total variation ½ Σ |p − q| */
} tkd_kl_divergence;

/* NULL-terminated, indexed by tkd_kl_divergence (kd.divergence's allowed values). */
extern const char *const tkd_kl_divergence_names[];

/* Parses "fkl" | "rkl" | "jsd" | "skl" | "srkl" | "tvd"; -1 when unknown. And the reverse. */
int tkd_kl_divergence_parse(const char *name);
const char *tkd_kl_divergence_name(tkd_kl_divergence d);

/* The teacher's tail bucket under `tail` for every divergence but fkl is max(r, this): r = 1 − Σp
 * is known only to the fp32 LSE's rounding (~1e-6 for |lse| ~ 20) and is 0 when rounding pushes Σp
 * past 1, where reverse KL's q·log(q/r) would be infinite for any student tail. fkl keeps r as is. */
#define TKD_KL_TAIL_MASS_MIN 1e-6

typedef struct tkd_kl_params {
    tkd_kl_variant variant;
    tkd_kl_divergence divergence; /* fkl (default) | rkl | jsd | skl | srkl | tvd */
    float jsd_beta;      /* jsd's β in [0, 1]: 0 is forward KL, 1 reverse KL (TRL's endpoints); default 0.5 */
    float skew_alpha;    /* skl / srkl's α in [0, 1): 0 is forward / reverse KL; default 0.1 */
    float temperature;   /* τ > 0; tail and sampled require τ == the cache's temperature */
    float alpha;         /* KD weight in [0, 1]; CE weight is 1 − alpha */
    int k;               /* stored top-k columns per row (row stride of topk_idx / topk_logit) */
    int k_use;           /* k' ≤ k: columns actually used (the first k', largest logits) */
    int s;               /* tail draws per row (row stride of tail_idx); sampled only, may be 0 */
    int chunk_rows;      /* rows per chunk; 0 picks a default from N, V and a memory target */
    int grad_in_forward; /* 1: make dH, dW during forward (6·N·D·V FLOPs instead of 8·N·D·V) */
    int ignore_index;    /* label value that excludes a row (HF convention: -100) */
    float grad_scale;    /* grad_in_forward only: forward makes the gradients of grad_scale·loss
                          * (backward's `scale` cannot reach them); default 1 */
    int dw_overwrite;    /* 1: dw holds no gradient yet (zeros, or anything to be replaced): the
                          * call that makes the gradients writes dW instead of adding to it (its
                          * first chunk does not read dw: V·D·4 bytes less); a call with no rows
                          * leaves dw as it was. 0 (default): dW += */
    int dense;           /* 1: online distillation from the teacher itself (issue 24's dense reference):
                          * the batch's teacher_h / teacher_w give the teacher's full distribution,
                          * its logits made chunk by chunk beside the student's (never the whole
                          * N × V); variant renorm and k = k_use = V (every token is a column);
                          * topk_* and teacher_lse unused. The CPU path and the CUDA one
                          * (kl_loss_cuda_dense.cu). 0 (default): a cache */
} tkd_kl_params;

/* Sets the defaults: renorm, fkl (jsd_beta 0.5, skew_alpha 0.1), τ = 1, alpha = 1, k_use = k, s = 0,
 * chunk auto, recompute mode, ignore_index = -100, grad_scale = 1. */
void tkd_kl_params_defaults(tkd_kl_params *p, int k);

/* One batch of rows, host pointers (fp32). */
typedef struct tkd_kl_batch {
    int64_t n;                 /* N rows (tokens) */
    int d;                     /* D hidden size */
    int v;                     /* V vocabulary size */
    const float *h;            /* (N, D) student final hidden states (after the final norm) */
    const float *w;            /* (V, D) LM-head weight */
    const int32_t *topk_idx;   /* (N, k) teacher top-k token ids, sorted by logit, largest first */
    const float *topk_logit;   /* (N, k) teacher raw logits (at the cache temperature) */
    const float *teacher_lse;  /* (N) teacher log-sum-exp over the full vocabulary */
    const int32_t *tail_idx;   /* (N, s) tail draws (sampled), or NULL */
    const int32_t *labels;     /* (N) next-token ids; ignore_index excludes the row */
    /* params.dense: through a backend's kl_stage these are backend act memory like kl_forward's h
     * and w (device bf16 on CUDA; validation never reads them) */
    const float *teacher_h;    /* params.dense: (N, Dt) the teacher's final hidden states */
    const float *teacher_w;    /* params.dense: (V, Dt) the teacher's LM head */
    int teacher_d;             /* params.dense: Dt */
} tkd_kl_batch;

typedef struct tkd_kl_result {
    double loss;     /* mean over kept rows of alpha·KD + (1 − alpha)·CE */
    double kd;       /* mean KD over kept rows: the divergence's value, τ²-scaled */
    double ce;       /* mean CE over kept rows */
    int64_t n_kept;  /* rows with label != ignore_index */
} tkd_kl_result;

/* Checks the parameters alone (τ > 0 finite, alpha in [0, 1], 0 ≤ k_use ≤ min(k, V), k_use ≥ 1
 * except for sampled, sampled needs k_use + s ≥ 1, chunk_rows ≥ 0, grad_scale finite, jsd_beta in
 * [0, 1], skew_alpha in [0, 1), and a divergence defined with the variant: with sampled, rkl (and
 * jsd at β = 1, srkl at α = 0, which are rkl) is refused, the target being 0 on the undrawn tail, and
 * every divergence but fkl needs s ≥ 1). TKD_ERR_INVALID_ARG names the field (the kd.* key for the
 * divergence's). Every implementation calls it on entry. */
tkd_status tkd_kl_params_check(const tkd_kl_params *p, int v);

/* Checks that a batch has the pointers its variant needs (h, w, labels; top-k when k_use > 0;
 * teacher_lse for tail/sampled; tail_idx for sampled with s > 0) and sane sizes. Cheap; every
 * implementation calls it on entry. Does not look at the values (that is tkd_kl_validate). */
tkd_status tkd_kl_batch_check(const tkd_kl_params *p, const tkd_kl_batch *b);

/* How exactly a cache holds the teacher's distribution. teacher-dump refuses to store a top-k logit
 * whose rounding to cache.logits_dtype moves it by more than TKD_KL_LOGIT_ROUND_TOL · τ (τ the
 * cache temperature): each stored probability exp(t/τ − lse) is then within a factor
 * e^(±1/8) of the teacher's, and a row's stored top-k mass at most e^(1/8) ≈ 1.133, since the exact
 * mass is ≤ 1 by the definition of the LSE. The loss refuses a row whose stored mass exceeds
 * TKD_KL_MASS_MAX (the same bound plus room for the float32 LSE's own rounding, |lse|·2^-24, which
 * stays below 0.01 for |lse| < 2^17): beyond it the cache was rounded too coarsely or is not one
 * of ours, and `tail` (r = 1 − Σp) and `sampled` (target weights) would train on a broken target. */
#define TKD_KL_LOGIT_ROUND_TOL 0.125
#define TKD_KL_MASS_MAX 1.15

/* Checks the teacher side of a batch before it is trained on: every used index in [0, V), no
 * duplicate among a row's first k' indices, teacher logits and LSE finite, labels in [0, V) or
 * ignore_index, tail draws in [0, V) and outside the row's top-k', and for tail and sampled the
 * row's stored top-k' mass Σ exp(t/τ − lse) ≤ TKD_KL_MASS_MAX. TKD_ERR_FORMAT names the row. */
tkd_status tkd_kl_validate(const tkd_kl_params *p, const tkd_kl_batch *b);

/* The same with a caller-owned scratch of V/8 + 1 bytes, all zero on entry and zero again on return
 * (so a training loop validates every batch without allocating). */
tkd_status tkd_kl_validate_scratch(const tkd_kl_params *p, const tkd_kl_batch *b, uint8_t *seen);

/* Dense float64 reference, independent of the chunked code (tests). Any of dh (N, D) / dw (V, D)
 * may be NULL; gradients are of result->loss (the mean) and are overwritten, not accumulated. */
tkd_status tkd_kl_ref_f64(const tkd_kl_params *p, const tkd_kl_batch *b, tkd_kl_result *res,
                          double *dh, double *dw);

/* Workspace for the chunked CPU path: sized once for (N max, V, chunk), reused every step. On
 * success *out is owned by the caller (tkd_kl_cpu_ws_free). */
typedef struct tkd_kl_cpu_ws tkd_kl_cpu_ws;
tkd_status tkd_kl_cpu_ws_create(tkd_kl_cpu_ws **out, const tkd_kl_params *p, int64_t n_max, int d,
                                int v);

/* tkd_kl_validate with the workspace's scratch: no allocation per batch. */
tkd_status tkd_kl_cpu_validate(tkd_kl_cpu_ws *ws, const tkd_kl_params *p, const tkd_kl_batch *b);
void tkd_kl_cpu_ws_free(tkd_kl_cpu_ws *ws); /* NULL is a no-op */

/* Forward: the loss and per-row statistics kept in ws for backward. With grad_in_forward it also
 * writes dh (N, D) and accumulates into dw (V, D) (writes it, with dw_overwrite) the gradient of
 * the mean loss. */
tkd_status tkd_kl_cpu_forward(tkd_kl_cpu_ws *ws, const tkd_kl_params *p, const tkd_kl_batch *b,
                              tkd_kl_result *res, float *dh, float *dw);

/* Backward (recompute mode): dh (N, D) overwritten with ∂(scale·loss)/∂H; dw (V, D) accumulated
 * (+=) with ∂(scale·loss)/∂W (overwritten with dw_overwrite). scale lets gradient accumulation divide by the micro-step count.
 * Must follow tkd_kl_cpu_forward on the same batch. */
tkd_status tkd_kl_cpu_backward(tkd_kl_cpu_ws *ws, const tkd_kl_params *p, const tkd_kl_batch *b,
                               float scale, float *dh, float *dw);

#ifdef __cplusplus
}
#endif

#endif /* TKD_KL_LOSS_H */
