/* kl_loss_cuda.h — the fused chunked LM-head + top-K distillation loss on a CUDA device.
 *
 * Same maths and structs as kernels/loss/kl_loss.h (docs/loss.md), every kd.divergence (the per-bucket
 * terms are kl_divergence.h's, shared with the CPU path); this is the H200 path. H (N, D) and
 * W (V, D) live on the device as bf16; per chunk of C rows the logits H_c Wᵀ come from a cuBLAS bf16
 * GEMM with fp32 accumulation into ONE fp32 chunk buffer (C, V) held by the workspace; row kernels
 * compute the log-sum-exps at τ and at 1 in one online pass, gather the k' teacher columns, write
 * one loss per row to a device array, and (backward) turn the chunk into ∂loss/∂s in place as bf16;
 * then dH_c = dS W and dW += dSᵀ H_c (bf16 operands, fp32 accumulation and fp32 outputs).
 * Gradient dtypes: dH (N, D) fp32 and dW (V, D) fp32, both device memory.
 * On compute capability 9.0 with D a multiple of 8 the logits GEMM is our own
 * (kernels/gemm_sm90/lmhead_sm90.h) and its epilogue does the row work (docs/loss.md, "the fused path"): in
 * recompute's forward the per-row statistics and the gather of the special columns, so no logits
 * are written; where the gradient's dense part is one softmax (τ = 1, α = 1 or α = 0) also the
 * gradient tile as bf16 exps, scaled per row in dH and dW, in both modes; those chunks hold up to
 * twice the rows (tkd_kl_cuda_ws_chunk_rows is the fp32 chunk). Otherwise (two softmaxes) the fp32
 * logits chunk makes the gradient, and in grad_in_forward also the statistics. Variant `tail` keeps cuBLAS. TKD_KL_FUSED=0 in the environment
 * when the workspace is made turns the fused path off, TKD_KL_SM90=0 forces cuBLAS (the fallback
 * and the reference).
 *
 * All work runs on the legacy default stream (stream 0) of the current device, so a caller's
 * cudaMemset/cudaMemcpy before or after is ordered with it. Nothing synchronises with the host
 * inside the chunk loop: forward reduces the loss on the device and makes one copy out at the end;
 * backward synchronises once at its end so that a device error is reported by the call that made it.
 * Device out-of-memory is TKD_ERR_DEVICE_OOM, other CUDA/cuBLAS failures TKD_ERR_DEVICE; a bad
 * teacher index / label / non-finite teacher value found on the device is TKD_ERR_FORMAT naming
 * the first bad row.
 *
 * Dense mode (tkd_kl_params.dense, kd.teacher; kl_loss_cuda_dense.cu): the batch carries the
 * teacher's bf16 hidden states and LM head instead of cache columns; per chunk the teacher's logits
 * Ht_c Wtᵀ come from a second cuBLAS GEMM into a second fp32 chunk buffer, and a row kernel takes
 * every divergence against the teacher's full distribution (the CPU path's k = V renorm), its
 * gradient written in place as bf16 dS as above.
 *
 * The row kernels run one fixed launch shape, the measured best (kernels/loss/kl_loss_cuda_internal.h
 * says which and why; the benchmark's per-stage timings and GEMM floor live in bench/).
 *
 * This header has no CUDA types: it is includable from C and compiled in every build. Without the
 * CUDA backend (TKD_HAVE_CUDA undefined) the functions are not defined; check
 * tkd_backend_cuda_built() / #ifdef TKD_HAVE_CUDA before calling them.
 */
#ifndef TKD_KL_LOSS_CUDA_H
#define TKD_KL_LOSS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/cuda/cuda_policy.h"
#include "kernels/loss/kl_loss.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Limits of the row kernels' shared memory (per row: k' teacher columns and S tail draws). */
#define TKD_KL_CUDA_MAX_K 1024
#define TKD_KL_CUDA_MAX_S 1024

/* One batch of rows, all pointers device memory (the device twin of tkd_kl_batch). */
typedef struct tkd_kl_cuda_batch {
    int64_t n;                 /* N rows */
    int d;                     /* D hidden size */
    int v;                     /* V vocabulary size */
    const uint16_t *h;         /* (N, D) bf16 student hidden states */
    const uint16_t *w;         /* (V, D) bf16 LM-head weight */
    const int32_t *topk_idx;   /* (N, k) teacher top-k ids, largest logit first */
    const float *topk_logit;   /* (N, k) teacher raw logits */
    const float *teacher_lse;  /* (N) log Σ_v exp(t_v / τ_cache) over the full vocabulary */
    const int32_t *tail_idx;   /* (N, s) tail draws (sampled), or NULL */
    const int32_t *labels;     /* (N) next-token ids; ignore_index excludes the row */
    const uint16_t *teacher_h; /* params.dense: (N, Dt) bf16 the teacher's final hidden states */
    const uint16_t *teacher_w; /* params.dense: (V, Dt) bf16 the teacher's LM head */
    int teacher_d;             /* params.dense: Dt */
} tkd_kl_cuda_batch;

/* Workspace: the cuBLAS handle and its workspace, the chunk buffer, per-row statistics (N max),
 * and on sm_90 our GEMM's workspace, its statistics partials and the fused path's per-row buffers
 * (special-column lists, references, sigma, the scaled hidden states), sized for its chunks.
 * Sized once; reused every step; one workspace per thread (it owns a cuBLAS handle). */
typedef struct tkd_kl_cuda_ws tkd_kl_cuda_ws;

/* Rows per chunk that tkd_kl_cuda_ws_create picks when p->chunk_rows == 0: the fp32 chunk buffer
 * aims at 1 GiB (C · V · 4 bytes), C a multiple of 128, at least 128, at most N rounded up to 128. */
int tkd_kl_cuda_default_chunk_rows(int64_t n_max, int v);

/* Allocates a workspace on the current device for batches of up to n_max rows of (D, V).
 * p->chunk_rows (0 = default) fixes the chunk; the rest of p is read per call. pol (NULL: the
 * defaults) picks the paths: kl_sm90, kl_fused, kl_grad, lmhead_sched (cuda_policy.h). On success *out is
 * owned by the caller (tkd_kl_cuda_ws_free). TKD_ERR_DEVICE_OOM when the device is too full.
 * Every p->divergence runs (docs/loss.md, "Divergences"). With p->dense (the teacher online) the
 * workspace also holds the teacher's fp32 logits chunk, the default chunk sized so that both chunk
 * buffers share the 1 GiB target, and dense calls run cuBLAS and kl_loss_cuda_dense.cu's row
 * kernel (batches with teacher_h / teacher_w); a dense call on a workspace made without it is
 * TKD_ERR_INVALID_ARG. */
tkd_status tkd_kl_cuda_ws_create(tkd_kl_cuda_ws **out, const tkd_kl_params *p, const tkd_cuda_policy *pol,
                               int64_t n_max, int d, int v);
void tkd_kl_cuda_ws_free(tkd_kl_cuda_ws *ws); /* NULL is a no-op */

/* Rows per fp32-logits chunk (the fused path cuts up to twice as many: tkd_kl_cuda_chunk_for in
 * kl_loss_cuda_internal.h). */
int tkd_kl_cuda_ws_chunk_rows(const tkd_kl_cuda_ws *ws);

/* Forward over a device batch: res gets the mean loss over kept rows and its KD and CE parts; the
 * per-row log-sum-exps stay in ws for backward. With p->grad_in_forward, also dh (N, D) fp32 is
 * overwritten with ∂loss/∂H and dw (V, D) fp32 accumulated (+=) with ∂loss/∂W, or overwritten with
 * p->dw_overwrite (device pointers; may be NULL otherwise). Synchronises once (the result copy). */
tkd_status tkd_kl_cuda_forward(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                               const tkd_kl_cuda_batch *b, tkd_kl_result *res, float *dh,
                               float *dw);

/* Backward (recompute mode), after tkd_kl_cuda_forward on the same batch: dh (N, D) overwritten
 * with ∂(scale·loss)/∂H, dw (V, D) accumulated (+=) with ∂(scale·loss)/∂W (overwritten with
 * p->dw_overwrite); device fp32 pointers.
 * With p->grad_in_forward it does nothing (forward made the gradients of grad_scale·loss) and
 * only checks that scale == p->grad_scale, as the CPU path does. */
tkd_status tkd_kl_cuda_backward(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                const tkd_kl_cuda_batch *b, float scale, float *dh, float *dw);

/* ---- a host batch on the device -------------------------------------------------------------- */

/* Copies a host batch to the device: h and w (with p->dense also teacher_h and teacher_w, and then
 * no cache columns) rounded to bf16 (round to nearest even, as common/half.h), the rest as is. On
 * success out owns device memory (tkd_kl_cuda_batch_free). */
tkd_status tkd_kl_cuda_batch_upload(tkd_kl_cuda_batch *out, const tkd_kl_params *p,
                                    const tkd_kl_batch *hb);
void tkd_kl_cuda_batch_free(tkd_kl_cuda_batch *b); /* frees what batch_upload allocated */

#ifdef __cplusplus
}
#endif

#endif /* TKD_KL_LOSS_CUDA_H */
