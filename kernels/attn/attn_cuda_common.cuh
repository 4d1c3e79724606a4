/* attn_cuda_common.cuh — helpers shared by the flash-attention forward (attn_cuda.cu) and backward
 * (attn_bwd_cuda.cu): PTX wrappers for cp.async, ldmatrix and the bf16 m16n8k16 MMA, the
 * fragment-level building blocks both passes use, and on the host their argument checks, head-dim
 * dispatch and launch. Internal: included by those two .cu files and by the Hopper backward
 * (attn_bwd_sm90.cu, for pack_bf16). Every function is inline, so each file compiles its own copy.
 *
 * Fragment layouts (PTX ISA, mma.m16n8k16 bf16, lane = 4·g + t): A regs {(g, 2t), (g+8, 2t),
 * (g, 2t+8), (g+8, 2t+8)} each holding 2 consecutive columns; B regs {(k = 2t, n = g),
 * (k = 2t+8, n = g)} each holding 2 consecutive k; C {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
 * So the C fragments of two n8 tiles (columns 0..15) are, element for element, the A fragment of
 * a 16 × 16 block with those columns as k (frag_c_to_a). A tile stored row-major in shared memory
 * (row = n, contiguous in k) read by a plain ldmatrix gives B fragments of its transpose
 * (mma_abt_16); stored with row = k, contiguous in n, ldmatrix.trans gives B fragments directly
 * (mma_ab_acc).
 *
 * Shared-memory tiles have a row stride of LD = DH + 8 elements: each row is 16 bytes longer than
 * a multiple of 128 (for DH = 48, 80, 96: 112, 176, 208 bytes, also 8 distinct 16-byte slots mod
 * 128), so the 8 row addresses of one ldmatrix phase hit 8 different bank groups.
 */
#ifndef TKD_ATTN_CUDA_COMMON_CUH
#define TKD_ATTN_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_fast_math.cuh"
#include "kernels/cuda/mma_sync.cuh"

namespace tkd_attn {

/* ---- PTX wrappers (kernels/cuda/mma_sync.cuh) ----------------------------------------------- */

using tkd_cuda::cp_async16;
using tkd_cuda::cp_async_commit;
using tkd_cuda::cp_async_wait_all;
using tkd_cuda::ldsm_x4;
using tkd_cuda::ldsm_x4_trans;
using tkd_cuda::mma_bf16;
using tkd_cuda::smem_addr;

using tkd_cuda::fast_exp2; /* 2^x on the special-function unit (cuda_fast_math.cuh) */

/* Two floats as a bf16 pair, lo in the low half (the lower column index), round to nearest. */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &p, sizeof u);
    return u;
}

/* ---- tiles and fragments ------------------------------------------------------------------- */

/* Starts copying rows [r0, r0 + ROWS) of one head (DH bf16 columns; global row stride ld
 * elements) into the smem tile s (ROWS, DH + 8), THREADS threads sharing the 16-byte chunks; rows
 * ≥ T are zero-filled and read nothing. Not committed here. */
template <int DH, int ROWS, int THREADS>
__device__ __forceinline__ void load_rows(uint16_t *s, const uint16_t *g, int64_t ld, int r0, int T)
{
    constexpr int CH = DH / 8, LD = DH + 8, N = ROWS * CH;
#pragma unroll
    for (int i = 0; i < (N + THREADS - 1) / THREADS; i++) {
        const int c = (int)threadIdx.x + i * THREADS;
        if (N % THREADS == 0 || c < N) {
            const int r = c / CH, col = (c % CH) * 8;
            const bool ok = r0 + r < T;
            const uint16_t *src = ok ? g + (int64_t)(r0 + r) * ld + col : g;
            cp_async16(smem_addr(s + r * LD + col), src, ok ? 16 : 0);
        }
    }
}

/* The same rows [r0, r0 + ROWS) of two tensors of one layout (K and V; global row stride ld) into
 * the smem tiles s0 and s1 as load_rows, then committed as one group: a stage of the K/V double
 * buffer. */
template <int DH, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_pair(uint16_t *s0, uint16_t *s1, const uint16_t *g0, const uint16_t *g1,
                                               int64_t ld, int r0, int T)
{
    load_rows<DH, ROWS, THREADS>(s0, g0, ld, r0, T);
    load_rows<DH, ROWS, THREADS>(s1, g1, ld, r0, T);
    cp_async_commit();
}

/* Rows 0..15 of the smem tile s (16, DH; row stride DH + 8) as A fragments, one per 16-wide slice
 * of the columns: lanes 0-15 address rows 0-15 at column 16kk, lanes 16-31 the same rows at
 * column 16kk + 8. */
template <int DH>
__device__ __forceinline__ void load_a_frags(uint32_t af[DH / 16][4], const uint16_t *s, int lane)
{
    const uint32_t base = smem_addr(s + (lane & 15) * (DH + 8) + (lane >> 4) * 8);
#pragma unroll
    for (int kk = 0; kk < DH / 16; kk++)
        ldsm_x4(base + kk * 32, af[kk]);
}

/* c (16 × 16 fp32: c[0] columns 0-7, c[1] columns 8-15) = A Bᵀ, A (16 × DH) given as fragments,
 * B the smem rows 0..15 of s (16, DH; row stride DH + 8), so c[m][n] = Σ_d A[m][d]·B[n][d].
 * One ldmatrix.x4 per 16-wide d slice gives the B fragments of both n8 tiles: lane → row
 * (lane & 7) + 8·(lane ≥ 16), column 16kk + 8·((lane >> 3) & 1). */
template <int DH>
__device__ __forceinline__ void mma_abt_16(float c[2][4], const uint32_t af[DH / 16][4],
                                           const uint16_t *s, int lane)
{
    const uint32_t base = smem_addr(s + ((lane & 7) + ((lane >> 4) << 3)) * (DH + 8) + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int e = 0; e < 4; e++)
        c[0][e] = c[1][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DH / 16; kk++) {
        uint32_t b[4];
        ldsm_x4(base + kk * 32, b);
        mma_bf16(c[0], af[kk], b[0], b[1]);
        mma_bf16(c[1], af[kk], b[2], b[3]);
    }
}

/* acc (16 × DH fp32, acc[dt] = columns 8dt .. 8dt+7) += A B, A (16 × 16 bf16) one fragment, B the
 * smem rows 0..15 of s (16, DH; row stride DH + 8) with the row as k. One ldmatrix.x4.trans gives
 * the B fragments of two d octets: lane → row (lane & 7) + 8·((lane >> 3) & 1), column
 * 16dp + 8·(lane ≥ 16). */
template <int DH>
__device__ __forceinline__ void mma_ab_acc(float acc[DH / 8][4], const uint32_t a[4], const uint16_t *s,
                                           int lane)
{
    const uint32_t base = smem_addr(s + ((lane & 7) + ((lane >> 3) & 1) * 8) * (DH + 8) + (lane >> 4) * 8);
#pragma unroll
    for (int dp = 0; dp < DH / 16; dp++) {
        uint32_t b[4];
        ldsm_x4_trans(base + dp * 32, b);
        mma_bf16(acc[2 * dp], a, b[0], b[1]);
        mma_bf16(acc[2 * dp + 1], a, b[2], b[3]);
    }
}

/* The C fragments of two n8 tiles (16 × 16 fp32) rounded to bf16 as the A fragment of the same
 * 16 × 16 block, its columns becoming k. */
__device__ __forceinline__ void frag_c_to_a(uint32_t a[4], const float c[2][4])
{
    a[0] = pack_bf16(c[0][0], c[0][1]);
    a[1] = pack_bf16(c[0][2], c[0][3]);
    a[2] = pack_bf16(c[1][0], c[1][1]);
    a[3] = pack_bf16(c[1][2], c[1][3]);
}

/* ---- the mask (tkd_attn_mask's window and documents) ---------------------------------------- */

/* The first key query row i sees: i − window + 1 with a window, its document's start with doc
 * (doc: the sequence's (T) starts; rows ≥ T, zero-filled, take the last row's); both are
 * non-decreasing in i. window 0 and doc NULL: 0. */
__device__ __forceinline__ int first_key(int i, int T, int window, const int32_t *doc)
{
    const int w = window > 0 ? max(0, i - window + 1) : 0;
    return doc ? max(w, doc[min(i, T - 1)]) : w;
}

/* One past the last query row that sees key j (0 ≤ j < T; window < T, so no overflow): the rows
 * i ≥ j with i − j < window, and with doc those before the first row i > j whose document starts
 * after j (doc is non-decreasing, so "starts after j" is false, then true: a bisection). Rows j ..
 * query_end(j) − 1 are exactly those whose first_key is ≤ j; query_end is non-decreasing in j. */
__device__ __forceinline__ int query_end(int j, int T, int window, const int32_t *doc)
{
    int lo = j + 1, hi = window > 0 ? min(T, j + window) : T;
    if (!doc)
        return hi;
    while (lo < hi) { /* the answer lies in [lo, hi] */
        const int mid = lo + (hi - lo) / 2;
        if (doc[mid] > j)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* ---- host side: the checks and the launch of both passes ------------------------------------ */

constexpr int kMaxGridY = 65535; /* grid.y limit: query or key tiles per (batch, head) */

inline bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* A tkd_attn_mask both forward kernels take (attn_cuda.h): NULL, or a window ≥ 0. */
inline tkd_status check_mask(const char *who, const tkd_attn_mask *mask)
{
    if (mask && mask->window < 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: window %d < 0", who, mask->window);
    return TKD_OK;
}

/* The head dims the kernels are built for; who names the entry point in the message. */
inline tkd_status check_dh(const char *who, int dh)
{
    if (dh != 48 && dh != 64 && dh != 80 && dh != 96 && dh != 128)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: head dim %d is not supported (48, 64, 80, 96 or 128)", who,
                             dh);
    return TKD_OK;
}

/* The head dim and the shape (B, T ≥ 0; H a multiple of Hkv ≥ 1). */
inline tkd_status check_shape(const char *who, int B, int T, int H, int Hkv, int dh)
{
    TKD_TRY(check_dh(who, dh));
    if (B < 0 || T < 0 || H < 1 || Hkv < 1 || H % Hkv != 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: bad shape B=%d T=%d H=%d Hkv=%d (H must be a multiple of Hkv)",
                             who, B, T, H, Hkv);
    return TKD_OK;
}

/* T's tiles of tile_rows (grid.y) and B·H (grid.x) fit the launch grid. */
inline tkd_status check_grid(const char *who, int B, int T, int H, int tile_rows)
{
    const int64_t tiles = ((int64_t)T + tile_rows - 1) / tile_rows;
    if (tiles > kMaxGridY || (int64_t)B * H > INT32_MAX)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "%s: T=%d with B·H=%lld exceeds the launch grid (T ≤ %d, B·H < 2^31)", who, T,
                             (long long)B * H, kMaxGridY * tile_rows);
    return TKD_OK;
}

/* f(std::integral_constant<int, DH>()) for the head dim dh (checked: 48, 64, 80, 96, else 128), so
 * that each entry point writes its dispatch over the kernels' instances once. */
template <class F> inline tkd_status with_dh(int dh, F f)
{
    switch (dh) {
    case 48: return f(std::integral_constant<int, 48>());
    case 64: return f(std::integral_constant<int, 64>());
    case 80: return f(std::integral_constant<int, 80>());
    case 96: return f(std::integral_constant<int, 96>());
    default: return f(std::integral_constant<int, 128>());
    }
}

/* kernel(a) over grid × threads with smem bytes of dynamic shared memory (the kernel's limit raised
 * to that first) on stream. */
template <class Args>
inline tkd_status launch_smem(void (*kernel)(Args), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                              const Args &a)
{
    TKD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<grid, threads, smem, stream>>>(a);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

} // namespace tkd_attn

#endif /* TKD_ATTN_CUDA_COMMON_CUH */
