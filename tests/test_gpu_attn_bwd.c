/* test_gpu_attn_bwd.c — the CUDA causal GQA attention backward (tkd_cuda_attn_bwd,
 * kernels/attn/attn_cuda.h) against a float64 reference of this file on every row (T ≤ 1024) or on
 * sampled rows (the first and last 70, every 97th, both sides of each 64-row boundary), and
 * against tkd_cpu_attn_bwd (fp32, kernels/cpu/cpu_ops.h, fed by tkd_cpu_attn_fwd's (B, H, T, T)
 * probabilities) where that scratch is small. Inputs are rounded to bf16 first; y and lse come
 * from the GPU forward (tkd_cuda_attn_fwd), as in training. Labelled gpu: exits 77 (skipped)
 * where no GPU answers or the build has no CUDA backend.
 *
 * Each case runs the backward four ways and checks:
 *   A: gradients into zeroed dq, dk, dv, followed by NaN guard bands: the guards untouched, every
 *      element finite and within tolerance of the references (below);
 *   B: the same into random bf16 dq, dk, dv: B = init + A up to two bf16 roundings (+= works,
 *      and A's rounding happened once): |B − (init + A)| ≤ 2^-8·(1 + 2^-8)·(|A| + |B|);
 *   C: B again: bit-identical to B (the backward is deterministic: no atomics);
 *   D: (one case) dq alone, then dk and dv alone (the others NULL): bit-identical to B.
 * Unmasked cases also run tkd_cuda_attn_bwd_masked under masks that hide nothing (NULL, window 0,
 * window T, window 2T) from B's init: bit-identical to B (the unmasked kernels).
 *
 * Masked cases (test_masked: tkd_cuda_attn_bwd_masked under a window and packed documents, y and
 * lse from tkd_cuda_attn_fwd_masked under the same mask) run A to D the same way, the references
 * summing over the visible pairs only (query i sees key j iff first_key(i) ≤ j ≤ i, ref64.h; the
 * CPU's through tkd_cpu_attn_sinks_fwd's masked probabilities), and check that the mask matters:
 * the unmasked backward on the same inputs differs from the masked one by more than MASK_MIN_DIFF
 * (relative L2, each gradient), so a kernel that ignored the mask could not pass.
 *
 * Tolerances. The GPU computes S = Q Kᵀ and dP = dY Vᵀ in fp32 from exact bf16 products, P from
 * the forward's fp32 lse, and rounds to bf16: P before dV += Pᵀ dY, dS before dK += dSᵀ Q and
 * dQ += dS K (each term off by ≤ 2^-8 relative, independently), and each output element once. It
 * also takes D_i = Σ_d dy_id·y_id from the forward's bf16 y, off from the exact Σ_j P_ij dP_ij by
 * ~2^-8·‖dy_i ⊙ y_i‖₂ (the same error in every dS_ij of the row). An output element is a sum of
 * such terms, so its error scales with their root-sum-square, not with its value (which can cancel:
 * row 0's dq is exactly 0). The float64 reference gives each gradient row that scale,
 *   dq_i: c·sqrt(Σ_j (P_ij·(|dP_ij| + |D_i| + ‖dy_i ⊙ y_i‖))²·ms(k_j)),
 *   dk_j: c·sqrt(Σ_h Σ_i (P_ij·(|dP_ij| + |D_i| + ‖dy_i ⊙ y_i‖))²·ms(q_i)),
 *   dv_j: sqrt(Σ_h Σ_i P_ij²·ms(dy_i)),
 * (c = 1/sqrt(dh), ms = mean square over d, h over the query heads of the kv head), and the
 * check per element is |Δ| ≤ ATOL·scale + RTOL·|ref|: RTOL for the final bf16 rounding (≤ 2^-8
 * = 3.9e-3 relative), ATOL for the sum of the roundings above. Over a case and tensor,
 * ‖Δ‖₂ / ‖ref‖₂ ≤ NORM_TOL (an indexing error gives O(1)). A numpy model of exactly these
 * roundings (float64 elsewhere; tests/attn_bwd_tol_model.py) on this file's shapes and input
 * scales gave at most 0.58 of the element tolerance (dq; dk 0.38, dv 0.45) and norm ratios ≤ 4.8e-3
 * (2.3e-3 to 4.1e-3 at std ≤ 1.5; the peaked std-3 case is the largest, its dq and dk being small
 * next to their terms). fp32 accumulation, ex2.approx and the fp32 lse add ~1e-6 relative.
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
#include "kernels/backend.h"

#define ATOL 2e-2
#define RTOL 1e-2
#define NORM_TOL 1e-2
#define ROUND2 (1.0 / 256.0 * (1.0 + 1.0 / 256.0)) /* two bf16 roundings, run B against A */
#define INIT_STD 0.5f     /* B's initial dq, dk, dv */
#define GUARD 4096        /* NaN elements after dq, dk, dv that must stay untouched */
#define FULL_ROWS_MAX 1024 /* up to this T the float64 reference checks every row */
#define MASK_MIN_DIFF 0.1  /* masked vs unmasked gradients, relative L2: ≥ 10 × NORM_TOL apart */

typedef struct bcase {
    const char *what;
    int B, T, H, Hkv, dh;
    float std;   /* q and k ~ normal(0, std²); v and dy ~ normal(0, 1) */
    int cpu_ref; /* also against tkd_cpu_attn_bwd (B·H·T² floats of scratch) */
    uint64_t seed;
} bcase;

/* A case's mask on the host: window (0: none) and doc (B·T document starts, NULL: one document per
 * sequence), tkd_attn_mask's meaning. A case run with no hmask at all takes tkd_cuda_attn_bwd. */
typedef struct hmask {
    int window;
    const int32_t *doc;
} hmask;

/* The inputs as bf16-rounded floats and their bits; the shapes' element counts. */
typedef tkd_test_attn_in inputs;

/* Device buffers of one case; dq, dk, dv carry GUARD extra elements. masked: the backward runs
 * through tkd_cuda_attn_bwd_masked under mp (NULL, or &mask: the case's, its doc on the device),
 * else through tkd_cuda_attn_bwd. */
typedef struct dev {
    uint16_t *q, *k, *v, *dy, *y, *dq, *dk, *dv;
    float *lse;
    int32_t *doc;
    int masked;
    tkd_attn_mask mask;
    const tkd_attn_mask *mp;
} dev;

/* One backward's gradients, copied back (nq, nkv, nkv bf16). */
typedef struct grads {
    uint16_t *dq, *dk, *dv;
} grads;

/* float64 row statistics of every (b, h, t): lse, D = Σ_j P dP, ‖dy ⊙ y‖₂; mean squares of the
 * rows of q, dy (B·T·H) and k (B·T·Hkv); the mask they were made under (window 0, doc NULL: none). */
typedef struct stats {
    double *lse, *D, *Dn;
    double *msq, *msdy, *msk;
    int window;
    const int32_t *doc;
} stats;

/* Where an element of dq (B·T, H·dh) or dk, dv (B·T, Hkv·dh) is, for the checker's worst element. */
typedef struct where_ctx {
    const bcase *c;
    int x; /* 0 dq, 1 dk, 2 dv */
} where_ctx;

static const tkd_test_tol kGradTol = {0.0, RTOL, "bf16 output rounding (2^-8 rel), + ATOL·scale: the roundings of P, "
                                                 "dS and D, by the root-sum-square of the row's terms"};

static const char *const kNames[3] = {"dq", "dk", "dv"};

static void inputs_make(inputs *in, const bcase *c)
{
    tkd_test_attn_in_make(in, c->B, c->T, c->H, c->Hkv, c->dh, c->std, c->seed);
}

static void inputs_free(inputs *in) { tkd_test_attn_in_free(in); }

/* Uploads the inputs and runs the GPU forward for y and lse (under m's mask when m is not NULL). */
static void dev_make(dev *d, const inputs *in, const bcase *c, const hmask *m)
{
    d->q = tkd_test_dev_alloc(2 * in->nq), d->dy = tkd_test_dev_alloc(2 * in->nq),
    d->y = tkd_test_dev_alloc(2 * in->nq);
    d->k = tkd_test_dev_alloc(2 * in->nkv), d->v = tkd_test_dev_alloc(2 * in->nkv);
    d->dq = tkd_test_dev_alloc(2 * (in->nq + GUARD));
    d->dk = tkd_test_dev_alloc(2 * (in->nkv + GUARD)), d->dv = tkd_test_dev_alloc(2 * (in->nkv + GUARD));
    d->lse = tkd_test_dev_alloc(sizeof(float) * in->nl);
    tkd_test_to_dev(d->q, in->qb, 2 * in->nq), tkd_test_to_dev(d->dy, in->dyb, 2 * in->nq);
    tkd_test_to_dev(d->k, in->kb, 2 * in->nkv), tkd_test_to_dev(d->v, in->vb, 2 * in->nkv);
    d->doc = NULL;
    if (m && m->doc) {
        d->doc = tkd_test_dev_alloc(sizeof(int32_t) * (size_t)c->B * c->T);
        tkd_test_to_dev(d->doc, m->doc, sizeof(int32_t) * (size_t)c->B * c->T);
    }
    d->masked = m != NULL;
    d->mask = (tkd_attn_mask){m ? m->window : 0, NULL, d->doc};
    d->mp = m ? &d->mask : NULL;
    tkd_status st = tkd_cuda_attn_fwd_masked(d->q, d->k, d->v, c->B, c->T, c->H, c->Hkv, c->dh, d->mp, d->y,
                                             d->lse, NULL);
    if (st != TKD_OK)
        fail_msg("%s: attention forward: %s: %s", c->what, tkd_status_name(st), tkd_error_msg());
}

static void dev_free(dev *d)
{
    cudaFree(d->q), cudaFree(d->k), cudaFree(d->v), cudaFree(d->dy), cudaFree(d->y);
    cudaFree(d->dq), cudaFree(d->dk), cudaFree(d->dv), cudaFree(d->lse), cudaFree(d->doc);
}

static void grads_alloc(grads *g, const inputs *in)
{
    g->dq = tkd_test_xmalloc(2 * in->nq), g->dk = tkd_test_xmalloc(2 * in->nkv),
    g->dv = tkd_test_xmalloc(2 * in->nkv);
}

static void grads_free(grads *g) { free(g->dq), free(g->dk), free(g->dv); }

/* Sets a gradient buffer to init (NULL: zeros) followed by GUARD NaNs. */
static void grad_init(uint16_t *d, const uint16_t *init, int64_t n)
{
    if (init)
        tkd_test_to_dev(d, init, 2 * n);
    else
        assert_int_equal(cudaMemset(d, 0, 2 * n), cudaSuccess);
    assert_int_equal(cudaMemset(d + n, 0xff, 2 * GUARD), cudaSuccess);
}

/* Copies a gradient back and fails when its guard band changed. */
static void grad_fetch(uint16_t *h, const uint16_t *d, int64_t n, const char *name, const bcase *c)
{
    uint16_t *guard = tkd_test_xmalloc(2 * GUARD);
    tkd_test_to_host(h, d, 2 * n, NULL);
    tkd_test_to_host(guard, d + n, 2 * GUARD, NULL);
    for (int i = 0; i < GUARD; i++)
        if (guard[i] != 0xffff)
            fail_msg("%s: %s written past its end (element n + %d = 0x%04x)", c->what, name, i, guard[i]);
    free(guard);
}

/* One backward: dq, dk, dv start at init (a struct of NULLs: zeros); `which` (bits 1 dq, 2 dk,
 * 4 dv) picks the gradients asked for, the others passed as NULL. Results into out. */
static void gpu_backward(const dev *d, const inputs *in, const bcase *c, tkd_cuda_attn_bwd_ws *ws,
                         const grads *init, int which, grads *out)
{
    grad_init(d->dq, init->dq, in->nq);
    grad_init(d->dk, init->dk, in->nkv);
    grad_init(d->dv, init->dv, in->nkv);
    uint16_t *dq = (which & 1) ? d->dq : NULL, *dk = (which & 2) ? d->dk : NULL, *dv = (which & 4) ? d->dv : NULL;
    tkd_status st = d->masked ? tkd_cuda_attn_bwd_masked(d->dy, d->q, d->k, d->v, d->y, d->lse, c->B, c->T, c->H,
                                                         c->Hkv, c->dh, d->mp, dq, dk, dv, ws, NULL)
                              : tkd_cuda_attn_bwd(d->dy, d->q, d->k, d->v, d->y, d->lse, c->B, c->T, c->H, c->Hkv,
                                                  c->dh, dq, dk, dv, ws, NULL);
    if (st != TKD_OK)
        fail_msg("%s: attention backward: %s: %s", c->what, tkd_status_name(st), tkd_error_msg());
    cudaError_t ce = cudaDeviceSynchronize();
    if (ce != cudaSuccess)
        fail_msg("%s: backward kernels failed: %s", c->what, cudaGetErrorString(ce));
    grad_fetch(out->dq, d->dq, in->nq, "dq", c);
    grad_fetch(out->dk, d->dk, in->nkv, "dk", c);
    grad_fetch(out->dv, d->dv, in->nkv, "dv", c);
}

/* ---- float64 reference ------------------------------------------------------------------- */

/* Row t of head h in batch b of a (B·T, heads·dh) tensor. */
static const float *row_of(const float *x, const bcase *c, int heads, int b, int t, int h)
{
    return tkd_ref64_row(x, c->T, heads, c->dh, b, t, h);
}

/* lse, D = Σ_j P_ij dP_ij = dy_i · y_i and ‖dy ⊙ y‖ of query row i of head h in batch b (float64,
 * under s's mask); sc: T doubles of scratch, y: dh doubles. */
static void stats_row(const stats *s, const inputs *in, const bcase *c, int b, int h, int i, double *sc,
                      double *y)
{
    const tkd_ref64_attn a = {c->B, c->T, c->H, c->Hkv, c->dh, in->q, in->k, in->v, s->window, NULL};
    const float *dyi = row_of(in->dy, c, c->H, b, i, h);
    const double lse = tkd_ref64_attn_doc_row(&a, s->doc, b, h, i, y, sc);
    double D = 0.0, dn = 0.0;
    for (int d = 0; d < c->dh; d++)
        D += dyi[d] * y[d], dn += (dyi[d] * y[d]) * (dyi[d] * y[d]);
    const int64_t r = ((int64_t)b * c->H + h) * c->T + i;
    s->lse[r] = lse, s->D[r] = D, s->Dn[r] = sqrt(dn);
}

static double mean_sq(const float *x, int n)
{
    return tkd_ref64_dot(x, x, n) / n;
}

static void stats_make(stats *s, const inputs *in, const bcase *c, const hmask *m)
{
    const int64_t nl = in->nl, nkr = (int64_t)c->B * c->T * c->Hkv;
    s->window = m ? m->window : 0;
    s->doc = m ? m->doc : NULL;
    s->lse = tkd_test_xmalloc(sizeof(double) * nl), s->D = tkd_test_xmalloc(sizeof(double) * nl);
    s->Dn = tkd_test_xmalloc(sizeof(double) * nl);
    s->msq = tkd_test_xmalloc(sizeof(double) * nl), s->msdy = tkd_test_xmalloc(sizeof(double) * nl);
    s->msk = tkd_test_xmalloc(sizeof(double) * nkr);
    for (int64_t r = 0; r < nl; r++) /* row r of (B·T, H) */
        s->msq[r] = mean_sq(in->q + r * c->dh, c->dh), s->msdy[r] = mean_sq(in->dy + r * c->dh, c->dh);
    for (int64_t r = 0; r < nkr; r++)
        s->msk[r] = mean_sq(in->k + r * c->dh, c->dh);
    double *sc = tkd_test_xmalloc(sizeof(double) * c->T), *y = tkd_test_xmalloc(sizeof(double) * c->dh);
    for (int b = 0; b < c->B; b++)
        for (int h = 0; h < c->H; h++)
            for (int i = 0; i < c->T; i++)
                stats_row(s, in, c, b, h, i, sc, y);
    free(sc), free(y);
}

static void stats_free(stats *s)
{
    free(s->lse), free(s->D), free(s->Dn), free(s->msq), free(s->msdy), free(s->msk);
}

/* Whether query i of sequence b sees key j under s's mask (causal, window, documents). */
static int sees(const stats *s, const bcase *c, int b, int i, int j)
{
    return j <= i && j >= tkd_ref64_first_key(s->window, s->doc, c->T, b, i);
}

/* P_ij, dP_ij and the weight P·(|dP| + |D_i| + ‖dy_i ⊙ y_i‖) of one (query i, key j) pair. */
static void pair(const stats *s, const inputs *in, const bcase *c, int b, int h, int i, int j, double *p,
                 double *dp, double *w)
{
    const int g = h / (c->H / c->Hkv);
    const int64_t r = ((int64_t)b * c->H + h) * c->T + i;
    const double sij = tkd_ref64_dot(row_of(in->q, c, c->H, b, i, h), row_of(in->k, c, c->Hkv, b, j, g), c->dh) /
                       sqrt((double)c->dh);
    *p = exp(sij - s->lse[r]);
    *dp = tkd_ref64_dot(row_of(in->dy, c, c->H, b, i, h), row_of(in->v, c, c->Hkv, b, j, g), c->dh);
    *w = *p * (fabs(*dp) + fabs(s->D[r]) + s->Dn[r]);
}

/* dq of query row i, head h, batch b (dh doubles); returns its error scale. */
static double ref_dq(const stats *s, const inputs *in, const bcase *c, int b, int h, int i, double *dq)
{
    const int g = h / (c->H / c->Hkv);
    const double scale = 1.0 / sqrt((double)c->dh), D = s->D[((int64_t)b * c->H + h) * c->T + i];
    double w2 = 0.0;
    for (int d = 0; d < c->dh; d++)
        dq[d] = 0.0;
    for (int j = tkd_ref64_first_key(s->window, s->doc, c->T, b, i); j <= i; j++) {
        double p, dp, w;
        pair(s, in, c, b, h, i, j, &p, &dp, &w);
        const float *kj = row_of(in->k, c, c->Hkv, b, j, g);
        for (int d = 0; d < c->dh; d++)
            dq[d] += scale * p * (dp - D) * kj[d];
        w2 += w * w * s->msk[((int64_t)b * c->T + j) * c->Hkv + g];
    }
    return scale * sqrt(w2);
}

/* dk and dv of key row j, kv head g, batch b (dh doubles each), summed over the group's query
 * heads; their error scales in sk, sv. */
static void ref_dkv(const stats *s, const inputs *in, const bcase *c, int b, int g, int j, double *dk,
                    double *dv, double *sk, double *sv)
{
    const int grp = c->H / c->Hkv;
    const double scale = 1.0 / sqrt((double)c->dh);
    double wk = 0.0, wv = 0.0;
    for (int d = 0; d < c->dh; d++)
        dk[d] = dv[d] = 0.0;
    for (int h = g * grp; h < (g + 1) * grp; h++)
        for (int i = j; i < c->T; i++) {
            double p, dp, w;
            if (!sees(s, c, b, i, j))
                continue;
            pair(s, in, c, b, h, i, j, &p, &dp, &w);
            const int64_t r = ((int64_t)b * c->T + i) * c->H + h; /* row of (B·T, H) */
            const double ds = p * (dp - s->D[((int64_t)b * c->H + h) * c->T + i]);
            const float *qi = in->q + r * c->dh, *dyi = in->dy + r * c->dh;
            for (int d = 0; d < c->dh; d++)
                dk[d] += scale * ds * qi[d], dv[d] += p * dyi[d];
            wk += w * w * s->msq[r], wv += p * p * s->msdy[r];
        }
    *sk = scale * sqrt(wk), *sv = sqrt(wv);
}

/* ---- comparison -------------------------------------------------------------------------- */

static int sampled(int t, int T)
{
    return T <= FULL_ROWS_MAX || t < 70 || t >= T - 70 || t % 97 == 0 || t % 64 == 0 || t % 64 == 63;
}

static void where_grad(char *buf, size_t cap, int64_t i, const void *ctx)
{
    const where_ctx *w = ctx;
    const int heads = w->x ? w->c->Hkv : w->c->H;
    const int64_t row = i / w->c->dh / heads;
    snprintf(buf, cap, "%s[b=%lld t=%lld head=%lld d=%lld]", kNames[w->x], (long long)(row / w->c->T),
             (long long)(row % w->c->T), (long long)(i / w->c->dh % heads), (long long)(i % w->c->dh));
}

/* One gradient row (dh elements of got, bf16, at element offset o) against ref at error scale sc. */
static void note_row(tkd_test_check *k, const uint16_t *got, int64_t o, const double *ref, double sc, int dh)
{
    for (int d = 0; d < dh; d++)
        tkd_test_check_add(k, o + d, tkd_bf16_to_f32(got[o + d]), ref[d], ATOL * sc);
}

/* The GPU's gradients A against the float64 reference (e64) and, when cpu is not NULL, against
 * tkd_cpu_attn_bwd's fp32 ones (ecpu: cpu->dq, dk, dv as floats), on the sampled rows. */
static void check_refs(const grads *A, const stats *s, const inputs *in, const bcase *c, float *const cpu[3],
                       tkd_test_check e64[3], tkd_test_check ecpu[3])
{
    const int dh = c->dh;
    double *r0 = tkd_test_xmalloc(sizeof(double) * dh), *r1 = tkd_test_xmalloc(sizeof(double) * dh);
    double *f = tkd_test_xmalloc(sizeof(double) * dh);
    for (int b = 0; b < c->B; b++)
        for (int t = 0; t < c->T; t++) {
            if (!sampled(t, c->T))
                continue;
            for (int h = 0; h < c->H; h++) {
                const int64_t o = (((int64_t)b * c->T + t) * c->H + h) * dh;
                const double sc = ref_dq(s, in, c, b, h, t, r0);
                note_row(&e64[0], A->dq, o, r0, sc, dh);
                if (cpu) {
                    for (int d = 0; d < dh; d++)
                        f[d] = cpu[0][o + d];
                    note_row(&ecpu[0], A->dq, o, f, sc, dh);
                }
            }
            for (int g = 0; g < c->Hkv; g++) {
                const int64_t o = (((int64_t)b * c->T + t) * c->Hkv + g) * dh;
                double sk, sv;
                ref_dkv(s, in, c, b, g, t, r0, r1, &sk, &sv);
                note_row(&e64[1], A->dk, o, r0, sk, dh);
                note_row(&e64[2], A->dv, o, r1, sv, dh);
                for (int x = 1; cpu && x < 3; x++) {
                    for (int d = 0; d < dh; d++)
                        f[d] = cpu[x][o + d];
                    note_row(&ecpu[x], x == 1 ? A->dk : A->dv, o, f, x == 1 ? sk : sv, dh);
                }
            }
        }
    free(r0), free(r1), free(f);
}

/* tkd_cpu_attn_fwd (tkd_cpu_attn_sinks_fwd under m's mask) + tkd_cpu_attn_bwd on the same inputs:
 * fp32 dq, dk, dv (caller frees). */
static void cpu_grads(const inputs *in, const bcase *c, const hmask *m, float *out[3])
{
    float *att = tkd_test_xmalloc(sizeof(float) * (size_t)c->B * c->H * c->T * c->T);
    float *y = tkd_test_xmalloc(sizeof(float) * in->nq);
    out[0] = calloc((size_t)in->nq, sizeof(float));
    out[1] = calloc((size_t)in->nkv, sizeof(float)), out[2] = calloc((size_t)in->nkv, sizeof(float));
    assert_true(out[0] && out[1] && out[2]);
    if (m)
        tkd_cpu_attn_sinks_fwd(in->q, in->k, in->v, c->B, c->T, c->H, c->Hkv, c->dh, m->window, m->doc, NULL, att,
                               y);
    else
        tkd_cpu_attn_fwd(in->q, in->k, in->v, c->B, c->T, c->H, c->Hkv, c->dh, att, y);
    tkd_cpu_attn_bwd(in->dy, in->q, in->k, in->v, att, c->B, c->T, c->H, c->Hkv, c->dh, out[0], out[1], out[2]);
    free(att), free(y);
}

/* Run B = init + run A up to two bf16 roundings, element by element. */
static void check_accumulate(const uint16_t *a, const uint16_t *bb, const uint16_t *init, int64_t n,
                             const char *name, const bcase *c)
{
    for (int64_t i = 0; i < n; i++) {
        const double av = tkd_bf16_to_f32(a[i]), bv = tkd_bf16_to_f32(bb[i]), iv = tkd_bf16_to_f32(init[i]);
        if (!(fabs(bv - (iv + av)) <= ROUND2 * (fabs(av) + fabs(bv))))
            fail_msg("%s: %s[%lld] += gave %.8g from init %.8g, but the gradient alone is %.8g "
                     "(|diff| %.3g > two bf16 roundings)", c->what, name, (long long)i, bv, iv, av,
                     fabs(bv - (iv + av)));
    }
}

static void check_same_bits(const uint16_t *x, const uint16_t *y, int64_t n, const char *name, const char *what,
                            const bcase *c)
{
    for (int64_t i = 0; i < n; i++)
        if (x[i] != y[i])
            fail_msg("%s: %s[%lld] differs between two runs (%s): 0x%04x vs 0x%04x", c->what, name,
                     (long long)i, what, x[i], y[i]);
}

static void check_finite(const grads *A, const inputs *in, const bcase *c)
{
    const uint16_t *t[3] = {A->dq, A->dk, A->dv};
    for (int x = 0; x < 3; x++)
        for (int64_t i = 0, n = x ? in->nkv : in->nq; i < n; i++)
            if (!isfinite(tkd_bf16_to_f32(t[x][i])))
                fail_msg("%s: %s[%lld] = 0x%04x is not finite", c->what, kNames[x], (long long)i, t[x][i]);
}

/* Prints the case's line and fails when any tensor is out of tolerance against either reference. */
static void report(const bcase *c, const tkd_test_check e64[3], const tkd_test_check ecpu[3], int with_cpu)
{
    char line[400];
    int n = snprintf(line, sizeof line, "%-32s B=%d T=%-5d H=%-2d Hkv=%-2d dh=%-3d:", c->what, c->B, c->T, c->H,
                     c->Hkv, c->dh);
    for (int x = 0; x < 3 && n < (int)sizeof line; x++)
        n += snprintf(line + n, sizeof line - n, " %s err/tol %.3f norm %.1e", kNames[x], e64[x].worst,
                      tkd_test_check_norm(&e64[x]));
    print_message("%s (ref64%s, %s rows)\n", line, with_cpu ? " and cpu" : "",
                  c->T <= FULL_ROWS_MAX ? "all" : "sampled");
    for (int r = 0; r < 1 + with_cpu; r++)
        for (int x = 0; x < 3; x++) {
            const tkd_test_check *k = r ? &ecpu[x] : &e64[x];
            tkd_test_check_end(k);
            if (!(tkd_test_check_norm(k) <= NORM_TOL))
                fail_msg("%s: rel norm %.3g over %g (an indexing error gives O(1))", k->what, tkd_test_check_norm(k),
                         NORM_TOL);
        }
}

/* Unmasked cases: tkd_cuda_attn_bwd_masked under masks that hide nothing (NULL, window 0, window T,
 * window 2T) gives B's bits from the same init. */
static void check_noop_masks(dev *d, const inputs *in, const bcase *c, tkd_cuda_attn_bwd_ws *ws, const grads *init,
                             const grads *Bg, grads *out)
{
    static const char *const names[4] = {"NULL mask", "window 0", "window T", "window 2T"};
    for (int i = 0; i < 4; i++) {
        d->masked = 1, d->mask = (tkd_attn_mask){i == 2 ? c->T : i == 3 ? 2 * c->T : 0, NULL, NULL};
        d->mp = i == 0 ? NULL : &d->mask;
        gpu_backward(d, in, c, ws, init, 7, out);
        check_same_bits(Bg->dq, out->dq, in->nq, "dq", names[i], c);
        check_same_bits(Bg->dk, out->dk, in->nkv, "dk", names[i], c);
        check_same_bits(Bg->dv, out->dv, in->nkv, "dv", names[i], c);
    }
    d->masked = 0, d->mp = NULL;
}

/* Masked cases: the unmasked forward and backward on the same inputs (overwriting y and lse) into
 * zeroed gradients, each of which must differ from the masked A by more than MASK_MIN_DIFF. */
static void check_mask_matters(dev *d, const inputs *in, const bcase *c, tkd_cuda_attn_bwd_ws *ws, const grads *A,
                               grads *U)
{
    const grads zero = {NULL, NULL, NULL};
    tkd_test_ok(tkd_cuda_attn_fwd(d->q, d->k, d->v, c->B, c->T, c->H, c->Hkv, c->dh, d->y, d->lse, NULL),
                "unmasked attention forward");
    d->masked = 0;
    gpu_backward(d, in, c, ws, &zero, 7, U);
    const uint16_t *a[3] = {A->dq, A->dk, A->dv}, *u[3] = {U->dq, U->dk, U->dv};
    for (int x = 0; x < 3; x++) {
        double d2 = 0.0, u2 = 0.0;
        for (int64_t i = 0, n = x ? in->nkv : in->nq; i < n; i++) {
            const double av = tkd_bf16_to_f32(a[x][i]), uv = tkd_bf16_to_f32(u[x][i]);
            d2 += (av - uv) * (av - uv), u2 += uv * uv;
        }
        const double rel = sqrt(d2 / (u2 > 0 ? u2 : 1.0));
        print_message("%s: %s masked vs unmasked: relative L2 difference %.3g\n", c->what, kNames[x], rel);
        if (!(rel > MASK_MIN_DIFF))
            fail_msg("%s: %s under the mask is within %.3g of the unmasked backward's (need > %g): the mask "
                     "changed nothing", c->what, kNames[x], rel, MASK_MIN_DIFF);
    }
}

/* Runs A, B, C (and D when `subsets`) and every check of the file comment; m: the case's mask (NULL:
 * unmasked, through tkd_cuda_attn_bwd). */
static void run_case(const bcase *c, const hmask *m, tkd_cuda_attn_bwd_ws *ws, int subsets)
{
    inputs in;
    dev d;
    stats s;
    grads zero = {NULL, NULL, NULL}, init, A, Bg, C;
    inputs_make(&in, c);
    dev_make(&d, &in, c, m);
    grads_alloc(&init, &in), grads_alloc(&A, &in), grads_alloc(&Bg, &in), grads_alloc(&C, &in);
    float *tmp = tkd_test_xmalloc(sizeof(float) * (in.nq > in.nkv ? in.nq : in.nkv));
    tkd_test_fill_bf16(tmp, init.dq, in.nq, c->seed * 5 + 5, INIT_STD);
    tkd_test_fill_bf16(tmp, init.dk, in.nkv, c->seed * 7 + 6, INIT_STD);
    tkd_test_fill_bf16(tmp, init.dv, in.nkv, c->seed * 11 + 7, INIT_STD);
    free(tmp);

    gpu_backward(&d, &in, c, ws, &zero, 7, &A);
    gpu_backward(&d, &in, c, ws, &init, 7, &Bg);
    gpu_backward(&d, &in, c, ws, &init, 7, &C);
    check_finite(&A, &in, c);
    check_same_bits(Bg.dq, C.dq, in.nq, "dq", "same inputs", c);
    check_same_bits(Bg.dk, C.dk, in.nkv, "dk", "same inputs", c);
    check_same_bits(Bg.dv, C.dv, in.nkv, "dv", "same inputs", c);
    check_accumulate(A.dq, Bg.dq, init.dq, in.nq, "dq", c);
    check_accumulate(A.dk, Bg.dk, init.dk, in.nkv, "dk", c);
    check_accumulate(A.dv, Bg.dv, init.dv, in.nkv, "dv", c);
    if (subsets) {
        gpu_backward(&d, &in, c, ws, &init, 1, &C);
        check_same_bits(Bg.dq, C.dq, in.nq, "dq", "dq alone vs all three", c);
        check_same_bits(C.dk, init.dk, in.nkv, "dk", "dk = NULL left it alone", c);
        gpu_backward(&d, &in, c, ws, &init, 6, &C);
        check_same_bits(Bg.dk, C.dk, in.nkv, "dk", "dk and dv alone vs all three", c);
        check_same_bits(Bg.dv, C.dv, in.nkv, "dv", "dk and dv alone vs all three", c);
        check_same_bits(C.dq, init.dq, in.nq, "dq", "dq = NULL left it alone", c);
    }
    if (m)
        check_mask_matters(&d, &in, c, ws, &A, &C);
    else
        check_noop_masks(&d, &in, c, ws, &init, &Bg, &C);
    dev_free(&d);

    tkd_test_check e64[3], ecpu[3];
    char what[2][3][160];
    where_ctx wc[3] = {{c, 0}, {c, 1}, {c, 2}};
    for (int x = 0; x < 3; x++) {
        snprintf(what[0][x], sizeof what[0][x], "%s: %s against ref64", c->what, kNames[x]);
        snprintf(what[1][x], sizeof what[1][x], "%s: %s against cpu", c->what, kNames[x]);
        tkd_test_check_begin(&e64[x], what[0][x], kGradTol, where_grad, &wc[x]);
        tkd_test_check_begin(&ecpu[x], what[1][x], kGradTol, where_grad, &wc[x]);
    }
    float *cpu[3] = {NULL, NULL, NULL};
    const int with_cpu = c->cpu_ref && c->T <= FULL_ROWS_MAX;
    if (with_cpu)
        cpu_grads(&in, c, m, cpu);
    stats_make(&s, &in, c, m);
    check_refs(&A, &s, &in, c, with_cpu ? cpu : NULL, e64, ecpu);
    report(c, e64, ecpu, with_cpu);
    stats_free(&s);
    free(cpu[0]), free(cpu[1]), free(cpu[2]);
    grads_free(&init), grads_free(&A), grads_free(&Bg), grads_free(&C);
    inputs_free(&in);
}

/* Runs cases through one workspace sized for the largest of them (smaller calls reuse it); masks
 * (NULL: every case unmasked) holds case i's mask at i. */
static void run_cases(const bcase *cases, const hmask *masks, size_t n, int subsets_first)
{
    int B = 1, T = 1, H = 1;
    for (size_t i = 0; i < n; i++) {
        B = cases[i].B > B ? cases[i].B : B, T = cases[i].T > T ? cases[i].T : T;
        H = cases[i].H > H ? cases[i].H : H;
    }
    tkd_cuda_attn_bwd_ws *ws = NULL;
    tkd_status st = tkd_cuda_attn_bwd_ws_create(&ws, B, T, H, 128);
    if (st != TKD_OK)
        fail_msg("workspace: %s: %s", tkd_status_name(st), tkd_error_msg());
    for (size_t i = 0; i < n; i++)
        run_case(&cases[i], masks ? &masks[i] : NULL, ws, subsets_first && i == 0);
    tkd_cuda_attn_bwd_ws_free(ws);
}

/* Every row against float64 and the CPU's fp32 backward. */
static void test_small(void **state)
{
    static const bcase cases[] = {
        {"T = 17, B = 2, GQA 2, dh 64", 2, 17, 4, 2, 64, 1.5f, 1, 2},
        {"T = 1", 1, 1, 2, 1, 64, 1.0f, 1, 1},
        {"T = 1, dh 128, GQA 1", 1, 1, 1, 1, 128, 1.0f, 1, 10},
        {"T = 65 (one key past a tile), dh 128", 1, 65, 2, 2, 128, 1.5f, 1, 3},
        {"T = 1000, GQA 7, dh 128", 1, 1000, 7, 1, 128, 1.5f, 1, 4},
        {"T = 1000, B = 2, GQA 1, dh 64", 2, 1000, 2, 2, 64, 1.0f, 1, 5},
        {"T = 333, GQA 3, dh 80", 1, 333, 6, 2, 80, 1.5f, 1, 6},
        {"T = 200, B = 2, GQA 2, dh 48", 2, 200, 4, 2, 48, 1.5f, 1, 7},
        {"T = 129, GQA 1, dh 96", 1, 129, 3, 3, 96, 1.5f, 1, 8},
        {"T = 128 (one full tile), GQA 2, dh 64", 1, 128, 2, 1, 64, 1.5f, 1, 13},
        {"T = 300, peaked softmax (std 3)", 1, 300, 2, 1, 64, 3.0f, 1, 9},
    };
    (void)state;
    run_cases(cases, NULL, sizeof cases / sizeof cases[0], 1);
}

/* T 4097: the float64 reference on sampled rows (the CPU's (T, T) scratch would be 2 GB). */
static void test_long(void **state)
{
    static const bcase cases[] = {
        {"T = 4097, GQA 2, dh 128", 1, 4097, 4, 2, 128, 1.5f, 0, 11},
        {"T = 4097, B = 2, GQA 2, dh 64", 2, 4097, 2, 1, 64, 1.0f, 0, 12},
    };
    (void)state;
    run_cases(cases, NULL, sizeof cases / sizeof cases[0], 0);
}

/* A masked case: the shape, the window (0: none) and, when docs, each sequence's document starts (0
 * first, ended by -1; tkd_test_doc_starts). */
typedef struct mcase {
    bcase c;
    int window, docs;
    int starts[2][12];
} mcase;

/* tkd_cuda_attn_bwd_masked on every row against float64 and the CPU's masked fp32 backward: T not a
 * multiple of the 64/128-row tiles, GQA 4, dh 48 to 128, documents of one token (first rows, a
 * tile's last and next-first rows, the last row), documents across 64- and 128-row tile edges and
 * starting exactly on them, different cuts per sequence, a window of 1 (only the diagonal), windows
 * across tiles, window and documents together, and whole key and query tiles skipped (T 1000). The
 * first case also runs dq alone and dk, dv alone (D). */
static void test_masked(void **state)
{
    static const mcase cases[] = {
        {{"docs: B 2, cuts differ, GQA 4, dh 64", 2, 300, 8, 2, 64, 1.5f, 1, 21}, 0, 1,
         {{0, 1, 2, 60, 61, 127, 128, 129, 200, 299, -1}, {0, 150, 151, -1}}},
        {{"window 1, GQA 4, dh 128", 1, 200, 4, 1, 128, 1.5f, 1, 22}, 1, 0, {{-1}, {-1}}},
        {{"window 37 + docs on tile edges, dh 128", 2, 333, 8, 2, 128, 1.5f, 1, 23}, 37, 1,
         {{0, 5, 140, 141, 270, -1}, {0, 64, 192, 256, -1}}},
        {{"docs of 16 and 1, dh 96", 1, 129, 4, 1, 96, 1.5f, 1, 24}, 0, 1,
         {{0, 16, 32, 33, 48, 64, 80, 96, 112, 128, -1}, {-1}}},
        {{"window 130, B 2, GQA 4, dh 48", 2, 270, 8, 2, 48, 1.5f, 1, 25}, 130, 0, {{-1}, {-1}}},
        {{"window 80, GQA 2, dh 80", 1, 257, 4, 2, 80, 1.5f, 1, 27}, 80, 0, {{-1}, {-1}}},
        {{"window 200 + docs, T 1000, dh 64", 1, 1000, 4, 1, 64, 1.0f, 1, 26}, 200, 1,
         {{0, 300, 301, 700, -1}, {-1}}},
    };
    enum { N = sizeof cases / sizeof cases[0] };
    bcase shapes[N];
    hmask masks[N];
    int32_t *docs[N];
    (void)state;
    for (int i = 0; i < N; i++) {
        const bcase *c = &cases[i].c;
        shapes[i] = *c;
        docs[i] = NULL;
        if (cases[i].docs) {
            docs[i] = tkd_test_xmalloc(sizeof(int32_t) * (size_t)c->B * c->T);
            tkd_test_doc_starts(&cases[i].starts[0][0], 12, c->B, c->T, docs[i]);
        }
        masks[i] = (hmask){cases[i].window, docs[i]};
    }
    run_cases(shapes, masks, N, 1);
    for (int i = 0; i < N; i++)
        free(docs[i]);
}

/* One case of test_backend_masked: the CUDA backend's attn_bwd (which overwrites dq, dk, dv) from
 * NaN-filled gradients against tkd_cuda_attn_bwd_masked from zeroed ones, bit for bit. starts: B
 * lists of 8 document starts (tkd_test_doc_starts), or NULL. */
static void backend_case(tkd_backend *be, const bcase *c, int window, const int *starts)
{
    inputs in;
    dev d;
    grads zero = {NULL, NULL, NULL}, want, got;
    int32_t *doc = NULL;
    if (starts) {
        doc = tkd_test_xmalloc(sizeof(int32_t) * (size_t)c->B * c->T);
        tkd_test_doc_starts(starts, 8, c->B, c->T, doc);
    }
    const hmask m = {window, doc};
    tkd_cuda_attn_bwd_ws *ws = NULL;
    tkd_test_ok(tkd_cuda_attn_bwd_ws_create(&ws, c->B, c->T, c->H, c->dh), "flash backward workspace");
    inputs_make(&in, c);
    dev_make(&d, &in, c, &m);
    grads_alloc(&want, &in), grads_alloc(&got, &in);
    gpu_backward(&d, &in, c, ws, &zero, 7, &want);
    tkd_test_poison(d.dq, 2 * (in.nq + GUARD)), tkd_test_poison(d.dk, 2 * (in.nkv + GUARD));
    tkd_test_poison(d.dv, 2 * (in.nkv + GUARD));
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess); /* the backend's stream may not wait for the memsets */
    tkd_test_ok(be->op->attn_bwd(be, d.dy, d.q, d.k, d.v, d.y, d.lse, c->B, c->T, c->H, c->Hkv, c->dh, window, d.doc,
                                 d.dq, d.dk, d.dv),
                "backend attn_bwd");
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    grad_fetch(got.dq, d.dq, in.nq, "dq", c), grad_fetch(got.dk, d.dk, in.nkv, "dk", c);
    grad_fetch(got.dv, d.dv, in.nkv, "dv", c);
    check_same_bits(want.dq, got.dq, in.nq, "dq", "backend vs tkd_cuda_attn_bwd_masked", c);
    check_same_bits(want.dk, got.dk, in.nkv, "dk", "backend vs tkd_cuda_attn_bwd_masked", c);
    check_same_bits(want.dv, got.dv, in.nkv, "dv", "backend vs tkd_cuda_attn_bwd_masked", c);
    dev_free(&d);
    grads_free(&want), grads_free(&got);
    inputs_free(&in);
    tkd_cuda_attn_bwd_ws_free(ws);
    free(doc);
}

/* The CUDA backend routes a window shorter than T or packed documents to tkd_cuda_attn_bwd_masked
 * where it takes the head size (not the simple kernel, whose bits differ), and keeps its op's
 * contract: the gradients are overwritten (NaN before the call would survive an add). */
static void test_backend_masked(void **state)
{
    static const int starts[2][8] = {{0, 3, 70, 71, 130, -1}, {0, 128, -1}};
    static const bcase docs = {"backend: window 50 + docs, dh 64", 2, 200, 4, 1, 64, 1.5f, 0, 31};
    static const bcase window = {"backend: window 9, dh 128", 1, 150, 4, 2, 128, 1.5f, 0, 32};
    tkd_backend *be = NULL;
    (void)state;
    tkd_test_ok(tkd_backend_open(TKD_DEVICE_CUDA, 0, &be), "CUDA backend");
    assert_int_equal(be->attn_docs_bwd, 1);
    assert_int_equal(be->attn_window_bwd, 1);
    backend_case(be, &docs, 50, &starts[0][0]);
    backend_case(be, &window, 9, NULL);
    tkd_backend_close(be);
}

static void test_errors(void **state)
{
    (void)state;
    uint16_t *d = tkd_test_dev_alloc(1 << 16);
    float *l = tkd_test_dev_alloc(1 << 16);
    tkd_cuda_attn_bwd_ws *ws = NULL;
    assert_int_equal(tkd_cuda_attn_bwd_ws_create(&ws, 1, 64, 2, 72), TKD_ERR_UNSUPPORTED);
    assert_null(ws);
    tkd_test_assert_msg_has("head dim 72");
    assert_int_equal(tkd_cuda_attn_bwd_ws_create(&ws, 1, 0, 2, 64), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_attn_bwd_ws_create(&ws, 1, 64, 2, 64), TKD_OK);
    assert_int_equal(tkd_cuda_attn_bwd(d, d, d, d, d, l, 1, 4, 2, 1, 32, d, d, d, ws, NULL), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("head dim 32");
    assert_int_equal(tkd_cuda_attn_bwd(d, d, d, d, d, l, 1, 4, 6, 4, 64, d, d, d, ws, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_attn_bwd(d, d, d, d, d, l, 1, -1, 2, 1, 64, d, d, d, ws, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_attn_bwd(d, d, d, d, d + 1, l, 1, 4, 2, 1, 64, d, d, d, ws, NULL),
                     TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_attn_bwd(d, d, d, d, d, l, 1, 4, 2, 1, 64, d, d, d, NULL, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_attn_bwd(d, d, d, d, d, NULL, 1, 4, 2, 1, 64, d, d, d, ws, NULL), TKD_ERR_INVALID_ARG);
    /* made for B·H·ceil(T/128) = 2 tiles of 128 rows; T = 129 needs 4 */
    assert_int_equal(tkd_cuda_attn_bwd(d, d, d, d, d, l, 1, 129, 2, 1, 64, d, d, d, ws, NULL),
                     TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("workspace too small");
    assert_int_equal(tkd_cuda_attn_bwd(d, d, d, d, d, l, 0, 4, 2, 1, 64, d, d, d, ws, NULL), TKD_OK);
    assert_int_equal(tkd_cuda_attn_bwd(d, d, d, d, d, l, 1, 4, 2, 1, 64, NULL, NULL, NULL, ws, NULL), TKD_OK);
    const tkd_attn_mask sinks = {0, l, NULL}, negative = {-1, NULL, NULL};
    assert_int_equal(tkd_cuda_attn_bwd_masked(d, d, d, d, d, l, 1, 4, 2, 1, 64, &sinks, d, d, d, ws, NULL),
                     TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("tkd_cuda_attn_bwd_masked: attention sinks are not supported");
    assert_int_equal(tkd_cuda_attn_bwd_masked(d, d, d, d, d, l, 1, 4, 2, 1, 64, &negative, d, d, d, ws, NULL),
                     TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("tkd_cuda_attn_bwd_masked: window -1 < 0");
    assert_int_equal(tkd_cuda_attn_bwd_masked(d, d, d, d, d, l, 1, 4, 2, 1, 32, &negative, d, d, d, ws, NULL),
                     TKD_ERR_INVALID_ARG); /* the mask is checked first */
    assert_int_equal(tkd_cuda_attn_bwd_masked(d, d, d, d, d, l, 1, 4, 2, 1, 32, NULL, d, d, d, ws, NULL),
                     TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("head dim 32");
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    tkd_cuda_attn_bwd_ws_free(ws);
    tkd_cuda_attn_bwd_ws_free(NULL);
    cudaFree(d), cudaFree(l);
}

static const struct CMUnitTest kTests[] = {
    cmocka_unit_test(test_errors),
    cmocka_unit_test(test_small),
    cmocka_unit_test(test_long),
    cmocka_unit_test(test_masked),
    cmocka_unit_test(test_backend_masked),
};
#endif /* TKD_HAVE_CUDA */

TKD_TEST_GPU_MAIN(kTests, NULL, NULL)
