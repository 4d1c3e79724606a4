/* kl_loss_cuda_tuning.h — tuning hooks of the CUDA KL loss's workspace (kl_loss_cuda_internal.h)
 * for bench/ and tests/ only: which GEMM path a workspace takes and the row kernels' launch shape.
 * In library tkd_kernels_tuning (kernels/CMakeLists.txt); the product chooses through the CUDA
 * policy when it creates the workspace (tkd_kl_cuda_ws_create). Header usable from C; CUDA builds
 * only.
 */
#ifndef TKD_KL_LOSS_CUDA_TUNING_H
#define TKD_KL_LOSS_CUDA_TUNING_H

#include "common/status.h"
#include "kernels/loss/kl_loss_cuda_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bench/tests: use (1) or not (0) the sm90 GEMM on this workspace. TKD_ERR_UNSUPPORTED when ws
 * has none (another device, D % 8 != 0, or TKD_KL_SM90=0 when it was made). */
tkd_status tkd_kl_cuda_ws_set_sm90(tkd_kl_cuda_ws *ws, int on);

/* Bench/tests: allow (1) or not (0) the fused path on this workspace; TKD_ERR_UNSUPPORTED without
 * the sm90 GEMM. */
tkd_status tkd_kl_cuda_ws_set_fused(tkd_kl_cuda_ws *ws, int on);

/* Sets the row kernels' launch shape for this workspace only: threads per block and float4 loads
 * in flight per thread (vec 4: 128, 256 or 512 threads; vec 8: 128 or 256); (0, 0) restores
 * TKD_KL_CUDA_ROW_THREADS x TKD_KL_CUDA_ROW_VEC. TKD_ERR_INVALID_ARG for any other pair. */
tkd_status tkd_kl_cuda_ws_set_rows(tkd_kl_cuda_ws *ws, int threads, int vec);

#ifdef __cplusplus
}
#endif

#endif /* TKD_KL_LOSS_CUDA_TUNING_H */
