/* test_gpu_ops_bwd.c — the CUDA backward ops and optimizer kernels (kernels/cuda/ops_bwd_cuda.h) against
 * the double references of kernels/cpu/cpu_ops_ref.h and, for AdamW, model/optim.c's tkd_adamw_step, on
 * inputs already rounded to bf16, over awkward shapes: one row, row counts that fill no tile or
 * chunk, widths that are not multiples of 8 (the scalar paths), pointers one element off 16-byte
 * alignment, GQA ratios 1, 2 and 7, tokens repeated across the embedding's chunk boundaries. Every
 * gradient output starts from random values (the ops ADD into it), gradients rounded to bf16 first
 * where they are bf16. Each op whose result depends on a summation order (embedding, RMSNorm, linear,
 * gradient norm) is run twice from the same state and must give the same bits. Labelled gpu: exits
 * 77 (skipped) where no GPU answers or the build has no CUDA backend.
 *
 * Tolerances (u = 2^-24, the fp32 unit roundoff; a bf16 output is the device's fp32 value rounded
 * once to nearest, |bf16(v) − v| ≤ 2^-8·|v|, so bf16 outputs get 2^-8·|ref| on top of the bound
 * on v's own error):
 *   embedding demb (fp32): a token's rows are summed in ≤ 64-row chunk pieces, the pieces joined in
 *     chunk order, then added to demb: ≤ 64 + chunks + 1 roundings, each ≤ u·Σ(|demb₀| + Σ|dx|);
 *     held to (64 + chunks + 2)·u times that sum. A token seen once is demb₀ + dx, one IEEE add:
 *     bit-identical to the host's. Rows of tokens not in the batch stay bit-identical.
 *   RMSNorm dx (fp32): Σ g·x in fp32 (≤ 32 serial adds per thread, a 10-level tree: ≤ 42u of
 *     Σ|g·x|), then ~5 roundings; held to 2^-23·|ref| + 1e-5·(r·|g| + r³/D·|x|·Σ|g·x|) with g = dy·w.
 *   RMSNorm dw, linear db (fp32): fp32 sums over row groups of ≤ max(16, N/512) rows (≤ 18 here),
 *     two roundings per product, the groups summed in double: ≤ 21u of Σ|terms|; held to
 *     2^-23·|ref| + 1e-5·Σ|terms|.
 *   RoPE (bf16): x·c ± y·s in fp32: ≤ 2^-23·(|x| + |y|) of the pair; held to 2^-21·(|x| + |y|).
 *   SwiGLU dg, du (bf16): expf (≤ 2 ulp), a divide and ≤ 6 more roundings, 1 − s off by ≤ 4u
 *     absolutely when s ≈ 1: held to 1e-5·|dh·u·s|·(1 + |g|) and 1e-5·|dh·g·s|, plus 1e-30
 *     absolute (σ(g) underflows to 0 for g < −88.7, where the true terms are < 1e-36).
 *   linear dx (bf16) and dw (fp32): fp32 tensor-core accumulation of the reduction (M for dx, N for
 *     dw) as in test_gpu_ops.c: held to 1e-4·Σ|products| (+ 2^-23·|ref| for dw's output rounding).
 *     cuBLASLt may round the product before the beta·C add (measured on an H200 for odd leading
 *     dimensions, as for the bias epilogue in test_gpu_ops.c, and for N = 1 at K = M = 64), so dx
 *     gets one more 2^-8 of Σ|products| at every shape.
 *   AdamW: bit-identical to tkd_adamw_step (IEEE-rounded fp32 operations in the same order on both
 *     sides, no fused multiply-adds; ADAMW_MAX_ULP = 0) after the host's tkd_optim_scale, the master
 *     weights joined from bf16 + residual, the bf16 half equal to the host's split; with bf16
 *     moments (optim.state_dtype) the stored m, v too (both round with common/half.h).
 *   grad norm² (double): all terms positive, ≤ ~90 double roundings in the longest chain: held to
 *     1e-13 relative to a long-double pairwise reference. scale: bit-identical to tkd_optim_scale.
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
#include "kernels/cuda/ops_bwd_cuda.h"
#include "kernels/cuda/ops_cuda.h"
#include "model/optim.h"
#include "tests/optim_testutil.h"

#define U 5.9604644775390625e-08  /* 2^-24 */
#define BF16_REL 0.00390625       /* 2^-8: one round-to-nearest into bf16 */
#define F32_OUT_REL 1.1920928955078125e-07 /* 2^-23: an fp32 output's rounding and its += */
#define EMB_CHUNK 64              /* ops_bwd_cuda.cu's kEmbChunk: serial rows per piece */
#define RMS_DX_REL 1e-5           /* fp32 row sum and ~5 roundings */
#define RMS_GUARD 64              /* 0xffff elements after dx_bf16 that must stay so */
#define COLSUM_REL 1e-5           /* row-group fp32 sums (RMSNorm dw, linear db) */
#define SWIGLU_F32_REL 1e-5       /* expf, divide, multiplies */
#define SWIGLU_ABS 1e-30          /* σ(g) underflow for g < -88.7 */
#define LINEAR_ACC_REL 1e-4       /* times Σ|products|: fp32 tensor-core accumulation */
#define ADAMW_MAX_ULP 0           /* same IEEE operations, same order */
#define NORM2_REL 1e-13           /* double accumulation of positive terms */

#define WS_ROWS 9000              /* the test workspace: embedding N ≤ 9000 ... */
#define WS_D 4096                 /* ... and D ≤ 4096 */

static cudaStream_t g_stream; /* every launch goes to this (non-default) stream */
static tkd_cuda_bwd_ws *g_ws;
static tkd_cuda_linear *g_lin;

/* ---- helpers ------------------------------------------------------------------------------------ */

static float *rand_f32(size_t n, uint64_t seed, float std)
{
    float *f = tkd_test_xmalloc(n * 4);
    tkd_test_randn(f, n, seed, std);
    return f;
}

static double *f32_to_f64(const float *f, size_t n)
{
    double *d = tkd_test_xmalloc(n * 8);
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    return d;
}

static double *zeros64(size_t n)
{
    double *d = tkd_test_xmalloc(n * 8);
    memset(d, 0, n * 8);
    return d;
}

/* Each output's rounding (bf16 2^-8·|ref|, fp32 2^-23·|ref|) on top of the op's bound per element
 * (abs_i, see the top). */
static const tkd_test_tol kEmbTol = {0.0, F32_OUT_REL, "fp32 2^-23, + (64 + chunks + 2)·u·Σ(|demb0| + Σ|dx|)"};
static const tkd_test_tol kRmsDxTol = {0.0, F32_OUT_REL, "fp32 2^-23, + 1e-5·(r·|g| + r³/D·|x|·Σ|g·x|)"};
static const tkd_test_tol kColsumTol = {0.0, F32_OUT_REL, "fp32 2^-23, + 1e-5·Σ|terms| (row-group fp32 sums)"};
static const tkd_test_tol kSwigluTol = {0.0, BF16_REL, "bf16 2^-8, + 1e-5 of the terms (expf, divide) + 1e-30"};
static const tkd_test_tol kLinDxTol = {0.0, BF16_REL, "bf16 2^-8, + (1e-4 + 2^-8)·Σ|products| (fp32 accumulation, "
                                                      "cuBLASLt's rounding before beta·C)"};
static const tkd_test_tol kLinDwTol = {0.0, F32_OUT_REL, "fp32 2^-23, + 1e-4·Σ|products| (fp32 accumulation)"};

/* Two runs from the same state must agree bit for bit. */
static void check_same_bits(const char *what, const void *a, const void *b, size_t bytes)
{
    if (memcmp(a, b, bytes) != 0) {
        size_t i = 0;
        while (((const unsigned char *)a)[i] == ((const unsigned char *)b)[i])
            i++;
        fail_msg("%s: a second run differs (first at byte %zu of %zu): not deterministic", what, i, bytes);
    }
}

static void scale_all(double *a, size_t n, double s)
{
    for (size_t i = 0; i < n; i++)
        a[i] *= s;
}

/* ---- embedding ---------------------------------------------------------------------------------- */

typedef enum { TOK_UNIFORM, TOK_SAME, TOK_DISTINCT, TOK_HEAVY, TOK_BLOCKS } tok_pattern;

/* Token ids in [0, V) for a pattern (blocks: tok[n] = (n + shift) / width). Returns V. */
static int make_tokens(int32_t *tok, int N, tok_pattern p, int width, int shift)
{
    uint64_t s = 0x9e3779b97f4a7c15ull ^ (uint64_t)N;
    int V = 50;
    for (int n = 0; n < N; n++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        switch (p) {
        case TOK_UNIFORM: tok[n] = (int32_t)(s % 50); break;         /* ~N/50 rows each */
        case TOK_SAME: tok[n] = 7, V = 8; break;                     /* one token spans every chunk */
        case TOK_DISTINCT: V = N + 13, tok[n] = (int32_t)(((int64_t)n * 7919) % V); break; /* all once */
        case TOK_HEAVY: V = 2000, tok[n] = s % 10 < 3 ? 3 : (int32_t)(s % 2000); break; /* 30% one id */
        case TOK_BLOCKS: tok[n] = (n + shift) / width, V = (N + shift) / width + 1; break;
        }
    }
    return V;
}

static void emb_bwd_case(int N, int D, tok_pattern p, int width, int shift, int off)
{
    char what[160];
    snprintf(what, sizeof what, "embedding_bwd N %d D %d pattern %d (%d, %d) offset %d", N, D, (int)p, width,
             shift, off);
    int32_t *tok = tkd_test_xmalloc((size_t)N * 4);
    const int V = make_tokens(tok, N, p, width, shift);
    const size_t nd = (size_t)N * D, vd = (size_t)V * D;
    float *dx = rand_f32(nd, 10 + D, 1.0f), *e0 = rand_f32(vd, 20 + D, 0.5f);
    double *ref = f32_to_f64(e0, vd), *abssum = tkd_test_xmalloc(vd * 8);
    int *count = calloc((size_t)V, sizeof(int)), *row = calloc((size_t)V, sizeof(int));
    assert_non_null(count);
    assert_non_null(row);
    for (size_t i = 0; i < vd; i++)
        abssum[i] = fabs(ref[i]);
    for (int n = 0; n < N; n++) {
        count[tok[n]]++;
        row[tok[n]] = n;
        for (int d = 0; d < D; d++) {
            ref[(size_t)tok[n] * D + d] += dx[(size_t)n * D + d];
            abssum[(size_t)tok[n] * D + d] += fabs(dx[(size_t)n * D + d]);
        }
    }
    const int chunks = (N + EMB_CHUNK - 1) / EMB_CHUNK;
    scale_all(abssum, vd, (EMB_CHUNK + chunks + 2) * U);

    int32_t *d_tok = tkd_test_dev_alloc((size_t)N * 4);
    float *d_dx = tkd_test_dev_alloc((nd + off) * 4), *d_e = tkd_test_dev_alloc((vd + off) * 4);
    tkd_test_to_dev(d_tok, tok, (size_t)N * 4);
    tkd_test_to_dev(d_dx + off, dx, nd * 4);
    float *got = tkd_test_xmalloc(vd * 4), *again = tkd_test_xmalloc(vd * 4);
    for (int run = 0; run < 2; run++) {
        tkd_test_to_dev(d_e + off, e0, vd * 4);
        tkd_test_ok(tkd_cuda_embedding_bwd(g_ws, d_tok, N, d_dx + off, D, d_e + off, g_stream), what);
        tkd_test_to_host(run ? again : got, d_e + off, vd * 4, g_stream);
    }
    tkd_test_check_f32_mat(what, got, ref, vd, (size_t)D, kEmbTol, abssum);
    check_same_bits(what, got, again, vd * 4);
    for (int v = 0; v < V; v++) /* untouched rows exact; single rows one IEEE add */
        for (int d = 0; d < D && count[v] <= 1; d++) {
            size_t i = (size_t)v * D + d;
            float want = count[v] ? e0[i] + dx[(size_t)row[v] * D + d] : e0[i];
            if (tkd_f32_bits(got[i]) != tkd_f32_bits(want))
                fail_msg("%s: token %d (seen %d times) column %d: got %.9g want %.9g exactly", what, v, count[v], d,
                         got[i], want);
        }
    cudaFree(d_tok), cudaFree(d_dx), cudaFree(d_e);
    free(tok), free(dx), free(e0), free(ref), free(abssum), free(count), free(row), free(got), free(again);
}

static void test_embedding_bwd(void **state)
{
    (void)state;
    const int ns[] = {1, 17, 1000, 5000}, ds[] = {64, 896, 1001};
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
        for (size_t j = 0; j < sizeof ds / sizeof *ds; j++)
            emb_bwd_case(ns[i], ds[j], TOK_UNIFORM, 0, 0, 0);
    emb_bwd_case(1000, 64, TOK_SAME, 0, 0, 0);   /* one token through 16 chunks */
    emb_bwd_case(9000, 7, TOK_SAME, 0, 0, 0);    /* ... through 141, scalar path */
    emb_bwd_case(1000, 896, TOK_DISTINCT, 0, 0, 0);
    emb_bwd_case(5000, 896, TOK_HEAVY, 0, 0, 0);
    emb_bwd_case(1000, 64, TOK_BLOCKS, 64, 0, 0);  /* each token exactly one chunk */
    emb_bwd_case(1000, 64, TOK_BLOCKS, 128, 0, 0); /* each token exactly two chunks */
    emb_bwd_case(1000, 64, TOK_BLOCKS, 64, 32, 0); /* every token crosses a boundary */
    emb_bwd_case(1000, 64, TOK_BLOCKS, 1, 0, 0);   /* all distinct, in order */
    emb_bwd_case(1000, 4096, TOK_BLOCKS, 200, 17, 0);
    emb_bwd_case(1000, 896, TOK_UNIFORM, 0, 0, 1); /* 4 bytes off alignment: scalar path */
    int32_t *d = tkd_test_dev_alloc(64);
    float *f = tkd_test_dev_alloc(64);
    assert_int_equal(tkd_cuda_embedding_bwd(g_ws, d, WS_ROWS + 1, f, 8, f, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_embedding_bwd(g_ws, d, 1, f, 0, f, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_embedding_bwd(NULL, d, 1, f, 8, f, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_embedding_bwd(g_ws, NULL, 0, NULL, 8, NULL, g_stream), TKD_OK); /* no rows */
    cudaFree(d), cudaFree(f);
}

/* ---- RMSNorm ------------------------------------------------------------------------------------ */

/* x (N, D) fp32: normal rows scaled by 10^(n % 5 − 2), row 3 all zeros; rstd as the forward gives it
 * (fp32 of the double value), which both sides then use. */
static void rms_inputs(int N, int D, float **x, float **rstd)
{
    *x = rand_f32((size_t)N * D, 100 + D, 1.0f);
    *rstd = tkd_test_xmalloc((size_t)N * 4);
    for (int n = 0; n < N; n++) {
        double ss = 0.0;
        for (int d = 0; d < D; d++) {
            float *v = &(*x)[(size_t)n * D + d];
            *v *= n == 3 ? 0.0f : powf(10.0f, (float)(n % 5 - 2));
            ss += (double)*v * *v;
        }
        (*rstd)[n] = (float)(1.0 / sqrt(ss / D + 1e-6));
    }
}

/* Per-element bounds for dx and dw (see the top), from g = dy·w. */
static void rms_bounds(const double *dy, const double *x, const double *w, const float *rstd, int N, int D,
                       double *dx_abs, double *dw_abs)
{
    memset(dw_abs, 0, (size_t)D * 8);
    for (int n = 0; n < N; n++) {
        const double r = rstd[n], *dr = dy + (size_t)n * D, *xr = x + (size_t)n * D;
        double gx = 0.0;
        for (int d = 0; d < D; d++)
            gx += fabs(dr[d] * w[d] * xr[d]);
        for (int d = 0; d < D; d++) {
            dx_abs[(size_t)n * D + d] = RMS_DX_REL * (r * fabs(dr[d] * w[d]) + r * r * r / D * fabs(xr[d]) * gx);
            dw_abs[d] += fabs(dr[d] * xr[d] * r);
        }
    }
    scale_all(dw_abs, (size_t)D, COLSUM_REL);
}

/* dx_bf16 modes of rms_bwd_case: none, a buffer of its own, written over dy (as model_fwd_bwd.c does). */
enum { RMS_ACT_NONE, RMS_ACT_OWN, RMS_ACT_IN_DY };

/* Fails unless act holds dx rounded by tkd_f32_to_bf16 (what tkd_cuda_f32_to_bf16 would write after
 * the call: the fused rounding must give the same bits) and the GUARD elements after it are still
 * 0xffff. */
static void check_dx_bf16(const char *what, const uint16_t *act, const float *dx, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (act[i] != tkd_f32_to_bf16(dx[i]))
            fail_msg("%s: dx_bf16 row %zu: 0x%04x, dx %.9g rounds to 0x%04x", what, i, act[i], (double)dx[i],
                     tkd_f32_to_bf16(dx[i]));
    for (size_t i = n; i < n + RMS_GUARD; i++)
        if (act[i] != 0xffff)
            fail_msg("%s: dx_bf16 written past its end (element n + %zu = 0x%04x)", what, i - n, act[i]);
}

static void rms_bwd_case(int N, int D, int want_dx, int want_dw, int off, int act)
{
    char what[160];
    snprintf(what, sizeof what, "rmsnorm_bwd N %d D %d%s%s offset %d%s", N, D, want_dx ? " dx" : "",
             want_dw ? " dw" : "", off, act == RMS_ACT_OWN ? " dx_bf16" : act == RMS_ACT_IN_DY ? " dx_bf16 in dy" : "");
    const size_t nd = (size_t)N * D;
    float *x, *rstd, *dx0 = rand_f32(nd, 300 + D, 1.0f), *dw0 = rand_f32((size_t)D, 400 + D, 1.0f);
    rms_inputs(N, D, &x, &rstd);
    uint16_t *dy = tkd_test_rand_bf16(nd, 500 + D, 1.0f), *w = tkd_test_rand_bf16((size_t)D, 600 + D, 0.5f);
    for (int d = 0; d < D; d++) /* w around 1, as trained norms are */
        w[d] = tkd_f32_to_bf16(1.0f + tkd_bf16_to_f32(w[d]));
    double *dyd = tkd_test_bf16_to_f64(dy, nd), *xd = f32_to_f64(x, nd),
           *wd = tkd_test_bf16_to_f64(w, (size_t)D);
    double *rd = f32_to_f64(rstd, (size_t)N), *dxr = f32_to_f64(dx0, nd), *dwr = f32_to_f64(dw0, (size_t)D);
    double *dx_abs = tkd_test_xmalloc(nd * 8), *dw_abs = tkd_test_xmalloc((size_t)D * 8);
    tkd_ref_rmsnorm_bwd(dyd, xd, wd, rd, N, D, dxr, dwr);
    rms_bounds(dyd, xd, wd, rstd, N, D, dx_abs, dw_abs);

    uint16_t *d_dy = tkd_test_dev_alloc((nd + off + RMS_GUARD) * 2), *d_w = tkd_test_dev_alloc((size_t)(D + off) * 2);
    uint16_t *d_act = act == RMS_ACT_OWN ? tkd_test_dev_alloc((nd + off + RMS_GUARD) * 2) : NULL;
    uint16_t *act_p = act == RMS_ACT_OWN ? d_act + off : act == RMS_ACT_IN_DY ? d_dy + off : NULL;
    uint16_t *gact = tkd_test_xmalloc((nd + RMS_GUARD) * 2);
    float *d_x = tkd_test_dev_alloc((nd + off) * 4), *d_r = tkd_test_dev_alloc((size_t)N * 4);
    float *d_dx = tkd_test_dev_alloc((nd + off) * 4), *d_dw = tkd_test_dev_alloc((size_t)(D + off) * 4);
    tkd_test_to_dev(d_w + off, w, (size_t)D * 2);
    tkd_test_to_dev(d_x + off, x, nd * 4);
    tkd_test_to_dev(d_r, rstd, (size_t)N * 4);
    float *gdx[2] = {tkd_test_xmalloc(nd * 4), tkd_test_xmalloc(nd * 4)},
          *gdw[2] = {tkd_test_xmalloc((size_t)D * 4), tkd_test_xmalloc((size_t)D * 4)};
    for (int run = 0; run < 2; run++) {
        tkd_test_poison(d_dy + off + nd, RMS_GUARD * 2); /* dy is overwritten in place: upload it per run */
        tkd_test_to_dev(d_dy + off, dy, nd * 2);
        if (d_act)
            tkd_test_poison(d_act, (nd + off + RMS_GUARD) * 2);
        tkd_test_to_dev(d_dx + off, dx0, nd * 4);
        tkd_test_to_dev(d_dw + off, dw0, (size_t)D * 4);
        tkd_test_ok(tkd_cuda_rmsnorm_bwd(g_ws, d_dy + off, d_x + off, d_w + off, d_r, N, D,
                                         want_dx ? d_dx + off : NULL, act_p, want_dw ? d_dw + off : NULL,
                                         g_stream),
                    what);
        tkd_test_to_host(gdx[run], d_dx + off, nd * 4, g_stream);
        tkd_test_to_host(gdw[run], d_dw + off, (size_t)D * 4, g_stream);
        if (act_p) {
            tkd_test_to_host(gact, act_p, (nd + RMS_GUARD) * 2, g_stream);
            check_dx_bf16(what, gact, gdx[run], nd);
        }
    }
    char w2[200];
    snprintf(w2, sizeof w2, "%s: dx", what);
    if (want_dx)
        tkd_test_check_f32_mat(w2, gdx[0], dxr, nd, (size_t)D, kRmsDxTol, dx_abs);
    else
        check_same_bits(w2, gdx[0], dx0, nd * 4); /* NULL: untouched */
    check_same_bits(w2, gdx[0], gdx[1], nd * 4);
    snprintf(w2, sizeof w2, "%s: dw", what);
    if (want_dw)
        tkd_test_check_f32_mat(w2, gdw[0], dwr, (size_t)D, (size_t)D, kColsumTol, dw_abs);
    else
        check_same_bits(w2, gdw[0], dw0, (size_t)D * 4);
    check_same_bits(w2, gdw[0], gdw[1], (size_t)D * 4);
    cudaFree(d_dy), cudaFree(d_w), cudaFree(d_x), cudaFree(d_r), cudaFree(d_dx), cudaFree(d_dw), cudaFree(d_act);
    free(gact), free(x), free(rstd), free(dx0), free(dw0), free(dy), free(w), free(dyd), free(xd), free(wd), free(rd);
    free(dxr), free(dwr), free(dx_abs), free(dw_abs), free(gdx[0]), free(gdx[1]), free(gdw[0]), free(gdw[1]);
}

static void test_rmsnorm_bwd(void **state)
{
    (void)state;
    /* 64..4096: one chunk per thread; 1001, 7: scalar path (D % 8 != 0) */
    const int ns[] = {1, 17, 1000}, ds[] = {64, 896, 1001, 7, 4096};
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
        for (size_t j = 0; j < sizeof ds / sizeof *ds; j++) {
            rms_bwd_case(ns[i], ds[j], 1, 1, 0, RMS_ACT_NONE);
            rms_bwd_case(ns[i], ds[j], 1, 1, 0, RMS_ACT_IN_DY); /* model_fwd_bwd.c's call */
        }
    /* 2 and 4 chunks per thread (8192, 12000, 16384), scalar with 2 and 4 (5003, 16383) */
    const int big[] = {8192, 12000, 16384, 5003, 16383};
    for (size_t j = 0; j < sizeof big / sizeof *big; j++)
        rms_bwd_case(17, big[j], 1, 1, 0, j % 2 ? RMS_ACT_OWN : RMS_ACT_IN_DY);
    rms_bwd_case(9000, 64, 1, 1, 0, RMS_ACT_IN_DY); /* 18 rows per group */
    rms_bwd_case(1000, 896, 1, 0, 0, RMS_ACT_OWN);
    rms_bwd_case(1000, 896, 0, 1, 0, RMS_ACT_NONE);
    rms_bwd_case(17, 896, 1, 1, 1, RMS_ACT_NONE); /* off alignment: scalar path */
    rms_bwd_case(17, 896, 1, 1, 1, RMS_ACT_IN_DY);
    rms_bwd_case(17, 896, 1, 1, 1, RMS_ACT_OWN);
    float *f = tkd_test_dev_alloc(64);
    uint16_t *h = tkd_test_dev_alloc(64);
    assert_int_equal(tkd_cuda_rmsnorm_bwd(g_ws, h, f, h, f, 1, 16385, f, NULL, f, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_rmsnorm_bwd(g_ws, h, f, h, f, 1, 0, f, NULL, f, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_rmsnorm_bwd(NULL, h, f, h, f, 1, 8, f, NULL, f, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_rmsnorm_bwd(g_ws, h, f, h, f, 1, 8, NULL, h, f, g_stream),
                     TKD_ERR_INVALID_ARG); /* dx_bf16 without dx */
    assert_int_equal(tkd_cuda_rmsnorm_bwd(g_ws, h, f, h, f, 0, 8, f, NULL, f, g_stream), TKD_OK); /* no rows */
    cudaFree(f), cudaFree(h);
}

/* ---- RoPE --------------------------------------------------------------------------------------- */

/* The shapes and the check: tests/gpu_testutil.h (tkd_test_rope_cases); dq and dk of seeds 700 + dh,
 * 800 + dh. */
static void test_rope_bwd(void **state)
{
    (void)state;
    tkd_test_rope_cases(1, 700, g_stream);
}

/* ---- SwiGLU ------------------------------------------------------------------------------------- */

/* acc = 0: dg and du are overwritten; they start as NaN, which must not reach the result. */
static void swiglu_bwd_case(int64_t n, int off, int want_dg, int want_du, int acc)
{
    char what[128];
    snprintf(what, sizeof what, "swiglu_bwd n %lld offset %d%s%s%s", (long long)n, off, want_dg ? " dg" : "",
             want_du ? " du" : "", acc ? "" : " (overwrite)");
    const size_t nn = (size_t)n;
    uint16_t *dh = tkd_test_rand_bf16(nn, 900, 1.0f), *g = tkd_test_rand_bf16(nn, 1000 + nn, 4.0f),
             *u = tkd_test_rand_bf16(nn, 1100, 1.0f);
    uint16_t *dg0 = tkd_test_rand_bf16(nn, 1200, 0.3f), *du0 = tkd_test_rand_bf16(nn, 1300, 0.3f);
    for (size_t i = 0; i < nn && !acc; i++)
        dg0[i] = du0[i] = 0x7fc0; /* NaN */
    const float special[] = {0.0f, -0.0f, 30.0f, -30.0f, -87.0f, -100.0f, 100.0f, 1e-30f, -1.278f};
    for (size_t j = 0; j < sizeof special / sizeof *special && j * 97 < nn; j++)
        g[j * 97] = tkd_f32_to_bf16(special[j]);
    double *dgr = acc ? tkd_test_bf16_to_f64(dg0, nn) : zeros64(nn),
           *dur = acc ? tkd_test_bf16_to_f64(du0, nn) : zeros64(nn),
           *dga = tkd_test_xmalloc(nn * 8), *dua = tkd_test_xmalloc(nn * 8);
    for (size_t i = 0; i < nn; i++) {
        double d = tkd_bf16_to_f32(dh[i]), gv = tkd_bf16_to_f32(g[i]), uv = tkd_bf16_to_f32(u[i]);
        double s = 1.0 / (1.0 + exp(-gv));
        dgr[i] += d * uv * s * (1.0 + gv * (1.0 - s));
        dur[i] += d * gv * s;
        dga[i] = SWIGLU_F32_REL * fabs(d * uv * s) * (1.0 + fabs(gv)) + SWIGLU_ABS;
        dua[i] = SWIGLU_F32_REL * fabs(d * gv * s) + SWIGLU_ABS;
    }
    uint16_t *d_dh = tkd_test_dev_alloc((nn + off) * 2), *d_g = tkd_test_dev_alloc((nn + off) * 2),
             *d_u = tkd_test_dev_alloc((nn + off) * 2);
    uint16_t *d_dg = tkd_test_dev_alloc((nn + off) * 2), *d_du = tkd_test_dev_alloc((nn + off) * 2);
    tkd_test_to_dev(d_dh + off, dh, nn * 2);
    tkd_test_to_dev(d_g + off, g, nn * 2);
    tkd_test_to_dev(d_u + off, u, nn * 2);
    tkd_test_to_dev(d_dg + off, dg0, nn * 2);
    tkd_test_to_dev(d_du + off, du0, nn * 2);
    tkd_test_ok(tkd_cuda_swiglu_bwd(d_dh + off, d_g + off, d_u + off, n, want_dg ? d_dg + off : NULL,
                                    want_du ? d_du + off : NULL, acc, g_stream),
                what);
    uint16_t *got = tkd_test_xmalloc(nn * 2);
    char w2[160];
    snprintf(w2, sizeof w2, "%s: dg", what);
    tkd_test_to_host(got, d_dg + off, nn * 2, g_stream);
    if (want_dg)
        tkd_test_check_bf16_mat(w2, got, dgr, nn, nn, kSwigluTol, dga);
    else
        check_same_bits(w2, got, dg0, nn * 2);
    snprintf(w2, sizeof w2, "%s: du", what);
    tkd_test_to_host(got, d_du + off, nn * 2, g_stream);
    if (want_du)
        tkd_test_check_bf16_mat(w2, got, dur, nn, nn, kSwigluTol, dua);
    else
        check_same_bits(w2, got, du0, nn * 2);
    cudaFree(d_dh), cudaFree(d_g), cudaFree(d_u), cudaFree(d_dg), cudaFree(d_du);
    free(dh), free(g), free(u), free(dg0), free(du0), free(dgr), free(dur), free(dga), free(dua), free(got);
}

static void test_swiglu_bwd(void **state)
{
    (void)state;
    const int64_t ns[] = {1, 7, 8, 1000, 1003, (1 << 20) + 5, 17 * 4864};
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
        for (int acc = 0; acc < 2; acc++)
            swiglu_bwd_case(ns[i], 0, 1, 1, acc);
    swiglu_bwd_case(1003, 1, 1, 1, 1); /* scalar path */
    swiglu_bwd_case(1003, 1, 1, 1, 0);
    swiglu_bwd_case(1003, 0, 1, 0, 1);
    swiglu_bwd_case(1003, 0, 0, 1, 0);
    assert_int_equal(tkd_cuda_swiglu_bwd(NULL, NULL, NULL, -1, NULL, NULL, 1, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_swiglu_bwd(NULL, NULL, NULL, 0, NULL, NULL, 1, g_stream), TKD_OK);
}

/* ---- linear ------------------------------------------------------------------------------------- */

typedef struct lin_case {
    int n, k, m;
    int dx, dw, db; /* which gradients to ask for */
    int off;        /* elements x, w, dy, dx, dw, db sit past a 256-byte boundary */
    int ov;         /* dx overwritten (dx_acc 0): it starts as NaN, which must not reach the result */
} lin_case;

typedef struct lin_data {
    uint16_t *dy, *x, *w, *dx0;
    float *dw0, *db0;
    double *dxr, *dwr, *dbr; /* references */
    double *dxa, *dwa, *dba; /* per-element bounds */
} lin_data;

static void lin_data_make(lin_case c, lin_data *L)
{
    const size_t ny = (size_t)c.n * c.m, nx = (size_t)c.n * c.k, nw = (size_t)c.m * c.k;
    L->dy = tkd_test_rand_bf16(ny, 1400 + c.m, 1.0f), L->x = tkd_test_rand_bf16(nx, 1500 + c.k, 1.0f);
    L->w = tkd_test_rand_bf16(nw, 1600 + c.m, 1.0f / sqrtf((float)c.k)),
    L->dx0 = tkd_test_rand_bf16(nx, 1700, 0.5f);
    for (size_t i = 0; i < nx && c.ov; i++)
        L->dx0[i] = 0x7fc0; /* NaN */
    L->dw0 = rand_f32(nw, 1800, 0.5f), L->db0 = rand_f32((size_t)c.m, 1900, 0.5f);
    double *dyd = tkd_test_bf16_to_f64(L->dy, ny), *xd = tkd_test_bf16_to_f64(L->x, nx),
           *wd = tkd_test_bf16_to_f64(L->w, nw);
    L->dxr = c.ov ? zeros64(nx) : tkd_test_bf16_to_f64(L->dx0, nx), L->dwr = f32_to_f64(L->dw0, nw),
    L->dbr = f32_to_f64(L->db0, (size_t)c.m);
    tkd_ref_linear_bwd(dyd, xd, wd, c.n, c.k, c.m, L->dxr, L->dwr, L->dbr);
    for (size_t i = 0; i < ny; i++)
        dyd[i] = fabs(dyd[i]);
    for (size_t i = 0; i < nx; i++)
        xd[i] = fabs(xd[i]);
    for (size_t i = 0; i < nw; i++)
        wd[i] = fabs(wd[i]);
    L->dxa = zeros64(nx), L->dwa = zeros64(nw), L->dba = zeros64((size_t)c.m);
    tkd_ref_linear_bwd(dyd, xd, wd, c.n, c.k, c.m, L->dxa, L->dwa, L->dba); /* Σ|products| */
    /* cuBLASLt may round dy·W to bf16 before the beta·C add (see the top): measured on an H200 for
     * odd leading dimensions and for N = 1 at K = M = 64, so one more rounding is allowed for every
     * shape (which kernel runs is cuBLASLt's choice per shape). */
    scale_all(L->dxa, nx, LINEAR_ACC_REL + BF16_REL);
    scale_all(L->dwa, nw, LINEAR_ACC_REL);
    scale_all(L->dba, (size_t)c.m, COLSUM_REL);
    free(dyd), free(xd), free(wd);
}

static void lin_data_free(lin_data *L)
{
    free(L->dy), free(L->x), free(L->w), free(L->dx0), free(L->dw0), free(L->db0);
    free(L->dxr), free(L->dwr), free(L->dbr), free(L->dxa), free(L->dwa), free(L->dba);
}

/* One backward, twice from the same state; checks values, determinism and that gradients not asked
 * for stay untouched. Pointers off 16-byte alignment may be refused (TKD_ERR_INVALID_ARG: no
 * cuBLASLt algorithm); then the refusal is printed. */
static void linear_bwd_case(lin_case c)
{
    char what[160];
    snprintf(what, sizeof what, "linear_bwd N %d K %d M %d%s%s%s offset %d%s", c.n, c.k, c.m, c.dx ? " dx" : "",
             c.dw ? " dw" : "", c.db ? " db" : "", c.off, c.ov ? " (dx overwritten)" : "");
    lin_data L;
    lin_data_make(c, &L);
    const size_t ny = (size_t)c.n * c.m, nx = (size_t)c.n * c.k, nw = (size_t)c.m * c.k, o = (size_t)c.off;
    uint16_t *d_dy = tkd_test_dev_alloc((ny + o) * 2), *d_x = tkd_test_dev_alloc((nx + o) * 2),
             *d_w = tkd_test_dev_alloc((nw + o) * 2);
    uint16_t *d_dx = tkd_test_dev_alloc((nx + o) * 2);
    float *d_dw = tkd_test_dev_alloc((nw + o) * 4), *d_db = tkd_test_dev_alloc((c.m + o) * 4);
    tkd_test_to_dev(d_dy + o, L.dy, ny * 2);
    tkd_test_to_dev(d_x + o, L.x, nx * 2);
    tkd_test_to_dev(d_w + o, L.w, nw * 2);
    uint16_t *gdx[2] = {tkd_test_xmalloc(nx * 2), tkd_test_xmalloc(nx * 2)};
    float *gdw[2] = {tkd_test_xmalloc(nw * 4), tkd_test_xmalloc(nw * 4)},
          *gdb[2] = {tkd_test_xmalloc(c.m * 4), tkd_test_xmalloc(c.m * 4)};
    for (int run = 0; run < 2; run++) {
        tkd_test_to_dev(d_dx + o, L.dx0, nx * 2);
        tkd_test_to_dev(d_dw + o, L.dw0, nw * 4);
        tkd_test_to_dev(d_db + o, L.db0, (size_t)c.m * 4);
        tkd_status st = tkd_cuda_linear_bwd(g_lin, g_ws, d_dy + o, d_x + o, d_w + o, c.n, c.k, c.m,
                                            c.dx ? d_dx + o : NULL, c.dw ? d_dw + o : NULL, c.db ? d_db + o : NULL,
                                            !c.ov, g_stream);
        if (st == TKD_ERR_INVALID_ARG && c.off % 8) {
            tkd_test_assert_msg_has("cuBLASLt has no");
            print_message("note: %s refused: %s\n", what, tkd_error_msg());
            goto out;
        }
        tkd_test_ok(st, what);
        tkd_test_to_host(gdx[run], d_dx + o, nx * 2, g_stream);
        tkd_test_to_host(gdw[run], d_dw + o, nw * 4, g_stream);
        tkd_test_to_host(gdb[run], d_db + o, (size_t)c.m * 4, g_stream);
    }
    char w2[200];
    snprintf(w2, sizeof w2, "%s: dx", what);
    if (c.dx)
        tkd_test_check_bf16_mat(w2, gdx[0], L.dxr, nx, (size_t)c.k, kLinDxTol, L.dxa);
    else
        check_same_bits(w2, gdx[0], L.dx0, nx * 2);
    check_same_bits(w2, gdx[0], gdx[1], nx * 2);
    snprintf(w2, sizeof w2, "%s: dw", what);
    if (c.dw)
        tkd_test_check_f32_mat(w2, gdw[0], L.dwr, nw, (size_t)c.k, kLinDwTol, L.dwa);
    else
        check_same_bits(w2, gdw[0], L.dw0, nw * 4);
    check_same_bits(w2, gdw[0], gdw[1], nw * 4);
    snprintf(w2, sizeof w2, "%s: db", what);
    if (c.db)
        tkd_test_check_f32_mat(w2, gdb[0], L.dbr, (size_t)c.m, (size_t)c.m, kColsumTol, L.dba);
    else
        check_same_bits(w2, gdb[0], L.db0, (size_t)c.m * 4);
    check_same_bits(w2, gdb[0], gdb[1], (size_t)c.m * 4);
out:
    cudaFree(d_dy), cudaFree(d_x), cudaFree(d_w), cudaFree(d_dx), cudaFree(d_dw), cudaFree(d_db);
    free(gdx[0]), free(gdx[1]), free(gdw[0]), free(gdw[1]), free(gdb[0]), free(gdb[1]);
    lin_data_free(&L);
}

static void test_linear_bwd(void **state)
{
    (void)state;
    const lin_case cases[] = {
        {1, 64, 64, 1, 1, 0, 0, 0},        {1, 896, 1000, 1, 1, 1, 0, 0},   {17, 896, 128, 1, 1, 1, 0, 0},
        {17, 1001, 77, 1, 1, 1, 0, 0},     /* K and M odd */             {1000, 896, 136, 1, 1, 1, 0, 0},
        {1000, 64, 4096, 1, 1, 0, 0, 0},   {33, 4096, 512, 1, 1, 0, 0, 0},  {7, 13, 5, 1, 1, 1, 0, 0},
        {257, 1000, 1003, 1, 1, 1, 0, 0},  {1000, 1001, 77, 1, 1, 1, 0, 0}, {1000, 896, 128, 1, 0, 0, 0, 0},
        {1000, 896, 128, 0, 1, 0, 0, 0},   {1000, 896, 128, 0, 0, 1, 0, 0}, {17, 896, 128, 1, 1, 1, 8, 0},
        {17, 896, 128, 1, 1, 1, 1, 0},     {17, 1001, 77, 1, 1, 1, 3, 0}, /* 2 or 6 bytes off alignment */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        linear_bwd_case(cases[i]);
        lin_case ov = cases[i];
        ov.ov = 1;
        linear_bwd_case(ov);
    }
    /* More shapes than the plan cache holds (32), then a cached one again (checked twice inside). */
    for (int m = 8; m < 8 + 40; m++)
        linear_bwd_case((lin_case){3, 24, m, 1, 1, m & 1, 0, m % 3 == 0});
    linear_bwd_case(cases[2]);

    uint16_t *d = tkd_test_dev_alloc(4096);
    float *f = tkd_test_dev_alloc(4096);
    assert_int_equal(tkd_cuda_linear_bwd(g_lin, g_ws, d, d, d, 0, 8, 8, d, f, f, 1, g_stream), TKD_OK); /* no rows */
    assert_int_equal(tkd_cuda_linear_bwd(g_lin, g_ws, d, d, d, 1, 0, 8, d, f, f, 1, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_linear_bwd(NULL, g_ws, d, d, d, 1, 8, 8, d, f, f, 1, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_linear_bwd(g_lin, NULL, d, d, d, 1, 8, 8, d, f, f, 1, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_linear_bwd(g_lin, g_ws, d, NULL, d, 1, 8, 8, d, f, f, 1, g_stream), TKD_ERR_INVALID_ARG);
    const uint16_t *odd = (const uint16_t *)((const char *)d + 1); /* not a bf16 address */
    assert_int_equal(tkd_cuda_linear_bwd(g_lin, g_ws, odd, d, d, 1, 8, 8, d + 64, f, f, 1, g_stream),
                     TKD_ERR_INVALID_ARG);
    cudaFree(d), cudaFree(f);
}

/* ---- AdamW -------------------------------------------------------------------------------------- */

/* Distance in units in the last place (0 when the bits agree; NaN patterns compared as integers). */
static uint32_t ulps(float a, float b)
{
    int64_t ia = (int32_t)tkd_f32_bits(a), ib = (int32_t)tkd_f32_bits(b);
    ia = ia < 0 ? (int64_t)INT32_MIN - ia : ia;
    ib = ib < 0 ? (int64_t)INT32_MIN - ib : ib;
    int64_t d = ia > ib ? ia - ib : ib - ia;
    return d > UINT32_MAX ? UINT32_MAX : (uint32_t)d;
}

static void check_ulps(const char *what, int step, const float *got, const float *want, size_t n)
{
    size_t bad = 0, worst = 0;
    uint32_t wu = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u = ulps(got[i], want[i]);
        bad += u > ADAMW_MAX_ULP;
        if (u > wu)
            wu = u, worst = i;
    }
    if (bad)
        fail_msg("adamw step %d: %s: %zu of %zu elements beyond %d ulp; worst [%zu]: got %.9g (0x%08x) host %.9g "
                 "(0x%08x), %u ulp", step, what, bad, n, ADAMW_MAX_ULP, worst, got[worst], tkd_f32_bits(got[worst]),
                 want[worst], tkd_f32_bits(want[worst]), wu);
}

/* Segments with decay and without, offsets not multiples of 4, one over two table chunks, and gaps
 * (elements no segment covers: they must stay untouched). */
static const tkd_cuda_param_seg k_segs[] = {
    {0, 1001, 1}, {1001, 7, 0}, {1008, 2112, 1}, {3120, 3, 0}, /* gap [3123, 3128) */
    {3128, 70001, 1}, {73129, 896, 0}, {74025, 65544, 1},      /* gap [139569, 139574) */
};
#define ADAMW_N 139574

/* The master weights (n) from their device halves, joined on the host (common/half.h). */
static void master_from_dev(const uint16_t *d_hi, const int16_t *d_lo, size_t n, float *out, uint16_t *hi)
{
    int16_t *lo = tkd_test_xmalloc(n * 2);
    tkd_test_to_host(hi, d_hi, n * 2, g_stream);
    tkd_test_to_host(lo, d_lo, n * 2, g_stream);
    for (size_t i = 0; i < n; i++)
        out[i] = tkd_bf16_join_f32(hi[i], lo[i]);
    free(lo);
}

/* Moments the device kept as bf16 (n) against the host's, bit for bit. */
static void check_bf16_moments(const char *what, int step, const uint16_t *d, const uint16_t *want, size_t n)
{
    uint16_t *got = tkd_test_xmalloc(n * 2);
    tkd_test_to_host(got, d, n * 2, g_stream);
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i])
            fail_msg("adamw (bf16 moments) step %d: %s [%zu] = 0x%04x, host 0x%04x", step, what, i, got[i], want[i]);
    free(got);
}

/* 5 steps of the device AdamW against tkd_adamw_step from the same start, the master weights held
 * on the device as bf16 + int16 residual (split on the host here, joined on the host to compare),
 * steps 2 and 4 with a clip scale (the host scales a copy of g first, as tkd_optim_clip does);
 * off: elements every device array sits past 16-byte alignment (scalar path); bf16: the moments
 * kept as bf16 on both sides (optim.state_dtype bf16: tkd_cuda_adamw_step_bf16 against
 * kernels/cpu/adamw.c's tkd_adamw_update with bf16 moments), equal to the bit like everything else. Dropping or
 * misplacing the residual would leave the master at bf16 precision: the random start has low bits. */
static void adamw_run(int off, int bf16)
{
    const int ns = (int)(sizeof k_segs / sizeof *k_segs);
    const size_t n = ADAMW_N, o = (size_t)off;
    tkd_param_info info[sizeof k_segs / sizeof *k_segs];
    memset(info, 0, sizeof info);
    for (int i = 0; i < ns; i++)
        info[i].offset = k_segs[i].offset, info[i].numel = k_segs[i].numel, info[i].decay = k_segs[i].decay;
    tkd_optim_config cfg;
    tkd_optim_config_defaults(&cfg);
    cfg.state_dtype = bf16 ? TKD_ADAMW_DTYPE_BF16 : TKD_ADAMW_DTYPE_F32;
    const size_t msz = bf16 ? 2 : 4; /* bytes per moment value */
    tkd_adamw *cpu = NULL;
    tkd_test_ok(tkd_adamw_init(&cfg, n, &cpu), "adamw_init");
    tkd_cuda_adamw *gpu = NULL;
    tkd_test_ok(tkd_cuda_adamw_create(k_segs, ns, &gpu), "cuda_adamw_create");

    float *p = rand_f32(n, 2000, 0.05f), *p0 = tkd_test_xmalloc(n * 4);
    memcpy(p0, p, n * 4);
    uint16_t *hi = tkd_test_xmalloc(n * 2);
    int16_t *lo = tkd_test_xmalloc(n * 2);
    size_t with_lo = 0;
    for (size_t i = 0; i < n; i++) {
        hi[i] = tkd_f32_split_bf16(p[i], &lo[i]);
        with_lo += lo[i] != 0;
    }
    assert_true(with_lo > n / 2); /* the test means something only if the residuals carry bits */
    float *d_g = tkd_test_dev_alloc((n + o) * 4);
    char *d_m = tkd_test_dev_alloc((n + o) * msz), *d_v = tkd_test_dev_alloc((n + o) * msz);
    uint16_t *d_hi = tkd_test_dev_alloc((n + o) * 2);
    int16_t *d_lo = tkd_test_dev_alloc((n + o) * 2);
    tkd_test_to_dev(d_hi + o, hi, n * 2);
    tkd_test_to_dev(d_lo + o, lo, n * 2);
    assert_int_equal(cudaMemset(d_m, 0, (n + o) * msz), cudaSuccess);
    assert_int_equal(cudaMemset(d_v, 0, (n + o) * msz), cudaSuccess);
    float *gp = tkd_test_xmalloc(n * 4), *gm = tkd_test_xmalloc(n * 4), *gv = tkd_test_xmalloc(n * 4);
    for (int s = 0; s < 5; s++) {
        float *g = rand_f32(n, 2100 + s, s == 2 ? 1e3f : 0.01f); /* step 3: large gradients */
        for (size_t i = 0; i < n; i += 101)
            g[i] = i % 2 ? 0.0f : 1e-20f; /* zeros; tiny ones whose squares are subnormal */
        const double lr = 1e-3 * (s + 1) / 5.0;
        const float scale = s % 2 ? 0.3f + 0.1f * s : 1.0f;
        tkd_test_to_dev(d_g + o, g, n * 4);
        tkd_optim_scale(g, n, scale);
        tkd_adamw_step(cpu, p, g, info, ns, lr);
        void *dm = d_m + o * msz, *dv = d_v + o * msz;
        if (bf16)
            tkd_test_ok(tkd_cuda_adamw_step_bf16(gpu, d_hi + o, d_lo + o, d_g + o, dm, dv, lr, cfg.beta1, cfg.beta2,
                                                 cfg.eps, cfg.weight_decay, s + 1, scale, g_stream),
                        "adamw_step_bf16");
        else
            tkd_test_ok(tkd_cuda_adamw_step(gpu, d_hi + o, d_lo + o, d_g + o, dm, dv, lr, cfg.beta1, cfg.beta2,
                                            cfg.eps, cfg.weight_decay, s + 1, scale, g_stream),
                        "adamw_step");
        master_from_dev(d_hi + o, d_lo + o, n, gp, hi);
        check_ulps("master weights", s + 1, gp, p, n);
        if (bf16) {
            check_bf16_moments("m", s + 1, dm, cpu->m_bf16, n);
            check_bf16_moments("v", s + 1, dv, cpu->v_bf16, n);
        } else {
            tkd_test_to_host(gm, dm, n * 4, g_stream);
            tkd_test_to_host(gv, dv, n * 4, g_stream);
            check_ulps("m", s + 1, gm, cpu->m, n);
            check_ulps("v", s + 1, gv, cpu->v, n);
        }
        for (size_t i = 0; i < n; i++) {
            const int gap = (i >= 3123 && i < 3128) || i >= 139569;
            int16_t r;
            const uint16_t want = tkd_f32_split_bf16(p[i], &r);
            if (hi[i] != want)
                fail_msg("adamw step %d: bf16 copy [%zu] = 0x%04x, want 0x%04x, the high half of %.9g", s + 1, i,
                         hi[i], want, p[i]);
            if (gap && tkd_f32_bits(gp[i]) != tkd_f32_bits(p0[i]))
                fail_msg("adamw step %d: [%zu] outside every segment changed", s + 1, i);
        }
        free(g);
    }
    cudaFree(d_hi), cudaFree(d_lo), cudaFree(d_g), cudaFree(d_m), cudaFree(d_v);
    free(p), free(p0), free(gp), free(gm), free(gv), free(hi), free(lo);
    tkd_adamw_free(cpu);
    tkd_cuda_adamw_free(gpu);
}

/* The split and join launchers (loading and saving the master weights): exact both ways. */
static void test_master_split_join(void **state)
{
    (void)state;
    const size_t n = 70001;
    float *x = rand_f32(n, 2200, 1.0f), *back = tkd_test_xmalloc(n * 4);
    const uint32_t edges[] = {0x80000000u, 0x3f7f8000u, 0x7f7fffffu, 0xff7fffffu, 0x00000001u, 0x7f800000u};
    for (size_t i = 0; i < sizeof edges / sizeof *edges; i++)
        x[i * 997] = tkd_bits_f32(edges[i]);
    float *d_x = tkd_test_dev_alloc(n * 4), *d_y = tkd_test_dev_alloc((n + 1) * 4);
    uint16_t *d_hi = tkd_test_dev_alloc((n + 1) * 2), *hi = tkd_test_xmalloc(n * 2);
    int16_t *d_lo = tkd_test_dev_alloc((n + 1) * 2);
    tkd_test_to_dev(d_x, x, n * 4);
    for (int off = 0; off < 2; off++) { /* off 1: the scalar path */
        tkd_test_ok(tkd_cuda_master_split(d_x, d_hi + off, d_lo + off, n, g_stream), "master_split");
        master_from_dev(d_hi + off, d_lo + off, n, back, hi);
        for (size_t i = 0; i < n; i++) {
            int16_t r;
            if (tkd_f32_bits(back[i]) != tkd_f32_bits(x[i]) || hi[i] != tkd_f32_split_bf16(x[i], &r))
                fail_msg("master_split (offset %d) [%zu]: 0x%08x gave hi 0x%04x, joined 0x%08x", off, i,
                         tkd_f32_bits(x[i]), hi[i], tkd_f32_bits(back[i]));
        }
        tkd_test_ok(tkd_cuda_master_join(d_hi + off, d_lo + off, d_y + off, n, g_stream), "master_join");
        tkd_test_to_host(back, d_y + off, n * 4, g_stream);
        for (size_t i = 0; i < n; i++)
            if (tkd_f32_bits(back[i]) != tkd_f32_bits(x[i]))
                fail_msg("master_join (offset %d) [%zu]: 0x%08x, want 0x%08x", off, i, tkd_f32_bits(back[i]),
                         tkd_f32_bits(x[i]));
    }
    cudaFree(d_x), cudaFree(d_y), cudaFree(d_hi), cudaFree(d_lo);
    free(x), free(back), free(hi);
}

static void test_adamw(void **state)
{
    (void)state;
    adamw_run(0, 0);
    adamw_run(1, 0); /* scalar path */
    adamw_run(0, 1); /* bf16 moments, 4-wide */
    adamw_run(1, 1); /* bf16 moments, scalar path */
    tkd_cuda_adamw *a = NULL;
    const tkd_cuda_param_seg overlap[] = {{0, 10, 1}, {9, 5, 0}};
    assert_int_equal(tkd_cuda_adamw_create(overlap, 2, &a), TKD_ERR_INVALID_ARG);
    assert_null(a);
    tkd_test_ok(tkd_cuda_adamw_create(NULL, 0, &a), "adamw_create empty");
    assert_int_equal(tkd_cuda_adamw_step_bf16(a, NULL, NULL, NULL, NULL, NULL, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0, 1.0f,
                                              g_stream),
                     TKD_ERR_INVALID_ARG); /* the bf16 sibling checks its arguments alike */
    assert_int_equal(tkd_cuda_adamw_step(a, NULL, NULL, NULL, NULL, NULL, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1, 1.0f,
                                         g_stream),
                     TKD_OK);
    assert_int_equal(tkd_cuda_adamw_step(a, NULL, NULL, NULL, NULL, NULL, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0, 1.0f,
                                         g_stream),
                     TKD_ERR_INVALID_ARG); /* step counts from 1 */
    tkd_cuda_adamw_free(a);
    tkd_cuda_adamw_free(NULL);
}

/* ---- gradient norm and scale -------------------------------------------------------------------- */

/* Σ g² in long double, pairwise over blocks of 1024 (≈ 1e-16 relative: the reference). */
static double norm2_ref(const float *g, size_t n)
{
    long double total = 0.0L;
    for (size_t b = 0; b < n; b += 1024) {
        long double s = 0.0L;
        for (size_t i = b; i < n && i < b + 1024; i++)
            s += (long double)g[i] * g[i];
        total += s;
    }
    return (double)total;
}

static void norm_case(size_t n, int off, float special)
{
    char what[96];
    snprintf(what, sizeof what, "grad_norm2 n %zu offset %d special %g", n, off, special);
    float *g = rand_f32(n, 2200 + n, 1.0f);
    for (size_t i = 0; i < n; i += 997)
        g[i] *= 1e3f; /* a spread of magnitudes */
    if (special != 0.0f)
        g[n / 2] = special;
    double *d_out = tkd_test_dev_alloc(16);
    float *d_g = tkd_test_dev_alloc((n + off) * 4);
    tkd_test_to_dev(d_g + off, g, n * 4);
    double got[2];
    for (int run = 0; run < 2; run++) {
        tkd_test_ok(tkd_cuda_grad_norm2(g_ws, d_g + off, n, d_out, g_stream), what);
        tkd_test_to_host(&got[run], d_out, 8, g_stream);
    }
    const double ref = norm2_ref(g, n);
    if (isfinite(ref) ? !(fabs(got[0] - ref) <= NORM2_REL * ref) : !(isnan(ref) ? isnan(got[0]) : got[0] == ref))
        fail_msg("%s: got %.17g ref %.17g (rel %.3g)", what, got[0], ref, fabs(got[0] - ref) / ref);
    check_same_bits(what, &got[0], &got[1], 8);
    cudaFree(d_out), cudaFree(d_g);
    free(g);
}

static void scale_case(size_t n, int off)
{
    char what[64];
    snprintf(what, sizeof what, "scale n %zu offset %d", n, off);
    float *g = rand_f32(n, 2300 + n, 2.0f), *got = tkd_test_xmalloc(n * 4);
    float *d_g = tkd_test_dev_alloc((n + off) * 4);
    tkd_test_to_dev(d_g + off, g, n * 4);
    tkd_test_ok(tkd_cuda_scale(d_g + off, n, 0.3183f, g_stream), what);
    tkd_optim_scale(g, n, 0.3183f);
    tkd_test_to_host(got, d_g + off, n * 4, g_stream);
    check_same_bits(what, got, g, n * 4);
    cudaFree(d_g);
    free(g), free(got);
}

static void test_grad_norm(void **state)
{
    (void)state;
    const size_t ns[] = {1, 3, 8, 1000, 1003, (1u << 20) + 3, 16000005};
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++) {
        norm_case(ns[i], 0, 0.0f);
        scale_case(ns[i], 0);
    }
    norm_case(1003, 1, 0.0f); /* scalar path */
    scale_case(1003, 1);
    norm_case(100000, 0, INFINITY);
    norm_case(100000, 0, NAN);
    double *d = tkd_test_dev_alloc(8), zero = 1.0;
    tkd_test_ok(tkd_cuda_grad_norm2(g_ws, NULL, 0, d, g_stream), "grad_norm2 n 0");
    tkd_test_to_host(&zero, d, 8, g_stream);
    assert_true(zero == 0.0);
    assert_int_equal(tkd_cuda_grad_norm2(NULL, (float *)d, 1, d, g_stream), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_scale(NULL, 5, 1.0f, g_stream), TKD_ERR_INVALID_ARG);
    cudaFree(d);
}

static int setup(void **state)
{
    (void)state;
    if (cudaStreamCreate(&g_stream) != cudaSuccess)
        return -1;
    if (tkd_cuda_bwd_ws_create(WS_ROWS, WS_D, &g_ws) != TKD_OK || tkd_cuda_linear_create(&g_lin) != TKD_OK) {
        print_error("setup: %s\n", tkd_error_msg());
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tkd_cuda_bwd_ws_free(g_ws);
    tkd_cuda_bwd_ws_free(NULL);
    tkd_cuda_linear_free(g_lin);
    cudaStreamDestroy(g_stream);
    return 0;
}

static const struct CMUnitTest kTests[] = {
    cmocka_unit_test(test_embedding_bwd), cmocka_unit_test(test_rmsnorm_bwd),
    cmocka_unit_test(test_rope_bwd),      cmocka_unit_test(test_swiglu_bwd),
    cmocka_unit_test(test_linear_bwd),    cmocka_unit_test(test_adamw),
    cmocka_unit_test(test_master_split_join), cmocka_unit_test(test_grad_norm),
};
#endif /* TKD_HAVE_CUDA */

TKD_TEST_GPU_MAIN(kTests, setup, teardown)
