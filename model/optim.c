/* optim.c — see optim.h. */
#include "model/optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "kernels/grad_clip.h"

void tkd_optim_config_defaults(tkd_optim_config *c)
{
    c->lr = 3e-4;
    c->min_lr = 3e-5;
    c->warmup_steps = 0;
    c->total_steps = 1000;
    c->beta1 = 0.9;
    c->beta2 = 0.95;
    c->eps = 1e-8;
    c->weight_decay = 0.1;
    c->clip_norm = 1.0;
    c->state_dtype = TKD_ADAMW_DTYPE_F32;
}

double tkd_optim_lr(const tkd_optim_config *c, int64_t s)
{
    if (s < c->warmup_steps)
        return c->lr * (double)(s + 1) / (double)c->warmup_steps;
    if (s >= c->total_steps || c->total_steps <= c->warmup_steps)
        return c->min_lr;
    double p = (double)(s - c->warmup_steps) / (double)(c->total_steps - c->warmup_steps);
    return c->min_lr + 0.5 * (c->lr - c->min_lr) * (1.0 + cos(M_PI * p));
}

/* Elements per moment in the one allocation of m and v, n ≤ cap. fp32: n, at least 1 (no 0-byte
 * allocation). bf16: n rounded up to 8, and 8 when n is 0, so v starts 16 bytes aligned like m (the
 * CUDA kernel's 4-wide path needs 8). */
static size_t moments_cap(tkd_adamw_dtype d, size_t n)
{
    if (d == TKD_ADAMW_DTYPE_BF16)
        return (n + 7) / 8 * 8 + (n == 0) * 8;
    return n > 0 ? n : 1;
}

/* Points o's moment pair of its dtype into mv (2·cap values: m, then v). */
static void moments_place(tkd_adamw *o, void *mv, size_t cap)
{
    if (o->cfg.state_dtype == TKD_ADAMW_DTYPE_BF16)
        o->m_bf16 = mv, o->v_bf16 = o->m_bf16 + cap;
    else
        o->m = mv, o->v = o->m + cap;
}

/* The first (second = 0) or second moment; the first is also the start of their one allocation. */
static void *moment_ptr(const tkd_adamw *o, int second)
{
    if (o->cfg.state_dtype == TKD_ADAMW_DTYPE_BF16)
        return second ? (void *)o->v_bf16 : (void *)o->m_bf16;
    return second ? (void *)o->v : (void *)o->m;
}

static tkd_status check_dtype(tkd_adamw_dtype d)
{
    return d == TKD_ADAMW_DTYPE_F32 || d == TKD_ADAMW_DTYPE_BF16
               ? TKD_OK
               : tkd_error_set(TKD_ERR_INVALID_ARG, "adamw: state dtype %d is neither f32 nor bf16", (int)d);
}

tkd_status tkd_adamw_init(const tkd_optim_config *c, size_t n, tkd_adamw **out)
{
    *out = NULL;
    TKD_TRY(check_dtype(c->state_dtype));
    const size_t cap = moments_cap(c->state_dtype, n);
    tkd_adamw *o = calloc(1, sizeof *o);
    void *mv = calloc(2 * cap, tkd_adamw_dtype_size(c->state_dtype)); /* m and v in one allocation */
    if (!o || !mv) {
        free(o);
        free(mv);
        return tkd_error_set(TKD_ERR_NOMEM, "adamw: out of memory for %zu parameters", n);
    }
    o->cfg = *c;
    o->n = n;
    moments_place(o, mv, cap);
    *out = o;
    return TKD_OK;
}

/* The update's hyper-parameters from the config at learning rate lr. */
static tkd_adamw_hparams hparams(const tkd_optim_config *c, double lr)
{
    tkd_adamw_hparams h = {.lr = lr, .beta1 = c->beta1, .beta2 = c->beta2, .eps = c->eps,
                           .weight_decay = c->weight_decay};
    return h;
}

void tkd_adamw_free(tkd_adamw *o)
{
    if (!o)
        return;
    if (o->be) {
        o->be->op->adamw_free(o->be, o->table);
        o->be->op->free(o->be, moment_ptr(o, 0));
    } else {
        free(moment_ptr(o, 0));
    }
    free(o);
}

/* The model's tensors cut to [begin, end), offsets counted from begin. */
static tkd_status adamw_table(const tkd_model *m, size_t begin, size_t end, tkd_backend_adamw **out)
{
    tkd_adamw_seg *segs = malloc(sizeof *segs * (size_t)(m->n_info > 0 ? m->n_info : 1));
    if (!segs)
        return tkd_error_set(TKD_ERR_NOMEM, "adamw: out of memory");
    int n = 0;
    for (int i = 0; i < m->n_info; i++) {
        size_t s0 = m->info[i].offset, s1 = s0 + m->info[i].numel;
        s0 = s0 > begin ? s0 : begin;
        s1 = s1 < end ? s1 : end;
        if (s0 < s1)
            segs[n++] = (tkd_adamw_seg){.offset = s0 - begin, .numel = s1 - s0, .decay = m->info[i].decay};
    }
    tkd_status st = m->be->op->adamw_create(m->be, segs, n, out);
    free(segs);
    return st;
}

tkd_status tkd_adamw_init_on(const tkd_optim_config *c, const tkd_model *m, tkd_adamw **out)
{
    return tkd_adamw_init_shard(c, m, 0, m->n_params, out);
}

tkd_status tkd_adamw_init_shard(const tkd_optim_config *c, const tkd_model *m, size_t begin, size_t end,
                                tkd_adamw **out)
{
    *out = NULL;
    tkd_backend *be = m->be;
    TKD_TRY(check_dtype(c->state_dtype));
    if (!be->op->adamw_step)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "adamw: the %s backend has no optimizer", be->name);
    if (begin > end || end > m->n_params)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "adamw: shard [%zu, %zu) outside the %zu parameters", begin, end,
                             m->n_params);
    tkd_adamw *o = calloc(1, sizeof *o);
    if (!o)
        return tkd_error_set(TKD_ERR_NOMEM, "adamw: out of memory");
    o->cfg = *c;
    o->n = end - begin;
    o->begin = begin;
    o->be = be;
    /* an empty shard (the last ranks of a tiny model) still gets a pair of values: no 0-byte alloc */
    size_t cap = moments_cap(c->state_dtype, o->n);
    void *mv = NULL;
    tkd_status st = be->op->alloc(be, 2 * cap * tkd_adamw_dtype_size(c->state_dtype), "AdamW moments", &mv);
    if (st == TKD_OK) {
        moments_place(o, mv, cap); /* m and v in one allocation */
        st = adamw_table(m, begin, end, &o->table);
    }
    if (st != TKD_OK) {
        tkd_adamw_free(o);
        return st;
    }
    *out = o;
    return TKD_OK;
}

tkd_status tkd_adamw_step_model_scaled(tkd_adamw *o, tkd_model *m, double lr, float grad_scale)
{
    if (o->be != m->be || o->begin + o->n > m->n_params || !m->grads || (!m->params && !m->master_lo))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "adamw: the state was not made for this model on %s, or the model "
                             "has no gradients", m->be->name);
    if (o->n == 0) { /* an empty shard: nothing to update, the step still counts */
        o->step++;
        return TKD_OK;
    }
    tkd_adamw_hparams h = hparams(&o->cfg, lr);
    size_t b = o->begin; /* a ZeRO-1 shard [b, b + n): every array advanced by b (backend.h) */
    void *w = (char *)m->dparams + b * m->be->act_size;
    void *lo = m->master_lo ? (char *)m->master_lo + b * m->be->master_lo_size : NULL;
    tkd_status st = m->be->op->adamw_step(m->be, o->table, w, lo, m->grads + b, moment_ptr(o, 0), moment_ptr(o, 1),
                                          o->cfg.state_dtype, &h, o->step + 1, grad_scale);
    if (st == TKD_OK)
        o->step++;
    return st;
}

tkd_status tkd_adamw_step_model(tkd_adamw *o, tkd_model *m, double lr)
{
    return tkd_adamw_step_model_scaled(o, m, lr, 1.0f);
}

/* The gradient norm and the clip coefficient (1 when not clipping), the gradients untouched. */
static tkd_status clip_coef_model(tkd_model *m, double max_norm, double *norm_out, float *coef)
{
    if (!m->grads)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "clip: the model has no gradients (no training forward yet)");
    double norm2 = 0;
    TKD_TRY(m->be->op->grad_norm2(m->be, m->grads, m->n_params, &norm2));
    double norm = sqrt(norm2);
    if (norm_out)
        *norm_out = norm;
    *coef = 1.0f;
    return tkd_grad_clip_coef(norm, max_norm, coef);
}

tkd_status tkd_adamw_clip_step_model(tkd_adamw *o, tkd_model *m, double lr, double max_norm, double *norm_out)
{
    float coef = 1.0f;
    TKD_TRY(clip_coef_model(m, max_norm, norm_out, &coef));
    return tkd_adamw_step_model_scaled(o, m, lr, coef);
}

/* bf16 moments <-> host fp32: exact widening, nearest-even narrowing (common/half.h). */
static void widen(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = tkd_bf16_to_f32(src[i]);
}

static void narrow(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = tkd_f32_to_bf16(src[i]);
}

/* bf16 moments in backend memory to host fp32, through one host buffer of n bf16 values. */
static tkd_status download_bf16(const tkd_adamw *o, float *m, float *v)
{
    uint16_t *tmp = malloc(o->n * sizeof *tmp + 1);
    if (!tmp)
        return tkd_error_set(TKD_ERR_NOMEM, "adamw: out of host memory for the moments");
    tkd_status st = TKD_OK;
    for (int k = 0; k < 2 && st == TKD_OK; k++) {
        st = o->be->op->download(o->be, tmp, moment_ptr(o, k), o->n * sizeof *tmp);
        if (st == TKD_OK)
            widen(k ? v : m, tmp, o->n);
    }
    free(tmp);
    return st;
}

/* Host fp32 to bf16 moments in backend memory; both halves staged at once, since an upload may
 * still read its source until the sync. */
static tkd_status upload_bf16(tkd_adamw *o, const float *m, const float *v)
{
    uint16_t *tmp = malloc(2 * o->n * sizeof *tmp + 1);
    if (!tmp)
        return tkd_error_set(TKD_ERR_NOMEM, "adamw: out of host memory for the moments");
    narrow(tmp, m, o->n);
    narrow(tmp + o->n, v, o->n);
    tkd_status st = o->be->op->upload(o->be, o->m_bf16, tmp, o->n * sizeof *tmp);
    if (st == TKD_OK)
        st = o->be->op->upload(o->be, o->v_bf16, tmp + o->n, o->n * sizeof *tmp);
    if (st == TKD_OK)
        st = o->be->op->sync(o->be);
    free(tmp);
    return st;
}

tkd_status tkd_adamw_moments_get(const tkd_adamw *o, float *m, float *v)
{
    const int bf16 = o->cfg.state_dtype == TKD_ADAMW_DTYPE_BF16;
    if (!o->be && bf16) {
        widen(m, o->m_bf16, o->n);
        widen(v, o->v_bf16, o->n);
        return TKD_OK;
    }
    if (!o->be) {
        memcpy(m, o->m, o->n * sizeof(float));
        memcpy(v, o->v, o->n * sizeof(float));
        return TKD_OK;
    }
    if (bf16)
        return download_bf16(o, m, v);
    TKD_TRY(o->be->op->download(o->be, m, o->m, o->n * sizeof(float)));
    return o->be->op->download(o->be, v, o->v, o->n * sizeof(float));
}

tkd_status tkd_adamw_moments_set(tkd_adamw *o, const float *m, const float *v)
{
    const int bf16 = o->cfg.state_dtype == TKD_ADAMW_DTYPE_BF16;
    if (!o->be && bf16) {
        narrow(o->m_bf16, m, o->n);
        narrow(o->v_bf16, v, o->n);
        return TKD_OK;
    }
    if (!o->be) {
        memcpy(o->m, m, o->n * sizeof(float));
        memcpy(o->v, v, o->n * sizeof(float));
        return TKD_OK;
    }
    if (bf16)
        return upload_bf16(o, m, v);
    TKD_TRY(o->be->op->upload(o->be, o->m, m, o->n * sizeof(float)));
    TKD_TRY(o->be->op->upload(o->be, o->v, v, o->n * sizeof(float)));
    return o->be->op->sync(o->be); /* the caller's host arrays may go once this returns */
}

tkd_status tkd_optim_clip_model(tkd_model *m, double max_norm, double *norm_out)
{
    float coef = 1.0f;
    TKD_TRY(clip_coef_model(m, max_norm, norm_out, &coef));
    if (coef < 1.0f)
        TKD_TRY(m->be->op->grad_scale(m->be, m->grads, m->n_params, coef));
    return TKD_OK;
}
