/* tail_sample.c — see tail_sample.h. */
#include "kernels/cpu/tail_sample.h"

#include <stdlib.h>

#include "common/ctr_rng.h"
#include "kernels/cpu/topk.h"

tkd_status tkd_tail_sample_check_args(int64_t C, int64_t V, int k, float tau, int S)
{
    if (C < 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tail_sample: row count C = %lld is negative",
                             (long long)C);
    if (k < 1 || k > TKD_TOPK_MAX_K)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tail_sample: k = %d is outside [1, %d]", k,
                             TKD_TOPK_MAX_K);
    if (V <= k || V > TKD_TAIL_MAX_V)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "tail_sample: vocabulary size V = %lld must be in (k = %d, %d]: the tail "
                             "outside the top-k must be non-empty", (long long)V, k, TKD_TAIL_MAX_V);
    if (S < 0 || S > TKD_TAIL_MAX_S)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "tail_sample: tail_samples = %d is outside [0, %d]; lower it in the config",
                             S, TKD_TAIL_MAX_S);
    if (!(tau > 0.0f) || !isfinite(tau))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tail_sample: temperature %g must be finite and > 0",
                             (double)tau);
    return TKD_OK;
}

typedef struct tail_target {
    uint64_t t; /* target in [0, W) */
    uint32_t j; /* draw number */
} tail_target;

static int tail_target_cmp(const void *a, const void *b)
{
    const tail_target *x = a, *y = b;
    if (x->t != y->t)
        return x->t < y->t ? -1 : 1;
    return x->j < y->j ? -1 : (x->j > y->j);
}

/* Sorted copy of the row's top-k ids into ex[0..k). Returns 0, or 1 when an id is ≥ V. */
static int tail_excluded(const uint32_t *idx, int k, int64_t V, uint32_t *ex)
{
    for (int i = 0; i < k; i++) {
        uint32_t x = idx[i];
        if (x >= (uint64_t)V)
            return 1;
        int j = i;
        for (; j > 0 && ex[j - 1] > x; j--)
            ex[j] = ex[j - 1];
        ex[j] = x;
    }
    return 0;
}

/* Status of one row: 0 ok, 1 bad top-k id, 2 non-finite logit.
 * The weights use fma, which is exactly rounded whether the processor does it or libm does;
 * the "fma" clone (picked at load time on processors that have it) inlines the instruction
 * instead of calling libm for every term, several times faster with the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("fma", "default")))
#endif
static int tail_row(const float *row, int64_t V, const uint32_t *topk, int k, double tau, int S,
                    uint64_t seed, int64_t seq, int32_t pos, uint32_t *out)
{
    uint32_t ex[TKD_TOPK_MAX_K];
    tail_target tg[TKD_TAIL_MAX_S];
    if (tail_excluded(topk, k, V, ex))
        return 1;
    /* Pass 1: the largest tail logit (exact, order-free). The walk over the sorted ids skips
     * the top-k, duplicates included. */
    float m = -INFINITY;
    int e = 0, bad = 0;
    for (int64_t v = 0; v < V; v++) {
        bad |= !isfinite(row[v]);
        while (e < k && ex[e] < v)
            e++;
        if (e < k && ex[e] == v)
            continue;
        m = row[v] > m ? row[v] : m;
    }
    if (bad)
        return 2;
    /* Pass 2: W = Σ w_v over the tail (integer, so exact). */
    uint64_t W = 0;
    e = 0;
    for (int64_t v = 0; v < V; v++) {
        while (e < k && ex[e] < v)
            e++;
        if (!(e < k && ex[e] == v))
            W += tkd_tail_weight(row[v], m, tau);
    }
    for (int j = 0; j < S; j++) {
        tg[j].t = tkd_tail_target(tkd_ctr_rng_u64(seed, (uint64_t)seq, (uint32_t)pos, (uint32_t)j), W);
        tg[j].j = (uint32_t)j;
    }
    qsort(tg, (size_t)S, sizeof tg[0], tail_target_cmp);
    /* Pass 3: walk the integer prefix sums; target T belongs to v when P_v - w_v <= T < P_v. */
    uint64_t P = 0;
    int d = 0;
    e = 0;
    for (int64_t v = 0; v < V && d < S; v++) {
        while (e < k && ex[e] < v)
            e++;
        if (e < k && ex[e] == v)
            continue;
        P += tkd_tail_weight(row[v], m, tau);
        for (; d < S && tg[d].t < P; d++)
            out[tg[d].j] = (uint32_t)v;
    }
    return 0;
}

tkd_status tkd_tail_sample_cpu(const float *logits, int64_t C, int64_t V, const uint32_t *topk_idx,
                               int k, float tau, int S, uint64_t seed, const int64_t *seq_index,
                               const int32_t *pos, uint32_t *out)
{
    TKD_TRY(tkd_tail_sample_check_args(C, V, k, tau, S));
    if (S == 0)
        return TKD_OK;
    int64_t bad_row = C; /* smallest failing row; C = none */
    int bad_kind = 0;
#pragma omp parallel for schedule(dynamic, 1) if (C > 1 && C * V >= 65536)
    for (int64_t r = 0; r < C; r++) {
        int st = tail_row(logits + r * V, V, topk_idx + r * k, k, (double)tau, S, seed, seq_index[r],
                          pos[r], out + r * S);
        if (st) {
#pragma omp critical(tkd_tail_bad)
            if (r < bad_row) {
                bad_row = r;
                bad_kind = st;
            }
        }
    }
    if (bad_row == C)
        return TKD_OK;
    if (bad_kind == 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "tail_sample: row %lld has a top-k id >= V = %lld; pass the ids from topk",
                             (long long)bad_row, (long long)V);
    return tkd_error_set(TKD_ERR_NUMERIC,
                         "tail_sample: logits row %lld has a non-finite value (NaN or Inf): the "
                         "teacher produced it; check the checkpoint's dtype and weights",
                         (long long)bad_row);
}
