/* attn_cudnn.h — causal grouped-query attention forward through cuDNN 9's fused attention engine,
 * the same maths, layouts and lse as kernels/attn_cuda.h (tkd_cuda_attn_fwd), for speed: cuDNN's
 * Hopper kernels run the forward at about twice our flash kernel's rate.
 *
 * The operation is expressed in cuDNN's graph API (backend descriptors, no cudnn-frontend) as the
 * scaled-dot-product-attention pattern its runtime fusion engine recognises:
 *   S = Q·Kᵀ (fp32) → S·scale → causal mask (GEN_INDEX row ≥ col, else −inf) → softmax from
 *   max, sub, exp, sum, div (P in bf16) → Y = P·V;  stats = max + log(sum), the natural-log
 *   log-sum-exp of the scaled scores, i.e. exactly attn_cuda.h's lse (no conversion).
 * GQA by K and V having Hkv heads (cuDNN broadcasts the head dimension, H a multiple of Hkv).
 *
 * Layouts: q (B·T, H·dh), k and v (B·T, Hkv·dh), y (B·T, H·dh), all bf16 (uint16_t bit patterns),
 * row n = b·T + t; lse (B, H, T) fp32 or NULL. All device pointers, 16-byte aligned.
 *
 * Plans: the first call for a shape (B, T, H, Hkv, dh, lse or not) builds the operation graph,
 * asks cuDNN's heuristics (mode A, then FALLBACK) for engine configs and keeps the first execution
 * plan that finalizes, in a small table (least recently used replaced); one device workspace grows
 * to the largest plan's need (at plan build, never per call). A shape no engine takes is
 * TKD_ERR_UNSUPPORTED with cuDNN's message; the refusal is cached too, so asking again is cheap and
 * the caller falls back to tkd_cuda_attn_fwd. Any failure while building a plan other than device
 * out-of-memory is reported as TKD_ERR_UNSUPPORTED (so a cuDNN that rejects our graph degrades to
 * the fallback, with the reason in the message); failures at execution are TKD_ERR_DEVICE.
 *
 * Builds without cuDNN (CMake found no cudnn_graph.h / libcudnn): every function below exists and
 * create returns TKD_ERR_UNSUPPORTED saying so. Header usable from C; defined only in builds with
 * the CUDA backend.
 */
#ifndef TKD_ATTN_CUDNN_H
#define TKD_ATTN_CUDNN_H

#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One cuDNN handle (on the current device), the plan table and the workspace. Not thread-safe:
 * one caller at a time; any stream per call. */
typedef struct tkd_cudnn_attn tkd_cudnn_attn;

/* Makes the state (no plans yet). TKD_ERR_UNSUPPORTED when this build or the runtime has no cuDNN
 * (message says which); *out is NULL on failure. The caller frees it with tkd_cudnn_attn_free. */
tkd_status tkd_cudnn_attn_create(tkd_cudnn_attn **out);
void tkd_cudnn_attn_free(tkd_cudnn_attn *a); /* NULL is a no-op; waits for nothing */

/* y (and lse when not NULL) = causal GQA attention of q, k, v, scale 1/sqrt(dh), asynchronous on
 * `stream` (a cudaStream_t; NULL: the legacy default stream). dh a multiple of 8, ≤ 256 (others:
 * TKD_ERR_UNSUPPORTED naming dh, before cuDNN is asked); H a multiple of Hkv; B = 0 or T = 0 does
 * nothing. Errors: TKD_ERR_INVALID_ARG (bad shape, unaligned or NULL pointer), TKD_ERR_UNSUPPORTED
 * (cuDNN offers no engine: fall back), TKD_ERR_DEVICE_OOM (workspace), TKD_ERR_DEVICE. */
tkd_status tkd_cudnn_attn_fwd(tkd_cudnn_attn *a, const uint16_t *q, // (B·T, H·dh)
                              const uint16_t *k, const uint16_t *v,   // (B·T, Hkv·dh) each
                              int B, int T, int H, int Hkv, int dh,
                              uint16_t *y,                            // (B·T, H·dh)
                              float *lse,                             // (B, H, T) or NULL
                              void *stream);

/* The gradients of tkd_cudnn_attn_fwd / tkd_cuda_attn_fwd through cuDNN's fused attention backward,
 * as cudnn-frontend's sdpa_backward lowers it: P recomputed from q, k and the forward's lse, then
 * dV = Σgroup Pᵀ·dY, dP = dY·Vᵀ, dS = P ⊙ (dP − rowsum(dY ⊙ Y))·scale, dK = Σgroup dSᵀ·Q,
 * dQ = dS·K (GQA: dK and dV per query head, summed over the group in the graph). Deterministic by
 * construction where cuDNN allows it: dQ by its own matmul (no fp32 atomic accumulator, the
 * frontend's deterministic choice on Hopper) and engine configs noted NONDETERMINISTIC skipped.
 *
 * Layouts as tkd_cuda_attn_bwd (attn_cuda.h): dy, y, q, dq (B·T, H·dh); k, v, dk, dv
 * (B·T, Hkv·dh); lse (B, H, T) the natural-log stats of the forward. UNLIKE tkd_cuda_attn_bwd,
 * dq, dk and dv are WRITTEN (overwritten), not added to, and all three are required: the same
 * result as tkd_cuda_attn_bwd on zeroed gradients (what model.c passes). A workspace of
 * B·H·T fp32 (rowsum(dY ⊙ Y)) plus cuDNN's own is part of the state's one workspace. Errors and
 * fallbacks as tkd_cudnn_attn_fwd (TKD_ERR_UNSUPPORTED with cuDNN's reason: use tkd_cuda_attn_bwd). */
tkd_status tkd_cudnn_attn_bwd(tkd_cudnn_attn *a, const uint16_t *dy, // (B·T, H·dh)
                              const uint16_t *q,                       // (B·T, H·dh)
                              const uint16_t *k, const uint16_t *v,    // (B·T, Hkv·dh) each
                              const uint16_t *y, const float *lse,     // (B·T, H·dh), (B, H, T)
                              int B, int T, int H, int Hkv, int dh,
                              uint16_t *dq,                            // (B·T, H·dh), written
                              uint16_t *dk, uint16_t *dv,              // (B·T, Hkv·dh), written
                              void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TKD_ATTN_CUDNN_H */
