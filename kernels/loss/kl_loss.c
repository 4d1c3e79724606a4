/* kl_loss.c — the parts of the KL loss shared by every implementation: parameter defaults,
 * variant names, parameter checks and the validation of a batch's teacher side. */
#include "kernels/loss/kl_loss.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

const char *const tkd_kl_variant_names[] = {"renorm", "tail", "sampled", NULL};

int tkd_kl_variant_parse(const char *name)
{
    if (!name)
        return -1;
    for (int i = 0; tkd_kl_variant_names[i]; i++)
        if (strcmp(name, tkd_kl_variant_names[i]) == 0)
            return i;
    return -1;
}

const char *tkd_kl_variant_name(tkd_kl_variant v)
{
    return (unsigned)v <= TKD_KL_VARIANT_SAMPLED ? tkd_kl_variant_names[v] : "unknown";
}

const char *const tkd_kl_divergence_names[] = {"fkl", "rkl", "jsd", "skl", "srkl", "tvd", NULL};

int tkd_kl_divergence_parse(const char *name)
{
    if (!name)
        return -1;
    for (int i = 0; tkd_kl_divergence_names[i]; i++)
        if (strcmp(name, tkd_kl_divergence_names[i]) == 0)
            return i;
    return -1;
}

const char *tkd_kl_divergence_name(tkd_kl_divergence d)
{
    return (unsigned)d <= TKD_KL_DIVERGENCE_TVD ? tkd_kl_divergence_names[d] : "unknown";
}

void tkd_kl_params_defaults(tkd_kl_params *p, int k)
{
    memset(p, 0, sizeof *p);
    p->variant = TKD_KL_VARIANT_RENORM;
    p->divergence = TKD_KL_DIVERGENCE_FKL;
    p->jsd_beta = 0.5f;
    p->skew_alpha = 0.1f; /* DistiLLM's default */
    p->temperature = 1.0f;
    p->alpha = 1.0f;
    p->k = k;
    p->k_use = k;
    p->s = 0;
    p->chunk_rows = 0;
    p->grad_in_forward = 0;
    p->ignore_index = -100;
    p->grad_scale = 1.0f;
}

/* The divergence's parameters, and whether it is defined with the variant. sampled's target is 0
 * on every tail token no draw hit, where reverse KL's q·log(q/0) is infinite; jsd at β = 1 and srkl
 * at α = 0 are reverse KL. Without draws sampled's target drops the tail mass r: not a
 * distribution, which only fkl (linear in the target) tolerates. */
static tkd_status check_divergence(const tkd_kl_params *p)
{
    const tkd_kl_divergence dv = p->divergence;
    if ((unsigned)dv > TKD_KL_DIVERGENCE_TVD)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: kd.divergence %d is not one of fkl, rkl, jsd, skl, "
                             "srkl, tvd", (int)dv);
    if (!(p->jsd_beta >= 0.0f && p->jsd_beta <= 1.0f))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: kd.jsd_beta = %g must lie in [0, 1]",
                             (double)p->jsd_beta);
    if (!(p->skew_alpha >= 0.0f && p->skew_alpha < 1.0f))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: kd.skew_alpha = %g must lie in [0, 1) (at 1 the "
                             "skewed divergence is 0 whatever the student)", (double)p->skew_alpha);
    if (p->variant != TKD_KL_VARIANT_SAMPLED || dv == TKD_KL_DIVERGENCE_FKL)
        return TKD_OK;
    const char *name = tkd_kl_divergence_name(dv);
    if (dv == TKD_KL_DIVERGENCE_RKL || (dv == TKD_KL_DIVERGENCE_JSD && p->jsd_beta == 1.0f) ||
        (dv == TKD_KL_DIVERGENCE_SRKL && p->skew_alpha == 0.0f))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "kl_loss: kd.divergence = %s%s is not defined with kd.variant = sampled: reverse KL "
                             "is infinite on the tail tokens no draw hit; use kd.variant = tail",
                             name, dv == TKD_KL_DIVERGENCE_JSD ? " with kd.jsd_beta = 1"
                                   : dv == TKD_KL_DIVERGENCE_SRKL ? " with kd.skew_alpha = 0" : "");
    if (p->s == 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "kl_loss: kd.divergence = %s with kd.variant = sampled needs tail draws (s = 0): "
                             "without them the target drops the tail mass and is not a distribution", name);
    return TKD_OK;
}

tkd_status tkd_kl_params_check(const tkd_kl_params *p, int v)
{
    if (!p)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: params is NULL");
    if ((unsigned)p->variant > TKD_KL_VARIANT_SAMPLED)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: variant %d is not renorm, tail or sampled",
                             (int)p->variant);
    if (!(p->temperature > 0.0f) || !isfinite(p->temperature))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: temperature %g must be finite and > 0",
                             (double)p->temperature);
    if (!(p->alpha >= 0.0f && p->alpha <= 1.0f))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: alpha %g must lie in [0, 1]", (double)p->alpha);
    if (v < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: vocabulary size %d must be >= 1", v);
    if (p->k < 0 || p->k_use < 0 || p->k_use > p->k)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: k_use %d must lie in [0, k = %d]", p->k_use, p->k);
    if (p->k_use > v)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: k_use %d exceeds the vocabulary size %d",
                             p->k_use, v);
    if (p->dense && (p->variant != TKD_KL_VARIANT_RENORM || p->k != v || p->k_use != v))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: dense (the teacher online) takes the teacher's whole "
                             "distribution: variant renorm and k = k_use = V = %d (got %s, k %d, k_use %d)", v,
                             tkd_kl_variant_name(p->variant), p->k, p->k_use);
    /* alpha = 0 with no teacher columns is plain cross-entropy: CE-only training (e.g. a teacher
     * trained from scratch) runs through the same fused kernel and never reads teacher arrays. */
    const int ce_only = p->alpha == 0.0f && p->k_use == 0 && p->s == 0;
    if (p->variant == TKD_KL_VARIANT_SAMPLED) {
        if (p->s < 0)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: tail draws s = %d must be >= 0", p->s);
        if (p->k_use == 0 && p->s == 0 && !ce_only)
            return tkd_error_set(TKD_ERR_INVALID_ARG,
                                 "kl_loss: sampled with k_use = 0 and no tail draws has no target; "
                                 "use a cache with /tail/indices or k_use >= 1");
    } else if (p->k_use == 0 && !ce_only) {
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: %s needs k_use >= 1 (only sampled allows 0)",
                             tkd_kl_variant_name(p->variant));
    }
    if (!ce_only)
        TKD_TRY(check_divergence(p));
    if (p->chunk_rows < 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: chunk_rows %d must be >= 0 (0 = auto)",
                             p->chunk_rows);
    if (!isfinite(p->grad_scale))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: grad_scale must be finite");
    return TKD_OK;
}

/* The pointers the teacher side of a variant needs (validate does not need h and w). */
static tkd_status check_pointers(const tkd_kl_params *p, const tkd_kl_batch *b)
{
    if (!b || b->n < 0 || b->v < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: batch is NULL or has N < 0 or V < 1");
    if (!b->labels && b->n > 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: batch has no labels");
    if (p->dense)
        return b->n > 0 && (!b->teacher_h || !b->teacher_w || b->teacher_d < 1)
                   ? tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: dense: the batch has no teacher hidden states or "
                                   "LM head")
                   : TKD_OK;
    if (p->k_use > 0 && b->n > 0 && (!b->topk_idx || !b->topk_logit))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: batch has no top-k indices or logits");
    if (p->variant != TKD_KL_VARIANT_RENORM && (p->k_use > 0 || p->s > 0) && b->n > 0 && !b->teacher_lse)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: %s needs the teacher LSE",
                             tkd_kl_variant_name(p->variant));
    if (p->variant == TKD_KL_VARIANT_SAMPLED && p->s > 0 && b->n > 0 && !b->tail_idx)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "kl_loss: sampled with s = %d needs tail draws (the cache's /tail/indices)", p->s);
    return TKD_OK;
}

tkd_status tkd_kl_batch_check(const tkd_kl_params *p, const tkd_kl_batch *b)
{
    if (!b)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: batch is NULL");
    TKD_TRY(tkd_kl_params_check(p, b->v));
    TKD_TRY(check_pointers(p, b));
    if (b->d < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: hidden size D = %d must be >= 1", b->d);
    if (b->n > 0 && (!b->h || !b->w))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: batch has no hidden states or LM-head weight");
    return TKD_OK;
}

/* tail and sampled read the stored logits as probabilities exp(t/τ − lse): their sum over the
 * stored columns cannot exceed 1 for an exact cache (kl_loss.h, TKD_KL_MASS_MAX). */
static tkd_status check_mass(const tkd_kl_params *p, const float *lg, int kk, float lse, int64_t i)
{
    double mass = 0.0;
    for (int j = 0; j < kk; j++)
        mass += exp((double)lg[j] / p->temperature - lse);
    if (mass <= TKD_KL_MASS_MAX)
        return TKD_OK;
    return tkd_error_set(TKD_ERR_FORMAT,
                         "kl_loss: row %lld: the teacher's stored probabilities sum to %g over the top-%d (at most "
                         "%g for a cache whose logits were stored within %g of the teacher's); the cache's logits "
                         "were rounded too coarsely or its LSE does not belong to them",
                         (long long)i, mass, kk, TKD_KL_MASS_MAX, TKD_KL_LOGIT_ROUND_TOL);
}

/* One row's teacher side; `seen` is a V-bit map, all clear on entry and on return. */
static tkd_status validate_row(const tkd_kl_params *p, const tkd_kl_batch *b, int64_t i, uint8_t *seen)
{
    const int kk = p->k_use, v = b->v;
    const int32_t *idx = b->topk_idx ? b->topk_idx + i * (int64_t)p->k : NULL;
    const float *lg = b->topk_logit ? b->topk_logit + i * (int64_t)p->k : NULL;
    tkd_status st = TKD_OK;
    int j = 0;
    for (; j < kk; j++) {
        int32_t t = idx[j];
        if (t < 0 || t >= v) {
            st = tkd_error_set(TKD_ERR_FORMAT,
                               "kl_loss: row %lld: top-k index %d (column %d) is outside the vocabulary "
                               "[0, %d); the cache was made for another vocabulary",
                               (long long)i, (int)t, j, v);
            break;
        }
        if (seen[t >> 3] & (1u << (t & 7))) {
            st = tkd_error_set(TKD_ERR_FORMAT,
                               "kl_loss: row %lld: top-k index %d appears twice (column %d); the cache is corrupt",
                               (long long)i, (int)t, j);
            break;
        }
        seen[t >> 3] |= (uint8_t)(1u << (t & 7));
        if (!isfinite(lg[j])) {
            st = tkd_error_set(TKD_ERR_FORMAT,
                               "kl_loss: row %lld: teacher logit at column %d is not finite (%g); the cache is "
                               "corrupt or its logits overflowed their dtype",
                               (long long)i, j, (double)lg[j]);
            j++;
            break;
        }
    }
    if (st == TKD_OK && p->variant != TKD_KL_VARIANT_RENORM && b->teacher_lse && !isfinite(b->teacher_lse[i]))
        st = tkd_error_set(TKD_ERR_FORMAT, "kl_loss: row %lld: teacher LSE is not finite (%g); the cache is corrupt",
                           (long long)i, (double)b->teacher_lse[i]);
    if (st == TKD_OK && p->variant != TKD_KL_VARIANT_RENORM && b->teacher_lse)
        st = check_mass(p, lg, kk, b->teacher_lse[i], i);
    if (st == TKD_OK && p->variant == TKD_KL_VARIANT_SAMPLED) {
        const int32_t *dr = b->tail_idx ? b->tail_idx + i * (int64_t)p->s : NULL;
        for (int d = 0; d < p->s && st == TKD_OK; d++) {
            int32_t t = dr[d];
            if (t < 0 || t >= v)
                st = tkd_error_set(TKD_ERR_FORMAT,
                                   "kl_loss: row %lld: tail draw %d = %d is outside the vocabulary [0, %d)",
                                   (long long)i, d, (int)t, v);
            else if (seen[t >> 3] & (1u << (t & 7)))
                st = tkd_error_set(TKD_ERR_FORMAT,
                                   "kl_loss: row %lld: tail draw %d = %d is inside the row's top-%d; draws "
                                   "must come from outside the top-k (the cache is corrupt)",
                                   (long long)i, d, (int)t, kk);
        }
    }
    for (int c = 0; c < j; c++) /* clear what this row set, so the map stays all-zero */
        if (idx[c] >= 0 && idx[c] < v)
            seen[idx[c] >> 3] = 0;
    return st;
}

tkd_status tkd_kl_validate(const tkd_kl_params *p, const tkd_kl_batch *b)
{
    if (!b)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: batch is NULL");
    uint8_t *seen = calloc((size_t)b->v / 8 + 1, 1);
    if (!seen)
        return tkd_error_set(TKD_ERR_NOMEM, "kl_loss: validate: out of memory for %d bits", b->v);
    tkd_status st = tkd_kl_validate_scratch(p, b, seen);
    free(seen);
    return st;
}

tkd_status tkd_kl_validate_scratch(const tkd_kl_params *p, const tkd_kl_batch *b, uint8_t *seen)
{
    if (!b)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss: batch is NULL");
    TKD_TRY(tkd_kl_params_check(p, b->v));
    TKD_TRY(check_pointers(p, b));
    tkd_status st = TKD_OK;
    for (int64_t i = 0; i < b->n && st == TKD_OK; i++) {
        int32_t y = b->labels[i];
        if (y == p->ignore_index)
            continue; /* masked rows are never trained on; their teacher side may be padding */
        if (y < 0 || y >= b->v) {
            st = tkd_error_set(TKD_ERR_FORMAT,
                               "kl_loss: row %lld: label %d is outside the vocabulary [0, %d) and is not "
                               "ignore_index %d",
                               (long long)i, (int)y, b->v, p->ignore_index);
            break;
        }
        if (!p->dense) /* dense: no stored columns to check */
            st = validate_row(p, b, i, seen);
    }
    return st;
}
