/* kl_loss_cpu.c — the chunked CPU path of the KL loss: one OpenBLAS sgemm per chunk of rows for
 * the logits, OpenMP over rows for the softmax statistics, the loss and ∂/∂s in place, then two
 * sgemms for dH and dW. Never holds more than one chunk of logits. Maths: docs/loss.md. */
#include "kernels/loss/kl_loss.h"
#include "kernels/loss/kl_divergence.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Per-row statistics kept from forward for backward. All log-sum-exps are in double; m and
 * m_tail are the maxima they were taken around, so that backward's exps see small arguments. */
typedef struct row_stat {
    double lse_z;    /* log Σ_v exp(s_v/τ) */
    double lse_s;    /* log Σ_v exp(s_v) (CE) */
    double lse_tail; /* log Σ_{v∉I} exp(s_v/τ); -inf when the tail is empty. log(1 − Q) = lse_tail − lse_z */
    float m;         /* max_v s_v */
    float m_tail;    /* max_{v∉I} s_v (-inf when the tail is empty) */
} row_stat;

struct tkd_kl_cpu_ws {
    int64_t n_max;
    int d, v, chunk, k_cap, s_cap;
    float *buf;      /* (chunk, V) logits, then ∂loss/∂s in place */
    float *s_top;    /* (chunk, k_cap) logits at the row's first k' teacher tokens */
    float *s_dr;     /* (chunk, s_cap) logits at the row's tail draws (sampled with a divergence but fkl) */
    row_stat *stat;  /* (n_max) */
    uint8_t *seen;   /* (V/8 + 1) zeroed scratch for tkd_kl_cpu_validate */
    float *tbuf;     /* dense: (chunk, V) the teacher's logits of the chunk */
    int32_t *iota;   /* dense: (V) 0, 1, ..., V − 1: every token is a teacher column */
    int64_t last_n;  /* rows of the last forward; -1 before any */
    int64_t n_kept;
};

/* 64 MiB of fp32 logits per chunk: large enough for sgemm to run near peak, small next to the
 * weights, and it bounds the memory no matter N. */
#define TKD_KL_CPU_CHUNK_BYTES (64ll << 20)

tkd_status tkd_kl_cpu_ws_create(tkd_kl_cpu_ws **out, const tkd_kl_params *p, int64_t n_max, int d,
                                int v)
{
    *out = NULL;
    TKD_TRY(tkd_kl_params_check(p, v));
    if (n_max < 1 || d < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss cpu: n_max %lld and D %d must be >= 1",
                             (long long)n_max, d);
    int64_t chunk = p->chunk_rows > 0 ? p->chunk_rows : TKD_KL_CPU_CHUNK_BYTES / (4ll * v);
    chunk = chunk < 1 ? 1 : chunk > n_max ? n_max : chunk;
    tkd_kl_cpu_ws *ws = calloc(1, sizeof *ws);
    if (!ws)
        return tkd_error_set(TKD_ERR_NOMEM, "kl_loss cpu: out of memory");
    ws->n_max = n_max, ws->d = d, ws->v = v, ws->chunk = (int)chunk;
    ws->k_cap = p->k > 0 ? p->k : 1;
    ws->s_cap = p->variant == TKD_KL_VARIANT_SAMPLED ? p->s : 0;
    ws->last_n = -1;
    ws->buf = malloc(sizeof(float) * (size_t)chunk * (size_t)v);
    ws->s_top = malloc(sizeof(float) * (size_t)chunk * (size_t)ws->k_cap);
    ws->s_dr = malloc(sizeof(float) * (size_t)chunk * (size_t)(ws->s_cap > 0 ? ws->s_cap : 1));
    ws->stat = malloc(sizeof(row_stat) * (size_t)n_max);
    ws->seen = calloc((size_t)v / 8 + 1, 1);
    if (p->dense) {
        ws->tbuf = malloc(sizeof(float) * (size_t)chunk * (size_t)v);
        if ((ws->iota = malloc(sizeof(int32_t) * (size_t)v)))
            for (int j = 0; j < v; j++)
                ws->iota[j] = j;
    }
    if (!ws->buf || !ws->s_top || !ws->s_dr || !ws->stat || !ws->seen || (p->dense && (!ws->tbuf || !ws->iota))) {
        tkd_kl_cpu_ws_free(ws);
        return tkd_error_set(TKD_ERR_NOMEM, "kl_loss cpu: out of memory for a chunk of %lld x %d logits",
                             (long long)chunk, v);
    }
    *out = ws;
    return TKD_OK;
}

void tkd_kl_cpu_ws_free(tkd_kl_cpu_ws *ws)
{
    if (!ws)
        return;
    free(ws->buf);
    free(ws->s_top);
    free(ws->s_dr);
    free(ws->stat);
    free(ws->seen);
    free(ws->tbuf);
    free(ws->iota);
    free(ws);
}

tkd_status tkd_kl_cpu_validate(tkd_kl_cpu_ws *ws, const tkd_kl_params *p, const tkd_kl_batch *b)
{
    if (b && b->v != ws->v)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss cpu: batch V = %d, workspace V = %d", b->v, ws->v);
    return tkd_kl_validate_scratch(p, b, ws->seen);
}

/* ---- one row ------------------------------------------------------------------------- */

/* The teacher side of a row, in double (k' values: negligible next to the V-long passes). */
typedef struct teacher_row {
    const int32_t *idx; /* (k') */
    const float *t;     /* (k') raw teacher logits */
    const int32_t *dr;  /* (S) draws, sampled only */
    double norm;        /* log p_j = t_j/τ − norm: renorm's LSE over t/τ, else the cache LSE */
    double r;           /* tail mass 1 − Σ p_j clamped at 0; 0 for renorm and when k' = V */
    double mass;        /* Σ of the target: 1 (renorm), Σp + r (tail), Σp + r·[S > 0] (sampled) */
} teacher_row;

/* Row i's teacher: the cache's columns, or with params.dense its whole distribution (t: the row of
 * the chunk's teacher logits, idx: every token), renorm over all V being the exact softmax. */
static teacher_row teacher_of(const tkd_kl_params *p, const tkd_kl_batch *b, const tkd_kl_cpu_ws *ws, int64_t i,
                              int64_t r)
{
    const int kk = p->k_use;
    const double inv_tau = 1.0 / p->temperature;
    teacher_row tr = {.idx = p->dense ? ws->iota : b->topk_idx ? b->topk_idx + i * p->k : NULL,
                      .t = p->dense ? ws->tbuf + r * b->v : b->topk_logit ? b->topk_logit + i * p->k : NULL,
                      .dr = p->variant == TKD_KL_VARIANT_SAMPLED && p->s > 0 ? b->tail_idx + i * p->s : NULL};
    if (kk == 0 && (p->variant != TKD_KL_VARIANT_SAMPLED || p->s == 0)) {
        tr.mass = 1.0; /* CE only (alpha = 0): no teacher to read */
        return tr;
    }
    if (p->variant == TKD_KL_VARIANT_RENORM) {
        double m = -INFINITY, sum = 0.0;
        for (int j = 0; j < kk; j++)
            m = fmax(m, tr.t[j] * inv_tau);
        for (int j = 0; j < kk; j++)
            sum += exp(tr.t[j] * inv_tau - m);
        tr.norm = m + log(sum);
        tr.mass = 1.0;
        return tr;
    }
    tr.norm = b->teacher_lse[i];
    double sp = 0.0;
    for (int j = 0; j < kk; j++)
        sp += exp(tr.t[j] * inv_tau - tr.norm);
    /* With k' = V there is no tail; otherwise rounding may push Σp past 1, hence the clamp. */
    tr.r = kk < b->v && sp < 1.0 ? 1.0 - sp : 0.0;
    tr.mass = sp + (p->variant == TKD_KL_VARIANT_TAIL || p->s > 0 ? tr.r : 0.0);
    return tr;
}

/* Saves the logits at the row's teacher tokens and masks them with -inf, so that one pass over the
 * row gives the tail's statistics and the full ones follow by adding k' terms. */
static void row_gather_mask(float *x, const int32_t *idx, int kk, float *s_top)
{
    for (int j = 0; j < kk; j++) {
        s_top[j] = x[idx[j]];
        x[idx[j]] = -INFINITY;
    }
}

/* log Σ exp(a·scale) and log Σ exp(a) over x (masked entries contribute 0), around max m. */
static void lse_pass(const float *x, int64_t n, float m, float inv_tau, double *lz, double *ls)
{
    if (m == -INFINITY) {
        *lz = *ls = -INFINITY;
        return;
    }
    double sz = 0.0, ss = 0.0;
    if (inv_tau == 1.0f) {
        for (int64_t j = 0; j < n; j++)
            sz += expf(x[j] - m);
        ss = sz;
    } else {
        for (int64_t j = 0; j < n; j++) {
            float dd = x[j] - m;
            sz += expf(dd * inv_tau);
            ss += expf(dd);
        }
    }
    *lz = m * (double)inv_tau + log(sz);
    *ls = m + log(ss);
}

/* Row statistics from a masked row x (V) and its saved top logits. */
static void row_stats(const float *x, int v, const float *s_top, int kk, float tau, row_stat *st)
{
    const float inv_tau = 1.0f / tau;
    float mt = -INFINITY, mk = -INFINITY;
    for (int j = 0; j < v; j++)
        mt = x[j] > mt ? x[j] : mt;
    for (int j = 0; j < kk; j++)
        mk = s_top[j] > mk ? s_top[j] : mk;
    double tz, ts, kz, ks;
    lse_pass(x, v, mt, inv_tau, &tz, &ts);
    lse_pass(s_top, kk, mk, inv_tau, &kz, &ks);
    st->lse_tail = tz;
    st->lse_z = tkd_kl_logaddexp(tz, kz);
    st->lse_s = tkd_kl_logaddexp(ts, ks);
    st->m = mt > mk ? mt : mk;
    st->m_tail = mt;
}

/* ---- divergences other than fkl (docs/loss.md, "Divergences") ----------------------------- */

/* 1/τ as the row statistics took it (fp32): log q_v = s_v·this − LSE(z) then sums to 1 to double
 * precision, where the exact 1/τ would leave |s|·2^-25 (1e-4 at |s| = 2e4) that reverse KL's
 * c·log(c/a) multiplies by |log a|. */
static double student_inv_tau(const tkd_kl_params *p)
{
    return (double)(1.0f / p->temperature);
}

/* The divergence as computed (tkd_kl_div_kind) and one bucket's term with the params' β and α. */
static int div_kind(const tkd_kl_params *p)
{
    return tkd_kl_div_kind(p->divergence, p->jsd_beta, p->skew_alpha);
}

static double div_term(int kind, const tkd_kl_params *p, tkd_kl_div_bucket k, double *cg)
{
    return tkd_kl_div_term(kind, p->jsd_beta, p->skew_alpha, k, cg);
}

/* Top-k' column j: the teacher's p_j (p̃_j for renorm) and the student's q at I_j (q̃ for renorm:
 * ls is then the LSE over the k' tokens, else LSE(z)). */
static tkd_kl_div_bucket top_bucket(const tkd_kl_params *p, const teacher_row *tr, const float *s_top, int j,
                                    double ls)
{
    return tkd_kl_div_bucket_of_logs(tr->t[j] * (1.0 / p->temperature) - tr->norm,
                                     s_top[j] * student_inv_tau(p) - ls);
}

/* Tail draw d of a sampled row as a bucket of its own (weight r·count/S); 0 for a repeat of an
 * earlier draw, whose bucket that one already is. */
static int draw_bucket(const tkd_kl_params *p, const teacher_row *tr, const float *s_dr, int d, double lse_z,
                       tkd_kl_div_bucket *k)
{
    double la;
    if (!tkd_kl_div_draw_log_mass(tr->dr, p->s, d, tr->r, &la))
        return 0;
    *k = tkd_kl_div_bucket_of_logs(la, s_dr[d] * student_inv_tau(p) - lse_z);
    return 1;
}

/* A row's divergence over its buckets and what its gradient needs beyond the per-bucket terms. */
typedef struct div_sums {
    double d;     /* D_z = Σ_b F(a_b, c_b) */
    double gbar;  /* Σ_b cg_b: ∂D/∂z_v = (q_v/c_b)·(cg_b − c_b·gbar) */
    double ls;    /* the student's normaliser of top_bucket: renorm's LSE over the k' tokens, else LSE(z) */
    double omq;   /* 1 − Q (tail, sampled; 0 without a tail) */
    double tail_cg; /* tail: the tail bucket's cg */
    double rest_g;  /* sampled: ∂F/∂c of the undrawn tail (a = 0: a constant, F is linear there) */
} div_sums;

static div_sums div_row_sums(const tkd_kl_params *p, const teacher_row *tr, const float *s_top, const float *s_dr,
                             const row_stat *st, int v)
{
    const int kind = div_kind(p);
    const int kk = p->k_use;
    div_sums ds = {.ls = st->lse_z};
    double cg;
    if (p->variant == TKD_KL_VARIANT_RENORM) { /* in double with top_bucket's 1/τ: q̃ sums to 1 */
        const double inv_tau = student_inv_tau(p);
        double mk = -INFINITY, sum = 0.0;
        for (int j = 0; j < kk; j++)
            mk = fmax(mk, s_top[j] * inv_tau);
        for (int j = 0; j < kk; j++)
            sum += exp(s_top[j] * inv_tau - mk);
        ds.ls = mk + log(sum);
    }
    for (int j = 0; j < kk; j++) {
        ds.d += div_term(kind, p, top_bucket(p, tr, s_top, j, ds.ls), &cg);
        ds.gbar += cg;
    }
    if (p->variant == TKD_KL_VARIANT_RENORM || kk == v)
        return ds; /* no tail bucket */
    const double log_omq = st->lse_tail - st->lse_z;
    ds.omq = exp(log_omq);
    if (p->variant == TKD_KL_VARIANT_TAIL) {
        ds.d += div_term(kind, p, tkd_kl_div_tail_bucket(tr->r, log_omq), &ds.tail_cg);
        ds.gbar += ds.tail_cg;
        return ds;
    }
    double rest = ds.omq; /* sampled: the tail less the drawn tokens */
    tkd_kl_div_bucket k;
    for (int d = 0; d < p->s; d++)
        if (draw_bucket(p, tr, s_dr, d, st->lse_z, &k)) {
            ds.d += div_term(kind, p, k, &cg);
            ds.gbar += cg;
            rest -= k.c;
        }
    ds.d += tkd_kl_div_rest_term(kind, p->jsd_beta, p->skew_alpha, rest, &cg, &ds.rest_g);
    ds.gbar += cg;
    return ds;
}

/* ---- one row's loss and gradient ------------------------------------------------------------ */

/* The row's KD (τ²-scaled) and CE, in double. x is the masked row (draws are never masked). */
static void row_loss(const tkd_kl_params *p, const teacher_row *tr, const float *x, int v, const float *s_top,
                     const float *s_dr, const row_stat *st, int32_t y, double *kd_out, double *ce_out)
{
    const double inv_tau = 1.0 / p->temperature;
    double kd = 0.0;
    if (tkd_kl_div_on(p)) {
        kd = div_row_sums(p, tr, s_top, s_dr, st, v).d;
    } else {
        for (int j = 0; j < p->k_use; j++) {
            double lp = tr->t[j] * inv_tau - tr->norm, lq = s_top[j] * inv_tau - st->lse_z;
            kd += exp(lp) * (lp - lq);
        }
        if (p->variant == TKD_KL_VARIANT_TAIL && tr->r > 0.0)
            kd += tr->r * (log(tr->r) - (st->lse_tail - st->lse_z));
        if (tr->dr && tr->r > 0.0)
            for (int d = 0; d < p->s; d++) { /* one term per draw instance, each of weight r/S */
                double lt;
                tkd_kl_div_draw_log_mass(tr->dr, p->s, d, tr->r, &lt);
                kd += tr->r / p->s * (lt - (x[tr->dr[d]] * inv_tau - st->lse_z));
            }
    }
    *kd_out = (double)p->temperature * p->temperature * kd;
    double sy = x[y] == -INFINITY ? 0.0 : x[y]; /* a label among the masked top-k: read it back */
    if (x[y] == -INFINITY)
        for (int j = 0; j < p->k_use; j++)
            if (tr->idx[j] == y)
                sy = s_top[j];
    *ce_out = st->lse_s - sy;
}

/* The dense part of a row's gradient over the whole masked row x (V), in place: fb·q¹_v plus the KD
 * part, ce·q_v/(1 − Q) around the tail's own max (tail_form: exact however small 1 − Q is) or
 * fa·q_v. The teacher's tokens (masked) come out 0 and are written afterwards. */
static void row_dense(float *x, int v, const row_stat *st, float inv_tau, int tail_form, float ce, float fa, float fb)
{
    const float cz = (float)(st->lse_z - (double)st->m * inv_tau), cs = (float)(st->lse_s - st->m);
    const float m = st->m;
    if (tail_form) {
        const float mt = st->m_tail, ct = (float)(st->lse_tail - (double)mt * inv_tau);
        for (int j = 0; j < v; j++) {
            float e = expf((x[j] - mt) * inv_tau - ct), q1 = expf((x[j] - m) - cs);
            x[j] = ce * e + fb * q1;
        }
    } else if (inv_tau == 1.0f) {
        const float c = fa + fb;
        for (int j = 0; j < v; j++)
            x[j] = c * expf((x[j] - m) - cz);
    } else {
        for (int j = 0; j < v; j++) {
            float dd = x[j] - m;
            x[j] = fa * expf(dd * inv_tau - cz) + fb * expf(dd - cs);
        }
    }
}

/* A divergence's gradient: the dense part's KD weight is the tail bucket's (tail), the undrawn
 * tail's (sampled) or 0 (renorm: q̃ does not depend on the logits outside I); then each special
 * bucket's exact value. a = coef·α·τ, b1 = coef·(1 − α). */
static void row_grad_div(const tkd_kl_params *p, const teacher_row *tr, float *x, int v, const float *s_top,
                         const float *s_dr, const row_stat *st, double a, double b1)
{
    const int kind = div_kind(p);
    const float inv_tau = 1.0f / p->temperature;
    const div_sums ds = div_row_sums(p, tr, s_top, s_dr, st, v);
    const int tail_form = ds.omq > 0.0 && st->m_tail != -INFINITY;
    double ce = 0.0;
    if (tail_form && p->variant == TKD_KL_VARIANT_TAIL)
        ce = a * (ds.tail_cg - ds.omq * ds.gbar);
    else if (tail_form)
        ce = a * ds.omq * (ds.rest_g - ds.gbar);
    row_dense(x, v, st, inv_tau, tail_form, (float)ce, 0.0f, (float)b1);
    double cg;
    for (int j = 0; j < p->k_use; j++) {
        tkd_kl_div_bucket k = top_bucket(p, tr, s_top, j, ds.ls);
        div_term(kind, p, k, &cg);
        x[tr->idx[j]] = (float)(a * (cg - k.c * ds.gbar) + b1 * exp(s_top[j] - st->lse_s));
    }
    tkd_kl_div_bucket k;
    for (int d = 0; tr->dr && d < p->s; d++) /* the dense part gave q_d·(rest_g − gbar) */
        if (draw_bucket(p, tr, s_dr, d, st->lse_z, &k)) {
            div_term(kind, p, k, &cg);
            x[tr->dr[d]] += (float)(a * (cg - k.c * ds.rest_g));
        }
}

/* Turns the masked row x (V) into coef·∂(row loss)/∂s in place. */
static void row_grad(const tkd_kl_params *p, const teacher_row *tr, float *x, int v, const float *s_top,
                     const float *s_dr, const row_stat *st, int32_t y, double coef)
{
    const float inv_tau = 1.0f / p->temperature;
    const double a = coef * p->alpha * p->temperature, b1 = coef * (1.0 - p->alpha);
    const float fb = (float)b1;
    if (tkd_kl_div_on(p)) {
        row_grad_div(p, tr, x, v, s_top, s_dr, st, a, b1);
        x[y] -= fb;
        return;
    }
    /* tail: g = a·(mass·(1 − Q) − r)·q_v/(1 − Q) + b1·q1_v */
    const int tail_form = p->variant == TKD_KL_VARIANT_TAIL && tr->r > 0.0;
    const float ce = tail_form ? (float)(a * (tr->mass * exp(st->lse_tail - st->lse_z) - tr->r)) : 0.0f;
    row_dense(x, v, st, inv_tau, tail_form, ce, (float)(a * tr->mass), fb);
    for (int j = 0; j < p->k_use; j++) { /* the teacher's tokens (masked above: 0 so far) */
        double lq = s_top[j] * (double)inv_tau - st->lse_z, lq1 = s_top[j] - st->lse_s;
        double pj = exp(tr->t[j] * (double)inv_tau - tr->norm);
        x[tr->idx[j]] = (float)(a * (tr->mass * exp(lq) - pj) + b1 * exp(lq1));
    }
    if (tr->dr && tr->r > 0.0)
        for (int d = 0; d < p->s; d++)
            x[tr->dr[d]] -= (float)(a * tr->r / p->s);
    x[y] -= fb;
}

/* ---- chunks ---------------------------------------------------------------------------- */

/* Guards memory safety only (tkd_kl_validate is the real check): indices used to address the row. */
static int row_indices_ok(const tkd_kl_params *p, const tkd_kl_batch *b, int64_t i)
{
    const int v = b->v;
    if (b->labels[i] < 0 || b->labels[i] >= v)
        return 0;
    if (p->dense) /* the teacher's columns are every token */
        return 1;
    for (int j = 0; j < p->k_use; j++)
        if ((unsigned)b->topk_idx[i * p->k + j] >= (unsigned)v)
            return 0;
    if (p->variant == TKD_KL_VARIANT_SAMPLED)
        for (int d = 0; d < p->s; d++)
            if ((unsigned)b->tail_idx[i * p->s + d] >= (unsigned)v)
                return 0;
    return 1;
}

typedef struct chunk_job {
    const tkd_kl_params *p;
    const tkd_kl_batch *b;
    tkd_kl_cpu_ws *ws;
    int64_t r0, rows;
    int mode;    /* 0 forward (stats + loss), 1 forward + grad, 2 backward (grad from stored stats) */
    double coef; /* scale / n_kept for the gradient */
} chunk_job;

/* The row passes over one chunk whose logits are in ws->buf. Returns the first bad row or -1. */
static int64_t chunk_rows_pass(const chunk_job *job, double *kd_sum, double *ce_sum)
{
    const tkd_kl_params *p = job->p;
    const tkd_kl_batch *b = job->b;
    tkd_kl_cpu_ws *ws = job->ws;
    const int v = b->v;
    int64_t bad = -1;
    double kd_acc = 0.0, ce_acc = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : kd_acc, ce_acc)
    for (int64_t r = 0; r < job->rows; r++) {
        const int64_t i = job->r0 + r;
        float *x = ws->buf + r * v, *s_top = ws->s_top + r * ws->k_cap;
        int32_t y = b->labels[i];
        if (y == p->ignore_index) {
            if (job->mode != 0)
                memset(x, 0, sizeof(float) * (size_t)v);
            continue;
        }
        if (!row_indices_ok(p, b, i)) {
#pragma omp critical(tkd_kl_bad_row)
            if (bad < 0 || i < bad)
                bad = i;
            continue;
        }
        teacher_row tr = teacher_of(p, b, ws, i, r);
        row_gather_mask(x, tr.idx, p->k_use, s_top);
        float *s_dr = ws->s_dr + r * ws->s_cap;
        if (tr.dr && tkd_kl_div_on(p)) /* the draws' logits outlive the dense gradient pass */
            for (int d = 0; d < p->s; d++)
                s_dr[d] = x[tr.dr[d]];
        if (job->mode != 2) {
            double kd, ce;
            row_stats(x, v, s_top, p->k_use, p->temperature, &ws->stat[i]);
            row_loss(p, &tr, x, v, s_top, s_dr, &ws->stat[i], y, &kd, &ce);
            kd_acc += kd;
            ce_acc += ce;
        }
        if (job->mode != 0)
            row_grad(p, &tr, x, v, s_top, s_dr, &ws->stat[i], y, job->coef);
    }
    *kd_sum += kd_acc;
    *ce_sum += ce_acc;
    return bad;
}

/* All chunks: logits by sgemm, row passes, and in modes 1 and 2 dH_c = dS W, dW += dSᵀ H_c. */
static tkd_status run_chunks(chunk_job job, float *dh, float *dw, double *kd_sum, double *ce_sum)
{
    const tkd_kl_batch *b = job.b;
    const int d = b->d, v = b->v;
    for (int64_t r0 = 0; r0 < b->n; r0 += job.ws->chunk) {
        const int64_t rows = b->n - r0 < job.ws->chunk ? b->n - r0 : job.ws->chunk;
        const float *hc = b->h + r0 * d;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, v, d, 1.0f, hc, d, b->w, d, 0.0f,
                    job.ws->buf, v);
        if (job.p->dense) /* the teacher's chunk beside the student's (made again in a backward) */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, v, b->teacher_d, 1.0f,
                        b->teacher_h + r0 * b->teacher_d, b->teacher_d, b->teacher_w, b->teacher_d, 0.0f,
                        job.ws->tbuf, v);
        job.r0 = r0, job.rows = rows;
        int64_t bad = chunk_rows_pass(&job, kd_sum, ce_sum);
        if (bad >= 0)
            return tkd_error_set(TKD_ERR_FORMAT,
                                 "kl_loss cpu: row %lld: a label, top-k index or tail draw is outside the "
                                 "vocabulary [0, %d); run tkd_kl_validate on the batch to see which",
                                 (long long)bad, v);
        if (job.mode == 0)
            continue;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, d, v, 1.0f, job.ws->buf, v, b->w, d,
                    0.0f, dh + r0 * d, d);
        const float beta = job.p->dw_overwrite && r0 == 0 ? 0.0f : 1.0f; /* dw_overwrite: write, not add */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v, d, (int)rows, 1.0f, job.ws->buf, v, hc, d, beta,
                    dw, d);
    }
    return TKD_OK;
}

static tkd_status check_ws(const tkd_kl_cpu_ws *ws, const tkd_kl_params *p, const tkd_kl_batch *b)
{
    if (!ws)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss cpu: workspace is NULL");
    TKD_TRY(tkd_kl_batch_check(p, b));
    if (p->variant == TKD_KL_VARIANT_SAMPLED && tkd_kl_div_on(p) && p->s > ws->s_cap)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "kl_loss cpu: %d tail draws per row, the workspace was made for %d (kd.divergence = %s "
                             "keeps the draws' logits)", p->s, ws->s_cap, tkd_kl_divergence_name(p->divergence));
    if (b->n > ws->n_max || b->d != ws->d || b->v != ws->v || p->k_use > ws->k_cap)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "kl_loss cpu: batch N=%lld D=%d V=%d k'=%d does not fit the workspace made for "
                             "N<=%lld D=%d V=%d k<=%d",
                             (long long)b->n, b->d, b->v, p->k_use, (long long)ws->n_max, ws->d, ws->v,
                             ws->k_cap);
    return TKD_OK;
}

static int64_t count_kept(const tkd_kl_params *p, const tkd_kl_batch *b)
{
    int64_t kept = 0;
    for (int64_t i = 0; i < b->n; i++)
        kept += b->labels[i] != p->ignore_index;
    return kept;
}

tkd_status tkd_kl_cpu_forward(tkd_kl_cpu_ws *ws, const tkd_kl_params *p, const tkd_kl_batch *b,
                              tkd_kl_result *res, float *dh, float *dw)
{
    TKD_TRY(check_ws(ws, p, b));
    if (!res || (p->grad_in_forward && (!dh || !dw)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss cpu: forward needs res (and dh, dw with grad_in_forward)");
    ws->last_n = -1;
    const int64_t kept = count_kept(p, b);
    chunk_job job = {.p = p, .b = b, .ws = ws, .mode = p->grad_in_forward ? 1 : 0,
                     .coef = kept ? (double)p->grad_scale / kept : 0.0};
    double kd_sum = 0.0, ce_sum = 0.0;
    if (kept == 0 && p->grad_in_forward)
        memset(dh, 0, sizeof(float) * (size_t)b->n * (size_t)b->d);
    if (kept > 0)
        TKD_TRY(run_chunks(job, dh, dw, &kd_sum, &ce_sum));
    res->n_kept = kept;
    res->kd = kept ? kd_sum / kept : 0.0;
    res->ce = kept ? ce_sum / kept : 0.0;
    res->loss = p->alpha * res->kd + (1.0 - p->alpha) * res->ce;
    ws->last_n = b->n;
    ws->n_kept = kept;
    if (!isfinite(res->loss))
        return tkd_error_set(TKD_ERR_NUMERIC, "kl_loss cpu: the loss is not finite (%g); the student's hidden "
                             "states or weights have overflowed", res->loss);
    return TKD_OK;
}

tkd_status tkd_kl_cpu_backward(tkd_kl_cpu_ws *ws, const tkd_kl_params *p, const tkd_kl_batch *b,
                               float scale, float *dh, float *dw)
{
    TKD_TRY(check_ws(ws, p, b));
    if (ws->last_n != b->n)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss cpu: backward must follow a successful forward on "
                             "the same batch (forward saw %lld rows, backward %lld)",
                             (long long)ws->last_n, (long long)b->n);
    if (p->grad_in_forward) {
        /* The gradients were made in forward, of grad_scale·loss; a different scale cannot reach them. */
        if (scale != p->grad_scale)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss cpu: grad_in_forward made the gradients with "
                                 "grad_scale %g; backward's scale %g must equal it",
                                 (double)p->grad_scale, (double)scale);
        return TKD_OK;
    }
    if (!dh || !dw)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss cpu: backward needs dh and dw");
    if (ws->n_kept == 0) {
        memset(dh, 0, sizeof(float) * (size_t)b->n * (size_t)b->d);
        return TKD_OK;
    }
    chunk_job job = {.p = p, .b = b, .ws = ws, .mode = 2, .coef = (double)scale / ws->n_kept};
    double kd_unused = 0.0, ce_unused = 0.0;
    return run_chunks(job, dh, dw, &kd_unused, &ce_unused);
}
