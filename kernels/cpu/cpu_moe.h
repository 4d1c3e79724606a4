/* cpu_moe.h — the sparse mixture-of-experts layer (forward only), fp32 on the CPU: a router picks
 * k of E experts per token, each chosen expert is a gated MLP, and the layer's output is the
 * routing-weighted sum of the chosen experts' outputs. Two families, as transformers 5.x computes
 * them (read in transformers' sources, see below); teacher-dump runs them, nothing trains them.
 *
 *   Qwen3-MoE (models/qwen3_moe/modeling_qwen3_moe.py: Qwen3MoeTopKRouter, Qwen3MoeExperts):
 *     logits = x W_rᵀ (no bias); p = softmax(logits) over all E experts in fp32 (dtype=torch.float);
 *     (w, e) = torch.topk(p, k) (sorted, largest first); if norm_topk_prob: w /= Σ w;
 *     expert(x) = down(silu(gate(x)) · up(x)) with moe_intermediate_size I and no biases.
 *     transformers 5 stores the experts fused: gate_up_proj (E, 2I, D) = per expert [W_gate; W_up]
 *     (gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)) and down_proj (E, D, I); the
 *     checkpoints hold them per expert as mlp.experts.<e>.{gate,up,down}_proj.weight, which is the
 *     layout below.
 *   gpt-oss (models/gpt_oss/modeling_gpt_oss.py: GptOssTopKRouter, GptOssExperts):
 *     logits = x W_rᵀ + b_r; (l, e) = torch.topk(logits, k); w = softmax(l) over those k only;
 *     gate_up = x · gate_up_proj[e] + gate_up_proj_bias[e] with gate_up_proj (E, D, 2I) and the
 *     halves INTERLEAVED: gate = gate_up[..., ::2], up = gate_up[..., 1::2];
 *     gate = min(gate, limit); up = clamp(up, −limit, limit); glu = gate · sigmoid(α · gate);
 *     h = (up + 1) · glu; out = h · down_proj[e] + down_proj_bias[e] with down_proj (E, I, D);
 *     α = 1.702 (applied in fp32: torch multiplies an fp32 tensor by a Python float in fp32),
 *     limit = 7.0 (GptOssExperts.limit; config swiglu_limit). The down bias is added before the
 *     routing weight multiplies, so it is weighted too. The gate's clamp is one-sided: a very
 *     negative gate gives a tiny glu, not a clamped one.
 *   Both: y[n] = Σ_j w[n,j] · expert_{e[n,j]}(x[n]), the products formed in fp32 and added with
 *   index_add_ into a zero row in increasing expert order (experts loop 0..E−1); this path sums in
 *   the same order.
 *
 * Ties: torch.topk follows no index order on equal values, and CPU and CUDA disagree (torch
 * 2.11, recorded by tests/moe_reference.py: zeros(8), k 3 gives [6, 5, 4] on the CPU and [2, 1, 0]
 * on CUDA; [0, 1, 1, 0, 1] gives [2, 4, 1] and [4, 2, 1]). We pick the lower expert index first,
 * in the reference and the fast path alike, so our routing is deterministic on every backend.
 * Exact ties need equal router rows (or bias and row both tied); trained checkpoints have none,
 * and where one occurs transformers' own answer depends on its device.
 * Checked against transformers 5.17 (tests/fixtures/moe/, ctest test_moe_transformers): same
 * routing, outputs within 5e-7 of the largest.
 *
 * Layout the op takes, for both families (row-major, as the dense MLP's weights of this repo):
 * per expert W_gate (I, D), W_up (I, D), W_down (D, I), stacked over experts, plus optional biases.
 * tkd_moe_from_gpt_oss converts gpt-oss's interleaved (E, D, 2I) / (E, I, D) tensors into it.
 */
#ifndef TKD_CPU_MOE_H
#define TKD_CPU_MOE_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Borrowed pointers; shapes beside each. A NULL bias is a zero bias. */
typedef struct tkd_moe_weights {
    const float *router_w; /* (E, D) */
    const float *router_b; /* (E) or NULL */
    const float *w_gate;   /* (E, I, D) */
    const float *w_up;     /* (E, I, D) */
    const float *w_down;   /* (E, D, I) */
    const float *b_gate;   /* (E, I) or NULL */
    const float *b_up;     /* (E, I) or NULL */
    const float *b_down;   /* (E, D) or NULL */
    tkd_moe_mxfp4 q;       /* with params.mxfp4: the three stacks as MXFP4 (w_gate/w_up/w_down unused) */
} tkd_moe_weights;

/* gpt-oss's clamped SwiGLU elementwise (see tkd_moe_act); h may alias g or u. */
void tkd_cpu_swiglu_clamp_fwd(const float *g, const float *u, int64_t n, float limit, float alpha,
                              float *h); // (n) each

/* The workspace: every buffer of the forward, sized once for at most max_tokens rows (about
 * max_tokens·k·(D + 2I) floats for the tokens sorted by expert). On success *out is owned by the
 * caller (tkd_cpu_moe_ws_free). */
typedef struct tkd_cpu_moe_ws tkd_cpu_moe_ws;
tkd_status tkd_cpu_moe_ws_create(tkd_cpu_moe_ws **out, const tkd_moe_params *p, int max_tokens);
void tkd_cpu_moe_ws_free(tkd_cpu_moe_ws *ws); /* NULL is a no-op */

/* y = MoE(x) for N ≤ max_tokens rows. experts / weights, when not NULL, receive each token's
 * choice in the router's order (largest weight first). Tokens are sorted by expert (a counting
 * sort of the (token, slot) pairs), each expert runs its GEMMs over its gathered rows, and each
 * output row sums its k products in increasing expert order. TKD_ERR_INVALID_ARG when N is out of
 * range. Not thread-safe on one ws. */
tkd_status tkd_cpu_moe_fwd(tkd_cpu_moe_ws *ws, const tkd_moe_weights *w,
                           const float *x, // (N, D)
                           int N, float *y, // (N, D)
                           int32_t *experts, // (N, k) or NULL
                           float *weights);  // (N, k) or NULL

/* gpt-oss's expert tensors (transformers' GptOssExperts, bf16 or dequantised checkpoints alike)
 * into the op's layout: w_gate[e,i,:] = gate_up[e,:,2i], w_up[e,i,:] = gate_up[e,:,2i+1],
 * b_gate[e,i] = gate_up_bias[e,2i], b_up[e,i] = gate_up_bias[e,2i+1], w_down[e,d,i] = down[e,i,d].
 * Biases may be NULL on both sides together; down_proj_bias (E, D) is already in the op's layout.
 * The caller owns every buffer. */
void tkd_moe_from_gpt_oss(int E, int D, int inter,
                          const float *gate_up,      // (E, D, 2I)
                          const float *gate_up_bias, // (E, 2I) or NULL
                          const float *down,         // (E, I, D)
                          float *w_gate,             // (E, I, D)
                          float *w_up,               // (E, I, D)
                          float *b_gate,             // (E, I) or NULL
                          float *b_up,               // (E, I) or NULL
                          float *w_down);            // (E, D, I)

#ifdef __cplusplus
}
#endif

#endif /* TKD_CPU_MOE_H */
