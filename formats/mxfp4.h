/* mxfp4.h — MXFP4 weights as gpt-oss checkpoints store their MoE experts: decoding, reading a
 * checkpoint's <name>_blocks / <name>_scales pair, and config.json's quantization_config.
 *
 * The format (OCP Microscaling, as transformers' integrations/mxfp4.py reads it): 32 values share
 * one scale. `<name>_blocks` is U8 (..., G, 16): 16 bytes = 32 FP4 E2M1 codes, two a byte, the LOW
 * nibble the earlier value (transformers puts lut[b & 0xF] at even positions, lut[b >> 4] at odd
 * ones). `<name>_scales` is U8 (..., G): an E8M0 exponent s, the block's scale 2^(s − 127). Code c
 * means E2M1[c] = {+0, .5, 1, 1.5, 2, 3, 4, 6, −0, −.5, −1, −1.5, −2, −3, −4, −6}[c]; the value is
 * E2M1[c] · 2^(s − 127), so a row of G blocks is G·32 values.
 *
 * Exactness. Every E2M1 value has at most two significant bits and |value| ≥ 0.5·2^−127 = 2^−128 when
 * non-zero, so E2M1 · 2^(s − 127) is exact in fp32 (subnormals reach 2^−149; 0.5·2^−127 is a
 * subnormal, held exactly) and in bf16 (same exponent range, subnormals to 2^−133, one mantissa bit
 * needed) whenever it is finite. Refused, naming the tensor and the block: scale 0xFF (E8M0's NaN)
 * and a block with a value ≥ 2^128 (beyond fp32 and bf16: e.g. code 4 (2.0) with s = 254).
 * transformers would give inf there; a checkpoint holding it is corrupt, so we stop instead.
 */
#ifndef TKD_MXFP4_H
#define TKD_MXFP4_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/mxfp4_codec.h" /* the format itself: values, blocks, decoding */
#include "formats/safetensors.h"

struct cJSON;

/* ---- a checkpoint's pair --------------------------------------------------------------------- */

/* Whether d holds <name>_blocks / <name>_scales, and the shape transformers 5 gives the dequantised
 * parameter. *found = 0 (TKD_OK) when neither tensor exists: the checkpoint stores <name> itself, or
 * not at all. Otherwise the pair must be: both U8, blocks 4-D (E, R, G, 16), scales (E, R, G); then
 * out_shape = (E, G·32, R). transformers' convert_moe_packed_tensors dequantises to (E, R, G·32) and
 * transposes dims 1 and 2, which gpt-oss keeps (its experts are "is_transposed": x @ W[e]):
 *   gate_up_proj_blocks (E, 2I, D/32, 16) -> gate_up_proj (E, D, 2I)
 *   down_proj_blocks    (E, D, I/32, 16)  -> down_proj    (E, I, D)
 * A broken pair (one of the two missing, not U8, a last dim other than 16, scales not the blocks'
 * shape without it) is TKD_ERR_FORMAT naming both tensors. */
tkd_status tkd_mxfp4_probe(const tkd_st_dir *d, const char *name, int *found, int64_t out_shape[3]);

/* Reads <name>_blocks / <name>_scales dequantised into dst (E, K, R) as tkd_mxfp4_probe describes:
 * dtype TKD_DTYPE_F32 (dst is float *) or TKD_DTYPE_BF16 (dst is uint16_t * of bf16 bits); n is
 * dst's element count and must be E·K·R. expect_shape (E, K, R) is what config.json implies; another
 * shape is TKD_ERR_MISMATCH naming both tensors. A missing pair is TKD_ERR_NOT_FOUND. */
tkd_status tkd_mxfp4_read(const tkd_st_dir *d, const char *name, const int64_t expect_shape[3], tkd_dtype dtype,
                          void *dst, size_t n);

/* ---- config.json's quantization_config -------------------------------------------------------- */

typedef struct tkd_mxfp4_quant {
    int mxfp4;            /* 1: quant_method "mxfp4"; 0: no quantization_config (or null) */
    int dequantize;       /* its "dequantize" (a loading choice of transformers; no effect on values) */
    int n_not_convert;
    char **not_convert;   /* modules_to_not_convert, as written (patterns such as "model.layers.*.self_attn") */
} tkd_mxfp4_quant;

/* Reads a config.json's "quantization_config" value qc (NULL or JSON null: not quantised) into *out,
 * which the caller releases with tkd_mxfp4_quant_free. gpt-oss writes
 *   {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
 *    "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
 * and those modules stay bf16 in the checkpoint (so do every bias and norm): only tensors stored as a
 * _blocks/_scales pair are MXFP4. Another quant_method is TKD_ERR_UNSUPPORTED naming it; a wrong type
 * is TKD_ERR_FORMAT naming "quantization_config.<key>" in path. Keys other than these three are
 * ignored, as transformers' Mxfp4Config ignores them. */
tkd_status tkd_mxfp4_quant_parse(const struct cJSON *qc, const char *path, tkd_mxfp4_quant *out);
void tkd_mxfp4_quant_free(tkd_mxfp4_quant *q); /* NULL is a no-op; leaves *q zeroed */

#endif /* TKD_MXFP4_H */
