/* test_gpu_attn_bwd_simple.c — kernels/attn_bwd_simple_cuda.h's attention backward against the
 * double reference (kernels/cpu_ops_ref.h: softmax probabilities kept, dS = P ∘ (dP − rowsum(P ∘ dP)))
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
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/attn_bwd_simple_cuda.h"
#include "kernels/cpu_ops_ref.h"

#define BF16_REL 0.00390625 /* 2^-8: the output's one rounding plus fp32 error at a boundary */
#define MAX_REL 1e-4        /* times max|ref|: fp32 accumulation over ≤ 420 terms */

static cudaStream_t g_stream;

static void *dev_copy(const void *h, size_t n)
{
    void *d = NULL;
    assert_int_equal(cudaMalloc(&d, n ? n : 1), cudaSuccess);
    assert_int_equal(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), cudaSuccess);
    return d;
}

static void to_host(void *h, const void *d, size_t n)
{
    assert_int_equal(cudaStreamSynchronize(g_stream), cudaSuccess);
    assert_int_equal(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost), cudaSuccess);
}

static uint16_t *rand_bf16(size_t n, uint64_t seed, float std)
{
    float *f = malloc(n * sizeof *f);
    uint16_t *b = malloc(n * sizeof *b);
    assert_non_null(f);
    assert_non_null(b);
    tkd_test_randn(f, n, seed, std);
    for (size_t i = 0; i < n; i++)
        b[i] = tkd_f32_to_bf16(f[i]);
    free(f);
    return b;
}

static double *as_f64(const uint16_t *b, size_t n)
{
    double *d = malloc(n * sizeof *d);
    assert_non_null(d);
    for (size_t i = 0; i < n; i++)
        d[i] = tkd_bf16_to_f32(b[i]);
    return d;
}

/* lse (B, H, T) of the scaled causal scores, in double, rounded to fp32 (what the forward saves). */
static float *host_lse(const double *q, const double *k, int B, int T, int H, int Hkv, int dh)
{
    float *lse = malloc(sizeof *lse * (size_t)B * H * T);
    assert_non_null(lse);
    assert_true(T <= 512); /* s[] below */
    double scale = 1.0 / sqrt((double)dh);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                const double *qi = q + ((size_t)b * T + i) * H * dh + (size_t)h * dh;
                double mx = -INFINITY, s[512];
                for (int j = 0; j <= i; j++) {
                    const double *kj = k + ((size_t)b * T + j) * Hkv * dh + (size_t)(h / (H / Hkv)) * dh;
                    double d = 0;
                    for (int c = 0; c < dh; c++)
                        d += qi[c] * kj[c];
                    s[j] = d * scale;
                    mx = fmax(mx, s[j]);
                }
                double sum = 0;
                for (int j = 0; j <= i; j++)
                    sum += exp(s[j] - mx);
                lse[((size_t)b * H + h) * T + i] = (float)(mx + log(sum));
            }
    return lse;
}

/* Holds got (bf16) to the tolerance above; names the worst element on failure. */
static void check(const char *what, const uint16_t *got, const double *ref, size_t n, size_t cols)
{
    double mx = 0;
    for (size_t i = 0; i < n; i++)
        mx = fmax(mx, fabs(ref[i]));
    size_t bad = 0, worst = 0;
    double worst_ratio = -1;
    for (size_t i = 0; i < n; i++) {
        double g = tkd_bf16_to_f32(got[i]), d = fabs(g - ref[i]), tol = BF16_REL * fabs(ref[i]) + MAX_REL * mx;
        bad += !(d <= tol);
        if (!(d / tol <= worst_ratio)) {
            worst_ratio = d / tol;
            worst = i;
        }
    }
    double g = tkd_bf16_to_f32(got[worst]);
    printf("    %s: worst |d|/tol %.3f at [%zu, %zu] (got %.6g, ref %.6g; max|ref| %.4g)\n", what, worst_ratio,
           worst / cols, worst % cols, g, ref[worst], mx);
    if (bad)
        fail_msg("%s: %zu of %zu elements off; worst [row %zu, col %zu]: got %.9g ref %.9g |d| %.3g tol %.3g", what,
                 bad, n, worst / cols, worst % cols, g, ref[worst], fabs(g - ref[worst]),
                 BF16_REL * fabs(ref[worst]) + MAX_REL * mx);
}

static void run_case(int B, int T, int H, int Hkv, int dh, uint64_t seed)
{
    printf("  B %d, T %d, H %d, Hkv %d, dh %d\n", B, T, H, Hkv, dh);
    size_t nq = (size_t)B * T * H * dh, nk = (size_t)B * T * Hkv * dh;
    uint16_t *q = rand_bf16(nq, seed, 1.0f), *k = rand_bf16(nk, seed + 1, 1.0f), *v = rand_bf16(nk, seed + 2, 1.0f);
    uint16_t *dy = rand_bf16(nq, seed + 3, 1.0f), *dq0 = rand_bf16(nq, seed + 4, 0.1f);
    uint16_t *dk0 = rand_bf16(nk, seed + 5, 0.1f), *dv0 = rand_bf16(nk, seed + 6, 0.1f);
    double *Q = as_f64(q, nq), *K = as_f64(k, nk), *Vv = as_f64(v, nk), *DY = as_f64(dy, nq);
    double *DQ = as_f64(dq0, nq), *DK = as_f64(dk0, nk), *DV = as_f64(dv0, nk);
    double *att = malloc(sizeof *att * (size_t)B * H * T * T), *y = malloc(sizeof *y * nq);
    assert_non_null(att);
    assert_non_null(y);
    tkd_ref_attn_fwd(Q, K, Vv, B, T, H, Hkv, dh, att, y);
    tkd_ref_attn_bwd(DY, Q, K, Vv, att, B, T, H, Hkv, dh, DQ, DK, DV);
    float *lse = host_lse(Q, K, B, T, H, Hkv, dh);

    uint16_t *d_q = dev_copy(q, nq * 2), *d_k = dev_copy(k, nk * 2), *d_v = dev_copy(v, nk * 2);
    uint16_t *d_dy = dev_copy(dy, nq * 2);
    float *d_lse = dev_copy(lse, sizeof *lse * (size_t)B * H * T);
    float *d_delta = dev_copy(lse, tkd_cuda_attn_bwd_simple_ws_bytes(B, T, H)); /* contents overwritten */
    uint16_t *out[2][3];
    for (int run = 0; run < 2; run++) {
        uint16_t *d_dq = dev_copy(dq0, nq * 2), *d_dk = dev_copy(dk0, nk * 2), *d_dv = dev_copy(dv0, nk * 2);
        tkd_status st = tkd_cuda_attn_bwd_simple(d_dy, d_q, d_k, d_v, NULL, d_lse, B, T, H, Hkv, dh, d_dq, d_dk, d_dv,
                                                 d_delta, g_stream);
        if (st != TKD_OK)
            fail_msg("attn_bwd_simple: %s", tkd_error_msg());
        for (int t = 0; t < 3; t++)
            out[run][t] = malloc((t ? nk : nq) * 2);
        to_host(out[run][0], d_dq, nq * 2);
        to_host(out[run][1], d_dk, nk * 2);
        to_host(out[run][2], d_dv, nk * 2);
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
    free(q), free(k), free(v), free(dy), free(dq0), free(dk0), free(dv0);
    free(Q), free(K), free(Vv), free(DY), free(DQ), free(DK), free(DV);
    free(att), free(y), free(lse);
}

static void test_demo_shape(void **state) { (void)state; run_case(2, 37, 4, 2, 16, 10); }
static void test_gqa6_two_chunks(void **state) { (void)state; run_case(1, 70, 6, 1, 32, 20); }
static void test_one_position(void **state) { (void)state; run_case(3, 1, 2, 2, 8, 30); }
static void test_dh80(void **state) { (void)state; run_case(1, 33, 2, 1, 80, 40); }
static void test_dh256(void **state) { (void)state; run_case(1, 5, 1, 1, 256, 50); }

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
#endif

int main(void)
{
    tkd_test_require_gpu();
#ifdef TKD_HAVE_CUDA
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_demo_shape), cmocka_unit_test(test_gqa6_two_chunks), cmocka_unit_test(test_one_position),
        cmocka_unit_test(test_dh80),       cmocka_unit_test(test_dh256),          cmocka_unit_test(test_refuses_bad_shapes),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
#else
    return 77;
#endif
}
