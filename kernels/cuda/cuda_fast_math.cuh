/* cuda_fast_math.cuh — the small device helpers the CUDA kernels share: the one fast 2^x (attention,
 * the KL loss, the Hopper LM-head GEMMs), scalar bf16 <-> fp32 and fp32 warp reductions (the simple
 * attention kernels), a padded float4-or-scalar load and the block scan (top-k, tail draws).
 * Internal: include from .cu files and their internal headers only. */
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

/* VEC (1 or 4) consecutive floats at p into x (one float4 when VEC = 4: p 16-byte aligned), or VEC
 * copies of pad when !in (p is then not read). */
template <int VEC> __device__ __forceinline__ void load_or(const float *p, bool in, float pad, float *x)
{
    if (VEC == 4) {
        const float4 f = in ? *reinterpret_cast<const float4 *>(p) : make_float4(pad, pad, pad, pad);
        x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
    } else {
        x[0] = in ? *p : pad;
    }
}

/* Inclusive scan of one value per thread over a block of WARPS full warps, in a fixed order (exact
 * for integers); *total gets the block sum (every thread). warp_tot holds WARPS values of shared
 * memory; two barriers inside, so every thread calls it. */
template <int WARPS, class T> __device__ __forceinline__ T block_scan(T x, T *warp_tot, T *total)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    T incl = x;
    for (int off = 1; off < 32; off <<= 1) {
        const T t = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off)
            incl += t;
    }
    if (lane == 31)
        warp_tot[w] = incl;
    __syncthreads();
    T before = 0, sum = 0;
    for (int i = 0; i < WARPS; i++) {
        before += i < w ? warp_tot[i] : 0;
        sum += warp_tot[i];
    }
    __syncthreads();
    *total = sum;
    return before + incl;
}

} // namespace tkd_cuda

#endif /* TKD_CUDA_FAST_MATH_CUH */
