/* cpu_ops_ref.c — see cpu_ops_ref.h. Plain loops in double; clarity over speed. */
#include "kernels/cpu/cpu_ops_ref.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void tkd_ref_embedding_fwd(const int32_t *tok, int N, const double *emb, int D, double *out)
{
    for (int n = 0; n < N; n++)
        memcpy(out + (int64_t)n * D, emb + (int64_t)tok[n] * D, sizeof(double) * (size_t)D);
}

void tkd_ref_embedding_bwd(const int32_t *tok, int N, const double *dout, int D, double *demb)
{
    for (int n = 0; n < N; n++)
        for (int d = 0; d < D; d++)
            demb[(int64_t)tok[n] * D + d] += dout[(int64_t)n * D + d];
}

void tkd_ref_rmsnorm_fwd(const double *x, const double *w, int N, int D, double eps, double *y,
                         double *rstd)
{
    for (int n = 0; n < N; n++) {
        const double *xr = x + (int64_t)n * D;
        double ss = 0;
        for (int d = 0; d < D; d++)
            ss += xr[d] * xr[d];
        double r = 1.0 / sqrt(ss / D + eps);
        for (int d = 0; d < D; d++)
            y[(int64_t)n * D + d] = xr[d] * r * w[d];
        if (rstd)
            rstd[n] = r;
    }
}

/* With xhat = x·r: dx = r·(dy·w − xhat·mean(dy·w·xhat)), dw = Σ_n dy·xhat. */
void tkd_ref_rmsnorm_bwd(const double *dy, const double *x, const double *w, const double *rstd,
                         int N, int D, double *dx, double *dw)
{
    for (int n = 0; n < N; n++) {
        const double *xr = x + (int64_t)n * D, *g = dy + (int64_t)n * D;
        double r = rstd[n], dot = 0;
        for (int d = 0; d < D; d++)
            dot += g[d] * w[d] * xr[d] * r;
        dot /= D;
        for (int d = 0; d < D; d++) {
            double xhat = xr[d] * r;
            if (dx)
                dx[(int64_t)n * D + d] += r * (g[d] * w[d] - xhat * dot);
            if (dw)
                dw[d] += g[d] * xhat;
        }
    }
}

void tkd_ref_linear_fwd(const double *x, const double *w, const double *b, int N, int K, int M,
                        int accumulate, double *y)
{
    for (int n = 0; n < N; n++)
        for (int m = 0; m < M; m++) {
            double s = b ? b[m] : 0.0;
            for (int k = 0; k < K; k++)
                s += x[(int64_t)n * K + k] * w[(int64_t)m * K + k];
            y[(int64_t)n * M + m] = (accumulate ? y[(int64_t)n * M + m] : 0.0) + s;
        }
}

void tkd_ref_linear_bwd(const double *dy, const double *x, const double *w, int N, int K, int M,
                        double *dx, double *dw, double *db)
{
    for (int n = 0; n < N; n++)
        for (int m = 0; m < M; m++) {
            double g = dy[(int64_t)n * M + m];
            for (int k = 0; k < K; k++) {
                if (dx)
                    dx[(int64_t)n * K + k] += g * w[(int64_t)m * K + k];
                if (dw)
                    dw[(int64_t)m * K + k] += g * x[(int64_t)n * K + k];
            }
            if (db)
                db[m] += g;
        }
}

/* sign = +1 rotates by +angle (forward), -1 by -angle (backward: the transpose). */
static void ref_rope(double *x, int N, int T, int nh, int dh, const float *cos_t,
                     const float *sin_t, double sign)
{
    int half = dh / 2;
    for (int n = 0; n < N; n++) {
        int t = n % T;
        for (int h = 0; h < nh; h++) {
            double *r = x + ((int64_t)n * nh + h) * dh;
            for (int i = 0; i < half; i++) {
                double c = cos_t[t * half + i], s = sign * sin_t[t * half + i];
                double a = r[i], b = r[i + half];
                r[i] = a * c - b * s;
                r[i + half] = b * c + a * s;
            }
        }
    }
}

void tkd_ref_rope_fwd(double *x, int N, int T, int nh, int dh, const float *cos_t,
                      const float *sin_t)
{
    ref_rope(x, N, T, nh, dh, cos_t, sin_t, 1.0);
}

void tkd_ref_rope_bwd(double *dx, int N, int T, int nh, int dh, const float *cos_t,
                      const float *sin_t)
{
    ref_rope(dx, N, T, nh, dh, cos_t, sin_t, -1.0);
}

void tkd_ref_attn_window_fwd(const double *q, const double *k, const double *v, int B, int T, int H,
                             int Hkv, int dh, int window, double *att, double *y)
{
    tkd_ref_attn_sinks_fwd(q, k, v, B, T, H, Hkv, dh, window, NULL, NULL, att, y);
}

void tkd_ref_attn_sinks_fwd(const double *q, const double *k, const double *v, int B, int T, int H,
                            int Hkv, int dh, int window, const int32_t *doc, const double *sinks, double *att,
                            double *y)
{
    int grp = H / Hkv;
    double scale = 1.0 / sqrt((double)dh);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                const double *qi = q + ((int64_t)(b * T + i) * H + h) * dh;
                double *a = att + (((int64_t)b * H + h) * T + i) * T;
                double mx = -INFINITY, sum = 0;
                const int d0 = doc ? doc[(int64_t)b * T + i] : 0; /* the document's first position */
                for (int j = 0; j < T; j++) {
                    a[j] = 0;
                    /* causal, inside the window (i − window < j: the query counts) and the document */
                    if (j > i || (window > 0 && j <= i - window) || j < d0)
                        continue;
                    const double *kj = k + ((int64_t)(b * T + j) * Hkv + h / grp) * dh;
                    double s = 0;
                    for (int d = 0; d < dh; d++)
                        s += qi[d] * kj[d];
                    a[j] = s * scale;
                    mx = fmax(mx, a[j]);
                }
                int j0 = window > 0 && i >= window ? i - window + 1 : 0;
                j0 = j0 > d0 ? j0 : d0;
                if (sinks) { /* the sink joins the max and the denominator, and is then dropped */
                    mx = fmax(mx, sinks[h]);
                    sum = exp(sinks[h] - mx);
                }
                for (int j = j0; j <= i; j++)
                    sum += (a[j] = exp(a[j] - mx));
                double *yi = y + ((int64_t)(b * T + i) * H + h) * dh;
                for (int d = 0; d < dh; d++)
                    yi[d] = 0;
                for (int j = j0; j <= i; j++) {
                    a[j] /= sum;
                    const double *vj = v + ((int64_t)(b * T + j) * Hkv + h / grp) * dh;
                    for (int d = 0; d < dh; d++)
                        yi[d] += a[j] * vj[d];
                }
            }
}

void tkd_ref_attn_fwd(const double *q, const double *k, const double *v, int B, int T, int H,
                      int Hkv, int dh, double *att, double *y)
{
    tkd_ref_attn_window_fwd(q, k, v, B, T, H, Hkv, dh, 0, att, y);
}

/* dP_ij = dy_i·v_j; dS_ij = P_ij (dP_ij − Σ_j' P_ij' dP_ij'); dq_i = scale Σ_j dS_ij k_j;
 * dk_j += scale dS_ij q_i; dv_j += P_ij dy_i. */
void tkd_ref_attn_bwd(const double *dy, const double *q, const double *k, const double *v,
                      const double *att, int B, int T, int H, int Hkv, int dh, double *dq,
                      double *dk, double *dv)
{
    int grp = H / Hkv;
    double scale = 1.0 / sqrt((double)dh);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                int64_t qrow = ((int64_t)(b * T + i) * H + h) * dh;
                const double *a = att + (((int64_t)b * H + h) * T + i) * T;
                double dsum = 0;
                for (int j = 0; j <= i; j++) {
                    int64_t kvrow = ((int64_t)(b * T + j) * Hkv + h / grp) * dh;
                    double dp = 0;
                    for (int d = 0; d < dh; d++) {
                        dp += dy[qrow + d] * v[kvrow + d];
                        dv[kvrow + d] += a[j] * dy[qrow + d];
                    }
                    dsum += a[j] * dp;
                }
                for (int j = 0; j <= i; j++) {
                    int64_t kvrow = ((int64_t)(b * T + j) * Hkv + h / grp) * dh;
                    double dp = 0;
                    for (int d = 0; d < dh; d++)
                        dp += dy[qrow + d] * v[kvrow + d];
                    double ds = a[j] * (dp - dsum) * scale;
                    for (int d = 0; d < dh; d++) {
                        dq[qrow + d] += ds * k[kvrow + d];
                        dk[kvrow + d] += ds * q[qrow + d];
                    }
                }
            }
}

void tkd_ref_swiglu_fwd(const double *g, const double *u, int64_t n, double *h)
{
    for (int64_t i = 0; i < n; i++)
        h[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
}

/* silu'(g) = σ(g)·(1 + g·(1 − σ(g))). */
void tkd_ref_swiglu_bwd(const double *dh, const double *g, const double *u, int64_t n, double *dg,
                        double *du)
{
    for (int64_t i = 0; i < n; i++) {
        double s = 1.0 / (1.0 + exp(-g[i]));
        if (dg)
            dg[i] += dh[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
        if (du)
            du[i] += dh[i] * g[i] * s;
    }
}

void tkd_ref_swiglu_clamp_fwd(const double *g, const double *u, int64_t n, double limit,
                              double alpha, double *h)
{
    for (int64_t i = 0; i < n; i++) {
        double gc = g[i] < limit ? g[i] : limit;
        double uc = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
        h[i] = (uc + 1.0) * gc / (1.0 + exp(-alpha * gc));
    }
}

/* sel[0..k): the k largest of v[0..E), largest first; among equal values the lower index first. */
static void ref_topk(const double *v, int E, int k, int32_t *sel)
{
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int t = 0; t < j; t++)
                taken |= sel[t] == e;
            if (!taken && (best < 0 || v[e] > v[best]))
                best = e;
        }
        sel[j] = best;
    }
}

static void ref_softmax(double *v, int n)
{
    double mx = v[0], s = 0;
    for (int i = 1; i < n; i++)
        mx = v[i] > mx ? v[i] : mx;
    for (int i = 0; i < n; i++)
        s += (v[i] = exp(v[i] - mx));
    for (int i = 0; i < n; i++)
        v[i] /= s;
}

/* One token's routing: sel and wts (k each) from its logits lg (E, overwritten). */
static void ref_moe_route(const tkd_moe_params *p, double *lg, int32_t *sel, double *wts)
{
    if (p->router == TKD_MOE_ROUTER_SOFTMAX_TOPK) {
        ref_softmax(lg, p->E);
        ref_topk(lg, p->E, p->k, sel);
        double s = 0;
        for (int j = 0; j < p->k; j++)
            s += (wts[j] = lg[sel[j]]);
        for (int j = 0; p->norm_topk_prob && j < p->k; j++)
            wts[j] /= s;
    } else {
        ref_topk(lg, p->E, p->k, sel);
        for (int j = 0; j < p->k; j++)
            wts[j] = lg[sel[j]];
        ref_softmax(wts, p->k);
    }
}

/* y += wt · expert_e(x) for one token row; h is scratch (I). */
static void ref_moe_expert(const tkd_moe_params *p, const tkd_moe_weights *w, int e, const float *x,
                           double wt, double *h, double *y)
{
    int D = p->D, I = p->inter;
    for (int i = 0; i < I; i++) {
        const float *wg = w->w_gate + ((int64_t)e * I + i) * D, *wu = w->w_up + ((int64_t)e * I + i) * D;
        double g = w->b_gate ? w->b_gate[(int64_t)e * I + i] : 0.0;
        double u = w->b_up ? w->b_up[(int64_t)e * I + i] : 0.0;
        for (int d = 0; d < D; d++) {
            g += (double)x[d] * wg[d];
            u += (double)x[d] * wu[d];
        }
        if (p->act == TKD_MOE_ACT_SWIGLU)
            tkd_ref_swiglu_fwd(&g, &u, 1, &h[i]);
        else
            tkd_ref_swiglu_clamp_fwd(&g, &u, 1, p->limit, p->alpha, &h[i]);
    }
    for (int d = 0; d < D; d++) {
        const float *wd = w->w_down + ((int64_t)e * D + d) * I;
        double o = w->b_down ? w->b_down[(int64_t)e * D + d] : 0.0;
        for (int i = 0; i < I; i++)
            o += h[i] * wd[i];
        y[d] += wt * o;
    }
}

void tkd_ref_moe_fwd(const tkd_moe_params *p, const tkd_moe_weights *w, const float *x, int N,
                     double *y, int32_t *experts, double *weights)
{
    int D = p->D, E = p->E, k = p->k;
    double *lg = malloc(sizeof(double) * (size_t)(E + k + p->inter));
    int32_t *sel = malloc(sizeof(int32_t) * (size_t)k);
    assert(lg && sel);
    double *wts = lg + E, *h = wts + k;
    for (int n = 0; n < N; n++) {
        const float *xr = x + (int64_t)n * D;
        for (int e = 0; e < E; e++) {
            double s = w->router_b ? w->router_b[e] : 0.0;
            for (int d = 0; d < D; d++)
                s += (double)xr[d] * w->router_w[(int64_t)e * D + d];
            lg[e] = s;
        }
        ref_moe_route(p, lg, sel, wts);
        memset(y + (int64_t)n * D, 0, sizeof(double) * (size_t)D);
        for (int j = 0; j < k; j++)
            ref_moe_expert(p, w, sel[j], xr, wts[j], h, y + (int64_t)n * D);
        for (int j = 0; j < k; j++) {
            if (experts)
                experts[(int64_t)n * k + j] = sel[j];
            if (weights)
                weights[(int64_t)n * k + j] = wts[j];
        }
    }
    free(lg);
    free(sel);
}
