/* mxfp4_codec.c — see mxfp4_codec.h. */
#include "common/mxfp4_codec.h"

#include <math.h>
#include <stdio.h>

#include "common/half.h"

/* E2M1 code -> value: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; transformers'
 * FP4_VALUES. */
static const float E2M1[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float tkd_mxfp4_value(unsigned code, unsigned scale)
{
    return ldexpf(E2M1[code & 15u], (int)(scale & 255u) - 127);
}

/* ---- decoding ----------------------------------------------------------------------------------- */

void tkd_mxfp4_lut_init(tkd_mxfp4_lut *t)
{
    for (int b = 0; b < 256; b++) {
        t->v[b][0] = E2M1[b & 15];
        t->v[b][1] = E2M1[b >> 4];
    }
}

/* 2^(s − 127) from its bits: s ≥ 1 is the normal number with exponent field s, s = 0 the subnormal
 * 2^−127 (mantissa bit 22). Multiplying an E2M1 value by it is exact (mxfp4.h), so this equals
 * ldexpf. s = 255 would be inf: callers refuse it first. */
static float pow2_scale(unsigned s)
{
    return tkd_bits_f32(s ? (uint32_t)s << 23 : 0x00400000u);
}

enum { BLOCK_OK = 0, BLOCK_NAN_SCALE, BLOCK_OVERFLOW };

/* One block: 16 bytes b with scale s into out[32]. */
static int decode_block(const tkd_mxfp4_lut *t, const uint8_t *b, unsigned s, float *out)
{
    if (s == 0xFFu)
        return BLOCK_NAN_SCALE;
    float f = pow2_scale(s);
    int inf = 0;
    for (int i = 0; i < TKD_MXFP4_BLOCK_BYTES; i++) {
        float lo = t->v[b[i]][0] * f, hi = t->v[b[i]][1] * f;
        out[2 * i] = lo;
        out[2 * i + 1] = hi;
        inf |= isinf(lo) | isinf(hi);
    }
    return inf ? BLOCK_OVERFLOW : BLOCK_OK;
}

/* The message of a refused block; at is its index ("[e, r, g]" or "[r, g]"). */
static tkd_status block_error(int why, const char *what, const char *at, unsigned s)
{
    if (why == BLOCK_NAN_SCALE)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: block %s has scale 0xFF, E8M0's NaN: the checkpoint is corrupt",
                             what, at);
    return tkd_error_set(TKD_ERR_FORMAT,
                         "%s: block %s (scale %u = 2^%d) holds a value >= 2^128, beyond fp32 and bf16: the "
                         "checkpoint is corrupt",
                         what, at, s, (int)s - 127);
}

tkd_status tkd_mxfp4_decode_rows(const tkd_mxfp4_lut *t, const uint8_t *blocks, const uint8_t *scales, int64_t rows,
                              int64_t groups, float *f32, uint16_t *bf16, const char *what, int64_t e,
                              int64_t r_base)
{
    float tmp[TKD_MXFP4_BLOCK];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            int64_t i = r * groups + g;
            float *o = f32 ? f32 + i * TKD_MXFP4_BLOCK : tmp;
            int why = decode_block(t, blocks + i * TKD_MXFP4_BLOCK_BYTES, scales[i], o);
            if (why != BLOCK_OK) {
                char at[96];
                if (e >= 0)
                    snprintf(at, sizeof at, "[%lld, %lld, %lld]", (long long)e, (long long)(r_base + r),
                             (long long)g);
                else
                    snprintf(at, sizeof at, "[%lld, %lld]", (long long)(r_base + r), (long long)g);
                return block_error(why, what, at, scales[i]);
            }
            if (!f32) /* exact: the value has <= 2 significant bits within bf16's range (mxfp4.h) */
                for (int j = 0; j < TKD_MXFP4_BLOCK; j++)
                    bf16[i * TKD_MXFP4_BLOCK + j] = (uint16_t)(tkd_f32_bits(tmp[j]) >> 16);
        }
    return TKD_OK;
}

tkd_status tkd_mxfp4_decode_f32(const uint8_t *blocks, const uint8_t *scales, int64_t rows, int64_t groups,
                                float *dst, const char *what)
{
    tkd_mxfp4_lut t;
    tkd_mxfp4_lut_init(&t);
    return tkd_mxfp4_decode_rows(&t, blocks, scales, rows, groups, dst, NULL, what, -1, 0);
}

tkd_status tkd_mxfp4_decode_bf16(const uint8_t *blocks, const uint8_t *scales, int64_t rows, int64_t groups,
                                 uint16_t *dst, const char *what)
{
    tkd_mxfp4_lut t;
    tkd_mxfp4_lut_init(&t);
    return tkd_mxfp4_decode_rows(&t, blocks, scales, rows, groups, NULL, dst, what, -1, 0);
}

