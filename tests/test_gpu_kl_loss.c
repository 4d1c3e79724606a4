/* test_gpu_kl_loss.c — the CUDA KL loss (kernels/loss/kl_loss_cuda.h) against the float64 reference
 * tkd_kl_ref_f64 (the fixture and the tolerances, with their reasons, in kl_testutil.h). Labelled gpu:
 * exits 77 (skipped) where no GPU answers or the build has no CUDA backend.
 *
 * Every test runs once per CUDA policy group (kl_testutil.h): on the default path (our sm90 logits
 * GEMM with the row work in its epilogue, where the device is compute capability 9.0 and D % 8 == 0:
 * the fused path — statistics, gather and, where the gradient is one softmax, the bf16 gradient
 * tile — else the fp32 logits it writes), with TKD_KL_SM90=0 (cuBLAS + the row kernel's own
 * statistics pass: the fallback) and with the gradient GEMMs' other choices. The tests written before
 * the sm90 path are unchanged, so the variant grid runs the fused path wherever it applies;
 * test_extreme_logits checks that the fused path's slow rows run and are right;
 * test_divergence_grid and test_against_cpu_path run every kd.divergence. Which path each
 * group ran, determinism and the paths' agreement are test_gpu_kl_loss_paths.c's.
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
#include "tests/kl_testutil.h"
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA

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

/* Student logits of size ~1e4: no NaN, the loss and gradients still match; forward KL and the
 * symmetric JSD (whose renorm rows at α = 1 would also rescale E: here α = 0.5). */
static void test_extreme_logits(void **state)
{
    (void)state;
    gcase *c = case_make(23, 16, 777, 5, 4, 1.0, 77, 28.0f); /* |s| ~ 28² · 4 · 3 ≈ 1e4 */
    for (int run = 0; run < 6; run++) {
        const int var = run % 3;
        tkd_kl_params p;
        params_set(&p, 5, (tkd_kl_variant)var, 1.0f, 0.5f, 5, 4, 8, 0);
        p.divergence = run < 3 ? TKD_KL_DIVERGENCE_FKL : TKD_KL_DIVERGENCE_JSD;
        gpu_ctx x = {0};
        ctx_init(&x, c, &p);
        errs e = check_params(&x, c, &p, 1.0f);
        printf("extreme %s %s: loss %.2e dH %.2e dW %.2e (rows made again on the fused path: %llu)\n",
               tkd_kl_divergence_name(p.divergence), tkd_kl_variant_name((tkd_kl_variant)var), e.loss, e.dh,
               e.dw, x.ws->slow_rows);
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

/* ---- kd.divergence (docs/loss.md, "Divergences") -------------------------------------------- */

/* The divergences the tests run, each with its parameters: every kd.divergence but fkl (the tests
 * above), jsd also at its endpoints (β = 0 and 1 are forward and reverse KL over the buckets: not
 * fkl's renorm) and the skews at a second α. */
typedef struct div_case {
    tkd_kl_divergence div;
    float beta, skew;
} div_case;

static const div_case kDivs[] = {
    {TKD_KL_DIVERGENCE_RKL, 0.5f, 0.1f},  {TKD_KL_DIVERGENCE_JSD, 0.5f, 0.1f},
    {TKD_KL_DIVERGENCE_JSD, 0.0f, 0.1f},  {TKD_KL_DIVERGENCE_JSD, 1.0f, 0.1f},
    {TKD_KL_DIVERGENCE_SKL, 0.5f, 0.1f},  {TKD_KL_DIVERGENCE_SKL, 0.5f, 0.6f},
    {TKD_KL_DIVERGENCE_SRKL, 0.5f, 0.1f}, {TKD_KL_DIVERGENCE_SRKL, 0.5f, 0.6f},
    {TKD_KL_DIVERGENCE_TVD, 0.5f, 0.1f},
};
#define N_DIVS (int)(sizeof kDivs / sizeof kDivs[0])

static void div_set(tkd_kl_params *p, const div_case *dc)
{
    p->divergence = dc->div;
    p->jsd_beta = dc->beta;
    p->skew_alpha = dc->skew;
}

/* Reverse KL with sampled (rkl, jsd at β = 1) is not defined (the undrawn tail has target 0): the
 * CUDA path refuses it with the library's message naming both keys, as the CPU does. */
static int div_refused(gpu_ctx *x, const tkd_kl_params *p)
{
    if (tkd_kl_params_check(p, x->db.v) == TKD_OK)
        return 0;
    assert_int_equal(p->variant, TKD_KL_VARIANT_SAMPLED);
    assert_true(p->divergence == TKD_KL_DIVERGENCE_RKL || (p->divergence == TKD_KL_DIVERGENCE_JSD &&
                                                           p->jsd_beta == 1.0f));
    tkd_kl_result g;
    tkd_test_expect_error(tkd_kl_cuda_forward(x->ws, p, &x->db, &g, NULL, NULL), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("kd.divergence = ", "kd.variant = sampled", "use kd.variant = tail"));
    return 1;
}

/* Every divergence × variant (where defined) × τ ∈ {1, 2} × α ∈ {1, 0.5} × k' ∈ {k, 3} (sampled with
 * S = 6 draws, one repeated), both modes (check_params: recompute, and grad_in_forward with dW
 * written), against the float64 reference: N = 37 in chunks of 16, V = 1003, masked rows. The
 * paths it crosses on the default policy: τ = 1 or α = 1 is the fused path's bf16 gradient tile
 * (renorm at α = 1 has no dense KD gradient at all: its rows take the rescaled E), τ = 2 with α = 0.5
 * the sm90 fp32 logits, tail always cuBLAS and the row kernel's own statistics. Tolerances: fkl's. */
static void test_divergence_grid(void **state)
{
    (void)state;
    const int n = 37, d = 40, v = 1003, k = 8, s = 6;
    const float taus[] = {1.0f, 2.0f}, alphas[] = {1.0f, 0.5f};
    const int kus[] = {k, 3};
    int ran = 0, refused = 0;
    for (int ti = 0; ti < 2; ti++) {
        gcase *c = case_make(n, d, v, k, s, taus[ti], 61 + ti, 0.35f);
        tkd_kl_params p;
        params_set(&p, k, TKD_KL_VARIANT_SAMPLED, taus[ti], 1.0f, k, s, 16, 0);
        gpu_ctx x = {0};
        ctx_init(&x, c, &p);
        for (int di = 0; di < N_DIVS; di++)
            for (int var = 0; var < 3; var++) {
                errs worst = {0, 0, 0};
                for (int ai = 0; ai < 2; ai++)
                    for (int ki = 0; ki < 2; ki++) {
                        params_set(&p, k, (tkd_kl_variant)var, taus[ti], alphas[ai], kus[ki], s, 16, 0);
                        div_set(&p, &kDivs[di]);
                        if (div_refused(&x, &p)) {
                            refused++;
                            continue;
                        }
                        errs e = check_params(&x, c, &p, 1.0f);
                        char what[160];
                        snprintf(what, sizeof what, "%s (beta %g, skew alpha %g) %s tau %g alpha %g k' %d",
                                 tkd_kl_divergence_name(p.divergence), (double)p.jsd_beta, (double)p.skew_alpha,
                                 tkd_kl_variant_name(p.variant), taus[ti], alphas[ai], kus[ki]);
                        expect_within(e, LOSS_TOL, GRAD_TOL, what);
                        worst.loss = fmax(worst.loss, e.loss);
                        worst.dh = fmax(worst.dh, e.dh);
                        worst.dw = fmax(worst.dw, e.dw);
                        ran++;
                    }
                printf("divergence tau %.0f %-4s beta %.1f skew %.1f %-7s worst: loss %.2e  dH %.2e  dW %.2e\n",
                       taus[ti], tkd_kl_divergence_name(kDivs[di].div), (double)kDivs[di].beta,
                       (double)kDivs[di].skew, tkd_kl_variant_name((tkd_kl_variant)var), worst.loss, worst.dh,
                       worst.dw);
            }
        ctx_free(&x);
        case_free(c);
    }
    /* rkl and jsd at β = 1 with sampled, 2 τ × 2 α × 2 k' each; everything else ran */
    assert_int_equal(refused, 2 * 2 * 2 * 2);
    assert_int_equal(ran, 2 * N_DIVS * 3 * 2 * 2 - refused);
}

/* The CUDA path against the chunked CPU path (tkd_kl_cpu_*) on the same bf16-representable inputs,
 * both modes, every variant and divergence (where defined), α 0.6 (τ = 2: the fp32 logits' gradient)
 * and 1 (the fused path's tile), different chunkings on the two sides. */
static void test_against_cpu_path(void **state)
{
    (void)state;
    gcase *c = case_make(45, 32, 2051, 7, 5, 2.0, 41, 0.4f);
    size_t nh = (size_t)(c->n * c->d), nw = (size_t)c->v * c->d;
    float *cdh = malloc(nh * 4), *cdw = malloc(nw * 4);
    double *rdh = malloc(nh * 8), *rdw = malloc(nw * 8);
    assert_true(cdh && cdw && rdh && rdw);
    tkd_kl_batch hb = case_batch(c);
    const float alphas[] = {0.6f, 1.0f};
    for (int run = 0; run < (N_DIVS + 1) * 2 * 3 * 2; run++) { /* divergence (fkl, kDivs) × α × variant × mode */
        const int di = run / 12 - 1, ai = run / 6 % 2, var = run / 2 % 3, gif = run % 2;
        tkd_kl_params p;
        params_set(&p, 7, (tkd_kl_variant)var, 2.0f, alphas[ai], 6, 5, 0, gif);
        if (di >= 0)
            div_set(&p, &kDivs[di]);
        if (tkd_kl_params_check(&p, c->v) != TKD_OK) /* reverse KL with sampled: test_divergence_grid */
            continue;
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
        char what[160];
        snprintf(what, sizeof what, "cuda vs cpu %s (beta %g, skew alpha %g) %s alpha %g %s",
                 tkd_kl_divergence_name(p.divergence), (double)p.jsd_beta, (double)p.skew_alpha,
                 tkd_kl_variant_name((tkd_kl_variant)var), (double)alphas[ai],
                 gif ? "grad_in_forward" : "recompute");
        printf("%s: loss %.2e dH %.2e dW %.2e\n", what, e.loss, e.dh, e.dw);
        expect_within(e, LOSS_TOL, GRAD_TOL, what);
        ctx_free(&x);
    }
    free(cdh), free(cdw), free(rdh), free(rdw);
    case_free(c);
}


/* ---- the teacher online (tkd_kl_params.dense, kl_loss_cuda_dense.cu) ------------------------- */

/* A dense batch: the student's H (N, D), W (V, D) and the teacher's Ht (N, Dt), Wt (V, Dt), all
 * bf16-representable (the GPU's operands exactly: CPU and GPU then differ only in arithmetic), every
 * 5th row masked. */
typedef struct dcase {
    int64_t n;
    int d, dt, v;
    float *h, *w, *th, *tw;
    int32_t *labels;
} dcase;

static float *randn_bf16(size_t n, uint64_t seed, float std)
{
    float *x = malloc(sizeof(float) * n + 4);
    assert_non_null(x);
    tkd_test_randn(x, n, seed, std);
    round_bf16(x, n);
    return x;
}

static dcase *dcase_make(int64_t n, int d, int dt, int v, uint64_t seed)
{
    dcase *c = calloc(1, sizeof *c);
    assert_non_null(c);
    c->n = n, c->d = d, c->dt = dt, c->v = v;
    c->h = randn_bf16((size_t)(n * d), seed + 1, 0.4f);
    c->w = randn_bf16((size_t)v * d, seed + 2, 0.4f);
    c->th = randn_bf16((size_t)(n * dt), seed + 3, 1.0f);
    c->tw = randn_bf16((size_t)v * dt, seed + 4, 0.6f); /* teacher logits of std ~3: a peaked target */
    c->labels = malloc(sizeof(int32_t) * (size_t)n);
    assert_non_null(c->labels);
    for (int64_t i = 0; i < n; i++)
        c->labels[i] = i % 5 == 3 ? -100 : (int32_t)((i * 37 + (int64_t)seed) % v);
    return c;
}

static void dcase_free(dcase *c)
{
    free(c->h), free(c->w), free(c->th), free(c->tw), free(c->labels), free(c);
}

static tkd_kl_batch dcase_batch(const dcase *c)
{
    tkd_kl_batch b = {.n = c->n, .d = c->d, .v = c->v, .h = c->h, .w = c->w, .labels = c->labels,
                      .teacher_h = c->th, .teacher_w = c->tw, .teacher_d = c->dt};
    return b;
}

/* The shape gpu_run and compare read (n, d, v). */
static gcase dcase_shape(const dcase *c)
{
    gcase g;
    memset(&g, 0, sizeof g);
    g.n = c->n, g.d = c->d, g.v = c->v;
    return g;
}

static void dense_params(tkd_kl_params *p, int v, const div_case *dc, float tau, float alpha)
{
    tkd_kl_params_defaults(p, v);
    p->dense = 1;
    p->temperature = tau;
    p->alpha = alpha;
    p->chunk_rows = 16; /* N = 37: chunks of 16, 16 and 5 */
    if (dc)
        div_set(p, dc);
}

static void dense_ctx(gpu_ctx *x, const dcase *c, const tkd_kl_params *p)
{
    tkd_kl_batch hb = dcase_batch(c);
    memset(x, 0, sizeof *x);
    ctx_init_batch(x, &hb, p, p);
}

/* The chunked CPU path's dense loss and gradients (recompute, scale 1) as the reference r. */
static void dense_cpu(const dcase *c, const tkd_kl_params *p0, refout *r)
{
    tkd_kl_params p = *p0;
    p.grad_in_forward = 0;
    p.dw_overwrite = 0;
    p.chunk_rows = 10; /* another chunking than the GPU's */
    const tkd_kl_batch hb = dcase_batch(c);
    size_t nh = (size_t)(c->n * c->d), nw = (size_t)c->v * c->d;
    float *dh = malloc(nh * 4 + 4), *dw = calloc(nw, 4);
    r->dh = malloc(nh * 8 + 8);
    r->dw = malloc(nw * 8 + 8);
    assert_true(dh && dw && r->dh && r->dw);
    tkd_kl_cpu_ws *ws = NULL;
    assert_int_equal(tkd_kl_cpu_ws_create(&ws, &p, c->n, c->d, c->v), TKD_OK);
    if (tkd_kl_cpu_forward(ws, &p, &hb, &r->res, NULL, NULL) != TKD_OK ||
        tkd_kl_cpu_backward(ws, &p, &hb, 1.0f, dh, dw) != TKD_OK)
        fail_msg("cpu dense: %s", tkd_error_msg());
    tkd_kl_cpu_ws_free(ws);
    for (size_t i = 0; i < nh; i++)
        r->dh[i] = dh[i];
    for (size_t i = 0; i < nw; i++)
        r->dw[i] = dw[i];
    free(dh), free(dw);
}

/* Every divergence (fkl and kDivs) × τ {1, 2} × α {0.5, 1} × both modes (recompute with backward's
 * scale 0.25, grad_in_forward with grad_scale 0.5 and dW written) on V = 257 and 1000 (not
 * multiples of 4 or of the row kernel's tiles), D = 40, Dt = 24 ≠ D, N = 37 in chunks of 16 with
 * masked rows, against the chunked CPU path's dense mode on the same bf16-representable operands.
 * Tolerances: the fixture's (kl_testutil.h): the logits are fp32 sums of exact products on both
 * sides, dS is bf16 on the GPU. */
static void test_dense_against_cpu_path(void **state)
{
    (void)state;
    const int vs[] = {257, 1000};
    const float taus[] = {1.0f, 2.0f}, alphas[] = {0.5f, 1.0f};
    int ran = 0;
    for (int vi = 0; vi < 2; vi++) {
        dcase *c = dcase_make(37, 40, 24, vs[vi], 71 + vi);
        gcase shape = dcase_shape(c);
        tkd_kl_params p;
        dense_params(&p, c->v, NULL, 1.0f, 1.0f);
        gpu_ctx x;
        dense_ctx(&x, c, &p);
        for (int di = -1; di < N_DIVS; di++)
            for (int ti = 0; ti < 2; ti++)
                for (int ai = 0; ai < 2; ai++) {
                    dense_params(&p, c->v, di >= 0 ? &kDivs[di] : NULL, taus[ti], alphas[ai]);
                    refout r;
                    dense_cpu(c, &p, &r);
                    assert_int_equal(r.res.n_kept, 30); /* 37 rows, 7 masked */
                    for (int gif = 0; gif < 2; gif++) {
                        const float scale = gif ? 0.5f : 0.25f;
                        p.grad_in_forward = gif;
                        p.dw_overwrite = gif;
                        tkd_kl_result g;
                        gpu_run(&x, &shape, &p, scale, &g);
                        errs e = compare(&x, &shape, &g, &r, scale);
                        char what[192];
                        snprintf(what, sizeof what, "dense V %d %s (beta %g, skew alpha %g) tau %g alpha %g %s",
                                 c->v, tkd_kl_divergence_name(p.divergence), (double)p.jsd_beta,
                                 (double)p.skew_alpha, (double)taus[ti], (double)alphas[ai],
                                 gif ? "grad_in_forward" : "recompute");
                        printf("%s: loss %.2e dH %.2e dW %.2e\n", what, e.loss, e.dh, e.dw);
                        expect_within(e, LOSS_TOL, GRAD_TOL, what);
                        assert_true(g.kd > 0.0);
                        ran++;
                    }
                    ref_free(&r);
                }
        ctx_free(&x);
        dcase_free(c);
    }
    assert_int_equal(ran, 2 * (N_DIVS + 1) * 2 * 2 * 2);
}

/* Issue 24's check on the device: the dense loss equals the cached path's on a cache holding every
 * token (k = V, the columns sorted and the LSE cut from the same teacher logits, made on the host
 * in double from the same bf16 operands), every divergence, τ 1 and 2, α 0.5 and 1, both modes.
 * They differ in how the teacher's logits are summed and in the paths' bf16 dS: the fixture's
 * tolerances. */
static void test_dense_equals_cache_of_every_token(void **state)
{
    (void)state;
    const int vs[] = {257, 1000};
    for (int vi = 0; vi < 2; vi++) {
        dcase *c = dcase_make(37, 40, 24, vs[vi], 91 + vi);
        gcase shape = dcase_shape(c);
        const int v = c->v;
        float *t = malloc(sizeof(float) * (size_t)v), *tl = malloc(sizeof(float) * (size_t)(c->n * v));
        float *lse = malloc(sizeof(float) * (size_t)c->n);
        int32_t *idx = malloc(sizeof(int32_t) * (size_t)(c->n * v));
        double *gdh = malloc(sizeof(double) * (size_t)(c->n * c->d)), *gdw = malloc(sizeof(double) * (size_t)v * c->d);
        assert_true(t && tl && lse && idx && gdh && gdw);
        for (int ti = 0; ti < 2; ti++) {
            const float tau = ti ? 2.0f : 1.0f;
            for (int64_t i = 0; i < c->n; i++) {
                for (int j = 0; j < v; j++) {
                    double acc = 0.0;
                    for (int e = 0; e < c->dt; e++)
                        acc += (double)c->th[i * c->dt + e] * c->tw[(size_t)j * c->dt + e];
                    t[j] = (float)acc;
                }
                tkd_test_cut_row(t, v, v, tau, 0, 1, NULL, NULL, idx + i * v, tl + i * v, lse + i, NULL);
            }
            const tkd_kl_batch cb = {.n = c->n, .d = c->d, .v = v, .h = c->h, .w = c->w, .topk_idx = idx,
                                     .topk_logit = tl, .teacher_lse = lse, .labels = c->labels};
            tkd_kl_params cp = tkd_test_kl_params(TKD_KL_VARIANT_RENORM, tau, 1.0, v, v, 0), dp;
            cp.chunk_rows = 16;
            gpu_ctx xc, xd;
            memset(&xc, 0, sizeof xc);
            ctx_init_batch(&xc, &cb, &cp, &cp);
            dense_params(&dp, v, NULL, tau, 1.0f);
            dense_ctx(&xd, c, &dp);
            for (int di = -1; di < N_DIVS; di++)
                for (int ai = 0; ai < 2; ai++)
                    for (int gif = 0; gif < 2; gif++) {
                        dense_params(&dp, v, di >= 0 ? &kDivs[di] : NULL, tau, ai ? 1.0f : 0.5f);
                        cp.divergence = dp.divergence, cp.jsd_beta = dp.jsd_beta, cp.skew_alpha = dp.skew_alpha;
                        cp.alpha = dp.alpha;
                        cp.grad_in_forward = dp.grad_in_forward = gif;
                        tkd_kl_result gc, gd;
                        gpu_run(&xc, &shape, &cp, 1.0f, &gc);
                        for (size_t i = 0; i < (size_t)(c->n * c->d); i++)
                            gdh[i] = xc.h_dh[i];
                        for (size_t i = 0; i < (size_t)v * c->d; i++)
                            gdw[i] = xc.h_dw[i];
                        gpu_run(&xd, &shape, &dp, 1.0f, &gd);
                        refout r = {gc, gdh, gdw};
                        errs e = compare(&xd, &shape, &gd, &r, 1.0);
                        char what[160];
                        snprintf(what, sizeof what, "dense vs k = V cache, V %d %s tau %g alpha %g %s", v,
                                 tkd_kl_divergence_name(dp.divergence), (double)tau, (double)dp.alpha,
                                 gif ? "grad_in_forward" : "recompute");
                        printf("%s: loss %.2e dH %.2e dW %.2e\n", what, e.loss, e.dh, e.dw);
                        expect_within(e, LOSS_TOL, GRAD_TOL, what);
                    }
            ctx_free(&xc);
            ctx_free(&xd);
        }
        free(t), free(tl), free(lse), free(idx), free(gdh), free(gdw);
        dcase_free(c);
    }
}

/* Every row masked: loss 0, gradients exactly 0. A label outside [0, V) and a non-finite teacher
 * are errors naming the row; a dense call on a workspace made for a cache is refused by name. */
static void test_dense_masked_and_errors(void **state)
{
    (void)state;
    dcase *c = dcase_make(9, 8, 12, 300, 5);
    gcase shape = dcase_shape(c);
    tkd_kl_params p;
    dense_params(&p, c->v, NULL, 2.0f, 0.5f);
    p.chunk_rows = 4;
    for (int i = 0; i < 9; i++)
        c->labels[i] = -100;
    gpu_ctx x;
    dense_ctx(&x, c, &p);
    tkd_kl_result g;
    for (int gif = 0; gif < 2; gif++) {
        p.grad_in_forward = gif;
        gpu_run(&x, &shape, &p, 1.0f, &g);
        assert_int_equal(g.n_kept, 0);
        assert_true(g.loss == 0.0 && g.kd == 0.0 && g.ce == 0.0);
        for (int i = 0; i < 9 * 8; i++)
            assert_true(x.h_dh[i] == 0.0f);
        for (int i = 0; i < 300 * 8; i++)
            assert_true(x.h_dw[i] == 0.0f);
    }
    ctx_free(&x);
    c->labels[2] = 7, c->labels[6] = 300; /* row 6: outside the vocabulary */
    p.grad_in_forward = 0;
    dense_ctx(&x, c, &p);
    tkd_test_expect_error(tkd_kl_cuda_forward(x.ws, &p, &x.db, &g, NULL, NULL), TKD_ERR_FORMAT,
                          TKD_TEST_FRAGS("row 6", "a label is outside [0, V)"));
    ctx_free(&x);
    c->labels[6] = 1;
    c->tw[5 * c->dt] = INFINITY; /* every row's teacher logit at token 5 */
    dense_ctx(&x, c, &p);
    tkd_test_expect_error(tkd_kl_cuda_forward(x.ws, &p, &x.db, &g, NULL, NULL), TKD_ERR_FORMAT,
                          TKD_TEST_FRAGS("row 2", "a teacher logit or log-sum-exp is not finite"));
    tkd_kl_cuda_ws *cache_ws = NULL; /* a workspace made for a cache */
    tkd_kl_params q = tkd_test_kl_params(TKD_KL_VARIANT_RENORM, 1.0, 1.0, 4, 4, 0);
    assert_int_equal(tkd_kl_cuda_ws_create(&cache_ws, &q, &g_pol, c->n, c->d, c->v), TKD_OK);
    tkd_test_expect_error(tkd_kl_cuda_forward(cache_ws, &p, &x.db, &g, NULL, NULL), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("a dense call (the teacher online) on a workspace made without "
                                         "tkd_kl_params.dense"));
    tkd_kl_cuda_ws_free(cache_ws);
    ctx_free(&x);
    dcase_free(c);
}

static const struct CMUnitTest kTests[] = {
    cmocka_unit_test(test_variant_grid),
    cmocka_unit_test(test_awkward_shapes),
    cmocka_unit_test(test_row_block_sizes),
    cmocka_unit_test(test_extreme_logits),
    cmocka_unit_test(test_tail_tiny_one_minus_q),
    cmocka_unit_test(test_scale_and_accumulate),
    cmocka_unit_test(test_all_masked),
    cmocka_unit_test(test_bad_teacher_data),
    cmocka_unit_test(test_against_cpu_path),
    cmocka_unit_test(test_divergence_grid),
    cmocka_unit_test(test_dense_against_cpu_path),
    cmocka_unit_test(test_dense_equals_cache_of_every_token),
    cmocka_unit_test(test_dense_masked_and_errors),
};
#endif /* TKD_HAVE_CUDA */

TKD_KL_TEST_MAIN(kTests)
