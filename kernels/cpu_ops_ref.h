/* cpu_ops_ref.h — scalar double-precision references of the decoder ops in kernels/cpu_ops.h.
 *
 * Same layouts, semantics and accumulate-into-gradients convention as cpu_ops.h, but every value is
 * a double and every loop is the plain textbook one, so these define what is correct: the fast CPU
 * path and the CUDA kernels are compared with them (tests/test_ops.c), and finite differences check
 * their backward passes in double (tests/test_gradcheck.c). Not for production: no threads, no BLAS.
 * RoPE takes the same fp32 cos/sin tables as the fast path (tkd_cpu_rope_table), so both rotate by
 * the same angles.
 */
#ifndef TKD_CPU_OPS_REF_H
#define TKD_CPU_OPS_REF_H

#include <stdint.h>

void tkd_ref_embedding_fwd(const int32_t *tok, int N, const double *emb, int D, double *out);
void tkd_ref_embedding_bwd(const int32_t *tok, int N, const double *dout, int D, double *demb);

void tkd_ref_rmsnorm_fwd(const double *x, const double *w, int N, int D, double eps, double *y,
                         double *rstd);
void tkd_ref_rmsnorm_bwd(const double *dy, const double *x, const double *w, const double *rstd,
                         int N, int D, double *dx, double *dw);

void tkd_ref_linear_fwd(const double *x, const double *w, const double *b, int N, int K, int M,
                        int accumulate, double *y);
void tkd_ref_linear_bwd(const double *dy, const double *x, const double *w, int N, int K, int M,
                        double *dx, double *dw, double *db);

void tkd_ref_rope_fwd(double *x, int N, int T, int nh, int dh, const float *cos_t,
                      const float *sin_t);
void tkd_ref_rope_bwd(double *dx, int N, int T, int nh, int dh, const float *cos_t,
                      const float *sin_t);

void tkd_ref_attn_fwd(const double *q, const double *k, const double *v, int B, int T, int H,
                      int Hkv, int dh, double *att, double *y);
void tkd_ref_attn_bwd(const double *dy, const double *q, const double *k, const double *v,
                      const double *att, int B, int T, int H, int Hkv, int dh, double *dq,
                      double *dk, double *dv);

void tkd_ref_swiglu_fwd(const double *g, const double *u, int64_t n, double *h);
void tkd_ref_swiglu_bwd(const double *dh, const double *g, const double *u, int64_t n, double *dg,
                        double *du);

#endif /* TKD_CPU_OPS_REF_H */
