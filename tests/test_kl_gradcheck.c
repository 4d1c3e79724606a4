/* test_kl_gradcheck.c — central finite differences of the KL loss w.r.t. H and W on a tiny case
 * (N = 4, D = 3, V = 7), through the float64 reference's loss, for every variant: the reference's
 * analytic gradients and the chunked CPU path's must both match them. */
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

enum { N = 4, D = 3, V = 7, K = 3, S = 3 };

typedef struct tiny {
    float h[N * D], w[V * D];
    int32_t idx[N * K], draws[N * S], labels[N];
    float tl[N * K], lse[N];
} tiny;

/* A fixed teacher per row: logits t_v, top-3 sorted largest first, LSE at τ_cache, and three tail
 * draws of which the first and third repeat (repeats must add up). Row 2 is masked. */
static void tiny_make(tiny *c, double tau_cache)
{
    tkd_test_randn(c->h, N * D, 5, 1.0f);
    tkd_test_randn(c->w, V * D, 6, 0.8f);
    float t[N * V];
    tkd_test_randn(t, N * V, 7, 2.0f);
    for (int i = 0; i < N; i++) {
        const float *ti = t + i * V;
        int used[V] = {0};
        for (int j = 0; j < K; j++) { /* selection sort of the top-k */
            int best = -1;
            for (int u = 0; u < V; u++)
                if (!used[u] && (best < 0 || ti[u] > ti[best]))
                    best = u;
            used[best] = 1;
            c->idx[i * K + j] = best;
            c->tl[i * K + j] = ti[best];
        }
        double m = -INFINITY, sum = 0.0;
        for (int u = 0; u < V; u++)
            m = fmax(m, ti[u] / tau_cache);
        for (int u = 0; u < V; u++)
            sum += exp(ti[u] / tau_cache - m);
        c->lse[i] = (float)(m + log(sum));
        int tail[V], nt = 0;
        for (int u = 0; u < V; u++)
            if (!used[u])
                tail[nt++] = u;
        c->draws[i * S + 0] = tail[i % nt];
        c->draws[i * S + 1] = tail[(i + 1) % nt];
        c->draws[i * S + 2] = tail[i % nt];
        c->labels[i] = i == 2 ? -100 : (i * 3 + 1) % V;
    }
}

static tkd_kl_batch tiny_batch(tiny *c)
{
    tkd_kl_batch b = {.n = N, .d = D, .v = V, .h = c->h, .w = c->w, .topk_idx = c->idx, .topk_logit = c->tl,
                      .teacher_lse = c->lse, .tail_idx = c->draws, .labels = c->labels};
    return b;
}

static double ref_loss(const tkd_kl_params *p, tiny *c)
{
    tkd_kl_batch b = tiny_batch(c);
    tkd_kl_result r;
    if (tkd_kl_ref_f64(p, &b, &r, NULL, NULL) != TKD_OK)
        fail_msg("ref: %s", tkd_error_msg());
    return r.loss;
}

/* ∂loss/∂x by central differences, stepping the fp32 input itself: the step actually taken is
 * x+ − x− after rounding, so the quotient has no fp32 rounding error in its denominator. */
static double fd(const tkd_kl_params *p, tiny *c, float *x)
{
    const float x0 = *x;
    const float xp = x0 + 1e-3f, xm = x0 - 1e-3f;
    *x = xp;
    double lp = ref_loss(p, c);
    *x = xm;
    double lm = ref_loss(p, c);
    *x = x0;
    return (lp - lm) / ((double)xp - (double)xm);
}

static void check_variant(tkd_kl_variant var, double tau, double alpha, int k_use, int s)
{
    tiny c;
    tiny_make(&c, tau);
    tkd_kl_params p = tkd_test_kl_params(var, tau, alpha, K, k_use, s);
    tkd_kl_batch b = tiny_batch(&c);
    double dh[N * D], dw[V * D], fd_h[N * D], fd_w[V * D];
    tkd_kl_result r;
    assert_int_equal(tkd_kl_ref_f64(&p, &b, &r, dh, dw), TKD_OK);
    assert_int_equal(r.n_kept, 3);
    double gmax = 0.0;
    for (int i = 0; i < N * D; i++)
        gmax = fmax(gmax, fabs(fd_h[i] = fd(&p, &c, &c.h[i])));
    for (int i = 0; i < V * D; i++)
        gmax = fmax(gmax, fabs(fd_w[i] = fd(&p, &c, &c.w[i])));
    assert_true(gmax > 1e-2); /* a gradient that is not all zero */
    /* central differences with step 1e-3 have truncation error ~ step²·|f'''| ≈ 1e-6 here; double
     * rounding of the loss adds ~1e-16/1e-3. 1e-5 of the largest gradient leaves a margin. */
    const double tol = 1e-5 * gmax;
    for (int i = 0; i < N * D; i++)
        if (fabs(dh[i] - fd_h[i]) > tol)
            fail_msg("%s tau=%g dH[%d]: ref %.9g, finite differences %.9g", tkd_kl_variant_name(var), tau, i,
                     dh[i], fd_h[i]);
    for (int i = 0; i < V * D; i++)
        if (fabs(dw[i] - fd_w[i]) > tol)
            fail_msg("%s tau=%g dW[%d]: ref %.9g, finite differences %.9g", tkd_kl_variant_name(var), tau, i,
                     dw[i], fd_w[i]);
    for (int e = 0; e < D; e++) /* the masked row */
        assert_true(dh[2 * D + e] == 0.0);

    /* the chunked fp32 path, chunks of 3 rows (N = 4 is not a multiple): fp32 logits and exps add
     * ~1e-7 relative, so the same 1e-5 of the largest gradient plus 1e-5 for fp32 */
    float fh[N * D], fw[V * D] = {0};
    tkd_kl_cpu_ws *ws = NULL;
    p.chunk_rows = 3;
    tkd_kl_result rc;
    assert_int_equal(tkd_kl_cpu_ws_create(&ws, &p, N, D, V), TKD_OK);
    assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &rc, NULL, NULL), TKD_OK);
    assert_int_equal(tkd_kl_cpu_backward(ws, &p, &b, 1.0f, fh, fw), TKD_OK);
    tkd_kl_cpu_ws_free(ws);
    assert_true(tkd_test_close(rc.loss, r.loss, 1e-7, 1e-6));
    for (int i = 0; i < N * D; i++)
        if (fabs(fh[i] - fd_h[i]) > 2 * tol)
            fail_msg("%s tau=%g dH[%d]: chunked %.9g, finite differences %.9g", tkd_kl_variant_name(var), tau, i,
                     (double)fh[i], fd_h[i]);
    for (int i = 0; i < V * D; i++)
        if (fabs(fw[i] - fd_w[i]) > 2 * tol)
            fail_msg("%s tau=%g dW[%d]: chunked %.9g, finite differences %.9g", tkd_kl_variant_name(var), tau, i,
                     (double)fw[i], fd_w[i]);
}

static void test_gradcheck_renorm(void **state)
{
    (void)state;
    check_variant(TKD_KL_VARIANT_RENORM, 1.0, 0.5, K, 0);
    check_variant(TKD_KL_VARIANT_RENORM, 2.0, 1.0, 2, 0);
}

static void test_gradcheck_tail(void **state)
{
    (void)state;
    check_variant(TKD_KL_VARIANT_TAIL, 1.0, 0.5, K, 0);
    check_variant(TKD_KL_VARIANT_TAIL, 2.0, 1.0, 1, 0);
}

static void test_gradcheck_sampled(void **state)
{
    (void)state;
    check_variant(TKD_KL_VARIANT_SAMPLED, 1.0, 0.5, K, S);
    check_variant(TKD_KL_VARIANT_SAMPLED, 2.0, 1.0, 0, S); /* plain sampled distillation */
    check_variant(TKD_KL_VARIANT_SAMPLED, 2.0, 0.0, 2, 0); /* CE only */
}

TKD_TEST_MAIN(test_gradcheck_renorm, test_gradcheck_tail, test_gradcheck_sampled)
