/* grad_clip.h — the gradient-clipping coefficient, one scalar formula for every backend and both
 * optimizers (model/optim.c's, student_train/zero.c's sharded one): the norm comes from the backend
 * (grad_norm2), the scale goes back through it (grad_scale). Backend-neutral: plain C. */
#ifndef TKD_GRAD_CLIP_H
#define TKD_GRAD_CLIP_H

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The factor torch.nn.utils.clip_grad_norm_ scales by for global norm `norm` and cap max_norm:
 * (float)(max_norm / (norm + 1e-6)) when that is below 1, else 1 (also when max_norm <= 0, no
 * clipping). A non-finite norm is TKD_ERR_NUMERIC ("the step is skipped"), *coef untouched. */
tkd_status tkd_grad_clip_coef(double norm, double max_norm, float *coef);

#ifdef __cplusplus
}
#endif

#endif
