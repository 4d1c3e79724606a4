/* moe_gemm_cuda.cu — see moe_gemm_cuda.h. One CTA computes a 128 × 128 block of one projection's
 * output: the rows of one M-tile (one expert) against 128 of that expert's weight rows.
 *
 * Both operands are K-major ("NT": x rows and W rows contiguous in k), so a tile of either stored
 * row-major in shared memory gives mma.m16n8k16's fragments through a plain ldmatrix (the A
 * operand row-major, the B operand "col" = W's rows). 8 warps as 2 (M) × 4 (N), each 64 × 32:
 * 4 × 4 m16n8 accumulators (64 fp32 a thread). K advances 32 at a time through a 4-stage cp.async
 * pipeline (4 × (128 + 128) × 32 bf16 = 64 KB of dynamic shared memory; two CTAs an SM).
 *
 * Shared layout: a stage's tile row holds 32 bf16 = 64 bytes = four 16-byte chunks, and chunk c of
 * row r sits in slot c ^ ((r >> 1) & 3). Without the swizzle the 8 row addresses of one ldmatrix
 * phase (rows r..r+7, one chunk) fall in only 2 of the 8 16-byte bank groups of a 128-byte line
 * (4-way conflicts); with it, (r & 1, (r >> 1) & 3) takes all 8 values over 8 consecutive rows, so
 * they fall in 8 different groups.
 *
 * Edges: rows past the tile's count or past m and weight rows past n are loaded as zeros
 * (cp.async's zero fill, reading nothing) and never stored; k % 8 == 0, so a 16-byte chunk is
 * wholly inside k or wholly past it (zeros: they add nothing).
 *
 * The PTX wrappers are kernels/cuda/mma_sync.cuh's, shared with the flash attention kernels.
 */
#include "kernels/cuda/moe_gemm_cuda.h"

#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma_sync.cuh"

namespace {

constexpr int kBM = TKD_MOE_GEMM_TILE_M, kBN = 128, kBK = 32, kStages = 4, kThreads = 256;
constexpr int kTileElems = kBM * kBK; /* one operand's tile in one stage (kBM == kBN) */
constexpr int kSmemBytes = kStages * 2 * kTileElems * 2;
static_assert(kBM == kBN, "A and B tiles share the load and the layout");

using tkd_cuda::cp_async16; /* the PTX wrappers: kernels/cuda/mma_sync.cuh */
using tkd_cuda::cp_async_commit;
using tkd_cuda::cp_async_wait;
using tkd_cuda::ldsm_x4;
using tkd_cuda::mma_bf16;
using tkd_cuda::smem_addr;

/* The element offset of (row, col) in a stage's tile (kBK columns; col a multiple of 8): the
 * swizzle of the file's comment. */
__device__ __forceinline__ int swz(int row, int col)
{
    return row * kBK + ((((col >> 3) ^ (row >> 1)) & 3) << 3);
}

/* Starts copying columns [k0, k0 + kBK) of rows 0..kBM−1 of g (row stride k elements; rows ≥ valid
 * zero-filled) into the stage tile s: 512 chunks of 16 bytes, two a thread. Not committed here. */
__device__ __forceinline__ void load_tile(uint16_t *s, const uint16_t *g, int valid, int k, int k0)
{
#pragma unroll
    for (int i = 0; i < kBM * kBK / 8 / kThreads; i++) {
        const int c = (int)threadIdx.x + i * kThreads, row = c >> 2, col = (c & 3) << 3;
        const bool ok = row < valid && k0 + col < k;
        const uint16_t *src = ok ? g + (int64_t)row * k + k0 + col : g;
        cp_async16(smem_addr(s + swz(row, col)), src, ok ? 16 : 0);
    }
}

/* acc (the warp's 64 × 32: [mi][ni] the m16n8 block at rows 16 mi, columns 8 ni) += the stage's
 * A rows wm.. times its B rows wn..ᵀ over the stage's 32 columns of k. A fragments: lanes 0-15
 * address rows 0-15 at column 16 kk, lanes 16-31 the same rows at 16 kk + 8 (regs: rows 0-7 / 8-15
 * × k 0-7 / 8-15 in mma's order). B fragments of two n8 blocks per ldmatrix.x4: lane → row
 * (lane & 7) + 8 (lane ≥ 16), column 16 kk + 8 ((lane >> 3) & 1). */
__device__ __forceinline__ void mma_stage(float acc[4][4][4], const uint16_t *sa, const uint16_t *sb, int wm, int wn,
                                          int lane)
{
#pragma unroll
    for (int kk = 0; kk < kBK / 16; kk++) {
        uint32_t a[4][4], b[4][2];
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
            ldsm_x4(smem_addr(sa + swz(wm + 16 * mi + (lane & 15), 16 * kk + 8 * (lane >> 4))), a[mi]);
#pragma unroll
        for (int np = 0; np < 2; np++) {
            uint32_t r[4];
            ldsm_x4(smem_addr(sb + swz(wn + 16 * np + (lane & 7) + 8 * (lane >> 4), 16 * kk + 8 * ((lane >> 3) & 1))),
                    r);
            b[2 * np][0] = r[0], b[2 * np][1] = r[1], b[2 * np + 1][0] = r[2], b[2 * np + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
                mma_bf16(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
}

/* The warp's accumulators rounded to bf16 pairs into c (row stride n): rows < valid_m of the
 * tile (c already at its first row), columns < n − col0 of the block (c already at col0).
 * Fragment element (g = lane / 4, t = lane % 4): [0], [1] row g, columns 2t, 2t + 1; [2], [3]
 * row g + 8. n is even, so a pair is inside n or wholly past it. */
__device__ __forceinline__ void store_acc(const float acc[4][4][4], uint16_t *c, int64_t n, int valid_m, int valid_n,
                                          int wm, int wn, int lane)
{
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = wm + 16 * mi + g + 8 * h;
            if (row >= valid_m)
                continue;
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const int col = wn + 8 * ni + 2 * t;
                if (col < valid_n) {
                    __nv_bfloat162 v = __floats2bfloat162_rn(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
                    *reinterpret_cast<__nv_bfloat162 *>(c + row * n + col) = v;
                }
            }
        }
}

/* grid (ceil(n / 128) · nz, n_tiles): blockIdx.x = column block · nz + z (gate and up of the same
 * block run side by side, sharing their x rows in L2); blockIdx.y the tile. */
__global__ void __launch_bounds__(kThreads, 2)
    moe_gemm_kernel(const uint16_t *__restrict__ x, const uint16_t *__restrict__ w0, const uint16_t *__restrict__ w1,
                    const int32_t *__restrict__ tiles, int m, int n, int k, int nz, uint16_t *c0, uint16_t *c1)
{
    extern __shared__ __align__(128) uint16_t smem[]; /* kStages × (A tile, B tile) */
    const int z = (int)blockIdx.x % nz, col0 = (int)blockIdx.x / nz * kBN;
    const int32_t *tile = tiles + (int64_t)blockIdx.y * TKD_MOE_TILE_INTS;
    const int e = tile[0], r0 = tile[1];
    const int valid_m = min(tile[2], m - r0), valid_n = min(kBN, n - col0);
    if (valid_m <= 0)
        return;
    const uint16_t *ga = x + (int64_t)r0 * k;
    const uint16_t *gb = (z ? w1 : w0) + ((int64_t)e * n + col0) * k;
    const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    float acc[4][4][4];
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                acc[mi][ni][j] = 0.f;

    const int KT = (k + kBK - 1) / kBK;
#pragma unroll
    for (int s = 0; s < kStages - 1; s++) { /* always commit: the group count stays kt's */
        if (s < KT) {
            load_tile(smem + s * 2 * kTileElems, ga, valid_m, k, s * kBK);
            load_tile(smem + s * 2 * kTileElems + kTileElems, gb, valid_n, k, s * kBK);
        }
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<kStages - 2>(); /* this thread's copies of stage kt landed */
        __syncthreads(); /* everyone's did, and everyone is done with stage kt − 1, refilled next */
        const int next = kt + kStages - 1;
        if (next < KT) {
            uint16_t *s = smem + (next % kStages) * 2 * kTileElems;
            load_tile(s, ga, valid_m, k, next * kBK);
            load_tile(s + kTileElems, gb, valid_n, k, next * kBK);
        }
        cp_async_commit();
        const uint16_t *s = smem + (kt % kStages) * 2 * kTileElems;
        mma_stage(acc, s, s + kTileElems, wm, wn, lane);
    }
    cp_async_wait<0>(); /* no copy outlives the CTA (the last groups are empty, but say so) */
    store_acc(acc, (z ? c1 : c0) + (int64_t)r0 * n + col0, n, valid_m, valid_n, wm, wn, lane);
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

} // namespace

extern "C" tkd_status tkd_cuda_moe_gemm(const uint16_t *x, const uint16_t *w0, const uint16_t *w1,
                                        const int32_t *tiles, int n_tiles, int m, int n, int k, uint16_t *c0,
                                        uint16_t *c1, void *stream)
{
    if (n_tiles < 0 || m < 0 || n < 0 || k < 1 || n_tiles > 65535 || (!w1) != (!c1))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "moe grouped GEMM: %d tiles, m %d, n %d, k %d, %s (tiles 0..65535, k ≥ 1, w1 and c1 "
                             "both given or both NULL)", n_tiles, m, n, k, w1 ? "two products" : "one product");
    if (k % 8 || n % 8 || !aligned16(x) || !aligned16(w0) || !aligned16(c0) || (w1 && (!aligned16(w1) || !aligned16(c1))))
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "moe grouped GEMM: (%d, %d) · (%d, %d)ᵀ: needs k and n multiples of 8 and 16-byte "
                             "aligned x, w and c (its 16-byte loads)", m, k, n, k);
    if (n_tiles == 0 || m == 0 || n == 0)
        return TKD_OK;
    TKD_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    const int nz = w1 ? 2 : 1;
    const dim3 grid((unsigned)((n + kBN - 1) / kBN * nz), (unsigned)n_tiles);
    moe_gemm_kernel<<<grid, kThreads, kSmemBytes, (cudaStream_t)stream>>>(x, w0, w1, tiles, m, n, k, nz, c0, c1);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}
