/* optim_testutil.c — see optim_testutil.h. */
#include "tests/optim_testutil.h"

#include <math.h>
#include <string.h>

#include "kernels/cpu/adamw.h"
#include "kernels/grad_clip.h"

void tkd_adamw_step(tkd_adamw *o, float *params, const float *grads, const tkd_param_info *info,
                    int n_info, double lr)
{
    o->step++;
    const tkd_adamw_hparams h = {.lr = lr, .beta1 = o->cfg.beta1, .beta2 = o->cfg.beta2, .eps = o->cfg.eps,
                                 .weight_decay = o->cfg.weight_decay};
    for (int i = 0; i < n_info; i++) {
        tkd_adamw_seg seg = {.offset = info[i].offset, .numel = info[i].numel, .decay = info[i].decay};
        const int bf16 = o->cfg.state_dtype == TKD_ADAMW_DTYPE_BF16;
        tkd_adamw_update(params, grads, 1.0f, bf16 ? (void *)o->m_bf16 : o->m, bf16 ? (void *)o->v_bf16 : o->v,
                         o->cfg.state_dtype, &seg, 1, &h, o->step);
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
