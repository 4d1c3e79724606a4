/* test_gpu_attn.c — the CUDA causal GQA attention forward (kernels/attn_cuda.h) against the CPU:
 * tkd_cpu_attn_fwd (fp32, kernels/cpu_ops.h) for every output where its (B, H, T, T) scratch is
 * small, and a float64 reference of this file for y and lse on every row (T ≤ 1024) or on a sample
 * of rows (the first and last 70, every 97th, both sides of each 128-row boundary). Inputs are
 * rounded to bf16 first, so the only differences are the GPU's fp32 accumulation order, its bf16
 * rounding of the probabilities P before P·V and the bf16 rounding of y. Every case also checks
 * that y and lse are written exactly where they should be (buffers pre-filled with NaN and
 * followed by a NaN guard band) and that lse = NULL gives bit-identical y. Labelled gpu: exits 77
 * (skipped) where no GPU answers or the build has no CUDA backend.
 *
 * Tolerances (v ~ normal(0, 1), so |y| ≲ 4):
 *   y, per element: |Δ| ≤ 1e-2 + 1e-2·|ref|. bf16 y: ≤ 2^-8 = 3.9e-3 relative. bf16 P: each
 *     weight off by ≤ 2^-8 relative, y by ≤ 2^-8·Σ p|v| / Σ p in the worst case (signs aligned),
 *     ≈ 2^-8·|v| / √(keys that matter) in practice; 1e-2 absolute covers two comparable keys with
 *     |v| ≈ 2 and rounding errors of one sign. fp32 scores and sums add ~1e-6.
 *   y, over a case: ‖Δ‖₂ / ‖ref‖₂ ≤ 1e-2 (an indexing error gives O(1)).
 *   A numpy model of these roundings (bf16 P and y, exact elsewhere) on this file's shapes and
 *   input scales gave at most 0.34 of the element tolerance and a norm ratio of ≤ 2e-3.
 *   lse: |Δ| ≤ 1e-3 + 2e-5·|ref|. The scores are fp32 sums of exact bf16 products (error ≲
 *     dh·2^-24·Σ_d|q_d k_d|/√dh, typically √dh·2^-24·that), ex2.approx is good to ~2^-22, and the
 *     fp32 row sum of ≤ T terms to ~1e-5 relative: ~1e-5 absolute on lse at O(1) scores. The
 *     relative part is for the cases with scores in the thousands (lse ≈ the largest score), where
 *     one fp32 ulp of a partial dot product is already ~1e-3 and Σ|q_d k_d|/√dh ≈ 2·lse.
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

#include "common/half.h"
#include "kernels/cpu_ops.h"
#include "tests/gpu_testutil.h"
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/attn_cuda.h"

#define Y_ATOL 1e-2
#define Y_RTOL 1e-2
#define Y_NORM_TOL 1e-2
#define LSE_ATOL 1e-3
#define LSE_RTOL 2e-5
#define GUARD 4096          /* NaN elements after y and lse that must stay untouched */
#define FULL_ROWS_MAX 1024  /* up to this T the float64 reference checks every row */

/* The kernel under test: the flash kernel, or (test_simple) the simple fallback for other dh. */
typedef tkd_status (*attn_fn)(const uint16_t *, const uint16_t *, const uint16_t *, int, int, int, int, int,
                              uint16_t *, float *, void *);
static attn_fn g_fwd = tkd_cuda_attn_fwd;

typedef struct acase {
    const char *what;
    int B, T, H, Hkv, dh;
    float std;   /* q and k ~ normal(0, std²): scores ~ normal(0, std⁴); v ~ normal(0, 1) */
    int cpu_ref; /* also every y against tkd_cpu_attn_fwd (B·H·T² floats of scratch) */
    uint64_t seed;
} acase;

/* The inputs (bf16-rounded floats and their bits) and the GPU's outputs of one case. */
typedef struct run {
    int64_t nq, nkv, nl;   /* elements of q / y, of k / v, of lse */
    float *q, *k, *v;      /* (B·T, H·dh), (B·T, Hkv·dh) ×2 */
    uint16_t *qb, *kb, *vb;
    uint16_t *y, *y_nolse; /* (B·T, H·dh) + GUARD */
    float *lse;            /* (B, H, T) + GUARD */
} run;

/* Worst error seen over a case, and where. */
typedef struct errs {
    double max_y, num, den; /* max |Δy| / allowed; Σ Δ², Σ ref² */
    double max_lse;         /* max |Δlse| / allowed */
    int64_t n_bad;
    char where[160];        /* the worst failing element */
} errs;

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Runs the kernel twice (with lse, then without) on fresh random inputs; checks the guard bands,
 * that every in-range output was written, and that both runs agree bit for bit. */
static void run_gpu(run *r, const acase *c)
{
    r->nq = (int64_t)c->B * c->T * c->H * c->dh;
    r->nkv = (int64_t)c->B * c->T * c->Hkv * c->dh;
    r->nl = (int64_t)c->B * c->H * c->T;
    r->q = malloc(sizeof(float) * r->nq), r->k = malloc(sizeof(float) * r->nkv);
    r->v = malloc(sizeof(float) * r->nkv);
    r->qb = malloc(2 * r->nq), r->kb = malloc(2 * r->nkv), r->vb = malloc(2 * r->nkv);
    r->y = malloc(2 * (r->nq + GUARD)), r->y_nolse = malloc(2 * r->nq);
    r->lse = malloc(sizeof(float) * (r->nl + GUARD));
    assert_true(r->q && r->k && r->v && r->qb && r->kb && r->vb && r->y && r->y_nolse && r->lse);
    tkd_test_fill_bf16(r->q, r->qb, r->nq, c->seed * 3 + 1, c->std);
    tkd_test_fill_bf16(r->k, r->kb, r->nkv, c->seed * 3 + 2, c->std);
    tkd_test_fill_bf16(r->v, r->vb, r->nkv, c->seed * 3 + 3, 1.0f);

    uint16_t *dq = tkd_test_dev_alloc(2 * r->nq), *dk = tkd_test_dev_alloc(2 * r->nkv),
             *dv = tkd_test_dev_alloc(2 * r->nkv);
    uint16_t *dy = tkd_test_dev_alloc(2 * (r->nq + GUARD)), *dy2 = tkd_test_dev_alloc(2 * r->nq);
    float *dl = tkd_test_dev_alloc(sizeof(float) * (r->nl + GUARD));
    assert_int_equal(cudaMemcpy(dq, r->qb, 2 * r->nq, cudaMemcpyHostToDevice), cudaSuccess);
    assert_int_equal(cudaMemcpy(dk, r->kb, 2 * r->nkv, cudaMemcpyHostToDevice), cudaSuccess);
    assert_int_equal(cudaMemcpy(dv, r->vb, 2 * r->nkv, cudaMemcpyHostToDevice), cudaSuccess);
    assert_int_equal(cudaMemset(dy, 0xff, 2 * (r->nq + GUARD)), cudaSuccess); /* bf16 NaN */
    assert_int_equal(cudaMemset(dy2, 0xff, 2 * r->nq), cudaSuccess);
    assert_int_equal(cudaMemset(dl, 0xff, sizeof(float) * (r->nl + GUARD)), cudaSuccess); /* NaN */
    tkd_status st = g_fwd(dq, dk, dv, c->B, c->T, c->H, c->Hkv, c->dh, dy, dl, NULL);
    if (st != TKD_OK)
        fail_msg("%s: attention forward: %s: %s", c->what, tkd_status_name(st), tkd_error_msg());
    st = g_fwd(dq, dk, dv, c->B, c->T, c->H, c->Hkv, c->dh, dy2, NULL, NULL);
    assert_int_equal(st, TKD_OK);
    cudaError_t ce = cudaDeviceSynchronize();
    if (ce != cudaSuccess)
        fail_msg("%s: kernel failed: %s", c->what, cudaGetErrorString(ce));
    assert_int_equal(cudaMemcpy(r->y, dy, 2 * (r->nq + GUARD), cudaMemcpyDeviceToHost), cudaSuccess);
    assert_int_equal(cudaMemcpy(r->y_nolse, dy2, 2 * r->nq, cudaMemcpyDeviceToHost), cudaSuccess);
    assert_int_equal(cudaMemcpy(r->lse, dl, sizeof(float) * (r->nl + GUARD), cudaMemcpyDeviceToHost),
                     cudaSuccess);
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dy), cudaFree(dy2), cudaFree(dl);

    for (int64_t i = 0; i < GUARD; i++) {
        if (r->y[r->nq + i] != 0xffff)
            fail_msg("%s: y written past its end (element nq + %lld = 0x%04x)", c->what, (long long)i,
                     r->y[r->nq + i]);
        if (f32_bits(r->lse[r->nl + i]) != 0xffffffffu)
            fail_msg("%s: lse written past its end (element %lld + %lld)", c->what, (long long)r->nl,
                     (long long)i);
    }
    for (int64_t i = 0; i < r->nq; i++)
        if (!isfinite(tkd_bf16_to_f32(r->y[i])) || r->y[i] != r->y_nolse[i])
            fail_msg("%s: y[%lld] (row %lld, column %lld) = 0x%04x with lse, 0x%04x without "
                     "(non-finite: unwritten or overflow; different: lse = NULL changed y)",
                     c->what, (long long)i, (long long)(i / ((int64_t)c->H * c->dh)),
                     (long long)(i % ((int64_t)c->H * c->dh)), r->y[i], r->y_nolse[i]);
    for (int64_t i = 0; i < r->nl; i++)
        if (!isfinite(r->lse[i]))
            fail_msg("%s: lse[%lld] = %g (b·H + h = %lld, t = %lld)", c->what, (long long)i,
                     (double)r->lse[i], (long long)(i / c->T), (long long)(i % c->T));
}

static void run_free(run *r)
{
    free(r->q), free(r->k), free(r->v), free(r->qb), free(r->kb), free(r->vb);
    free(r->y), free(r->y_nolse), free(r->lse);
}

/* float64 softmax attention of query row t of head h in batch b: y (dh) and returns the lse.
 * sc: scratch of t + 1 doubles. */
static double ref_row(const run *r, const acase *c, int b, int h, int t, double *y, double *sc)
{
    const int qs = c->H * c->dh, kvs = c->Hkv * c->dh, g = h / (c->H / c->Hkv);
    const float *qi = r->q + ((int64_t)b * c->T + t) * qs + (int64_t)h * c->dh;
    const float *k0 = r->k + (int64_t)b * c->T * kvs + (int64_t)g * c->dh;
    const float *v0 = r->v + (int64_t)b * c->T * kvs + (int64_t)g * c->dh;
    const double scale = 1.0 / sqrt((double)c->dh);
    double m = -INFINITY, sum = 0.0;
    for (int j = 0; j <= t; j++) {
        double s = 0.0;
        for (int d = 0; d < c->dh; d++)
            s += (double)qi[d] * k0[(int64_t)j * kvs + d];
        sc[j] = s * scale;
        m = fmax(m, sc[j]);
    }
    for (int d = 0; d < c->dh; d++)
        y[d] = 0.0;
    for (int j = 0; j <= t; j++) {
        double p = exp(sc[j] - m);
        sum += p;
        for (int d = 0; d < c->dh; d++)
            y[d] += p * v0[(int64_t)j * kvs + d];
    }
    for (int d = 0; d < c->dh; d++)
        y[d] /= sum;
    return m + log(sum);
}

/* Records one y element's error: how far over its tolerance (≤ 1 passes) and where. */
static void note_y(errs *e, double got, double ref, int b, int h, int t, int d,
                   const char *against)
{
    double excess = fabs(got - ref) / (Y_ATOL + Y_RTOL * fabs(ref));
    e->num += (got - ref) * (got - ref);
    e->den += ref * ref;
    if (excess > 1.0)
        e->n_bad++;
    if (excess > e->max_y) {
        e->max_y = excess;
        snprintf(e->where, sizeof e->where, "y[b=%d t=%d h=%d d=%d]: gpu %.6g, %s %.6g", b, t, h, d,
                 got, against, ref);
    }
}

static int sampled(int t, int T)
{
    return T <= FULL_ROWS_MAX || t < 70 || t >= T - 70 || t % 97 == 0 || t % 128 == 0 || t % 128 == 127;
}

/* The float64 reference on the rows `sampled` picks, for y and lse. */
static void check_ref64(const run *r, const acase *c, errs *e)
{
    double *y = malloc(sizeof(double) * c->dh), *sc = malloc(sizeof(double) * c->T);
    assert_true(y && sc);
    for (int b = 0; b < c->B; b++)
        for (int h = 0; h < c->H; h++)
            for (int t = 0; t < c->T; t++) {
                if (!sampled(t, c->T))
                    continue;
                double lse = ref_row(r, c, b, h, t, y, sc);
                const uint16_t *yg = r->y + ((int64_t)b * c->T + t) * c->H * c->dh + (int64_t)h * c->dh;
                for (int d = 0; d < c->dh; d++)
                    note_y(e, tkd_bf16_to_f32(yg[d]), y[d], b, h, t, d, "ref64");
                double got = r->lse[((int64_t)b * c->H + h) * c->T + t];
                double excess = fabs(got - lse) / (LSE_ATOL + LSE_RTOL * fabs(lse));
                if (excess > e->max_lse) {
                    e->max_lse = excess;
                    if (excess > 1.0)
                        snprintf(e->where, sizeof e->where, "lse[b=%d h=%d t=%d]: gpu %.9g, ref64 %.9g",
                                 b, h, t, got, lse);
                }
            }
    free(y), free(sc);
}

/* Every y against tkd_cpu_attn_fwd on the same bf16-rounded inputs. */
static void check_cpu(const run *r, const acase *c, errs *e)
{
    float *att = malloc(sizeof(float) * (size_t)c->B * c->H * c->T * c->T);
    float *y = malloc(sizeof(float) * r->nq);
    assert_true(att && y);
    tkd_cpu_attn_fwd(r->q, r->k, r->v, c->B, c->T, c->H, c->Hkv, c->dh, att, y);
    for (int64_t i = 0; i < r->nq; i++) {
        int64_t row = i / ((int64_t)c->H * c->dh), col = i % ((int64_t)c->H * c->dh);
        note_y(e, tkd_bf16_to_f32(r->y[i]), y[i], (int)(row / c->T), (int)(col / c->dh),
               (int)(row % c->T), (int)(col % c->dh), "cpu");
    }
    free(att), free(y);
}

static void run_case(const acase *c)
{
    run r;
    errs e = {0};
    run_gpu(&r, c);
    check_ref64(&r, c, &e);
    if (c->cpu_ref)
        check_cpu(&r, c, &e);
    double norm = sqrt(e.num / (e.den > 0 ? e.den : 1.0));
    print_message("%-34s B=%d T=%-5d H=%-2d Hkv=%-2d dh=%-3d: y max err/tol %.3f, rel norm %.2e; "
                  "lse max err/tol %.3f\n", c->what, c->B, c->T, c->H, c->Hkv, c->dh, e.max_y, norm,
                  e.max_lse);
    run_free(&r);
    if (e.n_bad > 0 || e.max_lse > 1.0 || !(norm <= Y_NORM_TOL))
        fail_msg("%s: %lld y elements out of tolerance, y rel norm %.3g (tol %g), lse err/tol %.3g; "
                 "worst: %s", c->what, (long long)e.n_bad, norm, Y_NORM_TOL, e.max_lse, e.where);
}

static void test_small(void **state)
{
    static const acase cases[] = {
        {"T = 1", 1, 1, 2, 1, 64, 1.0f, 1, 1},
        {"T = 17, B = 2, GQA 2, dh 48", 2, 17, 4, 2, 48, 1.5f, 1, 2},
        {"T = 1000, GQA 7, dh 128", 1, 1000, 7, 1, 128, 1.5f, 1, 3},
        {"T = 1000, B = 2, GQA 1, dh 64", 2, 1000, 2, 2, 64, 1.0f, 1, 4},
        {"T = 1000, GQA 2, dh 48", 1, 1000, 4, 2, 48, 2.0f, 1, 5},
        {"T = 333, GQA 3, dh 80", 1, 333, 6, 2, 80, 1.5f, 1, 6},
        {"T = 200, B = 2, GQA 1, dh 96", 2, 200, 3, 3, 96, 1.5f, 1, 7},
        {"T = 128 (one full query tile)", 1, 128, 2, 1, 128, 1.5f, 1, 8},
        {"T = 65 (one key past a tile)", 1, 65, 2, 2, 64, 1.5f, 1, 9},
    };
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
}

/* Long sequences: only the float64 reference, on sampled rows. */
static void test_long(void **state)
{
    static const acase cases[] = {
        {"T = 8192, GQA 2, dh 128", 1, 8192, 4, 2, 128, 1.5f, 0, 11},
        {"T = 8192, GQA 7, dh 48", 1, 8192, 7, 1, 48, 1.5f, 0, 12},
        {"T = 8192, B = 2, GQA 1, dh 64", 2, 8192, 2, 2, 64, 1.0f, 0, 13},
        {"T = 4097, GQA 2, dh 128", 1, 4097, 2, 1, 128, 2.0f, 0, 14},
    };
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
}

/* Scores in the thousands (q, k ~ normal(0, 30²)): exp(s) overflows fp32 without the running max. */
static void test_large_scores(void **state)
{
    static const acase cases[] = {
        {"large scores, dh 64", 1, 300, 2, 1, 64, 30.0f, 1, 21},
        {"large scores, dh 128, T = 4100", 1, 4100, 2, 2, 128, 20.0f, 0, 22},
    };
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
}

/* The simple kernel (kernels/attn_simple_cuda.cu) at the head sizes only it takes (the fixtures'
 * 16, the demo teacher's 32) and one the flash kernel takes too, same references and tolerances. */
static void test_simple(void **state)
{
    static const acase cases[] = {
        {"simple: T = 1, dh 16", 1, 1, 2, 1, 16, 1.0f, 1, 21},
        {"simple: T = 17, B = 2, GQA 2, dh 16", 2, 17, 4, 2, 16, 1.5f, 1, 22},
        {"simple: T = 300, GQA 7, dh 32", 1, 300, 7, 1, 32, 1.5f, 1, 23},
        {"simple: T = 1000, B = 2, GQA 2, dh 64", 2, 1000, 4, 2, 64, 1.0f, 1, 24},
    };
    (void)state;
    g_fwd = tkd_cuda_attn_fwd_simple;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
    g_fwd = tkd_cuda_attn_fwd;
}

static void test_errors(void **state)
{
    (void)state;
    uint16_t *d = tkd_test_dev_alloc(4096);
    float *l = tkd_test_dev_alloc(4096);
    assert_int_equal(tkd_cuda_attn_fwd(d, d, d, 1, 4, 2, 1, 32, d, l, NULL), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("head dim 32");
    assert_int_equal(tkd_cuda_attn_fwd(d, d, d, 1, 4, 2, 1, 72, d, l, NULL), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("head dim 72");
    assert_int_equal(tkd_cuda_attn_fwd(d, d, d, 1, 4, 6, 4, 64, d, l, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_attn_fwd(d, d, d, 1, -1, 2, 1, 64, d, l, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_attn_fwd(d + 1, d, d, 1, 4, 2, 1, 64, d, l, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_attn_fwd(d, d, d, 0, 4, 2, 1, 64, d, l, NULL), TKD_OK); /* empty batch */
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    cudaFree(d), cudaFree(l);
}
#endif /* TKD_HAVE_CUDA */

int main(void)
{
    tkd_test_require_gpu();
#ifdef TKD_HAVE_CUDA
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_small),
        cmocka_unit_test(test_large_scores),
        cmocka_unit_test(test_long),
        cmocka_unit_test(test_simple),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#else
    return 77;
#endif
}
