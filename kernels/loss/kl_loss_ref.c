/* kl_loss_ref.c — the dense float64 reference of the KL loss (tests only).
 *
 * Deliberately plain and independent of the chunked code: it materialises all N x V student
 * logits in double, builds each row's teacher target as a dense V-vector and applies the formulas
 * of docs/loss.md literally. It defines what the fast paths must compute. */
#include "kernels/loss/kl_loss.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* log Σ exp(x_v) over the v with skip[v] == 0 (all v when skip is NULL); -inf when none. */
static double lse_dense(const double *x, const unsigned char *skip, int v, double scale)
{
    double m = -INFINITY;
    for (int j = 0; j < v; j++)
        if (!(skip && skip[j]) && x[j] * scale > m)
            m = x[j] * scale;
    if (m == -INFINITY)
        return -INFINITY;
    double sum = 0.0;
    for (int j = 0; j < v; j++)
        if (!(skip && skip[j]))
            sum += exp(x[j] * scale - m);
    return m + log(sum);
}

typedef struct ref_row {
    double *target;      /* (V) dense teacher target */
    double *logtarget;   /* (V) its log where target > 0, computed in the log domain */
    unsigned char *in_i; /* (V) 1 on the row's first k' teacher tokens */
} ref_row;

/* Fills the dense target of row i; returns the tail mass r that `tail` spreads like the student. */
static double ref_target(const tkd_kl_params *p, const tkd_kl_batch *b, int64_t i, ref_row *w)
{
    const int v = b->v, kk = p->k_use;
    const double tau = p->temperature;
    const int32_t *idx = b->topk_idx ? b->topk_idx + i * (int64_t)p->k : NULL;
    const float *t = b->topk_logit ? b->topk_logit + i * (int64_t)p->k : NULL;
    memset(w->target, 0, sizeof(double) * (size_t)v);
    memset(w->in_i, 0, (size_t)v);
    double lse_top = -INFINITY; /* renorm's normaliser over the k' stored logits */
    if (p->variant == TKD_KL_VARIANT_RENORM) {
        for (int j = 0; j < kk; j++) /* logtarget is free scratch until filled below */
            w->logtarget[j] = t[j];
        lse_top = lse_dense(w->logtarget, NULL, kk, 1.0 / tau);
    }
    double mass = 0.0;
    for (int j = 0; j < kk; j++) {
        double lp = p->variant == TKD_KL_VARIANT_RENORM ? t[j] / tau - lse_top
                                                         : t[j] / tau - (double)b->teacher_lse[i];
        w->in_i[idx[j]] = 1;
        w->logtarget[idx[j]] = lp;
        w->target[idx[j]] = exp(lp);
        mass += exp(lp);
    }
    if (p->variant == TKD_KL_VARIANT_RENORM || kk == v)
        return 0.0; /* no tail: renorm drops it, and with k' = V there is none */
    double r = 1.0 - mass > 0.0 ? 1.0 - mass : 0.0;
    if (p->variant == TKD_KL_VARIANT_SAMPLED && p->s > 0) {
        const int32_t *dr = b->tail_idx + i * (int64_t)p->s;
        for (int d = 0; d < p->s; d++)
            w->target[dr[d]] += r / p->s;
        for (int d = 0; d < p->s; d++)
            w->logtarget[dr[d]] = log(w->target[dr[d]]);
    }
    return r;
}

/* One kept row: adds its loss parts, writes its ∂(row loss)/∂s into g (V) when g != NULL. */
static void ref_row_loss(const tkd_kl_params *p, const tkd_kl_batch *b, int64_t i, const double *s,
                         ref_row *w, double *kd_out, double *ce_out, double *g)
{
    const int v = b->v;
    const double tau = p->temperature, alpha = p->alpha;
    const int32_t y = b->labels[i];
    double r = ref_target(p, b, i, w);
    double lse_z = lse_dense(s, NULL, v, 1.0 / tau);
    double lse_s = lse_dense(s, NULL, v, 1.0);
    double kd = 0.0, mass = 0.0;
    for (int j = 0; j < v; j++) {
        if (w->target[j] > 0.0)
            kd += w->target[j] * (w->logtarget[j] - (s[j] / tau - lse_z));
        mass += w->target[j];
    }
    double lse_tail = -INFINITY; /* log Σ_{v ∉ I} exp(z_v): log(1 − Q) = lse_tail − lse_z */
    if (p->variant == TKD_KL_VARIANT_TAIL) {
        lse_tail = lse_dense(s, w->in_i, v, 1.0 / tau);
        if (r > 0.0)
            kd += r * (log(r) - (lse_tail - lse_z));
        mass += r;
    }
    *kd_out = tau * tau * kd;
    *ce_out = lse_s - s[y];
    if (!g)
        return;
    for (int j = 0; j < v; j++) {
        double q = exp(s[j] / tau - lse_z), q1 = exp(s[j] - lse_s);
        double dkd = mass * q - w->target[j];
        if (p->variant == TKD_KL_VARIANT_TAIL && !w->in_i[j] && r > 0.0)
            dkd -= r * exp(s[j] / tau - lse_tail); /* r·q_v/(1 − Q) */
        g[j] = alpha * tau * dkd + (1.0 - alpha) * (q1 - (j == y ? 1.0 : 0.0));
    }
}

tkd_status tkd_kl_ref_f64(const tkd_kl_params *p, const tkd_kl_batch *b, tkd_kl_result *res,
                          double *dh, double *dw)
{
    TKD_TRY(tkd_kl_validate(p, b));
    if (!b->h || !b->w || !res)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss ref: h, w and res are required");
    const int64_t n = b->n;
    const int d = b->d, v = b->v;
    double *s = malloc(sizeof(double) * (size_t)v);
    double *g = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1) * (size_t)v); /* (N, V) dS */
    ref_row w = {malloc(sizeof(double) * (size_t)v), malloc(sizeof(double) * (size_t)v), malloc((size_t)v)};
    if (!s || !g || !w.target || !w.logtarget || !w.in_i) {
        free(s), free(g), free(w.target), free(w.logtarget), free(w.in_i);
        return tkd_error_set(TKD_ERR_NOMEM, "kl_loss ref: out of memory for N x V = %lld x %d doubles",
                             (long long)n, v);
    }
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++)
        kept += b->labels[i] != p->ignore_index;
    double kd_sum = 0.0, ce_sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double *gi = g + i * (int64_t)v;
        memset(gi, 0, sizeof(double) * (size_t)v);
        if (b->labels[i] == p->ignore_index)
            continue;
        for (int j = 0; j < v; j++) { /* s = h Wᵀ in double */
            double acc = 0.0;
            for (int c = 0; c < d; c++)
                acc += (double)b->h[i * d + c] * (double)b->w[(int64_t)j * d + c];
            s[j] = acc;
        }
        double kd, ce;
        ref_row_loss(p, b, i, s, &w, &kd, &ce, gi);
        kd_sum += kd;
        ce_sum += ce;
        for (int j = 0; j < v; j++)
            gi[j] /= (double)kept; /* gradients are of the mean */
    }
    res->n_kept = kept;
    res->kd = kept ? kd_sum / kept : 0.0;
    res->ce = kept ? ce_sum / kept : 0.0;
    res->loss = p->alpha * res->kd + (1.0 - p->alpha) * res->ce;
    if (dh)
        for (int64_t i = 0; i < n; i++)
            for (int c = 0; c < d; c++) {
                double acc = 0.0;
                for (int j = 0; j < v; j++)
                    acc += g[i * v + j] * b->w[(int64_t)j * d + c];
                dh[i * d + c] = acc;
            }
    if (dw)
        for (int j = 0; j < v; j++)
            for (int c = 0; c < d; c++) {
                double acc = 0.0;
                for (int64_t i = 0; i < n; i++)
                    acc += g[i * v + j] * b->h[i * d + c];
                dw[(int64_t)j * d + c] = acc;
            }
    free(s), free(g), free(w.target), free(w.logtarget), free(w.in_i);
    return TKD_OK;
}
