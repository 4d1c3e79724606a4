/* grad_clip.c — see grad_clip.h. */
#include "kernels/grad_clip.h"

#include <math.h>

tkd_status tkd_grad_clip_coef(double norm, double max_norm, float *coef)
{
    if (!isfinite(norm))
        return tkd_error_set(TKD_ERR_NUMERIC, "gradient norm is %g: the step is skipped (lower the lr?)", norm);
    float c = 1.0f;
    if (max_norm > 0) {
        float r = (float)(max_norm / (norm + 1e-6));
        if (r < 1.0f)
            c = r;
    }
    *coef = c;
    return TKD_OK;
}
