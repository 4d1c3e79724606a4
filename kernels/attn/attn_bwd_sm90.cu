/* attn_bwd_sm90.cu — see attn_bwd_sm90.h. Built for sm_90a only (kernels/CMakeLists.txt); the
 * wgmma/TMA/mbarrier plumbing is kernels/cuda/sm90_common.cuh's.
 *
 * The maths, per batch and query head (s_ij = q_i·k_j·c, c = 1/√dh; lse2 = lse·log2 e and
 * D_i = dy_i·y_i from the flash backward's prep kernel, attn_bwd_cuda.cu, in its workspace):
 *   P_ij = 2^(s_ij·log2e − lse2_i) (j ≤ i), dP_ij = dy_i·v_j, dS_ij = P_ij (dP_ij − D_i),
 *   dv_j = Σ_i P_ij dy_i, dk_j = c Σ_i dS_ij q_i, dq_i = c Σ_j dS_ij k_j,
 * dk and dv of a kv head summed over its group of query heads.
 *
 * One kernel, one CTA per (128-key tile j, kv head g, batch b), three warpgroups:
 *  - warpgroup 0: thread 0 issues the TMA loads: the resident K and V tile (128 keys of kv head g,
 *    one 64-column box per 64 of dh, 128-byte swizzle) once, then "streamed" steps of 64 queries
 *    (Q, dY and the rows' lse2 and D) through a ring of kStages stages, each completing on its
 *    `full` mbarrier. Lane 0 of warp 1 (and of warp 2 at dh 64) is a dQ writer (below).
 *  - warpgroups 1 and 2, the consumers: each owns 64 of the resident keys (wgmma M = 64). Per step:
 *    Sᵀ = K Qᵀ and dPᵀ = V dYᵀ by wgmma from shared memory (P is computed while dPᵀ's products run),
 *    P and dS in registers, dV += Pᵀ dY and dK += dSᵀ Q by wgmma with P or dS as the A operand from
 *    registers (the accumulator layout of a 64 × 16 block is the A fragment layout) and the streamed
 *    tile as an MN-major B operand. While those run, each stores its dSᵀ (bf16, swizzled) to shared
 *    memory; after a named barrier both read the whole 128-key dS as an MN-major A operand for this
 *    step's dQ partial, dQ_t = dS K (64 queries × dh), each warpgroup half of its columns, and
 *    stage it (fp32) for a writer.
 *  - the dQ writers (one staging buffer each: two at dh 64, whose steps are short, one at dh 128,
 *    where shared memory has room for one) add each step's partial into an fp32 accumulator tile in
 *    the workspace with one bulk reduce-add (TMA), in a fixed order: the partial of key tile j goes
 *    in only after those of key tiles 0 .. j−1, counted by a per-(b, h, query tile) counter the
 *    writer waits on (the first, j = 0, is a plain bulk store: no zeroing pass). A small kernel then
 *    scales each tile by c and rounds it to bf16 into dq.
 * So every gradient element is the same sum in the same order on every run: bit-identical results,
 * with 5 matrix products per (query, key) block (the split design before this one recomputed S and
 * dP in a dQ kernel: 7). The workspace: the prep's B·H·Tp floats twice, the accumulators (B·H·Tp·dh
 * floats) and the counters (B·H·Tp/64).
 *
 * Order and progress: the grid is (Hkv·B, key tiles), launched with x fastest, so key tile j − 1 of
 * a (b, g) is launched before key tile j: a CTA only ever waits on CTAs launched before it, which
 * never wait on it (no deadlock however few CTAs are resident), and the long CTAs (small j: every
 * query tile after them) start first. This rests on the GPU starting a grid's CTAs in increasing
 * linear index, which CUDA does not document but every GPU does; tests/test_gpu_attn_cudnn_bwd.c
 * runs grids larger than the GPU holds. (Handing out the indices from a global ticket counter at
 * CTA start would not rest on it.) Each CTA walks its query tiles from the last down to its
 * diagonal, the heads of the group inside a tile: all CTAs of a (b, g) meet the same (tile, head)
 * at the same step, so a CTA trails the one before it by about one add's latency, not by steps.
 *
 * Causal mask: tile starts are multiples of 64, so a consumer's 64 keys against a 64-query step are
 * either wholly visible, on the diagonal (same start: elementwise key > query → P = 0), or wholly
 * masked (only warpgroup 2 on the CTA's first query tile, or on every tile where its keys are all
 * ≥ T: it skips its products and stores a zero dS block for the dQ product). Ragged T: the tensor maps are 3-D (columns, T, B),
 * so rows ≥ T of a box are zero-filled within the batch; their lse2 is +inf and D 0 (prep pads to
 * Tp), so P = 0 and they contribute nothing; gradient rows ≥ T are not stored.
 *
 * Fragments (wgmma m64nN, fp32): in warp w of a warpgroup, lane l holds rows 16w + l/4 + 8h and
 * columns 8j + 2(l%4) + e at register 4j + 2h + e. The A fragment of k-block c (columns 16c ..
 * 16c + 15) is then {x[8c], x[8c+1]}, {x[8c+2], x[8c+3]}, {x[8c+4], x[8c+5]}, {x[8c+6], x[8c+7]}
 * as bf16 pairs (to_a_frags).
 */
#include "kernels/attn/attn_bwd_sm90.h"

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/attn/attn_bwd_cuda_internal.h"
#include "kernels/attn/attn_cuda_common.cuh" /* pack_bf16 */
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/cuda/sm90_common.cuh"

namespace {

using namespace tkd_sm90;
using tkd_attn::pack_bf16;

constexpr int kRows = 64;                /* rows per consumer warpgroup (wgmma M) */
constexpr int kConsumers = 2;
constexpr int kRes = kRows * kConsumers; /* resident tile rows */
constexpr int kStr = 64;                 /* streamed tile rows per step */
constexpr int kStages = 3; /* a step is ~1 µs of wgmma: two loads in flight cover TMA latency */
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr double kLog2e = 1.4426950408889634;
static_assert(TKD_ATTN_BWD_PAD % kStr == 0, "a step's 64 lse2/D values and dQ tile lie inside the padded rows");

/* Shared memory, byte offsets from a 1024-aligned base: the resident K and V tiles, the ring's stages
 * (Q and dY tiles each), the two warpgroups' dSᵀ blocks twice (by step parity: a warpgroup writes
 * step s + 1's while the other may still read step s's), the staging buffers of the fp32 dQ partial
 * (64 × DH each), the stages' lse2/D vectors (64 + 64 floats each), the mbarriers. Each 64-column
 * box of a tile is rows × 128 bytes. DH 128: 232,008 bytes of the 232,448 an H200 CTA may have. */
template <int DH>
struct Smem {
    static constexpr uint32_t kResBox = kRes * 128, kStrBox = kStr * 128;
    static constexpr uint32_t kResTile = kResBox * (DH / 64), kStrTile = kStrBox * (DH / 64);
    static constexpr uint32_t kStage0 = 2 * kResTile;
    static constexpr uint32_t kDsHalf = kRows * 128; /* one warpgroup's 64 keys × 64 queries, bf16 */
    static constexpr uint32_t kDs = kStage0 + 2 * kStages * kStrTile;
    static constexpr uint32_t kDq = kDs + 2 * kConsumers * kDsHalf;
    static constexpr uint32_t kDqBytes = kStr * DH * 4;
    /* Staging buffers, each with its own writer thread: at DH 64 a step is short enough that one
     * writer's copy, wait and count would pace the CTA; at DH 128 there is room for one only. */
    static constexpr int kDqBufs = DH == 64 ? 2 : 1;
    static constexpr uint32_t kVec = kDq + kDqBufs * kDqBytes;
    static constexpr uint32_t kBar = kVec + kStages * 2 * kStr * 4;
    static constexpr int kNumBars = 2 * kStages + 1 + 2 * kDqBufs;
    static constexpr size_t kBytes = 1024 + kBar + 8 * kNumBars;
    static_assert(kResBox % 1024 == 0 && kStrBox % 1024 == 0 && kDs % 1024 == 0,
                  "swizzled boxes need 1024-byte alignment");
    static_assert(kBytes <= 232448, "more shared memory than a Hopper CTA may have");
};

__device__ inline uint32_t full_bar(uint32_t bar0, int s) { return bar0 + 8 * s; }
__device__ inline uint32_t empty_bar(uint32_t bar0, int s) { return bar0 + 8 * (kStages + s); }
__device__ inline uint32_t res_full_bar(uint32_t bar0) { return bar0 + 8 * (2 * kStages); }
/* Staging buffer i: its partial staged (both consumers), and read by its writer's copy. */
__device__ inline uint32_t dq_full_bar(uint32_t bar0, int i) { return bar0 + 8 * (2 * kStages + 1 + 2 * i); }
__device__ inline uint32_t dq_empty_bar(uint32_t bar0, int i) { return bar0 + 8 * (2 * kStages + 2 + 2 * i); }

struct Params {
    uint16_t *dk, *dv;        /* (B·T, Hkv·dh) */
    const float *lse2, *dsum; /* (B, H, Tp) */
    float *dq_acc;            /* (B, H, Tp / 64) tiles of 64 × dh fp32, in the staging layout (store_dq) */
    unsigned *dq_cnt;         /* (B, H, Tp / 64) partials added so far; zero at launch */
    int T, Tp, H, Hkv, grp;   /* grp = H / Hkv */
    float scale_log2;         /* log2(e) / √dh */
    float scale;              /* 1 / √dh */
    unsigned *err;
};

/* The CTA's place (batch b, kv head g, key tile j starting at key k0) and its walk: `steps` steps
 * over the query tiles from the last (nq − 1) down to the one holding key k0, the group's heads
 * inside each tile. Producer, consumers and writer walk it alike. */
struct Walk {
    int b, g, j, k0, nq, grp, steps;
    __device__ explicit Walk(const Params &p)
        : b((int)blockIdx.x / p.Hkv), g((int)blockIdx.x % p.Hkv), j((int)blockIdx.y), k0(j * kRes),
          nq((p.T + kStr - 1) / kStr), grp(p.grp), steps((nq - k0 / kStr) * p.grp)
    {
    }
    __device__ int qtile(int s) const { return nq - 1 - s / grp; }
    __device__ int head(int s) const { return g * grp + s % grp; }
};

/* ---- fragments ----------------------------------------------------------------------------------- */

template <int N>
__device__ inline void zero_regs(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        d[i] = 0.f;
}

/* Keeps A fragments alive (and in place) until the wgmma that reads them has completed. */
__device__ inline void fence_frags(uint32_t (&a)[4][4])
{
#pragma unroll
    for (int c = 0; c < 4; c++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            asm volatile("" : "+r"(a[c][i])::"memory");
}

/* The bf16 A fragments of the four 64 × 16 column blocks of a 64 × 64 fp32 fragment (file comment). */
__device__ inline void to_a_frags(uint32_t (&a)[4][4], const float (&x)[32])
{
#pragma unroll
    for (int c = 0; c < 4; c++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            a[c][i] = pack_bf16(x[8 * c + 2 * i], x[8 * c + 2 * i + 1]);
}

/* ---- the consumers' matrix products ---------------------------------------------------------- */

/* Issues s = A0 · B0ᵀ and dp = A1 · B1ᵀ (64 × 64 fp32 fragments, K = DH) as two commit groups, s's
 * first, so the caller can work on s while dp's products run (wgmma_wait<1>, then <0>): A0, A1 64
 * rows at a0, a1 whose 64-column boxes are abox bytes apart, B0, B1 64 rows at b0, b1 (boxes bbox
 * apart), all K-major and 128-byte swizzled. */
template <int DH>
__device__ __forceinline__ void scores(float (&s)[32], float (&dp)[32], uint32_t a0, uint32_t a1, uint32_t abox,
                                       uint32_t b0, uint32_t b1, uint32_t bbox)
{
    zero_regs(s); /* overwritten by the first wgmma; this keeps them defined */
    zero_regs(dp);
    fence_regs(s);
    fence_regs(dp);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DH / 16; kk++) /* 16 columns = 32 bytes of a box */
        wgmma_ss_n64(s, smem_desc(a0 + (kk / 4) * abox + (kk % 4) * 32),
                     smem_desc(b0 + (kk / 4) * bbox + (kk % 4) * 32), kk > 0);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < DH / 16; kk++)
        wgmma_ss_n64(dp, smem_desc(a1 + (kk / 4) * abox + (kk % 4) * 32),
                     smem_desc(b1 + (kk / 4) * bbox + (kk % 4) * 32), kk > 0);
    wgmma_commit();
}

/* acc (64 × DH) += A · B, A (64 × 64) as four k16 fragments, B the 64 × DH tile at b (rows = K,
 * MN-major: a k16 block is 16 rows = 2048 bytes; its two 64-column boxes bbox bytes apart). Issued
 * only: the caller commits and waits. */
template <int DH>
__device__ __forceinline__ void mma_rs(float (&acc)[DH / 2], const uint32_t (&a)[4][4], uint32_t b, uint32_t bbox)
{
#pragma unroll
    for (int c = 0; c < 4; c++) {
        const uint64_t db = smem_desc_mn(b + c * 2048, bbox);
        if constexpr (DH == 64)
            wgmma_rs_n64(acc, a[c], db);
        else
            wgmma_rs_n128(acc, a[c], db);
    }
}

/* P in place on the transposed score block s (rows: the warpgroup's 64 keys; columns: the step's
 * 64 queries, whose lse2 is l2[col] in shared memory). On the diagonal (both start together) keys
 * after their query get P = 0. */
__device__ __forceinline__ void p_keys(float (&s)[32], const float *l2, float scale_log2, bool diag)
{
    const int lane = threadIdx.x & 31, row = 16 * ((threadIdx.x / 32) & 3) + lane / 4;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int col = 8 * j + 2 * (lane & 3);
        const float2 l = *reinterpret_cast<const float2 *>(l2 + col);
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int i = 4 * j + 2 * h + e;
                float p = fast_exp2(fmaf(s[i], scale_log2, -(e ? l.y : l.x)));
                if (diag && row + 8 * h > col + e)
                    p = 0.f;
                s[i] = p;
            }
    }
}

/* dS = P (dP − D) in place on dp (the same layout; the queries' D is dd[col]). */
__device__ __forceinline__ void ds_keys(const float (&p)[32], float (&dp)[32], const float *dd)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const float2 d = *reinterpret_cast<const float2 *>(dd + 8 * j + 2 * (lane & 3));
#pragma unroll
        for (int i = 4 * j; i < 4 * j + 4; i++)
            dp[i] = p[i] * (dp[i] - ((i & 1) ? d.y : d.x));
    }
}

/* Rows row0 + 16w + l/4 (+8) of a 64 × DH fp32 fragment, times mul, to g (row r at g + r·ld) as
 * bf16 (one rounding); rows ≥ T skipped. Writes, never reads, g. */
template <int DH>
__device__ __forceinline__ void store_rows(uint16_t *g, int64_t ld, const float (&acc)[DH / 2], float mul, int row0,
                                           int T)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = row0 + 16 * ((threadIdx.x / 32) & 3) + lane / 4 + 8 * h;
        if (row >= T)
            continue;
        uint32_t *r = reinterpret_cast<uint32_t *>(g + (int64_t)row * ld + 2 * (lane & 3));
#pragma unroll
        for (int j = 0; j < DH / 8; j++)
            r[4 * j] = pack_bf16(acc[4 * j + 2 * h] * mul, acc[4 * j + 2 * h + 1] * mul);
    }
}

/* ---- the producer ------------------------------------------------------------------------------- */

/* One tile into shared dst: rows y .. y + box rows of batch b, columns col0 .. col0 + DH as DH/64
 * boxes box_bytes apart, completing on bar. */
template <int DH>
__device__ inline void load_tile(uint32_t dst, const CUtensorMap *tm, uint32_t box_bytes, int col0, int y, int b,
                                 uint32_t bar)
{
#pragma unroll
    for (int i = 0; i < DH / 64; i++)
        tma_load_3d(dst + i * box_bytes, tm, col0 + 64 * i, y, b, bar);
}

/* Waits for the ring's current stage to be free and arms its `full` barrier for bytes. */
__device__ inline uint32_t stage_acquire(Ring<kStages> &r, uint32_t bar0, uint32_t bytes, unsigned *err)
{
    mbar_wait(empty_bar(bar0, r.stage), r.phase ^ 1u, r.failed, err);
    const uint32_t full = full_bar(bar0, r.stage);
    mbar_arrive_expect_tx(full, bytes);
    return full;
}

/* The producer (one thread): the K and V tile of kv head g, then per step the Q and dY tiles of its
 * query tile and head with their lse2 and D. */
template <int DH>
__device__ void produce(const CUtensorMap *tk, const CUtensorMap *tv, const CUtensorMap *tq, const CUtensorMap *tdy,
                        const Params &p, uint32_t base)
{
    using S = Smem<DH>;
    const uint32_t bar0 = base + S::kBar;
    const Walk w(p);
    Ring<kStages> r;
    mbar_arrive_expect_tx(res_full_bar(bar0), 2 * S::kResTile);
    load_tile<DH>(base, tk, S::kResBox, w.g * DH, w.k0, w.b, res_full_bar(bar0));
    load_tile<DH>(base + S::kResTile, tv, S::kResBox, w.g * DH, w.k0, w.b, res_full_bar(bar0));
    for (int s = 0; s < w.steps; s++) {
        const int h = w.head(s), q0 = w.qtile(s) * kStr;
        const uint32_t full = stage_acquire(r, bar0, 2 * S::kStrTile + 2 * kStr * 4, p.err);
        const uint32_t st = base + S::kStage0 + 2 * r.stage * S::kStrTile;
        const uint32_t vec = base + S::kVec + r.stage * 2 * kStr * 4;
        load_tile<DH>(st, tq, S::kStrBox, h * DH, q0, w.b, full);
        load_tile<DH>(st + S::kStrTile, tdy, S::kStrBox, h * DH, q0, w.b, full);
        const int64_t row = ((int64_t)w.b * p.H + h) * p.Tp + q0; /* q0 + 64 ≤ Tp: prep padded */
        bulk_load(vec, p.lse2 + row, kStr * 4, full);
        bulk_load(vec + kStr * 4, p.dsum + row, kStr * 4, full);
        r.next();
    }
}

/* The accumulator tile of (b, h, query tile qt) and its counter. */
__device__ inline int64_t dq_tile(const Params &p, int b, int h, int qt)
{
    return ((int64_t)b * p.H + h) * (p.Tp / kStr) + qt;
}

/* dQ writer `wr` (one thread, of Smem<DH>::kDqBufs): steps wr, wr + kDqBufs, .. through staging
 * buffer wr. Per step, once both consumers staged the partial, it waits until key tiles 0 .. j−1
 * added theirs to the tile (its counter reads j), adds it (key tile 0: stores it) with one bulk
 * copy, frees the buffer as soon as the copy has read it, and counts the partial in once its writes
 * are done. */
template <int DH>
__device__ void dq_write(const Params &p, uint32_t base, int wr)
{
    using S = Smem<DH>;
    const uint32_t bar0 = base + S::kBar, src = base + S::kDq + wr * S::kDqBytes;
    const Walk w(p);
    bool failed = false;
    for (int s = wr, n = 0; s < w.steps; s += S::kDqBufs, n++) {
        mbar_wait(dq_full_bar(bar0, wr), n & 1, failed, p.err);
        const int64_t t = dq_tile(p, w.b, w.head(s), w.qtile(s));
        counter_wait(p.dq_cnt + t, (unsigned)w.j, failed, p.err); /* no wait for j = 0: reads 0 */
        if (!failed) {
            fence_async_global(); /* the earlier partials' writes, seen by the acquire, before this copy */
            float *dst = p.dq_acc + t * kStr * DH;
            if (w.j == 0)
                bulk_store(dst, src, S::kDqBytes);
            else
                bulk_reduce_add_f32(dst, src, S::kDqBytes);
            bulk_commit();
            bulk_wait_read();
        }
        mbar_arrive(dq_empty_bar(bar0, wr)); /* also when failed: the consumers must not hang */
        if (!failed) {
            bulk_wait_all();
            fence_async_global();
            red_release_add(p.dq_cnt + t, 1u);
        }
    }
}

/* ---- the consumers ------------------------------------------------------------------------------ */

/* Waits for a barrier phase, then reconverges the warp (lanes may leave the wait's loop apart;
 * the .aligned wgmma instructions want the warp converged). */
__device__ inline void consumer_wait(uint32_t bar, uint32_t parity, Ring<kStages> &r, unsigned *err)
{
    mbar_wait(bar, parity, r.failed, err);
    __syncwarp();
}

/* Releases a barrier phase: one arrival per consumer warp. */
__device__ inline void consumer_release(uint32_t bar)
{
    __syncwarp();
    if ((threadIdx.x & 31) == 0)
        mbar_arrive(bar);
}

/* The two consumer warpgroups meet (named barrier 1; barrier 0 is __syncthreads). */
__device__ inline void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(128 * kConsumers) : "memory"); }

/* This thread's part of dSᵀ (the A fragments dsa: rows = the warpgroup's 64 keys, columns = the
 * step's 64 queries) into the 64 × 128-byte block at ds, 128-byte swizzled like a TMA box: a[c][i]
 * holds row 16w + l/4 + 8(i % 2), columns 16c + 8(i / 2) + 2(l % 4) + {0, 1}, i.e. 16-byte chunk
 * 2c + i/2 of its row at byte 4(l % 4). Conflict-free: a warp's 8 rows hit 8 distinct chunks. */
__device__ inline void store_ds(uint32_t ds, const uint32_t (&a)[4][4])
{
    const int lane = threadIdx.x & 31, r8 = lane / 4;
    const uint32_t row0 = ds + (16 * ((threadIdx.x / 32) & 3) + r8) * 128 + 4 * (lane & 3);
#pragma unroll
    for (int c = 0; c < 4; c++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t at = row0 + 8 * 128 * (i & 1) + (((2 * c + i / 2) ^ r8) << 4);
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(a[c][i]) : "memory");
        }
}

/* dq (64 queries × this warpgroup's DH/2 columns) = dS K over the 128 keys of the resident tile:
 * A = dSᵀ from shared memory (MN-major: rows are keys), B = K (MN-major: rows are keys; DH 128: box
 * cw, N 64; DH 64: columns 32·cw .. of the one box, N 32). Issued only. */
template <int DH>
__device__ __forceinline__ void dq_mma(float (&dq)[DH / 4], uint32_t ds, uint32_t kres, int cw)
{
    const uint32_t b0 = DH == 128 ? kres + cw * Smem<DH>::kResBox : kres + cw * 64;
#pragma unroll
    for (int c = 0; c < kRes / 16; c++) {
        const uint64_t da = smem_desc_mn(ds + (c / 4) * Smem<DH>::kDsHalf + (c % 4) * 2048, 0);
        const uint64_t db = smem_desc_mn(b0 + c * 2048, 0);
        if constexpr (DH == 128)
            wgmma_ss_n64_t<1, 1>(dq, da, db, c > 0);
        else
            wgmma_ss_n32_t<1, 1>(dq, da, db, c > 0);
    }
}

/* Float4 chunk i of thread t's dq registers sits at chunk (i + rot(t)) % n of its row of the staging
 * tile (n = DH/16 chunks): rotating by the lane keeps 8 lanes' stores on distinct banks. */
template <int DH>
__device__ inline int dq_chunk(int i, int t)
{
    constexpr int n = DH / 16;
    return (i + t * n / 8) % n;
}

/* This warpgroup's dq partial (64 × DH/2 fp32) into the staging tile: thread t of warpgroup cw owns
 * the DH/4 floats from (128·cw + t)·DH/4, its registers in float4 chunks rotated by dq_chunk. */
template <int DH>
__device__ inline void store_dq(unsigned char *stage, const float (&dq)[DH / 4], int cw)
{
    const int t = threadIdx.x & 127;
    float4 *row = reinterpret_cast<float4 *>(stage) + (128 * cw + t) * (DH / 16);
#pragma unroll
    for (int i = 0; i < DH / 16; i++)
        row[dq_chunk<DH>(i, t)] = make_float4(dq[4 * i], dq[4 * i + 1], dq[4 * i + 2], dq[4 * i + 3]);
}

/* One step of consumer warpgroup cw: the streamed Q and dY tile of queries q0 .. in stage `stage`,
 * dSᵀ blocks of parity `par`. Leaves this step's dQ partial in dq. The visible and the masked case
 * are two straight paths, each with its own wgmma fence and wait (a wgmma under a branch inside one
 * sequence makes the compiler serialise them all). */
template <int DH>
__device__ __forceinline__ void step(float (&dk)[DH / 2], float (&dv)[DH / 2], float (&dq)[DH / 4], const Params &p,
                                     uint32_t base, const unsigned char *sp, int stage, int cw, int q0, int k0,
                                     int par)
{
    using S = Smem<DH>;
    const uint32_t sq = base + S::kStage0 + 2 * stage * S::kStrTile, sdy = sq + S::kStrTile;
    const uint32_t ds = base + S::kDs + par * kConsumers * S::kDsHalf;
    const int kw = k0 + cw * kRows;
    zero_regs(dq); /* overwritten by the first dQ wgmma; this keeps them defined */
    if (q0 >= kw) {
        const uint32_t mine = cw * kRows * 128; /* the warpgroup's 64 rows of a resident box */
        const float *l2 = reinterpret_cast<const float *>(sp + S::kVec + stage * 2 * kStr * 4);
        float s[32], dp[32];
        scores<DH>(s, dp, base + mine, base + S::kResTile + mine, S::kResBox, sq, sdy, S::kStrBox); /* Sᵀ, dPᵀ */
        wgmma_wait<1>();
        fence_regs(s);
        p_keys(s, l2, p.scale_log2, q0 == kw); /* while dPᵀ's products run */
        fence_regs(s);
        wgmma_wait<0>();
        fence_regs(dp);
        ds_keys(s, dp, l2 + kStr);
        uint32_t pa[4][4], dsa[4][4];
        to_a_frags(pa, s);
        to_a_frags(dsa, dp);
        fence_regs(dv);
        fence_regs(dk);
        wgmma_fence();
        mma_rs<DH>(dv, pa, sdy, S::kStrBox); /* dV += Pᵀ dY */
        mma_rs<DH>(dk, dsa, sq, S::kStrBox); /* dK += dSᵀ Q */
        wgmma_commit();
        store_ds(ds + cw * S::kDsHalf, dsa); /* while dV's and dK's products run */
        fence_async_shared();                /* the generic stores before the wgmmas that read them */
        consumers_sync();
        fence_regs(dq);
        wgmma_fence();
        dq_mma<DH>(dq, ds, base, cw); /* dQ_t = dS K */
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(dv);
        fence_regs(dk);
        fence_regs(dq);
        fence_frags(pa);
        fence_frags(dsa);
    } else { /* wholly masked: a zero dS block, so the dQ product runs over all 128 keys alike */
        const uint32_t zero[4][4] = {};
        store_ds(ds + cw * S::kDsHalf, zero);
        fence_async_shared();
        consumers_sync();
        fence_regs(dq);
        wgmma_fence();
        dq_mma<DH>(dq, ds, base, cw); /* dQ_t = dS K */
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(dq);
    }
}

/* Consumer warpgroup cw: keys k0 + 64·cw .. against every step; its dq partial goes to the staging
 * tile once the writer has read the previous one. dK and dV are stored at the end. */
template <int DH>
__device__ void consume(const Params &p, uint32_t base, unsigned char *sp, int cw)
{
    using S = Smem<DH>;
    const uint32_t bar0 = base + S::kBar;
    const Walk w(p);
    const int64_t ld = (int64_t)p.Hkv * DH, off = (int64_t)w.b * p.T * ld + (int64_t)w.g * DH;
    Ring<kStages> r;
    float dk[DH / 2], dv[DH / 2], dq[DH / 4];
    zero_regs(dk);
    zero_regs(dv);
    consumer_wait(res_full_bar(bar0), 0, r, p.err);
    for (int s = 0; s < w.steps; s++) {
        consumer_wait(full_bar(bar0, r.stage), r.phase, r, p.err);
        step<DH>(dk, dv, dq, p, base, sp, r.stage, cw, w.qtile(s) * kStr, w.k0, s & 1);
        consumer_release(empty_bar(bar0, r.stage));
        const int buf = s % S::kDqBufs, use = s / S::kDqBufs; /* the buffer, and its use count */
        consumer_wait(dq_empty_bar(bar0, buf), (use & 1) ^ 1, r, p.err); /* its previous partial read */
        store_dq<DH>(sp + S::kDq + buf * S::kDqBytes, dq, cw);
        fence_async_shared(); /* before the writer's bulk copy reads it */
        consumer_release(dq_full_bar(bar0, buf));
        r.next();
    }
    store_rows<DH>(p.dk + off, ld, dk, p.scale, w.k0 + cw * kRows, p.T);
    store_rows<DH>(p.dv + off, ld, dv, 1.f, w.k0 + cw * kRows, p.T);
}

/* ---- the kernels -------------------------------------------------------------------------------- */

/* Grid (Hkv·B, key tiles): maps tk, tv = K, V (boxes of 128 rows), tq, tdy = Q, dY (64 rows). 384
 * threads, Smem<DH>::kBytes dynamic. */
template <int DH>
__global__ void __launch_bounds__(kThreads, 1)
attn_bwd_sm90_kernel(const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                     const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdy, const Params p)
{
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
    unsigned char *sp = smem_raw + (base - raw);
    const uint32_t bar0 = base + Smem<DH>::kBar;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; s++) {
            mbar_init(full_bar(bar0, s), 1);               /* the producer's expect_tx */
            mbar_init(empty_bar(bar0, s), 4 * kConsumers); /* one arrival per consumer warp */
        }
        mbar_init(res_full_bar(bar0), 1);
        for (int i = 0; i < Smem<DH>::kDqBufs; i++) {
            mbar_init(dq_full_bar(bar0, i), 4 * kConsumers);
            mbar_init(dq_empty_bar(bar0, i), 1); /* its writer */
        }
        mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0)
            produce<DH>(&tk, &tv, &tq, &tdy, p, base);
        else if (threadIdx.x % 32 == 0 && threadIdx.x / 32 <= Smem<DH>::kDqBufs)
            dq_write<DH>(p, base, threadIdx.x / 32 - 1); /* lane 0 of warps 1 (and 2) */
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        consume<DH>(p, base, sp, threadIdx.x / 128 - 1);
    }
}

/* dq (B·T, H·dh) bf16 = c × the accumulator tiles: grid (Tp / 64, H, B), 256 threads, thread
 * 128·cw + t reading what consumer thread t of warpgroup cw staged (store_dq) and writing its rows
 * and columns of the fragment layout (file comment). */
template <int DH>
__global__ void __launch_bounds__(256) dq_finish_kernel(const float *__restrict__ acc, uint16_t *__restrict__ dq,
                                                        int T, int H, float scale)
{
    const int qt = (int)blockIdx.x, h = (int)blockIdx.y, b = (int)blockIdx.z;
    const int cw = (int)threadIdx.x / 128, t = (int)threadIdx.x & 127, lane = t & 31;
    const int64_t tile = ((int64_t)b * H + h) * gridDim.x + qt;
    const float4 *src = reinterpret_cast<const float4 *>(acc + tile * kStr * DH) + (128 * cw + t) * (DH / 16);
    float x[DH / 4];
#pragma unroll
    for (int i = 0; i < DH / 16; i++) {
        const float4 v = src[dq_chunk<DH>(i, t)];
        x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
    }
    const int64_t ld = (int64_t)H * DH;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int row = qt * kStr + 16 * (t / 32) + lane / 4 + 8 * hh;
        if (row >= T)
            continue;
        uint32_t *out = reinterpret_cast<uint32_t *>(dq + ((int64_t)b * T + row) * ld + h * DH + cw * (DH / 2) +
                                                     2 * (lane & 3));
#pragma unroll
        for (int j = 0; j < DH / 16; j++)
            out[4 * j] = pack_bf16(x[4 * j + 2 * hh] * scale, x[4 * j + 2 * hh + 1] * scale);
    }
}

/* ---- the probe (tests only) ---------------------------------------------------------------------- */

/* c (64 rows of ldc fp32) = a 64 × N fragment of this warpgroup. */
template <int N>
__device__ inline void store_frag_f32(float *c, int ldc, const float (&acc)[N / 2])
{
    const int lane = threadIdx.x & 31, row = 16 * ((threadIdx.x / 32) & 3) + lane / 4;
#pragma unroll
    for (int j = 0; j < N / 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) /* register 4j + i: row + 8(i / 2), column 8j + 2(lane % 4) + i % 2 */
            c[(row + 8 * (i / 2)) * ldc + 8 * j + 2 * (lane & 3) + (i & 1)] = acc[4 * j + i];
}

/* One warpgroup runs the two wgmma paths of the kernels on A and B (64 × DH bf16, loaded by TMA as
 * the streamed tiles are): c1 = A·Bᵀ (64 × 64, both K-major: scores), c2 = bf16(c1)·B (64 × DH:
 * register A fragments from the accumulator, B MN-major: mma_rs). */
template <int DH>
__global__ void __launch_bounds__(128, 1)
attn_bwd_sm90_probe_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb, float *c1,
                           float *c2, unsigned *err)
{
    extern __shared__ unsigned char smem_raw[];
    constexpr uint32_t kBox = Smem<DH>::kStrBox, kTile = Smem<DH>::kStrTile;
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u, bar = base + 2 * kTile;
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(bar, 2 * kTile);
        load_tile<DH>(base, &ta, kBox, 0, 0, 0, bar);
        load_tile<DH>(base + kTile, &tb, kBox, 0, 0, 0, bar);
    }
    Ring<kStages> r;
    consumer_wait(bar, 0, r, err);
    float s[32], s2[32], acc[DH / 2];
    scores<DH>(s, s2, base, base, kBox, base + kTile, base + kTile, kBox);
    wgmma_wait<0>();
    fence_regs(s);
    fence_regs(s2);
    store_frag_f32<64>(c1, 64, s);
    uint32_t a[4][4];
    to_a_frags(a, s);
    zero_regs(acc);
    fence_regs(acc);
    wgmma_fence();
    mma_rs<DH>(acc, a, base + kTile, kBox);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
    fence_frags(a);
    store_frag_f32<DH>(c2, DH, acc);
}

/* ---- host side ---------------------------------------------------------------------------------- */

/* Tensor map of x (B·T, heads·dh) bf16 as (columns, T, B), boxes of 64 columns × rows rows. */
tkd_status tmap_of(CUtensorMap *tm, const uint16_t *x, int B, int T, int heads, int dh, int rows)
{
    const cuuint64_t ld = (cuuint64_t)heads * dh;
    const cuuint64_t dims[3] = {ld, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[2] = {ld * 2, ld * 2 * (cuuint64_t)T};
    return make_tmap(tm, x, 3, dims, strides, rows, "tkd_cuda_attn_bwd_sm90");
}

struct Tensors {
    const uint16_t *dy, *q, *k, *v;
    int B, T, H, Hkv;
};

/* The counters to zero, the fused kernel, then dq from the accumulators, on stream. */
template <int DH>
tkd_status launch(const Tensors &x, const Params &p, uint16_t *dq, cudaStream_t stream)
{
    CUtensorMap tk, tv, tq, tdy; /* K, V with boxes of 128 rows; Q, dY of 64 */
    TKD_TRY(tmap_of(&tk, x.k, x.B, x.T, x.Hkv, DH, kRes));
    TKD_TRY(tmap_of(&tv, x.v, x.B, x.T, x.Hkv, DH, kRes));
    TKD_TRY(tmap_of(&tq, x.q, x.B, x.T, x.H, DH, kStr));
    TKD_TRY(tmap_of(&tdy, x.dy, x.B, x.T, x.H, DH, kStr));
    const int qtiles = p.Tp / kStr;
    TKD_CUDA_CHECK(cudaMemsetAsync(p.dq_cnt, 0, sizeof(unsigned) * (size_t)x.B * x.H * qtiles, stream));
    const size_t smem = Smem<DH>::kBytes;
    TKD_CUDA_CHECK(cudaFuncSetAttribute(attn_bwd_sm90_kernel<DH>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
    const dim3 grid((unsigned)(x.Hkv * x.B), (unsigned)((x.T + kRes - 1) / kRes));
    attn_bwd_sm90_kernel<DH><<<grid, kThreads, smem, stream>>>(tk, tv, tq, tdy, p);
    TKD_CUDA_CHECK(cudaGetLastError());
    dq_finish_kernel<DH><<<dim3((unsigned)qtiles, (unsigned)x.H, (unsigned)x.B), 256, 0, stream>>>(
        p.dq_acc, dq, x.T, x.H, p.scale);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

tkd_status check_args(const uint16_t *const *ptrs, int n, const float *lse, int B, int T, int H, int Hkv, int dh,
                      const tkd_cuda_attn_bwd_ws *ws)
{
    if (B < 0 || T < 0 || H < 1 || Hkv < 1 || H % Hkv != 0 || B > 65535 || H > 65535)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tkd_cuda_attn_bwd_sm90: bad shape B=%d T=%d H=%d Hkv=%d (H a "
                             "multiple of Hkv; B, H < 65536)", B, T, H, Hkv);
    if (!ws)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tkd_cuda_attn_bwd_sm90: no workspace");
    for (int i = 0; i < n; i++)
        if (!ptrs[i] || ((uintptr_t)ptrs[i] & 15u) != 0)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "tkd_cuda_attn_bwd_sm90: dy, q, k, v, y, dq, dk and dv are "
                                 "required and must be 16-byte aligned");
    if (!lse)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tkd_cuda_attn_bwd_sm90: lse is required");
    if ((T + kRes - 1) / kRes > 65535)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "tkd_cuda_attn_bwd_sm90: T=%d is more than 65535 key tiles of %d",
                             T, kRes);
    if (!ws->dq_acc || ws->dq_dh < dh)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tkd_cuda_attn_bwd_sm90: the workspace has no dQ accumulators for "
                             "head dim %d (made on another device, or for a smaller dh)", dh);
    return TKD_OK;
}

} // namespace

extern "C" tkd_status tkd_cuda_attn_bwd_sm90_supported(int dh)
{
    if (dh != 64 && dh != 128)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "tkd_cuda_attn_bwd_sm90: head dim %d is not supported (64 or 128)",
                             dh);
    return check_cc90("tkd_cuda_attn_bwd_sm90");
}

extern "C" tkd_status tkd_cuda_attn_bwd_sm90(const uint16_t *dy, const uint16_t *q, const uint16_t *k,
                                             const uint16_t *v, const uint16_t *y, const float *lse, int B, int T,
                                             int H, int Hkv, int dh, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                             tkd_cuda_attn_bwd_ws *ws, void *stream)
{
    TKD_TRY(tkd_cuda_attn_bwd_sm90_supported(dh));
    const uint16_t *const ptrs[] = {dy, q, k, v, y, dq, dk, dv};
    TKD_TRY(check_args(ptrs, 8, lse, B, T, H, Hkv, dh, ws));
    if (B == 0 || T == 0)
        return TKD_OK;
    cudaStream_t s = (cudaStream_t)stream;
    Params p = {};
    TKD_TRY(tkd_cuda_attn_bwd_prep(dy, y, lse, B, T, H, dh, ws, &p.Tp, s));
    p.lse2 = ws->lse2, p.dsum = ws->dsum, p.err = ws->err;
    p.T = T, p.H = H, p.Hkv = Hkv, p.grp = H / Hkv;
    p.scale_log2 = (float)(kLog2e / sqrt((double)dh));
    p.scale = (float)(1.0 / sqrt((double)dh));
    const Tensors x = {dy, q, k, v, B, T, H, Hkv};
    p.dk = dk, p.dv = dv, p.dq_acc = ws->dq_acc, p.dq_cnt = ws->dq_cnt;
    return dh == 64 ? launch<64>(x, p, dq, s) : launch<128>(x, p, dq, s);
}

extern "C" tkd_status tkd_cuda_attn_bwd_sm90_probe(const uint16_t *a, const uint16_t *b, int dh, float *c1,
                                                   float *c2, tkd_cuda_attn_bwd_ws *ws)
{
    TKD_TRY(tkd_cuda_attn_bwd_sm90_supported(dh));
    if (!a || !b || !c1 || !c2 || !ws || (((uintptr_t)a | (uintptr_t)b) & 15u) != 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tkd_cuda_attn_bwd_sm90_probe: bad pointer");
    CUtensorMap ta, tb;
    TKD_TRY(tmap_of(&ta, a, 1, kStr, 1, dh, kStr));
    TKD_TRY(tmap_of(&tb, b, 1, kStr, 1, dh, kStr));
    auto kernel = dh == 64 ? attn_bwd_sm90_probe_kernel<64> : attn_bwd_sm90_probe_kernel<128>;
    const size_t smem = 1024 + 2 * (size_t)kStr * dh * 2 + 8;
    TKD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<1, 128, smem>>>(ta, tb, c1, c2, ws->err);
    TKD_CUDA_CHECK(cudaGetLastError());
    return check_wait_flag(ws->err, "tkd_cuda_attn_bwd_sm90_probe");
}

extern "C" tkd_status tkd_cuda_attn_bwd_sm90_check(tkd_cuda_attn_bwd_ws *ws)
{
    return check_wait_flag(ws->err, "tkd_cuda_attn_bwd_sm90");
}
