/* kl_testutil.h — header-only fixture of the CUDA KL loss tests (test_gpu_kl_loss.c,
 * test_gpu_kl_loss_paths.c): a synthetic batch cut from full teacher logits, one GPU run of
 * kernels/loss/kl_loss_cuda.h and its comparison with the float64 reference tkd_kl_ref_f64 on inputs
 * already rounded to bf16 (so the only differences are the GPU's accumulation order, its fp32
 * logits / log-sum-exps and the bf16 rounding of dS), and the loop over the CUDA policies every test
 * runs under. Not a test itself (no test_ prefix); its names are local to those two programs.
 * Include after <cmocka.h>; everything but TKD_KL_TEST_MAIN exists only where the build has the CUDA
 * backend (TKD_HAVE_CUDA).
 *
 * Tolerances (relative unless said):
 *   loss, KD, CE: |Δ| ≤ 2e-4 + 2e-4·|ref|. The logits are fp32 sums of bf16 products (exact
 *     products, ~1e-7 relative rounding), the log-sum-exps fp32 (~1e-7 of |lse|), the per-row
 *     loss double; 2e-4 leaves room for the exp2 approximation on |s| up to ~100.
 *   dH, dW: ‖Δ‖₂ / ‖ref‖₂ ≤ 1e-2. dS is rounded to bf16 (≤ 2^-9 = 2e-3 relative per element,
 *     about 1e-3 in norm after the GEMM's fp32 sums); fp32 q adds ~1e-6.
 *   extreme logits (|s| ~ 1e4): loss 1e-3 relative (fp32 logits have ulp ~1e-3 there, and the
 *     loss is ~1e4 in size); gradients 3e-2, because q = exp(s/τ − lse) then carries an
 *     absolute error of ~1e-3 where a row's dS is a small difference of two numbers near 1.
 */
#ifndef TKD_KL_TESTUTIL_H
#define TKD_KL_TESTUTIL_H

/* A KL loss test's main (as gpu_testutil.h's TKD_TEST_GPU_MAIN): exits 77 (skipped) where no GPU
 * answers or the build has no CUDA backend, else runs `tests` (a CMUnitTest array, defined only where
 * TKD_HAVE_CUDA is) once per policy group (kl_test_run_groups). */
#ifdef TKD_HAVE_CUDA
#define TKD_KL_TEST_MAIN(tests)                                                                              \
    int main(void)                                                                                           \
    {                                                                                                        \
        tkd_test_require_gpu();                                                                              \
        return kl_test_run_groups(tests, sizeof tests / sizeof tests[0]);                                    \
    }
#else
#define TKD_KL_TEST_MAIN(tests)                                                                              \
    int main(void)                                                                                           \
    {                                                                                                        \
        printf("skipped: built without the CUDA backend\n");                                                 \
        return 77;                                                                                           \
    }
#endif

#ifdef TKD_HAVE_CUDA

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "kernels/loss/kl_loss.h"
#include "tests/testutil.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/loss/kl_loss_cuda.h"
#include "kernels/loss/kl_loss_cuda_tuning.h" /* the row kernels' launch shapes, the sm90 switch */
#include "kernels/gemm_sm90/lmhead_sm90.h"

#define LOSS_TOL 2e-4
#define GRAD_TOL 1e-2
#define EXTREME_LOSS_TOL 1e-3
#define EXTREME_GRAD_TOL 3e-2
/* sm90 path against the fallback on the same inputs: the logits differ only in fp32 summation
 * order (~1e-7 relative), so the losses agree to ~1e-6; dS may round to the neighbouring bf16 value
 * where the fp32 value sits near a rounding boundary (≤ 2^-8 relative on those elements, a few of
 * them), so dH and dW agree far inside one bf16 step in norm. */
#define PATHS_LOSS_TOL 1e-5
#define PATHS_GRAD_TOL 4e-3

/* The CUDA policy of the group being run (main runs the tests once per group: the default, our
 * GEMM off, and the gradient GEMMs' other choices); g_fallback: our logits GEMM is off in it. */
static tkd_cuda_policy g_pol;
static int g_fallback;

/* ---- a synthetic batch cut from full teacher logits ----------------------------------------- */

typedef struct gcase {
    int64_t n;
    int d, v, k, s;
    float *h, *w;         /* (N, D), (V, D), bf16-representable */
    int32_t *idx;         /* (N, k) */
    float *tl;            /* (N, k) */
    float *lse;           /* (N) log Σ exp(t / τ_cache) over the full V */
    int32_t *draws;       /* (N, S) outside the top-k, draw 1 repeats draw 0 */
    int32_t *labels;      /* (N) every 5th row ignore_index */
    uint64_t rng;
} gcase;

static inline uint64_t next_u64(gcase *c)
{
    c->rng ^= c->rng << 13;
    c->rng ^= c->rng >> 7;
    c->rng ^= c->rng << 17;
    return c->rng;
}

static inline int rand_below(gcase *c, int n) { return (int)(next_u64(c) % (uint64_t)n); }

static inline void round_bf16(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = tkd_bf16_to_f32(tkd_f32_to_bf16(x[i]));
}

static inline int gcase_rand(void *c, int n) { return rand_below(c, n); }

/* One row's teacher columns: the k largest of t (V), sorted, lse at τ_cache, and the draws (draw 1
 * repeats draw 0). */
static inline void cut_row(gcase *c, int64_t i, const float *t, double tau_cache)
{
    tkd_test_cut_row(t, c->v, c->k, tau_cache, c->s, 1, gcase_rand, c, c->idx + i * c->k, c->tl + i * c->k,
                     c->lse + i, c->draws + i * c->s);
}

static inline gcase *case_make(int64_t n, int d, int v, int k, int s, double tau_cache, uint64_t seed,
                        float hw_std)
{
    gcase *c = calloc(1, sizeof *c);
    assert_non_null(c);
    c->n = n, c->d = d, c->v = v, c->k = k, c->s = s;
    c->rng = seed * 0x9e3779b97f4a7c15ull + 7;
    c->h = malloc(sizeof(float) * (size_t)(n * d));
    c->w = malloc(sizeof(float) * (size_t)v * d);
    c->idx = malloc(sizeof(int32_t) * (size_t)(n * k + 1));
    c->tl = malloc(sizeof(float) * (size_t)(n * k + 1));
    c->lse = malloc(sizeof(float) * (size_t)n);
    c->draws = malloc(sizeof(int32_t) * (size_t)(n * s + 1));
    c->labels = malloc(sizeof(int32_t) * (size_t)n);
    float *t = malloc(sizeof(float) * (size_t)v);
    assert_true(c->h && c->w && c->idx && c->tl && c->lse && c->draws && c->labels && t);
    tkd_test_randn(c->h, (size_t)(n * d), seed + 1, hw_std);
    tkd_test_randn(c->w, (size_t)v * d, seed + 2, hw_std);
    round_bf16(c->h, (size_t)(n * d));
    round_bf16(c->w, (size_t)v * d);
    for (int64_t i = 0; i < n; i++) {
        tkd_test_randn(t, (size_t)v, seed * 1000 + 17 + (uint64_t)i, 2.5f);
        cut_row(c, i, t, tau_cache);
        c->labels[i] = (i % 5 == 3) ? -100 : rand_below(c, v);
    }
    free(t);
    return c;
}

static inline void case_free(gcase *c)
{
    free(c->h), free(c->w), free(c->idx), free(c->tl), free(c->lse), free(c->draws);
    free(c->labels), free(c);
}

static inline tkd_kl_batch case_batch(const gcase *c)
{
    tkd_kl_batch b = {.n = c->n, .d = c->d, .v = c->v, .h = c->h, .w = c->w, .topk_idx = c->idx,
                      .topk_logit = c->tl, .teacher_lse = c->lse, .tail_idx = c->s > 0 ? c->draws : NULL,
                      .labels = c->labels};
    return b;
}

/* ---- one GPU run and its comparison with the reference ---------------------------------------- */

typedef struct errs {
    double loss, dh, dw; /* loss: |Δ| / (1 + |ref|) over loss, kd, ce; grads: relative norms */
} errs;

/* ‖a − ref‖ / ‖ref‖; infinity when a holds a non-finite value (unwritten or NaN). */
static inline double rel_norm(const float *a, const double *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]))
            return INFINITY;
        num += (a[i] - ref[i]) * (a[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static inline double loss_err(const tkd_kl_result *g, const tkd_kl_result *r)
{
    double e = fabs(g->loss - r->loss) / (1.0 + fabs(r->loss));
    e = fmax(e, fabs(g->kd - r->kd) / (1.0 + fabs(r->kd)));
    e = fmax(e, fabs(g->ce - r->ce) / (1.0 + fabs(r->ce)));
    return isfinite(g->loss) ? e : INFINITY;
}

typedef struct gpu_ctx {
    tkd_kl_cuda_ws *ws;
    tkd_kl_cuda_batch db;
    float *dh, *dw;       /* device (N, D), (V, D) */
    float *h_dh, *h_dw;   /* host copies */
    float *poison;        /* host NaNs, (N, D) */
} gpu_ctx;

/* The device side of a run on host batch hb (uploaded with up's k, s and dense) and a workspace
 * for p; dH, dW and their host copies. */
static inline void ctx_init_batch(gpu_ctx *x, const tkd_kl_batch *hb, const tkd_kl_params *up,
                                  const tkd_kl_params *p)
{
    assert_int_equal(tkd_kl_cuda_batch_upload(&x->db, up, hb), TKD_OK);
    assert_int_equal(tkd_kl_cuda_ws_create(&x->ws, p, &g_pol, hb->n, hb->d, hb->v), TKD_OK);
    size_t nh = (size_t)(hb->n * hb->d), nw = (size_t)hb->v * hb->d;
    assert_int_equal(tkd_cuda_malloc((void **)&x->dh, nh * 4, "dH", NULL), TKD_OK);
    assert_int_equal(tkd_cuda_malloc((void **)&x->dw, nw * 4, "dW", NULL), TKD_OK);
    x->h_dh = malloc(nh * 4 + 4);
    x->h_dw = malloc(nw * 4 + 4);
    x->poison = malloc(nh * 4 + 4);
    assert_true(x->h_dh && x->h_dw && x->poison);
    for (size_t i = 0; i < nh; i++)
        x->poison[i] = NAN;
}

static inline void ctx_init(gpu_ctx *x, const gcase *c, const tkd_kl_params *p)
{
    tkd_kl_batch hb = case_batch(c);
    tkd_kl_params up = *p; /* upload every stored column and draw, whatever p uses */
    up.k = c->k;
    up.s = c->s;
    ctx_init_batch(x, &hb, &up, p);
}

static inline void ctx_free(gpu_ctx *x)
{
    tkd_kl_cuda_ws_free(x->ws);
    tkd_kl_cuda_batch_free(&x->db);
    tkd_cuda_free(x->dh), tkd_cuda_free(x->dw);
    free(x->h_dh), free(x->h_dw), free(x->poison);
}

/* Forward + gradients on the GPU (recompute: forward then backward(scale); grad_in_forward:
 * forward with p->grad_scale = scale). dH is poisoned with NaN first, so an unwritten element
 * fails; dW is zeroed (it accumulates), or poisoned too with p->dw_overwrite (it must be written). */
static inline void gpu_run(gpu_ctx *x, const gcase *c, const tkd_kl_params *p, float scale,
                    tkd_kl_result *res)
{
    size_t nh = (size_t)(c->n * c->d), nw = (size_t)c->v * c->d;
    assert_int_equal(tkd_cuda_to_device(x->dh, x->poison, nh * 4), TKD_OK);
    if (p->dw_overwrite) {
        float *nan_w = malloc(nw * 4 + 4);
        assert_non_null(nan_w);
        for (size_t i = 0; i < nw; i++)
            nan_w[i] = NAN;
        assert_int_equal(tkd_cuda_to_device(x->dw, nan_w, nw * 4), TKD_OK);
        free(nan_w);
    } else {
        assert_int_equal(tkd_cuda_memzero(x->dw, nw * 4), TKD_OK);
    }
    tkd_kl_params q = *p;
    tkd_status st;
    if (q.grad_in_forward) {
        q.grad_scale = scale;
        st = tkd_kl_cuda_forward(x->ws, &q, &x->db, res, x->dh, x->dw);
    } else {
        st = tkd_kl_cuda_forward(x->ws, &q, &x->db, res, NULL, NULL);
        if (st == TKD_OK)
            st = tkd_kl_cuda_backward(x->ws, &q, &x->db, scale, x->dh, x->dw);
    }
    if (st != TKD_OK)
        fail_msg("%s: %s", tkd_status_name(st), tkd_error_msg());
    assert_int_equal(tkd_cuda_to_host(x->h_dh, x->dh, nh * 4), TKD_OK);
    assert_int_equal(tkd_cuda_to_host(x->h_dw, x->dw, nw * 4), TKD_OK);
}

typedef struct refout {
    tkd_kl_result res;
    double *dh, *dw;
} refout;

static inline void ref_run(const gcase *c, const tkd_kl_params *p, refout *r)
{
    tkd_kl_batch hb = case_batch(c);
    r->dh = malloc(sizeof(double) * (size_t)(c->n * c->d) + 8);
    r->dw = malloc(sizeof(double) * (size_t)c->v * c->d + 8);
    assert_true(r->dh && r->dw);
    tkd_status st = tkd_kl_ref_f64(p, &hb, &r->res, r->dh, r->dw);
    if (st != TKD_OK)
        fail_msg("reference: %s", tkd_error_msg());
}

static inline void ref_free(refout *r) { free(r->dh), free(r->dw); }

static inline errs compare(const gpu_ctx *x, const gcase *c, const tkd_kl_result *g, const refout *r,
                    double scale)
{
    size_t nh = (size_t)(c->n * c->d), nw = (size_t)c->v * c->d;
    errs e;
    e.loss = loss_err(g, &r->res);
    if (g->n_kept != r->res.n_kept)
        e.loss = INFINITY;
    double *sh = malloc(sizeof(double) * (nh > nw ? nh : nw) + 8);
    assert_non_null(sh);
    for (size_t i = 0; i < nh; i++)
        sh[i] = scale * r->dh[i];
    e.dh = rel_norm(x->h_dh, sh, nh);
    for (size_t i = 0; i < nw; i++)
        sh[i] = scale * r->dw[i];
    e.dw = rel_norm(x->h_dw, sh, nw);
    free(sh);
    return e;
}

static inline void params_set(tkd_kl_params *p, int k, tkd_kl_variant var, float tau, float alpha,
                       int k_use, int s, int chunk, int gif)
{
    *p = tkd_test_kl_params(var, tau, alpha, k, k_use, var == TKD_KL_VARIANT_SAMPLED ? s : 0);
    p->chunk_rows = chunk;
    p->grad_in_forward = gif;
}

/* Runs both modes of one parameter set against the reference; returns the worst errors. */
static inline errs check_params(gpu_ctx *x, const gcase *c, const tkd_kl_params *p0, float scale)
{
    refout r;
    ref_run(c, p0, &r);
    errs worst = {0, 0, 0};
    for (int gif = 0; gif < 2; gif++) {
        tkd_kl_params p = *p0;
        p.grad_in_forward = gif;
        p.dw_overwrite = gif; /* both dW semantics against the reference: written, and added to 0 */
        tkd_kl_result g;
        gpu_run(x, c, &p, scale, &g);
        errs e = compare(x, c, &g, &r, scale);
        worst.loss = fmax(worst.loss, e.loss);
        worst.dh = fmax(worst.dh, e.dh);
        worst.dw = fmax(worst.dw, e.dw);
    }
    ref_free(&r);
    return worst;
}

static inline void expect_within(errs e, double loss_tol, double grad_tol, const char *what)
{
    if (!(e.loss <= loss_tol && e.dh <= grad_tol && e.dw <= grad_tol))
        fail_msg("%s: loss err %.3g (tol %.1g), dH %.3g, dW %.3g (tol %.1g)", what, e.loss,
                 loss_tol, e.dh, e.dw, grad_tol);
}

/* Runs tests (n_tests) once per group, each with its CUDA policy in g_pol. The policy is handed to
 * each workspace: the default, our logits GEMM off (cuBLAS and the row kernel's statistics), and the
 * gradient GEMMs both on cuBLAS and both ours. Returns the number of failures. */
static inline int kl_test_run_groups(const struct CMUnitTest *tests, size_t n_tests)
{
    static const struct {
        const char *name;
        int kl_sm90, kl_grad;
    } groups[] = {
        {"kl_loss, default policy (sm90 where it runs)", 1, TKD_POLICY_KL_GRAD_AUTO},
        {"kl_loss, TKD_KL_SM90=off (cuBLAS fallback)", 0, TKD_POLICY_KL_GRAD_AUTO},
        {"kl_loss, TKD_KL_GRAD_SM90=cublas", 1, TKD_POLICY_KL_GRAD_CUBLAS},
        {"kl_loss, TKD_KL_GRAD_SM90=both", 1, TKD_POLICY_KL_GRAD_BOTH},
    };
    int failed = 0;
    for (size_t i = 0; i < sizeof groups / sizeof groups[0]; i++) {
        g_pol = tkd_cuda_policy_default();
        g_pol.kl_sm90 = groups[i].kl_sm90;
        g_pol.kl_grad = groups[i].kl_grad;
        g_fallback = !groups[i].kl_sm90;
        failed += _cmocka_run_group_tests(groups[i].name, tests, n_tests, NULL, NULL);
    }
    return failed;
}

#endif /* TKD_HAVE_CUDA */

#endif
