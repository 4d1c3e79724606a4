/* half.h — IEEE binary16 and bfloat16 <-> float conversions, round to nearest even, and the exact
 * split of a float into a bf16 and an int16 residual.
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

/* Exact fp32 in 4 bytes as a bf16 plus an int16 residual (the CUDA backend's master weights: the
 * bf16 half is the compute copy itself, so the master costs 2 bytes beyond it, not 4):
 *   hi = (bits(f) + 0x8000) & 0xffff0000, lo = bits(f) − hi ∈ [−0x8000, 0x7fff],
 *   f  = bits⁻¹((uint32)(hi << 16) + (int32)lo), exactly (modulo 2^32).
 * Rounding the bit pattern half up is monotone within each sign, so hi is f rounded to the nearest
 * bf16 with ties away from zero: it differs from tkd_f32_to_bf16 (ties to even) only at exact ties
 * (low 16 bits 0x8000), and is within half a bf16 ulp of f. Edges: ±0 stay ±0; subnormals round
 * like any other pattern; a carry into the exponent gives the next power of two, as RNE does;
 * |f| ≥ 0x1.fep127 (patterns ≥ 0x7f7f8000, the top half-ulp) gets hi = ±inf with lo < 0, as RNE
 * also gives inf there, and still joins back exactly; ±inf is hi = ±inf, lo = 0. A NaN becomes
 * tkd_f32_to_bf16's quiet NaN with lo = 0: it joins back to a NaN, but not to its payload. */
static inline TKD_HD uint16_t tkd_f32_split_bf16(float f, int16_t *lo)
{
    uint32_t u = tkd_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        *lo = 0;
        return (uint16_t)((u >> 16) | 0x40u);
    }
    *lo = (int16_t)((int32_t)((u + 0x8000u) & 0xffffu) - 0x8000);
    return (uint16_t)((u + 0x8000u) >> 16);
}

/* The fp32 that tkd_f32_split_bf16 split into hi and lo. */
static inline TKD_HD float tkd_bf16_join_f32(uint16_t hi, int16_t lo)
{
    return tkd_bits_f32(((uint32_t)hi << 16) + (uint32_t)(int32_t)lo);
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
