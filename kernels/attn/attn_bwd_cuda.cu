/* attn_bwd_cuda.cu — see attn_cuda.h. The backward of the causal GQA flash-attention forward
 * (attn_cuda.cu), flash-attention-2 style, deterministic: bf16 tensor-core MMAs (m16n8k16, fp32
 * accumulation) fed by ldmatrix, tiles double-buffered with cp.async, no atomics.
 *
 * The maths (per batch and query head; s_ij = q_i·k_j·c, c = 1/sqrt(dh), lse_i from the forward):
 *   P_ij = exp(s_ij − lse_i) (j ≤ i, else 0), dP_ij = dy_i·v_j, D_i = dy_i·y_i = Σ_j P_ij dP_ij,
 *   dS_ij = P_ij (dP_ij − D_i), dv_j += Σ_i P_ij dy_i, dk_j += c Σ_i dS_ij q_i, dq_i += c Σ_j dS_ij k_j,
 * dk and dv of a kv head summing over the H / Hkv query heads that read it.
 *
 * Three kernels:
 *  - prep: one warp per (b, h, t): D (fp32 dot of the bf16 dy and y rows) and lse2 = lse·log2(e),
 *    into the workspace as (B, H, Tp) with Tp = T rounded up to 128; the padded rows get D = 0 and
 *    lse2 = +inf, so that P = 2^(s·c·log2(e) − lse2) = 0 there and no kernel below needs a test
 *    for rows ≥ T.
 *  - dkv: one CTA of 8 warps per (128-key tile, kv head, batch), heaviest (earliest) key tiles
 *    first in the grid. Warp w owns keys k0 + 16w .. +15: their K and V rows as A fragments and
 *    their dK, dV (16 × dh fp32 each) in registers. The CTA walks the steps (query head of the
 *    group, 64-query tile from the diagonal to T), Q, dY, lse2 and D of step s + 1 copied into the
 *    other smem stage while step s is computed. Per step the warp works on the transposed scores,
 *    keys as rows: for each 16-query chunk not wholly before its keys, Sᵀ = K Qᵀ and dPᵀ = V dYᵀ
 *    (16 × 16), Pᵀ and dSᵀ elementwise (queries are columns, so lse2 and D are per column), then
 *    dV += Pᵀ dY and dK += dSᵀ Q with Pᵀ and dSᵀ rounded to bf16 as A fragments. No row
 *    reductions are needed (lse is known), so 16-query chunks keep the registers for S small.
 *  - dq: one CTA of 8 warps per (128-query tile, query head, batch), the forward's layout: warp w
 *    owns rows q0 + 16w .. +15 (Q and dY A fragments, lse2, D and dQ 16 × dh fp32 in registers)
 *    and walks the 64-key tiles from the diagonal down to 0, K and V double-buffered; per 16-key
 *    chunk S = Q Kᵀ, dP = dY Vᵀ, dS, then dQ += dS K.
 * Every gradient element is written by exactly one CTA, in a fixed order: bit-identical results
 * run to run. The price against an atomic dQ from the dkv kernel: the dq kernel recomputes Q Kᵀ
 * and dY Vᵀ, 7 tile products per (query, key) pair instead of 5.
 *
 * Causal mask: a chunk of 16 keys and 16 queries, both starting at multiples of 16, is skipped
 * when its first key is after its first query (then every key is after every query), masked
 * elementwise when both start together, and taken whole otherwise. Keys ≥ T (zero-filled) are
 * after every real query, so only padded queries (P = 0 by lse2 = +inf) meet them unmasked.
 *
 * Window and documents (tkd_cuda_attn_bwd_masked; both kernels built a second time, kMask): query
 * i sees key j iff first_key(i) ≤ j ≤ i, equivalently j ≤ i < query_end(j) (attn_cuda_common.cuh;
 * both bounds non-decreasing). The dq CTA stages first_key of its 128 rows in smem and walks key
 * tiles only down to its first row's first key; a warp skips a tile or chunk wholly before its
 * first row's first key, and masks one elementwise when it reaches below its last row's. The dkv
 * CTA stages query_end of its 128 keys (a bisection over doc per key) and walks query tiles only up
 * to its last key's; a warp skips a chunk of queries all at or past its last key's end, and masks
 * one elementwise when it reaches past its first key's. Masking sets P (so dS) to 0: a masked
 * score above the row's lse cannot leak an inf. Rows are never wholly masked (i sees itself).
 *
 * Fragment layouts and smem padding: attn_cuda_common.cuh.
 */
#include "kernels/attn/attn_cuda.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/status.h"
#include "kernels/attn/attn_bwd_cuda_internal.h"
#include "kernels/attn/attn_bwd_sm90.h"
#include "kernels/attn/attn_cuda_common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"

namespace {

using namespace tkd_attn;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kPad = TKD_ATTN_BWD_PAD; /* Tp: T rounded up to this */
constexpr int kKvKeys = 16 * kWarps;  /* dkv: keys per CTA */
constexpr int kKvQ = 64;              /* dkv: queries per step */
constexpr int kQRows = 16 * kWarps;   /* dq: query rows per CTA */
constexpr int kQKeys = 64;            /* dq: keys per K/V tile */
constexpr double kLog2e = 1.4426950408889634;

struct BwdArgs {
    const uint16_t *dy, *q;  /* (B·T, H·dh) bf16 */
    const uint16_t *k, *v;   /* (B·T, Hkv·dh) bf16 */
    const float *lse2;       /* (B, H, Tp) */
    const float *dsum;       /* (B, H, Tp) */
    uint16_t *dq;            /* (B·T, H·dh) bf16 +=, or NULL */
    uint16_t *dk, *dv;       /* (B·T, Hkv·dh) bf16 +=, each may be NULL */
    int T, Tp, H, Hkv, grp;  /* grp = H / Hkv */
    int n_qt;                /* dq kernel's query tiles: ceil(T / kQRows) */
    float scale_log2;        /* log2(e) / sqrt(dh) */
    float scale;             /* 1 / sqrt(dh) */
    int window;              /* the kMask kernels': 0 or the sliding window (< T) */
    const int32_t *doc;      /* the kMask kernels': (B·T) document starts, or NULL */
};

/* Shared memory of the dkv kernel: K, V (128, LD) once; Q[2], dY[2] (64, LD); lse2[2], D[2] (64);
 * with kMask the keys' query_end (128 ints). */
template <int DH, bool kMask> struct KvGeo {
    static constexpr int LD = DH + 8;
    static constexpr int QS = kKvQ * LD; /* one Q or dY stage, elements */
    static constexpr size_t SMEM = (size_t)(2 * kKvKeys * LD + 4 * QS) * 2 + 4 * kKvQ * sizeof(float) +
                                   (kMask ? kKvKeys * sizeof(int) : 0);
};

/* Shared memory of the dq kernel: Q, dY (128, LD) once; K[2], V[2] (64, LD); lse2, D (128); with
 * kMask the rows' first_key (128 ints). */
template <int DH, bool kMask> struct QGeo {
    static constexpr int LD = DH + 8;
    static constexpr int KS = kQKeys * LD; /* one K or V stage, elements */
    static constexpr size_t SMEM = (size_t)(2 * kQRows * LD + 4 * KS) * 2 + 2 * kQRows * sizeof(float) +
                                   (kMask ? kQRows * sizeof(int) : 0);
};

/* ---- prep ---------------------------------------------------------------------------------- */

/* One warp per row r = (b·H + h)·Tp + t of the workspace: D = Σ_d dy·y (fp32, lanes stride the
 * bf16 pairs, then a fixed butterfly) and lse2 = lse·log2(e); rows t ≥ T get D = 0, lse2 = +inf. */
__global__ void __launch_bounds__(kThreads) attn_bwd_prep_kernel(const uint16_t *dy, const uint16_t *y,
                                                                 const float *lse, float *lse2, float *dsum,
                                                                 int64_t rows, int T, int Tp, int H, int dh)
{
    const int64_t r = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows)
        return;
    const int64_t bh = r / Tp;
    const int t = (int)(r % Tp);
    if (t >= T) {
        if (lane == 0)
            lse2[r] = INFINITY, dsum[r] = 0.f;
        return;
    }
    const int64_t off = (((bh / H) * T + t) * H + bh % H) * dh;
    const __nv_bfloat162 *a = reinterpret_cast<const __nv_bfloat162 *>(dy + off);
    const __nv_bfloat162 *c = reinterpret_cast<const __nv_bfloat162 *>(y + off);
    float s = 0.f;
    for (int i = lane; i < dh / 2; i += 32) {
        const float2 x = __bfloat1622float2(a[i]), z = __bfloat1622float2(c[i]);
        s = fmaf(x.x, z.x, s);
        s = fmaf(x.y, z.y, s);
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, m);
    if (lane == 0)
        dsum[r] = s, lse2[r] = lse[bh * T + t] * (float)kLog2e;
}

/* ---- shared pieces of dkv and dq ------------------------------------------------------------ */

/* Starts copying n floats (a multiple of 4, 16-byte aligned at both ends) to smem, one 16-byte
 * chunk per thread from thread `first` on. */
__device__ __forceinline__ void load_floats(float *s, const float *g, int n, int first)
{
    const int c = (int)threadIdx.x - first;
    if (c >= 0 && c < n / 4)
        cp_async16(smem_addr(s + 4 * c), g + 4 * c, 16);
}

/* P and dS in place for one 16 × 16 chunk of C fragments: p = 2^(s·scale_log2 − l2), ds =
 * p·(dp − d). l2 and d are per element ([nt][e]); when `part` (the chunk is partly masked: causal,
 * its rows and columns start at the same position; or the window or a document cuts it), elements
 * hidden(nt, e) get p = 0. */
template <typename Hidden>
__device__ __forceinline__ void p_ds(float s[2][4], float dp[2][4], const float l2[2][4], const float d[2][4],
                                     float scale_log2, bool part, Hidden hidden)
{
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float p = fast_exp2(fmaf(s[nt][e], scale_log2, -l2[nt][e]));
            if (part && hidden(nt, e))
                p = 0.f;
            s[nt][e] = p;
            dp[nt][e] = p * (dp[nt][e] - d[nt][e]);
        }
}

/* The kMask kernels' element mask of one partly masked chunk, as bit 4nt + e for C fragment element
 * [nt][e] (hidden(nt, e)): computed before the chunk's products, so that one register, not the
 * positions and bounds, is live beside S and dP. */
template <typename Hidden>
__device__ __forceinline__ unsigned hidden_bits(Hidden hidden)
{
    unsigned m = 0;
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            m |= hidden(nt, e) ? 1u << (4 * nt + e) : 0u;
    return m;
}

/* g (rows, ld) += acc·mul as bf16 for a warp's 16 rows starting at global row r0 (C fragments,
 * acc[dt] = columns 8dt .. 8dt+7 of the head at g); rows ≥ T are skipped. One rounding per
 * element (bf16(old + new) in fp32). */
template <int DH>
__device__ __forceinline__ void add_rows_bf16(uint16_t *g, int64_t ld, const float acc[DH / 8][4], float mul,
                                              int r0, int T, int lane)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = r0 + (lane >> 2) + 8 * r;
        if (row >= T)
            continue;
        uint32_t *p = reinterpret_cast<uint32_t *>(g + (int64_t)row * ld + (lane & 3) * 2);
#pragma unroll
        for (int dt = 0; dt < DH / 8; dt++) {
            __nv_bfloat162 old;
            memcpy(&old, &p[dt * 4], 4);
            const float2 o = __bfloat1622float2(old);
            p[dt * 4] = pack_bf16(fmaf(acc[dt][2 * r], mul, o.x), fmaf(acc[dt][2 * r + 1], mul, o.y));
        }
    }
}

template <int DH>
__device__ __forceinline__ void zero_acc(float acc[DH / 8][4])
{
#pragma unroll
    for (int dt = 0; dt < DH / 8; dt++)
        acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
}

/* ---- dkv ----------------------------------------------------------------------------------- */

/* Starts the copies of one dkv step: Q and dY rows [q0, q0 + 64) of head h (zero past T) and
 * their lse2 and D (the workspace is padded, so always in range). */
template <int DH>
__device__ __forceinline__ void dkv_load_step(const BwdArgs &a, uint16_t *sq, uint16_t *sdy, float *sl,
                                              float *sd, int b, int h, int q0)
{
    const int64_t qld = (int64_t)a.H * DH, off = (int64_t)b * a.T * qld + (int64_t)h * DH;
    const int64_t w = ((int64_t)b * a.H + h) * a.Tp + q0;
    load_rows<DH, kKvQ, kThreads>(sq, a.q + off, qld, q0, a.T);
    load_rows<DH, kKvQ, kThreads>(sdy, a.dy + off, qld, q0, a.T);
    load_floats(sl, a.lse2 + w, kKvQ, 0);
    load_floats(sd, a.dsum + w, kKvQ, kKvQ / 4);
}

/* One warp, one step: its 16 keys kw.. against the 64 queries q0.. staged in sq, sdy (64, LD),
 * sl, sd (64). dv += Pᵀ dY, dk += dSᵀ Q (unscaled), chunk by chunk of 16 queries. Sᵀ C fragments:
 * element [nt][e] is key kw + g + 8(e >> 1), query qc + 8nt + 2t + (e & 1) (lane = 4g + t).
 * kMask: qend (16) is query_end of the warp's keys (smem). */
template <int DH, bool kMask>
__device__ __forceinline__ void dkv_step(float dk[DH / 8][4], float dv[DH / 8][4], const uint32_t kf[DH / 16][4],
                                         const uint32_t vf[DH / 16][4], const uint16_t *sq, const uint16_t *sdy,
                                         const float *sl, const float *sd, const int *qend, int kw, int q0,
                                         int lane, float scale_log2)
{
    constexpr int LD = DH + 8;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int c = 0; c < kKvQ / 16; c++) {
        const int qc = q0 + 16 * c;
        if (kw > qc)
            continue; /* every key of the warp is after every query of the chunk */
        if (kMask && qc >= qend[15])
            continue; /* every query of the chunk is past every key's window or document */
        /* partly masked: the diagonal, or a query past the first key's end */
        const bool part = kw == qc || (kMask && qc + 15 >= qend[0]);
        unsigned hide = 0;
        if (kMask && part) {
            const int ke[2] = {qend[g], qend[g + 8]}; /* query_end of the lane's keys g, g + 8 */
            hide = hidden_bits([&](int nt, int e) {
                const int key = kw + g + 8 * (e >> 1), qry = qc + 8 * nt + 2 * t + (e & 1);
                return key > qry || qry >= ke[e >> 1];
            });
        }
        float s[2][4], dp[2][4], l2[2][4], d[2][4];
        mma_abt_16<DH>(s, kf, sq + 16 * c * LD, lane);   /* Sᵀ = K Qᵀ */
        mma_abt_16<DH>(dp, vf, sdy + 16 * c * LD, lane); /* dPᵀ = V dYᵀ */
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            const int col = 16 * c + 8 * nt + 2 * t; /* query within the step */
            l2[nt][0] = l2[nt][2] = sl[col], l2[nt][1] = l2[nt][3] = sl[col + 1];
            d[nt][0] = d[nt][2] = sd[col], d[nt][1] = d[nt][3] = sd[col + 1];
        }
        p_ds(s, dp, l2, d, scale_log2, kMask ? part : kw == qc, [&](int nt, int e) {
            if constexpr (kMask)
                return ((hide >> (4 * nt + e)) & 1u) != 0;
            return g + 8 * (e >> 1) > 8 * nt + 2 * t + (e & 1); /* the diagonal chunk: key after query */
        });
        uint32_t pa[4], dsa[4];
        frag_c_to_a(pa, s);
        frag_c_to_a(dsa, dp);
        mma_ab_acc<DH>(dv, pa, sdy + 16 * c * LD, lane); /* dV += Pᵀ dY */
        mma_ab_acc<DH>(dk, dsa, sq + 16 * c * LD, lane); /* dK += dSᵀ Q */
    }
}

/* One CTA: keys [k0, k0 + 128) of kv head g in batch b against every query q ≥ k0 of the query
 * heads g·grp .. g·grp + grp − 1 (kMask: up to the last key's query_end). Steps, pipeline and
 * layouts: see the file comment. */
template <int DH, bool kMask>
__global__ void __launch_bounds__(kThreads, DH <= 64 ? 2 : 1) attn_bwd_dkv_kernel(const BwdArgs a)
{
    extern __shared__ __align__(16) uint16_t smem[];
    constexpr int LD = KvGeo<DH, kMask>::LD, QS = KvGeo<DH, kMask>::QS;
    uint16_t *sk = smem, *sv = sk + kKvKeys * LD, *sq = sv + kKvKeys * LD, *sdy = sq + 2 * QS;
    float *sl = reinterpret_cast<float *>(sdy + 2 * QS), *sd = sl + 2 * kKvQ; /* [2][64] each */
    int *sqend = reinterpret_cast<int *>(sd + 2 * kKvQ);                      /* kMask: (128) */
    const int b = blockIdx.x / a.Hkv, g = blockIdx.x % a.Hkv, k0 = blockIdx.y * kKvKeys;
    const int64_t kvld = (int64_t)a.Hkv * DH, kv_off = (int64_t)b * a.T * kvld + (int64_t)g * DH;
    const int qt0 = k0 / kKvQ; /* the CTA's queries: tiles qt0 .. qt0 + n_q − 1 */
    int n_q = (a.T + kKvQ - 1) / kKvQ - qt0, n_steps = a.grp * n_q;

    load_rows<DH, kKvKeys, kThreads>(sk, a.k + kv_off, kvld, k0, a.T);
    load_rows<DH, kKvKeys, kThreads>(sv, a.v + kv_off, kvld, k0, a.T);
    dkv_load_step<DH>(a, sq, sdy, sl, sd, b, g * a.grp, qt0 * kKvQ);
    cp_async_commit();

    if (kMask) { /* query_end of each key (keys ≥ T take the last one's: T), while the tiles load */
        const int32_t *doc = a.doc ? a.doc + (int64_t)b * a.T : nullptr;
        if (threadIdx.x < kKvKeys)
            sqend[threadIdx.x] = query_end(min(k0 + (int)threadIdx.x, a.T - 1), a.T, a.window, doc);
        __syncthreads();
        /* the queries [k0, the last key's query_end): query_end is non-decreasing */
        n_q = (sqend[kKvKeys - 1] + kKvQ - 1) / kKvQ - qt0, n_steps = a.grp * n_q;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kw = k0 + 16 * warp;
    uint32_t kf[DH / 16][4], vf[DH / 16][4];
    float dk[DH / 8][4], dv[DH / 8][4];
    zero_acc<DH>(dk);
    zero_acc<DH>(dv);
    for (int s = 0, st = 0; s < n_steps; s++, st ^= 1) {
        cp_async_wait_all();
        __syncthreads(); /* step s is in stage st for all; nobody still reads stage st ^ 1 */
        if (s == 0) {
            load_a_frags<DH>(kf, sk + 16 * warp * LD, lane);
            load_a_frags<DH>(vf, sv + 16 * warp * LD, lane);
        }
        if (s + 1 < n_steps) {
            const int n = s + 1, h = g * a.grp + n / n_q, q0 = (qt0 + n % n_q) * kKvQ;
            dkv_load_step<DH>(a, sq + (st ^ 1) * QS, sdy + (st ^ 1) * QS, sl + (st ^ 1) * kKvQ,
                              sd + (st ^ 1) * kKvQ, b, h, q0);
            cp_async_commit();
        }
        const int q0 = (qt0 + s % n_q) * kKvQ;
        dkv_step<DH, kMask>(dk, dv, kf, vf, sq + st * QS, sdy + st * QS, sl + st * kKvQ, sd + st * kKvQ,
                            sqend + 16 * warp, kw, q0, lane, a.scale_log2);
    }
    if (a.dk)
        add_rows_bf16<DH>(a.dk + kv_off, kvld, dk, a.scale, kw, a.T, lane);
    if (a.dv)
        add_rows_bf16<DH>(a.dv + kv_off, kvld, dv, 1.f, kw, a.T, lane);
}

/* ---- dq ------------------------------------------------------------------------------------ */

/* One warp, one K/V tile: its 16 rows row0.. against keys k0 .. k0 + 63 staged in sk, sv (64, LD);
 * dq += dS K (unscaled), chunk by chunk of 16 keys. S C fragments: element [nt][e] is row
 * row0 + g + 8(e >> 1), key kc + 8nt + 2t + (e & 1). l2, d: the lse2 and D of rows g, g + 8.
 * kMask: lo (16) is first_key of the warp's rows (smem). */
template <int DH, bool kMask>
__device__ __forceinline__ void dq_tile(float dq[DH / 8][4], const uint32_t qf[DH / 16][4],
                                        const uint32_t dyf[DH / 16][4], const float l2r[2], const float dr[2],
                                        const uint16_t *sk, const uint16_t *sv, const int *lo, int k0, int row0,
                                        int lane, float scale_log2)
{
    constexpr int LD = DH + 8;
    const int g = lane >> 2, t = lane & 3;
    const float l2[2][4] = {{l2r[0], l2r[0], l2r[1], l2r[1]}, {l2r[0], l2r[0], l2r[1], l2r[1]}};
    const float d[2][4] = {{dr[0], dr[0], dr[1], dr[1]}, {dr[0], dr[0], dr[1], dr[1]}};
#pragma unroll
    for (int c = 0; c < kQKeys / 16; c++) {
        const int kc = k0 + 16 * c;
        if (kc > row0)
            continue; /* every key of the chunk is after every row of the warp */
        if (kMask && kc + 15 < lo[0])
            continue; /* every key of the chunk is before every row's first key */
        /* partly masked: the diagonal, or a key before the last row's first key */
        const bool part = kc == row0 || (kMask && kc < lo[15]);
        unsigned hide = 0;
        if (kMask && part) {
            const int rl[2] = {lo[g], lo[g + 8]}; /* first_key of the lane's rows g, g + 8 */
            hide = hidden_bits([&](int nt, int e) {
                const int key = kc + 8 * nt + 2 * t + (e & 1), row = row0 + g + 8 * (e >> 1);
                return key > row || key < rl[e >> 1];
            });
        }
        float s[2][4], dp[2][4];
        mma_abt_16<DH>(s, qf, sk + 16 * c * LD, lane);   /* S = Q Kᵀ */
        mma_abt_16<DH>(dp, dyf, sv + 16 * c * LD, lane); /* dP = dY Vᵀ */
        p_ds(s, dp, l2, d, scale_log2, kMask ? part : kc == row0, [&](int nt, int e) {
            if constexpr (kMask)
                return ((hide >> (4 * nt + e)) & 1u) != 0;
            return 8 * nt + 2 * t + (e & 1) > g + 8 * (e >> 1); /* the diagonal chunk: key after row */
        });
        uint32_t dsa[4];
        frag_c_to_a(dsa, dp);
        mma_ab_acc<DH>(dq, dsa, sk + 16 * c * LD, lane); /* dQ += dS K */
    }
}

/* One CTA: query rows [q0, q0 + 128) of head h in batch b against keys [0, min(q0 + 128, T)),
 * key tiles from the last down to 0 (kMask: down to row q0's first key's), the forward's order and
 * pipeline. */
template <int DH, bool kMask>
__global__ void __launch_bounds__(kThreads, DH <= 64 ? 2 : 1) attn_bwd_dq_kernel(const BwdArgs a)
{
    extern __shared__ __align__(16) uint16_t smem[];
    constexpr int LD = QGeo<DH, kMask>::LD, KS = QGeo<DH, kMask>::KS;
    uint16_t *sq = smem, *sdy = sq + kQRows * LD, *sk = sdy + kQRows * LD, *sv = sk + 2 * KS;
    float *sl = reinterpret_cast<float *>(sv + 2 * KS), *sd = sl + kQRows;
    int *slo = reinterpret_cast<int *>(sd + kQRows); /* kMask: first_key of the CTA's rows (128) */
    const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
    const int q0 = (a.n_qt - 1 - (int)blockIdx.y) * kQRows; /* heavy (late) tiles first */
    const int64_t qld = (int64_t)a.H * DH, kvld = (int64_t)a.Hkv * DH;
    const int64_t q_off = (int64_t)b * a.T * qld + (int64_t)h * DH;
    const int64_t kv_off = (int64_t)b * a.T * kvld + (int64_t)(h / a.grp) * DH;
    const int64_t w = ((int64_t)b * a.H + h) * a.Tp + q0;
    const uint16_t *gk = a.k + kv_off, *gv = a.v + kv_off;
    const int last = (min(q0 + kQRows, a.T) - 1) / kQKeys; /* key tiles 0 .. last */

    load_rows<DH, kQRows, kThreads>(sq, a.q + q_off, qld, q0, a.T);
    load_rows<DH, kQRows, kThreads>(sdy, a.dy + q_off, qld, q0, a.T);
    load_floats(sl, a.lse2 + w, kQRows, 0);
    load_floats(sd, a.dsum + w, kQRows, kQRows / 4);
    load_tile_pair<DH, kQKeys, kThreads>(sk, sv, gk, gv, kvld, last * kQKeys, a.T);

    int first = 0; /* key tiles first .. last */
    if (kMask) {   /* the rows' first keys, read after the loop's first barrier */
        const int32_t *doc = a.doc ? a.doc + (int64_t)b * a.T : nullptr;
        if (threadIdx.x < kQRows)
            slo[threadIdx.x] = first_key(q0 + (int)threadIdx.x, a.T, a.window, doc);
        first = first_key(q0, a.T, a.window, doc) / kQKeys; /* row q0's: the CTA's lowest */
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = q0 + 16 * warp;
    uint32_t qf[DH / 16][4], dyf[DH / 16][4];
    float l2[2], d[2], dq[DH / 8][4];
    zero_acc<DH>(dq);
    for (int j = last, st = 0; j >= first; j--, st ^= 1) {
        cp_async_wait_all();
        __syncthreads(); /* tile j is in stage st for all; nobody still reads stage st ^ 1 */
        if (j == last) {
            load_a_frags<DH>(qf, sq + 16 * warp * LD, lane);
            load_a_frags<DH>(dyf, sdy + 16 * warp * LD, lane);
            const int r = 16 * warp + (lane >> 2);
            l2[0] = sl[r], l2[1] = sl[r + 8], d[0] = sd[r], d[1] = sd[r + 8];
        }
        if (j > first)
            load_tile_pair<DH, kQKeys, kThreads>(sk + (st ^ 1) * KS, sv + (st ^ 1) * KS, gk, gv, kvld,
                                                 (j - 1) * kQKeys, a.T);
        const int k0 = j * kQKeys;
        if (k0 > row0 + 15)
            continue; /* every key of the tile is after every row of this warp */
        if (kMask && k0 + kQKeys - 1 < slo[16 * warp])
            continue; /* every key of the tile is before every row's first key */
        dq_tile<DH, kMask>(dq, qf, dyf, l2, d, sk + st * KS, sv + st * KS, slo + 16 * warp, k0, row0, lane,
                           a.scale_log2);
    }
    add_rows_bf16<DH>(a.dq + q_off, qld, dq, a.scale, row0, a.T, lane);
}

/* ---- launch -------------------------------------------------------------------------------- */

template <int DH, bool kMask>
tkd_status launch(const BwdArgs &a, int B, cudaStream_t stream)
{
    if (a.dk || a.dv) {
        const dim3 grid((unsigned)(B * a.Hkv), (unsigned)((a.T + kKvKeys - 1) / kKvKeys));
        TKD_TRY(launch_smem(attn_bwd_dkv_kernel<DH, kMask>, grid, kThreads, KvGeo<DH, kMask>::SMEM, stream, a));
    }
    if (a.dq) {
        const dim3 grid((unsigned)(B * a.H), (unsigned)a.n_qt);
        TKD_TRY(launch_smem(attn_bwd_dq_kernel<DH, kMask>, grid, kThreads, QGeo<DH, kMask>::SMEM, stream, a));
    }
    return TKD_OK;
}

int64_t padded_rows(int64_t B, int64_t T, int64_t H) { return B * H * ((T + kPad - 1) / kPad * kPad); }

/* The argument checks of tkd_cuda_attn_bwd, apart from the workspace's size. */
tkd_status check_args(const uint16_t *const *bf16, int n_bf16, int B, int T, int H, int Hkv, int dh,
                      const void *ws)
{
    TKD_TRY(check_shape("tkd_cuda_attn_bwd", B, T, H, Hkv, dh));
    if (!ws)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tkd_cuda_attn_bwd: no workspace");
    for (int i = 0; i < n_bf16; i++)
        if (!aligned16(bf16[i]))
            return tkd_error_set(TKD_ERR_INVALID_ARG,
                                 "tkd_cuda_attn_bwd: dy, q, k, v, y, dq, dk and dv must be 16-byte aligned");
    return check_grid("tkd_cuda_attn_bwd", B, T, H, kQRows);
}

} // namespace

tkd_status tkd_cuda_attn_bwd_prep(const uint16_t *dy, const uint16_t *y, const float *lse, int B, int T, int H,
                                  int dh, tkd_cuda_attn_bwd_ws *ws, int *Tp, cudaStream_t stream)
{
    const int64_t rows = padded_rows(B, T, H);
    if (rows > ws->cap)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "tkd_cuda_attn_bwd: workspace too small for B=%d T=%d H=%d (%lld rows, made for %lld)",
                             B, T, H, (long long)rows, (long long)ws->cap);
    const int64_t blocks = (rows + kWarps - 1) / kWarps; /* prep: one warp per workspace row */
    if (blocks > INT32_MAX)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "tkd_cuda_attn_bwd: B·H·T = %lld rows exceed the launch grid",
                             (long long)rows);
    *Tp = (int)(rows / ((int64_t)B * H));
    attn_bwd_prep_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(dy, y, lse, ws->lse2, ws->dsum, rows, T, *Tp,
                                                                     H, dh);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

/* ws's buffers for cap padded rows (ws zeroed). */
/* The Hopper backward's dQ accumulators and counters (attn_bwd_sm90.cu), where it can run. */
static tkd_status bwd_ws_setup_dq(tkd_cuda_attn_bwd_ws *ws, int64_t cap, int dh)
{
    if (tkd_cuda_attn_bwd_sm90_supported(dh) != TKD_OK) {
        tkd_error_clear(); /* another backward runs: nothing to make */
        return TKD_OK;
    }
    TKD_TRY(tkd_cuda_malloc((void **)&ws->dq_acc, sizeof(float) * (size_t)cap * (size_t)dh,
                            "attention backward workspace (dQ accumulators)", "lower the batch size or T"));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->dq_cnt, sizeof(unsigned) * (size_t)(cap / 64),
                            "attention backward workspace (dQ counters)", NULL));
    ws->dq_dh = dh;
    return TKD_OK;
}

static tkd_status bwd_ws_setup(tkd_cuda_attn_bwd_ws *ws, int64_t cap, int dh)
{
    TKD_TRY(bwd_ws_setup_dq(ws, cap, dh));
    ws->cap = cap;
    TKD_TRY(tkd_cuda_malloc((void **)&ws->lse2, sizeof(float) * (size_t)cap, "attention backward workspace (lse)",
                            "lower the batch size or T"));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->dsum, sizeof(float) * (size_t)cap, "attention backward workspace (D)",
                            "lower the batch size or T"));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->err, sizeof *ws->err, "attention backward error flag", NULL));
    return tkd_cuda_memzero(ws->err, sizeof *ws->err);
}

extern "C" tkd_status tkd_cuda_attn_bwd_ws_create(tkd_cuda_attn_bwd_ws **out, int B, int T, int H, int dh)
{
    *out = NULL;
    if (B < 1 || T < 1 || H < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tkd_cuda_attn_bwd_ws_create: bad shape B=%d T=%d H=%d", B,
                             T, H);
    TKD_TRY(check_dh("tkd_cuda_attn_bwd_ws_create", dh));
    return tkd_cuda_ws_create(out, tkd_cuda_attn_bwd_ws_free, "tkd_cuda_attn_bwd_ws_create: out of host memory",
                              [&](tkd_cuda_attn_bwd_ws *ws) { return bwd_ws_setup(ws, padded_rows(B, T, H), dh); });
}

extern "C" void tkd_cuda_attn_bwd_ws_free(tkd_cuda_attn_bwd_ws *ws)
{
    tkd_cuda_ws_free(ws, [](tkd_cuda_attn_bwd_ws *w) {
        tkd_cuda_free_all(w->lse2, w->dsum, w->err, w->dq_acc, w->dq_cnt);
    });
}

extern "C" tkd_status tkd_cuda_attn_bwd(const uint16_t *dy, const uint16_t *q, const uint16_t *k,
                                        const uint16_t *v, const uint16_t *y, const float *lse, int B, int T,
                                        int H, int Hkv, int dh, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                        tkd_cuda_attn_bwd_ws *ws, void *stream)
{
    return tkd_cuda_attn_bwd_masked(dy, q, k, v, y, lse, B, T, H, Hkv, dh, NULL, dq, dk, dv, ws, stream);
}

extern "C" tkd_status tkd_cuda_attn_bwd_masked(const uint16_t *dy, const uint16_t *q, const uint16_t *k,
                                               const uint16_t *v, const uint16_t *y, const float *lse, int B,
                                               int T, int H, int Hkv, int dh, const tkd_attn_mask *mask,
                                               uint16_t *dq, uint16_t *dk, uint16_t *dv, tkd_cuda_attn_bwd_ws *ws,
                                               void *stream)
{
    TKD_TRY(check_mask("tkd_cuda_attn_bwd_masked", mask));
    if (mask && mask->sinks)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "tkd_cuda_attn_bwd_masked: attention sinks are not supported "
                                                  "(no backward takes sinks: teachers only)");
    const uint16_t *const ptrs[] = {dy, q, k, v, y, dq, dk, dv};
    tkd_status st = check_args(ptrs, 8, B, T, H, Hkv, dh, ws);
    if (st != TKD_OK)
        return st;
    if (B == 0 || T == 0 || (!dq && !dk && !dv))
        return TKD_OK;
    if (!dy || !q || !k || !v || !y || !lse)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tkd_cuda_attn_bwd: dy, q, k, v, y and lse are required");
    cudaStream_t s = (cudaStream_t)stream;
    int Tp = 0;
    TKD_TRY(tkd_cuda_attn_bwd_prep(dy, y, lse, B, T, H, dh, ws, &Tp, s));
    BwdArgs a;
    a.dy = dy, a.q = q, a.k = k, a.v = v, a.lse2 = ws->lse2, a.dsum = ws->dsum;
    a.dq = dq, a.dk = dk, a.dv = dv;
    a.T = T, a.Tp = Tp, a.H = H, a.Hkv = Hkv, a.grp = H / Hkv;
    a.n_qt = (T + kQRows - 1) / kQRows;
    a.scale_log2 = (float)(kLog2e / sqrt((double)dh));
    a.scale = (float)(1.0 / sqrt((double)dh));
    /* a window of T or more hides nothing (and would overflow j + window in query_end) */
    a.window = mask && mask->window < T ? mask->window : 0;
    a.doc = mask ? mask->doc : NULL;
    const bool masked = a.window > 0 || a.doc;
    return with_dh(dh, [&](auto d) {
        constexpr int DH = decltype(d)::value;
        return masked ? launch<DH, true>(a, B, s) : launch<DH, false>(a, B, s);
    });
}
