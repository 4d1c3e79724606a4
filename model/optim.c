/* optim.c — see optim.h. */
#include "model/optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

tkd_status tkd_adamw_init(const tkd_optim_config *c, size_t n, tkd_adamw **out)
{
    *out = NULL;
    tkd_adamw *o = calloc(1, sizeof *o);
    float *mv = calloc(2 * n + 1, sizeof(float)); /* m and v in one allocation */
    if (!o || !mv) {
        free(o);
        free(mv);
        return tkd_error_set(TKD_ERR_NOMEM, "adamw: out of memory for %zu parameters", n);
    }
    o->cfg = *c;
    o->n = n;
    o->m = mv;
    o->v = mv + n;
    *out = o;
    return TKD_OK;
}

void tkd_adamw_free(tkd_adamw *o)
{
    if (!o)
        return;
    free(o->m);
    free(o);
}

/* torch's _single_tensor_adamw in fp32, same operation order:
 * p *= 1 − lr·wd; m = lerp(m, g, 1 − β1); v = β2·v + (1 − β2)·g²;
 * p −= (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps). */
static void adamw_span(float *p, const float *g, float *m, float *v, size_t n, float keep,
                       float one_m_b1, float b2, float one_m_b2, float eps, float step_size,
                       float bc2_sqrt)
{
#pragma omp parallel for schedule(static) if (n >= 32768)
    for (size_t i = 0; i < n; i++) {
        p[i] *= keep;
        m[i] += one_m_b1 * (g[i] - m[i]);
        v[i] = v[i] * b2 + one_m_b2 * g[i] * g[i];
        float denom = sqrtf(v[i]) / bc2_sqrt + eps;
        p[i] -= step_size * (m[i] / denom);
    }
}

void tkd_adamw_step(tkd_adamw *o, float *params, const float *grads, const tkd_param_info *info,
                    int n_info, double lr)
{
    const tkd_optim_config *c = &o->cfg;
    o->step++;
    double bc1 = 1.0 - pow(c->beta1, (double)o->step), bc2 = 1.0 - pow(c->beta2, (double)o->step);
    for (int i = 0; i < n_info; i++) {
        size_t off = info[i].offset;
        /* scalars formed in double and rounded once, as Python floats reach torch's kernels */
        double wd = info[i].decay ? c->weight_decay : 0.0;
        adamw_span(params + off, grads + off, o->m + off, o->v + off, info[i].numel,
                   (float)(1.0 - lr * wd), (float)(1.0 - c->beta1), (float)c->beta2,
                   (float)(1.0 - c->beta2), (float)c->eps, (float)(lr / bc1), (float)sqrt(bc2));
    }
}

double tkd_optim_grad_norm(const float *g, size_t n)
{
    double s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static) if (n >= 32768)
    for (size_t i = 0; i < n; i++)
        s += (double)g[i] * g[i];
    return sqrt(s);
}

tkd_status tkd_optim_clip(float *g, size_t n, double max_norm, double *norm_out)
{
    double norm = tkd_optim_grad_norm(g, n);
    if (norm_out)
        *norm_out = norm;
    if (!isfinite(norm))
        return tkd_error_set(TKD_ERR_NUMERIC, "gradient norm is %g: the step is skipped (lower the lr?)", norm);
    if (max_norm > 0) {
        float coef = (float)(max_norm / (norm + 1e-6));
        if (coef < 1.0f)
            tkd_optim_scale(g, n, coef);
    }
    return TKD_OK;
}

void tkd_optim_scale(float *g, size_t n, float s)
{
#pragma omp parallel for schedule(static) if (n >= 32768)
    for (size_t i = 0; i < n; i++)
        g[i] *= s;
}

void tkd_optim_zero(float *g, size_t n) { memset(g, 0, sizeof(float) * n); }
