/* adamw.c — see adamw.h. The loops are model/optim.c's former bodies, unchanged, so a run on the
 * CPU gives the same bits before and after they moved here. */
#include "kernels/cpu/adamw.h"

#include <math.h>

/* torch's _single_tensor_adamw in fp32, same operation order, after the clip's g *= s (its own
 * statement, rounded to fp32 before use: the same bits as scaling the gradients in place first;
 * s = 1 leaves g exactly as it is):
 * p *= 1 − lr·wd; m = lerp(m, g, 1 − β1); v = β2·v + (1 − β2)·g²;
 * p −= (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps). */
static void adamw_span(float *p, const float *g, float s, float *m, float *v, size_t n, float keep, float one_m_b1,
                       float b2, float one_m_b2, float eps, float step_size, float bc2_sqrt)
{
#pragma omp parallel for schedule(static) if (n >= 32768)
    for (size_t i = 0; i < n; i++) {
        const float gi = g[i] * s;
        p[i] *= keep;
        m[i] += one_m_b1 * (gi - m[i]);
        v[i] = v[i] * b2 + one_m_b2 * gi * gi;
        float denom = sqrtf(v[i]) / bc2_sqrt + eps;
        p[i] -= step_size * (m[i] / denom);
    }
}

void tkd_adamw_update(float *params, const float *grads, float grad_scale, float *m, float *v,
                      const tkd_adamw_seg *segs, int n_segs, const tkd_adamw_hparams *h, int64_t step)
{
    double bc1 = 1.0 - pow(h->beta1, (double)step), bc2 = 1.0 - pow(h->beta2, (double)step);
    for (int i = 0; i < n_segs; i++) {
        size_t off = segs[i].offset;
        /* scalars formed in double and rounded once, as Python floats reach torch's kernels */
        double wd = segs[i].decay ? h->weight_decay : 0.0;
        adamw_span(params + off, grads + off, grad_scale, m + off, v + off, segs[i].numel, (float)(1.0 - h->lr * wd),
                   (float)(1.0 - h->beta1), (float)h->beta2, (float)(1.0 - h->beta2), (float)h->eps,
                   (float)(h->lr / bc1), (float)sqrt(bc2));
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
