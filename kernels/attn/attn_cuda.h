/* attn_cuda.h — causal grouped-query attention on a CUDA device, flash-attention style: the
 * forward (below) and its backward (further down).
 *
 * y_i = Σ_{j ≤ i} softmax_j(q_i·k_j / sqrt(dh)) v_j per (batch, head), query head h reading kv head
 * h / (H / Hkv) in place (no K/V copies). One pass over key tiles with an online softmax in fp32,
 * bf16 tensor-core MMAs with fp32 accumulation; tiles wholly above the diagonal are skipped; the
 * (T, T) matrix never exists, so T is bounded only by memory for q, k, v, y. The maths is
 * kernels/cpu/cpu_ops.h's tkd_cpu_attn_fwd (the reference: tests/test_gpu_attn.c).
 *
 * Layouts: q (B·T, H·dh), k and v (B·T, Hkv·dh), y (B·T, H·dh), all bf16 (uint16_t bit patterns),
 * row n = b·T + t. lse (B, H, T) fp32 receives log Σ_j exp(s_ij) (natural log, scores already
 * scaled) for the backward pass; may be NULL. dh ∈ {48, 64, 80, 96, 128} (others:
 * TKD_ERR_UNSUPPORTED naming dh); H a multiple of Hkv. Asynchronous on `stream`. Header usable from
 * C; defined only in builds with the CUDA backend.
 */
#ifndef TKD_ATTN_CUDA_H
#define TKD_ATTN_CUDA_H

#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

tkd_status tkd_cuda_attn_fwd(const uint16_t *q, const uint16_t *k, const uint16_t *v, int B, int T,
                             int H, int Hkv, int dh, uint16_t *y, float *lse, void *stream);

/* What changes a query row's softmax beyond causality (issue 22's teachers; issue 23's packed
 * documents), each optional:
 *   window: a sliding window of `window` keys ending at the query's own: query i sees key j when
 *           i − window < j ≤ i (transformers' sliding_window; Mistral, Qwen2/3 with windows,
 *           gpt-oss's sliding layers). 0: every key j ≤ i.
 *   sinks:  (H) fp32 on the device, one learned logit per query head in the softmax's denominator,
 *           in the units of the scaled scores (gpt-oss's attention sinks):
 *           p_ij = exp(s_ij) / (exp(sink_h) + Σ_j' exp(s_ij')). The sink has no value (it only
 *           takes weight away from the keys), and lse includes it: log(exp(sink_h) + Σ_j exp(s_ij)).
 *           NULL: none.
 *   doc:    (B·T) int32 on the device: doc[b·T + i] is where query i's document starts in sequence
 *           b (≤ i, non-decreasing in i): the query sees no key before it (packed documents, a
 *           block-diagonal causal mask). NULL: one document per sequence. */
typedef struct tkd_attn_mask {
    int window;         /* 0 or the sliding window (keys i − window < j ≤ i) */
    const float *sinks; /* (H) fp32 or NULL */
    const int32_t *doc; /* (B·T) or NULL: where each query's document starts in its sequence (packed
                         * documents: no key before it; non-decreasing within a sequence, ≤ i) */
} tkd_attn_mask;

/* tkd_cuda_attn_fwd / tkd_cuda_attn_fwd_simple under mask (NULL: plain causal, the same bits as
 * the functions without it). window < 0 is TKD_ERR_INVALID_ARG. */
tkd_status tkd_cuda_attn_fwd_masked(const uint16_t *q, const uint16_t *k, const uint16_t *v, int B, int T,
                                    int H, int Hkv, int dh, const tkd_attn_mask *mask, uint16_t *y,
                                    float *lse, void *stream);
tkd_status tkd_cuda_attn_fwd_simple_masked(const uint16_t *q, const uint16_t *k, const uint16_t *v, int B,
                                           int T, int H, int Hkv, int dh, const tkd_attn_mask *mask,
                                           uint16_t *y, float *lse, void *stream);

/* The same maths by a simple kernel without tensor cores (one warp per query row, online softmax
 * over keys 32 at a time): any even dh ≤ 256. The fallback for head sizes the flash kernel does not
 * take (the test fixtures' 16, the demo's 32) and a second GPU reference for it. */
tkd_status tkd_cuda_attn_fwd_simple(const uint16_t *q, const uint16_t *k, const uint16_t *v, int B,
                                    int T, int H, int Hkv, int dh, uint16_t *y, float *lse,
                                    void *stream);

/* ---- backward ------------------------------------------------------------------------------
 *
 * The gradients of tkd_cuda_attn_fwd (flash-attention-2 style; kernels/attn/attn_bwd_cuda.cu): the
 * probabilities are recomputed tile by tile from q, k and the forward's lse, never stored. Three
 * launches on `stream`: D = rowsum(dy ⊙ y) and lse in log2 units into the workspace; one CTA per
 * (128-key tile, kv head, batch) accumulating dK and dV over every later query tile of every query
 * head of its group (so GQA sums in the CTA, in a fixed order); one CTA per (128-query tile, query
 * head, batch) recomputing the same scores for dQ. No atomics: two calls on the same inputs give
 * bit-identical gradients. The price is the second pass's recomputation of Q Kᵀ and dY Vᵀ: 7
 * tile matrix products per (query, key) pair instead of the 5 of an atomic dQ, 1.4× the FLOPs.
 *
 * dq (B·T, H·dh), dk and dv (B·T, Hkv·dh) are bf16 and ADDED to (g ← bf16(g + grad), one
 * rounding); any of them may be NULL (not computed). dy, y, q (B·T, H·dh), k, v (B·T, Hkv·dh)
 * bf16 as in the forward; y and lse (B, H, T) are what tkd_cuda_attn_fwd wrote for these q, k, v.
 * dh ∈ {48, 64, 80, 96, 128} (others: TKD_ERR_UNSUPPORTED naming dh); bf16 pointers 16-byte
 * aligned. ws from tkd_cuda_attn_bwd_ws_create with B·H·ceil(T / 128) no larger than at creation;
 * one workspace serves one stream at a time. */
typedef struct tkd_cuda_attn_bwd_ws tkd_cuda_attn_bwd_ws;

/* Allocates a workspace for backward calls up to (B, T, H) (fp32 D and lse, B·H·ceil(T/128)·128
 * of each: 8 MiB at B 1, T 32768, H 32). dh is checked (as the backward does) and reserved for an
 * fp32 dQ accumulator should an atomic dQ variant be added; the deterministic backward needs none.
 * On success *out is owned by the caller (tkd_cuda_attn_bwd_ws_free). */
tkd_status tkd_cuda_attn_bwd_ws_create(tkd_cuda_attn_bwd_ws **out, int B, int T, int H, int dh);
void tkd_cuda_attn_bwd_ws_free(tkd_cuda_attn_bwd_ws *ws); /* NULL is a no-op */

tkd_status tkd_cuda_attn_bwd(const uint16_t *dy, const uint16_t *q, const uint16_t *k,
                             const uint16_t *v, const uint16_t *y, const float *lse, int B, int T,
                             int H, int Hkv, int dh, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                             tkd_cuda_attn_bwd_ws *ws, void *stream);

/* tkd_cuda_attn_bwd under mask's window and documents: the gradients of tkd_cuda_attn_fwd_masked
 * (y and lse are what it wrote under the same mask), added to dq, dk, dv as there. The same kernels
 * built a second time with the mask: a 16 × 16 block of (query, key) pairs that the mask hides
 * wholly is skipped, one it hides in part is masked element by element, and key tiles before a query
 * tile's first visible key (query tiles past a key tile's last visible query) are never loaded, so
 * the work follows the visible pairs. Deterministic as the unmasked backward. mask NULL, or a window
 * of 0 or ≥ T with doc NULL: the unmasked kernels, bit for bit tkd_cuda_attn_bwd. Sinks:
 * TKD_ERR_UNSUPPORTED (no backward takes them: teachers only); window < 0: TKD_ERR_INVALID_ARG.
 * doc's starts must follow tkd_attn_mask's rule (≤ i, non-decreasing within a sequence). */
tkd_status tkd_cuda_attn_bwd_masked(const uint16_t *dy, const uint16_t *q, const uint16_t *k,
                                    const uint16_t *v, const uint16_t *y, const float *lse, int B,
                                    int T, int H, int Hkv, int dh, const tkd_attn_mask *mask,
                                    uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                    tkd_cuda_attn_bwd_ws *ws, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TKD_ATTN_CUDA_H */
