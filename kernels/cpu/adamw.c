/* adamw.c — see adamw.h. The per-element maths is model/optim.c's former loop body, operation for
 * operation, so a run on the CPU gives the same bits before and after it moved here. */
#include "kernels/cpu/adamw.h"

#include <math.h>

#include "common/half.h"

const char *tkd_adamw_dtype_name(tkd_adamw_dtype d) { return d == TKD_ADAMW_DTYPE_BF16 ? "bf16" : "f32"; }

size_t tkd_adamw_dtype_size(tkd_adamw_dtype d) { return d == TKD_ADAMW_DTYPE_BF16 ? 2 : 4; }

/* One segment's scalars, each formed in double and rounded once, as Python floats reach torch's
 * kernels. */
typedef struct span_scalars {
    float s; /* the clip coefficient (1: none) */
    float keep, one_m_b1, b2, one_m_b2, eps, step_size, bc2_sqrt;
} span_scalars;

static span_scalars scalars(const tkd_adamw_hparams *h, int decay, double bc1, double bc2, float grad_scale)
{
    double wd = decay ? h->weight_decay : 0.0;
    return (span_scalars){.s = grad_scale, .keep = (float)(1.0 - h->lr * wd), .one_m_b1 = (float)(1.0 - h->beta1),
                          .b2 = (float)h->beta2, .one_m_b2 = (float)(1.0 - h->beta2), .eps = (float)h->eps,
                          .step_size = (float)(h->lr / bc1), .bc2_sqrt = (float)sqrt(bc2)};
}

/* torch's _single_tensor_adamw for one element in fp32, same operation order, after the clip's
 * g *= s (its own statement, rounded to fp32 before use: the same bits as scaling the gradients in
 * place first; s = 1 leaves g exactly as it is):
 * p *= 1 − lr·wd; m = lerp(m, g, 1 − β1); v = β2·v + (1 − β2)·g²;
 * p −= (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps).
 * Both moment layouts run exactly this (C11 contracts no multiply-adds: -std=c11 is
 * -ffp-contract=off), so the bf16 state differs from the fp32 one only by the stores' rounding. */
static inline void adamw_elem(float *p, float g, float *m, float *v, const span_scalars *k)
{
    const float gi = g * k->s;
    *p *= k->keep;
    *m += k->one_m_b1 * (gi - *m);
    *v = *v * k->b2 + k->one_m_b2 * gi * gi;
    float denom = sqrtf(*v) / k->bc2_sqrt + k->eps;
    *p -= k->step_size * (*m / denom);
}

static void adamw_span(float *p, const float *g, float *m, float *v, size_t n, span_scalars k)
{
#pragma omp parallel for schedule(static) if (n >= 32768)
    for (size_t i = 0; i < n; i++)
        adamw_elem(&p[i], g[i], &m[i], &v[i], &k);
}

/* The moments widened to fp32 (exact), updated, stored back to nearest even bf16. */
static void adamw_span_bf16(float *p, const float *g, uint16_t *m, uint16_t *v, size_t n, span_scalars k)
{
#pragma omp parallel for schedule(static) if (n >= 32768)
    for (size_t i = 0; i < n; i++) {
        float mi = tkd_bf16_to_f32(m[i]), vi = tkd_bf16_to_f32(v[i]);
        adamw_elem(&p[i], g[i], &mi, &vi, &k);
        m[i] = tkd_f32_to_bf16(mi);
        v[i] = tkd_f32_to_bf16(vi);
    }
}

void tkd_adamw_update(float *params, const float *grads, float grad_scale, void *m, void *v, tkd_adamw_dtype mdt,
                      const tkd_adamw_seg *segs, int n_segs, const tkd_adamw_hparams *h, int64_t step)
{
    double bc1 = 1.0 - pow(h->beta1, (double)step), bc2 = 1.0 - pow(h->beta2, (double)step);
    for (int i = 0; i < n_segs; i++) {
        const size_t off = segs[i].offset;
        const span_scalars k = scalars(h, segs[i].decay, bc1, bc2, grad_scale);
        if (mdt == TKD_ADAMW_DTYPE_BF16)
            adamw_span_bf16(params + off, grads + off, (uint16_t *)m + off, (uint16_t *)v + off, segs[i].numel, k);
        else
            adamw_span(params + off, grads + off, (float *)m + off, (float *)v + off, segs[i].numel, k);
    }
}

double tkd_grad_norm2(const float *g, size_t n)
{
    double s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static) if (n >= 32768)
    for (size_t i = 0; i < n; i++)
        s += (double)g[i] * g[i];
    return s;
}

void tkd_grad_scale(float *g, size_t n, float s)
{
#pragma omp parallel for schedule(static) if (n >= 32768)
    for (size_t i = 0; i < n; i++)
        g[i] *= s;
}
