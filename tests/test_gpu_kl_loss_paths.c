/* test_gpu_kl_loss_paths.c — the CUDA KL loss's paths (kernels/loss/kl_loss_cuda.h): run once per
 * CUDA policy group as test_gpu_kl_loss.c (fixture, tolerances and groups in kl_testutil.h).
 * test_path_engaged says which path each group ran (so a silent fallback cannot pass for the sm90
 * path), test_deterministic that repeated calls give the same bits, test_paths_agree that the three
 * paths agree and that the fused one is no less accurate; the policy's gradient-GEMM choice and the
 * fused path's dH chunk rows are the ones taken, and a workspace the device cannot hold is an error.
 * Labelled gpu: exits 77 (skipped) where no GPU answers or the build has no CUDA backend.
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

static const struct CMUnitTest kTests[] = {
    cmocka_unit_test(test_path_engaged),
    cmocka_unit_test(test_device_oom),
    cmocka_unit_test(test_deterministic),
    cmocka_unit_test(test_paths_agree),
    cmocka_unit_test(test_dh_chunk_rows),
    cmocka_unit_test(test_grad_paths),
};
#endif /* TKD_HAVE_CUDA */

TKD_KL_TEST_MAIN(kTests)
