/* lmhead_sm90.h — our own Hopper (sm_90a) GEMM for the LM head's logits chunk, Z = H · Wᵀ, whose
 * epilogue can reduce each row while the tile is still in registers (issue 13). The CUDA KL loss
 * (kernels/loss/kl_loss_cuda_fused.cu) runs its chunks through the fused epilogues on compute capability 9.0
 * (logits_stats where the gradient needs the fp32 logits); teacher-dump can run its top-k through
 * tkd_lmhead_sm90_topk (opt-in).
 *
 * H (N, D) and W (V, D) are bf16 row-major on the device; accumulation is fp32 (wgmma). Three
 * epilogues:
 *   logits: Z (N, ldz) fp32 written out (verification against cuBLAS, and the GEMM core's speed);
 *   stats:  per row i and V-tile t (TKD_LMHEAD_SM90_BN columns) the partials
 *             m = max_v z_iv,  s1 = Σ_v exp(z_iv − m),  st = Σ_v exp((z_iv − m)/τ)
 *           into part, then tkd_lmhead_sm90_lse combines them into per-row log-sum-exps at scale 1
 *           and at scale 1/τ: lse1 = log Σ_v exp(z_v), lset = log Σ_v exp(z_v / τ); the fp32
 *           logits never reach device memory;
 *   logits_stats: both from the same accumulators in one pass (the loss's fallback for the
 *           two-softmax gradient: τ ≠ 1 with 0 < α < 1);
 *   fused: statistics, the gradient tile as bf16 exps and the gather of listed columns, in the
 *           combinations the loss runs (tkd_lmhead_sm90_fused_run below).
 * Every output element and partial is computed the same way whichever CTA or schedule runs its
 * tile, so results do not depend on the grid (tests check it bit for bit).
 *
 * Limits: compute capability 9.0 only (every launcher returns TKD_ERR_UNSUPPORTED elsewhere, so a
 * caller falls back to cuBLAS); D a multiple of 8 (TMA wants 16-byte row strides; a D that is not
 * a multiple of 64 runs a zero-filled last K tile); 1 ≤ N, V < 2^31; h and w 16-byte aligned.
 * All work runs on the legacy default stream; launchers do not synchronise. A kernel whose
 * pipeline stalls (a bug, never by design) does not hang: every wait is bounded (seconds), sets an
 * error flag and lets the kernel end with garbage; tkd_lmhead_sm90_sync reports it.
 *
 * Tuning hooks (a grid cap, the schedule, the bare main loop) are in lmhead_sm90_tuning.h, for
 * bench/ and tests/ only. Header usable from C; defined only in CUDA builds (TKD_HAVE_CUDA).
 */
#ifndef TKD_LMHEAD_SM90_H
#define TKD_LMHEAD_SM90_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Output tile: BM rows of H by BN rows of W (columns of Z) in the cooperative schedule; 64 x BN
 * in ping-pong. Partials are per BN columns in both. */
#define TKD_LMHEAD_SM90_BM 128
#define TKD_LMHEAD_SM90_BN 256

/* How the two consumer warpgroups share the work (lmhead_sm90.cu says more):
 *   PINGPONG (the default): each owns whole 64 x 256 tiles in alternation, so one runs its
 *     epilogue while the other's wgmma run (more W traffic from L2: W is loaded per 64 rows);
 *   COOP: both work on each 128 x 256 tile and run its epilogue together (tensor cores idle). */
typedef enum tkd_lmhead_sm90_sched {
    TKD_LMHEAD_SM90_SCHED_PINGPONG = 0,
    TKD_LMHEAD_SM90_SCHED_COOP = 1,
} tkd_lmhead_sm90_sched;

/* TKD_OK when the current device is compute capability 9.0, else TKD_ERR_UNSUPPORTED naming it. */
tkd_status tkd_lmhead_sm90_supported(void);

/* Workspace: the device error flag, the grid size and the schedule (sched: a tkd_lmhead_sm90_sched,
 * the CUDA policy's lmhead_sched; anything but COOP is PINGPONG). On success *out is owned by the
 * caller (tkd_lmhead_sm90_ws_free). TKD_ERR_UNSUPPORTED on devices other than compute capability 9.0. */
typedef struct tkd_lmhead_sm90_ws tkd_lmhead_sm90_ws;
tkd_status tkd_lmhead_sm90_ws_create(tkd_lmhead_sm90_ws **out, int sched); /* tkd_lmhead_sm90_sched */
void tkd_lmhead_sm90_ws_free(tkd_lmhead_sm90_ws *ws); /* NULL is a no-op */

/* V-tiles per row (ceil(V / BN)) and the floats part holds: 3 · N · tiles. */
int tkd_lmhead_sm90_vtiles(int v);
size_t tkd_lmhead_sm90_part_floats(int64_t n, int v);

/* z (N, ldz) fp32 = h (N, D) · w (V, D)ᵀ; columns [V, ldz) are not written. ldz ≥ V and even,
 * z 8-byte aligned. */
tkd_status tkd_lmhead_sm90_logits(tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w,
                                  int64_t n, int d, int v, float *z, int64_t ldz);

/* part (3, N, tiles) fp32: planes m, s1, st of each row's V-tiles (see above) for z = h wᵀ; τ > 0. */
tkd_status tkd_lmhead_sm90_stats(tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w,
                                 int64_t n, int d, int v, float tau, float *part);

/* Both from one pass: z as tkd_lmhead_sm90_logits, part as tkd_lmhead_sm90_stats. */
tkd_status tkd_lmhead_sm90_logits_stats(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                        const uint16_t *w, int64_t n, int d, int v, float tau,
                                        float *z, int64_t ldz, float *part);

/* The loss's fused passes (kernels/loss/kl_loss_cuda_fused.cu), z = h wᵀ never written. Which parts run
 * follows from what is set; the combinations built are statistics + gather (recompute forward),
 * exp + gather (recompute backward) and all three (grad_in_forward):
 *   part (stats): as tkd_lmhead_sm90_stats, at tau.
 *   e (exp): e (N, lde) bf16 = exp2(z · l2e_k − ref[i] · ref_scale), l2e_k =
 *       tkd_lmhead_sm90_exp_scale(tau, k_one) (log2 e, or log2 e / τ); with the statistics it
 *       reuses their exps. With ref = the row's log-sum-exp at that scale (ref_scale = log2 e) it is
 *       the softmax; with any ref ≤ max z it is the softmax up to a per-row factor, and finite
 *       while k · (max z − ref) < 88. lde ≥ V and even, e 4-byte aligned; columns [V, lde) untouched.
 *   gather (sp_off): g[i · sp_l + slot] = z[i, col] for every (col, slot) pair of row i's list
 *       sp_list[i · sp_l ..] (int pairs, sorted by col, 0 ≤ col < V), whose entries for V-tile t
 *       are [sp_off[i · (tiles + 1) + t], sp_off[i · (tiles + 1) + t + 1]). */
typedef struct tkd_lmhead_sm90_fused {
    float tau;
    float *part;
    uint16_t *e;
    int64_t lde;
    const float *ref;
    float ref_scale;
    int k_one;
    const int *sp_off;
    const int32_t *sp_list;
    int sp_l;
    float *g;
} tkd_lmhead_sm90_fused;

float tkd_lmhead_sm90_exp_scale(float tau, int k_one);
tkd_status tkd_lmhead_sm90_fused_run(tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w,
                                     int64_t n, int d, int v, const tkd_lmhead_sm90_fused *f);

/* lse1 (N), lset (N) fp32 from the partials of tkd_lmhead_sm90_stats with the same N, V, τ. */
tkd_status tkd_lmhead_sm90_lse(const float *part, int64_t n, int v, float tau, float *lse1,
                               float *lset);

/* The stream of later launches on ws (a cudaStream_t; NULL: the legacy default stream, as made). */
void tkd_lmhead_sm90_ws_set_stream(tkd_lmhead_sm90_ws *ws, void *stream);

/* The workspace's error flag on the device (one unsigned, non-zero after a pipeline wait timed
 * out): for a caller that reads it asynchronously instead of through tkd_lmhead_sm90_sync. */
const unsigned *tkd_lmhead_sm90_ws_error_flag(const tkd_lmhead_sm90_ws *ws);

/* Teacher-dump's LM head without its logits (issue 13): per row the top k of z = h wᵀ as
 * (id, raw logit), sorted by logit, ties by the smaller id (kernels/cpu/topk.h's order), and
 * lse = log Σ exp(z/τ). Two passes of the GEMM: the statistics epilogue (the LSE, and each 256-column
 * tile's max, whose k-th largest bounds the row's k-th logit from below), then a candidate epilogue
 * that keeps the logits at or above that bound (at least k, usually a few hundred), which a sort
 * per row reduces to the top k. Meant for small D and large V, where the GEMM is cheap against
 * writing and reading back N·V fp32 logits; measured, two passes still lose to one cuBLAS GEMM plus
 * the top-k kernel (docs/PERFORMANCE.md), so teacher-dump takes it only with TKD_TOPK_FUSED=1.
 * Exact unless flagged, in flags (2 unsigned, device; the caller
 * sets flags[0] = 0 and flags[1] = UINT_MAX before the first call): flags[0] counts rows with more
 * than cap candidates (their idx/val are not written), flags[1] is the first row holding a
 * non-finite logit; the caller then takes the logits path for those rows. scratch holds
 * tkd_lmhead_sm90_topk_bytes(n, v, cap) bytes (8-byte aligned); idx, val (n, k), lse (n) device.
 * k ≤ cap ≤ TKD_LMHEAD_SM90_TOPK_MAX_CAP. Asynchronous on ws's stream. */
#define TKD_LMHEAD_SM90_TOPK_MAX_CAP 8192
size_t tkd_lmhead_sm90_topk_bytes(int64_t n, int v, int cap);
tkd_status tkd_lmhead_sm90_topk(tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w,
                                int64_t n, int d, int v, int k, float tau, int cap, void *scratch,
                                unsigned *flags, uint32_t *idx, float *val, float *lse);

/* Waits for the device, then reports (and clears) a pipeline timeout of any earlier launch on ws:
 * TKD_ERR_INTERNAL when one happened, TKD_ERR_DEVICE for a CUDA error. */
tkd_status tkd_lmhead_sm90_sync(tkd_lmhead_sm90_ws *ws);

#ifdef __cplusplus
}
#endif

#endif /* TKD_LMHEAD_SM90_H */
