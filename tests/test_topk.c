/* test_topk.c — top-k + LSE: the fast CPU path equals the scalar reference exactly, the reference
 * obeys the stated order, LSE matches an independent double computation, bad input errors. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/topk.h"
#include "tests/testutil.h"

/* log Σ exp(t/τ) in long double with the max taken first: an independent reference. */
static double lse_check(const float *row, int64_t V, float tau)
{
    long double m = -INFINITY, s = 0;
    for (int64_t v = 0; v < V; v++)
        m = fmaxl(m, (long double)row[v] / tau);
    for (int64_t v = 0; v < V; v++)
        s += expl((long double)row[v] / tau - m);
    return (double)(m + logl(s));
}

static int better(float va, uint32_t ia, float vb, uint32_t ib)
{
    return va > vb || (va == vb && ia < ib);
}

/* The reference's output is the k best of each row under (value desc, id asc), sorted. */
static void check_order(const float *x, int64_t C, int64_t V, int k, const uint32_t *idx,
                        const float *val)
{
    unsigned char *taken = calloc((size_t)V, 1);
    assert_non_null(taken);
    for (int64_t r = 0; r < C; r++) {
        memset(taken, 0, (size_t)V);
        const uint32_t *ri = idx + r * k;
        const float *rv = val + r * k;
        for (int j = 0; j < k; j++) {
            assert_true(ri[j] < V);
            assert_false(taken[ri[j]]);
            taken[ri[j]] = 1;
            assert_memory_equal(&rv[j], &x[r * V + ri[j]], sizeof(float)); /* raw value, same bits */
            if (j > 0)
                assert_true(better(rv[j - 1], ri[j - 1], rv[j], ri[j]));
        }
        for (int64_t v = 0; v < V; v++)
            if (!taken[v])
                assert_true(better(rv[k - 1], ri[k - 1], x[r * V + v], (uint32_t)v));
    }
    free(taken);
}

static void run_case(int64_t C, int64_t V, int k, float tau, tkd_test_fill f, uint64_t seed)
{
    float *x = malloc((size_t)(C * V) * sizeof *x);
    uint32_t *i_ref = malloc((size_t)(C * k) * sizeof *i_ref), *i_cpu = malloc((size_t)(C * k) * sizeof *i_cpu);
    float *v_ref = malloc((size_t)(C * k) * sizeof *v_ref), *v_cpu = malloc((size_t)(C * k) * sizeof *v_cpu);
    float *l_ref = malloc((size_t)C * sizeof *l_ref), *l_cpu = malloc((size_t)C * sizeof *l_cpu);
    assert_true(x && i_ref && i_cpu && v_ref && v_cpu && l_ref && l_cpu);
    tkd_test_fill_logits(x, (size_t)(C * V), f, seed);
    assert_int_equal(tkd_topk_ref(x, C, V, k, tau, i_ref, v_ref, l_ref), TKD_OK);
    assert_int_equal(tkd_topk_cpu(x, C, V, k, tau, i_cpu, v_cpu, l_cpu), TKD_OK);
    check_order(x, C, V, k, i_ref, v_ref);
    assert_memory_equal(i_ref, i_cpu, (size_t)(C * k) * sizeof *i_ref);
    assert_memory_equal(v_ref, v_cpu, (size_t)(C * k) * sizeof *v_ref);
    for (int64_t r = 0; r < C; r++) {
        double want = lse_check(x + r * V, V, tau);
        /* Both paths sum in double and round once to fp32: within 2 fp32 ulps (2·6e-8 relative)
         * of the long double value, plus 1e-7 absolute for an lse near 0. */
        assert_true(tkd_test_close(l_ref[r], want, 1e-7, 1.2e-7));
        assert_true(tkd_test_close(l_cpu[r], want, 1e-7, 1.2e-7));
    }
    free(x), free(i_ref), free(i_cpu), free(v_ref), free(v_cpu), free(l_ref), free(l_cpu);
}

static void test_shapes(void **state)
{
    (void)state;
    run_case(3, 1001, 5, 1.0f, TKD_TEST_FILL_RANDN, 1);      /* V not a multiple of 8 */
    run_case(1, 37, 1, 1.0f, TKD_TEST_FILL_RANDN, 2);        /* one row, k = 1 */
    run_case(4, 4099, 128, 0.7f, TKD_TEST_FILL_RANDN, 3);    /* k = 128, τ < 1 */
    run_case(5, 2003, 100, 2.0f, TKD_TEST_FILL_TIES, 4);     /* many ties, τ > 1 */
    run_case(3, 515, 64, 1.0f, TKD_TEST_FILL_EXTREME, 5);    /* ±1e4 among small values */
    run_case(2, 300, 128, 1.3f, TKD_TEST_FILL_CONST, 6);     /* every logit equal: ids 0..k-1 */
    run_case(2, 301, 50, 1.0f, TKD_TEST_FILL_ZEROS_SIGNED, 7); /* -0.0 ties +0.0 */
    run_case(2, 128, 128, 1.0f, TKD_TEST_FILL_RANDN, 8);     /* V == k */
    run_case(17, 3001, 20, 1.0f, TKD_TEST_FILL_RANDN, 9);    /* several rows through OpenMP */
    run_case(0, 100, 10, 1.0f, TKD_TEST_FILL_RANDN, 10);     /* no rows */
}

static void test_const_row_picks_smallest_ids(void **state)
{
    (void)state;
    float x[10];
    for (int i = 0; i < 10; i++)
        x[i] = i == 7 ? 2.0f : 1.0f;
    uint32_t idx[4];
    float val[4], lse;
    assert_int_equal(tkd_topk_cpu(x, 1, 10, 4, 1.0f, idx, val, &lse), TKD_OK);
    assert_int_equal(idx[0], 7);
    assert_int_equal(idx[1], 0);
    assert_int_equal(idx[2], 1);
    assert_int_equal(idx[3], 2);
    assert_true(val[0] == 2.0f && val[3] == 1.0f);
    /* log(9e + e^2) */
    assert_true(tkd_test_close(lse, log(9 * exp(1.0) + exp(2.0)), 0, 1e-6));
}

static void test_bad_args(void **state)
{
    (void)state;
    float x[40] = {0};
    uint32_t idx[200];
    float val[200], lse[4];
    assert_int_equal(tkd_topk_cpu(x, 1, 4, 5, 1.0f, idx, val, lse), TKD_ERR_INVALID_ARG); /* V < k */
    assert_int_equal(tkd_topk_ref(x, 1, 4, 5, 1.0f, idx, val, lse), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_topk_cpu(x, 1, 40, 0, 1.0f, idx, val, lse), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_topk_cpu(x, 1, 200, 129, 1.0f, idx, val, lse), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_topk_cpu(x, 1, 40, 3, 0.0f, idx, val, lse), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_topk_cpu(x, 1, 40, 3, NAN, idx, val, lse), TKD_ERR_INVALID_ARG);
    assert_non_null(strstr(tkd_error_msg(), "temperature"));
}

static void test_nonfinite(void **state)
{
    (void)state;
    enum { C = 4, V = 33 };
    float x[C * V];
    uint32_t idx[C * 3];
    float val[C * 3], lse[C];
    float bad[3] = {NAN, INFINITY, -INFINITY};
    for (int b = 0; b < 3; b++) {
        tkd_test_randn(x, C * V, 11, 1.0f);
        x[2 * V + 17] = bad[b];
        x[3 * V + 1] = bad[b]; /* a later row too: the first one is named */
        assert_int_equal(tkd_topk_cpu(x, C, V, 3, 1.0f, idx, val, lse), TKD_ERR_NUMERIC);
        assert_non_null(strstr(tkd_error_msg(), "row 2, column 17"));
        assert_int_equal(tkd_topk_ref(x, C, V, 3, 1.0f, idx, val, lse), TKD_ERR_NUMERIC);
        assert_non_null(strstr(tkd_error_msg(), "row 2, column 17"));
    }
}

TKD_TEST_MAIN(test_shapes, test_const_row_picks_smallest_ids, test_bad_args, test_nonfinite)
