/* kl_loss_cuda.cu — see kl_loss_cuda.h. The workspace, the per-chunk stages (the logits GEMM, cuBLAS's
 * dH / dW) and forward / backward over the chunks; the row kernel is in kl_loss_cuda_rows.cu, the
 * fused path in kl_loss_cuda_fused.cu (what they share: kl_loss_cuda_rows.cuh; the workspace and the
 * stages, for bench/ and tests/: kl_loss_cuda_internal.h).
 *
 * The logits GEMM. On compute capability 9.0 (and D a multiple of 8, TKD_KL_SM90 not "0" when the
 * workspace was made) the chunk's logits come from our Hopper GEMM (kernels/gemm_sm90/lmhead_sm90.h), whose
 * epilogue reduces each row tile to (max, Σ exp at 1, Σ exp at 1/τ) partials; a small combine
 * turns them into the LSEs. On the fused path (kl_loss_cuda_fused.cu, docs/loss.md)
 * the epilogue also gathers each row's special columns and, in the gradient modes, writes the
 * bf16 tile E, so no logits are stored; elsewhere (two softmaxes in the gradient, TKD_KL_FUSED=0)
 * it writes the fp32 logits chunk that the row kernel gathers from and turns into dS. Forward and
 * backward use the same GEMM, so they see the same bits. `tail` keeps cuBLAS and the row kernel's
 * own pass: its log(1 − Q) is a sum outside the row's top-k' that the GEMM cannot know. cuBLAS +
 * the row kernel's pass are the fallback and the reference.
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

constexpr size_t kBlasWsBytes = 32u << 20; /* cuBLAS workspace we hand it, so it allocates none */

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

/* dH_c (rows, D) fp32 = dS (rows, V) · W; ds bf16 with leading dimension ld. */
tkd_status gemm_dh(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int64_t row0, int rows, const void *ds,
                   long long ld, float *dh)
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
tkd_status gemm_dw(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, const uint16_t *x, int rows, const void *ds,
                   long long ld, float *dw, int accumulate)
{
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    TKD_CUBLAS_CHECK(cublasGemmEx(ws->blas, CUBLAS_OP_N, CUBLAS_OP_T, b->d, b->v, rows, &one, x,
                                  CUDA_R_16BF, b->d, ds, CUDA_R_16BF, (int)ld, &beta, dw,
                                  CUDA_R_32F, b->d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return TKD_OK;
}

} // namespace tkd_klc

using namespace tkd_klc;

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

/* Dense mode (the teacher online, kl_loss_cuda_dense.cu): the teacher's logits chunk and the row
 * statistics backward reads. Its chunks run cuBLAS and the dense row kernel only, so the sm90
 * GEMM's buffers (sized by k + s, V + 1 slots per row here) are not made. */
static tkd_status dense_setup(tkd_kl_cuda_ws *ws)
{
    const char *hint = "lower kd.chunk_size (rows per chunk)";
    TKD_TRY(tkd_cuda_malloc((void **)&ws->tchunk_buf, (size_t)ws->chunk * ws->ldl * sizeof(float),
                            "teacher chunk buffer (fp32 logits)", hint));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->dense_stats, 4 * (size_t)ws->n_max * sizeof(double), "row statistics",
                            NULL));
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
    /* dense: two fp32 chunk buffers (the student's and the teacher's) share the one target */
    ws->chunk = p->chunk_rows > 0 ? p->chunk_rows : tkd_kl_cuda_default_chunk_rows(n_max, p->dense ? 2 * v : v);
    if (ws->chunk > n_max)
        ws->chunk = (int)n_max;
    ws->chunk_e = ws->chunk;
    ws->sp_l = p->k + p->s + 1;
    ws->row_threads = TKD_KL_CUDA_ROW_THREADS;
    ws->row_vec = TKD_KL_CUDA_ROW_VEC;
    const int chunk = ws->chunk;
    tkd_status st = ws_setup(ws);
    if (st == TKD_OK)
        st = p->dense ? dense_setup(ws) : sm90_setup(ws, pol ? pol : &defaults);
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
    tkd_cuda_ws_free(ws, [](tkd_kl_cuda_ws *w) {
        tkd_cuda_release(cublasDestroy, w->blas);
        tkd_cuda_free_all(w->chunk_buf, w->lse_tau, w->lse_one, w->log_omq, w->row_stats, w->out, w->blas_ws);
        tkd_lmhead_sm90_ws_free(w->lm);
        tkd_cuda_free_all(w->lm_part, w->sp_list, w->sp_off, w->sp_g, w->ref, w->sigma, w->hs);
        tkd_cuda_free_all(w->tchunk_buf, w->dense_stats);
    });
}

extern "C" int tkd_kl_cuda_ws_chunk_rows(const tkd_kl_cuda_ws *ws) { return ws->chunk; }

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

/* tkd_kl_cuda_check_call's checks of a dense call (the batch's shape is checked already). */
static tkd_status check_dense_call(const tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int need_grads,
                                   const float *dh, const float *dw)
{
    if (!ws->tchunk_buf)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss_cuda: a dense call (the teacher online) on a "
                             "workspace made without tkd_kl_params.dense; make it with dense set");
    if (!b->h || !b->w || !b->labels || !b->teacher_h || !b->teacher_w || b->teacher_d < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss_cuda: dense: the batch lacks h, w, labels or the "
                             "teacher's hidden states and LM head (teacher_d %d)", b->teacher_d);
    if (need_grads && (!dh || !dw))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "kl_loss_cuda: dh and dw are required here");
    return TKD_OK;
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
    if (p->dense)
        return check_dense_call(ws, b, need_grads, dh, dw);
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
    return chunk_grads(ws, p, b, row0, rows, dh, dw, mk, mk_ctx);
}

extern "C" tkd_status tkd_kl_cuda_run_chunk(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                            const tkd_kl_cuda_batch *b, tkd_kl_cuda_rows_mode mode,
                                            int64_t row0, int rows, float grad_scale, float *dh,
                                            float *dw, tkd_kl_cuda_mark_fn mk, void *mk_ctx)
{
    const int grad = mode != TKD_KL_CUDA_ROWS_STATS;
    if (p->dense) {
        if (rows < 0 || rows > ws->chunk)
            return tkd_error_set(TKD_ERR_INTERNAL, "kl_loss_cuda: a dense chunk of %d rows, whose buffers hold %d",
                                 rows, ws->chunk);
        return dense_chunk(ws, p, b, (int)mode, row0, rows, grad_scale, dh, dw, mk, mk_ctx);
    }
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

static tkd_status check_dev_out(const DevOut &o, const char *what, int dense)
{
    if (o.err_bits == 0)
        return TKD_OK;
    return tkd_error_set(TKD_ERR_FORMAT,
                         "kl_loss_cuda: %s: row %lld (first bad row): %s (error bits 0x%x); %s",
                         what, o.err_row, err_reason(o.err_bits), o.err_bits,
                         dense ? "the teacher online (dense): its logits overflowed, or a label lies outside the vocabulary"
                               : "check the teacher cache with tkd_kl_validate");
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
    TKD_TRY(check_dev_out(o, "forward", p->dense));
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
    return check_dev_out(o, "backward", p->dense);
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
    if (p->dense) { /* the teacher's hidden states and LM head instead of cache columns */
        o->teacher_d = hb->teacher_d;
        TKD_TRY(upload_bf16(&o->teacher_h, hb->teacher_h, n * hb->teacher_d));
        TKD_TRY(upload_bf16(&o->teacher_w, hb->teacher_w, (size_t)hb->v * hb->teacher_d));
        return upload_raw(&o->labels, hb->labels, n);
    }
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
    tkd_cuda_free((void *)b->teacher_h);
    tkd_cuda_free((void *)b->teacher_w);
    memset(b, 0, sizeof *b);
}

