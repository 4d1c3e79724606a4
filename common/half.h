/* half.h — IEEE binary16 and bfloat16 <-> float conversions, round to nearest even.
 * Header-only and usable from CUDA device code too (TKD_HD), so CPU and GPU round identically. */
#ifndef TKD_HALF_H
#define TKD_HALF_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define TKD_HD __host__ __device__
#else
#define TKD_HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

static inline TKD_HD uint32_t tkd_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline TKD_HD float tkd_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline TKD_HD float tkd_bf16_to_f32(uint16_t b) { return tkd_bits_f32((uint32_t)b << 16); }

static inline TKD_HD uint16_t tkd_f32_to_bf16(float f)
{
    uint32_t u = tkd_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a quiet NaN */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline TKD_HD float tkd_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) /* inf / nan */
        return tkd_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return tkd_bits_f32(sign);
        /* subnormal: value = man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return tkd_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline TKD_HD uint16_t tkd_f32_to_f16(float f)
{
    uint32_t u = tkd_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (a >= 0x477ff000u)                  /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below the smallest normal half (2^-14): subnormal or zero */
        /* Adding 0.5 (as float) aligns the mantissa so the FPU rounds to nearest even for us. */
        float v = tkd_bits_f32(a) + 0.5f;
        return (uint16_t)(sign | (uint16_t)(tkd_f32_bits(v) - 0x3f000000u));
    }
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round to nearest even */
    return (uint16_t)(sign | (uint16_t)(a >> 13));
}

#ifdef __cplusplus
}
#endif

#endif /* TKD_HALF_H */
