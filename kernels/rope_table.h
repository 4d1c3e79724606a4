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
/* YaRN (rope_type "yarn": gpt-oss, long-context Qwen) as transformers' _compute_yarn_parameters:
 * inv = interpolation·(1 − ramp) + extrapolation·ramp, extrapolation = 1 / theta^(2i/dh),
 * interpolation = extrapolation / factor, ramp = 1 − clamp((i − low) / (high − low), 0, 1) over
 * the correction range [low, high] of beta_fast and beta_slow rotations within orig_max positions
 * (floor/ceil when truncate), clipped to [0, dh − 1]. *attn_factor: the cos/sin scale,
 * 0.1·ln(factor) + 1 (1 when factor ≤ 1), unless attention_factor > 0 is given. */
void tkd_rope_inv_freq_yarn(double theta, int dh, double factor, double beta_fast, double beta_slow, int orig_max,
                            int truncate, double attention_factor, float *inv_freq, // (dh / 2)
                            float *attn_factor);
/* cos/sin tables for positions 0..T-1: angle = (float)(inv[i] · t), as transformers' fp32 matmul. */
void tkd_rope_table(const float *inv_freq, // (dh / 2)
                    int dh, int T, float *cos_t, // (T, dh / 2)
                    float *sin_t);               // (T, dh / 2)
/* The same with both tables multiplied by scale in fp32 (YaRN's attention factor: transformers'
 * emb.cos() * attention_scaling); scale 1 gives tkd_rope_table's bits. */
void tkd_rope_table_scaled(const float *inv_freq, int dh, int T, float scale, float *cos_t, float *sin_t);

#ifdef __cplusplus
}
#endif

#endif
