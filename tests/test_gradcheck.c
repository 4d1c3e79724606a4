/* test_gradcheck.c — backward passes against central finite differences.
 *
 * Ops: every double reference op (kernels/cpu/cpu_ops_ref.h) with the scalar loss L = Σ c·out for a fixed
 * random c, so ∂L/∂out = c is what backward receives. In double with step h = 1e-6 the difference
 * quotient is accurate to ~1e-9 (rounding ~1e-16/h, truncation ~h²), so the bound
 * |fd − analytic| ≤ 1e-7 + 1e-6·|analytic| is tight; the fast ops are tied to these by test_ops.c.
 *
 * Whole model: the fp32 model (tiny: V=11, D=8, 2 layers, H=2, Hkv=1, Dh=4, F=12, B=2, T=5, q/k/v
 * bias; untied and tied variants; and Qwen3: per-head q/k norms, Dh=6, layer 1 sliding with W=2) under mean next-token cross-entropy of its full logits, every
 * parameter perturbed. fp32 forward noise on the loss is ~1e-6; a five-point stencil with step
 * h = 2^-7 has truncation O(h^4), so the quotient is good to ~2e-4 absolute at these weights:
 * the bound is |fd − analytic| ≤ 1e-3 + 2e-2·|analytic| per element, and in addition each tensor's
 * relative L2 error ‖fd − analytic‖ / ‖analytic‖ ≤ 1e-2. A backward that drops or misroutes a term
 * is wrong by O(1) relative and fails both.
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

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_ops_ref.h"
#include "kernels/rope_table.h"
#include "model/model.h"
#include "tests/testutil.h"

/* ---- op level, double ----------------------------------------------------------------------- */

typedef double (*loss_fn)(void *ctx);

static double *randd(size_t n, uint64_t seed, float std)
{
    float *f = malloc(sizeof(float) * (n + 1));
    double *d = calloc(n + 1, sizeof(double));
    tkd_test_randn(f, n, seed, std);
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    free(f);
    return d;
}

static double dot(const double *a, const double *b, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* Central differences of f over x[0..n) against the analytic gradient an[0..n). */
static void check(const char *what, double *x, size_t n, const double *an, loss_fn f, void *ctx)
{
    const double h = 1e-6;
    for (size_t i = 0; i < n; i++) {
        double keep = x[i];
        x[i] = keep + h;
        double lp = f(ctx);
        x[i] = keep - h;
        double lm = f(ctx);
        x[i] = keep;
        double fd = (lp - lm) / (2 * h);
        if (!tkd_test_close(fd, an[i], 1e-7, 1e-6))
            fail_msg("%s[%zu]: finite difference %.10g vs backward %.10g", what, i, fd, an[i]);
    }
}

typedef struct op_ctx {
    int N, D, K, M, T, B, H, Hkv, dh, V, window;
    double *x, *w, *b, *c, *out, *rstd, *g, *u, *q, *k, *v, *att, *tmp;
    int32_t *tok;
    const float *cs, *sn;
} op_ctx;

static double loss_rmsnorm(void *p)
{
    op_ctx *o = p;
    tkd_ref_rmsnorm_fwd(o->x, o->w, o->N, o->D, 1e-5, o->out, o->rstd);
    return dot(o->c, o->out, (size_t)o->N * o->D);
}

static void test_rmsnorm(void **s)
{
    (void)s;
    op_ctx o = {.N = 3, .D = 7};
    size_t nx = 21;
    o.x = randd(nx, 1, 1), o.w = randd(7, 2, 1), o.c = randd(nx, 3, 1);
    o.out = calloc(nx, sizeof(double)), o.rstd = calloc(3, sizeof(double));
    double *dx = calloc(nx, sizeof(double)), *dw = calloc(7, sizeof(double));
    loss_rmsnorm(&o);
    tkd_ref_rmsnorm_bwd(o.c, o.x, o.w, o.rstd, o.N, o.D, dx, dw);
    check("rmsnorm dx", o.x, nx, dx, loss_rmsnorm, &o);
    check("rmsnorm dw", o.w, 7, dw, loss_rmsnorm, &o);
    free(o.x), free(o.w), free(o.c), free(o.out), free(o.rstd), free(dx), free(dw);
}

static double loss_linear(void *p)
{
    op_ctx *o = p;
    tkd_ref_linear_fwd(o->x, o->w, o->b, o->N, o->K, o->M, 0, o->out);
    return dot(o->c, o->out, (size_t)o->N * o->M);
}

static void test_linear(void **s)
{
    (void)s;
    op_ctx o = {.N = 4, .K = 5, .M = 3};
    o.x = randd(20, 4, 1), o.w = randd(15, 5, 1), o.b = randd(3, 6, 1), o.c = randd(12, 7, 1);
    o.out = calloc(12, sizeof(double));
    double *dx = calloc(20, sizeof(double)), *dw = calloc(15, sizeof(double)), *db = calloc(3, sizeof(double));
    tkd_ref_linear_bwd(o.c, o.x, o.w, o.N, o.K, o.M, dx, dw, db);
    check("linear dx", o.x, 20, dx, loss_linear, &o);
    check("linear dw", o.w, 15, dw, loss_linear, &o);
    check("linear db", o.b, 3, db, loss_linear, &o);
    free(o.x), free(o.w), free(o.b), free(o.c), free(o.out), free(dx), free(dw), free(db);
}

static double loss_embedding(void *p)
{
    op_ctx *o = p;
    tkd_ref_embedding_fwd(o->tok, o->N, o->w, o->D, o->out);
    return dot(o->c, o->out, (size_t)o->N * o->D);
}

static void test_embedding(void **s)
{
    (void)s;
    int32_t tok[6] = {2, 0, 2, 4, 1, 2};
    op_ctx o = {.N = 6, .D = 3, .V = 5, .tok = tok};
    o.w = randd(15, 8, 1), o.c = randd(18, 9, 1), o.out = calloc(18, sizeof(double));
    double *dw = calloc(15, sizeof(double));
    tkd_ref_embedding_bwd(tok, 6, o.c, 3, dw);
    check("embedding demb", o.w, 15, dw, loss_embedding, &o);
    free(o.w), free(o.c), free(o.out), free(dw);
}

static double loss_rope(void *p)
{
    op_ctx *o = p;
    size_t n = (size_t)o->N * o->H * o->dh;
    memcpy(o->tmp, o->x, sizeof(double) * n);
    tkd_ref_rope_fwd(o->tmp, o->N, o->T, o->H, o->dh, o->cs, o->sn);
    return dot(o->c, o->tmp, n);
}

static void test_rope(void **s)
{
    (void)s;
    float inv[3], cs[5 * 3], sn[5 * 3];
    tkd_rope_inv_freq(10.0, 6, 0, 1, 1, 4, 8, inv); /* small theta: large angles */
    tkd_rope_table(inv, 6, 5, cs, sn);
    op_ctx o = {.N = 10, .T = 5, .H = 2, .dh = 6, .cs = cs, .sn = sn};
    size_t n = 120;
    o.x = randd(n, 10, 1), o.c = randd(n, 11, 1), o.tmp = calloc(n, sizeof(double));
    double *dx = calloc(n, sizeof(double));
    memcpy(dx, o.c, sizeof(double) * n);
    tkd_ref_rope_bwd(dx, o.N, o.T, o.H, o.dh, cs, sn); /* in place: the gradient itself rotates */
    check("rope dx", o.x, n, dx, loss_rope, &o);
    free(o.x), free(o.c), free(o.tmp), free(dx);
}

static double loss_attn(void *p)
{
    op_ctx *o = p;
    tkd_ref_attn_window_fwd(o->q, o->k, o->v, o->B, o->T, o->H, o->Hkv, o->dh, o->window, o->att, o->out);
    return dot(o->c, o->out, (size_t)o->B * o->T * o->H * o->dh);
}

static void test_attention(void **s)
{
    (void)s;
    /* B, T, H, Hkv, dh, window: GQA 1, 2, 4, full causal; then sliding windows of 2 and 1 keys */
    int cfgs[][6] = {{2, 4, 2, 2, 3, 0}, {1, 5, 4, 2, 2, 0}, {2, 3, 4, 1, 3, 0}, {2, 6, 4, 2, 3, 2}, {1, 4, 2, 1, 2, 1}};
    for (int c = 0; c < 5; c++) {
        op_ctx o = {.B = cfgs[c][0], .T = cfgs[c][1], .H = cfgs[c][2], .Hkv = cfgs[c][3], .dh = cfgs[c][4],
                    .window = cfgs[c][5]};
        size_t N = (size_t)o.B * o.T, nq = N * o.H * o.dh, nkv = N * o.Hkv * o.dh;
        o.q = randd(nq, 20 + c, 1), o.k = randd(nkv, 30 + c, 1), o.v = randd(nkv, 40 + c, 1);
        o.c = randd(nq, 50 + c, 1), o.out = calloc(nq, sizeof(double));
        o.att = calloc((size_t)o.B * o.H * o.T * o.T, sizeof(double));
        double *dq = calloc(nq, sizeof(double)), *dk = calloc(nkv, sizeof(double)), *dv = calloc(nkv, sizeof(double));
        loss_attn(&o);
        tkd_ref_attn_bwd(o.c, o.q, o.k, o.v, o.att, o.B, o.T, o.H, o.Hkv, o.dh, dq, dk, dv);
        check("attn dq", o.q, nq, dq, loss_attn, &o);
        check("attn dk", o.k, nkv, dk, loss_attn, &o);
        check("attn dv", o.v, nkv, dv, loss_attn, &o);
        free(o.q), free(o.k), free(o.v), free(o.c), free(o.out), free(o.att), free(dq), free(dk), free(dv);
    }
}

static double loss_swiglu(void *p)
{
    op_ctx *o = p;
    tkd_ref_swiglu_fwd(o->g, o->u, o->N, o->out);
    return dot(o->c, o->out, (size_t)o->N);
}

static void test_swiglu(void **s)
{
    (void)s;
    op_ctx o = {.N = 17};
    o.g = randd(17, 60, 3), o.u = randd(17, 61, 1), o.c = randd(17, 62, 1), o.out = calloc(17, sizeof(double));
    double *dg = calloc(17, sizeof(double)), *du = calloc(17, sizeof(double));
    tkd_ref_swiglu_bwd(o.c, o.g, o.u, 17, dg, du);
    check("swiglu dg", o.g, 17, dg, loss_swiglu, &o);
    check("swiglu du", o.u, 17, du, loss_swiglu, &o);
    free(o.g), free(o.u), free(o.c), free(o.out), free(dg), free(du);
}

/* ---- whole model, fp32 ---------------------------------------------------------------------- */

enum { MB = 2, MT = 5, MN = MB * MT };

static const int32_t m_in[MN] = {1, 4, 9, 4, 10, 0, 3, 3, 7, 2};
static const int32_t m_lab[MN] = {4, 9, 4, 10, 6, 3, 3, 7, 2, 5};

/* Mean CE of the full logits (double); with grad = 1 also runs backward into m->grads. */
static double model_loss(tkd_model *m, int grad)
{
    int V = m->cfg.vocab_size, D = m->cfg.hidden_size;
    const void *h = NULL;
    assert_int_equal(tkd_model_forward(m, m_in, MB, MT, grad, &h), TKD_OK);
    float lg[MN * 11], dlg[MN * 11], dh[MN * 8] = {0};
    tkd_model_logits(m, h, MN, lg);
    double loss = 0;
    for (int i = 0; i < MN; i++) {
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < V; j++)
            mx = fmax(mx, lg[i * V + j]);
        for (int j = 0; j < V; j++)
            sum += exp(lg[i * V + j] - mx);
        loss += mx + log(sum) - lg[i * V + m_lab[i]];
        for (int j = 0; j < V; j++)
            dlg[i * V + j] = (float)((exp(lg[i * V + j] - mx) / sum - (j == m_lab[i])) / MN);
    }
    if (grad) {
        tkd_cpu_linear_bwd(dlg, h, tkd_model_lm_head(m), MN, D, V, dh, tkd_model_lm_head_grad(m), NULL);
        assert_int_equal(tkd_model_backward(m, dh), TKD_OK);
    }
    return loss / MN;
}

/* qwen3: per-head q/k norms with head_dim 6 != D/H = 4, and layer 1 sliding with a window of 2
 * keys (< T = 5), so the norms' weights and the masked attention are differentiated too. */
static void model_gradcheck(int tied, int bias, int qwen3)
{
    tkd_model_config c;
    tkd_model_config_defaults(&c);
    c.vocab_size = 11, c.hidden_size = 8, c.intermediate_size = 12, c.num_hidden_layers = 2;
    c.num_attention_heads = 2, c.num_key_value_heads = 1, c.head_dim = 4, c.max_position_embeddings = 8;
    c.tie_word_embeddings = tied, c.attention_bias = bias, c.rope_theta = 100.0, c.rms_norm_eps = 1e-5f;
    c.initializer_range = 0.5f, c.rope_scaling = TKD_ROPE_SCALING_NONE;
    if (qwen3) {
        c.arch = TKD_ARCH_QWEN3, c.head_dim = 6;
        c.sliding_window = 2, c.layer_sliding[1] = 1;
    }
    tkd_model *m = NULL;
    if (tkd_model_init_random(&c, 7, &m) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    /* non-trivial norms and biases, so their gradients are exercised at generic points */
    for (int i = 0; i < m->n_info; i++)
        if (!m->info[i].decay)
            tkd_test_randn(m->params + m->info[i].offset, m->info[i].numel, 100 + i, 0.3f);
    for (int i = 0; i < m->n_info; i++)
        if (strstr(m->info[i].name, "norm"))
            for (size_t j = 0; j < m->info[i].numel; j++)
                m->params[m->info[i].offset + j] += 1.0f;
    tkd_model_zero_grad(m);
    model_loss(m, 1);
    tkd_model_zero_grad(m); /* backward adds: a second pass from zero must give the same */
    model_loss(m, 1);
    const float h = 0x1p-7f; /* a power of two: keep ± h, ± 2h are (nearly) exact in fp32 */
    for (int t = 0; t < m->n_info; t++) {
        const tkd_param_info *p = &m->info[t];
        double e2 = 0, a2 = 0;
        for (size_t j = 0; j < p->numel; j++) {
            float *x = m->params + p->offset + j, keep = *x;
            const float step[4] = {2 * h, h, -h, -2 * h};
            double l[4];
            for (int k = 0; k < 4; k++) {
                *x = keep + step[k];
                l[k] = model_loss(m, 0);
            }
            *x = keep;
            /* five-point stencil: truncation O(h^4), so fp32 noise dominates */
            double fd = (8 * (l[1] - l[2]) - (l[0] - l[3])) / (12.0 * h), an = m->grads[p->offset + j];
            e2 += (fd - an) * (fd - an);
            a2 += an * an;
            if (!tkd_test_close(fd, an, 1e-3, 2e-2))
                fail_msg("tied=%d qwen3=%d %s[%zu]: finite difference %.6g vs backward %.6g", tied, qwen3, p->name, j,
                         fd, an);
        }
        double rel = sqrt(e2 / fmax(a2, 1e-30));
        printf("tied=%d bias=%d qwen3=%d %-45s |g| %.3e rel L2 err %.2e\n", tied, bias, qwen3, p->name, sqrt(a2), rel);
        assert_true(a2 > 0); /* every parameter influences the loss */
        assert_true(rel <= 1e-2);
    }
    tkd_model_free(m);
}

static void test_model_untied_bias(void **s) { (void)s; model_gradcheck(0, 1, 0); }
static void test_model_tied(void **s) { (void)s; model_gradcheck(1, 0, 0); }
static void test_model_qwen3_window(void **s) { (void)s; model_gradcheck(0, 0, 1); }

TKD_TEST_MAIN(test_rmsnorm, test_linear, test_embedding, test_rope, test_attention, test_swiglu,
    test_model_untied_bias, test_model_tied, test_model_qwen3_window)
