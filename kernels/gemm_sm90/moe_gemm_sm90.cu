/* moe_gemm_sm90.cu — see moe_gemm_sm90.h. Built for sm_90a only (kernels/CMakeLists.txt).
 *
 * Both GEMMs are one problem of the driver (gemm_sm90_pipe.cuh), Moe<kFused, kMx>. Output tiles go group
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
 * MXFP4 weights (kMx, cooperative only): the stage holds x's box and, in place of B, the 256 rows'
 * codes and scales (the producer warp's TMA and cp.async); the consumers decode B into the driver's
 * B buffers one K step ahead of the wgmma (Moe::transform, the driver's transform), the same bytes
 * TMA would have landed from the decoded stacks.
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
#include "common/mxfp4_bits.h"
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

/* What only some launches read: the second B map (W_up's; down: W's again), the biases and the
 * activation (fused), and the MXFP4 weights' scales. */
struct MExtra {
    CUtensorMap tm_b2;
    const uint16_t *b_gate, *b_up; /* (E, n) or NULL */
    int act;                       /* tkd_moe_act */
    float limit, alpha;
    const uint8_t *sc0, *sc1; /* MXFP4: (E · n, k / 32) E8M0 scales of the two B halves' stacks */
    long long stack_rows;     /* MXFP4: E · n (rows past it are zero-filled) */
    int groups;               /* MXFP4: k / 32 */
};

/* MXFP4 weights (kMx): per K step (64) a weight row is 32 bytes of E2M1 codes (two MXFP4 blocks)
 * and two scales. The stage after B holds the 256 rows' codes (two TMA boxes of 128 rows x 32
 * bytes, unswizzled) and each row's 4-byte aligned word holding its two scales (cp.async; G = k / 32
 * even, so the pair never straddles a word). */
constexpr uint32_t kPackedBytes = kBN * 32, kScaleBytes = kBN * 4;

/* Shared address a as a pointer into the kernel's dynamic shared memory, so the compiler sees
 * shared loads and stores it may schedule (the driver's stage addresses are 32-bit ones). */
__device__ __forceinline__ unsigned char *smem_ptr(uint32_t a)
{
    extern __shared__ unsigned char smem_raw[];
    return smem_raw + (a - smem_u32(smem_raw));
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b)
{
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

/* 8 codes (a word) times 2^(s − 127) as 8 bf16, in order: the values of moe_cuda's decoder and
 * common/mxfp4_codec.h, bit for bit. For 2 ≤ s ≤ 128 one bf16 multiply a pair by 2^(s − 1) (a
 * normal bf16) is exact: its products are normal (≥ 2^−126) multiples of the codes' values. Other
 * scales (none in a trained checkpoint: values ≥ 4 or below 2^−126) take that decoder's fp32
 * product (common/mxfp4_bits.h, which the CPU tests hold to the codec for every code and scale). */
__device__ __forceinline__ uint4 e2m1x8_scaled(uint32_t w, unsigned s)
{
    uint32_t r[4];
    tkd_mxfp4_e2m1x8_bits(w, r);
    if (tkd_mxfp4_fast_scale(s)) {
        const uint32_t mm = tkd_mxfp4_fast_multiplier(s); /* 2^(s − 1) in both halves */
#pragma unroll
        for (int j = 0; j < 4; j++)
            r[j] = bf16x2_mul(r[j], mm);
    } else {
        tkd_mxfp4_scale_f32(r, s);
    }
    return make_uint4(r[0], r[1], r[2], r[3]);
}

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

template <bool kFused, bool kMx>
struct Moe {
    using Params = MParams;
    using Extra = MExtra;
    /* the pipeline's options (gemm_sm90_pipe.cuh's Traits): MXFP4 weights are decoded into B by
     * the producer's other warps, from codes and scales the producer warp loads into the stage */
    static constexpr bool kTransform = kMx, kWarpLoad = kMx;
    static constexpr uint32_t kExtraBytes = kMx ? kPackedBytes + kScaleBytes : 0;
    static_assert(2 * kBN % 256 == 0, "the consumers' 256 threads share a stage's 512 blocks evenly");
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
        tl.bytes = kMx ? S::kBytesA + kPackedBytes : S::kStageBytes; /* every box is whole: zero-filled bytes count */
        return tl;
    }
    /* The stack row of B row i (< 256) of the tile: fused, rows i and i + 128 are row i of W_gate
     * and of W_up. */
    __device__ static __forceinline__ long long b_row(const Params &p, const Tile &tl, int i)
    {
        return (long long)tl.e * p.n + tl.nj * (kFused ? kHalfB : kBN) + (kFused ? (i & (kHalfB - 1)) : i);
    }
    template <class S>
    __device__ static __forceinline__ void load(const CUtensorMap *tm_a, const CUtensorMap *tm_b, const Params &p,
                                                const Extra &x, const Tile &tl, uint32_t a, uint32_t b,
                                                uint32_t full, int kt)
    {
        const int w0 = tl.e * p.n + tl.nj * (kFused ? kHalfB : kBN);
        if (!kMx) {
            tma_load_2d(a, tm_a, kt * kBK, tl.r, full);
            tma_load_2d(b, tm_b, kt * kBK, w0, full);
            tma_load_2d(b + kHalfBBytes, &x.tm_b2, kt * kBK, kFused ? w0 : w0 + kHalfB, full);
            return;
        }
        const int lane = threadIdx.x & 31; /* the whole producer warp; b: the stage's extra bytes */
        const uint32_t pk = b, sc = pk + kPackedBytes;
        if (lane == 0) {
            tma_load_2d(a, tm_a, kt * kBK, tl.r, full);
            tma_load_2d(pk, tm_b, kt * (kBK / 2), w0, full);
            tma_load_2d(pk + kPackedBytes / 2, &x.tm_b2, kt * (kBK / 2), kFused ? w0 : w0 + kHalfB, full);
        }
#pragma unroll
        for (int i = lane; i < kBN; i += 32) {
            const long long row = b_row(p, tl, i);
            const uint8_t *stack = i < kHalfB ? x.sc0 : x.sc1;
            const bool in = row < x.stack_rows;
            cp_async_4(sc + 4 * i, in ? stack + ((row * x.groups + 2 * kt) & ~3ll) : stack, in ? 4 : 0);
        }
        cp_async_arrive_noinc(full);
    }
    /* Consumer thread d's (< 256) blocks of K step kt, from the codes and scales at e into B at b:
     * block u (< 512) is B row u / 2's codes of K half u % 2 (16 bytes), decoded into that row's
     * four 16-byte chunks 4·(u % 2) + j, each XOR-ed by row % 8 as a 128-byte swizzled TMA box
     * lands. A warp's 16-byte loads and stores each cover 512 contiguous resp. 8-row-distinct chunk
     * positions: no bank conflicts. Both blocks are loaded before either is decoded. */
    template <class S>
    __device__ static __forceinline__ void transform(const Params &p, const Extra &x, const Tile &tl, uint32_t e,
                                                     uint32_t b, int kt, int d)
    {
        const uint4 *__restrict__ codes = reinterpret_cast<const uint4 *>(smem_ptr(e));
        const unsigned char *__restrict__ scales = smem_ptr(e + kPackedBytes);
        unsigned char *__restrict__ out = smem_ptr(b);
        constexpr int kUnits = 2 * kBN / 256;
        const uint32_t w0 = (uint32_t)b_row(p, tl, 0), g = (uint32_t)x.groups;
        uint4 q[kUnits];
        unsigned sc[kUnits];
#pragma unroll
        for (int t = 0; t < kUnits; t++) {
            const int u = d + 256 * t, i = u >> 1;
            /* the row's scale pair sits at (row·G + 2kt) mod 4 in its word; mod 4 is enough */
            const uint32_t at = (w0 + (uint32_t)(kFused ? (i & (kHalfB - 1)) : i)) * g + 2u * kt;
            q[t] = codes[u];
            sc[t] = scales[4 * i + (at & 3u) + (u & 1)];
        }
#pragma unroll
        for (int t = 0; t < kUnits; t++) {
            const int u = d + 256 * t, i = u >> 1, h = u & 1, sw = i & 7;
            uint4 *row = reinterpret_cast<uint4 *>(out + 128 * i);
            row[(4 * h + 0) ^ sw] = e2m1x8_scaled(q[t].x, sc[t]);
            row[(4 * h + 1) ^ sw] = e2m1x8_scaled(q[t].y, sc[t]);
            row[(4 * h + 2) ^ sw] = e2m1x8_scaled(q[t].z, sc[t]);
            row[(4 * h + 3) ^ sw] = e2m1x8_scaled(q[t].w, sc[t]);
        }
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

/* The B stacks of one launch: bf16 w0, w1 (E · n rows of k each), or MXFP4 codes c0, c1 (E · n rows
 * of k / 2 bytes) with their scales (Extra's sc0, sc1). */
struct Stacks {
    const uint16_t *w0, *w1;
    const uint8_t *c0, *c1;
};

/* One launch of Moe<kFused, kMx> on ws's schedule over E experts' stacks. */
template <bool kFused, bool kMx>
tkd_status run(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const Stacks &st, int E, const int32_t *tiles, int n_tiles,
               int m, int n, int k, uint16_t *out, MExtra &ex)
{
    if (E < 1 || (long long)E * n > INT32_MAX)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe_gemm_sm90: %d experts of %d rows", E, n);
    if (n_tiles == 0 || m == 0 || n == 0)
        return TKD_OK;
    const bool pp = ws->sched == TKD_LMHEAD_SM90_SCHED_PINGPONG;
    const long long rows = (long long)E * n;
    CUtensorMap tm_x, tm_w;
    TKD_TRY(bf16_tmap(&tm_x, x, m, k, k, pp ? PingPong::kTileM : Coop::kTileM, "moe_gemm_sm90: x"));
    if (kMx) {
        TKD_TRY(make_tmap_u8(&tm_w, st.c0, rows, k / 2, k / 2, kBK / 2, kHalfB, "moe_gemm_sm90: w (MXFP4)"));
        TKD_TRY(make_tmap_u8(&ex.tm_b2, st.c1, rows, k / 2, k / 2, kBK / 2, kHalfB, "moe_gemm_sm90: w (MXFP4)"));
        ex.stack_rows = rows;
        ex.groups = k / 32;
    } else {
        TKD_TRY(bf16_tmap(&tm_w, st.w0, rows, k, k, kHalfB, "moe_gemm_sm90: w"));
        TKD_TRY(bf16_tmap(&ex.tm_b2, st.w1, rows, k, k, kHalfB, "moe_gemm_sm90: w"));
    }
    MParams p = {};
    p.ntiles = (n + (kFused ? kHalfB : kBN) - 1) / (kFused ? kHalfB : kBN);
    p.tiles = (long long)n_tiles * p.ntiles;
    p.ktiles = (k + kBK - 1) / kBK;
    p.err = ws->err;
    p.list = tiles;
    p.m = m;
    p.n = n;
    p.out = out;
    if constexpr (kMx) /* the consumers decode: cooperative only (check_mx refuses ping-pong) */
        return gemm_launch<Moe<kFused, kMx>, false>(ws, tm_x, tm_w, p, ex);
    else
        return pp ? gemm_launch<Moe<kFused, kMx>, true>(ws, tm_x, tm_w, p, ex)
                  : gemm_launch<Moe<kFused, kMx>, false>(ws, tm_x, tm_w, p, ex);
}

/* The MXFP4 launches' extra limits: the cooperative schedule, k a multiple of 64 (a K step is two whole blocks, so a row's
 * scale pair sits in one aligned word), codes 16-byte and scales 4-byte aligned. */
tkd_status check_mx(const tkd_lmhead_sm90_ws *ws, const tkd_moe_mxfp4 *q, int j0, int j1, int k, const char *what)
{
    if (ws->sched != TKD_LMHEAD_SM90_SCHED_COOP)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "moe_gemm_sm90: %s (MXFP4): runs on the cooperative schedule only "
                             "(its two consumer warpgroups decode each K step's weights together)", what);
    if (!q || !q->blocks[j0] || !q->blocks[j1] || !q->scales[j0] || !q->scales[j1])
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe_gemm_sm90: %s (MXFP4): no codes or scales", what);
    if (k % 64 || !aligned16(q->blocks[j0]) || !aligned16(q->blocks[j1]) || ((uintptr_t)q->scales[j0] & 3u) ||
        ((uintptr_t)q->scales[j1] & 3u))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "moe_gemm_sm90: %s (MXFP4): k %d must be a multiple of 64, the codes "
                             "16-byte and the scales 4-byte aligned", what, k);
    return TKD_OK;
}

} // namespace

extern "C" int tkd_moe_gemm_sm90_tile_rows(const tkd_lmhead_sm90_ws *ws)
{
    return ws->sched == TKD_LMHEAD_SM90_SCHED_PINGPONG ? PingPong::kTileM : Coop::kTileM;
}

/* The fused launch's activation and biases. */
static tkd_status gate_up_extra(const tkd_moe_params *p, const uint16_t *b_gate, const uint16_t *b_up, MExtra *ex)
{
    if (!p || (p->act != TKD_MOE_ACT_SWIGLU && p->act != TKD_MOE_ACT_SWIGLU_CLAMP))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe_gemm_sm90: gate/up: no or unknown activation");
    *ex = MExtra{};
    ex->b_gate = b_gate, ex->b_up = b_up;
    ex->act = p->act, ex->limit = p->limit, ex->alpha = p->alpha;
    return TKD_OK;
}

extern "C" tkd_status tkd_moe_gemm_sm90_gate_up(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const uint16_t *w_gate,
                                                const uint16_t *w_up, const uint16_t *b_gate, const uint16_t *b_up,
                                                const tkd_moe_params *p, const int32_t *tiles, int n_tiles, int m,
                                                int n, int k, uint16_t *h)
{
    TKD_TRY(check_args(x, w_gate, w_up, tiles, n_tiles, m, n, k, h, "gate/up"));
    MExtra ex;
    TKD_TRY(gate_up_extra(p, b_gate, b_up, &ex));
    const Stacks st = {w_gate, w_up, NULL, NULL};
    return run<true, false>(ws, x, st, p->E, tiles, n_tiles, m, n, k, h, ex);
}

extern "C" tkd_status tkd_moe_gemm_sm90_down(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const uint16_t *w, int E,
                                             const int32_t *tiles, int n_tiles, int m, int n, int k, uint16_t *o)
{
    TKD_TRY(check_args(x, w, w, tiles, n_tiles, m, n, k, o, "down"));
    MExtra ex = {};
    const Stacks st = {w, w, NULL, NULL};
    return run<false, false>(ws, x, st, E, tiles, n_tiles, m, n, k, o, ex);
}

extern "C" tkd_status tkd_moe_gemm_sm90_gate_up_mxfp4(tkd_lmhead_sm90_ws *ws, const uint16_t *x,
                                                      const tkd_moe_mxfp4 *q, const uint16_t *b_gate,
                                                      const uint16_t *b_up, const tkd_moe_params *p,
                                                      const int32_t *tiles, int n_tiles, int m, int n, int k,
                                                      uint16_t *h)
{
    TKD_TRY(check_mx(ws, q, 0, 1, k, "gate/up"));
    TKD_TRY(check_args(x, x, x, tiles, n_tiles, m, n, k, h, "gate/up"));
    MExtra ex;
    TKD_TRY(gate_up_extra(p, b_gate, b_up, &ex));
    ex.sc0 = q->scales[0], ex.sc1 = q->scales[1];
    const Stacks st = {NULL, NULL, q->blocks[0], q->blocks[1]};
    return run<true, true>(ws, x, st, p->E, tiles, n_tiles, m, n, k, h, ex);
}

extern "C" tkd_status tkd_moe_gemm_sm90_down_mxfp4(tkd_lmhead_sm90_ws *ws, const uint16_t *x, const tkd_moe_mxfp4 *q,
                                                   int E, const int32_t *tiles, int n_tiles, int m, int n, int k,
                                                   uint16_t *o)
{
    TKD_TRY(check_mx(ws, q, 2, 2, k, "down"));
    TKD_TRY(check_args(x, x, x, tiles, n_tiles, m, n, k, o, "down"));
    MExtra ex = {};
    ex.sc0 = ex.sc1 = q->scales[2];
    const Stacks st = {NULL, NULL, q->blocks[2], q->blocks[2]};
    return run<false, true>(ws, x, st, E, tiles, n_tiles, m, n, k, o, ex);
}
