/* test_gpu_kl_loss.c — the CUDA KL loss (kernels/loss/kl_loss_cuda.h) against the float64 reference
 * tkd_kl_ref_f64, run on inputs already rounded to bf16, so the only differences are the GPU's
 * accumulation order, its fp32 logits / log-sum-exps and the bf16 rounding of dS. Labelled gpu:
 * exits 77 (skipped) where no GPU answers or the build has no CUDA backend.
 *
 * Every test runs twice, as two cmocka groups: on the default path (our sm90 logits GEMM with the
 * row work in its epilogue, where the device is compute capability 9.0 and D % 8 == 0: the fused
 * path — statistics, gather and, where the gradient is one softmax, the bf16 gradient tile — else
 * the fp32 logits it writes) and with TKD_KL_SM90=0 (cuBLAS + the row kernel's own statistics
 * pass: the fallback). The tests written before the sm90 path are unchanged, so the variant grid
 * runs the fused path wherever it applies; test_path_engaged says which path each group ran (so a
 * silent fallback cannot pass for the sm90 path), test_deterministic that repeated calls give the
 * same bits, test_paths_agree that the three paths agree and that the fused one is no less
 * accurate, test_extreme_logits that the fused path's slow rows run and are right.
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
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "kernels/loss/kl_loss.h"
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include "kernels/cuda/cuda_mem.h"
#include "kernels/loss/kl_loss_cuda.h"
#include "kernels/loss/kl_loss_cuda_internal.h" /* the row kernels' launch shapes, the sm90 switch */
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

static uint64_t next_u64(gcase *c)
{
    c->rng ^= c->rng << 13;
    c->rng ^= c->rng >> 7;
    c->rng ^= c->rng << 17;
    return c->rng;
}

static int rand_below(gcase *c, int n) { return (int)(next_u64(c) % (uint64_t)n); }

static void round_bf16(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = tkd_bf16_to_f32(tkd_f32_to_bf16(x[i]));
}

/* One row's teacher columns: the k largest of t (V), sorted, and lse at τ_cache. */
static void cut_row(gcase *c, int64_t i, const float *t, double tau_cache)
{
    int32_t *idx = c->idx + i * c->k;
    for (int j = 0; j < c->k; j++) {
        int best = -1;
        for (int u = 0; u < c->v; u++) {
            int taken = 0;
            for (int q = 0; q < j && !taken; q++)
                taken = idx[q] == u;
            if (!taken && (best < 0 || t[u] > t[best]))
                best = u;
        }
        idx[j] = best;
        c->tl[i * c->k + j] = t[best];
    }
    double m = -INFINITY, sum = 0.0;
    for (int u = 0; u < c->v; u++)
        m = fmax(m, t[u] / tau_cache);
    for (int u = 0; u < c->v; u++)
        sum += exp(t[u] / tau_cache - m);
    c->lse[i] = (float)(m + log(sum));
    for (int j = 0; j < c->s; j++) {
        int u, clash;
        do {
            u = rand_below(c, c->v);
            clash = 0;
            for (int q = 0; q < c->k; q++)
                clash |= idx[q] == u;
        } while (clash);
        c->draws[i * c->s + j] = (j == 1) ? c->draws[i * c->s] : u; /* a repeated draw */
    }
}

static gcase *case_make(int64_t n, int d, int v, int k, int s, double tau_cache, uint64_t seed,
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

static void case_free(gcase *c)
{
    free(c->h), free(c->w), free(c->idx), free(c->tl), free(c->lse), free(c->draws);
    free(c->labels), free(c);
}

static tkd_kl_batch case_batch(const gcase *c)
{
    tkd_kl_batch b = {c->n, c->d, c->v, c->h, c->w, c->idx, c->tl, c->lse,
                      c->s > 0 ? c->draws : NULL, c->labels};
    return b;
}

/* ---- one GPU run and its comparison with the reference ---------------------------------------- */

typedef struct errs {
    double loss, dh, dw; /* loss: |Δ| / (1 + |ref|) over loss, kd, ce; grads: relative norms */
} errs;

/* ‖a − ref‖ / ‖ref‖; infinity when a holds a non-finite value (unwritten or NaN). */
static double rel_norm(const float *a, const double *ref, size_t n)
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

static double loss_err(const tkd_kl_result *g, const tkd_kl_result *r)
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

static void ctx_init(gpu_ctx *x, const gcase *c, const tkd_kl_params *p)
{
    tkd_kl_batch hb = case_batch(c);
    tkd_kl_params up = *p; /* upload every stored column and draw, whatever p uses */
    up.k = c->k;
    up.s = c->s;
    assert_int_equal(tkd_kl_cuda_batch_upload(&x->db, &up, &hb), TKD_OK);
    assert_int_equal(tkd_kl_cuda_ws_create(&x->ws, p, &g_pol, c->n, c->d, c->v), TKD_OK);
    size_t nh = (size_t)(c->n * c->d), nw = (size_t)c->v * c->d;
    assert_int_equal(tkd_cuda_malloc((void **)&x->dh, nh * 4, "dH", NULL), TKD_OK);
    assert_int_equal(tkd_cuda_malloc((void **)&x->dw, nw * 4, "dW", NULL), TKD_OK);
    x->h_dh = malloc(nh * 4 + 4);
    x->h_dw = malloc(nw * 4 + 4);
    x->poison = malloc(nh * 4 + 4);
    assert_true(x->h_dh && x->h_dw && x->poison);
    for (size_t i = 0; i < nh; i++)
        x->poison[i] = NAN;
}

static void ctx_free(gpu_ctx *x)
{
    tkd_kl_cuda_ws_free(x->ws);
    tkd_kl_cuda_batch_free(&x->db);
    tkd_cuda_free(x->dh), tkd_cuda_free(x->dw);
    free(x->h_dh), free(x->h_dw), free(x->poison);
}

/* Forward + gradients on the GPU (recompute: forward then backward(scale); grad_in_forward:
 * forward with p->grad_scale = scale). dH is poisoned with NaN first, so an unwritten element
 * fails; dW is zeroed (it accumulates), or poisoned too with p->dw_overwrite (it must be written). */
static void gpu_run(gpu_ctx *x, const gcase *c, const tkd_kl_params *p, float scale,
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

static void ref_run(const gcase *c, const tkd_kl_params *p, refout *r)
{
    tkd_kl_batch hb = case_batch(c);
    r->dh = malloc(sizeof(double) * (size_t)(c->n * c->d) + 8);
    r->dw = malloc(sizeof(double) * (size_t)c->v * c->d + 8);
    assert_true(r->dh && r->dw);
    tkd_status st = tkd_kl_ref_f64(p, &hb, &r->res, r->dh, r->dw);
    if (st != TKD_OK)
        fail_msg("reference: %s", tkd_error_msg());
}

static void ref_free(refout *r) { free(r->dh), free(r->dw); }

static errs compare(const gpu_ctx *x, const gcase *c, const tkd_kl_result *g, const refout *r,
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

static void params_set(tkd_kl_params *p, int k, tkd_kl_variant var, float tau, float alpha,
                       int k_use, int s, int chunk, int gif)
{
    *p = tkd_test_kl_params(var, tau, alpha, k, k_use, var == TKD_KL_VARIANT_SAMPLED ? s : 0);
    p->chunk_rows = chunk;
    p->grad_in_forward = gif;
}

/* Runs both modes of one parameter set against the reference; returns the worst errors. */
static errs check_params(gpu_ctx *x, const gcase *c, const tkd_kl_params *p0, float scale)
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

static void expect_within(errs e, double loss_tol, double grad_tol, const char *what)
{
    if (!(e.loss <= loss_tol && e.dh <= grad_tol && e.dw <= grad_tol))
        fail_msg("%s: loss err %.3g (tol %.1g), dH %.3g, dW %.3g (tol %.1g)", what, e.loss,
                 loss_tol, e.dh, e.dw, grad_tol);
}

/* ---- tests ------------------------------------------------------------------------------------ */

/* Every variant × τ × alpha × k' (× S for sampled), both modes, N = 37 rows in chunks of 16 (the
 * last one short), V = 1003 (not a multiple of 8), masked rows, a repeated tail draw. */
static void test_variant_grid(void **state)
{
    (void)state;
    const int n = 37, d = 40, v = 1003, k = 8, s = 6;
    const float taus[] = {1.0f, 2.5f}, alphas[] = {1.0f, 0.5f, 0.0f};
    const int kus[] = {k, 3, 1}, ss[] = {0, s};
    for (int ti = 0; ti < 2; ti++) {
        gcase *c = case_make(n, d, v, k, s, taus[ti], 11 + ti, 0.35f);
        tkd_kl_params p;
        params_set(&p, k, TKD_KL_VARIANT_RENORM, taus[ti], 1.0f, k, s, 16, 0);
        gpu_ctx x = {0};
        ctx_init(&x, c, &p);
        for (int var = 0; var < 3; var++) {
            errs worst = {0, 0, 0};
            for (int ai = 0; ai < 3; ai++)
                for (int ki = 0; ki < 3; ki++)
                    for (int si = 0; si < (var == TKD_KL_VARIANT_SAMPLED ? 2 : 1); si++) {
                        params_set(&p, k, (tkd_kl_variant)var, taus[ti], alphas[ai], kus[ki],
                                   ss[si], 16, 0);
                        errs e = check_params(&x, c, &p, 1.0f);
                        char what[160];
                        snprintf(what, sizeof what, "%s tau %g alpha %g k' %d S %d",
                                 tkd_kl_variant_name((tkd_kl_variant)var), taus[ti], alphas[ai],
                                 kus[ki], p.s);
                        expect_within(e, LOSS_TOL, GRAD_TOL, what);
                        worst.loss = fmax(worst.loss, e.loss);
                        worst.dh = fmax(worst.dh, e.dh);
                        worst.dw = fmax(worst.dw, e.dw);
                    }
            printf("grid tau %.1f %-7s worst: loss %.2e  dH %.2e  dW %.2e\n", taus[ti],
                   tkd_kl_variant_name((tkd_kl_variant)var), worst.loss, worst.dh, worst.dw);
        }
        ctx_free(&x);
        case_free(c);
    }
}

/* One row; k = 1; V = 5 (< one float4 pair); N not a multiple of the chunk; V > one in-place tile
 * (4096) so several tiles and a ragged last tile; automatic chunk. Sampled, which has every term. */
static void test_awkward_shapes(void **state)
{
    (void)state;
    const struct { int n, d, v, k, s, chunk; } sh[] = {
        {1, 8, 5, 1, 2, 0}, {130, 24, 4099, 1, 3, 128}, {65, 32, 20011, 16, 8, 0},
        {50, 16, 9000, 4, 4, 7},
    };
    for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) {
        gcase *c = case_make(sh[i].n, sh[i].d, sh[i].v, sh[i].k, sh[i].s, 1.5, 31 + i, 0.4f);
        for (int var = 0; var < 3; var++) {
            tkd_kl_params p;
            params_set(&p, sh[i].k, (tkd_kl_variant)var, 1.5f, 0.7f, sh[i].k, sh[i].s,
                       sh[i].chunk, 0);
            gpu_ctx x = {0};
            ctx_init(&x, c, &p);
            errs e = check_params(&x, c, &p, 1.0f);
            char what[160];
            snprintf(what, sizeof what, "N %d D %d V %d k %d chunk %d(%d) %s", sh[i].n, sh[i].d,
                     sh[i].v, sh[i].k, sh[i].chunk, tkd_kl_cuda_ws_chunk_rows(x.ws),
                     tkd_kl_variant_name((tkd_kl_variant)var));
            printf("%s: loss %.2e dH %.2e dW %.2e\n", what, e.loss, e.dh, e.dw);
            expect_within(e, LOSS_TOL, GRAD_TOL, what);
            ctx_free(&x);
        }
        case_free(c);
    }
}

/* Every row-kernel launch shape the benchmark may sweep (tkd_kl_cuda_ws_set_rows) gives the same
 * answers: the in-place tiles depend on the block size. The product's shape is one of them. */
static void test_row_block_sizes(void **state)
{
    (void)state;
    gcase *c = case_make(21, 16, 9001, 4, 4, 1.0, 51, 0.4f);
    const int threads[] = {128, 256, 512, 128, 256}, vecs[] = {4, 4, 4, 8, 8};
    for (int i = 0; i < 5; i++) {
        for (int var = 0; var < 3; var++) {
            tkd_kl_params p;
            params_set(&p, 4, (tkd_kl_variant)var, 1.0f, 0.5f, 4, 4, 8, 0);
            gpu_ctx x = {0};
            ctx_init(&x, c, &p);
            assert_int_equal(x.ws->row_threads, TKD_KL_CUDA_ROW_THREADS); /* fresh: the product's */
            assert_int_equal(x.ws->row_vec, TKD_KL_CUDA_ROW_VEC);
            assert_int_equal(tkd_kl_cuda_ws_set_rows(x.ws, threads[i], vecs[i]), TKD_OK);
            errs e = check_params(&x, c, &p, 1.0f);
            printf("row threads %d vec %d %s: loss %.2e dH %.2e dW %.2e\n", threads[i], vecs[i],
                   tkd_kl_variant_name((tkd_kl_variant)var), e.loss, e.dh, e.dw);
            expect_within(e, LOSS_TOL, GRAD_TOL, "row block size");
            if (i == 4 && var == 2) { /* the shapes the kernels are not built for are refused */
                assert_int_equal(tkd_kl_cuda_ws_set_rows(x.ws, 512, 8), TKD_ERR_INVALID_ARG);
                assert_int_equal(tkd_kl_cuda_ws_set_rows(x.ws, 1024, 4), TKD_ERR_INVALID_ARG);
                assert_int_equal(x.ws->row_threads, 256); /* a refused shape changes nothing */
                assert_int_equal(tkd_kl_cuda_ws_set_rows(x.ws, 0, 0), TKD_OK);
                assert_int_equal(x.ws->row_threads, TKD_KL_CUDA_ROW_THREADS);
                assert_int_equal(x.ws->row_vec, TKD_KL_CUDA_ROW_VEC);
            }
            ctx_free(&x);
        }
    }
    case_free(c);
}

/* Student logits of size ~1e4: no NaN, the loss and gradients still match. */
static void test_extreme_logits(void **state)
{
    (void)state;
    gcase *c = case_make(23, 16, 777, 5, 4, 1.0, 77, 28.0f); /* |s| ~ 28² · 4 · 3 ≈ 1e4 */
    for (int var = 0; var < 3; var++) {
        tkd_kl_params p;
        params_set(&p, 5, (tkd_kl_variant)var, 1.0f, 0.5f, 5, 4, 8, 0);
        gpu_ctx x = {0};
        ctx_init(&x, c, &p);
        errs e = check_params(&x, c, &p, 1.0f);
        printf("extreme %s: loss %.2e dH %.2e dW %.2e (rows made again on the fused path: %llu)\n",
               tkd_kl_variant_name((tkd_kl_variant)var), e.loss, e.dh, e.dw, x.ws->slow_rows);
        /* |s| ~ 1e4: the logit at a row's first special column is far below its max, so the
         * fused path must take its slow path (and be right) */
        if (tkd_kl_cuda_fused_grad_on(x.ws, &p) && x.ws->slow_rows == 0)
            fail_msg("extreme logits on the fused path: no row took the slow path");
        expect_within(e, EXTREME_LOSS_TOL, EXTREME_GRAD_TOL, "extreme logits");
        ctx_free(&x);
    }
    case_free(c);
}

/* tail with 1 − Q far below any epsilon: every kept row's top-k' holds the student's argmax and
 * the logits are ~1e4 apart, so 1 − Q ~ e^-100 or less. log(1 − Q) must be exact (docs/loss.md:
 * the tail's own log-sum-exp, never 1 − Σ q), as in the reference. */
static void test_tail_tiny_one_minus_q(void **state)
{
    (void)state;
    gcase *c = case_make(17, 16, 500, 6, 0, 1.0, 83, 28.0f);
    for (int64_t i = 0; i < c->n; i++) {
        int best = 0;
        double sbest = -INFINITY;
        for (int j = 0; j < c->v; j++) {
            double acc = 0.0;
            for (int q = 0; q < c->d; q++)
                acc += (double)c->h[i * c->d + q] * c->w[(size_t)j * c->d + q];
            if (acc > sbest)
                sbest = acc, best = j;
        }
        int present = 0;
        for (int j = 0; j < c->k; j++)
            present |= c->idx[i * c->k + j] == best;
        if (!present)
            c->idx[i * c->k + c->k - 1] = best;
    }
    tkd_kl_params p;
    params_set(&p, 6, TKD_KL_VARIANT_TAIL, 1.0f, 0.7f, 6, 0, 5, 0);
    gpu_ctx x = {0};
    ctx_init(&x, c, &p);
    errs e = check_params(&x, c, &p, 1.0f);
    printf("tail, 1 - Q tiny: loss %.2e dH %.2e dW %.2e\n", e.loss, e.dh, e.dw);
    expect_within(e, EXTREME_LOSS_TOL, EXTREME_GRAD_TOL, "tail with tiny 1 - Q");
    ctx_free(&x);
    case_free(c);
}

/* backward's scale multiplies the gradients; dW accumulates across calls; dH is overwritten. */
static void test_scale_and_accumulate(void **state)
{
    (void)state;
    gcase *c = case_make(29, 24, 513, 6, 0, 1.0, 5, 0.4f);
    tkd_kl_params p;
    params_set(&p, 6, TKD_KL_VARIANT_TAIL, 1.0f, 0.8f, 6, 0, 8, 0);
    gpu_ctx x = {0};
    ctx_init(&x, c, &p);
    errs e = check_params(&x, c, &p, 0.25f);
    expect_within(e, LOSS_TOL, GRAD_TOL, "scale 0.25");
    /* a second backward without zeroing dW: dW doubles, dH stays */
    tkd_kl_result g;
    assert_int_equal(tkd_kl_cuda_forward(x.ws, &p, &x.db, &g, NULL, NULL), TKD_OK);
    assert_int_equal(tkd_kl_cuda_backward(x.ws, &p, &x.db, 0.25f, x.dh, x.dw), TKD_OK);
    refout r;
    ref_run(c, &p, &r);
    size_t nw = (size_t)c->v * c->d;
    assert_int_equal(tkd_cuda_to_host(x.h_dw, x.dw, nw * 4), TKD_OK);
    double *twice = malloc(sizeof(double) * nw);
    assert_non_null(twice);
    for (size_t i = 0; i < nw; i++)
        twice[i] = 0.5 * r.dw[i];
    double edw = rel_norm(x.h_dw, twice, nw);
    printf("dW accumulated over two backward calls: rel err %.2e\n", edw);
    assert_true(edw <= GRAD_TOL);
    /* grad_in_forward: backward is a no-op that insists on forward's grad_scale */
    p.grad_in_forward = 1;
    p.grad_scale = 0.25f;
    assert_int_equal(tkd_kl_cuda_backward(x.ws, &p, &x.db, 0.25f, x.dh, x.dw), TKD_OK);
    assert_int_equal(tkd_kl_cuda_backward(x.ws, &p, &x.db, 1.0f, x.dh, x.dw), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_to_host(x.h_dw, x.dw, nw * 4), TKD_OK);
    assert_true(rel_norm(x.h_dw, twice, nw) == edw); /* untouched */
    free(twice);
    ref_free(&r);
    ctx_free(&x);
    case_free(c);
}

/* Every row masked: the loss is 0 over 0 kept rows and the gradients are exactly 0. */
static void test_all_masked(void **state)
{
    (void)state;
    gcase *c = case_make(9, 8, 100, 3, 0, 1.0, 3, 0.5f);
    for (int i = 0; i < 9; i++)
        c->labels[i] = -100;
    tkd_kl_params p;
    params_set(&p, 3, TKD_KL_VARIANT_RENORM, 1.0f, 0.5f, 3, 0, 4, 0);
    gpu_ctx x = {0};
    ctx_init(&x, c, &p);
    tkd_kl_result g;
    gpu_run(&x, c, &p, 1.0f, &g);
    assert_int_equal(g.n_kept, 0);
    assert_true(g.loss == 0.0);
    for (int i = 0; i < 9 * 8; i++)
        assert_true(x.h_dh[i] == 0.0f);
    for (int i = 0; i < 100 * 8; i++)
        assert_true(x.h_dw[i] == 0.0f);
    ctx_free(&x);
    case_free(c);
}

/* A duplicate teacher index or an index ≥ V is an error naming the row, not garbage. */
static void test_bad_teacher_data(void **state)
{
    (void)state;
    gcase *c = case_make(12, 8, 200, 4, 0, 1.0, 9, 0.5f);
    tkd_kl_params p;
    params_set(&p, 4, TKD_KL_VARIANT_RENORM, 1.0f, 1.0f, 4, 0, 5, 0);
    c->idx[6 * 4 + 2] = c->idx[6 * 4 + 0]; /* row 6: a duplicate */
    c->idx[9 * 4 + 1] = 200;               /* row 9: out of range */
    c->labels[6] = 1, c->labels[9] = 2;    /* both kept */
    gpu_ctx x = {0};
    ctx_init(&x, c, &p);
    tkd_kl_result g;
    assert_int_equal(tkd_kl_cuda_forward(x.ws, &p, &x.db, &g, NULL, NULL), TKD_ERR_FORMAT);
    printf("bad teacher data: %s\n", tkd_error_msg());
    assert_non_null(strstr(tkd_error_msg(), "row 6"));
    ctx_free(&x);
    case_free(c);
    /* sampled: a tail draw that repeats one of the row's top-k' tokens */
    c = case_make(12, 8, 200, 4, 3, 1.0, 10, 0.5f);
    params_set(&p, 4, TKD_KL_VARIANT_SAMPLED, 1.0f, 1.0f, 4, 3, 5, 0);
    c->draws[4 * 3 + 2] = c->idx[4 * 4 + 1];
    c->labels[4] = 7;
    gpu_ctx y = {0};
    ctx_init(&y, c, &p);
    assert_int_equal(tkd_kl_cuda_forward(y.ws, &p, &y.db, &g, NULL, NULL), TKD_ERR_FORMAT);
    printf("bad tail draw: %s\n", tkd_error_msg());
    assert_non_null(strstr(tkd_error_msg(), "row 4"));
    assert_non_null(strstr(tkd_error_msg(), "tail draw"));
    ctx_free(&y);
    case_free(c);
}

/* The CUDA path against the chunked CPU path (tkd_kl_cpu_*) on the same bf16-representable inputs,
 * both modes, every variant, different chunkings on the two sides. */
static void test_against_cpu_path(void **state)
{
    (void)state;
    gcase *c = case_make(45, 32, 2051, 7, 5, 2.0, 41, 0.4f);
    size_t nh = (size_t)(c->n * c->d), nw = (size_t)c->v * c->d;
    float *cdh = malloc(nh * 4), *cdw = malloc(nw * 4);
    double *rdh = malloc(nh * 8), *rdw = malloc(nw * 8);
    assert_true(cdh && cdw && rdh && rdw);
    tkd_kl_batch hb = case_batch(c);
    for (int var = 0; var < 3; var++)
        for (int gif = 0; gif < 2; gif++) {
            tkd_kl_params p;
            params_set(&p, 7, (tkd_kl_variant)var, 2.0f, 0.6f, 6, 5, 0, gif);
            p.chunk_rows = 10;
            tkd_kl_cpu_ws *cws = NULL;
            assert_int_equal(tkd_kl_cpu_ws_create(&cws, &p, c->n, c->d, c->v), TKD_OK);
            tkd_kl_result cr;
            memset(cdw, 0, nw * 4);
            assert_int_equal(tkd_kl_cpu_forward(cws, &p, &hb, &cr, cdh, cdw), TKD_OK);
            if (!gif)
                assert_int_equal(tkd_kl_cpu_backward(cws, &p, &hb, 1.0f, cdh, cdw), TKD_OK);
            tkd_kl_cpu_ws_free(cws);
            p.chunk_rows = 16;
            gpu_ctx x = {0};
            ctx_init(&x, c, &p);
            tkd_kl_result g;
            gpu_run(&x, c, &p, 1.0f, &g);
            for (size_t i = 0; i < nh; i++)
                rdh[i] = cdh[i];
            for (size_t i = 0; i < nw; i++)
                rdw[i] = cdw[i];
            refout r = {cr, rdh, rdw};
            errs e = compare(&x, c, &g, &r, 1.0);
            printf("cuda vs cpu %s %s: loss %.2e dH %.2e dW %.2e\n",
                   tkd_kl_variant_name((tkd_kl_variant)var), gif ? "grad_in_forward" : "recompute",
                   e.loss, e.dh, e.dw);
            expect_within(e, LOSS_TOL, GRAD_TOL, "cuda vs cpu");
            ctx_free(&x);
        }
    free(cdh), free(cdw), free(rdh), free(rdw);
    case_free(c);
}

/* The path the group meant is the path the workspace takes: the sm90 GEMM on compute capability
 * 9.0 unless the policy's kl_sm90 is off, never for D % 8 != 0 or for `tail`. */
static void test_path_engaged(void **state)
{
    (void)state;
    const int sm90 = tkd_lmhead_sm90_supported() == TKD_OK;
    tkd_error_clear();
    tkd_kl_params p;
    params_set(&p, 4, TKD_KL_VARIANT_RENORM, 1.0f, 1.0f, 4, 0, 8, 0);
    tkd_kl_cuda_ws *ws = NULL;
    assert_int_equal(tkd_kl_cuda_ws_create(&ws, &p, &g_pol, 21, 40, 1003), TKD_OK);
    printf("path: %s (device %s compute capability 9.0, TKD_KL_SM90=%s)\n",
           ws->lm ? "sm90 logits GEMM + fused statistics" : "cuBLAS + row-kernel statistics",
           sm90 ? "is" : "is not", g_fallback ? "off" : "on");
    if (sm90 && !g_fallback && !ws->lm)
        fail_msg("the workspace did not take the sm90 path on an sm_90 device");
    if (g_fallback && ws->lm)
        fail_msg("kl_sm90 off did not force the cuBLAS fallback");
    assert_int_equal(tkd_kl_cuda_sm90_on(ws, &p), ws->lm != NULL);
    /* the fused path (the gradient tile from the epilogue): one softmax in the dense gradient */
    assert_int_equal(tkd_kl_cuda_fused_grad_on(ws, &p), ws->lm != NULL);
    printf("fused path (gather + bf16 gradient tile in the epilogue): %s\n",
           tkd_kl_cuda_fused_grad_on(ws, &p) ? "on" : "off");
    p.temperature = 2.0f, p.alpha = 0.5f; /* two softmaxes: the fp32 logits make the gradient */
    assert_int_equal(tkd_kl_cuda_fused_grad_on(ws, &p), 0);
    assert_int_equal(tkd_kl_cuda_fused_on(ws, &p), ws->lm != NULL); /* forward statistics: fused */
    p.alpha = 0.0f;
    assert_int_equal(tkd_kl_cuda_fused_grad_on(ws, &p), ws->lm != NULL);
    p.k_use = 5; /* more slots than the workspace was made for: not fused */
    assert_int_equal(tkd_kl_cuda_fused_on(ws, &p), 0);
    p.k_use = 4, p.temperature = 1.0f;
    p.variant = TKD_KL_VARIANT_TAIL;
    assert_int_equal(tkd_kl_cuda_sm90_on(ws, &p), 0); /* tail: the row kernel's own pass */
    assert_int_equal(tkd_kl_cuda_fused_on(ws, &p), 0);
    if (ws->lm) { /* the LSE flag is refused where it cannot be right */
        assert_int_equal(tkd_kl_cuda_chunk_rows(ws, &p, NULL, (tkd_kl_cuda_rows_mode)
                                                (TKD_KL_CUDA_ROWS_STATS | TKD_KL_CUDA_ROWS_LSE_GIVEN),
                                                0, 1, 1.0f), TKD_ERR_INVALID_ARG);
    }
    tkd_kl_cuda_ws_free(ws);
    assert_int_equal(tkd_kl_cuda_ws_create(&ws, &p, &g_pol, 21, 36, 1003), TKD_OK); /* D % 8 != 0 */
    assert_null(ws->lm);
    tkd_kl_cuda_ws_free(ws);
}

/* Host copies of one run's outputs. */
typedef struct run_out {
    tkd_kl_result res;
    float *dh, *dw;
} run_out;

static run_out run_copy(gpu_ctx *x, const gcase *c, const tkd_kl_params *p)
{
    size_t nh = (size_t)(c->n * c->d), nw = (size_t)c->v * c->d;
    run_out o;
    gpu_run(x, c, p, 1.0f, &o.res);
    o.dh = malloc(nh * 4 + 4), o.dw = malloc(nw * 4 + 4);
    assert_true(o.dh && o.dw);
    memcpy(o.dh, x->h_dh, nh * 4), memcpy(o.dw, x->h_dw, nw * 4);
    return o;
}

/* A case with several chunks, many GEMM tiles and several CTAs (N 300 in chunks of 128, V 5000). */
static gcase *big_case(void) { return case_make(300, 256, 5000, 8, 4, 1.5, 61, 0.15f); }

/* Two runs of the same call give the same loss, dH and dW, bit for bit (renorm, sampled and tail,
 * both modes): no atomics in the order of any sum. */
static void test_deterministic(void **state)
{
    (void)state;
    gcase *c = big_case();
    size_t nh = (size_t)(c->n * c->d), nw = (size_t)c->v * c->d;
    for (int var = 0; var < 3; var++)
        for (int gif = 0; gif < 2; gif++) {
            tkd_kl_params p;
            params_set(&p, 8, (tkd_kl_variant)var, 1.5f, 0.6f, 8, 4, 128, gif);
            gpu_ctx x = {0};
            ctx_init(&x, c, &p);
            run_out a = run_copy(&x, c, &p), b = run_copy(&x, c, &p);
            const char *what = tkd_kl_variant_name((tkd_kl_variant)var);
            if (memcmp(&a.res.loss, &b.res.loss, sizeof(double)) != 0)
                fail_msg("%s %s: loss %.17g then %.17g", what, gif ? "gif" : "recompute", a.res.loss, b.res.loss);
            for (size_t i = 0; i < nh; i++)
                if (memcmp(&a.dh[i], &b.dh[i], 4) != 0)
                    fail_msg("%s %s: dH[%zu] %.9g then %.9g", what, gif ? "gif" : "recompute", i, a.dh[i], b.dh[i]);
            for (size_t i = 0; i < nw; i++)
                if (memcmp(&a.dw[i], &b.dw[i], 4) != 0)
                    fail_msg("%s %s: dW[%zu] %.9g then %.9g", what, gif ? "gif" : "recompute", i, a.dw[i], b.dw[i]);
            free(a.dh), free(a.dw), free(b.dh), free(b.dw);
            ctx_free(&x);
        }
    case_free(c);
}

/* Relative differences of two runs: loss, and dH, dW in norm. */
static errs run_diff(const run_out *a, const run_out *b, const gcase *c)
{
    size_t nh = (size_t)(c->n * c->d), nw = (size_t)c->v * c->d;
    double num = 0, den = 0;
    errs e;
    e.loss = fabs(a->res.loss - b->res.loss) / (1.0 + fabs(b->res.loss));
    for (size_t i = 0; i < nh; i++)
        num += (a->dh[i] - b->dh[i]) * (double)(a->dh[i] - b->dh[i]), den += b->dh[i] * (double)b->dh[i];
    e.dh = sqrt(num / fmax(den, 1e-300));
    num = den = 0;
    for (size_t i = 0; i < nw; i++)
        num += (a->dw[i] - b->dw[i]) * (double)(a->dw[i] - b->dw[i]), den += b->dw[i] * (double)b->dw[i];
    e.dw = sqrt(num / fmax(den, 1e-300));
    return e;
}

/* The product's path (fused where it applies), the sm90 fp32-logits path (fused off) and the
 * cuBLAS fallback on one workspace, both modes, renorm and sampled, τ 1 and 2.5: the loss within
 * PATHS_LOSS_TOL, dH and dW within PATHS_GRAD_TOL of each other; the fused path takes no slow row
 * on ordinary logits. Where the workspace has no sm90 GEMM (fallback group, other devices) it
 * checks the refusals. */
static void test_paths_agree(void **state)
{
    (void)state;
    /* sampled reads the cache's probabilities at the loss's τ, so each τ gets a cache made at it */
    gcase *cases[2] = {case_make(300, 256, 5000, 8, 4, 1.0, 61, 0.15f), case_make(300, 256, 5000, 8, 4, 2.5, 61, 0.15f)};
    for (int var = 0; var < 3; var += 2)
        for (int ti = 0; ti < 2; ti++)
            for (int gif = 0; gif < 2; gif++) {
                gcase *c = cases[ti];
                tkd_kl_params p;
                params_set(&p, 8, (tkd_kl_variant)var, ti ? 2.5f : 1.0f, ti ? 0.6f : 0.5f, 8, 4, 128, gif);
                gpu_ctx x = {0};
                ctx_init(&x, c, &p);
                if (!x.ws->lm) {
                    assert_int_equal(tkd_kl_cuda_ws_set_sm90(x.ws, 1), TKD_ERR_UNSUPPORTED);
                    assert_int_equal(tkd_kl_cuda_ws_set_fused(x.ws, 1), TKD_ERR_UNSUPPORTED);
                    printf("paths agree: no sm90 GEMM in this group, nothing to compare\n");
                    ctx_free(&x);
                    case_free(cases[0]);
                    case_free(cases[1]);
                    return;
                }
                const int fused = tkd_kl_cuda_fused_grad_on(x.ws, &p);
                refout r;
                ref_run(c, &p, &r);
                run_out a = run_copy(&x, c, &p);
                const errs ea = compare(&x, c, &a.res, &r, 1.0);
                if (fused && x.ws->slow_rows != 0)
                    fail_msg("fused path: %llu rows took the slow path on ordinary logits",
                             x.ws->slow_rows);
                assert_int_equal(tkd_kl_cuda_ws_set_fused(x.ws, 0), TKD_OK);
                run_out f = run_copy(&x, c, &p);
                const errs ef = compare(&x, c, &f.res, &r, 1.0);
                assert_int_equal(tkd_kl_cuda_ws_set_sm90(x.ws, 0), TKD_OK);
                run_out b = run_copy(&x, c, &p);
                const errs ab = run_diff(&a, &b, c), af = run_diff(&a, &f, c);
                printf("%s %s tau %g %s: vs float64 dH %.2e dW %.2e (sm90 fp32: %.2e %.2e); vs "
                       "cuBLAS: loss %.2e dH %.2e dW %.2e; vs sm90 fp32: loss %.2e dH %.2e dW %.2e\n",
                       fused ? "fused" : "sm90", tkd_kl_variant_name((tkd_kl_variant)var),
                       p.temperature, gif ? "grad_in_forward" : "recompute", ea.dh, ea.dw, ef.dh,
                       ef.dw, ab.loss, ab.dh, ab.dw, af.loss, af.dh, af.dw);
                /* The fused path rounds E = exp(k·s − ref) to bf16 where the others round dS: its
                 * roundings are independent of theirs, so it is judged by its distance to float64
                 * (no worse than the fp32-logits path's, within a quarter) and against the other
                 * paths with twice the tolerance (two independent bf16 roundings apart). */
                const double gt = fused ? 2 * PATHS_GRAD_TOL : PATHS_GRAD_TOL;
                expect_within(ab, PATHS_LOSS_TOL, gt, "product path vs cuBLAS");
                expect_within(af, PATHS_LOSS_TOL, gt, "product path vs sm90 fp32");
                if (!(ea.dh <= 1.25 * ef.dh + 1e-5 && ea.dw <= 1.25 * ef.dw + 1e-5))
                    fail_msg("product path less accurate than the sm90 fp32 path: dH %.3g vs %.3g, "
                             "dW %.3g vs %.3g", ea.dh, ef.dh, ea.dw, ef.dw);
                ref_free(&r);
                free(a.dh), free(a.dw), free(b.dh), free(b.dw), free(f.dh), free(f.dw);
                ctx_free(&x);
            }
    case_free(cases[0]);
    case_free(cases[1]);
}

/* A workspace the device cannot hold is TKD_ERR_DEVICE_OOM, not an abort. */
static void test_device_oom(void **state)
{
    (void)state;
    tkd_kl_params p;
    params_set(&p, 4, TKD_KL_VARIANT_RENORM, 1.0f, 1.0f, 4, 0, 1 << 20, 0);
    tkd_kl_cuda_ws *ws = NULL;
    tkd_status st = tkd_kl_cuda_ws_create(&ws, &p, &g_pol, (int64_t)1 << 22, 64, 1 << 20); /* 4 TiB chunk */
    assert_int_equal(st, TKD_ERR_DEVICE_OOM);
    assert_null(ws);
    printf("oom: %s\n", tkd_error_msg());
}

/* The fused path's chunk rows where our dH runs: whole dH waves, never above chunk_e. */
static void test_dh_chunk_rows(void **state)
{
    (void)state;
    /* 8192 rows, D 2048 (8 tiles wide), 132 SMs: 3 x 2816 rows are 2 waves each, 4 x 2048 one */
    assert_int_equal(tkd_kl_cuda_dh_chunk_rows(8192, 2816, 3, 2048, 132), 2048);
    /* 4096 rows at D 4096: one chunk (4 waves) beats two (2 x 2 waves + a chunk's cost) */
    assert_int_equal(tkd_kl_cuda_dh_chunk_rows(4096, 4096, 1, 4096, 132), 4096);
    assert_int_equal(tkd_kl_cuda_dh_chunk_rows(100, 4096, 1, 4096, 132), 128);
    assert_int_equal(tkd_kl_cuda_dh_chunk_rows(100, 64, 2, 4096, 132), 64); /* below 128 rows */
    for (int64_t n = 1; n < 40000; n += 997)
        for (int ce = 64; ce <= 8192; ce *= 2) {
            const int64_t c0 = (n + ce - 1) / ce;
            const int r = tkd_kl_cuda_dh_chunk_rows(n, ce, c0, 2880, 132);
            assert_true(r >= 1 && r <= ce);
        }
}

/* The policy's gradient-GEMM choice is the one the workspace takes (on an sm_90 device with our
 * logits GEMM; elsewhere both gradients stay on cuBLAS): D 256 is a multiple of 256, so auto puts dH
 * on ours; D 264 is not, so auto leaves it on cuBLAS. */
static void test_grad_paths(void **state)
{
    (void)state;
    tkd_kl_params p;
    params_set(&p, 4, TKD_KL_VARIANT_RENORM, 1.0f, 1.0f, 4, 0, 0, 0);
    static const struct {
        int choice, d, want;
    } cases[] = {
        {TKD_POLICY_KL_GRAD_AUTO, 256, TKD_KL_GRAD_DH}, {TKD_POLICY_KL_GRAD_AUTO, 264, 0},
        {TKD_POLICY_KL_GRAD_CUBLAS, 256, 0},           {TKD_POLICY_KL_GRAD_DH, 264, TKD_KL_GRAD_DH},
        {TKD_POLICY_KL_GRAD_DW, 256, TKD_KL_GRAD_DW},  {TKD_POLICY_KL_GRAD_BOTH, 256, TKD_KL_GRAD_DH | TKD_KL_GRAD_DW},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tkd_cuda_policy pol = g_pol;
        pol.kl_grad = cases[i].choice;
        tkd_kl_cuda_ws *ws = NULL;
        assert_int_equal(tkd_kl_cuda_ws_create(&ws, &p, &pol, 64, cases[i].d, 1000), TKD_OK);
        const int want = ws->lm ? cases[i].want : 0;
        if (ws->grad_sm90 != want)
            fail_msg("kl_grad %d at D %d: the workspace took %d, want %d", cases[i].choice, cases[i].d,
                     ws->grad_sm90, want);
        tkd_kl_cuda_ws_free(ws);
    }
}

int main(void)
{
    tkd_test_require_gpu();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_path_engaged),
        cmocka_unit_test(test_variant_grid),     cmocka_unit_test(test_awkward_shapes),
        cmocka_unit_test(test_row_block_sizes),  cmocka_unit_test(test_extreme_logits),
        cmocka_unit_test(test_tail_tiny_one_minus_q),   cmocka_unit_test(test_scale_and_accumulate),
        cmocka_unit_test(test_all_masked),       cmocka_unit_test(test_bad_teacher_data),
        cmocka_unit_test(test_against_cpu_path), cmocka_unit_test(test_device_oom),
        cmocka_unit_test(test_deterministic),    cmocka_unit_test(test_paths_agree),
        cmocka_unit_test(test_dh_chunk_rows),    cmocka_unit_test(test_grad_paths),
    };
    /* The policy is handed to each workspace: the default, our logits GEMM off (cuBLAS and the row
     * kernel's statistics), and the gradient GEMMs both on cuBLAS and both ours. */
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
        failed += cmocka_run_group_tests_name(groups[i].name, tests, NULL, NULL);
    }
    return failed;
}

#else /* no CUDA backend in this build */

int main(void)
{
    printf("skipped: built without the CUDA backend\n");
    return 77;
}

#endif
