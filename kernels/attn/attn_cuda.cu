/* attn_cuda.cu — see attn_cuda.h. Causal GQA attention forward, flash-attention-2 style, for sm_80+
 * (tuned for Hopper's mma.sync path): bf16 tensor-core MMAs (m16n8k16, fp32 accumulation) fed by
 * ldmatrix from shared memory, K/V tiles double-buffered with cp.async.
 *
 * Work split. One CTA of 8 warps per (query tile of kBr = 128 rows, head, batch); warp w owns the
 * 16 query rows q0 + 16w .. q0 + 16w + 15 and keeps their Q fragments, the running max m, the
 * running sum l and the output accumulator O (16 × dh fp32) in registers. The CTA walks the key
 * tiles of kBc = 64 rows from the one holding its last valid row down to tile 0: the first tiles
 * visited are the ones that need the causal mask (and the zero-filled rows past T); a warp skips a
 * tile lying wholly above its rows. While tile j is computed, tile j − 1 is copied into the other
 * shared-memory stage. The grid is (B·H, query tiles) with the heaviest (latest) query tiles in the
 * first rows of the grid, which the hardware schedules first, so the short early tiles fill the
 * tail of the causal triangle.
 *
 * Per tile and warp: S = Q Kᵀ (16 × 64, fp32), masked to −inf where key > row or key ≥ T; scores
 * in log2 units s·log2(e)/sqrt(dh) so that exp is one ex2; m_new = max(m, rowmax), O and l scaled
 * by 2^(m − m_new), P = 2^(s − m_new) rounded to bf16 as the A operand of O += P V, l += Σ P (fp32,
 * before rounding). At the end y = O / l (bf16) and lse = (m·ln 2 + ln l), the natural log-sum-exp
 * of the scaled scores.
 *
 * The PTX wrappers, the tile loader and the fragment helpers live in attn_cuda_common.cuh, shared
 * with the backward (attn_bwd_cuda.cu).
 *
 * Fragment layouts (PTX ISA, mma.m16n8k16 bf16, lane = 4·g + t): A regs {(g, 2t), (g+8, 2t),
 * (g, 2t+8), (g+8, 2t+8)} each holding 2 consecutive columns; B regs {(k = 2t, n = g),
 * (k = 2t+8, n = g)} each holding 2 consecutive k; C {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
 * So the C fragment of S for keys 16kk .. 16kk+15 is, element for element, the A fragment of P for
 * the same keys, and K (row = key, contiguous in d) read by a plain ldmatrix is Kᵀ's B fragment,
 * V (row = key, contiguous in d) read by ldmatrix.trans is V's B fragment.
 *
 * Shared memory: Q (128, dh + 8), K[2] and V[2] (64, dh + 8) bf16. The 8-element pad makes a row
 * 16 bytes longer than a multiple of 128 (for dh = 48, 80, 96 it is 112, 176, 208 bytes: also 8
 * distinct 16-byte slots mod 128), so the 8 row addresses of one ldmatrix phase hit 8 different
 * bank groups. The Q region holds the bf16 output tile at the end so y is written with 16-byte
 * coalesced stores.
 */
#include "kernels/attn/attn_cuda.h"

#include <math.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/attn/attn_cuda_common.cuh"
#include "kernels/cuda/cuda_check.h"

namespace {

using namespace tkd_attn;

constexpr int kWarps = 8;                /* per CTA, 16 query rows each */
constexpr int kThreads = 32 * kWarps;
constexpr int kBr = 16 * kWarps;         /* query rows per CTA */
constexpr int kBc = 64;                  /* keys per K/V tile */
constexpr int kNt = kBc / 8;             /* n8 tiles of S per warp */
constexpr double kLog2e = 1.4426950408889634;
constexpr float kLn2 = 0.69314718055994531f;

/* Shared-memory geometry for head dim DH (a multiple of 16). */
template <int DH> struct Geo {
    static constexpr int LD = DH + 8;    /* row stride in elements (see the file comment) */
    static constexpr int CH = DH / 8;    /* 16-byte chunks per row */
    static constexpr int KSTAGE = kBc * LD;
    static constexpr size_t SMEM = (size_t)(kBr + 4 * kBc) * LD * sizeof(uint16_t);
};

struct AttnArgs {
    const uint16_t *q;  /* (B·T, H·dh) bf16 */
    const uint16_t *k;  /* (B·T, Hkv·dh) bf16 */
    const uint16_t *v;  /* (B·T, Hkv·dh) bf16 */
    uint16_t *y;        /* (B·T, H·dh) bf16 */
    float *lse;         /* (B, H, T) or NULL */
    int T, H, Hkv, grp; /* grp = H / Hkv query heads per kv head */
    int n_qt;           /* query tiles: ceil(T / kBr) */
    float scale_log2;   /* log2(e) / sqrt(dh) */
    int window;         /* tkd_attn_mask: 0 or the sliding window */
    const float *sinks; /* (H) or NULL */
    const int32_t *doc; /* (B·T) or NULL: each query's document start */
};

/* ---- tile stages --------------------------------------------------------------------------- */

/* s (16 rows × 64 keys, fp32 C fragments: s[nt] = keys 8nt .. 8nt+7) = Q Kᵀ for one K tile.
 * One ldmatrix.x4 gives the B fragments of two key octets (n-tiles 2np, 2np+1) for one k16 slice:
 * lane → key row (lane & 7) + 8·(lane ≥ 16), column 16kk + 8·((lane >> 3) & 1). */
template <int DH>
__device__ __forceinline__ void qk_tile(float s[kNt][4], const uint32_t qf[DH / 16][4],
                                        const uint16_t *sk, int lane)
{
    constexpr int LD = Geo<DH>::LD;
    const uint32_t base = smem_addr(sk + ((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int nt = 0; nt < kNt; nt++)
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DH / 16; kk++)
#pragma unroll
        for (int np = 0; np < kNt / 2; np++) {
            uint32_t b[4];
            ldsm_x4(base + (np * 16 * LD + kk * 16) * 2, b);
            mma_bf16(s[2 * np], qf[kk], b[0], b[1]);
            mma_bf16(s[2 * np + 1], qf[kk], b[2], b[3]);
        }
}

/* Sets to −inf the scores of keys after their query row (causal), of keys ≥ T (zero-filled rows)
 * and of keys before the row's first key (lo[0] for the lane's row, lo[1] for the row 8 below:
 * first_key, attn_cuda_common.cuh). k0: the tile's first key; row0: the warp's first query row. */
__device__ __forceinline__ void mask_tile(float s[kNt][4], int k0, int row0, int T, const int lo[2], int lane)
{
    const int row = row0 + (lane >> 2), key = k0 + (lane & 3) * 2;
#pragma unroll
    for (int nt = 0; nt < kNt; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int kj = key + nt * 8 + (e & 1), qi = row + (e >> 1) * 8;
            if (kj > qi || kj >= T || kj < lo[e >> 1])
                s[nt][e] = -INFINITY;
        }
}

/* Online softmax over one tile for the thread's two rows (r = 0: row g, r = 1: row g + 8): new
 * running max (reduced over the 4 lanes of the row), rescale of l and O, s ← 2^(s·c − m). l is
 * this lane's partial sum (its 16 columns of each tile); the 4 lanes are summed at the end. */
template <int DH>
__device__ __forceinline__ void softmax_update(float s[kNt][4], float m[2], float l[2],
                                               float o[DH / 8][4], float scale_log2)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNt; nt++)
            mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[r], mx * scale_log2);
        /* a row with every key masked so far keeps m = −inf: subtract 0 so no −inf − −inf */
        const float m_sub = m_new == -INFINITY ? 0.f : m_new;
        const float corr = fast_exp2(m[r] - m_sub);
        m[r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNt; nt++) {
            s[nt][2 * r] = fast_exp2(fmaf(s[nt][2 * r], scale_log2, -m_sub));
            s[nt][2 * r + 1] = fast_exp2(fmaf(s[nt][2 * r + 1], scale_log2, -m_sub));
            sum += s[nt][2 * r] + s[nt][2 * r + 1];
        }
        l[r] = l[r] * corr + sum;
#pragma unroll
        for (int dt = 0; dt < DH / 8; dt++) {
            o[dt][2 * r] *= corr;
            o[dt][2 * r + 1] *= corr;
        }
    }
}

/* O (16 × DH, o[dt] = columns 8dt .. 8dt+7) += P V for one V tile; P (in s) becomes A fragments
 * key slice by key slice. One ldmatrix.x4.trans gives the B fragments of two d octets for 16 keys:
 * lane → key row (lane & 7) + 8·((lane >> 3) & 1), column 16dp + 8·(lane ≥ 16). */
template <int DH>
__device__ __forceinline__ void pv_tile(float o[DH / 8][4], const float s[kNt][4], const uint16_t *sv,
                                        int lane)
{
    constexpr int LD = Geo<DH>::LD;
    const uint32_t base = smem_addr(sv + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8);
#pragma unroll
    for (int kk = 0; kk < kBc / 16; kk++) {
        const uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                               pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < DH / 16; dp++) {
            uint32_t b[4];
            ldsm_x4_trans(base + (kk * 16 * LD + dp * 16) * 2, b);
            mma_bf16(o[2 * dp], a, b[0], b[1]);
            mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

/* y rows [q0, q0 + kBr) ∩ [0, T) = O / l as bf16, staged through the Q region of smem (each warp
 * writes its own rows, then 16-byte coalesced stores); lse = m·ln 2 + ln l when requested. */
template <int DH>
__device__ __forceinline__ void store_out(const AttnArgs &a, float o[DH / 8][4], const float m[2],
                                          float l[2], uint16_t *sq, int b, int h, int q0)
{
    constexpr int LD = Geo<DH>::LD, CH = Geo<DH>::CH;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const float inv = 1.f / l[r];
        const int row = warp * 16 + (lane >> 2) + 8 * r;
#pragma unroll
        for (int dt = 0; dt < DH / 8; dt++)
            *reinterpret_cast<uint32_t *>(sq + row * LD + dt * 8 + (lane & 3) * 2) =
                pack_bf16(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
        if (a.lse && (lane & 3) == 0 && q0 + row < a.T)
            a.lse[((int64_t)b * a.H + h) * a.T + q0 + row] = m[r] * kLn2 + logf(l[r]);
    }
    __syncthreads();
    const int64_t ld = (int64_t)a.H * DH;
    uint16_t *gy = a.y + (int64_t)b * a.T * ld + (int64_t)h * DH;
    for (int c = threadIdx.x; c < kBr * CH; c += kThreads) {
        const int r = c / CH, col = (c % CH) * 8;
        if (q0 + r < a.T)
            *reinterpret_cast<uint4 *>(gy + (int64_t)(q0 + r) * ld + col) =
                *reinterpret_cast<const uint4 *>(sq + r * LD + col);
    }
}

/* One CTA: query rows [q0, q0 + kBr) of head h of batch b against keys [0, min(q0 + kBr, T)).
 * Tile order, pipeline and layouts: see the file comment. */
template <int DH, bool kMask>
__global__ void __launch_bounds__(kThreads, DH <= 64 ? 2 : 1) attn_fwd_kernel(const AttnArgs a)
{
    extern __shared__ __align__(16) uint16_t smem[];
    constexpr int LD = Geo<DH>::LD, KS = Geo<DH>::KSTAGE;
    uint16_t *sq = smem, *sk = smem + kBr * LD, *sv = sk + 2 * KS; /* Q; K[2]; V[2] */
    const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
    const int q0 = (a.n_qt - 1 - (int)blockIdx.y) * kBr; /* heavy (late) tiles first */
    const int64_t qld = (int64_t)a.H * DH, kvld = (int64_t)a.Hkv * DH;
    const int64_t kv_off = (int64_t)b * a.T * kvld + (int64_t)(h / a.grp) * DH;
    const uint16_t *gk = a.k + kv_off, *gv = a.v + kv_off;
    const int last = (min(q0 + kBr, a.T) - 1) / kBc; /* key tiles first .. last */
    const int window = kMask ? a.window : 0; /* kMask false: plain causal, no register spent on it */
    const int32_t *doc = kMask && a.doc ? a.doc + (int64_t)b * a.T : nullptr;
    const int first = first_key(q0, a.T, window, doc) / kBc; /* row q0's first key's tile: the CTA's lowest */

    load_rows<DH, kBr, kThreads>(sq, a.q + (int64_t)b * a.T * qld + (int64_t)h * DH, qld, q0, a.T);
    load_tile_pair<DH, kBc, kThreads>(sk, sv, gk, gv, kvld, last * kBc, a.T);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = q0 + warp * 16;
    /* the warp's lowest and highest first keys, and the lane's two rows' */
    const int wlo = first_key(row0, a.T, window, doc), whi = first_key(row0 + 15, a.T, window, doc);
    const int lo[2] = {first_key(row0 + (lane >> 2), a.T, window, doc),
                       first_key(row0 + (lane >> 2) + 8, a.T, window, doc)};
    uint32_t qf[DH / 16][4];
    float o[DH / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    if (kMask && a.sinks) { /* the sink as a key of score sinks[h] and no value: a start of the running max
                    * and sum (one lane of the row's quad holds its 1; the quad's sums add up) */
        m[0] = m[1] = a.sinks[h] * (float)kLog2e;
        l[0] = l[1] = (lane & 3) == 0 ? 1.f : 0.f;
    }
#pragma unroll
    for (int dt = 0; dt < DH / 8; dt++)
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    for (int j = last, st = 0; j >= first; j--, st ^= 1) {
        cp_async_wait_all();
        __syncthreads(); /* tile j is in stage st for all; nobody still reads stage st ^ 1 */
        if (j == last)
            load_a_frags<DH>(qf, sq + warp * 16 * LD, lane);
        if (j > first)
            load_tile_pair<DH, kBc, kThreads>(sk + (st ^ 1) * KS, sv + (st ^ 1) * KS, gk, gv, kvld, (j - 1) * kBc,
                                              a.T);
        const int k0 = j * kBc;
        if (k0 > row0 + 15)
            continue; /* every key of the tile is after every row of this warp */
        if (k0 + kBc - 1 < wlo)
            continue; /* every key of the tile is before every row's first key */
        float s[kNt][4];
        qk_tile<DH>(s, qf, sk + st * KS, lane);
        if (k0 + kBc - 1 > row0 || k0 + kBc > a.T || k0 < whi)
            mask_tile(s, k0, row0, a.T, lo, lane);
        softmax_update<DH>(s, m, l, o, a.scale_log2);
        pv_tile<DH>(o, s, sv + st * KS, lane);
    }
    store_out<DH>(a, o, m, l, sq, b, h, q0);
}

/* A window or sinks take the kernel built for them; plain causal attention the one without. */
template <int DH>
tkd_status launch(const AttnArgs &a, int B, cudaStream_t stream)
{
    const dim3 grid((unsigned)(B * a.H), (unsigned)a.n_qt);
    return a.window > 0 || a.sinks || a.doc ? launch_smem(attn_fwd_kernel<DH, true>, grid, kThreads, Geo<DH>::SMEM, stream, a)
                                   : launch_smem(attn_fwd_kernel<DH, false>, grid, kThreads, Geo<DH>::SMEM, stream, a);
}

} // namespace

extern "C" tkd_status tkd_cuda_attn_fwd(const uint16_t *q, const uint16_t *k, const uint16_t *v, int B,
                                        int T, int H, int Hkv, int dh, uint16_t *y, float *lse,
                                        void *stream)
{
    return tkd_cuda_attn_fwd_masked(q, k, v, B, T, H, Hkv, dh, NULL, y, lse, stream);
}

extern "C" tkd_status tkd_cuda_attn_fwd_masked(const uint16_t *q, const uint16_t *k, const uint16_t *v, int B,
                                               int T, int H, int Hkv, int dh, const tkd_attn_mask *mask,
                                               uint16_t *y, float *lse, void *stream)
{
    TKD_TRY(check_mask("tkd_cuda_attn_fwd", mask));
    TKD_TRY(check_shape("tkd_cuda_attn_fwd", B, T, H, Hkv, dh));
    if (B == 0 || T == 0)
        return TKD_OK;
    if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(y))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "tkd_cuda_attn_fwd: q, k, v and y must be 16-byte aligned device pointers");
    TKD_TRY(check_grid("tkd_cuda_attn_fwd", B, T, H, kBr));
    AttnArgs a;
    a.q = q, a.k = k, a.v = v, a.y = y, a.lse = lse;
    a.T = T, a.H = H, a.Hkv = Hkv, a.grp = H / Hkv, a.n_qt = (T + kBr - 1) / kBr;
    a.scale_log2 = (float)(kLog2e / sqrt((double)dh));
    a.window = mask ? mask->window : 0;
    a.sinks = mask ? mask->sinks : NULL;
    a.doc = mask ? mask->doc : NULL;
    cudaStream_t st = (cudaStream_t)stream;
    return with_dh(dh, [&](auto d) { return launch<decltype(d)::value>(a, B, st); });
}
