/* kl_loss_cuda_rows.cuh — what the fused KL loss's three CUDA files share, and nothing else includes:
 * kl_loss_cuda.cu (the workspace, the per-chunk GEMM stages, forward / backward), kl_loss_cuda_rows.cu
 * (the row kernel: statistics, per-row loss, dS in place) and kl_loss_cuda_fused.cu (the fused path:
 * the special columns, the GEMM with the loss epilogue, sigma and the scaled dH / dW), kl_loss_cuda_dense.cu
 * (the teacher online: its own row kernel beside the teacher's logits chunk), and the tuning
 * hooks' kl_loss_cuda_tuning.cu (the row shapes it may set). Kernels stay
 * static in their files; these are the launchers and the argument blocks they take.
 */
#ifndef TKD_KL_LOSS_CUDA_ROWS_CUH
#define TKD_KL_LOSS_CUDA_ROWS_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/loss/kl_loss.h"
#include "kernels/loss/kl_loss_cuda_internal.h"

/* Written by the count, row and reduce kernels; read back once per call. */
struct tkd_kl_cuda_dev_out {
    double loss, kd, ce;
    long long n_kept;
    long long err_row; /* first bad row, LLONG_MAX when none */
    unsigned int err_bits;
    float inv_n_kept;  /* 1 / n_kept (0 when no row is kept) */
    unsigned long long slow_rows; /* fused path: rows whose E was made again (row_exp_remake) */
};

namespace tkd_klc {

typedef tkd_kl_cuda_dev_out DevOut;

/* The (threads, vec) pairs the kernels are built for (their __launch_bounds__). */
constexpr bool row_shape_ok(int threads, int vec)
{
    return (vec == 4 && (threads == 128 || threads == 256 || threads == 512)) ||
           (vec == 8 && (threads == 128 || threads == 256));
}
static_assert(row_shape_ok(TKD_KL_CUDA_ROW_THREADS, TKD_KL_CUDA_ROW_VEC),
              "the product's row shape must be one the row kernels are built for");
constexpr float kLog2e = 1.4426950408889634f;

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
    /* kd.divergence other than fkl (tkd_kl_div_on; else 0 and fkl's own code runs): div_kind is
     * tkd_kl_div_kind's, with kd.jsd_beta and kd.skew_alpha */
    int div_on, div_kind;
    float jsd_beta, skew_alpha;
};


/* The row kernel's arguments for chunk [row0, ...) of batch b: the fp32 paths' fields; the fused
 * path fills its own on top (kl_loss_cuda_rows.cu). */
RowArgs row_args(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b, long long row0,
                 float grad_scale);

/* The row kernel over `rows` rows in mode (a RowMode), ws->row_vec / ws->row_threads's shape. */
tkd_status launch_rows(const tkd_kl_cuda_ws *ws, int mode, int rows, const RowArgs &a);

/* cuBLAS's dH_c (rows, D) fp32 = dS · W and dW (V, D) fp32 (+)= dSᵀ · x, dS bf16 with leading
 * dimension ld (kl_loss_cuda.cu). */
tkd_status gemm_dh(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int64_t row0, int rows, const void *ds,
                   long long ld, float *dh);
tkd_status gemm_dw(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, const uint16_t *x, int rows, const void *ds,
                   long long ld, float *dw, int accumulate);

/* One chunk on the fused path (kl_loss_cuda_fused.cu); arguments as tkd_kl_cuda_run_chunk's. */
tkd_status fused_chunk(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b, int mode,
                       int64_t row0, int rows, float grad_scale, float *dh, float *dw, tkd_kl_cuda_mark_fn mk,
                       void *mk_ctx);

/* One chunk of the dense mode (kl_loss_cuda_dense.cu: the teacher online, tkd_kl_params.dense);
 * arguments as tkd_kl_cuda_run_chunk's. */
tkd_status dense_chunk(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b, int mode,
                       int64_t row0, int rows, float grad_scale, float *dh, float *dw, tkd_kl_cuda_mark_fn mk,
                       void *mk_ctx);

/* The sum over a warp's 32 lanes, in every lane (the row kernel's and the count kernel's reductions). */
__device__ inline double warp_sum(double x)
{
    for (int off = 16; off > 0; off >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

/* h · w over d (even) bf16 values, fp32 sums in a fixed order, on every lane of the warp (the
 * fused path's reference logit and the row kernel's slow path: the same sum, so the same bits). */
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

/* A timing mark between a chunk's stages, when the caller asked for them. */
inline tkd_status mark(tkd_kl_cuda_mark_fn fn, void *ctx, int stage)
{
    return fn ? fn(ctx, stage) : TKD_OK;
}

/* A chunk's gradient GEMMs from the dS the row kernel left in ws->chunk_buf (marks 2 and 3): dH
 * over the chunk's rows, dW added (written by the first chunk with dw_overwrite). Every chunk
 * path that makes dS in the chunk buffer ends with it. */
inline tkd_status chunk_grads(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b, int64_t row0,
                              int rows, float *dh, float *dw, tkd_kl_cuda_mark_fn mk, void *mk_ctx)
{
    TKD_TRY(mark(mk, mk_ctx, 2));
    TKD_TRY(tkd_kl_cuda_chunk_dh(ws, b, row0, rows, ws->chunk_buf, dh));
    TKD_TRY(mark(mk, mk_ctx, 3));
    return tkd_kl_cuda_chunk_dw(ws, b, row0, rows, ws->chunk_buf, dw, !(p->dw_overwrite && row0 == 0));
}

} // namespace tkd_klc

#endif /* TKD_KL_LOSS_CUDA_ROWS_CUH */
