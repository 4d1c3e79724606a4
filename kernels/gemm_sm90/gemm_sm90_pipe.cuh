/* gemm_sm90_pipe.cuh — the one Hopper GEMM driver: the persistent producer/consumer pipeline that
 * every GEMM of gemm_sm90/ runs (the logits GEMM with its loss and top-k epilogues,
 * lmhead_sm90_logits.cuh; the gradient GEMMs dH and dW, lmhead_grad_sm90.cu; the benchmark's
 * main loop, lmhead_sm90_tuning.cu). It holds the workspace, tile sizes, the two schedules' ring
 * geometry, the mbarriers, the tile order, where an accumulator fragment sits, and the pipeline
 * itself (producer, consumer main loop, consumer tile loop, kernel, launch), written once; a GEMM
 * supplies only its problem: how a tile's operands are loaded, how one K step's wgmma read them,
 * and its epilogue (the contract is at "the driver" below), and optionally what Traits adds (extra
 * stage bytes, a warp-wide load, B written by the consumers: the MXFP4 MoE GEMMs). lmhead_sm90.cu's
 * header comment describes the pipeline. Internal to gemm_sm90/ (built for sm_90a alone).
 */
#ifndef TKD_GEMM_SM90_PIPE_CUH
#define TKD_GEMM_SM90_PIPE_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_common.cuh"
#include "kernels/gemm_sm90/lmhead_sm90.h"

struct tkd_lmhead_sm90_ws {
    unsigned *err; /* device: non-zero after a pipeline wait timed out */
    int max_ctas;  /* 0: one CTA per SM */
    tkd_lmhead_sm90_sched sched;
    cudaStream_t stream; /* of every launch; 0 (the legacy stream) unless set */
    int grad_sched;      /* gradient GEMMs: 0 the default (cooperative), 1 + a schedule: that one */
};

namespace tkd_lmhead {

using tkd_sm90::Ring;

constexpr int kBN = TKD_LMHEAD_SM90_BN, kBK = 64;
constexpr int kConsumers = 2;                 /* consumer warpgroups */
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kAcc = kBN / 2;                 /* fp32 accumulators per consumer thread (64 x 256) */
constexpr int kGroupRows = 2048;              /* rows of H whose tiles are swept together along V */
constexpr uint32_t kBytesB = kBN * kBK * 2;
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kBK * 2 == 128, "a K step is one 128-byte swizzle span");

/* What a problem may add to the pipeline; a problem that declares none of it (every one but
 * moe_gemm_sm90's MXFP4 GEMMs) gets the defaults, nothing:
 *   kExtraBytes  shared memory a stage holds for the problem's load (a multiple of 1024);
 *   kWarpLoad    its load runs on every lane of the producer warp, each lane adding one arrival on
 *                the stage's full mbarrier (cp.async's mbarrier arrive) besides lane 0's expect_tx;
 *                else on lane 0 alone;
 *   kTransform   the consumers write B themselves from what the load put in the stage (e.g.
 *                decoding packed weights): a stage then holds A and the extra bytes but no B, and B
 *                lives in kBBufs buffers of its own, written one K step ahead of the wgmma that
 *                reads it (mma_tile). Cooperative schedule only. */
template <class P, class = void>
struct Traits {
    static constexpr uint32_t kExtraBytes = 0;
    static constexpr bool kWarpLoad = false, kTransform = false;
};
template <class P>
struct Traits<P, std::void_t<decltype(P::kTransform)>> {
    static constexpr uint32_t kExtraBytes = P::kExtraBytes;
    static constexpr bool kWarpLoad = P::kWarpLoad, kTransform = P::kTransform;
};
/* a transform's B buffers: step q's is written while step q − 1's wgmma runs, read by step q's, and
 * written again for step q + 3 */
constexpr int kBBufs = 3;
constexpr int kBarTransform = 1; /* the named barrier of the two consumer warpgroups (0 is __syncthreads) */

/* What a schedule fixes (lmhead_sm90.cu's header): tile rows, ring depth, shared memory, the
 * arrivals that free a stage (one per consuming warp). kExtra: the problem's kExtraBytes a stage;
 * the ring then has as many stages as fit, up to the schedule's own depth. */
template <bool kPingPong, uint32_t kExtra = 0, bool kXform = false>
struct Sched {
    static constexpr bool kPP = kPingPong;
    static constexpr int kTileM = kPP ? 64 : TKD_LMHEAD_SM90_BM;
    static constexpr uint32_t kBytesA = kTileM * kBK * 2;
    /* 40 KB resp. 48 KB plain; a transform's stage holds no B */
    static constexpr uint32_t kStageBytes = kBytesA + (kXform ? 0 : kBytesB) + kExtra;
    static constexpr uint32_t kBBufBytes = kXform ? kBBufs * kBytesB : 0;
    static constexpr int kDepth = kXform ? 8 : kPP ? 5 : 4;
    static constexpr int kFit = (int)((227 * 1024 - 1024 - kBBufBytes - 8 * (2 * kDepth + 2)) / kStageBytes);
    static constexpr int kStages = kFit < kDepth ? kFit : kDepth;
    /* the stages, a transform's B buffers, then the full, empty and (ping-pong) turn mbarriers */
    static constexpr size_t kSmemBytes = 1024 + (size_t)kStages * kStageBytes + kBBufBytes + (2 * kStages + 2) * 8;
    static constexpr int kGroupM = kGroupRows / kTileM;
    static constexpr unsigned kEmptyArrivals = kPP ? 4 : 4 * kConsumers;
    static_assert(kBytesA % 1024 == 0 && kStageBytes % 1024 == 0, "swizzled tiles need 1024-byte alignment");
    static_assert(!(kXform && kPP), "a transform runs on the cooperative schedule");
    static_assert(kStages >= 2 && kSmemBytes <= 227 * 1024,
                  "the ring must fit the 227 KB of shared memory a CTA may have");
};
using Coop = Sched<false>;
using PingPong = Sched<true>;

/* Shared memory from `base` (1024-aligned): the stages, a transform's B buffers, then the full,
 * empty and turn mbarriers. */
template <class S> __device__ inline uint32_t stage_a(uint32_t base, int s) { return base + s * S::kStageBytes; }
template <class S> __device__ inline uint32_t stage_b(uint32_t base, int s) { return stage_a<S>(base, s) + S::kBytesA; }
/* A transform's B buffer j (in the plain layout: where the stage's B would be). */
template <class S> __device__ inline uint32_t b_buf(uint32_t base, int j) { return base + S::kStages * S::kStageBytes + j * kBytesB; }
template <class S> __device__ inline uint32_t full_bar(uint32_t base, int s) { return base + S::kStages * S::kStageBytes + S::kBBufBytes + 8 * s; }
template <class S> __device__ inline uint32_t empty_bar(uint32_t base, int s) { return full_bar<S>(base, S::kStages + s); }
/* Ping-pong: consumer c may start its next main loop once turn_bar(c) completed a phase. */
template <class S> __device__ inline uint32_t turn_bar(uint32_t base, int c) { return full_bar<S>(base, 2 * S::kStages + c); }

/* Thread 0 initialises the ring's mbarriers; the caller then __syncthreads(). */
template <class P, class S>
__device__ inline void init_bars(uint32_t base)
{
    for (int s = 0; s < S::kStages; s++) {
        /* the producer's expect_tx, and with a warp-wide load one arrival per lane */
        tkd_sm90::mbar_init(full_bar<S>(base, s), Traits<P>::kWarpLoad ? 33 : 1);
        tkd_sm90::mbar_init(empty_bar<S>(base, s), S::kEmptyArrivals); /* one arrival per consuming warp */
    }
    for (int c = 0; c < kConsumers; c++)
        tkd_sm90::mbar_init(turn_bar<S>(base, c), 1); /* one thread of the other consumer */
    tkd_sm90::mbar_init_fence();
}

/* Moves ring r to position q (slot q mod stages, phase parity (q / stages) mod 2). */
template <class S>
__device__ inline void ring_seek(Ring<S::kStages> &r, long long q)
{
    r.stage = (int)(q % S::kStages);
    r.phase = (uint32_t)((q / S::kStages) & 1);
}

/* Tile t's (M-tile, N-tile): groups of group_m M-tiles (fewer in the last group), each group
 * swept along N with its M-tiles innermost (group_m 1: N innermost). */
__device__ inline void tile_coords(long long t, int mtiles, int ntiles, int group_m, int &mi, int &ni)
{
    const long long per_group = (long long)group_m * ntiles;
    const int g = (int)(t / per_group);
    const int first = g * group_m;
    const int gm = min(group_m, mtiles - first);
    const long long r = t - g * per_group;
    mi = first + (int)(r % gm);
    ni = (int)(r / gm);
}

/* Where this thread's accumulators sit in the output: rows row0 + 8h (h = 0, 1), columns
 * col0 + 8j + e (j < 32, e = 0, 1) hold acc[4j + 2h + e]. */
struct Frag {
    long long row0;
    int col0;
};

/* a_row: the warpgroup's first row within the tile (cooperative: 64·cw; ping-pong: 0). */
template <class S>
__device__ inline Frag frag_of(int mi, int ni, int a_row)
{
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    return {(long long)mi * S::kTileM + a_row + warp * 16 + lane / 4, ni * kBN + 2 * (lane & 3)};
}

/* ---- the driver ---------------------------------------------------------------------------------
 * A GEMM is a problem class P with:
 *   P::Params   the kernel's parameters, by value; members tiles (long long), ktiles (int), err;
 *   P::Extra    a second parameter (__grid_constant__) for arguments only some epilogues read, so
 *               the others keep Params small (a larger Params costs them spills);
 *   P::Tile     what the producer and consumers need to know of one output tile: mi, ni (its M-
 *               and N-tile) and bytes (what one stage of it loads, zero-filled bytes included);
 *   template <class S> static Tile tile(const Params &, long long t): the CTA-independent tile t;
 *   template <class S> static void load(tm_a, tm_b, p, x, tile, a, b, full, kt): the TMA loads of K
 *               step kt into a stage (A at shared address a, B at b), completing on `full` (x for
 *               a problem with more operands than two, e.g. a second tensor map);
 *   static void mma(acc, a, b, bool first): one K step's four wgmma m64n256k16 reading the
 *               warpgroup's 64 rows of A at a and B at b, overwriting acc when first;
 *   static void epilogue(acc, p, x, Frag, tile): the tile's output from the 128 accumulators;
 * and, with Traits' kTransform (above),
 *   template <class S> static void transform(p, x, tile, e, b, kt, d): consumer thread d's (< 256)
 *               share of writing K step kt's B at shared address b (the plain layout) from what
 *               load put at e (the stage's kExtraBytes), the stage full.
 * A stage's operands are at a (A) and b (B; a transform's stage has none: its extra bytes are at b). */

/* The producer thread: for every tile of this CTA and every K step, waits for a free stage and
 * has P load it. */
template <class P, class S>
__device__ __forceinline__ void produce(const CUtensorMap *tm_a, const CUtensorMap *tm_b,
                                        const typename P::Params &p, const typename P::Extra &x, uint32_t base)
{
    Ring<S::kStages> r;
    for (long long t = blockIdx.x; t < p.tiles; t += gridDim.x) {
        const typename P::Tile tl = P::template tile<S>(p, t);
        for (int kt = 0; kt < p.ktiles; kt++) {
            tkd_sm90::mbar_wait(empty_bar<S>(base, r.stage), r.phase ^ 1u, r.failed, p.err);
            const uint32_t full = full_bar<S>(base, r.stage);
            if (threadIdx.x == 0) /* a warp-wide load: its lanes' arrivals come from their copies */
                tkd_sm90::mbar_arrive_expect_tx(full, tl.bytes); /* zero-filled bytes count too */
            P::template load<S>(tm_a, tm_b, p, x, tl, stage_a<S>(base, r.stage), stage_b<S>(base, r.stage), full, kt);
            r.next();
        }
    }
}

/* Both consumers' B for ring position q (the stage r points at, full once waited for): each thread
 * its share (P::transform), the writes made visible to wgmma (the async proxy), then both warpgroups
 * meet, so B is whole before either reads it. */
template <class P, class S>
__device__ __forceinline__ void transform_b(const typename P::Params &p, const typename P::Extra &x,
                                            const typename P::Tile &tl, uint32_t base, Ring<S::kStages> &r,
                                            long long q, int kt)
{
    tkd_sm90::mbar_wait(full_bar<S>(base, r.stage), r.phase, r.failed, p.err);
    P::template transform<S>(p, x, tl, stage_a<S>(base, r.stage) + S::kBytesA, b_buf<S>(base, (int)(q % kBBufs)), kt,
                             (int)threadIdx.x - 128);
    tkd_sm90::fence_async_shared();
    asm volatile("bar.sync %0, 256;" ::"n"(kBarTransform) : "memory");
}

/* One consumer warpgroup (cw = 0, 1) over all K steps of a tile: acc (64 x 256) = rows a_row.. of
 * the stage's A tile · B_tileᵀ. One K step of wgmma stays in flight; a stage is released (one
 * arrival per warp) once the wgmma that read it has completed. Ping-pong: once every stage of the
 * tile has been waited for, the other consumer gets its turn.
 * A transform problem (cooperative) reads B from buffer (q0 + kt) mod kBBufs (q0 the tile's first
 * ring position), written by both warpgroups while step kt − 1's wgmma runs. That buffer was last
 * read by step kt − 3's wgmma, which both had waited for (wgmma_wait<1> after issuing step kt − 2)
 * before they met after writing step kt − 1's B. */
template <class P, class S>
__device__ __forceinline__ void mma_tile(float (&acc)[kAcc], const typename P::Params &p, const typename P::Extra &x,
                                         const typename P::Tile &tl, uint32_t base, int cw, int a_row,
                                         Ring<S::kStages> &r, long long q0)
{
    constexpr bool kXform = Traits<P>::kTransform;
    if constexpr (kXform)
        transform_b<P, S>(p, x, tl, base, r, q0, 0);
    int prev = -1;
    for (int kt = 0; kt < p.ktiles; kt++) {
        if constexpr (!kXform) /* a transform waited for the stage when it wrote B */
            tkd_sm90::mbar_wait(full_bar<S>(base, r.stage), r.phase, r.failed, p.err);
        __syncwarp(); /* lanes may leave the wait's loop apart; wgmma wants the warp converged */
        tkd_sm90::wgmma_fence();
        const uint32_t b = kXform ? b_buf<S>(base, (int)((q0 + kt) % kBBufs)) : stage_b<S>(base, r.stage);
        P::mma(acc, stage_a<S>(base, r.stage) + a_row * 128, b, kt == 0);
        tkd_sm90::wgmma_commit();
        if (prev >= 0) {
            tkd_sm90::wgmma_wait<1>();
            if ((threadIdx.x & 31) == 0)
                tkd_sm90::mbar_arrive(empty_bar<S>(base, prev));
        }
        prev = r.stage;
        r.next();
        if constexpr (kXform)
            if (kt + 1 < p.ktiles)
                transform_b<P, S>(p, x, tl, base, r, q0 + kt + 1, kt + 1);
    }
    if (S::kPP && (threadIdx.x & 127) == 0)
        tkd_sm90::mbar_arrive(turn_bar<S>(base, 1 - cw));
    tkd_sm90::wgmma_wait<0>();
    tkd_sm90::fence_regs(acc);
    if ((threadIdx.x & 31) == 0)
        tkd_sm90::mbar_arrive(empty_bar<S>(base, prev));
}

/* A consumer warpgroup (cw = 0, 1): its tiles of this CTA, main loop then epilogue. Cooperative:
 * every tile of the CTA, rows 64·cw.. of each. Ping-pong: the CTA's tiles cw, cw + 2, .. whole,
 * each main loop after the other consumer's turn (its previous tile's stages all waited for). */
template <class P, class S>
__device__ __forceinline__ void consume(const typename P::Params &p, const typename P::Extra &x,
                                        uint32_t base, int cw)
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
        const typename P::Tile tl = P::template tile<S>(p, t);
        ring_seek<S>(r, j * p.ktiles);
        /* consumer 1's tile i follows consumer 0's tile i; consumer 0's tile i follows 1's i − 1 */
        if (S::kPP && (cw == 1 || mine > 0))
            tkd_sm90::mbar_wait(turn_bar<S>(base, cw), (uint32_t)((cw == 1 ? mine : mine - 1) & 1),
                                r.failed, p.err);
        mma_tile<P, S>(acc, p, x, tl, base, cw, a_row, r, j * p.ktiles);
        P::epilogue(acc, p, x, frag_of<S>(tl.mi, tl.ni, a_row), tl);
    }
}

/* The persistent GEMM of problem P on schedule kPP: 384 threads, its Sched's kSmemBytes dynamic;
 * tm_a and tm_b are P's operands (boxes as its load wants, 128-byte swizzled). */
template <class P, bool kPP>
__global__ void __launch_bounds__(kThreads, 1)
gemm_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
            const typename P::Params p, const __grid_constant__ typename P::Extra x)
{
    using S = Sched<kPP, Traits<P>::kExtraBytes, Traits<P>::kTransform>;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (tkd_sm90::smem_u32(smem_raw) + 1023u) & ~1023u;
    if (threadIdx.x == 0)
        init_bars<P, S>(base);
    __syncthreads();
    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x < (Traits<P>::kWarpLoad ? 32 : 1))
            produce<P, S>(&tm_a, &tm_b, p, x, base);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        consume<P, S>(p, x, base, threadIdx.x / 128 - 1);
    }
}

/* One K step (64) of the four wgmma m64n256k16 from a stage, for either operand layout: K-major
 * (kMN 0: a K step of 16 is +32 bytes = 2 descriptor units inside the swizzle span) or MN-major
 * (kMN 1: 64 x 64 boxes kBoxBytes apart along M/N, a K step of 16 is +16 rows = +2048 bytes).
 * A problem's mma is one call of it; first overwrites acc. */
constexpr uint32_t kBoxBytes = 64 * 128; /* one 64 x 64 bf16 box */

template <int kAMN, int kBMN>
__device__ __forceinline__ void kstep_mma(float (&acc)[kAcc], uint32_t a, uint32_t b, bool first)
{
#pragma unroll
    for (int kk = 0; kk < kBK / 16; kk++) {
        const uint64_t da = kAMN ? tkd_sm90::smem_desc_mn(a + 2048 * kk, kBoxBytes) : tkd_sm90::smem_desc(a) + 2 * kk;
        const uint64_t db = kBMN ? tkd_sm90::smem_desc_mn(b + 2048 * kk, kBoxBytes) : tkd_sm90::smem_desc(b) + 2 * kk;
        tkd_sm90::wgmma_ss_n256_t<kAMN, kBMN>(acc, da, db, !first || kk > 0);
    }
}

/* Launches P's GEMM on ws's stream: one CTA per SM (ws->max_ctas caps it), no more than tiles. */
template <class P, bool kPP>
tkd_status gemm_launch(const tkd_lmhead_sm90_ws *ws, const CUtensorMap &tm_a, const CUtensorMap &tm_b,
                       const typename P::Params &p, const typename P::Extra &x)
{
    using S = Sched<kPP, Traits<P>::kExtraBytes, Traits<P>::kTransform>;
    int dev = 0, sms = 0;
    TKD_CUDA_CHECK(cudaGetDevice(&dev));
    TKD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    long long grid = ws->max_ctas > 0 && ws->max_ctas < sms ? ws->max_ctas : sms;
    if (grid > p.tiles)
        grid = p.tiles;
    TKD_CUDA_CHECK(cudaFuncSetAttribute(gemm_kernel<P, kPP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)S::kSmemBytes));
    gemm_kernel<P, kPP><<<(unsigned)grid, kThreads, S::kSmemBytes, ws->stream>>>(tm_a, tm_b, p, x);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

/* A row-major (rows, cols) bf16 matrix with leading dimension ld as a tensor map: boxes of 64
 * columns x box_rows rows, 128-byte swizzle, zero fill out of range. */
inline tkd_status bf16_tmap(CUtensorMap *tm, const uint16_t *ptr, long long rows, int cols, long long ld,
                            int box_rows, const char *who)
{
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)ld * 2};
    return tkd_sm90::make_tmap(tm, ptr, 2, dims, strides, box_rows, who);
}

/* Calls fn(h, row) for the thread's two fragment rows (h = 0, 1: row f.row0 + 8h) that lie below
 * n: the loop every row-wise epilogue starts with. */
template <class Fn>
__device__ __forceinline__ void for_frag_rows(Frag f, long long n, Fn &&fn)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const long long row = f.row0 + 8 * h;
        if (row < n)
            fn(h, row);
    }
}

} // namespace tkd_lmhead

#endif /* TKD_GEMM_SM90_PIPE_CUH */
