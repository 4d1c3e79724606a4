/* kl_loss_cuda_rows.cu — the fused KL loss's row kernel (kl_loss_cuda.h): one block per row of a
 * chunk streams the row's logits once for its statistics (LSE at τ and at 1, `tail`'s sum outside the
 * top-k'), validates and gathers the teacher side, computes the row's loss in double, and in the
 * gradient modes rewrites the row in place as bf16 dS. The fused path (kl_loss_cuda_fused.cu) runs
 * the same kernel on its GEMM's statistics and bf16 tile E instead of fp32 logits.
 *
 * Layout. Row-major everywhere on our side; cuBLAS is column-major, so a row-major (R, C) matrix
 * with leading dimension ld is cuBLAS's (C, R) matrix with the same ld. The chunk buffer holds the
 * fp32 logits (C, ldl), ldl = V rounded up to 16 floats so every row starts 64-byte aligned and
 * float4 loads never straddle a row. The row kernel rewrites a row in place as bf16 dS: row i of
 * dS starts where fp32 row i starts, so dS is the bf16 matrix (C, 2·ldl) whose first V columns
 * hold the values. In-place is safe because the block reads fp32 tile t (elements [Tt, T(t+1)),
 * T = 16 · blockDim) before a barrier and then writes bf16 elements [Tt, T(t+1)), which overlay fp32
 * elements [Tt/2, T(t+1)/2): all read already by this block, and none in tile t + 1.
 *
 * Per row (docs/loss.md): z = s/τ, q = softmax(z), q1 = softmax(s). KD is defined on z and
 * multiplied by τ²; CE is at τ = 1; loss = α·KD + (1 − α)·CE, averaged over kept rows. The
 * gradient wrt s is τ·α·(c_v·q_v − target_v) + (1 − α)(q1_v − [v = y]), times scale / n_kept,
 * with c_v = M = Σ target; `tail` adds −τ·α·r·q_v/(1 − Q) = −τ·α·r·exp(z_v − LSE_{v∉I}(z)) off
 * the top-k' (an exp that cannot overflow, however small 1 − Q). The dense pass writes the
 * off-top-k' value for every v; a fix-up then rewrites the few special positions (top-k', tail
 * draws, label) exactly. Another kd.divergence (row_div_warp, the kernels' DIV instantiations)
 * changes only the row's coefficients and the special positions' values: the same two passes.
 */
#include <cuda_bf16.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_fast_math.cuh"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/loss/kl_divergence.h"
#include "kernels/loss/kl_loss.h"
#include "kernels/loss/kl_loss_cuda_internal.h"
#include "kernels/loss/kl_loss_cuda_rows.cuh"
#include "kernels/gemm_sm90/lmhead_grad_sm90.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"

namespace tkd_klc {
namespace {

/* Row kernels stream a row in tiles of VEC float4 loads per thread, all issued before any is used:
 * VEC·16 bytes in flight per thread. The product runs VEC = 4 with 512-thread blocks (2 per SM,
 * TKD_KL_CUDA_ROW_THREADS x TKD_KL_CUDA_ROW_VEC); VEC = 8 with ≤ 256-thread blocks (3 per SM) is
 * there for the benchmark's sweep (tkd_kl_cuda_ws_set_rows). */
constexpr int kMaxThreads = 512;           /* row-kernel block: one row per block */
constexpr int kMaxWarps = kMaxThreads / 32;
/* Per-row scalars shared by the block. */
struct RowShared {
    float lse_tau, lse_one, s_label, teacher_lse;
    int label, bad, kept;
    float c_off, c_in, c_tgt, c_ce; /* gradient coefficients, scale / n_kept folded in */
    float c_x, x_b;                 /* tail: coefficient of exp(z − LSE_{v∉I}(z)), log2e·LSE_{v∉I} */
    float log_omq; /* tail: log(1 − Q) = log Σ_{v∉I} q_v */
    float red_m[kMaxWarps], red_a[kMaxWarps], red_t[kMaxWarps], red_x[kMaxWarps];
    float red_mx[kMaxWarps];
};

/* Dynamic shared memory: the k' top-k columns and the S tail draws of this row, and in the stats
 * modes a bitmap of the top-k' over V (duplicate and draw-inside-top-k' checks in O(k' + S), and
 * `tail`'s sum outside the top-k'). */
struct RowSmem {
    int *idx_i; float *s_i, *t_i, *tgt_i; /* (k') */
    int *idx_t; float *s_t, *tgt_t;       /* (S) */
    unsigned *bitmap;                     /* (ceil(V / 32)) or NULL */
};

__host__ __device__ inline size_t bitmap_words(int v) { return ((size_t)v + 31) / 32; }

__host__ __device__ inline size_t row_smem_bytes(int k_use, int s, int v, int with_bitmap)
{
    return (size_t)k_use * 16 + (size_t)s * 12 + (with_bitmap ? bitmap_words(v) * 4 : 0);
}

__device__ inline RowSmem row_smem_carve(unsigned char *base, int k_use, int s, int v,
                                         int with_bitmap)
{
    RowSmem m;
    m.idx_i = (int *)base;
    m.s_i = (float *)(m.idx_i + k_use);
    m.t_i = m.s_i + k_use;
    m.tgt_i = m.t_i + k_use;
    m.idx_t = (int *)(m.tgt_i + k_use);
    m.s_t = (float *)(m.idx_t + s);
    m.tgt_t = m.s_t + s;
    m.bitmap = with_bitmap ? (unsigned *)(m.tgt_t + s) : NULL;
    (void)v;
    return m;
}

/* ---- online log-sum-exp at τ and at 1, one pass ---------------------------------------------- */

using tkd_cuda::fast_exp2; /* 2^x on the special-function unit (cuda_fast_math.cuh) */

/* Running state: max m of s, a1 = Σ exp(s − m), at = Σ exp((s − m)/τ) and, for `tail`, the
 * log-sum-exp of z over the tokens outside the top-k' around their own max mx:
 * ax = Σ_{v∉I} exp((s_v − mx)/τ). So log(1 − Q) = LSE_{v∉I}(z) − LSE(z) is exact however small
 * 1 − Q is (docs/loss.md), never 1 − Σ q. The max of s/τ is m/τ because τ > 0. */
struct Lse3 { float m, a1, at, mx, ax; };

/* Two partial sums around their own maxima, combined around the larger (l2e: log2 e / scale). */
__device__ inline float sum_merge(float mx, float sx, float my, float sy, float m, float l2e)
{
    return sx * fast_exp2((mx - m) * l2e) + sy * fast_exp2((my - m) * l2e); /* −inf max: 0 */
}

__device__ inline Lse3 lse3_merge(Lse3 x, Lse3 y, float l2e_tau)
{
    float m = fmaxf(x.m, y.m);
    if (m > -INFINITY) {
        x.a1 = sum_merge(x.m, x.a1, y.m, y.a1, m, kLog2e);
        x.at = sum_merge(x.m, x.at, y.m, y.at, m, l2e_tau);
        x.m = m;
    }
    float mt = fmaxf(x.mx, y.mx);
    if (mt > -INFINITY) {
        x.ax = sum_merge(x.mx, x.ax, y.mx, y.ax, mt, l2e_tau);
        x.mx = mt;
    }
    return x;
}

/* Adds four values (masked ones are -inf); top_bits: bit j set when element j is in the top-k'
 * (only read when `tail`). */
__device__ inline void lse3_add4(Lse3 &st, float4 x, float l2e_tau, bool same_tau, bool tail,
                                 unsigned top_bits)
{
    float v4[4] = {x.x, x.y, x.z, x.w};
    float mloc = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
    if (mloc == -INFINITY)
        return;
    if (mloc > st.m) { /* st.m = −inf at first: the sums are 0 and stay 0 */
        float d = st.m - mloc;
        st.a1 *= fast_exp2(d * kLog2e);
        st.at *= fast_exp2(d * l2e_tau);
        st.m = mloc;
    }
    float e1[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        e1[j] = fast_exp2((v4[j] - st.m) * kLog2e);
        st.a1 += e1[j];
    }
    if (same_tau && !tail) {
        st.at = st.a1;
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
        st.at += same_tau ? e1[j] : fast_exp2((v4[j] - st.m) * l2e_tau);
    if (!tail)
        return;
    float tloc = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; j++)
        if (!((top_bits >> j) & 1u))
            tloc = fmaxf(tloc, v4[j]);
    if (tloc == -INFINITY)
        return;
    if (tloc > st.mx) {
        st.ax *= fast_exp2((st.mx - tloc) * l2e_tau);
        st.mx = tloc;
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
        if (!((top_bits >> j) & 1u))
            st.ax += fast_exp2((v4[j] - st.mx) * l2e_tau);
}

/* float4 at row[e..e+3], elements ≥ v set to -inf (ldl padding holds garbage). */
__device__ inline float4 load4_masked(const float *row, int e, int v)
{
    float4 x = *reinterpret_cast<const float4 *>(row + e);
    if (e + 3 >= v) {
        if (e + 1 >= v) x.y = -INFINITY;
        if (e + 2 >= v) x.z = -INFINITY;
        if (e + 3 >= v) x.w = -INFINITY;
    }
    return x;
}

/* The 4 top-k' bits of elements e..e+3 (e a multiple of 4, so one word holds them). */
__device__ inline unsigned top4(const unsigned *bitmap, int e)
{
    return bitmap ? (bitmap[e >> 5] >> (e & 31)) & 0xfu : 0u;
}

/* Block-wide log-sum-exps of one row; results in sh (all threads see them after return).
 * bitmap (V bits, shared) marks the top-k' for `tail`, else NULL. */
template <int VEC>
__device__ void row_lse(const float *row, int v, float tau, const unsigned *bitmap, RowShared &sh)
{
    const float l2e_tau = kLog2e / tau;
    const bool same_tau = tau == 1.0f, tail = bitmap != NULL;
    Lse3 st = {-INFINITY, 0.0f, 0.0f, -INFINITY, 0.0f};
    const int nt = blockDim.x;
    for (int base = 0; base < v; base += VEC * 4 * nt) {
        float4 x[VEC];
#pragma unroll
        for (int j = 0; j < VEC; j++) { /* all loads first: VEC·16 bytes in flight per thread */
            int e = base + j * 4 * nt + threadIdx.x * 4;
            if (e < v)
                x[j] = load4_masked(row, e, v);
        }
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            int e = base + j * 4 * nt + threadIdx.x * 4;
            if (e < v)
                lse3_add4(st, x[j], l2e_tau, same_tau, tail, top4(bitmap, e));
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        Lse3 o = {__shfl_xor_sync(0xffffffffu, st.m, off), __shfl_xor_sync(0xffffffffu, st.a1, off),
                  __shfl_xor_sync(0xffffffffu, st.at, off), __shfl_xor_sync(0xffffffffu, st.mx, off),
                  __shfl_xor_sync(0xffffffffu, st.ax, off)};
        st = lse3_merge(st, o, l2e_tau);
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        sh.red_m[warp] = st.m;
        sh.red_a[warp] = st.a1;
        sh.red_t[warp] = st.at;
        sh.red_x[warp] = st.ax;
        sh.red_mx[warp] = st.mx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        Lse3 acc = {sh.red_m[0], sh.red_a[0], sh.red_t[0], sh.red_mx[0], sh.red_x[0]};
        for (int w = 1; w < nt / 32; w++)
            acc = lse3_merge(
                acc, Lse3{sh.red_m[w], sh.red_a[w], sh.red_t[w], sh.red_mx[w], sh.red_x[w]},
                l2e_tau);
        sh.lse_one = acc.m + logf(acc.a1);
        sh.lse_tau = acc.m / tau + logf(acc.at);
        /* LSE_{v∉I}(z) − LSE(z); −inf only when no token lies outside the top-k' */
        sh.log_omq = acc.ax > 0.0f ? acc.mx / tau + logf(acc.ax) - sh.lse_tau : -INFINITY;
    }
    __syncthreads();
}

/* ---- gather and validate the row's teacher side ---------------------------------------------- */

__device__ void row_gather(const RowArgs &a, long long r, const float *row, RowSmem m,
                           RowShared &sh)
{
    const int tid = threadIdx.x;
    if (m.bitmap)
        for (size_t w = tid; w < bitmap_words(a.v); w += blockDim.x)
            m.bitmap[w] = 0u;
    if (tid == 0) {
        sh.bad = 0;
        int y = a.labels[r];
        sh.label = y;
        sh.kept = y != a.ignore_index;
        sh.teacher_lse = a.variant != TKD_KL_VARIANT_RENORM ? a.teacher_lse[r] : 0.0f;
        sh.s_label = 0.0f;
        if (sh.kept) {
            if (y < 0 || y >= a.v)
                sh.bad |= kErrLabelRange;
            else
                sh.s_label = a.g ? a.g[r * a.ldg + a.k_use + a.s] : row[y];
        }
        if (a.variant != TKD_KL_VARIANT_RENORM && !isfinite(sh.teacher_lse))
            sh.bad |= kErrTeacherNonFinite;
    }
    __syncthreads();
    int bad = 0;
    for (int j = tid; j < a.k_use; j += blockDim.x) {
        int id = a.topk_idx[r * a.k + j];
        float t = a.topk_logit[r * a.k + j];
        m.idx_i[j] = id;
        m.t_i[j] = t;
        if (id < 0 || id >= a.v) {
            bad |= kErrTopkRange;
            m.s_i[j] = 0.0f;
        } else {
            m.s_i[j] = a.g ? a.g[r * a.ldg + j] : row[id];
            if (m.bitmap) { /* the second writer of a bit has found a duplicate */
                unsigned bit = 1u << (id & 31);
                if (atomicOr(&m.bitmap[id >> 5], bit) & bit)
                    bad |= kErrTopkDup;
            }
        }
        if (!isfinite(t))
            bad |= kErrTeacherNonFinite;
    }
    for (int j = tid; j < a.s; j += blockDim.x) {
        int id = a.tail_idx[r * a.s + j];
        m.idx_t[j] = id;
        if (id < 0 || id >= a.v) {
            bad |= kErrTailRange;
            m.s_t[j] = 0.0f;
        } else {
            m.s_t[j] = a.g ? a.g[r * a.ldg + a.k_use + j] : row[id];
        }
    }
    __syncthreads();
    /* A draw inside the top-k' would double-count mass (duplicates were caught above). Forward
     * checks; backward runs on the batch forward accepted and has no bitmap. */
    for (int j = tid; j < (m.bitmap ? a.s : 0); j += blockDim.x) {
        int id = m.idx_t[j];
        if (id >= 0 && id < a.v && ((m.bitmap[id >> 5] >> (id & 31)) & 1u))
            bad |= kErrTailInTopk;
    }
    if (bad)
        atomicOr(&sh.bad, bad);
    __syncthreads();
    if (tid == 0 && sh.bad && sh.kept) {
        atomicOr(&a.out->err_bits, (unsigned)sh.bad);
        atomicMin(&a.out->err_row, a.row0 + r);
    }
}

/* ---- per-row loss and gradient coefficients (warp 0, double) --------------------------------- */

__device__ inline double warp_max(double x)
{
    for (int off = 16; off > 0; off >>= 1)
        x = fmax(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}

/* Fills m.tgt_i / m.tgt_t and the coefficients in sh; returns KD (without τ²) on lane 0. */
__device__ double row_kd_warp(const RowArgs &a, RowSmem m, RowShared &sh, double *c_off,
                              double *c_in, double *c_x)
{
    const int lane = threadIdx.x % 32;
    const double inv_tau = 1.0 / (double)a.tau, ltau = sh.lse_tau;
    double kd = 0.0;
    *c_off = *c_in = 1.0;
    *c_x = 0.0;
    if (a.variant == TKD_KL_VARIANT_RENORM) {
        double mt = -INFINITY;
        for (int j = lane; j < a.k_use; j += 32)
            mt = fmax(mt, m.t_i[j] * inv_tau);
        mt = warp_max(mt);
        double z = 0.0;
        for (int j = lane; j < a.k_use; j += 32)
            z += exp(m.t_i[j] * inv_tau - mt);
        double log_z = log(warp_sum(z));
        for (int j = lane; j < a.k_use; j += 32) {
            double lp = m.t_i[j] * inv_tau - mt - log_z, p = exp(lp);
            m.tgt_i[j] = (float)p;
            kd += p * (lp - (m.s_i[j] * inv_tau - ltau));
        }
        return warp_sum(kd);
    }
    double p_sum = 0.0, q_sum = 0.0;
    for (int j = lane; j < a.k_use; j += 32) {
        double lp = m.t_i[j] * inv_tau - sh.teacher_lse, p = exp(lp);
        double lq = m.s_i[j] * inv_tau - ltau;
        m.tgt_i[j] = (float)p;
        p_sum += p;
        q_sum += exp(lq);
        if (p > 0.0)
            kd += p * (lp - lq);
    }
    p_sum = warp_sum(p_sum);
    q_sum = warp_sum(q_sum);
    kd = warp_sum(kd);
    /* with k' = V there is no tail: r is rounding noise, not mass */
    double r = a.k_use == a.v ? 0.0 : fmax(1.0 - p_sum, 0.0);
    if (a.variant == TKD_KL_VARIANT_TAIL) {
        (void)q_sum; /* 1 − Q comes from the stats pass, without cancellation */
        (void)q_sum; /* 1 − Q comes from the stats pass, exact in the log domain */
        *c_in = *c_off = p_sum + r; /* Σ target (1 unless the teacher's top-k' mass exceeds 1) */
        if (r > 0.0) {
            kd += r * (log(r) - (double)sh.log_omq);
            *c_x = r;
        }
        return kd;
    }
    /* sampled: each draw carries r/S; a token drawn c times has target c·r/S */
    double w = a.s > 0 ? r / a.s : 0.0, kd_t = 0.0;
    for (int j = lane; j < a.s; j += 32) {
        int c = 0;
        for (int i = 0; i < a.s; i++)
            c += m.idx_t[i] == m.idx_t[j];
        double tgt = w * c;
        m.tgt_t[j] = (float)tgt;
        if (tgt > 0.0)
            kd_t += w * (log(tgt) - (m.s_t[j] * inv_tau - ltau));
    }
    kd += warp_sum(kd_t);
    *c_off = *c_in = p_sum + (a.s > 0 ? r : 0.0);
    return kd;
}

/* ---- a divergence other than fkl: row_div_warp (kl_loss_cuda_rows_div.cuh, this file's part) - */
#include "kernels/loss/kl_loss_cuda_rows_div.cuh"

/* DIV: a divergence other than fkl (RowArgs::div_on); fkl's instantiations are its code as it was. */
template <int MODE, bool DIV>
__device__ void row_finalize(const RowArgs &a, long long r, RowSmem m, RowShared &sh)
{
    if (threadIdx.x >= 32)
        return;
    const int ok = sh.kept && !sh.bad;
    double kd = 0.0, ce = 0.0, c_off = 0.0, c_in = 0.0, c_x = 0.0;
    if (ok) {
        kd = (DIV ? row_div_warp(a, m, sh, MODE != kModeStats, &c_off, &c_in, &c_x)
                  : row_kd_warp(a, m, sh, &c_off, &c_in, &c_x)) * (double)a.tau * a.tau;
        ce = (double)sh.lse_one - sh.s_label;
    }
    if (threadIdx.x != 0)
        return;
    if (MODE != kModeGrad) {
        a.row_kd[r] = ok ? kd : 0.0;
        a.row_ce[r] = ok ? ce : 0.0;
        a.row_loss[r] = ok ? a.alpha * kd + (1.0 - a.alpha) * ce : 0.0;
    }
    double g = ok ? (double)a.grad_scale * a.out->inv_n_kept : 0.0;
    double kd_g = g * a.alpha * a.tau;
    sh.c_off = (float)(kd_g * c_off);
    sh.c_in = (float)(kd_g * c_in);
    sh.c_x = (float)(kd_g * c_x);
    sh.x_b = (sh.lse_tau + sh.log_omq) * kLog2e;
    sh.c_tgt = (float)kd_g;
    sh.c_ce = (float)(g * (1.0 - a.alpha));
}

/* ---- dS in place ----------------------------------------------------------------------------- */

struct GradCoef { float zs, zb, os, ob, c_q, c_ce, c_x, xb; bool same_tau; };

/* tail's −τ·α·r·q_v/(1 − Q) term (0 for the other variants, and on the top-k'). */
__device__ inline float grad_tail_term(float s, const GradCoef &c)
{
    return c.c_x != 0.0f ? c.c_x * fast_exp2(fmaf(s, c.zs, -c.xb)) : 0.0f;
}

__device__ inline float grad_dense(float s, const GradCoef &c)
{
    float q = fast_exp2(fmaf(s, c.zs, -c.zb));
    if (c.same_tau) /* τ = 1: q1 = q, one exp per element */
        return (c.c_q + c.c_ce) * q - grad_tail_term(s, c);
    float q1 = fast_exp2(fmaf(s, c.os, -c.ob));
    return c.c_q * q + c.c_ce * q1 - grad_tail_term(s, c);
}

__device__ inline uint2 pack4_bf16(float a, float b, float c, float d)
{
    __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
    uint2 u;
    u.x = *reinterpret_cast<unsigned int *>(&lo);
    u.y = *reinterpret_cast<unsigned int *>(&hi);
    return u;
}

__device__ inline uint2 grad4(float4 x, const GradCoef &c, bool zero)
{
    if (zero)
        return make_uint2(0u, 0u);
    return pack4_bf16(grad_dense(x.x, c), grad_dense(x.y, c), grad_dense(x.z, c),
                      grad_dense(x.w, c));
}

/* Exact gradient at a special position v (a top-k' column, a tail draw or the label). A draw's
 * KD part: fkl's c_off·q − target (c_in = c_off there), a divergence's the exact −tgt (c_in = 0). */
template <bool DIV>
__device__ float grad_special(const RowArgs &a, RowSmem m, const RowShared &sh, const GradCoef &c,
                              int v, float s)
{
    float tgt = 0.0f, cq = sh.c_off;
    bool in_top = false;
    for (int i = 0; i < a.k_use; i++)
        if (m.idx_i[i] == v) {
            tgt = m.tgt_i[i];
            cq = sh.c_in;
            in_top = true;
        }
    if (a.variant == TKD_KL_VARIANT_SAMPLED)
        for (int j = 0; j < a.s; j++)
            if (m.idx_t[j] == v) {
                tgt = m.tgt_t[j];
                if (DIV)
                    cq = sh.c_in;
            }
    float q = fast_exp2(fmaf(s, c.zs, -c.zb));
    float q1 = fast_exp2(fmaf(s, c.os, -c.ob));
    float g = cq * q - sh.c_tgt * tgt + sh.c_ce * (q1 - (v == sh.label ? 1.0f : 0.0f));
    return in_top ? g : g - grad_tail_term(s, c);
}

/* The row's gradient coefficients (after row_finalize). */
__device__ inline GradCoef grad_coef(const RowArgs &a, const RowShared &sh)
{
    GradCoef c;
    c.zs = kLog2e / a.tau;
    c.zb = sh.lse_tau * kLog2e;
    c.os = kLog2e;
    c.ob = sh.lse_one * kLog2e;
    c.c_q = sh.c_off;
    c.c_x = sh.c_x; /* 0 unless `tail` */
    c.xb = sh.x_b;
    c.c_ce = sh.c_ce;
    c.same_tau = a.tau == 1.0f;
    return c;
}

/* out[pos] = bf16(dS · mul) at the row's special positions (top-k', draws, label). Writers of one
 * position (repeated draws, label inside the top-k') store equal values. */
template <bool DIV>
__device__ void write_specials(const RowArgs &a, RowSmem m, const RowShared &sh, const GradCoef &c,
                               __nv_bfloat16 *out, float mul)
{
    const int n_special = a.k_use + a.s + 1; /* a.s is 0 unless `sampled` (row_args) */
    for (int j = threadIdx.x; j < n_special; j += blockDim.x) {
        int pos;
        float s;
        if (j < a.k_use) {
            pos = m.idx_i[j];
            s = m.s_i[j];
        } else if (j < n_special - 1) {
            pos = m.idx_t[j - a.k_use];
            s = m.s_t[j - a.k_use];
        } else {
            pos = sh.label;
            s = sh.s_label;
        }
        out[pos] = __float2bfloat16_rn(grad_special<DIV>(a, m, sh, c, pos, s) * mul);
    }
}

template <int VEC, bool DIV>
__device__ void row_grad_inplace(const RowArgs &a, float *row, RowSmem m, const RowShared &sh)
{
    const int v = a.v, tid = threadIdx.x;
    const bool zero = !sh.kept || sh.bad;
    const GradCoef c = grad_coef(a, sh);
    __nv_bfloat16 *ds = reinterpret_cast<__nv_bfloat16 *>(row);
    const int nt = blockDim.x;
    for (int base = 0; base < v; base += VEC * 4 * nt) {
        float4 x[VEC];
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            int e = base + j * 4 * nt + tid * 4;
            if (e < v)
                x[j] = *reinterpret_cast<const float4 *>(row + e);
        }
        __syncthreads(); /* every fp32 value this tile's bf16 stores overlay has been read */
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            int e = base + j * 4 * nt + tid * 4;
            if (e < v)
                *reinterpret_cast<uint2 *>(ds + e) = grad4(x[j], c, zero);
        }
    }
    __syncthreads();
    if (!zero)
        write_specials<DIV>(a, m, sh, c, ds, 1.0f);
}

/* ---- dS on the fused path: the dense part is E from the GEMM's epilogue ------------------------ */

/* Where the dense gradient is one softmax (fused path) it is c·exp(k·s − LSE_k) = sigma · E with
 * E = exp2(s·l2e_k − rb) from the epilogue and sigma = c·exp2(rb − LSE_k·log2 e); Σ_v E = 2^x with
 * x = LSE_k·log2 e − rb. Past 2^kMaxLog2SumE the E tile may have overflowed (the reference column
 * is far below the row's max) or would overflow dH's fp32 sums: the row is then made again here. */
constexpr float kMaxLog2SumE = 64.0f;

/* The slow path for one row (rare: the student's logit at the reference column is over ~44/k
 * below its max): E = exp(k·s − LSE_k) made from h and W with one warp per column; zeros for a
 * row whose gradient is zero. */
__device__ void row_exp_remake(const RowArgs &a, long long r, __nv_bfloat16 *er, float lse_k,
                               bool zero)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    const uint16_t *hr = a.h + (a.row0 + r) * a.d;
    const float lb = lse_k * kLog2e;
    for (int col = warp; col < a.v; col += nw) {
        const float acc = zero ? 0.0f : warp_dot_bf16(hr, a.w + (size_t)col * a.d, a.d);
        if (lane == 0)
            er[col] = __float2bfloat16_rn(zero ? 0.0f : fast_exp2(fmaf(acc, a.l2e_k, -lb)));
    }
}

/* A divergence's dense coefficient may be 0 (renorm at α = 1: only the k' tokens get a KD
 * gradient) or small, of either sign (sampled: rest_g − gbar); sigma = c_dense·2^−x would then make
 * the special positions' dS / sigma huge next to E (dH's fp32 sums lose E) or infinite. Below this
 * share of the row's gradient scale (|KD weight| + |CE weight|), sigma takes that scale instead and
 * the row's E is multiplied by c_dense / scale in place: one bf16 pass over the row, those rows only.
 * At the bound the specials' E is at most ~16× the dense sum's (times their own size): far inside
 * fp32's sums. fkl's c_dense (Σ target, plus CE's) never takes this path. */
constexpr float kMinDenseShare = 1.0f / 16.0f;

/* er[0, v) *= f, bf16 in place, by the whole block (8 values per 16-byte access; the row starts
 * 32-byte aligned: lde is a multiple of 16). */
__device__ void row_exp_scale(__nv_bfloat16 *er, int v, float f)
{
    uint4 *p = reinterpret_cast<uint4 *>(er);
    for (int i = threadIdx.x; i < v / 8; i += blockDim.x) {
        uint4 u = p[i];
        __nv_bfloat162 *h2 = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float2 x = __bfloat1622float2(h2[q]);
            h2[q] = __floats2bfloat162_rn(x.x * f, x.y * f);
        }
        p[i] = u;
    }
    for (int i = v / 8 * 8 + threadIdx.x; i < v; i += blockDim.x)
        er[i] = __float2bfloat16_rn(__bfloat162float(er[i]) * f);
}

/* The fused path's gradient pass of one row: sigma, the slow path where needed, then each special
 * position's exact dS / sigma over E's value there (as row_grad_inplace writes dS). DIV: a
 * divergence other than fkl, whose dense coefficient may be small (kMinDenseShare). */
template <bool DIV>
__device__ void row_grad_fused(const RowArgs &a, long long r, RowSmem m, RowShared &sh)
{
    const bool zero = !sh.kept || sh.bad;
    const float lse_k = a.k_one ? sh.lse_one : sh.lse_tau;
    const float x = lse_k * kLog2e - a.ref[r] * a.ref_scale; /* the epilogue's rb, bit for bit */
    const float c_dense = sh.c_off + sh.c_ce; /* one of the two is 0 unless τ = 1 (host checks) */
    const float c_row = fabsf(sh.c_tgt) + fabsf(sh.c_ce);
    const bool rescale = DIV && fabsf(c_dense) < kMinDenseShare * c_row;
    const float c_sig = rescale ? c_row : c_dense;
    __nv_bfloat16 *er = a.e + r * a.lde;
    const bool slow = !(x <= kMaxLog2SumE);
    if (slow) {
        row_exp_remake(a, r, er, lse_k, zero);
        if (threadIdx.x == 0)
            atomicAdd(&a.out->slow_rows, 1ull);
    }
    const float sigma = zero ? 0.0f : slow ? c_sig : c_sig * fast_exp2(-x);
    if (threadIdx.x == 0)
        a.sigma[r] = sigma;
    __syncthreads(); /* the slow path's E is written before the special positions */
    if (zero)
        return; /* sigma 0: E is finite (x bounded or remade as zeros) and contributes nothing */
    if (rescale) { /* E finite: x bounded, or remade */
        row_exp_scale(er, a.v, c_dense / c_row);
        __syncthreads();
    }
    /* each special position holds its exact dS over sigma, so that sigma · E is dS there too (a
     * divergence's sigma may be negative) */
    if (DIV)
        write_specials<DIV>(a, m, sh, grad_coef(a, sh), er, sigma != 0.0f ? 1.0f / sigma : 0.0f);
    else
        write_specials<DIV>(a, m, sh, grad_coef(a, sh), er, sigma > 0.0f ? 1.0f / sigma : 0.0f);
}

/* One block per row of the chunk; DIV: RowArgs::div_on (fkl's kernels are DIV = false). */
template <int MODE, int VEC, bool DIV>
__global__ void __launch_bounds__(VEC == 4 ? 512 : 256, VEC == 4 ? 2 : 3) kl_row_kernel(RowArgs a)
{
    extern __shared__ unsigned char dyn_smem[];
    __shared__ RowShared sh;
    const long long r = blockIdx.x;
    float *row = a.logits + r * a.ldl;
    const int tail = a.variant == TKD_KL_VARIANT_TAIL;
    RowSmem m = row_smem_carve(dyn_smem, a.k_use, a.s, a.v, MODE != kModeGrad);
    row_gather(a, r, row, m, sh);
    if (MODE == kModeGrad || a.lse_given) { /* lse_given is never `tail` (the host checks) */
        if (threadIdx.x == 0) {
            sh.lse_tau = a.lse_tau[r];
            sh.lse_one = a.lse_one[r];
            sh.log_omq = tail ? a.log_omq[r] : 0.0f;
        }
        __syncthreads();
    } else {
        row_lse<VEC>(row, a.v, a.tau, tail ? m.bitmap : NULL, sh);
        if (threadIdx.x == 0) {
            a.lse_tau[r] = sh.lse_tau;
            a.lse_one[r] = sh.lse_one;
            if (tail)
                a.log_omq[r] = sh.log_omq;
        }
    }
    row_finalize<MODE, DIV>(a, r, m, sh);
    __syncthreads();
    if (MODE != kModeStats) {
        if (a.e)
            row_grad_fused<DIV>(a, r, m, sh);
        else
            row_grad_inplace<VEC, DIV>(a, row, m, sh);
    }
}

} // namespace

RowArgs row_args(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b,
                        long long row0, float grad_scale)
{
    RowArgs a = {}; /* the fused path's fields stay NULL here */
    size_t n = (size_t)ws->n_max;
    a.logits = ws->chunk_buf;
    a.ldl = ws->ldl;
    a.row0 = row0;
    a.v = b->v;
    a.k = p->k;
    a.k_use = p->k_use;
    a.s = p->variant == TKD_KL_VARIANT_SAMPLED ? p->s : 0;
    a.variant = (int)p->variant;
    a.tau = p->temperature;
    a.alpha = p->alpha;
    a.grad_scale = grad_scale;
    a.ignore_index = p->ignore_index;
    a.lse_given = 0;
    a.div_on = tkd_kl_div_on(p);
    a.div_kind = tkd_kl_div_kind(p->divergence, p->jsd_beta, p->skew_alpha);
    a.jsd_beta = p->jsd_beta;
    a.skew_alpha = p->skew_alpha;
    a.topk_idx = a.k_use > 0 ? b->topk_idx + row0 * p->k : NULL;
    a.topk_logit = a.k_use > 0 ? b->topk_logit + row0 * p->k : NULL;
    a.teacher_lse = b->teacher_lse ? b->teacher_lse + row0 : NULL;
    a.tail_idx = a.s > 0 ? b->tail_idx + row0 * a.s : NULL;
    a.labels = b->labels + row0;
    a.lse_tau = ws->lse_tau + row0;
    a.lse_one = ws->lse_one + row0;
    a.log_omq = ws->log_omq + row0;
    a.row_loss = ws->row_stats + row0;
    a.row_kd = ws->row_stats + n + row0;
    a.row_ce = ws->row_stats + 2 * n + row0;
    a.out = ws->out;
    return a;
}

template <int VEC>
static tkd_status launch_rows_vec(int mode, int rows, int threads, const RowArgs &a)
{
    size_t smem = row_smem_bytes(a.k_use, a.s, a.v, mode != kModeGrad);
    void (*kern)(RowArgs) = mode == kModeStats  ? a.div_on ? kl_row_kernel<kModeStats, VEC, true>
                                                           : kl_row_kernel<kModeStats, VEC, false>
                            : mode == kModeGrad ? a.div_on ? kl_row_kernel<kModeGrad, VEC, true>
                                                           : kl_row_kernel<kModeGrad, VEC, false>
                            : a.div_on          ? kl_row_kernel<kModeStatsGrad, VEC, true>
                                                : kl_row_kernel<kModeStatsGrad, VEC, false>;
    if (smem > 48 * 1024) /* beyond the default limit: ask for it (the bitmap at large V) */
        TKD_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem));
    kern<<<rows, threads, smem>>>(a);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

tkd_status launch_rows(const tkd_kl_cuda_ws *ws, int mode, int rows, const RowArgs &a)
{
    return ws->row_vec == 8 ? launch_rows_vec<8>(mode, rows, ws->row_threads, a)
                            : launch_rows_vec<4>(mode, rows, ws->row_threads, a);
}

} // namespace tkd_klc

using namespace tkd_klc;

extern "C" tkd_status tkd_kl_cuda_chunk_rows(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                             const tkd_kl_cuda_batch *b,
                                             tkd_kl_cuda_rows_mode mode, int64_t row0, int rows,
                                             float grad_scale)
{
    const int given = (mode & TKD_KL_CUDA_ROWS_LSE_GIVEN) != 0;
    const int base_mode = (int)mode & ~TKD_KL_CUDA_ROWS_LSE_GIVEN;
    if (given && (base_mode == kModeGrad || p->variant == TKD_KL_VARIANT_TAIL))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss_cuda: given LSEs are for the stats modes "
                             "of renorm and sampled only (mode %d, variant %s)", (int)mode,
                             tkd_kl_variant_name(p->variant));
    RowArgs a = row_args(ws, p, b, row0, grad_scale);
    a.lse_given = given;
    return launch_rows(ws, base_mode, rows, a);
}

