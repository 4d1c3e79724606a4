/* test_gpu_ops.c — the CUDA decoder ops (kernels/cuda/ops_cuda.h) against the double references of
 * kernels/cpu/cpu_ops_ref.h, on inputs already rounded to bf16 (so the only differences are the device's
 * own fp32 arithmetic and its one rounding to bf16), over awkward shapes: one row, row counts that
 * fill no tile, widths that are not multiples of 8 (the scalar paths), pointers one element off
 * 16-byte alignment. Outputs are poisoned (all bits set: NaN) before each launch, so an element a
 * kernel skips fails. Labelled gpu: exits 77 (skipped) where no GPU answers or the build has no CUDA
 * backend.
 *
 * Tolerances. A bf16 output is the device's fp32 value v rounded once to nearest: |bf16(v) − v| ≤
 * half an ulp ≤ 2^-8·|v| (8 significant bits). So each bf16 output is held to
 * |got − ref| ≤ 2^-8·|ref| + (a bound on v's own fp32 error, per op):
 *   RMSNorm y: fp32 sum of squares (≤ 32 serial adds per thread, then a 9-level tree: ≤ 41·2^-24)
 *     and 1/sqrt: ≤ 3e-6 relative; held to 1e-5·|ref|.
 *   RoPE: x·c − y·s in fp32: ≤ 2^-23·(|x| + |y|) of the pair's inputs; held to 2^-21·(|x| + |y|).
 *   SwiGLU: expf, a divide, two multiplies: ≤ ~6·2^-24 relative; held to 1e-5·|ref|, plus 1e-30
 *     absolute: for g < −88.7 e^−g overflows fp32 and silu(g) comes out −0 instead of |g|·e^g < 1e-36
 *     (the CPU fast path does the same).
 *   linear: fp32 accumulation of K products on tensor cores, which may truncate rather than round
 *     each add, in MMA blocks of 16 then across k-tiles: ≤ (K/16 + 16)·2^-23·Σ_k|x_k·w_k| (≤ 3.2e-5
 *     of that sum at K = 4096); held to 1e-4·Σ_k|x_k·w_k|. The bias is added in fp32 before the
 *     rounding where K and M are multiples of 8; elsewhere cuBLASLt rounds first (see linear_run).
 * fp32 outputs: the embedding rows and the residual x_out = x_in + float(branch) (one IEEE add) are
 * bit-identical to the host's; rstd within 1e-5 relative (the sum of squares above). The conversions
 * are bit-identical to common/half.h's (NaN payloads included).
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
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_ops_ref.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/cuda/ops_cuda.h"

#define BF16_REL 0.00390625       /* 2^-8: one round-to-nearest into bf16 (see the top) */
#define RMS_F32_REL 1e-5          /* fp32 sum of squares and 1/sqrt */
#define SWIGLU_F32_REL 1e-5       /* expf, divide, multiplies */
#define SWIGLU_ABS 1e-30          /* e^-g overflow for g < -88.7 */
#define LINEAR_ACC_REL 1e-4       /* times Σ|x·w|: fp32 tensor-core accumulation */
#define RSTD_REL 1e-5             /* rstd: fp32 sum of squares and 1/sqrt */

static cudaStream_t g_stream; /* every launch goes to this (non-default) stream */

/* ---- helpers ------------------------------------------------------------------------------------ */

/* bf16 outputs: one round-to-nearest (2^-8·|ref|) on top of each op's fp32 bound (see the top). */
static const tkd_test_tol kRmsTol = {0.0, BF16_REL + RMS_F32_REL, "bf16 y 2^-8 + fp32 sum of squares and 1/sqrt 1e-5"};
static const tkd_test_tol kSwigluTol = {SWIGLU_ABS, BF16_REL + SWIGLU_F32_REL,
                                        "bf16 2^-8 + expf, divide, multiplies 1e-5; 1e-30: e^-g overflow"};
static const tkd_test_tol kLinearTol = {0.0, BF16_REL, "bf16 2^-8, + 1e-4·Σ|x·w| (fp32 tensor-core accumulation)"};

/* fp32 outputs that must equal the host's bit for bit. */
static void check_f32_bits(const char *what, const float *got, const float *want, size_t n, size_t cols)
{
    for (size_t i = 0; i < n; i++)
        if (tkd_f32_bits(got[i]) != tkd_f32_bits(want[i]))
            fail_msg("%s: [%zu, %zu]: got %.9g (0x%08x) want %.9g (0x%08x)", what, i / cols, i % cols,
                     got[i], tkd_f32_bits(got[i]), want[i], tkd_f32_bits(want[i]));
}

/* ---- embedding ------------------------------------------------------------------------------------ */

static void embedding_case(int N, int D)
{
    const int V = 50;
    char what[128];
    snprintf(what, sizeof what, "embedding N %d D %d", N, D);
    uint16_t *emb = tkd_test_rand_bf16((size_t)V * D, 11 + D, 1.0f);
    int32_t *tok = tkd_test_xmalloc((size_t)N * 4);
    for (int n = 0; n < N; n++)
        tok[n] = (int32_t)((n * 7919u + 3u) % V);
    tok[0] = 0, tok[N - 1] = V - 1;
    float *want = tkd_test_xmalloc((size_t)N * D * 4), *got = tkd_test_xmalloc((size_t)N * D * 4);
    for (int n = 0; n < N; n++)
        for (int d = 0; d < D; d++)
            want[(size_t)n * D + d] = tkd_bf16_to_f32(emb[(size_t)tok[n] * D + d]);
    uint16_t *d_emb = tkd_test_dev_alloc((size_t)V * D * 2);
    int32_t *d_tok = tkd_test_dev_alloc((size_t)N * 4);
    float *d_x = tkd_test_dev_alloc((size_t)N * D * 4);
    tkd_test_to_dev(d_emb, emb, (size_t)V * D * 2);
    tkd_test_to_dev(d_tok, tok, (size_t)N * 4);
    tkd_test_poison(d_x, (size_t)N * D * 4);
    tkd_test_ok(tkd_cuda_embedding_fwd(d_tok, N, d_emb, D, d_x, g_stream), what);
    tkd_test_to_host(got, d_x, (size_t)N * D * 4, g_stream);
    check_f32_bits(what, got, want, (size_t)N * D, (size_t)D);
    cudaFree(d_emb), cudaFree(d_tok), cudaFree(d_x);
    free(emb), free(tok), free(want), free(got);
}

static void test_embedding(void **state)
{
    (void)state;
    const int ns[] = {1, 17, 1000}, ds[] = {64, 896, 1000, 1001, 4096, 7};
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
        for (size_t j = 0; j < sizeof ds / sizeof *ds; j++)
            embedding_case(ns[i], ds[j]);
    assert_int_equal(tkd_cuda_embedding_fwd(NULL, 1, NULL, 0, NULL, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_embedding_fwd(NULL, 0, NULL, 8, NULL, g_stream), TKD_OK); /* no rows */
}

/* ---- RMSNorm and the fused residual add ------------------------------------------------------------ */

/* x (N, D) fp32: normal rows scaled by 10^(n % 5 − 2), and row 3 all zeros (rstd = 1/sqrt(eps)). */
static float *rms_input(int N, int D, uint64_t seed)
{
    float *x = tkd_test_xmalloc((size_t)N * D * 4);
    tkd_test_randn(x, (size_t)N * D, seed, 1.0f);
    for (int n = 0; n < N; n++)
        for (int d = 0; d < D; d++)
            x[(size_t)n * D + d] *= n == 3 ? 0.0f : powf(10.0f, (float)(n % 5 - 2));
    return x;
}

/* One RMSNorm (fused = 0) or residual add + RMSNorm (fused = 1, in place when inplace = 1). */
static void rmsnorm_case(int N, int D, int fused, int inplace, int with_rstd)
{
    const float eps = 1e-6f;
    const size_t nd = (size_t)N * D;
    char what[160];
    snprintf(what, sizeof what, "%s N %d D %d%s%s", fused ? "add_rmsnorm" : "rmsnorm", N, D,
             inplace ? " in place" : "", with_rstd ? "" : " (rstd NULL)");
    float *x = rms_input(N, D, 100 + D), *x_out = tkd_test_xmalloc(nd * 4), *got_x = tkd_test_xmalloc(nd * 4);
    uint16_t *w = tkd_test_rand_bf16((size_t)D, 200 + D, 0.5f), *br = tkd_test_rand_bf16(nd, 300 + D, 2.0f);
    for (int d = 0; d < D; d++) /* w around 1, as trained norms are */
        w[d] = tkd_f32_to_bf16(1.0f + tkd_bf16_to_f32(w[d]));
    for (size_t i = 0; i < nd; i++)
        x_out[i] = fused ? x[i] + tkd_bf16_to_f32(br[i]) : x[i]; /* one fp32 add, as the device */
    double *xd = tkd_test_xmalloc(nd * 8), *wd = tkd_test_bf16_to_f64(w, (size_t)D),
           *ref = tkd_test_xmalloc(nd * 8);
    double *rref = tkd_test_xmalloc((size_t)N * 8);
    for (size_t i = 0; i < nd; i++)
        xd[i] = x_out[i];
    tkd_ref_rmsnorm_fwd(xd, wd, N, D, eps, ref, rref);

    float *d_x = tkd_test_dev_alloc(nd * 4), *d_xo = inplace ? d_x : tkd_test_dev_alloc(nd * 4);
    float *d_r = tkd_test_dev_alloc((size_t)N * 4);
    uint16_t *d_w = tkd_test_dev_alloc((size_t)D * 2), *d_b = tkd_test_dev_alloc(nd * 2),
             *d_y = tkd_test_dev_alloc(nd * 2);
    tkd_test_to_dev(d_x, x, nd * 4);
    tkd_test_to_dev(d_w, w, (size_t)D * 2);
    tkd_test_to_dev(d_b, br, nd * 2);
    tkd_test_poison(d_y, nd * 2);
    tkd_test_poison(d_r, (size_t)N * 4);
    if (fused && !inplace)
        tkd_test_poison(d_xo, nd * 4);
    float *rstd = with_rstd ? d_r : NULL;
    if (fused)
        tkd_test_ok(tkd_cuda_add_rmsnorm_fwd(d_x, d_b, d_xo, d_w, N, D, eps, d_y, rstd, g_stream), what);
    else
        tkd_test_ok(tkd_cuda_rmsnorm_fwd(d_x, d_w, N, D, eps, d_y, rstd, g_stream), what);

    uint16_t *y = tkd_test_xmalloc(nd * 2);
    float *r = tkd_test_xmalloc((size_t)N * 4);
    tkd_test_to_host(y, d_y, nd * 2, g_stream);
    tkd_test_check_bf16_mat(what, y, ref, nd, (size_t)D, kRmsTol, NULL);
    if (fused) {
        tkd_test_to_host(got_x, d_xo, nd * 4, g_stream);
        check_f32_bits(what, got_x, x_out, nd, (size_t)D);
    }
    tkd_test_to_host(r, d_r, (size_t)N * 4, g_stream);
    for (int n = 0; n < N; n++)
        if (with_rstd ? !tkd_test_close(r[n], rref[n], 0.0, RSTD_REL) : tkd_f32_bits(r[n]) != 0xffffffffu)
            fail_msg("%s: rstd[%d] = %.9g, ref %.9g%s", what, n, r[n], rref[n],
                     with_rstd ? "" : " (rstd was NULL: must stay unwritten)");
    cudaFree(d_x), cudaFree(d_r), cudaFree(d_w), cudaFree(d_b), cudaFree(d_y);
    if (!inplace)
        cudaFree(d_xo);
    free(x), free(x_out), free(got_x), free(w), free(br), free(xd), free(wd), free(ref), free(rref);
    free(y), free(r);
}

/* RMSNorm of bf16 input (tkd_cuda_rmsnorm_bf16_fwd), in place: the bits of tkd_cuda_rmsnorm_fwd on
 * the exact f32 copy, y and rstd both (rmsnorm_case holds that one to the float64 reference). */
static void rmsnorm_bf16_case(int N, int D)
{
    const size_t nd = (size_t)N * D;
    char what[96];
    snprintf(what, sizeof what, "rmsnorm from bf16, in place, N %d D %d", N, D);
    uint16_t *xb = tkd_test_rand_bf16(nd, 400 + D, 1.5f), *w = tkd_test_rand_bf16((size_t)D, 500 + D, 0.5f);
    float *xf = tkd_test_xmalloc(nd * 4);
    for (size_t i = 0; i < nd; i++)
        xf[i] = tkd_bf16_to_f32(xb[i]);
    float *d_xf = tkd_test_dev_alloc(nd * 4), *d_r1 = tkd_test_dev_alloc((size_t)N * 4),
          *d_r2 = tkd_test_dev_alloc((size_t)N * 4);
    uint16_t *d_xb = tkd_test_dev_alloc(nd * 2), *d_w = tkd_test_dev_alloc((size_t)D * 2),
             *d_y = tkd_test_dev_alloc(nd * 2);
    tkd_test_to_dev(d_xf, xf, nd * 4);
    tkd_test_to_dev(d_xb, xb, nd * 2);
    tkd_test_to_dev(d_w, w, (size_t)D * 2);
    tkd_test_ok(tkd_cuda_rmsnorm_fwd(d_xf, d_w, N, D, 1e-6f, d_y, d_r1, g_stream), what);
    tkd_test_ok(tkd_cuda_rmsnorm_bf16_fwd(d_xb, d_w, N, D, 1e-6f, d_xb, d_r2, g_stream), what);
    uint16_t *y1 = tkd_test_xmalloc(nd * 2), *y2 = tkd_test_xmalloc(nd * 2);
    float *r1 = tkd_test_xmalloc((size_t)N * 4), *r2 = tkd_test_xmalloc((size_t)N * 4);
    tkd_test_to_host(y1, d_y, nd * 2, g_stream);
    tkd_test_to_host(y2, d_xb, nd * 2, g_stream);
    tkd_test_to_host(r1, d_r1, (size_t)N * 4, g_stream);
    tkd_test_to_host(r2, d_r2, (size_t)N * 4, g_stream);
    for (size_t i = 0; i < nd; i++)
        if (y1[i] != y2[i])
            fail_msg("%s: y[%zu] = 0x%04x, from the f32 copy 0x%04x", what, i, y2[i], y1[i]);
    assert_memory_equal(r1, r2, (size_t)N * 4);
    cudaFree(d_xf), cudaFree(d_r1), cudaFree(d_r2), cudaFree(d_xb), cudaFree(d_w), cudaFree(d_y);
    free(xb), free(w), free(xf), free(y1), free(y2), free(r1), free(r2);
}

static void rmsnorm_all(int N, int D)
{
    rmsnorm_case(N, D, 0, 0, 1);
    rmsnorm_case(N, D, 1, 0, 1);
    rmsnorm_case(N, D, 1, 1, 0);
}

static void test_rmsnorm(void **state)
{
    (void)state;
    /* 64..4096: one chunk per thread; 1001, 7: scalar path (D % 8 != 0) */
    const int ns[] = {1, 17, 1000}, ds[] = {64, 896, 1000, 1001, 4096, 7};
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
        for (size_t j = 0; j < sizeof ds / sizeof *ds; j++)
            rmsnorm_all(ns[i], ds[j]);
    /* 2 and 4 chunks per thread (8192, 12000, 16384), scalar with 2 and 4 (5003, 16383) */
    const int big[] = {8192, 12000, 16384, 5003, 16383};
    for (size_t j = 0; j < sizeof big / sizeof *big; j++) {
        rmsnorm_all(1, big[j]);
        rmsnorm_all(17, big[j]);
    }
    rmsnorm_case(17, 896, 0, 0, 0); /* rstd NULL on the plain path too */
    /* short rows (plain, D ≤ 256: G = 4, 8, 16, 32 lanes a row, 256 / G rows a block), N not a
     * multiple of the rows a block takes; 264 and 1001: the one-block-a-row kernel again */
    const int sn[] = {1, 33, 4099}, sd[] = {8, 24, 128, 136, 256, 264};
    for (size_t i = 0; i < sizeof sn / sizeof *sn; i++)
        for (size_t j = 0; j < sizeof sd / sizeof *sd; j++)
            rmsnorm_case(sn[i], sd[j], 0, 0, 1);
    rmsnorm_case(4099, 128, 0, 0, 0);
    /* bf16 input: short rows, one block a row (4096), the scalar path (1000, 7) */
    const int bd[] = {64, 128, 136, 4096, 1000, 7};
    for (size_t j = 0; j < sizeof bd / sizeof *bd; j++) {
        rmsnorm_bf16_case(1, bd[j]);
        rmsnorm_bf16_case(1000, bd[j]);
    }
    float *d = tkd_test_dev_alloc(64);
    uint16_t *h = tkd_test_dev_alloc(64);
    assert_int_equal(tkd_cuda_rmsnorm_fwd(d, h, 1, 16385, 1e-6f, h, NULL, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_rmsnorm_fwd(d, h, 1, 0, 1e-6f, h, NULL, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_add_rmsnorm_fwd(d, NULL, d, h, 1, 8, 1e-6f, h, NULL, g_stream),
                     TKD_ERR_INVALID_ARG);
    cudaFree(d), cudaFree(h);
}

/* ---- RoPE ----------------------------------------------------------------------------------------- */

/* The shapes and the check: tests/gpu_testutil.h (tkd_test_rope_cases); q and k of seeds 400 + dh,
 * 500 + dh. */
static void test_rope(void **state)
{
    (void)state;
    tkd_test_rope_cases(0, 400, g_stream);
}

/* ---- SwiGLU --------------------------------------------------------------------------------------- */

/* off: elements the device pointers sit past a 16-byte boundary (1: the scalar path). */
static void swiglu_case(int64_t n, int off)
{
    char what[96];
    snprintf(what, sizeof what, "swiglu n %lld offset %d", (long long)n, off);
    uint16_t *g = tkd_test_rand_bf16((size_t)n, 600 + (uint64_t)n, 4.0f),
             *u = tkd_test_rand_bf16((size_t)n, 700, 1.0f);
    const float special[] = {0.0f, -0.0f, 30.0f, -30.0f, -87.0f, -100.0f, 100.0f, 1e-30f};
    for (size_t j = 0; j < sizeof special / sizeof *special && (int64_t)j * 97 < n; j++)
        g[j * 97] = tkd_f32_to_bf16(special[j]);
    double *gd = tkd_test_bf16_to_f64(g, (size_t)n), *ud = tkd_test_bf16_to_f64(u, (size_t)n),
           *ref = tkd_test_xmalloc((size_t)n * 8);
    tkd_ref_swiglu_fwd(gd, ud, n, ref);
    uint16_t *d_g = tkd_test_dev_alloc((size_t)(n + off) * 2),
             *d_u = tkd_test_dev_alloc((size_t)(n + off) * 2);
    uint16_t *d_h = tkd_test_dev_alloc((size_t)(n + off) * 2);
    tkd_test_to_dev(d_g + off, g, (size_t)n * 2);
    tkd_test_to_dev(d_u + off, u, (size_t)n * 2);
    tkd_test_poison(d_h, (size_t)(n + off) * 2);
    tkd_test_ok(tkd_cuda_swiglu_fwd(d_g + off, d_u + off, n, d_h + off, g_stream), what);
    tkd_test_to_host(g, d_h + off, (size_t)n * 2, g_stream); /* g's buffer now holds h */
    tkd_test_check_bf16_mat(what, g, ref, (size_t)n, (size_t)n, kSwigluTol, NULL);
    cudaFree(d_g), cudaFree(d_u), cudaFree(d_h);
    free(g), free(u), free(gd), free(ud), free(ref);
}

static void test_swiglu(void **state)
{
    (void)state;
    const int64_t ns[] = {1, 7, 8, 1000, 1003, (1 << 20) + 5, 17 * 4864};
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
        swiglu_case(ns[i], 0);
    swiglu_case(1003, 1);
    swiglu_case(8, 1);
    assert_int_equal(tkd_cuda_swiglu_fwd(NULL, NULL, -1, NULL, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_swiglu_fwd(NULL, NULL, 0, NULL, g_stream), TKD_OK);
}

/* ---- conversions ---------------------------------------------------------------------------------- */

/* Every bf16 upper half with lower halves that round down, tie (to even, both parities of the kept
 * bit), round up and carry into the exponent; random ones; so every exponent (subnormals, 0, inf,
 * NaN payloads, the largest finite that rounds to inf) is covered. n = 65536·16 + 5. */
static uint32_t *conv_values(size_t *n_out)
{
    const uint16_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
    const size_t per = 16, n = 65536 * per + 5;
    uint32_t *v = tkd_test_xmalloc(n * 4);
    uint64_t s = 0x243f6a8885a308d3ull;
    for (uint32_t hi = 0; hi < 65536; hi++)
        for (size_t j = 0; j < per; j++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            uint32_t lo = j < sizeof lows / sizeof *lows ? lows[j] : (uint32_t)(s & 0xffffu);
            v[hi * per + j] = hi << 16 | lo;
        }
    for (size_t i = 65536 * per; i < n; i++)
        v[i] = 0x7f7fffffu - (uint32_t)(i & 3); /* the odd tail: largest finite values */
    *n_out = n;
    return v;
}

static void f32_to_bf16_run(const uint32_t *v, size_t n, int off)
{
    char what[80];
    snprintf(what, sizeof what, "f32_to_bf16 n %zu offset %d", n, off);
    float *d_src = tkd_test_dev_alloc((n + off) * 4);
    uint16_t *d_dst = tkd_test_dev_alloc((n + off) * 2), *got = tkd_test_xmalloc(n * 2);
    tkd_test_to_dev(d_src + off, v, n * 4);
    tkd_test_poison(d_dst, (n + off) * 2);
    tkd_test_ok(tkd_cuda_f32_to_bf16(d_src + off, d_dst + off, n, g_stream), what);
    tkd_test_to_host(got, d_dst + off, n * 2, g_stream);
    for (size_t i = 0; i < n; i++) {
        uint16_t want = tkd_f32_to_bf16(tkd_bits_f32(v[i]));
        if (got[i] != want)
            fail_msg("%s: [%zu] 0x%08x -> 0x%04x, host 0x%04x", what, i, v[i], got[i], want);
    }
    cudaFree(d_src), cudaFree(d_dst), free(got);
}

static void bf16_to_f32_run(size_t n, int off)
{
    char what[80];
    snprintf(what, sizeof what, "bf16_to_f32 n %zu offset %d", n, off);
    uint16_t *src = tkd_test_xmalloc(n * 2);
    uint32_t *got = tkd_test_xmalloc(n * 4);
    for (size_t i = 0; i < n; i++)
        src[i] = (uint16_t)(i * 40503u); /* odd multiplier: all 65536 patterns when n = 65536 */
    uint16_t *d_src = tkd_test_dev_alloc((n + off) * 2);
    float *d_dst = tkd_test_dev_alloc((n + off) * 4);
    tkd_test_to_dev(d_src + off, src, n * 2);
    tkd_test_poison(d_dst, (n + off) * 4);
    tkd_test_ok(tkd_cuda_bf16_to_f32(d_src + off, d_dst + off, n, g_stream), what);
    tkd_test_to_host(got, d_dst + off, n * 4, g_stream);
    for (size_t i = 0; i < n; i++)
        if (got[i] != tkd_f32_bits(tkd_bf16_to_f32(src[i])))
            fail_msg("%s: [%zu] 0x%04x -> 0x%08x, host 0x%08x", what, i, src[i], got[i],
                     tkd_f32_bits(tkd_bf16_to_f32(src[i])));
    cudaFree(d_src), cudaFree(d_dst), free(src), free(got);
}

static void test_convert(void **state)
{
    (void)state;
    size_t n;
    uint32_t *v = conv_values(&n);
    f32_to_bf16_run(v, n, 0);     /* vector path and a tail of 5 */
    f32_to_bf16_run(v, n - 2, 1); /* scalar path */
    f32_to_bf16_run(v + 3, 1, 0);
    free(v);
    bf16_to_f32_run(65536, 0);
    bf16_to_f32_run(65536, 1);
    bf16_to_f32_run(13, 0);
    assert_int_equal(tkd_cuda_f32_to_bf16(NULL, NULL, 0, g_stream), TKD_OK);
    assert_int_equal(tkd_cuda_bf16_to_f32(NULL, NULL, 5, g_stream), TKD_ERR_INVALID_ARG);
}

/* ---- linear --------------------------------------------------------------------------------------- */

typedef struct lin_case {
    int n, k, m, bias;
    int off, boff; /* elements x, w, y (off) and b (boff) sit past a 256-byte boundary */
} lin_case;

/* Runs one product; writes the device result (N, M) to out (bf16) and checks it against the
 * reference. b_seed picks the bias values. Pointers off 16-byte alignment may be refused
 * (TKD_ERR_INVALID_ARG, when cuBLASLt offers no algorithm for them: ops_cuda.h); then out is
 * untouched and the refusal is printed. Returns 1 when the product ran. */
static int linear_run(tkd_cuda_linear *lin, lin_case c, uint64_t b_seed, uint16_t *out)
{
    char what[128];
    snprintf(what, sizeof what, "linear N %d K %d M %d%s offset %d/%d", c.n, c.k, c.m,
             c.bias ? " bias" : "", c.off, c.boff);
    const size_t nx = (size_t)c.n * c.k, nw = (size_t)c.m * c.k, ny = (size_t)c.n * c.m;
    uint16_t *x = tkd_test_rand_bf16(nx, 800 + c.k, 1.0f),
             *w = tkd_test_rand_bf16(nw, 900 + c.m, 1.0f / sqrtf((float)c.k));
    uint16_t *b = c.bias ? tkd_test_rand_bf16((size_t)c.m, b_seed, 0.5f) : NULL;
    double *xd = tkd_test_bf16_to_f64(x, nx), *wd = tkd_test_bf16_to_f64(w, nw),
           *bd = b ? tkd_test_bf16_to_f64(b, (size_t)c.m) : NULL;
    double *ref = tkd_test_xmalloc(ny * 8), *absum = tkd_test_xmalloc(ny * 8),
           *prod = tkd_test_xmalloc(ny * 8);
    tkd_ref_linear_fwd(xd, wd, bd, c.n, c.k, c.m, 0, ref);
    tkd_ref_linear_fwd(xd, wd, NULL, c.n, c.k, c.m, 0, prod);
    for (size_t i = 0; i < nx; i++)
        xd[i] = fabs(xd[i]);
    for (size_t i = 0; i < nw; i++)
        wd[i] = fabs(wd[i]);
    tkd_ref_linear_fwd(xd, wd, NULL, c.n, c.k, c.m, 0, absum);
    /* Measured on an H200: for leading dimensions that are not multiples of 8 elements, cuBLASLt's
     * kernels round the product to bf16 before the bias epilogue adds the bias (K 1001, M 77: 16 of
     * 1309 elements beyond the fp32-bias bound), so there one more rounding of |x·w| is allowed.
     * Model shapes are multiples of 8, where the bias is added before the one rounding. */
    int bias_after_round = b && (c.k % 8 || c.m % 8);
    for (size_t i = 0; i < ny; i++)
        absum[i] = absum[i] * LINEAR_ACC_REL + (bias_after_round ? ldexp(fabs(prod[i]), -8) : 0.0);
    uint16_t *d_x = tkd_test_dev_alloc((nx + c.off) * 2), *d_w = tkd_test_dev_alloc((nw + c.off) * 2);
    uint16_t *d_y = tkd_test_dev_alloc((ny + c.off) * 2),
             *d_b = tkd_test_dev_alloc((size_t)(c.m + c.boff) * 2);
    tkd_test_to_dev(d_x + c.off, x, nx * 2);
    tkd_test_to_dev(d_w + c.off, w, nw * 2);
    if (b)
        tkd_test_to_dev(d_b + c.boff, b, (size_t)c.m * 2);
    tkd_test_poison(d_y, (ny + c.off) * 2);
    tkd_status st = tkd_cuda_linear_fwd(lin, d_x + c.off, d_w + c.off, b ? d_b + c.boff : NULL, c.n,
                                        c.k, c.m, d_y + c.off, g_stream);
    const int ran = !(st == TKD_ERR_INVALID_ARG && (c.off % 8 || c.boff % 8));
    if (ran) {
        tkd_test_ok(st, what);
        tkd_test_to_host(out, d_y + c.off, ny * 2, g_stream);
        tkd_test_check_bf16_mat(what, out, ref, ny, (size_t)c.m, kLinearTol, absum);
    } else {
        tkd_test_assert_msg_has("no bf16 algorithm");
        print_message("note: %s refused: %s\n", what, tkd_error_msg());
    }
    cudaFree(d_x), cudaFree(d_w), cudaFree(d_y), cudaFree(d_b);
    free(x), free(w), free(b), free(xd), free(wd), free(bd), free(ref), free(absum), free(prod);
    return ran;
}

static void test_linear(void **state)
{
    (void)state;
    tkd_cuda_linear *lin = NULL;
    tkd_test_ok(tkd_cuda_linear_create(&lin), "linear_create");
    const lin_case cases[] = {
        {1, 64, 64, 0, 0, 0},       {1, 896, 1000, 1, 0, 0},  {17, 896, 128, 1, 0, 0},
        {17, 1001, 77, 1, 0, 0},    /* K and M odd */         {1000, 896, 136, 1, 0, 0},
        {1000, 64, 4096, 0, 0, 0},  {33, 4096, 512, 0, 0, 0}, {7, 13, 5, 1, 0, 0},
        {257, 1000, 1003, 1, 0, 0}, {17, 896, 128, 1, 8, 8}, /* 16-byte, not 256-byte, aligned */
        /* x, w, y 2 or 6 bytes past alignment; then the bias too */
        {17, 896, 128, 0, 1, 0},    {17, 1001, 77, 1, 3, 0},  {1, 7, 3, 1, 1, 0},
        {17, 896, 128, 1, 0, 1},    {17, 1001, 77, 1, 1, 3},
    };
    const size_t nc = sizeof cases / sizeof *cases;
    uint16_t *first = tkd_test_xmalloc((size_t)cases[2].n * cases[2].m * 2);
    uint16_t *again = tkd_test_xmalloc((size_t)cases[2].n * cases[2].m * 2);
    for (size_t i = 0; i < nc; i++) {
        uint16_t *out = tkd_test_xmalloc((size_t)cases[i].n * cases[i].m * 2);
        linear_run(lin, cases[i], 1000 + i, out);
        if (i == 2)
            memcpy(first, out, (size_t)cases[2].n * cases[2].m * 2);
        free(out);
    }
    /* The cached plan again, with the same bias (bit-identical) and with another bias vector. */
    assert_true(linear_run(lin, cases[2], 1002, again));
    assert_memory_equal(first, again, (size_t)cases[2].n * cases[2].m * 2);
    assert_true(linear_run(lin, cases[2], 4242, again));
    /* More shapes than the plan table holds (32), then a cached one again. */
    for (int m = 8; m < 8 + 40; m++) {
        lin_case c = {3, 24, m, m & 1, 0, 0};
        uint16_t *out = tkd_test_xmalloc((size_t)3 * m * 2);
        linear_run(lin, c, 5000 + m, out);
        free(out);
    }
    assert_true(linear_run(lin, cases[2], 1002, again));
    assert_memory_equal(first, again, (size_t)cases[2].n * cases[2].m * 2);

    uint16_t *d = tkd_test_dev_alloc(4096);
    assert_int_equal(tkd_cuda_linear_fwd(lin, d, d, NULL, 0, 8, 8, d, g_stream), TKD_OK); /* no rows */
    assert_int_equal(tkd_cuda_linear_fwd(lin, d, d, NULL, 1, 0, 8, d, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_linear_fwd(lin, d, d, NULL, -1, 8, 8, d, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_linear_fwd(NULL, d, d, NULL, 1, 8, 8, d, g_stream), TKD_ERR_INVALID_ARG);
    const uint16_t *odd = (const uint16_t *)((const char *)d + 1); /* not a bf16 address */
    assert_int_equal(tkd_cuda_linear_fwd(lin, odd, d, NULL, 1, 8, 8, d + 64, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_linear_fwd(lin, d, d, odd, 1, 8, 8, d + 64, g_stream), TKD_ERR_INVALID_ARG);
    cudaFree(d);
    free(first), free(again);
    tkd_cuda_linear_free(lin);
    tkd_cuda_linear_free(NULL);
}

/* The ledger of device memory by name (cuda_mem.h): an allocation counts under its name while it
 * lives, its peak stays after the free, and two allocations of one name add up. */
static const tkd_cuda_mem_use *find_use(tkd_cuda_mem_use *u, int n, const char *what)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(u[i].what, what))
            return &u[i];
    return NULL;
}

static void test_memory_ledger(void **state)
{
    (void)state;
    enum { CAP = 512 };
    static tkd_cuda_mem_use u[CAP];
    const size_t before = tkd_cuda_mem_live();
    void *a = NULL, *b = NULL;
    assert_int_equal(tkd_cuda_malloc(&a, 3 << 20, "test_gpu_ops: ledger", NULL), TKD_OK);
    assert_int_equal(tkd_cuda_malloc(&b, 1 << 20, "test_gpu_ops: ledger", NULL), TKD_OK);
    int n = tkd_cuda_mem_ledger(u, CAP);
    assert_true(n <= CAP);
    const tkd_cuda_mem_use *x = find_use(u, n, "test_gpu_ops: ledger");
    assert_non_null(x);
    assert_int_equal(x->live, 4 << 20);
    assert_int_equal(x->count, 2);
    assert_int_equal(tkd_cuda_mem_live(), before + (4 << 20));
    for (int i = 1; i < n; i++) /* most live first */
        assert_true(u[i - 1].live >= u[i].live);
    tkd_cuda_free(a);
    tkd_cuda_free(b);
    n = tkd_cuda_mem_ledger(u, CAP);
    x = find_use(u, n, "test_gpu_ops: ledger");
    assert_non_null(x);
    assert_int_equal(x->live, 0);
    assert_int_equal(x->count, 0);
    assert_int_equal(x->peak, 4 << 20);
    assert_int_equal(tkd_cuda_mem_live(), before);
}

static int setup(void **state)
{
    (void)state;
    return cudaStreamCreate(&g_stream) == cudaSuccess ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    cudaStreamDestroy(g_stream);
    return 0;
}

static const struct CMUnitTest kTests[] = {
    cmocka_unit_test(test_convert),   cmocka_unit_test(test_embedding),
    cmocka_unit_test(test_rmsnorm),   cmocka_unit_test(test_rope),
    cmocka_unit_test(test_swiglu),    cmocka_unit_test(test_linear),
    cmocka_unit_test(test_memory_ledger),
};
#endif /* TKD_HAVE_CUDA */

TKD_TEST_GPU_MAIN(kTests, setup, teardown)
