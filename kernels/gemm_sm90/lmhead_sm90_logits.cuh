/* lmhead_sm90_logits.cuh — the logits GEMM, Z = H · Wᵀ (lmhead_sm90.h), as a problem of the one
 * Hopper GEMM driver (gemm_sm90_pipe.cuh): its kernel parameters, how a tile's H and W boxes are
 * loaded and read by the wgmma, its epilogues (logits, statistics, exp, gather, top-k candidates),
 * and the host launch for a combination of epilogues. lmhead_sm90.cu builds the product's
 * combinations from it; lmhead_sm90_tuning.cu the benchmark's main loop. Internal to gemm_sm90/.
 * Everything sits in an anonymous namespace: each file that includes it gets its own kernels.
 */
#ifndef TKD_LMHEAD_SM90_LOGITS_CUH
#define TKD_LMHEAD_SM90_LOGITS_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_common.cuh"
#include "kernels/gemm_sm90/gemm_sm90_pipe.cuh"
#include "kernels/gemm_sm90/lmhead_sm90.h"

namespace {

using namespace tkd_sm90;
using namespace tkd_lmhead;

using namespace tkd_sm90;
using namespace tkd_lmhead;

/* Epilogue parts, a bit each, combined in one template argument. kEpiExp: E = exp(k·z − ref) as
 * bf16 (the loss's gradient tile up to a per-row factor); with kEpiStats both come from the same
 * exps. kEpiGather: the logits at a per-row list of columns (the teacher's top-k', tail draws,
 * label). kEpiCand: teacher-dump's top-k candidates. (Bit 4 was the benchmark's "no epilogue",
 * now a problem of its own in lmhead_sm90_tuning.cu.) */
enum Epi {
    kEpiLogits = 1, kEpiStats = 2, kEpiExp = 8, kEpiGather = 16, kEpiCand = 32,
    kEpiLogitsStats = kEpiLogits | kEpiStats,
};

struct Params {
    long long n;     /* rows of H (and Z) */
    int v;           /* rows of W (columns of Z) */
    int ktiles, mtiles, ntiles;
    long long tiles; /* mtiles · ntiles */
    float *z;        /* logits: (n, ldz) */
    long long ldz;
    float *part;     /* stats: (3, n, ntiles) */
    float l2e_tau;   /* stats: log2(e) / τ */
    int tau_mode;    /* stats: 1 when τ = 1, 2 when τ = 2, else 0 (store_stats) */
    float *sink;     /* the benchmark's main loop (lmhead_sm90_tuning.cu): always NULL, but the
                      * compiler cannot know, so the accumulators stay live to a store that never
                      * runs (an honest main-loop time) */
    unsigned *err;
};

/* The fused epilogues' arguments (exp, gather): a kernel parameter of their own, so that the
 * kernels without them keep Params small (a larger Params costs the others ~150 bytes of spills). */
struct Fx {
    __nv_bfloat16 *e; /* exp: (n, lde) */
    long long lde;
    const float *ref; /* exp: (n) per-row reference; E = exp2(z·l2e_k − ref·ref_scale) */
    float ref_scale, l2e_k;
    const int *sp_off;    /* gather: (n, ntiles + 1) start of each row-tile's entries in sp_list */
    const int2 *sp_list;  /* gather: (n, sp_l) (column, slot) pairs, sorted by column per row */
    int sp_l;
    float *g;             /* gather: (n, sp_l) logits by slot */
    const float *thr;     /* cand: (n) per-row threshold */
    unsigned *cnt;        /* cand: (n) candidates seen per row (may pass cap) */
    int2 *cand;           /* cand: (n, cap) (logit bits, column) */
    int cap;
    unsigned *flags;      /* cand: [1] the first row with a non-finite logit (UINT_MAX: none) */
};

/* ---- the problem: H (n, D) row boxes and W (v, D) row boxes, both K-major ----------------------- */

/* The part of the logits GEMM every epilogue shares (the driver's contract, gemm_sm90_pipe.cuh):
 * tiles of kTileM rows of H by 256 rows of W, in groups of 2048 rows of H swept along V
 * (tile_coords); a stage is one H box and one W box; both operands K-major. */
struct LogitsLoads {
    using Params = ::Params;
    using Extra = Fx;
    struct Tile {
        int mi, ni;
        uint32_t bytes;
    };
    template <class S>
    __device__ static __forceinline__ Tile tile(const Params &p, long long t)
    {
        Tile tl;
        tile_coords(t, p.mtiles, p.ntiles, S::kGroupM, tl.mi, tl.ni);
        tl.bytes = S::kStageBytes;
        return tl;
    }
    template <class S>
    __device__ static __forceinline__ void load(const CUtensorMap *tm_h, const CUtensorMap *tm_w, const Params &,
                                                const Extra &, const Tile &tl, uint32_t a, uint32_t b,
                                                uint32_t full, int kt)
    {
        tma_load_2d(a, tm_h, kt * kBK, tl.mi * S::kTileM, full);
        tma_load_2d(b, tm_w, kt * kBK, tl.ni * kBN, full);
    }
    __device__ static __forceinline__ void mma(float (&acc)[kAcc], uint32_t a, uint32_t b, bool first)
    {
        kstep_mma<0, 0>(acc, a, b, first); /* H and W both K-major */
    }
};

/* ---- epilogues --------------------------------------------------------------------------------- */

/* Logits epilogue: the fragment to z (n, ldz), in-range elements only (ldz even: float2 stores). */
__device__ __forceinline__ void store_logits(const float (&acc)[kAcc], const Params &p, Frag f)
{
    for_frag_rows(f, p.n, [&](int h, long long row) {
        float *zr = p.z + row * p.ldz;
#pragma unroll
        for (int j = 0; j < kBN / 8; j++) {
            const int col = f.col0 + 8 * j;
            if (col + 1 < p.v)
                *reinterpret_cast<float2 *>(zr + col) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            else if (col < p.v)
                zr[col] = acc[4 * j + 2 * h];
        }
    });
}

/* Accumulator (j, h, e) of the fragment, or -inf where its column is at or past V. */
__device__ inline float masked(const float (&acc)[kAcc], int j, int h, int e, Frag f, int v)
{
    return f.col0 + 8 * j + e < v ? acc[4 * j + 2 * h + e] : -INFINITY;
}

/* Max over the 256 columns of row half h, reduced over the quad that holds the row. */
__device__ inline float row_max(const float (&acc)[kAcc], int h, Frag f, int v)
{
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kBN / 8; j++)
        m = fmaxf(m, fmaxf(masked(acc, j, h, 0, f, v), masked(acc, j, h, 1, f, v)));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    return fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
}

/* Σ exp2(l2e·(z − m)) over row half h (l2e = log2(e)/scale), reduced over the quad. */
__device__ inline float row_sum_exp(const float (&acc)[kAcc], int h, Frag f, int v, float m, float l2e)
{
    const float mb = m * l2e;
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kBN / 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++)
            s += fast_exp2(fmaf(masked(acc, j, h, e, f, v), l2e, -mb));
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    return s + __shfl_xor_sync(0xffffffffu, s, 2);
}

/* τ = 2: (Σ exp(z − m), Σ exp((z − m)/2)) over row half h from one exp per element, e =
 * exp((z − m)/2) and exp(z − m) = e², reduced over the quad. */
__device__ inline float2 row_sum_exp_tau2(const float (&acc)[kAcc], int h, Frag f, int v, float m)
{
    const float l2e = 0.5f * kLog2e, mb = m * l2e;
    float s1 = 0.0f, st = 0.0f;
#pragma unroll
    for (int j = 0; j < kBN / 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float x = fast_exp2(fmaf(masked(acc, j, h, e, f, v), l2e, -mb));
            st += x;
            s1 = fmaf(x, x, s1);
        }
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    st += __shfl_xor_sync(0xffffffffu, st, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    st += __shfl_xor_sync(0xffffffffu, st, 2);
    return make_float2(s1, st);
}

/* Statistics epilogue: for each of this thread's two rows, m, s1 = Σ exp(z − m) and
 * st = Σ exp((z − m)/τ) over the tile's in-range columns, written by the quad's first lane to
 * part (3, n, ntiles) at V-tile ni. One exp per element at τ = 1 (st = s1) and τ = 2 (squares),
 * two otherwise: the special-function unit is the epilogue's bottleneck. */
__device__ __forceinline__ void store_stats(const float (&acc)[kAcc], const Params &p, Frag f, int ni)
{
    const size_t plane = (size_t)p.n * p.ntiles;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float m = row_max(acc, h, f, p.v);
        float s1, st;
        if (p.tau_mode == 2) {
            const float2 s = row_sum_exp_tau2(acc, h, f, p.v, m);
            s1 = s.x, st = s.y;
        } else {
            s1 = row_sum_exp(acc, h, f, p.v, m, kLog2e);
            st = p.tau_mode == 1 ? s1 : row_sum_exp(acc, h, f, p.v, m, p.l2e_tau);
        }
        const long long row = f.row0 + 8 * h;
        if ((threadIdx.x & 3) == 0 && row < p.n) {
            const size_t i = (size_t)row * p.ntiles + ni;
            p.part[i] = m;
            p.part[plane + i] = s1;
            p.part[2 * plane + i] = st;
        }
    }
}

/* Row half h's E row (NULL past n) and its reference in exp2 units. */
__device__ inline __nv_bfloat16 *exp_row(const Params &p, const Fx &x, Frag f, int h, float &rb)
{
    const long long row = f.row0 + 8 * h;
    rb = row < p.n ? x.ref[row] * x.ref_scale : 0.0f;
    return row < p.n ? x.e + row * x.lde : nullptr;
}

__device__ inline uint32_t exp_pair(const float (&acc)[kAcc], int j, int h, Frag f, int v, float l2e,
                                    float rb)
{
    const __nv_bfloat162 b = __floats2bfloat162_rn(fast_exp2(fmaf(masked(acc, j, h, 0, f, v), l2e, -rb)),
                                                   fast_exp2(fmaf(masked(acc, j, h, 1, f, v), l2e, -rb)));
    return *reinterpret_cast<const uint32_t *>(&b);
}

/* Exp epilogue: E = exp2(z·l2e_k − ref·ref_scale), one exp per element and a pass of its own
 * (sharing the statistics' exps costs registers the 168-register budget does not have: spills;
 * the special-function unit has room, and the epilogue overlaps the other consumer's main loop).
 * Whole 32-byte sectors per store: a quad holds columns 8j..8j+7 of a row as four bf16 pairs, so
 * two quad shuffles per j pair regroup 16 columns into four 8-byte runs (lane q: columns 4q..4q+3
 * of the 16). Stored as the fragment lies (16 bytes per row per instruction), half-sector writes
 * made the L2 fetch the sectors from DRAM first: ncu counted 10.8 GB read for 1 GB of E. */
__device__ __forceinline__ void store_exp(const float (&acc)[kAcc], const Params &p, const Fx &x, Frag f)
{
    const int q = threadIdx.x & 3;
    const int tile_col = f.col0 - 2 * q;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float rb;
        __nv_bfloat16 *er = exp_row(p, x, f, h, rb); /* the same for the quad: no early exit,
                                                      * the shuffles need the whole warp */
#pragma unroll
        for (int jj = 0; jj < kBN / 16; jj++) {
            const uint32_t a = exp_pair(acc, 2 * jj, h, f, p.v, x.l2e_k, rb);     /* cols 2q, 2q+1 */
            const uint32_t b = exp_pair(acc, 2 * jj + 1, h, f, p.v, x.l2e_k, rb); /* 8 + 2q, .. */
            const uint32_t r1 = __shfl_xor_sync(0xffffffffu, q < 2 ? b : a, 2);
            const uint32_t lo = q < 2 ? a : r1, hi = q < 2 ? r1 : b; /* q<2: pairs q, q+2 of a */
            const uint32_t r2 = __shfl_xor_sync(0xffffffffu, (q & 1) ? lo : hi, 1);
            const uint2 out = (q & 1) ? make_uint2(r2, hi) : make_uint2(lo, r2);
            const int col = tile_col + 16 * jj + 4 * q;
            if (!er)
                continue;
            if (col + 3 < p.v) {
                *reinterpret_cast<uint2 *>(er + col) = out;
            } else {
                const uint32_t w[2] = {out.x, out.y};
                for (int e = 0; e < 4 && col + e < p.v; e++)
                    reinterpret_cast<uint16_t *>(er)[col + e] = (uint16_t)(w[e / 2] >> (16 * (e & 1)));
            }
        }
    }
}

/* Gather epilogue: each listed column of this row tile is held by one lane of the row's quad
 * (column 8j + 2·(lane % 4) + e of the tile); that lane writes its logit to g at the entry's slot.
 * The register is picked by an unrolled compare (registers cannot be indexed at run time). */
__device__ __forceinline__ void gather_cols(const float (&acc)[kAcc], const Params &p, const Fx &x, Frag f,
                                            int ni)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const long long row = f.row0 + 8 * h;
        if (row >= p.n)
            continue;
        const int *off = x.sp_off + row * (p.ntiles + 1) + ni;
        const int end = off[1];
        for (int q = off[0]; q < end; q++) {
            const int2 it = x.sp_list[row * x.sp_l + q];
            const int local = it.x - ni * kBN;
            if (((local >> 1) & 3) != (int)(threadIdx.x & 3))
                continue;
            const int jt = local >> 3, e = local & 1;
            float val = 0.0f;
#pragma unroll
            for (int j = 0; j < kBN / 8; j++)
                if (j == jt)
                    val = e ? acc[4 * j + 2 * h + 1] : acc[4 * j + 2 * h];
            x.g[row * x.sp_l + it.y] = val;
        }
    }
}

/* Candidate epilogue (teacher-dump's top-k): every in-range logit at or above its row's threshold
 * is appended to the row's candidates (an atomic slot; past cap only counted), and a non-finite
 * logit records its row. */
__device__ __forceinline__ void store_cand(const float (&acc)[kAcc], const Params &p, const Fx &x, Frag f)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const long long row = f.row0 + 8 * h;
        if (row >= p.n)
            continue;
        const float t = x.thr[row];
#pragma unroll
        for (int j = 0; j < kBN / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = f.col0 + 8 * j + e;
                const float z = acc[4 * j + 2 * h + e];
                if (col >= p.v)
                    continue;
                if (z >= t) {
                    const unsigned slot = atomicAdd(&x.cnt[row], 1u);
                    if (slot < (unsigned)x.cap)
                        x.cand[row * x.cap + slot] = make_int2(__float_as_int(z), col);
                }
                if (!(fabsf(z) <= 3.402823466e38f)) /* inf or NaN */
                    atomicMin(&x.flags[1], (unsigned)row);
            }
    }
}

template <int kEpi>
__device__ __forceinline__ void logits_epilogue(float (&acc)[kAcc], const Params &p, const Fx &x, Frag f,
                                                int ni)
{
    if (kEpi & kEpiGather)
        gather_cols(acc, p, x, f, ni);
    if (kEpi & kEpiLogits)
        store_logits(acc, p, f);
    if (kEpi & kEpiExp)
        store_exp(acc, p, x, f);
    /* The statistics after the exp pass, fenced: left to interleave the two, the compiler needs
     * more than the 168 registers and spills (ptxas -v: 400 bytes); in this order, none. */
    if ((kEpi & kEpiStats) && (kEpi & kEpiExp))
        fence_regs(acc);
    if (kEpi & kEpiStats)
        store_stats(acc, p, f, ni);
    if (kEpi & kEpiCand)
        store_cand(acc, p, x, f);
}

/* A consumer warpgroup (cw = 0, 1): its tiles of this CTA, main loop then epilogue. Cooperative:

/* The logits GEMM with the epilogues kEpi (a combination of Epi bits). */
template <int kEpi>
struct Logits : LogitsLoads {
    __device__ static __forceinline__ void epilogue(float (&acc)[kAcc], const Params &p, const Fx &x, Frag f,
                                                    const Tile &tl)
    {
        logits_epilogue<kEpi>(acc, p, x, f, tl.ni);
    }
};

/* ---- host side ------------------------------------------------------------------------------------ */

tkd_status check_shape(const uint16_t *h, const uint16_t *w, int64_t n, int d, int v)
{
    if (!h || !w || n < 1 || n > INT32_MAX || v < 1 || d < 8)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: bad shape or pointer (N %lld, D %d, "
                             "V %d; h %p, w %p)", (long long)n, d, v, (const void *)h, (const void *)w);
    if (d % 8 != 0)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "lmhead_sm90: D %d is not a multiple of 8 (TMA "
                             "needs 16-byte row strides); use the cuBLAS path", d);
    if (((uintptr_t)h | (uintptr_t)w) % 16 != 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: h and w must be 16-byte aligned");
    return tkd_lmhead_sm90_supported();
}

/* Fills the shape part of the kernel parameters (M-tiles are the schedule's: set by launch). */
Params params_of(const tkd_lmhead_sm90_ws *ws, int64_t n, int d, int v)
{
    Params p = {};
    p.n = n;
    p.v = v;
    p.ktiles = (d + kBK - 1) / kBK;
    p.ntiles = tkd_lmhead_sm90_vtiles(v);
    p.err = ws->err;
    return p;
}

/* Launches problem P (Logits<kEpi>, or another with its parameters) on ws's schedule; p from
 * params_of plus the epilogues' fields. */
template <class P, bool kPP>
tkd_status launch_sched(const tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w, int d, Params p,
                        const Fx &fx)
{
    using S = Sched<kPP>;
    p.mtiles = (int)((p.n + S::kTileM - 1) / S::kTileM);
    p.tiles = (long long)p.mtiles * p.ntiles;
    CUtensorMap tm_h, tm_w;
    TKD_TRY(bf16_tmap(&tm_h, h, p.n, d, d, S::kTileM, "lmhead_sm90"));
    TKD_TRY(bf16_tmap(&tm_w, w, p.v, d, d, kBN, "lmhead_sm90"));
    return gemm_launch<P, kPP>(ws, tm_h, tm_w, p, fx);
}

template <class P>
tkd_status launch_problem(const tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w, int d,
                          const Params &p, const Fx &fx = Fx{})
{
    return ws->sched == TKD_LMHEAD_SM90_SCHED_COOP ? launch_sched<P, false>(ws, h, w, d, p, fx)
                                                   : launch_sched<P, true>(ws, h, w, d, p, fx);
}

template <int kEpi>
tkd_status launch(const tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w, int d, const Params &p,
                  const Fx &fx = Fx{})
{
    return launch_problem<Logits<kEpi>>(ws, h, w, d, p, fx);
}

} // namespace

#endif /* TKD_LMHEAD_SM90_LOGITS_CUH */
