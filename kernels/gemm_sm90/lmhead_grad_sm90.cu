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
 * Both run on gemm_sm90/'s one driver (gemm_sm90_pipe.cuh) as the problem Grad<kKind>, which
 * supplies only the tile order, the loads, the wgmma's operand layouts and the epilogue: a producer
 * thread fills a ring of stages, two consumer warpgroups run wgmma m64n256k16 from it. Cooperative (the
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
#include "kernels/cuda/sm90_common.cuh"
#include "kernels/gemm_sm90/gemm_sm90_pipe.cuh"

namespace {

using namespace tkd_sm90;
using namespace tkd_lmhead;

enum Kind { kDH = 0, kDW = 1 };

constexpr uint32_t kBox = kBoxBytes;
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
    for_frag_rows(f, p.m, [&](int h, long long row) {
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
    });
}

struct NoExtra {};

/* dH or dW as a problem of the driver (gemm_sm90_pipe.cuh). What the producer loads for output tile
 * t: A and the B boxes that hold columns below N. dH's A is one K-major box of kTileM rows; dW's A
 * is one MN-major box per 64 of M, those wholly past M skipped, as are B boxes wholly past N (the
 * accumulators they would feed are never stored). dW with accumulate also prefetches the tile's
 * old values into L2 kPrefetchSteps K steps before its end. */
template <int kKind>
struct Grad {
    using Params = GParams;
    using Extra = NoExtra;
    struct Tile {
        int mi, ni;
        int na, nb; /* A boxes (dW) and B boxes loaded per stage */
        uint32_t bytes;
    };
    template <class S>
    __device__ static __forceinline__ Tile tile(const Params &p, long long t)
    {
        Tile tl;
        coords<kKind>(t, p, tl.mi, tl.ni);
        tl.nb = min(4, (p.n - tl.ni * kBN + 63) / 64);
        tl.na = kKind == kDH ? 1 : min(S::kTileM / 64, (p.m - tl.mi * S::kTileM + 63) / 64);
        tl.bytes = (kKind == kDH ? S::kBytesA : tl.na * kBox) + tl.nb * kBox;
        return tl;
    }
    template <class S>
    __device__ static __forceinline__ void load(const CUtensorMap *tm_a, const CUtensorMap *tm_b, const Params &p,
                                                const Extra &, const Tile &tl, uint32_t a, uint32_t b,
                                                uint32_t full, int kt)
    {
        if (kKind == kDH)
            tma_load_2d(a, tm_a, kt * kBK, tl.mi * S::kTileM, full);
        else
            for (int i = 0; i < tl.na; i++)
                tma_load_2d(a + i * kBox, tm_a, tl.mi * S::kTileM + 64 * i, kt * kBK, full);
        for (int i = 0; i < tl.nb; i++)
            tma_load_2d(b + i * kBox, tm_b, tl.ni * kBN + 64 * i, kt * kBK, full);
        if (kKind == kDW && p.prefetch && kt == max(0, p.ktiles - kPrefetchSteps))
            prefetch_out<S>(p, tl.mi, tl.ni);
    }
    __device__ static __forceinline__ void mma(float (&acc)[kAcc], uint32_t a, uint32_t b, bool first)
    {
        kstep_mma<kKind == kDW, 1>(acc, a, b, first); /* A: E K-major (dH) or Eᵀ MN-major (dW); B MN-major */
    }
    __device__ static __forceinline__ void epilogue(float (&acc)[kAcc], const Params &p, const Extra &, Frag f,
                                                    const Tile &)
    {
        store_tile<kKind>(acc, p, f);
    }
};

/* ---- host side ----------------------------------------------------------------------------------- */

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
tkd_status launch(const tkd_lmhead_sm90_ws *ws, const CUtensorMap &tm_a, const CUtensorMap &tm_b, GParams p)
{
    using S = Sched<kPP>;
    p.ntiles = (p.n + kBN - 1) / kBN;
    p.mtiles = (p.m + S::kTileM - 1) / S::kTileM;
    p.tiles = (long long)p.mtiles * p.ntiles;
    p.err = ws->err;
    if (kKind == kDH)
        p.group = S::kGroupM;
    return gemm_launch<Grad<kKind>, kPP>(ws, tm_a, tm_b, p, NoExtra{});
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

extern "C" tkd_status tkd_lmhead_grad_sm90_dh(tkd_lmhead_sm90_ws *ws, const uint16_t *e, int64_t lde,
                                         const uint16_t *w, int64_t rows, int d, int v, const float *sigma,
                                         float *dh)
{
    TKD_TRY(check_args(e, lde, w, rows, d, v, dh, "dH"));
    if (!sigma)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_grad_sm90: dH: sigma is NULL");
    const bool pp = pingpong_of(ws);
    CUtensorMap tm_e, tm_w;
    TKD_TRY(bf16_tmap(&tm_e, e, rows, v, lde, pp ? PingPong::kTileM : Coop::kTileM, "lmhead_grad_sm90: dH: E"));
    TKD_TRY(bf16_tmap(&tm_w, w, v, d, d, 64, "lmhead_grad_sm90: dH: W"));
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
    TKD_TRY(bf16_tmap(&tm_e, e, rows, v, lde, 64, "lmhead_grad_sm90: dW: E"));
    TKD_TRY(bf16_tmap(&tm_x, x, rows, d, d, 64, "lmhead_grad_sm90: dW: X"));
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
