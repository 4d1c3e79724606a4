/* attn_bwd_simple_cuda.h — the backward of causal grouped-query attention (kernels/attn/attn_cuda.h's
 * forward) by two simple kernels without tensor cores: the correct-first fallback for head sizes
 * the flash backward does not take (the demo students' 16 and 32) and a second reference for it.
 *
 * With s_ij = scale·q_i·k_j (scale 1/sqrt(dh)), P_ij = exp(s_ij − lse_i) recomputed from the
 * forward's log-sum-exp (never a (T, T) matrix), dP_ij = dy_i·v_j and δ_i = Σ_j P_ij dP_ij:
 *   dq_i += scale Σ_{j ≤ i} P_ij (dP_ij − δ_i) k_j
 *   dk_j += scale Σ_{h in j's group} Σ_{i ≥ j} P_ij (dP_ij − δ_i) q_i,   dv_j += Σ Σ P_ij dy_i
 * δ is computed from P and dP themselves (fp32), not as dy·y, so it does not inherit the bf16
 * rounding of the forward's output (nor cuDNN's bf16 P). One warp per query row (dq, δ), then one
 * warp per key row and kv head (dk, dv): every sum runs in a fixed order, so the results are
 * bit-identical run to run (no atomics). Work is O(T²·dh) per head pair with one query or key row
 * per warp: fine for the demo's and the tests' sizes, slow at T in the thousands.
 *
 * Layouts as the forward: q, dy, dq (B·T, H·dh); k, v, dk, dv (B·T, Hkv·dh); all bf16 (uint16_t bit
 * patterns), row n = b·T + t, query head h reading kv head h / (H / Hkv); lse (B, H, T) fp32 natural
 * log of the scaled scores (attn_cuda.h's and attn_cudnn.h's). dq, dk, dv are ADDED to (fp32 sum,
 * one bf16 rounding). delta: caller's scratch of tkd_cuda_attn_bwd_simple_ws_bytes(B, T, H).
 * Any dh ≤ 256; H a multiple of Hkv; T ≤ 2^31 − 1, H and B ≤ 65535. Asynchronous on `stream`.
 * Header usable from C; defined only in builds with the CUDA backend.
 */
#ifndef TKD_ATTN_BWD_SIMPLE_CUDA_H
#define TKD_ATTN_BWD_SIMPLE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/attn/attn_cuda.h" /* tkd_attn_mask */

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of the delta scratch: (B, H, T) fp32. */
size_t tkd_cuda_attn_bwd_simple_ws_bytes(int B, int T, int H);

/* y is accepted for the flash backward's signature and not read. */
tkd_status tkd_cuda_attn_bwd_simple(const uint16_t *dy,                    // (B·T, H·dh)
                                    const uint16_t *q,                     // (B·T, H·dh)
                                    const uint16_t *k, const uint16_t *v,  // (B·T, Hkv·dh) each
                                    const uint16_t *y,                     // (B·T, H·dh), unused
                                    const float *lse,                      // (B, H, T)
                                    int B, int T, int H, int Hkv, int dh,
                                    uint16_t *dq,                          // (B·T, H·dh) +=
                                    uint16_t *dk, uint16_t *dv,            // (B·T, Hkv·dh) += each
                                    float *delta,                          // (B, H, T) scratch
                                    void *stream);

/* The same under a window and packed documents (kernels/attn/attn_cuda.h's tkd_attn_mask; sinks
 * refused: no backward takes them), from the masked forward's lse: query i's sums run over the keys
 * it saw, key j's over the queries that saw it. NULL: plain causal (the bits of the function above).
 * The CUDA backend's masked backward for head sizes tkd_cuda_attn_bwd_masked (attn_cuda.h) does not
 * take, and a second GPU reference for it; checked by tests/test_gpu_attn_bwd_simple.c's masked
 * cases against float64. */
tkd_status tkd_cuda_attn_bwd_simple_masked(const uint16_t *dy, const uint16_t *q, const uint16_t *k,
                                           const uint16_t *v, const uint16_t *y, const float *lse, int B, int T,
                                           int H, int Hkv, int dh, const tkd_attn_mask *mask, uint16_t *dq,
                                           uint16_t *dk, uint16_t *dv, float *delta, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TKD_ATTN_BWD_SIMPLE_CUDA_H */
