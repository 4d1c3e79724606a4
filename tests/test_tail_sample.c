/* test_tail_sample.c — tail draws follow the teacher's tail distribution (chi-square), never land
 * in the top-k, and are a pure function of (seed, sequence index, position, draw). Also checks the
 * Philox4x32-10 generator against the published known answers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/ctr_rng.h"
#include "kernels/cpu/tail_sample.h"
#include "kernels/cpu/topk.h"
#include "tests/testutil.h"

static void test_philox_known_answers(void **state)
{
    (void)state;
    /* Random123's tests/kat_vectors, the three "philox4x32 10" lines (ctr[4] key[2] -> out[4]). */
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff,
         0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0,
         0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        tkd_philox4x32_10(kat[i], kat[i] + 4, out);
        assert_memory_equal(out, kat[i] + 6, sizeof out);
    }
    double u = tkd_ctr_rng_uniform(1, 2, 3, 4);
    assert_true(u >= 0.0 && u < 1.0);
}

static void test_weight(void **state)
{
    (void)state;
    const double one = 8796093022208.0; /* 2^43 */
    assert_true(tkd_tail_weight(3.0f, 3.0f, 1.0) == (uint64_t)one);
    /* (t - m)/τ = -1, -10, -25.5: within 1e-12 relative of 2^43·e^x (polynomial error < 2e-13
     * plus the final truncation, < 1 unit of a number ≥ 2^6) */
    const float ts[3] = {1.0f, -18.0f, -49.0f};
    for (int i = 0; i < 3; i++) {
        double x = ((double)ts[i] - 2.0) / 2.0;
        double w = (double)tkd_tail_weight(ts[i], 2.0f, 2.0);
        assert_true(tkd_test_close(w, one * exp(x), 1.0, 1e-12));
    }
    assert_true(tkd_tail_weight(-40.0f, 0.0f, 1.0) == 0); /* e^-40 < 2^-43: dropped */
    uint64_t prev = UINT64_MAX;
    for (int i = 0; i < 2000; i++) { /* monotone on a fine grid */
        uint64_t w = tkd_tail_weight(-0.0137f * (float)i, 0.0f, 0.9);
        assert_true(w <= prev);
        prev = w;
    }
}

/* Upper 0.999 quantile of chi-square with df degrees of freedom, Wilson–Hilferty approximation
 * (accurate to ~0.1% for df > 30; z = 3.0902 is the standard normal 0.999 quantile). For df = 44
 * it gives 78.8; tables give 78.75. */
static double chi2_crit_999(int df)
{
    double a = 2.0 / (9.0 * df);
    double c = 1.0 - a + 3.0902323061678132 * sqrt(a);
    return df * c * c * c;
}

/* Chi-square statistic of counts against p ∝ exp(t_v/τ) on the tail (not in topk). */
static double chi2_stat(const float *t, int V, const uint32_t *topk, int k, double tau,
                        const long *count, long n)
{
    double z = 0, stat = 0;
    int in_top[64] = {0};
    for (int j = 0; j < k; j++)
        in_top[topk[j]] = 1;
    for (int v = 0; v < V; v++)
        if (!in_top[v])
            z += exp(t[v] / tau);
    for (int v = 0; v < V; v++) {
        if (in_top[v])
            continue;
        double e = n * exp(t[v] / tau) / z;
        stat += (count[v] - e) * (count[v] - e) / e;
    }
    return stat;
}

static void test_chi_square(void **state)
{
    (void)state;
    enum { V = 50, K = 5, C = 40, S = 500 }; /* 20000 draws over a 45-token tail */
    const float tau = 1.5f;
    float *x = malloc(sizeof(float) * C * V);
    uint32_t *out = malloc(sizeof(uint32_t) * C * S);
    uint32_t idx[C * K];
    float val[C * K], lse[C];
    int64_t seq[C];
    int32_t pos[C];
    assert_true(x && out);
    /* One fixture row repeated; logits in [-2, 2] so every tail token expects > 100 draws. */
    for (int r = 0; r < C; r++) {
        for (int v = 0; v < V; v++)
            x[r * V + v] = 2.0f * sinf(1.7f * (float)v + 0.3f);
        seq[r] = 1000 + r / 8;
        pos[r] = r % 8;
    }
    assert_int_equal(tkd_topk_cpu(x, C, V, K, tau, idx, val, lse), TKD_OK);
    assert_int_equal(tkd_tail_sample_cpu(x, C, V, idx, K, tau, S, 42, seq, pos, out), TKD_OK);
    long count[V] = {0};
    for (int i = 0; i < C * S; i++) {
        assert_true(out[i] < V);
        count[out[i]]++;
    }
    for (int j = 0; j < K; j++)
        assert_int_equal(count[idx[j]], 0);
    const double crit = chi2_crit_999(V - K - 1);
    assert_true(crit > 78.0 && crit < 79.5);
    double stat = chi2_stat(x, V, idx, K, tau, count, (long)C * S);
    assert_true(stat < crit);
    /* The statistic has power: the same draws judged against τ = 1 must fail. */
    assert_true(chi2_stat(x, V, idx, K, 1.0, count, (long)C * S) > crit);
    free(x), free(out);
}

/* Random logits, their top-k, and draws for rows [r0, r0 + n) of a larger batch. */
typedef struct fixture {
    int64_t C, V;
    int k, S;
    float *x;
    uint32_t *idx;
    float *val, *lse;
    int64_t *seq;
    int32_t *pos;
} fixture;

static fixture fixture_make(int64_t C, int64_t V, int k, int S, uint64_t seed)
{
    fixture f = {C, V, k, S, malloc(sizeof(float) * C * V), malloc(sizeof(uint32_t) * C * k),
                 malloc(sizeof(float) * C * k), malloc(sizeof(float) * C),
                 malloc(sizeof(int64_t) * C), malloc(sizeof(int32_t) * C)};
    assert_true(f.x && f.idx && f.val && f.lse && f.seq && f.pos);
    tkd_test_randn(f.x, (size_t)(C * V), seed, 2.0f);
    for (int64_t r = 0; r < C; r++) {
        f.seq[r] = 7 + r / 3;
        f.pos[r] = (int32_t)(r % 3);
    }
    assert_int_equal(tkd_topk_cpu(f.x, C, V, k, 1.0f, f.idx, f.val, f.lse), TKD_OK);
    return f;
}

static void fixture_free(fixture *f)
{
    free(f->x), free(f->idx), free(f->val), free(f->lse), free(f->seq), free(f->pos);
}

static void draw(const fixture *f, int64_t r0, int64_t n, uint64_t seed, uint32_t *out)
{
    assert_int_equal(tkd_tail_sample_cpu(f->x + r0 * f->V, n, f->V, f->idx + r0 * f->k, f->k, 1.0f,
                                         f->S, seed, f->seq + r0, f->pos + r0, out), TKD_OK);
}

static double frac_equal(const uint32_t *a, const uint32_t *b, size_t n)
{
    size_t e = 0;
    for (size_t i = 0; i < n; i++)
        e += a[i] == b[i];
    return (double)e / (double)n;
}

static void test_never_topk_and_reproducible(void **state)
{
    (void)state;
    fixture f = fixture_make(10, 3001, 128, 256, 5);
    size_t n = (size_t)(f.C * f.S);
    uint32_t *a = malloc(n * 4), *b = malloc(n * 4), *c = malloc(n * 4);
    assert_true(a && b && c);
    draw(&f, 0, f.C, 99, a);
    for (int64_t r = 0; r < f.C; r++)
        for (int j = 0; j < f.S; j++) {
            uint32_t t = a[r * f.S + j];
            assert_true(t < f.V);
            for (int i = 0; i < f.k; i++)
                assert_int_not_equal(t, f.idx[r * f.k + i]);
        }
    draw(&f, 0, f.C, 99, b);
    assert_memory_equal(a, b, n * 4); /* same key, same draws */
    /* Split invariance: rows 0..4 then 5..9, each with its own global index and position. */
    draw(&f, 0, 5, 99, c);
    draw(&f, 5, 5, 99, c + 5 * f.S);
    assert_memory_equal(a, c, n * 4);
    /* Another seed, or another position, gives other draws. Two independent draws from one of
     * these tails coincide with probability Σ p² < 0.05 (checked loosely at 0.2). */
    draw(&f, 0, f.C, 100, b);
    assert_true(frac_equal(a, b, n) < 0.2);
    for (int64_t r = 0; r < f.C; r++)
        f.pos[r] += 1;
    draw(&f, 0, f.C, 99, b);
    assert_true(frac_equal(a, b, n) < 0.2);
    /* Draw order: distinct draws of one row differ too (not one token repeated). */
    assert_true(frac_equal(a, a + 1, (size_t)f.S - 1) < 0.2);
    free(a), free(b), free(c);
    fixture_free(&f);
}

static void test_edge_rows(void **state)
{
    (void)state;
    /* Tail of one token: V = k + 1. */
    float x[6] = {5, 4, 3, 2, 1, 0};
    uint32_t idx[5] = {0, 1, 2, 3, 4}, out[8];
    int64_t seq = 0;
    int32_t pos = 0;
    assert_int_equal(tkd_tail_sample_cpu(x, 1, 6, idx, 5, 1.0f, 8, 1, &seq, &pos, out), TKD_OK);
    for (int j = 0; j < 8; j++)
        assert_int_equal(out[j], 5);
    /* Tail 2e4 below the top-k and spread over e^-30: weights are relative to the tail's own max,
     * so draws still come from the tail, mostly its top token (index 3 then 4). */
    float y[6] = {1e4f, 1e4f, -1e4f, -1e4f + 29.0f, -1e4f + 30.0f, -1e4f};
    uint32_t ti[2] = {1, 0}, o2[64];
    assert_int_equal(tkd_tail_sample_cpu(y, 1, 6, ti, 2, 1.0f, 64, 3, &seq, &pos, o2), TKD_OK);
    int n4 = 0;
    for (int j = 0; j < 64; j++) {
        assert_true(o2[j] >= 2 && o2[j] <= 5);
        n4 += o2[j] == 4;
    }
    assert_true(n4 > 32); /* p(4) = e/(e + 1 + ...) ≈ 0.73 */
    /* S = 0 writes nothing and succeeds. */
    assert_int_equal(tkd_tail_sample_cpu(x, 1, 6, idx, 5, 1.0f, 0, 1, &seq, &pos, NULL), TKD_OK);
}

static void test_errors(void **state)
{
    (void)state;
    fixture f = fixture_make(4, 100, 8, 4, 3);
    uint32_t out[16];
    f.idx[2 * 8 + 3] = 100; /* id ≥ V in row 2 */
    assert_int_equal(tkd_tail_sample_cpu(f.x, 4, 100, f.idx, 8, 1.0f, 4, 1, f.seq, f.pos, out),
                     TKD_ERR_INVALID_ARG);
    assert_non_null(strstr(tkd_error_msg(), "row 2"));
    f.idx[2 * 8 + 3] = 0;
    f.x[3 * 100 + 50] = NAN;
    assert_int_equal(tkd_tail_sample_cpu(f.x, 4, 100, f.idx, 8, 1.0f, 4, 1, f.seq, f.pos, out),
                     TKD_ERR_NUMERIC);
    assert_non_null(strstr(tkd_error_msg(), "row 3"));
    assert_int_equal(tkd_tail_sample_cpu(f.x, 1, 8, f.idx, 8, 1.0f, 4, 1, f.seq, f.pos, out),
                     TKD_ERR_INVALID_ARG); /* V == k: empty tail */
    assert_int_equal(tkd_tail_sample_cpu(f.x, 1, 100, f.idx, 8, 1.0f, TKD_TAIL_MAX_S + 1, 1, f.seq,
                                         f.pos, out), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_tail_sample_cpu(f.x, 1, 100, f.idx, 8, -1.0f, 4, 1, f.seq, f.pos, out),
                     TKD_ERR_INVALID_ARG);
    fixture_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_philox_known_answers),
        cmocka_unit_test(test_weight),
        cmocka_unit_test(test_chi_square),
        cmocka_unit_test(test_never_topk_and_reproducible),
        cmocka_unit_test(test_edge_rows),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
