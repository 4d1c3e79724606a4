/* rope_table.h — the RoPE frequency and cos/sin tables, built on the host for every backend: the
 * model builds them once at load and the CUDA backend uploads them (model/model.c), the CPU ops
 * and their references read them as they are (kernels/cpu/cpu_ops.h, cpu_ops_ref.h). Backend-neutral:
 * plain C, no backend state. */
#ifndef TKD_ROPE_TABLE_H
#define TKD_ROPE_TABLE_H

#ifdef __cplusplus
extern "C" {
#endif

/* RoPE inverse frequencies as transformers computes them (fp32 arithmetic, same order):
 * inv[i] = 1 / theta^(2i / dh); with llama3 scaling (llama3 != 0) wavelengths 2π/inv above
 * orig_max / low_ff are divided by factor, those below orig_max / high_ff kept, smoothed between. */
void tkd_rope_inv_freq(double theta, int dh, int llama3, double factor, double low_ff, double high_ff,
                       int orig_max, float *inv_freq); // (dh / 2)
/* cos/sin tables for positions 0..T-1: angle = (float)(inv[i] · t), as transformers' fp32 matmul. */
void tkd_rope_table(const float *inv_freq, // (dh / 2)
                    int dh, int T, float *cos_t, // (T, dh / 2)
                    float *sin_t);               // (T, dh / 2)

#ifdef __cplusplus
}
#endif

#endif
