/* test_gpu_lmhead_grad_sm90.c — our Hopper gradient GEMMs of the LM head (kernels/gemm_sm90/lmhead_grad_sm90.h):
 * dH = sigma ⊙ (E·W) and dW (+)= Eᵀ·X against a float64 reference over awkward shapes (rows, V not
 * multiples of the 64 x 256 tile or of the 64-wide K step, one row, D = 8 and D not a multiple of
 * 64 or 256, E's row padding filled with NaN, which must never be read), dW written over a
 * NaN-filled buffer and added to random contents, the result bit-identical whatever the grid or
 * schedule, and the argument checks; every test runs under the default schedule (cooperative) and
 * ping-pong (two cmocka groups), the float64 checks on the full grid and on one CTA. Labelled gpu: exits 77 where no GPU answers or it is not compute capability
 * 9.0.
 *
 * Tolerance. The operands are bf16, so each product is exact in fp32 and the only error is the fp32
 * summation over K: any order of K − 1 additions is within (K − 1)·u·Σ_k |a_k b_k| of the exact
 * sum (u = 2^-24), twice that if the tensor cores' adder truncates. The epilogue's one fmaf (times
 * sigma, or plus dW's old value) adds u·|result|. So per element
 *   |got − ref| ≤ |s|·2·K·u·Σ_k |a_k b_k| + 2u·(|ref| + |old|) + 1e-30,
 * computed exactly beside the reference; a wrong tile, a skipped K step or a misplaced box misses
 * it by orders of magnitude.
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

#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/gemm_sm90/lmhead_grad_sm90.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"
#include "kernels/gemm_sm90/lmhead_sm90_tuning.h"
#include "tests/gpu_check.h"
#include "tests/gpu_testutil.h"

#define FP32_U 5.9604644775390625e-8 /* 2^-24 */

static int g_sched; /* the running group's schedule (setup) */

/* One case: e (rows, lde) with NaN padding, w (V, D), x (rows, D), sigma (rows), host and device. */
typedef struct grad_case {
    int64_t rows, lde;
    int d, v;
    float *e, *w, *x, *sigma;
    uint16_t *eb, *wb, *xb;
    uint16_t *de, *dw_op, *dx; /* device operands */
    float *dsig;
} grad_case;

static grad_case case_make(int64_t rows, int d, int v, uint64_t seed)
{
    grad_case c = {.rows = rows, .d = d, .v = v, .lde = ((int64_t)v + 15) / 16 * 16 + 16};
    const size_t ne = (size_t)rows * c.lde, nw = (size_t)v * d, nx = (size_t)rows * d;
    c.e = tkd_test_xmalloc(ne * sizeof(float));
    c.eb = tkd_test_xmalloc(ne * 2);
    c.w = tkd_test_xmalloc(nw * sizeof(float));
    c.wb = tkd_test_xmalloc(nw * 2);
    c.x = tkd_test_xmalloc(nx * sizeof(float));
    c.xb = tkd_test_xmalloc(nx * 2);
    c.sigma = tkd_test_xmalloc((size_t)rows * sizeof(float));
    tkd_test_fill_bf16(c.e, c.eb, (int64_t)ne, seed, 1.0f);
    tkd_test_fill_bf16(c.w, c.wb, (int64_t)nw, seed + 1, 0.05f);
    tkd_test_fill_bf16(c.x, c.xb, (int64_t)nx, seed + 2, 1.0f);
    for (int64_t i = 0; i < rows; i++) {
        for (int64_t j = v; j < c.lde; j++)
            c.eb[i * c.lde + j] = 0xFFFF; /* NaN: the padding must never be read */
        c.sigma[i] = i % 7 == 3 ? 0.0f : 0.5f + (float)((i * 37) % 11) / 8.0f; /* masked rows: 0 */
    }
    c.de = tkd_test_dev_alloc(ne * 2);
    c.dw_op = tkd_test_dev_alloc(nw * 2);
    c.dx = tkd_test_dev_alloc(nx * 2);
    c.dsig = tkd_test_dev_alloc((size_t)rows * sizeof(float));
    tkd_test_to_dev(c.de, c.eb, ne * 2);
    tkd_test_to_dev(c.dw_op, c.wb, nw * 2);
    tkd_test_to_dev(c.dx, c.xb, nx * 2);
    tkd_test_to_dev(c.dsig, c.sigma, (size_t)rows * sizeof(float));
    return c;
}

static void case_free(grad_case *c)
{
    free(c->e), free(c->eb), free(c->w), free(c->wb), free(c->x), free(c->xb), free(c->sigma);
    cudaFree(c->de), cudaFree(c->dw_op), cudaFree(c->dx), cudaFree(c->dsig);
}

/* Compares got with ref within the tolerance above (bound[i] = 2·K·u·|s|·Σ|ab| + 2u·|old|, plus the
 * output's rounding 2u·|ref|); prints the worst element when any is off and returns how many are. */
static int check(const float *got, const double *ref, const double *bound, size_t n, int ld,
                 const char *what)
{
    static const tkd_test_tol tol = {1e-30, 2 * FP32_U, "fp32 output rounding 2u, + fp32 accumulation 2·K·u·|s|·Σ|ab| "
                                                        "(+ 2u·|old| when accumulating)"};
    const size_t cols = (size_t)ld;
    char line[1024];
    tkd_test_check k;
    tkd_test_check_begin(&k, what, tol, tkd_test_where_rowcol, &cols);
    for (size_t i = 0; i < n; i++)
        tkd_test_check_add(&k, (int64_t)i, got[i], ref[i], bound[i]);
    if (k.bad) {
        tkd_test_check_describe(&k, line, sizeof line);
        printf("%s\n", line);
    }
    return (int)k.bad;
}

/* dH of case c on ws, on the full grid and on one CTA (every tile through one pipeline: ring
 * wrap-around, and ping-pong's turns), each checked against float64. */
static int check_dh(tkd_lmhead_sm90_ws *ws, const grad_case *c)
{
    const int64_t rows = c->rows;
    const int d = c->d, v = c->v;
    const size_t n = (size_t)rows * d;
    float *ddh = tkd_test_dev_alloc(n * 4), *got = tkd_test_xmalloc(n * 4);
    double *ref = tkd_test_xmalloc(n * 8), *bound = tkd_test_xmalloc(n * 8);
    for (int64_t i = 0; i < rows; i++)
        for (int j = 0; j < d; j++) {
            double s = 0.0, a = 0.0;
            for (int k = 0; k < v; k++) {
                const double p = (double)c->e[i * c->lde + k] * c->w[(size_t)k * d + j];
                s += p;
                a += fabs(p);
            }
            ref[i * d + j] = c->sigma[i] * s;
            bound[i * d + j] = fabs(c->sigma[i]) * 2.0 * v * FP32_U * a;
        }
    int bad = 0;
    for (int ctas = 0; ctas <= 1; ctas++) {
        tkd_lmhead_sm90_ws_set_max_ctas(ws, ctas);
        tkd_test_poison(ddh, n * 4);
        tkd_test_ok(tkd_lmhead_grad_sm90_dh(ws, c->de, c->lde, c->dw_op, rows, d, v, c->dsig, ddh), "dh");
        tkd_test_ok(tkd_lmhead_sm90_sync(ws), "dh sync");
        tkd_test_to_host(got, ddh, n * 4, NULL);
        char what[96];
        snprintf(what, sizeof what, "dH rows %lld D %d V %d%s", (long long)rows, d, v, ctas ? " one CTA" : "");
        bad += check(got, ref, bound, n, d, what);
    }
    tkd_lmhead_sm90_ws_set_max_ctas(ws, 0);
    cudaFree(ddh);
    free(got), free(ref), free(bound);
    return bad;
}

/* dW of case c on ws, written over NaN (accumulate 0) or added to random contents, on the full
 * grid and on one CTA; `off` floats into its buffer (2: 8- but not 16-byte aligned, where the L2
 * prefetch must stand aside). */
static int check_dw(tkd_lmhead_sm90_ws *ws, const grad_case *c, int accumulate, int off)
{
    const int64_t rows = c->rows;
    const int d = c->d, v = c->v;
    const size_t n = (size_t)v * d;
    float *base = tkd_test_dev_alloc((n + (size_t)off) * 4), *ddw = base + off;
    float *got = tkd_test_xmalloc(n * 4), *old = tkd_test_xmalloc(n * 4);
    uint16_t *oldb = tkd_test_xmalloc(n * 2);
    double *ref = tkd_test_xmalloc(n * 8), *bound = tkd_test_xmalloc(n * 8);
    if (accumulate)
        tkd_test_fill_bf16(old, oldb, (int64_t)n, 77 + (uint64_t)v, 3.0f);
    else
        memset(old, 0, n * 4);
    for (size_t i = 0; i < n; i++)
        ref[i] = old[i], bound[i] = 0.0;
    for (int64_t r = 0; r < rows; r++)
        for (int k = 0; k < v; k++) {
            const double ev = c->e[r * c->lde + k];
            for (int j = 0; j < d; j++) {
                const double p = ev * c->x[r * d + j];
                ref[(size_t)k * d + j] += p;
                bound[(size_t)k * d + j] += fabs(p);
            }
        }
    for (size_t i = 0; i < n; i++)
        bound[i] = bound[i] * 2.0 * (double)rows * FP32_U + 2 * FP32_U * fabs((double)old[i]);
    int bad = 0;
    for (int ctas = 0; ctas <= 1; ctas++) {
        tkd_lmhead_sm90_ws_set_max_ctas(ws, ctas);
        if (accumulate)
            tkd_test_to_dev(ddw, old, n * 4);
        else
            tkd_test_poison(ddw, n * 4);
        tkd_test_ok(tkd_lmhead_grad_sm90_dw(ws, c->de, c->lde, c->dx, rows, d, v, ddw, accumulate), "dw");
        tkd_test_ok(tkd_lmhead_sm90_sync(ws), "dw sync");
        tkd_test_to_host(got, ddw, n * 4, NULL);
        char what[128];
        snprintf(what, sizeof what, "dW rows %lld D %d V %d %s%s%s", (long long)rows, d, v,
                 accumulate ? "accumulate" : "overwrite", off ? " 8-byte aligned" : "", ctas ? " one CTA" : "");
        bad += check(got, ref, bound, n, d, what);
    }
    tkd_lmhead_sm90_ws_set_max_ctas(ws, 0);
    cudaFree(base);
    free(got), free(old), free(oldb), free(ref), free(bound);
    return bad;
}

/* (rows, D, V): one row, D = 8, tiles cut in every direction, K not a multiple of 64, several
 * tiles, a long K; 2100 rows: dH's tiles in two groups of 2048 rows; 8200 x 1032: dW's N tiles in
 * groups of 3 (X's columns within 16 MB) and a short last group of 2. */
static const int kShapes[][3] = {
    {1, 8, 1}, {1, 64, 300}, {63, 200, 65}, {70, 264, 130}, {129, 520, 1000}, {300, 96, 5003},
    {200, 1024, 777}, {2100, 8, 65}, {8200, 1032, 65},
};

static void test_dh_vs_f64(void **state)
{
    int bad = 0;
    for (size_t s = 0; s < sizeof kShapes / sizeof kShapes[0]; s++) {
        grad_case c = case_make(kShapes[s][0], kShapes[s][1], kShapes[s][2], 100 + s);
        bad += check_dh(*state, &c);
        case_free(&c);
    }
    assert_int_equal(bad, 0);
}

static void test_dw_vs_f64(void **state)
{
    int bad = 0;
    for (size_t s = 0; s < sizeof kShapes / sizeof kShapes[0]; s++) {
        grad_case c = case_make(kShapes[s][0], kShapes[s][1], kShapes[s][2], 200 + s);
        bad += check_dw(*state, &c, 0, 0);
        bad += check_dw(*state, &c, 1, s == 4 ? 2 : 0); /* one shape into an 8-byte-aligned buffer */
        case_free(&c);
    }
    assert_int_equal(bad, 0);
}

/* dH and dW on 1, 3 and all CTAs and on either schedule: bit-identical. */
static void test_grid_invariant(void **state)
{
    tkd_lmhead_sm90_ws *ws = *state;
    grad_case c = case_make(333, 520, 2100, 300);
    const size_t nh = (size_t)c.rows * c.d, nw = (size_t)c.v * c.d;
    float *ddh = tkd_test_dev_alloc(nh * 4), *ddw = tkd_test_dev_alloc(nw * 4);
    float *h0 = tkd_test_xmalloc(nh * 4), *w0 = tkd_test_xmalloc(nw * 4);
    float *h1 = tkd_test_xmalloc(nh * 4), *w1 = tkd_test_xmalloc(nw * 4);
    /* full grid, 1 and 3 CTAs on this group's schedules, then the full grid on each forced one */
    const int ctas[] = {0, 1, 3, 0, 0};
    const int scheds[] = {-2, -2, -2, TKD_LMHEAD_SM90_SCHED_PINGPONG, TKD_LMHEAD_SM90_SCHED_COOP};
    for (int g = 0; g < 5; g++) {
        tkd_lmhead_sm90_ws_set_max_ctas(ws, ctas[g]);
        if (scheds[g] != -2)
            tkd_lmhead_grad_sm90_set_schedule(ws, scheds[g]);
        tkd_test_poison(ddh, nh * 4);
        tkd_test_poison(ddw, nw * 4);
        tkd_test_ok(tkd_lmhead_grad_sm90_dh(ws, c.de, c.lde, c.dw_op, c.rows, c.d, c.v, c.dsig, ddh), "dh");
        tkd_test_ok(tkd_lmhead_grad_sm90_dw(ws, c.de, c.lde, c.dx, c.rows, c.d, c.v, ddw, 0), "dw");
        tkd_test_ok(tkd_lmhead_sm90_sync(ws), "sync");
        tkd_test_to_host(g == 0 ? h0 : h1, ddh, nh * 4, NULL);
        tkd_test_to_host(g == 0 ? w0 : w1, ddw, nw * 4, NULL);
        if (g > 0) {
            if (memcmp(h0, h1, nh * 4) != 0 || memcmp(w0, w1, nw * 4) != 0)
                printf("run %d (max_ctas %d): dH %s, dW %s the first run's\n", g, ctas[g],
                       memcmp(h0, h1, nh * 4) ? "differs from" : "equals",
                       memcmp(w0, w1, nw * 4) ? "differs from" : "equals");
            assert_memory_equal(h0, h1, nh * 4);
            assert_memory_equal(w0, w1, nw * 4);
        }
    }
    tkd_lmhead_sm90_ws_set_max_ctas(ws, 0);
    tkd_lmhead_grad_sm90_set_schedule(ws, g_sched); /* the group's own again */
    cudaFree(ddh), cudaFree(ddw);
    free(h0), free(h1), free(w0), free(w1);
    case_free(&c);
}

static void test_arguments(void **state)
{
    tkd_lmhead_sm90_ws *ws = *state;
    grad_case c = case_make(8, 64, 16, 400);
    float *out = tkd_test_dev_alloc(64 * 64 * 4);
    assert_int_equal(tkd_lmhead_grad_sm90_dh(ws, c.de, c.lde, c.dw_op, 8, 60, 16, c.dsig, out), TKD_ERR_UNSUPPORTED);
    assert_int_equal(tkd_lmhead_grad_sm90_dh(ws, c.de, 20, c.dw_op, 8, 64, 16, c.dsig, out), TKD_ERR_UNSUPPORTED);
    assert_int_equal(tkd_lmhead_grad_sm90_dh(ws, c.de, 8, c.dw_op, 8, 64, 16, c.dsig, out), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_lmhead_grad_sm90_dh(ws, c.de, c.lde, c.dw_op, 8, 64, 16, NULL, out), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_lmhead_grad_sm90_dh(ws, c.de + 1, c.lde, c.dw_op, 8, 64, 16, c.dsig, out),
                     TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_lmhead_grad_sm90_dw(ws, c.de, c.lde, c.dx, 0, 64, 16, out, 0), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_lmhead_grad_sm90_dw(ws, c.de, c.lde, c.dx, 8, 64, 16, out + 1, 0), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_lmhead_grad_sm90_dw(ws, c.de, c.lde, NULL, 8, 64, 16, out, 0), TKD_ERR_INVALID_ARG);
    tkd_test_ok(tkd_lmhead_sm90_sync(ws), "sync");
    cudaFree(out);
    case_free(&c);
}

/* The group's schedule: -1 the default (cooperative), else forced. */
static int setup(void **state, int sched)
{
    tkd_lmhead_sm90_ws *ws = NULL;
    tkd_status st = tkd_lmhead_sm90_ws_create(&ws, TKD_LMHEAD_SM90_SCHED_PINGPONG);
    if (st != TKD_OK) {
        printf("lmhead_sm90 workspace: %s: %s\n", tkd_status_name(st), tkd_error_msg());
        return -1;
    }
    tkd_lmhead_grad_sm90_set_schedule(ws, sched);
    g_sched = sched;
    *state = ws;
    return 0;
}

static int setup_default(void **state) { return setup(state, -1); }
static int setup_pingpong(void **state) { return setup(state, TKD_LMHEAD_SM90_SCHED_PINGPONG); }

static int teardown(void **state)
{
    tkd_lmhead_sm90_ws_free(*state);
    return 0;
}
#endif /* TKD_HAVE_CUDA */

int main(void)
{
    tkd_test_require_gpu();
#ifdef TKD_HAVE_CUDA
    tkd_test_skip_unless_ok(tkd_lmhead_sm90_supported());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arguments),
        cmocka_unit_test(test_dh_vs_f64),
        cmocka_unit_test(test_dw_vs_f64),
        cmocka_unit_test(test_grid_invariant),
    };
    int failed = cmocka_run_group_tests_name("lmhead_grad_sm90 default (cooperative)", tests, setup_default, teardown);
    failed += cmocka_run_group_tests_name("lmhead_grad_sm90 ping-pong", tests, setup_pingpong, teardown);
    return failed;
#else
    return 77;
#endif
}
