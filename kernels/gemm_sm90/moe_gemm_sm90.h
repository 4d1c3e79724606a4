/* moe_gemm_sm90.h — the mixture-of-experts layer's expert GEMMs on Hopper (sm_90a), for moe_cuda.h:
 * every expert's product in one persistent launch of gemm_sm90/'s driver (gemm_sm90_pipe.cuh: TMA
 * producer, two consumer warpgroups running wgmma m64n256k16, cooperative or ping-pong), over rows
 * already sorted by expert and a list of M-tiles in kernels/moe.h's format (expert, first row,
 * rows, group), built by tkd_moe_gemm_tiles with tkd_moe_gemm_sm90_tile_rows(ws) rows a tile. Two
 * problems:
 *   gate_up: h (m, n) bf16 = act(bf16(x W_gate[e]ᵀ) + b_gate[e], bf16(x W_up[e]ᵀ) + b_up[e])
 *            with the activation in the epilogue, so G and U never reach memory: one output tile's
 *            B stage holds 128 rows of W_gate and the same 128 rows of W_up, and each thread then
 *            holds g and u of the same columns. The values are those of moe_cuda's act kernel over
 *            bf16 G and U (G and U are rounded to bf16 before the bias, as a bf16 linear layer's
 *            output would be); n is I, k is D.
 *   down:    o (m, n) bf16 = bf16(h W_down[e]ᵀ); n is D, k is I.
 * Each output element is one fp32 sum in a fixed order (no split-K, no atomics): bit-identical run
 * to run and for any grid. Rows of a listed tile past its `rows` or past m are loaded (they belong
 * to the next expert, or lie past m and are zero-filled) but never stored; rows not in any tile are
 * neither read nor written.
 *
 * Limits: compute capability 9.0 (TKD_ERR_UNSUPPORTED elsewhere: moe_cuda falls back to the mma.sync
 * kernel); n and k multiples of 8 (16-byte TMA row strides and stores); x, w and the output 16-byte
 * aligned.
 * Every tile's expert must index the stacks and its rows be at most the tile rows (the list is the
 * caller's, not checked). Asynchronous on ws's stream; a stalled pipeline sets ws's error flag
 * (tkd_lmhead_sm90_sync reports it).
 *
 * Header usable from C; defined only in CUDA builds.
 */
#ifndef TKD_MOE_GEMM_SM90_H
#define TKD_MOE_GEMM_SM90_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"
#include "kernels/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of one M-tile on ws's schedule: 128 cooperative, 64 ping-pong. */
int tkd_moe_gemm_sm90_tile_rows(const tkd_lmhead_sm90_ws *ws);

/* h (m, n) bf16 as above for the listed tiles; x (m, k), w_gate and w_up (E, n, k) bf16 row-major
 * stacks, b_gate and b_up (E, n) bf16 or NULL (zero); p gives E and the activation (act, limit,
 * alpha). */
tkd_status tkd_moe_gemm_sm90_gate_up(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const uint16_t *w_gate,
                                     const uint16_t *w_up, const uint16_t *b_gate, const uint16_t *b_up,
                                     const tkd_moe_params *p, const int32_t *tiles, int n_tiles, int m, int n, int k,
                                     uint16_t *h);

/* o (m, n) bf16 as above for the listed tiles; x (m, k), w (E, n, k) bf16 row-major. */
tkd_status tkd_moe_gemm_sm90_down(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const uint16_t *w, int E,
                                  const int32_t *tiles, int n_tiles, int m, int n, int k, uint16_t *o);

/* The same two products with the experts' weights as MXFP4 (kernels/moe.h's tkd_moe_mxfp4: kinds 0
 * W_gate and 1 W_up (E, n, k) for gate_up, 2 W_down (E, n, k) for down; codes (E, n, k / 2) bytes,
 * scales (E, n, k / 32)), decoded inside the GEMM: per K step the producer warp loads the tile's
 * codes (TMA) and scales (cp.async) into the stage, and the two consumer warpgroups decode them
 * into a bf16 B buffer one K step ahead of the wgmma that reads it, exactly the values
 * common/mxfp4_codec.h gives, so the output is bit for bit that of the bf16 launches over the
 * decoded stacks. Cooperative schedule only; also needs k a multiple of 64, the codes 16-byte and
 * the scales 4-byte aligned (TKD_ERR_UNSUPPORTED otherwise). */
tkd_status tkd_moe_gemm_sm90_gate_up_mxfp4(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const tkd_moe_mxfp4 *q,
                                           const uint16_t *b_gate, const uint16_t *b_up, const tkd_moe_params *p,
                                           const int32_t *tiles, int n_tiles, int m, int n, int k, uint16_t *h);
tkd_status tkd_moe_gemm_sm90_down_mxfp4(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const tkd_moe_mxfp4 *q, int E,
                                        const int32_t *tiles, int n_tiles, int m, int n, int k, uint16_t *o);

#ifdef __cplusplus
}
#endif

#endif /* TKD_MOE_GEMM_SM90_H */
