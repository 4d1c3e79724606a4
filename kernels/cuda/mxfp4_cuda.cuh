/* mxfp4_cuda.cuh — MXFP4 decoding on the device (the format of common/mxfp4_codec.h: E2M1 codes two
 * a byte, the earlier in the low nibble, one E8M0 scale per 32), shared by the MoE op's layer
 * decoder (moe_cuda.cu) and the Hopper GEMM that decodes inside its pipeline
 * (gemm_sm90/moe_gemm_sm90.cu). Both give common/mxfp4_codec.h's values bit for bit. Internal. */
#ifndef TKD_MXFP4_CUDA_CUH
#define TKD_MXFP4_CUDA_CUH

#include <stdint.h>

namespace tkd_mx {

/* 8 E2M1 codes (a word, the earliest in the low nibble) as 4 bf16 pairs, in order (the earlier of
 * a pair in the low half), each the code's value times 2^−126: the sign to bit 15, the magnitude's
 * 3 bits (exponent e, mantissa m) to bits 8..6, so e ≥ 1 reads as 2^(e − 127)·(1 + m/2) and e 0
 * as the subnormal m·2^−127, the code's value 2^(e − 1)·(1 + m/2) (m/2 for e 0) times 2^−126.
 * Pair b's codes are byte b's nibbles: one byte permute puts the low one at bits 12..15 (from w
 * shifted by 4) and the high one at bits 28..31, where a mask keeps the signs and a shift by 6
 * moves the magnitudes. */
__device__ __forceinline__ void e2m1x8_bits(uint32_t w, uint32_t (&r)[4])
{
    const uint32_t w4 = w << 4;
#pragma unroll
    for (int b = 0; b < 4; b++) {
        const uint32_t src = __byte_perm(w4, w, 0x4400u + 0x1111u * b);
        r[b] = (src & 0x80008000u) | ((src >> 6) & 0x01C001C0u);
    }
}

/* The pairs r of e2m1x8_bits times 2^(s − 127), any scale s: each value as fp32 (exact: the code
 * value times 2^(s − 127) has two significant bits), truncated to its upper half, which is exact
 * wherever the value is a bf16 (every scale but those giving values past bf16's range), and
 * otherwise what the format's reference (common/mxfp4_codec.h) takes as the bf16 value. */
__device__ __forceinline__ void scale_f32(uint32_t (&r)[4], unsigned s)
{
    const float f = __uint_as_float(s ? s << 23 : 0x00400000u); /* 2^(s − 127); s 0: subnormal */
#pragma unroll
    for (int j = 0; j < 4; j++) { /* ·2^126: the code values, exactly */
        const float lo = __uint_as_float(r[j] << 16) * 0x1p126f * f;
        const float hi = __uint_as_float(r[j] & 0xFFFF0000u) * 0x1p126f * f;
        r[j] = (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xFFFF0000u);
    }
}

} // namespace tkd_mx

#endif /* TKD_MXFP4_CUDA_CUH */
