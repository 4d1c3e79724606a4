/* test_kl_ce_only.c — alpha = 0 with no teacher columns is plain cross-entropy through the fused
 * kernel (CE-only training, e.g. the demo's teacher), checked against CE computed here in double. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/loss/kl_loss.h"
#include "tests/testutil.h"

enum { N = 29, D = 6, V = 37 };

/* CE and its gradients in double, straight from the definition. */
static double ce_ref(const float *h, const float *w, const int32_t *y, double *dh, double *dw)
{
    double loss = 0;
    int kept = 0;
    for (int i = 0; i < N; i++)
        kept += y[i] != -100;
    memset(dh, 0, sizeof(double) * N * D);
    memset(dw, 0, sizeof(double) * V * D);
    for (int i = 0; i < N; i++) {
        if (y[i] == -100)
            continue;
        double s[V], m = -INFINITY, z = 0;
        for (int v = 0; v < V; v++) {
            s[v] = 0;
            for (int d = 0; d < D; d++)
                s[v] += (double)h[i * D + d] * w[v * D + d];
            m = fmax(m, s[v]);
        }
        for (int v = 0; v < V; v++)
            z += exp(s[v] - m);
        loss += (m + log(z) - s[y[i]]) / kept;
        for (int v = 0; v < V; v++) {
            double g = (exp(s[v] - m) / z - (v == y[i])) / kept;
            for (int d = 0; d < D; d++) {
                dh[i * D + d] += g * w[v * D + d];
                dw[v * D + d] += g * h[i * D + d];
            }
        }
    }
    return loss;
}

static void check_variant(tkd_kl_variant variant, int grad_in_forward)
{
    float h[N * D], w[V * D], dh[N * D], dw[V * D];
    int32_t y[N];
    double rdh[N * D], rdw[V * D];
    tkd_test_randn(h, N * D, 11, 1.0f);
    tkd_test_randn(w, V * D, 12, 1.0f);
    for (int i = 0; i < N; i++)
        y[i] = i % 5 == 3 ? -100 : (i * 7) % V;
    double ref = ce_ref(h, w, y, rdh, rdw);

    tkd_kl_params p;
    tkd_kl_params_defaults(&p, 0);
    p.variant = variant;
    p.alpha = 0.0f;
    p.k = p.k_use = p.s = 0;
    p.chunk_rows = 8; /* N = 29 is not a multiple: the last chunk is partial */
    p.grad_in_forward = grad_in_forward;
    tkd_kl_batch b = {.n = N, .d = D, .v = V, .h = h, .w = w, .labels = y};
    assert_int_equal(tkd_kl_validate(&p, &b), TKD_OK);
    tkd_kl_cpu_ws *ws = NULL;
    assert_int_equal(tkd_kl_cpu_ws_create(&ws, &p, N, D, V), TKD_OK);
    tkd_kl_result r;
    memset(dw, 0, sizeof dw);
    if (grad_in_forward) {
        assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &r, dh, dw), TKD_OK);
    } else {
        assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &r, NULL, NULL), TKD_OK);
        assert_int_equal(tkd_kl_cpu_backward(ws, &p, &b, 1.0f, dh, dw), TKD_OK);
    }
    /* fp32 logits and expf against double: 1e-5 relative on a loss of about log(37) + spread */
    assert_true(tkd_test_close(r.loss, ref, 1e-6, 1e-5));
    assert_true(tkd_test_close(r.ce, ref, 1e-6, 1e-5));
    assert_true(r.kd == 0.0);
    assert_int_equal(r.n_kept, N - N / 5 - (N % 5 > 3));
    for (int i = 0; i < N * D; i++)
        assert_true(tkd_test_close(dh[i], rdh[i], 1e-6, 1e-4));
    for (int i = 0; i < V * D; i++)
        assert_true(tkd_test_close(dw[i], rdw[i], 1e-6, 1e-4));
    tkd_kl_cpu_ws_free(ws);
}

static void test_ce_only_every_variant(void **state)
{
    (void)state;
    for (int v = 0; v <= TKD_KL_VARIANT_SAMPLED; v++)
        for (int g = 0; g <= 1; g++)
            check_variant((tkd_kl_variant)v, g);
}

static void test_no_teacher_needs_alpha_zero(void **state)
{
    (void)state;
    tkd_kl_params p;
    tkd_kl_params_defaults(&p, 0);
    p.k = p.k_use = 0;
    p.alpha = 0.5f; /* KD asked for, but no teacher columns: refused */
    assert_int_not_equal(tkd_kl_params_check(&p, V), TKD_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ce_only_every_variant),
        cmocka_unit_test(test_no_teacher_needs_alpha_zero),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
