/* test_harness_check.c — the GPU tests' harness on the CPU: the checker of tests/gpu_check.h (counts,
 * the worst element and its decoded place, NaN and zero tolerances, the reason in the message) and
 * the float64 references of tests/ref64.h (the attention row against tkd_cpu_attn_fwd, RoPE against
 * its inverse), so a harness bug shows here rather than as a GPU test that cannot fail. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "kernels/cpu/cpu_ops.h"
#include "tests/gpu_check.h"
#include "tests/ref64.h"
#include "tests/testutil.h"

static const tkd_test_tol kTol = {0.5, 0.1, "half a unit plus a tenth"};

static void test_check_counts_and_worst(void **state)
{
    (void)state;
    const double ref[6] = {1, 2, 3, 4, 5, 6}, got[6] = {1.2, 2, 3.9, 4, 5, 6.5};
    const size_t cols = 3;
    tkd_test_check k;
    tkd_test_check_begin(&k, "toy", kTol, tkd_test_where_rowcol, &cols);
    for (int i = 0; i < 6; i++)
        tkd_test_check_add(&k, i, got[i], ref[i], 0.0);
    assert_int_equal(k.n, 6);
    assert_int_equal(k.bad, 1); /* 3.9 vs 3: allowed 0.8 */
    assert_int_equal(k.worst_i, 2);
    assert_true(fabs(k.worst - 0.9 / 0.8) < 1e-12);
    char msg[512];
    tkd_test_check_describe(&k, msg, sizeof msg);
    assert_non_null(strstr(msg, "toy: 1 of 6 elements off"));
    assert_non_null(strstr(msg, "half a unit plus a tenth"));
    assert_non_null(strstr(msg, "[row 0, col 2]"));
    assert_true(fabs(tkd_test_check_norm(&k) - sqrt((0.04 + 0.81 + 0.25) / 91.0)) < 1e-12);
}

static void test_check_nan_stays_worst(void **state)
{
    (void)state;
    const uint16_t poison = 0xffff; /* what tkd_test_poison leaves */
    tkd_test_check k;
    tkd_test_check_begin(&k, "nan", kTol, NULL, NULL);
    tkd_test_check_add(&k, 0, 1.0, 1.0, 0.0);
    tkd_test_check_add(&k, 1, tkd_bf16_to_f32(poison), 1.0, 0.0);
    tkd_test_check_add(&k, 2, 100.0, 1.0, 0.0); /* a larger finite error does not hide the NaN */
    tkd_test_check_add(&k, 3, INFINITY, 1.0, 0.0);
    assert_int_equal(k.bad, 3);
    assert_int_equal(k.worst_i, 1);
    assert_true(isnan(k.worst));
    char msg[512];
    tkd_test_check_describe(&k, msg, sizeof msg);
    assert_non_null(strstr(msg, "worst [1]"));
}

static void test_check_zero_tolerance_and_extra(void **state)
{
    (void)state;
    tkd_test_check k;
    tkd_test_check_begin(&k, "bits", (tkd_test_tol){0, 0, "bit-identical"}, NULL, NULL);
    assert_true(tkd_test_check_add(&k, 0, 2.0, 2.0, 0.0) == 0.0);
    assert_int_equal(k.bad, 0);
    assert_true(isinf(tkd_test_check_add(&k, 1, 2.0, 2.0 + 1e-12, 0.0)));
    assert_int_equal(k.bad, 1);
    assert_true(tkd_test_check_add(&k, 2, 3.0, 2.0, 2.0) == 0.5); /* a per-element allowance */
    assert_int_equal(k.bad, 1);
    tkd_test_check ok;
    tkd_test_check_begin(&ok, "fine", kTol, NULL, NULL);
    tkd_test_check_add(&ok, 0, 1.0, 1.1, 0.0);
    tkd_test_check_end(&ok); /* passes */
    const uint16_t b[2] = {tkd_f32_to_bf16(1.0f), tkd_f32_to_bf16(-2.0f)};
    const double r[2] = {1.0, -2.0};
    tkd_test_check_bf16("bf16", b, r, 2, kTol, NULL, NULL, NULL);
    tkd_test_check_bf16_mat("bf16 mat", b, r, 2, 1, kTol, NULL);
}

/* ref64's attention row against tkd_cpu_attn_window_fwd (fp32) on a GQA shape, full causal and
 * with a window of 3 keys; row 0 is v_0 exactly. */
static void test_ref64_attention(void **state)
{
    (void)state;
    enum { B = 2, T = 9, H = 4, HKV = 2, DH = 8 };
    const size_t nq = (size_t)B * T * H * DH, nk = (size_t)B * T * HKV * DH;
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *y = malloc(nq * 4);
    float *att = malloc(sizeof(float) * B * H * T * T);
    assert_true(q && k && v && y && att);
    tkd_test_randn(q, nq, 1, 1.5f), tkd_test_randn(k, nk, 2, 1.5f), tkd_test_randn(v, nk, 3, 1.0f);
    for (int W = 0; W <= 3; W += 3) {
        tkd_cpu_attn_window_fwd(q, k, v, B, T, H, HKV, DH, W, att, y);
        const tkd_ref64_attn a = {B, T, H, HKV, DH, q, k, v, 0, NULL};
        double y64[DH], sc[T];
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int t = 0; t < T; t++) {
                    const double lse = tkd_ref64_attn_window_row(&a, W, b, h, t, y64, sc);
                    const float *yc = tkd_ref64_row(y, T, H, DH, b, t, h);
                    double sum = 0;
                    for (int j = W && t >= W ? t - W + 1 : 0; j <= t; j++)
                        sum += exp(sc[j] - lse);
                    assert_true(fabs(sum - 1.0) < 1e-12);
                    for (int d = 0; d < DH; d++)
                        assert_true(tkd_test_close(y64[d], yc[d], 1e-5, 1e-5));
                    if (t == 0)
                        assert_true(y64[0] == tkd_ref64_row(v, T, HKV, DH, b, 0, h / 2)[0]);
                }
    }
    free(q), free(k), free(v), free(y), free(att);
}

/* RoPE forward then backward gives the input back; the bound is bound·(|x_i| + |x_partner|). */
static void test_ref64_rope(void **state)
{
    (void)state;
    enum { N = 6, T = 3, NH = 2, DH = 8 };
    float c[T * DH / 2], s[T * DH / 2], f[N * NH * DH];
    uint16_t x[N * NH * DH], y[N * NH * DH];
    for (int i = 0; i < T * DH / 2; i++)
        c[i] = cosf(0.3f * (float)i), s[i] = sinf(0.3f * (float)i);
    tkd_test_randn(f, N * NH * DH, 7, 1.0f);
    for (int i = 0; i < N * NH * DH; i++)
        x[i] = tkd_f32_to_bf16(f[i]);
    double *fwd, *bound, *back, *bound2;
    tkd_ref64_rope(x, N, T, NH, DH, c, s, 0, 0.25, &fwd, &bound);
    assert_true(bound[1] == 0.25 * (fabs(tkd_bf16_to_f32(x[1])) + fabs(tkd_bf16_to_f32(x[1 + DH / 2]))));
    for (int i = 0; i < N * NH * DH; i++)
        y[i] = tkd_f32_to_bf16((float)fwd[i]);
    tkd_ref64_rope(y, N, T, NH, DH, c, s, 1, 0.0, &back, &bound2);
    for (int i = 0; i < N * NH * DH; i++) /* y was rounded to bf16: 2^-8 of the pair's size */
        assert_true(fabs(back[i] - tkd_bf16_to_f32(x[i])) <= 0.0079 * bound[i] / 0.25 + 1e-30);
    free(fwd), free(bound), free(back), free(bound2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check_counts_and_worst),  cmocka_unit_test(test_check_nan_stays_worst),
        cmocka_unit_test(test_check_zero_tolerance_and_extra), cmocka_unit_test(test_ref64_attention),
        cmocka_unit_test(test_ref64_rope),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
