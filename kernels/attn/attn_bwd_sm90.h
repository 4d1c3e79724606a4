/* attn_bwd_sm90.h — the causal GQA attention backward on Hopper (sm_90a): wgmma tensor cores fed by
 * TMA, one fused kernel for dK, dV and dQ, deterministic (dQ's per-key-tile partials are added in a
 * fixed order, so every gradient element is the same sum in the same order on every run).
 * kernels/attn/attn_bwd_sm90.cu says how; the maths and layouts are tkd_cuda_attn_bwd's
 * (kernels/attn/attn_cuda.h). Workspace: the flash backward's (D and lse, B·H·T fp32 each) plus
 * fp32 dQ accumulators (B·H·T·dh) and per-64-row counters, which tkd_cuda_attn_bwd_ws_create makes
 * where this backward can run.
 *
 * dy, y, q (B·T, H·dh) and k, v (B·T, Hkv·dh) bf16, lse (B, H, T) the forward's natural-log
 * log-sum-exp of the scaled scores (what tkd_cuda_attn_fwd and tkd_cudnn_attn_fwd write); dq
 * (B·T, H·dh), dk, dv (B·T, Hkv·dh) bf16 are WRITTEN (overwritten, like tkd_cudnn_attn_bwd), all
 * three required. Roundings, those of tkd_cuda_attn_bwd: P = 2^(s·log2e/√dh − lse·log2e) in fp32,
 * dS = P·(dP − D) with D = Σ dy·y in fp32, P and dS rounded to bf16 as tensor-core operands, fp32
 * accumulation (the GQA group summed in fp32 inside a CTA; dq's partials of 128 keys each summed in
 * fp32 in key order), dq and dk scaled by 1/√dh in fp32 and each gradient rounded to bf16 once.
 *
 * Limits: compute capability 9.0 (elsewhere TKD_ERR_UNSUPPORTED: fall back to tkd_cuda_attn_bwd);
 * dh 64 or 128 (others TKD_ERR_UNSUPPORTED); H a multiple of Hkv; B, T ≥ 0 (0: nothing to do);
 * B and H each < 65536, T < 2^23; all pointers 16-byte aligned; ws from
 * tkd_cuda_attn_bwd_ws_create for at least (B, T, H) and this dh, on this device. Asynchronous on
 * `stream`. A pipeline wait that never completes (a bug, never by design) does not hang: it gives
 * up after seconds, sets the workspace's error flag and lets the kernel end with garbage;
 * tkd_cuda_attn_bwd_sm90_check reports it. Header usable from C; defined only in CUDA builds.
 */
#ifndef TKD_ATTN_BWD_SM90_H
#define TKD_ATTN_BWD_SM90_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/attn/attn_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* TKD_OK when this backward runs here for head dim dh: the current device is compute capability
 * 9.0 and dh is 64 or 128; else TKD_ERR_UNSUPPORTED saying which. */
tkd_status tkd_cuda_attn_bwd_sm90_supported(int dh);

tkd_status tkd_cuda_attn_bwd_sm90(const uint16_t *dy, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                  const uint16_t *y, const float *lse, int B, int T, int H, int Hkv, int dh,
                                  uint16_t *dq, uint16_t *dk, uint16_t *dv, tkd_cuda_attn_bwd_ws *ws,
                                  void *stream);

/* Synchronises the device and reports whether a backward launched on ws since the last check had a
 * pipeline wait time out (TKD_ERR_INTERNAL: its gradients are garbage); clears the flag. */
tkd_status tkd_cuda_attn_bwd_sm90_check(tkd_cuda_attn_bwd_ws *ws);

/* Tests only: the kernels' two wgmma paths on one tile, to tell a layout bug from a pipeline bug.
 * a, b (64, dh) bf16 row-major on the device; c1 (64, 64) = a·bᵀ through TMA, 128-byte swizzle and
 * K-major descriptors; c2 (64, dh) = bf16(c1)·b through register A fragments and an MN-major
 * descriptor; fp32, row-major. Synchronous (checks ws's wait flag). dh 64 or 128, as supported. */
tkd_status tkd_cuda_attn_bwd_sm90_probe(const uint16_t *a, const uint16_t *b, int dh, float *c1, float *c2,
                                        tkd_cuda_attn_bwd_ws *ws);

#ifdef __cplusplus
}
#endif

#endif /* TKD_ATTN_BWD_SM90_H */
