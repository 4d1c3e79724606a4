/* backend_cuda.cu — the CUDA backend: bf16 weights and activations, fp32 residual stream and
 * statistics, every op on one non-blocking compute stream of the chosen GPU, and a second stream
 * that carries the LM head's results to pinned host staging while the next chunk computes.
 *
 * Ops are the launchers of ops_cuda.h (row ops, cuBLASLt linear), attn_cuda.h (flash attention)
 * and topk_cuda.h / tail_sample_cuda.h (the LM-head consumer). Scratch that depends on the shape
 * of a call (the fp32 staging of uploads, the LM head's logits chunk and its per-row outputs) is
 * grown to the largest call seen and then reused, so a steady loop allocates nothing.
 * The backward entries are NULL until the GPU training work lands: the model refuses training. */
#include "kernels/backend.h"

#include <cublas_v2.h>
#include <new>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/signals.h"
#include "kernels/attn_cuda.h"
#include "kernels/attn_cudnn.h"
#include "kernels/cuda_check.h"
#include "kernels/cuda_mem.h"
#include "kernels/ops_cuda.h"
#include "kernels/tail_sample_cuda.h"
#include "kernels/topk_cuda.h"

namespace {

constexpr size_t kStageFloats = 16u << 20; /* 64 MiB of fp32 staging per conversion step */
constexpr size_t kBlasWsBytes = 32u << 20;

/* A device buffer that grows to the largest size asked and is then reused. */
struct Grow {
    void *p = nullptr;
    size_t bytes = 0;
};

/* A pinned host buffer that grows to the largest size asked and is then reused. */
struct GrowHost {
    void *p = nullptr;
    size_t bytes = 0;
};

struct CudaImpl {
    int gpu = 0;
    cudaStream_t stream = nullptr;
    cudaStream_t copy = nullptr;   /* device-to-host copies of the LM head's results, beside compute */
    cudaEvent_t chunk_done = nullptr;
    tkd_cuda_linear *lin = nullptr;
    cublasHandle_t blas = nullptr; /* the LM head's bf16 x bf16 -> fp32 logits GEMM */
    void *blas_ws = nullptr;
    tkd_topk_cuda_ws *topk = nullptr;
    tkd_cudnn_attn *cudnn = nullptr;  /* cuDNN's fused attention; NULL where cuDNN is absent */
    float *stage = nullptr;        // (kStageFloats) fp32 staging of upload_f32 / download_f32
    Grow logits, idx, val, lse, tail, seq, pos;
    GrowHost h_idx, h_val, h_lse, h_tail; /* pinned staging the copy stream writes into */
};

CudaImpl *impl(tkd_backend *be) { return static_cast<CudaImpl *>(be->impl); }
cudaStream_t stream_of(tkd_backend *be) { return impl(be)->stream; }

tkd_status grow(Grow *g, size_t bytes, const char *what, const char *hint)
{
    if (bytes <= g->bytes)
        return TKD_OK;
    tkd_cuda_free(g->p);
    g->p = nullptr;
    g->bytes = 0;
    TKD_TRY(tkd_cuda_malloc(&g->p, bytes, what, hint));
    g->bytes = bytes;
    return TKD_OK;
}

tkd_status grow_host(GrowHost *g, size_t bytes, const char *what)
{
    if (bytes <= g->bytes)
        return TKD_OK;
    tkd_cuda_free_host(g->p);
    g->p = nullptr;
    g->bytes = 0;
    TKD_TRY(tkd_cuda_malloc_host(&g->p, bytes, what));
    g->bytes = bytes;
    return TKD_OK;
}

void cu_close(tkd_backend *be)
{
    CudaImpl *c = impl(be);
    (void)cudaSetDevice(c->gpu);
    if (c->stream)
        (void)cudaStreamSynchronize(c->stream);
    tkd_cuda_linear_free(c->lin);
    if (c->blas)
        (void)cublasDestroy(c->blas);
    tkd_cuda_free(c->blas_ws);
    tkd_topk_cuda_ws_free(c->topk);
    tkd_cudnn_attn_free(c->cudnn);
    tkd_cuda_free(c->stage);
    for (Grow *g : {&c->logits, &c->idx, &c->val, &c->lse, &c->tail, &c->seq, &c->pos})
        tkd_cuda_free(g->p);
    for (GrowHost *g : {&c->h_idx, &c->h_val, &c->h_lse, &c->h_tail})
        tkd_cuda_free_host(g->p);
    if (c->copy)
        (void)cudaStreamSynchronize(c->copy);
    if (c->chunk_done)
        (void)cudaEventDestroy(c->chunk_done);
    if (c->copy)
        (void)cudaStreamDestroy(c->copy);
    if (c->stream)
        (void)cudaStreamDestroy(c->stream);
    delete c;
    free(be);
}

/* ---- memory ---- */

tkd_status cu_alloc(tkd_backend *be, size_t bytes, const char *what, void **out)
{
    TKD_TRY(tkd_cuda_malloc(out, bytes, what, "lower run.batch_size or data.seq_len, or use a GPU with more memory"));
    TKD_CUDA_CHECK(cudaMemsetAsync(*out, 0, bytes, stream_of(be)));
    return TKD_OK;
}

void cu_free(tkd_backend *be, void *p)
{
    (void)be;
    tkd_cuda_free(p);
}

tkd_status cu_host_alloc(tkd_backend *be, size_t bytes, void **out)
{
    (void)be;
    return tkd_cuda_malloc_host(out, bytes, "pinned host buffer");
}

void cu_host_free(tkd_backend *be, void *p)
{
    (void)be;
    tkd_cuda_free_host(p);
}

/* Copies are ordered on the compute stream; from pageable host memory they return once the source
 * may be reused, to it once the data is there. */
tkd_status cu_upload(tkd_backend *be, void *dst, const void *src, size_t bytes)
{
    TKD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_of(be)));
    return TKD_OK;
}

tkd_status cu_download(tkd_backend *be, void *dst, const void *src, size_t bytes)
{
    TKD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(be)));
    TKD_CUDA_CHECK(cudaStreamSynchronize(stream_of(be)));
    return TKD_OK;
}

/* fp32 host -> bf16 device through the fp32 staging buffer, kStageFloats at a time. */
tkd_status cu_upload_f32(tkd_backend *be, void *dst, const float *src, size_t n)
{
    CudaImpl *c = impl(be);
    for (size_t i = 0; i < n; i += kStageFloats) {
        size_t m = n - i < kStageFloats ? n - i : kStageFloats;
        TKD_CUDA_CHECK(cudaMemcpyAsync(c->stage, src + i, m * sizeof(float), cudaMemcpyHostToDevice, c->stream));
        TKD_TRY(tkd_cuda_f32_to_bf16(c->stage, static_cast<uint16_t *>(dst) + i, m, c->stream));
    }
    return TKD_OK;
}

tkd_status cu_download_f32(tkd_backend *be, float *dst, const void *src, size_t n)
{
    CudaImpl *c = impl(be);
    for (size_t i = 0; i < n; i += kStageFloats) {
        size_t m = n - i < kStageFloats ? n - i : kStageFloats;
        TKD_TRY(tkd_cuda_bf16_to_f32(static_cast<const uint16_t *>(src) + i, c->stage, m, c->stream));
        TKD_CUDA_CHECK(cudaMemcpyAsync(dst + i, c->stage, m * sizeof(float), cudaMemcpyDeviceToHost, c->stream));
    }
    TKD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return TKD_OK;
}

tkd_status cu_memset0(tkd_backend *be, void *p, size_t bytes)
{
    TKD_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_of(be)));
    return TKD_OK;
}

tkd_status cu_sync(tkd_backend *be)
{
    TKD_CUDA_CHECK(cudaStreamSynchronize(stream_of(be)));
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

/* ---- forward ---- */

typedef const uint16_t *cbf;
typedef uint16_t *bf;

tkd_status cu_embedding_fwd(tkd_backend *be, const int32_t *tok, int N, const void *emb, int D, float *x)
{
    return tkd_cuda_embedding_fwd(tok, N, static_cast<cbf>(emb), D, x, stream_of(be));
}

tkd_status cu_rmsnorm_fwd(tkd_backend *be, const float *x, const void *w, int N, int D, float eps, void *y,
                          float *rstd)
{
    return tkd_cuda_rmsnorm_fwd(x, static_cast<cbf>(w), N, D, eps, static_cast<bf>(y), rstd, stream_of(be));
}

tkd_status cu_add_rmsnorm_fwd(tkd_backend *be, const float *x_in, const void *branch, float *x_out, const void *w,
                              int N, int D, float eps, void *y, float *rstd)
{
    return tkd_cuda_add_rmsnorm_fwd(x_in, static_cast<cbf>(branch), x_out, static_cast<cbf>(w), N, D, eps,
                                    static_cast<bf>(y), rstd, stream_of(be));
}

tkd_status cu_linear_fwd(tkd_backend *be, const void *x, const void *w, const void *b, int N, int K, int M, void *y)
{
    return tkd_cuda_linear_fwd(impl(be)->lin, static_cast<cbf>(x), static_cast<cbf>(w), static_cast<cbf>(b), N, K,
                               M, static_cast<bf>(y), stream_of(be));
}

tkd_status cu_rope_fwd(tkd_backend *be, void *q, void *k, int N, int T, int H, int Hkv, int dh, const float *cos_t,
                       const float *sin_t)
{
    return tkd_cuda_rope_fwd(static_cast<bf>(q), static_cast<bf>(k), N, T, H, Hkv, dh, cos_t, sin_t, stream_of(be));
}

/* The flash kernel where it takes the head size, the simple one elsewhere (dh 16, 32, ...). */
bool flash_takes(int dh) { return dh == 48 || dh == 64 || dh == 80 || dh == 96 || dh == 128; }

/* cuDNN's fused attention first (about twice our kernel's rate on an H200); where cuDNN is absent or
 * refuses the shape (a refusal is cached per shape, so asking again is free), our own kernels. */
tkd_status cu_attn_fwd(tkd_backend *be, const void *q, const void *k, const void *v, int B, int T, int H, int Hkv,
                       int dh, void *y, void *saved)
{
    CudaImpl *c = impl(be);
    if (c->cudnn) {
        tkd_status st = tkd_cudnn_attn_fwd(c->cudnn, static_cast<cbf>(q), static_cast<cbf>(k), static_cast<cbf>(v),
                                           B, T, H, Hkv, dh, static_cast<bf>(y), static_cast<float *>(saved),
                                           c->stream);
        if (st != TKD_ERR_UNSUPPORTED)
            return st;
        tkd_error_clear();
    }
    auto fn = flash_takes(dh) ? tkd_cuda_attn_fwd : tkd_cuda_attn_fwd_simple;
    return fn(static_cast<cbf>(q), static_cast<cbf>(k), static_cast<cbf>(v), B, T, H, Hkv, dh, static_cast<bf>(y),
              static_cast<float *>(saved), c->stream);
}

/* Flash attention keeps only each row's log-sum-exp (B, H, T) for its backward. */
size_t cu_attn_saved_bytes(const tkd_backend *be, int B, int T, int H)
{
    (void)be;
    return sizeof(float) * (size_t)B * (size_t)H * (size_t)T;
}

tkd_status cu_swiglu_fwd(tkd_backend *be, const void *g, const void *u, int64_t n, void *h)
{
    return tkd_cuda_swiglu_fwd(static_cast<cbf>(g), static_cast<cbf>(u), n, static_cast<bf>(h), stream_of(be));
}

/* ---- the LM head + top-k consumer ---- */

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

tkd_status cu_lmhead_topk(tkd_backend *be, tkd_lmhead_topk_args *a)
{
    CudaImpl *c = impl(be);
    int64_t C = a->chunk_rows < a->rows ? a->chunk_rows : a->rows;
    TKD_TRY(lmhead_scratch(c, a, C));
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

const tkd_backend_ops cuda_ops = {
    cu_close,
    cu_alloc, cu_free, cu_host_alloc, cu_host_free, cu_upload, cu_download, cu_upload_f32, cu_download_f32,
    cu_memset0, cu_sync,
    cu_embedding_fwd, cu_rmsnorm_fwd, cu_add_rmsnorm_fwd, cu_linear_fwd, cu_rope_fwd, cu_attn_fwd,
    cu_attn_saved_bytes, cu_swiglu_fwd,
    nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, /* backward: not yet on CUDA */
    cu_lmhead_topk,
};

tkd_status cuda_setup(CudaImpl *c)
{
    TKD_CUDA_CHECK(cudaSetDevice(c->gpu));
    TKD_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    TKD_CUDA_CHECK(cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking));
    TKD_CUDA_CHECK(cudaEventCreateWithFlags(&c->chunk_done, cudaEventDisableTiming));
    TKD_TRY(tkd_cuda_linear_create(&c->lin));
    TKD_TRY(tkd_cuda_malloc(&c->blas_ws, kBlasWsBytes, "cuBLAS workspace", nullptr));
    TKD_CUBLAS_CHECK(cublasCreate(&c->blas));
    TKD_CUBLAS_CHECK(cublasSetStream(c->blas, c->stream));
    TKD_CUBLAS_CHECK(cublasSetWorkspace(c->blas, c->blas_ws, kBlasWsBytes));
    TKD_TRY(tkd_topk_cuda_ws_create(&c->topk));
    if (!getenv("TKD_NO_CUDNN") && tkd_cudnn_attn_create(&c->cudnn) != TKD_OK) {
        c->cudnn = nullptr; /* no cuDNN: our attention kernels serve alone */
        tkd_error_clear();
    }
    return tkd_cuda_malloc(reinterpret_cast<void **>(&c->stage), kStageFloats * sizeof(float), "upload staging",
                           nullptr);
}

} // namespace

extern "C" tkd_status tkd_backend_cuda_open(int gpu, tkd_backend **out)
{
    *out = nullptr;
    tkd_backend *be = static_cast<tkd_backend *>(calloc(1, sizeof *be));
    CudaImpl *c = new (std::nothrow) CudaImpl;
    if (!be || !c) {
        free(be);
        delete c;
        return tkd_error_set(TKD_ERR_NOMEM, "backend: out of memory");
    }
    c->gpu = gpu;
    be->device = TKD_DEVICE_CUDA;
    be->name = "cuda";
    be->act_size = 2;
    be->op = &cuda_ops;
    be->impl = c;
    tkd_status st = cuda_setup(c);
    if (st != TKD_OK) {
        tkd_error_saved keep;
        tkd_error_save(&keep, st);
        cu_close(be);
        return tkd_error_prefix(tkd_error_restore(&keep), "device: cuda (GPU %d)", gpu);
    }
    *out = be;
    return TKD_OK;
}
