/* test_gpu_attn.c — the causal GQA attention forward of every implementation against the CPU, as one
 * table of cases run over the implementations (as ggml's test-backend-ops loops over backends): our
 * flash kernel (tkd_cuda_attn_fwd), the simple kernel for the head sizes the flash kernel refuses
 * (tkd_cuda_attn_fwd_simple) and cuDNN's fused attention where the build and the machine have it
 * (tkd_cudnn_attn_fwd). References: tkd_cpu_attn_fwd (fp32, kernels/cpu/cpu_ops.h) for every y where its
 * (B, H, T, T) scratch fits CPU_REF_MAX_BYTES, and the float64 row of tests/ref64.h for y and lse on
 * every row (T ≤ 1024) or on a sample of rows (the first and last 70, every 97th, both sides of each
 * 128-row boundary); both are computed once a case and shared by the implementations. Inputs are
 * rounded to bf16 first, so the only differences are the device's fp32 accumulation order, its bf16
 * rounding of the probabilities P before P·V and the bf16 rounding of y.
 *
 * Each implementation runs a case twice, with lse and without: our kernels must give bit-identical y
 * (one kernel, lse only stored); cuDNN builds two plans, so its second y is checked against the
 * references on its own. Every output buffer is pre-filled with NaN and followed by a NaN guard band,
 * so an unwritten element or a write past the end fails.
 *
 * Which implementation takes which case: each case names the implementations it runs on and those
 * that must take it (a TKD_ERR_UNSUPPORTED there fails); the others may refuse (cuDNN's message is
 * printed). Every case and table counts what ran, and a table fails when an implementation it asked
 * refused every case ("cuDNN refused everything" does not pass). Where the build or the machine has
 * no cuDNN, its runs are reported as not available and its own tests (plan cache, argument errors)
 * skip. Labelled gpu: exits 77 (skipped) where no GPU answers or the build has no CUDA backend.
 *
 * Tolerances (v ~ normal(0, 1), so |y| ≲ 4), the same for every implementation:
 *   y, per element: |Δ| ≤ 1e-2 + 1e-2·|ref|. bf16 y: ≤ 2^-8 = 3.9e-3 relative. bf16 P: each
 *     weight off by ≤ 2^-8 relative, y by ≤ 2^-8·Σ p|v| / Σ p in the worst case (signs aligned),
 *     ≈ 2^-8·|v| / √(keys that matter) in practice; 1e-2 absolute covers two comparable keys with
 *     |v| ≈ 2 and rounding errors of one sign. fp32 scores and sums add ~1e-6. cuDNN normalises P
 *     before the bf16 rounding (P = exp/Σ, then P·V) where the flash kernel rounds the unnormalised
 *     exp(s − m) and divides y by Σ afterwards: the same relative rounding per weight, the same bound.
 *   y, over a case: ‖Δ‖₂ / ‖ref‖₂ ≤ 1e-2 against each reference (an indexing error gives O(1)).
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
#include "kernels/cpu/cpu_ops.h"
#include "tests/gpu_check.h"
#include "tests/gpu_testutil.h"
#include "tests/ref64.h"
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/attn/attn_cuda.h"
#include "kernels/attn/attn_cudnn.h"

#define Y_NORM_TOL 1e-2
#define GUARD 4096                     /* NaN elements after y and lse that must stay untouched */
#define FULL_ROWS_MAX 1024             /* up to this T the float64 reference checks every row */
#define CPU_REF_MAX_BYTES (256u << 20) /* tkd_cpu_attn_fwd's (B, H, T, T) scratch, at most */

static const tkd_test_tol kYTol = {1e-2, 1e-2, "bf16 y (2^-8 rel) and bf16 P (2^-8 rel per weight, ~2^-8·|v| "
                                               "on y); fp32 sums ~1e-6"};
static const tkd_test_tol kLseTol = {1e-3, 2e-5, "fp32 scores, ex2.approx and row sums: ~1e-5 at O(1) scores; "
                                                 "relative part for scores in the thousands"};

/* The implementations, as bits of a case's masks. */
enum { FLASH = 1, SIMPLE = 2, CUDNN = 4 };

typedef struct impl {
    const char *name;
    unsigned bit;
    int same_bits;          /* y without lse must equal y with lse bit for bit */
    int asked, ran, refused; /* over one table */
} impl;

static impl g_impls[] = {{"flash", FLASH, 1, 0, 0, 0}, {"simple", SIMPLE, 1, 0, 0, 0}, {"cudnn", CUDNN, 0, 0, 0, 0}};
#define N_IMPL (sizeof g_impls / sizeof g_impls[0])

static tkd_cudnn_attn *g_attn; /* one state for the whole run (plans cached across cases); NULL: no cuDNN */
static char g_no_cudnn[256];   /* why g_attn is NULL */

typedef struct acase {
    int table;     /* which test runs it (SMALL, LONG, ...) */
    const char *what;
    int B, T, H, Hkv, dh;
    float std;     /* q and k ~ normal(0, std²): scores ~ normal(0, std⁴); v ~ normal(0, 1) */
    uint64_t seed;
    unsigned runs; /* the implementations it runs on */
    unsigned must; /* those whose refusal fails the test (the others may refuse) */
    int window;    /* tkd_attn_mask's sliding window (0: none) */
    float sink_std; /* > 0: per-head sinks ~ normal(0, sink_std²); 0: none */
} acase;

/* A case's inputs (bf16-rounded floats and their bits, on the host and the device) and references. */
typedef struct inputs {
    int64_t nq, nkv, nl;   /* elements of q / y, of k / v, of lse */
    float *q, *k, *v;      /* (B·T, H·dh), (B·T, Hkv·dh) ×2 */
    uint16_t *qb, *kb, *vb;
    uint16_t *dq, *dk, *dv; /* device copies of the bits */
    float *sinks, *dsinks;  /* (H) host and device, or NULL */
    double *y64, *lse64;   /* float64 y and lse on the sampled rows */
    float *ycpu;           /* tkd_cpu_attn_fwd's y, or NULL where its scratch is too large */
} inputs;

/* One implementation's outputs of a case. */
typedef struct outs {
    uint16_t *y, *y_nolse; /* (B·T, H·dh) + GUARD each */
    float *lse;            /* (B, H, T) + GUARD */
} outs;

static int sampled(int t, int T)
{
    return T <= FULL_ROWS_MAX || t < 70 || t >= T - 70 || t % 97 == 0 || t % 128 == 0 || t % 128 == 127;
}

static tkd_ref64_attn ref_of(const inputs *in, const acase *c)
{
    return (tkd_ref64_attn){c->B, c->T, c->H, c->Hkv, c->dh, in->q, in->k, in->v, c->window, in->sinks};
}

/* y element i of (B·T, H·dh) as "y[b= t= h= d=]"; ctx: the case. */
static void where_y(char *buf, size_t cap, int64_t i, const void *ctx)
{
    const acase *c = ctx;
    const int64_t row = i / ((int64_t)c->H * c->dh), col = i % ((int64_t)c->H * c->dh);
    snprintf(buf, cap, "y[b=%lld t=%lld h=%lld d=%lld]", (long long)(row / c->T), (long long)(row % c->T),
             (long long)(col / c->dh), (long long)(col % c->dh));
}

/* lse element i of (B, H, T) as "lse[b= h= t=]"; ctx: the case. */
static void where_lse(char *buf, size_t cap, int64_t i, const void *ctx)
{
    const acase *c = ctx;
    const int64_t bh = i / c->T;
    snprintf(buf, cap, "lse[b=%lld h=%lld t=%lld]", (long long)(bh / c->H), (long long)(bh % c->H),
             (long long)(i % c->T));
}

/* Draws the inputs of shape c (all T rows), uploads them; refs: also the references. */
static void inputs_make(inputs *in, const acase *c, int refs)
{
    memset(in, 0, sizeof *in);
    in->nq = (int64_t)c->B * c->T * c->H * c->dh;
    in->nkv = (int64_t)c->B * c->T * c->Hkv * c->dh;
    in->nl = (int64_t)c->B * c->H * c->T;
    in->q = tkd_test_xmalloc(sizeof(float) * in->nq), in->qb = tkd_test_xmalloc(2 * in->nq);
    in->k = tkd_test_xmalloc(sizeof(float) * in->nkv), in->kb = tkd_test_xmalloc(2 * in->nkv);
    in->v = tkd_test_xmalloc(sizeof(float) * in->nkv), in->vb = tkd_test_xmalloc(2 * in->nkv);
    tkd_test_fill_bf16(in->q, in->qb, in->nq, c->seed * 3 + 1, c->std);
    tkd_test_fill_bf16(in->k, in->kb, in->nkv, c->seed * 3 + 2, c->std);
    tkd_test_fill_bf16(in->v, in->vb, in->nkv, c->seed * 3 + 3, 1.0f);
    in->dq = tkd_test_dev_alloc(2 * in->nq), in->dk = tkd_test_dev_alloc(2 * in->nkv);
    in->dv = tkd_test_dev_alloc(2 * in->nkv);
    tkd_test_to_dev(in->dq, in->qb, 2 * in->nq);
    tkd_test_to_dev(in->dk, in->kb, 2 * in->nkv);
    tkd_test_to_dev(in->dv, in->vb, 2 * in->nkv);
    if (c->sink_std > 0.0f) {
        uint16_t *bits = tkd_test_xmalloc(2 * (size_t)c->H);
        in->sinks = tkd_test_xmalloc(sizeof(float) * c->H);
        tkd_test_fill_bf16(in->sinks, bits, c->H, c->seed * 3 + 4, c->sink_std);
        in->dsinks = tkd_test_dev_alloc(sizeof(float) * c->H);
        tkd_test_to_dev(in->dsinks, in->sinks, sizeof(float) * c->H);
        free(bits);
    }
    if (!refs)
        return;
    const tkd_ref64_attn a = ref_of(in, c);
    in->y64 = tkd_test_xmalloc(sizeof(double) * in->nq), in->lse64 = tkd_test_xmalloc(sizeof(double) * in->nl);
    double *sc = tkd_test_xmalloc(sizeof(double) * c->T);
    for (int b = 0; b < c->B; b++)
        for (int h = 0; h < c->H; h++)
            for (int t = 0; t < c->T; t++)
                if (sampled(t, c->T))
                    in->lse64[((int64_t)b * c->H + h) * c->T + t] = tkd_ref64_attn_row(
                        &a, b, h, t, in->y64 + ((int64_t)b * c->T + t) * c->H * c->dh + (int64_t)h * c->dh, sc);
    free(sc);
    /* the CPU's attention is plain causal: a reference for the unmasked cases only */
    if (!c->window && !in->sinks && (double)c->B * c->H * c->T * c->T * sizeof(float) <= CPU_REF_MAX_BYTES) {
        float *att = tkd_test_xmalloc(sizeof(float) * (size_t)c->B * c->H * c->T * c->T);
        in->ycpu = tkd_test_xmalloc(sizeof(float) * in->nq);
        tkd_cpu_attn_fwd(in->q, in->k, in->v, c->B, c->T, c->H, c->Hkv, c->dh, att, in->ycpu);
        free(att);
    }
}

static void inputs_free(inputs *in)
{
    free(in->q), free(in->k), free(in->v), free(in->qb), free(in->kb), free(in->vb);
    free(in->y64), free(in->lse64), free(in->ycpu), free(in->sinks);
    cudaFree(in->dq), cudaFree(in->dk), cudaFree(in->dv), cudaFree(in->dsinks);
}

static tkd_status impl_fwd(const impl *m, const inputs *in, const acase *c, uint16_t *y, float *lse)
{
    const tkd_attn_mask mask = {c->window, in->dsinks, NULL};
    const int masked = c->window || in->dsinks;
    switch (m->bit) {
    case FLASH: /* the plain entry point on unmasked cases: it is the one the product calls there */
        return masked ? tkd_cuda_attn_fwd_masked(in->dq, in->dk, in->dv, c->B, c->T, c->H, c->Hkv, c->dh, &mask, y,
                                                 lse, NULL)
                      : tkd_cuda_attn_fwd(in->dq, in->dk, in->dv, c->B, c->T, c->H, c->Hkv, c->dh, y, lse, NULL);
    case SIMPLE:
        return masked ? tkd_cuda_attn_fwd_simple_masked(in->dq, in->dk, in->dv, c->B, c->T, c->H, c->Hkv, c->dh,
                                                        &mask, y, lse, NULL)
                      : tkd_cuda_attn_fwd_simple(in->dq, in->dk, in->dv, c->B, c->T, c->H, c->Hkv, c->dh, y, lse,
                                                 NULL);
    default:
        if (masked)
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "cuDNN's graph here has no window or sinks");
        return tkd_cudnn_attn_fwd(g_attn, in->dq, in->dk, in->dv, c->B, c->T, c->H, c->Hkv, c->dh, y, lse, NULL);
    }
}

/* One call; returns 0 when the implementation refused the shape (message printed; fails where the
 * case says it must take it). */
static int call(const impl *m, const inputs *in, const acase *c, uint16_t *y, float *lse)
{
    tkd_status st = impl_fwd(m, in, c, y, lse);
    if (st == TKD_ERR_UNSUPPORTED) {
        print_message("%s (%s lse): %s refused: %s\n", c->what, lse ? "with" : "without", m->name, tkd_error_msg());
        if (c->must & m->bit)
            fail_msg("%s: %s must take this shape", c->what, m->name);
        return 0;
    }
    if (st != TKD_OK)
        fail_msg("%s: %s forward: %s: %s", c->what, m->name, tkd_status_name(st), tkd_error_msg());
    return 1;
}

/* Fails unless the GUARD elements after y's nq (and lse's nl) still hold their NaN fill, and every
 * in-range y is finite (non-finite: unwritten or overflow). */
static void check_written(const inputs *in, const acase *c, const impl *m, const uint16_t *y, const float *lse,
                          const char *which)
{
    char where[96];
    for (int64_t i = 0; i < GUARD; i++) {
        if (y[in->nq + i] != 0xffff)
            fail_msg("%s: %s y (%s) written past its end (element nq + %lld = 0x%04x)", c->what, m->name, which,
                     (long long)i, y[in->nq + i]);
        if (lse && tkd_f32_bits(lse[in->nl + i]) != 0xffffffffu)
            fail_msg("%s: %s lse written past its end (element %lld + %lld)", c->what, m->name, (long long)in->nl,
                     (long long)i);
    }
    for (int64_t i = 0; i < in->nq; i++)
        if (!isfinite(tkd_bf16_to_f32(y[i]))) {
            where_y(where, sizeof where, i, c);
            fail_msg("%s: %s %s (%s) = 0x%04x: unwritten or overflow", c->what, m->name, where, which, y[i]);
        }
    for (int64_t i = 0; lse && i < in->nl; i++)
        if (!isfinite(lse[i])) {
            where_lse(where, sizeof where, i, c);
            fail_msg("%s: %s %s = %g", c->what, m->name, where, (double)lse[i]);
        }
}

/* Runs implementation m with lse, then without, into NaN-filled buffers; checks what they wrote.
 * Returns 0 when m refused the shape. */
static int run_impl(const impl *m, const inputs *in, const acase *c, outs *o)
{
    uint16_t *dy = tkd_test_dev_alloc(2 * (in->nq + GUARD)), *dy2 = tkd_test_dev_alloc(2 * (in->nq + GUARD));
    float *dl = tkd_test_dev_alloc(sizeof(float) * (in->nl + GUARD));
    tkd_test_poison(dy, 2 * (in->nq + GUARD)); /* bf16 NaN */
    tkd_test_poison(dy2, 2 * (in->nq + GUARD));
    tkd_test_poison(dl, sizeof(float) * (in->nl + GUARD)); /* fp32 NaN */
    int ok = call(m, in, c, dy, dl) && call(m, in, c, dy2, NULL);
    cudaError_t ce = cudaDeviceSynchronize();
    if (ce != cudaSuccess)
        fail_msg("%s: %s: kernel failed: %s", c->what, m->name, cudaGetErrorString(ce));
    tkd_test_to_host(o->y, dy, 2 * (in->nq + GUARD), NULL);
    tkd_test_to_host(o->y_nolse, dy2, 2 * (in->nq + GUARD), NULL);
    tkd_test_to_host(o->lse, dl, sizeof(float) * (in->nl + GUARD), NULL);
    cudaFree(dy), cudaFree(dy2), cudaFree(dl);
    if (!ok)
        return 0;
    check_written(in, c, m, o->y, o->lse, "with lse");
    check_written(in, c, m, o->y_nolse, NULL, "without lse");
    if (m->same_bits && memcmp(o->y, o->y_nolse, 2 * in->nq) != 0) {
        int64_t i = 0;
        char where[96];
        while (o->y[i] == o->y_nolse[i])
            i++;
        where_y(where, sizeof where, i, c);
        fail_msg("%s: %s %s = 0x%04x with lse, 0x%04x without (lse = NULL changed y)", c->what, m->name, where, o->y[i],
                 o->y_nolse[i]);
    }
    return 1;
}

/* One y (bf16) against the float64 rows and, where there is one, the CPU's y; returns the worst
 * err/tol, failing on any element out of tolerance or a norm ratio over Y_NORM_TOL. */
static double check_y(const inputs *in, const acase *c, const impl *m, const uint16_t *y, const char *which)
{
    char what[2][160];
    tkd_test_check k[2];
    snprintf(what[0], sizeof what[0], "%s: %s y (%s) against ref64", c->what, m->name, which);
    snprintf(what[1], sizeof what[1], "%s: %s y (%s) against cpu", c->what, m->name, which);
    tkd_test_check_begin(&k[0], what[0], kYTol, where_y, c);
    tkd_test_check_begin(&k[1], what[1], kYTol, where_y, c);
    const int64_t cols = (int64_t)c->H * c->dh;
    for (int64_t i = 0; i < in->nq; i++) {
        if (sampled((int)(i / cols % c->T), c->T))
            tkd_test_check_add(&k[0], i, tkd_bf16_to_f32(y[i]), in->y64[i], 0.0);
        if (in->ycpu)
            tkd_test_check_add(&k[1], i, tkd_bf16_to_f32(y[i]), in->ycpu[i], 0.0);
    }
    double worst = 0.0;
    for (int r = 0; r < (in->ycpu ? 2 : 1); r++) {
        tkd_test_check_end(&k[r]);
        if (!(tkd_test_check_norm(&k[r]) <= Y_NORM_TOL))
            fail_msg("%s: rel norm %.3g over %g (an indexing error gives O(1))", what[r], tkd_test_check_norm(&k[r]),
                     Y_NORM_TOL);
        worst = fmax(worst, k[r].worst);
    }
    return worst;
}

/* lse against the float64 rows; returns the worst err/tol. */
static double check_lse(const inputs *in, const acase *c, const impl *m, const float *lse)
{
    char what[160];
    tkd_test_check k;
    snprintf(what, sizeof what, "%s: %s lse against ref64", c->what, m->name);
    tkd_test_check_begin(&k, what, kLseTol, where_lse, c);
    for (int64_t i = 0; i < in->nl; i++)
        if (sampled((int)(i % c->T), c->T))
            tkd_test_check_add(&k, i, lse[i], in->lse64[i], 0.0);
    tkd_test_check_end(&k);
    return k.worst;
}

/* One case over every implementation it names; counts into each implementation's tally. */
static void run_case(const acase *c)
{
    inputs in;
    inputs_make(&in, c, 1);
    outs o = {tkd_test_xmalloc(2 * (in.nq + GUARD)), tkd_test_xmalloc(2 * (in.nq + GUARD)),
              tkd_test_xmalloc(sizeof(float) * (in.nl + GUARD))};
    for (size_t x = 0; x < N_IMPL; x++) {
        impl *m = &g_impls[x];
        if (!(c->runs & m->bit))
            continue;
        if (m->bit == CUDNN && !g_attn) {
            print_message("%-34s %s: not available (%s)\n", c->what, m->name, g_no_cudnn);
            continue;
        }
        m->asked++;
        if (!run_impl(m, &in, c, &o)) {
            m->refused++;
            continue;
        }
        const double ey = check_y(&in, c, m, o.y, "with lse");
        const double ey2 = m->same_bits ? ey : check_y(&in, c, m, o.y_nolse, "without lse"); /* same bits: checked */
        const double el = check_lse(&in, c, m, o.lse);
        m->ran++;
        print_message("%-34s B=%d T=%-5d H=%-2d Hkv=%-2d dh=%-3d %-6s: y max err/tol %.3f (no lse %.3f), "
                      "lse %.3f%s\n", c->what, c->B, c->T, c->H, c->Hkv, c->dh, m->name, ey, ey2, el,
                      in.ycpu ? "" : " (no cpu ref)");
    }
    free(o.y), free(o.y_nolse), free(o.lse);
    inputs_free(&in);
}

#define FC (FLASH | CUDNN)

/* The tables: small shapes (every row against both references); long sequences (the float64
 * reference on sampled rows, the CPU's where its scratch fits); scores in the thousands (q, k ~
 * normal(0, 30²): exp(s) overflows fp32 without the running max); the simple kernel
 * (kernels/attn/attn_simple_cuda.cu) at the head sizes only it takes (the fixtures' 16, the demo
 * teacher's 32) and one the flash kernel takes too. The T = 1000 cases at dh 64 and 128 are the
 * teacher's shapes: cuDNN must take them. */
enum { SMALL, LONG, LARGE, SIMPLE_K, MASKED };
static const char *const kTables[] = {"small", "long", "large scores", "simple", "window and sinks"};
#define FS (FLASH | SIMPLE)
static const acase kCases[] = {
    {SMALL, "T = 1", 1, 1, 2, 1, 64, 1.0f, 1, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 17, B = 2, GQA 2, dh 48", 2, 17, 4, 2, 48, 1.5f, 2, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 1000, GQA 7, dh 128", 1, 1000, 7, 1, 128, 1.5f, 3, FC, FC, 0, 0.0f},
    {SMALL, "T = 1000, B = 2, GQA 1, dh 64", 2, 1000, 2, 2, 64, 1.0f, 4, FC, FC, 0, 0.0f},
    {SMALL, "T = 1000, GQA 2, dh 48", 1, 1000, 4, 2, 48, 2.0f, 5, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 333, GQA 3, dh 80", 1, 333, 6, 2, 80, 1.5f, 6, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 200, B = 2, GQA 1, dh 96", 2, 200, 3, 3, 96, 1.5f, 7, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 128 (one full query tile)", 1, 128, 2, 1, 128, 1.5f, 8, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 65 (one key past a tile)", 1, 65, 2, 2, 64, 1.5f, 9, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 1, GQA 1, dh 64", 1, 1, 2, 2, 64, 1.0f, 1, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 1, B = 2, GQA 7, dh 128", 2, 1, 7, 1, 128, 1.0f, 2, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 17, B = 2, GQA 2, dh 64", 2, 17, 4, 2, 64, 1.5f, 3, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 17, GQA 7, dh 128", 1, 17, 14, 2, 128, 1.5f, 4, FC, FLASH, 0, 0.0f},
    {SMALL, "T = 1000, GQA 2, dh 128", 1, 1000, 4, 2, 128, 2.0f, 7, FC, FC, 0, 0.0f},
    {SMALL, "T = 1000, B = 2, GQA 7, dh 64", 2, 1000, 7, 1, 64, 1.5f, 8, FC, FC, 0, 0.0f},
    {LONG, "T = 8192, GQA 2, dh 128", 1, 8192, 4, 2, 128, 1.5f, 11, FC, FLASH, 0, 0.0f},
    {LONG, "T = 8192, GQA 7, dh 48", 1, 8192, 7, 1, 48, 1.5f, 12, FC, FLASH, 0, 0.0f},
    {LONG, "T = 8192, B = 2, GQA 1, dh 64", 2, 8192, 2, 2, 64, 1.0f, 13, FC, FLASH, 0, 0.0f},
    {LONG, "T = 4097, GQA 2, dh 128", 1, 4097, 2, 1, 128, 2.0f, 14, FC, FLASH, 0, 0.0f},
    {LONG, "T = 4097, B = 2, GQA 7, dh 64", 2, 4097, 7, 1, 64, 1.5f, 12, FC, FLASH, 0, 0.0f},
    {LONG, "T = 4097, GQA 1, dh 64", 1, 4097, 3, 3, 64, 1.0f, 13, FC, FLASH, 0, 0.0f},
    {LARGE, "large scores, dh 64", 1, 300, 2, 1, 64, 30.0f, 21, FC, FLASH, 0, 0.0f},
    {LARGE, "large scores, dh 128, T = 4100", 1, 4100, 2, 2, 128, 20.0f, 22, FC, FLASH, 0, 0.0f},
    {SIMPLE_K, "simple: T = 1, dh 16", 1, 1, 2, 1, 16, 1.0f, 21, SIMPLE | CUDNN, SIMPLE, 0, 0.0f},
    {SIMPLE_K, "simple: T = 17, B = 2, GQA 2, dh 16", 2, 17, 4, 2, 16, 1.5f, 22, SIMPLE | CUDNN, SIMPLE, 0, 0.0f},
    {SIMPLE_K, "simple: T = 300, GQA 7, dh 32", 1, 300, 7, 1, 32, 1.5f, 23, SIMPLE | CUDNN, SIMPLE, 0, 0.0f},
    {SIMPLE_K, "simple: T = 1000, B = 2, GQA 2, dh 64", 2, 1000, 4, 2, 64, 1.0f, 24, SIMPLE | FC, SIMPLE | FLASH, 0, 0.0f},
    /* sliding windows (Mistral, Qwen2/3, gpt-oss's sliding layers) and gpt-oss's sinks, on both of
     * our kernels: a window of one key (only the query's own), one key tile, one not a multiple of
     * the tiles, one longer than the sequence (= plain causal), sinks alone and with a window, and
     * sinks large enough to take most of the weight */
    {MASKED, "window 1, dh 64", 1, 100, 2, 1, 64, 1.5f, 41, FS, FS, 1, 0.0f},
    {MASKED, "window 64, dh 48, B = 2", 2, 300, 4, 2, 48, 1.5f, 42, FS, FS, 64, 0.0f},
    {MASKED, "window 128 + sinks, GQA 8, dh 64", 1, 1000, 8, 1, 64, 1.5f, 43, FS, FS, 128, 2.0f},
    {MASKED, "window 200, dh 128, T = 4097", 1, 4097, 4, 2, 128, 1.5f, 44, FS, FS, 200, 0.0f},
    {MASKED, "window 5000 > T, dh 80", 1, 1000, 2, 2, 80, 1.5f, 45, FS, FS, 5000, 0.0f},
    {MASKED, "sinks, dh 96", 1, 333, 6, 2, 96, 1.5f, 46, FS, FS, 0, 2.0f},
    {MASKED, "large sinks, dh 64, T = 17", 2, 17, 4, 4, 64, 1.0f, 47, FS, FS, 0, 8.0f},
    {MASKED, "window 128 + sinks, dh 16 (simple only)", 1, 700, 4, 2, 16, 1.5f, 48, SIMPLE, SIMPLE, 128, 2.0f},
};

/* Runs the cases of one table over their implementations; fails when an implementation it asked
 * took none of them. */
static void run_table(int which)
{
    const char *table = kTables[which];
    for (size_t x = 0; x < N_IMPL; x++)
        g_impls[x].asked = g_impls[x].ran = g_impls[x].refused = 0;
    for (size_t i = 0; i < sizeof kCases / sizeof kCases[0]; i++)
        if (kCases[i].table == which)
            run_case(&kCases[i]);
    for (size_t x = 0; x < N_IMPL; x++) {
        const impl *m = &g_impls[x];
        if (m->asked)
            print_message("%s: %s took %d of %d cases (%d refused)\n", table, m->name, m->ran, m->asked, m->refused);
        if (m->asked && !m->ran)
            fail_msg("%s: %s refused all %d cases it was asked", table, m->name, m->asked);
    }
}

static void test_small(void **state) { (void)state, run_table(SMALL); }
static void test_long(void **state) { (void)state, run_table(LONG); }
static void test_large_scores(void **state) { (void)state, run_table(LARGE); }
static void test_simple(void **state) { (void)state, run_table(SIMPLE_K); }
static void test_masked(void **state) { (void)state, run_table(MASKED); }

/* One cuDNN forward of shape c (inputs in) into fresh NaN-filled buffers dy, dl; y and lse back in
 * hy, hl. Returns 0 when cuDNN refused the shape. */
static int fwd_into(const acase *c, const inputs *in, uint16_t *dy, float *dl, uint16_t *hy, float *hl)
{
    const size_t ny = (size_t)c->B * c->T * c->H * c->dh, nl = (size_t)c->B * c->H * c->T;
    tkd_test_poison(dy, 2 * ny);
    tkd_test_poison(dl, 4 * nl);
    if (!call(&g_impls[2], in, c, dy, dl))
        return 0;
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    tkd_test_to_host(hy, dy, 2 * ny, NULL);
    tkd_test_to_host(hl, dl, 4 * nl, NULL);
    return 1;
}

/* lse of every row of shape c (inputs in, drawn for a longer T: a shorter T reads their first rows)
 * against the float64 row. */
static void check_lse_all(const inputs *in, const acase *c, const float *lse)
{
    const tkd_ref64_attn a = ref_of(in, c);
    double *y = tkd_test_xmalloc(sizeof(double) * c->dh), *sc = tkd_test_xmalloc(sizeof(double) * c->T);
    tkd_test_check k;
    tkd_test_check_begin(&k, c->what, kLseTol, where_lse, c);
    for (int b = 0; b < c->B; b++)
        for (int h = 0; h < c->H; h++)
            for (int t = 0; t < c->T; t++) {
                const int64_t i = ((int64_t)b * c->H + h) * c->T + t;
                tkd_test_check_add(&k, i, lse[i], tkd_ref64_attn_row(&a, b, h, t, y, sc), 0.0);
            }
    tkd_test_check_end(&k);
    free(y), free(sc);
}

/* cuDNN's plan table and variant-pack cache: more shapes than the table holds (each checked on its
 * lse, then the first ones again after their eviction), and one shape run into other output
 * buffers and back, which must give the same bits (the same plan; a pack still pointing at the
 * old buffers would leave the new ones NaN). */
/* Packed documents (tkd_attn_mask.doc): each document's rows of a packed batch equal that document
 * run alone under the same window and sinks, for the flash kernel (dh 64, 128) and the simple one
 * (dh 32), documents of 1 to 200 tokens across tile boundaries. The two runs multiply the same bf16
 * numbers but in tiles aligned differently, so their fp32 sums differ in the last bits and the
 * bf16 output may round the other way: y within one bf16 step (2^-7·max(|y|, 1)), lse within 1e-4. */
static void run_documents(int dh, int window, int with_sinks)
{
    enum { B = 2, T = 333, H = 4, Hkv = 2 };
    static const int starts[B][5] = {{0, 1, 100, 229, -1}, {0, 200, -1}};
    int32_t doc[B * T];
    tkd_test_doc_starts(&starts[0][0], 5, B, T, doc);
    const int64_t nq = (int64_t)B * T * H * dh, nkv = (int64_t)B * T * Hkv * dh;
    float *f = tkd_test_xmalloc(sizeof(float) * nq), sk[H];
    uint16_t *qb = tkd_test_xmalloc(2 * nq), *kb = tkd_test_xmalloc(2 * nkv), *vb = tkd_test_xmalloc(2 * nkv), skb[H];
    tkd_test_fill_bf16(f, qb, nq, 501 + dh, 1.5f);
    tkd_test_fill_bf16(f, kb, nkv, 502 + dh, 1.5f);
    tkd_test_fill_bf16(f, vb, nkv, 503 + dh, 1.0f);
    tkd_test_fill_bf16(sk, skb, H, 504, 2.0f);
    uint16_t *dq = tkd_test_dev_alloc(2 * nq), *dk = tkd_test_dev_alloc(2 * nkv), *dv = tkd_test_dev_alloc(2 * nkv);
    uint16_t *dy = tkd_test_dev_alloc(2 * nq), *dya = tkd_test_dev_alloc(2 * nq);
    float *dl = tkd_test_dev_alloc(sizeof(float) * B * H * T), *dla = tkd_test_dev_alloc(sizeof(float) * B * H * T);
    float *dsk = tkd_test_dev_alloc(sizeof(float) * H);
    int32_t *ddoc = tkd_test_dev_alloc(sizeof(doc));
    tkd_test_to_dev(dq, qb, 2 * nq), tkd_test_to_dev(dk, kb, 2 * nkv), tkd_test_to_dev(dv, vb, 2 * nkv);
    tkd_test_to_dev(dsk, sk, sizeof(sk)), tkd_test_to_dev(ddoc, doc, sizeof(doc));
    const int flash = dh != 32;
    tkd_status (*fn)(const uint16_t *, const uint16_t *, const uint16_t *, int, int, int, int, int,
                     const tkd_attn_mask *, uint16_t *, float *, void *) =
        flash ? tkd_cuda_attn_fwd_masked : tkd_cuda_attn_fwd_simple_masked;
    const tkd_attn_mask packed = {window, with_sinks ? dsk : NULL, ddoc}, alone = {window, packed.sinks, NULL};
    assert_int_equal(fn(dq, dk, dv, B, T, H, Hkv, dh, &packed, dy, dl, NULL), TKD_OK);
    for (int b = 0; b < B; b++)
        for (int d = 0; starts[b][d] >= 0; d++) { /* each document alone, written where it sits packed */
            int s0 = starts[b][d], n = (starts[b][d + 1] >= 0 ? starts[b][d + 1] : T) - s0;
            const int64_t r0 = (int64_t)b * T + s0;
            uint16_t *yo = tkd_test_dev_alloc(2 * (size_t)n * H * dh);
            float *lo = tkd_test_dev_alloc(sizeof(float) * H * n), *lh = tkd_test_xmalloc(sizeof(float) * H * n);
            assert_int_equal(fn(dq + r0 * H * dh, dk + r0 * Hkv * dh, dv + r0 * Hkv * dh, 1, n, H, Hkv, dh, &alone, yo,
                                lo, NULL),
                             TKD_OK);
            assert_int_equal(cudaMemcpy(dya + r0 * H * dh, yo, 2 * (size_t)n * H * dh, cudaMemcpyDeviceToDevice),
                             cudaSuccess);
            tkd_test_to_host(lh, lo, sizeof(float) * H * n, NULL);
            for (int h = 0; h < H; h++) /* lse (B, H, T): the document's stretch of row (b, h) */
                assert_int_equal(cudaMemcpy(dla + ((int64_t)b * H + h) * T + s0, lh + (int64_t)h * n,
                                            sizeof(float) * n, cudaMemcpyHostToDevice),
                                 cudaSuccess);
            cudaFree(yo), cudaFree(lo), free(lh);
        }
    uint16_t *y = tkd_test_xmalloc(2 * nq), *ya = tkd_test_xmalloc(2 * nq);
    float *l = tkd_test_xmalloc(sizeof(float) * B * H * T), *la = tkd_test_xmalloc(sizeof(float) * B * H * T);
    tkd_test_to_host(y, dy, 2 * nq, NULL), tkd_test_to_host(ya, dya, 2 * nq, NULL);
    tkd_test_to_host(l, dl, sizeof(float) * B * H * T, NULL), tkd_test_to_host(la, dla, sizeof(float) * B * H * T, NULL);
    double worst = 0, worst_l = 0; /* worst: |dy| in units of its bf16 spacing bound 2^-7·max(|y|, 1) */
    for (int64_t i = 0; i < nq; i++) {
        double a = tkd_bf16_to_f32(y[i]), c = tkd_bf16_to_f32(ya[i]);
        worst = fmax(worst, fabs(a - c) / (0x1p-7 * fmax(fmax(fabs(a), fabs(c)), 1.0)));
    }
    for (int64_t i = 0; i < (int64_t)B * H * T; i++)
        worst_l = fmax(worst_l, fabs((double)l[i] - la[i]));
    print_message("documents, %s dh %3d window %2d sinks %d: packed vs alone max |dy| %.3g bf16 steps, |dlse| %.3g\n",
                  flash ? "flash " : "simple", dh, window, with_sinks, worst, worst_l);
    if (!(worst <= 1.0) || !(worst_l <= 1e-4))
        fail_msg("dh %d window %d sinks %d: packed documents differ from each alone: |dy| %g bf16 steps, |dlse| %g", dh, window,
                 with_sinks, worst, worst_l);
    free(f), free(qb), free(kb), free(vb), free(y), free(ya), free(l), free(la);
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dy), cudaFree(dya), cudaFree(dl), cudaFree(dla);
    cudaFree(dsk), cudaFree(ddoc);
}

static void test_documents(void **state)
{
    (void)state;
    static const int dhs[] = {32, 64, 128};
    for (int i = 0; i < 3; i++)
        for (int c = 0; c < 3; c++) /* plain, a window of 50, sinks */
            run_documents(dhs[i], c == 1 ? 50 : 0, c == 2);
}

static void test_plan_cache(void **state)
{
    (void)state;
    if (!g_attn)
        skip();
    enum { N_T = 20, H = 2, HKV = 1, DH = 64 };
    acase big = {0, "plan cache", 1, N_T, H, HKV, DH, 1.5f, 31, CUDNN, 0, 0, 0.0f};
    inputs in;
    inputs_make(&in, &big, 0);
    uint16_t *dy = tkd_test_dev_alloc(2 * in.nq), *dy2 = tkd_test_dev_alloc(2 * in.nq);
    float *dl = tkd_test_dev_alloc(4 * in.nl), *dl2 = tkd_test_dev_alloc(4 * in.nl);
    uint16_t *y1 = tkd_test_xmalloc(2 * in.nq), *y2 = tkd_test_xmalloc(2 * in.nq);
    float *l1 = tkd_test_xmalloc(4 * in.nl), *l2 = tkd_test_xmalloc(4 * in.nl);
    char what[64];
    int took = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int T = 1; T <= (pass ? 4 : N_T); T++) { /* pass 1: T = 1..4 were evicted */
            acase c = big;
            c.T = T, c.what = what;
            snprintf(what, sizeof what, "plan cache T = %d (pass %d)", T, pass);
            if (fwd_into(&c, &in, dy, dl, y1, l1))
                check_lse_all(&in, &c, l1), took++;
        }
    if (!took)
        fail_msg("plan cache: cuDNN refused all %d shapes", N_T + 4);
    acase c = big;
    c.T = 17, c.what = "plan cache, other buffers";
    if (fwd_into(&c, &in, dy, dl, y1, l1)) {
        const size_t ny = (size_t)c.T * H * DH, nl = (size_t)H * c.T;
        for (int round = 0; round < 2; round++) { /* into dy2/dl2, then back into dy/dl */
            assert_true(fwd_into(&c, &in, round ? dy : dy2, round ? dl : dl2, y2, l2));
            if (memcmp(y1, y2, 2 * ny) != 0 || memcmp(l1, l2, 4 * nl) != 0)
                fail_msg("plan cache: the same shape into %s buffers gave other bits (a variant pack kept "
                         "stale pointers, or cuDNN's forward is not reproducible)", round ? "the first" : "new");
        }
    }
    free(y1), free(y2), free(l1), free(l2);
    cudaFree(dy), cudaFree(dy2), cudaFree(dl), cudaFree(dl2);
    inputs_free(&in);
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
    const tkd_attn_mask neg = {-1, NULL, NULL};
    assert_int_equal(tkd_cuda_attn_fwd_masked(d, d, d, 1, 4, 2, 1, 64, &neg, d, l, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("window -1");
    assert_int_equal(tkd_cuda_attn_fwd_simple_masked(d, d, d, 1, 4, 2, 1, 64, &neg, d, l, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("window -1");
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    cudaFree(d), cudaFree(l);
}

static void test_cudnn_errors(void **state)
{
    (void)state;
    if (!g_attn)
        skip();
    uint16_t *d = tkd_test_dev_alloc(4096);
    float *l = tkd_test_dev_alloc(4096);
    assert_int_equal(tkd_cudnn_attn_fwd(g_attn, d, d, d, 1, 4, 2, 1, 76, d, l, NULL), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("head dim 76"); /* not a multiple of 8 (72 is, and cuDNN takes it) */
    assert_int_equal(tkd_cudnn_attn_fwd(g_attn, d, d, d, 1, 4, 2, 1, 512, d, l, NULL), TKD_ERR_UNSUPPORTED);
    assert_int_equal(tkd_cudnn_attn_fwd(g_attn, d, d, d, 1, 4, 6, 4, 64, d, l, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cudnn_attn_fwd(g_attn, d, d, d, 1, -1, 2, 1, 64, d, l, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cudnn_attn_fwd(g_attn, d + 1, d, d, 1, 4, 2, 1, 64, d, l, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cudnn_attn_fwd(g_attn, d, d, d, 1, 4, 2, 1, 64, d, l + 1, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cudnn_attn_fwd(NULL, d, d, d, 1, 4, 2, 1, 64, d, l, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cudnn_attn_fwd(g_attn, d, d, d, 0, 4, 2, 1, 64, d, l, NULL), TKD_OK); /* empty */
    assert_int_equal(tkd_cudnn_attn_fwd(g_attn, d, d, d, 1, 0, 2, 1, 64, d, l, NULL), TKD_OK);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    tkd_cudnn_attn_free(NULL);
    cudaFree(d), cudaFree(l);
}

/* cuDNN where the build and the machine have it: TKD_ERR_UNSUPPORTED leaves g_attn NULL (its runs
 * reported as not available), any other failure fails the group. */
static int group_setup(void **state)
{
    (void)state;
    tkd_status st = tkd_cudnn_attn_create(&g_attn);
    if (st == TKD_ERR_UNSUPPORTED) {
        snprintf(g_no_cudnn, sizeof g_no_cudnn, "%s", tkd_error_msg());
        print_message("cuDNN not available: %s\n", g_no_cudnn);
        g_attn = NULL;
        return 0;
    }
    if (st != TKD_OK)
        print_message("tkd_cudnn_attn_create: %s: %s\n", tkd_status_name(st), tkd_error_msg());
    return st == TKD_OK ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    tkd_cudnn_attn_free(g_attn);
    g_attn = NULL;
    return 0;
}

static const struct CMUnitTest kTests[] = {
    cmocka_unit_test(test_errors),       cmocka_unit_test(test_cudnn_errors), cmocka_unit_test(test_small),
    cmocka_unit_test(test_plan_cache),   cmocka_unit_test(test_large_scores), cmocka_unit_test(test_long),
    cmocka_unit_test(test_simple),       cmocka_unit_test(test_masked),       cmocka_unit_test(test_documents),
};
#endif /* TKD_HAVE_CUDA */

TKD_TEST_GPU_MAIN(kTests, group_setup, group_teardown)
