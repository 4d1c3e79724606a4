/* test_ops.c — each fast CPU op (kernels/cpu/cpu_ops.h) against its double reference
 * (kernels/cpu/cpu_ops_ref.h), forward and backward, over awkward shapes: one row, T = 1, B = 3, widths
 * that are odd or not multiples of 8, GQA ratios 1, 2 and 4. Backward outputs start from random
 * values in both paths, which also checks the "backward adds into its outputs" convention.
 *
 * Tolerance: |fast − ref| ≤ 2e-5 + 2e-5·|ref| elementwise. The fast path accumulates in fp32 over at
 * most ~130 terms of size O(1): worst-case relative rounding ~130·6e-8 ≈ 8e-6 of the largest term.
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
#include "tests/testutil.h"

#define ATOL 2e-5
#define RTOL 2e-5

/* A float buffer and its double twin holding the same values. */
typedef struct pair {
    float *f;
    double *d;
    size_t n;
} pair;

static pair mk(size_t n, uint64_t seed, float std)
{
    pair p = {calloc(n + 1, sizeof(float)), calloc(n + 1, sizeof(double)), n};
    assert_true(p.f && p.d);
    if (std > 0)
        tkd_test_randn(p.f, n, seed, std);
    for (size_t i = 0; i < n; i++)
        p.d[i] = p.f[i];
    return p;
}

static void drop(pair *p)
{
    free(p->f);
    free(p->d);
}

static void expect_close(const pair *p, const char *what)
{
    for (size_t i = 0; i < p->n; i++) {
        if (!tkd_test_close(p->f[i], p->d[i], ATOL, RTOL))
            fail_msg("%s[%zu]: fast %.8g vs reference %.8g", what, i, p->f[i], p->d[i]);
    }
}

static void test_embedding(void **s)
{
    (void)s;
    enum { V = 11, D = 131, N = 300 }; /* N·D above the threads threshold */
    int32_t tok[N];
    for (int i = 0; i < N; i++) /* repeats: backward must add */
        tok[i] = (i * 7 + i / 5) % V;
    pair e = mk((size_t)V * D, 1, 1), out = mk((size_t)N * D, 0, 0), dy = mk((size_t)N * D, 2, 1);
    pair de = mk((size_t)V * D, 3, 1);
    tkd_cpu_embedding_fwd(tok, N, e.f, D, out.f);
    tkd_ref_embedding_fwd(tok, N, e.d, D, out.d);
    expect_close(&out, "embedding out");
    tkd_cpu_embedding_bwd(tok, N, dy.f, D, de.f);
    tkd_ref_embedding_bwd(tok, N, dy.d, D, de.d);
    expect_close(&de, "embedding demb");
    drop(&e), drop(&out), drop(&dy), drop(&de);
}

static void test_rmsnorm(void **s)
{
    (void)s;
    int shapes[][2] = {{1, 1}, {5, 7}, {3, 33}, {11, 130}, {300, 130}}; /* the last runs threaded */
    for (int c = 0; c < 5; c++) {
        int N = shapes[c][0], D = shapes[c][1];
        pair x = mk((size_t)N * D, 10 + c, 2), w = mk(D, 20 + c, 1), y = mk((size_t)N * D, 0, 0);
        pair r = mk(N, 0, 0), dy = mk((size_t)N * D, 30 + c, 1), dx = mk((size_t)N * D, 40 + c, 1);
        pair dw = mk(D, 50 + c, 1);
        tkd_cpu_rmsnorm_fwd(x.f, w.f, N, D, 1e-5f, y.f, r.f);
        tkd_ref_rmsnorm_fwd(x.d, w.d, N, D, 1e-5f, y.d, r.d);
        expect_close(&y, "rmsnorm y");
        expect_close(&r, "rmsnorm rstd");
        tkd_cpu_rmsnorm_bwd(dy.f, x.f, w.f, r.f, N, D, dx.f, dw.f);
        tkd_ref_rmsnorm_bwd(dy.d, x.d, w.d, r.d, N, D, dx.d, dw.d);
        expect_close(&dx, "rmsnorm dx");
        expect_close(&dw, "rmsnorm dw");
        drop(&x), drop(&w), drop(&y), drop(&r), drop(&dy), drop(&dx), drop(&dw);
    }
}

static void test_linear(void **s)
{
    (void)s;
    int shapes[][3] = {{1, 1, 1}, {7, 13, 5}, {3, 33, 17}, {22, 48, 131}, {300, 48, 131}};
    for (int c = 0; c < 5; c++)
        for (int variant = 0; variant < 2; variant++) { /* 0: bias + overwrite, 1: no bias + accumulate */
            int N = shapes[c][0], K = shapes[c][1], M = shapes[c][2];
            uint64_t sd = 100 * c + 10 * variant;
            pair x = mk((size_t)N * K, sd + 1, 1), w = mk((size_t)M * K, sd + 2, 0.3f), b = mk(M, sd + 3, 1);
            pair y = mk((size_t)N * M, sd + 4, 1), dy = mk((size_t)N * M, sd + 5, 1);
            pair dx = mk((size_t)N * K, sd + 6, 1), dw = mk((size_t)M * K, sd + 7, 1), db = mk(M, sd + 8, 1);
            tkd_cpu_linear_fwd(x.f, w.f, variant ? NULL : b.f, N, K, M, variant, y.f);
            tkd_ref_linear_fwd(x.d, w.d, variant ? NULL : b.d, N, K, M, variant, y.d);
            expect_close(&y, "linear y");
            tkd_cpu_linear_bwd(dy.f, x.f, w.f, N, K, M, dx.f, dw.f, db.f);
            tkd_ref_linear_bwd(dy.d, x.d, w.d, N, K, M, dx.d, dw.d, db.d);
            expect_close(&dx, "linear dx");
            expect_close(&dw, "linear dw");
            expect_close(&db, "linear db");
            drop(&x), drop(&w), drop(&b), drop(&y), drop(&dy), drop(&dx), drop(&dw), drop(&db);
        }
}

/* llama3 scaling: band edges for theta 1e4, dh 16, original 32, low 1, high 4, factor 8 —
 * wavelength 6.28 (kept), 19.9 (smoothed), 62.8 and above (divided by 8). */
static void test_rope_inv_freq(void **s)
{
    (void)s;
    float inv[8];
    tkd_rope_inv_freq(1e4, 16, 1, 8.0, 1.0, 4.0, 32, inv);
    for (int i = 0; i < 8; i++) {
        double base = 1.0 / pow(1e4, 2.0 * i / 16), wl = 2 * M_PI / base, want;
        if (wl < 32.0 / 4)
            want = base;
        else if (wl > 32.0 / 1)
            want = base / 8;
        else {
            double sm = (32.0 / wl - 1.0) / (4.0 - 1.0);
            want = (1 - sm) * base / 8 + sm * base;
        }
        assert_true(tkd_test_close(inv[i], want, 0, 1e-6));
    }
    assert_true(inv[0] == 1.0f);                          /* band 1: untouched */
    assert_true(fabs(inv[2] * 8 - 1 / pow(1e4, 0.25)) < 1e-7); /* band 3: divided by factor */
    float plain[8];
    tkd_rope_inv_freq(1e4, 16, 0, 8.0, 1.0, 4.0, 32, plain);
    assert_true(fabs(plain[2] - inv[2] * 8) < 1e-7 && plain[1] != inv[1]); /* scaling off: plain */
}

/* YaRN in double, the formula of transformers' _compute_yarn_parameters written out plainly. */
static double yarn_want(int i, double theta, int dh, double factor, double bf, double bs, int omax, int trunc)
{
    double lo = dh * log(omax / (bf * 2 * M_PI)) / (2 * log(theta));
    double hi = dh * log(omax / (bs * 2 * M_PI)) / (2 * log(theta));
    if (trunc)
        lo = floor(lo), hi = ceil(hi);
    lo = fmax(lo, 0), hi = fmin(hi, dh - 1);
    if (lo == hi)
        hi += 0.001;
    const double ramp = fmin(fmax((i - lo) / (hi - lo), 0), 1), w_extra = 1 - ramp;
    const double extra = 1 / pow(theta, 2.0 * i / dh);
    return extra / factor * (1 - w_extra) + extra * w_extra;
}

/* YaRN with gpt-oss's parameters (θ 150000, factor 32, β 32 / 1, 4096 original positions, no
 * truncation) and truncated: the fast dimensions kept, the slow ones divided by the factor, a
 * linear ramp between; the attention factor 0.1·ln 32 + 1; the scaled table at scale 1 equals the
 * plain one bit for bit. */
static void test_rope_yarn(void **s)
{
    (void)s;
    for (int trunc = 0; trunc < 2; trunc++) {
        float inv[32], af = 0;
        tkd_rope_inv_freq_yarn(150000.0, 64, 32.0, 32.0, 1.0, 4096, trunc, 0.0, inv, &af);
        for (int i = 0; i < 32; i++)
            assert_true(tkd_test_close(inv[i], yarn_want(i, 150000.0, 64, 32.0, 32.0, 1.0, 4096, trunc), 0, 2e-6));
        assert_true(inv[0] == 1.0f);                                              /* fastest: kept */
        assert_true(fabs(inv[31] * 32 - 1 / pow(150000.0, 62.0 / 64)) < 1e-6 * inv[31] * 32); /* slowest: / 32 */
        assert_true(fabs(af - (0.1 * log(32.0) + 1)) < 1e-6);
    }
    float inv[8], af = 0;
    tkd_rope_inv_freq_yarn(1e4, 16, 1.0, 32.0, 1.0, 4096, 1, 0.0, inv, &af);
    assert_true(af == 1.0f); /* factor 1: no scaling of the attention */
    tkd_rope_inv_freq_yarn(1e4, 16, 4.0, 32.0, 1.0, 4096, 1, 0.7, inv, &af);
    assert_true(af == 0.7f); /* an explicit attention_factor wins */
    float c1[5 * 8], s1[5 * 8], c2[5 * 8], s2[5 * 8];
    tkd_rope_table(inv, 16, 5, c1, s1);
    tkd_rope_table_scaled(inv, 16, 5, 1.0f, c2, s2);
    assert_memory_equal(c1, c2, sizeof c1);
    assert_memory_equal(s1, s2, sizeof s1);
    tkd_rope_table_scaled(inv, 16, 5, 1.5f, c2, s2);
    for (int i = 0; i < 5 * 8; i++)
        assert_true(c2[i] == c1[i] * 1.5f && s2[i] == s1[i] * 1.5f);
}

static void test_rope(void **s)
{
    (void)s;
    /* B, T, nh, dh; the last runs threaded */
    int cases[][4] = {{1, 1, 1, 2}, {3, 5, 3, 6}, {2, 7, 2, 16}, {1, 13, 4, 10}, {9, 64, 4, 16}};
    for (int c = 0; c < 5; c++) {
        int B = cases[c][0], T = cases[c][1], nh = cases[c][2], dh = cases[c][3], N = B * T;
        float inv[8], cs[64 * 8], sn[64 * 8];
        tkd_rope_inv_freq(c == 2 ? 1e4 : 5e5, dh, c == 2, 8.0, 1.0, 4.0, 32, inv);
        tkd_rope_table(inv, dh, T, cs, sn);
        pair x = mk((size_t)N * nh * dh, 200 + c, 1), g = mk((size_t)N * nh * dh, 300 + c, 1);
        tkd_cpu_rope_fwd(x.f, N, T, nh, dh, cs, sn);
        tkd_ref_rope_fwd(x.d, N, T, nh, dh, cs, sn);
        expect_close(&x, "rope fwd");
        tkd_cpu_rope_bwd(g.f, N, T, nh, dh, cs, sn);
        tkd_ref_rope_bwd(g.d, N, T, nh, dh, cs, sn);
        expect_close(&g, "rope bwd");
        /* bwd is the inverse rotation: applying it after fwd restores the input */
        pair y = mk((size_t)N * nh * dh, 400 + c, 1);
        float *keep = malloc(sizeof(float) * y.n);
        memcpy(keep, y.f, sizeof(float) * y.n);
        tkd_cpu_rope_fwd(y.f, N, T, nh, dh, cs, sn);
        tkd_cpu_rope_bwd(y.f, N, T, nh, dh, cs, sn);
        for (size_t i = 0; i < y.n; i++)
            assert_true(fabsf(y.f[i] - keep[i]) < 1e-6f);
        free(keep);
        drop(&x), drop(&g), drop(&y);
    }
}

static void test_attention(void **s)
{
    (void)s;
    /* B, T, H, Hkv, dh: one token; GQA 1 (B=3); GQA 2 with odd dh; GQA 4; GQA 4 with dh 3;
     * GQA 4 big enough to run threaded (dk, dv shared by 4 query heads: a race would show) */
    int cases[][5] = {{1, 1, 1, 1, 2}, {3, 5, 2, 2, 6}, {2, 7, 4, 2, 5}, {3, 9, 4, 1, 8}, {1, 13, 8, 2, 3},
                      {3, 37, 8, 2, 10}};
    for (int c = 0; c < 6; c++) {
        int B = cases[c][0], T = cases[c][1], H = cases[c][2], Hkv = cases[c][3], dh = cases[c][4];
        size_t N = (size_t)B * T, nq = N * H * dh, nkv = N * Hkv * dh, na = (size_t)B * H * T * T;
        uint64_t sd = 1000 * c;
        pair q = mk(nq, sd + 1, 1.5f), k = mk(nkv, sd + 2, 1.5f), v = mk(nkv, sd + 3, 1);
        pair att = mk(na, 0, 0), y = mk(nq, 0, 0), dy = mk(nq, sd + 4, 1);
        pair dq = mk(nq, sd + 5, 1), dk = mk(nkv, sd + 6, 1), dv = mk(nkv, sd + 7, 1);
        tkd_cpu_attn_fwd(q.f, k.f, v.f, B, T, H, Hkv, dh, att.f, y.f);
        tkd_ref_attn_fwd(q.d, k.d, v.d, B, T, H, Hkv, dh, att.d, y.d);
        expect_close(&att, "attn probabilities");
        expect_close(&y, "attn y");
        for (size_t r = 0; r < (size_t)B * H * T; r++) { /* causal rows sum to 1 */
            double sum = 0;
            for (int j = 0; j < T; j++)
                sum += att.f[r * T + j];
            assert_true(fabs(sum - 1) < 1e-5);
            for (int j = (int)(r % T) + 1; j < T; j++)
                assert_true(att.f[r * T + j] == 0.0f);
        }
        tkd_cpu_attn_bwd(dy.f, q.f, k.f, v.f, att.f, B, T, H, Hkv, dh, dq.f, dk.f, dv.f);
        tkd_ref_attn_bwd(dy.d, q.d, k.d, v.d, att.d, B, T, H, Hkv, dh, dq.d, dk.d, dv.d);
        expect_close(&dq, "attn dq");
        expect_close(&dk, "attn dk");
        expect_close(&dv, "attn dv");
        drop(&q), drop(&k), drop(&v), drop(&att), drop(&y), drop(&dy), drop(&dq), drop(&dk), drop(&dv);
    }
}

/* Sliding windows: query i attends keys i − W < j ≤ i (W keys counting itself, transformers'
 * convention), fast path against the double reference forward and backward; W ≥ T is full causal
 * bit for bit; W = 1 returns each row's own v. */
static void test_attention_window(void **s)
{
    (void)s;
    int cases[][6] = {{2, 9, 4, 2, 5, 3}, {1, 7, 2, 1, 4, 1}, {3, 6, 4, 4, 3, 5}, {1, 5, 2, 2, 6, 5},
                      {1, 4, 2, 1, 4, 9}, {2, 37, 8, 2, 10, 16}}; /* B, T, H, Hkv, dh, W */
    for (int c = 0; c < 6; c++) {
        int B = cases[c][0], T = cases[c][1], H = cases[c][2], Hkv = cases[c][3], dh = cases[c][4], W = cases[c][5];
        size_t N = (size_t)B * T, nq = N * H * dh, nkv = N * Hkv * dh, na = (size_t)B * H * T * T;
        uint64_t sd = 7000 + 100 * c;
        pair q = mk(nq, sd + 1, 1.5f), k = mk(nkv, sd + 2, 1.5f), v = mk(nkv, sd + 3, 1);
        pair att = mk(na, 0, 0), y = mk(nq, 0, 0), dy = mk(nq, sd + 4, 1);
        pair dq = mk(nq, sd + 5, 1), dk = mk(nkv, sd + 6, 1), dv = mk(nkv, sd + 7, 1);
        tkd_cpu_attn_window_fwd(q.f, k.f, v.f, B, T, H, Hkv, dh, W, att.f, y.f);
        tkd_ref_attn_window_fwd(q.d, k.d, v.d, B, T, H, Hkv, dh, W, att.d, y.d);
        expect_close(&att, "window attn probabilities");
        expect_close(&y, "window attn y");
        for (size_t r = 0; r < (size_t)B * H * T; r++) {
            int i = (int)(r % T);
            double sum = 0;
            for (int j = 0; j < T; j++) {
                int inside = j <= i && j > i - W;
                if (inside != (att.f[r * T + j] > 0.0f) || inside != (att.d[r * T + j] > 0.0))
                    fail_msg("case %d row %d key %d: probability %g (window %d)", c, i, j, att.f[r * T + j], W);
                sum += att.f[r * T + j];
            }
            assert_true(fabs(sum - 1) < 1e-5);
        }
        if (W == 1) /* only the query's own key: y_i = v_i */
            for (size_t n = 0; n < N; n++)
                for (int h = 0; h < H; h++)
                    for (int d = 0; d < dh; d++)
                        assert_true(fabsf(y.f[(n * H + h) * dh + d] - v.f[(n * Hkv + h / (H / Hkv)) * dh + d]) < 1e-6f);
        if (W >= T) { /* nothing beyond causality is masked */
            float *yf = malloc(sizeof(float) * nq), *af = malloc(sizeof(float) * na);
            tkd_cpu_attn_fwd(q.f, k.f, v.f, B, T, H, Hkv, dh, af, yf);
            assert_memory_equal(yf, y.f, sizeof(float) * nq);
            free(yf), free(af);
        }
        tkd_cpu_attn_bwd(dy.f, q.f, k.f, v.f, att.f, B, T, H, Hkv, dh, dq.f, dk.f, dv.f);
        tkd_ref_attn_bwd(dy.d, q.d, k.d, v.d, att.d, B, T, H, Hkv, dh, dq.d, dk.d, dv.d);
        expect_close(&dq, "window attn dq");
        expect_close(&dk, "window attn dk");
        expect_close(&dv, "window attn dv");
        drop(&q), drop(&k), drop(&v), drop(&att), drop(&y), drop(&dy), drop(&dq), drop(&dk), drop(&dv);
    }
}

/* y_i of head h written out in double from its definition (transformers' eager_attention_forward
 * for gpt-oss): combined = [s_ij for the keys i attends, sink_h], minus its max, exp, normalised,
 * sink dropped. Independent of the reference op. */
static double direct_sink_y(const double *q, const double *k, const double *v, int T, int H, int Hkv, int dh,
                            int W, double sink, int b, int h, int i, int d)
{
    int grp = H / Hkv, j0 = W > 0 && i >= W ? i - W + 1 : 0;
    double s[64], mx = sink, z = 0, y = 0;
    for (int j = j0; j <= i; j++) {
        double dot = 0;
        for (int e = 0; e < dh; e++)
            dot += q[((size_t)(b * T + i) * H + h) * dh + e] * k[((size_t)(b * T + j) * Hkv + h / grp) * dh + e];
        s[j] = dot / sqrt((double)dh);
        mx = s[j] > mx ? s[j] : mx;
    }
    z = exp(sink - mx);
    for (int j = j0; j <= i; j++)
        z += exp(s[j] - mx);
    for (int j = j0; j <= i; j++)
        y += exp(s[j] - mx) / z * v[((size_t)(b * T + j) * Hkv + h / grp) * dh + d];
    return y;
}

/* Attention sinks (gpt-oss), with and without a window: the fast path against the double
 * reference and against the definition written out above; a row's weights sum to
 * 1 − exp(sink − m)/Z < 1; a sink of −1e30 changes nothing (bit for bit against no sinks). */
static void test_attention_sinks(void **s)
{
    (void)s;
    int cases[][6] = {{2, 9, 4, 2, 5, 3}, {1, 11, 4, 1, 16, 4}, {3, 6, 2, 2, 3, 0}, {2, 37, 8, 2, 10, 16}};
    for (int c = 0; c < 4; c++) {
        int B = cases[c][0], T = cases[c][1], H = cases[c][2], Hkv = cases[c][3], dh = cases[c][4], W = cases[c][5];
        size_t N = (size_t)B * T, nq = N * H * dh, nkv = N * Hkv * dh, na = (size_t)B * H * T * T;
        uint64_t sd = 9100 + 100 * c;
        pair q = mk(nq, sd + 1, 1.5f), k = mk(nkv, sd + 2, 1.5f), v = mk(nkv, sd + 3, 1), sk = mk((size_t)H, sd + 4, 2);
        pair att = mk(na, 0, 0), y = mk(nq, 0, 0);
        tkd_cpu_attn_sinks_fwd(q.f, k.f, v.f, B, T, H, Hkv, dh, W, NULL, sk.f, att.f, y.f);
        tkd_ref_attn_sinks_fwd(q.d, k.d, v.d, B, T, H, Hkv, dh, W, NULL, sk.d, att.d, y.d);
        expect_close(&att, "sink attn probabilities");
        expect_close(&y, "sink attn y");
        double worst = 0;
        for (int b = 0; b < B; b++)
            for (int i = 0; i < T; i++)
                for (int h = 0; h < H; h++)
                    for (int d = 0; d < dh; d++) {
                        double want = direct_sink_y(q.d, k.d, v.d, T, H, Hkv, dh, W, sk.d[h], b, h, i, d);
                        double got = y.f[((size_t)(b * T + i) * H + h) * dh + d];
                        worst = fmax(worst, fabs(got - want));
                    }
        if (worst > 2e-6) /* fp32 softmax and sums over at most 37 keys of |v| ~ 1 */
            fail_msg("case %d: y differs from the definition by %g", c, worst);
        for (size_t r = 0; r < (size_t)B * H * T; r++) {
            double sum = 0;
            for (int j = 0; j < T; j++)
                sum += att.f[r * T + j];
            assert_true(sum < 1.0 && sum > 0.0);
        }
        /* no sink at all: −1e30 leaves the window op's bits */
        float *yf = malloc(sizeof(float) * nq), *af = malloc(sizeof(float) * na), none[8];
        for (int h = 0; h < H; h++)
            none[h] = -1e30f;
        tkd_cpu_attn_window_fwd(q.f, k.f, v.f, B, T, H, Hkv, dh, W, af, yf);
        tkd_cpu_attn_sinks_fwd(q.f, k.f, v.f, B, T, H, Hkv, dh, W, NULL, none, att.f, y.f);
        assert_memory_equal(yf, y.f, sizeof(float) * nq);
        free(yf), free(af);
        drop(&q), drop(&k), drop(&v), drop(&sk), drop(&att), drop(&y);
    }
}

/* Packed documents (data.packing: documents): with doc, the fast path equals the double reference,
 * and each document's rows are bit for bit those of the document run alone (same keys, same order
 * of operations), with and without a window and sinks. */
static void test_attention_documents(void **s)
{
    (void)s;
    enum { B = 2, T = 13, H = 4, Hkv = 2, dh = 6 };
    static const int starts[B][5] = {{0, 1, 5, 9, -1}, {0, 6, -1}}; /* a one-token document, a long one */
    int32_t doc[B * T];
    tkd_test_doc_starts(&starts[0][0], 5, B, T, doc);
    size_t N = (size_t)B * T, nq = N * H * dh, nkv = N * Hkv * dh, na = (size_t)B * H * T * T;
    pair q = mk(nq, 7701, 1.5f), k = mk(nkv, 7702, 1.5f), v = mk(nkv, 7703, 1), sk = mk(H, 7704, 2);
    for (int c = 0; c < 4; c++) {
        int W = c & 1 ? 3 : 0;
        const float *sf = c & 2 ? sk.f : NULL;
        pair att = mk(na, 0, 0), y = mk(nq, 0, 0);
        tkd_cpu_attn_sinks_fwd(q.f, k.f, v.f, B, T, H, Hkv, dh, W, doc, sf, att.f, y.f);
        tkd_ref_attn_sinks_fwd(q.d, k.d, v.d, B, T, H, Hkv, dh, W, doc, c & 2 ? sk.d : NULL, att.d, y.d);
        expect_close(&att, "documents: attn probabilities");
        expect_close(&y, "documents: attn y");
        for (int b = 0; b < B; b++)
            for (int d = 0; starts[b][d] >= 0; d++) {
                int s0 = starts[b][d], s1 = starts[b][d + 1] >= 0 ? starts[b][d + 1] : T, n = s1 - s0;
                size_t r0 = (size_t)b * T + s0;
                float *ya = malloc(sizeof(float) * n * H * dh), *aa = malloc(sizeof(float) * H * n * n);
                assert_true(ya && aa);
                tkd_cpu_attn_sinks_fwd(q.f + r0 * H * dh, k.f + r0 * Hkv * dh, v.f + r0 * Hkv * dh, 1, n, H, Hkv, dh, W,
                                       NULL, sf, aa, ya);
                if (memcmp(ya, y.f + r0 * H * dh, sizeof(float) * n * H * dh) != 0)
                    fail_msg("case %d: sequence %d, document at %d (%d tokens): packed rows differ from it alone", c, b,
                             s0, n);
                for (int h = 0; h < H; h++) /* no weight on a key outside the document */
                    for (int i = s0; i < s1; i++)
                        for (int j = 0; j < T; j++)
                            if (j < s0 || j > i)
                                assert_true(att.f[(((size_t)b * H + h) * T + i) * T + j] == 0.0f);
                free(ya), free(aa);
            }
        drop(&att), drop(&y);
    }
    drop(&q), drop(&k), drop(&v), drop(&sk);
}

/* Large scores must not overflow: softmax subtracts the row max. */
static void test_attention_large_scores(void **s)
{
    (void)s;
    int B = 1, T = 4, H = 1, Hkv = 1, dh = 2;
    float q[8] = {100, 100, 100, 100, 100, 100, 100, 100}, k[8] = {100, 0, 0, 100, 100, 100, -100, 0};
    float v[8] = {1, 2, 3, 4, 5, 6, 7, 8}, att[16], y[8];
    tkd_cpu_attn_fwd(q, k, v, B, T, H, Hkv, dh, att, y);
    for (int i = 0; i < 8; i++)
        assert_true(isfinite(y[i]));
    assert_true(fabsf(y[4] - 5) < 1e-5f && fabsf(y[5] - 6) < 1e-5f); /* row 2: key 2 dominates */
}

static void test_swiglu(void **s)
{
    (void)s;
    int64_t sizes[] = {1, 7, 40001};
    for (int c = 0; c < 3; c++) {
        int64_t n = sizes[c];
        pair g = mk(n, 500 + c, 4), u = mk(n, 600 + c, 1), h = mk(n, 0, 0), dh = mk(n, 700 + c, 1);
        pair dg = mk(n, 800 + c, 1), du = mk(n, 900 + c, 1);
        if (n > 2) { /* saturated gates: silu(-30) ≈ 0, silu(30) ≈ 30 */
            g.f[0] = -30, g.d[0] = -30, g.f[1] = 30, g.d[1] = 30;
        }
        tkd_cpu_swiglu_fwd(g.f, u.f, n, h.f);
        tkd_ref_swiglu_fwd(g.d, u.d, n, h.d);
        expect_close(&h, "swiglu h");
        tkd_cpu_swiglu_bwd(dh.f, g.f, u.f, n, dg.f, du.f);
        tkd_ref_swiglu_bwd(dh.d, g.d, u.d, n, dg.d, du.d);
        expect_close(&dg, "swiglu dg");
        expect_close(&du, "swiglu du");
        drop(&g), drop(&u), drop(&h), drop(&dh), drop(&dg), drop(&du);
    }
}

TKD_TEST_MAIN(test_embedding, test_rmsnorm, test_linear, test_rope_inv_freq, test_rope_yarn, test_rope,
    test_attention, test_attention_window, test_attention_sinks, test_attention_documents, test_attention_large_scores, test_swiglu)
