/* moe_gemm_cuda.h — our grouped GEMM for the mixture-of-experts layer's experts (moe_cuda.h): every
 * expert's product in one launch, over rows already sorted by expert. mma.sync bf16 (sm_80 and
 * later), fp32 accumulation, each output rounded once to bf16 (round to nearest even, as cuBLAS's
 * bf16 output). Deterministic: each output element is one CTA's own fixed-order sum (no atomics,
 * no split-K).
 *
 * The work is a list of M-tiles, each a run of at most TKD_MOE_GEMM_TILE_M consecutive rows that
 * belong to one expert; the op builds it on the host from the routing's per-expert counts
 * (kernels/moe.h's tkd_moe_gemm_tiles) and uploads it each call. Rows not in any tile are neither
 * read nor written.
 *
 * Header usable from C; defined only in CUDA builds.
 */
#ifndef TKD_MOE_GEMM_CUDA_H
#define TKD_MOE_GEMM_CUDA_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TKD_MOE_GEMM_TILE_M TKD_MOE_TILE_M_MAX /* rows of one M-tile (the list's tile_m) */

/* For each listed tile {e, r, rows}, z in 0..nz−1 (nz = 2 when w1 and c1 are given, else 1):
 *   c_z[r + i, j] = bf16( Σ_{d<k} x[r + i, d] · w_z[e, j, d] )   for 0 ≤ i < rows, r + i < m, 0 ≤ j < n
 * x (m, k) bf16 row-major; w0, w1 (E, n, k) bf16 row-major stacks (expert e's matrix at e·n·k);
 * c0, c1 (m, n) bf16 row-major; tiles (n_tiles, TKD_MOE_TILE_INTS) int32 on the device, each expert index valid
 * for the stacks (not checked: the list is the caller's). Enqueued on stream (a cudaStream_t; NULL
 * the legacy stream). Gate and up in one launch: w0, w1 = W_gate, W_up; c0, c1 = G, U.
 * TKD_ERR_UNSUPPORTED naming the shape unless k and n are multiples of 8 and every pointer is
 * 16-byte aligned (the 16-byte loads); TKD_ERR_INVALID_ARG on a negative size, k < 1, more than
 * 65535 tiles (the grid's y) or only one of w1 and c1. n_tiles, m or n 0: nothing to do. */
tkd_status tkd_cuda_moe_gemm(const uint16_t *x, const uint16_t *w0, const uint16_t *w1, const int32_t *tiles,
                             int n_tiles, int m, int n, int k, uint16_t *c0, uint16_t *c1, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TKD_MOE_GEMM_CUDA_H */
