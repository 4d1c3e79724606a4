/* attn_bwd_sm90.cu — see attn_bwd_sm90.h. Built for sm_90a only (kernels/CMakeLists.txt); the
 * wgmma/TMA/mbarrier plumbing is kernels/cuda/sm90_common.cuh's.
 *
 * The maths, per batch and query head (s_ij = q_i·k_j·c, c = 1/√dh; lse2 = lse·log2 e and
 * D_i = dy_i·y_i from the flash backward's prep kernel, attn_bwd_cuda.cu, in its workspace):
 *   P_ij = 2^(s_ij·log2e − lse2_i) (j ≤ i), dP_ij = dy_i·v_j, dS_ij = P_ij (dP_ij − D_i),
 *   dv_j = Σ_i P_ij dy_i, dk_j = c Σ_i dS_ij q_i, dq_i = c Σ_j dS_ij k_j,
 * dk and dv of a kv head summed over its group of query heads.
 *
 * Two kernels of the same shape, one CTA of three warpgroups each:
 *  - warpgroup 0, the producer: one thread issues the TMA loads. A "resident" tile of 128 rows
 *    (two operands, one 64-column box per 64 of dh, 128-byte swizzle) is loaded once per pass and
 *    "streamed" tiles of 64 rows (two operands, plus the rows' lse2 and D by plain bulk copies in
 *    the dK/dV kernel) go through a ring of kStages stages, each completing on its `full` mbarrier;
 *  - warpgroups 1 and 2, the consumers: each owns 64 rows of the resident tile (wgmma M = 64),
 *    computes per streamed tile the two 64 × 64 score blocks by wgmma from shared memory, P and dS
 *    in registers, and accumulates the gradient(s) of its 64 rows by wgmma with P or dS as the A
 *    operand from registers (the accumulator layout of a 64 × 16 block is the A fragment layout)
 *    and the streamed tile as an MN-major B operand (the same swizzled bytes, transpose flag set);
 *    it releases a stage (one arrival per warp) when its wgmmas are done.
 *  dK/dV kernel: resident K, V (128 keys of kv head g), streamed Q, dY (64 queries) of every query
 *    head of the group, from the tile holding the first key to T: Sᵀ = K Qᵀ, dPᵀ = V dYᵀ,
 *    dV += Pᵀ dY, dK += dSᵀ Q (scaled by c at the end). The GQA sum happens in the fp32
 *    accumulators, in a fixed order.
 *  dQ kernel: resident Q, dY (128 queries of one head), their lse2 and D; streamed K, V (64 keys)
 *    from the diagonal tile down to key 0: S = Q Kᵀ, dP = dY Vᵀ, dQ += dS K.
 * Every gradient row is written by one consumer warpgroup, once (no atomics, no partial sums in
 * memory): bit-identical results run to run, no workspace beyond prep's B·H·Tp floats twice. The
 * price is the dQ kernel's recomputation of the two score blocks: 7 matrix products per (query,
 * key) block instead of the 5 of an atomic dQ (1.4× the FLOPs counted as 2.5× the forward's).
 *
 * Causal balance: a CTA takes a pair of resident tiles, i and n − 1 − i (n = ceil(T / 128); the
 * middle one alone when n is odd), one after the other, so every CTA walks about n + 1 streamed
 * tiles per head: the grid (pairs, heads, B) is one even wave-set even when there are only 2 kv
 * heads (Qwen2.5-0.5B: 4 × 2 × 16 = 128 dK/dV CTAs on 132 SMs).
 *
 * Causal mask: tile starts are multiples of 64, so a consumer's 64 rows against a 64-row streamed
 * tile are either wholly visible (skip nothing), on the diagonal (same start: elementwise key >
 * query → P = 0), or wholly masked (the warpgroup skips the step but still releases the stage).
 * Ragged T: the tensor maps are 3-D (columns, T, B), so rows ≥ T of a box are zero-filled within
 * the batch; their lse2 is +inf and D 0 (prep pads to Tp), so P = 0 and they contribute nothing;
 * gradient rows ≥ T are not stored.
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
static_assert(kRes == TKD_ATTN_BWD_PAD, "the dQ kernel reads 128 lse2/D values per tile from the padded workspace");

/* Shared memory, byte offsets from a 1024-aligned base: the resident tiles, the ring's stages (two
 * streamed tiles each), the lse2/D vectors (dK/dV: 64 + 64 floats per stage; dQ: 128 + 128 for the
 * resident rows), the mbarriers. Each 64-column box of a tile is rows × 128 bytes. */
template <int DH>
struct Smem {
    static constexpr uint32_t kResBox = kRes * 128, kStrBox = kStr * 128;
    static constexpr uint32_t kResTile = kResBox * (DH / 64), kStrTile = kStrBox * (DH / 64);
    static constexpr uint32_t kStage0 = 2 * kResTile;
    static constexpr uint32_t kVec = kStage0 + 2 * kStages * kStrTile;
    static constexpr uint32_t kVecStage = kStages * 2 * kStr * 4, kVecRes = 2 * kRes * 4;
    static constexpr uint32_t kVecBytes = kVecStage > kVecRes ? kVecStage : kVecRes;
    static constexpr uint32_t kBar = kVec + kVecBytes;
    static constexpr size_t kBytes = 1024 + kBar + 8 * (2 * kStages + 2);
    static_assert(kResBox % 1024 == 0 && kStrBox % 1024 == 0, "swizzled boxes need 1024-byte alignment");
};

__device__ inline uint32_t full_bar(uint32_t bar0, int s) { return bar0 + 8 * s; }
__device__ inline uint32_t empty_bar(uint32_t bar0, int s) { return bar0 + 8 * (kStages + s); }
__device__ inline uint32_t res_full_bar(uint32_t bar0) { return bar0 + 8 * (2 * kStages); }
__device__ inline uint32_t res_empty_bar(uint32_t bar0) { return bar0 + 8 * (2 * kStages + 1); }

struct Params {
    uint16_t *g0, *g1;        /* dK/dV kernel: dk, dv (B·T, Hkv·dh); dQ kernel: dq (B·T, H·dh) */
    const float *lse2, *dsum; /* (B, H, Tp) */
    int T, Tp, H, Hkv, grp;   /* grp = H / Hkv */
    int ntiles;               /* resident tiles: ceil(T / 128) */
    float scale_log2;         /* log2(e) / √dh */
    float scale;              /* 1 / √dh */
    unsigned *err;
};

/* The CTA's passes: resident tiles blockIdx.x and ntiles − 1 − blockIdx.x (one pass when equal). */
__device__ inline int n_passes(int ntiles) { return 2 * (int)blockIdx.x + 1 == ntiles ? 1 : 2; }
__device__ inline int pass_tile(int pass, int ntiles)
{
    return pass == 0 ? (int)blockIdx.x : ntiles - 1 - (int)blockIdx.x;
}

/* dQ kernel: the last 64-key tile that query rows [q0, q0 + 128) see. */
__device__ inline int last_key_tile(int q0, int T) { return (min(q0 + kRes, T) - 1) / kStr; }

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

/* s = A0 · B0ᵀ and dp = A1 · B1ᵀ (64 × 64 fp32 fragments, K = DH), waited for: A0, A1 64 rows at
 * a0, a1 whose 64-column boxes are abox bytes apart, B0, B1 64 rows at b0, b1 (boxes bbox apart),
 * all K-major and 128-byte swizzled. */
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
#pragma unroll
    for (int kk = 0; kk < DH / 16; kk++)
        wgmma_ss_n64(dp, smem_desc(a1 + (kk / 4) * abox + (kk % 4) * 32),
                     smem_desc(b1 + (kk / 4) * bbox + (kk % 4) * 32), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
    fence_regs(dp);
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

/* dK/dV kernel, P and dS in place on the transposed blocks (rows: the warpgroup's 64 keys;
 * columns: the step's 64 queries, whose lse2 and D are l2[col], dd[col] in shared memory). On the
 * diagonal (both start together) keys after their query get P = 0. */
__device__ __forceinline__ void p_ds_keys(float (&s)[32], float (&dp)[32], const float *l2, const float *dd,
                                          float scale_log2, bool diag)
{
    const int lane = threadIdx.x & 31, row = 16 * ((threadIdx.x / 32) & 3) + lane / 4;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int col = 8 * j + 2 * (lane & 3);
        const float2 l = *reinterpret_cast<const float2 *>(l2 + col);
        const float2 d = *reinterpret_cast<const float2 *>(dd + col);
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int i = 4 * j + 2 * h + e;
                float p = fast_exp2(fmaf(s[i], scale_log2, -(e ? l.y : l.x)));
                if (diag && row + 8 * h > col + e)
                    p = 0.f;
                s[i] = p;
                dp[i] = p * (dp[i] - (e ? d.y : d.x));
            }
    }
}

/* dQ kernel, P and dS in place (rows: the warpgroup's 64 queries, this thread's two with lse2
 * l2[h] and D d[h]; columns: the step's 64 keys). On the diagonal keys after the query get P = 0. */
__device__ __forceinline__ void p_ds_queries(float (&s)[32], float (&dp)[32], const float (&l2)[2],
                                             const float (&d)[2], float scale_log2, bool diag)
{
    const int lane = threadIdx.x & 31, row = 16 * ((threadIdx.x / 32) & 3) + lane / 4;
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int i = 4 * j + 2 * h + e;
                float p = fast_exp2(fmaf(s[i], scale_log2, -l2[h]));
                if (diag && 8 * j + 2 * (lane & 3) + e > row + 8 * h)
                    p = 0.f;
                s[i] = p;
                dp[i] = p * (dp[i] - d[h]);
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

/* dK/dV kernel's producer (one thread): per pass the K and V tile of kv head g, then for each
 * query head of the group and each 64-query tile from the resident tile's first key to T, the Q
 * and dY tiles and their lse2 and D. */
template <int DH>
__device__ void dkv_produce(const CUtensorMap *tk, const CUtensorMap *tv, const CUtensorMap *tq,
                            const CUtensorMap *tdy, const Params &p, uint32_t base, int g, int b)
{
    using S = Smem<DH>;
    const uint32_t bar0 = base + S::kBar;
    const int nq = (p.T + kStr - 1) / kStr;
    Ring<kStages> r;
    for (int pass = 0; pass < n_passes(p.ntiles); pass++) {
        const int k0 = pass_tile(pass, p.ntiles) * kRes, per_h = nq - k0 / kStr;
        mbar_wait(res_empty_bar(bar0), (pass & 1) ^ 1u, r.failed, p.err);
        mbar_arrive_expect_tx(res_full_bar(bar0), 2 * S::kResTile);
        load_tile<DH>(base, tk, S::kResBox, g * DH, k0, b, res_full_bar(bar0));
        load_tile<DH>(base + S::kResTile, tv, S::kResBox, g * DH, k0, b, res_full_bar(bar0));
        for (int s = 0; s < p.grp * per_h; s++) {
            const int h = g * p.grp + s / per_h, q0 = k0 + (s % per_h) * kStr;
            const uint32_t full = stage_acquire(r, bar0, 2 * S::kStrTile + 2 * kStr * 4, p.err);
            const uint32_t st = base + S::kStage0 + 2 * r.stage * S::kStrTile;
            const uint32_t vec = base + S::kVec + r.stage * 2 * kStr * 4;
            load_tile<DH>(st, tq, S::kStrBox, h * DH, q0, b, full);
            load_tile<DH>(st + S::kStrTile, tdy, S::kStrBox, h * DH, q0, b, full);
            const int64_t w = ((int64_t)b * p.H + h) * p.Tp + q0; /* q0 + 64 ≤ Tp: prep padded */
            bulk_load(vec, p.lse2 + w, kStr * 4, full);
            bulk_load(vec + kStr * 4, p.dsum + w, kStr * 4, full);
            r.next();
        }
    }
}

/* dQ kernel's producer (one thread): per pass the Q and dY tile of query head h with their lse2 and
 * D, then the K and V tiles of its kv head from the last one the tile sees down to key 0. */
template <int DH>
__device__ void dq_produce(const CUtensorMap *tq, const CUtensorMap *tdy, const CUtensorMap *tk,
                           const CUtensorMap *tv, const Params &p, uint32_t base, int h, int b)
{
    using S = Smem<DH>;
    const uint32_t bar0 = base + S::kBar, g = h / p.grp;
    Ring<kStages> r;
    for (int pass = 0; pass < n_passes(p.ntiles); pass++) {
        const int q0 = pass_tile(pass, p.ntiles) * kRes, last = last_key_tile(q0, p.T);
        const uint32_t res = res_full_bar(bar0);
        mbar_wait(res_empty_bar(bar0), (pass & 1) ^ 1u, r.failed, p.err);
        mbar_arrive_expect_tx(res, 2 * S::kResTile + 2 * kRes * 4);
        load_tile<DH>(base, tq, S::kResBox, h * DH, q0, b, res);
        load_tile<DH>(base + S::kResTile, tdy, S::kResBox, h * DH, q0, b, res);
        const int64_t w = ((int64_t)b * p.H + h) * p.Tp + q0; /* q0 + 128 ≤ Tp */
        bulk_load(base + S::kVec, p.lse2 + w, kRes * 4, res);
        bulk_load(base + S::kVec + kRes * 4, p.dsum + w, kRes * 4, res);
        for (int j = last; j >= 0; j--) {
            const uint32_t full = stage_acquire(r, bar0, 2 * S::kStrTile, p.err);
            const uint32_t st = base + S::kStage0 + 2 * r.stage * S::kStrTile;
            load_tile<DH>(st, tk, S::kStrBox, g * DH, j * kStr, b, full);
            load_tile<DH>(st + S::kStrTile, tv, S::kStrBox, g * DH, j * kStr, b, full);
            r.next();
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
    if ((threadIdx.x & 31) == 0)
        mbar_arrive(bar);
}

/* dK/dV kernel, one step of consumer warpgroup cw: the streamed Q and dY tile in stage `stage`. */
template <int DH>
__device__ __forceinline__ void dkv_step(float (&dk)[DH / 2], float (&dv)[DH / 2], const Params &p, uint32_t base,
                                         const unsigned char *sp, int stage, int cw, bool diag)
{
    using S = Smem<DH>;
    const uint32_t sq = base + S::kStage0 + 2 * stage * S::kStrTile, sdy = sq + S::kStrTile;
    const uint32_t mine = cw * kRows * 128; /* the warpgroup's 64 rows of a resident box */
    const float *l2 = reinterpret_cast<const float *>(sp + S::kVec + stage * 2 * kStr * 4);
    float s[32], dp[32];
    scores<DH>(s, dp, base + mine, base + S::kResTile + mine, S::kResBox, sq, sdy, S::kStrBox); /* Sᵀ, dPᵀ */
    p_ds_keys(s, dp, l2, l2 + kStr, p.scale_log2, diag);
    uint32_t pa[4][4], dsa[4][4];
    to_a_frags(pa, s);
    to_a_frags(dsa, dp);
    fence_regs(dv);
    fence_regs(dk);
    wgmma_fence();
    mma_rs<DH>(dv, pa, sdy, S::kStrBox); /* dV += Pᵀ dY */
    mma_rs<DH>(dk, dsa, sq, S::kStrBox); /* dK += dSᵀ Q */
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(dv);
    fence_regs(dk);
    fence_frags(pa);
    fence_frags(dsa);
}

/* dK/dV kernel, consumer warpgroup cw: keys k0 + 64·cw .. of each pass against every streamed step;
 * steps wholly before its keys are skipped (the stage is still released). */
template <int DH>
__device__ void dkv_consume(const Params &p, uint32_t base, const unsigned char *sp, int cw, int g, int b)
{
    const uint32_t bar0 = base + Smem<DH>::kBar;
    const int nq = (p.T + kStr - 1) / kStr;
    const int64_t ld = (int64_t)p.Hkv * DH, off = (int64_t)b * p.T * ld + (int64_t)g * DH;
    Ring<kStages> r;
    float dk[DH / 2], dv[DH / 2];
    for (int pass = 0; pass < n_passes(p.ntiles); pass++) {
        const int k0 = pass_tile(pass, p.ntiles) * kRes, kw = k0 + cw * kRows, per_h = nq - k0 / kStr;
        zero_regs(dk);
        zero_regs(dv);
        consumer_wait(res_full_bar(bar0), pass & 1, r, p.err);
        for (int s = 0; s < p.grp * per_h; s++) {
            const int q0 = k0 + (s % per_h) * kStr;
            consumer_wait(full_bar(bar0, r.stage), r.phase, r, p.err);
            if (q0 >= kw)
                dkv_step<DH>(dk, dv, p, base, sp, r.stage, cw, q0 == kw);
            consumer_release(empty_bar(bar0, r.stage));
            r.next();
        }
        consumer_release(res_empty_bar(bar0)); /* every wgmma reading K and V has completed */
        store_rows<DH>(p.g0 + off, ld, dk, p.scale, kw, p.T);
        store_rows<DH>(p.g1 + off, ld, dv, 1.f, kw, p.T);
    }
}

/* dQ kernel, one step of consumer warpgroup cw: the streamed K and V tile in stage `stage`. */
template <int DH>
__device__ __forceinline__ void dq_step(float (&dq)[DH / 2], const float (&l2)[2], const float (&d)[2],
                                        const Params &p, uint32_t base, int stage, int cw, bool diag)
{
    using S = Smem<DH>;
    const uint32_t sk = base + S::kStage0 + 2 * stage * S::kStrTile, sv = sk + S::kStrTile;
    const uint32_t mine = cw * kRows * 128;
    float s[32], dp[32];
    scores<DH>(s, dp, base + mine, base + S::kResTile + mine, S::kResBox, sk, sv, S::kStrBox); /* S, dP */
    p_ds_queries(s, dp, l2, d, p.scale_log2, diag);
    uint32_t dsa[4][4];
    to_a_frags(dsa, dp);
    fence_regs(dq);
    wgmma_fence();
    mma_rs<DH>(dq, dsa, sk, S::kStrBox); /* dQ += dS K */
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(dq);
    fence_frags(dsa);
}

/* dQ kernel, consumer warpgroup cw: query rows q0 + 64·cw .. of each pass against the key tiles
 * the producer streams (last down to 0); tiles wholly after its rows are skipped. */
template <int DH>
__device__ void dq_consume(const Params &p, uint32_t base, const unsigned char *sp, int cw, int h, int b)
{
    const uint32_t bar0 = base + Smem<DH>::kBar;
    const int64_t ld = (int64_t)p.H * DH, off = (int64_t)b * p.T * ld + (int64_t)h * DH;
    const float *vl = reinterpret_cast<const float *>(sp + Smem<DH>::kVec), *vd = vl + kRes;
    const int mine = cw * kRows + 16 * ((threadIdx.x / 32) & 3) + (threadIdx.x & 31) / 4;
    Ring<kStages> r;
    float dq[DH / 2];
    for (int pass = 0; pass < n_passes(p.ntiles); pass++) {
        const int q0 = pass_tile(pass, p.ntiles) * kRes, r0 = q0 + cw * kRows;
        zero_regs(dq);
        consumer_wait(res_full_bar(bar0), pass & 1, r, p.err);
        const float l2[2] = {vl[mine], vl[mine + 8]}, d[2] = {vd[mine], vd[mine + 8]};
        for (int j = last_key_tile(q0, p.T); j >= 0; j--) {
            consumer_wait(full_bar(bar0, r.stage), r.phase, r, p.err);
            if (j * kStr <= r0)
                dq_step<DH>(dq, l2, d, p, base, r.stage, cw, j * kStr == r0);
            consumer_release(empty_bar(bar0, r.stage));
            r.next();
        }
        consumer_release(res_empty_bar(bar0)); /* Q, dY read; lse2 and D in registers */
        store_rows<DH>(p.g0 + off, ld, dq, p.scale, r0, p.T);
    }
}

/* ---- the kernels -------------------------------------------------------------------------------- */

/* kDQ false: the dK/dV kernel, grid (pairs of 128-key tiles, Hkv, B), maps t0, t1 = K, V (boxes of
 * 128 rows) and t2, t3 = Q, dY (64 rows). kDQ true: the dQ kernel, grid (pairs of 128-query tiles, H,
 * B), t0, t1 = Q, dY (128 rows), t2, t3 = K, V (64 rows). 384 threads, Smem<DH>::kBytes dynamic. */
template <int DH, bool kDQ>
__global__ void __launch_bounds__(kThreads, 1)
attn_bwd_sm90_kernel(const __grid_constant__ CUtensorMap t0, const __grid_constant__ CUtensorMap t1,
                     const __grid_constant__ CUtensorMap t2, const __grid_constant__ CUtensorMap t3, const Params p)
{
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
    const unsigned char *sp = smem_raw + (base - raw);
    const uint32_t bar0 = base + Smem<DH>::kBar;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; s++) {
            mbar_init(full_bar(bar0, s), 1);               /* the producer's expect_tx */
            mbar_init(empty_bar(bar0, s), 4 * kConsumers); /* one arrival per consumer warp */
        }
        mbar_init(res_full_bar(bar0), 1);
        mbar_init(res_empty_bar(bar0), 4 * kConsumers);
        mbar_init_fence();
    }
    __syncthreads();
    const int head = blockIdx.y, b = blockIdx.z;
    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            if constexpr (kDQ)
                dq_produce<DH>(&t0, &t1, &t2, &t3, p, base, head, b);
            else
                dkv_produce<DH>(&t0, &t1, &t2, &t3, p, base, head, b);
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        if constexpr (kDQ)
            dq_consume<DH>(p, base, sp, threadIdx.x / 128 - 1, head, b);
        else
            dkv_consume<DH>(p, base, sp, threadIdx.x / 128 - 1, head, b);
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

template <int DH, bool kDQ>
tkd_status launch_one(const CUtensorMap (&tm)[4], const Params &p, int heads, int B, cudaStream_t stream)
{
    const size_t smem = Smem<DH>::kBytes;
    TKD_CUDA_CHECK(cudaFuncSetAttribute(attn_bwd_sm90_kernel<DH, kDQ>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
    const dim3 grid((unsigned)((p.ntiles + 1) / 2), (unsigned)heads, (unsigned)B);
    attn_bwd_sm90_kernel<DH, kDQ><<<grid, kThreads, smem, stream>>>(tm[0], tm[1], tm[2], tm[3], p);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

struct Tensors {
    const uint16_t *dy, *q, *k, *v;
    int B, T, H, Hkv;
};

/* The dK/dV kernel, then the dQ kernel, on stream. */
template <int DH>
tkd_status launch(const Tensors &x, Params p, uint16_t *dq, uint16_t *dk, uint16_t *dv, cudaStream_t stream)
{
    CUtensorMap res[4], str[4]; /* q, dy, k, v with boxes of 128 rows, and of 64 */
    const uint16_t *src[4] = {x.q, x.dy, x.k, x.v};
    for (int i = 0; i < 4; i++) {
        const int heads = i < 2 ? x.H : x.Hkv;
        TKD_TRY(tmap_of(&res[i], src[i], x.B, x.T, heads, DH, kRes));
        TKD_TRY(tmap_of(&str[i], src[i], x.B, x.T, heads, DH, kStr));
    }
    p.g0 = dk, p.g1 = dv;
    const CUtensorMap dkv_maps[4] = {res[2], res[3], str[0], str[1]};
    TKD_TRY((launch_one<DH, false>(dkv_maps, p, x.Hkv, x.B, stream)));
    p.g0 = dq, p.g1 = NULL;
    const CUtensorMap dq_maps[4] = {res[0], res[1], str[2], str[3]};
    return launch_one<DH, true>(dq_maps, p, x.H, x.B, stream);
}

tkd_status check_args(const uint16_t *const *ptrs, int n, const float *lse, int B, int T, int H, int Hkv,
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
    TKD_TRY(check_args(ptrs, 8, lse, B, T, H, Hkv, ws));
    if (B == 0 || T == 0)
        return TKD_OK;
    cudaStream_t s = (cudaStream_t)stream;
    Params p = {};
    TKD_TRY(tkd_cuda_attn_bwd_prep(dy, y, lse, B, T, H, dh, ws, &p.Tp, s));
    p.lse2 = ws->lse2, p.dsum = ws->dsum, p.err = ws->err;
    p.T = T, p.H = H, p.Hkv = Hkv, p.grp = H / Hkv;
    p.ntiles = (T + kRes - 1) / kRes;
    p.scale_log2 = (float)(kLog2e / sqrt((double)dh));
    p.scale = (float)(1.0 / sqrt((double)dh));
    const Tensors x = {dy, q, k, v, B, T, H, Hkv};
    return dh == 64 ? launch<64>(x, p, dq, dk, dv, s) : launch<128>(x, p, dq, dk, dv, s);
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
