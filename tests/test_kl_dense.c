/* test_kl_dense.c — the loss's dense mode (tkd_kl_params.dense: the teacher online, its full
 * distribution made chunk by chunk from its hidden states and LM head) against the same loss over a
 * cache holding every token (k = V, sorted columns and LSE cut from the same teacher logits): the
 * issue-24 check "the dense loss equals the offline loss on a cache with k = V for a small
 * vocabulary", for every divergence, τ 1 and 2, α 0.5 and 1, both gradient modes, awkward chunks and
 * masked rows; and its refusals. The two differ only in the order the teacher's columns are summed
 * (index order against sorted), so values agree to fp32 rounding. */
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

enum { N = 37, D = 24, DT = 20, V = 53 };

typedef struct dense_case {
    float h[N * D], w[V * D], th[N * DT], tw[V * DT], t[N * V];
    int32_t idx[N * V], labels[N];
    float tl[N * V], lse[N];
} dense_case;

static int no_draws(void *ctx, int n)
{
    (void)ctx, (void)n;
    return 0;
}

static void case_make(dense_case *c, double tau)
{
    tkd_test_randn(c->h, N * D, 5, 1.0f);
    tkd_test_randn(c->w, V * D, 6, 0.5f);
    tkd_test_randn(c->th, N * DT, 7, 1.0f);
    tkd_test_randn(c->tw, V * DT, 8, 0.8f);
    for (int i = 0; i < N; i++) {
        c->labels[i] = i % 6 == 4 ? -100 : (i * 11 + 3) % V;
        for (int v = 0; v < V; v++) {
            float s = 0.0f;
            for (int e = 0; e < DT; e++)
                s += c->th[i * DT + e] * c->tw[v * DT + e];
            c->t[i * V + v] = s;
        }
        tkd_test_cut_row(c->t + i * V, V, V, tau, 0, 1, no_draws, NULL, c->idx + i * V, c->tl + i * V, c->lse + i,
                         NULL);
    }
}

typedef struct run_out {
    tkd_kl_result res;
    float dh[N * D], dw[V * D];
} run_out;

static void run(const tkd_kl_params *p, const tkd_kl_batch *b, run_out *o)
{
    tkd_kl_cpu_ws *ws = NULL;
    memset(o, 0, sizeof *o);
    if (tkd_kl_cpu_ws_create(&ws, p, N, D, V) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    if (tkd_kl_cpu_forward(ws, p, b, &o->res, o->dh, o->dw) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    if (!p->grad_in_forward && tkd_kl_cpu_backward(ws, p, b, 1.0f, o->dh, o->dw) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    tkd_kl_cpu_ws_free(ws);
}

static double rel(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++)
        num += (a[i] - b[i]) * (double)(a[i] - b[i]), den += (double)b[i] * b[i];
    return sqrt(num / (den > 0.0 ? den : 1.0));
}

static void test_dense_equals_cache_of_every_token(void **state)
{
    (void)state;
    static dense_case c;
    static run_out a, d;
    const tkd_kl_divergence divs[] = {TKD_KL_DIVERGENCE_FKL, TKD_KL_DIVERGENCE_RKL, TKD_KL_DIVERGENCE_JSD,
                                      TKD_KL_DIVERGENCE_SKL, TKD_KL_DIVERGENCE_SRKL, TKD_KL_DIVERGENCE_TVD};
    double worst = 0.0;
    for (int ti = 0; ti < 2; ti++) {
        const double tau = ti ? 2.0 : 1.0;
        case_make(&c, tau);
        for (size_t di = 0; di < sizeof divs / sizeof divs[0]; di++)
            for (int ai = 0; ai < 2; ai++)
                for (int gif = 0; gif < 2; gif++) {
                    tkd_kl_params p;
                    tkd_kl_params_defaults(&p, V);
                    p.divergence = divs[di];
                    p.temperature = (float)tau;
                    p.alpha = ai ? 1.0f : 0.5f;
                    p.grad_in_forward = gif;
                    p.chunk_rows = 5; /* chunks of 5, the last of 2 */
                    const tkd_kl_batch cache = {.n = N, .d = D, .v = V, .h = c.h, .w = c.w, .topk_idx = c.idx,
                                                .topk_logit = c.tl, .teacher_lse = c.lse, .labels = c.labels};
                    const tkd_kl_batch dense = {.n = N, .d = D, .v = V, .h = c.h, .w = c.w, .labels = c.labels,
                                                .teacher_h = c.th, .teacher_w = c.tw, .teacher_d = DT};
                    run(&p, &cache, &a);
                    p.dense = 1;
                    run(&p, &dense, &d);
                    char what[96];
                    snprintf(what, sizeof what, "%s τ %g α %g %s", tkd_kl_divergence_name(divs[di]), tau,
                             (double)p.alpha, gif ? "grad in forward" : "recompute");
                    assert_int_equal(d.res.n_kept, a.res.n_kept);
                    if (!(fabs(d.res.loss - a.res.loss) <= 1e-5 * (1.0 + fabs(a.res.loss))) ||
                        !(fabs(d.res.kd - a.res.kd) <= 1e-5 * (1.0 + fabs(a.res.kd))))
                        fail_msg("%s: dense loss %.9g kd %.9g, cache of every token %.9g %.9g", what, d.res.loss,
                                 d.res.kd, a.res.loss, a.res.kd);
                    const double eh = rel(d.dh, a.dh, N * D), ew = rel(d.dw, a.dw, V * D);
                    if (!(eh <= 1e-5) || !(ew <= 1e-5))
                        fail_msg("%s: gradients differ: dH %.3g, dW %.3g (relative norms)", what, eh, ew);
                    worst = fmax(worst, fmax(eh, ew));
                    assert_true(a.res.kd > 0.0 || divs[di] == TKD_KL_DIVERGENCE_TVD);
                }
    }
    print_message("dense vs k = V cache: worst relative gradient difference %.3g\n", worst);
}

static void test_dense_refusals(void **state)
{
    (void)state;
    tkd_kl_params p;
    tkd_kl_params_defaults(&p, V);
    p.dense = 1;
    p.variant = TKD_KL_VARIANT_TAIL;
    tkd_kl_cpu_ws *ws = NULL;
    assert_int_equal(tkd_kl_cpu_ws_create(&ws, &p, N, D, V), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("dense (the teacher online) takes the teacher's whole distribution: variant renorm and "
                            "k = k_use = V = 53 (got tail, k 53, k_use 53)");
    p.variant = TKD_KL_VARIANT_RENORM;
    p.k_use = 20;
    assert_int_equal(tkd_kl_cpu_ws_create(&ws, &p, N, D, V), TKD_ERR_INVALID_ARG);
    p.k_use = V;
    assert_int_equal(tkd_kl_cpu_ws_create(&ws, &p, N, D, V), TKD_OK);
    static float h[N * D], w[V * D];
    int32_t labels[N] = {0};
    const tkd_kl_batch b = {.n = N, .d = D, .v = V, .h = h, .w = w, .labels = labels};
    tkd_kl_result res;
    assert_int_equal(tkd_kl_cpu_forward(ws, &p, &b, &res, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("dense: the batch has no teacher hidden states or LM head");
    tkd_kl_cpu_ws_free(ws);
}

TKD_TEST_MAIN(test_dense_equals_cache_of_every_token, test_dense_refusals)
