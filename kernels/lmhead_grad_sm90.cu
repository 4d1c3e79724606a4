/* lmhead_grad_sm90.cu — see lmhead_grad_sm90.h. Built for sm_90a only (kernels/CMakeLists.txt).
 *
 * One kernel template, two problems (kKind), C (M x N) = Σ_k A[m, k] · B[n, k]:
 *   dH: M = rows, N = D, K = V;  A = E as it lies (rows are M, K contiguous: K-major),
 *                                 B = W (V, D): rows are K, N contiguous: MN-major;
 *   dW: M = V,    N = D, K = rows; A = Eᵀ: E's rows are K, M contiguous: MN-major,
 *                                 B = X (rows, D): MN-major.
 * Every operand is loaded in 64 x 64 bf16 boxes (128-byte swizzle) of one tensor map per matrix:
 * E's box at (column k0, row m0) for dH and at (column m0, row k0) for dW; W's and X's four boxes
 * of a 256-wide N tile side by side, 8 KB apart (the descriptors' leading offset). A K step of 16 is
 * +32 bytes inside a K-major box and +16 rows = +2048 bytes in an MN-major one (sm90_common.cuh).
 *
 * The pipeline is the logits GEMM's ping-pong schedule (lmhead_sm90.cu, lmhead_sm90_pipe.cuh): a
 * producer thread fills a ring of 5 stages of 40 KB, two consumer warpgroups own whole 64 x 256
 * tiles in alternation, so one's epilogue (dW: read, add, write 64 KB of fp32) overlaps the other's
 * main loop. Tile order: dH (K = V long, few tiles) sweeps groups of 32 M-tiles along N, so a wave
 * of CTAs shares its E rows and W columns in L2 at each K step; dW (K = rows short, V/64 · D/256
 * tiles) runs N innermost, so the CTA that loads an E column block reuses it from L2 for the next
 * N tiles, and X (rows x D) stays in L2 throughout.
 */
#include "kernels/lmhead_grad_sm90.h"

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels/cuda_check.h"
#include "kernels/lmhead_sm90_pipe.cuh"
#include "kernels/sm90_common.cuh"

namespace {

using namespace tkd_sm90;
using namespace tkd_lmhead;
using S = PingPong;

enum Kind { kDH = 0, kDW = 1 };

constexpr uint32_t kBox = 64 * 128;      /* one 64 x 64 bf16 box */
constexpr int kBatch = 16;               /* dW epilogue: float2 loads issued before their stores */
constexpr int kPrefetchSteps = 24;       /* dW: the tile's old values go to L2 this many K steps before its end */
static_assert(S::kBytesA == kBox && kBytesB == 4 * kBox, "the ping-pong stage is one A box and four B boxes");

struct GParams {
    int m, n;              /* output rows and columns */
    int ktiles, mtiles, ntiles;
    int group_m;           /* M-tiles swept together along N (1: N innermost) */
    long long tiles;
    float *out;            /* (m, n) fp32, dense */
    const float *rowscale; /* dH: (m) */
    int accumulate;        /* dW: add to out */
    unsigned *err;
};

/* dW's old values under output tile (mi, ni) into L2 (a bulk prefetch per row), so that the
 * epilogue's loads find them there. */
__device__ inline void prefetch_out(const GParams &p, int mi, int ni)
{
    const uint32_t bytes = (uint32_t)min(kBN, p.n - ni * kBN) * 4;
    for (int r = mi * 64; r < min(p.m, mi * 64 + 64); r++) {
        const float *q = p.out + (long long)r * p.n + ni * kBN;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(q), "r"(bytes) : "memory");
    }
}

/* The producer thread: every K step of every tile of this CTA, the A box and the B boxes that hold
 * columns below N (a box wholly past N is not loaded; the accumulators it would feed are never
 * stored). */
template <int kKind>
__device__ __forceinline__ void produce(const CUtensorMap *tm_a, const CUtensorMap *tm_b, const GParams &p,
                                        uint32_t base)
{
    Ring<S::kStages> r;
    for (long long t = blockIdx.x; t < p.tiles; t += gridDim.x) {
        int mi, ni;
        tile_coords(t, p.mtiles, p.ntiles, p.group_m, mi, ni);
        const int nb = min(4, (p.n - ni * kBN + 63) / 64);
        for (int kt = 0; kt < p.ktiles; kt++) {
            mbar_wait(empty_bar<S>(base, r.stage), r.phase ^ 1u, r.failed, p.err);
            const uint32_t full = full_bar<S>(base, r.stage);
            const uint32_t a = stage_a<S>(base, r.stage), b = stage_b<S>(base, r.stage);
            mbar_arrive_expect_tx(full, kBox * (1 + nb)); /* zero-filled bytes count too */
            if (kKind == kDH)
                tma_load_2d(a, tm_a, kt * kBK, mi * 64, full);
            else
                tma_load_2d(a, tm_a, mi * 64, kt * kBK, full);
            for (int i = 0; i < nb; i++)
                tma_load_2d(b + i * kBox, tm_b, ni * kBN + 64 * i, kt * kBK, full);
            if (kKind == kDW && p.accumulate && kt == max(0, p.ktiles - kPrefetchSteps))
                prefetch_out(p, mi, ni);
            r.next();
        }
    }
}

/* One consumer warpgroup over all K steps of a tile: acc (64 x 256) = A_tile · B_tileᵀ, one K step
 * of wgmma in flight, a stage released (one arrival per warp) once the wgmma that read it are done;
 * after its last wait, the other consumer's turn. */
template <int kKind>
__device__ __forceinline__ void mma_tile(float (&acc)[kAcc], const GParams &p, uint32_t base, int cw,
                                         Ring<S::kStages> &r)
{
    int prev = -1;
    for (int kt = 0; kt < p.ktiles; kt++) {
        mbar_wait(full_bar<S>(base, r.stage), r.phase, r.failed, p.err);
        __syncwarp(); /* lanes may leave the wait's loop apart; wgmma wants the warp converged */
        const uint32_t a = stage_a<S>(base, r.stage), b = stage_b<S>(base, r.stage);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; kk++) {
            const uint64_t db = smem_desc_mn(b + 2048 * kk, kBox);
            if (kKind == kDH)
                wgmma_ss_n256_t<0, 1>(acc, smem_desc(a) + 2 * kk, db, kt > 0 || kk > 0);
            else
                wgmma_ss_n256_t<1, 1>(acc, smem_desc_mn(a + 2048 * kk, kBox), db, kt > 0 || kk > 0);
        }
        wgmma_commit();
        if (prev >= 0) {
            wgmma_wait<1>();
            if ((threadIdx.x & 31) == 0)
                mbar_arrive(empty_bar<S>(base, prev));
        }
        prev = r.stage;
        r.next();
    }
    if ((threadIdx.x & 127) == 0)
        mbar_arrive(turn_bar<S>(base, 1 - cw));
    wgmma_wait<0>();
    fence_regs(acc);
    if ((threadIdx.x & 31) == 0)
        mbar_arrive(empty_bar<S>(base, prev));
}

/* fp32 pair load and store that keep their program order: the compiler would otherwise sink each
 * load next to its use (to save registers), and the epilogue would wait one memory latency per pair
 * (measured: 19.7 ms instead of 9.2 for dW at 4096 x 4096 x 128256). */
__device__ inline float2 ld_f2(const float *q)
{
    float2 r;
    asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(r.x), "=f"(r.y) : "l"(q));
    return r;
}

__device__ inline void st_f2(float *q, float2 x)
{
    asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(q), "f"(x.x), "f"(x.y) : "memory");
}

/* The epilogue: out = acc · rowscale (dH) or out (+)= acc (dW), in-range rows; N is a multiple of 8,
 * so a float2 is wholly in or out. A quad writes 32 contiguous bytes per j (whole sectors). dW
 * issues kBatch loads before their stores (and the producer prefetched the tile into L2). */
template <int kKind>
__device__ __forceinline__ void store_tile(const float (&acc)[kAcc], const GParams &p, Frag f)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const long long row = f.row0 + 8 * h;
        if (row >= p.m)
            continue;
        float *o = p.out + row * (long long)p.n;
        const float s = kKind == kDH ? p.rowscale[row] : 1.0f;
#pragma unroll
        for (int jb = 0; jb < kBN / 8; jb += kBatch) {
            float2 old[kBatch];
#pragma unroll
            for (int j = 0; j < kBatch; j++) {
                const int col = f.col0 + 8 * (jb + j);
                old[j] = make_float2(0.0f, 0.0f);
                if (kKind == kDW && p.accumulate && col < p.n)
                    old[j] = ld_f2(o + col);
            }
#pragma unroll
            for (int j = 0; j < kBatch; j++) {
                const int col = f.col0 + 8 * (jb + j), i = 4 * (jb + j) + 2 * h;
                if (col < p.n) /* fmaf(x, 1, old) and fmaf(x, s, 0) round as x + old and x·s */
                    st_f2(o + col, make_float2(fmaf(acc[i], s, old[j].x), fmaf(acc[i + 1], s, old[j].y)));
            }
        }
    }
}

/* A consumer warpgroup (cw = 0, 1): the CTA's tiles cw, cw + 2, .., each main loop after the other
 * consumer's turn (lmhead_sm90.cu's ping-pong). */
template <int kKind>
__device__ __forceinline__ void consume(const GParams &p, uint32_t base, int cw)
{
    float acc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; i++)
        acc[i] = 0.0f;
    Ring<S::kStages> r;
    for (long long j = cw, mine = 0;; j += 2, mine++) {
        const long long t = blockIdx.x + j * gridDim.x;
        if (t >= p.tiles)
            break;
        int mi, ni;
        tile_coords(t, p.mtiles, p.ntiles, p.group_m, mi, ni);
        ring_seek<S>(r, j * p.ktiles);
        if (cw == 1 || mine > 0)
            mbar_wait(turn_bar<S>(base, cw), (uint32_t)((cw == 1 ? mine : mine - 1) & 1), r.failed, p.err);
        mma_tile<kKind>(acc, p, base, cw, r);
        store_tile<kKind>(acc, p, frag_of<S>(mi, ni, 0));
    }
}

/* tm_a: E (rows, V) boxes 64 x 64; tm_b: W (V, D) or X (rows, D), boxes 64 x 64. 384 threads,
 * S::kSmemBytes dynamic. */
template <int kKind>
__global__ void __launch_bounds__(kThreads, 1)
grad_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b, const GParams p)
{
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    if (threadIdx.x == 0)
        init_bars<S>(base);
    __syncthreads();
    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0)
            produce<kKind>(&tm_a, &tm_b, p, base);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        consume<kKind>(p, base, threadIdx.x / 128 - 1);
    }
}

/* ---- host side ----------------------------------------------------------------------------------- */

/* A row-major (rows, cols) bf16 matrix with leading dimension ld, boxes of 64 x 64. */
tkd_status tmap64(CUtensorMap *tm, const uint16_t *ptr, long long rows, int cols, long long ld)
{
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)ld * 2};
    return make_tmap(tm, ptr, 2, dims, strides, 64, "lmhead_grad_sm90");
}

tkd_status check_args(const uint16_t *e, int64_t lde, const uint16_t *b, int64_t rows, int d, int v,
                      const float *out, const char *what)
{
    if (!e || !b || !out || rows < 1 || rows > INT32_MAX || v < 1 || d < 8 || lde < v)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_grad_sm90: %s: bad shape or pointer (rows %lld, "
                             "D %d, V %d, lde %lld)", what, (long long)rows, d, v, (long long)lde);
    if (d % 8 != 0 || lde % 8 != 0)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "lmhead_grad_sm90: %s: D %d and lde %lld must be "
                             "multiples of 8 (16-byte TMA strides); use the cuBLAS path", what, d,
                             (long long)lde);
    if (((uintptr_t)e | (uintptr_t)b) % 16 != 0 || (uintptr_t)out % 8 != 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_grad_sm90: %s: operands must be 16-byte and "
                             "the output 8-byte aligned", what);
    return tkd_lmhead_sm90_supported();
}

template <int kKind>
tkd_status launch(tkd_lmhead_sm90_ws *ws, const CUtensorMap &tm_a, const CUtensorMap &tm_b, GParams p)
{
    p.ntiles = (p.n + kBN - 1) / kBN;
    p.mtiles = (p.m + S::kTileM - 1) / S::kTileM;
    p.tiles = (long long)p.mtiles * p.ntiles;
    p.err = ws->err;
    int dev = 0, sms = 0;
    TKD_CUDA_CHECK(cudaGetDevice(&dev));
    TKD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    long long grid = ws->max_ctas > 0 && ws->max_ctas < sms ? ws->max_ctas : sms;
    if (grid > p.tiles)
        grid = p.tiles;
    TKD_CUDA_CHECK(cudaFuncSetAttribute(grad_kernel<kKind>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)S::kSmemBytes));
    grad_kernel<kKind><<<(unsigned)grid, kThreads, S::kSmemBytes, ws->stream>>>(tm_a, tm_b, p);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

} // namespace

extern "C" tkd_status tkd_lmhead_sm90_dh(tkd_lmhead_sm90_ws *ws, const uint16_t *e, int64_t lde,
                                         const uint16_t *w, int64_t rows, int d, int v, const float *sigma,
                                         float *dh)
{
    TKD_TRY(check_args(e, lde, w, rows, d, v, dh, "dH"));
    if (!sigma)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_grad_sm90: dH: sigma is NULL");
    CUtensorMap tm_e, tm_w;
    TKD_TRY(tmap64(&tm_e, e, rows, v, lde));
    TKD_TRY(tmap64(&tm_w, w, v, d, d));
    GParams p = {};
    p.m = (int)rows;
    p.n = d;
    p.ktiles = (v + kBK - 1) / kBK;
    p.group_m = getenv("TKD_GRAD_GROUP_DH") ? atoi(getenv("TKD_GRAD_GROUP_DH")) : S::kGroupM; /* TUNING */
    p.out = dh;
    p.rowscale = sigma;
    return launch<kDH>(ws, tm_e, tm_w, p);
}

extern "C" tkd_status tkd_lmhead_sm90_dw(tkd_lmhead_sm90_ws *ws, const uint16_t *e, int64_t lde,
                                         const uint16_t *x, int64_t rows, int d, int v, float *dw,
                                         int accumulate)
{
    TKD_TRY(check_args(e, lde, x, rows, d, v, dw, "dW"));
    CUtensorMap tm_e, tm_x;
    TKD_TRY(tmap64(&tm_e, e, rows, v, lde));
    TKD_TRY(tmap64(&tm_x, x, rows, d, d));
    GParams p = {};
    p.m = v;
    p.n = d;
    p.ktiles = (int)((rows + kBK - 1) / kBK);
    p.group_m = getenv("TKD_GRAD_GROUP_DW") ? atoi(getenv("TKD_GRAD_GROUP_DW")) : 1; /* TUNING */
    p.out = dw;
    p.accumulate = accumulate != 0;
    return launch<kDW>(ws, tm_e, tm_x, p);
}
