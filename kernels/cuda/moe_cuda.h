/* moe_cuda.h — the mixture-of-experts layer on a CUDA device, forward only (teacher-dump's Qwen3-MoE
 * and gpt-oss teachers): the maths, layout and tie rule of kernels/cpu/cpu_moe.h (its reference is
 * tkd_ref_moe_fwd; tests/test_gpu_moe.c holds this path to it), bf16 weights and activations,
 * fp32 routing and accumulation.
 *
 * The steps, on the workspace's stream:
 *   1. router logits (N, E) fp32 = x Wᵣᵀ (+ bᵣ) by cuBLAS;
 *   2. routing, one warp per token: Qwen3-MoE's softmax over E then top-k (renormalised when
 *      norm_topk_prob) or gpt-oss's top-k of the logits then softmax over those k; ties to the
 *      lower expert index, as on the CPU;
 *   3. the (token, slot) pairs sorted by expert (CUB's stable radix sort: deterministic), the
 *      tokens' rows gathered in that order, and the per-expert counts copied to the host (the one
 *      synchronisation of a call: the GEMMs' shapes);
 *   4. per expert with rows: G and U (rows, I) bf16 = X_e W_gateᵀ, X_e W_upᵀ (fp32 accumulation,
 *      rounded once, as a bf16 linear layer in transformers), then h = act(G + b_g, U + b_u) in
 *      fp32, rounded to bf16, then O (rows, D) bf16 = h W_downᵀ. Our grouped GEMM does this in
 *      two launches (on Hopper the activation inside the first: G and U never reach memory), or
 *      cuBLAS in two grouped calls or a loop (see below);
 *   5. per token y = Σ_j w_j · (O_j + b_down) over its k slots in increasing expert order, fp32,
 *      rounded once to bf16.
 * Workspace (max_tokens · k rows): the gathered rows (D bf16), G, U and h (I bf16 each), O (D bf16):
 * about max_tokens · k · (4 D + 6 I) bytes; a caller with more tokens calls in chunks. Our
 * grouped GEMM's tile list adds 12 bytes per 128 rows and per expert, on the host and the device.
 * With params.mxfp4 the experts stay MXFP4: where the Hopper kernel runs them (AUTO or OURS on
 * compute capability 9.0, D and I multiples of 64, on the cooperative schedule: the default with
 * MXFP4 experts) it decodes them inside the GEMM, tile by tile;
 * elsewhere (or with tkd_cuda_moe_ws_set_mxfp4_layer) the op first decodes the layer's experts to a
 * bf16 copy, 6·E·I·D bytes (6.4 GB at gpt-oss-120b's shape) allocated on the first such call.
 * Either way the values are exact (an MXFP4 value is exact in bf16), so y is bit for bit the bf16
 * op's over the decoded experts (tests/test_gpu_moe.c: test_mxfp4_experts).
 *
 * Header usable from C; defined only in CUDA builds.
 */
#ifndef TKD_MOE_CUDA_H
#define TKD_MOE_CUDA_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One layer's weights on the device, bf16 bit patterns, in cpu_moe.h's layout. NULL bias: zero. */
typedef struct tkd_cuda_moe_weights {
    const uint16_t *router_w; /* (E, D) */
    const uint16_t *router_b; /* (E) or NULL */
    const uint16_t *w_gate;   /* (E, I, D) */
    const uint16_t *w_up;     /* (E, I, D) */
    const uint16_t *w_down;   /* (E, D, I) */
    const uint16_t *b_gate;   /* (E, I) or NULL */
    const uint16_t *b_up;     /* (E, I) or NULL */
    const uint16_t *b_down;   /* (E, D) or NULL */
    tkd_moe_mxfp4 q;          /* params.mxfp4: the experts as MXFP4 (w_gate/w_up/w_down unused), decoded
                               * exactly inside the GEMM or a layer at a time (above); each stack's codes
                               * 16-byte and scales 4-byte aligned (TKD_ERR_INVALID_ARG otherwise) */
} tkd_cuda_moe_weights;

/* A workspace for layers of shape p, up to max_tokens rows a call, running on stream (a
 * cudaStream_t; NULL the legacy stream). E ≤ 1024 and k ≤ 16 (TKD_ERR_UNSUPPORTED otherwise). On
 * success *out is owned by the caller (tkd_cuda_moe_ws_free). */
typedef struct tkd_cuda_moe_ws tkd_cuda_moe_ws;
tkd_status tkd_cuda_moe_ws_create(tkd_cuda_moe_ws **out, const tkd_moe_params *p, int max_tokens, void *stream);
void tkd_cuda_moe_ws_free(tkd_cuda_moe_ws *ws); /* NULL is a no-op */

/* How the experts' GEMMs run (cuda_policy.h's TKD_MOE_GEMM), tkd_cuda_moe_ws_set_grouped's argument:
 * GROUPED two grouped cuBLAS calls a layer; LOOP one GEMM per expert and projection; OURS our grouped
 * GEMM, two launches a layer (D and I multiples of 8, else tkd_cuda_moe_fwd returns its
 * TKD_ERR_UNSUPPORTED): on compute capability 9.0 the Hopper kernel with the activation in its
 * epilogue (gemm_sm90/moe_gemm_sm90.h), elsewhere the mma.sync one (moe_gemm_cuda.h); AUTO (the
 * default) ours where the Hopper kernel runs and D and I are multiples of 8, else chosen per call
 * from the routing's counts: cuBLAS grouped where the average expert's product is small (many small
 * GEMMs), else the loop (moe_cuda.cu's auto_grouped says where the line is and why). Other positive
 * values mean GROUPED, other negative ones AUTO. tkd_cuda_moe_ws_ran says which mode the last call
 * ran (LOOP, GROUPED or OURS), tkd_cuda_moe_ws_grouped whether it was GROUPED (1) or not (0): a
 * cuBLAS that refuses the grouped call (CUBLAS_STATUS_NOT_SUPPORTED) runs the loop from then on.
 * All give results within the op's tolerance, not necessarily the same bits (cuBLAS picks its
 * kernels; ours is deterministic). */
enum {
    TKD_CUDA_MOE_GEMM_AUTO = -1,
    TKD_CUDA_MOE_GEMM_LOOP = 0,
    TKD_CUDA_MOE_GEMM_GROUPED = 1,
    TKD_CUDA_MOE_GEMM_OURS = 2,
};
void tkd_cuda_moe_ws_set_grouped(tkd_cuda_moe_ws *ws, int grouped);
int tkd_cuda_moe_ws_grouped(const tkd_cuda_moe_ws *ws);
int tkd_cuda_moe_ws_ran(const tkd_cuda_moe_ws *ws);

/* Which of our kernels OURS (and AUTO) run, tkd_cuda_moe_ws_set_ours_kernel's argument: DEFAULT the
 * Hopper kernel on its default schedules (moe_cuda.cu's kDefaultGateUp, kDefaultDown) where the
 * device has it, else mma.sync; MMA_SYNC always the mma.sync kernel (AUTO then chooses between the
 * cuBLAS ways); SM90_COOP and SM90_PINGPONG the Hopper kernel on that schedule for both launches,
 * SM90_MIXED cooperative for gate/up and ping-pong for down, where the device has it (benchmarks
 * and tests compare them). TKD_ERR_INVALID_ARG for another value. tkd_cuda_moe_ws_ours_sm90: 1 when
 * ours runs the Hopper kernel. */
enum {
    TKD_CUDA_MOE_OURS_DEFAULT = 0,
    TKD_CUDA_MOE_OURS_MMA_SYNC = 1,
    TKD_CUDA_MOE_OURS_SM90_COOP = 2,
    TKD_CUDA_MOE_OURS_SM90_PINGPONG = 3,
    TKD_CUDA_MOE_OURS_SM90_MIXED = 4,
};
tkd_status tkd_cuda_moe_ws_set_ours_kernel(tkd_cuda_moe_ws *ws, int kernel);
int tkd_cuda_moe_ws_ours_sm90(const tkd_cuda_moe_ws *ws);

/* The loop's GEMMs over each expert's rows rounded up to a multiple of rows (1, the default:
 * exact counts; at most 256): few distinct shapes for cuBLAS's per-shape heuristics, for a little
 * extra work. The extra rows are overwritten or never read, so y is the same up to the kernels
 * cuBLAS picks for the larger shapes. TKD_ERR_INVALID_ARG outside 1..256. */
tkd_status tkd_cuda_moe_ws_set_pad(tkd_cuda_moe_ws *ws, int rows);


/* params.mxfp4: on (1), always decode the layer's experts to bf16 before the GEMMs, as on devices
 * without the Hopper kernel (benchmarks and tests compare the two); off (0, the default), inside
 * the GEMM where it can. tkd_cuda_moe_ws_mxfp4_in_gemm: 1 when the last call decoded inside it. */
void tkd_cuda_moe_ws_set_mxfp4_layer(tkd_cuda_moe_ws *ws, int on);
int tkd_cuda_moe_ws_mxfp4_in_gemm(const tkd_cuda_moe_ws *ws);

/* y (N, D) bf16 = MoE(x (N, D) bf16), 0 ≤ N ≤ max_tokens; experts, weights (N, k) on the device
 * receive the routing when not NULL (largest weight first). y may not alias x. Returns after the
 * counts are on the host; the rest is enqueued. */
tkd_status tkd_cuda_moe_fwd(tkd_cuda_moe_ws *ws, const tkd_cuda_moe_weights *w, const uint16_t *x, int N,
                            uint16_t *y, int32_t *experts, float *weights);

#ifdef __cplusplus
}
#endif

#endif /* TKD_MOE_CUDA_H */
