/* test_gpu_attn_bwd_simple.c — kernels/attn/attn_bwd_simple_cuda.h's attention backward against the
 * double reference (kernels/cpu/cpu_ops_ref.h: softmax probabilities kept, dS = P ∘ (dP − rowsum(P ∘ dP)))
 * on bf16-rounded inputs, over awkward shapes: one position, T not a multiple of the warp's 32,
 * GQA ratios 1, 2 and 6, head sizes 8 to 256 (one to eight output dims per lane). The log-sum-exps
 * the kernel reads are computed on the host in double from the same bf16 q and k, so only the
 * backward is under test. dq, dk, dv start from random bf16 values (the kernel ADDS). Run twice from
 * the same state, the results must be bit-identical (no atomics). Labelled gpu: exits 77 where no
 * GPU answers or the build has no CUDA backend.
 *
 * Tolerance per element: |got − ref| ≤ 2^-8·|ref| + 1e-4·max|ref| of the tensor. The device sums
 * in fp32 from the same bf16 inputs (P from expf of an fp32 score: ~1e-6 relative; sums of ≤ 6·70
 * terms: ≤ ~5e-5 of the largest partial sum) and rounds the result to bf16 once (≤ 2^-9·|v|; 2^-8
 * allows the fp32 error to straddle a rounding boundary). An index error moves values by O(max|ref|).
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
#include "tests/gpu_check.h"
#include "tests/gpu_testutil.h"
#include "tests/ref64.h"
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/attn/attn_bwd_simple_cuda.h"
#include "kernels/cpu/cpu_ops_ref.h"

#define BF16_REL 0.00390625 /* 2^-8: the output's one rounding plus fp32 error at a boundary */
#define MAX_REL 1e-4        /* times max|ref|: fp32 accumulation over ≤ 420 terms */

static cudaStream_t g_stream;

static void *dev_copy(const void *h, size_t n)
{
    void *d = tkd_test_dev_alloc(n);
    tkd_test_to_dev(d, h, n);
    return d;
}

static float *as_f32(const double *x, size_t n)
{
    float *f = tkd_test_xmalloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++)
        f[i] = (float)x[i]; /* exact: x holds bf16 values */
    return f;
}

/* lse (B, H, T) of the scaled causal scores (ref64's float64 row), rounded to fp32 (what the forward
 * saves). */
static float *host_lse(const double *q, const double *k, const double *v, int B, int T, int H, int Hkv, int dh)
{
    const size_t nq = (size_t)B * T * H * dh, nk = (size_t)B * T * Hkv * dh;
    float *lse = tkd_test_xmalloc(sizeof *lse * (size_t)B * H * T), *qf = as_f32(q, nq), *kf = as_f32(k, nk),
          *vf = as_f32(v, nk);
    double *y = tkd_test_xmalloc(sizeof *y * dh), *sc = tkd_test_xmalloc(sizeof *sc * T);
    const tkd_ref64_attn a = {B, T, H, Hkv, dh, qf, kf, vf, 0, NULL};
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++)
                lse[((size_t)b * H + h) * T + i] = (float)tkd_ref64_attn_row(&a, b, h, i, y, sc);
    free(qf), free(kf), free(vf), free(y), free(sc);
    return lse;
}

/* Holds got (bf16) to the tolerance above; prints the worst element, fails on any one off. */
static void check(const char *what, const uint16_t *got, const double *ref, size_t n, size_t cols)
{
    double mx = 0;
    for (size_t i = 0; i < n; i++)
        mx = fmax(mx, fabs(ref[i]));
    const tkd_test_tol tol = {MAX_REL * mx, BF16_REL, "bf16 rounding 2^-8 + fp32 accumulation 1e-4·max|ref|"};
    tkd_test_check k;
    char line[1024];
    tkd_test_check_begin(&k, what, tol, tkd_test_where_rowcol, &cols);
    for (size_t i = 0; i < n; i++)
        tkd_test_check_add(&k, (int64_t)i, tkd_bf16_to_f32(got[i]), ref[i], 0.0);
    tkd_test_check_describe(&k, line, sizeof line);
    printf("    %s (max|ref| %.4g)\n", line, mx);
    tkd_test_check_end(&k);
}

/* lse (B, H, T) of the scaled scores over the keys each query sees (window, documents), in double
 * rounded to fp32: what the masked forward saves. */
static float *masked_lse(const double *q, const double *k, int B, int T, int H, int Hkv, int dh, int window,
                         const int32_t *doc)
{
    float *lse = tkd_test_xmalloc(sizeof *lse * (size_t)B * H * T);
    const double scale = 1.0 / sqrt((double)dh);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                int lo = window > 0 && i >= window ? i - window + 1 : 0;
                lo = doc && doc[b * T + i] > lo ? doc[b * T + i] : lo;
                double m = -INFINITY, sum = 0.0, s[512];
                for (int j = lo; j <= i; j++) {
                    double dot = 0.0;
                    for (int d = 0; d < dh; d++)
                        dot += q[((size_t)(b * T + i) * H + h) * dh + d] * k[((size_t)(b * T + j) * Hkv + h / (H / Hkv)) * dh + d];
                    s[j - lo] = dot * scale;
                    m = fmax(m, s[j - lo]);
                }
                for (int j = lo; j <= i; j++)
                    sum += exp(s[j - lo] - m);
                lse[((size_t)b * H + h) * T + i] = (float)(m + log(sum));
            }
    return lse;
}

static void run_case_mask(int B, int T, int H, int Hkv, int dh, uint64_t seed, int window, const int32_t *doc);

static void run_case(int B, int T, int H, int Hkv, int dh, uint64_t seed)
{
    run_case_mask(B, T, H, Hkv, dh, seed, 0, NULL);
}

/* The case under a window and documents (0 / NULL: plain causal, through the unmasked entry point). */
static void run_case_mask(int B, int T, int H, int Hkv, int dh, uint64_t seed, int window, const int32_t *doc)
{
    printf("  B %d, T %d, H %d, Hkv %d, dh %d, window %d%s\n", B, T, H, Hkv, dh, window, doc ? ", documents" : "");
    const int masked = window > 0 || doc;
    size_t nq = (size_t)B * T * H * dh, nk = (size_t)B * T * Hkv * dh;
    uint16_t *q = tkd_test_rand_bf16(nq, seed, 1.0f), *k = tkd_test_rand_bf16(nk, seed + 1, 1.0f);
    uint16_t *v = tkd_test_rand_bf16(nk, seed + 2, 1.0f);
    uint16_t *dy = tkd_test_rand_bf16(nq, seed + 3, 1.0f), *dq0 = tkd_test_rand_bf16(nq, seed + 4, 0.1f);
    uint16_t *dk0 = tkd_test_rand_bf16(nk, seed + 5, 0.1f), *dv0 = tkd_test_rand_bf16(nk, seed + 6, 0.1f);
    double *Q = tkd_test_bf16_to_f64(q, nq), *K = tkd_test_bf16_to_f64(k, nk), *Vv = tkd_test_bf16_to_f64(v, nk);
    double *DY = tkd_test_bf16_to_f64(dy, nq), *DQ = tkd_test_bf16_to_f64(dq0, nq);
    double *DK = tkd_test_bf16_to_f64(dk0, nk), *DV = tkd_test_bf16_to_f64(dv0, nk);
    double *att = malloc(sizeof *att * (size_t)B * H * T * T), *y = malloc(sizeof *y * nq);
    assert_non_null(att);
    assert_non_null(y);
    tkd_ref_attn_sinks_fwd(Q, K, Vv, B, T, H, Hkv, dh, window, doc, NULL, att, y);
    tkd_ref_attn_bwd(DY, Q, K, Vv, att, B, T, H, Hkv, dh, DQ, DK, DV);
    float *lse = masked ? masked_lse(Q, K, B, T, H, Hkv, dh, window, doc) : host_lse(Q, K, Vv, B, T, H, Hkv, dh);
    int32_t *d_doc = doc ? dev_copy(doc, sizeof *doc * (size_t)B * T) : NULL;
    const tkd_attn_mask mask = {window, NULL, d_doc};

    uint16_t *d_q = dev_copy(q, nq * 2), *d_k = dev_copy(k, nk * 2), *d_v = dev_copy(v, nk * 2);
    uint16_t *d_dy = dev_copy(dy, nq * 2);
    float *d_lse = dev_copy(lse, sizeof *lse * (size_t)B * H * T);
    float *d_delta = dev_copy(lse, tkd_cuda_attn_bwd_simple_ws_bytes(B, T, H)); /* contents overwritten */
    uint16_t *out[2][3];
    for (int run = 0; run < 2; run++) {
        uint16_t *d_dq = dev_copy(dq0, nq * 2), *d_dk = dev_copy(dk0, nk * 2), *d_dv = dev_copy(dv0, nk * 2);
        tkd_status st = masked ? tkd_cuda_attn_bwd_simple_masked(d_dy, d_q, d_k, d_v, NULL, d_lse, B, T, H, Hkv, dh,
                                                                 &mask, d_dq, d_dk, d_dv, d_delta, g_stream)
                               : tkd_cuda_attn_bwd_simple(d_dy, d_q, d_k, d_v, NULL, d_lse, B, T, H, Hkv, dh, d_dq,
                                                          d_dk, d_dv, d_delta, g_stream);
        if (st != TKD_OK)
            fail_msg("attn_bwd_simple: %s", tkd_error_msg());
        for (int t = 0; t < 3; t++)
            out[run][t] = malloc((t ? nk : nq) * 2);
        tkd_test_to_host(out[run][0], d_dq, nq * 2, g_stream);
        tkd_test_to_host(out[run][1], d_dk, nk * 2, g_stream);
        tkd_test_to_host(out[run][2], d_dv, nk * 2, g_stream);
        cudaFree(d_dq);
        cudaFree(d_dk);
        cudaFree(d_dv);
    }
    check("dq", out[0][0], DQ, nq, (size_t)H * dh);
    check("dk", out[0][1], DK, nk, (size_t)Hkv * dh);
    check("dv", out[0][2], DV, nk, (size_t)Hkv * dh);
    const char *names[3] = {"dq", "dk", "dv"};
    for (int t = 0; t < 3; t++)
        if (memcmp(out[0][t], out[1][t], (t ? nk : nq) * 2) != 0)
            fail_msg("%s differs between two runs from the same state (the kernel must be deterministic)", names[t]);
    for (int t = 0; t < 3; t++) {
        free(out[0][t]);
        free(out[1][t]);
    }
    cudaFree(d_q);
    cudaFree(d_k);
    cudaFree(d_v);
    cudaFree(d_dy);
    cudaFree(d_lse);
    cudaFree(d_delta);
    cudaFree(d_doc);
    free(q), free(k), free(v), free(dy), free(dq0), free(dk0), free(dv0);
    free(Q), free(K), free(Vv), free(DY), free(DQ), free(DK), free(DV);
    free(att), free(y), free(lse);
}

static void test_demo_shape(void **state) { (void)state; run_case(2, 37, 4, 2, 16, 10); }
static void test_gqa6_two_chunks(void **state) { (void)state; run_case(1, 70, 6, 1, 32, 20); }
static void test_one_position(void **state) { (void)state; run_case(3, 1, 2, 2, 8, 30); }
static void test_dh80(void **state) { (void)state; run_case(1, 33, 2, 1, 80, 40); }
static void test_dh256(void **state) { (void)state; run_case(1, 5, 1, 1, 256, 50); }

/* A sliding window and packed documents (documents of 1, 12 and 24 tokens; then 37), alone and
 * together, against the float64 reference under the same mask. */
static void test_window_and_documents(void **state)
{
    (void)state;
    enum { B = 2, T = 37 };
    static const int starts[B][4] = {{0, 1, 13, -1}, {0, -1}};
    int32_t doc[B * T];
    tkd_test_doc_starts(&starts[0][0], 4, B, T, doc);
    run_case_mask(B, T, 4, 2, 16, 60, 5, NULL);
    run_case_mask(B, T, 4, 2, 16, 61, 0, doc);
    run_case_mask(B, T, 6, 2, 32, 62, 7, doc);
}

static void test_refuses_bad_shapes(void **state)
{
    (void)state;
    uint16_t x = 0;
    float f = 0;
    assert_int_equal(tkd_cuda_attn_bwd_simple(&x, &x, &x, &x, NULL, &f, 1, 4, 3, 2, 16, &x, &x, &x, &f, NULL),
                     TKD_ERR_INVALID_ARG); /* H not a multiple of Hkv */
    assert_int_equal(tkd_cuda_attn_bwd_simple(&x, &x, &x, &x, NULL, &f, 1, 4, 2, 2, 258, &x, &x, &x, &f, NULL),
                     TKD_ERR_INVALID_ARG); /* dh > 256 */
}

static int setup(void **state)
{
    (void)state;
    return cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking) == cudaSuccess ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    cudaStreamDestroy(g_stream);
    return 0;
}

static const struct CMUnitTest kTests[] = {
    cmocka_unit_test(test_demo_shape), cmocka_unit_test(test_gqa6_two_chunks), cmocka_unit_test(test_one_position),
    cmocka_unit_test(test_dh80),       cmocka_unit_test(test_dh256),
    cmocka_unit_test(test_window_and_documents),          cmocka_unit_test(test_refuses_bad_shapes),
};
#endif

TKD_TEST_GPU_MAIN(kTests, setup, teardown)
