/* kl_loss_cuda_dense.cu — the CUDA KL loss's dense mode (tkd_kl_params.dense, kd.teacher: the
 * teacher online, its full distribution the target; docs/loss.md, "The teacher online"). The CPU
 * path's arithmetic (kl_loss_cpu.c: renorm over every token, k = V) on the device, chunk by chunk:
 *
 *   Zs = H_c Wᵀ (C, V) and Zt = Ht_c Wtᵀ (C, V): cuBLAS, bf16 in, fp32 out, into the workspace's
 *   chunk buffer and its teacher twin (never N × V); then one block per row:
 *     pass 1 (forward) — online, one read of both rows: LSE(zt/τ), LSE(zs/τ), LSE(zs) and, for
 *       forward KL, Σ p_v·(zt_v − zs_v)/τ (rescaled with the teacher's running max), so that
 *       KL = Σ p (zt − zs)/τ − LSE(zt/τ) + LSE(zs/τ) needs no second pass;
 *     pass 2 (forward, another kd.divergence) — the buckets p_v = softmax(zt/τ)_v and
 *       q_v = softmax(zs/τ)_v, their terms F and c·∂F/∂c from kl_divergence.h in float64 (the CPU's
 *       text), summed in float64: D and gbar = Σ cg;
 *     pass 3 (gradient modes) — ∂(scale·loss)/∂zs_v in place as bf16 over the row (dS (C, 2·ldl),
 *       as the cached path's row kernel writes it): forward KL a·(q_v − p_v), another divergence
 *       a·(cg_v − q_v·gbar) (kl_divergence.h's header), plus b·(q¹_v − [v = y]); a = g·α·τ,
 *       b = g·(1 − α), g = scale / n_kept (0 on a masked row, which is written as zeros);
 *   then dH_c = dS W and dW (+)= dSᵀ H_c (cuBLAS, as the cached path).
 * dS is bf16 for the same reasons as the cached path: the gradient GEMMs run bf16 tensor cores with
 * W and H in bf16 already, and the in-place rewrite needs no buffer of its own (fp32 dS would need a
 * third chunk buffer or TF32 GEMMs, for a rounding that dH's bf16 operands already have).
 *
 * Recompute's backward makes Zs and Zt again and reads the row statistics forward kept (float64,
 * ws->dense_stats); grad_in_forward runs passes 1, (2,) 3 on one GEMM pair. Row statistics' sums are
 * fp32 per thread (2^x on the special-function unit, as the row kernel), combined in float64.
 * Nothing synchronises with the host here; a label outside [0, V) or a non-finite teacher logit
 * is reported through DevOut as the cached path's errors are.
 */
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_fast_math.cuh"
#include "kernels/loss/kl_divergence.h"
#include "kernels/loss/kl_loss.h"
#include "kernels/loss/kl_loss_cuda_internal.h"
#include "kernels/loss/kl_loss_cuda_rows.cuh"

namespace tkd_klc {
namespace {

using tkd_cuda::fast_exp2;

/* One row per block, 512 threads (2 blocks per SM), each with two float4 of each row in flight:
 * the row kernel's shape (kl_loss_cuda_internal.h), the two rows read side by side. */
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 2;

/* What the dense row kernel needs; per-row arrays already offset to the chunk. */
struct DenseArgs {
    float *zs;          /* (rows, ldl) student logits; rewritten as bf16 dS (rows, 2·ldl) in grad modes */
    const float *zt;    /* (rows, ldl) teacher logits */
    long long ldl, row0;
    int v, ignore_index;
    float tau, alpha, grad_scale;
    int div_kind;       /* tkd_kl_div_kind (the DIV kernels only) */
    double beta, skew;  /* kd.jsd_beta, kd.skew_alpha */
    const int32_t *labels;              /* (rows) */
    double *lse_t, *lse_s, *lse_1, *gbar; /* (rows) kept by forward, read by kModeGrad */
    double *row_loss, *row_kd, *row_ce;   /* (rows) written by the stats modes */
    DevOut *out;
};

/* Per-row values shared by the block. */
struct DenseShared {
    double lse_t, lse_s, lse_1, gbar, kl_b; /* kl_b: Σ p (zt − zs)/τ (forward KL's pass 1) */
    float s_label;
    int label, live;
    double red[3][kWarps];
    float rf[6][kWarps];
};

/* ---- pass 1: online statistics of both rows ------------------------------------------------- */

/* Running state of one thread: the teacher's max mt, at = Σ exp((zt − mt)/τ) and
 * bt = Σ exp((zt − mt)/τ)·(zt − zs)/τ; the student's max ms, a1 = Σ exp(zs − ms) and
 * as = Σ exp((zs − ms)/τ). The max of x/τ is max(x)/τ (τ > 0). */
struct Online {
    float mt, at, bt, ms, a1, as;
};

/* x·2^((m_old − m)·k): a sum taken around m_old, moved to m ≥ m_old (0 while m_old is −inf). */
__device__ inline float rescale(float x, float m_old, float m, float k)
{
    return x * fast_exp2((m_old - m) * k);
}

__device__ inline float max4(float4 x) { return fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)); }

/* Adds the first n ≤ 4 of four columns (the others, ≥ V, are −inf in both rows). kt = log2 e/τ,
 * itau = 1/τ. */
__device__ inline void online_add4(Online &o, float4 s, float4 t, int n, float kt, float itau, bool same_tau)
{
    const float mt = fmaxf(o.mt, max4(t)), ms = fmaxf(o.ms, max4(s));
    if (mt > o.mt) {
        o.at = rescale(o.at, o.mt, mt, kt);
        o.bt = rescale(o.bt, o.mt, mt, kt);
        o.mt = mt;
    }
    if (ms > o.ms) {
        o.a1 = rescale(o.a1, o.ms, ms, kLog2e);
        o.as = rescale(o.as, o.ms, ms, kt);
        o.ms = ms;
    }
    const float sv[4] = {s.x, s.y, s.z, s.w}, tv[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if (j >= n)
            break;
        const float e = fast_exp2((tv[j] - o.mt) * kt);
        o.at += e;
        o.bt = fmaf(e, (tv[j] - sv[j]) * itau, o.bt);
        const float e1 = fast_exp2((sv[j] - o.ms) * kLog2e);
        o.a1 += e1;
        o.as += same_tau ? e1 : fast_exp2((sv[j] - o.ms) * kt);
    }
}

__device__ inline Online online_merge(Online x, const Online &y, float kt)
{
    const float mt = fmaxf(x.mt, y.mt), ms = fmaxf(x.ms, y.ms);
    if (mt > -INFINITY) {
        x.at = rescale(x.at, x.mt, mt, kt) + rescale(y.at, y.mt, mt, kt);
        x.bt = rescale(x.bt, x.mt, mt, kt) + rescale(y.bt, y.mt, mt, kt);
        x.mt = mt;
    }
    if (ms > -INFINITY) {
        x.a1 = rescale(x.a1, x.ms, ms, kLog2e) + rescale(y.a1, y.ms, ms, kLog2e);
        x.as = rescale(x.as, x.ms, ms, kt) + rescale(y.as, y.ms, ms, kt);
        x.ms = ms;
    }
    return x;
}

__device__ inline float4 load4_masked(const float *row, int e, int v)
{
    float4 x = *reinterpret_cast<const float4 *>(row + e);
    if (e + 1 >= v) x.y = -INFINITY;
    if (e + 2 >= v) x.z = -INFINITY;
    if (e + 3 >= v) x.w = -INFINITY;
    return x;
}

__device__ inline Online online_shfl(const Online &o, int off)
{
    return Online{__shfl_xor_sync(0xffffffffu, o.mt, off), __shfl_xor_sync(0xffffffffu, o.at, off),
                  __shfl_xor_sync(0xffffffffu, o.bt, off), __shfl_xor_sync(0xffffffffu, o.ms, off),
                  __shfl_xor_sync(0xffffffffu, o.a1, off), __shfl_xor_sync(0xffffffffu, o.as, off)};
}

/* Pass 1 over the row: sh.lse_t = LSE(zt/τ), sh.lse_s = LSE(zs·(1/τ)_fp32) (the CPU's student
 * 1/τ), sh.lse_1 = LSE(zs), sh.kl_b = Σ p (zt − zs)/τ; the block's partial sums combine in
 * float64. */
__device__ void dense_stats(const DenseArgs &a, const float *zs, const float *zt, DenseShared &sh)
{
    const float itau = 1.0f / a.tau, kt = kLog2e * itau;
    const bool same_tau = a.tau == 1.0f;
    Online o = {-INFINITY, 0.0f, 0.0f, -INFINITY, 0.0f, 0.0f};
    const int nt = blockDim.x;
    for (int base = 0; base < a.v; base += kVec * 4 * nt) {
        float4 xs[kVec], xt[kVec];
#pragma unroll
        for (int j = 0; j < kVec; j++) { /* every load first */
            const int e = base + j * 4 * nt + threadIdx.x * 4;
            if (e < a.v) {
                xs[j] = load4_masked(zs, e, a.v);
                xt[j] = load4_masked(zt, e, a.v);
            }
        }
#pragma unroll
        for (int j = 0; j < kVec; j++) {
            const int e = base + j * 4 * nt + threadIdx.x * 4;
            if (e < a.v)
                online_add4(o, xs[j], xt[j], a.v - e, kt, itau, same_tau);
        }
    }
    for (int off = 16; off > 0; off >>= 1)
        o = online_merge(o, online_shfl(o, off), kt);
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
        const float f[6] = {o.mt, o.at, o.bt, o.ms, o.a1, o.as};
        for (int i = 0; i < 6; i++)
            sh.rf[i][warp] = f[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        /* warp partials around the row's maxima, in float64; a warp that saw no column has max
         * −inf and adds nothing (a NaN sum of a non-finite teacher row passes through) */
        float mt = -INFINITY, ms = -INFINITY;
        for (int w = 0; w < nt / 32; w++)
            mt = fmaxf(mt, sh.rf[0][w]), ms = fmaxf(ms, sh.rf[3][w]);
        const double itd = (double)itau;
        double at = 0.0, bt = 0.0, a1 = 0.0, as = 0.0;
        for (int w = 0; w < nt / 32; w++) {
            if (sh.rf[0][w] > -INFINITY) {
                const double ft = exp(((double)sh.rf[0][w] - mt) * itd);
                at += ft * sh.rf[1][w];
                bt += ft * sh.rf[2][w];
            }
            if (sh.rf[3][w] > -INFINITY) {
                a1 += exp((double)sh.rf[3][w] - ms) * sh.rf[4][w];
                as += exp(((double)sh.rf[3][w] - ms) * itd) * sh.rf[5][w];
            }
        }
        sh.lse_t = mt * (1.0 / (double)a.tau) + log(at);
        sh.lse_s = ms * itd + log(as);
        sh.lse_1 = ms + log(a1);
        sh.kl_b = bt / at;
    }
    __syncthreads();
}

/* ---- passes 2 and 3: the divergence's terms and the gradient --------------------------------- */

/* A row's coefficients for the element functions. */
struct DenseCoef {
    float kt, bt;   /* p_v = 2^(zt·kt − bt) */
    float ks, bs;   /* q_v = 2^(zs·ks − bs) */
    float bs1;      /* q¹_v = 2^(zs·log2 e − bs1) */
    float ca, cb;   /* a = g·α·τ, b = g·(1 − α) (fp32, forward KL's dense form) */
    double da;      /* a in float64 (a divergence's exact form) */
    double itt, its, lse_t, lse_s, gbar; /* a divergence's buckets, as the CPU forms them */
    int label;
    bool same_tau;
};

__device__ inline DenseCoef dense_coef(const DenseArgs &a, const DenseShared &sh, double g)
{
    DenseCoef c;
    const float itau = 1.0f / a.tau;
    c.kt = kLog2e * itau;
    c.bt = (float)(sh.lse_t * (double)kLog2e);
    c.ks = c.kt;
    c.bs = (float)(sh.lse_s * (double)kLog2e);
    c.bs1 = (float)(sh.lse_1 * (double)kLog2e);
    c.da = g * a.alpha * a.tau;
    c.ca = (float)c.da;
    c.cb = (float)(g * (1.0 - a.alpha));
    c.itt = 1.0 / (double)a.tau; /* the teacher's 1/τ in double, the student's fp32's (kl_loss_cpu.c) */
    c.its = (double)itau;
    c.lse_t = sh.lse_t;
    c.lse_s = sh.lse_s;
    c.gbar = sh.gbar;
    c.label = sh.label;
    c.same_tau = a.tau == 1.0f;
    return c;
}

/* Column v's bucket term F(p_v, q_v) and *cg = q_v·∂F/∂q_v, *q = q_v (float64, kl_divergence.h).
 * Out of line: its float64 exps and logs need more registers than the sweep's 64. */
__device__ __noinline__ double div_elem(int kind, double beta, double skew, double la, double lc, double *cg,
                                        double *q)
{
    const tkd_kl_div_bucket k = tkd_kl_div_bucket_of_logs(la, lc);
    *q = k.c;
    return tkd_kl_div_term(kind, beta, skew, k, cg);
}

/* CE's part of column v's gradient: b·(q¹_v − [v = y]). */
__device__ inline float ce_grad(const DenseCoef &c, float s, float q, int v)
{
    const float q1 = c.same_tau ? q : fast_exp2(fmaf(s, kLog2e, -c.bs1));
    return c.cb * (q1 - (v == c.label ? 1.0f : 0.0f));
}

/* Column v's gradient: forward KL a·(q − p), another divergence a·(cg − q·gbar); plus CE's. */
template <bool DIV>
__device__ inline float grad_elem(const DenseArgs &a, const DenseCoef &c, float s, float t, int v)
{
    const float q = fast_exp2(fmaf(s, c.ks, -c.bs));
    float g;
    if (DIV) {
        double cg, qd;
        div_elem(a.div_kind, a.beta, a.skew, t * c.itt - c.lse_t, s * c.its - c.lse_s, &cg, &qd);
        g = (float)(c.da * (cg - qd * c.gbar));
    } else {
        g = c.ca * (q - fast_exp2(fmaf(t, c.kt, -c.bt)));
    }
    return g + ce_grad(c, s, q, v);
}

__device__ inline uint2 pack4_bf16(const float g[4])
{
    __nv_bfloat162 lo = __floats2bfloat162_rn(g[0], g[1]), hi = __floats2bfloat162_rn(g[2], g[3]);
    uint2 u;
    u.x = *reinterpret_cast<unsigned int *>(&lo);
    u.y = *reinterpret_cast<unsigned int *>(&hi);
    return u;
}

/* A thread's kVec float4 loads of both rows at tile base (every load issued before any is used),
 * none where skip or past v (rows start 16-byte aligned and are padded to whole float4s). */
__device__ __forceinline__ void load_tiles(const float *zs, const float *zt, int base, int v, bool skip,
                                           float4 xs[kVec], float4 xt[kVec])
{
#pragma unroll
    for (int j = 0; j < kVec; j++) {
        const int e = base + j * 4 * blockDim.x + threadIdx.x * 4;
        if (e < v && !skip) {
            xs[j] = *reinterpret_cast<const float4 *>(zs + e);
            xt[j] = *reinterpret_cast<const float4 *>(zt + e);
        }
    }
}

/* Pass 2 (a divergence other than forward KL): this thread's share of D and gbar over the row. */
__device__ void div_sums(const DenseArgs &a, const float *zs, const float *zt, const DenseCoef &c, double *d,
                         double *gb)
{
    double sd = 0.0, sg = 0.0;
    const int nt = blockDim.x;
    for (int base = 0; base < a.v; base += kVec * 4 * nt) {
        float4 xs[kVec], xt[kVec];
        load_tiles(zs, zt, base, a.v, false, xs, xt);
        for (int j = 0; j < kVec; j++) {
            const int e = base + j * 4 * nt + threadIdx.x * 4;
            const float sv[4] = {xs[j].x, xs[j].y, xs[j].z, xs[j].w}, tv[4] = {xt[j].x, xt[j].y, xt[j].z, xt[j].w};
            for (int q = 0; q < 4 && e + q < a.v; q++) {
                double cg, qd;
                sd += div_elem(a.div_kind, a.beta, a.skew, tv[q] * c.itt - c.lse_t, sv[q] * c.its - c.lse_s, &cg,
                               &qd);
                sg += cg;
            }
        }
    }
    *d = sd;
    *gb = sg;
}

/* Pass 3: the row's gradient over zs in place as bf16 (zeros when zero). Each tile's fp32 values
 * are read before the barrier and its bf16 values written after it: bf16 elements [Tt, T(t+1))
 * overlay fp32 elements [Tt/2, T(t+1)/2), read already (kl_loss_cuda_rows.cu's layout note). */
template <bool DIV>
__device__ void grad_sweep(const DenseArgs &a, float *zs, const float *zt, const DenseCoef &c, bool zero)
{
    __nv_bfloat16 *ds = reinterpret_cast<__nv_bfloat16 *>(zs);
    const int nt = blockDim.x;
    for (int base = 0; base < a.v; base += kVec * 4 * nt) {
        float4 xs[kVec], xt[kVec];
        load_tiles(zs, zt, base, a.v, zero, xs, xt);
        __syncthreads();
#pragma unroll
        for (int j = 0; j < kVec; j++) {
            const int e = base + j * 4 * nt + threadIdx.x * 4;
            if (e >= a.v)
                continue;
            const float sv[4] = {xs[j].x, xs[j].y, xs[j].z, xs[j].w}, tv[4] = {xt[j].x, xt[j].y, xt[j].z, xt[j].w};
            float g[4];
#pragma unroll
            for (int q = 0; q < 4; q++)
                g[q] = zero || e + q >= a.v ? 0.0f : grad_elem<DIV>(a, c, sv[q], tv[q], e + q);
            *reinterpret_cast<uint2 *>(ds + e) = pack4_bf16(g);
        }
    }
}

/* The block's sums of n ≤ 3 doubles per thread, on thread 0. */
__device__ void block_sum(double *x, int n, DenseShared &sh)
{
    const int warp = threadIdx.x / 32;
    for (int i = 0; i < n; i++) {
        const double s = warp_sum(x[i]);
        if (threadIdx.x % 32 == 0)
            sh.red[i][warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int i = 0; i < n; i++) {
            x[i] = 0.0;
            for (int w = 0; w < (int)blockDim.x / 32; w++)
                x[i] += sh.red[i][w];
        }
}

/* The row's label and whether it is trained on; the student's logit at the label, read before any
 * thread rewrites the row. */
__device__ void row_label(const DenseArgs &a, long long r, const float *zs, DenseShared &sh)
{
    if (threadIdx.x == 0) {
        const int y = a.labels[r];
        const bool kept = y != a.ignore_index, in = y >= 0 && y < a.v;
        if (kept && !in) {
            atomicOr(&a.out->err_bits, (unsigned)kErrLabelRange);
            atomicMin(&a.out->err_row, a.row0 + r);
        }
        sh.label = y;
        sh.live = kept && in;
        sh.s_label = sh.live ? zs[y] : 0.0f;
    }
    __syncthreads();
}

/* Forward's statistics and loss of a live row (passes 1 and 2); thread 0 writes the row's loss,
 * KD, CE and the statistics backward reads. A non-finite teacher makes the row an error. */
template <bool DIV>
__device__ void row_forward(const DenseArgs &a, long long r, const float *zs, const float *zt, DenseShared &sh)
{
    dense_stats(a, zs, zt, sh);
    /* an infinite teacher logit makes LSE_t (+inf) or Σ p (zt − zs) (−inf: 0·inf) NaN */
    if (threadIdx.x == 0 && !(isfinite(sh.lse_t) && isfinite(sh.kl_b))) {
        atomicOr(&a.out->err_bits, (unsigned)kErrTeacherNonFinite);
        atomicMin(&a.out->err_row, a.row0 + r);
        sh.live = 0;
    }
    __syncthreads();
    if (!sh.live)
        return;
    double x[2] = {0.0, 0.0}, d;
    if (DIV) {
        const DenseCoef c = dense_coef(a, sh, 0.0);
        div_sums(a, zs, zt, c, &x[0], &x[1]);
        block_sum(x, 2, sh);
        d = x[0];
    } else {
        d = sh.kl_b - sh.lse_t + sh.lse_s; /* KL = Σ p (lp − lq) = Σ p (zt − zs)/τ − LSE_t + LSE_s */
    }
    if (threadIdx.x == 0) {
        const double kd = (double)a.tau * a.tau * d, ce = sh.lse_1 - sh.s_label;
        a.row_kd[r] = kd;
        a.row_ce[r] = ce;
        a.row_loss[r] = a.alpha * kd + (1.0 - a.alpha) * ce;
        sh.gbar = DIV ? x[1] : -1.0;
        a.lse_t[r] = sh.lse_t;
        a.lse_s[r] = sh.lse_s;
        a.lse_1[r] = sh.lse_1;
        a.gbar[r] = sh.gbar;
    }
    __syncthreads();
}

/* One block per row of the chunk. MODE: kModeStats (passes 1, 2), kModeGrad (pass 3 on forward's
 * statistics), kModeStatsGrad (all); DIV: a divergence other than forward KL. */
template <int MODE, bool DIV>
__global__ void __launch_bounds__(kThreads, 2) kl_dense_kernel(DenseArgs a)
{
    __shared__ DenseShared sh;
    const long long r = blockIdx.x;
    float *zs = a.zs + r * a.ldl;
    const float *zt = a.zt + r * a.ldl;
    row_label(a, r, zs, sh);
    if (MODE != kModeGrad) {
        if (threadIdx.x == 0) /* a masked row's loss is 0 (the sums run over every row) */
            a.row_loss[r] = a.row_kd[r] = a.row_ce[r] = 0.0;
        if (sh.live)
            row_forward<DIV>(a, r, zs, zt, sh);
        if (MODE == kModeStats)
            return;
    } else if (threadIdx.x == 0 && sh.live) {
        sh.lse_t = a.lse_t[r];
        sh.lse_s = a.lse_s[r];
        sh.lse_1 = a.lse_1[r];
        sh.gbar = a.gbar[r];
    }
    __syncthreads();
    const bool zero = !sh.live;
    const double g = zero ? 0.0 : (double)a.grad_scale / (double)a.out->n_kept;
    grad_sweep<DIV>(a, zs, zt, dense_coef(a, sh, g), zero);
}

template <int MODE>
void launch_mode(bool div, int rows, const DenseArgs &a)
{
    if (div)
        kl_dense_kernel<MODE, true><<<rows, kThreads>>>(a);
    else
        kl_dense_kernel<MODE, false><<<rows, kThreads>>>(a);
}

DenseArgs dense_args(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b, long long row0,
                     float grad_scale)
{
    DenseArgs a = {};
    const long long n = ws->n_max;
    a.zs = ws->chunk_buf;
    a.zt = ws->tchunk_buf;
    a.ldl = ws->ldl;
    a.row0 = row0;
    a.v = b->v;
    a.ignore_index = p->ignore_index;
    a.tau = p->temperature;
    a.alpha = p->alpha;
    a.grad_scale = grad_scale;
    a.div_kind = tkd_kl_div_kind(p->divergence, p->jsd_beta, p->skew_alpha);
    a.beta = p->jsd_beta;
    a.skew = p->skew_alpha;
    a.labels = b->labels + row0;
    a.lse_t = ws->dense_stats + row0;
    a.lse_s = ws->dense_stats + n + row0;
    a.lse_1 = ws->dense_stats + 2 * n + row0;
    a.gbar = ws->dense_stats + 3 * n + row0;
    a.row_loss = ws->row_stats + row0;
    a.row_kd = ws->row_stats + n + row0;
    a.row_ce = ws->row_stats + 2 * n + row0;
    a.out = ws->out;
    return a;
}

} // namespace

} // namespace tkd_klc

using namespace tkd_klc;

/* cuBLAS column-major as tkd_kl_cuda_chunk_logits: (V × rows) = Wtᵀ_cm (V × Dt) · Ht_cm (Dt × rows). */
extern "C" tkd_status tkd_kl_cuda_chunk_teacher_logits(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b,
                                                       int64_t row0, int rows)
{
    const float one = 1.0f, zero = 0.0f;
    const int dt = b->teacher_d;
    TKD_CUBLAS_CHECK(cublasGemmEx(ws->blas, CUBLAS_OP_T, CUBLAS_OP_N, b->v, rows, dt, &one, b->teacher_w,
                                  CUDA_R_16BF, dt, b->teacher_h + row0 * dt, CUDA_R_16BF, dt, &zero,
                                  ws->tchunk_buf, CUDA_R_32F, (int)ws->ldl, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
    return TKD_OK;
}

namespace tkd_klc {

/* The dense row kernel over the chunk in ws's two buffers. */
static tkd_status dense_rows(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b, int mode,
                      int64_t row0, int rows, float grad_scale)
{
    if (rows == 0)
        return TKD_OK;
    const DenseArgs a = dense_args(ws, p, b, row0, grad_scale);
    const bool div = p->divergence != TKD_KL_DIVERGENCE_FKL; /* tkd_kl_div_on: k' = V ≥ 1 */
    if (mode == kModeStats)
        launch_mode<kModeStats>(div, rows, a);
    else if (mode == kModeGrad)
        launch_mode<kModeGrad>(div, rows, a);
    else
        launch_mode<kModeStatsGrad>(div, rows, a);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

tkd_status dense_chunk(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b, int mode,
                       int64_t row0, int rows, float grad_scale, float *dh, float *dw, tkd_kl_cuda_mark_fn mk,
                       void *mk_ctx)
{
    TKD_TRY(mark(mk, mk_ctx, 0));
    TKD_TRY(tkd_kl_cuda_chunk_logits(ws, b, row0, rows));
    TKD_TRY(tkd_kl_cuda_chunk_teacher_logits(ws, b, row0, rows));
    TKD_TRY(mark(mk, mk_ctx, 1));
    TKD_TRY(dense_rows(ws, p, b, mode, row0, rows, grad_scale));
    if (mode == kModeStats)
        return TKD_OK;
    return chunk_grads(ws, p, b, row0, rows, dh, dw, mk, mk_ctx);
}

} // namespace tkd_klc
