/* cpu_ops.c — see cpu_ops.h. GEMMs through cblas_sgemm; the other loops are OpenMP-parallel over
 * independent rows / heads / columns, so results do not depend on the thread count. */
#include "kernels/cpu/cpu_ops.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

/* Below this many element-operations a parallel region costs more than it saves (and on a loaded
 * machine an oversubscribed barrier can cost milliseconds), so small calls stay on one thread. */
#define TKD_OMP_MIN_WORK 32768

void tkd_cpu_embedding_fwd(const int32_t *tok, int N, const float *emb, int D, float *out)
{
#pragma omp parallel for schedule(static) if ((int64_t)N * D >= TKD_OMP_MIN_WORK)
    for (int n = 0; n < N; n++)
        memcpy(out + (int64_t)n * D, emb + (int64_t)tok[n] * D, sizeof(float) * (size_t)D);
}

void tkd_cpu_embedding_bwd(const int32_t *tok, int N, const float *dout, int D, float *demb)
{
    /* serial over rows: a token repeated in the batch adds into the same row */
    for (int n = 0; n < N; n++) {
        float *dst = demb + (int64_t)tok[n] * D;
        const float *src = dout + (int64_t)n * D;
        for (int d = 0; d < D; d++)
            dst[d] += src[d];
    }
}

void tkd_cpu_rmsnorm_fwd(const float *x, const float *w, int N, int D, float eps, float *y,
                         float *rstd)
{
#pragma omp parallel for schedule(static) if ((int64_t)N * D >= TKD_OMP_MIN_WORK)
    for (int n = 0; n < N; n++) {
        const float *xr = x + (int64_t)n * D;
        float *yr = y + (int64_t)n * D;
        double ss = 0;
        for (int d = 0; d < D; d++)
            ss += (double)xr[d] * xr[d];
        float r = (float)(1.0 / sqrt(ss / D + eps));
        for (int d = 0; d < D; d++)
            yr[d] = w[d] * (xr[d] * r);
        if (rstd)
            rstd[n] = r;
    }
}

void tkd_cpu_rmsnorm_bwd(const float *dy, const float *x, const float *w, const float *rstd, int N,
                         int D, float *dx, float *dw)
{
    if (dx) {
#pragma omp parallel for schedule(static) if ((int64_t)N * D >= TKD_OMP_MIN_WORK)
        for (int n = 0; n < N; n++) {
            const float *xr = x + (int64_t)n * D, *g = dy + (int64_t)n * D;
            float *o = dx + (int64_t)n * D;
            float r = rstd[n];
            double dot = 0;
            for (int d = 0; d < D; d++)
                dot += (double)g[d] * w[d] * xr[d];
            float c = (float)(dot * r / D) * r; /* mean(dy·w·xhat), times r once more for xhat */
            for (int d = 0; d < D; d++)
                o[d] += r * (g[d] * w[d] - xr[d] * c);
        }
    }
    if (dw) {
        /* per column, rows in order: deterministic whatever the thread count */
#pragma omp parallel for schedule(static) if ((int64_t)N * D >= TKD_OMP_MIN_WORK)
        for (int d = 0; d < D; d++) {
            double s = 0;
            for (int n = 0; n < N; n++)
                s += (double)dy[(int64_t)n * D + d] * x[(int64_t)n * D + d] * rstd[n];
            dw[d] += (float)s;
        }
    }
}

void tkd_cpu_linear_fwd(const float *x, const float *w, const float *b, int N, int K, int M,
                        int accumulate, float *y)
{
    if (N <= 0 || M <= 0)
        return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, M, K, 1.0f, x, K, w, K,
                accumulate ? 1.0f : 0.0f, y, M);
    if (b) {
#pragma omp parallel for schedule(static) if ((int64_t)N * M >= TKD_OMP_MIN_WORK)
        for (int n = 0; n < N; n++)
            for (int m = 0; m < M; m++)
                y[(int64_t)n * M + m] += b[m];
    }
}

void tkd_cpu_linear_bwd(const float *dy, const float *x, const float *w, int N, int K, int M,
                        float *dx, float *dw, float *db)
{
    if (N <= 0)
        return;
    if (dx)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, K, M, 1.0f, dy, M, w, K, 1.0f, dx,
                    K);
    if (dw)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, M, K, N, 1.0f, dy, M, x, K, 1.0f, dw,
                    K);
    if (db) {
#pragma omp parallel for schedule(static) if ((int64_t)N * M >= TKD_OMP_MIN_WORK)
        for (int m = 0; m < M; m++) {
            double s = 0;
            for (int n = 0; n < N; n++)
                s += dy[(int64_t)n * M + m];
            db[m] += (float)s;
        }
    }
}

static void cpu_rope(float *x, int N, int T, int nh, int dh, const float *cos_t,
                     const float *sin_t, float sign)
{
    int half = dh / 2;
#pragma omp parallel for schedule(static) if ((int64_t)N * nh * dh >= TKD_OMP_MIN_WORK)
    for (int n = 0; n < N; n++) {
        const float *c = cos_t + (n % T) * half, *s = sin_t + (n % T) * half;
        for (int h = 0; h < nh; h++) {
            float *r = x + ((int64_t)n * nh + h) * dh;
            for (int i = 0; i < half; i++) {
                float a = r[i], b = r[i + half], si = sign * s[i];
                r[i] = a * c[i] - b * si;
                r[i + half] = b * c[i] + a * si;
            }
        }
    }
}

void tkd_cpu_rope_fwd(float *x, int N, int T, int nh, int dh, const float *cos_t,
                      const float *sin_t)
{
    cpu_rope(x, N, T, nh, dh, cos_t, sin_t, 1.0f);
}

void tkd_cpu_rope_bwd(float *dx, int N, int T, int nh, int dh, const float *cos_t,
                      const float *sin_t)
{
    cpu_rope(dx, N, T, nh, dh, cos_t, sin_t, -1.0f);
}

static float dotf(const float *a, const float *b, int n)
{
    float s = 0;
    for (int i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* The first key query i attends: i - window + 1 (the window counts the query itself), or 0 when
 * window is 0 (full causal) or reaches back past the start; never before its document's first
 * position doc0 (0: one document). */
static inline int attn_first_key(int i, int window, int doc0)
{
    int j0 = window > 0 && i >= window ? i - window + 1 : 0;
    return doc0 > j0 ? doc0 : j0;
}

/* One (batch, head): rows are independent, row i touches keys j0..i only (j0 = 0: causal). */
static void attn_fwd_head(const float *q, const float *k, const float *v, int T, int qs, int kvs,
                          int dh, int window, const int32_t *doc, float scale, const float *sink, float *att,
                          float *y)
{
    for (int i = 0; i < T; i++) {
        const float *qi = q + (int64_t)i * qs;
        float *a = att + (int64_t)i * T, *yi = y + (int64_t)i * qs;
        float mx = -INFINITY, sum = 0;
        int j0 = attn_first_key(i, window, doc ? doc[i] : 0);
        for (int j = j0; j <= i; j++) {
            a[j] = dotf(qi, k + (int64_t)j * kvs, dh) * scale;
            mx = a[j] > mx ? a[j] : mx;
        }
        if (sink) { /* transformers: cat(scores, sink), minus the max, softmax, sink column dropped */
            mx = *sink > mx ? *sink : mx;
            sum = expf(*sink - mx);
        }
        for (int j = j0; j <= i; j++)
            sum += (a[j] = expf(a[j] - mx));
        float inv = 1.0f / sum;
        for (int j = 0; j < T; j++)
            if (j < j0 || j > i)
                a[j] = 0;
        for (int d = 0; d < dh; d++)
            yi[d] = 0;
        for (int j = j0; j <= i; j++) {
            a[j] *= inv;
            const float *vj = v + (int64_t)j * kvs;
            for (int d = 0; d < dh; d++)
                yi[d] += a[j] * vj[d];
        }
    }
}

void tkd_cpu_attn_window_fwd(const float *q, const float *k, const float *v, int B, int T, int H, int Hkv,
                             int dh, int window, float *att, float *y)
{
    tkd_cpu_attn_sinks_fwd(q, k, v, B, T, H, Hkv, dh, window, NULL, NULL, att, y);
}

void tkd_cpu_attn_sinks_fwd(const float *q, const float *k, const float *v, int B, int T, int H, int Hkv,
                            int dh, int window, const int32_t *doc, const float *sinks, float *att, float *y)
{
    int grp = H / Hkv, qs = H * dh, kvs = Hkv * dh;
    float scale = (float)(1.0 / sqrt((double)dh));
#pragma omp parallel for schedule(dynamic) collapse(2) if ((int64_t)B * H * T * T * dh >= TKD_OMP_MIN_WORK)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            int64_t q0 = (int64_t)b * T * qs + (int64_t)h * dh;
            int64_t kv0 = (int64_t)b * T * kvs + (int64_t)(h / grp) * dh;
            attn_fwd_head(q + q0, k + kv0, v + kv0, T, qs, kvs, dh, window, doc ? doc + (int64_t)b * T : NULL, scale,
                          sinks ? sinks + h : NULL,
                          att + ((int64_t)b * H + h) * T * T, y + q0);
        }
}

void tkd_cpu_attn_fwd(const float *q, const float *k, const float *v, int B, int T, int H, int Hkv,
                      int dh, float *att, float *y)
{
    tkd_cpu_attn_window_fwd(q, k, v, B, T, H, Hkv, dh, 0, att, y);
}

/* One (batch, query head). Two passes per row so that no dP scratch is needed: the first gets
 * Σ_j P_ij dP_ij (and dv), the second recomputes dP_ij to form dS_ij. */
static void attn_bwd_head(const float *dy, const float *q, const float *k, const float *v,
                          const float *att, int T, int qs, int kvs, int dh, float scale, float *dq,
                          float *dk, float *dv)
{
    for (int i = 0; i < T; i++) {
        const float *a = att + (int64_t)i * T, *dyi = dy + (int64_t)i * qs;
        const float *qi = q + (int64_t)i * qs;
        float dsum = 0;
        for (int j = 0; j <= i; j++) {
            dsum += a[j] * dotf(dyi, v + (int64_t)j * kvs, dh);
            if (dv) {
                float *dvj = dv + (int64_t)j * kvs;
                for (int d = 0; d < dh; d++)
                    dvj[d] += a[j] * dyi[d];
            }
        }
        for (int j = 0; j <= i; j++) {
            float ds = a[j] * (dotf(dyi, v + (int64_t)j * kvs, dh) - dsum) * scale;
            const float *kj = k + (int64_t)j * kvs;
            if (dq) {
                float *dqi = dq + (int64_t)i * qs;
                for (int d = 0; d < dh; d++)
                    dqi[d] += ds * kj[d];
            }
            if (dk) {
                float *dkj = dk + (int64_t)j * kvs;
                for (int d = 0; d < dh; d++)
                    dkj[d] += ds * qi[d];
            }
        }
    }
}

void tkd_cpu_attn_bwd(const float *dy, const float *q, const float *k, const float *v,
                      const float *att, int B, int T, int H, int Hkv, int dh, float *dq, float *dk,
                      float *dv)
{
    int grp = H / Hkv, qs = H * dh, kvs = Hkv * dh;
    float scale = (float)(1.0 / sqrt((double)dh));
    /* parallel over (batch, kv head): the query heads sharing a kv head add into the same dk, dv */
#pragma omp parallel for schedule(dynamic) collapse(2) if ((int64_t)B * H * T * T * dh >= TKD_OMP_MIN_WORK)
    for (int b = 0; b < B; b++)
        for (int g = 0; g < Hkv; g++) {
            int64_t kv0 = (int64_t)b * T * kvs + (int64_t)g * dh;
            for (int h = g * grp; h < (g + 1) * grp; h++) {
                int64_t q0 = (int64_t)b * T * qs + (int64_t)h * dh;
                attn_bwd_head(dy + q0, q + q0, k + kv0, v + kv0, att + ((int64_t)b * H + h) * T * T,
                              T, qs, kvs, dh, scale, dq ? dq + q0 : NULL, dk ? dk + kv0 : NULL,
                              dv ? dv + kv0 : NULL);
            }
        }
}

void tkd_cpu_swiglu_fwd(const float *g, const float *u, int64_t n, float *h)
{
#pragma omp parallel for schedule(static) if (n >= TKD_OMP_MIN_WORK)
    for (int64_t i = 0; i < n; i++)
        h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void tkd_cpu_swiglu_bwd(const float *dh, const float *g, const float *u, int64_t n, float *dg,
                        float *du)
{
#pragma omp parallel for schedule(static) if (n >= TKD_OMP_MIN_WORK)
    for (int64_t i = 0; i < n; i++) {
        float s = 1.0f / (1.0f + expf(-g[i]));
        if (dg)
            dg[i] += dh[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
        if (du)
            du[i] += dh[i] * g[i] * s;
    }
}
