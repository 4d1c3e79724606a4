/* cuda_fast_math.cuh — the small device math the CUDA kernels share: the one fast 2^x (attention,
 * the KL loss, the Hopper LM-head GEMMs), scalar bf16 <-> fp32 and fp32 warp reductions (the simple
 * attention kernels). Internal: include from .cu files and their internal headers only. */
#ifndef TKD_CUDA_FAST_MATH_CUH
#define TKD_CUDA_FAST_MATH_CUH

#include <cuda_bf16.h>
#include <stdint.h>

namespace tkd_cuda {

/* 2^x on the special-function unit (ex2.approx.ftz: ~2 ulp); subnormal results flush to 0 and
 * 2^-inf is 0. exp2f would add a subnormal fix-up to every call, and a probability below 1e-38 is
 * 0 for every user here. */
__device__ __forceinline__ float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* A bf16 (its bits) as fp32: exact. */
__device__ __forceinline__ float bf(uint16_t x) { return __uint_as_float((unsigned)x << 16); }

/* fp32 to bf16 bits, round to nearest even (cuda_bf16.h's rounding). */
__device__ __forceinline__ uint16_t to_bf(float x)
{
    __nv_bfloat16 b = __float2bfloat16_rn(x);
    return *reinterpret_cast<uint16_t *>(&b);
}

/* The max and the sum of x over the 32 lanes of a full warp (butterfly: every lane gets it). */
__device__ __forceinline__ float warp_max(float x)
{
    for (int o = 16; o > 0; o >>= 1)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

} // namespace tkd_cuda

#endif /* TKD_CUDA_FAST_MATH_CUH */
