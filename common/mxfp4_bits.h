/* mxfp4_bits.h — the MXFP4 decode the CUDA MoE op runs (kernels/cuda/moe_cuda.cu's layer decoder
 * and gemm_sm90/moe_gemm_sm90.cu's decode inside the GEMM), written once for the host and the
 * device so the CPU tests hold it to common/mxfp4_codec.h's values for every code and scale
 * (tests/test_mxfp4.c: test_device_bits). Header-only (TKD_HD, common/half.h).
 *
 * Eight E2M1 codes (a word, the earliest in the low nibble) become four bf16 pairs, in order (the
 * earlier of a pair in the low half), each the code's value times 2^−126: the sign to bit 15, the
 * magnitude's 3 bits (exponent e, mantissa m) to bits 8..6, so e ≥ 1 reads as 2^(e − 127)·(1 + m/2)
 * and e 0 as the subnormal m·2^−127: the code's value 2^(e − 1)·(1 + m/2) (m/2 for e 0) times
 * 2^−126. Then the scale s: for 2 ≤ s ≤ 128 one bf16 multiply of a pair by 2^(s − 1) (a normal
 * bf16) is exact, every product being a normal (≥ 2^−126) multiple of a code's value with two
 * significant bits; any s, the fp32 product of the value and 2^(s − 127), truncated to its upper
 * half (what common/mxfp4_codec.h takes as the bf16 value). */
#ifndef TKD_MXFP4_BITS_H
#define TKD_MXFP4_BITS_H

#include <stdint.h>

#include "common/half.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__CUDACC__)
#define TKD_MXFP4_UNROLL _Pragma("unroll")
#else
#define TKD_MXFP4_UNROLL
#endif

/* The codes of byte b of w as a bf16 pair: its low nibble at bits 12..15 (w shifted by 4) and its
 * high one at bits 28..31 (one byte permute on the device; bytes 0 and 2 are not read), then a
 * mask keeps the signs and a shift by 6 moves the magnitudes. */
static inline TKD_HD void tkd_mxfp4_e2m1x8_bits(uint32_t w, uint32_t r[4])
{
    const uint32_t w4 = w << 4;
    TKD_MXFP4_UNROLL
    for (int b = 0; b < 4; b++) {
#if defined(__CUDA_ARCH__)
        const uint32_t src = __byte_perm(w4, w, 0x4400u + 0x1111u * (unsigned)b);
#else
        const uint32_t src = ((w4 >> (8 * b)) & 0xFFu) << 8 | ((w >> (8 * b)) & 0xFFu) << 24;
#endif
        r[b] = (src & 0x80008000u) | ((src >> 6) & 0x01C001C0u);
    }
}

/* Whether scale s takes the bf16 multiply, and its multiplier 2^(s − 1) in both halves. */
static inline TKD_HD int tkd_mxfp4_fast_scale(unsigned s) { return s >= 2 && s <= 128; }
static inline TKD_HD uint32_t tkd_mxfp4_fast_multiplier(unsigned s) { return ((s + 126u) << 7) * 0x10001u; }

/* The pairs r of tkd_mxfp4_e2m1x8_bits times 2^(s − 127), any scale: each value in fp32 (exact),
 * truncated to its upper half. */
static inline TKD_HD void tkd_mxfp4_scale_f32(uint32_t r[4], unsigned s)
{
    const float f = tkd_bits_f32(s ? s << 23 : 0x00400000u); /* 2^(s − 127); s 0: subnormal */
    TKD_MXFP4_UNROLL
    for (int j = 0; j < 4; j++) { /* ·2^126: the code values, exactly */
        const float lo = tkd_bits_f32(r[j] << 16) * 0x1p126f * f;
        const float hi = tkd_bits_f32(r[j] & 0xFFFF0000u) * 0x1p126f * f;
        r[j] = (tkd_f32_bits(lo) >> 16) | (tkd_f32_bits(hi) & 0xFFFF0000u);
    }
}

#ifdef __cplusplus
}
#endif

#endif /* TKD_MXFP4_BITS_H */
