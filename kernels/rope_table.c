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

void tkd_rope_table(const float *inv_freq, int dh, int T, float *cos_t, float *sin_t)
{
    int half = dh / 2;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            float a = inv_freq[i] * (float)t;
            cos_t[t * half + i] = (float)cos((double)a);
            sin_t[t * half + i] = (float)sin((double)a);
        }
}
