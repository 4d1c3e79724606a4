/* sm90_common.cuh — Hopper (sm_90a) plumbing shared by the *_sm90.cu kernels (lmhead_sm90.cu,
 * lmhead_grad_sm90.cu, attn_bwd_sm90.cu): shared-memory addresses, mbarriers with bounded waits, TMA
 * tile loads, bulk stores and fp32 reduce-adds to global memory, GPU-scope counters with bounded
 * waits, proxy fences, wgmma shared-memory descriptors and fences, and the host side of tensor maps.
 * Internal: included by *_sm90.cu files (built for sm_90a alone, kernels/CMakeLists.txt) and the
 * internal headers only they include (gemm_sm90_pipe.cuh). Everything is inline, so each file
 * compiles its own copy.
 *
 * Swizzled tiles: a TMA box of 64 bf16 columns (128 bytes) × R rows with CU_TENSOR_MAP_SWIZZLE_128B
 * lands as R rows of 128 bytes, 8-row groups of 1024 bytes, the 16-byte chunks of row r XOR-ed by
 * r % 8; it must start 1024-byte aligned. The same bytes serve wgmma in two ways:
 *   K-major (the 64 columns are the reduction dimension K): smem_desc, one 16-wide K step = +32
 *     bytes of start address inside the 128-byte span;
 *   MN-major (the rows are K, the 64 columns are M or N; the instruction's transpose flag set):
 *     smem_desc_mn, one 16-wide K step = 16 rows = +2048 bytes; a second 64-column block (N 128)
 *     is `lbo` bytes further (the next box).
 */
#ifndef TKD_SM90_COMMON_CUH
#define TKD_SM90_COMMON_CUH

#include <cuda.h>         /* CUtensorMap and its enums (types only: nothing links libcuda) */
#include <cudaTypedefs.h> /* PFN_cuTensorMapEncodeTiled_v12000 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_fast_math.cuh"
#include "kernels/cuda/cuda_mem.h"

namespace tkd_sm90 {

/* A wait longer than this is a broken pipeline (legitimate waits are microseconds). */
constexpr unsigned long long kWaitLimitNs = 4000000000ull;

/* ---- PTX wrappers: shared-memory addresses, mbarriers, TMA ------------------------------------- */

__device__ inline uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ inline unsigned long long globaltimer_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ inline void mbar_init(uint32_t bar, unsigned count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

/* Makes the mbarrier inits visible to the async proxy (TMA) and the other threads; call by the
 * initialising thread, then __syncthreads(). */
__device__ inline void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ inline bool mbar_try_wait(uint32_t bar, uint32_t parity)
{
    uint32_t ok;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    return ok != 0;
}

/* Waits until the phase of parity `parity` of bar completed. Bounded: after kWaitLimitNs it sets
 * *err, marks this thread failed and returns; a failed thread never waits again, so a broken
 * pipeline ends the kernel (with garbage) instead of hanging it. */
__device__ inline void mbar_wait(uint32_t bar, uint32_t parity, bool &failed, unsigned *err)
{
    if (failed)
        return;
    for (int spin = 0; spin < 1024; spin++) /* the common case: no clock reads */
        if (mbar_try_wait(bar, parity))
            return;
    const unsigned long long t0 = globaltimer_ns();
    while (!mbar_try_wait(bar, parity))
        if (globaltimer_ns() - t0 > kWaitLimitNs) {
            failed = true;
            atomicOr(err, 1u);
            return;
        }
}

__device__ inline void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ inline void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

/* The box of tm at (x = column, y = row) into shared dst, completing its bytes on bar. */
__device__ inline void tma_load_2d(uint32_t dst, const CUtensorMap *tm, int x, int y, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"((uint64_t)tm), "r"(x), "r"(y), "r"(bar) : "memory");
}

/* The box of tm at (x = column, y = row, z = batch) into shared dst, completing on bar. */
__device__ inline void tma_load_3d(uint32_t dst, const CUtensorMap *tm, int x, int y, int z, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(dst), "l"((uint64_t)tm), "r"(x), "r"(y), "r"(z), "r"(bar) : "memory");
}

/* bytes (a multiple of 16; both addresses 16-byte aligned) from global src to shared dst, a plain
 * bulk copy completing on bar. */
__device__ inline void bulk_load(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

/* 4 bytes from global src (4-byte aligned) to shared dst (4-byte aligned), an asynchronous copy of
 * this thread; src_bytes 0 writes zeros instead (src is then not read). cp_async_arrive_noinc has
 * `bar` receive one arrival (counted in its init) once this thread's earlier copies are done. */
__device__ inline void cp_async_4(uint32_t dst, const void *src, uint32_t src_bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ inline void cp_async_arrive_noinc(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

/* bytes (a multiple of 16; both 16-byte aligned) from shared src to global dst: a plain bulk copy
 * (bulk_store) or an element-wise fp32 add into dst (bulk_reduce_add_f32), in this thread's bulk
 * group; bulk_commit closes the group, bulk_wait_read waits until its shared reads are done (src may
 * be reused), bulk_wait_all until its global writes are. */
__device__ inline void bulk_store(void *dst, uint32_t src, uint32_t bytes)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
__device__ inline void bulk_reduce_add_f32(float *dst, uint32_t src, uint32_t bytes)
{
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(src),
                 "r"(bytes) : "memory");
}
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ inline void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ inline void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

/* Orders this thread's generic-proxy accesses of shared (resp. global) memory with async-proxy ones
 * (wgmma and bulk copies read shared memory through the async proxy). */
__device__ inline void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ inline void fence_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

/* GPU-scope acquire load and release add of a counter in global memory. */
__device__ inline unsigned ld_acquire(const unsigned *p)
{
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ inline void red_release_add(unsigned *p, unsigned v)
{
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* Waits until *p == want (another CTA's release_add). Bounded like mbar_wait: after kWaitLimitNs it
 * sets *err and marks this thread failed. */
__device__ inline void counter_wait(const unsigned *p, unsigned want, bool &failed, unsigned *err)
{
    if (failed)
        return;
    for (int spin = 0; spin < 256; spin++)
        if (ld_acquire(p) == want)
            return;
    const unsigned long long t0 = globaltimer_ns();
    while (ld_acquire(p) != want) {
        __nanosleep(64);
        if (globaltimer_ns() - t0 > kWaitLimitNs) {
            failed = true;
            atomicOr(err, 1u);
            return;
        }
    }
}

/* A position in a ring of kStages shared-memory stages: the stage and the parity of its current
 * phase; `failed` once a wait of this thread timed out (mbar_wait). Producer and consumers walk the
 * same sequence of loads, so their rings stay in step. */
template <int kStages>
struct Ring {
    int stage = 0;
    uint32_t phase = 0;
    bool failed = false;
    __device__ void next()
    {
        if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
        }
    }
};

/* ---- wgmma --------------------------------------------------------------------------------------- */

/* Descriptor of a K-major operand in the 128-byte swizzle layout (rows 128 bytes apart): start
 * address >> 4 (bits 0-13), leading offset 16 B (unused by this layout, bits 16-29), stride 1024 B
 * between 8-row groups (bits 32-45), base offset 0 (1024-aligned atoms), layout 1 = 128-byte
 * swizzle (bits 62-63). */
__device__ inline uint64_t smem_desc(uint32_t addr)
{
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

/* Descriptor of an MN-major operand in the same layout: rows are K (128 bytes apart, 8-row groups
 * 1024 B apart: the stride offset), 64 M/N elements per row; the next 64 M/N elements `lbo` bytes
 * further (the leading offset; unused when M/N is 64). */
__device__ inline uint64_t smem_desc_mn(uint32_t addr, uint32_t lbo)
{
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ inline void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

/* ---- wgmma instructions (bf16 × bf16 → fp32) -------------------------------------------------- *
 * Accumulator operands: d[i] is %i; TKD_WG_D32_k names %32k .. %32k+31 in the instruction string and
 * TKD_WG_ACC32(i) binds d[i .. i+31] to them. */
#define TKD_WG_D32_0 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define TKD_WG_D32_1 \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define TKD_WG_D32_2 \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define TKD_WG_D32_3 \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define TKD_WG_ACC8(i) \
    "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
        "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define TKD_WG_ACC32(i) TKD_WG_ACC8(i), TKD_WG_ACC8((i) + 8), TKD_WG_ACC8((i) + 16), TKD_WG_ACC8((i) + 24)

/* d (64 x 256 of this warpgroup, fp32 fragment) (+)= A (64 x 16) · B (256 x 16)ᵀ, both operands in
 * shared memory (descriptors), K-major unless kTransA / kTransB (then MN-major: smem_desc_mn);
 * accumulate = 0 overwrites d. */
template <int kTransA, int kTransB>
__device__ inline void wgmma_ss_n256_t(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" TKD_WG_D32_0 ", " TKD_WG_D32_1 ", "
                 TKD_WG_D32_2 ", " TKD_WG_D32_3 "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
                 : TKD_WG_ACC32(0), TKD_WG_ACC32(32), TKD_WG_ACC32(64), TKD_WG_ACC32(96)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

/* Both operands K-major. */
__device__ inline void wgmma_ss_n256(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate)
{
    wgmma_ss_n256_t<0, 0>(d, desc_a, desc_b, accumulate);
}

/* d (64 x 64, fp32 fragment) (+)= A (64 x 16) · B (64 x 16)ᵀ, both K-major in shared memory;
 * accumulate = 0 overwrites d. */
__device__ inline void wgmma_ss_n64(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" TKD_WG_D32_0 "}, %32, %33, "
                 "p, 1, 1, 0, 0;\n}\n"
                 : TKD_WG_ACC32(0)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/* d (64 x 64, fp32 fragment) (+)= A (64 x 16) · B (16 x 64), both in shared memory, K-major unless
 * kTransA / kTransB (then MN-major: smem_desc_mn); accumulate = 0 overwrites d. */
template <int kTransA, int kTransB>
__device__ inline void wgmma_ss_n64_t(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" TKD_WG_D32_0 "}, %32, %33, "
                 "p, 1, 1, %35, %36;\n}\n"
                 : TKD_WG_ACC32(0)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

/* The same with N 32 (d 64 x 32). */
template <int kTransA, int kTransB>
__device__ inline void wgmma_ss_n32_t(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
                 "%9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
                 : TKD_WG_ACC8(0), TKD_WG_ACC8(8)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

/* d (64 x 64, fp32 fragment) += A (64 x 16, bf16 pairs in registers: the accumulator layout of a 64 x 16
 * block) · B (16 x 64), B MN-major in shared memory (the transpose flag set). */
__device__ inline void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" TKD_WG_D32_0 "}, {%32, %33, %34, %35}, %36, "
                 "p, 1, 1, 1;\n}\n"
                 : TKD_WG_ACC32(0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

/* The same with B 16 x 128 (d 64 x 128). */
__device__ inline void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" TKD_WG_D32_0 ", " TKD_WG_D32_1 "}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : TKD_WG_ACC32(0), TKD_WG_ACC32(32)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

/* Keeps the compiler from moving reads or writes of d across a wgmma wait or fence. */
template <int N>
__device__ inline void fence_regs(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

using tkd_cuda::fast_exp2; /* 2^x on the special-function unit (cuda_fast_math.cuh) */

/* ---- host side ----------------------------------------------------------------------------------- */

/* cuTensorMapEncodeTiled from the driver through the runtime (no libcuda link); NULL if absent. */
inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn()
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn = []() {
        void *f = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                             &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            f = NULL;
        return (PFN_cuTensorMapEncodeTiled_v12000)f;
    }();
    return fn;
}

/* Tensor map of a bf16 tensor of `rank` (2 or 3) dimensions, innermost first: dims[0] elements
 * contiguous, strides[i] bytes between steps of dimension i + 1 (multiples of 16). Boxes of 64
 * columns (128 bytes) × box_rows rows (× 1 along a third dimension), 128-byte swizzle, zero fill
 * out of range. `who` names the caller in the error message. */
inline tkd_status make_tmap(CUtensorMap *tm, const uint16_t *ptr, int rank, const cuuint64_t *dims,
                            const cuuint64_t *strides, int box_rows, const char *who)
{
    PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
    if (!encode)
        return tkd_error_set(TKD_ERR_DEVICE, "%s: the driver has no cuTensorMapEncodeTiled", who);
    const cuuint32_t box[3] = {64, (cuuint32_t)box_rows, 1};
    const cuuint32_t elem[3] = {1, 1, 1};
    CUresult r = encode(tm, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)ptr, dims, strides, box,
                        elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return tkd_error_set(TKD_ERR_DEVICE, "%s: cuTensorMapEncodeTiled (%llu x %llu, box %d rows) failed: "
                             "CUresult %d", who, (unsigned long long)dims[1], (unsigned long long)dims[0],
                             box_rows, (int)r);
    return TKD_OK;
}

/* A row-major (rows, cols) byte matrix with leading dimension ld (a multiple of 16) as a tensor map:
 * unswizzled boxes of box_cols bytes (a multiple of 16) x box_rows rows, zero fill out of range. */
inline tkd_status make_tmap_u8(CUtensorMap *tm, const uint8_t *ptr, long long rows, long long cols, long long ld,
                               int box_cols, int box_rows, const char *who)
{
    PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
    if (!encode)
        return tkd_error_set(TKD_ERR_DEVICE, "%s: the driver has no cuTensorMapEncodeTiled", who);
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)ld};
    const cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows};
    const cuuint32_t elem[2] = {1, 1};
    CUresult r = encode(tm, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, (void *)ptr, dims, strides, box, elem,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return tkd_error_set(TKD_ERR_DEVICE, "%s: cuTensorMapEncodeTiled (%lld x %lld bytes, box %d x %d) failed: "
                             "CUresult %d", who, rows, cols, box_rows, box_cols, (int)r);
    return TKD_OK;
}

/* TKD_OK when the current device is compute capability 9.0, else TKD_ERR_UNSUPPORTED naming it and
 * `who` (the caller falls back to another path). */
inline tkd_status check_cc90(const char *who)
{
    int dev = 0, major = 0, minor = 0;
    TKD_CUDA_CHECK(cudaGetDevice(&dev));
    TKD_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    TKD_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major != 9 || minor != 0)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: device %d is compute capability %d.%d; this kernel is "
                             "built for 9.0 (sm_90a) only", who, dev, major, minor);
    return TKD_OK;
}

/* Synchronises the device, then reads (and clears) a device error flag the bounded waits set:
 * TKD_ERR_INTERNAL naming `who` when a wait timed out since the last check. */
inline tkd_status check_wait_flag(unsigned *err, const char *who)
{
    TKD_CUDA_CHECK(cudaDeviceSynchronize());
    unsigned h = 0;
    TKD_TRY(tkd_cuda_to_host(&h, err, sizeof h));
    if (h == 0)
        return TKD_OK;
    TKD_TRY(tkd_cuda_memzero(err, sizeof *err));
    return tkd_error_set(TKD_ERR_INTERNAL, "%s: an mbarrier wait timed out (%.0f s) in a kernel launched on this "
                         "workspace: a pipeline bug; its outputs are garbage", who, kWaitLimitNs * 1e-9);
}

} // namespace tkd_sm90

#endif /* TKD_SM90_COMMON_CUH */
