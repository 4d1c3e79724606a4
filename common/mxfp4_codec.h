/* mxfp4_codec.h — MXFP4 values and blocks (the format formats/mxfp4.h describes: E2M1 codes two a
 * byte, the low nibble first, one E8M0 scale per 32 values), decoded exactly to fp32 or bf16. Here
 * in common/ because both the checkpoint reader (formats/mxfp4.c) and the MoE op, which keeps
 * gpt-oss's experts in MXFP4 and decodes an expert at a time (kernels/cpu/cpu_moe.c), use it. */
#ifndef TKD_MXFP4_CODEC_H
#define TKD_MXFP4_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define TKD_MXFP4_BLOCK 32       /* values per block (one scale) */
#define TKD_MXFP4_BLOCK_BYTES 16 /* bytes per block: two E2M1 codes a byte */

/* The scalar reference: code (0..15) times 2^(scale − 127) by ldexpf, for any scale 0..255 (so it can
 * be inf, or finite for 0xFF, where the decoders below refuse the block). */
float tkd_mxfp4_value(unsigned code, unsigned scale);

/* Dequantises blocks (rows, G, 16) with scales (rows, G) into dst (rows, G·32): fp32, or bf16 bits
 * (exactly the fp32 value's upper half: see above). Table-driven (one 256-entry byte → two values
 * table), equal bit for bit to tkd_mxfp4_value. A refused block (scale 0xFF, a value ≥ 2^128) is
 * TKD_ERR_FORMAT "<what>: block [r, g] ..." and dst is then partly written. */
tkd_status tkd_mxfp4_decode_f32(const uint8_t *blocks, const uint8_t *scales, int64_t rows, int64_t groups,
                                float *dst, const char *what);
tkd_status tkd_mxfp4_decode_bf16(const uint8_t *blocks, const uint8_t *scales, int64_t rows, int64_t groups,
                                 uint16_t *dst, const char *what);

/* byte -> its two values at scale 1: [0] from the low nibble (the earlier element), [1] the high. */
typedef struct tkd_mxfp4_lut {
    float v[256][2];
} tkd_mxfp4_lut;
void tkd_mxfp4_lut_init(tkd_mxfp4_lut *t);

/* Rows [0, rows) of blocks (rows, G, 16) / scales (rows, G) into f32 (rows, G·32) or, when f32 is
 * NULL, bf16 (rows, G·32). Messages name what and number the rows from r_base, inside expert e
 * when e ≥ 0. */
tkd_status tkd_mxfp4_decode_rows(const tkd_mxfp4_lut *t, const uint8_t *blocks, const uint8_t *scales, int64_t rows,
                                 int64_t groups, float *f32, uint16_t *bf16, const char *what, int64_t e,
                                 int64_t r_base);

#endif /* TKD_MXFP4_CODEC_H */
