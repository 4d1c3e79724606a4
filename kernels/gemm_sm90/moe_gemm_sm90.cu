/* moe_gemm_sm90.cu — see moe_gemm_sm90.h. Built for sm_90a only (kernels/CMakeLists.txt).
 *
 * Both GEMMs are one problem of the driver (gemm_sm90_pipe.cuh), Moe<kFused>. Output tiles go group
 * by group of the list (up to 16 M-tiles of one expert: kernels/moe.h), and within a group N-tile
 * by N-tile with the group's M-tiles innermost: a group of c M-tiles starting at list index g0
 * owns the tiles g0 · ntiles .. (g0 + c) · ntiles − 1, tile g0 · ntiles + nj · c + i being (M-tile
 * g0 + i, N-tile nj). So a wave of 132 CTAs reads a few groups' rows of x and a slice of their
 * experts' weights, which stay in L2 while the wave reads them: each x row and each weight row
 * comes from DRAM about once, even for an expert whose weights exceed the L2 (gpt-oss's 33 MB of
 * gate and up weights; with the N-tiles of one M-tile innermost instead, each wave streamed all of
 * them again). Per K step the producer loads x's rows of the tile
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
#include "kernels/moe.h"

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
    const int32_t *list; /* (n_tiles, TKD_MOE_TILE_INTS): kernels/moe.h's tile list */
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

/* A quad's (4 lanes: one fragment row) packed bf16 pairs p[jj] of four consecutive 8-column groups
 * j0 + jj — lane q holding columns 8(j0 + jj) + 2q and + 1 — transposed so that lane q holds all 8
 * columns of group j0 + q, in order, for one 16-byte store: lane q takes pair i from lane i, which
 * sends at shuffle s the pair its receiver (q = i − s) needs. Every lane of the warp must call it. */
__device__ __forceinline__ uint4 quad_transpose(const uint32_t (&p)[4])
{
    const int q = threadIdx.x & 3, base = (threadIdx.x & 31) & ~3;
    uint32_t o[4] = {p[0], p[1], p[2], p[3]}; /* o[q] = p[q] already (s = 0); the others come from lanes i ≠ q */
#pragma unroll
    for (int s = 1; s < 4; s++) {
        const int want = (q - s) & 3, from = (q + s) & 3;
        const uint32_t send = want == 0 ? p[0] : want == 1 ? p[1] : want == 2 ? p[2] : p[3];
        const uint32_t got = __shfl_sync(0xffffffffu, send, base + from);
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (i == from)
                o[i] = got;
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
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
        int li;
        tkd_moe_tile_of(p.list, p.ntiles, t, &li, &tl.nj);
        const int32_t *q = p.list + TKD_MOE_TILE_INTS * li;
        tl.mi = tl.ni = 0;
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
    /* Each group of four 8-column groups is transposed within the quad (quad_transpose) into one
     * 16-byte store per lane; n is a multiple of 8, so a group is wholly in or out. The shuffles run
     * on every lane, the stores only on rows inside the tile and m. */
    __device__ static __forceinline__ void epilogue(float (&acc)[kAcc], const Params &p, const Extra &x, Frag f,
                                                    const Tile &tl)
    {
        const int q = threadIdx.x & 3, cbase = tl.nj * (kFused ? kHalfB : kBN);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int local = (int)f.row0 + 8 * h;
            const bool live = local < tl.rows && tl.r + local < p.m;
            uint16_t *o = p.out + (long long)(tl.r + local) * p.n;
            const long long bias0 = (long long)tl.e * p.n;
#pragma unroll
            for (int j0 = 0; j0 < (kFused ? kBN / 16 : kBN / 8); j0 += 4) {
                uint32_t pr[4];
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    const int j = j0 + jj, col = cbase + f.col0 + 8 * j, i = 4 * j + 2 * h;
                    if (kFused) {
                        const int iu = i + kAcc / 2;
                        const bool in = col < p.n;
                        const float g0 = bf16_round(acc[i]) + (in ? bias_of(x.b_gate, bias0 + col) : 0.0f);
                        const float g1 = bf16_round(acc[i + 1]) + (in ? bias_of(x.b_gate, bias0 + col + 1) : 0.0f);
                        const float u0 = bf16_round(acc[iu]) + (in ? bias_of(x.b_up, bias0 + col) : 0.0f);
                        const float u1 = bf16_round(acc[iu + 1]) + (in ? bias_of(x.b_up, bias0 + col + 1) : 0.0f);
                        pr[jj] = pack_bf16(act_of(x, g0, u0), act_of(x, g1, u1));
                    } else {
                        pr[jj] = pack_bf16(acc[i], acc[i + 1]);
                    }
                }
                const uint4 v = quad_transpose(pr);
                const int col = cbase + 8 * (j0 + q);
                if (live && col < p.n)
                    *reinterpret_cast<uint4 *>(o + col) = v;
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
    if (n % 8 || k % 8 || !aligned16(x) || !aligned16(w0) || !aligned16(w1) || !aligned16(out))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "moe_gemm_sm90: %s: (%d, %d) · (%d, %d)ᵀ needs n and k multiples "
                             "of 8 and x, w and the output 16-byte aligned", what, m, k, n, k);
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
