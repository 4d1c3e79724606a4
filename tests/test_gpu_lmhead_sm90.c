/* test_gpu_lmhead_sm90.c — our Hopper LM-head GEMM (kernels/gemm_sm90/lmhead_sm90.h): the fp32 logits
 * epilogue against a CPU float64 reference and against cuBLAS (bf16 -> fp32, same inputs), and the
 * statistics epilogue's log-sum-exps against a float64 reference, over awkward shapes (N, V not
 * multiples of the 128 x 256 tile, one row, one column, D not a multiple of 64) and rows of huge
 * and tiny logits; the fused logits + statistics epilogue (the loss's pass) against the two
 * separate ones, bit for bit. Every test runs under both schedules (ping-pong, then cooperative: two
 * cmocka groups, named so), and the partials must not depend on the schedule or the grid.
 * Labelled gpu: exits 77 where no GPU answers or it is not compute capability 9.0.
 *
 * Tolerances. The inputs are bf16, so every product h_k·w_k is exact in fp32 (8 + 8 significand
 * bits) and the only error is the fp32 summation over D: any order of D − 1 fp32 additions is
 * within (D − 1)·u·Σ_k |h_k w_k| of the exact sum (u = 2^-24, recursive summation), twice that if
 * the tensor cores' adder truncates instead of rounding. Σ_k |h_k w_k| ≤ ‖h_i‖₂‖w_v‖₂ (Cauchy–
 * Schwarz), cheap for every element. So:
 *   logits vs float64:  |Δ| ≤ 2·D·u·‖h_i‖‖w_v‖ per element;
 *   logits vs cuBLAS:   |Δ| ≤ 4·D·u·‖h_i‖‖w_v‖ (both sides carry the bound);
 *   both also ‖Δ‖₂/‖ref‖₂ ≤ 1e-5 (fp32 sums land far under it; a wrong tile does not).
 *   LSE at scale 1: |Δ| ≤ B_i + 1e-5·(1 + |lse|), B_i = 2·D·u·‖h_i‖·max_v ‖w_v‖: the LSE is
 *     1-Lipschitz in the max-norm of the logits (B_i), and the ex2.approx of each term (relative
 *     ~2^-22), the fp32 products (z − m)·log2 e (≤ 20·1.44·u on every term that matters) and the
 *     fp32 result (|lse|·u) stay under 1e-5·(1 + |lse|).
 *   LSE at scale 1/τ: the same with B_i / τ (τ = 1, 2 and 3: the epilogue's three paths).
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
#include "common/rng.h"
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/gemm_sm90/lmhead_sm90.h"
#include "kernels/gemm_sm90/lmhead_sm90_tuning.h"
#include "kernels/cpu/topk.h"
#include "tests/gpu_testutil.h"

#define FP32_U 5.9604644775390625e-8 /* 2^-24 */
#define REL_NORM_TOL 1e-5
#define LSE_TOL 1e-5
#define MAX_PRINTS 8 /* failures printed per check; all are counted */

/* The running group's schedule (setup_pingpong / setup_coop set it on the workspace). */
static tkd_lmhead_sm90_sched g_sched;

/* Inputs: h (N, D), w (V, D) bf16, on the host as bits and doubles and on the device; the row
 * norms ‖h_i‖₂, ‖w_v‖₂. */
typedef struct inputs {
    int64_t n;
    int d, v;
    uint16_t *hb, *wb;
    double *h, *w, *hn, *wn;
    uint16_t *dh, *dw;
} inputs;

/* Scales row i of h by 2^e (exact in bf16 while in range). */
static void scale_row(uint16_t *row, int d, int e)
{
    for (int k = 0; k < d; k++)
        row[k] = tkd_f32_to_bf16(ldexpf(tkd_bf16_to_f32(row[k]), e));
}

static double *row_norms(const double *x, int64_t rows, int d)
{
    double *nrm = tkd_test_xmalloc(sizeof(double) * (size_t)rows);
    for (int64_t i = 0; i < rows; i++) {
        double s = 0.0;
        for (int k = 0; k < d; k++)
            s += x[i * d + k] * x[i * d + k];
        nrm[i] = sqrt(s);
    }
    return nrm;
}

/* Random h (std 1) and w (std 2.5/√D: logits of std ~2.5, like an LM head's). With extreme, rows
 * i % 7 == 3 are scaled by 2^10 (logits ~1e4) and rows i % 7 == 5 by 2^-30 (logits ~1e-9). */
static inputs inputs_make(int64_t n, int d, int v, uint64_t seed, int extreme)
{
    inputs in = {.n = n, .d = d, .v = v};
    in.hb = tkd_test_rand_bf16((size_t)(n * d), seed, 1.0f);
    in.wb = tkd_test_rand_bf16((size_t)v * d, seed + 1, 2.5f / sqrtf((float)d));
    for (int64_t i = 0; extreme && i < n; i++)
        if (i % 7 == 3 || i % 7 == 5)
            scale_row(in.hb + i * d, d, i % 7 == 3 ? 10 : -30);
    in.h = tkd_test_bf16_to_f64(in.hb, (size_t)(n * d));
    in.w = tkd_test_bf16_to_f64(in.wb, (size_t)v * d);
    in.hn = row_norms(in.h, n, d);
    in.wn = row_norms(in.w, v, d);
    in.dh = tkd_test_dev_alloc((size_t)(n * d) * 2);
    in.dw = tkd_test_dev_alloc((size_t)v * d * 2);
    tkd_test_to_dev(in.dh, in.hb, (size_t)(n * d) * 2);
    tkd_test_to_dev(in.dw, in.wb, (size_t)v * d * 2);
    return in;
}

static void inputs_free(inputs *in)
{
    free(in->hb), free(in->wb), free(in->h), free(in->w), free(in->hn), free(in->wn);
    cudaFree(in->dh), cudaFree(in->dw);
}

/* h_i · w_v in float64. */
static double ref_dot(const inputs *in, int64_t i, int v)
{
    const double *hi = in->h + i * in->d, *wv = in->w + (size_t)v * in->d;
    double s = 0.0;
    for (int k = 0; k < in->d; k++)
        s += hi[k] * wv[k];
    return s;
}

/* z[0..V) = h_i · w_vᵀ in float64. */
static void ref_row(const inputs *in, int64_t i, double *z)
{
    for (int v = 0; v < in->v; v++)
        z[v] = ref_dot(in, i, v);
}

/* For a wrong logit: which elements of its 128 x 256 output tile have, in float64, the value we
 * got. A hit elsewhere means a permuted layout (swizzle, descriptor, accumulator fragment); none
 * means a wrong sum (a K step missed or doubled, garbage). */
static void diagnose(const inputs *in, double got, int64_t i, int v)
{
    const int64_t r0 = i / TKD_LMHEAD_SM90_BM * TKD_LMHEAD_SM90_BM;
    const int c0 = v / TKD_LMHEAD_SM90_BN * TKD_LMHEAD_SM90_BN;
    int found = 0;
    for (int64_t r = r0; r < r0 + TKD_LMHEAD_SM90_BM && r < in->n; r++)
        for (int c = c0; c < c0 + TKD_LMHEAD_SM90_BN && c < in->v && found < 4; c++) {
            double ref = ref_dot(in, r, c);
            if (fabs(ref - got) <= 1e-5 * (fabs(got) + 1e-3) && found++ < 4)
                printf("    the value got at (%lld, %d) is the reference of (%lld, %d): %+lld rows, %+d "
                       "columns within the tile\n", (long long)i, v, (long long)r, c,
                       (long long)(r - i), c - v);
        }
    if (!found)
        printf("    no element of its 128 x 256 tile has the value got at (%lld, %d): not a permutation "
               "(a wrong sum: K steps missed or doubled, stale or garbage data)\n", (long long)i, v);
}

/* Wrong elements by position in a 128 x 256 block of the output: rows in blocks of 16 (a consumer
 * warp each; cooperative: 0-3 warpgroup 1, 4-7 warpgroup 2; ping-pong: 0-3 the even 64-row tiles,
 * 4-7 the odd ones, i.e. one warpgroup each on one CTA), columns in blocks of 32. */
typedef struct fail_map { int rows[8], cols[8]; } fail_map;

static void fail_map_print(const fail_map *f, const char *what)
{
    printf("    %s failures by tile row block of 16:", what);
    for (int k = 0; k < 8; k++)
        printf(" %d", f->rows[k]);
    printf("; by tile column block of 32:");
    for (int k = 0; k < 8; k++)
        printf(" %d", f->cols[k]);
    printf("\n");
}

static int is_poison(float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    return b == 0xffffffffu;
}

/* ---- the fp32 logits epilogue ---------------------------------------------------------------- */

/* The row stride the tests give z: at least two guard columns past V, even (the kernel stores
 * column pairs as 8-byte writes, so it takes only even strides). */
static int64_t ldz_of(int64_t v) { return (v + 3) & ~(int64_t)1; }

/* Our logits (N, ldz) fp32, ldz = ldz_of(V) and one guard row past N, all poisoned first; returns the
 * host copy ((N + 1) · ldz floats). */
static float *run_logits(tkd_lmhead_sm90_ws *ws, const inputs *in, int64_t ldz)
{
    size_t bytes = (size_t)(in->n + 1) * ldz * 4;
    float *dz = tkd_test_dev_alloc(bytes), *z = tkd_test_xmalloc(bytes);
    tkd_test_poison(dz, bytes);
    tkd_test_ok(tkd_lmhead_sm90_logits(ws, in->dh, in->dw, in->n, in->d, in->v, dz, ldz), "logits");
    tkd_test_ok(tkd_lmhead_sm90_sync(ws), "logits sync");
    tkd_test_to_host(z, dz, bytes, NULL);
    cudaFree(dz);
    return z;
}

/* cuBLAS's z (N, ldz) = H Wᵀ, bf16 inputs, fp32 accumulation and output (column-major view:
 * Zᵀ (V x N) = W (D x V)ᵀ · H (D x N)). */
static float *run_cublas(const inputs *in, int64_t ldz)
{
    size_t bytes = (size_t)in->n * ldz * 4;
    float *dz = tkd_test_dev_alloc(bytes), *z = tkd_test_xmalloc(bytes);
    cublasHandle_t hd;
    assert_int_equal(cublasCreate(&hd), CUBLAS_STATUS_SUCCESS);
    const float one = 1.0f, zero = 0.0f;
    assert_int_equal(cublasGemmEx(hd, CUBLAS_OP_T, CUBLAS_OP_N, in->v, (int)in->n, in->d, &one, in->dw,
                                  CUDA_R_16BF, in->d, in->dh, CUDA_R_16BF, in->d, &zero, dz, CUDA_R_32F,
                                  (int)ldz, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                     CUBLAS_STATUS_SUCCESS);
    tkd_test_to_host(z, dz, bytes, NULL);
    cublasDestroy(hd);
    cudaFree(dz);
    return z;
}

/* Element checks of got (N, ldz) against exp (row i from exp_row) with |Δ| ≤ k·D·u·‖h_i‖‖w_v‖;
 * also the norm-wise error, and (when guards) that columns [V, ldz) and row N kept their poison.
 * Prints up to MAX_PRINTS failures; returns their count. */
typedef void (*row_fn)(const inputs *in, int64_t i, double *z, const void *ctx);

static int check_logits(const inputs *in, const float *got, int64_t ldz, row_fn exp_row,
                        const void *ctx, double k, int guards, const char *what)
{
    double *ref = tkd_test_xmalloc(sizeof(double) * (size_t)in->v), num = 0.0, den = 0.0;
    int bad = 0;
    fail_map fm = {{0}, {0}};
    for (int64_t i = 0; i < in->n; i++) {
        exp_row(in, i, ref, ctx);
        for (int v = 0; v < in->v; v++) {
            double g = got[i * ldz + v], d = fabs(g - ref[v]);
            double tol = k * in->d * FP32_U * in->hn[i] * in->wn[v];
            num += d * d, den += ref[v] * ref[v];
            if (d <= tol)
                continue;
            fm.rows[i % TKD_LMHEAD_SM90_BM / 16]++, fm.cols[v % TKD_LMHEAD_SM90_BN / 32]++;
            if (bad++ < MAX_PRINTS)
                printf("  %s %lldx%dx%d: row %lld col %d: expected %.9g got %.9g (|diff| %.3g > tol %.3g)\n",
                       what, (long long)in->n, in->d, in->v, (long long)i, v, ref[v], g, d, tol);
            if (bad == 1)
                diagnose(in, g, i, v);
        }
        for (int64_t c = in->v; guards && c < ldz; c++)
            if (!is_poison(got[i * ldz + c]) && bad++ < MAX_PRINTS)
                printf("  %s: row %lld col %lld past V was written\n", what, (long long)i, (long long)c);
    }
    for (int64_t c = 0; guards && c < ldz; c++)
        if (!is_poison(got[in->n * ldz + c]) && bad++ < MAX_PRINTS)
            printf("  %s: guard row %lld col %lld was written\n", what, (long long)in->n, (long long)c);
    if (bad)
        fail_map_print(&fm, what);
    double rel = den > 0.0 ? sqrt(num / den) : sqrt(num);
    if (!(rel <= REL_NORM_TOL) && bad++ < MAX_PRINTS)
        printf("  %s %lldx%dx%d: norm-wise error %.3g > %.1g\n", what, (long long)in->n, in->d, in->v,
               rel, REL_NORM_TOL);
    free(ref);
    return bad;
}

static void f64_row(const inputs *in, int64_t i, double *z, const void *ctx)
{
    (void)ctx;
    ref_row(in, i, z);
}

/* Row i of a float (N, ldz) matrix (ctx: the matrix; ldz = ldz_of(V)) as doubles. */
static void f32_row(const inputs *in, int64_t i, double *z, const void *ctx)
{
    const float *m = ctx;
    for (int v = 0; v < in->v; v++)
        z[v] = m[i * ldz_of(in->v) + v];
}

/* Small shapes against float64, with the full grid and with one CTA (all tiles through one
 * pipeline, so its stages wrap and its phases flip across tiles); D = 8 and 40 as the loss's tests
 * use (one K step, mostly zero-filled). */
static void test_logits_vs_f64(void **state)
{
    tkd_lmhead_sm90_ws *ws = *state;
    const int shapes[][3] = {{1, 64, 1},   {63, 64, 127},  {65, 128, 129}, {200, 64, 1000},
                             {130, 200, 257}, {300, 2048, 700}, {129, 64, 513}, {37, 8, 1003},
                             {50, 40, 9000}};
    int bad = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        inputs in = inputs_make(shapes[s][0], shapes[s][1], shapes[s][2], 100 + s, 0);
        for (int ctas = 0; ctas <= 1; ctas++) {
            tkd_lmhead_sm90_ws_set_max_ctas(ws, ctas);
            float *z = run_logits(ws, &in, ldz_of(in.v));
            bad += check_logits(&in, z, ldz_of(in.v), f64_row, NULL, 2.0, 1, ctas ? "logits (1 CTA)" : "logits");
            free(z);
        }
        tkd_lmhead_sm90_ws_set_max_ctas(ws, 0);
        inputs_free(&in);
    }
    assert_int_equal(bad, 0);
}

/* Larger shapes against cuBLAS: more tiles than SMs (the persistent loop), D = 4096 and a ragged
 * one; one CTA gives the same bits as the full grid (each tile is computed alike). */
static void test_logits_vs_cublas(void **state)
{
    tkd_lmhead_sm90_ws *ws = *state;
    const int shapes[][3] = {{1000, 4096, 5000}, {517, 2880, 3001}, {2048, 1024, 8192}};
    int bad = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        inputs in = inputs_make(shapes[s][0], shapes[s][1], shapes[s][2], 200 + s, 0);
        const int64_t ldz = ldz_of(in.v);
        float *z = run_logits(ws, &in, ldz), *zc = run_cublas(&in, ldz);
        bad += check_logits(&in, z, ldz, f32_row, zc, 4.0, 1, "logits vs cuBLAS");
        tkd_lmhead_sm90_ws_set_max_ctas(ws, 3);
        float *z3 = run_logits(ws, &in, ldz);
        tkd_lmhead_sm90_ws_set_max_ctas(ws, 0);
        for (int64_t i = 0; i < in.n * ldz; i++)
            if (memcmp(&z[i], &z3[i], 4) != 0 && bad++ < MAX_PRINTS)
                printf("  logits %lldx%dx%d: 3 CTAs differ from the full grid at row %lld col %lld: "
                       "%.9g vs %.9g\n", (long long)in.n, in.d, in.v, (long long)(i / ldz),
                       (long long)(i % ldz), z3[i], z[i]);
        free(z), free(zc), free(z3);
        inputs_free(&in);
    }
    assert_int_equal(bad, 0);
}

/* ---- the statistics epilogue ----------------------------------------------------------------- */

/* lse1, lset (N) from the stats kernel and the combine, poisoned first. h_off: rows of in skipped
 * (the launch sees rows h_off.. only, as a chunk of a larger H). */
static void run_lse(tkd_lmhead_sm90_ws *ws, const inputs *in, int64_t h_off, float tau,
                    float *lse1, float *lset)
{
    const int64_t n = in->n - h_off;
    size_t pb = tkd_lmhead_sm90_part_floats(n, in->v) * 4;
    float *part = tkd_test_dev_alloc(pb), *d1 = tkd_test_dev_alloc((size_t)n * 4),
          *dt = tkd_test_dev_alloc((size_t)n * 4);
    tkd_test_poison(part, pb);
    tkd_test_poison(d1, (size_t)n * 4);
    tkd_test_poison(dt, (size_t)n * 4);
    tkd_test_ok(tkd_lmhead_sm90_stats(ws, in->dh + h_off * in->d, in->dw, n, in->d, in->v, tau, part),
                "stats");
    tkd_test_ok(tkd_lmhead_sm90_lse(part, n, in->v, tau, d1, dt), "lse");
    tkd_test_ok(tkd_lmhead_sm90_sync(ws), "stats sync");
    tkd_test_to_host(lse1, d1, (size_t)n * 4, NULL);
    tkd_test_to_host(lset, dt, (size_t)n * 4, NULL);
    cudaFree(part), cudaFree(d1), cudaFree(dt);
}

/* log Σ_v exp(z_v / τ) in float64. */
static double ref_lse(const double *z, int v, double tau)
{
    double m = -INFINITY, s = 0.0;
    for (int j = 0; j < v; j++)
        m = fmax(m, z[j] / tau);
    for (int j = 0; j < v; j++)
        s += exp(z[j] / tau - m);
    return m + log(s);
}

/* Checks rows h_off.. of in for τ = 1, 2 and 3 (the epilogue has a path for each: one exp, one
 * exp and its square, two exps); returns the failures (printed up to MAX_PRINTS). */
static int check_lse_case(tkd_lmhead_sm90_ws *ws, const inputs *in, int64_t h_off, const char *what)
{
    const int64_t n = in->n - h_off;
    double *z = tkd_test_xmalloc(sizeof(double) * (size_t)in->v), wmax = 0.0;
    float *g1[3], *gt[3];
    for (int ti = 0; ti < 3; ti++) {
        g1[ti] = tkd_test_xmalloc((size_t)n * 4), gt[ti] = tkd_test_xmalloc((size_t)n * 4);
        run_lse(ws, in, h_off, (float)(ti + 1), g1[ti], gt[ti]);
    }
    for (int v = 0; v < in->v; v++)
        wmax = fmax(wmax, in->wn[v]);
    int bad = 0;
    for (int64_t r = 0; r < n; r++) {
        ref_row(in, h_off + r, z);
        const double e1 = ref_lse(z, in->v, 1.0), b = 2.0 * in->d * FP32_U * in->hn[h_off + r] * wmax;
        for (int ti = 0; ti < 3; ti++) {
            const double tau = ti + 1, et = ref_lse(z, in->v, tau);
            const double t1 = b + LSE_TOL * (1 + fabs(e1)), tt = b / tau + LSE_TOL * (1 + fabs(et));
            if (!(fabs(g1[ti][r] - e1) <= t1) && bad++ < MAX_PRINTS)
                printf("  %s %lldx%dx%d tau %g: row %lld: lse at 1: expected %.9g got %.9g (tol %.3g)\n",
                       what, (long long)n, in->d, in->v, tau, (long long)r, e1, g1[ti][r], t1);
            if (!(fabs(gt[ti][r] - et) <= tt) && bad++ < MAX_PRINTS)
                printf("  %s %lldx%dx%d tau %g: row %lld: lse at 1/tau: expected %.9g got %.9g (tol %.3g)\n",
                       what, (long long)n, in->d, in->v, tau, (long long)r, et, gt[ti][r], tt);
        }
    }
    free(z);
    for (int ti = 0; ti < 3; ti++)
        free(g1[ti]), free(gt[ti]);
    return bad;
}

/* N x V over {1, 63, 65, 200} x {1, 127, 129, 1000, 20000} at D = 64 and 128, the cheaper part
 * of that at D = 2048, a ragged D, every 7th row huge and every 7th tiny. */
static void test_lse_vs_f64(void **state)
{
    tkd_lmhead_sm90_ws *ws = *state;
    const int ns[] = {1, 63, 65, 200}, vs[] = {1, 127, 129, 1000, 20000}, ds[] = {64, 128, 2048};
    int bad = 0, seed = 300;
    for (int di = 0; di < 3; di++)
        for (int ni = 0; ni < 4; ni++)
            for (int vi = 0; vi < 5; vi++) {
                if (ds[di] == 2048 && (vs[vi] == 127 || (vs[vi] == 20000 && ns[ni] != 65)))
                    continue; /* float64 reference cost; 129 and 1000 cover the same edges */
                inputs in = inputs_make(ns[ni], ds[di], vs[vi], seed++, 1);
                bad += check_lse_case(ws, &in, 0, "lse");
                inputs_free(&in);
            }
    inputs in = inputs_make(70, 200, 1000, seed++, 1); /* ragged K, rows 5.. as a chunk */
    bad += check_lse_case(ws, &in, 0, "lse ragged D");
    bad += check_lse_case(ws, &in, 5, "lse rows 5..");
    inputs_free(&in);
    assert_int_equal(bad, 0);
}

/* Compares partials (pf floats) bit for bit; prints up to MAX_PRINTS differences. */
static int same_partials(const float *got, const float *ref, size_t pf, int v, const char *what)
{
    int bad = 0;
    const size_t tiles = (size_t)tkd_lmhead_sm90_vtiles(v);
    for (size_t i = 0; i < pf; i++)
        if (memcmp(&got[i], &ref[i], 4) != 0 && bad++ < MAX_PRINTS)
            printf("  %s: partial %zu (plane %zu, row %zu, tile %zu): %.9g vs %.9g of the full grid\n",
                   what, i, i / (pf / 3), i % (pf / 3) / tiles, i % tiles, got[i], ref[i]);
    return bad;
}

/* One, two and three CTAs, and the other schedule, give the same partials, bit for bit, as the
 * full grid (each tile is computed alike wherever it runs; ping-pong on 1 or 2 CTAs hands a CTA's
 * tiles to its two consumers in another order than the full grid does). */
static void test_stats_grid_invariant(void **state)
{
    tkd_lmhead_sm90_ws *ws = *state;
    inputs in = inputs_make(300, 128, 20000, 400, 1); /* 3 x 79 tiles (5 x 79 in ping-pong) */
    const size_t pf = tkd_lmhead_sm90_part_floats(in.n, in.v);
    float *dp = tkd_test_dev_alloc(pf * 4), *ref = tkd_test_xmalloc(pf * 4), *got = tkd_test_xmalloc(pf * 4);
    const int ctas[] = {0, 1, 2, 3, 0};
    int bad = 0;
    for (int g = 0; g < 5; g++) {
        tkd_lmhead_sm90_ws_set_max_ctas(ws, ctas[g]);
        if (g == 4) /* the other schedule */
            tkd_lmhead_sm90_ws_set_schedule(ws, g_sched == TKD_LMHEAD_SM90_SCHED_COOP
                                                    ? TKD_LMHEAD_SM90_SCHED_PINGPONG
                                                    : TKD_LMHEAD_SM90_SCHED_COOP);
        tkd_test_poison(dp, pf * 4);
        tkd_test_ok(tkd_lmhead_sm90_stats(ws, in.dh, in.dw, in.n, in.d, in.v, 2.0f, dp), "stats");
        tkd_test_ok(tkd_lmhead_sm90_sync(ws), "stats sync");
        tkd_test_to_host(g ? got : ref, dp, pf * 4, NULL);
        char what[96];
        snprintf(what, sizeof what, "stats with %s", g == 4 ? "the other schedule (full grid)"
                                                            : ctas[g] == 1 ? "1 CTA" : ctas[g] == 2 ? "2 CTAs" : "3 CTAs");
        if (g)
            bad += same_partials(got, ref, pf, in.v, what);
    }
    tkd_lmhead_sm90_ws_set_max_ctas(ws, 0);
    tkd_lmhead_sm90_ws_set_schedule(ws, g_sched);
    cudaFree(dp), free(ref), free(got);
    inputs_free(&in);
    assert_int_equal(bad, 0);
}

/* The loss's pass: logits_stats writes the same logits as the logits epilogue and the same
 * partials as the stats epilogue, bit for bit (the same accumulators), into a z with the loss's
 * padded row stride; columns [V, ldz) and a guard row stay untouched. One CTA and the full grid;
 * τ = 1 (and 2.5: the two-exp path); ragged N, V and D. */
static void test_logits_stats(void **state)
{
    tkd_lmhead_sm90_ws *ws = *state;
    const int shapes[][3] = {{37, 40, 1003}, {300, 2048, 5000}, {1, 8, 5}, {517, 200, 3001}};
    int bad = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        inputs in = inputs_make(shapes[s][0], shapes[s][1], shapes[s][2], 600 + s, s == 0);
        const int64_t ldz = (in.v + 15) / 16 * 16 + 16; /* the loss's ldl, plus guard columns */
        const size_t pf = tkd_lmhead_sm90_part_floats(in.n, in.v), zb = (size_t)(in.n + 1) * ldz * 4;
        float *dz = tkd_test_dev_alloc(zb), *dp = tkd_test_dev_alloc(pf * 4);
        float *z = tkd_test_xmalloc(zb), *zref = run_logits(ws, &in, ldz);
        float *part = tkd_test_xmalloc(pf * 4), *pref = tkd_test_xmalloc(pf * 4);
        for (int ctas = 0; ctas <= 1; ctas++)
            for (int ti = 0; ti < 2; ti++) {
                const float tau = ti ? 2.5f : 1.0f;
                tkd_lmhead_sm90_ws_set_max_ctas(ws, ctas);
                tkd_test_poison(dz, zb), tkd_test_poison(dp, pf * 4);
                tkd_test_ok(tkd_lmhead_sm90_stats(ws, in.dh, in.dw, in.n, in.d, in.v, tau, dp), "stats");
                tkd_test_ok(tkd_lmhead_sm90_sync(ws), "stats sync");
                tkd_test_to_host(pref, dp, pf * 4, NULL);
                tkd_test_poison(dp, pf * 4);
                tkd_test_ok(tkd_lmhead_sm90_logits_stats(ws, in.dh, in.dw, in.n, in.d, in.v, tau, dz,
                                                         ldz, dp), "logits_stats");
                tkd_test_ok(tkd_lmhead_sm90_sync(ws), "logits_stats sync");
                tkd_test_to_host(z, dz, zb, NULL);
                tkd_test_to_host(part, dp, pf * 4, NULL);
                char what[96];
                snprintf(what, sizeof what, "logits_stats %lldx%dx%d tau %g%s", (long long)in.n, in.d,
                         in.v, tau, ctas ? " (1 CTA)" : "");
                bad += same_partials(part, pref, pf, in.v, what);
                for (int64_t i = 0; i < (in.n + 1) * ldz; i++) {
                    const int in_z = i / ldz < in.n && i % ldz < in.v;
                    const int ok = in_z ? memcmp(&z[i], &zref[i], 4) == 0 : is_poison(z[i]);
                    if (!ok && bad++ < MAX_PRINTS)
                        printf("  %s: z row %lld col %lld: %.9g, expected %s %.9g\n", what,
                               (long long)(i / ldz), (long long)(i % ldz), z[i],
                               in_z ? "the logits epilogue's" : "untouched poison", in_z ? zref[i] : 0.0);
                }
            }
        tkd_lmhead_sm90_ws_set_max_ctas(ws, 0);
        cudaFree(dz), cudaFree(dp);
        free(z), free(zref), free(part), free(pref);
        inputs_free(&in);
    }
    assert_int_equal(bad, 0);
}

/* ---- the loss's fused epilogues ------------------------------------------------------------- */

#define SP_L 7 /* special slots per row in test_fused */

/* Row i's special list: up to SP_L (column, slot) pairs, some slots left out (as an invalid index
 * would be), one column repeated, sorted by (column, slot); off (tiles + 1) per row. */
static void fused_lists(int64_t n, int v, uint64_t seed, int32_t *list, int *off)
{
    const int tiles = tkd_lmhead_sm90_vtiles(v);
    for (int64_t i = 0; i < n; i++) {
        int32_t *l = list + i * SP_L * 2;
        int c = 0;
        for (int slot = 0; slot < SP_L; slot++) {
            uint64_t st = seed * 1000003u + (uint64_t)i * SP_L + slot;
            const uint64_t r = tkd_rng_splitmix64(&st);
            if (slot == 3 && i % 2)
                continue; /* a left-out slot */
            int col = slot == 5 && c > 0 ? l[0] : (int)(r % (uint64_t)v); /* slot 5: a repeat */
            l[2 * c] = col, l[2 * c + 1] = slot;
            c++;
        }
        for (int a = 1; a < c; a++) /* insertion sort by (column, slot) */
            for (int b = a; b > 0 && (l[2 * b - 2] > l[2 * b] || (l[2 * b - 2] == l[2 * b] &&
                                                                  l[2 * b - 1] > l[2 * b + 1])); b--) {
                int32_t t0 = l[2 * b - 2], t1 = l[2 * b - 1];
                l[2 * b - 2] = l[2 * b], l[2 * b - 1] = l[2 * b + 1], l[2 * b] = t0, l[2 * b + 1] = t1;
            }
        for (int t = 0; t <= tiles; t++) {
            int k = 0;
            while (k < c && l[2 * k] < t * TKD_LMHEAD_SM90_BN)
                k++;
            off[i * (tiles + 1) + t] = k;
        }
    }
}

/* One fused launch of parts `parts` (1 stats, 2 exp; gather always) against the logits zref
 * (ldz) and the stats partials pref: gathered logits bit-equal, partials bit-equal, E within
 * bf16 rounding of exp2(z·l2e_k − ref·ref_scale) computed from zref, untouched slots, columns
 * [V, lde) and the guard row still poisoned. Returns the number of failures. */
static int check_fused(tkd_lmhead_sm90_ws *ws, const inputs *in, const float *zref, int64_t ldz,
                       const float *pref, float tau, int parts, int k_one, const char *what)
{
    const int tiles = tkd_lmhead_sm90_vtiles(in->v);
    const int64_t n = in->n, lde = (in->v + 15) / 16 * 16 + 16;
    const size_t pf = tkd_lmhead_sm90_part_floats(n, in->v), eb = (size_t)(n + 1) * lde * 2;
    int32_t *list = tkd_test_xmalloc((size_t)n * SP_L * 8);
    int *off = tkd_test_xmalloc((size_t)n * (tiles + 1) * 4);
    fused_lists(n, in->v, 7 + (uint64_t)parts, list, off);
    float *ref = tkd_test_xmalloc((size_t)n * 4), *g = tkd_test_xmalloc((size_t)n * SP_L * 4);
    float *part = tkd_test_xmalloc(pf * 4);
    uint16_t *e = tkd_test_xmalloc(eb);
    for (int64_t i = 0; i < n; i++) /* a reference below the row's max (a logit of the row) */
        ref[i] = zref[i * ldz + (i * 7919) % in->v];
    int32_t *dlist = tkd_test_dev_alloc((size_t)n * SP_L * 8);
    int *doff = tkd_test_dev_alloc((size_t)n * (tiles + 1) * 4);
    float *dref = tkd_test_dev_alloc((size_t)n * 4), *dg = tkd_test_dev_alloc((size_t)n * SP_L * 4);
    float *dp = tkd_test_dev_alloc(pf * 4);
    uint16_t *de = tkd_test_dev_alloc(eb);
    tkd_test_to_dev(dlist, list, (size_t)n * SP_L * 8);
    tkd_test_to_dev(doff, off, (size_t)n * (tiles + 1) * 4);
    tkd_test_to_dev(dref, ref, (size_t)n * 4);
    tkd_test_poison(dg, (size_t)n * SP_L * 4), tkd_test_poison(dp, pf * 4), tkd_test_poison(de, eb);
    tkd_lmhead_sm90_fused f = {.tau = tau, .k_one = k_one, .sp_off = doff, .sp_list = dlist,
                               .sp_l = SP_L, .g = dg};
    if (parts & 1)
        f.part = dp;
    if (parts & 2)
        f.e = de, f.lde = lde, f.ref = dref, f.ref_scale = tkd_lmhead_sm90_exp_scale(tau, k_one);
    tkd_test_ok(tkd_lmhead_sm90_fused_run(ws, in->dh, in->dw, n, in->d, in->v, &f), what);
    tkd_test_ok(tkd_lmhead_sm90_sync(ws), what);
    tkd_test_to_host(g, dg, (size_t)n * SP_L * 4, NULL);
    tkd_test_to_host(part, dp, pf * 4, NULL);
    tkd_test_to_host(e, de, eb, NULL);
    int bad = (parts & 1) ? same_partials(part, pref, pf, in->v, what) : 0;
    const double l2e_k = tkd_lmhead_sm90_exp_scale(tau, k_one);
    for (int64_t i = 0; i < n; i++) {
        int listed[SP_L] = {0};
        for (int k = 0; k < off[i * (tiles + 1) + tiles]; k++) {
            const int col = list[(i * SP_L + k) * 2], slot = list[(i * SP_L + k) * 2 + 1];
            listed[slot] = 1;
            if (memcmp(&g[i * SP_L + slot], &zref[i * ldz + col], 4) != 0 && bad++ < MAX_PRINTS)
                printf("  %s: row %lld slot %d (column %d): gathered %.9g, logit %.9g\n", what,
                       (long long)i, slot, col, g[i * SP_L + slot], zref[i * ldz + col]);
        }
        for (int slot = 0; slot < SP_L; slot++)
            if (!listed[slot] && !is_poison(g[i * SP_L + slot]) && bad++ < MAX_PRINTS)
                printf("  %s: row %lld slot %d is not listed but was written\n", what, (long long)i, slot);
        for (int64_t c = 0; (parts & 2) && c < lde; c++) {
            const uint16_t b = e[i * lde + c];
            if (c >= in->v) {
                if (b != 0xffffu && bad++ < MAX_PRINTS)
                    printf("  %s: E row %lld col %lld past V was written\n", what, (long long)i, (long long)c);
                continue;
            }
            const double x = exp2((double)zref[i * ldz + c] * (float)l2e_k - (double)(ref[i] * (float)l2e_k));
            if (!(x > 1e-30 && x < 1e30))
                continue; /* outside bf16's comfortable range (extreme rows): not judged */
            const double got = tkd_bf16_to_f32(b);
            if (!(fabs(got - x) <= 8e-3 * x) && bad++ < MAX_PRINTS)
                printf("  %s: E row %lld col %lld: %.6g, expected %.6g\n", what, (long long)i, (long long)c, got, x);
        }
    }
    for (int64_t c = 0; (parts & 2) && c < lde; c++)
        if (e[n * lde + c] != 0xffffu && bad++ < MAX_PRINTS)
            printf("  %s: E guard row col %lld was written\n", what, (long long)c);
    cudaFree(dlist), cudaFree(doff), cudaFree(dref), cudaFree(dg), cudaFree(dp), cudaFree(de);
    free(list), free(off), free(ref), free(g), free(part), free(e);
    return bad;
}

/* The loss's fused passes (statistics + gather, exp + gather, all three; E at scale 1 and 1/τ)
 * against the logits and statistics epilogues: ragged N, V and D, τ 1, 2 and 2.5, one CTA and the
 * full grid. */
static void test_fused(void **state)
{
    tkd_lmhead_sm90_ws *ws = *state;
    const int shapes[][3] = {{37, 40, 1003}, {300, 2048, 5000}, {1, 8, 5}, {517, 200, 3001}};
    const float taus[] = {1.0f, 2.0f, 2.5f};
    int bad = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        inputs in = inputs_make(shapes[s][0], shapes[s][1], shapes[s][2], 700 + s, s == 0);
        const int64_t ldz = ldz_of(in.v);
        float *zref = run_logits(ws, &in, ldz);
        const size_t pf = tkd_lmhead_sm90_part_floats(in.n, in.v);
        float *dp = tkd_test_dev_alloc(pf * 4), *pref = tkd_test_xmalloc(pf * 4);
        for (int ti = 0; ti < 3; ti++) {
            tkd_test_ok(tkd_lmhead_sm90_stats(ws, in.dh, in.dw, in.n, in.d, in.v, taus[ti], dp), "stats");
            tkd_test_ok(tkd_lmhead_sm90_sync(ws), "stats sync");
            tkd_test_to_host(pref, dp, pf * 4, NULL);
            for (int parts = 1; parts <= 3; parts++)
                for (int k_one = 0; k_one < (parts & 2 ? 2 : 1); k_one++)
                    for (int ctas = 0; ctas <= (s == 0); ctas++) {
                        char what[128];
                        snprintf(what, sizeof what, "fused %s%s %lldx%dx%d tau %g k %s%s",
                                 parts & 1 ? "stats+" : "", parts & 2 ? "exp+gather" : "gather",
                                 (long long)in.n, in.d, in.v, taus[ti], k_one ? "1" : "1/tau",
                                 ctas ? " (1 CTA)" : "");
                        tkd_lmhead_sm90_ws_set_max_ctas(ws, ctas);
                        bad += check_fused(ws, &in, zref, ldz, pref, taus[ti], parts, k_one, what);
                    }
            tkd_lmhead_sm90_ws_set_max_ctas(ws, 0);
        }
        cudaFree(dp), free(pref), free(zref);
        inputs_free(&in);
    }
    assert_int_equal(bad, 0);
}

/* ---- teacher-dump's top-k without logits ------------------------------------------------------ */

/* One tkd_lmhead_sm90_topk call with cap against tkd_topk_ref on our own fp32 logits (the same
 * accumulators: ids and values must match exactly; lse within LSE_TOL). Returns failures; the
 * flags (overflowed rows, first non-finite row) come back in flags. */
static int check_topk(tkd_lmhead_sm90_ws *ws, const inputs *in, int k, float tau, int cap,
                      unsigned flags[2], const char *what)
{
    const int64_t n = in->n, ldz = ldz_of(in->v);
    float *z = run_logits(ws, in, ldz);
    void *scratch = tkd_test_dev_alloc(tkd_lmhead_sm90_topk_bytes(n, in->v, cap));
    unsigned *dflags = tkd_test_dev_alloc(8);
    uint32_t *didx = tkd_test_dev_alloc((size_t)n * k * 4), *idx = tkd_test_xmalloc((size_t)n * k * 4);
    float *dval = tkd_test_dev_alloc((size_t)n * k * 4), *val = tkd_test_xmalloc((size_t)n * k * 4);
    float *dlse = tkd_test_dev_alloc((size_t)n * 4), *lse = tkd_test_xmalloc((size_t)n * 4);
    const unsigned init[2] = {0u, 0xffffffffu};
    tkd_test_to_dev(dflags, init, 8);
    tkd_test_ok(tkd_lmhead_sm90_topk(ws, in->dh, in->dw, n, in->d, in->v, k, tau, cap, scratch,
                                     dflags, didx, dval, dlse), what);
    tkd_test_ok(tkd_lmhead_sm90_sync(ws), what);
    tkd_test_to_host(flags, dflags, 8, NULL);
    tkd_test_to_host(idx, didx, (size_t)n * k * 4, NULL);
    tkd_test_to_host(val, dval, (size_t)n * k * 4, NULL);
    tkd_test_to_host(lse, dlse, (size_t)n * 4, NULL);
    uint32_t *ri = tkd_test_xmalloc((size_t)k * 4);
    float *rv = tkd_test_xmalloc((size_t)k * 4), rl;
    int bad = 0;
    for (int64_t i = 0; i < n && flags[0] == 0 && flags[1] == 0xffffffffu; i++) {
        tkd_test_ok(tkd_topk_ref(z + i * ldz, 1, in->v, k, tau, ri, rv, &rl), "topk_ref");
        if ((memcmp(ri, idx + i * k, (size_t)k * 4) != 0 || memcmp(rv, val + i * k, (size_t)k * 4) != 0) &&
            bad++ < MAX_PRINTS)
            for (int j = 0; j < k; j++)
                if (ri[j] != idx[i * k + j] || memcmp(&rv[j], &val[i * k + j], 4) != 0) {
                    printf("  %s: row %lld rank %d: (%u, %.9g), expected (%u, %.9g)\n", what,
                           (long long)i, j, idx[i * k + j], val[i * k + j], ri[j], rv[j]);
                    break;
                }
        if (!(fabs(lse[i] - rl) <= LSE_TOL * (1 + fabs(rl))) && bad++ < MAX_PRINTS)
            printf("  %s: row %lld lse %.9g, expected %.9g\n", what, (long long)i, lse[i], rl);
    }
    cudaFree(scratch), cudaFree(dflags), cudaFree(didx), cudaFree(dval), cudaFree(dlse);
    free(z), free(idx), free(val), free(lse), free(ri), free(rv);
    return bad;
}

/* Copies W row src over row dst (equal logits in every row: a tie the order must break by id). */
static void copy_w_row(inputs *in, int dst, int src)
{
    memcpy(in->wb + (size_t)dst * in->d, in->wb + (size_t)src * in->d, (size_t)in->d * 2);
}

/* The top-k without logits: random rows at τ 1 and 2, rows with ties, rows whose top k crowd two
 * tiles (many candidates), a cap too small for them (reported, not wrong), a non-finite logit
 * (reported with its row); one CTA and the full grid. */
static void test_topk(void **state)
{
    tkd_lmhead_sm90_ws *ws = *state;
    int bad = 0;
    unsigned flags[2];
    inputs in = inputs_make(300, 896, 40000, 800, 0);
    for (int ctas = 0; ctas <= 1; ctas++) {
        tkd_lmhead_sm90_ws_set_max_ctas(ws, ctas);
        bad += check_topk(ws, &in, 100, 1.0f, 4096, flags, ctas ? "topk tau 1 (1 CTA)" : "topk tau 1");
        bad += flags[0] != 0 || flags[1] != 0xffffffffu;
    }
    tkd_lmhead_sm90_ws_set_max_ctas(ws, 0);
    bad += check_topk(ws, &in, 100, 2.0f, 4096, flags, "topk tau 2");
    bad += flags[0] != 0 || flags[1] != 0xffffffffu;
    for (int j = 0; j < 512; j++) /* crowding: columns 0..511 (two tiles) scaled up 4x */
        scale_row(in.wb + (size_t)j * in.d, in.d, 2);
    for (int j = 0; j < 40; j++) /* ties: 40 pairs of equal columns among the largest, far apart */
        copy_w_row(&in, 20000 + 7 * j, 3 * j);
    tkd_test_to_dev(in.dw, in.wb, (size_t)in.v * in.d * 2);
    bad += check_topk(ws, &in, 100, 1.0f, 4096, flags, "topk ties, crowded");
    if (flags[0] != 0 || flags[1] != 0xffffffffu) {
        printf("  topk crowded: flags %u %u, expected none\n", flags[0], flags[1]);
        bad++;
    }
    bad += check_topk(ws, &in, 100, 1.0f, 128, flags, "topk cap 128");
    if (flags[0] == 0) {
        printf("  topk cap 128: no row reported more candidates than the cap\n");
        bad++;
    }
    in.hb[7 * in.d + 5] = 0x7f80; /* +inf in row 7 */
    tkd_test_to_dev(in.dh, in.hb, (size_t)in.n * in.d * 2);
    check_topk(ws, &in, 100, 1.0f, 4096, flags, "topk inf");
    if (flags[1] != 7) {
        printf("  topk inf: first non-finite row %u, expected 7\n", flags[1]);
        bad++;
    }
    inputs_free(&in);
    assert_int_equal(bad, 0);
}

/* Refusals: D not a multiple of 8, τ ≤ 0, odd ldz, misaligned h; the benchmark's no-epilogue
 * launch runs and ends. */
static void test_arguments(void **state)
{
    tkd_lmhead_sm90_ws *ws = *state;
    inputs in = inputs_make(8, 64, 16, 500, 0);
    float *dz = tkd_test_dev_alloc(8 * 18 * 4);
    assert_int_equal(tkd_lmhead_sm90_logits(ws, in.dh, in.dw, 8, 60, 16, dz, 18), TKD_ERR_UNSUPPORTED);
    assert_int_equal(tkd_lmhead_sm90_stats(ws, in.dh, in.dw, 8, 64, 16, 0.0f, dz), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_lmhead_sm90_logits(ws, in.dh, in.dw, 8, 64, 16, dz, 17), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_lmhead_sm90_logits(ws, in.dh + 1, in.dw, 7, 64, 16, dz, 18), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_lmhead_sm90_logits_stats(ws, in.dh, in.dw, 8, 64, 16, 1.0f, dz, 17, dz),
                     TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_lmhead_sm90_logits_stats(ws, in.dh, in.dw, 8, 64, 16, -1.0f, dz, 18, dz),
                     TKD_ERR_INVALID_ARG);
    tkd_test_ok(tkd_lmhead_sm90_mainloop(ws, in.dh, in.dw, 8, 64, 16), "mainloop (the benchmark's)");
    tkd_test_ok(tkd_lmhead_sm90_sync(ws), "sync");
    cudaFree(dz);
    inputs_free(&in);
}

static int setup(void **state, tkd_lmhead_sm90_sched sched)
{
    tkd_lmhead_sm90_ws *ws = NULL;
    tkd_status st = tkd_lmhead_sm90_ws_create(&ws, sched);
    if (st != TKD_OK) {
        printf("lmhead_sm90 workspace: %s: %s\n", tkd_status_name(st), tkd_error_msg());
        return -1;
    }
    g_sched = sched;
    tkd_lmhead_sm90_ws_set_schedule(ws, sched);
    printf("---- schedule: %s\n", sched == TKD_LMHEAD_SM90_SCHED_COOP ? "cooperative" : "ping-pong");
    *state = ws;
    return 0;
}

static int setup_pingpong(void **state) { return setup(state, TKD_LMHEAD_SM90_SCHED_PINGPONG); }
static int setup_coop(void **state) { return setup(state, TKD_LMHEAD_SM90_SCHED_COOP); }

static int teardown(void **state)
{
    tkd_lmhead_sm90_ws_free(*state);
    return 0;
}
#endif /* TKD_HAVE_CUDA */

int main(void)
{
    tkd_test_require_gpu();
#ifdef TKD_HAVE_CUDA
    tkd_test_skip_unless_ok(tkd_lmhead_sm90_supported());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arguments),
        cmocka_unit_test(test_logits_vs_f64),
        cmocka_unit_test(test_logits_vs_cublas),
        cmocka_unit_test(test_lse_vs_f64),
        cmocka_unit_test(test_stats_grid_invariant),
        cmocka_unit_test(test_logits_stats),
        cmocka_unit_test(test_fused),
        cmocka_unit_test(test_topk),
    };
    int failed = cmocka_run_group_tests_name("lmhead_sm90 ping-pong", tests, setup_pingpong, teardown);
    failed += cmocka_run_group_tests_name("lmhead_sm90 cooperative", tests, setup_coop, teardown);
    return failed;
#else
    return 77;
#endif
}
