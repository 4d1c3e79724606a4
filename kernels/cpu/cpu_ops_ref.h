/* cpu_ops_ref.h — scalar double-precision references of the decoder ops in kernels/cpu/cpu_ops.h.
 *
 * Same layouts, semantics and accumulate-into-gradients convention as cpu_ops.h, but every value is
 * a double and every loop is the plain textbook one, so these define what is correct: the fast CPU
 * path and the CUDA kernels are compared with them (tests/test_ops.c), and finite differences check
 * their backward passes in double (tests/test_gradcheck.c). Not for production: no threads, no BLAS.
 * RoPE takes the same fp32 cos/sin tables as the fast path (tkd_rope_table), so both rotate by
 * the same angles. The MoE layer's reference reads the fast path's fp32 tensors and computes in
 * double from them (tests/test_moe.c).
 */
#ifndef TKD_CPU_OPS_REF_H
#define TKD_CPU_OPS_REF_H

#include <stdint.h>

#include "kernels/cpu/cpu_moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shapes as in cpu_ops.h; gradient outputs are added into (+=). */
void tkd_ref_embedding_fwd(const int32_t *tok, // (N)
                           int N, const double *emb, // (V, D)
                           int D, double *out);      // (N, D)
void tkd_ref_embedding_bwd(const int32_t *tok, // (N)
                           int N, const double *dout, // (N, D)
                           int D, double *demb);      // (V, D) +=

void tkd_ref_rmsnorm_fwd(const double *x, // (N, D)
                         const double *w, // (D)
                         int N, int D, double eps, double *y, // (N, D)
                         double *rstd);                      // (N)
void tkd_ref_rmsnorm_bwd(const double *dy,   // (N, D)
                         const double *x,    // (N, D)
                         const double *w,    // (D)
                         const double *rstd, // (N) from the forward
                         int N, int D, double *dx, // (N, D) +=
                         double *dw);              // (D) +=

void tkd_ref_linear_fwd(const double *x, // (N, K)
                        const double *w, // (M, K)
                        const double *b, // (M) or NULL
                        int N, int K, int M, int accumulate, double *y); // (N, M)
void tkd_ref_linear_bwd(const double *dy, // (N, M)
                        const double *x,  // (N, K)
                        const double *w,  // (M, K)
                        int N, int K, int M, double *dx, // (N, K) +=
                        double *dw,                      // (M, K) +=
                        double *db);                     // (M) +=

/* cos_t, sin_t: (T, dh / 2) from tkd_rope_table. */
void tkd_ref_rope_fwd(double *x, // (N, nh, dh) in place
                      int N, int T, int nh, int dh, const float *cos_t, const float *sin_t);
void tkd_ref_rope_bwd(double *dx, // (N, nh, dh) in place
                      int N, int T, int nh, int dh, const float *cos_t, const float *sin_t);

void tkd_ref_attn_fwd(const double *q, // (B·T, H·dh) after RoPE
                      const double *k, // (B·T, Hkv·dh) after RoPE
                      const double *v, // (B·T, Hkv·dh)
                      int B, int T, int H, int Hkv, int dh, double *att, // (B, H, T, T)
                      double *y);                                       // (B·T, H·dh)
/* With a sliding window (window ≥ 1; 0: full): query i attends keys i − window < j ≤ i. The
 * backward below takes either forward's att (zeros where masked). */
void tkd_ref_attn_window_fwd(const double *q, const double *k, const double *v, // as above
                             int B, int T, int H, int Hkv, int dh, int window,
                             double *att, // (B, H, T, T)
                             double *y);  // (B·T, H·dh)
/* With attention sinks too (gpt-oss; sinks NULL: none): head h's row softmax runs over its scores
 * and one more logit sinks[h], whose column is then dropped, so a row's weights sum to less than 1.
 * Forward only (no backward with sinks). */
void tkd_ref_attn_sinks_fwd(const double *q, const double *k, const double *v, // as above
                            int B, int T, int H, int Hkv, int dh, int window,
                            const int32_t *doc,  // (B·T) or NULL: tkd_cpu_attn_sinks_fwd's documents
                            const double *sinks, // (H) or NULL
                            double *att,         // (B, H, T, T)
                            double *y);          // (B·T, H·dh)
void tkd_ref_attn_bwd(const double *dy, // (B·T, H·dh)
                      const double *q, const double *k, const double *v,
                      const double *att, // (B, H, T, T) from the forward
                      int B, int T, int H, int Hkv, int dh, double *dq, // (B·T, H·dh) +=
                      double *dk,                                       // (B·T, Hkv·dh) +=
                      double *dv);                                      // (B·T, Hkv·dh) +=

void tkd_ref_swiglu_fwd(const double *g, const double *u, int64_t n, double *h); // (n) each
void tkd_ref_swiglu_bwd(const double *dh, const double *g, const double *u, int64_t n,
                        double *dg, double *du); // (n) each, +=

/* The mixture-of-experts layer of cpu_moe.h (p must pass tkd_moe_params_check). Unlike the ops
 * above it reads the same fp32 tensors as the fast path (x and every weight are fp32 in the model),
 * and computes everything in double from them: router logits, softmax, top-k (ties: lower expert
 * index first), each chosen expert and the weighted sum. experts / weights (router order, largest
 * weight first) may be NULL. */
void tkd_ref_moe_fwd(const tkd_moe_params *p, const tkd_moe_weights *w,
                     const float *x, // (N, D)
                     int N, double *y, // (N, D)
                     int32_t *experts, // (N, k) or NULL
                     double *weights); // (N, k) or NULL
/* gpt-oss's clamped SwiGLU (tkd_moe_act) in double. */
void tkd_ref_swiglu_clamp_fwd(const double *g, const double *u, int64_t n, double limit,
                              double alpha, double *h); // (n) each

#ifdef __cplusplus
}
#endif

#endif /* TKD_CPU_OPS_REF_H */
