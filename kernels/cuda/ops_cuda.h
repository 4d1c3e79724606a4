/* ops_cuda.h — the decoder's elementwise and row ops on a CUDA device, bf16 activations with fp32
 * arithmetic: embedding, RMSNorm (alone and fused with the residual add), RoPE on q and k in one
 * pass, SwiGLU, and the linear layer through cuBLASLt (bias in the epilogue).
 *
 * The maths is kernels/cpu/cpu_ops.h's (the reference; tests/test_gpu_ops.c holds these to it on
 * inputs rounded to bf16). Types: `bf16` arguments are uint16_t bit patterns of bfloat16; the
 * residual stream, rstd and the RoPE tables are fp32. All pointers are device memory; launchers
 * are asynchronous on `stream` (a cudaStream_t passed as void *), return TKD_ERR_DEVICE when a
 * launch fails and TKD_ERR_INVALID_ARG for a shape they do not handle. Header usable from C;
 * defined only in builds with the CUDA backend.
 */
#ifndef TKD_OPS_CUDA_H
#define TKD_OPS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* x[n] = float(emb[tok[n]]). Token ids are validated on the host before upload. */
tkd_status tkd_cuda_embedding_fwd(const int32_t *tok, int N,     // (N)
                                  const uint16_t *emb, int D,    // (V, D) bf16
                                  float *x, void *stream);       // (N, D) f32

/* y = bf16(w · x · rstd), rstd = 1/sqrt(mean(x²) + eps) in fp32; rstd may be NULL. One block per
 * row holds the row in registers: 1 ≤ D ≤ 16384 (any D; 16-byte loads when D % 8 == 0 and every
 * pointer is 16-byte aligned, a scalar path otherwise). */
tkd_status tkd_cuda_rmsnorm_fwd(const float *x,                  // (N, D) f32
                                const uint16_t *w, int N, int D, // (D) bf16
                                float eps, uint16_t *y,          // (N, D) bf16
                                float *rstd, void *stream);      // (N) f32 or NULL

/* The same from bf16 x (read as fp32, exactly: the bits of tkd_cuda_rmsnorm_fwd on that copy); y may
 * equal x. */
tkd_status tkd_cuda_rmsnorm_bf16_fwd(const uint16_t *x,               // (N, D) bf16
                                     const uint16_t *w, int N, int D, // (D) bf16
                                     float eps, uint16_t *y,          // (N, D) bf16
                                     float *rstd, void *stream);      // (N) f32 or NULL

/* x_out = x_in + float(branch) (x_out may equal x_in), then y = rmsnorm(x_out) as above. */
tkd_status tkd_cuda_add_rmsnorm_fwd(const float *x_in,           // (N, D) f32
                                    const uint16_t *branch,      // (N, D) bf16
                                    float *x_out,                // (N, D) f32
                                    const uint16_t *w, int N, int D, float eps,
                                    uint16_t *y, float *rstd, void *stream);

/* RoPE in place on q (N, H·dh) and k (N, Hkv·dh), rotate-half pairs (i, i + dh/2), position
 * t = n % T, angle tables cos_t/sin_t (T, dh/2) fp32; arithmetic in fp32, one bf16 rounding.
 * Any even dh (16-byte loads when dh % 16 == 0, e.g. 48, 64, 80, 96, 128); H, Hkv ≥ 1. */
tkd_status tkd_cuda_rope_fwd(uint16_t *q, uint16_t *k, int N, int T, int H, int Hkv, int dh,
                             const float *cos_t, const float *sin_t, void *stream);

/* h = bf16(silu(g) · u), g and u read as fp32. */
tkd_status tkd_cuda_swiglu_fwd(const uint16_t *g, const uint16_t *u, int64_t n, uint16_t *h,
                               void *stream);

/* cuBLASLt state for the linear layers: one handle, a 32 MiB workspace, cached matmul plans.
 * Not thread-safe, and one stream at a time: every call shares the workspace. */
typedef struct tkd_cuda_linear tkd_cuda_linear;
tkd_status tkd_cuda_linear_create(tkd_cuda_linear **out);
void tkd_cuda_linear_free(tkd_cuda_linear *lin); /* NULL is a no-op */

/* y = x Wᵀ + b: bf16 operands, fp32 accumulation, bf16 out; b (M) bf16 or NULL (bias added in the
 * GEMM epilogue, in fp32 before the one rounding). Any N ≥ 0, K, M ≥ 1 (no multiple-of-8 rule:
 * cuBLASLt takes any leading dimension for bf16) and pointers at least 2-byte aligned; 16-byte
 * (best 256-byte) alignment and K, M multiples of 8 give the fast kernels. A shape or alignment
 * for which cuBLASLt offers no algorithm is TKD_ERR_INVALID_ARG naming both. */
tkd_status tkd_cuda_linear_fwd(tkd_cuda_linear *lin, const uint16_t *x, // (N, K)
                               const uint16_t *w,                       // (M, K)
                               const uint16_t *b, int N, int K, int M,  // (M) or NULL
                               uint16_t *y, void *stream);              // (N, M)

/* lin's cuBLASLt handle (a cublasLtHandle_t) and workspace, lent to kernels/cuda/ops_bwd_cuda.cu's
 * backward GEMMs: the same one-stream-at-a-time rule holds. */
void tkd_cuda_linear_lt(tkd_cuda_linear *lin, void **handle, void **ws, size_t *ws_bytes);

/* Conversions for uploads/downloads: dst[i] = bf16(src[i]) (round to nearest even) and back. */
tkd_status tkd_cuda_f32_to_bf16(const float *src, uint16_t *dst, size_t n, void *stream);
tkd_status tkd_cuda_bf16_to_f32(const uint16_t *src, float *dst, size_t n, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TKD_OPS_CUDA_H */
