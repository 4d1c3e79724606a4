/* topk.c — see topk.h. */
#include "kernels/cpu/topk.h"

#include <math.h>
#include <stdlib.h>

/* The one total order: larger value first, then smaller id. -0.0 == +0.0 under `>` and `==`. */
static int topk_better(float va, uint32_t ia, float vb, uint32_t ib)
{
    return va > vb || (va == vb && ia < ib);
}

tkd_status tkd_topk_check_args(int64_t C, int64_t V, int k, float tau)
{
    if (C < 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "topk: row count C = %lld is negative", (long long)C);
    if (k < 1 || k > TKD_TOPK_MAX_K)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "topk: k = %d is outside [1, %d]; lower k in the config",
                             k, TKD_TOPK_MAX_K);
    if (V < k || V > INT32_MAX)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "topk: vocabulary size V = %lld must be in [k = %d, 2^31 - 1]", (long long)V, k);
    if (!(tau > 0.0f) || !isfinite(tau))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "topk: temperature %g must be finite and > 0", (double)tau);
    return TKD_OK;
}

int tkd_topk_first_nonfinite(const float *logits, int64_t C, int64_t V, int64_t *row, int64_t *col)
{
    for (int64_t r = 0; r < C; r++)
        for (int64_t c = 0; c < V; c++)
            if (!isfinite(logits[r * V + c])) {
                *row = r;
                *col = c;
                return 1;
            }
    return 0;
}

/* Row r (of V values) holds a non-finite value. */
static tkd_status topk_nonfinite(const float *row, int64_t r, int64_t V)
{
    int64_t zero = 0, c = V;
    tkd_topk_first_nonfinite(row, 1, V, &zero, &c);
    return tkd_error_set(TKD_ERR_NUMERIC,
                         "topk: logits row %lld, column %lld is %g: the teacher produced a non-finite "
                         "logit; check the checkpoint's dtype and weights",
                         (long long)r, (long long)c, c < V ? (double)row[c] : 0.0);
}

/* log Σ exp(t/τ) in double, with the max subtracted first. */
static double topk_row_lse(const float *row, int64_t V, double tau, float vmax)
{
    const double m = (double)vmax / tau;
    double s = 0.0;
    for (int64_t v = 0; v < V; v++)
        s += exp((double)row[v] / tau - m);
    return m + log(s);
}

typedef struct topk_pair {
    float v;
    uint32_t i;
} topk_pair;

static int topk_pair_cmp(const void *a, const void *b)
{
    const topk_pair *x = a, *y = b;
    if (topk_better(x->v, x->i, y->v, y->i))
        return -1;
    return topk_better(y->v, y->i, x->v, x->i) ? 1 : 0;
}

tkd_status tkd_topk_ref(const float *logits, int64_t C, int64_t V, int k, float tau,
                        uint32_t *out_idx, float *out_val, float *out_lse)
{
    TKD_TRY(tkd_topk_check_args(C, V, k, tau));
    topk_pair *pairs = malloc((size_t)V * sizeof *pairs);
    if (!pairs)
        return tkd_error_set(TKD_ERR_NOMEM, "topk_ref: cannot allocate %lld pairs", (long long)V);
    for (int64_t r = 0; r < C; r++) {
        const float *row = logits + r * V;
        for (int64_t v = 0; v < V; v++) {
            if (!isfinite(row[v])) {
                free(pairs);
                return topk_nonfinite(row, r, V);
            }
            pairs[v].v = row[v];
            pairs[v].i = (uint32_t)v;
        }
        qsort(pairs, (size_t)V, sizeof *pairs, topk_pair_cmp);
        for (int j = 0; j < k; j++) {
            out_idx[r * k + j] = pairs[j].i;
            out_val[r * k + j] = pairs[j].v;
        }
        out_lse[r] = (float)topk_row_lse(row, V, (double)tau, pairs[0].v);
    }
    free(pairs);
    return TKD_OK;
}

/* Restores the heap property below slot i of a heap whose root holds the WORST entry. */
static void topk_sift_down(uint32_t *idx, float *val, int n, int i)
{
    for (;;) {
        int w = i, l = 2 * i + 1, r = l + 1;
        if (l < n && topk_better(val[w], idx[w], val[l], idx[l]))
            w = l;
        if (r < n && topk_better(val[w], idx[w], val[r], idx[r]))
            w = r;
        if (w == i)
            return;
        float tv = val[i];
        uint32_t ti = idx[i];
        val[i] = val[w];
        idx[i] = idx[w];
        val[w] = tv;
        idx[w] = ti;
        i = w;
    }
}

/* One row: heap of the k best in (idx, val); returns 0, or 1 when a non-finite value was seen.
 * Scanning ids in increasing order, an entry equal to the root is never better (larger id), so
 * `x > root` is the whole admission test. */
static int topk_row_fast(const float *row, int64_t V, int k, uint32_t *idx, float *val, float *vmax)
{
    int bad = 0;
    float m = row[0];
    for (int j = 0; j < k; j++) {
        val[j] = row[j];
        idx[j] = (uint32_t)j;
        bad |= !isfinite(row[j]);
        m = row[j] > m ? row[j] : m;
    }
    for (int j = k / 2 - 1; j >= 0; j--)
        topk_sift_down(idx, val, k, j);
    for (int64_t v = k; v < V; v++) {
        const float x = row[v];
        bad |= !isfinite(x);
        m = x > m ? x : m;
        if (x > val[0]) {
            val[0] = x;
            idx[0] = (uint32_t)v;
            topk_sift_down(idx, val, k, 0);
        }
    }
    /* Heapsort: moving the worst to the back leaves the row sorted best first. */
    for (int n = k - 1; n > 0; n--) {
        float tv = val[0];
        uint32_t ti = idx[0];
        val[0] = val[n];
        idx[0] = idx[n];
        val[n] = tv;
        idx[n] = ti;
        topk_sift_down(idx, val, n, 0);
    }
    *vmax = m;
    return bad;
}

tkd_status tkd_topk_cpu(const float *logits, int64_t C, int64_t V, int k, float tau,
                        uint32_t *out_idx, float *out_val, float *out_lse)
{
    TKD_TRY(tkd_topk_check_args(C, V, k, tau));
    int64_t bad_row = C; /* smallest row with a non-finite value; C = none */
#pragma omp parallel for schedule(dynamic, 1) if (C > 1 && C * V >= 65536)
    for (int64_t r = 0; r < C; r++) {
        const float *row = logits + r * V;
        float vmax;
        if (topk_row_fast(row, V, k, out_idx + r * k, out_val + r * k, &vmax)) {
#pragma omp critical(tkd_topk_bad)
            bad_row = r < bad_row ? r : bad_row;
            continue;
        }
        out_lse[r] = (float)topk_row_lse(row, V, (double)tau, vmax);
    }
    if (bad_row < C)
        return topk_nonfinite(logits + bad_row * V, bad_row, V);
    return TKD_OK;
}
