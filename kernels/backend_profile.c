/* backend_profile.c — see backend_profile.h. Each timed op is one line of TKD_PROFILE_TIMED below:
 * its name, its parameters after `be` and the arguments that forward them; the macro makes the
 * wrapper function, the op's id and its name. */
#include "kernels/backend_profile.h"

#include <stdlib.h>
#include <string.h>

/* X(name, (, parameters after be), (, the same names as arguments)) for every op returning tkd_status
 * (the leading commas let sync's lists be empty). */
#define TKD_PROFILE_TIMED(X)                                                                                          \
    X(alloc, (, size_t bytes, const char *what, void **out), (, bytes, what, out))                                    \
    X(host_alloc, (, size_t bytes, void **out), (, bytes, out))                                                       \
    X(upload, (, void *dst, const void *src, size_t bytes), (, dst, src, bytes))                                      \
    X(download, (, void *dst, const void *src, size_t bytes), (, dst, src, bytes))                                    \
    X(upload_f32, (, void *dst, const float *src, size_t n), (, dst, src, n))                                         \
    X(download_f32, (, float *dst, const void *src, size_t n), (, dst, src, n))                                       \
    X(memset0, (, void *p, size_t bytes), (, p, bytes))                                                               \
    X(sync, (), ())                                                                                                   \
    X(embedding_fwd, (, const int32_t *tok, int N, const void *emb, int D, float *x), (, tok, N, emb, D, x))          \
    X(rmsnorm_fwd,                                                                                                    \
      (, const float *x, const void *w, int N, int D, float eps, void *y, float *rstd),                               \
      (, x, w, N, D, eps, y, rstd))                                                                                   \
    X(add_rmsnorm_fwd,                                                                                                \
      (, const float *x_in, const void *branch, float *x_out, const void *w, int N, int D, float eps, void *y,        \
       float *rstd),                                                                                                  \
      (, x_in, branch, x_out, w, N, D, eps, y, rstd))                                                                 \
    X(rmsnorm_act_fwd,                                                                                                \
      (, const void *x, const void *w, int N, int D, float eps, void *y, float *rstd),                                \
      (, x, w, N, D, eps, y, rstd))                                                                                   \
    X(linear_fwd,                                                                                                     \
      (, const void *x, const void *w, const void *b, int N, int K, int M, void *y),                                  \
      (, x, w, b, N, K, M, y))                                                                                        \
    X(rope_fwd,                                                                                                       \
      (, void *q, void *k, int N, int T, int H, int Hkv, int dh, const float *c, const float *s),                     \
      (, q, k, N, T, H, Hkv, dh, c, s))                                                                               \
    X(attn_fwd,                                                                                                       \
      (, const void *q, const void *k, const void *v, int B, int T, int H, int Hkv, int dh, int window,              \
       const int32_t *doc, const void *sinks, void *y, void *saved),                                                  \
      (, q, k, v, B, T, H, Hkv, dh, window, doc, sinks, y, saved))                                                         \
    X(swiglu_fwd, (, const void *g, const void *u, int64_t n, void *h), (, g, u, n, h))                               \
    X(embedding_bwd, (, const int32_t *tok, int N, const float *dx, int D, float *demb), (, tok, N, dx, D, demb))     \
    X(rmsnorm_bwd,                                                                                                    \
      (, const void *dy, const float *x, const void *w, const float *rstd, int N, int D, float *dx, float *dw,        \
       void *dx_act),                                                                                                 \
      (, dy, x, w, rstd, N, D, dx, dw, dx_act))                                                                       \
    X(linear_bwd,                                                                                                     \
      (, const void *dy, const void *x, const void *w, int N, int K, int M, void *dx, float *dw, float *db,           \
       int dx_acc),                                                                                                   \
      (, dy, x, w, N, K, M, dx, dw, db, dx_acc))                                                                      \
    X(rope_bwd,                                                                                                       \
      (, void *dq, void *dk, int N, int T, int H, int Hkv, int dh, const float *c, const float *s),                   \
      (, dq, dk, N, T, H, Hkv, dh, c, s))                                                                             \
    X(attn_bwd,                                                                                                       \
      (, const void *dy, const void *q, const void *k, const void *v, const void *y, const void *saved, int B,       \
       int T, int H, int Hkv, int dh, int window, const int32_t *doc, void *dq, void *dk, void *dv),                  \
      (, dy, q, k, v, y, saved, B, T, H, Hkv, dh, window, doc, dq, dk, dv))                                                \
    X(swiglu_bwd,                                                                                                     \
      (, const void *dh, const void *g, const void *u, int64_t n, void *dg, void *du, int acc),                       \
      (, dh, g, u, n, dg, du, acc))                                                                                   \
    X(lmhead_topk, (, tkd_lmhead_topk_args *a), (, a))                                                                \
    X(f32_to_act, (, const float *src, void *dst, size_t n), (, src, dst, n))                                         \
    X(act_to_f32, (, const void *src, float *dst, size_t n), (, src, dst, n))                                         \
    X(adamw_create, (, const tkd_adamw_seg *segs, int n_segs, tkd_backend_adamw **out), (, segs, n_segs, out))        \
    X(adamw_step,                                                                                                     \
      (, const tkd_backend_adamw *a, void *w, void *lo, const float *grads, void *m, void *v, tkd_adamw_dtype mdt,    \
       const tkd_adamw_hparams *h, int64_t step, float grad_scale),                                                   \
      (, a, w, lo, grads, m, v, mdt, h, step, grad_scale))                                                            \
    X(master_upload, (, void *w, void *lo, const float *src_host, size_t n), (, w, lo, src_host, n))                  \
    X(master_download, (, float *dst_host, const void *w, const void *lo, size_t n), (, dst_host, w, lo, n))          \
    X(grad_norm2, (, const float *g, size_t n, double *norm2), (, g, n, norm2))                                       \
    X(grad_scale, (, float *g, size_t n, float s), (, g, n, s))                                                       \
    X(moe_create, (, const tkd_moe_params *p, int max_tokens, tkd_backend_moe **out), (, p, max_tokens, out))       \
    X(moe_fwd, (, tkd_backend_moe *m, const tkd_moe_act_weights *w, const void *x, int N, void *y), (, m, w, x, N, y)) \
    X(kl_create,                                                                                                      \
      (, const tkd_kl_params *p, int64_t n_max, int d, int v, tkd_backend_kl **out),                                  \
      (, p, n_max, d, v, out))                                                                                        \
    X(kl_stage, (, tkd_backend_kl *kl, const tkd_kl_params *p, const tkd_kl_batch *hb), (, kl, p, hb))                \
    X(kl_forward,                                                                                                     \
      (, tkd_backend_kl *kl, const tkd_kl_params *p, const void *h, const void *w, tkd_kl_result *res, float *dh,     \
       float *dw),                                                                                                    \
      (, kl, p, h, w, res, dh, dw))                                                                                   \
    X(kl_backward,                                                                                                    \
      (, tkd_backend_kl *kl, const tkd_kl_params *p, const void *h, const void *w, float scale, float *dh,            \
       float *dw),                                                                                                    \
      (, kl, p, h, w, scale, dh, dw))

enum {
#define TKD_PROFILE_ID(name, params, args) PROF_##name,
    TKD_PROFILE_TIMED(TKD_PROFILE_ID)
#undef TKD_PROFILE_ID
    PROF_N
};

_Static_assert(PROF_N == TKD_PROFILE_OPS, "TKD_PROFILE_OPS must count the timed ops");

static const char *const kOpName[PROF_N] = {
#define TKD_PROFILE_NAME(name, params, args) #name,
    TKD_PROFILE_TIMED(TKD_PROFILE_NAME)
#undef TKD_PROFILE_NAME
};

/* The wrapper's state: its own op table (inner's NULL entries kept NULL) and the calls so far; call
 * k is bracketed by inner's marks 2k and 2k + 1. */
typedef struct prof {
    tkd_backend *inner;
    tkd_backend_ops ops;
    uint8_t *call_op; // (cap) the op id of each call
    int64_t calls, cap;
} prof;

static prof *prof_of(tkd_backend *be) { return be->impl; }

/* Notes call number *k of op id and records its start mark. */
static tkd_status call_begin(prof *p, int id, int64_t *k)
{
    if (p->calls == p->cap) { /* doubling: a profiled step grows this a few times, then never */
        int64_t cap = p->cap ? 2 * p->cap : 1024;
        uint8_t *c = realloc(p->call_op, (size_t)cap);
        if (!c)
            return tkd_error_set(TKD_ERR_NOMEM, "backend profile: out of memory for %lld calls", (long long)cap);
        p->call_op = c, p->cap = cap;
    }
    *k = p->calls;
    TKD_TRY(p->inner->op->mark(p->inner, 2 * *k));
    p->call_op[p->calls++] = (uint8_t)id;
    return TKD_OK;
}

/* Records call k's end mark; the op's own status wins over the mark's. */
static tkd_status call_end(prof *p, int64_t k, tkd_status op_st)
{
    if (op_st != TKD_OK) {
        tkd_error_saved keep;
        tkd_error_save(&keep, op_st);
        (void)p->inner->op->mark(p->inner, 2 * k + 1);
        return tkd_error_restore(&keep);
    }
    return p->inner->op->mark(p->inner, 2 * k + 1);
}

#define TKD_PROFILE_UNPACK(...) __VA_ARGS__
/* (the locals' names avoid the ops' parameter names: p, k, ...) */
#define TKD_PROFILE_FN(name, params, args)                                                         \
    static tkd_status prof_##name(tkd_backend *be TKD_PROFILE_UNPACK params)                       \
    {                                                                                               \
        prof *prof_ = prof_of(be);                                                                  \
        int64_t call_ = 0;                                                                          \
        TKD_TRY(call_begin(prof_, PROF_##name, &call_));                                            \
        return call_end(prof_, call_, prof_->inner->op->name(prof_->inner TKD_PROFILE_UNPACK args)); \
    }
TKD_PROFILE_TIMED(TKD_PROFILE_FN)
#undef TKD_PROFILE_FN

/* ---- untimed: forwarded as they are ---- */

static void prof_close(tkd_backend *be) /* the wrapper only: inner is borrowed */
{
    prof *p = prof_of(be);
    free(p->call_op);
    free(p);
    free(be);
}

static void prof_free(tkd_backend *be, void *ptr) { prof_of(be)->inner->op->free(prof_of(be)->inner, ptr); }

static void prof_host_free(tkd_backend *be, void *ptr)
{
    prof_of(be)->inner->op->host_free(prof_of(be)->inner, ptr);
}

static size_t prof_attn_saved_bytes(const tkd_backend *be, int B, int T, int H)
{
    const prof *p = be->impl;
    return p->inner->op->attn_saved_bytes(p->inner, B, T, H);
}

static int prof_lmhead_chunk_rows(const tkd_backend *be, int64_t v)
{
    const prof *p = be->impl;
    return p->inner->op->lmhead_chunk_rows(p->inner, v);
}

static void prof_adamw_free(tkd_backend *be, tkd_backend_adamw *a)
{
    prof_of(be)->inner->op->adamw_free(prof_of(be)->inner, a);
}

static void prof_kl_free(tkd_backend *be, tkd_backend_kl *kl)
{
    prof_of(be)->inner->op->kl_free(prof_of(be)->inner, kl);
}

static void prof_moe_free(tkd_backend *be, tkd_backend_moe *m)
{
    prof_of(be)->inner->op->moe_free(prof_of(be)->inner, m);
}

static tkd_status prof_mark(tkd_backend *be, int64_t i) { return prof_of(be)->inner->op->mark(prof_of(be)->inner, i); }

static tkd_status prof_mark_ms(tkd_backend *be, int64_t a, int64_t b, double *ms)
{
    return prof_of(be)->inner->op->mark_ms(prof_of(be)->inner, a, b, ms);
}

static tkd_status prof_mem_info(tkd_backend *be, size_t *free_bytes, size_t *total_bytes)
{
    return prof_of(be)->inner->op->mem_info(prof_of(be)->inner, free_bytes, total_bytes);
}

/* The wrapper's table: every entry forwarding, NULL where inner's is NULL (the model checks some). */
static void ops_fill(tkd_backend_ops *t, const tkd_backend_ops *in)
{
#define TKD_PROFILE_SET(name, params, args) t->name = in->name ? prof_##name : NULL;
    TKD_PROFILE_TIMED(TKD_PROFILE_SET)
#undef TKD_PROFILE_SET
    t->close = prof_close;
    t->free = in->free ? prof_free : NULL;
    t->host_free = in->host_free ? prof_host_free : NULL;
    t->attn_saved_bytes = in->attn_saved_bytes ? prof_attn_saved_bytes : NULL;
    t->adamw_free = in->adamw_free ? prof_adamw_free : NULL;
    t->kl_free = in->kl_free ? prof_kl_free : NULL;
    t->moe_free = in->moe_free ? prof_moe_free : NULL;
    t->lmhead_chunk_rows = in->lmhead_chunk_rows ? prof_lmhead_chunk_rows : NULL;
    t->mem_info = in->mem_info ? prof_mem_info : NULL;
    t->mark = prof_mark;
    t->mark_ms = prof_mark_ms;
}

tkd_status tkd_backend_profile_wrap(tkd_backend *inner, tkd_backend **out)
{
    *out = NULL;
    if (!inner->op->mark || !inner->op->mark_ms)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "backend profile: the %s backend has no timing marks", inner->name);
    tkd_backend *be = calloc(1, sizeof *be);
    prof *p = calloc(1, sizeof *p);
    if (!be || !p) {
        free(be), free(p);
        return tkd_error_set(TKD_ERR_NOMEM, "backend profile: out of memory");
    }
    p->inner = inner;
    ops_fill(&p->ops, inner->op);
    be->device = inner->device;
    be->name = inner->name;
    be->act_size = inner->act_size;
    be->master_lo_size = inner->master_lo_size;
    be->host_addressable = inner->host_addressable;
    be->data_parallel = 0; /* the collectives need the inner backend's stream, which this one does not show */
    be->attn_window = inner->attn_window;
    be->attn_window_bwd = inner->attn_window_bwd;
    be->attn_docs = inner->attn_docs;
    be->attn_docs_bwd = inner->attn_docs_bwd;
    be->moe_mxfp4 = inner->moe_mxfp4;
    be->op = &p->ops;
    be->impl = p;
    *out = be;
    return TKD_OK;
}

static int is_profile(const tkd_backend *be) { return be && be->op->close == prof_close; }

static int row_cmp(const void *a, const void *b)
{
    const tkd_profile_row *x = a, *y = b;
    if (x->ms != y->ms)
        return x->ms < y->ms ? 1 : -1;
    return strcmp(x->op, y->op);
}

tkd_status tkd_backend_profile_report(tkd_backend *be, tkd_profile_row *rows, int *n)
{
    *n = 0;
    if (!is_profile(be))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "backend profile: report asked of a backend that is no profiler");
    prof *p = prof_of(be);
    tkd_profile_row all[PROF_N];
    for (int i = 0; i < PROF_N; i++)
        all[i] = (tkd_profile_row){kOpName[i], 0, 0.0};
    for (int64_t k = 0; k < p->calls; k++) { /* each read waits for its call's end mark */
        double ms = 0.0;
        TKD_TRY(p->inner->op->mark_ms(p->inner, 2 * k, 2 * k + 1, &ms));
        all[p->call_op[k]].calls++;
        all[p->call_op[k]].ms += ms;
    }
    for (int i = 0; i < PROF_N; i++)
        if (all[i].calls > 0)
            rows[(*n)++] = all[i];
    qsort(rows, (size_t)*n, sizeof *rows, row_cmp);
    return TKD_OK;
}

void tkd_backend_profile_reset(tkd_backend *be)
{
    if (is_profile(be))
        prof_of(be)->calls = 0;
}
