/* test_moe.c — the mixture-of-experts layer (kernels/cpu/cpu_moe.h): the fast CPU path against the
 * double reference tkd_ref_moe_fwd over awkward shapes for both families (Qwen3-MoE, gpt-oss): one
 * token, odd D and I, k = 1 and k = E, an expert no token picks and one every token picks, exactly
 * tied router logits, enough rows per expert for the serial-experts branch; the clamped SwiGLU
 * beyond its limit; the converter of gpt-oss's interleaved expert tensors; the error messages.
 * `test_moe fixtures` (ctest test_moe_transformers, registered once tests/fixtures/moe/ exists)
 * checks both paths against the outputs transformers wrote (tests/moe_reference.py).
 *
 * Tolerances. Routing must agree exactly (the same experts in the same order): the random cases
 * have no logits within fp32 rounding of each other at the k-th place, and exact ties are broken
 * the same way by construction. Routing weights: |fast − ref| ≤ 1e-6 + 1e-5·|ref| — fp32 logits
 * over D ≤ 64 terms of size O(1) (error ≲ 64·6e-8·8 ≈ 3e-6 before the softmax's contraction), then
 * a few fp32 exps and divisions. Outputs: |fast − ref| ≤ 1e-5·max|ref| + 1e-4·|ref|, max over the
 * case: an fp32 GEMM's rounding is relative to the sum of |terms|, which follows the scale of the
 * layer's outputs (weights of std 1/sqrt(fan-in)), not one output that may cancel to near 0; three
 * GEMM levels of ≤ 64 terms give ≲ 3·64·6e-8 ≈ 1e-5 worst case. Seen: ≤ 1.3e-6·max|ref| (with
 * TKD_TEST_MOE_VERBOSE=1 each case prints its worst), the largest where x_std 12 drives the clamp.
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
#include <sys/stat.h>

#include "common/mxfp4_codec.h"
#include "kernels/cpu/cpu_moe.h"
#include "kernels/cpu/cpu_ops_ref.h"
#include "kernels/moe.h"
#include "tests/testutil.h"

#define W_ATOL 1e-6
#define W_RTOL 1e-5
#define Y_ATOL 1e-5 /* times max |ref| of the case */
#define Y_RTOL 1e-4

/* One layer's tensors in the op's layout, owned. */
typedef struct moe_case {
    tkd_moe_params p;
    int N;
    float *x, *rw, *rb, *wg, *wu, *wd, *bg, *bu, *bd;
} moe_case;

static float *rnd(size_t n, uint64_t seed, float std)
{
    float *v = calloc(n + 1, sizeof(float));
    assert_non_null(v);
    tkd_test_randn(v, n, seed, std);
    return v;
}

/* Random x ~ N(0, x_std²) and weights scaled by 1/sqrt(fan-in); biases (gpt-oss) ~ N(0, 0.5²). */
static moe_case case_make(tkd_moe_params p, int N, uint64_t seed, float x_std)
{
    size_t D = (size_t)p.D, I = (size_t)p.inter, E = (size_t)p.E;
    moe_case c = {.p = p, .N = N};
    c.x = rnd((size_t)N * D, seed, x_std);
    c.rw = rnd(E * D, seed + 1, 1.0f / sqrtf((float)D));
    c.wg = rnd(E * I * D, seed + 2, 1.0f / sqrtf((float)D));
    c.wu = rnd(E * I * D, seed + 3, 1.0f / sqrtf((float)D));
    c.wd = rnd(E * D * I, seed + 4, 1.0f / sqrtf((float)I));
    if (p.router == TKD_MOE_ROUTER_TOPK_SOFTMAX) {
        c.rb = rnd(E, seed + 5, 0.5f);
        c.bg = rnd(E * I, seed + 6, 0.5f);
        c.bu = rnd(E * I, seed + 7, 0.5f);
        c.bd = rnd(E * D, seed + 8, 0.5f);
    }
    return c;
}

static void case_free(moe_case *c)
{
    float *all[] = {c->x, c->rw, c->rb, c->wg, c->wu, c->wd, c->bg, c->bu, c->bd};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        free(all[i]);
}

static tkd_moe_weights case_weights(const moe_case *c)
{
    tkd_moe_weights w = {c->rw, c->rb, c->wg, c->wu, c->wd, c->bg, c->bu, c->bd, {{NULL}, {NULL}}};
    return w;
}

/* What a run gives: y and the routing, owned. */
typedef struct moe_out {
    float *y, *w;
    int32_t *e;
} moe_out;

static void out_free(moe_out *o)
{
    free(o->y);
    free(o->w);
    free(o->e);
}

/* The fast path, outputs poisoned first so an unwritten element fails the comparison. */
static moe_out run_fast(const moe_case *c)
{
    size_t nk = (size_t)c->N * (size_t)c->p.k;
    moe_out o = {malloc(sizeof(float) * (size_t)c->N * (size_t)c->p.D + 1), malloc(sizeof(float) * nk),
                 malloc(sizeof(int32_t) * nk)};
    assert_true(o.y && o.w && o.e);
    for (size_t i = 0; i < (size_t)c->N * (size_t)c->p.D; i++)
        o.y[i] = NAN;
    for (size_t i = 0; i < nk; i++)
        o.w[i] = NAN, o.e[i] = -1;
    tkd_cpu_moe_ws *ws = NULL;
    assert_int_equal(tkd_cpu_moe_ws_create(&ws, &c->p, c->N), TKD_OK);
    tkd_moe_weights w = case_weights(c);
    assert_int_equal(tkd_cpu_moe_fwd(ws, &w, c->x, c->N, o.y, o.e, o.w), TKD_OK);
    tkd_cpu_moe_ws_free(ws);
    return o;
}

/* The reference's outputs rounded to float (the comparison is in double). */
typedef struct ref_out {
    double *y, *w;
    int32_t *e;
} ref_out;

static ref_out run_ref(const moe_case *c)
{
    size_t nk = (size_t)c->N * (size_t)c->p.k;
    ref_out r = {malloc(sizeof(double) * (size_t)c->N * (size_t)c->p.D + 1), malloc(sizeof(double) * nk),
                 malloc(sizeof(int32_t) * nk)};
    assert_true(r.y && r.w && r.e);
    tkd_moe_weights w = case_weights(c);
    tkd_ref_moe_fwd(&c->p, &w, c->x, c->N, r.y, r.e, r.w);
    return r;
}

static void ref_free(ref_out *r)
{
    free(r->y);
    free(r->w);
    free(r->e);
}

/* Routing equal, weights and y close; what names the case in a failure. */
static void expect_match(const char *what, int N, int D, int k, const float *y, const int32_t *e,
                         const float *w, const double *ry, const int32_t *re, const double *rw)
{
    for (int i = 0; i < N * k; i++) {
        if (e[i] != re[i])
            fail_msg("%s: token %d slot %d picks expert %d, the reference %d", what, i / k, i % k, e[i], re[i]);
        if (!tkd_test_close(w[i], rw[i], W_ATOL, W_RTOL))
            fail_msg("%s: weight[token %d slot %d] %.9g vs reference %.9g", what, i / k, i % k, w[i], rw[i]);
    }
    double scale = 0, worst = 0;
    for (int i = 0; i < N * D; i++)
        scale = fmax(scale, fabs(ry[i]));
    for (int i = 0; i < N * D; i++) {
        worst = fmax(worst, fabs(y[i] - ry[i]) / scale);
        if (!tkd_test_close(y[i], ry[i], Y_ATOL * scale, Y_RTOL))
            fail_msg("%s: y[n=%d d=%d] %.9g vs reference %.9g (max |ref| %.3g)", what, i / D, i % D, y[i],
                     ry[i], scale);
    }
    if (getenv("TKD_TEST_MOE_VERBOSE"))
        printf("%s: max |y - ref| / max |ref| = %.3g (max |ref| %.3g)\n", what, worst, scale);
}

/* Fast against reference; returns the reference's routing counts per expert in hits (E) if asked. */
static void check_case(const char *what, const moe_case *c, int *hits)
{
    moe_out o = run_fast(c);
    ref_out r = run_ref(c);
    expect_match(what, c->N, c->p.D, c->p.k, o.y, o.e, o.w, r.y, r.e, r.w);
    if (hits) {
        memset(hits, 0, sizeof(int) * (size_t)c->p.E);
        for (int i = 0; i < c->N * c->p.k; i++)
            hits[r.e[i]]++;
    }
    out_free(&o);
    ref_free(&r);
}

typedef struct shape {
    int N, D, inter, E, k;
} shape;

/* N = 1, odd D and I, k = 1 and k = E, N·k not a multiple of anything; the last two put ≥ 128 rows
 * on each expert on average, the branch where experts run one after another with threaded sgemms. */
static const shape g_shapes[] = {
    {1, 7, 5, 4, 2},   {37, 33, 19, 8, 3}, {61, 16, 9, 6, 1}, {13, 9, 11, 5, 5},
    {29, 64, 40, 16, 4}, {700, 17, 13, 4, 1}, {301, 21, 15, 3, 2},
};

static void test_qwen3_shapes(void **s)
{
    (void)s;
    char what[96];
    for (size_t i = 0; i < sizeof g_shapes / sizeof *g_shapes; i++) {
        const shape *sh = &g_shapes[i];
        for (int norm = 0; norm <= 1; norm++) {
            moe_case c = case_make(tkd_moe_params_qwen3(sh->D, sh->inter, sh->E, sh->k, norm), sh->N, 100 + i, 1.0f);
            snprintf(what, sizeof what, "qwen3 N %d D %d I %d E %d k %d norm %d", sh->N, sh->D, sh->inter, sh->E,
                     sh->k, norm);
            check_case(what, &c, NULL);
            case_free(&c);
        }
    }
}

/* Counts gate pre-activations above limit and up pre-activations below −limit (biases included),
 * over every token and every expert, so a test can show the clamp was exercised. */
static void count_clamped(const moe_case *c, int *g_hi, int *u_lo)
{
    int D = c->p.D, I = c->p.inter;
    *g_hi = *u_lo = 0;
    for (int n = 0; n < c->N; n++)
        for (int r = 0; r < c->p.E * I; r++) {
            double g = c->bg[r], u = c->bu[r];
            for (int d = 0; d < D; d++) {
                g += (double)c->x[(size_t)n * D + d] * c->wg[(size_t)r * D + d];
                u += (double)c->x[(size_t)n * D + d] * c->wu[(size_t)r * D + d];
            }
            *g_hi += g > c->p.limit;
            *u_lo += u < -c->p.limit;
        }
}

static void test_gpt_oss_shapes(void **s)
{
    (void)s;
    char what[112];
    for (size_t i = 0; i < sizeof g_shapes / sizeof *g_shapes; i++) {
        const shape *sh = &g_shapes[i];
        /* x_std 1 keeps the experts unclamped; 12 drives many gates and ups past ±7 */
        const float x_std[] = {1.0f, 12.0f};
        for (int j = 0; j < 2; j++) {
            moe_case c = case_make(tkd_moe_params_gpt_oss(sh->D, sh->inter, sh->E, sh->k, 7.0f), sh->N, 200 + i,
                                   x_std[j]);
            snprintf(what, sizeof what, "gpt-oss N %d D %d I %d E %d k %d x_std %g", sh->N, sh->D, sh->inter,
                     sh->E, sh->k, (double)x_std[j]);
            if (j == 1 && sh->N > 1) {
                int g_hi, u_lo;
                count_clamped(&c, &g_hi, &u_lo);
                if (g_hi == 0 || u_lo == 0)
                    fail_msg("%s: the clamp is not exercised (%d gates > limit, %d ups < -limit)", what, g_hi, u_lo);
            }
            check_case(what, &c, NULL);
            case_free(&c);
        }
    }
}

/* Router row `hot` = +8·e_0 and row `cold` = −8·e_0 with x[:, 0] ≥ 1: every token picks hot, none
 * picks cold (the other logits are O(1)). */
static void rig_hot_cold(moe_case *c, int hot, int cold)
{
    int D = c->p.D;
    for (int n = 0; n < c->N; n++)
        c->x[(size_t)n * D] = 1.0f + fabsf(c->x[(size_t)n * D]);
    memset(c->rw + (size_t)hot * D, 0, sizeof(float) * (size_t)D);
    memset(c->rw + (size_t)cold * D, 0, sizeof(float) * (size_t)D);
    c->rw[(size_t)hot * D] = 8.0f;
    c->rw[(size_t)cold * D] = -8.0f;
    if (c->rb)
        c->rb[hot] = c->rb[cold] = 0.0f;
}

static void test_expert_by_none_and_by_all(void **s)
{
    (void)s;
    tkd_moe_params ps[] = {tkd_moe_params_qwen3(19, 7, 6, 2, 1), tkd_moe_params_gpt_oss(19, 7, 6, 2, 7.0f)};
    for (int f = 0; f < 2; f++) {
        moe_case c = case_make(ps[f], 45, 300 + f, 1.0f);
        rig_hot_cold(&c, 2, 4);
        int hits[6];
        check_case(f ? "gpt-oss hot/cold" : "qwen3 hot/cold", &c, hits);
        assert_int_equal(hits[2], 45); /* every token */
        assert_int_equal(hits[4], 0);  /* no token: its rows are empty in the sorted buffers */
        case_free(&c);
    }
}

/* Exactly tied router logits: the lower expert index comes first, in both paths. */
static void test_ties(void **s)
{
    (void)s;
    for (int f = 0; f < 2; f++) {
        int D = 11, E = 5, N = 9;
        for (int k = 1; k <= 3; k++) {
            tkd_moe_params p = f ? tkd_moe_params_gpt_oss(D, 6, E, k, 7.0f) : tkd_moe_params_qwen3(D, 6, E, k, 1);
            /* rows 1 and 3 equal and ahead of the rest: k = 1 picks 1, k = 2 picks [1, 3] */
            moe_case c = case_make(p, N, 400 + f, 1.0f);
            rig_hot_cold(&c, 1, 0);
            memcpy(c.rw + 3 * D, c.rw + 1 * D, sizeof(float) * (size_t)D);
            if (c.rb)
                c.rb[3] = c.rb[1];
            moe_out o = run_fast(&c);
            for (int n = 0; n < N; n++) {
                assert_int_equal(o.e[n * k], 1);
                if (k >= 2)
                    assert_int_equal(o.e[n * k + 1], 3);
                if (k >= 2 && p.router == TKD_MOE_ROUTER_TOPK_SOFTMAX)
                    assert_true(o.w[n * k] == o.w[n * k + 1]); /* equal logits, equal weights */
            }
            check_case(f ? "gpt-oss tie 1=3" : "qwen3 tie 1=3", &c, NULL);
            out_free(&o);
            /* every logit equal (zero router): experts 0..k-1 in order, weights 1/k */
            memset(c.rw, 0, sizeof(float) * (size_t)E * D);
            if (c.rb)
                memset(c.rb, 0, sizeof(float) * (size_t)E);
            o = run_fast(&c);
            for (int n = 0; n < N; n++)
                for (int j = 0; j < k; j++) {
                    assert_int_equal(o.e[n * k + j], j);
                    assert_true(fabsf(o.w[n * k + j] - 1.0f / (float)k) <= 1e-7f);
                }
            check_case(f ? "gpt-oss all tied" : "qwen3 all tied", &c, NULL);
            out_free(&o);
            case_free(&c);
        }
    }
}

/* Without norm_topk_prob the weights are the softmax over all E experts, not renormalised. */
static void test_qwen3_norm_topk_prob(void **s)
{
    (void)s;
    moe_case c = case_make(tkd_moe_params_qwen3(8, 4, 4, 2, 0), 1, 500, 1.0f);
    memset(c.rw, 0, sizeof(float) * 4 * 8); /* all logits 0: p = 1/4 each */
    moe_out o = run_fast(&c);
    assert_true(fabsf(o.w[0] - 0.25f) <= 1e-7f && fabsf(o.w[1] - 0.25f) <= 1e-7f);
    out_free(&o);
    c.p.norm_topk_prob = 1;
    o = run_fast(&c);
    assert_true(fabsf(o.w[0] - 0.5f) <= 1e-7f && fabsf(o.w[1] - 0.5f) <= 1e-7f);
    out_free(&o);
    case_free(&c);
}

/* The clamped SwiGLU at and beyond its limit: g clamps above only, u on both sides, u gets +1. */
static void test_swiglu_clamp(void **s)
{
    (void)s;
    const float L = 7.0f, A = 1.702f;
    const float g[] = {100.0f, 7.5f, 7.0f, 0.0f, -3.0f, -20.0f, 2.0f, 2.0f, 2.0f, 2.0f};
    const float u[] = {100.0f, -9.0f, -7.0f, 5.0f, 0.0f, 0.0f, 8.0f, -8.0f, -1.0f, 0.5f};
    enum { n = sizeof g / sizeof *g };
    float h[n];
    double hr[n], gd[n], ud[n];
    tkd_cpu_swiglu_clamp_fwd(g, u, n, L, A, h);
    for (int i = 0; i < n; i++)
        gd[i] = g[i], ud[i] = u[i];
    tkd_ref_swiglu_clamp_fwd(gd, ud, n, L, A, hr);
    const double a = (double)A; /* α as the fp32 the kernels (and torch's fp32 tensors) use */
    double s7 = 7.0 / (1.0 + exp(-a * 7.0)); /* glu at the limit */
    double s2 = 2.0 / (1.0 + exp(-a * 2.0));
    double want[n] = {8.0 * s7,  -6.0 * s7, -6.0 * s7, 0.0, -3.0 / (1.0 + exp(a * 3.0)),
                      -20.0 / (1.0 + exp(a * 20.0)), 8.0 * s2, -6.0 * s2, 0.0, 1.5 * s2};
    for (int i = 0; i < n; i++) {
        if (!tkd_test_close(hr[i], want[i], 1e-15, 1e-12))
            fail_msg("reference h(g %g, u %g) = %.17g, want %.17g", (double)g[i], (double)u[i], hr[i], want[i]);
        /* fp32 of one exp, one division and two products: a few ulp */
        if (!tkd_test_close(h[i], want[i], 1e-30, 1e-6))
            fail_msg("fast h(g %g, u %g) = %.9g, want %.9g", (double)g[i], (double)u[i], (double)h[i], want[i]);
    }
    assert_true(h[5] != 0.0f && h[5] > -1e-12f); /* g is not clamped from below: tiny, not zero */
    /* in place, as the op calls it */
    float gi[n];
    memcpy(gi, g, sizeof gi);
    tkd_cpu_swiglu_clamp_fwd(gi, u, n, L, A, gi);
    assert_memory_equal(gi, h, sizeof h);
}

/* gpt-oss's tensors as transformers holds them, each element naming its place: the converter puts
 * even columns in the gate, odd ones in up, and transposes down. */
static void test_gpt_oss_converter_layout(void **s)
{
    (void)s;
    enum { E = 3, D = 5, I = 4 };
    static float gu[E * D * 2 * I], gub[E * 2 * I], dn[E * I * D];
    static float wg[E * I * D], wu[E * I * D], bg[E * I], bu[E * I], wd[E * D * I];
    for (int e = 0; e < E; e++) {
        for (int d = 0; d < D; d++)
            for (int c = 0; c < 2 * I; c++)
                gu[(e * D + d) * 2 * I + c] = (float)(e * 10000 + d * 100 + c);
        for (int c = 0; c < 2 * I; c++)
            gub[e * 2 * I + c] = (float)(-e * 100 - c);
        for (int i = 0; i < I; i++)
            for (int d = 0; d < D; d++)
                dn[(e * I + i) * D + d] = (float)(e * 10000 + i * 100 + d) + 0.5f;
    }
    tkd_moe_from_gpt_oss(E, D, I, gu, gub, dn, wg, wu, bg, bu, wd);
    for (int e = 0; e < E; e++)
        for (int i = 0; i < I; i++) {
            for (int d = 0; d < D; d++) {
                assert_true(wg[(e * I + i) * D + d] == (float)(e * 10000 + d * 100 + 2 * i));
                assert_true(wu[(e * I + i) * D + d] == (float)(e * 10000 + d * 100 + 2 * i + 1));
                assert_true(wd[(e * D + d) * I + i] == (float)(e * 10000 + i * 100 + d) + 0.5f);
            }
            assert_true(bg[e * I + i] == (float)(-e * 100 - 2 * i));
            assert_true(bu[e * I + i] == (float)(-e * 100 - 2 * i - 1));
        }
}

/* GptOssExperts' own arithmetic on the interleaved tensors (gate_up = x·W[e] + b, gate = [::2],
 * up = [1::2], out = h·down[e] + b_down), in double, for the routing `sel`/`wt`: y (N, D). */
static void gpt_oss_experts_interleaved(int N, int D, int I, int k, const float *x, const float *gu,
                                        const float *gub, const float *dn, const float *bd,
                                        const int32_t *sel, const double *wt, double *y)
{
    double *h = malloc(sizeof(double) * (size_t)I);
    assert_non_null(h);
    for (int n = 0; n < N; n++)
        for (int d = 0; d < D; d++)
            y[(size_t)n * D + d] = 0;
    for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) {
            int e = sel[n * k + j];
            for (int i = 0; i < I; i++) {
                double g = gub[(size_t)e * 2 * I + 2 * i], u = gub[(size_t)e * 2 * I + 2 * i + 1];
                for (int d = 0; d < D; d++) {
                    g += (double)x[(size_t)n * D + d] * gu[((size_t)e * D + d) * 2 * I + 2 * i];
                    u += (double)x[(size_t)n * D + d] * gu[((size_t)e * D + d) * 2 * I + 2 * i + 1];
                }
                g = g < 7.0 ? g : 7.0;
                u = u < -7.0 ? -7.0 : u > 7.0 ? 7.0 : u;
                h[i] = (u + 1.0) * g / (1.0 + exp(-(double)1.702f * g)); /* α in fp32, as torch */
            }
            for (int d = 0; d < D; d++) {
                double o = bd[(size_t)e * D + d];
                for (int i = 0; i < I; i++)
                    o += h[i] * dn[((size_t)e * I + i) * D + d];
                y[(size_t)n * D + d] += wt[n * k + j] * o;
            }
        }
    free(h);
}

/* The op on converted weights computes what GptOssExperts computes on the interleaved ones. */
static void test_gpt_oss_converter_semantics(void **s)
{
    (void)s;
    int N = 23, D = 13, I = 9, E = 5, k = 3;
    moe_case c = case_make(tkd_moe_params_gpt_oss(D, I, E, k, 7.0f), N, 600, 6.0f);
    float *gu = rnd((size_t)E * D * 2 * I, 601, 1.0f / sqrtf((float)D));
    float *gub = rnd((size_t)E * 2 * I, 602, 0.5f);
    float *dn = rnd((size_t)E * I * D, 603, 1.0f / sqrtf((float)I));
    tkd_moe_from_gpt_oss(E, D, I, gu, gub, dn, c.wg, c.wu, c.bg, c.bu, c.wd);
    ref_out r = run_ref(&c);
    double *y = malloc(sizeof(double) * (size_t)N * D);
    assert_non_null(y);
    gpt_oss_experts_interleaved(N, D, I, k, c.x, gu, gub, dn, c.bd, r.e, r.w, y);
    for (int i = 0; i < N * D; i++)
        if (!tkd_test_close(r.y[i], y[i], 1e-12, 1e-10)) /* both double, different loop order */
            fail_msg("y[n=%d d=%d]: op on converted weights %.17g, interleaved %.17g", i / D, i % D, r.y[i], y[i]);
    check_case("gpt-oss converted", &c, NULL);
    free(y);
    ref_free(&r);
    free(gu);
    free(gub);
    free(dn);
    case_free(&c);
}

/* MXFP4 experts (params.mxfp4, the stacks' q): the op decodes an expert's matrices as it runs them
 * and gives the bits of the same op on the decoded fp32 stacks (decoding is exact), with the experts
 * run one per thread (few rows) and one after another (many); D or I not a multiple of 32 is refused. */
static void test_mxfp4_experts(void **s)
{
    (void)s;
    enum { D = 64, I = 96, E = 6, K = 2 };
    const int rows[3] = {E * I, E * I, E * D}, groups[3] = {D / 32, D / 32, I / 32};
    uint8_t *blocks[3], *scales[3];
    float *deq[3];
    uint64_t r = 12345;
    for (int j = 0; j < 3; j++) {
        size_t nb = (size_t)rows[j] * groups[j];
        blocks[j] = malloc(nb * 16), scales[j] = malloc(nb), deq[j] = malloc(sizeof(float) * nb * 32);
        assert_true(blocks[j] && scales[j] && deq[j]);
        for (size_t i = 0; i < nb * 16; i++)
            blocks[j][i] = (uint8_t)((r = r * 6364136223846793005ull + 1442695040888963407ull) >> 56);
        for (size_t i = 0; i < nb; i++) /* 2^-6 .. 2^-3: values up to 0.75 */
            scales[j][i] = (uint8_t)(121 + ((r = r * 6364136223846793005ull + 1442695040888963407ull) >> 62));
        assert_int_equal(tkd_mxfp4_decode_f32(blocks[j], scales[j], rows[j], groups[j], deq[j], "test"), TKD_OK);
    }
    const int Ns[2] = {53, 800}; /* 53·2 < 6·128: experts in parallel; 800·2: one after another */
    for (int t = 0; t < 2; t++) {
        moe_case c = case_make(tkd_moe_params_gpt_oss(D, I, E, K, 7.0f), Ns[t], 900 + t, 1.0f);
        tkd_moe_weights w = case_weights(&c);
        w.w_gate = deq[0], w.w_up = deq[1], w.w_down = deq[2];
        tkd_moe_params pq = c.p;
        pq.mxfp4 = 1;
        tkd_moe_weights wq = w;
        wq.w_gate = wq.w_up = wq.w_down = NULL;
        for (int j = 0; j < 3; j++)
            wq.q.blocks[j] = blocks[j], wq.q.scales[j] = scales[j];
        float *y = malloc(sizeof(float) * (size_t)Ns[t] * D), *yq = malloc(sizeof(float) * (size_t)Ns[t] * D);
        tkd_cpu_moe_ws *ws = NULL, *wsq = NULL;
        assert_int_equal(tkd_cpu_moe_ws_create(&ws, &c.p, Ns[t]), TKD_OK);
        assert_int_equal(tkd_cpu_moe_ws_create(&wsq, &pq, Ns[t]), TKD_OK);
        assert_int_equal(tkd_cpu_moe_fwd(ws, &w, c.x, Ns[t], y, NULL, NULL), TKD_OK);
        assert_int_equal(tkd_cpu_moe_fwd(wsq, &wq, c.x, Ns[t], yq, NULL, NULL), TKD_OK);
        assert_memory_equal(y, yq, sizeof(float) * (size_t)Ns[t] * D);
        double mx = 0;
        for (int i = 0; i < Ns[t] * D; i++)
            mx = fmax(mx, fabs(y[i]));
        assert_true(mx > 0.1); /* the experts did something */
        tkd_cpu_moe_ws_free(ws), tkd_cpu_moe_ws_free(wsq);
        free(y), free(yq);
        case_free(&c);
    }
    tkd_moe_params bad = tkd_moe_params_gpt_oss(48, I, E, K, 7.0f);
    bad.mxfp4 = 1;
    tkd_cpu_moe_ws *ws = NULL;
    assert_int_equal(tkd_cpu_moe_ws_create(&ws, &bad, 4), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("MXFP4 experts need hidden 48 and intermediate 96 to be multiples of 32");
    for (int j = 0; j < 3; j++)
        free(blocks[j]), free(scales[j]), free(deq[j]);
}

static void test_errors(void **s)
{
    (void)s;
    tkd_cpu_moe_ws *ws = NULL;
    tkd_moe_params p = tkd_moe_params_qwen3(8, 4, 4, 5, 1);
    assert_int_equal(tkd_cpu_moe_ws_create(&ws, &p, 4), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("experts per token 5 must lie in 1..4");
    assert_null(ws);
    p = tkd_moe_params_gpt_oss(8, 4, 4, 2, 0.0f);
    assert_int_equal(tkd_cpu_moe_ws_create(&ws, &p, 4), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("swiglu_limit 0 must be finite and > 0");
    p = tkd_moe_params_qwen3(8, 0, 4, 2, 1);
    assert_int_equal(tkd_moe_params_check(&p), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("intermediate 0");
    p = tkd_moe_params_qwen3(8, 4, 4, 2, 1);
    assert_int_equal(tkd_cpu_moe_ws_create(&ws, &p, 0), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("max_tokens 0");
    moe_case c = case_make(p, 5, 700, 1.0f);
    assert_int_equal(tkd_cpu_moe_ws_create(&ws, &p, 4), TKD_OK);
    tkd_moe_weights w = case_weights(&c);
    float y[5 * 8];
    assert_int_equal(tkd_cpu_moe_fwd(ws, &w, c.x, 5, y, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("5 tokens, the workspace holds 1..4");
    /* a smaller call on the same workspace works, routing outputs optional */
    assert_int_equal(tkd_cpu_moe_fwd(ws, &w, c.x, 0, y, NULL, NULL), TKD_OK);
    assert_int_equal(tkd_cpu_moe_fwd(ws, &w, c.x, 3, y, NULL, NULL), TKD_OK);
    tkd_cpu_moe_ws_free(ws);
    tkd_cpu_moe_ws_free(NULL);
    case_free(&c);
}

/* ---- against transformers' own outputs (tests/moe_reference.py) ------------------------------- */

#define FIX_DIR TKD_SOURCE_DIR "/tests/fixtures/moe"

/* The value of key in <dir>/meta.txt ("key value" lines); fails the test when absent. */
static double meta_get(const char *dir, const char *key)
{
    const char *path = tkd_test_path(dir, "meta.txt");
    FILE *f = fopen(path, "r");
    if (!f)
        fail_msg("%s: missing (run tests/moe_reference.py)", path);
    char k[64], v[64];
    while (fscanf(f, "%63s %63s", k, v) == 2)
        if (strcmp(k, key) == 0) {
            fclose(f);
            return atof(v);
        }
    fclose(f);
    fail_msg("%s: no key '%s'", path, key);
    return 0;
}

/* <dir>/<name> holding exactly n elements of 4 bytes, malloc'd; fails the test otherwise. */
static void *fix_read(const char *dir, const char *name, size_t n)
{
    const char *path = tkd_test_path(dir, name);
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("%s: missing (the fixture is incomplete: rerun tests/moe_reference.py)", path);
    void *v = malloc(4 * n + 4);
    assert_non_null(v);
    size_t got = fread(v, 4, n + 1, f);
    fclose(f);
    if (got != n)
        fail_msg("%s: %zu elements of 4 bytes, want %zu", path, got, n);
    return v;
}

/* One family's fixture: the op in both paths against transformers' y and routing. */
static void check_fixture(const char *family)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", FIX_DIR, family);
    int N = (int)meta_get(dir, "N"), D = (int)meta_get(dir, "D"), I = (int)meta_get(dir, "I");
    int E = (int)meta_get(dir, "E"), k = (int)meta_get(dir, "k");
    int gpt = strcmp(family, "gpt_oss") == 0;
    assert_true(N > 0 && D > 0 && I > 0 && E > 0 && k > 0 && k <= E);
    tkd_moe_params p = gpt ? tkd_moe_params_gpt_oss(D, I, E, k, (float)meta_get(dir, "limit"))
                           : tkd_moe_params_qwen3(D, I, E, k, (int)meta_get(dir, "norm_topk_prob"));
    if (gpt)
        assert_true(fabs(meta_get(dir, "alpha") - 1.702) < 1e-9); /* the α this op assumes */
    moe_case c = {.p = p, .N = N};
    size_t EID = (size_t)E * I * D;
    c.x = fix_read(dir, "x.f32", (size_t)N * D);
    c.rw = fix_read(dir, "router_w.f32", (size_t)E * D);
    float *gu = NULL, *gub = NULL, *dn = NULL;
    if (gpt) {
        c.rb = fix_read(dir, "router_b.f32", (size_t)E);
        gu = fix_read(dir, "gate_up_proj.f32", 2 * EID);
        gub = fix_read(dir, "gate_up_proj_bias.f32", (size_t)E * 2 * I);
        dn = fix_read(dir, "down_proj.f32", EID);
        c.bd = fix_read(dir, "down_proj_bias.f32", (size_t)E * D);
        c.wg = malloc(4 * EID), c.wu = malloc(4 * EID), c.wd = malloc(4 * EID);
        c.bg = malloc(4 * (size_t)E * I), c.bu = malloc(4 * (size_t)E * I);
        assert_true(c.wg && c.wu && c.wd && c.bg && c.bu);
        tkd_moe_from_gpt_oss(E, D, I, gu, gub, dn, c.wg, c.wu, c.bg, c.bu, c.wd);
    } else {
        c.wg = fix_read(dir, "w_gate.f32", EID);
        c.wu = fix_read(dir, "w_up.f32", EID);
        c.wd = fix_read(dir, "w_down.f32", EID);
    }
    float *ty = fix_read(dir, "y.f32", (size_t)N * D), *tw = fix_read(dir, "weights.f32", (size_t)N * k);
    int32_t *te = fix_read(dir, "experts.i32", (size_t)N * k);
    double *tyd = malloc(sizeof(double) * (size_t)N * D), *twd = malloc(sizeof(double) * (size_t)N * k);
    assert_true(tyd && twd);
    for (int i = 0; i < N * D; i++)
        tyd[i] = ty[i];
    for (int i = 0; i < N * k; i++)
        twd[i] = tw[i];
    char what[96];
    /* transformers (fp32) as the truth for both: the same tolerances as fast vs reference */
    moe_out o = run_fast(&c);
    snprintf(what, sizeof what, "%s: fast path vs transformers", family);
    expect_match(what, N, D, k, o.y, o.e, o.w, tyd, te, twd);
    ref_out r = run_ref(&c);
    float *ry = malloc(sizeof(float) * (size_t)N * D), *rw = malloc(sizeof(float) * (size_t)N * k);
    assert_true(ry && rw);
    for (int i = 0; i < N * D; i++)
        ry[i] = (float)r.y[i];
    for (int i = 0; i < N * k; i++)
        rw[i] = (float)r.w[i];
    snprintf(what, sizeof what, "%s: reference vs transformers", family);
    expect_match(what, N, D, k, ry, r.e, rw, tyd, te, twd);
    free(ry), free(rw), free(tyd), free(twd), free(ty), free(tw), free(te), free(gu), free(gub), free(dn);
    out_free(&o);
    ref_free(&r);
    case_free(&c);
}

static void test_transformers_qwen3(void **s)
{
    (void)s;
    check_fixture("qwen3");
}

static void test_transformers_qwen3_nonorm(void **s)
{
    (void)s;
    check_fixture("qwen3_nonorm");
}

static void test_transformers_gpt_oss(void **s)
{
    (void)s;
    check_fixture("gpt_oss");
}

/* The grouped GEMMs' tile list (kernels/moe.h): every row of every expert in exactly one tile, in
 * order, tiles of at most tile_m rows; groups of consecutive tiles of one expert, 16 except an
 * expert's last, each tile naming its own; no more tiles than the bound the callers size for. */
static void test_gemm_tiles(void **s)
{
    (void)s;
    static const int32_t counts[] = {0, 1, 64, 65, 1030, 2049, 0, 7};
    enum { E = 8, I = TKD_MOE_TILE_INTS };
    const int tms[] = {64, 128, 1, 100};
    int32_t total = 0;
    for (int e = 0; e < E; e++)
        total += counts[e];
    for (size_t m = 0; m < sizeof tms / sizeof *tms; m++) {
        const int tm = tms[m];
        int32_t *t = malloc(sizeof(int32_t) * I * (size_t)(total / tm + E + 1));
        assert_non_null(t);
        const int nt = tkd_moe_gemm_tiles(counts, E, tm, t);
        assert_true(nt <= (total + tm - 1) / tm + E);
        int i = 0;
        int32_t row = 0;
        for (int e = 0; e < E; e++) {
            const int first = i;
            for (int32_t r = 0; r < counts[e]; i++) {
                const int32_t *q = t + (size_t)I * i;
                assert_true(i < nt);
                assert_int_equal(q[0], e), assert_int_equal(q[1], row + r);
                assert_true(q[2] >= 1 && q[2] <= tm && q[2] == (counts[e] - r < tm ? counts[e] - r : tm));
                const int pos = i - first, n_e = (counts[e] + tm - 1) / tm;
                const int g = pos / TKD_MOE_GROUP_TILES * TKD_MOE_GROUP_TILES;
                assert_int_equal(q[3], first + g);
                assert_int_equal(q[4], n_e - g < TKD_MOE_GROUP_TILES ? n_e - g : TKD_MOE_GROUP_TILES);
                r += q[2];
            }
            row += counts[e];
        }
        assert_int_equal(i, nt);
        /* the device's order over them: every (M-tile, N-tile) once, a group's tiles together */
        for (int ntl = 1; ntl <= 23; ntl += 11) {
            char *seen = calloc((size_t)nt * ntl, 1);
            assert_non_null(seen);
            for (long long o = 0; o < (long long)nt * ntl; o++) {
                int li = -1, nj = -1;
                tkd_moe_tile_of(t, ntl, o, &li, &nj);
                assert_true(li >= 0 && li < nt && nj >= 0 && nj < ntl);
                assert_false(seen[(size_t)li * ntl + nj]);
                seen[(size_t)li * ntl + nj] = 1;
                const int32_t *q = t + (size_t)I * li; /* inside its group's span of the order */
                assert_true(o >= (long long)q[3] * ntl && o < (long long)(q[3] + q[4]) * ntl);
            }
            free(seen);
        }
        free(t);
    }
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "fixtures") == 0) {
        const struct CMUnitTest fix[] = {
            cmocka_unit_test(test_transformers_qwen3),
            cmocka_unit_test(test_transformers_qwen3_nonorm),
            cmocka_unit_test(test_transformers_gpt_oss),
        };
        return cmocka_run_group_tests_name("moe vs transformers", fix, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen3_shapes),
        cmocka_unit_test(test_gpt_oss_shapes),
        cmocka_unit_test(test_expert_by_none_and_by_all),
        cmocka_unit_test(test_ties),
        cmocka_unit_test(test_qwen3_norm_topk_prob),
        cmocka_unit_test(test_swiglu_clamp),
        cmocka_unit_test(test_gpt_oss_converter_layout),
        cmocka_unit_test(test_gpt_oss_converter_semantics),
        cmocka_unit_test(test_mxfp4_experts),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_gemm_tiles),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
