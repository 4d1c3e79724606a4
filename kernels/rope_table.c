/* rope_table.c — see rope_table.h. */
#include "kernels/rope_table.h"

#include <math.h>

/* fp32 throughout and in transformers' order (_compute_default_rope_parameters and
 * _compute_llama3_parameters), so the frequencies match its to the last bit or so. */
void tkd_rope_inv_freq(double theta, int dh, int llama3, double factor, double low_ff, double high_ff,
                       int orig_max, float *inv_freq)
{
    const float two_pi = (float)(2.0 * M_PI);
    float low_wl = (float)(orig_max / low_ff), high_wl = (float)(orig_max / high_ff);
    for (int i = 0; i < dh / 2; i++) {
        float e = (float)(2 * i) / (float)dh;
        float inv = 1.0f / powf((float)theta, e);
        if (llama3) {
            float wl = two_pi / inv;
            float scaled = wl > low_wl ? inv / (float)factor : inv;
            if (!(wl < high_wl) && !(wl > low_wl)) {
                float s = ((float)orig_max / wl - (float)low_ff) / (float)(high_ff - low_ff);
                scaled = (1.0f - s) * scaled / (float)factor + s * scaled;
            }
            inv = scaled;
        }
        inv_freq[i] = inv;
    }
}

/* find_correction_dim: the dimension whose wavelength makes `rotations` turns in max_pos positions
 * (python floats: double). */
static double yarn_correction_dim(double rotations, int dh, double theta, int max_pos)
{
    return (dh * log(max_pos / (rotations * 2 * M_PI))) / (2 * log(theta));
}

void tkd_rope_inv_freq_yarn(double theta, int dh, double factor, double beta_fast, double beta_slow, int orig_max,
                            int truncate, double attention_factor, float *inv_freq, float *attn_factor)
{
    double low = yarn_correction_dim(beta_fast, dh, theta, orig_max);
    double high = yarn_correction_dim(beta_slow, dh, theta, orig_max);
    if (truncate)
        low = floor(low), high = ceil(high);
    low = low > 0 ? low : 0;
    high = high < dh - 1 ? high : dh - 1;
    if (low == high)
        high += 0.001; /* linear_ramp_factor's guard against a zero-width ramp */
    for (int i = 0; i < dh / 2; i++) {
        /* torch: base ** (arange(0, dim, 2).float() / dim) in fp32; the ramp in fp32 from the
         * python-float range */
        const float pos = powf((float)theta, (float)(2 * i) / (float)dh);
        const float extra = 1.0f / pos, inter = 1.0f / ((float)factor * pos);
        float r = ((float)i - (float)low) / (float)(high - low);
        r = r < 0.0f ? 0.0f : r > 1.0f ? 1.0f : r;
        const float w = 1.0f - r; /* the extrapolation's weight */
        inv_freq[i] = inter * (1.0f - w) + extra * w;
    }
    if (attention_factor > 0)
        *attn_factor = (float)attention_factor;
    else
        *attn_factor = factor <= 1 ? 1.0f : (float)(0.1 * log(factor) + 1.0);
}

void tkd_rope_table_scaled(const float *inv_freq, int dh, int T, float scale, float *cos_t, float *sin_t)
{
    int half = dh / 2;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            float a = inv_freq[i] * (float)t;
            cos_t[t * half + i] = (float)cos((double)a) * scale;
            sin_t[t * half + i] = (float)sin((double)a) * scale;
        }
}

void tkd_rope_table(const float *inv_freq, int dh, int T, float *cos_t, float *sin_t)
{
    tkd_rope_table_scaled(inv_freq, dh, T, 1.0f, cos_t, sin_t);
}
