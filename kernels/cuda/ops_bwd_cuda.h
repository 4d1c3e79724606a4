/* ops_bwd_cuda.h — the backward passes of kernels/cuda/ops_cuda.h's decoder ops on a CUDA device
 * (embedding, RMSNorm, RoPE, SwiGLU, linear), and the optimizer's device kernels: one fused
 * multi-tensor AdamW over the flat master weights (bf16 + int16 residual: exact fp32 in 4 bytes,
 * two of them the compute copy), the global gradient norm and a scale.
 *
 * The maths is kernels/cpu/cpu_ops.h's and model/optim.c's (tests/test_gpu_ops_bwd.c holds these to the
 * double references on bf16-rounded inputs, and AdamW to tkd_adamw_step bit for bit). Convention as
 * on the CPU: every backward ADDS into its gradient outputs, and any gradient output may be NULL when
 * not wanted. Types: `bf16` arguments are uint16_t bit patterns of bfloat16 (activations, weights
 * and activation gradients), the residual stream x and its gradient dx, rstd, the RoPE tables, every
 * weight gradient and the optimizer state are fp32.
 *
 * Determinism: every launcher here gives bit-identical results when run twice on the same inputs
 * and shapes (no floating-point atomics; every reduction sums in an order fixed by the shape). The
 * GEMMs are cuBLASLt's, deterministic for a fixed algorithm on one GPU model.
 *
 * All pointers are device memory; launchers are asynchronous on `stream` (a cudaStream_t passed as
 * void *), return TKD_ERR_DEVICE when a launch fails and TKD_ERR_INVALID_ARG for a shape they do not
 * handle. Header usable from C; defined only in builds with the CUDA backend.
 */
#ifndef TKD_OPS_BWD_CUDA_H
#define TKD_OPS_BWD_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/cuda/ops_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Scratch for the backward ops, sized once: the embedding's sort buffers (N ≤ max_rows), the
 * partial sums of the deterministic column reductions (RMSNorm dw, linear db, embedding rows that
 * span chunks), the gradient norm's block partials, and the cached cuBLASLt plans of the linear
 * backward. Not thread-safe, one stream at a time (launches share the scratch in stream order). */
typedef struct tkd_cuda_bwd_ws tkd_cuda_bwd_ws;

/* For embedding batches of up to max_rows rows and widths up to max_d (RMSNorm and linear take any
 * width). *out owned by the caller (tkd_cuda_bwd_ws_free); TKD_ERR_DEVICE_OOM when the device is
 * full. */
tkd_status tkd_cuda_bwd_ws_create(int max_rows, int max_d, tkd_cuda_bwd_ws **out);
void tkd_cuda_bwd_ws_free(tkd_cuda_bwd_ws *ws); /* NULL is a no-op */

/* demb[tok[n]] += dx[n]. Deterministic: the (token, row) pairs are radix-sorted (stable, so each
 * token's rows stay in ascending order), chunks of 64 sorted rows sum their pieces per token, and a
 * token whose rows span chunks adds its pieces in chunk order. N ≤ the workspace's max_rows,
 * D ≤ its max_d. Token ids are validated on the host (0 ≤ tok < V). */
tkd_status tkd_cuda_embedding_bwd(tkd_cuda_bwd_ws *ws, const int32_t *tok, int N, // (N) i32
                                  const float *dx, int D,                        // (N, D) f32
                                  float *demb, void *stream);                    // (V, D) f32 +=

/* With g = dy·w, c = r²·Σ_d g·x / D (r = rstd[n]): dx += r·(g − x·c), dw += Σ_n dy·x·r.
 * Row sums in fp32; dw from per-block partials over fixed row groups, then summed per column in a
 * fixed order (double). dx_bf16 (NULL: none; needs dx) receives the new dx rounded as
 * tkd_cuda_f32_to_bf16 rounds (the same bits as that pass after this call, without it); it may be
 * dy itself. 1 ≤ D ≤ 16384 (16-byte loads when D % 8 == 0 and dy, x, w, dx, dx_bf16 are 16-byte
 * aligned); any N ≥ 0. */
tkd_status tkd_cuda_rmsnorm_bwd(tkd_cuda_bwd_ws *ws, const uint16_t *dy, // (N, D) bf16
                                const float *x,                         // (N, D) f32
                                const uint16_t *w,                      // (D) bf16
                                const float *rstd, int N, int D,        // (N) f32
                                float *dx,                              // (N, D) f32 +=
                                uint16_t *dx_bf16,                      // (N, D) bf16 or NULL
                                float *dw, void *stream);               // (D) f32 +=

/* The transpose of tkd_cuda_rope_fwd's rotation, in place on dq (N, H·dh) and dk (N, Hkv·dh):
 * d_i ← d_i c + d_{i+half} s, d_{i+half} ← d_{i+half} c − d_i s; fp32 arithmetic, one bf16
 * rounding. Any even dh (16-byte loads when dh % 16 == 0 and every pointer is 16-byte aligned). */
tkd_status tkd_cuda_rope_bwd(uint16_t *dq, uint16_t *dk, int N, int T, int H, int Hkv, int dh,
                             const float *cos_t, const float *sin_t, void *stream); // (T, dh/2)

/* With s = σ(g): dg += dh·u·s·(1 + g·(1 − s)), du += dh·g·s; fp32 arithmetic on the bf16 inputs
 * and the old gradient, one bf16 rounding. dg or du may be NULL. acc = 0 overwrites dg and du
 * instead (their old contents are never read: no zeroing pass before the first contribution). */
tkd_status tkd_cuda_swiglu_bwd(const uint16_t *dh, const uint16_t *g, const uint16_t *u, // (n) bf16
                               int64_t n, uint16_t *dg, uint16_t *du, int acc,          // (n) bf16 +=
                               void *stream);

/* dx += dy W (bf16: cuBLASLt with beta = 1, the add in fp32 before the one rounding; dx_acc = 0:
 * dx = dy W with beta = 0, dx's old contents never read),
 * dw += dyᵀ x (bf16 operands, fp32 accumulation, fp32 output with beta = 1),
 * db += Σ_n dy (fp32 column sums over fixed row groups, then summed per column in a fixed order).
 * `lin` lends its cuBLASLt handle and workspace; `ws` caches the two GEMM plans per shape. Shapes
 * and alignment as tkd_cuda_linear_fwd (a shape or alignment with no cuBLASLt algorithm is
 * TKD_ERR_INVALID_ARG naming both). */
tkd_status tkd_cuda_linear_bwd(tkd_cuda_linear *lin, tkd_cuda_bwd_ws *ws,
                               const uint16_t *dy,                     // (N, M) bf16
                               const uint16_t *x,                      // (N, K) bf16
                               const uint16_t *w, int N, int K, int M, // (M, K) bf16
                               uint16_t *dx,                           // (N, K) bf16 +=
                               float *dw,                              // (M, K) f32 +=
                               float *db, int dx_acc, void *stream);   // (M) f32 +=

/* ---- optimizer -------------------------------------------------------------------------------- */

/* One parameter tensor inside the flat arrays: elements [offset, offset + numel), weight decay when
 * decay != 0 (model/model.h's tkd_param_info: not norms, not biases). */
typedef struct tkd_cuda_param_seg {
    size_t offset;
    size_t numel;
    int decay;
} tkd_cuda_param_seg;

/* The segments as a device table of chunks (≤ 32768 elements, each inside one segment), built once. */
typedef struct tkd_cuda_adamw tkd_cuda_adamw;
tkd_status tkd_cuda_adamw_create(const tkd_cuda_param_seg *segs, int n_segs, // host, copied
                                 tkd_cuda_adamw **out);
void tkd_cuda_adamw_free(tkd_cuda_adamw *a); /* NULL is a no-op */

/* One AdamW update of every segment's elements, tests/optim_testutil.c's tkd_adamw_step operation by
 * operation in fp32 (IEEE-rounded, no fused multiply-adds), so it matches the CPU bit for bit:
 *   g *= grad_scale (the clip coefficient; 1: none);
 *   p *= 1 − lr·wd (decay segments); m += (1 − β1)(g − m); v = β2·v + (1 − β2)·g·g;
 *   p −= (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps),  bc_i = 1 − β_i^step;
 * scalars formed in double on the host and rounded once, as the CPU does. `step` is the 1-based
 * count of this update (tkd_adamw's step after its increment). The fp32 master weights p are held
 * exactly as the bf16 compute copy w_hi plus int16 residuals w_lo (common/half.h's
 * tkd_f32_split_bf16): the kernel joins them, updates, and splits the result back into both, so the
 * compute copy is p rounded to the nearest bf16 with ties away from zero (not to even).
 * Bytes per element and step: reads hi, lo, g, m, v (16), writes hi, lo, m, v (12): 28, against
 * 30 for an fp32 master with a separate bf16 copy; with grad_scale the clip's own scale pass over
 * g (8 more) is not needed.
 * Elements outside every segment are not touched. The segments' offsets index every array, so a
 * contiguous sub-range [b, e) of a flat array set is updated by a table built from the segments
 * cut to [b, e) and shifted by −b, with every pointer advanced by b (or pointing at arrays that
 * hold only that range). */
tkd_status tkd_cuda_adamw_step(const tkd_cuda_adamw *a,
                               uint16_t *w_hi, int16_t *w_lo,        // (n) bf16, (n) int16: the master
                               const float *grads,                   // (n) f32
                               float *m, float *v,                   // (n) f32 each
                               double lr, double beta1, double beta2, double eps,
                               double weight_decay, int64_t step, float grad_scale, void *stream);

/* The same update with the moments kept as bf16 bits (optim.state_dtype bf16): per element m and v
 * are widened to fp32, the fp32 update above runs unchanged, and they are stored back rounded to
 * nearest even (common/half.h's tkd_f32_to_bf16) — kernels/cpu/adamw.h's tkd_adamw_update with bf16
 * moments, bit for bit. The 4-wide path needs m and v 8-byte aligned. Bytes per element and step: 20 (28 − 8). */
tkd_status tkd_cuda_adamw_step_bf16(const tkd_cuda_adamw *a,
                                    uint16_t *w_hi, int16_t *w_lo,   // (n) bf16, (n) int16: the master
                                    const float *grads,              // (n) f32
                                    uint16_t *m, uint16_t *v,        // (n) bf16 each
                                    double lr, double beta1, double beta2, double eps,
                                    double weight_decay, int64_t step, float grad_scale, void *stream);

/* The exact split of fp32 src into the master's two halves, and the join back (loading and
 * saving the master weights; common/half.h's tkd_f32_split_bf16 / tkd_bf16_join_f32). */
tkd_status tkd_cuda_master_split(const float *src, uint16_t *w_hi, int16_t *w_lo, size_t n, void *stream);
tkd_status tkd_cuda_master_join(const uint16_t *w_hi, const int16_t *w_lo, float *dst, size_t n, void *stream);

/* *norm2 (a device double) = Σ g² accumulated in double: fixed per-block partials, then one block
 * sums them in a fixed order (deterministic for a given n and alignment of g). The global norm of
 * tkd_optim_clip is sqrt(*norm2). */
tkd_status tkd_cuda_grad_norm2(tkd_cuda_bwd_ws *ws, const float *g, size_t n, // (n) f32
                               double *norm2, void *stream);                 // (1) device

/* g *= factor (fp32, as tkd_optim_scale: clipping and gradient-accumulation scaling). */
tkd_status tkd_cuda_scale(float *g, size_t n, float factor, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* TKD_OPS_BWD_CUDA_H */
