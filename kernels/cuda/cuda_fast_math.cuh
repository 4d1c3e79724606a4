/* cuda_fast_math.cuh — the one fast 2^x the CUDA kernels share (attention, the KL loss, the Hopper
 * LM-head GEMMs). Internal: include from .cu files and their internal headers only. */
#ifndef TKD_CUDA_FAST_MATH_CUH
#define TKD_CUDA_FAST_MATH_CUH

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

} // namespace tkd_cuda

#endif /* TKD_CUDA_FAST_MATH_CUH */
