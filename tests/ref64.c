/* ref64.c — see ref64.h. */
#include "tests/ref64.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>

#include "common/half.h"
#include "kernels/cpu/cpu_ops_ref.h"

double tkd_ref64_dot(const float *a, const float *b, int n)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)a[i] * b[i], s1 += (double)a[i + 1] * b[i + 1];
        s2 += (double)a[i + 2] * b[i + 2], s3 += (double)a[i + 3] * b[i + 3];
    }
    for (; i < n; i++)
        s0 += (double)a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

const float *tkd_ref64_row(const float *x, int T, int heads, int dh, int b, int t, int h)
{
    return x + (((int64_t)b * T + t) * heads + h) * dh;
}

int tkd_ref64_first_key(int window, const int32_t *doc, int T, int b, int t)
{
    int j0 = window > 0 && t - window + 1 > 0 ? t - window + 1 : 0;
    if (doc && doc[(int64_t)b * T + t] > j0)
        j0 = doc[(int64_t)b * T + t];
    return j0;
}

double tkd_ref64_attn_doc_row(const tkd_ref64_attn *a, const int32_t *doc, int b, int h, int t, double *y,
                              double *sc)
{
    const int g = h / (a->H / a->Hkv), dh = a->dh;
    const int j0 = tkd_ref64_first_key(a->window, doc, a->T, b, t);
    const float *qi = tkd_ref64_row(a->q, a->T, a->H, dh, b, t, h);
    const double scale = 1.0 / sqrt((double)dh);
    double m = a->sinks ? a->sinks[h] : -INFINITY, sum = 0.0;
    for (int j = j0; j <= t; j++) {
        sc[j] = tkd_ref64_dot(qi, tkd_ref64_row(a->k, a->T, a->Hkv, dh, b, j, g), dh) * scale;
        m = fmax(m, sc[j]);
    }
    for (int d = 0; d < dh; d++)
        y[d] = 0.0;
    if (a->sinks)
        sum = exp(a->sinks[h] - m); /* weight without a value */
    for (int j = j0; j <= t; j++) {
        const float *vj = tkd_ref64_row(a->v, a->T, a->Hkv, dh, b, j, g);
        const double p = exp(sc[j] - m);
        sum += p;
        for (int d = 0; d < dh; d++)
            y[d] += p * vj[d];
    }
    for (int d = 0; d < dh; d++)
        y[d] /= sum;
    return m + log(sum);
}

double tkd_ref64_attn_row(const tkd_ref64_attn *a, int b, int h, int t, double *y, double *sc)
{
    return tkd_ref64_attn_doc_row(a, NULL, b, h, t, y, sc);
}

double tkd_ref64_attn_window_row(const tkd_ref64_attn *a, int window, int b, int h, int t, double *y, double *sc)
{
    tkd_ref64_attn w = *a;
    w.window = window;
    return tkd_ref64_attn_row(&w, b, h, t, y, sc);
}

void tkd_ref64_rope(const uint16_t *x, int N, int T, int nh, int dh, const float *c, const float *s, int backward,
                    double bound, double **ref, double **abs_i)
{
    const size_t n = (size_t)N * nh * dh;
    const int half = dh / 2;
    *ref = malloc(n * 8), *abs_i = malloc(n * 8);
    assert_true(*ref && *abs_i);
    for (size_t i = 0; i < n; i++)
        (*ref)[i] = tkd_bf16_to_f32(x[i]);
    for (size_t r = 0; r < n / (size_t)dh; r++)
        for (int i = 0; i < half; i++) {
            size_t a = r * dh + i, b = a + half;
            double m = bound * (fabs((*ref)[a]) + fabs((*ref)[b]));
            (*abs_i)[a] = (*abs_i)[b] = m;
        }
    if (backward)
        tkd_ref_rope_bwd(*ref, N, T, nh, dh, c, s);
    else
        tkd_ref_rope_fwd(*ref, N, T, nh, dh, c, s);
}
