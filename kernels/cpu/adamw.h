/* adamw.h — the optimizer's per-element maths on host fp32 arrays, one implementation for
 * model/optim.c (host optimizer state) and the CPU backend's training ops (kernels/cpu/backend_cpu.c):
 * the AdamW update over segments of a flat parameter array, the squared global gradient norm,
 * and the gradient scale (the clip coefficient, the same on every backend, is kernels/grad_clip.h).
 *
 * The update follows torch.optim.AdamW (single-tensor path) operation by operation in fp32, its
 * scalars formed in double and rounded once as Python floats reach torch's kernels; the CUDA
 * kernel (kernels/cuda/ops_bwd_cuda.h, tkd_cuda_adamw_step) forms the same scalars and matches it bit
 * for bit. Loops use OpenMP above 32768 elements.
 *
 * The moments m and v are fp32 or, to halve their memory (optim.state_dtype: bf16), bf16: each
 * update then loads them to fp32, takes exactly the fp32 update, and stores them back rounded to
 * the nearest bf16, ties to even (common/half.h, the rounding the CUDA kernel uses too).
 */
#ifndef TKD_ADAMW_H
#define TKD_ADAMW_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How the moments are kept. The values index TKD_ADAMW_DTYPE_NAMES (the config's spelling). */
typedef enum tkd_adamw_dtype {
    TKD_ADAMW_DTYPE_F32 = 0,  /* 4 bytes each: the update is torch's, bit for bit */
    TKD_ADAMW_DTYPE_BF16 = 1, /* 2 bytes each: rounded to bf16 after every update */
} tkd_adamw_dtype;
#define TKD_ADAMW_DTYPE_NAMES {"f32", "bf16", NULL}

/* The name of d ("f32", "bf16"), and its bytes per moment value. */
const char *tkd_adamw_dtype_name(tkd_adamw_dtype d);
size_t tkd_adamw_dtype_size(tkd_adamw_dtype d);

/* One parameter tensor inside the flat arrays: elements [offset, offset + numel), weight decay
 * when decay != 0 (model/model.h's tkd_param_info: not norms, not biases). */
typedef struct tkd_adamw_seg {
    size_t offset;
    size_t numel;
    int decay;
} tkd_adamw_seg;

/* The hyper-parameters of one update (lr already scheduled). */
typedef struct tkd_adamw_hparams {
    double lr, beta1, beta2, eps, weight_decay;
} tkd_adamw_hparams;

/* One AdamW update of the elements of every segment of params (n) from grads · grad_scale (the
 * clip coefficient applied on the fly, fp32-rounded before use: the bits of tkd_grad_scale first;
 * 1 = unscaled; grads are not written), with moments m and v (same layout, n values of mdt each);
 * step is the 1-based count of this update (bias correction):
 *   p *= 1 − lr·wd (decay segments); m += (1 − β1)(g − m); v = β2·v + (1 − β2)·g²;
 *   p −= (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps),  bc_i = 1 − β_i^step.
 * bf16 moments (uint16_t bits) are widened to fp32 exactly, updated and used as above in fp32, and
 * stored back rounded to nearest even; params stay fp32. Elements outside every segment are not
 * touched. */
void tkd_adamw_update(float *params, const float *grads, float grad_scale, void *m, void *v, tkd_adamw_dtype mdt,
                      const tkd_adamw_seg *segs, int n_segs, const tkd_adamw_hparams *h, int64_t step);

/* Σ g² over g (n), accumulated in double (OpenMP reduction above 32768 elements). */
double tkd_grad_norm2(const float *g, size_t n);

/* g *= s (fp32), element by element. */
void tkd_grad_scale(float *g, size_t n, float s);

#ifdef __cplusplus
}
#endif

#endif /* TKD_ADAMW_H */
