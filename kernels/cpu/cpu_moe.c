/* cpu_moe.c — see cpu_moe.h. The router is one sgemm and a per-token loop (OpenMP over tokens);
 * the experts run over tokens sorted by expert: gather, two sgemms and the activation, one sgemm
 * down, all in place in the sorted buffers; then each output row gathers its k products. */
#include "kernels/cpu/cpu_moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/mxfp4_codec.h"
#include "kernels/cpu/cpu_ops.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* As cpu_ops.c: below this many element-operations a parallel region costs more than it saves. */
#define TKD_MOE_OMP_MIN_WORK 32768
/* Rows per expert below which the experts run in parallel (single-threaded sgemms each) instead of
 * one after another with OpenBLAS's own threads: small GEMMs do not feed a thread pool. */
#define TKD_MOE_PAR_EXPERT_ROWS 128

struct tkd_cpu_moe_ws {
    tkd_moe_params p;
    int max_tokens;
    float *logits;   /* (max_tokens, E) router logits, then probabilities */
    int32_t *sel;    /* (max_tokens, k) chosen experts, router order */
    float *wts;      /* (max_tokens, k) their weights */
    int32_t *row_of; /* (max_tokens, k) row of (token, slot) in the sorted buffers */
    int32_t *tok_of; /* (max_tokens·k) token of each sorted row */
    int32_t *off;    /* (E + 1) first sorted row of each expert */
    float *xs;       /* (max_tokens·k, D) gathered inputs, then the experts' outputs */
    float *gs;       /* (max_tokens·k, I) gate, then the activation */
    float *us;       /* (max_tokens·k, I) up */
    /* MXFP4 experts (p.mxfp4): one decoded matrix (I·D floats) per thread, and the byte table */
    float *deq;
    int n_deq;
    tkd_mxfp4_lut *lut;
};

void tkd_cpu_swiglu_clamp_fwd(const float *g, const float *u, int64_t n, float limit, float alpha,
                              float *h)
{
#pragma omp parallel for schedule(static) if (n >= TKD_MOE_OMP_MIN_WORK)
    for (int64_t i = 0; i < n; i++) {
        float gc = fminf(g[i], limit);
        float uc = fminf(fmaxf(u[i], -limit), limit);
        h[i] = (uc + 1.0f) * (gc / (1.0f + expf(-alpha * gc)));
    }
}

tkd_status tkd_cpu_moe_ws_create(tkd_cpu_moe_ws **out, const tkd_moe_params *p, int max_tokens)
{
    *out = NULL;
    TKD_TRY(tkd_moe_params_check(p));
    if (max_tokens < 1 || (int64_t)max_tokens * p->k > INT32_MAX)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe: max_tokens %d must lie in 1..%d for k %d",
                             max_tokens, INT32_MAX / p->k, p->k);
    tkd_cpu_moe_ws *ws = calloc(1, sizeof *ws);
    if (!ws)
        return tkd_error_set(TKD_ERR_NOMEM, "moe: out of memory");
    ws->p = *p;
    ws->max_tokens = max_tokens;
    size_t nt = (size_t)max_tokens, rows = nt * (size_t)p->k;
    ws->logits = malloc(sizeof(float) * nt * (size_t)p->E);
    ws->sel = malloc(sizeof(int32_t) * rows);
    ws->wts = malloc(sizeof(float) * rows);
    ws->row_of = malloc(sizeof(int32_t) * rows);
    ws->tok_of = malloc(sizeof(int32_t) * rows);
    ws->off = malloc(sizeof(int32_t) * ((size_t)p->E + 1));
    ws->xs = malloc(sizeof(float) * rows * (size_t)p->D);
    ws->gs = malloc(sizeof(float) * rows * (size_t)p->inter);
    ws->us = malloc(sizeof(float) * rows * (size_t)p->inter);
    if (p->mxfp4) { /* a decoded matrix per thread: the experts may run one per thread */
#ifdef _OPENMP
        ws->n_deq = omp_get_max_threads();
#else
        ws->n_deq = 1;
#endif
        ws->deq = malloc(sizeof(float) * (size_t)ws->n_deq * (size_t)p->inter * (size_t)p->D);
        ws->lut = malloc(sizeof *ws->lut);
        if (ws->lut)
            tkd_mxfp4_lut_init(ws->lut);
    }
    if (!ws->logits || !ws->sel || !ws->wts || !ws->row_of || !ws->tok_of || !ws->off || !ws->xs ||
        !ws->gs || !ws->us || (p->mxfp4 && (!ws->deq || !ws->lut))) {
        tkd_cpu_moe_ws_free(ws);
        return tkd_error_set(TKD_ERR_NOMEM,
                             "moe: out of memory for %d tokens x %d experts each (hidden %d, intermediate %d)",
                             max_tokens, p->k, p->D, p->inter);
    }
    *out = ws;
    return TKD_OK;
}

void tkd_cpu_moe_ws_free(tkd_cpu_moe_ws *ws)
{
    if (!ws)
        return;
    free(ws->logits);
    free(ws->sel);
    free(ws->wts);
    free(ws->row_of);
    free(ws->tok_of);
    free(ws->off);
    free(ws->xs);
    free(ws->gs);
    free(ws->us);
    free(ws->deq);
    free(ws->lut);
    free(ws);
}

/* The k largest of v[0..E) in decreasing order, equal values by increasing index: each pick is the
 * largest entry that comes after the previous pick in that order, so no scratch is needed. */
static void moe_topk_row(const float *v, int E, int k, int32_t *idx)
{
    int prev = -1;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            if (prev >= 0 && !(v[e] < v[prev] || (v[e] == v[prev] && e > prev)))
                continue; /* not after the previous pick */
            if (best < 0 || v[e] > v[best])
                best = e;
        }
        idx[j] = best;
        prev = best;
    }
}

/* softmax in place over v[0..n), max subtracted, in fp32 as torch does with dtype=torch.float */
static void moe_softmax(float *v, int n)
{
    float mx = v[0];
    for (int i = 1; i < n; i++)
        mx = fmaxf(mx, v[i]);
    float s = 0.0f;
    for (int i = 0; i < n; i++) {
        v[i] = expf(v[i] - mx);
        s += v[i];
    }
    for (int i = 0; i < n; i++)
        v[i] /= s;
}

/* One token's routing from its logits row (overwritten): sel and wts, k each. */
static void moe_route_row(const tkd_moe_params *p, float *lg, int32_t *sel, float *wts)
{
    int k = p->k;
    if (p->router == TKD_MOE_ROUTER_SOFTMAX_TOPK) {
        moe_softmax(lg, p->E);
        moe_topk_row(lg, p->E, k, sel);
        float s = 0.0f;
        for (int j = 0; j < k; j++)
            s += (wts[j] = lg[sel[j]]);
        if (p->norm_topk_prob)
            for (int j = 0; j < k; j++)
                wts[j] /= s;
    } else {
        moe_topk_row(lg, p->E, k, sel);
        for (int j = 0; j < k; j++)
            wts[j] = lg[sel[j]];
        moe_softmax(wts, k);
    }
}

/* Counting sort of the (token, slot) pairs by expert, stable (rows of one expert in token order):
 * off (E + 1), tok_of (N·k sorted rows) and row_of (N, k). */
static void moe_sort_by_expert(tkd_cpu_moe_ws *ws, int N)
{
    int E = ws->p.E, k = ws->p.k;
    int32_t *off = ws->off;
    memset(off, 0, sizeof(int32_t) * ((size_t)E + 1));
    for (int64_t s = 0; s < (int64_t)N * k; s++)
        off[ws->sel[s] + 1]++;
    for (int e = 0; e < E; e++)
        off[e + 1] += off[e];
    /* off[e] is now expert e's next free row; shift back afterwards */
    for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) {
            int32_t r = off[ws->sel[(int64_t)n * k + j]]++;
            ws->tok_of[r] = n;
            ws->row_of[(int64_t)n * k + j] = r;
        }
    for (int e = E; e > 0; e--)
        off[e] = off[e - 1];
    off[0] = 0;
}

/* Expert e's matrix of kind j (0 W_gate, 1 W_up, 2 W_down): the act stack's slice, or with MXFP4
 * stacks the slice decoded into this thread's buffer (exact: common/mxfp4_codec.h; the blocks were
 * checked when the model loaded them, so decoding cannot fail here). */
static const float *expert_matrix(const tkd_cpu_moe_ws *ws, const tkd_moe_weights *w, int e, int j)
{
    const tkd_moe_params *p = &ws->p;
    const size_t n = (size_t)p->inter * (size_t)p->D;
    if (!p->mxfp4) {
        const float *s[3] = {w->w_gate, w->w_up, w->w_down};
        return s[j] + (size_t)e * n;
    }
    int t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num() % ws->n_deq;
#endif
    float *dst = ws->deq + (size_t)t * n;
    const int64_t rows = j == 2 ? p->D : p->inter, groups = (j == 2 ? p->inter : p->D) / 32;
    const size_t eb = (size_t)e * (size_t)rows * (size_t)groups;
    (void)tkd_mxfp4_decode_rows(ws->lut, w->q.blocks[j] + eb * 16, w->q.scales[j] + eb, rows, groups, dst, NULL,
                                "moe", e, 0);
    return dst;
}

/* Expert e over its c sorted rows at r0: xs rows in, its output rows out in the same place. */
static void moe_expert(const tkd_cpu_moe_ws *ws, const tkd_moe_weights *w, int e, int64_t r0, int c)
{
    const tkd_moe_params *p = &ws->p;
    int D = p->D, I = p->inter;
    float *x = ws->xs + r0 * D, *g = ws->gs + r0 * I, *u = ws->us + r0 * I;
    tkd_cpu_linear_fwd(x, expert_matrix(ws, w, e, 0), w->b_gate ? w->b_gate + (size_t)e * I : NULL, c, D, I, 0, g);
    tkd_cpu_linear_fwd(x, expert_matrix(ws, w, e, 1), w->b_up ? w->b_up + (size_t)e * I : NULL, c, D, I, 0, u);
    if (p->act == TKD_MOE_ACT_SWIGLU)
        tkd_cpu_swiglu_fwd(g, u, (int64_t)c * I, g);
    else
        tkd_cpu_swiglu_clamp_fwd(g, u, (int64_t)c * I, p->limit, p->alpha, g);
    /* the inputs are spent: the output takes their rows */
    tkd_cpu_linear_fwd(g, expert_matrix(ws, w, e, 2), w->b_down ? w->b_down + (size_t)e * D : NULL, c, I, D, 0, x);
}

static void moe_run_experts(const tkd_cpu_moe_ws *ws, const tkd_moe_weights *w, int N)
{
    int E = ws->p.E;
    const int32_t *off = ws->off;
    if ((int64_t)N * ws->p.k < (int64_t)E * TKD_MOE_PAR_EXPERT_ROWS) {
        /* many small GEMMs: one expert per thread (OpenBLAS runs single-threaded inside) */
#pragma omp parallel for schedule(dynamic, 1)
        for (int e = 0; e < E; e++)
            if (off[e + 1] > off[e])
                moe_expert(ws, w, e, off[e], off[e + 1] - off[e]);
    } else {
        for (int e = 0; e < E; e++)
            if (off[e + 1] > off[e])
                moe_expert(ws, w, e, off[e], off[e + 1] - off[e]);
    }
}

/* y[n] = Σ_j wts[n,j] · out[row_of[n,j]], products in fp32 added in increasing expert order into 0
 * (the order of transformers' index_add_ loop over experts). */
static void moe_combine(const tkd_cpu_moe_ws *ws, int N, float *y)
{
    int D = ws->p.D, k = ws->p.k;
#pragma omp parallel for schedule(static) if ((int64_t)N * k * D >= TKD_MOE_OMP_MIN_WORK)
    for (int n = 0; n < N; n++) {
        const int32_t *sel = ws->sel + (int64_t)n * k, *rows = ws->row_of + (int64_t)n * k;
        const float *wt = ws->wts + (int64_t)n * k;
        float *yr = y + (int64_t)n * D;
        memset(yr, 0, sizeof(float) * (size_t)D);
        int prev = -1;
        for (int j = 0; j < k; j++) {
            int s = -1; /* the slot with the next larger expert: k is small, a scan is enough */
            for (int t = 0; t < k; t++)
                if (sel[t] > prev && (s < 0 || sel[t] < sel[s]))
                    s = t;
            prev = sel[s];
            const float *o = ws->xs + (int64_t)rows[s] * D;
            for (int d = 0; d < D; d++)
                yr[d] += o[d] * wt[s];
        }
    }
}

tkd_status tkd_cpu_moe_fwd(tkd_cpu_moe_ws *ws, const tkd_moe_weights *w, const float *x, int N,
                           float *y, int32_t *experts, float *weights)
{
    const tkd_moe_params *p = &ws->p;
    if (N < 0 || N > ws->max_tokens)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe: %d tokens, the workspace holds 1..%d", N,
                             ws->max_tokens);
    if (N == 0)
        return TKD_OK;
    int D = p->D, E = p->E, k = p->k;
    tkd_cpu_linear_fwd(x, w->router_w, w->router_b, N, D, E, 0, ws->logits);
#pragma omp parallel for schedule(static) if ((int64_t)N * E * k >= TKD_MOE_OMP_MIN_WORK)
    for (int n = 0; n < N; n++)
        moe_route_row(p, ws->logits + (int64_t)n * E, ws->sel + (int64_t)n * k, ws->wts + (int64_t)n * k);
    moe_sort_by_expert(ws, N);
#pragma omp parallel for schedule(static) if ((int64_t)N * k * D >= TKD_MOE_OMP_MIN_WORK)
    for (int64_t r = 0; r < (int64_t)N * k; r++)
        memcpy(ws->xs + r * D, x + (int64_t)ws->tok_of[r] * D, sizeof(float) * (size_t)D);
    moe_run_experts(ws, w, N);
    moe_combine(ws, N, y);
    if (experts)
        memcpy(experts, ws->sel, sizeof(int32_t) * (size_t)N * (size_t)k);
    if (weights)
        memcpy(weights, ws->wts, sizeof(float) * (size_t)N * (size_t)k);
    return TKD_OK;
}

void tkd_moe_from_gpt_oss(int E, int D, int I, const float *gate_up, const float *gate_up_bias,
                          const float *down, float *w_gate, float *w_up, float *b_gate, float *b_up,
                          float *w_down)
{
    for (int e = 0; e < E; e++) {
        const float *gu = gate_up + (size_t)e * D * 2 * I; /* (D, 2I) */
        const float *dn = down + (size_t)e * I * D;        /* (I, D) */
        float *wg = w_gate + (size_t)e * I * D, *wu = w_up + (size_t)e * I * D;
        float *wd = w_down + (size_t)e * D * I;
        for (int d = 0; d < D; d++)
            for (int i = 0; i < I; i++) {
                wg[(size_t)i * D + d] = gu[(size_t)d * 2 * I + 2 * i];
                wu[(size_t)i * D + d] = gu[(size_t)d * 2 * I + 2 * i + 1];
                wd[(size_t)d * I + i] = dn[(size_t)i * D + d];
            }
        if (gate_up_bias)
            for (int i = 0; i < I; i++) {
                b_gate[(size_t)e * I + i] = gate_up_bias[(size_t)e * 2 * I + 2 * i];
                b_up[(size_t)e * I + i] = gate_up_bias[(size_t)e * 2 * I + 2 * i + 1];
            }
    }
}
