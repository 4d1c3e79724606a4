/* cpu_ops.h — the decoder's compute ops on the CPU, fp32: embedding, RMSNorm, RoPE, causal
 * grouped-query attention, SwiGLU and linear layers (cblas_sgemm), forward and backward.
 *
 * This is the fast CPU path (OpenBLAS + OpenMP); kernels/cpu/cpu_ops_ref.h holds the scalar double
 * references each op is tested against (tests/test_ops.c), and the CUDA path is held to these.
 *
 * Layouts: activations are row-major (N, width) with N = B·T rows, row n = (b = n / T, t = n % T).
 * Attention heads are packed along the row: q (N, H·Dh), k and v (N, Hkv·Dh); query head h reads
 * kv head h / (H / Hkv) (GQA). Linear weights use the Hugging Face layout W (M out, K in).
 * Convention: every backward ADDS into its gradient outputs (dx, dw, db, dq, ...), so residual
 * branches, tied weights and gradient accumulation compose; callers zero buffers where needed.
 * Any gradient output may be NULL when not wanted.
 */
#ifndef TKD_CPU_OPS_H
#define TKD_CPU_OPS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* out[n] = emb[tok[n]]. Tokens must already be validated to lie in [0, V). */
void tkd_cpu_embedding_fwd(const int32_t *tok, // (N)
                           int N, const float *emb, // (V, D)
                           int D, float *out);      // (N, D)
/* demb[tok[n]] += dout[n]. */
void tkd_cpu_embedding_bwd(const int32_t *tok, // (N)
                           int N, const float *dout, // (N, D)
                           int D, float *demb);      // (V, D)

/* y = w · (x · rstd) with rstd = 1 / sqrt(mean(x²) + eps) (sum of squares accumulated in double).
 * rstd may be NULL (inference). */
void tkd_cpu_rmsnorm_fwd(const float *x, // (N, D)
                         const float *w, // (D)
                         int N, int D, float eps, float *y, // (N, D)
                         float *rstd);                     // (N)
void tkd_cpu_rmsnorm_bwd(const float *dy,   // (N, D)
                         const float *x,    // (N, D)
                         const float *w,    // (D)
                         const float *rstd, // (N) from the forward
                         int N, int D, float *dx, // (N, D) +=
                         float *dw);              // (D) +=

/* y = x Wᵀ + b (accumulate = 0) or y += x Wᵀ + b (accumulate = 1, for residual adds). b may be NULL. */
void tkd_cpu_linear_fwd(const float *x, // (N, K)
                        const float *w, // (M, K)
                        const float *b, // (M) or NULL
                        int N, int K, int M, int accumulate, float *y); // (N, M)
/* dx += dy W, dw += dyᵀ x, db += Σ_n dy. */
void tkd_cpu_linear_bwd(const float *dy, // (N, M)
                        const float *x,  // (N, K)
                        const float *w,  // (M, K)
                        int N, int K, int M, float *dx, // (N, K) +=
                        float *dw,                      // (M, K) +=
                        float *db);                     // (M) +=

/* In place, rotate-half convention (pairs i, i + dh/2): x ← x cos + rotate_half(x) sin, position
 * t = n % T. bwd rotates the gradient back by the same angle (the transpose of the rotation). */
void tkd_cpu_rope_fwd(float *x, // (N, nh, dh)
                      int N, int T, int nh, int dh, const float *cos_t, const float *sin_t);
void tkd_cpu_rope_bwd(float *dx, // (N, nh, dh)
                      int N, int T, int nh, int dh, const float *cos_t, const float *sin_t);

/* Causal attention, softmax in fp32 with max subtraction, scale = 1/sqrt(dh):
 * att[b,h,i,j] = softmax_j≤i(q_i·k_j·scale) (entries j > i are written 0), y_i = Σ_j att_ij v_j. */
void tkd_cpu_attn_fwd(const float *q, // (B·T, H·dh) after RoPE
                      const float *k, // (B·T, Hkv·dh) after RoPE
                      const float *v, // (B·T, Hkv·dh)
                      int B, int T, int H, int Hkv, int dh, float *att, // (B, H, T, T)
                      float *y);                                       // (B·T, H·dh)
/* The same with a sliding window (window ≥ 1; 0: full causal): query i attends keys
 * i − window < j ≤ i, so the window counts the query itself (transformers' sliding_window). The
 * masked entries of att are written 0, which is all the backward needs to know of the window. */
void tkd_cpu_attn_window_fwd(const float *q, const float *k, const float *v, // as above
                             int B, int T, int H, int Hkv, int dh, int window,
                             float *att, // (B, H, T, T)
                             float *y);  // (B·T, H·dh)
/* The same with documents and attention sinks. doc (NULL: one document per sequence): doc[b·T + i]
 * is the position in sequence b where query i's document starts (data.packing: documents), and
 * query i attends no key before it (a block-diagonal causal mask; att is 0 there, which is all the
 * backward needs). Sinks (gpt-oss; NULL: none): head h's softmax runs over its scores and the logit
 * sinks[h] (in the max and the denominator), whose column is then dropped, so a row of att sums
 * to less than 1. No backward takes sinks (teachers only). */
void tkd_cpu_attn_sinks_fwd(const float *q, const float *k, const float *v, // as above
                            int B, int T, int H, int Hkv, int dh, int window,
                            const int32_t *doc, // (B·T) or NULL
                            const float *sinks, // (H) or NULL
                            float *att,         // (B, H, T, T)
                            float *y);          // (B·T, H·dh)
/* Backward of the forwards without sinks, from its att (zeros where masked). */
void tkd_cpu_attn_bwd(const float *dy, // (B·T, H·dh)
                      const float *q, const float *k, const float *v,
                      const float *att, // (B, H, T, T) from the forward
                      int B, int T, int H, int Hkv, int dh, float *dq, // (B·T, H·dh) +=
                      float *dk,                                       // (B·T, Hkv·dh) +=
                      float *dv);                                      // (B·T, Hkv·dh) +=

/* h = silu(g) · u elementwise. */
void tkd_cpu_swiglu_fwd(const float *g, const float *u, int64_t n, float *h); // (n) each
void tkd_cpu_swiglu_bwd(const float *dh, const float *g, const float *u, int64_t n,
                        float *dg, float *du); // (n) each, +=

#ifdef __cplusplus
}
#endif

#endif /* TKD_CPU_OPS_H */
