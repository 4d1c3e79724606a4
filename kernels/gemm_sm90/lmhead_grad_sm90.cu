/* lmhead_grad_sm90.cu — see lmhead_grad_sm90.h. Built for sm_90a only (kernels/CMakeLists.txt).
 *
 * One kernel template, two problems (kKind), C (M x N) = Σ_k A[m, k] · B[n, k]:
 *   dH: M = rows, N = D, K = V;  A = E as it lies (rows are M, K contiguous: K-major),
 *                                 B = W (V, D): rows are K, N contiguous: MN-major;
 *   dW: M = V,    N = D, K = rows; A = Eᵀ: E's rows are K, M contiguous: MN-major,
 *                                 B = X (rows, D): MN-major.
 * Operands are loaded by TMA (128-byte swizzle) as they lie: dH's A as one K-major box of 64 K x
 * tile-rows of E at (column k0, row m0); dW's A as one MN-major 64 x 64 box of E per 64 of M at
 * (column m0, row k0); B (W or X) as four MN-major 64 x 64 boxes side by side, 8 KB apart (the
 * descriptors' leading offset). A K step of 16 is +32 bytes inside a K-major box and +16 rows =
 * +2048 bytes in an MN-major one (sm90_common.cuh).
 *
 * The pipeline is the logits GEMM's (lmhead_sm90.cu, lmhead_sm90_pipe.cuh): a producer thread
 * fills a ring of stages, two consumer warpgroups run wgmma m64n256k16 from it. Cooperative (the
 * default: 128 x 256 tiles, both consumers on each, 4 stages of 48 KB) or ping-pong (64 x 256
 * tiles owned in alternation, 5 stages of 40 KB); see pingpong_of for why cooperative. Tile order:
 * dH (K = V long, few tiles) sweeps groups of 2048 rows along N, so a wave of CTAs shares its E rows
 * and W columns in L2 at each K step; dW (K = rows short, V/128 · D/256 tiles) sweeps all of M per
 * group of N tiles whose X columns fit 16 MB, so they stay in L2 while E streams past once per
 * group. dW's epilogue reads the old values, which the producer prefetched into L2 before the tile's
 * last K steps.
 */
#include "kernels/gemm_sm90/lmhead_grad_sm90.h"

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/gemm_sm90/lmhead_sm90_pipe.cuh"
#include "kernels/cuda/sm90_common.cuh"

namespace {

using namespace tkd_sm90;
using namespace tkd_lmhead;

enum Kind { kDH = 0, kDW = 1 };

constexpr uint32_t kBox = 64 * 128;      /* one 64 x 64 bf16 box */
constexpr int kBatch = 16;               /* dW epilogue: float2 loads issued before their stores */
constexpr int kPrefetchSteps = 24;       /* dW: the tile's old values go to L2 this many K steps before its end */
static_assert(kBytesB == 4 * kBox, "a stage's B is four boxes");
static_assert(Coop::kBytesA == 2 * kBox && PingPong::kBytesA == kBox, "a stage's A is one box per 64 rows");

struct GParams {
    int m, n;              /* output rows and columns */
    int ktiles, mtiles, ntiles;
    int group;             /* dH: M-tiles swept together along N; dW: N-tiles swept together along M */
    long long tiles;
    float *out;            /* (m, n) fp32, dense */
    const float *rowscale; /* dH: (m) */
    int accumulate;        /* dW: add to out */
    int prefetch;          /* dW accumulate: out is 16-byte aligned, as the L2 bulk prefetch needs */
    unsigned *err;
};

/* Tile t's (M-tile, N-tile). dH: groups of `group` M-tiles, each swept along N (tile_coords). dW:
 * groups of `group` N-tiles, each swept along all of M with its N-tiles innermost, so the X columns
 * of a group (rows x 256·group bf16) stay in L2 while E streams past once per group. */
template <int kKind>
__device__ inline void coords(long long t, const GParams &p, int &mi, int &ni)
{
    if (kKind == kDH) {
        tile_coords(t, p.mtiles, p.ntiles, p.group, mi, ni);
        return;
    }
    const long long per_group = (long long)p.group * p.mtiles;
    const int g = (int)(t / per_group);
    const int first = g * p.group;
    const int gn = min(p.group, p.ntiles - first);
    const long long r = t - g * per_group;
    ni = first + (int)(r % gn);
    mi = (int)(r / gn);
}

/* dW's old values under output tile (mi, ni) into L2 (a bulk prefetch per row: 16-byte aligned,
 * since out is and a row, N a multiple of 8, is 32-byte multiples long), so that the epilogue's
 * loads find them there. */
template <class S>
__device__ inline void prefetch_out(const GParams &p, int mi, int ni)
{
    const uint32_t bytes = (uint32_t)min(kBN, p.n - ni * kBN) * 4;
    for (int r = mi * S::kTileM; r < min(p.m, (mi + 1) * S::kTileM); r++) {
        const float *q = p.out + (long long)r * p.n + ni * kBN;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(q), "r"(bytes) : "memory");
    }
}

/* The producer thread: every K step of every tile of this CTA, A and the B boxes that hold
 * columns below N. dH's A is one K-major box of kTileM rows; dW's A is one MN-major box per 64 of
 * M, those wholly past M skipped, as are B boxes wholly past N (the accumulators they would feed
 * are never stored). */
template <int kKind, class S>
__device__ __forceinline__ void produce(const CUtensorMap *tm_a, const CUtensorMap *tm_b, const GParams &p,
                                        uint32_t base)
{
    Ring<S::kStages> r;
    for (long long t = blockIdx.x; t < p.tiles; t += gridDim.x) {
        int mi, ni;
        coords<kKind>(t, p, mi, ni);
        const int nb = min(4, (p.n - ni * kBN + 63) / 64);
        const int na = kKind == kDH ? 1 : min(S::kTileM / 64, (p.m - mi * S::kTileM + 63) / 64);
        const uint32_t bytes = (kKind == kDH ? S::kBytesA : na * kBox) + nb * kBox;
        for (int kt = 0; kt < p.ktiles; kt++) {
            mbar_wait(empty_bar<S>(base, r.stage), r.phase ^ 1u, r.failed, p.err);
            const uint32_t full = full_bar<S>(base, r.stage);
            const uint32_t a = stage_a<S>(base, r.stage), b = stage_b<S>(base, r.stage);
            mbar_arrive_expect_tx(full, bytes); /* zero-filled bytes count too */
            if (kKind == kDH)
                tma_load_2d(a, tm_a, kt * kBK, mi * S::kTileM, full);
            else
                for (int i = 0; i < na; i++)
                    tma_load_2d(a + i * kBox, tm_a, mi * S::kTileM + 64 * i, kt * kBK, full);
            for (int i = 0; i < nb; i++)
                tma_load_2d(b + i * kBox, tm_b, ni * kBN + 64 * i, kt * kBK, full);
            if (kKind == kDW && p.prefetch && kt == max(0, p.ktiles - kPrefetchSteps))
                prefetch_out<S>(p, mi, ni);
            r.next();
        }
    }
}

/* One consumer warpgroup over all K steps of a tile: acc (64 x 256) = its 64 rows of A (a_off bytes
 * into the stage's A: 8 KB per warpgroup in either layout) · B_tileᵀ, one K step of wgmma in
 * flight, a stage released (one arrival per warp) once the wgmma that read it are done; ping-pong:
 * after its last wait, the other consumer's turn. */
template <int kKind, class S>
__device__ __forceinline__ void mma_tile(float (&acc)[kAcc], const GParams &p, uint32_t base, int cw,
                                         uint32_t a_off, Ring<S::kStages> &r)
{
    int prev = -1;
    for (int kt = 0; kt < p.ktiles; kt++) {
        mbar_wait(full_bar<S>(base, r.stage), r.phase, r.failed, p.err);
        __syncwarp(); /* lanes may leave the wait's loop apart; wgmma wants the warp converged */
        const uint32_t a = stage_a<S>(base, r.stage) + a_off, b = stage_b<S>(base, r.stage);
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
    if (S::kPP && (threadIdx.x & 127) == 0)
        mbar_arrive(turn_bar<S>(base, 1 - cw));
    wgmma_wait<0>();
    fence_regs(acc);
    if ((threadIdx.x & 31) == 0)
        mbar_arrive(empty_bar<S>(base, prev));
}

/* fp32 pair load and store that keep their program order: the compiler would otherwise sink each
 * load next to its use (to save registers), and the epilogue would wait one memory latency per pair
 * (measured: 19.7 ms instead of 7.4 for dW at 4096 x 4096 x 128256). */
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
                old[j] = make_float2(-0.0f, -0.0f); /* x + (−0) is x, the sign of a zero included */
                if (kKind == kDW && p.accumulate && col < p.n)
                    old[j] = ld_f2(o + col);
            }
#pragma unroll
            for (int j = 0; j < kBatch; j++) {
                const int col = f.col0 + 8 * (jb + j), i = 4 * (jb + j) + 2 * h;
                if (col < p.n) /* fmaf(x, 1, old) and fmaf(x, s, −0) round as x + old and x·s */
                    st_f2(o + col, make_float2(fmaf(acc[i], s, old[j].x), fmaf(acc[i + 1], s, old[j].y)));
            }
        }
    }
}

/* A consumer warpgroup (cw = 0, 1), as lmhead_sm90.cu's: cooperative, rows 64·cw of every tile of
 * the CTA; ping-pong, the CTA's tiles cw, cw + 2, .. whole, each main loop after the other
 * consumer's turn. */
template <int kKind, class S>
__device__ __forceinline__ void consume(const GParams &p, uint32_t base, int cw)
{
    float acc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; i++)
        acc[i] = 0.0f;
    Ring<S::kStages> r;
    const int a_row = S::kPP ? 0 : 64 * cw;
    for (long long j = S::kPP ? cw : 0, mine = 0;; j += S::kPP ? 2 : 1, mine++) {
        const long long t = blockIdx.x + j * gridDim.x;
        if (t >= p.tiles)
            break;
        int mi, ni;
        coords<kKind>(t, p, mi, ni);
        ring_seek<S>(r, j * p.ktiles);
        if (S::kPP && (cw == 1 || mine > 0))
            mbar_wait(turn_bar<S>(base, cw), (uint32_t)((cw == 1 ? mine : mine - 1) & 1), r.failed, p.err);
        mma_tile<kKind, S>(acc, p, base, cw, (uint32_t)a_row * 128, r);
        store_tile<kKind>(acc, p, frag_of<S>(mi, ni, a_row));
    }
}

/* tm_a: E (rows, V), boxes 64 x kTileM (dH) or 64 x 64 (dW); tm_b: W (V, D) or X (rows, D), boxes
 * 64 x 64. 384 threads, S::kSmemBytes dynamic. */
template <int kKind, bool kPP>
__global__ void __launch_bounds__(kThreads, 1)
grad_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b, const GParams p)
{
    using S = Sched<kPP>;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    if (threadIdx.x == 0)
        init_bars<S>(base);
    __syncthreads();
    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0)
            produce<kKind, S>(&tm_a, &tm_b, p, base);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        consume<kKind, S>(p, base, threadIdx.x / 128 - 1);
    }
}

/* ---- host side ----------------------------------------------------------------------------------- */

/* A row-major (rows, cols) bf16 matrix with leading dimension ld, boxes of 64 columns x box_rows. */
tkd_status tmap(CUtensorMap *tm, const uint16_t *ptr, long long rows, int cols, long long ld, int box_rows,
                const char *who)
{
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)ld * 2};
    return make_tmap(tm, ptr, 2, dims, strides, box_rows, who);
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

/* The schedule on ws: cooperative unless tkd_lmhead_grad_sm90_set_schedule forced ping-pong.
 * Measured (grad_bench, docs/PERFORMANCE.md): dH (K = V long, the epilogue negligible) gains most
 * from 128-row tiles, which halve W's traffic per flop (ncu: tensor pipe 99.7 % active, against 86 %
 * in ping-pong); dW also runs faster cooperative (grad_bench: 6.3 against 9.4 ms at 4096 x 4096 x
 * 128256), although there one consumer's read-add-write epilogue could hide under the other's main
 * loop: ping-pong loads X per 64 rows and misses L2 (ncu: 13.6 GB read from DRAM). */
bool pingpong_of(const tkd_lmhead_sm90_ws *ws)
{
    return ws->grad_sched == 1 + TKD_LMHEAD_SM90_SCHED_PINGPONG;
}

/* Launches kind kKind on schedule S; tm_a for dH must have boxes of S::kTileM rows. */
template <int kKind, bool kPP>
tkd_status launch(tkd_lmhead_sm90_ws *ws, const CUtensorMap &tm_a, const CUtensorMap &tm_b, GParams p)
{
    using S = Sched<kPP>;
    p.ntiles = (p.n + kBN - 1) / kBN;
    p.mtiles = (p.m + S::kTileM - 1) / S::kTileM;
    p.tiles = (long long)p.mtiles * p.ntiles;
    p.err = ws->err;
    if (kKind == kDH)
        p.group = S::kGroupM;
    int dev = 0, sms = 0;
    TKD_CUDA_CHECK(cudaGetDevice(&dev));
    TKD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    long long grid = ws->max_ctas > 0 && ws->max_ctas < sms ? ws->max_ctas : sms;
    if (grid > p.tiles)
        grid = p.tiles;
    TKD_CUDA_CHECK(cudaFuncSetAttribute(grad_kernel<kKind, kPP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)S::kSmemBytes));
    grad_kernel<kKind, kPP><<<(unsigned)grid, kThreads, S::kSmemBytes, ws->stream>>>(tm_a, tm_b, p);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

/* dW's N-group: as many 256-column tiles as keep their X columns (rows x 256 bf16 each) within
 * 16 MB, a third of the L2, so they stay there while E streams past. */
int dw_group(int64_t rows, int ntiles)
{
    const int64_t per_tile = rows * kBN * 2;
    const int64_t g = (16ll << 20) / per_tile;
    return g < 1 ? 1 : g > ntiles ? ntiles : (int)g;
}

} // namespace

extern "C" void tkd_lmhead_grad_sm90_set_schedule(tkd_lmhead_sm90_ws *ws, int sched)
{
    ws->grad_sched = sched == TKD_LMHEAD_SM90_SCHED_PINGPONG ? 1 + TKD_LMHEAD_SM90_SCHED_PINGPONG
                     : sched == TKD_LMHEAD_SM90_SCHED_COOP   ? 1 + TKD_LMHEAD_SM90_SCHED_COOP
                                                             : 0;
}

extern "C" tkd_status tkd_lmhead_grad_sm90_dh(tkd_lmhead_sm90_ws *ws, const uint16_t *e, int64_t lde,
                                         const uint16_t *w, int64_t rows, int d, int v, const float *sigma,
                                         float *dh)
{
    TKD_TRY(check_args(e, lde, w, rows, d, v, dh, "dH"));
    if (!sigma)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_grad_sm90: dH: sigma is NULL");
    const bool pp = pingpong_of(ws);
    CUtensorMap tm_e, tm_w;
    TKD_TRY(tmap(&tm_e, e, rows, v, lde, pp ? PingPong::kTileM : Coop::kTileM, "lmhead_grad_sm90: dH: E"));
    TKD_TRY(tmap(&tm_w, w, v, d, d, 64, "lmhead_grad_sm90: dH: W"));
    GParams p = {};
    p.m = (int)rows;
    p.n = d;
    p.ktiles = (v + kBK - 1) / kBK;
    p.out = dh;
    p.rowscale = sigma;
    return pp ? launch<kDH, true>(ws, tm_e, tm_w, p) : launch<kDH, false>(ws, tm_e, tm_w, p);
}

extern "C" tkd_status tkd_lmhead_grad_sm90_dw(tkd_lmhead_sm90_ws *ws, const uint16_t *e, int64_t lde,
                                         const uint16_t *x, int64_t rows, int d, int v, float *dw,
                                         int accumulate)
{
    TKD_TRY(check_args(e, lde, x, rows, d, v, dw, "dW"));
    CUtensorMap tm_e, tm_x;
    TKD_TRY(tmap(&tm_e, e, rows, v, lde, 64, "lmhead_grad_sm90: dW: E"));
    TKD_TRY(tmap(&tm_x, x, rows, d, d, 64, "lmhead_grad_sm90: dW: X"));
    GParams p = {};
    p.m = v;
    p.n = d;
    p.ktiles = (int)((rows + kBK - 1) / kBK);
    p.group = dw_group(rows, (d + kBN - 1) / kBN);
    p.out = dw;
    p.accumulate = accumulate != 0;
    p.prefetch = p.accumulate && (uintptr_t)dw % 16 == 0;
    return pingpong_of(ws) ? launch<kDW, true>(ws, tm_e, tm_x, p) : launch<kDW, false>(ws, tm_e, tm_x, p);
}
