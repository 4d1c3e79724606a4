/* lmhead_sm90_pipe.cuh — the pieces of the Hopper LM-head GEMMs' pipeline that the logits GEMM
 * (lmhead_sm90.cu) and the gradient GEMMs (lmhead_grad_sm90.cu) share: the workspace, tile sizes,
 * the two schedules' ring geometry, the mbarrier addresses, the ring position of a tile, the tile
 * order and where an accumulator fragment sits in the output. lmhead_sm90.cu's header comment
 * describes the pipeline. Internal: included by those two files only (built for sm_90a alone).
 */
#ifndef TKD_LMHEAD_SM90_PIPE_CUH
#define TKD_LMHEAD_SM90_PIPE_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/gemm_sm90/lmhead_sm90.h"
#include "kernels/cuda/sm90_common.cuh"

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

/* What a schedule fixes (lmhead_sm90.cu's header): tile rows, ring depth, shared memory, the
 * arrivals that free a stage (one per consuming warp). */
template <bool kPingPong>
struct Sched {
    static constexpr bool kPP = kPingPong;
    static constexpr int kTileM = kPP ? 64 : TKD_LMHEAD_SM90_BM;
    static constexpr int kStages = kPP ? 5 : 4;
    static constexpr uint32_t kBytesA = kTileM * kBK * 2;
    static constexpr uint32_t kStageBytes = kBytesA + kBytesB; /* 40 KB resp. 48 KB */
    /* the stages, then the full, empty and (ping-pong) turn mbarriers */
    static constexpr size_t kSmemBytes = 1024 + (size_t)kStages * kStageBytes + (2 * kStages + 2) * 8;
    static constexpr int kGroupM = kGroupRows / kTileM;
    static constexpr unsigned kEmptyArrivals = kPP ? 4 : 4 * kConsumers;
    static_assert(kBytesA % 1024 == 0 && kStageBytes % 1024 == 0, "swizzled tiles need 1024-byte alignment");
    static_assert(kSmemBytes <= 227 * 1024, "the ring must fit the 227 KB of shared memory a CTA may have");
};
using Coop = Sched<false>;
using PingPong = Sched<true>;

/* Shared memory from `base` (1024-aligned): the stages, then the full, empty and turn mbarriers. */
template <class S> __device__ inline uint32_t stage_a(uint32_t base, int s) { return base + s * S::kStageBytes; }
template <class S> __device__ inline uint32_t stage_b(uint32_t base, int s) { return stage_a<S>(base, s) + S::kBytesA; }
template <class S> __device__ inline uint32_t full_bar(uint32_t base, int s) { return base + S::kStages * S::kStageBytes + 8 * s; }
template <class S> __device__ inline uint32_t empty_bar(uint32_t base, int s) { return full_bar<S>(base, S::kStages + s); }
/* Ping-pong: consumer c may start its next main loop once turn_bar(c) completed a phase. */
template <class S> __device__ inline uint32_t turn_bar(uint32_t base, int c) { return full_bar<S>(base, 2 * S::kStages + c); }

/* Thread 0 initialises the ring's mbarriers; the caller then __syncthreads(). */
template <class S>
__device__ inline void init_bars(uint32_t base)
{
    for (int s = 0; s < S::kStages; s++) {
        tkd_sm90::mbar_init(full_bar<S>(base, s), 1);                  /* the producer's expect_tx */
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

} // namespace tkd_lmhead

#endif /* TKD_LMHEAD_SM90_PIPE_CUH */
