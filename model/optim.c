/* optim.c — see optim.h. */
#include "model/optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/adamw.h"

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

/* The update's hyper-parameters from the config at learning rate lr. */
static tkd_adamw_hparams hparams(const tkd_optim_config *c, double lr)
{
    tkd_adamw_hparams h = {.lr = lr, .beta1 = c->beta1, .beta2 = c->beta2, .eps = c->eps,
                           .weight_decay = c->weight_decay};
    return h;
}

void tkd_adamw_step(tkd_adamw *o, float *params, const float *grads, const tkd_param_info *info,
                    int n_info, double lr)
{
    o->step++;
    tkd_adamw_hparams h = hparams(&o->cfg, lr);
    for (int i = 0; i < n_info; i++) {
        tkd_adamw_seg seg = {.offset = info[i].offset, .numel = info[i].numel, .decay = info[i].decay};
        tkd_adamw_update(params, grads, o->m, o->v, &seg, 1, &h, o->step);
    }
}

double tkd_optim_grad_norm(const float *g, size_t n) { return sqrt(tkd_grad_norm2(g, n)); }

tkd_status tkd_optim_clip(float *g, size_t n, double max_norm, double *norm_out)
{
    double norm = tkd_optim_grad_norm(g, n);
    if (norm_out)
        *norm_out = norm;
    float coef = 1.0f;
    TKD_TRY(tkd_grad_clip_coef(norm, max_norm, &coef));
    if (coef < 1.0f)
        tkd_optim_scale(g, n, coef);
    return TKD_OK;
}

void tkd_optim_scale(float *g, size_t n, float s) { tkd_grad_scale(g, n, s); }

void tkd_optim_zero(float *g, size_t n) { memset(g, 0, sizeof(float) * n); }
