/* backend_cuda_lmhead.cu — the CUDA backend's LM head with its top-k / tail-draw consumer (backend.h's
 * lmhead_topk): chunk by chunk, the logits GEMM (cuBLAS, or our sm90 GEMM's top-k epilogues under the
 * policy's topk_fused) then topk_cuda.h's top-k and tail_sample_cuda.h's draws, the results carried to
 * pinned staging on the copy stream while the next chunk computes. Split from backend_cuda.cu, whose
 * state it shares through backend_cuda_internal.h. */
#include "kernels/cuda/backend_cuda_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/signals.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/cuda/tail_sample_cuda.h"

namespace tkd_cub {
namespace {

tkd_status lmhead_scratch(CudaImpl *c, const tkd_lmhead_topk_args *a, int64_t C)
{
    const char *hint = "lower lm_head.chunk_rows or run.batch_size";
    size_t R = (size_t)a->rows;
    TKD_TRY(grow(&c->logits, (size_t)C * (size_t)a->v * sizeof(float), "lm_head: logits chunk", hint));
    TKD_TRY(grow(&c->idx, R * a->k * sizeof(uint32_t), "lm_head: top-k ids", hint));
    TKD_TRY(grow(&c->val, R * a->k * sizeof(float), "lm_head: top-k logits", hint));
    TKD_TRY(grow(&c->lse, R * sizeof(float), "lm_head: lse", hint));
    if (a->s > 0) {
        TKD_TRY(grow(&c->tail, R * a->s * sizeof(uint32_t), "lm_head: tail draws", hint));
        TKD_TRY(grow(&c->seq, R * sizeof(int64_t), "lm_head: row keys", hint));
        TKD_TRY(grow(&c->pos, R * sizeof(int32_t), "lm_head: row keys", hint));
        TKD_TRY(grow_host(&c->h_tail, R * a->s * sizeof(uint32_t), "lm_head: tail draws"));
    }
    TKD_TRY(grow_host(&c->h_idx, R * a->k * sizeof(uint32_t), "lm_head: top-k ids"));
    TKD_TRY(grow_host(&c->h_val, R * a->k * sizeof(float), "lm_head: top-k logits"));
    return grow_host(&c->h_lse, R * sizeof(float), "lm_head: lse");
}

/* logits (n, V) fp32 = H[r0 : r0 + n] (n, D) · Wᵀ; cuBLAS column-major: (V × n) = Wᵀ · Hᵀ. */
tkd_status lmhead_gemm(CudaImpl *c, const tkd_lmhead_topk_args *a, int64_t r0, int64_t n)
{
    const float one = 1.0f, zero = 0.0f;
    const uint16_t *h = static_cast<const uint16_t *>(a->hidden) + r0 * a->d;
    TKD_CUBLAS_CHECK(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)a->v, (int)n, a->d, &one, a->w,
                                  CUDA_R_16BF, a->d, h, CUDA_R_16BF, a->d, &zero, c->logits.p, CUDA_R_32F,
                                  (int)a->v, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return TKD_OK;
}

/* Rows [r0, r0 + n) of the results, device -> pinned staging on the copy stream once the compute
 * stream has made them: the copies of chunk c overlap the GEMM and top-k of chunk c + 1. */
tkd_status lmhead_copy_chunk(CudaImpl *c, const tkd_lmhead_topk_args *a, int64_t r0, int64_t n)
{
    TKD_CUDA_CHECK(cudaEventRecord(c->chunk_done, c->stream));
    TKD_CUDA_CHECK(cudaStreamWaitEvent(c->copy, c->chunk_done, 0));
    const size_t k = (size_t)a->k, s = (size_t)a->s;
    auto d2h = [&](GrowHost &h, const Grow &d, size_t per_row, size_t elem) -> cudaError_t {
        return cudaMemcpyAsync(static_cast<char *>(h.p) + r0 * per_row * elem,
                               static_cast<const char *>(d.p) + r0 * per_row * elem, n * per_row * elem,
                               cudaMemcpyDeviceToHost, c->copy);
    };
    TKD_CUDA_CHECK(d2h(c->h_idx, c->idx, k, sizeof(uint32_t)));
    TKD_CUDA_CHECK(d2h(c->h_val, c->val, k, sizeof(float)));
    TKD_CUDA_CHECK(d2h(c->h_lse, c->lse, 1, sizeof(float)));
    if (s > 0)
        TKD_CUDA_CHECK(d2h(c->h_tail, c->tail, s, sizeof(uint32_t)));
    return TKD_OK;
}

/* After both streams are done: the staging into the caller's buffers. */
void lmhead_deliver(CudaImpl *c, const tkd_lmhead_topk_args *a)
{
    size_t R = (size_t)a->rows;
    memcpy(a->idx, c->h_idx.p, R * a->k * sizeof(uint32_t));
    memcpy(a->val, c->h_val.p, R * a->k * sizeof(float));
    memcpy(a->lse, c->h_lse.p, R * sizeof(float));
    if (a->s > 0)
        memcpy(a->tail, c->h_tail.p, R * a->s * sizeof(uint32_t));
}

/* After the top-k flagged a non-finite logit: the chunks again, one at a time, to find the first
 * flagged row, then that row's logits on the host for the token and value (an error path only). */
tkd_status lmhead_locate_nonfinite(CudaImpl *c, tkd_lmhead_topk_args *a, int64_t C)
{
    tkd_error_saved keep;
    tkd_error_save(&keep, TKD_ERR_NUMERIC);
    float *row = static_cast<float *>(malloc(sizeof(float) * a->v));
    for (int64_t r0 = 0; row && r0 < a->rows; r0 += C) {
        int64_t n = a->rows - r0 < C ? a->rows - r0 : C;
        if (lmhead_gemm(c, a, r0, n) != TKD_OK ||
            tkd_topk_cuda(c->topk, static_cast<const float *>(c->logits.p), n, a->v, a->k, a->tau,
                          static_cast<uint32_t *>(c->idx.p), static_cast<float *>(c->val.p),
                          static_cast<float *>(c->lse.p), c->stream) != TKD_OK ||
            tkd_topk_cuda_sync(c->topk, c->stream) != TKD_ERR_NUMERIC)
            continue;
        int64_t bad = (int64_t)c->topk->h_flags[0];
        if (cudaMemcpy(row, static_cast<const float *>(c->logits.p) + bad * a->v, sizeof(float) * a->v,
                       cudaMemcpyDeviceToHost) != cudaSuccess)
            break;
        for (int64_t v = 0; v < a->v; v++)
            if (!isfinite(row[v])) {
                a->bad_row = r0 + bad, a->bad_col = v, a->bad_value = row[v];
                break;
            }
        break;
    }
    free(row);
    return tkd_error_restore(&keep);
}

/* Candidates per row the top-k epilogue keeps (tkd_lmhead_sm90_topk); a row with more takes the
 * logits path. */
constexpr int kTopkCap = 4096;

/* Whether the LM head's top-k goes through our sm90 GEMM's epilogues (no fp32 logits): only with
 * the policy's topk_fused (TKD_TOPK_FUSED=on), on compute capability 9.0 with D % 8 == 0 and no tail draws (they need the whole
 * row). Not the default: measured at the Qwen2.5-0.5B teacher (D 896, V 151936), its two GEMM
 * passes cost 36.2 ms per 32768 positions against 24.4 for cuBLAS's logits GEMM plus the top-k
 * kernel (docs/PERFORMANCE.md); it wins only once the candidates come out of the statistics pass. */
bool lmhead_fused_ok(CudaImpl *c, const tkd_lmhead_topk_args *a)
{
    if (!c->pol.topk_fused || a->s > 0 || a->d % 8 != 0 || a->v > INT32_MAX ||
        tkd_lmhead_sm90_vtiles((int)a->v) < a->k || a->k > kTopkCap)
        return false;
    if (!c->lm_tried) {
        c->lm_tried = 1;
        if (tkd_lmhead_sm90_ws_create(&c->lm, c->pol.lmhead_sched) != TKD_OK) {
            tkd_error_clear(); /* another device: the logits path is the answer */
            c->lm = nullptr;
        } else {
            tkd_lmhead_sm90_ws_set_stream(c->lm, c->stream);
        }
    }
    return c->lm != nullptr;
}

/* The fused LM head over all chunks; *redo when a row had more than kTopkCap candidates or a
 * non-finite logit (the caller then takes the logits path, which also names a bad logit). */
tkd_status lmhead_topk_fused(CudaImpl *c, tkd_lmhead_topk_args *a, int64_t C, bool *redo)
{
    TKD_TRY(grow(&c->lm_scratch, tkd_lmhead_sm90_topk_bytes(C, (int)a->v, kTopkCap),
                 "lm_head: top-k candidates", "lower lm_head.chunk_rows or run.batch_size"));
    TKD_TRY(grow(&c->lm_flags, 2 * sizeof(unsigned), "lm_head: top-k flags", nullptr));
    const unsigned init[2] = {0u, 0xffffffffu};
    unsigned flags[2];
    unsigned *d_flags = static_cast<unsigned *>(c->lm_flags.p);
    TKD_CUDA_CHECK(cudaMemcpyAsync(d_flags, init, sizeof init, cudaMemcpyHostToDevice, c->stream));
    for (int64_t r0 = 0; r0 < a->rows; r0 += C) {
        if (tkd_interrupted())
            return tkd_error_set(TKD_ERR_INTERRUPTED, "interrupted");
        int64_t n = a->rows - r0 < C ? a->rows - r0 : C;
        TKD_TRY(tkd_lmhead_sm90_topk(c->lm, static_cast<const uint16_t *>(a->hidden) + r0 * a->d,
                                     static_cast<const uint16_t *>(a->w), n, a->d, (int)a->v, a->k,
                                     a->tau, kTopkCap, c->lm_scratch.p, d_flags,
                                     static_cast<uint32_t *>(c->idx.p) + r0 * a->k,
                                     static_cast<float *>(c->val.p) + r0 * a->k,
                                     static_cast<float *>(c->lse.p) + r0));
        TKD_TRY(lmhead_copy_chunk(c, a, r0, n));
    }
    TKD_CUDA_CHECK(cudaMemcpyAsync(flags, d_flags, sizeof flags, cudaMemcpyDeviceToHost, c->stream));
    TKD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    TKD_TRY(tkd_lmhead_sm90_sync(c->lm));
    *redo = flags[0] != 0 || flags[1] != 0xffffffffu;
    return TKD_OK;
}

} // namespace

/* About 2 GiB of fp32 logits per chunk (large GEMMs, few top-k launches): a multiple of 256 rows in
 * [256, 65536]. */
int cu_lmhead_chunk_rows(const tkd_backend *be, int64_t v)
{
    (void)be;
    int64_t rows = ((int64_t)2 << 30) / (4 * v) / 256 * 256;
    return rows < 256 ? 256 : rows > (1 << 16) ? 1 << 16 : (int)rows;
}

tkd_status cu_lmhead_topk(tkd_backend *be, tkd_lmhead_topk_args *a)
{
    CudaImpl *c = impl(be);
    int64_t C = a->chunk_rows < a->rows ? a->chunk_rows : a->rows;
    TKD_TRY(lmhead_scratch(c, a, C));
    bool redo = true;
    if (lmhead_fused_ok(c, a)) {
        TKD_TRY(lmhead_topk_fused(c, a, C, &redo));
        if (!redo) {
            TKD_CUDA_CHECK(cudaStreamSynchronize(c->copy));
            lmhead_deliver(c, a);
            return TKD_OK;
        }
    }
    uint32_t *idx = static_cast<uint32_t *>(c->idx.p);
    float *val = static_cast<float *>(c->val.p), *lse = static_cast<float *>(c->lse.p);
    if (a->s > 0) {
        TKD_CUDA_CHECK(cudaMemcpyAsync(c->seq.p, a->row_seq, a->rows * sizeof(int64_t), cudaMemcpyHostToDevice,
                                       c->stream));
        TKD_CUDA_CHECK(cudaMemcpyAsync(c->pos.p, a->row_pos, a->rows * sizeof(int32_t), cudaMemcpyHostToDevice,
                                       c->stream));
    }
    for (int64_t r0 = 0; r0 < a->rows; r0 += C) {
        if (tkd_interrupted())
            return tkd_error_set(TKD_ERR_INTERRUPTED, "interrupted");
        int64_t n = a->rows - r0 < C ? a->rows - r0 : C;
        const float *lg = static_cast<const float *>(c->logits.p);
        TKD_TRY(lmhead_gemm(c, a, r0, n));
        TKD_TRY(tkd_topk_cuda(c->topk, lg, n, a->v, a->k, a->tau, idx + r0 * a->k, val + r0 * a->k, lse + r0,
                              c->stream));
        if (a->s > 0)
            TKD_TRY(tkd_tail_sample_cuda(c->topk, lg, n, a->v, idx + r0 * a->k, a->k, a->tau, a->s, a->seed,
                                         static_cast<const int64_t *>(c->seq.p) + r0,
                                         static_cast<const int32_t *>(c->pos.p) + r0,
                                         static_cast<uint32_t *>(c->tail.p) + r0 * a->s, c->stream));
        TKD_TRY(lmhead_copy_chunk(c, a, r0, n));
    }
    tkd_status st = tkd_topk_cuda_sync(c->topk, c->stream); /* waits; flags non-finite logits */
    if (st == TKD_ERR_NUMERIC) {
        (void)cudaStreamSynchronize(c->copy);
        return lmhead_locate_nonfinite(c, a, C);
    }
    TKD_TRY(st);
    TKD_CUDA_CHECK(cudaStreamSynchronize(c->copy));
    lmhead_deliver(c, a);
    return TKD_OK;
}

} // namespace tkd_cub
