/* backend_cpu.c — the CPU backend: fp32 everywhere, the ops of cpu_ops.h (OpenBLAS + OpenMP).
 * It is the reference the CUDA backend is tested against; "device memory" is plain host memory,
 * so a model's weights on this backend are its fp32 parameters themselves (no copy). */
#include "kernels/backend.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/progress.h"
#include "common/signals.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/cpu_moe.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/loss/kl_loss.h"
#include "kernels/cpu/tail_sample.h"
#include "kernels/cpu/topk.h"

typedef struct cpu_impl {
    float *logits;    // (chunk, V) scratch of the LM-head consumers, grown to the largest asked
    size_t logits_n;
    int64_t *row_seq; // (chunk) tail-draw keys of the chunk's rows
    int32_t *row_pos; // (chunk)
    size_t rows_n;
    double *marks;    // (marks_n) timing marks: tkd_progress_now() seconds
    int64_t marks_n;
} cpu_impl;

static void cpu_close(tkd_backend *be)
{
    cpu_impl *c = be->impl;
    free(c->logits);
    free(c->row_seq);
    free(c->row_pos);
    free(c->marks);
    free(c);
    free(be);
}

static tkd_status cpu_alloc(tkd_backend *be, size_t bytes, const char *what, void **out)
{
    (void)be;
    *out = calloc(1, bytes ? bytes : 1);
    if (!*out)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory asking for %.1f MiB", what, bytes / 1048576.0);
    return TKD_OK;
}

static void cpu_free(tkd_backend *be, void *p) { (void)be; free(p); }

/* The value in bytes of /proc/meminfo's line `key` (kB there), or 0 when it cannot be read. */
static size_t meminfo_bytes(const char *key)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return 0;
    char line[256];
    size_t n = strlen(key), kb = 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && line[n] == ':') {
            kb = strtoull(line + n + 1, NULL, 10);
            break;
        }
    fclose(f);
    return kb * 1024;
}

/* MemAvailable, not MemFree: the page cache the kernel would give back counts as free. Where
 * /proc/meminfo is missing, the free and total physical pages. */
static tkd_status cpu_mem_info(tkd_backend *be, size_t *free_bytes, size_t *total_bytes)
{
    (void)be;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    *free_bytes = meminfo_bytes("MemAvailable");
    *total_bytes = meminfo_bytes("MemTotal");
    if (!*free_bytes)
        *free_bytes = (size_t)sysconf(_SC_AVPHYS_PAGES) * page;
    if (!*total_bytes)
        *total_bytes = (size_t)sysconf(_SC_PHYS_PAGES) * page;
    return TKD_OK;
}

static tkd_status cpu_host_alloc(tkd_backend *be, size_t bytes, void **out)
{
    return cpu_alloc(be, bytes, "host buffer", out);
}

static tkd_status cpu_copy(tkd_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if (bytes)
        memmove(dst, src, bytes);
    return TKD_OK;
}

static tkd_status cpu_copy_f32(tkd_backend *be, void *dst, const float *src, size_t n)
{
    return cpu_copy(be, dst, src, n * sizeof(float));
}

static tkd_status cpu_download_f32(tkd_backend *be, float *dst, const void *src, size_t n)
{
    return cpu_copy(be, dst, src, n * sizeof(float));
}

static tkd_status cpu_memset0(tkd_backend *be, void *p, size_t bytes)
{
    (void)be;
    memset(p, 0, bytes);
    return TKD_OK;
}

static tkd_status cpu_sync(tkd_backend *be) { (void)be; return TKD_OK; }

/* ---- forward ---- */

static tkd_status cpu_embedding_fwd(tkd_backend *be, const int32_t *tok, int N, const void *emb, int D, float *x)
{
    (void)be;
    tkd_cpu_embedding_fwd(tok, N, emb, D, x);
    return TKD_OK;
}

static tkd_status cpu_rmsnorm_fwd(tkd_backend *be, const float *x, const void *w, int N, int D, float eps, void *y,
                                  float *rstd)
{
    (void)be;
    tkd_cpu_rmsnorm_fwd(x, w, N, D, eps, y, rstd);
    return TKD_OK;
}

/* act is f32 here: the plain norm (in place is fine: a row's sum is taken before it is written) */
static tkd_status cpu_rmsnorm_act_fwd(tkd_backend *be, const void *x, const void *w, int N, int D, float eps,
                                      void *y, float *rstd)
{
    return cpu_rmsnorm_fwd(be, x, w, N, D, eps, y, rstd);
}

static tkd_status cpu_add_rmsnorm_fwd(tkd_backend *be, const float *x_in, const void *branch, float *x_out,
                                      const void *w, int N, int D, float eps, void *y, float *rstd)
{
    const float *br = branch;
    int64_t n = (int64_t)N * D;
#pragma omp parallel for if (n >= (1 << 16))
    for (int64_t i = 0; i < n; i++)
        x_out[i] = x_in[i] + br[i];
    return cpu_rmsnorm_fwd(be, x_out, w, N, D, eps, y, rstd);
}

static tkd_status cpu_linear_fwd(tkd_backend *be, const void *x, const void *w, const void *b, int N, int K, int M,
                                 void *y)
{
    (void)be;
    tkd_cpu_linear_fwd(x, w, b, N, K, M, 0, y);
    return TKD_OK;
}

static tkd_status cpu_rope_fwd(tkd_backend *be, void *q, void *k, int N, int T, int H, int Hkv, int dh,
                               const float *cos_t, const float *sin_t)
{
    (void)be;
    tkd_cpu_rope_fwd(q, N, T, H, dh, cos_t, sin_t);
    tkd_cpu_rope_fwd(k, N, T, Hkv, dh, cos_t, sin_t);
    return TKD_OK;
}

static tkd_status cpu_attn_fwd(tkd_backend *be, const void *q, const void *k, const void *v, int B, int T, int H,
                               int Hkv, int dh, int window, const int32_t *doc, const void *sinks, void *y,
                               void *saved)
{
    (void)be;
    tkd_cpu_attn_sinks_fwd(q, k, v, B, T, H, Hkv, dh, window, doc, sinks, saved, y);
    return TKD_OK;
}

/* The CPU keeps the softmax probabilities (B, H, T, T): its backward reads them. */
static size_t cpu_attn_saved_bytes(const tkd_backend *be, int B, int T, int H)
{
    (void)be;
    return sizeof(float) * (size_t)B * (size_t)H * (size_t)T * (size_t)T;
}

static tkd_status cpu_swiglu_fwd(tkd_backend *be, const void *g, const void *u, int64_t n, void *h)
{
    (void)be;
    tkd_cpu_swiglu_fwd(g, u, n, h);
    return TKD_OK;
}

/* ---- backward ---- */

static tkd_status cpu_embedding_bwd(tkd_backend *be, const int32_t *tok, int N, const float *dx, int D, float *demb)
{
    (void)be;
    tkd_cpu_embedding_bwd(tok, N, dx, D, demb);
    return TKD_OK;
}

/* act is fp32 here: the act copy of dx is dx itself (copied when asked elsewhere, after the rows are done). */
static tkd_status cpu_rmsnorm_bwd(tkd_backend *be, const void *dy, const float *x, const void *w, const float *rstd,
                                  int N, int D, float *dx, float *dw, void *dx_act)
{
    (void)be;
    tkd_cpu_rmsnorm_bwd(dy, x, w, rstd, N, D, dx, dw);
    if (dx_act && dx && dx_act != dx)
        memcpy(dx_act, dx, sizeof(float) * (size_t)N * (size_t)D);
    return TKD_OK;
}

static tkd_status cpu_linear_bwd(tkd_backend *be, const void *dy, const void *x, const void *w, int N, int K, int M,
                                 void *dx, float *dw, float *db, int dx_acc)
{
    (void)be;
    if (dx && !dx_acc) /* the CPU kernel adds: overwrite = add to zeros */
        memset(dx, 0, sizeof(float) * (size_t)N * (size_t)K);
    tkd_cpu_linear_bwd(dy, x, w, N, K, M, dx, dw, db);
    return TKD_OK;
}

static tkd_status cpu_rope_bwd(tkd_backend *be, void *dq, void *dk, int N, int T, int H, int Hkv, int dh,
                               const float *cos_t, const float *sin_t)
{
    (void)be;
    tkd_cpu_rope_bwd(dq, N, T, H, dh, cos_t, sin_t);
    tkd_cpu_rope_bwd(dk, N, T, Hkv, dh, cos_t, sin_t);
    return TKD_OK;
}

static tkd_status cpu_attn_bwd(tkd_backend *be, const void *dy, const void *q, const void *k, const void *v,
                               const void *y, const void *saved, int B, int T, int H, int Hkv, int dh, int window,
                               const int32_t *doc, void *dq, void *dk, void *dv)
{
    (void)be;
    (void)y;
    (void)window; /* the saved probabilities are zero outside the window and the document */
    (void)doc;
    memset(dq, 0, sizeof(float) * (size_t)B * T * H * dh); /* the CPU kernel adds; the op overwrites */
    memset(dk, 0, sizeof(float) * (size_t)B * T * Hkv * dh);
    memset(dv, 0, sizeof(float) * (size_t)B * T * Hkv * dh);
    tkd_cpu_attn_bwd(dy, q, k, v, saved, B, T, H, Hkv, dh, dq, dk, dv);
    return TKD_OK;
}

static tkd_status cpu_swiglu_bwd(tkd_backend *be, const void *dh, const void *g, const void *u, int64_t n, void *dg,
                                 void *du, int acc)
{
    (void)be;
    if (!acc) { /* the CPU kernel adds: overwrite = add to zeros */
        if (dg)
            memset(dg, 0, sizeof(float) * (size_t)n);
        if (du)
            memset(du, 0, sizeof(float) * (size_t)n);
    }
    tkd_cpu_swiglu_bwd(dh, g, u, n, dg, du);
    return TKD_OK;
}

/* ---- LM-head consumers ---- */

/* Grows the logits chunk and row keys to what a call needs (once per shape, never per chunk). */
static tkd_status cpu_scratch(cpu_impl *c, int64_t rows, int64_t V)
{
    size_t need = (size_t)rows * (size_t)V;
    if (need > c->logits_n) {
        free(c->logits);
        c->logits_n = 0;
        if (!(c->logits = malloc(need * sizeof(float))))
            return tkd_error_set(TKD_ERR_NOMEM, "lm_head.chunk_rows: out of memory for %lld x %lld logits — "
                                 "lower lm_head.chunk_rows", (long long)rows, (long long)V);
        c->logits_n = need;
    }
    if ((size_t)rows > c->rows_n) {
        free(c->row_seq);
        free(c->row_pos);
        c->row_seq = malloc((size_t)rows * sizeof *c->row_seq);
        c->row_pos = malloc((size_t)rows * sizeof *c->row_pos);
        c->rows_n = c->row_seq && c->row_pos ? (size_t)rows : 0;
        if (!c->rows_n)
            return tkd_error_set(TKD_ERR_NOMEM, "lm_head: out of memory for %lld row keys", (long long)rows);
    }
    return TKD_OK;
}

static tkd_status cpu_lmhead_topk(tkd_backend *be, tkd_lmhead_topk_args *a)
{
    cpu_impl *c = be->impl;
    const float *H = a->hidden, *W = a->w;
    int64_t C = a->chunk_rows < a->rows ? a->chunk_rows : a->rows;
    TKD_TRY(cpu_scratch(c, C, a->v));
    for (int64_t r0 = 0; r0 < a->rows; r0 += C) {
        if (tkd_interrupted())
            return tkd_error_set(TKD_ERR_INTERRUPTED, "interrupted");
        int64_t n = a->rows - r0 < C ? a->rows - r0 : C;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)a->v, a->d, 1.0f, H + r0 * a->d, a->d, W,
                    a->d, 0.0f, c->logits, (int)a->v);
        uint32_t *idx = a->idx + r0 * a->k;
        tkd_status st = tkd_topk_cpu(c->logits, n, a->v, a->k, a->tau, idx, a->val + r0 * a->k, a->lse + r0);
        if (st == TKD_ERR_NUMERIC && tkd_topk_first_nonfinite(c->logits, n, a->v, &a->bad_row, &a->bad_col)) {
            a->bad_value = c->logits[a->bad_row * a->v + a->bad_col];
            a->bad_row += r0;
        }
        TKD_TRY(st);
        if (a->s > 0)
            TKD_TRY(tkd_tail_sample_cpu(c->logits, n, a->v, idx, a->k, a->tau, a->s, a->seed, a->row_seq + r0,
                                        a->row_pos + r0, a->tail + r0 * a->s));
    }
    return TKD_OK;
}

/* ---- training: optimizer and gradient helpers ---- */

static tkd_status cpu_f32_to_act(tkd_backend *be, const float *src, void *dst, size_t n)
{
    return cpu_copy(be, dst, src, n * sizeof(float));
}

static tkd_status cpu_act_to_f32(tkd_backend *be, const void *src, float *dst, size_t n)
{
    return cpu_copy(be, dst, src, n * sizeof(float));
}

struct tkd_backend_adamw {
    tkd_adamw_seg *segs; // (n) host copy of the table
    int n;
};

static tkd_status cpu_adamw_create(tkd_backend *be, const tkd_adamw_seg *segs, int n_segs, tkd_backend_adamw **out)
{
    (void)be;
    *out = NULL;
    tkd_backend_adamw *a = calloc(1, sizeof *a);
    if (a)
        a->segs = malloc(sizeof *segs * (size_t)(n_segs > 0 ? n_segs : 1));
    if (!a || !a->segs) {
        free(a);
        return tkd_error_set(TKD_ERR_NOMEM, "adamw: out of memory for %d segments", n_segs);
    }
    if (n_segs > 0)
        memcpy(a->segs, segs, sizeof *segs * (size_t)n_segs);
    a->n = n_segs;
    *out = a;
    return TKD_OK;
}

static void cpu_adamw_free(tkd_backend *be, tkd_backend_adamw *a)
{
    (void)be;
    if (a)
        free(a->segs);
    free(a);
}

/* The compute weights are the fp32 master weights themselves (w; no low part). */
static tkd_status cpu_adamw_step(tkd_backend *be, const tkd_backend_adamw *a, void *w, void *lo, const float *grads,
                                 void *m, void *v, tkd_adamw_dtype mdt, const tkd_adamw_hparams *h, int64_t step,
                                 float grad_scale)
{
    (void)be;
    (void)lo;
    tkd_adamw_update(w, grads, grad_scale, m, v, mdt, a->segs, a->n, h, step);
    return TKD_OK;
}

static tkd_status cpu_master_upload(tkd_backend *be, void *w, void *lo, const float *src, size_t n)
{
    (void)lo;
    return cpu_copy(be, w, src, n * sizeof(float));
}

static tkd_status cpu_master_download(tkd_backend *be, float *dst, const void *w, const void *lo, size_t n)
{
    (void)lo;
    return cpu_copy(be, dst, w, n * sizeof(float));
}

static tkd_status cpu_grad_norm2(tkd_backend *be, const float *g, size_t n, double *norm2)
{
    (void)be;
    *norm2 = tkd_grad_norm2(g, n);
    return TKD_OK;
}

static tkd_status cpu_grad_scale(tkd_backend *be, float *g, size_t n, float s)
{
    (void)be;
    tkd_grad_scale(g, n, s);
    return TKD_OK;
}

/* ---- the fused KL loss ---- */

struct tkd_backend_kl {
    tkd_kl_cpu_ws *ws;
    tkd_kl_batch b; /* the staged batch: the caller's host pointers, h and w set per call */
};

/* The seam's opaque tkd_backend_moe is the op's own workspace. */
static tkd_status cpu_moe_create(tkd_backend *be, const tkd_moe_params *p, int max_tokens, tkd_backend_moe **out)
{
    (void)be;
    return tkd_cpu_moe_ws_create((tkd_cpu_moe_ws **)out, p, max_tokens);
}

static void cpu_moe_free(tkd_backend *be, tkd_backend_moe *m)
{
    (void)be;
    tkd_cpu_moe_ws_free((tkd_cpu_moe_ws *)m);
}

/* act is fp32 on the CPU: the seam's weights are the op's own. */
static tkd_status cpu_moe_fwd(tkd_backend *be, tkd_backend_moe *m, const tkd_moe_act_weights *w, const void *x, int N,
                              void *y)
{
    (void)be;
    const tkd_moe_weights fw = {w->router_w, w->router_b, w->w_gate, w->w_up, w->w_down,
                                w->b_gate,   w->b_up,     w->b_down, w->q};
    return tkd_cpu_moe_fwd((tkd_cpu_moe_ws *)m, &fw, x, N, y, NULL, NULL);
}

static tkd_status cpu_kl_create(tkd_backend *be, const tkd_kl_params *p, int64_t n_max, int d, int v,
                                tkd_backend_kl **out)
{
    (void)be;
    *out = NULL;
    tkd_backend_kl *kl = calloc(1, sizeof *kl);
    if (!kl)
        return tkd_error_set(TKD_ERR_NOMEM, "kl_loss: out of memory");
    tkd_status st = tkd_kl_cpu_ws_create(&kl->ws, p, n_max, d, v);
    if (st != TKD_OK) {
        free(kl);
        return st;
    }
    *out = kl;
    return TKD_OK;
}

static void cpu_kl_free(tkd_backend *be, tkd_backend_kl *kl)
{
    (void)be;
    if (kl)
        tkd_kl_cpu_ws_free(kl->ws);
    free(kl);
}

static tkd_status cpu_kl_stage(tkd_backend *be, tkd_backend_kl *kl, const tkd_kl_params *p, const tkd_kl_batch *hb)
{
    (void)be;
    (void)p;
    kl->b = *hb;
    return TKD_OK;
}

static tkd_status cpu_kl_forward(tkd_backend *be, tkd_backend_kl *kl, const tkd_kl_params *p, const void *h,
                                 const void *w, tkd_kl_result *res, float *dh, float *dw)
{
    (void)be;
    kl->b.h = h;
    kl->b.w = w;
    TKD_TRY(tkd_kl_cpu_validate(kl->ws, p, &kl->b));
    return tkd_kl_cpu_forward(kl->ws, p, &kl->b, res, dh, dw);
}

static tkd_status cpu_kl_backward(tkd_backend *be, tkd_backend_kl *kl, const tkd_kl_params *p, const void *h,
                                  const void *w, float scale, float *dh, float *dw)
{
    (void)be;
    kl->b.h = h;
    kl->b.w = w;
    return tkd_kl_cpu_backward(kl->ws, p, &kl->b, scale, dh, dw);
}

/* Mark i = the monotonic clock now (the ops before it have returned: they are synchronous). */
static tkd_status cpu_mark(tkd_backend *be, int64_t i)
{
    cpu_impl *c = be->impl;
    if (i < 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "backend mark: index %lld", (long long)i);
    if (i >= c->marks_n) { /* grows by doubling: a profiled step allocates a few times, then never */
        int64_t n = c->marks_n ? c->marks_n : 256;
        while (n <= i)
            n *= 2;
        double *m = realloc(c->marks, sizeof(double) * (size_t)n);
        if (!m)
            return tkd_error_set(TKD_ERR_NOMEM, "backend marks: out of memory for %lld", (long long)n);
        for (int64_t j = c->marks_n; j < n; j++)
            m[j] = NAN; /* not recorded yet: mark_ms refuses it */
        c->marks = m;
        c->marks_n = n;
    }
    c->marks[i] = tkd_progress_now();
    return TKD_OK;
}

static tkd_status cpu_mark_ms(tkd_backend *be, int64_t a, int64_t b, double *ms)
{
    cpu_impl *c = be->impl;
    if (a < 0 || b < 0 || a >= c->marks_n || b >= c->marks_n || isnan(c->marks[a]) || isnan(c->marks[b]))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "backend mark: %lld or %lld was never recorded", (long long)a,
                             (long long)b);
    *ms = (c->marks[b] - c->marks[a]) * 1e3;
    return TKD_OK;
}

/* A fixed 256 rows: a few hundred MB of fp32 logits at real vocabularies, plenty of rows for the
 * threaded GEMM and top-k. */
static int cpu_lmhead_chunk_rows(const tkd_backend *be, int64_t v)
{
    (void)be, (void)v;
    return 256;
}

static const tkd_backend_ops cpu_ops = {
    .close = cpu_close,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .upload_f32 = cpu_copy_f32,
    .download_f32 = cpu_download_f32,
    .memset0 = cpu_memset0,
    .sync = cpu_sync,
    .mem_info = cpu_mem_info,
    .embedding_fwd = cpu_embedding_fwd,
    .rmsnorm_fwd = cpu_rmsnorm_fwd,
    .add_rmsnorm_fwd = cpu_add_rmsnorm_fwd,
    .rmsnorm_act_fwd = cpu_rmsnorm_act_fwd,
    .linear_fwd = cpu_linear_fwd,
    .rope_fwd = cpu_rope_fwd,
    .attn_fwd = cpu_attn_fwd,
    .attn_saved_bytes = cpu_attn_saved_bytes,
    .swiglu_fwd = cpu_swiglu_fwd,
    .embedding_bwd = cpu_embedding_bwd,
    .rmsnorm_bwd = cpu_rmsnorm_bwd,
    .linear_bwd = cpu_linear_bwd,
    .rope_bwd = cpu_rope_bwd,
    .attn_bwd = cpu_attn_bwd,
    .swiglu_bwd = cpu_swiglu_bwd,
    .lmhead_topk = cpu_lmhead_topk,
    .lmhead_chunk_rows = cpu_lmhead_chunk_rows,
    .f32_to_act = cpu_f32_to_act,
    .act_to_f32 = cpu_act_to_f32,
    .adamw_create = cpu_adamw_create,
    .adamw_free = cpu_adamw_free,
    .adamw_step = cpu_adamw_step,
    .master_upload = cpu_master_upload,
    .master_download = cpu_master_download,
    .grad_norm2 = cpu_grad_norm2,
    .grad_scale = cpu_grad_scale,
    .moe_create = cpu_moe_create,
    .moe_free = cpu_moe_free,
    .moe_fwd = cpu_moe_fwd,
    .kl_create = cpu_kl_create,
    .kl_free = cpu_kl_free,
    .kl_stage = cpu_kl_stage,
    .kl_forward = cpu_kl_forward,
    .kl_backward = cpu_kl_backward,
    .mark = cpu_mark,
    .mark_ms = cpu_mark_ms,
};

tkd_status tkd_backend_cpu_open(tkd_backend **out)
{
    *out = NULL;
    tkd_backend *be = calloc(1, sizeof *be);
    cpu_impl *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return tkd_error_set(TKD_ERR_NOMEM, "backend: out of memory");
    }
    be->device = TKD_DEVICE_CPU;
    be->name = "cpu";
    be->act_size = sizeof(float);
    be->host_addressable = 1;
    be->data_parallel = 0;
    be->attn_window = 1;
    be->attn_window_bwd = 1;
    be->attn_docs = 1;
    be->attn_docs_bwd = 1;
    be->moe_mxfp4 = 1;
    be->op = &cpu_ops;
    be->impl = c;
    *out = be;
    return TKD_OK;
}
