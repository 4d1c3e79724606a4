/* attn_cudnn.h — causal grouped-query attention forward through cuDNN 9's fused attention engine,
 * the same maths, layouts and lse as kernels/attn/attn_cuda.h (tkd_cuda_attn_fwd), for speed: cuDNN's
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
 * to the largest need of a plan that runs (at its first call, never in a steady loop). A shape no engine takes is
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
 * result as tkd_cuda_attn_bwd on zeroed gradients (what model_fwd_bwd.c passes). A workspace of
 * B·H·T fp32 (rowsum(dY ⊙ Y)) plus cuDNN's own is part of the state's one workspace. Errors and
 * fallbacks as tkd_cudnn_attn_fwd (TKD_ERR_UNSUPPORTED with cuDNN's reason: use tkd_cuda_attn_bwd).
 *
 * Workspace bound: cuDNN's deterministic engine keeps dS (or dP) of every (batch, head) in its
 * workspace for the separate dQ = dS·K product: cudnn-frontend names it the "dP workspace" and
 * sized it B·H·T²·2 bytes (T rounded up to 64) when it chose it itself (cuDNN 8.9); that is the
 * ~4 GiB measured for the 1B student at T 8192, and would be 48 GiB for the 3B one at T 32768 (the
 * plan reports the exact size: tkd_cudnn_attn_bwd_plan). When one call's workspace would
 * pass the state's budget (TKD_CUDNN_ATTN_BWD_BUDGET unless set otherwise), the backward runs as
 * several calls, each over gb batches × gk kv heads with their query heads (gb divides B, gk divides
 * Hkv, the largest gb·gk whose workspace fits; at worst one batch and one kv head), addressing the
 * same tensors at offsets with the full strides: no copies. The groups' plan prefers the one-call
 * plan's engine and knobs, so the results are the same bits where that engine computes each
 * (batch, head) alone, which tests/test_gpu_attn_cudnn_bwd.c checks. T not a multiple of 4 (lse
 * offsets not 16-byte aligned) always takes one call. */
tkd_status tkd_cudnn_attn_bwd(tkd_cudnn_attn *a, const uint16_t *dy, // (B·T, H·dh)
                              const uint16_t *q,                       // (B·T, H·dh)
                              const uint16_t *k, const uint16_t *v,    // (B·T, Hkv·dh) each
                              const uint16_t *y, const float *lse,     // (B·T, H·dh), (B, H, T)
                              int B, int T, int H, int Hkv, int dh,
                              uint16_t *dq,                            // (B·T, H·dh), written
                              uint16_t *dk, uint16_t *dv,              // (B·T, Hkv·dh), written
                              void *stream);

/* The default bound on cuDNN's workspace for one backward call, in bytes: 512 MiB keeps the 1B
 * student's attention backward at T 8192 (4 GiB in one call) to 8 calls of one kv head each, at the
 * cost of ~1.5 % of the H200's memory; smaller budgets would split into calls too small to fill the
 * GPU (one call of one kv head at 0.5B, T 4096 is 7 heads × 32 query tiles). */
#define TKD_CUDNN_ATTN_BWD_BUDGET ((size_t)512 << 20)

/* Sets the budget of tkd_cudnn_attn_bwd's workspace (0: no bound, always one call); each shape's
 * call size is chosen again at its next call. Tests lower it to make the backward group its calls. */
void tkd_cudnn_attn_set_bwd_budget(tkd_cudnn_attn *a, size_t bytes);

/* allow = 1: tkd_cudnn_attn_bwd builds the graph cudnn-frontend builds when determinism is not
 * asked for (dQ = dS·K summed over key tiles into an fp32 accumulator in our workspace, B·H·T·dh·4
 * bytes, zeroed before each call, then converted to bf16) and takes engines cuDNN notes
 * NONDETERMINISTIC; 0 (the default): deterministic engines only. Results are then not the same bits
 * from run to run, so a resumed training run is not bit-exact; this is here to measure what
 * determinism costs (TKD_CUDNN_BWD_NONDET=1 in the CUDA backend, bench/attn_bench's column). */
void tkd_cudnn_attn_set_bwd_nondet(tkd_cudnn_attn *a, int allow);

/* How tkd_cudnn_attn_bwd runs one shape. */
typedef struct tkd_cudnn_attn_bwd_info {
    int64_t ws_one_call; /* cuDNN's workspace of one call over the whole shape, bytes */
    int64_t ws_call;     /* cuDNN's workspace of the calls made (= ws_one_call when calls = 1) */
    int calls;           /* calls per backward, each over `batches` × `kv_heads` */
    int batches, kv_heads;
    int nondet;          /* the engine picked carries cuDNN's NONDETERMINISTIC note */
    int64_t engine;      /* the calls' engine (cuDNN's global index), one_call_engine the one call's */
    int64_t one_call_engine;
} tkd_cudnn_attn_bwd_info;

/* Builds (or finds) the plans tkd_cudnn_attn_bwd uses for this shape, without running them or
 * allocating their workspace, and says how it will run. Errors as tkd_cudnn_attn_bwd. */
tkd_status tkd_cudnn_attn_bwd_plan(tkd_cudnn_attn *a, int B, int T, int H, int Hkv, int dh,
                                   tkd_cudnn_attn_bwd_info *info);

#ifdef __cplusplus
}
#endif

#endif /* TKD_ATTN_CUDNN_H */
