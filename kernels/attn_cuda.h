/* attn_cuda.h — causal grouped-query attention on a CUDA device, flash-attention style.
 *
 * y_i = Σ_{j ≤ i} softmax_j(q_i·k_j / sqrt(dh)) v_j per (batch, head), query head h reading kv head
 * h / (H / Hkv) in place (no K/V copies). One pass over key tiles with an online softmax in fp32,
 * bf16 tensor-core MMAs with fp32 accumulation; tiles wholly above the diagonal are skipped; the
 * (T, T) matrix never exists, so T is bounded only by memory for q, k, v, y. The maths is
 * kernels/cpu_ops.h's tkd_cpu_attn_fwd (the reference: tests/test_gpu_attn.c).
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

/* The same maths by a simple kernel without tensor cores (one warp per query row, online softmax
 * over keys 32 at a time): any even dh ≤ 256. The fallback for head sizes the flash kernel does not
 * take (the test fixtures' 16, the demo's 32) and a second GPU reference for it. */
tkd_status tkd_cuda_attn_fwd_simple(const uint16_t *q, const uint16_t *k, const uint16_t *v, int B,
                                    int T, int H, int Hkv, int dh, uint16_t *y, float *lse,
                                    void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TKD_ATTN_CUDA_H */
