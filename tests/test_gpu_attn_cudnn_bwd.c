/* test_gpu_attn_cudnn_bwd.c — is cuDNN's attention backward (tkd_cudnn_attn_bwd, kernels/attn/attn_cudnn.h)
 * as accurate as bf16 arithmetic in a flash backward allows? And are our own flash backward
 * (tkd_cuda_attn_bwd, kernels/attn/attn_cuda.h) and our Hopper wgmma backward (tkd_cuda_attn_bwd_sm90,
 * kernels/attn/attn_bwd_sm90.h; judged only on a compute capability 9.0 device)? All are judged by one
 * rule against CPU references computed here on the same bf16 inputs, the same y (the GPU forward's
 * bf16 output) and every row:
 *
 *   ref64 — the exact gradients in float64: P = exp(S − lse), D_i = Σ_j P_ij·dP_ij (exact),
 *           dS = P ⊙ (dP − D), dQ = c·dS·K, dK = c·Σgroup dSᵀ·Q, dV = Σgroup Pᵀ·dY (c = 1/sqrt(dh)).
 *   emul  — the same maths with the roundings a bf16 flash backward must make (fp32 accumulation
 *           modelled by float64: its ~2^-24 relative error is 2^16 times below bf16's), one flavour
 *           per implementation:
 *     both:  D_i = Σ_d dy_id·y_id from the forward's bf16 y (what both are given; the exact D is not
 *            available to a backward), P rounded to bf16 before dV += Pᵀ·dY, dS rounded to bf16
 *            before the dQ and dK products (tensor cores take bf16 operands), each output rounded to
 *            bf16 once at the end;
 *     ours:  dS = bf16(P ⊙ (dP − D)), c applied to the fp32 dQ and dK accumulators (attn_bwd_cuda.cu);
 *            the GQA group summed in fp32 inside the CTA; the wgmma backward (attn_bwd_sm90.cu) makes
 *            exactly these roundings too (P from the same fp32 formula, the same prep kernel's D), so
 *            it is judged against the same emulation, only its fp32 accumulation order differs;
 *     cuDNN: dS = bf16(c·P ⊙ (dP − D)) and, for GQA, each query head's dK and dV rounded to bf16
 *            before the sum over the group: the order and types our graph declares (attn_cudnn_graph.cu:
 *            "dS·scale" before the bf16 dSᵀ view, the per-head gradient a bf16 virtual tensor, the
 *            sum a reduction). cuDNN's documentation states the SDPA backward's equations and fp32
 *            accumulation (compute type FLOAT) but not where its fused Hopper kernel rounds; what we
 *            assume is the flash-attention practice (Q·Kᵀ and softmax in fp32, P and dS converted to
 *            bf16 for the tensor-core GEMMs) in the graph's order. Should cuDNN round elsewhere, its
 *            errors become a different draw of the same size, which the rule below allows (its
 *            summary line then shows an error ratio away from 1.00; that is information, not a
 *            failure).
 *
 * The rule, per gradient row (dq: one (b, query head, t); dk, dv: one (b, kv head, t)) of dh elements,
 * e = ‖row − ref64 row‖₂:
 *       e_impl ≤ K·e_emul + floor,   K = 2,   floor = FLOOR_ULPS·u·(rss(t) + ‖ref64 row‖) + rss(f),  u = 2^-8,
 * over the row's terms: dq_i: t_j = c·|P_ij·(dP_ij − D_i)|·‖k_j‖ (what rounding dS_ij can move),
 * f_j = c·FP32_DOT·P_ij·‖dy_i‖·(‖v_j‖ + ‖y_i‖)·‖k_j‖ (what fp32 dot products can move dP − D by: row
 * 0's dS is exactly 0 in float64 — dP_00 = D_0 — and fp32 noise on the GPU); dk_j: the same with
 * ‖q_i‖ over the group's (h, i ≥ j); dv_j: t = P_ij·‖dy_i‖; for GQA also the per-head gradients' norms
 * (cuDNN's extra rounding).
 * Why this holds for a correct bf16 backward and fails for one that rounds more:
 *   - An implementation that makes the emulated roundings on the same fp32 values has, row by row,
 *     the emulation's error (fp32 accumulation order flips a rounding only where a value sits
 *     within ~2^-17 of a bf16 midpoint, about 1 in 2^9): e_impl ≈ e_emul, the summary's ratio x1.00.
 *   - One that makes the same number of roundings in another order draws its errors independently.
 *     A row's error is a sum of n independent roundings (n = keys, or queries for dk/dv, plus dh
 *     output roundings); for n ≳ 8 its norm concentrates within ~1/sqrt(2n) ≲ 25 % of its mean, so
 *     a factor 2 is several deviations away.
 *   - Rows of few terms do not concentrate (with two terms, two independent draws differ by more
 *     than 2× one time in five); there the floor decides. A rounding to bf16 errs by at most u·|x|,
 *     so one set of roundings errs by at most u·Σ|t_j| ≤ u·sqrt(n)·rss(t), plus u·‖row‖ from the
 *     output rounding: FLOOR_ULPS = 2 covers two such sets (impl and emul differing in every
 *     rounding) up to n = 4 outright, and beyond that the error (rms ≈ u/sqrt(3) per rounding) would
 *     have to pass 3.5 standard deviations and 2× its twin.
 *   - Checked on the CPU before the GPU saw it, with simulated backwards in fp32 (these roundings in
 *     fp32 arithmetic, so fp32 noise included) on this file's small shapes and T 1000 GQA 7 dh 128:
 *     faithful to the flavour, worst row ratio 0.45 (x1.00); each flavour judged by the other's
 *     emulation (independent draws, and cuDNN's extra per-head rounding present or missing), worst
 *     0.45 (x0.73–1.37); D rounded to bf16 fails (rows with dP ≈ D, ratios 1.8–3.9); an extra
 *     rounding of dQ per 64-key tile or of P before dS passes (x1.1–1.6: bf16 roundings of the same
 *     size, which is what the question allows). A wrong mask, scale or index gives O(1) errors.
 * Also per case: two runs of each backward are bit-identical (cuDNN: deterministic engines only; the
 * GPU resume is bit-exact and must stay so); cuDNN's opt-in non-deterministic backward
 * (tkd_cudnn_attn_set_bwd_nondet: fp32 dQ accumulation) is held to the same rule with cuDNN's
 * flavour where cuDNN offers it (how many elements its two runs differ in is printed, not judged);
 * cuDNN and the wgmma backward write (gradient buffers
 * pre-filled with NaN: an unwritten element is a NaN row) and write nothing past the ends (NaN guard
 * bands); the wgmma backward's bounded pipeline waits did not time out (its error flag). Our flash
 * backward adds into zeroed buffers.
 * On failure the worst rows are printed: b, head, t, number of keys (or queries), e_impl, e_emul, the
 * floor and the rule's ratio, where the row sits in the wgmma kernels' tiling (128-row tile, its
 * consumer warpgroup, warp and row within the warp's 16) and its first elements got vs ref64 vs emul;
 * a summary line per case and implementation gives, per tensor, the worst ratio (≤ 1 passes), both
 * errors' relative norms against ref64 and their ratio.
 * Grouped calls (test_grouped): cuDNN's backward under a lowered workspace budget runs as several
 * calls over groups of batches and kv heads (attn_cudnn.h); each case compares them bit for bit with
 * one call over the whole shape (the groups' plan prefers the one call's engine and knobs, so a
 * difference means the engine computes a head differently in a smaller grid, or an offset or
 * stride is wrong: the message names the element and both engines), and a T not a multiple of 4
 * must stay one call. test_workspace prints cuDNN's workspace per student shape, one call and the
 * calls the default budget makes (plans only: nothing of it is allocated).
 * Shapes: T 1, 17, 65, 129, 256, 257, 300, 333, 1000, 2049 (mostly not multiples of 64 or 128, one
 * past a tile; 256 whole tiles; 257 and 2049 an odd count of 128-row tiles, so a middle tile of
 * the wgmma kernels' pairing runs alone), B 1 and 2,
 * GQA groups 1, 2, 4, 7, dh 64 and 128, q and k std 1 to 3 (peaked softmax). A cuDNN refusal of a
 * case fails it (these are the shapes the student needs) with cuDNN's message. */
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
#include "tests/gpu_testutil.h"
#include "tests/ref64.h"
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/attn/attn_bwd_sm90.h"
#include "kernels/attn/attn_cuda.h"
#include "kernels/attn/attn_cudnn.h"

#define U_BF16 (1.0 / 256.0) /* bf16's unit roundoff: round-to-nearest errs by at most 2^-8·|x| */
#define K_RULE 2.0           /* see the file comment */
#define FLOOR_ULPS 2.0       /* see the file comment */
#define FP32_DOT 0x1p-14      /* an fp32 dot of dh ≤ 128 bf16 pairs errs by ≤ dh·2^-24 = 2^-17 of ‖a‖‖b‖: 8× that */
#define GUARD 4096           /* NaN elements after each cuDNN gradient that must stay NaN */
#define NWORST 5             /* rows printed per tensor on failure */

enum { IMPL_CUDNN, IMPL_OURS, IMPL_WGMMA, IMPL_CUDNN_ND, NIMPL }; /* ND: tkd_cudnn_attn_set_bwd_nondet(1) */
enum { GQ, GK, GV };
static const char *const kImpl[NIMPL] = {"cuDNN", "ours", "wgmma", "cuDNN nondet"};
#define NSHOW 4 /* elements of a worst row printed */
static const char *const kNames[3] = {"dq", "dk", "dv"};

static tkd_cudnn_attn *g_attn;
static int g_wgmma; /* the wgmma backward runs on this device (compute capability 9.0) */

typedef struct bcase {
    const char *what;
    int B, T, H, Hkv, dh;
    float std; /* q, k ~ normal(0, std²); v, dy ~ normal(0, 1) */
    uint64_t seed;
} bcase;

/* The bf16 inputs (t), y from the GPU forward (as floats), row norms. */
typedef struct inputs {
    tkd_test_attn_in t;
    float *y;                          // (B·T, H·dh)
    double *nq_, *nk_, *nv, *ndy, *ny; // ‖q‖, ‖dy‖, ‖y‖ (B·T·H), ‖k‖, ‖v‖ (B·T·Hkv) per dh-row
} inputs;

typedef struct worst_row {
    double ratio, e_impl, e_emul, floor;
    int b, head, t, terms;
    double got[NSHOW], ref[NSHOW], emu[NSHOW]; /* its first elements */
} worst_row;

/* The rule's tally over one case, implementation and tensor. */
typedef struct tally {
    double e2_impl, e2_emul, ref2, max_ratio;
    int64_t rows, n_bad;
    worst_row worst[NWORST]; /* largest ratios first */
} tally;

/* The reference pass's state: the GPU's gradients and the tallies, scratch for one kv group. */
typedef struct refctx {
    const bcase *c;
    const inputs *in;
    const uint16_t *got[NIMPL][3];
    tally tl[NIMPL][3];
    double *s, *dp;          // (T) one query row's scores and dP
    double *dq[3];           // (dh) ref64, ours (unscaled), cuDNN accumulators of one query row
    double *dk[4], *dv[4];   // (T, dh) ref64, ours (unscaled), cuDNN this head, cuDNN the group
    double *tk2, *tv2, *fk2; // (T) Σ t² of dk, dv rows; Σ f² of dk rows (fp32 terms)
    double *hk2, *hv2;       // (T) Σ over heads of ‖per-head row‖² (cuDNN's per-head rounding)
} refctx;

static double bf16r(double x) { return tkd_bf16_to_f32(tkd_f32_to_bf16((float)x)); }

static const float *row_of(const float *x, const bcase *c, int heads, int b, int t, int h)
{
    return tkd_ref64_row(x, c->T, heads, c->dh, b, t, h);
}

static double *norms_of(const float *x, int64_t rows, int dh)
{
    double *n = tkd_test_xmalloc(sizeof(double) * rows);
    for (int64_t r = 0; r < rows; r++)
        n[r] = sqrt(tkd_ref64_dot(x + r * dh, x + r * dh, dh));
    return n;
}

static void inputs_make(inputs *in, const bcase *c)
{
    tkd_test_attn_in_make(&in->t, c->B, c->T, c->H, c->Hkv, c->dh, c->std, c->seed);
    in->y = tkd_test_xmalloc(sizeof(float) * in->t.nq);
    in->ny = NULL; /* gpu_run: the norms of the GPU forward's y */
    in->nq_ = norms_of(in->t.q, in->t.nq / c->dh, c->dh);
    in->ndy = norms_of(in->t.dy, in->t.nq / c->dh, c->dh);
    in->nk_ = norms_of(in->t.k, in->t.nkv / c->dh, c->dh);
    in->nv = norms_of(in->t.v, in->t.nkv / c->dh, c->dh);
}

static void inputs_free(inputs *in)
{
    tkd_test_attn_in_free(&in->t);
    free(in->y), free(in->nq_), free(in->nk_), free(in->nv), free(in->ndy), free(in->ny);
}

/* ---- the GPU side ------------------------------------------------------------------------ */

/* Fails unless two runs' gradients are bit-identical. */
static void check_same_bits(const uint16_t *x, const uint16_t *y, int64_t n, const char *impl, const char *name,
                            const bcase *c)
{
    for (int64_t i = 0; i < n; i++)
        if (x[i] != y[i])
            fail_msg("%s: %s %s: two runs differ at element %lld (0x%04x vs 0x%04x): not deterministic", c->what,
                     impl, name, (long long)i, x[i], y[i]);
}

/* Copies n + GUARD elements back; fails when an element past n is not NaN any more. */
static uint16_t *fetch(const uint16_t *d, int64_t n, const char *impl, const char *name, const bcase *c)
{
    uint16_t *h = tkd_test_xmalloc(2 * (n + GUARD));
    tkd_test_to_host(h, d, 2 * (n + GUARD), NULL);
    for (int i = 0; i < GUARD; i++)
        if (h[n + i] != 0xffff)
            fail_msg("%s: %s wrote %s past its end (element n + %d = 0x%04x)", c->what, impl, name, i, h[n + i]);
    return h;
}

/* One run of backward impl on the device buffers into g (dq, dk, dv), synchronised; fails the case
 * with the implementation's message (and, for wgmma, when a pipeline wait timed out). */
static int run_bwd(int impl, const bcase *c, const uint16_t *dy, const uint16_t *q, const uint16_t *k,
                   const uint16_t *v, const uint16_t *y, const float *lse, uint16_t *const g[3],
                   tkd_cuda_attn_bwd_ws *ws)
{
    tkd_status st;
    if (impl == IMPL_CUDNN || impl == IMPL_CUDNN_ND) {
        tkd_cudnn_attn_set_bwd_nondet(g_attn, impl == IMPL_CUDNN_ND);
        st = tkd_cudnn_attn_bwd(g_attn, dy, q, k, v, y, lse, c->B, c->T, c->H, c->Hkv, c->dh, g[0], g[1], g[2], NULL);
        tkd_cudnn_attn_set_bwd_nondet(g_attn, 0);
        if (st == TKD_ERR_UNSUPPORTED && impl == IMPL_CUDNN_ND) { /* optional: judged where offered */
            printf("  (no non-deterministic cuDNN backward for this shape: %s)\n", tkd_error_msg());
            return 1;
        }
    } else if (impl == IMPL_OURS)
        st = tkd_cuda_attn_bwd(dy, q, k, v, y, lse, c->B, c->T, c->H, c->Hkv, c->dh, g[0], g[1], g[2], ws, NULL);
    else
        st = tkd_cuda_attn_bwd_sm90(dy, q, k, v, y, lse, c->B, c->T, c->H, c->Hkv, c->dh, g[0], g[1], g[2], ws,
                                    NULL);
    if (st == TKD_OK && impl == IMPL_WGMMA)
        st = tkd_cuda_attn_bwd_sm90_check(ws); /* synchronises */
    if (st != TKD_OK)
        fail_msg("%s: %s backward: %s: %s", c->what, kImpl[impl], tkd_status_name(st), tkd_error_msg());
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    return 0;
}

/* Runs the forward (cuDNN's, as training does; our flash kernel where cuDNN refuses it) for y and lse,
 * then each backward twice: got[impl][tensor] host copies of the first run (NULL for wgmma where
 * it does not run), the second compared bit for bit. y (as floats) into in->y. */
static void gpu_run(inputs *in, const bcase *c, uint16_t *got[NIMPL][3])
{
    const int64_t n3[3] = {in->t.nq, in->t.nkv, in->t.nkv};
    uint16_t *q = tkd_test_dev_alloc(2 * in->t.nq), *dy = tkd_test_dev_alloc(2 * in->t.nq);
    uint16_t *y = tkd_test_dev_alloc(2 * in->t.nq);
    uint16_t *k = tkd_test_dev_alloc(2 * in->t.nkv), *v = tkd_test_dev_alloc(2 * in->t.nkv), *g[3];
    float *lse = tkd_test_dev_alloc(4 * in->t.nl);
    tkd_test_to_dev(q, in->t.qb, 2 * in->t.nq), tkd_test_to_dev(dy, in->t.dyb, 2 * in->t.nq);
    tkd_test_to_dev(k, in->t.kb, 2 * in->t.nkv), tkd_test_to_dev(v, in->t.vb, 2 * in->t.nkv);
    tkd_status st = tkd_cudnn_attn_fwd(g_attn, q, k, v, c->B, c->T, c->H, c->Hkv, c->dh, y, lse, NULL);
    if (st == TKD_ERR_UNSUPPORTED) {
        printf("  (cuDNN forward refused, flash forward used: %s)\n", tkd_error_msg());
        st = tkd_cuda_attn_fwd(q, k, v, c->B, c->T, c->H, c->Hkv, c->dh, y, lse, NULL);
    }
    tkd_test_ok(st, "attention forward");
    uint16_t *yh = tkd_test_xmalloc(2 * in->t.nq);
    tkd_test_to_host(yh, y, 2 * in->t.nq, NULL);
    for (int64_t i = 0; i < in->t.nq; i++)
        in->y[i] = tkd_bf16_to_f32(yh[i]);
    free(yh);
    in->ny = norms_of(in->y, in->t.nq / c->dh, c->dh);
    for (int x = 0; x < 3; x++)
        g[x] = tkd_test_dev_alloc(2 * (n3[x] + GUARD));
    tkd_cuda_attn_bwd_ws *ws = NULL;
    tkd_test_ok(tkd_cuda_attn_bwd_ws_create(&ws, c->B, c->T, c->H, c->dh), "flash backward workspace");
    for (int impl = 0; impl < NIMPL; impl++)
        for (int run = 0; run < 2; run++) {
            if (impl == IMPL_WGMMA && !g_wgmma) {
                got[impl][0] = got[impl][1] = got[impl][2] = NULL;
                break;
            }
            for (int x = 0; x < 3; x++) { /* ours adds (zeros first), the others write (NaN first); NaN guards */
                assert_int_equal(cudaMemset(g[x], impl == IMPL_OURS ? 0 : 0xff, 2 * n3[x]), cudaSuccess);
                tkd_test_poison(g[x] + n3[x], 2 * GUARD);
            }
            if (run_bwd(impl, c, dy, q, k, v, y, lse, g, ws)) { /* not offered for this shape */
                got[impl][0] = got[impl][1] = got[impl][2] = NULL;
                break;
            }
            for (int x = 0; x < 3; x++) {
                uint16_t *h = fetch(g[x], n3[x], kImpl[impl], kNames[x], c);
                if (run == 0) {
                    got[impl][x] = h;
                } else if (impl == IMPL_CUDNN_ND) { /* allowed to differ: say how much */
                    int64_t nd = 0;
                    for (int64_t i = 0; i < n3[x]; i++)
                        nd += got[impl][x][i] != h[i];
                    printf("  cuDNN nondet %s: two runs differ in %lld of %lld elements\n", kNames[x], (long long)nd,
                           (long long)n3[x]);
                    free(h);
                } else {
                    check_same_bits(got[impl][x], h, n3[x], kImpl[impl], kNames[x], c);
                    free(h);
                }
            }
        }
    tkd_cuda_attn_bwd_ws_free(ws);
    for (int x = 0; x < 3; x++)
        cudaFree(g[x]);
    cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(dy), cudaFree(y), cudaFree(lse);
}

/* ---- the rule, row by row ------------------------------------------------------------------ */

/* Tallies one row of dh elements: got (bf16) against ref, the flavour's emulation emu. */
static void tally_row(tally *t, const uint16_t *got, const double *emu, const double *ref, int dh, double floor,
                      int b, int head, int row, int terms)
{
    double ei = 0, ee = 0, r2 = 0;
    for (int d = 0; d < dh; d++) {
        const double gi = tkd_bf16_to_f32(got[d]);
        ei += (gi - ref[d]) * (gi - ref[d]), ee += (emu[d] - ref[d]) * (emu[d] - ref[d]), r2 += ref[d] * ref[d];
    }
    t->e2_impl += ei, t->e2_emul += ee, t->ref2 += r2, t->rows++;
    ei = sqrt(ei), ee = sqrt(ee);
    double ratio = ei == 0 ? 0.0 : ei / (K_RULE * ee + floor);
    if (isnan(ratio))
        ratio = INFINITY; /* a NaN or inf in the row */
    t->n_bad += !(ratio <= 1.0);
    t->max_ratio = fmax(t->max_ratio, ratio);
    int at = NWORST;
    while (at > 0 && (t->worst[at - 1].terms == 0 || ratio > t->worst[at - 1].ratio))
        at--;
    if (at == NWORST)
        return;
    memmove(&t->worst[at + 1], &t->worst[at], sizeof(worst_row) * (NWORST - 1 - at));
    worst_row *w = &t->worst[at];
    *w = (worst_row){ratio, ei, ee, floor, b, head, row, terms, {0}, {0}, {0}};
    for (int d = 0; d < NSHOW && d < dh; d++)
        w->got[d] = tkd_bf16_to_f32(got[d]), w->ref[d] = ref[d], w->emu[d] = emu[d];
}

/* Every implementation's row against its flavour: emu[0] ours (and wgmma's: the same roundings), emu[1]
 * cuDNN's, deterministic or not (the same roundings: dQ = bf16(dS)·K summed in fp32 either way) (dh
 * doubles each). */
static void tally_both(refctx *r, int x, int64_t off, const double *ref, double *const emu[2], double floor, int b,
                       int head, int row, int terms)
{
    for (int i = 0; i < NIMPL; i++) /* NULL: not run on this device or shape */
        if (r->got[i][x])
            tally_row(&r->tl[i][x], r->got[i][x] + off, emu[i == IMPL_OURS || i == IMPL_WGMMA ? 0 : 1], ref,
                      r->c->dh, floor, b, head, row, terms);
}

/* Query row i of head h (kv head g) in batch b: scores, P and dP in float64, then every flavour's
 * dS into dq (finished and tallied here) and into the group's dk, dv accumulators (key rows j ≤ i). */
static void query_row(refctx *r, int b, int h, int g, int i)
{
    const bcase *c = r->c;
    const inputs *in = r->in;
    const int dh = c->dh;
    const double sc = 1.0 / sqrt((double)dh);
    const float *qi = row_of(in->t.q, c, c->H, b, i, h), *dyi = row_of(in->t.dy, c, c->H, b, i, h);
    const int64_t qr = ((int64_t)b * c->T + i) * c->H + h; /* row of (B·T, H) */
    double m = -INFINITY, sum = 0, dref = 0, tq2 = 0, fq2 = 0;
    for (int j = 0; j <= i; j++) {
        r->s[j] = tkd_ref64_dot(qi, row_of(in->t.k, c, c->Hkv, b, j, g), dh) * sc;
        r->dp[j] = tkd_ref64_dot(dyi, row_of(in->t.v, c, c->Hkv, b, j, g), dh);
        m = fmax(m, r->s[j]);
    }
    for (int j = 0; j <= i; j++)
        sum += exp(r->s[j] - m);
    const double lse = m + log(sum), dgpu = tkd_ref64_dot(dyi, in->y + qr * dh, dh);
    for (int j = 0; j <= i; j++)
        dref += exp(r->s[j] - lse) * r->dp[j];
    for (int x = 0; x < 3; x++)
        memset(r->dq[x], 0, sizeof(double) * dh);
    for (int j = 0; j <= i; j++) {
        const int64_t kr = ((int64_t)b * c->T + j) * c->Hkv + g; /* row of (B·T, Hkv) */
        const double p = exp(r->s[j] - lse), pb = bf16r(p), ds_u = p * (r->dp[j] - dgpu);
        const double ds = p * (r->dp[j] - dref), ds_o = bf16r(ds_u), ds_c = bf16r(sc * ds_u);
        /* the sizes the floor is made of (file comment): dS's own (its rounding) and fp32's in dP − D */
        const double t = sc * fabs(ds_u), f = sc * FP32_DOT * p * in->ndy[qr] * (in->nv[kr] + in->ny[qr]);
        const float *kj = row_of(in->t.k, c, c->Hkv, b, j, g);
        double *dk0 = r->dk[0] + (int64_t)j * dh, *dk1 = r->dk[1] + (int64_t)j * dh, *dk2 = r->dk[2] + (int64_t)j * dh;
        double *dv0 = r->dv[0] + (int64_t)j * dh, *dv1 = r->dv[1] + (int64_t)j * dh, *dv2 = r->dv[2] + (int64_t)j * dh;
        for (int d = 0; d < dh; d++) {
            r->dq[0][d] += sc * ds * kj[d], r->dq[1][d] += ds_o * kj[d], r->dq[2][d] += ds_c * kj[d];
            dk0[d] += sc * ds * qi[d], dk1[d] += ds_o * qi[d], dk2[d] += ds_c * qi[d];
            dv0[d] += p * dyi[d], dv1[d] += pb * dyi[d], dv2[d] += pb * dyi[d];
        }
        tq2 += (t * in->nk_[kr]) * (t * in->nk_[kr]), fq2 += (f * in->nk_[kr]) * (f * in->nk_[kr]);
        r->tk2[j] += (t * in->nq_[qr]) * (t * in->nq_[qr]), r->fk2[j] += (f * in->nq_[qr]) * (f * in->nq_[qr]);
        r->tv2[j] += (p * in->ndy[qr]) * (p * in->ndy[qr]);
    }
    double rn = 0;
    for (int d = 0; d < dh; d++) {
        rn += r->dq[0][d] * r->dq[0][d];
        r->dq[1][d] = bf16r(sc * r->dq[1][d]), r->dq[2][d] = bf16r(r->dq[2][d]);
    }
    double *const emu[2] = {r->dq[1], r->dq[2]};
    tally_both(r, GQ, qr * dh, r->dq[0], emu, FLOOR_ULPS * U_BF16 * (sqrt(tq2) + sqrt(rn)) + sqrt(fq2), b, h, i,
               i + 1);
}

/* After head h of a group: cuDNN's per-head dK and dV (slot 2) into the group sums (slot 3), rounded
 * to bf16 first when the group has more than one head; slot 2 zeroed for the next head. */
static void head_done(refctx *r)
{
    const bcase *c = r->c;
    const int grp = c->H / c->Hkv;
    for (int64_t j = 0; j < c->T; j++)
        for (int d = 0; d < c->dh; d++) {
            const int64_t e = j * c->dh + d;
            const double hk = r->dk[2][e], hv = r->dv[2][e];
            r->hk2[j] += grp > 1 ? hk * hk : 0.0, r->hv2[j] += grp > 1 ? hv * hv : 0.0;
            r->dk[3][e] += grp > 1 ? bf16r(hk) : hk, r->dv[3][e] += grp > 1 ? bf16r(hv) : hv;
            r->dk[2][e] = r->dv[2][e] = 0.0;
        }
}

/* Finishes and tallies the dk, dv rows of kv head g in batch b. */
static void key_rows(refctx *r, int b, int g)
{
    const bcase *c = r->c;
    const int dh = c->dh, grp = c->H / c->Hkv;
    const double sc = 1.0 / sqrt((double)dh);
    double *ek = tkd_test_xmalloc(sizeof(double) * dh), *ev = tkd_test_xmalloc(sizeof(double) * dh);
    for (int j = 0; j < c->T; j++) {
        const int64_t o = (int64_t)j * dh, off = (((int64_t)b * c->T + j) * c->Hkv + g) * dh;
        double rk = 0, rv = 0;
        for (int d = 0; d < dh; d++) {
            rk += r->dk[0][o + d] * r->dk[0][o + d], rv += r->dv[0][o + d] * r->dv[0][o + d];
            ek[d] = bf16r(sc * r->dk[1][o + d]), ev[d] = bf16r(r->dv[1][o + d]);
            r->dk[3][o + d] = bf16r(r->dk[3][o + d]), r->dv[3][o + d] = bf16r(r->dv[3][o + d]);
        }
        double *const emk[2] = {ek, r->dk[3] + o}, *const emv[2] = {ev, r->dv[3] + o};
        const int terms = (c->T - j) * grp;
        tally_both(r, GK, off, r->dk[0] + o, emk,
                   FLOOR_ULPS * U_BF16 * (sqrt(r->tk2[j]) + sqrt(r->hk2[j]) + sqrt(rk)) + sqrt(r->fk2[j]), b, g, j,
                   terms);
        tally_both(r, GV, off, r->dv[0] + o, emv,
                   FLOOR_ULPS * U_BF16 * (sqrt(r->tv2[j]) + sqrt(r->hv2[j]) + sqrt(rv)), b, g, j, terms);
    }
    free(ek), free(ev);
}

/* The float64 reference and both emulations over every row, tallied against got. */
static void check_rows(refctx *r)
{
    const bcase *c = r->c;
    const int64_t T = c->T, dh = c->dh;
    r->s = tkd_test_xmalloc(sizeof(double) * T), r->dp = tkd_test_xmalloc(sizeof(double) * T);
    for (int x = 0; x < 3; x++)
        r->dq[x] = tkd_test_xmalloc(sizeof(double) * dh);
    for (int x = 0; x < 4; x++)
        r->dk[x] = tkd_test_xmalloc(sizeof(double) * T * dh), r->dv[x] = tkd_test_xmalloc(sizeof(double) * T * dh);
    double **acc[5] = {&r->tk2, &r->tv2, &r->fk2, &r->hk2, &r->hv2};
    for (int x = 0; x < 5; x++)
        *acc[x] = tkd_test_xmalloc(sizeof(double) * T);
    const int grp = c->H / c->Hkv;
    for (int b = 0; b < c->B; b++)
        for (int g = 0; g < c->Hkv; g++) {
            for (int x = 0; x < 4; x++)
                memset(r->dk[x], 0, sizeof(double) * T * dh), memset(r->dv[x], 0, sizeof(double) * T * dh);
            for (int x = 0; x < 5; x++)
                memset(*acc[x], 0, sizeof(double) * T);
            for (int h = g * grp; h < (g + 1) * grp; h++) {
                for (int i = 0; i < c->T; i++)
                    query_row(r, b, h, g, i);
                head_done(r);
            }
            key_rows(r, b, g);
        }
    free(r->s), free(r->dp);
    for (int x = 0; x < 3; x++)
        free(r->dq[x]);
    for (int x = 0; x < 4; x++)
        free(r->dk[x]), free(r->dv[x]);
    for (int x = 0; x < 5; x++)
        free(*acc[x]);
}

/* The summary line of one implementation and, where the rule broke, its worst rows; 1 when it broke. */
static int report(const refctx *r, int impl)
{
    if (!r->got[impl][0])
        return 0; /* wgmma on a device it does not run on */
    printf("  %-5s", kImpl[impl]);
    for (int x = 0; x < 3; x++) {
        const tally *t = &r->tl[impl][x];
        const double den = t->ref2 > 0 ? t->ref2 : 1.0;
        printf(" | %s worst %.2f, err %.1e vs emul %.1e (x%.2f)", kNames[x], t->max_ratio, sqrt(t->e2_impl / den),
               sqrt(t->e2_emul / den), t->e2_emul > 0 ? sqrt(t->e2_impl / t->e2_emul) : 0.0);
    }
    printf("\n");
    int bad = 0;
    for (int x = 0; x < 3; x++) {
        const tally *t = &r->tl[impl][x];
        if (t->n_bad == 0)
            continue;
        bad = 1;
        printf("  %s %s: %lld of %lld rows break e_impl <= %.0f*e_emul + floor; worst:\n", kImpl[impl], kNames[x],
               (long long)t->n_bad, (long long)t->rows, K_RULE);
        for (int w = 0; w < NWORST && t->worst[w].terms; w++) {
            const worst_row *wr = &t->worst[w];
            printf("    b=%d %s=%d t=%d %s=%d: e_impl %.3e e_emul %.3e floor %.3e ratio %.2f\n", wr->b,
                   x == GQ ? "head" : "kv_head", wr->head, wr->t, x == GQ ? "keys" : "queries", wr->terms,
                   wr->e_impl, wr->e_emul, wr->floor, wr->ratio);
            /* where the wgmma kernels hold the row: 128-row tile, consumer warpgroup, warp, row in warp */
            printf("      (wgmma: %s tile %d, warpgroup %d, warp %d, row %d of 16) got / ref64 / emul:", x == GQ ?
                   "query" : "key", wr->t / 128, wr->t % 128 / 64, wr->t % 64 / 16, wr->t % 16);
            for (int d = 0; d < NSHOW; d++)
                printf(" [%d] %.4g / %.4g / %.4g", d, wr->got[d], wr->ref[d], wr->emu[d]);
            printf("\n");
        }
    }
    return bad;
}

static void run_case(const bcase *c)
{
    inputs in;
    uint16_t *got[NIMPL][3];
    inputs_make(&in, c);
    gpu_run(&in, c, got);
    refctx r;
    memset(&r, 0, sizeof r);
    r.c = c, r.in = &in;
    for (int i = 0; i < NIMPL; i++)
        for (int x = 0; x < 3; x++)
            r.got[i][x] = got[i][x];
    check_rows(&r);
    printf("%s (B=%d T=%d H=%d Hkv=%d dh=%d std %.1f): deterministic (two runs each bit-identical)\n", c->what,
           c->B, c->T, c->H, c->Hkv, c->dh, c->std);
    int bad[NIMPL], any = 0;
    for (int i = 0; i < NIMPL; i++)
        any |= bad[i] = report(&r, i);
    for (int i = 0; i < NIMPL; i++)
        for (int x = 0; x < 3; x++)
            free(got[i][x]);
    inputs_free(&in);
    if (any)
        fail_msg("%s: less accurate than bf16 arithmetic explains (rows above):%s%s%s%s", c->what,
                 bad[IMPL_CUDNN] ? " cuDNN's backward" : "", bad[IMPL_OURS] ? " our flash backward" : "",
                 bad[IMPL_WGMMA] ? " our wgmma backward" : "",
                 bad[IMPL_CUDNN_ND] ? " cuDNN's non-deterministic backward" : "");
}

static void run_cases(const bcase *cases, size_t n)
{
    for (size_t i = 0; i < n; i++)
        run_case(&cases[i]);
}

static void test_small(void **state)
{
    (void)state;
    static const bcase cases[] = {
        {"T = 1", 1, 1, 2, 1, 64, 1.0f, 1},
        {"T = 1, B = 2, dh 128", 2, 1, 1, 1, 128, 1.0f, 2},
        {"T = 17, B = 2, GQA 2", 2, 17, 4, 2, 64, 1.5f, 3},
        {"T = 65 (a tile + 1), dh 128", 1, 65, 2, 2, 128, 1.5f, 4},
        {"T = 129, B = 2, GQA 7", 2, 129, 14, 2, 64, 1.0f, 5},
        {"T = 333, GQA 2, dh 128", 1, 333, 8, 4, 128, 1.0f, 6},
        {"T = 300, peaked softmax (std 3)", 1, 300, 2, 1, 64, 3.0f, 7},
        {"T = 256 (two whole tiles), B = 2, GQA 4", 2, 256, 8, 2, 64, 1.0f, 8},
        {"T = 257 (3 key tiles, the last of one key), GQA 4, dh 128", 1, 257, 4, 1, 128, 1.5f, 9},
    };
    run_cases(cases, sizeof cases / sizeof cases[0]);
}

static void test_long(void **state)
{
    (void)state;
    static const bcase cases[] = {
        {"T = 1000, GQA 7, dh 128", 1, 1000, 7, 1, 128, 1.5f, 11},
        {"T = 1000, B = 2, GQA 1", 2, 1000, 2, 2, 64, 1.0f, 12},
        {"T = 2049, GQA 4, dh 128", 1, 2049, 4, 1, 128, 1.0f, 13},
        {"T = 1000, GQA 7, dh 64 (Qwen's group)", 1, 1000, 7, 1, 64, 1.5f, 14},
        /* 9 key tiles × 32 (b, kv head) = 288 wgmma CTAs, more than an H200 holds at once: CTAs wait on
         * dQ counters of CTAs launched before them, never after */
        {"T = 1100, B = 8, GQA 1: more CTAs than SMs", 8, 1100, 4, 4, 64, 1.0f, 15},
        {"T = 700, B = 6, GQA 2, dh 128: more CTAs than SMs", 6, 700, 12, 6, 128, 1.0f, 16},
    };
    run_cases(cases, sizeof cases / sizeof cases[0]);
}

/* Compares got (rows × cols fp32) with ref (float64) column by column; fails naming the product, the
 * first wrong elements and the likely culprit. An fp32 accumulation of ≤ 128 bf16 products errs by
 * ≤ 128·2^-24 of Σ|a·b| (≤ 2^-17 ‖a‖‖b‖); 2^-12 of the row's scale passes any correct path and fails
 * a permutation or a dropped block (O(1) errors). */
static void probe_check(const float *got, const double *ref, const double *scale, int rows, int cols,
                        const char *what, const char *culprit, int dh)
{
    int bad = 0;
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            const double e = fabs(got[i * cols + j] - ref[i * cols + j]);
            if (!(e <= 0x1p-12 * scale[i]) && bad++ < 6)
                printf("  probe dh %d: %s[%d][%d] = %.6g, expected %.6g (row scale %.3g)\n", dh, what, i, j,
                       (double)got[i * cols + j], ref[i * cols + j], scale[i]);
        }
    if (bad)
        fail_msg("probe dh %d: %d of %d elements of %s wrong: suspect %s", dh, bad, rows * cols, what, culprit);
}

/* ---- grouped calls: the workspace bound ---------------------------------------------------- */

static void print_info(const char *what, const tkd_cudnn_attn_bwd_info *i)
{
    printf("  %-34s one call %9.1f MiB (engine %lld) | %2d call(s) of %d batch(es) x %d kv head(s), "
           "%9.1f MiB each (engine %lld)%s\n", what, i->ws_one_call / 1048576.0, (long long)i->one_call_engine,
           i->calls, i->batches, i->kv_heads, i->ws_call / 1048576.0, (long long)i->engine,
           i->nondet ? ", non-deterministic" : "");
}

/* cuDNN's backward of c's inputs under workspace budget (0: none) into fresh host copies g[3],
 * gradients pre-filled with NaN, NaN guard bands after each; *info how it ran. */
static void grouped_run(const bcase *c, const tkd_test_attn_in *t, size_t budget, uint16_t *g[3],
                        tkd_cudnn_attn_bwd_info *info)
{
    const int64_t n3[3] = {t->nq, t->nkv, t->nkv};
    uint16_t *q = tkd_test_dev_alloc(2 * t->nq), *dy = tkd_test_dev_alloc(2 * t->nq);
    uint16_t *y = tkd_test_dev_alloc(2 * t->nq);
    uint16_t *k = tkd_test_dev_alloc(2 * t->nkv), *v = tkd_test_dev_alloc(2 * t->nkv), *d[3];
    float *lse = tkd_test_dev_alloc(4 * t->nl);
    tkd_test_to_dev(q, t->qb, 2 * t->nq), tkd_test_to_dev(dy, t->dyb, 2 * t->nq);
    tkd_test_to_dev(k, t->kb, 2 * t->nkv), tkd_test_to_dev(v, t->vb, 2 * t->nkv);
    tkd_status st = tkd_cudnn_attn_fwd(g_attn, q, k, v, c->B, c->T, c->H, c->Hkv, c->dh, y, lse, NULL);
    if (st == TKD_ERR_UNSUPPORTED)
        st = tkd_cuda_attn_fwd(q, k, v, c->B, c->T, c->H, c->Hkv, c->dh, y, lse, NULL);
    tkd_test_ok(st, "attention forward");
    for (int x = 0; x < 3; x++) {
        d[x] = tkd_test_dev_alloc(2 * (n3[x] + GUARD));
        tkd_test_poison(d[x], 2 * (n3[x] + GUARD));
    }
    tkd_cudnn_attn_set_bwd_budget(g_attn, budget);
    tkd_test_ok(tkd_cudnn_attn_bwd_plan(g_attn, c->B, c->T, c->H, c->Hkv, c->dh, info), "backward plan");
    st = tkd_cudnn_attn_bwd(g_attn, dy, q, k, v, y, lse, c->B, c->T, c->H, c->Hkv, c->dh, d[0], d[1], d[2], NULL);
    tkd_cudnn_attn_set_bwd_budget(g_attn, TKD_CUDNN_ATTN_BWD_BUDGET);
    if (st != TKD_OK)
        fail_msg("%s: cuDNN backward (budget %zu): %s: %s", c->what, budget, tkd_status_name(st), tkd_error_msg());
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    for (int x = 0; x < 3; x++) {
        g[x] = fetch(d[x], n3[x], "cuDNN (grouped)", kNames[x], c);
        cudaFree(d[x]);
    }
    cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(dy), cudaFree(y), cudaFree(lse);
}

/* Fails at the first element where the grouped run's gradient x differs from the one call's,
 * naming its batch, token, head and component and both plans' engines. */
static void check_grouped_bits(const bcase *c, int x, const uint16_t *one, const uint16_t *grp, int64_t n,
                               const tkd_cudnn_attn_bwd_info *ione, const tkd_cudnn_attn_bwd_info *igrp)
{
    const int heads = x == GQ ? c->H : c->Hkv;
    for (int64_t i = 0; i < n; i++) {
        if (one[i] == grp[i])
            continue;
        const int64_t row = i / ((int64_t)heads * c->dh);
        fail_msg("%s: %s differs between one call and %d calls of %d batch(es) x %d kv head(s) at b=%lld t=%lld "
                 "%s=%lld d=%lld: 0x%04x vs 0x%04x (engines %lld and %lld; the same engine should give the "
                 "same bits)", c->what, kNames[x], igrp->calls, igrp->batches, igrp->kv_heads,
                 (long long)(row / c->T), (long long)(row % c->T), x == GQ ? "head" : "kv_head",
                 (long long)(i / c->dh % heads), (long long)(i % c->dh), one[i], grp[i],
                 (long long)ione->engine, (long long)igrp->engine);
    }
}

/* One call (no budget) against grouped calls (budget a third of one call's workspace, then 1 byte:
 * one batch and one kv head per call): the same bits, and grouping happens exactly when split. */
static void grouped_case(const bcase *c, int split)
{
    tkd_test_attn_in t;
    tkd_test_attn_in_make(&t, c->B, c->T, c->H, c->Hkv, c->dh, c->std, c->seed);
    const int64_t n3[3] = {t.nq, t.nkv, t.nkv};
    uint16_t *one[3], *grp[3];
    tkd_cudnn_attn_bwd_info ione, igrp;
    grouped_run(c, &t, 0, one, &ione);
    printf("%s (B=%d T=%d H=%d Hkv=%d dh=%d):\n", c->what, c->B, c->T, c->H, c->Hkv, c->dh);
    print_info("no budget", &ione);
    if (ione.calls != 1)
        fail_msg("%s: %d calls without a budget", c->what, ione.calls);
    if (split && ione.ws_one_call <= 0)
        fail_msg("%s: cuDNN reports no workspace for the deterministic backward: nothing to bound", c->what);
    const size_t budgets[2] = {ione.ws_one_call / 3 > 0 ? (size_t)ione.ws_one_call / 3 : 1, 1};
    for (int bi = 0; bi < 2; bi++) {
        grouped_run(c, &t, budgets[bi], grp, &igrp);
        char what[64];
        snprintf(what, sizeof what, "budget %zu bytes", budgets[bi]);
        print_info(what, &igrp);
        if (split != (igrp.calls > 1))
            fail_msg("%s: %d call(s) under budget %zu, expected %s", c->what, igrp.calls, budgets[bi],
                     split ? "several" : "one (T not a multiple of 4)");
        if (igrp.calls > 1 && (size_t)igrp.ws_call > budgets[bi] && igrp.batches * igrp.kv_heads > 1)
            fail_msg("%s: calls of %lld bytes over budget %zu though they could be smaller", c->what,
                     (long long)igrp.ws_call, budgets[bi]);
        for (int x = 0; x < 3; x++) {
            check_grouped_bits(c, x, one[x], grp[x], n3[x], &ione, &igrp);
            free(grp[x]);
        }
    }
    for (int x = 0; x < 3; x++)
        free(one[x]);
    tkd_test_attn_in_free(&t);
}

static void test_grouped(void **state)
{
    (void)state;
    static const bcase cases[] = {
        {"grouped: B = 2, GQA 2", 2, 256, 8, 4, 64, 1.0f, 21},
        {"grouped: B = 3, GQA 7 (Qwen's heads)", 3, 192, 14, 2, 64, 1.5f, 22},
        {"grouped: GQA 3, dh 128 (the 3B's heads)", 1, 520, 24, 8, 128, 1.0f, 23},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        grouped_case(&cases[i], 1);
    static const bcase odd = {"T = 130 (not a multiple of 4): one call", 2, 130, 4, 2, 64, 1.0f, 24};
    grouped_case(&odd, 0);
}

/* Prints how the backward runs the students' shapes (plans only: nothing runs, nothing of the
 * workspace is allocated) and checks the default budget holds where it can. */
static void test_workspace(void **state)
{
    (void)state;
    static const bcase shapes[] = {
        {"Llama 3.2 1B, T 8192", 1, 8192, 32, 8, 64, 1, 0},
        {"~3B, T 8192", 1, 8192, 24, 8, 128, 1, 0},
        {"~3B, T 32768", 1, 32768, 24, 8, 128, 1, 0},
        {"Qwen2.5-0.5B, 4 x T 4096", 4, 4096, 14, 2, 64, 1, 0},
        {"Llama 3 8B, T 8192", 1, 8192, 32, 8, 128, 1, 0},
    };
    printf("cuDNN's backward workspace (default budget %zu MiB):\n", TKD_CUDNN_ATTN_BWD_BUDGET >> 20);
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const bcase *c = &shapes[i];
        tkd_cudnn_attn_bwd_info info;
        tkd_test_ok(tkd_cudnn_attn_bwd_plan(g_attn, c->B, c->T, c->H, c->Hkv, c->dh, &info), c->what);
        print_info(c->what, &info);
        if ((size_t)info.ws_call > TKD_CUDNN_ATTN_BWD_BUDGET && info.batches * info.kv_heads > 1)
            fail_msg("%s: calls of %lld bytes over the budget though they could be smaller", c->what,
                     (long long)info.ws_call);
    }
}

/* The wgmma paths alone, before any backward runs (tkd_cuda_attn_bwd_sm90_probe): c1 = A·Bᵀ checks
 * TMA, the 128-byte swizzle and the K-major descriptors; c2 = bf16(c1)·B (from the GPU's own c1)
 * checks the register A fragments and the MN-major descriptor. */
static void test_probe(void **state)
{
    (void)state;
    if (!g_wgmma)
        skip();
    for (int dh = 64; dh <= 128; dh += 64) {
        const size_t n = 64 * (size_t)dh; /* elements of A, B and c2 */
        uint16_t *a = tkd_test_rand_bf16(n, 101 + dh, 1.0f), *b = tkd_test_rand_bf16(n, 202 + dh, 1.0f);
        double *af = tkd_test_bf16_to_f64(a, n), *bf = tkd_test_bf16_to_f64(b, n);
        uint16_t *da = tkd_test_dev_alloc(2 * n), *db = tkd_test_dev_alloc(2 * n);
        float *dc1 = tkd_test_dev_alloc(4 * 64 * 64), *dc2 = tkd_test_dev_alloc(4 * n);
        tkd_test_to_dev(da, a, 2 * n), tkd_test_to_dev(db, b, 2 * n);
        tkd_test_poison(dc1, 4 * 64 * 64), tkd_test_poison(dc2, 4 * n);
        tkd_cuda_attn_bwd_ws *ws = NULL;
        tkd_test_ok(tkd_cuda_attn_bwd_ws_create(&ws, 1, 64, 1, dh), "workspace");
        tkd_test_ok(tkd_cuda_attn_bwd_sm90_probe(da, db, dh, dc1, dc2, ws), "probe");
        float *c1 = tkd_test_xmalloc(4 * 64 * 64), *c2 = tkd_test_xmalloc(4 * n);
        tkd_test_to_host(c1, dc1, 4 * 64 * 64, NULL), tkd_test_to_host(c2, dc2, 4 * n, NULL);
        double *r1 = tkd_test_xmalloc(8 * 64 * 64), *r2 = tkd_test_xmalloc(8 * n);
        double s1[64], s2[64];
        for (int i = 0; i < 64; i++) {
            s1[i] = s2[i] = 0;
            for (int j = 0; j < 64; j++) {
                double acc = 0, mag = 0;
                for (int d = 0; d < dh; d++)
                    acc += af[i * dh + d] * bf[j * dh + d], mag += fabs(af[i * dh + d] * bf[j * dh + d]);
                r1[i * 64 + j] = acc, s1[i] = fmax(s1[i], mag);
            }
            for (int d = 0; d < dh; d++) {
                double acc = 0, mag = 0;
                for (int j = 0; j < 64; j++) {
                    const double p = bf16r(c1[i * 64 + j]) * bf[j * dh + d];
                    acc += p, mag += fabs(p);
                }
                r2[i * dh + d] = acc, s2[i] = fmax(s2[i], mag);
            }
        }
        probe_check(c1, r1, s1, 64, 64, "c1 = A·Bᵀ", "the TMA boxes, the 128-byte swizzle or smem_desc (K-major)", dh);
        probe_check(c2, r2, s2, 64, dh, "c2 = bf16(c1)·B",
                    "smem_desc_mn (MN-major B: leading offset = the next 64 columns' box, stride 1024) or "
                    "to_a_frags (accumulator → register A fragments)", dh);
        printf("probe dh %d: both wgmma paths right\n", dh);
        tkd_cuda_attn_bwd_ws_free(ws);
        cudaFree(da), cudaFree(db), cudaFree(dc1), cudaFree(dc2);
        free(a), free(b), free(af), free(bf), free(c1), free(c2), free(r1), free(r2);
    }
}

static void test_errors(void **state)
{
    (void)state;
    uint16_t *p = tkd_test_dev_alloc(4096);
    float *l = tkd_test_dev_alloc(4096);
    assert_int_equal(tkd_cudnn_attn_bwd(g_attn, p, p, p, p, p, l, 1, 8, 3, 2, 64, p, p, p, NULL),
                     TKD_ERR_INVALID_ARG); /* H not a multiple of Hkv */
    assert_int_equal(tkd_cudnn_attn_bwd(g_attn, p, p, p, p, p, l, 1, 8, 2, 2, 60, p, p, p, NULL),
                     TKD_ERR_UNSUPPORTED); /* dh not a multiple of 8 */
    assert_int_equal(tkd_cudnn_attn_bwd(g_attn, p, p, p, p, p, l, 1, 8, 2, 2, 64, p, NULL, p, NULL),
                     TKD_ERR_INVALID_ARG); /* all gradients required */
    assert_int_equal(tkd_cudnn_attn_bwd(g_attn, p, p, p, p, p, l, 0, 8, 2, 2, 64, p, p, p, NULL), TKD_OK);
    if (g_wgmma) { /* the wgmma backward's refusals */
        tkd_cuda_attn_bwd_ws *ws = NULL;
        tkd_test_ok(tkd_cuda_attn_bwd_ws_create(&ws, 1, 8, 3, 64), "workspace");
        assert_int_equal(tkd_cuda_attn_bwd_sm90(p, p, p, p, p, l, 1, 8, 3, 2, 64, p, p, p, ws, NULL),
                         TKD_ERR_INVALID_ARG); /* H not a multiple of Hkv */
        assert_int_equal(tkd_cuda_attn_bwd_sm90(p, p, p, p, p, l, 1, 8, 2, 2, 96, p, p, p, ws, NULL),
                         TKD_ERR_UNSUPPORTED); /* dh 96: the flash backward's */
        assert_int_equal(tkd_cuda_attn_bwd_sm90(p, p, p, p, p, l, 1, 8, 2, 2, 64, NULL, p, p, ws, NULL),
                         TKD_ERR_INVALID_ARG); /* all gradients required */
        assert_int_equal(tkd_cuda_attn_bwd_sm90(p, p, p, p, p, l, 1, 8, 2, 2, 64, p + 1, p, p, ws, NULL),
                         TKD_ERR_INVALID_ARG); /* unaligned */
        assert_int_equal(tkd_cuda_attn_bwd_sm90(p, p, p, p, p, l, 1, 8, 2, 2, 64, p, p, p, NULL, NULL),
                         TKD_ERR_INVALID_ARG); /* no workspace */
        assert_int_equal(tkd_cuda_attn_bwd_sm90(p, p, p, p, p, l, 4, 8, 3, 3, 64, p, p, p, ws, NULL),
                         TKD_ERR_INVALID_ARG); /* workspace made for fewer rows */
        assert_int_equal(tkd_cuda_attn_bwd_sm90(p, p, p, p, p, l, 0, 8, 2, 2, 64, p, p, p, ws, NULL), TKD_OK);
        tkd_cuda_attn_bwd_ws_free(ws);
    }
    cudaFree(p), cudaFree(l);
}
#endif /* TKD_HAVE_CUDA */

int main(void)
{
    tkd_test_require_gpu();
#ifdef TKD_HAVE_CUDA
    tkd_status st = tkd_cudnn_attn_create(&g_attn);
    if (st == TKD_ERR_UNSUPPORTED) {
        printf("skipped: %s\n", tkd_error_msg());
        return 77;
    }
    if (st != TKD_OK) {
        printf("tkd_cudnn_attn_create: %s\n", tkd_error_msg());
        return 1;
    }
    g_wgmma = tkd_cuda_attn_bwd_sm90_supported(64) == TKD_OK;
    if (!g_wgmma)
        printf("wgmma backward not judged here: %s\n", tkd_error_msg());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_probe),
        cmocka_unit_test(test_workspace),
        cmocka_unit_test(test_grouped),
        cmocka_unit_test(test_small),
        cmocka_unit_test(test_long),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tkd_cudnn_attn_free(g_attn);
    return rc;
#else
    return 77;
#endif
}
