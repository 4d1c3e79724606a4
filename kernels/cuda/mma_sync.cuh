/* mma_sync.cuh — the PTX wrappers of our mma.sync kernels (sm_80 and later): the asynchronous
 * global → shared copy, ldmatrix and the bf16 tensor-core product. The flash attention kernels
 * (kernels/attn/attn_cuda_common.cuh) and the MoE grouped GEMM (moe_gemm_cuda.cu) take them from
 * here. CUDA device code only.
 *
 * Fragment layouts (PTX ISA, mma.m16n8k16 bf16, lane = 4·g + t): A regs {(g, 2t), (g+8, 2t),
 * (g, 2t+8), (g+8, 2t+8)}, B regs {(2t, g), (2t+8, g)}, C {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
 */
#ifndef TKD_MMA_SYNC_CUH
#define TKD_MMA_SYNC_CUH

#include <stdint.h>

namespace tkd_cuda {

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/* 16-byte global → shared copy through L2 only; src_bytes = 0 stores 16 zero bytes and reads nothing. */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

/* Waits until at most N committed groups are still in flight. */
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

/* Four 8×8 bf16 matrices; lanes 8i .. 8i+7 give the row addresses of matrix i, r[i] receives
 * (row lane/4, columns 2(lane%4), +1) of matrix i, or with .trans (rows 2(lane%4), +1; column lane/4). */
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t r[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t r[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* c (16×8 fp32) += a (16×16 bf16, row) · b (16×8 bf16, col). */
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

} // namespace tkd_cuda

#endif /* TKD_MMA_SYNC_CUH */
