/* kl_loss_cuda.cu — see kl_loss_cuda.h. Row kernels (static) + cuBLAS bf16 GEMMs per chunk; the
 * workspace and the per-chunk stages forward/backward are made of are in kl_loss_cuda_internal.h.
 *
 * The logits GEMM. On compute capability 9.0 (and D a multiple of 8, TKD_KL_SM90 not "0" when the
 * workspace was made) the chunk's logits come from our Hopper GEMM (kernels/lmhead_sm90.h), whose
 * epilogue reduces each row tile to (max, Σ exp at 1, Σ exp at 1/τ) partials; a small combine
 * turns them into the LSEs. On the fused path (the section "the fused path" below, docs/loss.md)
 * the epilogue also gathers each row's special columns and, in the gradient modes, writes the
 * bf16 tile E, so no logits are stored; elsewhere (two softmaxes in the gradient, TKD_KL_FUSED=0)
 * it writes the fp32 logits chunk that the row kernel gathers from and turns into dS. Forward and
 * backward use the same GEMM, so they see the same bits. `tail` keeps cuBLAS and the row kernel's
 * own pass: its log(1 − Q) is a sum outside the row's top-k' that the GEMM cannot know. cuBLAS +
 * the row kernel's pass are the fallback and the reference.
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
 * draws, label) exactly.
 */
#include "kernels/kl_loss_cuda.h"

#include <cuda_bf16.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "common/status.h"
#include "kernels/cuda_check.h"
#include "kernels/cuda_fast_math.cuh"
#include "kernels/cuda_mem.h"
#include "kernels/kl_loss.h"
#include "kernels/kl_loss_cuda_internal.h"
#include "kernels/lmhead_grad_sm90.h"
#include "kernels/lmhead_sm90.h"

/* Written by the count, row and reduce kernels; read back once per call. */
struct tkd_kl_cuda_dev_out {
    double loss, kd, ce;
    long long n_kept;
    long long err_row; /* first bad row, LLONG_MAX when none */
    unsigned int err_bits;
    float inv_n_kept;  /* 1 / n_kept (0 when no row is kept) */
    unsigned long long slow_rows; /* fused path: rows whose E was made again (row_exp_remake) */
};

namespace {

typedef tkd_kl_cuda_dev_out DevOut;

/* Row kernels stream a row in tiles of VEC float4 loads per thread, all issued before any is used:
 * VEC·16 bytes in flight per thread. The product runs VEC = 4 with 512-thread blocks (2 per SM,
 * TKD_KL_CUDA_ROW_THREADS x TKD_KL_CUDA_ROW_VEC); VEC = 8 with ≤ 256-thread blocks (3 per SM) is
 * there for the benchmark's sweep (tkd_kl_cuda_ws_set_rows). */
constexpr int kMaxThreads = 512;           /* row-kernel block: one row per block */
constexpr int kMaxWarps = kMaxThreads / 32;
/* The (threads, vec) pairs the kernels are built for (their __launch_bounds__). */
constexpr bool row_shape_ok(int threads, int vec)
{
    return (vec == 4 && (threads == 128 || threads == 256 || threads == 512)) ||
           (vec == 8 && (threads == 128 || threads == 256));
}
static_assert(row_shape_ok(TKD_KL_CUDA_ROW_THREADS, TKD_KL_CUDA_ROW_VEC),
              "the product's row shape must be one the row kernels are built for");
constexpr float kLog2e = 1.4426950408889634f;
constexpr size_t kBlasWsBytes = 32u << 20; /* cuBLAS workspace we hand it, so it allocates none */

enum RowMode {
    kModeStats = TKD_KL_CUDA_ROWS_STATS,
    kModeGrad = TKD_KL_CUDA_ROWS_GRAD,
    kModeStatsGrad = TKD_KL_CUDA_ROWS_STATS_GRAD,
};

/* Bits of DevOut::err_bits: why a row's teacher data or label was rejected. */
enum {
    kErrTopkRange = 1, kErrTopkDup = 2, kErrTeacherNonFinite = 4, kErrLabelRange = 8,
    kErrTailRange = 16, kErrTailInTopk = 32,
};

/* What the row kernel needs; pointers to per-row arrays are already offset to the chunk. */
struct RowArgs {
    float *logits;  /* (rows, ldl) chunk buffer; rewritten as bf16 dS in grad modes */
    long long ldl;
    long long row0; /* global index of the chunk's first row (error reports) */
    int v, k, k_use, s;
    int variant;
    float tau, alpha, grad_scale;
    int ignore_index;
    int lse_given;            /* stats modes: lse_tau / lse_one hold the chunk's LSEs already */
    const int32_t *topk_idx;  /* (rows, k) */
    const float *topk_logit;  /* (rows, k) */
    const float *teacher_lse; /* (rows) */
    const int32_t *tail_idx;  /* (rows, s) or NULL */
    const int32_t *labels;    /* (rows) */
    float *lse_tau, *lse_one; /* (rows) written by stats modes, read by kModeGrad and lse_given */
    float *log_omq;           /* (rows) tail: log(1 − Q), likewise */
    double *row_loss, *row_kd, *row_ce; /* (rows) written by stats modes */
    DevOut *out;
    /* Fused path (else NULL): the special columns' logits by slot, from the GEMM's gather */
    const float *g;           /* (rows, ldg): slots k' top-k, then S draws, then the label */
    int ldg;
    /* ... and in the gradient modes the bf16 tile E = exp2(s·l2e_k − ref·ref_scale) */
    __nv_bfloat16 *e;         /* (rows, lde) */
    long long lde;
    const float *ref;         /* (rows) */
    float ref_scale, l2e_k;
    int k_one;                /* E at scale 1 (α = 0), else at 1/τ */
    float *sigma;             /* (rows) out: dS = sigma · E off the special columns */
    const uint16_t *h, *w;    /* the batch's H (row0 is this chunk's first row) and W: the slow path */
    int d;
};

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

__device__ inline double warp_sum(double x)
{
    for (int off = 16; off > 0; off >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

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

template <int MODE>
__device__ void row_finalize(const RowArgs &a, long long r, RowSmem m, RowShared &sh)
{
    if (threadIdx.x >= 32)
        return;
    const int ok = sh.kept && !sh.bad;
    double kd = 0.0, ce = 0.0, c_off = 0.0, c_in = 0.0, c_x = 0.0;
    if (ok) {
        kd = row_kd_warp(a, m, sh, &c_off, &c_in, &c_x) * (double)a.tau * a.tau;
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

/* Exact gradient at a special position v (a top-k' column, a tail draw or the label). */
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
            if (m.idx_t[j] == v)
                tgt = m.tgt_t[j];
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
        out[pos] = __float2bfloat16_rn(grad_special(a, m, sh, c, pos, s) * mul);
    }
}

template <int VEC>
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
        write_specials(a, m, sh, c, ds, 1.0f);
}

/* ---- dS on the fused path: the dense part is E from the GEMM's epilogue ------------------------ */

/* Where the dense gradient is one softmax (fused path) it is c·exp(k·s − LSE_k) = sigma · E with
 * E = exp2(s·l2e_k − rb) from the epilogue and sigma = c·exp2(rb − LSE_k·log2 e); Σ_v E = 2^x with
 * x = LSE_k·log2 e − rb. Past 2^kMaxLog2SumE the E tile may have overflowed (the reference column
 * is far below the row's max) or would overflow dH's fp32 sums: the row is then made again here. */
constexpr float kMaxLog2SumE = 64.0f;

/* h · w over d (even) bf16 values, fp32 sums in a fixed order, on every lane of the warp. */
__device__ inline float warp_dot_bf16(const uint16_t *h, const uint16_t *w, int d)
{
    const __nv_bfloat162 *h2 = reinterpret_cast<const __nv_bfloat162 *>(h);
    const __nv_bfloat162 *w2 = reinterpret_cast<const __nv_bfloat162 *>(w);
    float acc = 0.0f;
    for (int i = threadIdx.x % 32; i < d / 2; i += 32) {
        const float2 x = __bfloat1622float2(h2[i]), y = __bfloat1622float2(w2[i]);
        acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
    }
    for (int off = 16; off > 0; off >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
}

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

/* The fused path's gradient pass of one row: sigma, the slow path where needed, then each special
 * position's exact dS / sigma over E's value there (as row_grad_inplace writes dS). */
__device__ void row_grad_fused(const RowArgs &a, long long r, RowSmem m, RowShared &sh)
{
    const bool zero = !sh.kept || sh.bad;
    const float lse_k = a.k_one ? sh.lse_one : sh.lse_tau;
    const float x = lse_k * kLog2e - a.ref[r] * a.ref_scale; /* the epilogue's rb, bit for bit */
    const float c_dense = sh.c_off + sh.c_ce; /* one of the two is 0 unless τ = 1 (host checks) */
    __nv_bfloat16 *er = a.e + r * a.lde;
    const bool slow = !(x <= kMaxLog2SumE);
    if (slow) {
        row_exp_remake(a, r, er, lse_k, zero);
        if (threadIdx.x == 0)
            atomicAdd(&a.out->slow_rows, 1ull);
    }
    const float sigma = zero ? 0.0f : slow ? c_dense : c_dense * fast_exp2(-x);
    if (threadIdx.x == 0)
        a.sigma[r] = sigma;
    __syncthreads(); /* the slow path's E is written before the special positions */
    if (zero)
        return; /* sigma 0: E is finite (x bounded or remade as zeros) and contributes nothing */
    /* each special position holds its exact dS over sigma, so that sigma · E is dS there too */
    write_specials(a, m, sh, grad_coef(a, sh), er, sigma > 0.0f ? 1.0f / sigma : 0.0f);
}

/* One block per row of the chunk. */
template <int MODE, int VEC>
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
    row_finalize<MODE>(a, r, m, sh);
    __syncthreads();
    if (MODE != kModeStats) {
        if (a.e)
            row_grad_fused(a, r, m, sh);
        else
            row_grad_inplace<VEC>(a, row, m, sh);
    }
}

/* ---- the fused path's small kernels ------------------------------------------------------------ */

/* What sp_prep_kernel reads and writes; per-row pointers offset to the chunk. */
struct SpArgs {
    const int32_t *topk_idx; /* (rows, k), first k_use used */
    int k, k_use;
    const int32_t *tail_idx; /* (rows, s) or NULL */
    int s;
    const int32_t *labels;
    int ignore_index, v, tiles, sp_l, d;
    int2 *list;              /* (rows, sp_l) */
    int *off;                /* (rows, tiles + 1) */
    float *g;                /* (rows, sp_l): NaN, the epilogue overwrites the listed slots */
    float *ref;              /* (rows) gif: the logit at the row's first listed slot, 0 if none */
    const uint16_t *h, *w;   /* h offset to the chunk */
};

/* One warp per row: the row's special columns (top-k', draws, the label of a kept row; indices
 * outside [0, V) are left out: the row kernel reports them) compacted in slot order by ballots,
 * sorted by (column, slot) (a rank sort: pairs are distinct, so ranks are), each V-tile's first
 * entry, and (ref) the logit at the first listed slot as a dot product. Dynamic smem: 2·sp_l int2
 * per warp. */
__global__ void sp_prep_kernel(SpArgs a, int rows)
{
    extern __shared__ int2 sp_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const long long r = (long long)blockIdx.x * (blockDim.x / 32) + warp;
    if (r >= rows)
        return; /* whole warps only: nothing below syncs the block */
    int2 *raw = sp_smem + (size_t)warp * 2 * a.sp_l, *sorted = raw + a.sp_l;
    const int n_items = a.k_use + a.s + 1;
    int cnt = 0, first = INT_MAX;
    for (int base = 0; base < n_items; base += 32) {
        const int j = base + lane;
        int col = -1;
        if (j < n_items) {
            if (j < a.k_use)
                col = a.topk_idx[r * a.k + j];
            else if (j < n_items - 1)
                col = a.tail_idx[r * a.s + (j - a.k_use)];
            else
                col = a.labels[r] == a.ignore_index ? -1 : a.labels[r];
            a.g[r * a.sp_l + j] = NAN;
        }
        const bool ok = col >= 0 && col < a.v;
        const unsigned m = __ballot_sync(0xffffffffu, ok);
        if (ok)
            raw[cnt + __popc(m & ((1u << lane) - 1u))] = make_int2(col, j);
        if (m && first == INT_MAX)
            first = base + __ffs(m) - 1;
        cnt += __popc(m);
    }
    __syncwarp();
    for (int i = lane; i < cnt; i += 32) {
        const int2 x = raw[i];
        int rank = 0;
        for (int q = 0; q < cnt; q++)
            rank += raw[q].x < x.x || (raw[q].x == x.x && raw[q].y < x.y);
        sorted[rank] = x;
        a.list[r * a.sp_l + rank] = x;
    }
    __syncwarp();
    for (int t = lane; t <= a.tiles; t += 32) { /* first entry with column ≥ 256·t */
        int lo = 0, hi = cnt;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (sorted[mid].x < t * TKD_LMHEAD_SM90_BN)
                lo = mid + 1;
            else
                hi = mid;
        }
        a.off[r * (a.tiles + 1) + t] = lo;
    }
    if (!a.ref)
        return;
    float acc = 0.0f;
    if (first != INT_MAX) {
        int col = 0;
        for (int i = 0; i < cnt; i++)
            if (raw[i].y == first)
                col = raw[i].x;
        acc = warp_dot_bf16(a.h + r * a.d, a.w + (size_t)col * a.d, a.d);
    }
    if (lane == 0)
        a.ref[r] = acc;
}

/* dh (rows, d) *= sigma per row. */
__global__ void scale_rows_kernel(float *dh, const float *sigma, long long rows, int d)
{
    const long long n = rows * d;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dh[i] *= sigma[i / d];
}

/* hs (rows, d) bf16 = sigma_i · h_i (one rounding: h and sigma are exact inputs). */
__global__ void scale_h_kernel(const __nv_bfloat16 *h, const float *sigma, long long rows, int d,
                               __nv_bfloat16 *hs)
{
    const long long n = rows * d;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        hs[i] = __float2bfloat16_rn(sigma[i / d] * __bfloat162float(h[i]));
}

/* Counts kept rows and resets the error state (one block). */
__global__ void kl_count_kernel(const int32_t *labels, long long n, int ignore_index, DevOut *out)
{
    __shared__ long long part[32];
    long long c = 0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x)
        c += labels[i] != ignore_index;
    for (int off = 16; off > 0; off >>= 1)
        c += __shfl_xor_sync(0xffffffffu, c, off);
    if (threadIdx.x % 32 == 0)
        part[threadIdx.x / 32] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        long long t = 0;
        for (int w = 0; w < (int)(blockDim.x / 32); w++)
            t += part[w];
        out->n_kept = t;
        out->inv_n_kept = t > 0 ? (float)(1.0 / (double)t) : 0.0f;
        out->err_bits = 0;
        out->err_row = 0x7fffffffffffffffLL;
        out->slow_rows = 0;
    }
}

/* Sums the per-row losses into the means (one block). */
__global__ void kl_reduce_kernel(const double *row_loss, const double *row_kd,
                                 const double *row_ce, long long n, DevOut *out)
{
    __shared__ double part[3][32];
    double s[3] = {0.0, 0.0, 0.0};
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        s[0] += row_loss[i];
        s[1] += row_kd[i];
        s[2] += row_ce[i];
    }
    for (int j = 0; j < 3; j++) {
        s[j] = warp_sum(s[j]);
        if (threadIdx.x % 32 == 0)
            part[j][threadIdx.x / 32] = s[j];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double t[3] = {0.0, 0.0, 0.0};
        for (int w = 0; w < (int)(blockDim.x / 32); w++)
            for (int j = 0; j < 3; j++)
                t[j] += part[j][w];
        double inv = out->n_kept > 0 ? 1.0 / (double)out->n_kept : 0.0;
        out->loss = t[0] * inv;
        out->kd = t[1] * inv;
        out->ce = t[2] * inv;
    }
}

} // namespace

/* ---- workspace ------------------------------------------------------------------------------- */

extern "C" int tkd_kl_cuda_default_chunk_rows(int64_t n_max, int v)
{
    const double target = 1024.0 * 1024.0 * 1024.0; /* one GiB of fp32 logits */
    long long c = (long long)(target / (4.0 * (double)(v > 0 ? v : 1)));
    c = c / 128 * 128;
    long long n_up = (n_max + 127) / 128 * 128;
    if (c > n_up) c = n_up;
    if (c < 128) c = 128;
    return (int)c;
}

static tkd_status ws_setup(tkd_kl_cuda_ws *ws)
{
    size_t n = (size_t)ws->n_max;
    TKD_TRY(tkd_cuda_malloc((void **)&ws->chunk_buf, (size_t)ws->chunk * ws->ldl * sizeof(float),
                            "chunk buffer (fp32 logits)", "lower kd.chunk_size (rows per chunk)"));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->lse_tau, n * sizeof(float), "row statistics", NULL));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->lse_one, n * sizeof(float), "row statistics", NULL));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->log_omq, n * sizeof(float), "row statistics", NULL));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->row_stats, 3 * n * sizeof(double), "row statistics", NULL));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->out, sizeof(DevOut), "loss sums", NULL));
    TKD_TRY(tkd_cuda_malloc(&ws->blas_ws, kBlasWsBytes, "cuBLAS workspace", NULL));
    TKD_CUBLAS_CHECK(cublasCreate(&ws->blas));
    TKD_CUBLAS_CHECK(cublasSetStream(ws->blas, 0));
    TKD_CUBLAS_CHECK(cublasSetWorkspace(ws->blas, ws->blas_ws, kBlasWsBytes));
    TKD_CUDA_CHECK(cudaMemset(ws->out, 0, sizeof(DevOut)));
    return TKD_OK;
}

/* Which gradient GEMMs run on ours (TKD_KL_GRAD_DH | TKD_KL_GRAD_DW). By default dH on ours where D
 * is a multiple of 256 (there as fast as cuBLAS, within 1 %, with sigma in its epilogue instead of a
 * pass; its tiles are 256 wide, so at D 2880 a twelfth tile a quarter full makes it 4-6 % slower and
 * cuBLAS does dH), dW on cuBLAS (ours 9-13 % slower); docs/PERFORMANCE.md. The policy picks others. */
static int grad_paths(int kl_grad, int d)
{
    switch (kl_grad) {
    case TKD_POLICY_KL_GRAD_CUBLAS: return 0;
    case TKD_POLICY_KL_GRAD_DH: return TKD_KL_GRAD_DH;
    case TKD_POLICY_KL_GRAD_DW: return TKD_KL_GRAD_DW;
    case TKD_POLICY_KL_GRAD_BOTH: return TKD_KL_GRAD_DH | TKD_KL_GRAD_DW;
    default: return d % TKD_LMHEAD_SM90_BN == 0 ? TKD_KL_GRAD_DH : 0;
    }
}

/* Our Hopper GEMM for the logits where it runs (compute capability 9.0, D a multiple of 8) unless
 * the policy's kl_sm90 is off: its workspace and its statistics partials (3, chunk, ceil(V / 256)).
 * Elsewhere nothing, and cuBLAS makes the logits. */
static tkd_status sm90_setup(tkd_kl_cuda_ws *ws, const tkd_cuda_policy *pol)
{
    if (!pol->kl_sm90 || ws->d % 8 != 0)
        return TKD_OK;
    tkd_status st = tkd_lmhead_sm90_ws_create(&ws->lm, pol->lmhead_sched);
    if (st == TKD_ERR_UNSUPPORTED) { /* another device: the fallback is the answer, not an error */
        tkd_error_clear();
        return TKD_OK;
    }
    TKD_TRY(st);
    ws->fused = pol->kl_fused != 0;
    ws->grad_sm90 = grad_paths(pol->kl_grad, ws->d);
    int dev = 0;
    TKD_CUDA_CHECK(cudaGetDevice(&dev));
    TKD_CUDA_CHECK(cudaDeviceGetAttribute(&ws->sms, cudaDevAttrMultiProcessorCount, dev));
    /* the fused path's chunks: bf16 E takes half the bytes of fp32 logits per row */
    ws->chunk_e = ws->fused && 2LL * ws->chunk <= ws->n_max ? 2 * ws->chunk
                  : ws->fused                               ? (int)ws->n_max
                                                            : ws->chunk;
    const size_t ce = (size_t)ws->chunk_e, tiles = (size_t)tkd_lmhead_sm90_vtiles(ws->v);
    const char *hint = "lower kd.chunk_size (rows per chunk)";
    TKD_TRY(tkd_cuda_malloc((void **)&ws->lm_part,
                            tkd_lmhead_sm90_part_floats(ws->chunk_e, ws->v) * sizeof(float),
                            "logits GEMM statistics partials", hint));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->sp_list, ce * ws->sp_l * 2 * sizeof(int32_t),
                            "special-column lists", hint));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->sp_off, ce * (tiles + 1) * sizeof(int),
                            "special-column offsets", hint));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->sp_g, ce * ws->sp_l * sizeof(float),
                            "special-column logits", hint));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->ref, ce * sizeof(float), "row statistics", NULL));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->sigma, ce * sizeof(float), "row statistics", NULL));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->hs, ce * ws->d * sizeof(uint16_t), "scaled hidden states",
                            hint));
    ws->use_sm90 = 1;
    return TKD_OK;
}

extern "C" tkd_status tkd_kl_cuda_ws_create(tkd_kl_cuda_ws **out, const tkd_kl_params *p,
                                          const tkd_cuda_policy *pol, int64_t n_max, int d, int v)
{
    *out = NULL;
    const tkd_cuda_policy defaults = tkd_cuda_policy_default();
    if (n_max <= 0 || d <= 0 || v <= 0 || p->chunk_rows < 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "kl_loss_cuda: ws_create: n_max %lld, d %d, v %d, chunk_rows %d: all "
                             "must be positive (chunk_rows 0 = auto)",
                             (long long)n_max, d, v, p->chunk_rows);
    tkd_kl_cuda_ws *ws = (tkd_kl_cuda_ws *)calloc(1, sizeof *ws);
    if (!ws)
        return tkd_error_set(TKD_ERR_NOMEM, "kl_loss_cuda: ws_create: host allocation failed");
    ws->n_max = n_max;
    ws->d = d;
    ws->v = v;
    ws->ldl = ((long long)v + 15) / 16 * 16;
    ws->chunk = p->chunk_rows > 0 ? p->chunk_rows : tkd_kl_cuda_default_chunk_rows(n_max, v);
    if (ws->chunk > n_max)
        ws->chunk = (int)n_max;
    ws->chunk_e = ws->chunk;
    ws->sp_l = p->k + p->s + 1;
    ws->row_threads = TKD_KL_CUDA_ROW_THREADS;
    ws->row_vec = TKD_KL_CUDA_ROW_VEC;
    const int chunk = ws->chunk;
    tkd_status st = ws_setup(ws);
    if (st == TKD_OK)
        st = sm90_setup(ws, pol ? pol : &defaults);
    if (st != TKD_OK) {
        tkd_kl_cuda_ws_free(ws);
        return tkd_error_prefix(st, "kl_loss_cuda: workspace for %lld rows x V %d, chunk %d",
                                (long long)n_max, v, chunk);
    }
    *out = ws;
    return TKD_OK;
}

extern "C" void tkd_kl_cuda_ws_free(tkd_kl_cuda_ws *ws)
{
    if (!ws)
        return;
    if (ws->blas) /* teardown errors are not actionable */
        (void)cublasDestroy(ws->blas);
    tkd_cuda_free(ws->chunk_buf);
    tkd_cuda_free(ws->lse_tau);
    tkd_cuda_free(ws->lse_one);
    tkd_cuda_free(ws->log_omq);
    tkd_cuda_free(ws->row_stats);
    tkd_cuda_free(ws->out);
    tkd_cuda_free(ws->blas_ws);
    tkd_lmhead_sm90_ws_free(ws->lm);
    tkd_cuda_free(ws->lm_part);
    tkd_cuda_free(ws->sp_list);
    tkd_cuda_free(ws->sp_off);
    tkd_cuda_free(ws->sp_g);
    tkd_cuda_free(ws->ref);
    tkd_cuda_free(ws->sigma);
    tkd_cuda_free(ws->hs);
    free(ws);
}

extern "C" int tkd_kl_cuda_ws_chunk_rows(const tkd_kl_cuda_ws *ws) { return ws->chunk; }

extern "C" tkd_status tkd_kl_cuda_ws_set_rows(tkd_kl_cuda_ws *ws, int threads, int vec)
{
    if (threads == 0 && vec == 0) {
        threads = TKD_KL_CUDA_ROW_THREADS;
        vec = TKD_KL_CUDA_ROW_VEC;
    }
    if (!row_shape_ok(threads, vec))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "kl_loss_cuda: row kernels: %d threads x %d float4: use vec 4 with "
                             "128/256/512 threads, vec 8 with 128/256, or 0, 0 for the default",
                             threads, vec);
    ws->row_threads = threads;
    ws->row_vec = vec;
    return TKD_OK;
}

/* ---- per-chunk stages (cuBLAS column-major views of our row-major matrices) ------------------ */

/* logits (rows, ldl) fp32 = H_c (rows, D) · Wᵀ; cuBLAS: (V × rows) = Wᵀ_cm(V × D) · H_cm(D × rows). */
extern "C" tkd_status tkd_kl_cuda_chunk_logits(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b,
                                               int64_t row0, int rows)
{
    const float one = 1.0f, zero = 0.0f;
    TKD_CUBLAS_CHECK(cublasGemmEx(ws->blas, CUBLAS_OP_T, CUBLAS_OP_N, b->v, rows, b->d, &one,
                                  b->w, CUDA_R_16BF, b->d, b->h + row0 * b->d, CUDA_R_16BF, b->d,
                                  &zero, ws->chunk_buf, CUDA_R_32F, (int)ws->ldl,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return TKD_OK;
}

/* dH_c (rows, D) fp32 = dS (rows, V) · W; ds bf16 with leading dimension ld. */
static tkd_status gemm_dh(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int64_t row0, int rows,
                          const void *ds, long long ld, float *dh)
{
    const float one = 1.0f, zero = 0.0f;
    TKD_CUBLAS_CHECK(cublasGemmEx(ws->blas, CUBLAS_OP_N, CUBLAS_OP_N, b->d, rows, b->v, &one,
                                  b->w, CUDA_R_16BF, b->d, ds, CUDA_R_16BF, (int)ld, &zero,
                                  dh + row0 * b->d, CUDA_R_32F, b->d, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
    return TKD_OK;
}

/* dW (V, D) fp32 += dSᵀ · x (x: (rows, D) bf16, H_c or its scaled copy), or = when !accumulate;
 * ds as gemm_dh. */
static tkd_status gemm_dw(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, const uint16_t *x,
                          int rows, const void *ds, long long ld, float *dw, int accumulate)
{
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    TKD_CUBLAS_CHECK(cublasGemmEx(ws->blas, CUBLAS_OP_N, CUBLAS_OP_T, b->d, b->v, rows, &one, x,
                                  CUDA_R_16BF, b->d, ds, CUDA_R_16BF, (int)ld, &beta, dw,
                                  CUDA_R_32F, b->d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return TKD_OK;
}

/* The fp32 paths' in-place dS has leading dimension 2·ldl bf16. */
extern "C" tkd_status tkd_kl_cuda_chunk_dh(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b,
                                           int64_t row0, int rows, const void *ds, float *dh)
{
    return gemm_dh(ws, b, row0, rows, ds, 2 * ws->ldl, dh);
}

extern "C" tkd_status tkd_kl_cuda_chunk_dw(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b,
                                           int64_t row0, int rows, const void *ds, float *dw,
                                           int accumulate)
{
    return gemm_dw(ws, b, b->h + row0 * b->d, rows, ds, 2 * ws->ldl, dw, accumulate);
}

extern "C" int tkd_kl_cuda_sm90_on(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p)
{
    return ws->use_sm90 && ws->lm && p->variant != TKD_KL_VARIANT_TAIL;
}

extern "C" tkd_status tkd_kl_cuda_ws_set_sm90(tkd_kl_cuda_ws *ws, int on)
{
    if (on && !ws->lm)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "kl_loss_cuda: this workspace has no sm90 logits "
                             "GEMM (not compute capability 9.0, D %% 8 != 0, or TKD_KL_SM90=0 when "
                             "it was made)");
    ws->use_sm90 = on != 0;
    return TKD_OK;
}

extern "C" tkd_status tkd_kl_cuda_chunk_logits_auto(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                                    const tkd_kl_cuda_batch *b, int64_t row0,
                                                    int rows, int stats, int *rows_flag)
{
    *rows_flag = 0;
    if (!tkd_kl_cuda_sm90_on(ws, p))
        return tkd_kl_cuda_chunk_logits(ws, b, row0, rows);
    const uint16_t *h = b->h + row0 * b->d;
    if (!stats)
        return tkd_lmhead_sm90_logits(ws->lm, h, b->w, rows, b->d, b->v, ws->chunk_buf, ws->ldl);
    TKD_TRY(tkd_lmhead_sm90_logits_stats(ws->lm, h, b->w, rows, b->d, b->v, p->temperature,
                                         ws->chunk_buf, ws->ldl, ws->lm_part));
    TKD_TRY(tkd_lmhead_sm90_lse(ws->lm_part, rows, b->v, p->temperature, ws->lse_one + row0,
                                ws->lse_tau + row0));
    *rows_flag = TKD_KL_CUDA_ROWS_LSE_GIVEN;
    return TKD_OK;
}

extern "C" tkd_status tkd_kl_cuda_sm90_check(tkd_kl_cuda_ws *ws)
{
    return ws->lm ? tkd_lmhead_sm90_sync(ws->lm) : TKD_OK;
}

extern "C" tkd_status tkd_kl_cuda_check_call(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                             const tkd_kl_cuda_batch *b, int need_grads,
                                             const float *dh, const float *dw)
{
    if (b->n < 0 || b->n > ws->n_max || b->d != ws->d || b->v != ws->v)
        return tkd_error_set(TKD_ERR_MISMATCH,
                             "kl_loss_cuda: batch (N %lld, D %d, V %d) does not fit the workspace "
                             "(N max %lld, D %d, V %d); make a workspace for this shape",
                             (long long)b->n, b->d, b->v, (long long)ws->n_max, ws->d, ws->v);
    TKD_TRY(tkd_kl_params_check(p, b->v));
    if (p->k_use > TKD_KL_CUDA_MAX_K)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "kl_loss_cuda: k_use %d exceeds the row kernel's "
                             "limit %d; use fewer teacher columns", p->k_use, TKD_KL_CUDA_MAX_K);
    if (!b->h || !b->w || !b->labels || (p->k_use > 0 && (!b->topk_idx || !b->topk_logit)) ||
        (p->variant != TKD_KL_VARIANT_RENORM && !b->teacher_lse))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss_cuda: batch lacks h, w, labels, the "
                             "top-k columns or (tail, sampled) the teacher LSE");
    int s = p->variant == TKD_KL_VARIANT_SAMPLED ? p->s : 0;
    if (s > TKD_KL_CUDA_MAX_S || (s > 0 && !b->tail_idx))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "kl_loss_cuda: sampled needs s in [0, %d] tail draws and tail_idx "
                             "(s = %d, tail_idx %s)",
                             TKD_KL_CUDA_MAX_S, s, b->tail_idx ? "set" : "NULL");
    if (need_grads && (!dh || !dw))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss_cuda: dh and dw are required here");
    return TKD_OK;
}

extern "C" tkd_status tkd_kl_cuda_count_kept(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                             const tkd_kl_cuda_batch *b)
{
    kl_count_kernel<<<1, 1024>>>(b->labels, b->n, p->ignore_index, ws->out);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

static RowArgs row_args(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b,
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
    void (*kern)(RowArgs) = mode == kModeStats  ? kl_row_kernel<kModeStats, VEC>
                            : mode == kModeGrad ? kl_row_kernel<kModeGrad, VEC>
                                                : kl_row_kernel<kModeStatsGrad, VEC>;
    if (smem > 48 * 1024) /* beyond the default limit: ask for it (the bitmap at large V) */
        TKD_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem));
    kern<<<rows, threads, smem>>>(a);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

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
    return ws->row_vec == 8 ? launch_rows_vec<8>(base_mode, rows, ws->row_threads, a)
                            : launch_rows_vec<4>(base_mode, rows, ws->row_threads, a);
}

/* ---- the fused path ----------------------------------------------------------------------------- */

extern "C" int tkd_kl_cuda_fused_on(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p)
{
    const int s = p->variant == TKD_KL_VARIANT_SAMPLED ? p->s : 0;
    return tkd_kl_cuda_sm90_on(ws, p) && ws->fused && p->k_use + s + 1 <= ws->sp_l;
}

extern "C" int tkd_kl_cuda_fused_grad_on(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p)
{
    return tkd_kl_cuda_fused_on(ws, p) &&
           (p->temperature == 1.0f || p->alpha == 1.0f || p->alpha == 0.0f);
}

extern "C" tkd_status tkd_kl_cuda_ws_set_fused(tkd_kl_cuda_ws *ws, int on)
{
    if (on && !ws->lm)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "kl_loss_cuda: this workspace has no sm90 GEMM, "
                             "so no fused path");
    ws->fused = on != 0;
    return TKD_OK;
}

/* Rows per chunk when our dH GEMM runs (cooperative 128 x 256 tiles, K = V: one wave of tiles
 * costs as much as a whole 128 x 256 x V tile, however few tiles it holds): among c0 .. c0 + 3
 * chunks of equal size (multiples of 128 rows, at most chunk_e), the one whose dH waves plus a
 * per-chunk cost are fewest. The per-chunk cost, in dH-wave units: dW's read-modify-write of the
 * fp32 (V, D) gradient (8·V·D bytes at ~3 TB/s against one tile's 2·128·256·V flop at ~5.6 TFLOP/s
 * per SM: ≈ 2.3e-4·D) and the chunk's launches (0.1). 8192 rows at D 2048, V 151552: 4 × 2048 rows
 * (4 waves) instead of 3 × 2816 (176 tiles on 132 SMs: 6 waves). */
extern "C" int tkd_kl_cuda_dh_chunk_rows(int64_t n, int chunk_e, int64_t c0, int d, int sms)
{
    const int64_t nt = (d + TKD_LMHEAD_SM90_BN - 1) / TKD_LMHEAD_SM90_BN;
    const double per_chunk = 2.3e-4 * d + 0.1;
    int64_t best_rows = 0;
    double best = INFINITY;
    for (int64_t c = c0; c <= c0 + 3; c++) {
        const int64_t rows = ((n + c - 1) / c + 127) / 128 * 128;
        if (rows > chunk_e)
            continue;
        double cost = 0.0;
        for (int64_t row0 = 0; row0 < n; row0 += rows) {
            const int64_t r = n - row0 < rows ? n - row0 : rows;
            cost += (double)((((r + 127) / 128) * nt + sms - 1) / sms) + per_chunk;
        }
        if (cost < best)
            best = cost, best_rows = rows;
    }
    return best_rows > 0 ? (int)best_rows : chunk_e; /* none fits: chunk_e is below 128 rows (or n is 0) */
}

extern "C" int tkd_kl_cuda_chunk_for(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p, int grad,
                                     int64_t n)
{
    if (!(grad ? tkd_kl_cuda_fused_grad_on(ws, p) : tkd_kl_cuda_fused_on(ws, p)))
        return ws->chunk;
    /* Balanced: as many chunks as chunk_e rows need, of equal size (a multiple of 128 rows) — a
     * short last chunk runs its dH GEMM on fewer tiles than the GPU has SMs. */
    const int64_t chunks = n > 0 ? (n + ws->chunk_e - 1) / ws->chunk_e : 1;
    if (grad && (ws->grad_sm90 & TKD_KL_GRAD_DH)) /* sms is set wherever the fused path runs */
        return tkd_kl_cuda_dh_chunk_rows(n, ws->chunk_e, chunks, ws->d, ws->sms);
    int64_t rows = ((n + chunks - 1) / chunks + 127) / 128 * 128;
    return (int)(rows < ws->chunk_e ? rows : ws->chunk_e);
}

static tkd_status mark(tkd_kl_cuda_mark_fn fn, void *ctx, int stage)
{
    return fn ? fn(ctx, stage) : TKD_OK;
}

/* The special-column lists (and, gif, the reference logits) of chunk [row0, row0 + rows). */
static tkd_status fused_prep(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b,
                             int64_t row0, int rows, int want_ref)
{
    SpArgs a;
    a.k = p->k;
    a.k_use = p->k_use;
    a.s = p->variant == TKD_KL_VARIANT_SAMPLED ? p->s : 0;
    a.topk_idx = a.k_use > 0 ? b->topk_idx + row0 * p->k : NULL;
    a.tail_idx = a.s > 0 ? b->tail_idx + row0 * a.s : NULL;
    a.labels = b->labels + row0;
    a.ignore_index = p->ignore_index;
    a.v = b->v;
    a.tiles = tkd_lmhead_sm90_vtiles(b->v);
    a.sp_l = ws->sp_l;
    a.d = b->d;
    a.list = reinterpret_cast<int2 *>(ws->sp_list);
    a.off = ws->sp_off;
    a.g = ws->sp_g;
    a.ref = want_ref ? ws->ref : NULL;
    a.h = b->h + row0 * b->d;
    a.w = b->w;
    /* 8 rows (warps) per block where their lists fit 64 KB of shared memory, fewer for long lists */
    const size_t per_warp = 2 * (size_t)ws->sp_l * sizeof(int2);
    int warps = (int)(64 * 1024 / per_warp);
    warps = warps < 1 ? 1 : warps > 8 ? 8 : warps;
    const size_t smem = per_warp * warps;
    if (smem > 48 * 1024)
        TKD_CUDA_CHECK(cudaFuncSetAttribute(sp_prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem));
    sp_prep_kernel<<<(rows + warps - 1) / warps, 32 * warps, smem>>>(a, rows);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

static unsigned grid_for(long long n)
{
    long long g = (n + 255) / 256;
    return (unsigned)(g < 4096 ? g : 4096);
}

/* One chunk on the fused path: lists, the GEMM with its epilogue (statistics and gather; in the
 * gradient modes E), the LSE combine (forward), the row kernel (losses; sigma and the special
 * positions of dS), then dH = sigma·(E W) and dW += Eᵀ (sigma·H). */
static tkd_status fused_chunk(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                              const tkd_kl_cuda_batch *b, int mode, int64_t row0, int rows,
                              float grad_scale, float *dh, float *dw, tkd_kl_cuda_mark_fn mk,
                              void *mk_ctx)
{
    const int grad = mode != kModeStats, stats = mode != kModeGrad;
    const int k_one = p->alpha == 0.0f;
    const float tau = p->temperature;
    TKD_TRY(mark(mk, mk_ctx, 0));
    TKD_TRY(fused_prep(ws, p, b, row0, rows, grad && stats));
    tkd_lmhead_sm90_fused f;
    memset(&f, 0, sizeof f);
    f.tau = tau;
    f.part = stats ? ws->lm_part : NULL;
    f.sp_off = ws->sp_off;
    f.sp_list = ws->sp_list;
    f.sp_l = ws->sp_l;
    f.g = ws->sp_g;
    __nv_bfloat16 *e = reinterpret_cast<__nv_bfloat16 *>(ws->chunk_buf);
    if (grad) {
        f.e = reinterpret_cast<uint16_t *>(e);
        f.lde = ws->ldl;
        f.k_one = k_one;
        /* gif: E relative to the logit at the first special column; backward: to the LSE */
        f.ref = stats ? ws->ref : (k_one ? ws->lse_one : ws->lse_tau) + row0;
        f.ref_scale = stats ? tkd_lmhead_sm90_exp_scale(tau, k_one) : kLog2e;
    }
    const uint16_t *h = b->h + row0 * b->d;
    TKD_TRY(tkd_lmhead_sm90_fused_run(ws->lm, h, b->w, rows, b->d, b->v, &f));
    if (stats)
        TKD_TRY(tkd_lmhead_sm90_lse(ws->lm_part, rows, b->v, tau, ws->lse_one + row0,
                                    ws->lse_tau + row0));
    TKD_TRY(mark(mk, mk_ctx, 1));
    RowArgs a = row_args(ws, p, b, row0, grad_scale);
    a.lse_given = stats;
    a.g = ws->sp_g;
    a.ldg = ws->sp_l;
    if (grad) {
        a.e = e;
        a.lde = ws->ldl;
        a.ref = f.ref;
        a.ref_scale = f.ref_scale;
        a.l2e_k = tkd_lmhead_sm90_exp_scale(tau, k_one);
        a.k_one = k_one;
        a.sigma = ws->sigma;
        a.h = b->h;
        a.w = b->w;
        a.d = b->d;
    }
    TKD_TRY(ws->row_vec == 8 ? launch_rows_vec<8>(mode, rows, ws->row_threads, a)
                             : launch_rows_vec<4>(mode, rows, ws->row_threads, a));
    if (!grad)
        return TKD_OK;
    TKD_TRY(mark(mk, mk_ctx, 2));
    const long long nd = (long long)rows * b->d;
    const uint16_t *e16 = reinterpret_cast<const uint16_t *>(e);
    if (ws->grad_sm90 & TKD_KL_GRAD_DH) { /* sigma applied in the GEMM's epilogue */
        TKD_TRY(tkd_lmhead_grad_sm90_dh(ws->lm, e16, ws->ldl, b->w, rows, b->d, b->v, ws->sigma,
                                   dh + row0 * b->d));
    } else {
        TKD_TRY(gemm_dh(ws, b, row0, rows, e, ws->ldl, dh));
        scale_rows_kernel<<<grid_for(nd), 256>>>(dh + row0 * b->d, ws->sigma, rows, b->d);
        TKD_CUDA_CHECK(cudaGetLastError());
    }
    TKD_TRY(mark(mk, mk_ctx, 3));
    scale_h_kernel<<<grid_for(nd), 256>>>(reinterpret_cast<const __nv_bfloat16 *>(h), ws->sigma,
                                         rows, b->d, reinterpret_cast<__nv_bfloat16 *>(ws->hs));
    TKD_CUDA_CHECK(cudaGetLastError());
    const int accumulate = !(p->dw_overwrite && row0 == 0);
    if (ws->grad_sm90 & TKD_KL_GRAD_DW)
        return tkd_lmhead_grad_sm90_dw(ws->lm, e16, ws->ldl, ws->hs, rows, b->d, b->v, dw, accumulate);
    return gemm_dw(ws, b, ws->hs, rows, e, ws->ldl, dw, accumulate);
}

/* One chunk on the fp32-logits paths (sm90 GEMM or cuBLAS): logits, the row kernel (dS in place
 * in the gradient modes), dH and dW from that dS. */
static tkd_status logits_chunk(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                               const tkd_kl_cuda_batch *b, int mode, int64_t row0, int rows,
                               float grad_scale, float *dh, float *dw, tkd_kl_cuda_mark_fn mk,
                               void *mk_ctx)
{
    int given = 0;
    TKD_TRY(mark(mk, mk_ctx, 0));
    TKD_TRY(tkd_kl_cuda_chunk_logits_auto(ws, p, b, row0, rows, mode != kModeGrad, &given));
    TKD_TRY(mark(mk, mk_ctx, 1));
    TKD_TRY(tkd_kl_cuda_chunk_rows(ws, p, b, (tkd_kl_cuda_rows_mode)(mode | given), row0, rows,
                                   grad_scale));
    if (mode == kModeStats)
        return TKD_OK;
    TKD_TRY(mark(mk, mk_ctx, 2));
    TKD_TRY(tkd_kl_cuda_chunk_dh(ws, b, row0, rows, ws->chunk_buf, dh));
    TKD_TRY(mark(mk, mk_ctx, 3));
    return tkd_kl_cuda_chunk_dw(ws, b, row0, rows, ws->chunk_buf, dw, !(p->dw_overwrite && row0 == 0));
}

extern "C" tkd_status tkd_kl_cuda_run_chunk(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                            const tkd_kl_cuda_batch *b, tkd_kl_cuda_rows_mode mode,
                                            int64_t row0, int rows, float grad_scale, float *dh,
                                            float *dw, tkd_kl_cuda_mark_fn mk, void *mk_ctx)
{
    const int grad = mode != TKD_KL_CUDA_ROWS_STATS;
    const int fused = grad ? tkd_kl_cuda_fused_grad_on(ws, p) : tkd_kl_cuda_fused_on(ws, p);
    const int cap = fused ? ws->chunk_e : ws->chunk; /* the rows chunk_buf holds on this path */
    if (rows < 0 || rows > cap) /* callers cut with tkd_kl_cuda_chunk_for, which decides the same way */
        return tkd_error_set(TKD_ERR_INTERNAL, "kl_loss_cuda: a chunk of %d rows on the %s path, whose "
                             "buffer holds %d", rows, fused ? "fused" : "fp32-logits", cap);
    return fused ? fused_chunk(ws, p, b, (int)mode, row0, rows, grad_scale, dh, dw, mk, mk_ctx)
                 : logits_chunk(ws, p, b, (int)mode, row0, rows, grad_scale, dh, dw, mk, mk_ctx);
}

/* ---- forward / backward ---------------------------------------------------------------------- */

static const char *err_reason(unsigned bits)
{
    if (bits & kErrTopkRange) return "a teacher top-k index is outside [0, V)";
    if (bits & kErrTopkDup) return "a teacher top-k index repeats within the first k' columns";
    if (bits & kErrTeacherNonFinite) return "a teacher logit or log-sum-exp is not finite";
    if (bits & kErrLabelRange) return "a label is outside [0, V) and not ignore_index";
    if (bits & kErrTailRange) return "a tail draw is outside [0, V)";
    return "a tail draw repeats one of the row's top-k' tokens";
}

static tkd_status check_dev_out(const DevOut &o, const char *what)
{
    if (o.err_bits == 0)
        return TKD_OK;
    return tkd_error_set(TKD_ERR_FORMAT,
                         "kl_loss_cuda: %s: row %lld (first bad row): %s (error bits 0x%x); "
                         "check the teacher cache with tkd_kl_validate",
                         what, o.err_row, err_reason(o.err_bits), o.err_bits);
}

extern "C" tkd_status tkd_kl_cuda_forward(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                          const tkd_kl_cuda_batch *b, tkd_kl_result *res,
                                          float *dh, float *dw)
{
    TKD_TRY(tkd_kl_cuda_check_call(ws, p, b, p->grad_in_forward, dh, dw));
    const long long n = b->n;
    TKD_TRY(tkd_kl_cuda_count_kept(ws, p, b));
    const tkd_kl_cuda_rows_mode mode =
        p->grad_in_forward ? TKD_KL_CUDA_ROWS_STATS_GRAD : TKD_KL_CUDA_ROWS_STATS;
    const int chunk = tkd_kl_cuda_chunk_for(ws, p, p->grad_in_forward, n);
    for (long long row0 = 0; row0 < n; row0 += chunk) {
        int rows = (int)(n - row0 < chunk ? n - row0 : chunk);
        TKD_TRY(tkd_kl_cuda_run_chunk(ws, p, b, mode, row0, rows, p->grad_scale, dh, dw, NULL, NULL));
    }
    kl_reduce_kernel<<<1, 1024>>>(ws->row_stats, ws->row_stats + ws->n_max,
                                  ws->row_stats + 2 * ws->n_max, n, ws->out);
    TKD_CUDA_CHECK(cudaGetLastError());
    DevOut o;
    TKD_CUDA_CHECK(cudaMemcpy(&o, ws->out, sizeof o, cudaMemcpyDeviceToHost));
    ws->slow_rows = o.slow_rows;
    TKD_TRY(tkd_kl_cuda_sm90_check(ws));
    TKD_TRY(check_dev_out(o, "forward"));
    res->loss = o.loss;
    res->kd = o.kd;
    res->ce = o.ce;
    res->n_kept = o.n_kept;
    return TKD_OK;
}

extern "C" tkd_status tkd_kl_cuda_backward(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                           const tkd_kl_cuda_batch *b, float scale, float *dh,
                                           float *dw)
{
    if (p->grad_in_forward) { /* forward made the gradients, of grad_scale·loss (docs/loss.md) */
        if (scale != p->grad_scale)
            return tkd_error_set(TKD_ERR_INVALID_ARG,
                                 "kl_loss_cuda: grad_in_forward made the gradients with grad_scale "
                                 "%g; backward's scale %g must equal it",
                                 (double)p->grad_scale, (double)scale);
        return TKD_OK;
    }
    TKD_TRY(tkd_kl_cuda_check_call(ws, p, b, 1, dh, dw));
    const int chunk = tkd_kl_cuda_chunk_for(ws, p, 1, b->n);
    for (long long row0 = 0; row0 < b->n; row0 += chunk) {
        int rows = (int)(b->n - row0 < chunk ? b->n - row0 : chunk);
        TKD_TRY(tkd_kl_cuda_run_chunk(ws, p, b, TKD_KL_CUDA_ROWS_GRAD, row0, rows, scale, dh, dw,
                                      NULL, NULL));
    }
    DevOut o;
    TKD_CUDA_CHECK(cudaMemcpy(&o, ws->out, sizeof o, cudaMemcpyDeviceToHost));
    ws->slow_rows = o.slow_rows;
    TKD_TRY(tkd_kl_cuda_sm90_check(ws));
    return check_dev_out(o, "backward");
}

/* ---- batch upload ---------------------------------------------------------------------------- */

/* Host fp32 -> device bf16 (n values). */
static tkd_status upload_bf16(const uint16_t **out, const float *src, size_t n)
{
    uint16_t *tmp = (uint16_t *)malloc(n * sizeof *tmp + 1);
    if (!tmp)
        return tkd_error_set(TKD_ERR_NOMEM, "kl_loss_cuda: upload: %zu bf16 values", n);
    for (size_t i = 0; i < n; i++)
        tmp[i] = tkd_f32_to_bf16(src[i]);
    void *dev = NULL;
    tkd_status st = tkd_cuda_malloc(&dev, n * sizeof *tmp, "kl_loss_cuda: batch upload", NULL);
    if (st == TKD_OK)
        st = tkd_cuda_to_device(dev, tmp, n * sizeof *tmp);
    free(tmp);
    *out = (const uint16_t *)dev;
    return st;
}

template <typename T>
static tkd_status upload_raw(const T **out, const T *src, size_t n)
{
    void *dev = NULL;
    TKD_TRY(tkd_cuda_malloc(&dev, n * sizeof(T), "kl_loss_cuda: batch upload", NULL));
    *out = (const T *)dev;
    return tkd_cuda_to_device(dev, src, n * sizeof(T));
}

static tkd_status batch_upload(tkd_kl_cuda_batch *o, const tkd_kl_params *p,
                               const tkd_kl_batch *hb)
{
    size_t n = (size_t)hb->n;
    TKD_TRY(upload_bf16(&o->h, hb->h, n * hb->d));
    TKD_TRY(upload_bf16(&o->w, hb->w, (size_t)hb->v * hb->d));
    TKD_TRY(upload_raw(&o->topk_idx, hb->topk_idx, n * p->k));
    TKD_TRY(upload_raw(&o->topk_logit, hb->topk_logit, n * p->k));
    TKD_TRY(upload_raw(&o->teacher_lse, hb->teacher_lse, n));
    TKD_TRY(upload_raw(&o->labels, hb->labels, n));
    if (hb->tail_idx && p->s > 0)
        TKD_TRY(upload_raw(&o->tail_idx, hb->tail_idx, n * p->s));
    return TKD_OK;
}

extern "C" tkd_status tkd_kl_cuda_batch_upload(tkd_kl_cuda_batch *out, const tkd_kl_params *p,
                                               const tkd_kl_batch *hb)
{
    memset(out, 0, sizeof *out);
    out->n = hb->n;
    out->d = hb->d;
    out->v = hb->v;
    tkd_status st = batch_upload(out, p, hb);
    if (st != TKD_OK)
        tkd_kl_cuda_batch_free(out);
    return st;
}

extern "C" void tkd_kl_cuda_batch_free(tkd_kl_cuda_batch *b)
{
    if (!b)
        return;
    tkd_cuda_free((void *)b->h);
    tkd_cuda_free((void *)b->w);
    tkd_cuda_free((void *)b->topk_idx);
    tkd_cuda_free((void *)b->topk_logit);
    tkd_cuda_free((void *)b->teacher_lse);
    tkd_cuda_free((void *)b->tail_idx);
    tkd_cuda_free((void *)b->labels);
    memset(b, 0, sizeof *b);
}
