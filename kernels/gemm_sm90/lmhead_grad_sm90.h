/* lmhead_grad_sm90.h — our own Hopper (sm_90a) GEMMs for the LM head's gradients in the fused KL
 * loss (issue 13): the loss's gradient tile arrives as bf16 E (rows, V) with dS = sigma_i · E_iv
 * (kernels/loss/kl_loss_cuda_fused.cu), and
 *   dH (rows, D) fp32  = sigma ⊙ (E · W)      (row i scaled by sigma_i in the epilogue),
 *   dW (V, D)    fp32 (+)= Eᵀ · X             (X = sigma ⊙ H as bf16; added to dW in the epilogue,
 *                                              or written over it),
 * so neither needs a separate scaling pass and dW's fp32 accumulation across chunks happens while
 * the tile is in registers. The same pipeline as the logits GEMM (kernels/gemm_sm90/lmhead_sm90.cu:
 * persistent CTAs, a TMA producer, two consumer warpgroups, cooperative or ping-pong); E, W and X
 * enter shared memory as they lie in memory, the wgmma transpose flags read them K- or MN-major.
 * Each output element is summed in one fixed order, whatever the grid: results are bit-identical
 * for any CTA count (tests check it).
 *
 * Limits: compute capability 9.0 (TKD_ERR_UNSUPPORTED elsewhere: fall back to cuBLAS); D a multiple
 * of 8; lde ≥ V and a multiple of 8 (16-byte row strides for the TMA); e, w, x 16-byte aligned, dh
 * and dw 8-byte aligned (dW's L2 prefetch runs only where dw is 16-byte aligned);
 * 1 ≤ rows, V < 2^31. The functions take the logits GEMM's workspace (kernels/gemm_sm90/lmhead_sm90.h: its
 * error flag, grid cap and stream). Asynchronous on the workspace's stream; a stalled pipeline sets the
 * workspace's error flag (tkd_lmhead_sm90_sync reports it) instead of hanging.
 *
 * Header usable from C; defined only in CUDA builds (TKD_HAVE_CUDA).
 */
#ifndef TKD_LMHEAD_GRAD_SM90_H
#define TKD_LMHEAD_GRAD_SM90_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dh (rows, D) fp32 = sigma[i] · Σ_v e[i, v] · w[v, :]; e (rows, lde) bf16, w (V, D) bf16, sigma
 * (rows) fp32, dh dense (leading dimension D). */
tkd_status tkd_lmhead_grad_sm90_dh(tkd_lmhead_sm90_ws *ws, const uint16_t *e, int64_t lde, const uint16_t *w,
                              int64_t rows, int d, int v, const float *sigma, float *dh);

/* dw (V, D) fp32 += Σ_i e[i, :]ᵀ · x[i, :] (accumulate ≠ 0), or = (accumulate = 0: dw's old contents,
 * NaN included, are never read); e (rows, lde) bf16, x (rows, D) bf16. */
tkd_status tkd_lmhead_grad_sm90_dw(tkd_lmhead_sm90_ws *ws, const uint16_t *e, int64_t lde, const uint16_t *x,
                              int64_t rows, int d, int v, float *dw, int accumulate);

#ifdef __cplusplus
}
#endif

#endif /* TKD_LMHEAD_GRAD_SM90_H */
