/* lmhead_sm90.cu — see lmhead_sm90.h. Built for sm_90a only (kernels/CMakeLists.txt).
 *
 * The GEMM. Tiles of Z are BN = 256 columns wide, K in steps of 64 (BK: one 128-byte swizzle span
 * of bf16). A persistent grid (one CTA per SM) walks the tiles; each CTA has three warpgroups:
 *   warpgroup 0, the producer: one thread issues the TMA loads (cp.async.bulk.tensor) of the H tile
 *     (rows x 64) and the W tile (256 x 64) of each K step into a ring of shared-memory stages,
 *     each completing on that stage's `full` mbarrier (expect_tx of the stage's bytes);
 *   warpgroups 1 and 2, the consumers: each waits on `full`, issues four wgmma.m64n256k16 per K
 *     step (both operands from shared memory, 128-byte swizzle), keeps one K step of wgmma in
 *     flight, and releases a stage on its `empty` mbarrier (one arrival per consuming warp) once
 *     the wgmma that read it is done; after the last K step it runs the epilogue straight from the
 *     128 fp32 accumulators per thread.
 * Two schedules (tkd_lmhead_sm90_sched):
 *   cooperative: 128 x 256 tiles, 4 stages of 48 KB; both consumers work on every tile (64 rows
 *     each) and run its epilogue together, while the tensor cores wait.
 *   ping-pong: 64 x 256 tiles, 5 stages of 40 KB; the consumers own whole tiles in alternation
 *     (consumer 0 the CTA's tiles 0, 2, 4.., consumer 1 tiles 1, 3, 5..), so one runs its epilogue
 *     while the other's wgmma run. A pair of `turn` mbarriers orders their main loops: consumer c
 *     starts the main loop of its tile only after the other finished waiting on every stage of
 *     the tile before it. That keeps the tensor cores with one warpgroup at a time and, more
 *     importantly, keeps the ring's parity waits exact: a consumer that skips the other's K steps
 *     must never wait on a stage whose previous fill has not even landed (an mbarrier's parity
 *     tells only its last two phases apart).
 *     The price: each W tile is loaded per 64 rows instead of per 128 (320 instead of 192 loaded
 *     rows per 64 x 256 of output, from L2), so whether it wins is a measurement (kl_bench --lmhead
 *     times both).
 * setmaxnreg moves registers from the producer (40) to the consumers (232). Stage q of the ring
 * (q = the CTA's tile sequence number · K steps + K step) sits in slot q mod stages with phase
 * parity (q / stages) mod 2; producer and consumers derive it from the same tile sequence. Tiles are
 * visited in groups of 2048 rows of H swept along V, so a wave of CTAs shares its H rows and W rows
 * in L2.
 *
 * Shared memory per stage: A (rows x 128 B) then B (256 rows x 128 B), each 1024-byte aligned
 * as the 128-byte swizzle wants (the TMA writes the swizzled layout; the wgmma descriptors say
 * "128-byte swizzle, 8-row groups 1024 bytes apart"; the K step inside the span moves the start
 * address by 32 bytes). Out-of-range rows and K columns of a box are zero-filled by the TMA.
 *
 * Accumulator fragment of wgmma m64nNk16 (fp32): in warp w of a warpgroup, lane l holds rows
 * 16w + l/4 (+8) and columns 8j + 2(l%4) + e of the warpgroup's 64 x 256 block, register
 * 4j + 2h + e for row 16w + l/4 + 8h. So a row lives in the 4 lanes of a quad: quad shuffles
 * reduce it.
 */
#include "kernels/gemm_sm90/lmhead_sm90.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/gemm_sm90/lmhead_sm90_pipe.cuh"
#include "kernels/cuda/sm90_common.cuh"

namespace {

using namespace tkd_sm90;
using namespace tkd_lmhead;

/* Epilogue parts, a bit each, combined in one template argument. kEpiNone (benchmark only): no
 * epilogue, so its time is the main loop's. kEpiExp: E = exp(k·z − ref) as bf16 (the loss's
 * gradient tile up to a per-row factor); with kEpiStats both come from the same exps. kEpiGather:
 * the logits at a per-row list of columns (the teacher's top-k', tail draws, label). */
enum Epi {
    kEpiLogits = 1, kEpiStats = 2, kEpiNone = 4, kEpiExp = 8, kEpiGather = 16, kEpiCand = 32,
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
    float *sink;     /* no epilogue: always NULL, but the compiler cannot know, so the accumulators
                      * stay live to a store that never runs (an honest main-loop time) */
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

/* ---- the pipeline: ring stages, tile order ----------------------------------------------------- */

/* The producer thread: for every tile of this CTA and every K step, waits for a free stage and
 * loads the H box (rows mi·kTileM.., K kt·BK..) and the W box (rows ni·BN..) into it. */
template <class S>
__device__ __forceinline__ void produce(const CUtensorMap *tm_h, const CUtensorMap *tm_w, const Params &p,
                                        uint32_t base)
{
    Ring<S::kStages> r;
    for (long long t = blockIdx.x; t < p.tiles; t += gridDim.x) {
        int mi, ni;
        tile_coords(t, p.mtiles, p.ntiles, S::kGroupM, mi, ni);
        for (int kt = 0; kt < p.ktiles; kt++) {
            mbar_wait(empty_bar<S>(base, r.stage), r.phase ^ 1u, r.failed, p.err);
            const uint32_t full = full_bar<S>(base, r.stage);
            mbar_arrive_expect_tx(full, S::kStageBytes); /* zero-filled bytes count too */
            tma_load_2d(stage_a<S>(base, r.stage), tm_h, kt * kBK, mi * S::kTileM, full);
            tma_load_2d(stage_b<S>(base, r.stage), tm_w, kt * kBK, ni * kBN, full);
            r.next();
        }
    }
}

/* One consumer warpgroup (cw = 0, 1) over all K steps of a tile: acc (64 x 256) = rows
 * a_row.. (of the stage's A tile) · W_tileᵀ. One K step of wgmma stays in flight; a stage is
 * released (one arrival per warp) once the wgmma that read it has completed. Ping-pong: once
 * every stage of the tile has been waited for, the other consumer gets its turn. */
template <class S>
__device__ __forceinline__ void mma_tile(float (&acc)[kAcc], const Params &p, uint32_t base, int cw,
                                         int a_row, Ring<S::kStages> &r)
{
    int prev = -1;
    for (int kt = 0; kt < p.ktiles; kt++) {
        mbar_wait(full_bar<S>(base, r.stage), r.phase, r.failed, p.err);
        __syncwarp(); /* lanes may leave the wait's loop apart; wgmma wants the warp converged */
        const uint64_t da = smem_desc(stage_a<S>(base, r.stage) + a_row * 128);
        const uint64_t db = smem_desc(stage_b<S>(base, r.stage));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; kk++) /* 16 K = 32 bytes = 2 descriptor units */
            wgmma_ss_n256(acc, da + 2 * kk, db + 2 * kk, kt > 0 || kk > 0);
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

/* ---- epilogues --------------------------------------------------------------------------------- */

/* Logits epilogue: the fragment to z (n, ldz), in-range elements only (ldz even: float2 stores). */
__device__ __forceinline__ void store_logits(const float (&acc)[kAcc], const Params &p, Frag f)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const long long row = f.row0 + 8 * h;
        if (row >= p.n)
            continue;
        float *zr = p.z + row * p.ldz;
#pragma unroll
        for (int j = 0; j < kBN / 8; j++) {
            const int col = f.col0 + 8 * j;
            if (col + 1 < p.v)
                *reinterpret_cast<float2 *>(zr + col) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            else if (col < p.v)
                zr[col] = acc[4 * j + 2 * h];
        }
    }
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

/* No epilogue (benchmark): the accumulators go to a store guarded by p.sink, which is NULL at
 * run time; the compiler must keep every wgmma result, so the main loop is timed as it runs. */
__device__ __forceinline__ void sink_acc(const float (&acc)[kAcc], const Params &p)
{
    if (p.sink) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < kAcc; i++)
            s += acc[i];
        p.sink[threadIdx.x] = s;
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
__device__ __forceinline__ void epilogue(float (&acc)[kAcc], const Params &p, const Fx &x, Frag f,
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
    if (kEpi & kEpiNone)
        sink_acc(acc, p);
}

/* A consumer warpgroup (cw = 0, 1): its tiles of this CTA, main loop then epilogue. Cooperative:
 * every tile of the CTA, rows 64·cw.. of each. Ping-pong: the CTA's tiles cw, cw + 2, .. whole,
 * each main loop after the other consumer's turn (its previous tile's stages all waited for). */
template <int kEpi, class S>
__device__ __forceinline__ void consume(const Params &p, const Fx &x, uint32_t base, int cw)
{
    float acc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; i++)
        acc[i] = 0.0f; /* the first wgmma of a tile overwrites; this only keeps them defined */
    Ring<S::kStages> r;
    const int a_row = S::kPP ? 0 : 64 * cw;
    for (long long j = S::kPP ? cw : 0, mine = 0;; j += S::kPP ? 2 : 1, mine++) {
        const long long t = blockIdx.x + j * gridDim.x; /* the CTA's j-th tile */
        if (t >= p.tiles)
            break;
        int mi, ni;
        tile_coords(t, p.mtiles, p.ntiles, S::kGroupM, mi, ni);
        ring_seek<S>(r, j * p.ktiles);
        /* consumer 1's tile i follows consumer 0's tile i; consumer 0's tile i follows 1's i − 1 */
        if (S::kPP && (cw == 1 || mine > 0))
            mbar_wait(turn_bar<S>(base, cw), (uint32_t)((cw == 1 ? mine : mine - 1) & 1), r.failed, p.err);
        mma_tile<S>(acc, p, base, cw, a_row, r);
        epilogue<kEpi>(acc, p, x, frag_of<S>(mi, ni, a_row), ni);
    }
}

/* The persistent GEMM: Z = H Wᵀ tile by tile, schedule S, epilogue kEpi. tm_h: (n, D) bf16 boxes
 * 64 x kTileM, tm_w: (v, D) bf16 boxes 64 x 256, both 128-byte swizzled. 384 threads,
 * S::kSmemBytes dynamic. */
template <int kEpi, bool kPP>
__global__ void __launch_bounds__(kThreads, 1)
lmhead_kernel(const __grid_constant__ CUtensorMap tm_h, const __grid_constant__ CUtensorMap tm_w,
              const Params p, const __grid_constant__ Fx fx)
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
            produce<S>(&tm_h, &tm_w, p, base);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        consume<kEpi, S>(p, fx, base, threadIdx.x / 128 - 1);
    }
}

/* lse1, lset (n) from part (3, n, T): per row M = max m_t, lse1 = M + log Σ s1_t e^(m_t − M),
 * lset = M/τ + log Σ st_t e^((m_t − M)/τ). One warp per row. */
__global__ void lse_combine_kernel(const float *part, long long n, int T, float inv_tau,
                                   float *lse1, float *lset)
{
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= n)
        return;
    const int lane = threadIdx.x & 31;
    const size_t plane = (size_t)n * T;
    const float *pm = part + (size_t)row * T, *p1 = pm + plane, *pt = pm + 2 * plane;
    float m = -INFINITY;
    for (int t = lane; t < T; t += 32)
        m = fmaxf(m, pm[t]);
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s1 = 0.0f, st = 0.0f;
    for (int t = lane; t < T; t += 32) {
        const float dm = pm[t] - m;
        s1 += p1[t] * expf(dm);
        st += pt[t] * expf(dm * inv_tau);
    }
    for (int o = 16; o > 0; o >>= 1) {
        s1 += __shfl_xor_sync(0xffffffffu, s1, o);
        st += __shfl_xor_sync(0xffffffffu, st, o);
    }
    if (lane == 0) {
        lse1[row] = m + logf(s1);
        lset[row] = m * inv_tau + logf(st);
    }
}

/* The k-th largest tile maximum of each row (plane m of part (3, n, T)): at least k logits of the
 * row are at or above it, so its top k are. -inf when T < k. One warp per row. */
__global__ void topk_thr_kernel(const float *part, long long n, int T, int k, float *thr)
{
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= n)
        return;
    const int lane = threadIdx.x & 31;
    const float *m = part + (size_t)row * T;
    float best = -INFINITY;
    for (int i = lane; i < T && T >= k; i += 32) {
        const float x = m[i];
        int c = 0;
        for (int j = 0; j < T; j++)
            c += m[j] >= x;
        if (c >= k)
            best = fmaxf(best, x);
    }
    for (int o = 16; o > 0; o >>= 1)
        best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, o));
    if (lane == 0)
        thr[row] = best;
}

/* Ascending order of (logit descending, column ascending) as one 64-bit key. */
__device__ inline unsigned long long cand_key(int2 c)
{
    const unsigned u = (unsigned)c.x, ord = u ^ ((u >> 31) ? 0xffffffffu : 0x80000000u);
    return ((unsigned long long)(~ord) << 32) | (unsigned)c.y;
}

__device__ inline float key_logit(unsigned long long key)
{
    const unsigned ord = ~(unsigned)(key >> 32);
    return __uint_as_float(ord ^ ((ord >> 31) ? 0x80000000u : 0xffffffffu));
}

/* One block per row: the row's candidates sorted (bitonic, in shared memory: a power of two ≥
 * their count, at most cap) and the first k written out as (id, logit), ties by the smaller id
 * (kernels/cpu/topk.h's order). A row with more than cap candidates counts in flags[0] and writes
 * nothing (the caller runs the logits path instead). */
__global__ void topk_select_kernel(const int2 *cand, const unsigned *cnt, int cap, long long n, int k,
                                   uint32_t *idx, float *val, unsigned *flags)
{
    extern __shared__ unsigned long long keys[];
    const long long row = blockIdx.x;
    const unsigned c = cnt[row];
    if (c > (unsigned)cap || c < (unsigned)k) { /* too many to sort here; too few: NaN maxima */
        if (threadIdx.x == 0)
            atomicAdd(&flags[0], 1u);
        return;
    }
    int m = 1;
    while (m < (int)c)
        m <<= 1;
    for (int i = threadIdx.x; i < m; i += blockDim.x)
        keys[i] = i < (int)c ? cand_key(cand[row * cap + i]) : ~0ull;
    __syncthreads();
    for (int size = 2; size <= m; size <<= 1)
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < m; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool up = (i & size) == 0;
                    const unsigned long long a = keys[i], b = keys[j];
                    if ((a > b) == up) {
                        keys[i] = b;
                        keys[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        const unsigned long long key = i < (int)c ? keys[i] : ~0ull;
        idx[row * k + i] = (uint32_t)(key & 0xffffffffu);
        val[row * k + i] = i < (int)c ? key_logit(key) : -INFINITY;
    }
}

/* ---- host side ----------------------------------------------------------------------------------- */

/* Tensor map of a row-major (rows, d) bf16 matrix, boxes of 64 columns x box_rows rows, 128-byte
 * swizzle, zero fill out of range. */
tkd_status make_tmap(CUtensorMap *tm, const uint16_t *ptr, long long rows, int d, int box_rows)
{
    const cuuint64_t dims[2] = {(cuuint64_t)d, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)d * 2};
    return tkd_sm90::make_tmap(tm, ptr, 2, dims, strides, box_rows, "lmhead_sm90");
}

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
Params params_of(tkd_lmhead_sm90_ws *ws, int64_t n, int d, int v)
{
    Params p = {};
    p.n = n;
    p.v = v;
    p.ktiles = (d + kBK - 1) / kBK;
    p.ntiles = tkd_lmhead_sm90_vtiles(v);
    p.err = ws->err;
    return p;
}

template <int kEpi, bool kPP>
tkd_status launch_sched(tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w, int d, Params p,
                        const Fx &fx)
{
    using S = Sched<kPP>;
    p.mtiles = (int)((p.n + S::kTileM - 1) / S::kTileM);
    p.tiles = (long long)p.mtiles * p.ntiles;
    CUtensorMap tm_h, tm_w;
    TKD_TRY(make_tmap(&tm_h, h, p.n, d, S::kTileM));
    TKD_TRY(make_tmap(&tm_w, w, p.v, d, kBN));
    int dev = 0, sms = 0;
    TKD_CUDA_CHECK(cudaGetDevice(&dev));
    TKD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    long long grid = ws->max_ctas > 0 && ws->max_ctas < sms ? ws->max_ctas : sms;
    if (grid > p.tiles)
        grid = p.tiles;
    TKD_CUDA_CHECK(cudaFuncSetAttribute(lmhead_kernel<kEpi, kPP>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)S::kSmemBytes));
    lmhead_kernel<kEpi, kPP><<<(unsigned)grid, kThreads, S::kSmemBytes, ws->stream>>>(tm_h, tm_w, p, fx);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

template <int kEpi>
tkd_status launch(tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w, int d, const Params &p,
                  const Fx &fx = Fx{})
{
    return ws->sched == TKD_LMHEAD_SM90_SCHED_COOP ? launch_sched<kEpi, false>(ws, h, w, d, p, fx)
                                                   : launch_sched<kEpi, true>(ws, h, w, d, p, fx);
}

tkd_status check_z(const float *z, int v, int64_t ldz)
{
    if (!z || ldz < v || ldz % 2 != 0 || (uintptr_t)z % 8 != 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: z needs ldz >= V (%d), ldz even "
                             "(got %lld) and 8-byte alignment", v, (long long)ldz);
    return TKD_OK;
}

/* The statistics epilogue's part of p: partials (3, n, tiles) and τ. */
tkd_status set_stats(Params &p, float *part, float tau)
{
    if (!part || !(tau > 0.0f) || !isfinite(tau))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: stats need part and a finite "
                             "τ > 0 (got %g)", (double)tau);
    p.part = part;
    p.l2e_tau = kLog2e / tau;
    p.tau_mode = tau == 1.0f ? 1 : tau == 2.0f ? 2 : 0;
    return TKD_OK;
}

/* The fused epilogues' arguments into p; which parts run follows from what is set. */
tkd_status set_fused(Params &p, Fx &x, const tkd_lmhead_sm90_fused *f, int &epi)
{
    epi = 0;
    if (f->part) {
        TKD_TRY(set_stats(p, f->part, f->tau));
        epi |= kEpiStats;
    }
    if (f->e) {
        if (f->lde < p.v || f->lde % 2 != 0 || (uintptr_t)f->e % 4 != 0 || !f->ref ||
            !(f->tau > 0.0f) || !isfinite(f->tau))
            return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: exp epilogue needs lde >= V "
                                 "(%d) and even (got %lld), e 4-byte aligned, ref and τ > 0", p.v,
                                 (long long)f->lde);
        x.e = reinterpret_cast<__nv_bfloat16 *>(f->e);
        x.lde = f->lde;
        x.ref = f->ref;
        x.ref_scale = f->ref_scale;
        x.l2e_k = f->k_one ? kLog2e : kLog2e / f->tau;
        epi |= kEpiExp;
    }
    if (f->sp_off) {
        if (!f->sp_list || !f->g || f->sp_l < 1)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: gather needs sp_list, g and "
                                 "sp_l >= 1 (got %d)", f->sp_l);
        x.sp_off = f->sp_off;
        x.sp_list = reinterpret_cast<const int2 *>(f->sp_list);
        x.sp_l = f->sp_l;
        x.g = f->g;
        epi |= kEpiGather;
    }
    return TKD_OK;
}

} // namespace

extern "C" tkd_status tkd_lmhead_sm90_supported(void)
{
    tkd_status st = check_cc90("lmhead_sm90");
    return st == TKD_ERR_UNSUPPORTED ? tkd_error_hint(st, "use the cuBLAS path") : st;
}

extern "C" tkd_status tkd_lmhead_sm90_ws_create(tkd_lmhead_sm90_ws **out, int sched)
{
    *out = NULL;
    TKD_TRY(tkd_lmhead_sm90_supported());
    tkd_lmhead_sm90_ws *ws = (tkd_lmhead_sm90_ws *)calloc(1, sizeof *ws);
    if (!ws)
        return tkd_error_set(TKD_ERR_NOMEM, "lmhead_sm90: workspace");
    ws->sched = sched == TKD_LMHEAD_SM90_SCHED_COOP ? TKD_LMHEAD_SM90_SCHED_COOP : TKD_LMHEAD_SM90_SCHED_PINGPONG;
    tkd_status st = tkd_cuda_malloc((void **)&ws->err, sizeof *ws->err, "lmhead_sm90: error flag", NULL);
    if (st == TKD_OK)
        st = tkd_cuda_memzero(ws->err, sizeof *ws->err);
    if (st != TKD_OK) {
        tkd_lmhead_sm90_ws_free(ws);
        return st;
    }
    *out = ws;
    return TKD_OK;
}

extern "C" void tkd_lmhead_sm90_ws_free(tkd_lmhead_sm90_ws *ws)
{
    if (!ws)
        return;
    tkd_cuda_free(ws->err);
    free(ws);
}

extern "C" void tkd_lmhead_sm90_ws_set_max_ctas(tkd_lmhead_sm90_ws *ws, int max_ctas)
{
    ws->max_ctas = max_ctas > 0 ? max_ctas : 0;
}

extern "C" void tkd_lmhead_sm90_ws_set_schedule(tkd_lmhead_sm90_ws *ws, tkd_lmhead_sm90_sched sched)
{
    ws->sched = sched == TKD_LMHEAD_SM90_SCHED_COOP ? TKD_LMHEAD_SM90_SCHED_COOP
                                                    : TKD_LMHEAD_SM90_SCHED_PINGPONG;
}

extern "C" int tkd_lmhead_sm90_vtiles(int v) { return (v + kBN - 1) / kBN; }

extern "C" size_t tkd_lmhead_sm90_part_floats(int64_t n, int v)
{
    return 3 * (size_t)n * (size_t)tkd_lmhead_sm90_vtiles(v);
}

extern "C" tkd_status tkd_lmhead_sm90_logits(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                             const uint16_t *w, int64_t n, int d, int v, float *z,
                                             int64_t ldz)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    TKD_TRY(check_z(z, v, ldz));
    Params p = params_of(ws, n, d, v);
    p.z = z;
    p.ldz = ldz;
    return launch<kEpiLogits>(ws, h, w, d, p);
}

extern "C" tkd_status tkd_lmhead_sm90_stats(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                            const uint16_t *w, int64_t n, int d, int v, float tau,
                                            float *part)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    Params p = params_of(ws, n, d, v);
    TKD_TRY(set_stats(p, part, tau));
    return launch<kEpiStats>(ws, h, w, d, p);
}

extern "C" tkd_status tkd_lmhead_sm90_logits_stats(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                                   const uint16_t *w, int64_t n, int d, int v,
                                                   float tau, float *z, int64_t ldz, float *part)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    TKD_TRY(check_z(z, v, ldz));
    Params p = params_of(ws, n, d, v);
    TKD_TRY(set_stats(p, part, tau));
    p.z = z;
    p.ldz = ldz;
    return launch<kEpiLogitsStats>(ws, h, w, d, p);
}

extern "C" float tkd_lmhead_sm90_exp_scale(float tau, int k_one)
{
    return k_one ? kLog2e : kLog2e / tau;
}

extern "C" tkd_status tkd_lmhead_sm90_fused_run(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                                const uint16_t *w, int64_t n, int d, int v,
                                                const tkd_lmhead_sm90_fused *f)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    Params p = params_of(ws, n, d, v);
    Fx x = {};
    int epi = 0;
    TKD_TRY(set_fused(p, x, f, epi));
    switch (epi) { /* the combinations the loss runs, each one kernel */
    case kEpiStats | kEpiGather: return launch<kEpiStats | kEpiGather>(ws, h, w, d, p, x);
    case kEpiExp | kEpiGather: return launch<kEpiExp | kEpiGather>(ws, h, w, d, p, x);
    case kEpiStats | kEpiExp | kEpiGather:
        return launch<kEpiStats | kEpiExp | kEpiGather>(ws, h, w, d, p, x);
    default:
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "lmhead_sm90: fused epilogue 0x%x: only "
                             "statistics + gather, exp + gather, and all three are built", epi);
    }
}

extern "C" tkd_status tkd_lmhead_sm90_mainloop(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                               const uint16_t *w, int64_t n, int d, int v)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    return launch<kEpiNone>(ws, h, w, d, params_of(ws, n, d, v));
}

static tkd_status launch_lse(const float *part, int64_t n, int v, float tau, float *lse1, float *lset,
                             cudaStream_t stream)
{
    if (!part || !lse1 || !lset || n < 1 || v < 1 || !(tau > 0.0f) || !isfinite(tau))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: lse: bad arguments (N %lld, V %d, "
                             "τ %g)", (long long)n, v, (double)tau);
    constexpr int kRowsPerBlock = 8; /* one warp per row */
    const long long blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
    lse_combine_kernel<<<(unsigned)blocks, 32 * kRowsPerBlock, 0, stream>>>(
        part, n, tkd_lmhead_sm90_vtiles(v), 1.0f / tau, lse1, lset);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

extern "C" tkd_status tkd_lmhead_sm90_lse(const float *part, int64_t n, int v, float tau,
                                          float *lse1, float *lset)
{
    return launch_lse(part, n, v, tau, lse1, lset, 0);
}

extern "C" void tkd_lmhead_sm90_ws_set_stream(tkd_lmhead_sm90_ws *ws, void *stream)
{
    ws->stream = static_cast<cudaStream_t>(stream);
}

extern "C" size_t tkd_lmhead_sm90_topk_bytes(int64_t n, int v, int cap)
{
    return tkd_lmhead_sm90_part_floats(n, v) * 4 + (size_t)n * (3 * 4 + (size_t)cap * 8) + 2 * 4 + 64;
}

extern "C" tkd_status tkd_lmhead_sm90_topk(tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w,
                                           int64_t n, int d, int v, int k, float tau, int cap,
                                           void *scratch, unsigned *flags, uint32_t *idx,
                                           float *val, float *lse)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    if (k < 1 || k > v || cap < k || cap > TKD_LMHEAD_SM90_TOPK_MAX_CAP || !scratch || !flags ||
        !idx || !val || !lse)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: topk: k %d (V %d), cap %d (k..%d) "
                             "or a NULL buffer", k, v, cap, TKD_LMHEAD_SM90_TOPK_MAX_CAP);
    /* scratch: part (3, n, T), then thr, lse1, cnt (n each), then cand (n, cap) 8-byte aligned */
    float *part = static_cast<float *>(scratch);
    float *thr = part + tkd_lmhead_sm90_part_floats(n, v), *lse1 = thr + n;
    unsigned *cnt = reinterpret_cast<unsigned *>(lse1 + n);
    int2 *cand = reinterpret_cast<int2 *>(((uintptr_t)(cnt + n) + 7) & ~(uintptr_t)7);
    const cudaStream_t st = ws->stream;
    TKD_CUDA_CHECK(cudaMemsetAsync(cnt, 0, (size_t)n * 4, st));
    Params p = params_of(ws, n, d, v);
    TKD_TRY(set_stats(p, part, tau));
    TKD_TRY(launch<kEpiStats>(ws, h, w, d, p));
    TKD_TRY(launch_lse(part, n, v, tau, lse1, lse, st));
    const long long blocks = (n + 7) / 8;
    topk_thr_kernel<<<(unsigned)blocks, 256, 0, st>>>(part, n, tkd_lmhead_sm90_vtiles(v), k, thr);
    TKD_CUDA_CHECK(cudaGetLastError());
    Fx x = {};
    x.thr = thr, x.cnt = cnt, x.cand = cand, x.cap = cap, x.flags = flags;
    TKD_TRY(launch<kEpiCand>(ws, h, w, d, params_of(ws, n, d, v), x));
    int m = 1;
    while (m < cap)
        m <<= 1;
    const size_t smem = (size_t)m * 8;
    if (smem > 48 * 1024)
        TKD_CUDA_CHECK(cudaFuncSetAttribute(topk_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem));
    topk_select_kernel<<<(unsigned)n, 256, smem, st>>>(cand, cnt, cap, n, k, idx, val, flags);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

extern "C" tkd_status tkd_lmhead_sm90_sync(tkd_lmhead_sm90_ws *ws)
{
    return check_wait_flag(ws->err, "lmhead_sm90");
}
