/* teacher_bench_cuda.cu — teacher_bench's random weights drawn on the device: a benchmark of a
 * 30B-parameter MoE cannot spend minutes on the seeded host draws (model.h), and its speed does not
 * depend on which normal draws the weights are. Norm weights 1, biases 0, the rest N(0, std²) from a
 * counter hash (Box–Muller), bf16; MXFP4 experts (m->qlayer) random codes at scale 2^-7. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "model/model.h"

namespace {

__device__ __forceinline__ uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* kind 0: N(0, std²); 1: ones; 2: zeros */
__global__ void fill_kernel(__nv_bfloat16 *p, size_t n, int kind, float std, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = kind == 1 ? 1.0f : 0.0f;
        if (kind == 0) {
            const uint64_t r = mix(seed + 0x9e3779b97f4a7c15ull * (i + 1));
            const float u1 = ((uint32_t)r + 1.0f) * 2.3283064e-10f, u2 = (uint32_t)(r >> 32) * 2.3283064e-10f;
            v = std * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
        }
        p[i] = __float2bfloat16_rn(v);
    }
}

__global__ void fill_bytes_kernel(uint8_t *p, size_t n, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (uint8_t)(mix(seed + 0x9e3779b97f4a7c15ull * (i + 1)) >> 56);
}

} // namespace

/* Fills every tensor of m (a CUDA model: bf16 m->dparams); 0 on success. */
extern "C" int bench_fill_weights_cuda(tkd_model *m, uint64_t seed)
{
    __nv_bfloat16 *base = static_cast<__nv_bfloat16 *>(m->dparams);
    for (int i = 0; i < m->n_info; i++) {
        const tkd_param_info *p = &m->info[i];
        const int kind = strstr(p->name, "norm.weight") ? 1 : strstr(p->name, ".bias") ? 2 : 0;
        fill_kernel<<<1024, 256>>>(base + p->offset, p->numel, kind, m->cfg.initializer_range, seed + 7919ull * i);
    }
    for (int l = 0; m->qlayer && l < m->cfg.num_hidden_layers; l++) /* MXFP4 experts: random codes, */
        for (int j = 0; j < 3; j++) {                                   /* scales 2^-7 (values ≤ 0.05) */
            const size_t rows = (size_t)m->cfg.num_experts * (j == 2 ? m->cfg.hidden_size : m->cfg.moe_intermediate_size);
            const size_t groups = (size_t)(j == 2 ? m->cfg.moe_intermediate_size : m->cfg.hidden_size) / 32;
            fill_bytes_kernel<<<1024, 256>>>((uint8_t *)m->qlayer[l].blocks[j], rows * groups * 16, seed + 31ull * l + j);
            cudaMemset((void *)m->qlayer[l].scales[j], 120, rows * groups);
        }
    return cudaDeviceSynchronize() != cudaSuccess;
}
