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
    int *bucket;         /* (V) divergences but fkl: the token's bucket, -1 for none */
    double *ba, *bla;    /* (V + 1) per bucket: the teacher's mass and its log */
    double *bm, *bsum;   /* (V + 1) per bucket: max of z over it, then log Σ exp z over it */
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

/* ---- divergences other than fkl: the row's buckets written out token by token ---------------- */

/* x·(lx − ly), 0 where x = 0 */
static double xlog_ratio(double x, double lx, double ly)
{
    return x > 0.0 ? x * (lx - ly) : 0.0;
}

/* F(A, C) of the divergence on one bucket and W = C·∂F/∂C, literally (the mixture formed as a sum,
 * its log taken plainly). jsd at β = 0 and 1 is forward and reverse KL, as in TRL; the skews at
 * α = 0 too (where their plain mixture would be a probability that may underflow). */
static double ref_div_term(const tkd_kl_params *p, double A, double LA, double C, double LC, double *W)
{
    const double beta = p->jsd_beta, al = p->skew_alpha;
    double M, F;
    tkd_kl_divergence dv = p->divergence;
    if (dv == TKD_KL_DIVERGENCE_JSD && (beta == 0.0 || beta == 1.0))
        dv = beta == 0.0 ? TKD_KL_DIVERGENCE_FKL : TKD_KL_DIVERGENCE_RKL;
    if ((dv == TKD_KL_DIVERGENCE_SKL || dv == TKD_KL_DIVERGENCE_SRKL) && al == 0.0)
        dv = dv == TKD_KL_DIVERGENCE_SKL ? TKD_KL_DIVERGENCE_FKL : TKD_KL_DIVERGENCE_RKL;
    switch (dv) {
    case TKD_KL_DIVERGENCE_FKL:
        *W = -A;
        return xlog_ratio(A, LA, LC);
    case TKD_KL_DIVERGENCE_RKL:
        *W = C > 0.0 ? C * (LC - LA + 1.0) : 0.0;
        return xlog_ratio(C, LC, LA);
    case TKD_KL_DIVERGENCE_JSD:
        M = beta * A + (1.0 - beta) * C;
        *W = C > 0.0 ? (1.0 - beta) * C * (LC - log(M)) : 0.0;
        return beta * xlog_ratio(A, LA, log(M)) + (1.0 - beta) * xlog_ratio(C, LC, log(M));
    case TKD_KL_DIVERGENCE_SKL:
        M = al * A + (1.0 - al) * C;
        *W = M > 0.0 ? -(1.0 - al) * A * C / M : 0.0;
        return xlog_ratio(A, LA, log(M));
    case TKD_KL_DIVERGENCE_SRKL:
        M = al * C + (1.0 - al) * A;
        F = xlog_ratio(C, LC, log(M));
        *W = C > 0.0 ? C * (LC - log(M) + 1.0 - al * C / M) : 0.0;
        return F;
    case TKD_KL_DIVERGENCE_TVD:
        *W = 0.5 * C * (C > A ? 1.0 : C < A ? -1.0 : 0.0);
        return 0.5 * fabs(A - C);
    }
    *W = 0.0;
    return 0.0;
}

/* The row's buckets: each teacher token its own; tail: one bucket for every token outside I (the
 * teacher's mass max(r, TKD_KL_TAIL_MASS_MIN)); sampled: each drawn token its own and one for the
 * undrawn rest (mass 0); renorm: the k' tokens alone. Returns the number of buckets. */
static int ref_buckets(const tkd_kl_params *p, int v, double r, ref_row *w)
{
    int nb = 0, rest = -1;
    for (int j = 0; j < v; j++)
        w->bucket[j] = -1;
    for (int j = 0; j < v; j++)
        if (w->in_i[j] || (p->variant == TKD_KL_VARIANT_SAMPLED && w->target[j] > 0.0)) {
            w->ba[nb] = w->target[j];
            w->bla[nb] = w->logtarget[j];
            w->bucket[j] = nb++;
        }
    for (int j = 0; j < v && p->variant != TKD_KL_VARIANT_RENORM; j++)
        if (w->bucket[j] < 0) {
            if (rest < 0) {
                rest = nb++;
                w->ba[rest] = p->variant == TKD_KL_VARIANT_TAIL ? fmax(r, TKD_KL_TAIL_MASS_MIN) : 0.0;
                w->bla[rest] = w->ba[rest] > 0.0 ? log(w->ba[rest]) : -INFINITY;
            }
            w->bucket[j] = rest;
        }
    return nb;
}

/* A divergence's row: KD_z over the buckets, and ∂KD_z/∂z_v = (q_v/C_b)·(W_b − C_b·Σ W), where the
 * student's bucket masses C_b are its probabilities summed over each bucket and normalised over
 * the tokens in buckets (all of V, or renorm's k'). dz (V) gets ∂KD_z/∂z. */
static double ref_row_div(const tkd_kl_params *p, int v, const double *s, double r, ref_row *w, double *dz)
{
    const double tau = p->temperature;
    const int nb = ref_buckets(p, v, r, w);
    for (int c = 0; c < nb; c++)
        w->bm[c] = -INFINITY, w->bsum[c] = 0.0;
    for (int j = 0; j < v; j++)
        if (w->bucket[j] >= 0)
            w->bm[w->bucket[j]] = fmax(w->bm[w->bucket[j]], s[j] / tau);
    for (int j = 0; j < v; j++)
        if (w->bucket[j] >= 0)
            w->bsum[w->bucket[j]] += exp(s[j] / tau - w->bm[w->bucket[j]]);
    double top = -INFINITY, norm = 0.0;
    for (int c = 0; c < nb; c++)
        w->bsum[c] = w->bm[c] + log(w->bsum[c]), top = fmax(top, w->bsum[c]); /* log Σ_b exp z */
    for (int c = 0; c < nb; c++)
        norm += exp(w->bsum[c] - top);
    norm = top + log(norm);
    double kd = 0.0, wsum = 0.0, *wb = w->bm; /* bm is free again: it holds W_b from here */
    for (int c = 0; c < nb; c++) {
        const double lc = w->bsum[c] - norm;
        kd += ref_div_term(p, w->ba[c], w->bla[c], exp(lc), lc, &wb[c]);
        wsum += wb[c];
    }
    for (int j = 0; j < v; j++) {
        const int c = w->bucket[j];
        dz[j] = c < 0 ? 0.0 : exp(s[j] / tau - w->bsum[c]) * (wb[c] - exp(w->bsum[c] - norm) * wsum);
    }
    return kd;
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
    const int teacher = p->k_use > 0 || (p->variant == TKD_KL_VARIANT_SAMPLED && p->s > 0); /* else CE only */
    if (p->divergence != TKD_KL_DIVERGENCE_FKL && teacher) {
        double *dz = w->logtarget; /* the target's logs are in the buckets now */
        *kd_out = tau * tau * ref_row_div(p, v, s, r, w, dz);
        *ce_out = lse_s - s[y];
        for (int j = 0; g && j < v; j++)
            g[j] = alpha * tau * dz[j] + (1.0 - alpha) * (exp(s[j] - lse_s) - (j == y ? 1.0 : 0.0));
        return;
    }
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

static void ref_row_free(ref_row *w)
{
    free(w->target), free(w->logtarget), free(w->in_i), free(w->bucket), free(w->ba), free(w->bla), free(w->bm),
        free(w->bsum);
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
    const size_t nd = sizeof(double) * (size_t)(v + 1);
    ref_row w = {malloc(nd), malloc(nd), malloc((size_t)v), malloc(sizeof(int) * (size_t)v), malloc(nd), malloc(nd),
                 malloc(nd), malloc(nd)};
    if (!s || !g || !w.target || !w.logtarget || !w.in_i || !w.bucket || !w.ba || !w.bla || !w.bm || !w.bsum) {
        free(s), free(g), ref_row_free(&w);
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
    free(s), free(g), ref_row_free(&w);
    return TKD_OK;
}
