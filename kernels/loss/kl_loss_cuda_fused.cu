/* kl_loss_cuda_fused.cu — the fused KL loss's fused path (kl_loss_cuda.h, docs/loss.md): where the
 * gradient is one softmax, our Hopper GEMM's epilogue (kernels/gemm_sm90/lmhead_sm90.h) gathers each row's
 * special columns (top-k', tail draws, label) and writes the bf16 tile E = exp of the scaled logits,
 * so no fp32 logits are stored; the row kernel turns the statistics into the row's loss and sigma,
 * and dH = sigma·(E W) (our dH GEMM or cuBLAS plus a scale), dW += Eᵀ (sigma·H).
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
#include "kernels/loss/kl_loss.h"
#include "kernels/loss/kl_loss_cuda_internal.h"
#include "kernels/loss/kl_loss_cuda_rows.cuh"
#include "kernels/gemm_sm90/lmhead_grad_sm90.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"

namespace tkd_klc {
namespace {

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

/* The special-column lists (and, gif, the reference logits) of chunk [row0, row0 + rows). */
tkd_status fused_prep(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b,
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

unsigned grid_for(long long n)
{
    long long g = (n + 255) / 256;
    return (unsigned)(g < 4096 ? g : 4096);
}

/* One chunk on the fused path: lists, the GEMM with its epilogue (statistics and gather; in the
 * gradient modes E), the LSE combine (forward), the row kernel (losses; sigma and the special
 * positions of dS), then dH = sigma·(E W) and dW += Eᵀ (sigma·H). */
} // namespace

tkd_status fused_chunk(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
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
    TKD_TRY(launch_rows(ws, mode, rows, a));
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

} // namespace tkd_klc

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
