/* kl_bench_cuda.h — the CUDA side of bench/kl_bench.c (bench/kl_bench_cuda.cu, built into the
 * kl_bench target only): the GEMM floor the fused KL loss is measured against, per-stage device
 * times, the row kernels' launch shape for a sweep, and random device data.
 *
 * Everything here drives the product's own per-chunk stages (kernels/loss/kl_loss_cuda_internal.h), so
 * the floor runs exactly the GEMMs tkd_kl_cuda_forward/backward run and the profile times exactly
 * their stages. No CUDA types: kl_bench.c is C.
 */
#ifndef TKD_KL_BENCH_CUDA_H
#define TKD_KL_BENCH_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/loss/kl_loss.h"
#include "kernels/loss/kl_loss_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The plain GEMMs the method must do, with the same shapes, dtypes, layouts and chunking and
 * nothing else: per chunk the logits GEMM (twice when recompute), dS·W and dSᵀ·H_c (beta = 1;
 * 0 in the first chunk with overwrite, as the loss does with tkd_kl_params.dw_overwrite).
 * ds (C, 2·ldl) bf16 device is a caller-filled stand-in for dS, ideally random
 * (tkd_kl_bench_ds_elems gives its size in bf16 elements); dh (N, D), dw (V, D) fp32 device.
 * Synchronises at the end. */
tkd_status tkd_kl_bench_gemm_floor(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int recompute,
                                   const uint16_t *ds, float *dh, float *dw, int overwrite);
size_t tkd_kl_bench_ds_elems(const tkd_kl_cuda_ws *ws);

/* The dense mode's (the teacher online) plain GEMMs in its chunks (ws made with dense): per chunk
 * the two logits GEMMs H_c Wᵀ and Ht_c Wtᵀ (kind LOGITS: that is all, forward's floor; RECOMPUTE:
 * twice, forward and backward), then with GIF and RECOMPUTE dS·W and dSᵀ·H_c from the stand-in
 * ds as tkd_kl_bench_gemm_floor. Synchronises at the end. */
enum { TKD_KL_BENCH_DENSE_LOGITS = 0, TKD_KL_BENCH_DENSE_GIF = 1, TKD_KL_BENCH_DENSE_RECOMPUTE = 2 };
tkd_status tkd_kl_bench_dense_floor(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int kind, const uint16_t *ds,
                                    float *dh, float *dw, int overwrite);

/* Per-stage device time (ms, summed over chunks) of one recompute forward + backward and one
 * grad_in_forward forward (gradients of 1·loss), on the path ws takes (the logits stages are the
 * sm90 GEMM with its fused statistics + their combine where tkd_kl_cuda_sm90_on; on the fused path
 * also the special-column lists; its dH stage includes scaling dH, its dW stage scaling H). Indices
 * of ms: */
enum {
    TKD_KL_BENCH_PROF_LOGITS_FWD = 0, TKD_KL_BENCH_PROF_STATS_ROWS = 1,
    TKD_KL_BENCH_PROF_LOGITS_BWD = 2, TKD_KL_BENCH_PROF_GRAD_ROWS = 3,
    TKD_KL_BENCH_PROF_DH_GEMM = 4, TKD_KL_BENCH_PROF_DW_GEMM = 5,
    TKD_KL_BENCH_PROF_GIF_LOGITS = 6, TKD_KL_BENCH_PROF_GIF_ROWS = 7,
    TKD_KL_BENCH_PROF_GIF_DH_GEMM = 8, TKD_KL_BENCH_PROF_GIF_DW_GEMM = 9,
    TKD_KL_BENCH_PROF_STAGES = 10,
};
tkd_status tkd_kl_bench_profile(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                const tkd_kl_cuda_batch *b, float *dh, float *dw,
                                double ms[TKD_KL_BENCH_PROF_STAGES]);

/* The fused path on (1) or off (0) for this workspace (tkd_kl_cuda_ws_set_fused), and the rows
 * per chunk a call with p takes (grad: its gradient pass). */
tkd_status tkd_kl_bench_set_fused(tkd_kl_cuda_ws *ws, int on);
int tkd_kl_bench_chunk_for(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p, int grad, int64_t n);
/* 1 when a grad_in_forward call with p on ws takes the fused path (its row kernels read no logits). */
int tkd_kl_bench_fused_on(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p);

/* Row kernels' launch shape for this workspace (tkd_kl_cuda_ws_set_rows: threads x vec, 0 x 0 =
 * the product's). */
tkd_status tkd_kl_bench_set_rows(tkd_kl_cuda_ws *ws, int threads, int vec);

/* The LM head's logits pass alone over all N rows in ws's chunks (issue 13: our Hopper GEMM with
 * the statistics in its epilogue against what it replaces). Per chunk:
 *   CUBLAS:       cuBLAS's bf16 -> fp32 logits GEMM into ws's chunk buffer (the floor it replaces);
 *   CUBLAS_ROWS:  the same plus today's statistics row kernel (LSE at τ and at 1, the teacher's
 *                 top-k gather, the per-row loss: tkd_kl_cuda_chunk_rows in stats mode);
 *   SM90_STATS:   our GEMM with the statistics epilogue into part (3, chunk, ceil(V/256)), then the
 *                 combine into lse1 / lset (N) device;
 *   SM90_LOGITS_STATS: our GEMM writing the fp32 logits into ws's chunk buffer and the partials
 *                 in one pass, then the combine (the loss's forward pass on sm_90 when the
 *                 fused path is off);
 *   SM90_ROWS:    SM90_LOGITS_STATS plus the row kernel taking those LSEs (what replaces
 *                 CUBLAS_ROWS in the loss);
 *   SM90_LOGITS:  our GEMM with the fp32 epilogue into ws's chunk buffer (the GEMM core's speed);
 *   SM90_NONE:    our GEMM with no epilogue (the main loop alone: the epilogues cost the rest).
 * The SM90 kinds run lw's schedule (tkd_lmhead_sm90_ws_set_schedule). lw is NULL-able for the
 * cuBLAS kinds. Synchronises at the end; SM90 kinds report a pipeline timeout
 * (tkd_lmhead_sm90_sync). */
enum {
    TKD_KL_BENCH_LM_CUBLAS = 0, TKD_KL_BENCH_LM_CUBLAS_ROWS = 1,
    TKD_KL_BENCH_LM_SM90_STATS = 2, TKD_KL_BENCH_LM_SM90_LOGITS_STATS = 3,
    TKD_KL_BENCH_LM_SM90_ROWS = 4, TKD_KL_BENCH_LM_SM90_LOGITS = 5, TKD_KL_BENCH_LM_SM90_NONE = 6,
    TKD_KL_BENCH_LM_KINDS = 7,
};
struct tkd_lmhead_sm90_ws;
tkd_status tkd_kl_bench_lmhead(tkd_kl_cuda_ws *ws, struct tkd_lmhead_sm90_ws *lw,
                               const tkd_kl_params *p, const tkd_kl_cuda_batch *b, int kind,
                               float *part, float *lse1, float *lset);

/* Our LSEs (lse1, lset (N) device, from SM90_STATS) against the row kernel's (ws, from
 * CUBLAS_ROWS): the largest |difference| of each over N rows. And our fp32 logits against
 * cuBLAS's on the first 4 rows of chunk 0: the largest |difference| over the largest |logit|
 * (the chunk buffer is overwritten). */
tkd_status tkd_kl_bench_lmhead_check(tkd_kl_cuda_ws *ws, struct tkd_lmhead_sm90_ws *lw,
                                     const tkd_kl_cuda_batch *b, const float *lse1,
                                     const float *lset, double *max_d1, double *max_dt,
                                     double *logits_rel);

/* Runs forward/backward on ws with (1) or without (0) its sm90 GEMM: TKD_ERR_UNSUPPORTED when ws
 * has none (tkd_kl_cuda_ws_set_sm90). */
tkd_status tkd_kl_bench_set_sm90(tkd_kl_cuda_ws *ws, int on);

/* Fills n bf16 values at dev with a deterministic normal(0, std)-like sequence (random data, never
 * zeros). Asynchronous on the legacy default stream. */
tkd_status tkd_kl_bench_fill_bf16(uint16_t *dev, size_t n, uint64_t seed, float std);

#ifdef __cplusplus
}
#endif

#endif /* TKD_KL_BENCH_CUDA_H */
