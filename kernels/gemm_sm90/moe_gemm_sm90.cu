/* moe_gemm_sm90.cu — see moe_gemm_sm90.h. Built for sm_90a only (kernels/CMakeLists.txt).
 *
 * Both GEMMs are one problem of the driver (gemm_sm90_pipe.cuh), Moe<kFused>. Output tile t is
 * (M-tile li of the list, N-tile nj) with t = li · ntiles + nj: the N-tiles of an M-tile are
 * neighbours, so a wave of 132 CTAs covers ~22 M-tiles (five or six experts) whose rows of x and
 * whose expert weights stay in L2 while the wave reads them (each x tile once from DRAM, each
 * expert's weights once for all of its M-tiles). Per K step the producer loads x's rows of the tile
 * (one K-major box of tile-rows x 64 at (k0, r)) and two 128-row boxes of weights into the stage's
 * 256-row B (the same 128-byte-swizzled layout as one 256-row box): W_gate then W_up at the same
 * rows (fused), or the tile's 256 rows of W in two halves (down). Weight rows past the expert's n
 * rows belong to the next expert (or lie past the stack, zero-filled): they feed accumulators that
 * are never stored, as do x rows past the tile's rows.
 *
 * The epilogue's fragment (gemm_sm90_pipe.cuh's Frag, with the tile's own origin): rows row0 + 8h,
 * accumulator columns col0 + 8j + e (j < 32) in acc[4j + 2h + e]. Fused, columns j < 16 are gate
 * columns nj·128 + col0 + 8j + e and j + 16 the up columns of the same output column.
 */
#include "kernels/gemm_sm90/moe_gemm_sm90.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_common.cuh"
#include "kernels/gemm_sm90/gemm_sm90_pipe.cuh"

namespace {

using namespace tkd_sm90;
using namespace tkd_lmhead;

constexpr int kHalfB = kBN / 2;              /* weight rows of one of a stage's two B boxes */
constexpr uint32_t kHalfBBytes = kHalfB * 128;
static_assert(kBytesB == 2 * kHalfBBytes, "a stage's B is two 128-row boxes");

struct MParams {
    long long tiles; /* list tiles x ntiles */
    int ktiles;
    unsigned *err;
    const int32_t *list; /* (n_tiles, 3): {expert, first row, rows} */
    int ntiles;          /* N-tiles per M-tile: ceil(n / 128) fused, ceil(n / 256) down */
    int m;               /* rows of x and the output: tile rows at or past m are neither stored */
    int n;               /* output columns, and each expert's weight rows */
    uint16_t *out;       /* (m, n) bf16 */
};

/* What only the fused GEMM reads: W_up's map (down: W's again), the biases, the activation. */
struct MExtra {
    CUtensorMap tm_b2;
    const uint16_t *b_gate, *b_up; /* (E, n) or NULL */
    int act;                       /* tkd_moe_act */
    float limit, alpha;
};

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x = lo at the lower address */
    return *reinterpret_cast<const uint32_t *>(&v);
}

__device__ __forceinline__ float bias_of(const uint16_t *b, long long i)
{
    return b ? __uint_as_float((unsigned)b[i] << 16) : 0.0f;
}

/* h = act(g, u) in fp32, the expressions of moe_cuda.cu's act_kernel (and the CPU reference's). */
__device__ __forceinline__ float act_of(const MExtra &x, float g, float u)
{
    if (x.act == TKD_MOE_ACT_SWIGLU)
        return g / (1.0f + expf(-g)) * u;
    g = fminf(g, x.limit);
    u = fminf(fmaxf(u, -x.limit), x.limit);
    return (u + 1.0f) * (g / (1.0f + expf(-x.alpha * g)));
}

template <bool kFused>
struct Moe {
    using Params = MParams;
    using Extra = MExtra;
    struct Tile {
        int mi, ni;    /* 0, 0: the epilogue's fragment is relative to the tile */
        uint32_t bytes;
        int nj;        /* N-tile */
        int e, r, rows; /* the list's entry */
    };
    template <class S>
    __device__ static __forceinline__ Tile tile(const Params &p, long long t)
    {
        Tile tl;
        const long long li = t / p.ntiles;
        const int32_t *q = p.list + 3 * li;
        tl.mi = tl.ni = 0;
        tl.nj = (int)(t - li * p.ntiles);
        tl.e = q[0], tl.r = q[1], tl.rows = q[2];
        tl.bytes = S::kStageBytes; /* every box is whole: zero-filled bytes count */
        return tl;
    }
    template <class S>
    __device__ static __forceinline__ void load(const CUtensorMap *tm_a, const CUtensorMap *tm_b, const Params &p,
                                                const Extra &x, const Tile &tl, uint32_t a, uint32_t b,
                                                uint32_t full, int kt)
    {
        tma_load_2d(a, tm_a, kt * kBK, tl.r, full);
        const int w0 = tl.e * p.n + tl.nj * (kFused ? kHalfB : kBN);
        tma_load_2d(b, tm_b, kt * kBK, w0, full);
        tma_load_2d(b + kHalfBBytes, &x.tm_b2, kt * kBK, kFused ? w0 : w0 + kHalfB, full);
    }
    __device__ static __forceinline__ void mma(float (&acc)[kAcc], uint32_t a, uint32_t b, bool first)
    {
        kstep_mma<0, 0>(acc, a, b, first); /* x and W both K-major */
    }
    __device__ static __forceinline__ void epilogue(float (&acc)[kAcc], const Params &p, const Extra &x, Frag f,
                                                    const Tile &tl)
    {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int local = (int)f.row0 + 8 * h;
            if (local >= tl.rows || tl.r + local >= p.m)
                continue;
            uint16_t *o = p.out + (long long)(tl.r + local) * p.n;
            if (kFused) {
                const long long bias0 = (long long)tl.e * p.n;
#pragma unroll
                for (int j = 0; j < kBN / 16; j++) {
                    const int col = tl.nj * kHalfB + f.col0 + 8 * j, ig = 4 * j + 2 * h, iu = ig + kAcc / 2;
                    if (col >= p.n)
                        continue;
                    const float g0 = bf16_round(acc[ig]) + bias_of(x.b_gate, bias0 + col);
                    const float g1 = bf16_round(acc[ig + 1]) + bias_of(x.b_gate, bias0 + col + 1);
                    const float u0 = bf16_round(acc[iu]) + bias_of(x.b_up, bias0 + col);
                    const float u1 = bf16_round(acc[iu + 1]) + bias_of(x.b_up, bias0 + col + 1);
                    *reinterpret_cast<uint32_t *>(o + col) = pack_bf16(act_of(x, g0, u0), act_of(x, g1, u1));
                }
            } else {
#pragma unroll
                for (int j = 0; j < kBN / 8; j++) {
                    const int col = tl.nj * kBN + f.col0 + 8 * j, i = 4 * j + 2 * h;
                    if (col < p.n)
                        *reinterpret_cast<uint32_t *>(o + col) = pack_bf16(acc[i], acc[i + 1]);
                }
            }
        }
    }
};

/* ---- host side ------------------------------------------------------------------------------------ */

bool aligned16(const void *q) { return ((uintptr_t)q & 15u) == 0; }

tkd_status check_args(const uint16_t *x, const uint16_t *w0, const uint16_t *w1, const int32_t *tiles, int n_tiles,
                      int m, int n, int k, const uint16_t *out, const char *what)
{
    if (!x || !w0 || !w1 || !out || (n_tiles > 0 && !tiles) || n_tiles < 0 || m < 0 || n < 0 || k < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe_gemm_sm90: %s: bad shape or pointer (%d tiles, m %d, n %d, "
                             "k %d)", what, n_tiles, m, n, k);
    if (n % 8 || k % 8 || !aligned16(x) || !aligned16(w0) || !aligned16(w1) || ((uintptr_t)out & 3u))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "moe_gemm_sm90: %s: (%d, %d) · (%d, %d)ᵀ needs n and k multiples "
                             "of 8, x and w 16-byte aligned, the output 4-byte aligned", what, m, k, n, k);
    return tkd_lmhead_sm90_supported();
}

/* One launch of Moe<kFused> on ws's schedule over E experts' stacks w0, w1 (E · n rows each). */
template <bool kFused>
tkd_status run(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const uint16_t *w0, const uint16_t *w1, int E,
               const int32_t *tiles, int n_tiles, int m, int n, int k, uint16_t *out, MExtra &ex)
{
    if (E < 1 || (long long)E * n > INT32_MAX)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe_gemm_sm90: %d experts of %d rows", E, n);
    if (n_tiles == 0 || m == 0 || n == 0)
        return TKD_OK;
    const bool pp = ws->sched == TKD_LMHEAD_SM90_SCHED_PINGPONG;
    CUtensorMap tm_x, tm_w;
    TKD_TRY(bf16_tmap(&tm_x, x, m, k, k, pp ? PingPong::kTileM : Coop::kTileM, "moe_gemm_sm90: x"));
    TKD_TRY(bf16_tmap(&tm_w, w0, (long long)E * n, k, k, kHalfB, "moe_gemm_sm90: w"));
    TKD_TRY(bf16_tmap(&ex.tm_b2, w1, (long long)E * n, k, k, kHalfB, "moe_gemm_sm90: w"));
    MParams p = {};
    p.ntiles = (n + (kFused ? kHalfB : kBN) - 1) / (kFused ? kHalfB : kBN);
    p.tiles = (long long)n_tiles * p.ntiles;
    p.ktiles = (k + kBK - 1) / kBK;
    p.err = ws->err;
    p.list = tiles;
    p.m = m;
    p.n = n;
    p.out = out;
    return pp ? gemm_launch<Moe<kFused>, true>(ws, tm_x, tm_w, p, ex)
              : gemm_launch<Moe<kFused>, false>(ws, tm_x, tm_w, p, ex);
}

} // namespace

extern "C" int tkd_moe_gemm_sm90_tile_rows(const tkd_lmhead_sm90_ws *ws)
{
    return ws->sched == TKD_LMHEAD_SM90_SCHED_PINGPONG ? PingPong::kTileM : Coop::kTileM;
}

extern "C" tkd_status tkd_moe_gemm_sm90_gate_up(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const uint16_t *w_gate,
                                                const uint16_t *w_up, const uint16_t *b_gate, const uint16_t *b_up,
                                                const tkd_moe_params *p, const int32_t *tiles, int n_tiles, int m,
                                                int n, int k, uint16_t *h)
{
    TKD_TRY(check_args(x, w_gate, w_up, tiles, n_tiles, m, n, k, h, "gate/up"));
    if (!p || (p->act != TKD_MOE_ACT_SWIGLU && p->act != TKD_MOE_ACT_SWIGLU_CLAMP))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe_gemm_sm90: gate/up: no or unknown activation");
    MExtra ex = {};
    ex.b_gate = b_gate, ex.b_up = b_up;
    ex.act = p->act, ex.limit = p->limit, ex.alpha = p->alpha;
    return run<true>(ws, x, w_gate, w_up, p->E, tiles, n_tiles, m, n, k, h, ex);
}

extern "C" tkd_status tkd_moe_gemm_sm90_down(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const uint16_t *w, int E,
                                             const int32_t *tiles, int n_tiles, int m, int n, int k, uint16_t *o)
{
    TKD_TRY(check_args(x, w, w, tiles, n_tiles, m, n, k, o, "down"));
    MExtra ex = {};
    return run<false>(ws, x, w, w, E, tiles, n_tiles, m, n, k, o, ex);
}
