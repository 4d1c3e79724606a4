/* lmhead_sm90_tuning.h — tuning hooks of the Hopper LM-head GEMMs (lmhead_sm90.h,
 * lmhead_grad_sm90.h) for the benchmarks and tests: a grid cap, the schedules, and the logits GEMM
 * with no epilogue. In library tkd_kernels_tuning, which only bench/ and tests/ link; the product
 * chooses through the CUDA policy (kernels/cuda/cuda_policy.h) when it creates the workspace.
 *
 * Header usable from C; defined only in CUDA builds (TKD_HAVE_CUDA).
 */
#ifndef TKD_LMHEAD_SM90_TUNING_H
#define TKD_LMHEAD_SM90_TUNING_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Caps the persistent grid at max_ctas CTAs (0: one per SM, the default). Tests use 1 to push
 * every tile through one CTA's pipeline. */
void tkd_lmhead_sm90_ws_set_max_ctas(tkd_lmhead_sm90_ws *ws, int max_ctas);

/* The schedule of later launches on ws (anything else than COOP is PINGPONG). */
void tkd_lmhead_sm90_ws_set_schedule(tkd_lmhead_sm90_ws *ws, tkd_lmhead_sm90_sched sched);

/* For the benchmark: the same GEMM with no epilogue (writes nothing: the accumulators feed a store
 * behind a run-time condition that never holds, so no wgmma can be dropped); its time is the main
 * loop's, so the epilogues' cost is the difference. */
tkd_status tkd_lmhead_sm90_mainloop(tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w,
                                    int64_t n, int d, int v);

/* The gradient GEMMs' schedule on ws: cooperative (128 x 256 tiles, both consumers on each) by
 * default, measured faster for both; TKD_LMHEAD_SM90_SCHED_PINGPONG forces ping-pong, anything else
 * restores the default. Results do not depend on it (tests check it bit for bit). */
void tkd_lmhead_grad_sm90_set_schedule(tkd_lmhead_sm90_ws *ws, int sched);

#ifdef __cplusplus
}
#endif

#endif /* TKD_LMHEAD_SM90_TUNING_H */
