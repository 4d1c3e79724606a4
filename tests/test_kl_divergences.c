/* test_kl_divergences.c — kd.divergence (docs/loss.md, "Divergences"): the float64 reference against
 * the definitions written out here over the distributions each variant forms, the endpoints that are
 * forward or reverse KL, central finite differences of the reference's loss (its gradients and the
 * chunked path's), the chunked CPU path in both modes against the reference over awkward shapes, the
 * refused combinations, and (`test_kl_divergences fixtures`, once tests/fixtures/divergences/ exists)
 * both against PyTorch's float64 autograd (tests/divergence_reference.py). */
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

/* ---- a batch cut from full teacher logits --------------------------------------------------- */

typedef struct dcase {
    int64_t n;
    int d, v, k, s;
    float *h, *w;        /* (N, D), (V, D) */
    float *tfull;        /* (N, V) the teacher's logits the cache columns are cut from */
    int32_t *idx;        /* (N, k) top-k, largest first */
    float *tl, *lse;     /* (N, k), (N) at τ_cache */
    int32_t *draws;      /* (N, S) outside the top-k; draw 2 repeats draw 0 */
    int32_t *labels;     /* (N) every fifth row (i % 5 == 3) masked */
    uint64_t rng;
} dcase;

static int rand_below(dcase *c, int n)
{
    c->rng ^= c->rng << 13, c->rng ^= c->rng >> 7, c->rng ^= c->rng << 17;
    return (int)((c->rng >> 11) % (uint64_t)n);
}

static int dcase_rand(void *c, int n) { return rand_below(c, n); }

/* The cache columns of every row from c->tfull (top-k by selection, LSE at τ_cache, draws). */
static void dcase_cut(dcase *c, double tau_cache)
{
    for (int64_t i = 0; i < c->n; i++)
        tkd_test_cut_row(c->tfull + i * c->v, c->v, c->k, tau_cache, c->s, 2, dcase_rand, c, c->idx + i * c->k,
                         c->tl + i * c->k, c->lse + i, c->draws + i * c->s);
}

static dcase dcase_make(int64_t n, int d, int v, int k, int s, double tau_cache, uint64_t seed)
{
    dcase c = {.n = n, .d = d, .v = v, .k = k, .s = s, .rng = seed * 0x9e3779b97f4a7c15ull + 3};
    c.h = malloc(sizeof(float) * (size_t)(n * d));
    c.w = malloc(sizeof(float) * (size_t)(v * d));
    c.tfull = malloc(sizeof(float) * (size_t)(n * v));
    c.idx = malloc(sizeof(int32_t) * (size_t)(n * k));
    c.tl = malloc(sizeof(float) * (size_t)(n * k));
    c.lse = malloc(sizeof(float) * (size_t)n);
    c.draws = malloc(sizeof(int32_t) * (size_t)(n * (s ? s : 1)));
    c.labels = malloc(sizeof(int32_t) * (size_t)n);
    assert_true(c.h && c.w && c.tfull && c.idx && c.tl && c.lse && c.draws && c.labels);
    tkd_test_randn(c.h, (size_t)(n * d), seed, 1.0f);
    tkd_test_randn(c.w, (size_t)(v * d), seed + 1, 0.7f);
    tkd_test_randn(c.tfull, (size_t)(n * v), seed + 2, 2.0f);
    for (int64_t i = 0; i < n; i++)
        c.labels[i] = i % 5 == 3 ? -100 : rand_below(&c, v);
    dcase_cut(&c, tau_cache);
    return c;
}

static void dcase_free(dcase *c)
{
    free(c->h), free(c->w), free(c->tfull), free(c->idx), free(c->tl), free(c->lse), free(c->draws);
    free(c->labels);
}

static tkd_kl_batch dcase_batch(const dcase *c)
{
    tkd_kl_batch b = {.n = c->n, .d = c->d, .v = c->v, .h = c->h, .w = c->w, .topk_idx = c->idx,
                      .topk_logit = c->tl, .teacher_lse = c->lse, .tail_idx = c->s ? c->draws : NULL,
                      .labels = c->labels};
    return b;
}

/* ---- the divergences and parameters under test ---------------------------------------------- */

typedef struct dspec {
    tkd_kl_divergence dv;
    float beta, skew; /* jsd_beta, skew_alpha */
} dspec;

/* every divergence at an inner parameter, and the endpoints that are forward or reverse KL */
static const dspec g_specs[] = {
    {TKD_KL_DIVERGENCE_FKL, 0.5f, 0.1f},  {TKD_KL_DIVERGENCE_RKL, 0.5f, 0.1f},
    {TKD_KL_DIVERGENCE_JSD, 0.5f, 0.1f},  {TKD_KL_DIVERGENCE_JSD, 0.2f, 0.1f},
    {TKD_KL_DIVERGENCE_JSD, 0.0f, 0.1f},  {TKD_KL_DIVERGENCE_JSD, 1.0f, 0.1f},
    {TKD_KL_DIVERGENCE_SKL, 0.5f, 0.1f},  {TKD_KL_DIVERGENCE_SKL, 0.5f, 0.0f},
    {TKD_KL_DIVERGENCE_SRKL, 0.5f, 0.1f}, {TKD_KL_DIVERGENCE_SRKL, 0.5f, 0.0f},
    {TKD_KL_DIVERGENCE_SKL, 0.5f, 0.6f},  {TKD_KL_DIVERGENCE_TVD, 0.5f, 0.1f},
};
#define N_SPECS ((int)(sizeof g_specs / sizeof g_specs[0]))

/* sampled's target is 0 on the undrawn tail: reverse KL (rkl, jsd at β = 1, srkl at α = 0) is refused */
static int spec_refused(const dspec *sp, tkd_kl_variant var)
{
    return var == TKD_KL_VARIANT_SAMPLED &&
           (sp->dv == TKD_KL_DIVERGENCE_RKL || (sp->dv == TKD_KL_DIVERGENCE_JSD && sp->beta == 1.0f) ||
            (sp->dv == TKD_KL_DIVERGENCE_SRKL && sp->skew == 0.0f));
}

static tkd_kl_params spec_params(const dspec *sp, tkd_kl_variant var, double tau, double alpha, int k, int k_use,
                                 int s)
{
    tkd_kl_params p = tkd_test_kl_params(var, tau, alpha, k, k_use, var == TKD_KL_VARIANT_SAMPLED ? s : 0);
    p.divergence = sp->dv;
    p.jsd_beta = sp->beta;
    p.skew_alpha = sp->skew;
    return p;
}

static const char *spec_name(const tkd_kl_params *p)
{
    static char buf[160];
    snprintf(buf, sizeof buf, "%s beta=%g skew=%g / %s tau=%g alpha=%g k'=%d/%d S=%d",
             tkd_kl_divergence_name(p->divergence), (double)p->jsd_beta, (double)p->skew_alpha,
             tkd_kl_variant_name(p->variant), (double)p->temperature, (double)p->alpha, p->k_use, p->k, p->s);
    return buf;
}

/* ---- the definitions, written out over the distributions (test-local) ------------------------- */

/* D(P ‖ Q) over n outcomes, straight from each definition. */
static double local_div(const tkd_kl_params *p, const double *P, const double *Q, int n)
{
    const double b = p->jsd_beta, al = p->skew_alpha;
    double d = 0.0;
    for (int i = 0; i < n; i++) {
        const double x = P[i], y = Q[i];
        double m;
        switch (p->divergence) {
        case TKD_KL_DIVERGENCE_FKL:
            d += x > 0 ? x * log(x / y) : 0.0;
            break;
        case TKD_KL_DIVERGENCE_RKL:
            d += y > 0 ? y * log(y / x) : 0.0;
            break;
        case TKD_KL_DIVERGENCE_JSD: /* TRL: β = 0 is KL(P‖Q), β = 1 is KL(Q‖P) */
            m = b * x + (1 - b) * y;
            if (b == 0.0)
                d += x > 0 ? x * log(x / y) : 0.0;
            else if (b == 1.0)
                d += y > 0 ? y * log(y / x) : 0.0;
            else
                d += (x > 0 ? b * x * log(x / m) : 0.0) + (y > 0 ? (1 - b) * y * log(y / m) : 0.0);
            break;
        case TKD_KL_DIVERGENCE_SKL:
            m = al * x + (1 - al) * y;
            d += x > 0 ? x * log(x / m) : 0.0;
            break;
        case TKD_KL_DIVERGENCE_SRKL:
            m = al * y + (1 - al) * x;
            d += y > 0 ? y * log(y / m) : 0.0;
            break;
        case TKD_KL_DIVERGENCE_TVD:
            d += 0.5 * fabs(x - y);
            break;
        }
    }
    return d;
}

/* KD of row i (τ²-scaled) from the distributions the variant forms, built here token by token:
 * renorm p̃ and q̃ over the k' tokens (fkl: q itself); tail p and q on the k' tokens plus the tail bucket (teacher
 * max(r, TKD_KL_TAIL_MASS_MIN), student 1 − Σq); sampled the target and q over all V tokens. */
static double local_row_kd(const dcase *c, const tkd_kl_params *p, int64_t i)
{
    const int v = c->v, kk = p->k_use;
    const double tau = p->temperature;
    double *z = malloc(sizeof(double) * (size_t)v), *P = calloc((size_t)v + 1, sizeof(double));
    double *Q = calloc((size_t)v + 1, sizeof(double));
    assert_true(z && P && Q);
    double zs = 0.0, ps = 0.0, qs = 0.0;
    for (int u = 0; u < v; u++) {
        z[u] = 0.0;
        for (int e = 0; e < c->d; e++)
            z[u] += (double)c->h[i * c->d + e] * c->w[u * c->d + e];
        z[u] = exp(z[u] / tau); /* unnormalised q */
        zs += z[u];
    }
    const int32_t *I = c->idx + i * c->k;
    const float *t = c->tl + i * c->k;
    int n = kk;
    if (p->variant == TKD_KL_VARIANT_RENORM) {
        for (int j = 0; j < kk; j++)
            P[j] = exp(t[j] / tau), Q[j] = z[I[j]], ps += P[j], qs += Q[j];
        for (int j = 0; j < kk; j++) /* fkl keeps log q over V: KL(p̃ ‖ q) */
            P[j] /= ps, Q[j] /= p->divergence == TKD_KL_DIVERGENCE_FKL ? zs : qs;
    } else if (p->variant == TKD_KL_VARIANT_TAIL) {
        for (int j = 0; j < kk; j++)
            P[j] = exp(t[j] / tau - c->lse[i]), Q[j] = z[I[j]] / zs, ps += P[j], qs += Q[j];
        if (kk < v)
            P[kk] = fmax(1.0 - ps, TKD_KL_TAIL_MASS_MIN), Q[kk] = 1.0 - qs, n = kk + 1;
    } else {
        for (int j = 0; j < kk; j++)
            P[I[j]] = exp(t[j] / tau - c->lse[i]), ps += P[I[j]];
        const double r = fmax(1.0 - ps, 0.0);
        for (int e = 0; e < p->s; e++)
            P[c->draws[i * c->s + e]] += r / p->s;
        for (int u = 0; u < v; u++)
            Q[u] = z[u] / zs;
        n = v;
    }
    double kd = tau * tau * local_div(p, P, Q, n);
    free(z), free(P), free(Q);
    return kd;
}

/* ---- runs ------------------------------------------------------------------------------------ */

typedef struct refg {
    tkd_kl_result res;
    double *dh, *dw;
} refg;

static refg ref_run(const dcase *c, const tkd_kl_params *p)
{
    refg g = {.dh = malloc(sizeof(double) * (size_t)(c->n * c->d)),
              .dw = malloc(sizeof(double) * (size_t)(c->v * c->d))};
    assert_true(g.dh && g.dw);
    tkd_kl_batch b = dcase_batch(c);
    if (tkd_kl_ref_f64(p, &b, &g.res, g.dh, g.dw) != TKD_OK)
        fail_msg("ref %s: %s", spec_name(p), tkd_error_msg());
    return g;
}

static void refg_free(refg *g)
{
    free(g->dh), free(g->dw);
}

typedef struct cpug {
    tkd_kl_result res;
    float *dh, *dw;
} cpug;

/* Forward + backward (recompute) or forward alone (grad_in_forward, dw_overwrite onto NaN). */
static cpug cpu_run(const dcase *c, tkd_kl_params p, int chunk, int gif)
{
    cpug o = {.dh = malloc(sizeof(float) * (size_t)(c->n * c->d)), .dw = malloc(sizeof(float) * (size_t)(c->v * c->d))};
    assert_true(o.dh && o.dw);
    for (int i = 0; i < c->n * c->d; i++)
        o.dh[i] = NAN; /* an unwritten element fails */
    for (int i = 0; i < c->v * c->d; i++)
        o.dw[i] = gif ? NAN : 0.0f;
    p.chunk_rows = chunk;
    p.grad_in_forward = gif;
    p.dw_overwrite = gif;
    tkd_kl_batch b = dcase_batch(c);
    tkd_kl_cpu_ws *ws = NULL;
    if (tkd_kl_cpu_ws_create(&ws, &p, c->n, c->d, c->v) != TKD_OK ||
        tkd_kl_cpu_forward(ws, &p, &b, &o.res, o.dh, o.dw) != TKD_OK ||
        tkd_kl_cpu_backward(ws, &p, &b, p.grad_scale, o.dh, o.dw) != TKD_OK)
        fail_msg("cpu %s: %s", spec_name(&p), tkd_error_msg());
    tkd_kl_cpu_ws_free(ws);
    return o;
}

static void cpug_free(cpug *o)
{
    free(o->dh), free(o->dw);
}

/* max |a − b| / max |b|; NaN is infinitely wrong */
static double rel_err(const float *a, const double *b, size_t n)
{
    double e = 0.0, m = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]);
        e = isnan(d) ? INFINITY : fmax(e, d);
        m = fmax(m, fabs(b[i]));
    }
    return m > 0 ? e / m : e;
}

static double rel_err_dd(const double *a, const double *b, size_t n)
{
    double e = 0.0, m = 0.0;
    for (size_t i = 0; i < n; i++)
        e = fmax(e, fabs(a[i] - b[i])), m = fmax(m, fabs(b[i]));
    return m > 0 ? e / m : e;
}

static double worst_loss, worst_grad; /* reported once, for docs/loss.md */

/* As test_kl_loss.c: fp32 logits from sgemm (~1e-7 relative) move the double loss by as much, so
 * 1e-6 relative (+1e-7 absolute); fp32 exps and sgemm sums over V or a chunk: 2e-5 of the largest
 * gradient. The divergences add only double arithmetic on k' + S + 1 buckets per row. */
#define LOSS_RTOL 1e-6
#define LOSS_ATOL 1e-7
#define GRAD_RTOL 2e-5

static void expect_cpu_matches(const char *tag, const dcase *c, const tkd_kl_params *p, const cpug *o, const refg *g,
                               double loss_rtol, double grad_rtol)
{
    const double el = fmax(fabs(o->res.loss - g->res.loss) / (LOSS_ATOL / LOSS_RTOL + fabs(g->res.loss)),
                           fabs(o->res.kd - g->res.kd) / (LOSS_ATOL / LOSS_RTOL + fabs(g->res.kd)));
    const double eh = rel_err(o->dh, g->dh, (size_t)(c->n * c->d)), ew = rel_err(o->dw, g->dw, (size_t)(c->v * c->d));
    worst_loss = fmax(worst_loss, el);
    if (grad_rtol == GRAD_RTOL)
        worst_grad = fmax(worst_grad, fmax(eh, ew));
    if (!(el <= loss_rtol) || !isfinite(o->res.loss) || o->res.n_kept != g->res.n_kept)
        fail_msg("%s %s: loss %.10g kd %.10g, ref %.10g %.10g", tag, spec_name(p), o->res.loss, o->res.kd,
                 g->res.loss, g->res.kd);
    if (!(eh <= grad_rtol && ew <= grad_rtol))
        fail_msg("%s %s: gradient error dH %.3g dW %.3g of the largest", tag, spec_name(p), eh, ew);
    for (int64_t i = 0; i < c->n; i++) /* masked rows get no gradient at all */
        for (int e = 0; c->labels[i] == -100 && e < c->d; e++)
            if (o->dh[i * c->d + e] != 0.0f)
                fail_msg("%s %s: masked row %lld has dH %g", tag, spec_name(p), (long long)i,
                         (double)o->dh[i * c->d + e]);
}

/* The chunked path in both modes against the reference. */
static void check_chunked(const char *tag, const dcase *c, const tkd_kl_params *p, int chunk, double loss_rtol,
                          double grad_rtol)
{
    refg g = ref_run(c, p);
    for (int gif = 0; gif < 2; gif++) {
        char what[64];
        snprintf(what, sizeof what, "%s %s", tag, gif ? "grad_in_forward" : "recompute");
        cpug o = cpu_run(c, *p, chunk, gif);
        expect_cpu_matches(what, c, p, &o, &g, loss_rtol, grad_rtol);
        cpug_free(&o);
    }
    refg_free(&g);
}

/* ---- tests ----------------------------------------------------------------------------------- */

static void test_divergence_names(void **state)
{
    (void)state;
    for (int i = 0; tkd_kl_divergence_names[i]; i++)
        assert_int_equal(tkd_kl_divergence_parse(tkd_kl_divergence_name((tkd_kl_divergence)i)), i);
    assert_int_equal(tkd_kl_divergence_parse("srkl"), TKD_KL_DIVERGENCE_SRKL);
    assert_int_equal(tkd_kl_divergence_parse("kl"), -1);
    assert_string_equal(tkd_kl_divergence_name((tkd_kl_divergence)17), "unknown");
    tkd_kl_params p;
    tkd_kl_params_defaults(&p, 4);
    assert_int_equal(p.divergence, TKD_KL_DIVERGENCE_FKL);
    assert_true(p.jsd_beta == 0.5f && p.skew_alpha == 0.1f);
}

/* The reference equals the definitions over each variant's distributions (sampled's over all V
 * tokens, where the reference coarse-grains the undrawn tail into one bucket), k' < k and k' = V. */
static void test_ref_matches_definitions(void **state)
{
    (void)state;
    const double tau = 2.0, alpha = 0.3;
    dcase c = dcase_make(11, 5, 23, 6, 4, tau, 61), full = dcase_make(6, 4, 13, 13, 0, tau, 62);
    int checked = 0;
    for (int si = 0; si < N_SPECS; si++)
        for (int var = 0; var < 3; var++) {
            for (int f = 0; f < 2; f++) {
                const dcase *cc = f ? &full : &c;
                if (f && var == TKD_KL_VARIANT_SAMPLED)
                    continue; /* no tail to draw from */
                tkd_kl_params p =
                    spec_params(&g_specs[si], (tkd_kl_variant)var, tau, alpha, cc->k, f ? cc->k : 4, cc->s);
                if (spec_refused(&g_specs[si], (tkd_kl_variant)var))
                    continue;
                double kd = 0.0;
                int kept = 0;
                for (int64_t i = 0; i < cc->n; i++)
                    if (cc->labels[i] != -100)
                        kd += local_row_kd(cc, &p, i), kept++;
                refg g = ref_run(cc, &p);
                /* 1e-10: double arithmetic on the same fp32 inputs in another order (and the tail's
                 * 1 − Σq formed by subtraction here, from log-sum-exps there) */
                if (!tkd_test_close(g.res.kd, kd / kept, 1e-10, 1e-10))
                    fail_msg("%s: ref kd %.14g, definition %.14g", spec_name(&p), g.res.kd, kd / kept);
                assert_true(kd / kept > 1e-3); /* not trivially zero */
                refg_free(&g);
                checked++;
            }
        }
    assert_int_equal(checked, N_SPECS * 5 - 3 * 1);
    dcase_free(&c), dcase_free(&full);
}

/* Forward and reverse KL at the endpoints: jsd β = 0 and skl α = 0 are fkl, jsd β = 1 and srkl
 * α = 0 are rkl, over the same buckets. With tail (and sampled for fkl) those buckets are fkl's
 * own, so the loss and gradients equal kd.divergence = fkl's; renorm's fkl keeps log q over V
 * (docs/loss.md), so there only the reverse endpoints are compared. */
static void test_endpoints(void **state)
{
    (void)state;
    const double tau = 1.0;
    dcase c = dcase_make(17, 6, 41, 5, 3, tau, 71);
    const dspec fkl = {TKD_KL_DIVERGENCE_FKL, 0.5f, 0.1f}, rkl = {TKD_KL_DIVERGENCE_RKL, 0.5f, 0.1f};
    const dspec to_f[] = {{TKD_KL_DIVERGENCE_JSD, 0.0f, 0.1f}, {TKD_KL_DIVERGENCE_SKL, 0.5f, 0.0f}};
    const dspec to_r[] = {{TKD_KL_DIVERGENCE_JSD, 1.0f, 0.1f}, {TKD_KL_DIVERGENCE_SRKL, 0.5f, 0.0f}};
    for (int var = 0; var < 3; var++)
        for (int e = 0; e < 2; e++) {
            const dspec *pairs[2][2] = {{&to_f[e], &fkl}, {&to_r[e], &rkl}};
            for (int which = 0; which < 2; which++) {
                if ((which == 0 && var == TKD_KL_VARIANT_RENORM) || (which == 1 && var == TKD_KL_VARIANT_SAMPLED))
                    continue;
                tkd_kl_params pe = spec_params(pairs[which][0], (tkd_kl_variant)var, tau, 0.5, 5, 5, 3);
                tkd_kl_params pk = spec_params(pairs[which][1], (tkd_kl_variant)var, tau, 0.5, 5, 5, 3);
                refg ge = ref_run(&c, &pe), gk = ref_run(&c, &pk);
                cpug oe = cpu_run(&c, pe, 4, 1), ok = cpu_run(&c, pk, 4, 1);
                /* 1e-12 for the reference: the same maths in another order; the chunked path's fkl is
                 * today's code, its endpoint the divergence code: fp32 rounding apart, as vs the ref */
                if (!tkd_test_close(ge.res.loss, gk.res.loss, 1e-12, 1e-12) ||
                    rel_err_dd(ge.dw, gk.dw, (size_t)(c.v * c.d)) > 1e-10)
                    fail_msg("%s: ref loss %.14g vs %.14g", spec_name(&pe), ge.res.loss, gk.res.loss);
                if (!tkd_test_close(oe.res.loss, ok.res.loss, LOSS_ATOL, LOSS_RTOL) ||
                    rel_err(oe.dw, gk.dw, (size_t)(c.v * c.d)) > GRAD_RTOL)
                    fail_msg("%s: chunked loss %.10g vs %.10g", spec_name(&pe), oe.res.loss, ok.res.loss);
                refg_free(&ge), refg_free(&gk), cpug_free(&oe), cpug_free(&ok);
            }
        }
    /* and the inner JSD is not either end, so the comparisons above have teeth */
    tkd_kl_params pj = spec_params(&g_specs[2], TKD_KL_VARIANT_TAIL, tau, 0.5, 5, 5, 0);
    tkd_kl_params pf = spec_params(&fkl, TKD_KL_VARIANT_TAIL, tau, 0.5, 5, 5, 0);
    refg gj = ref_run(&c, &pj), gf = ref_run(&c, &pf);
    assert_true(rel_err_dd(gj.dw, gf.dw, (size_t)(c.v * c.d)) > 1e-2);
    refg_free(&gj), refg_free(&gf);
    dcase_free(&c);
}

/* ---- finite differences ----------------------------------------------------------------------- */

enum { FN = 4, FD_ = 3, FV = 7, FK = 3, FS = 3 };

static double fd_loss(const tkd_kl_params *p, dcase *c)
{
    tkd_kl_batch b = dcase_batch(c);
    tkd_kl_result r;
    if (tkd_kl_ref_f64(p, &b, &r, NULL, NULL) != TKD_OK)
        fail_msg("ref: %s", tkd_error_msg());
    return r.loss;
}

/* central differences stepping the fp32 input itself (the step taken is x+ − x− after rounding) */
static double fd(const tkd_kl_params *p, dcase *c, float *x)
{
    const float x0 = *x, xp = x0 + 1e-3f, xm = x0 - 1e-3f;
    *x = xp;
    double lp = fd_loss(p, c);
    *x = xm;
    double lm = fd_loss(p, c);
    *x = x0;
    return (lp - lm) / ((double)xp - (double)xm);
}

static void gradcheck_one(dcase *c, const tkd_kl_params *p)
{
    double fh[FN * FD_], fw[FV * FD_], gmax = 0.0;
    for (int i = 0; i < FN * FD_; i++)
        gmax = fmax(gmax, fabs(fh[i] = fd(p, c, &c->h[i])));
    for (int i = 0; i < FV * FD_; i++)
        gmax = fmax(gmax, fabs(fw[i] = fd(p, c, &c->w[i])));
    assert_true(gmax > 1e-2);
    refg g = ref_run(c, p);
    cpug o = cpu_run(c, *p, 3, 0), of = cpu_run(c, *p, 3, 1);
    /* step 1e-3: truncation ~ step²·|f'''| ≈ 1e-6 of the largest gradient here; 1e-5 leaves a margin
     * (2e-5 for the fp32 chunked path, whose own rounding is ~1e-7 relative) */
    const double tol = 1e-5 * gmax;
    for (int i = 0; i < FN * FD_ + FV * FD_; i++) {
        const int h = i < FN * FD_, j = h ? i : i - FN * FD_;
        const double want = h ? fh[j] : fw[j], ref = h ? g.dh[j] : g.dw[j];
        const double ch = h ? o.dh[j] : o.dw[j], chf = h ? of.dh[j] : of.dw[j];
        if (fabs(ref - want) > tol || fabs(ch - want) > 2 * tol || fabs(chf - want) > 2 * tol)
            fail_msg("%s d%s[%d]: finite differences %.9g, ref %.9g, chunked %.9g / %.9g", spec_name(p), h ? "H" : "W",
                     j, want, ref, ch, chf);
    }
    refg_free(&g), cpug_free(&o), cpug_free(&of);
}

/* Every divergence x variant (where defined) x τ ∈ {1, 2} x α ∈ {0.5, 1}, k' < k, one masked row. */
static void test_gradcheck(void **state)
{
    (void)state;
    int n = 0;
    for (int ti = 0; ti < 2; ti++) {
        const double tau = ti ? 2.0 : 1.0;
        dcase c = dcase_make(FN, FD_, FV, FK, FS, tau, 81 + ti);
        c.labels[3] = 1, c.labels[2] = -100; /* row 2 masked, the others kept */
        for (int si = 0; si < N_SPECS; si++)
            for (int var = 0; var < 3; var++)
                for (int ai = 0; ai < 2; ai++) {
                    if (spec_refused(&g_specs[si], (tkd_kl_variant)var))
                        continue;
                    tkd_kl_params p = spec_params(&g_specs[si], (tkd_kl_variant)var, tau, ai ? 1.0 : 0.5, FK, 2, FS);
                    gradcheck_one(&c, &p);
                    n++;
                }
        dcase_free(&c);
    }
    assert_int_equal(n, 2 * 2 * (N_SPECS * 3 - 3));
}

/* ---- the chunked path against the reference ----------------------------------------------------- */

/* Every divergence but fkl (test_kl_loss.c has it) x variant x τ x α x k' (x S for sampled), N = 37 in
 * chunks of 8, V = 203, both modes. */
static void test_chunked_grid(void **state)
{
    (void)state;
    const double alphas[] = {0.0, 0.5, 1.0};
    const int n = 37, d = 16, v = 203, k = 6, kus[] = {1, 3, 6};
    for (int ti = 0; ti < 2; ti++) {
        const double tau = ti ? 2.0 : 1.0;
        dcase c7 = dcase_make(n, d, v, k, 7, tau, 100 + ti), c1 = dcase_make(n, d, v, k, 1, tau, 110 + ti);
        for (int si = 1; si < N_SPECS; si++)
            for (int var = 0; var < 3; var++)
                for (int ai = 0; ai < 3; ai++)
                    for (int ki = 0; ki < 3; ki++)
                        for (int sc = 0; sc < (var == TKD_KL_VARIANT_SAMPLED ? 2 : 1); sc++) {
                            if (spec_refused(&g_specs[si], (tkd_kl_variant)var))
                                continue;
                            const dcase *c = sc ? &c1 : &c7;
                            tkd_kl_params p = spec_params(&g_specs[si], (tkd_kl_variant)var, tau, alphas[ai], k,
                                                          kus[ki], c->s);
                            check_chunked("grid", c, &p, 8, LOSS_RTOL, GRAD_RTOL);
                        }
        dcase_free(&c7), dcase_free(&c1);
    }
    print_message("divergences: worst error vs the float64 reference: loss %.3g (relative), gradients %.3g (of the "
                  "largest)\n", worst_loss, worst_grad);
}

/* k = 1, one row, chunks of 1 and the automatic chunk, V not a multiple of anything. */
static void test_chunked_small_shapes(void **state)
{
    (void)state;
    dcase c = dcase_make(13, 5, 29, 1, 7, 1.0, 200), one = dcase_make(1, 3, 11, 4, 5, 2.0, 201);
    one.labels[0] = 10;
    for (int si = 1; si < N_SPECS; si++)
        for (int var = 0; var < 3; var++) {
            if (spec_refused(&g_specs[si], (tkd_kl_variant)var))
                continue;
            tkd_kl_params p = spec_params(&g_specs[si], (tkd_kl_variant)var, 1.0, 0.5, 1, 1, 7);
            check_chunked("k=1", &c, &p, 3, LOSS_RTOL, GRAD_RTOL);
            check_chunked("k=1 auto chunk", &c, &p, 0, LOSS_RTOL, GRAD_RTOL);
            tkd_kl_params p1 = spec_params(&g_specs[si], (tkd_kl_variant)var, 2.0, 1.0, 4, 2, 5);
            check_chunked("N=1", &one, &p1, 1, LOSS_RTOL, GRAD_RTOL);
        }
    dcase_free(&c), dcase_free(&one);
}

/* Logits of ±1e4 (student and teacher; exact in fp32, as in test_kl_loss.c): finite, and still the
 * reference's values. Many teacher and student probabilities underflow to 0 here, which the buckets'
 * log-domain terms must survive. Gradients to 1e-4 of the largest, as test_kl_loss.c's extreme cases
 * (dH and dW cancel terms far larger than the result). The loss to 1e-4 relative: at τ ≠ 1 the row
 * statistics carry 1/τ in fp32 (LSE(z) off by |s|·2^-25 ≈ 1e-4 at |s| = 2e4, as for fkl), and the
 * reverse-KL-like terms c·(log c − log a) multiply that relative error of c by |log a|, up to
 * ~1e4/τ here (observed 1.3e-5). */
#define EXTREME_LOSS_RTOL 1e-4
#define EXTREME_GRAD_RTOL 1e-4
static void test_chunked_extreme_logits(void **state)
{
    (void)state;
    const int n = 23, d = 4, v = 61, k = 6;
    for (int ti = 0; ti < 2; ti++) {
        const double tau = ti ? 2.5 : 1.0;
        dcase c = dcase_make(n, d, v, k, 7, tau, 300 + ti);
        for (int i = 0; i < n * d; i++)
            c.h[i] = (float)(rand_below(&c, 3) - 1);
        for (int i = 0; i < v * d; i++)
            c.w[i] = (float)(2500 * (rand_below(&c, 5) - 2));
        for (int i = 0; i < n * v; i++)
            c.tfull[i] = (float)(rand_below(&c, 20001) - 10000);
        dcase_cut(&c, tau);
        for (int si = 1; si < N_SPECS; si++)
            for (int var = 0; var < 3; var++) {
                if (spec_refused(&g_specs[si], (tkd_kl_variant)var))
                    continue;
                tkd_kl_params p = spec_params(&g_specs[si], (tkd_kl_variant)var, tau, 0.5, k, k, 7);
                check_chunked("extreme", &c, &p, 8, EXTREME_LOSS_RTOL, EXTREME_GRAD_RTOL);
            }
        dcase_free(&c);
    }
}

/* ---- errors ----------------------------------------------------------------------------------- */

static void expect_params_error(tkd_kl_params p, const char *const *frags)
{
    tkd_test_expect_error(tkd_kl_params_check(&p, 50), TKD_ERR_INVALID_ARG, frags);
}

static void test_refused_combinations(void **state)
{
    (void)state;
    const dspec rkl = {TKD_KL_DIVERGENCE_RKL, 0.5f, 0.1f}, jsd1 = {TKD_KL_DIVERGENCE_JSD, 1.0f, 0.1f};
    const dspec srkl0 = {TKD_KL_DIVERGENCE_SRKL, 0.5f, 0.0f}, jsd = {TKD_KL_DIVERGENCE_JSD, 0.5f, 0.1f};
    expect_params_error(spec_params(&rkl, TKD_KL_VARIANT_SAMPLED, 1, 0.5, 4, 4, 3),
                        TKD_TEST_FRAGS("kd.divergence = rkl", "kd.variant = sampled", "kd.variant = tail"));
    expect_params_error(spec_params(&jsd1, TKD_KL_VARIANT_SAMPLED, 1, 0.5, 4, 4, 3),
                        TKD_TEST_FRAGS("kd.divergence = jsd with kd.jsd_beta = 1", "kd.variant = sampled"));
    expect_params_error(spec_params(&srkl0, TKD_KL_VARIANT_SAMPLED, 1, 0.5, 4, 4, 3),
                        TKD_TEST_FRAGS("kd.divergence = srkl with kd.skew_alpha = 0", "kd.variant = sampled"));
    expect_params_error(spec_params(&jsd, TKD_KL_VARIANT_SAMPLED, 1, 0.5, 4, 4, 0),
                        TKD_TEST_FRAGS("kd.divergence = jsd with kd.variant = sampled needs tail draws"));
    tkd_kl_params p = spec_params(&jsd, TKD_KL_VARIANT_TAIL, 1, 0.5, 4, 4, 0);
    p.jsd_beta = 1.5f;
    expect_params_error(p, TKD_TEST_FRAGS("kd.jsd_beta = 1.5", "[0, 1]"));
    p.jsd_beta = NAN;
    expect_params_error(p, TKD_TEST_FRAGS("kd.jsd_beta = nan"));
    p = spec_params(&jsd, TKD_KL_VARIANT_RENORM, 1, 0.5, 4, 4, 0);
    p.skew_alpha = 1.0f;
    expect_params_error(p, TKD_TEST_FRAGS("kd.skew_alpha = 1", "[0, 1)"));
    p.skew_alpha = 0.1f;
    p.divergence = (tkd_kl_divergence)6;
    expect_params_error(p, TKD_TEST_FRAGS("kd.divergence 6"));
    /* defined: the same divergences with tail, and CE only (no teacher read) whatever the divergence */
    tkd_kl_params ok = spec_params(&rkl, TKD_KL_VARIANT_TAIL, 1, 0.5, 4, 4, 0);
    assert_int_equal(tkd_kl_params_check(&ok, 50), TKD_OK);
    ok = spec_params(&rkl, TKD_KL_VARIANT_SAMPLED, 1, 0.0, 4, 0, 0);
    assert_int_equal(tkd_kl_params_check(&ok, 50), TKD_OK);

    /* a workspace made for fewer draws than a call brings (the draws' logits are kept per row) */
    dcase c = dcase_make(5, 3, 17, 3, 3, 1.0, 400);
    tkd_kl_batch b = dcase_batch(&c);
    tkd_kl_params p1 = spec_params(&jsd, TKD_KL_VARIANT_SAMPLED, 1, 0.5, 3, 3, 1), p3 = p1;
    p3.s = 3;
    tkd_kl_cpu_ws *ws = NULL;
    assert_int_equal(tkd_kl_cpu_ws_create(&ws, &p1, 5, 3, 17), TKD_OK);
    tkd_kl_result res;
    tkd_test_expect_error(tkd_kl_cpu_forward(ws, &p3, &b, &res, NULL, NULL), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("3 tail draws per row", "made for 1", "kd.divergence = jsd"));
    tkd_kl_cpu_ws_free(ws);
    /* and the reference refuses what params_check refuses */
    tkd_kl_params pr = spec_params(&rkl, TKD_KL_VARIANT_SAMPLED, 1, 0.5, 3, 3, 3);
    double dh[15], dw[51];
    tkd_test_expect_error(tkd_kl_ref_f64(&pr, &b, &res, dh, dw), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("kd.divergence = rkl"));
    dcase_free(&c);
}

/* ---- PyTorch's float64 autograd (tests/divergence_reference.py) ------------------------------- */

#define FIX_DIR TKD_SOURCE_DIR "/tests/fixtures/divergences"

/* <dir>/<name>: exactly n elements of `size` bytes, malloc'd; fails the test otherwise. */
static void *fix_read(const char *dir, const char *name, size_t n, size_t size)
{
    const char *path = tkd_test_path(dir, name);
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("%s: missing (rerun tests/divergence_reference.py)", path);
    void *x = malloc(size * n + size);
    assert_non_null(x);
    size_t got = fread(x, size, n + 1, f);
    fclose(f);
    if (got != n)
        fail_msg("%s: %zu elements, want %zu", path, got, n);
    return x;
}

/* One input set (<dir>/meta.txt "N D V k S tau_cache", its arrays) and every case in cases.txt
 * ("name variant divergence beta skew tau alpha k_use"): the reference and the chunked path (both
 * modes) against torch's loss, KD, CE, dH and dW. */
static int check_fixture_set(const char *set)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", FIX_DIR, set);
    FILE *mf = fopen(tkd_test_path(dir, "meta.txt"), "r");
    if (!mf)
        fail_msg("%s/meta.txt: missing (rerun tests/divergence_reference.py)", dir);
    dcase c = {0};
    double tau_cache;
    if (fscanf(mf, "%lld %d %d %d %d %lf", (long long *)&c.n, &c.d, &c.v, &c.k, &c.s, &tau_cache) != 6)
        fail_msg("%s/meta.txt: want \"N D V k S tau_cache\"", dir);
    fclose(mf);
    c.h = fix_read(dir, "h.f32", (size_t)(c.n * c.d), 4);
    c.w = fix_read(dir, "w.f32", (size_t)(c.v * c.d), 4);
    c.idx = fix_read(dir, "idx.i32", (size_t)(c.n * c.k), 4);
    c.tl = fix_read(dir, "tl.f32", (size_t)(c.n * c.k), 4);
    c.lse = fix_read(dir, "lse.f32", (size_t)c.n, 4);
    c.draws = fix_read(dir, "draws.i32", (size_t)(c.n * c.s), 4);
    c.labels = fix_read(dir, "labels.i32", (size_t)c.n, 4);
    FILE *cf = fopen(tkd_test_path(dir, "cases.txt"), "r");
    if (!cf)
        fail_msg("%s/cases.txt: missing", dir);
    char name[64], var[16], dv[16];
    float beta, skew, tau, alpha;
    int k_use, n = 0;
    while (fscanf(cf, "%63s %15s %15s %f %f %f %f %d", name, var, dv, &beta, &skew, &tau, &alpha, &k_use) == 8) {
        tkd_kl_params p = tkd_test_kl_params((tkd_kl_variant)tkd_kl_variant_parse(var), tau, alpha, c.k, k_use,
                                             strcmp(var, "sampled") == 0 ? c.s : 0);
        p.divergence = (tkd_kl_divergence)tkd_kl_divergence_parse(dv);
        p.jsd_beta = beta, p.skew_alpha = skew;
        assert_true((int)p.variant >= 0 && (int)p.divergence >= 0);
        char fn[96];
        snprintf(fn, sizeof fn, "%s.loss.f64", name);
        double *want = fix_read(dir, fn, 3, 8); /* loss, kd, ce */
        snprintf(fn, sizeof fn, "%s.dh.f64", name);
        double *wdh = fix_read(dir, fn, (size_t)(c.n * c.d), 8);
        snprintf(fn, sizeof fn, "%s.dw.f64", name);
        double *wdw = fix_read(dir, fn, (size_t)(c.v * c.d), 8);
        refg torch = {.res = {.loss = want[0], .kd = want[1], .ce = want[2]}, .dh = wdh, .dw = wdw};
        refg g = ref_run(&c, &p);
        torch.res.n_kept = g.res.n_kept;
        /* float64 on both sides from the same fp32 inputs: only the order of operations differs */
        const double eh = rel_err_dd(g.dh, wdh, (size_t)(c.n * c.d)), ew = rel_err_dd(g.dw, wdw, (size_t)(c.v * c.d));
        if (!tkd_test_close(g.res.loss, want[0], 1e-10, 1e-10) || !tkd_test_close(g.res.kd, want[1], 1e-10, 1e-10) ||
            !tkd_test_close(g.res.ce, want[2], 1e-10, 1e-10) || eh > 1e-9 || ew > 1e-9)
            fail_msg("%s %s: reference vs torch: loss %.14g vs %.14g, kd %.14g vs %.14g, dH %.3g dW %.3g", set, name,
                     g.res.loss, want[0], g.res.kd, want[1], eh, ew);
        for (int gif = 0; gif < 2; gif++) {
            cpug o = cpu_run(&c, p, 5, gif);
            expect_cpu_matches(name, &c, &p, &o, &torch, LOSS_RTOL, GRAD_RTOL);
            cpug_free(&o);
        }
        refg_free(&g);
        free(want), free(wdh), free(wdw);
        n++;
    }
    fclose(cf);
    free(c.h), free(c.w), free(c.idx), free(c.tl), free(c.lse), free(c.draws), free(c.labels);
    return n;
}

static void test_torch_fixtures(void **state)
{
    (void)state;
    int n = check_fixture_set("tau1") + check_fixture_set("tau2");
    print_message("divergences: %d cases against torch\n", n);
    assert_true(n >= 2 * 2 * (6 * 3 - 1)); /* every divergence x variant where defined x alpha, per τ */
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "fixtures") == 0) {
        const struct CMUnitTest fix[] = {cmocka_unit_test(test_torch_fixtures)};
        return cmocka_run_group_tests_name("divergences vs torch", fix, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_divergence_names),
        cmocka_unit_test(test_ref_matches_definitions),
        cmocka_unit_test(test_endpoints),
        cmocka_unit_test(test_gradcheck),
        cmocka_unit_test(test_chunked_grid),
        cmocka_unit_test(test_chunked_small_shapes),
        cmocka_unit_test(test_chunked_extreme_logits),
        cmocka_unit_test(test_refused_combinations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
