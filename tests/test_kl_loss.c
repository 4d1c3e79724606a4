/* test_kl_loss.c — the KL loss: the float64 reference against identities that do not use its
 * formulas, validation errors, and the chunked CPU path against the reference. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/loss/kl_loss.h"
#include "tests/testutil.h"

/* ---- a synthetic batch built from a full teacher distribution ---------------------------- */

typedef struct kcase {
    int64_t n;
    int d, v, k, s;
    float *h;      /* (N, D) */
    float *w;      /* (V, D) */
    float *tfull;  /* (N, V) the teacher's full logits, from which the cache columns are cut */
    int32_t *idx;  /* (N, k) */
    float *tl;     /* (N, k) */
    float *lse;    /* (N) log Σ exp(t / τ_cache) */
    int32_t *draws;  /* (N, S) */
    int32_t *labels; /* (N) */
    double tau_cache;
    uint64_t rng;
} kcase;

static double urand(kcase *c)
{
    c->rng ^= c->rng << 13;
    c->rng ^= c->rng >> 7;
    c->rng ^= c->rng << 17;
    return ((c->rng >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static const float *sort_key; /* qsort has no context argument */
static int by_key_desc(const void *a, const void *b)
{
    float x = sort_key[*(const int32_t *)a], y = sort_key[*(const int32_t *)b];
    if (x != y)
        return x > y ? -1 : 1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

/* Cuts the cache columns (top-k, LSE at τ_cache, S tail draws) out of c->tfull. */
static void kcase_cut_teacher(kcase *c)
{
    int32_t *order = malloc(sizeof(int32_t) * (size_t)c->v);
    double *pt = malloc(sizeof(double) * (size_t)c->v);
    for (int64_t i = 0; i < c->n; i++) {
        const float *t = c->tfull + i * c->v;
        for (int j = 0; j < c->v; j++)
            order[j] = j;
        sort_key = t;
        qsort(order, (size_t)c->v, sizeof(int32_t), by_key_desc);
        double m = -INFINITY, sum = 0.0;
        for (int j = 0; j < c->v; j++)
            m = fmax(m, t[j] / c->tau_cache);
        for (int j = 0; j < c->v; j++)
            sum += exp(t[j] / c->tau_cache - m);
        c->lse[i] = (float)(m + log(sum));
        for (int j = 0; j < c->k; j++) {
            c->idx[i * c->k + j] = order[j];
            c->tl[i * c->k + j] = t[order[j]];
        }
        /* draws from the teacher distribution restricted to the tail outside the full top-k */
        double tail = 0.0;
        for (int j = c->k; j < c->v; j++)
            tail += pt[j] = exp(t[order[j]] / c->tau_cache - m);
        for (int s = 0; s < c->s; s++) {
            double u = urand(c) * tail, acc = 0.0;
            int pick = c->v - 1;
            for (int j = c->k; j < c->v; j++)
                if ((acc += pt[j]) >= u) {
                    pick = j;
                    break;
                }
            c->draws[i * c->s + s] = order[pick];
        }
        if (c->s >= 3) /* a deliberately repeated draw: repeats must add up */
            c->draws[i * c->s + 2] = c->draws[i * c->s];
    }
    free(order);
    free(pt);
}

static kcase kcase_make(int64_t n, int d, int v, int k, int s, double tau_cache, uint64_t seed)
{
    kcase c = {.n = n, .d = d, .v = v, .k = k, .s = s, .tau_cache = tau_cache, .rng = seed * 2654435761u + 7};
    c.h = malloc(sizeof(float) * (size_t)(n * d));
    c.w = malloc(sizeof(float) * (size_t)v * (size_t)d);
    c.tfull = malloc(sizeof(float) * (size_t)(n * v));
    c.idx = malloc(sizeof(int32_t) * (size_t)(n * (k ? k : 1)));
    c.tl = malloc(sizeof(float) * (size_t)(n * (k ? k : 1)));
    c.lse = malloc(sizeof(float) * (size_t)n);
    c.draws = malloc(sizeof(int32_t) * (size_t)(n * (s ? s : 1)));
    c.labels = malloc(sizeof(int32_t) * (size_t)n);
    tkd_test_randn(c.h, (size_t)(n * d), seed, 1.0f);
    tkd_test_randn(c.w, (size_t)v * (size_t)d, seed + 1, 0.7f);
    tkd_test_randn(c.tfull, (size_t)(n * v), seed + 2, 2.0f);
    for (int64_t i = 0; i < n; i++)
        c.labels[i] = i % 5 == 3 ? -100 : (int32_t)(urand(&c) * v); /* every fifth row masked */
    kcase_cut_teacher(&c);
    return c;
}

static void kcase_free(kcase *c)
{
    free(c->h), free(c->w), free(c->tfull), free(c->idx), free(c->tl), free(c->lse), free(c->draws),
        free(c->labels);
}

static tkd_kl_batch kcase_batch(const kcase *c)
{
    tkd_kl_batch b = {.n = c->n, .d = c->d, .v = c->v, .h = c->h, .w = c->w, .topk_idx = c->idx,
                      .topk_logit = c->tl, .teacher_lse = c->lse, .tail_idx = c->s ? c->draws : NULL,
                      .labels = c->labels};
    return b;
}

static double max_abs(const double *x, size_t n)
{
    double m = 0.0;
    for (size_t i = 0; i < n; i++)
        m = fmax(m, fabs(x[i]));
    return m;
}

/* max |a − b| / max |b| (0 when b is all zero and a equals it) */
static double rel_err_dd(const double *a, const double *b, size_t n)
{
    double e = 0.0;
    for (size_t i = 0; i < n; i++)
        e = fmax(e, fabs(a[i] - b[i]));
    double m = max_abs(b, n);
    return m > 0 ? e / m : e;
}

/* Dense KD of row i with the full teacher, written directly: τ² KL(softmax(T/τ) || softmax(s/τ)). */
static double dense_kd_row(const kcase *c, int64_t i, double tau)
{
    double *s = malloc(sizeof(double) * (size_t)c->v);
    double ms = -INFINITY, mt = -INFINITY, ss = 0.0, st = 0.0, kl = 0.0;
    for (int j = 0; j < c->v; j++) {
        double acc = 0.0;
        for (int e = 0; e < c->d; e++)
            acc += (double)c->h[i * c->d + e] * c->w[(int64_t)j * c->d + e];
        s[j] = acc / tau;
        ms = fmax(ms, s[j]);
        mt = fmax(mt, c->tfull[i * c->v + j] / tau);
    }
    for (int j = 0; j < c->v; j++) {
        ss += exp(s[j] - ms);
        st += exp(c->tfull[i * c->v + j] / tau - mt);
    }
    for (int j = 0; j < c->v; j++) {
        double lp = c->tfull[i * c->v + j] / tau - mt - log(st), lq = s[j] - ms - log(ss);
        kl += exp(lp) * (lp - lq);
    }
    free(s);
    return tau * tau * kl;
}

static double dense_kd_mean(const kcase *c, double tau)
{
    double sum = 0.0;
    int64_t kept = 0;
    for (int64_t i = 0; i < c->n; i++)
        if (c->labels[i] != -100) {
            sum += dense_kd_row(c, i, tau);
            kept++;
        }
    return sum / kept;
}

typedef struct grads {
    double *dh, *dw;
    tkd_kl_result res;
} grads;

static grads ref_run(const kcase *c, const tkd_kl_params *p)
{
    grads g = {.dh = malloc(sizeof(double) * (size_t)(c->n * c->d)), .dw = malloc(sizeof(double) * (size_t)c->v * c->d)};
    tkd_kl_batch b = kcase_batch(c);
    tkd_status st = tkd_kl_ref_f64(p, &b, &g.res, g.dh, g.dw);
    if (st != TKD_OK)
        fail_msg("ref: %s", tkd_error_msg());
    return g;
}

static void grads_free(grads *g)
{
    free(g->dh), free(g->dw);
}

/* ---- the reference against identities that do not use its formulas -------------------- */

/* With k = V every variant is the exact dense KL of the full teacher (a test-local formula). */
static void test_ref_full_k_is_dense_kl(void **state)
{
    (void)state;
    const double taus[] = {1.0, 2.5};
    for (int ti = 0; ti < 2; ti++) {
        kcase c = kcase_make(9, 5, 13, 13, 0, taus[ti], 11 + ti);
        double want = dense_kd_mean(&c, taus[ti]);
        tkd_kl_params pr = tkd_test_kl_params(TKD_KL_VARIANT_RENORM, taus[ti], 1.0, 13, 13, 0);
        tkd_kl_params pt = tkd_test_kl_params(TKD_KL_VARIANT_TAIL, taus[ti], 1.0, 13, 13, 0);
        tkd_kl_params ps = tkd_test_kl_params(TKD_KL_VARIANT_SAMPLED, taus[ti], 1.0, 13, 13, 0);
        grads gr = ref_run(&c, &pr), gt = ref_run(&c, &pt), gs = ref_run(&c, &ps);
        /* 1e-6: the cache's LSE is rounded to fp32 (relative 6e-8 of |lse| ~ 5), and p = exp(t − lse) */
        assert_true(tkd_test_close(gr.res.kd, want, 1e-9, 1e-9));
        assert_true(tkd_test_close(gt.res.kd, want, 1e-6, 1e-6));
        assert_true(tkd_test_close(gs.res.kd, want, 1e-6, 1e-6));
        assert_true(want > 0.1); /* the case is not trivially zero */
        assert_true(rel_err_dd(gt.dw, gr.dw, (size_t)13 * 5) < 1e-6);
        assert_true(rel_err_dd(gs.dh, gr.dh, (size_t)9 * 5) < 1e-6);
        grads_free(&gr), grads_free(&gt), grads_free(&gs);
        kcase_free(&c);
    }
}

/* When the teacher's tail has the student's own shape (t_v/τ = s_v/τ + const off the top-k),
 * `tail` is exact: it equals dense KL, loss and gradients. */
static void test_ref_tail_exact_when_tail_has_student_shape(void **state)
{
    (void)state;
    const int n = 6, d = 4, v = 17, k = 5;
    const double tau = 2.5;
    kcase c = kcase_make(n, d, v, k, 0, tau, 21);
    for (int64_t i = 0; i < n; i++) {
        double smax = -INFINITY;
        for (int j = 0; j < v; j++) {
            double acc = 0.0;
            for (int e = 0; e < d; e++)
                acc += (double)c.h[i * d + e] * c.w[j * d + e];
            c.tfull[i * v + j] = (float)(acc - 1.0); /* tail: student logits shifted */
            smax = fmax(smax, acc);
        }
        for (int j = 0; j < k; j++) /* top-k: tokens 2j+i%2, well above every tail logit */
            c.tfull[i * v + 2 * j + i % 2] = (float)(smax + 0.5 * j + 1.0);
    }
    kcase_cut_teacher(&c);
    kcase full = c; /* the same teacher with k = V, through renorm (checked dense above) */
    full.k = v;
    full.idx = malloc(sizeof(int32_t) * n * v);
    full.tl = malloc(sizeof(float) * n * v);
    kcase_cut_teacher(&full);
    tkd_kl_params pt = tkd_test_kl_params(TKD_KL_VARIANT_TAIL, tau, 0.5, k, k, 0);
    tkd_kl_params pd = tkd_test_kl_params(TKD_KL_VARIANT_RENORM, tau, 0.5, v, v, 0);
    grads gt = ref_run(&c, &pt), gd = ref_run(&full, &pd);
    /* 1e-5: t is rounded to fp32 (relative 6e-8 of values ~ 10) and lse too */
    assert_true(tkd_test_close(gt.res.kd, gd.res.kd, 1e-5, 1e-5));
    assert_true(tkd_test_close(gt.res.kd, dense_kd_mean(&c, tau), 1e-5, 1e-5));
    assert_true(rel_err_dd(gt.dh, gd.dh, (size_t)n * d) < 1e-5);
    assert_true(rel_err_dd(gt.dw, gd.dw, (size_t)v * d) < 1e-5);
    /* and renorm at the same k is not exact here, so the comparison has teeth */
    tkd_kl_params pr = tkd_test_kl_params(TKD_KL_VARIANT_RENORM, tau, 0.5, k, k, 0);
    grads gr = ref_run(&c, &pr);
    assert_true(rel_err_dd(gr.dw, gd.dw, (size_t)v * d) > 1e-2);
    grads_free(&gt), grads_free(&gd), grads_free(&gr);
    free(full.idx), free(full.tl);
    kcase_free(&c);
}

/* `sampled` is unbiased: the exact expectation over every pair of draws (S = 2, repeats
 * included, probability p_a p_b / r²) of its gradient is the dense-KD gradient, and of its loss
 * the dense KD plus τ²·(E[Σ target log target] − Σ_tail p log p). One kept row. */
static void test_ref_sampled_expectation_is_dense(void **state)
{
    (void)state;
    const int d = 3, v = 9, k = 3;
    const double tau = 2.0;
    kcase c = kcase_make(1, d, v, k, 2, tau, 31);
    c.labels[0] = 4;
    kcase full = kcase_make(1, d, v, v, 0, tau, 31); /* same seeds: same h, w, teacher */
    full.labels[0] = 4;
    tkd_kl_params pd = tkd_test_kl_params(TKD_KL_VARIANT_RENORM, tau, 1.0, v, v, 0);
    tkd_kl_params ps = tkd_test_kl_params(TKD_KL_VARIANT_SAMPLED, tau, 1.0, k, k, 2);
    grads gd = ref_run(&full, &pd);
    double p[9], tail_mass = 0.0, tail_plogp = 0.0;
    unsigned char in_top[9] = {0};
    for (int j = 0; j < k; j++)
        in_top[c.idx[j]] = 1;
    for (int j = 0; j < v; j++) {
        double lp = c.tfull[j] / tau - c.lse[0];
        p[j] = exp(lp);
        if (!in_top[j])
            tail_mass += p[j], tail_plogp += p[j] * lp;
    }
    double e_dh[3] = {0}, e_dw[27] = {0}, e_kd = 0.0, e_tlogt = 0.0, wsum = 0.0;
    for (int a = 0; a < v; a++)
        for (int bb = 0; bb < v; bb++) {
            if (in_top[a] || in_top[bb])
                continue;
            double wt = p[a] * p[bb] / (tail_mass * tail_mass);
            c.draws[0] = a, c.draws[1] = bb;
            grads g = ref_run(&c, &ps);
            for (int e = 0; e < d; e++)
                e_dh[e] += wt * g.dh[e];
            for (int e = 0; e < v * d; e++)
                e_dw[e] += wt * g.dw[e];
            e_kd += wt * g.res.kd;
            e_tlogt += wt * (a == bb ? tail_mass * log(tail_mass) : tail_mass * log(tail_mass / 2));
            wsum += wt;
            grads_free(&g);
        }
    assert_true(fabs(wsum - 1.0) < 1e-12);
    assert_true(tail_mass > 0.05); /* a real tail, or the test proves little */
    /* 1e-6: the only difference is the fp32 rounding of the cache LSE in p = exp(t/τ − lse) */
    assert_true(rel_err_dd(e_dh, gd.dh, (size_t)d) < 1e-6);
    assert_true(rel_err_dd(e_dw, gd.dw, (size_t)v * d) < 1e-6);
    assert_true(tkd_test_close(e_kd, gd.res.kd + tau * tau * (e_tlogt - tail_plogp), 1e-6, 1e-6));
    /* a single pair of draws is not the dense gradient: the expectation is what matches */
    c.draws[0] = c.draws[1] = c.idx[0] == 0 ? 1 : 0;
    while (in_top[c.draws[0]])
        c.draws[0] = c.draws[1] = c.draws[0] + 1;
    grads g1 = ref_run(&c, &ps);
    assert_true(rel_err_dd(g1.dw, gd.dw, (size_t)v * d) > 1e-3);
    grads_free(&g1), grads_free(&gd);
    kcase_free(&c), kcase_free(&full);
}

static void test_ref_ce_only(void **state)
{
    (void)state;
    kcase c = kcase_make(10, 4, 11, 3, 0, 1.0, 41);
    tkd_kl_params p = tkd_test_kl_params(TKD_KL_VARIANT_RENORM, 1.0, 0.0, 3, 3, 0);
    grads g = ref_run(&c, &p);
    double sum = 0.0;
    int kept = 0;
    for (int64_t i = 0; i < c.n; i++) {
        if (c.labels[i] == -100)
            continue;
        double z[11], m = -INFINITY, e = 0.0;
        for (int j = 0; j < 11; j++) {
            z[j] = 0.0;
            for (int q = 0; q < 4; q++)
                z[j] += (double)c.h[i * 4 + q] * c.w[j * 4 + q];
            m = fmax(m, z[j]);
        }
        for (int j = 0; j < 11; j++)
            e += exp(z[j] - m);
        sum += m + log(e) - z[c.labels[i]];
        kept++;
    }
    assert_int_equal(g.res.n_kept, kept);
    assert_int_equal(kept, 8);
    assert_true(tkd_test_close(g.res.loss, sum / kept, 1e-12, 1e-12));
    assert_true(tkd_test_close(g.res.ce, sum / kept, 1e-12, 1e-12));
    assert_true(g.res.kd > 0.0); /* still reported for logging */
    for (int e = 0; e < 4; e++) /* masked row 3 gets no gradient */
        assert_true(g.dh[3 * 4 + e] == 0.0);
    grads_free(&g);
    kcase_free(&c);
}

/* Every variant at k' < k, τ ≠ 1 and 0 < alpha < 1, against docs/loss.md's formulas written out here
 * per row from the cache columns (no dense target vector, no shared helper): the cases above pin the
 * reference only at k' = k (or k = V), alpha ∈ {0, 1}, so a reference that used all k stored columns,
 * mixed alpha the wrong way round or normalised `renorm` over the wrong set would pass them and, the
 * chunked paths being checked against it, take every fast path along. */
static void test_ref_matches_doc_formulas_kprime_lt_k(void **state)
{
    (void)state;
    enum { N = 11, D = 5, V = 23, K = 6, KU = 4, S = 4 };
    const double tau = 2.0, alpha = 0.3;
    kcase c = kcase_make(N, D, V, K, S, tau, 61); /* draws 0 and 2 of each row repeat */
    for (int var = 0; var < 3; var++) {
        double kd_sum = 0.0, ce_sum = 0.0;
        int kept = 0;
        for (int64_t i = 0; i < N; i++) {
            if (c.labels[i] == -100)
                continue;
            double sv[V], lse_z = -INFINITY, lse_s = -INFINITY;
            for (int j = 0; j < V; j++) {
                sv[j] = 0.0;
                for (int e = 0; e < D; e++)
                    sv[j] += (double)c.h[i * D + e] * c.w[j * D + e];
            }
            double mz = -INFINITY, ms = -INFINITY, ez = 0.0, es = 0.0;
            for (int j = 0; j < V; j++)
                mz = fmax(mz, sv[j] / tau), ms = fmax(ms, sv[j]);
            for (int j = 0; j < V; j++)
                ez += exp(sv[j] / tau - mz), es += exp(sv[j] - ms);
            lse_z = mz + log(ez), lse_s = ms + log(es);
            ce_sum += lse_s - sv[c.labels[i]];
            const int32_t *I = c.idx + i * K;
            const float *t = c.tl + i * K;
            double kdz = 0.0;
            if (var == TKD_KL_VARIANT_RENORM) {
                double m = -INFINITY, e = 0.0;
                for (int j = 0; j < KU; j++)
                    m = fmax(m, t[j] / tau);
                for (int j = 0; j < KU; j++)
                    e += exp(t[j] / tau - m);
                for (int j = 0; j < KU; j++) {
                    double lp = t[j] / tau - m - log(e);
                    kdz += exp(lp) * (lp - (sv[I[j]] / tau - lse_z));
                }
            } else {
                double psum = 0.0, qsum = 0.0;
                for (int j = 0; j < KU; j++) {
                    double lp = t[j] / tau - c.lse[i], lq = sv[I[j]] / tau - lse_z;
                    psum += exp(lp), qsum += exp(lq);
                    if (var == TKD_KL_VARIANT_TAIL)
                        kdz += exp(lp) * (lp - lq);
                }
                double r = fmax(0.0, 1.0 - psum);
                assert_true(r > 0.05); /* a real tail, or the tail terms prove little */
                if (var == TKD_KL_VARIANT_TAIL)
                    kdz += r * (log(r) - log1p(-qsum));
                else /* target_v = p_v·[v ∈ I] + r·#{d = v}/S, summed token by token */
                    for (int v = 0; v < V; v++) {
                        double tv = 0.0;
                        for (int j = 0; j < KU; j++)
                            if (I[j] == v)
                                tv += exp(t[j] / tau - c.lse[i]);
                        for (int q = 0; q < S; q++)
                            if (c.draws[i * S + q] == v)
                                tv += r / S;
                        if (tv > 0.0)
                            kdz += tv * (log(tv) - (sv[v] / tau - lse_z));
                    }
            }
            kd_sum += tau * tau * kdz;
            kept++;
        }
        tkd_kl_params p = tkd_test_kl_params((tkd_kl_variant)var, tau, alpha, K, KU, var == TKD_KL_VARIANT_SAMPLED ? S : 0);
        grads g = ref_run(&c, &p);
        double kd = kd_sum / kept, ce = ce_sum / kept, a = p.alpha; /* alpha as the params hold it: fp32 0.3 */
        /* 1e-10: both sides are double arithmetic on the same fp32 inputs, differing only in the order of
         * operations (and log1p(−Q) against lse_tail − lse_z), ~1e-15 relative on values of order 1 */
        if (!tkd_test_close(g.res.kd, kd, 1e-10, 1e-10) || !tkd_test_close(g.res.ce, ce, 1e-10, 1e-10) ||
            !tkd_test_close(g.res.loss, a * kd + (1 - a) * ce, 1e-10, 1e-10))
            fail_msg("%s: ref kd %.12g ce %.12g loss %.12g, formulas %.12g %.12g %.12g", tkd_kl_variant_name(p.variant),
                     g.res.kd, g.res.ce, g.res.loss, kd, ce, a * kd + (1 - a) * ce);
        assert_int_equal(g.res.n_kept, kept);
        assert_true(kd > 0.1 && fabs(kd - ce) > 0.1); /* alpha's two sides are distinguishable */
        grads_free(&g);
    }
    kcase_free(&c);
}

/* ---- validation ---------------------------------------------------------------------- */

static void expect_format_error(const tkd_kl_params *p, const tkd_kl_batch *b, const char *what)
{
    tkd_status st = tkd_kl_validate(p, b);
    if (st != TKD_ERR_FORMAT)
        fail_msg("%s: expected TKD_ERR_FORMAT, got %s (%s)", what, tkd_status_name(st), tkd_error_msg());
    if (!strstr(tkd_error_msg(), "row 3:"))
        fail_msg("%s: message does not name row 3: %s", what, tkd_error_msg());
}

static void test_validate_errors(void **state)
{
    (void)state;
    kcase c = kcase_make(6, 3, 20, 4, 3, 1.0, 51);
    c.labels[3] = 5; /* row 3 kept (the default mask would drop it) */
    tkd_kl_batch b = kcase_batch(&c);
    tkd_kl_params ps = tkd_test_kl_params(TKD_KL_VARIANT_SAMPLED, 1.0, 0.5, 4, 4, 3);
    tkd_kl_params pt = tkd_test_kl_params(TKD_KL_VARIANT_TAIL, 1.0, 0.5, 4, 4, 0);
    assert_int_equal(tkd_kl_validate(&ps, &b), TKD_OK);

    int32_t saved = c.idx[3 * 4 + 2];
    c.idx[3 * 4 + 2] = c.idx[3 * 4 + 0];
    expect_format_error(&ps, &b, "duplicate index");
    ps.k_use = 2; /* the duplicate sits beyond k' = 2: not used, not an error */
    c.draws[3 * 3 + 0] = c.draws[3 * 3 + 1] = c.draws[3 * 3 + 2] = c.idx[3 * 4 + 3];
    assert_int_equal(tkd_kl_validate(&ps, &b), TKD_OK);
    ps.k_use = 4;
    c.idx[3 * 4 + 2] = saved;
    expect_format_error(&ps, &b, "draw inside the top-k");
    kcase_cut_teacher(&c); /* fresh draws */

    c.idx[3 * 4 + 1] = 20;
    expect_format_error(&pt, &b, "index >= V");
    c.idx[3 * 4 + 1] = -1;
    expect_format_error(&pt, &b, "negative index");
    kcase_cut_teacher(&c);
    c.tl[3 * 4 + 3] = NAN;
    expect_format_error(&pt, &b, "NaN teacher logit");
    kcase_cut_teacher(&c);
    c.lse[3] = INFINITY;
    expect_format_error(&pt, &b, "inf teacher LSE");
    kcase_cut_teacher(&c);
    /* the stored top-k mass Σ exp(t/τ − lse): an exact cache has at most 1 (plus the LSE's rounding);
     * TKD_KL_MASS_MAX is the most a cache teacher-dump wrote can hold. Shifting the LSE moves the mass
     * by a known factor: just under and just over the bound. */
    double mass = 0.0;
    for (int j = 0; j < 4; j++)
        mass += exp((double)c.tl[3 * 4 + j] - c.lse[3]); /* τ = 1 */
    float exact_lse = c.lse[3];
    c.lse[3] = (float)(exact_lse + log(mass) - log(TKD_KL_MASS_MAX * 0.999));
    assert_int_equal(tkd_kl_validate(&pt, &b), TKD_OK);
    c.lse[3] = (float)(exact_lse + log(mass) - log(TKD_KL_MASS_MAX * 1.001));
    expect_format_error(&pt, &b, "top-k mass above TKD_KL_MASS_MAX (tail)");
    assert_non_null(strstr(tkd_error_msg(), "stored probabilities sum to 1.15"));
    expect_format_error(&ps, &b, "top-k mass above TKD_KL_MASS_MAX (sampled)");
    tkd_kl_params pr = pt; /* renorm reads no LSE */
    pr.variant = TKD_KL_VARIANT_RENORM;
    assert_int_equal(tkd_kl_validate(&pr, &b), TKD_OK);
    c.lse[3] = exact_lse;
    c.draws[3 * 3 + 1] = 99;
    expect_format_error(&ps, &b, "draw >= V");
    kcase_cut_teacher(&c);
    c.labels[3] = 20;
    expect_format_error(&pt, &b, "label >= V");
    c.labels[3] = -100; /* a masked row's teacher side is padding and is not checked */
    c.idx[3 * 4 + 1] = 1000;
    assert_int_equal(tkd_kl_validate(&pt, &b), TKD_OK);

    /* parameters */
    tkd_kl_params bad = pt;
    bad.k_use = 5;
    assert_int_equal(tkd_kl_validate(&bad, &b), TKD_ERR_INVALID_ARG);
    bad = pt;
    bad.k_use = 0;
    assert_int_equal(tkd_kl_validate(&bad, &b), TKD_ERR_INVALID_ARG);
    bad = ps;
    bad.k_use = 0;
    bad.s = 0;
    assert_int_equal(tkd_kl_validate(&bad, &b), TKD_ERR_INVALID_ARG);
    bad.s = 3; /* plain sampled distillation */
    assert_int_equal(tkd_kl_validate(&bad, &b), TKD_OK);
    bad = pt;
    bad.temperature = 0.0f;
    assert_int_equal(tkd_kl_validate(&bad, &b), TKD_ERR_INVALID_ARG);
    bad = pt;
    bad.alpha = 1.5f;
    assert_int_equal(tkd_kl_validate(&bad, &b), TKD_ERR_INVALID_ARG);
    kcase_free(&c);
}

static void test_variant_names(void **state)
{
    (void)state;
    for (int i = 0; i < 3; i++)
        assert_int_equal(tkd_kl_variant_parse(tkd_kl_variant_name((tkd_kl_variant)i)), i);
    assert_int_equal(tkd_kl_variant_parse("sampled"), TKD_KL_VARIANT_SAMPLED);
    assert_int_equal(tkd_kl_variant_parse("dense"), -1);
    tkd_kl_params p;
    tkd_kl_params_defaults(&p, 7);
    assert_int_equal(p.k_use, 7);
    assert_int_equal(p.ignore_index, -100);
    assert_true(p.alpha == 1.0f && p.temperature == 1.0f && p.grad_scale == 1.0f);
}

/* ---- the chunked CPU path against the reference ------------------------------------------ */

typedef struct cpu_out {
    float *dh, *dw;
    tkd_kl_result res;
} cpu_out;

/* Forward + backward (or forward alone with grad_in_forward) on a fresh workspace. */
static cpu_out cpu_run(const kcase *c, tkd_kl_params p, int chunk, int grad_in_forward)
{
    cpu_out o = {.dh = malloc(sizeof(float) * (size_t)(c->n * c->d)),
                 .dw = calloc((size_t)c->v * c->d, sizeof(float))};
    p.chunk_rows = chunk;
    p.grad_in_forward = grad_in_forward;
    tkd_kl_batch b = kcase_batch(c);
    tkd_kl_cpu_ws *ws = NULL;
    if (tkd_kl_cpu_ws_create(&ws, &p, c->n, c->d, c->v) != TKD_OK ||
        tkd_kl_cpu_forward(ws, &p, &b, &o.res, o.dh, o.dw) != TKD_OK ||
        tkd_kl_cpu_backward(ws, &p, &b, p.grad_scale, o.dh, o.dw) != TKD_OK)
        fail_msg("cpu: %s", tkd_error_msg());
    tkd_kl_cpu_ws_free(ws);
    return o;
}

static void cpu_out_free(cpu_out *o)
{
    free(o->dh), free(o->dw);
}

/* max |a − b| / max |b| over a float and a double array; NaN counts as infinitely wrong */
static double rel_err_fd(const float *a, const double *b, size_t n)
{
    double e = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]);
        e = isnan(d) ? INFINITY : fmax(e, d);
    }
    double m = max_abs(b, n);
    return m > 0 ? e / m : e;
}

static double worst_loss_err, worst_grad_err, worst_extreme_grad_err; /* reported once, for docs and the lead */

/* Loss: the fp32 logits from sgemm are off by about sqrt(D)·2^-24·|h||w| (~1e-7 relative here); the
 * loss, summed in double, moves by as much: 1e-6 relative (+1e-7 absolute for losses near 0) leaves
 * ~50x margin over what these cases show (1.5e-8).
 * Gradients: the same logit error, fp32 exp, and fp32 sgemm sums over V = 203 or a chunk's rows:
 * 2e-5 of the largest gradient (these cases show 5e-7). */
#define LOSS_RTOL 1e-6
#define LOSS_ATOL 1e-7
#define GRAD_RTOL 2e-5
/* With |W| = 5000 and |H| = 1, dH = dS·W and dW = dSᵀ·H sum terms far larger than the result (the
 * rows of dS sum to ~0), so fp32 rounding of dS (2^-24 of each term) shows up to ~1e-5 of the
 * largest gradient; 1e-4 keeps a margin and still catches a wrong formula (errors of O(1)). */
#define EXTREME_GRAD_RTOL 1e-4

static void expect_match(const char *what, const kcase *c, const cpu_out *o, const grads *g, double grad_rtol)
{
    double el = fabs(o->res.loss - g->res.loss) / (LOSS_ATOL / LOSS_RTOL + fabs(g->res.loss));
    double ek = fabs(o->res.kd - g->res.kd) / (LOSS_ATOL / LOSS_RTOL + fabs(g->res.kd));
    double ec = fabs(o->res.ce - g->res.ce) / (LOSS_ATOL / LOSS_RTOL + fabs(g->res.ce));
    double eh = rel_err_fd(o->dh, g->dh, (size_t)(c->n * c->d)), ew = rel_err_fd(o->dw, g->dw, (size_t)c->v * c->d);
    worst_loss_err = fmax(worst_loss_err, fmax(el, fmax(ek, ec)));
    if (grad_rtol == GRAD_RTOL)
        worst_grad_err = fmax(worst_grad_err, fmax(eh, ew));
    else
        worst_extreme_grad_err = fmax(worst_extreme_grad_err, fmax(eh, ew));
    if (!(el <= LOSS_RTOL && ek <= LOSS_RTOL && ec <= LOSS_RTOL) || !isfinite(o->res.loss))
        fail_msg("%s: loss %.10g kd %.10g ce %.10g, ref %.10g %.10g %.10g", what, o->res.loss, o->res.kd,
                 o->res.ce, g->res.loss, g->res.kd, g->res.ce);
    if (!(eh <= grad_rtol && ew <= grad_rtol))
        fail_msg("%s: gradient error dH %.3g dW %.3g of the largest", what, eh, ew);
    if (o->res.n_kept != g->res.n_kept)
        fail_msg("%s: n_kept %lld, ref %lld", what, (long long)o->res.n_kept, (long long)g->res.n_kept);
}

/* Recompute and grad_in_forward do the same arithmetic on the same logits. */
static void expect_same(const char *what, const kcase *c, const cpu_out *a, const cpu_out *b)
{
    size_t nh = (size_t)(c->n * c->d), nw = (size_t)c->v * c->d;
    double mh = 0, mw = 0, eh = 0, ew = 0;
    for (size_t i = 0; i < nh; i++)
        mh = fmax(mh, fabs(b->dh[i])), eh = fmax(eh, fabs(a->dh[i] - b->dh[i]));
    for (size_t i = 0; i < nw; i++)
        mw = fmax(mw, fabs(b->dw[i])), ew = fmax(ew, fabs(a->dw[i] - b->dw[i]));
    /* 1e-6: only the order of fp32 additions may differ between the two modes' sgemm calls */
    if (a->res.loss != b->res.loss || eh > 1e-6 * mh || ew > 1e-6 * mw)
        fail_msg("%s: grad_in_forward differs from recompute: loss %.10g vs %.10g, dH %.3g dW %.3g", what,
                 a->res.loss, b->res.loss, eh / mh, ew / mw);
}

static void check_one(const char *tag, const kcase *c, tkd_kl_params p, int chunk, double grad_rtol)
{
    char what[160];
    snprintf(what, sizeof what, "%s %s tau=%g alpha=%g k'=%d/%d S=%d chunk=%d", tag,
             tkd_kl_variant_name(p.variant), (double)p.temperature, (double)p.alpha, p.k_use, p.k, p.s, chunk);
    grads g = ref_run(c, &p);
    cpu_out o = cpu_run(c, p, chunk, 0), of = cpu_run(c, p, chunk, 1);
    expect_match(what, c, &o, &g, grad_rtol);
    expect_same(what, c, &of, &o);
    grads_free(&g), cpu_out_free(&o), cpu_out_free(&of);
}

/* Every variant x τ x alpha x k' (x S for sampled), N = 37 in chunks of 8, V = 203. */
static void test_chunked_matches_ref_grid(void **state)
{
    (void)state;
    const double taus[] = {1.0, 2.5}, alphas[] = {0.0, 0.5, 1.0};
    const int n = 37, d = 16, v = 203, k = 6;
    for (int ti = 0; ti < 2; ti++) {
        kcase c7 = kcase_make(n, d, v, k, 7, taus[ti], 100 + ti), c1 = kcase_make(n, d, v, k, 1, taus[ti], 100 + ti);
        for (int ai = 0; ai < 3; ai++)
            for (int var = 0; var < 3; var++) {
                const int kus[] = {0, 1, k / 2, k};
                for (int ki = 0; ki < 4; ki++) {
                    for (int s = 0; s <= 7; s++) {
                        if ((s != 0 && s != 1 && s != 7) || (var != TKD_KL_VARIANT_SAMPLED && s != 0))
                            continue;
                        if (kus[ki] == 0 && (var != TKD_KL_VARIANT_SAMPLED || s == 0))
                            continue;
                        tkd_kl_params p = tkd_test_kl_params((tkd_kl_variant)var, taus[ti], alphas[ai], k, kus[ki], s);
                        check_one("grid", s == 1 ? &c1 : &c7, p, 8, GRAD_RTOL);
                    }
                }
            }
        kcase_free(&c7), kcase_free(&c1);
    }
    print_message("worst error vs the float64 reference: loss %.3g (relative), gradients %.3g (of the largest)\n",
                  worst_loss_err, worst_grad_err);
}

/* k = 1, one row, a single chunk of everything, and the automatic chunk size. */
static void test_chunked_small_shapes(void **state)
{
    (void)state;
    kcase c = kcase_make(13, 5, 29, 1, 7, 1.0, 200);
    for (int var = 0; var < 3; var++) {
        tkd_kl_params p =
            tkd_test_kl_params((tkd_kl_variant)var, 1.0, 0.5, 1, 1, var == TKD_KL_VARIANT_SAMPLED ? 7 : 0);
        check_one("k=1", &c, p, 3, GRAD_RTOL);
        check_one("k=1 auto chunk", &c, p, 0, GRAD_RTOL);
    }
    kcase one = kcase_make(1, 3, 11, 4, 7, 2.5, 201);
    one.labels[0] = 10;
    for (int var = 0; var < 3; var++) {
        tkd_kl_params p =
            tkd_test_kl_params((tkd_kl_variant)var, 2.5, 0.5, 4, 2, var == TKD_KL_VARIANT_SAMPLED ? 7 : 0);
        check_one("N=1", &one, p, 1, GRAD_RTOL);
    }
    kcase_free(&c), kcase_free(&one);
}

/* Logits of ±1e4 (student and teacher): no NaN, finite gradients, still the reference's values.
 * H in {-1, 0, 1} and W in multiples of 2500 make the fp32 logits exact (multiples of 2500 up to
 * 2e4), so the tolerances need not grow with the logits. */
static void test_chunked_extreme_logits(void **state)
{
    (void)state;
    const int n = 37, d = 4, v = 203, k = 6;
    const double taus[] = {1.0, 2.5};
    for (int ti = 0; ti < 2; ti++) {
        kcase c = kcase_make(n, d, v, k, 7, taus[ti], 300 + ti);
        for (int i = 0; i < n * d; i++)
            c.h[i] = (float)((int)(urand(&c) * 3) - 1);
        for (int i = 0; i < v * d; i++)
            c.w[i] = (float)(2500 * ((int)(urand(&c) * 5) - 2));
        for (int i = 0; i < n * v; i++)
            c.tfull[i] = (float)(1e4 * (urand(&c) * 2 - 1));
        c.tfull[5 * v + 7] = c.tfull[5 * v + 8]; /* a tie at the top does not matter either */
        kcase_cut_teacher(&c);
        for (int var = 0; var < 3; var++)
            for (int ki = 1; ki <= k; ki += k - 1) {
                tkd_kl_params p = tkd_test_kl_params((tkd_kl_variant)var, taus[ti], 0.5, k, ki,
                                            var == TKD_KL_VARIANT_SAMPLED ? 7 : 0);
                check_one("extreme", &c, p, 8, EXTREME_GRAD_RTOL);
            }
        kcase_free(&c);
    }
    print_message("worst error so far, extreme logits included: loss %.3g; gradients of extreme cases %.3g\n",
                  worst_loss_err, worst_extreme_grad_err);
}

/* dw_overwrite: dW written, not added, whatever dw held (NaN here), over several chunks and in both
 * modes: the same values as adding into zeros; off again, it adds. */
static void test_chunked_dw_overwrite(void **state)
{
    (void)state;
    kcase c = kcase_make(37, 6, 31, 4, 0, 1.0, 401);
    tkd_kl_batch b = kcase_batch(&c);
    for (int gif = 0; gif < 2; gif++) {
        tkd_kl_params p = tkd_test_kl_params(TKD_KL_VARIANT_RENORM, 1.0, 0.5, 4, 4, 0);
        p.chunk_rows = 5;
        p.grad_in_forward = gif;
        tkd_kl_cpu_ws *ws = NULL;
        assert_int_equal(tkd_kl_cpu_ws_create(&ws, &p, 37, 6, 31), TKD_OK);
        float dh[37 * 6], dw0[31 * 6], dw1[31 * 6];
        tkd_kl_result res;
        for (int ow = 0; ow < 2; ow++) {
            float *dw = ow ? dw1 : dw0;
            for (int i = 0; i < 31 * 6; i++)
                dw[i] = ow ? NAN : 0.0f;
            p.dw_overwrite = ow;
            assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &res, dh, dw), TKD_OK);
            if (!gif)
                assert_int_equal(tkd_kl_cpu_backward(ws, &p, &b, 1.0f, dh, dw), TKD_OK);
        }
        for (int i = 0; i < 31 * 6; i++)
            assert_true(dw1[i] == dw0[i]); /* ±0 alike */
        p.dw_overwrite = 0; /* adds again: twice the gradient */
        assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &res, dh, dw1), TKD_OK);
        if (!gif)
            assert_int_equal(tkd_kl_cpu_backward(ws, &p, &b, 1.0f, dh, dw1), TKD_OK);
        for (int i = 0; i < 31 * 6; i++)
            assert_true(fabsf(dw1[i] - 2.0f * dw0[i]) <= 1e-6f * (1.0f + fabsf(dw0[i])));
        tkd_kl_cpu_ws_free(ws);
    }
    kcase_free(&c);
}

/* backward scales by `scale` and accumulates into dw; a workspace serves smaller batches;
 * grad_scale reaches grad_in_forward; a mismatched scale is refused. */
static void test_chunked_scale_accumulate_reuse(void **state)
{
    (void)state;
    kcase c = kcase_make(37, 6, 31, 4, 0, 1.0, 400);
    tkd_kl_params p = tkd_test_kl_params(TKD_KL_VARIANT_TAIL, 1.0, 0.5, 4, 4, 0);
    p.chunk_rows = 5;
    tkd_kl_cpu_ws *ws = NULL;
    assert_int_equal(tkd_kl_cpu_ws_create(&ws, &p, 37, 6, 31), TKD_OK);
    kcase small = c;
    small.n = 20; /* the first 20 rows of the same batch */
    grads g = ref_run(&small, &p);
    tkd_kl_batch b = kcase_batch(&small);
    float dh[37 * 6], dw[31 * 6];
    for (int i = 0; i < 31 * 6; i++)
        dw[i] = 1.0f;
    tkd_kl_result res;
    assert_int_equal(tkd_kl_cpu_backward(ws, &p, &b, 1.0f, dh, dw), TKD_ERR_INVALID_ARG); /* no forward yet */
    assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &res, NULL, NULL), TKD_OK);
    assert_int_equal(tkd_kl_cpu_backward(ws, &p, &b, 0.25f, dh, dw), TKD_OK);
    assert_true(tkd_test_close(res.loss, g.res.loss, LOSS_ATOL, LOSS_RTOL));
    double mw = max_abs(g.dw, 31 * 6), mh = max_abs(g.dh, 20 * 6);
    for (int i = 0; i < 31 * 6; i++)
        assert_true(fabs(dw[i] - (1.0 + 0.25 * g.dw[i])) <= GRAD_RTOL * mw);
    for (int i = 0; i < 20 * 6; i++)
        assert_true(fabs(dh[i] - 0.25 * g.dh[i]) <= GRAD_RTOL * mh);

    p.grad_in_forward = 1;
    p.grad_scale = 0.5f;
    memset(dw, 0, sizeof dw);
    assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &res, dh, dw), TKD_OK);
    assert_int_equal(tkd_kl_cpu_backward(ws, &p, &b, 0.5f, dh, dw), TKD_OK); /* a no-op */
    assert_int_equal(tkd_kl_cpu_backward(ws, &p, &b, 1.0f, dh, dw), TKD_ERR_INVALID_ARG);
    for (int i = 0; i < 31 * 6; i++)
        assert_true(fabs(dw[i] - 0.5 * g.dw[i]) <= GRAD_RTOL * mw);

    b.n = 38; /* larger than the workspace */
    assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &res, dh, dw), TKD_ERR_INVALID_ARG);
    b.n = 20;
    c.idx[4 * 4 + 1] = 31; /* out of range: refused, never read out of bounds */
    assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &res, dh, dw), TKD_ERR_FORMAT);
    assert_non_null(strstr(tkd_error_msg(), "row 4"));
    for (int i = 0; i < 37; i++) /* every row masked: zero loss, zero dH, dW untouched */
        c.labels[i] = -100;
    p.grad_in_forward = 0;
    dw[0] = 3.0f;
    assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &res, NULL, NULL), TKD_OK);
    assert_int_equal(tkd_kl_cpu_backward(ws, &p, &b, 1.0f, dh, dw), TKD_OK);
    assert_true(res.loss == 0.0 && res.n_kept == 0 && dh[7] == 0.0f && dw[0] == 3.0f);
    tkd_kl_cpu_ws_free(ws);
    tkd_kl_cpu_ws_free(NULL);
    grads_free(&g);
    kcase_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_variant_names),
        cmocka_unit_test(test_ref_full_k_is_dense_kl),
        cmocka_unit_test(test_ref_tail_exact_when_tail_has_student_shape),
        cmocka_unit_test(test_ref_sampled_expectation_is_dense),
        cmocka_unit_test(test_ref_ce_only),
        cmocka_unit_test(test_ref_matches_doc_formulas_kprime_lt_k),
        cmocka_unit_test(test_validate_errors),
        cmocka_unit_test(test_chunked_matches_ref_grid),
        cmocka_unit_test(test_chunked_small_shapes),
        cmocka_unit_test(test_chunked_extreme_logits),
        cmocka_unit_test(test_chunked_scale_accumulate_reuse),
        cmocka_unit_test(test_chunked_dw_overwrite),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
