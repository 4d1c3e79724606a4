/* backend_cuda.cu — the CUDA backend: bf16 weights and activations, fp32 residual stream and
 * statistics, every op on one non-blocking compute stream of the chosen GPU, and a second stream
 * that carries the LM head's results to pinned host staging while the next chunk computes.
 *
 * Ops are the launchers of ops_cuda.h (row ops, cuBLASLt linear), attn_cuda.h / attn_cudnn.h
 * (attention forward), ops_bwd_cuda.h (the backward ops, AdamW, the gradient norm and scale),
 * attn_bwd_simple_cuda.h (attention backward), kl_loss_cuda.h (the fused loss) and topk_cuda.h /
 * tail_sample_cuda.h (the LM-head consumer, in backend_cuda_lmhead.cu; the state both files share is
 * in backend_cuda_internal.h). Scratch that depends on the shape of a call (the fp32
 * staging of uploads, the LM head's logits chunk and its per-row outputs, the backward workspace,
 * attention backward's δ) is grown to the largest call seen and then reused, so a steady loop
 * allocates nothing after its first step.
 *
 * The fused loss runs on the legacy default stream (kl_loss_cuda.h): kl_forward / kl_backward make
 * that stream wait for the compute stream (an event) and for the teacher batch's copy, and the
 * loss's calls return only after a host synchronisation, so the compute stream's later work is
 * ordered after them. */
#include "kernels/cuda/backend_cuda_internal.h"

#include <cublas_v2.h>
#include <new>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attn/attn_bwd_cuda_internal.h"
#include "kernels/attn/attn_bwd_simple_cuda.h"
#include "kernels/attn/attn_bwd_sm90.h"
#include "kernels/attn/attn_cuda.h"
#include "kernels/attn/attn_cudnn.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/loss/kl_loss_cuda.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"
#include "kernels/cuda/ops_bwd_cuda.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/moe_cuda.h"
#include "kernels/cuda/topk_cuda.h"

using namespace tkd_cub;

namespace tkd_cub {

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

} // namespace tkd_cub

namespace {

constexpr size_t kStageFloats = 16u << 20; /* 64 MiB of fp32 staging per conversion step */
constexpr size_t kBlasWsBytes = 32u << 20;

void cu_close(tkd_backend *be)
{
    CudaImpl *c = impl(be);
    (void)cudaSetDevice(c->gpu);
    if (c->stream)
        (void)cudaStreamSynchronize(c->stream);
    tkd_cuda_linear_free(c->lin);
    tkd_cuda_release(cublasDestroy, c->blas);
    tkd_cuda_free(c->blas_ws);
    tkd_topk_cuda_ws_free(c->topk);
    tkd_cudnn_attn_free(c->cudnn);
    tkd_cuda_attn_bwd_ws_free(c->attn_bwd_ws);
    tkd_cuda_free(c->stage);
    tkd_cuda_bwd_ws_free(c->bwd);
    tkd_cuda_free(c->norm2);
    tkd_cuda_free_host(c->h_norm2);
    tkd_cuda_free_host(c->h_wait_err);
    tkd_lmhead_sm90_ws_free(c->lm);
    for (Grow *g : {&c->logits, &c->idx, &c->val, &c->lse, &c->tail, &c->seq, &c->pos, &c->attn_delta,
                    &c->lm_scratch, &c->lm_flags, &c->sinks32})
        tkd_cuda_free(g->p);
    for (GrowHost *g : {&c->h_idx, &c->h_val, &c->h_lse, &c->h_tail})
        tkd_cuda_free_host(g->p);
    for (int64_t i = 0; i < c->marks_n; i++)
        (void)cudaEventDestroy(c->marks[i]); /* teardown: not actionable */
    free(c->marks);
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
    TKD_TRY(tkd_cuda_malloc(out, bytes, what,
                            "lower the batch (teacher-dump run.batch_size, student-train train.batch_size) or "
                            "data.seq_len, or use a GPU with more memory"));
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

tkd_status cu_rmsnorm_act_fwd(tkd_backend *be, const void *x, const void *w, int N, int D, float eps, void *y,
                              float *rstd)
{
    return tkd_cuda_rmsnorm_bf16_fwd(static_cast<cbf>(x), static_cast<cbf>(w), N, D, eps, static_cast<bf>(y), rstd,
                                     stream_of(be));
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

/* A window shorter than T, documents or sinks: our kernels' masked forward (cuDNN's graph here has
 * none of them).
 * The masked kernels take fp32 sinks (H): the act (bf16) sinks are widened, exactly, into a small
 * buffer of the backend on the stream, once per call (H floats: nothing beside the attention). */
tkd_status attn_fwd_window(CudaImpl *c, const void *q, const void *k, const void *v, int B, int T, int H, int Hkv,
                           int dh, int window, const int32_t *doc, const void *sinks, void *y, void *saved)
{
    if (sinks) {
        TKD_TRY(grow(&c->sinks32, (size_t)H * sizeof(float), "attention sinks (fp32)", nullptr));
        TKD_TRY(tkd_cuda_bf16_to_f32(static_cast<cbf>(sinks), static_cast<float *>(c->sinks32.p), (size_t)H,
                                     c->stream));
    }
    const tkd_attn_mask mask = {window, sinks ? static_cast<const float *>(c->sinks32.p) : nullptr, doc};
    auto fn = flash_takes(dh) ? tkd_cuda_attn_fwd_masked : tkd_cuda_attn_fwd_simple_masked;
    return fn(static_cast<cbf>(q), static_cast<cbf>(k), static_cast<cbf>(v), B, T, H, Hkv, dh, &mask,
              static_cast<bf>(y), static_cast<float *>(saved), c->stream);
}

/* cuDNN's fused attention first (about twice our kernel's rate on an H200); where cuDNN is absent or
 * refuses the shape (a refusal is cached per shape, so asking again is free), our own kernels. */
tkd_status cu_attn_fwd(tkd_backend *be, const void *q, const void *k, const void *v, int B, int T, int H, int Hkv,
                       int dh, int window, const int32_t *doc, const void *sinks, void *y, void *saved)
{
    CudaImpl *c = impl(be);
    if ((window > 0 && window < T) || sinks || doc)
        return attn_fwd_window(c, q, k, v, B, T, H, Hkv, dh, window, doc, sinks, y, saved);
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

/* ---- mixture of experts: the seam's opaque tkd_backend_moe is the op's own workspace, on the
 * compute stream ---- */

tkd_status cu_moe_create(tkd_backend *be, const tkd_moe_params *p, int max_tokens, tkd_backend_moe **out)
{
    tkd_cuda_moe_ws *ws = nullptr;
    TKD_TRY(tkd_cuda_moe_ws_create(&ws, p, max_tokens, stream_of(be)));
    const int choice = impl(be)->pol.moe_gemm;
    tkd_cuda_moe_ws_set_grouped(ws, choice == TKD_POLICY_MOE_GEMM_AUTO      ? TKD_CUDA_MOE_GEMM_AUTO
                                    : choice == TKD_POLICY_MOE_GEMM_GROUPED ? TKD_CUDA_MOE_GEMM_GROUPED
                                    : choice == TKD_POLICY_MOE_GEMM_OURS    ? TKD_CUDA_MOE_GEMM_OURS
                                                                            : TKD_CUDA_MOE_GEMM_LOOP);
    tkd_cuda_moe_ws_set_mxfp4_layer(ws, impl(be)->pol.moe_mxfp4 == TKD_POLICY_MOE_MXFP4_LAYER);
    (void)tkd_cuda_moe_ws_set_pad(ws, 128); /* the loop: few shapes for cuBLAS's heuristics (moe_cuda.h); in range */
    *out = reinterpret_cast<tkd_backend_moe *>(ws);
    return TKD_OK;
}

void cu_moe_free(tkd_backend *be, tkd_backend_moe *m)
{
    (void)be;
    tkd_cuda_moe_ws_free(reinterpret_cast<tkd_cuda_moe_ws *>(m));
}

tkd_status cu_moe_fwd(tkd_backend *be, tkd_backend_moe *m, const tkd_moe_act_weights *w, const void *x, int N, void *y)
{
    (void)be;
    const tkd_cuda_moe_weights cw = {static_cast<cbf>(w->router_w), static_cast<cbf>(w->router_b),
                                     static_cast<cbf>(w->w_gate),   static_cast<cbf>(w->w_up),
                                     static_cast<cbf>(w->w_down),   static_cast<cbf>(w->b_gate),
                                     static_cast<cbf>(w->b_up),     static_cast<cbf>(w->b_down),
                                     w->q};
    return tkd_cuda_moe_fwd(reinterpret_cast<tkd_cuda_moe_ws *>(m), &cw, static_cast<cbf>(x), N, static_cast<bf>(y),
                            nullptr, nullptr);
}

/* ---- backward ---- */

/* The backward workspace, grown (after the stream drains: the old one may be in use) to at least
 * N rows of width D; any existing one serves calls that need no particular size (N = D = 0). */
tkd_status bwd_ws(CudaImpl *c, int N, int D, tkd_cuda_bwd_ws **out)
{
    if (!c->bwd || N > c->bwd_rows || D > c->bwd_d) {
        int rows = N > c->bwd_rows ? N : c->bwd_rows, d = D > c->bwd_d ? D : c->bwd_d;
        rows = rows > 0 ? rows : 1;
        d = d > 0 ? d : 1;
        TKD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        tkd_cuda_bwd_ws_free(c->bwd);
        c->bwd = nullptr;
        c->bwd_rows = c->bwd_d = 0;
        TKD_TRY(tkd_cuda_bwd_ws_create(rows, d, &c->bwd));
        c->bwd_rows = rows;
        c->bwd_d = d;
    }
    *out = c->bwd;
    return TKD_OK;
}

tkd_status cu_embedding_bwd(tkd_backend *be, const int32_t *tok, int N, const float *dx, int D, float *demb)
{
    tkd_cuda_bwd_ws *ws = nullptr;
    TKD_TRY(bwd_ws(impl(be), N, D, &ws));
    return tkd_cuda_embedding_bwd(ws, tok, N, dx, D, demb, stream_of(be));
}

tkd_status cu_rmsnorm_bwd(tkd_backend *be, const void *dy, const float *x, const void *w, const float *rstd, int N,
                          int D, float *dx, float *dw, void *dx_act)
{
    tkd_cuda_bwd_ws *ws = nullptr;
    TKD_TRY(bwd_ws(impl(be), N, D, &ws)); /* sized for the embedding's rows at the first call */
    return tkd_cuda_rmsnorm_bwd(ws, static_cast<cbf>(dy), x, static_cast<cbf>(w), rstd, N, D, dx,
                                static_cast<bf>(dx_act), dw, stream_of(be));
}

tkd_status cu_linear_bwd(tkd_backend *be, const void *dy, const void *x, const void *w, int N, int K, int M,
                         void *dx, float *dw, float *db, int dx_acc)
{
    CudaImpl *c = impl(be);
    tkd_cuda_bwd_ws *ws = nullptr;
    TKD_TRY(bwd_ws(c, 0, 0, &ws));
    return tkd_cuda_linear_bwd(c->lin, ws, static_cast<cbf>(dy), static_cast<cbf>(x), static_cast<cbf>(w), N, K,
                               M, static_cast<bf>(dx), dw, db, dx_acc, c->stream);
}

tkd_status cu_rope_bwd(tkd_backend *be, void *dq, void *dk, int N, int T, int H, int Hkv, int dh, const float *cos_t,
                       const float *sin_t)
{
    return tkd_cuda_rope_bwd(static_cast<bf>(dq), static_cast<bf>(dk), N, T, H, Hkv, dh, cos_t, sin_t,
                             stream_of(be));
}

/* The flash backward's workspace, made again when a call needs more rows than it was made for
 * (once per shape growth, never per step). */
tkd_status attn_bwd_ws_fit(CudaImpl *c, int B, int T, int H, int dh)
{
    int64_t rows = (int64_t)B * H * ((T + 127) / 128);
    if (c->attn_bwd_ws && rows <= c->attn_bwd_rows && dh <= c->attn_bwd_dh)
        return TKD_OK;
    TKD_CUDA_CHECK(cudaStreamSynchronize(c->stream)); /* the old one may still be in use */
    tkd_cuda_attn_bwd_ws_free(c->attn_bwd_ws);
    c->attn_bwd_ws = nullptr;
    TKD_TRY(tkd_cuda_attn_bwd_ws_create(&c->attn_bwd_ws, B, T, H, dh));
    c->attn_bwd_rows = rows;
    c->attn_bwd_dh = dh;
    return TKD_OK;
}

/* The attention backward, first choice c->attn_bwd (TKD_ATTN_BWD; default wgmma), then down the list:
 * our Hopper wgmma kernel (attn_bwd_sm90.h: compute capability 9.0, dh 64 or 128, deterministic,
 * fp32 dQ accumulators in its workspace), cuDNN's fused backward (deterministic engines only,
 * TKD_CUDNN_BWD_NONDET=1 allows the others and a resumed run is then not bit-exact; its workspace
 * bounded by calls over groups),
 * our flash backward (deterministic, mma.sync) where it takes the head size, the simple
 * deterministic kernels elsewhere. A choice that is absent or refuses the shape passes to the next;
 * "flash" skips cuDNN and wgmma. tests/test_gpu_attn_cudnn_bwd.c holds all the fast ones row by row
 * to what bf16 arithmetic in a flash backward must cost, against a float64 reference.
 * A window shorter than T or packed documents skip wgmma and cuDNN (neither masks here) and go to our
 * flash backward's masked variant (tkd_cuda_attn_bwd_masked, tests/test_gpu_attn_bwd.c) where it
 * takes the head size, else to the simple kernels' masked variant (tests/test_gpu_attn_bwd_simple.c). */
tkd_status cu_attn_bwd(tkd_backend *be, const void *dy, const void *q, const void *k, const void *v, const void *y,
                       const void *saved, int B, int T, int H, int Hkv, int dh, int window, const int32_t *doc,
                       void *dq, void *dk, void *dv)
{
    CudaImpl *c = impl(be);
    const bool masked = (window > 0 && window < T) || doc; /* only our flash and simple kernels mask */
    const float *lse = static_cast<const float *>(saved);
    auto wgmma = [&]() -> tkd_status { /* TKD_ERR_UNSUPPORTED (message cleared) where it cannot run */
        tkd_status st = tkd_cuda_attn_bwd_sm90_supported(dh);
        if (st == TKD_OK)
            st = attn_bwd_ws_fit(c, B, T, H, dh);
        if (st == TKD_OK)
            st = tkd_cuda_attn_bwd_sm90(static_cast<cbf>(dy), static_cast<cbf>(q), static_cast<cbf>(k),
                                        static_cast<cbf>(v), static_cast<cbf>(y), lse, B, T, H, Hkv, dh,
                                        static_cast<bf>(dq), static_cast<bf>(dk), static_cast<bf>(dv),
                                        c->attn_bwd_ws, c->stream);
        if (st == TKD_ERR_UNSUPPORTED)
            tkd_error_clear();
        return st;
    };
    tkd_status st = TKD_ERR_UNSUPPORTED;
    if (!masked && c->pol.attn_bwd == TKD_POLICY_ATTN_BWD_WGMMA && (st = wgmma()) != TKD_ERR_UNSUPPORTED)
        return st;
    if (!masked && c->cudnn && c->pol.attn_bwd != TKD_POLICY_ATTN_BWD_FLASH) { /* writes dq/dk/dv, as the op's contract asks */
        st = tkd_cudnn_attn_bwd(c->cudnn, static_cast<cbf>(dy), static_cast<cbf>(q), static_cast<cbf>(k),
                                static_cast<cbf>(v), static_cast<cbf>(y), lse, B, T, H, Hkv, dh, static_cast<bf>(dq),
                                static_cast<bf>(dk), static_cast<bf>(dv), c->stream);
        if (st != TKD_ERR_UNSUPPORTED)
            return st;
        tkd_error_clear();
    }
    if (!masked && c->pol.attn_bwd == TKD_POLICY_ATTN_BWD_CUDNN && (st = wgmma()) != TKD_ERR_UNSUPPORTED)
        return st;
    /* our other kernels add into dq/dk/dv: zero them first (the op overwrites) */
    size_t nq = (size_t)B * T * H * dh * 2, nkv = (size_t)B * T * Hkv * dh * 2;
    TKD_CUDA_CHECK(cudaMemsetAsync(dq, 0, nq, c->stream));
    TKD_CUDA_CHECK(cudaMemsetAsync(dk, 0, nkv, c->stream));
    TKD_CUDA_CHECK(cudaMemsetAsync(dv, 0, nkv, c->stream));
    const tkd_attn_mask mask = {window, nullptr, doc};
    if (flash_takes(dh)) {
        TKD_TRY(attn_bwd_ws_fit(c, B, T, H, dh));
        return tkd_cuda_attn_bwd_masked(static_cast<cbf>(dy), static_cast<cbf>(q), static_cast<cbf>(k),
                                        static_cast<cbf>(v), static_cast<cbf>(y), lse, B, T, H, Hkv, dh,
                                        masked ? &mask : nullptr, static_cast<bf>(dq), static_cast<bf>(dk),
                                        static_cast<bf>(dv), c->attn_bwd_ws, c->stream);
    }
    TKD_TRY(grow(&c->attn_delta, tkd_cuda_attn_bwd_simple_ws_bytes(B, T, H), "attention backward scratch",
                 "lower train.batch_size or data.seq_len"));
    return tkd_cuda_attn_bwd_simple_masked(static_cast<cbf>(dy), static_cast<cbf>(q), static_cast<cbf>(k),
                                           static_cast<cbf>(v), static_cast<cbf>(y), lse, B, T, H, Hkv, dh,
                                           masked ? &mask : nullptr, static_cast<bf>(dq), static_cast<bf>(dk),
                                           static_cast<bf>(dv), static_cast<float *>(c->attn_delta.p), c->stream);
}

tkd_status cu_swiglu_bwd(tkd_backend *be, const void *dh, const void *g, const void *u, int64_t n, void *dg,
                         void *du, int acc)
{
    return tkd_cuda_swiglu_bwd(static_cast<cbf>(dh), static_cast<cbf>(g), static_cast<cbf>(u), n,
                               static_cast<bf>(dg), static_cast<bf>(du), acc, stream_of(be));
}

/* ---- training: optimizer and gradient helpers ---- */

tkd_status cu_f32_to_act(tkd_backend *be, const float *src, void *dst, size_t n)
{
    return tkd_cuda_f32_to_bf16(src, static_cast<bf>(dst), n, stream_of(be));
}

tkd_status cu_act_to_f32(tkd_backend *be, const void *src, float *dst, size_t n)
{
    return tkd_cuda_bf16_to_f32(static_cast<cbf>(src), dst, n, stream_of(be));
}

} // namespace

struct tkd_backend_adamw {
    tkd_cuda_adamw *dev;
};

namespace {

tkd_status cu_adamw_create(tkd_backend *be, const tkd_adamw_seg *segs, int n_segs, tkd_backend_adamw **out)
{
    (void)be;
    *out = nullptr;
    tkd_cuda_param_seg *t = static_cast<tkd_cuda_param_seg *>(malloc(sizeof *t * (size_t)(n_segs > 0 ? n_segs : 1)));
    tkd_backend_adamw *a = new (std::nothrow) tkd_backend_adamw{nullptr};
    if (!t || !a) {
        free(t);
        delete a;
        return tkd_error_set(TKD_ERR_NOMEM, "adamw: out of host memory for %d segments", n_segs);
    }
    for (int i = 0; i < n_segs; i++)
        t[i] = tkd_cuda_param_seg{segs[i].offset, segs[i].numel, segs[i].decay};
    tkd_status st = tkd_cuda_adamw_create(t, n_segs, &a->dev);
    free(t);
    if (st != TKD_OK) {
        delete a;
        return st;
    }
    *out = a;
    return TKD_OK;
}

void cu_adamw_free(tkd_backend *be, tkd_backend_adamw *a)
{
    (void)be;
    if (!a)
        return;
    tkd_cuda_adamw_free(a->dev);
    delete a;
}

tkd_status cu_adamw_step(tkd_backend *be, const tkd_backend_adamw *a, void *w, void *lo, const float *grads, void *m,
                         void *v, tkd_adamw_dtype mdt, const tkd_adamw_hparams *h, int64_t step, float grad_scale)
{
    if (mdt == TKD_ADAMW_DTYPE_BF16)
        return tkd_cuda_adamw_step_bf16(a->dev, static_cast<bf>(w), static_cast<int16_t *>(lo), grads,
                                        static_cast<uint16_t *>(m), static_cast<uint16_t *>(v), h->lr, h->beta1,
                                        h->beta2, h->eps, h->weight_decay, step, grad_scale, stream_of(be));
    return tkd_cuda_adamw_step(a->dev, static_cast<bf>(w), static_cast<int16_t *>(lo), grads, static_cast<float *>(m),
                               static_cast<float *>(v), h->lr, h->beta1, h->beta2, h->eps, h->weight_decay, step,
                               grad_scale, stream_of(be));
}

/* Master weights host fp32 <-> (bf16, int16 residual) through the fp32 staging buffer, as
 * upload_f32 / download_f32 (loading, checkpoints: not the step's hot path). */
tkd_status cu_master_upload(tkd_backend *be, void *w, void *lo, const float *src, size_t n)
{
    CudaImpl *c = impl(be);
    for (size_t i = 0; i < n; i += kStageFloats) {
        size_t k = n - i < kStageFloats ? n - i : kStageFloats;
        TKD_CUDA_CHECK(cudaMemcpyAsync(c->stage, src + i, k * sizeof(float), cudaMemcpyHostToDevice, c->stream));
        TKD_TRY(tkd_cuda_master_split(c->stage, static_cast<bf>(w) + i, static_cast<int16_t *>(lo) + i, k, c->stream));
    }
    return TKD_OK;
}

tkd_status cu_master_download(tkd_backend *be, float *dst, const void *w, const void *lo, size_t n)
{
    CudaImpl *c = impl(be);
    for (size_t i = 0; i < n; i += kStageFloats) {
        size_t k = n - i < kStageFloats ? n - i : kStageFloats;
        TKD_TRY(tkd_cuda_master_join(static_cast<const uint16_t *>(w) + i, static_cast<const int16_t *>(lo) + i,
                                     c->stage, k, c->stream));
        TKD_CUDA_CHECK(cudaMemcpyAsync(dst + i, c->stage, k * sizeof(float), cudaMemcpyDeviceToHost, c->stream));
    }
    TKD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return TKD_OK;
}

tkd_status cu_grad_norm2(tkd_backend *be, const float *g, size_t n, double *norm2)
{
    CudaImpl *c = impl(be);
    tkd_cuda_bwd_ws *ws = nullptr;
    TKD_TRY(bwd_ws(c, 0, 0, &ws));
    TKD_TRY(tkd_cuda_grad_norm2(ws, g, n, c->norm2, c->stream));
    TKD_CUDA_CHECK(cudaMemcpyAsync(c->h_norm2, c->norm2, sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    *c->h_wait_err = 0;
    if (c->attn_bwd_ws) /* the step's one synchronisation also reports a timed-out wgmma pipeline wait */
        TKD_CUDA_CHECK(cudaMemcpyAsync(c->h_wait_err, c->attn_bwd_ws->err, sizeof(unsigned), cudaMemcpyDeviceToHost,
                                       c->stream));
    TKD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    *norm2 = *c->h_norm2;
    if (*c->h_wait_err)
        return tkd_error_set(TKD_ERR_INTERNAL, "attention backward (wgmma): a pipeline wait timed out this step, "
                             "so its gradients are garbage; TKD_ATTN_BWD=cudnn or flash avoids that kernel");
    return TKD_OK;
}

tkd_status cu_grad_scale(tkd_backend *be, float *g, size_t n, float s)
{
    return tkd_cuda_scale(g, n, s, stream_of(be));
}

} // namespace

/* ---- the fused KL loss ---- */

/* The teacher side of one batch: five sections of n_max rows (widths k, k, 1, s, 1; 4-byte
 * elements), in pinned host memory (hb's pointers, for validation) and on the device (dev's). Dense
 * mode (the teacher online) stages only the labels (k = s = 0 here): its teacher_h / teacher_w are
 * backend memory already (the teacher model runs on this backend: device bf16), passed through. */
struct tkd_backend_kl {
    tkd_kl_cuda_ws *ws = nullptr;
    int64_t n_max = 0;
    int k = 0, s = 0, v = 0;
    size_t sec[5] = {0};            /* element offsets of idx, logit, lse, tail, labels */
    size_t elems = 0;
    char *h_buf = nullptr;          /* pinned (elems · 4 bytes) */
    char *d_buf = nullptr;          /* device (elems · 4 bytes) */
    tkd_kl_batch hb = {};           /* the staged batch, pointers into h_buf */
    tkd_kl_cuda_batch dev = {};     /* the same on the device (h, w set per call) */
    uint8_t *seen = nullptr;        /* (V/8 + 1) validation scratch, zero between calls */
    cudaEvent_t staged = nullptr;   /* the batch's copy is on the device (copy stream) */
    cudaEvent_t ready = nullptr;    /* the compute stream's work so far (hidden, zeroed grads) */
};

namespace {

/* The cache columns per row a call stages: none in dense mode (the teacher's logits are made on
 * the device from its hidden states). */
int staged_k(const tkd_kl_params *p)
{
    return p->dense ? 0 : p->k;
}

void kl_release(tkd_backend_kl *kl)
{
    if (!kl)
        return;
    tkd_cuda_release(cudaEventSynchronize, kl->staged);
    tkd_kl_cuda_ws_free(kl->ws);
    tkd_cuda_free_host(kl->h_buf);
    tkd_cuda_free(kl->d_buf);
    free(kl->seen);
    if (kl->staged)
        (void)cudaEventDestroy(kl->staged);
    if (kl->ready)
        (void)cudaEventDestroy(kl->ready);
    delete kl;
}

tkd_status kl_setup(tkd_backend_kl *kl, const tkd_kl_params *p, const tkd_cuda_policy *pol, int d)
{
    const size_t n = (size_t)kl->n_max, widths[5] = {(size_t)kl->k, (size_t)kl->k, 1, (size_t)kl->s, 1};
    for (int i = 0; i < 5; i++) {
        kl->sec[i] = kl->elems;
        kl->elems += n * widths[i];
    }
    TKD_TRY(tkd_kl_cuda_ws_create(&kl->ws, p, pol, kl->n_max, d, kl->v));
    TKD_TRY(tkd_cuda_malloc_host(reinterpret_cast<void **>(&kl->h_buf), kl->elems * 4, "loss: teacher staging"));
    TKD_TRY(tkd_cuda_malloc(reinterpret_cast<void **>(&kl->d_buf), kl->elems * 4, "loss: teacher batch",
                            "lower train.batch_size or kd.topk"));
    if (!(kl->seen = static_cast<uint8_t *>(calloc((size_t)kl->v / 8 + 1, 1))))
        return tkd_error_set(TKD_ERR_NOMEM, "loss: out of host memory");
    TKD_CUDA_CHECK(cudaEventCreateWithFlags(&kl->staged, cudaEventDisableTiming));
    TKD_CUDA_CHECK(cudaEventCreateWithFlags(&kl->ready, cudaEventDisableTiming));
    return TKD_OK;
}

tkd_status cu_kl_create(tkd_backend *be, const tkd_kl_params *p, int64_t n_max, int d, int v, tkd_backend_kl **out)
{
    *out = nullptr;
    tkd_backend_kl *kl = new (std::nothrow) tkd_backend_kl;
    if (!kl)
        return tkd_error_set(TKD_ERR_NOMEM, "loss: out of host memory");
    kl->n_max = n_max;
    kl->k = staged_k(p);
    kl->s = p->variant == TKD_KL_VARIANT_SAMPLED ? p->s : 0;
    kl->v = v;
    tkd_status st = n_max > 0 && d > 0 && v > 0 && p->k >= 0 && p->s >= 0
                        ? kl_setup(kl, p, &impl(be)->pol, d)
                        : tkd_error_set(TKD_ERR_INVALID_ARG, "loss: n_max %lld, D %d, V %d, k %d, s %d",
                                        (long long)n_max, d, v, p->k, p->s);
    if (st != TKD_OK) {
        kl_release(kl);
        return st;
    }
    *out = kl;
    return TKD_OK;
}

void cu_kl_free(tkd_backend *be, tkd_backend_kl *kl)
{
    (void)be;
    kl_release(kl);
}

/* Section i of the staged batch: a copy of src (rows · width elements) into pinned memory, then
 * to the device on the copy stream. Sets the host and device pointers (NULL when src is). */
template <typename E>
tkd_status kl_stage_section(CudaImpl *c, tkd_backend_kl *kl, int i, const E *src, int64_t rows, int width,
                            const E **h, const E **d)
{
    *h = nullptr;
    *d = nullptr;
    if (!src || width == 0)
        return TKD_OK;
    size_t bytes = (size_t)rows * (size_t)width * sizeof(E);
    E *hp = reinterpret_cast<E *>(kl->h_buf + kl->sec[i] * 4), *dp = reinterpret_cast<E *>(kl->d_buf + kl->sec[i] * 4);
    memcpy(hp, src, bytes);
    TKD_CUDA_CHECK(cudaMemcpyAsync(dp, hp, bytes, cudaMemcpyHostToDevice, c->copy));
    *h = hp;
    *d = dp;
    return TKD_OK;
}

tkd_status cu_kl_stage(tkd_backend *be, tkd_backend_kl *kl, const tkd_kl_params *p, const tkd_kl_batch *hb)
{
    CudaImpl *c = impl(be);
    if (hb->n < 0 || hb->n > kl->n_max || hb->v != kl->v || staged_k(p) != kl->k)
        return tkd_error_set(TKD_ERR_MISMATCH, "loss: batch of %lld rows, V %d, k %d%s does not fit the loss state "
                             "(%lld rows, V %d, k %d)", (long long)hb->n, hb->v, staged_k(p),
                             p->dense ? " (dense)" : "", (long long)kl->n_max, kl->v, kl->k);
    int s = p->variant == TKD_KL_VARIANT_SAMPLED ? p->s : 0;
    if (s > kl->s)
        return tkd_error_set(TKD_ERR_MISMATCH, "loss: %d tail draws per row, the loss state holds %d", s, kl->s);
    TKD_CUDA_CHECK(cudaEventSynchronize(kl->staged)); /* the last batch's copy has left the staging */
    kl->hb = *hb;
    kl->hb.h = nullptr;
    kl->hb.w = nullptr;
    kl->dev = tkd_kl_cuda_batch{};
    kl->dev.n = hb->n, kl->dev.d = hb->d, kl->dev.v = hb->v;
    if (p->dense) { /* device bf16 already; validation reads only the labels (tkd_kl_validate_scratch) */
        kl->dev.teacher_h = reinterpret_cast<cbf>(hb->teacher_h);
        kl->dev.teacher_w = reinterpret_cast<cbf>(hb->teacher_w);
        kl->dev.teacher_d = hb->teacher_d;
    }
    const int64_t n = hb->n;
    TKD_TRY(kl_stage_section(c, kl, 0, hb->topk_idx, n, kl->k, &kl->hb.topk_idx, &kl->dev.topk_idx));
    TKD_TRY(kl_stage_section(c, kl, 1, hb->topk_logit, n, kl->k, &kl->hb.topk_logit, &kl->dev.topk_logit));
    TKD_TRY(kl_stage_section(c, kl, 2, hb->teacher_lse, n, 1, &kl->hb.teacher_lse, &kl->dev.teacher_lse));
    TKD_TRY(kl_stage_section(c, kl, 3, hb->tail_idx, n, s, &kl->hb.tail_idx, &kl->dev.tail_idx));
    TKD_TRY(kl_stage_section(c, kl, 4, hb->labels, n, 1, &kl->hb.labels, &kl->dev.labels));
    TKD_CUDA_CHECK(cudaEventRecord(kl->staged, c->copy));
    return TKD_OK;
}

/* The loss's stream (the legacy default stream) waits for the compute stream and the batch copy. */
tkd_status kl_order(CudaImpl *c, tkd_backend_kl *kl)
{
    TKD_CUDA_CHECK(cudaEventRecord(kl->ready, c->stream));
    TKD_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(0), kl->ready, 0));
    TKD_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(0), kl->staged, 0));
    return TKD_OK;
}

tkd_status cu_kl_forward(tkd_backend *be, tkd_backend_kl *kl, const tkd_kl_params *p, const void *h, const void *w,
                         tkd_kl_result *res, float *dh, float *dw)
{
    TKD_TRY(tkd_kl_validate_scratch(p, &kl->hb, kl->seen));
    TKD_TRY(kl_order(impl(be), kl));
    kl->dev.h = static_cast<cbf>(h);
    kl->dev.w = static_cast<cbf>(w);
    return tkd_kl_cuda_forward(kl->ws, p, &kl->dev, res, dh, dw);
}

tkd_status cu_kl_backward(tkd_backend *be, tkd_backend_kl *kl, const tkd_kl_params *p, const void *h, const void *w,
                          float scale, float *dh, float *dw)
{
    TKD_TRY(kl_order(impl(be), kl));
    kl->dev.h = static_cast<cbf>(h);
    kl->dev.w = static_cast<cbf>(w);
    return tkd_kl_cuda_backward(kl->ws, p, &kl->dev, scale, dh, dw);
}

/* ---- timing marks ---- */

/* c->marks grown (by doubling) to hold index i, the new ones made as timing events. */
tkd_status marks_fit(CudaImpl *c, int64_t i)
{
    if (i < c->marks_n)
        return TKD_OK;
    int64_t n = c->marks_n ? c->marks_n : 256;
    while (n <= i)
        n *= 2;
    cudaEvent_t *m = static_cast<cudaEvent_t *>(realloc(c->marks, sizeof(cudaEvent_t) * (size_t)n));
    if (!m)
        return tkd_error_set(TKD_ERR_NOMEM, "backend marks: out of memory for %lld", (long long)n);
    c->marks = m;
    for (; c->marks_n < n; c->marks_n++)
        TKD_CUDA_CHECK(cudaEventCreate(&c->marks[c->marks_n]));
    return TKD_OK;
}

/* Mark i = an event recorded on the compute stream: read back only by cu_mark_ms. */
tkd_status cu_mark(tkd_backend *be, int64_t i)
{
    CudaImpl *c = impl(be);
    if (i < 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "backend mark: index %lld", (long long)i);
    TKD_TRY(marks_fit(c, i));
    TKD_CUDA_CHECK(cudaEventRecord(c->marks[i], c->stream));
    return TKD_OK;
}

tkd_status cu_mark_ms(tkd_backend *be, int64_t a, int64_t b, double *ms)
{
    CudaImpl *c = impl(be);
    if (a < 0 || b < 0 || a >= c->marks_n || b >= c->marks_n)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "backend mark: %lld or %lld was never recorded", (long long)a,
                             (long long)b);
    float f = 0.0f;
    TKD_CUDA_CHECK(cudaEventSynchronize(c->marks[b]));
    TKD_CUDA_CHECK(cudaEventElapsedTime(&f, c->marks[a], c->marks[b]));
    *ms = f;
    return TKD_OK;
}

static tkd_status cu_mem_info(tkd_backend *be, size_t *free_bytes, size_t *total_bytes)
{
    (void)be; /* the backend's device is the current one */
    return tkd_cuda_mem_info(free_bytes, total_bytes);
}

const tkd_backend_ops cuda_ops = {
    cu_close,
    cu_alloc, cu_free, cu_host_alloc, cu_host_free, cu_upload, cu_download, cu_upload_f32, cu_download_f32,
    cu_memset0, cu_sync,
    cu_embedding_fwd, cu_rmsnorm_fwd, cu_add_rmsnorm_fwd, cu_rmsnorm_act_fwd, cu_linear_fwd, cu_rope_fwd, cu_attn_fwd,
    cu_attn_saved_bytes, cu_swiglu_fwd,
    cu_embedding_bwd, cu_rmsnorm_bwd, cu_linear_bwd, cu_rope_bwd, cu_attn_bwd, cu_swiglu_bwd,
    cu_lmhead_topk, cu_lmhead_chunk_rows,
    cu_f32_to_act, cu_act_to_f32, cu_adamw_create, cu_adamw_free, cu_adamw_step, cu_master_upload, cu_master_download,
    cu_grad_norm2, cu_grad_scale,
    cu_kl_create, cu_kl_free, cu_kl_stage, cu_kl_forward, cu_kl_backward,
    cu_moe_create, cu_moe_free, cu_moe_fwd,
    cu_mark, cu_mark_ms,
    cu_mem_info,
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
    TKD_TRY(tkd_cuda_malloc(reinterpret_cast<void **>(&c->norm2), sizeof(double), "gradient norm", nullptr));
    TKD_TRY(tkd_cuda_malloc_host(reinterpret_cast<void **>(&c->h_norm2), sizeof(double), "gradient norm"));
    TKD_TRY(tkd_cuda_malloc_host(reinterpret_cast<void **>(&c->h_wait_err), sizeof(unsigned), "wait flag"));
    if (c->pol.cudnn && tkd_cudnn_attn_create(&c->cudnn) != TKD_OK) {
        c->cudnn = nullptr; /* no cuDNN: our attention kernels serve alone */
        tkd_error_clear();
    }
    if (c->cudnn && c->pol.cudnn_bwd_nondet) /* to measure what determinism costs */
        tkd_cudnn_attn_set_bwd_nondet(c->cudnn, 1);
    return tkd_cuda_malloc(reinterpret_cast<void **>(&c->stage), kStageFloats * sizeof(float), "upload staging",
                           nullptr);
}

} // namespace

extern "C" tkd_status tkd_backend_cuda_open(int gpu, const tkd_cuda_policy *pol, tkd_backend **out)
{
    *out = nullptr;
    tkd_cuda_policy chosen;
    if (pol)
        chosen = *pol;
    else
        TKD_TRY(tkd_cuda_policy_from_env(&chosen, nullptr));
    tkd_backend *be = static_cast<tkd_backend *>(calloc(1, sizeof *be));
    CudaImpl *c = new (std::nothrow) CudaImpl;
    if (!be || !c) {
        free(be);
        delete c;
        return tkd_error_set(TKD_ERR_NOMEM, "backend: out of memory");
    }
    c->gpu = gpu;
    c->pol = chosen;
    be->policy = &c->pol;
    be->device = TKD_DEVICE_CUDA;
    be->name = "cuda";
    be->act_size = 2;
    be->master_lo_size = sizeof(int16_t);
    be->host_addressable = 0;
    be->data_parallel = 1;
    be->attn_window = 1;     /* attn_fwd_window */
    be->attn_window_bwd = 1; /* cu_attn_bwd: our flash (or simple) backward's masked variant */
    be->attn_docs = 1;       /* attn_fwd_window */
    be->attn_docs_bwd = 1;   /* the same */
    be->moe_mxfp4 = 1;       /* moe_cuda.h decodes MXFP4 experts inside its Hopper GEMM, else a layer at a time */
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

extern "C" void *tkd_backend_cuda_stream(tkd_backend *be)
{
    /* the op table, not be->device: a profiling wrapper (kernels/backend_profile.c) copies the
     * device but its impl is not ours */
    return be && be->op == &cuda_ops ? static_cast<void *>(stream_of(be)) : nullptr;
}
