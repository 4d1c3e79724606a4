/* topk_cuda.cu — see topk_cuda.h; the selection scheme and its paths are described there. */
#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_fast_math.cuh"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/cpu/topk.h"
#include "kernels/cuda/topk_cuda.h"
#include "kernels/cuda/topk_cuda_internal.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

#define TOPK_THREADS TKD_TOPK_CUDA_THREADS
#define TOPK_WARPS (TOPK_THREADS / 32)
#define TOPK_ITEMS 16                          /* logits per thread per tile, all loaded before use */
#define TOPK_TILE (TOPK_THREADS * TOPK_ITEMS)  /* 4096 logits per block per tile */
#define TOPK_BITS TKD_TOPK_CUDA_BIN_BITS      /* pass 1 bins by the top 12 bits of the key */
#define TOPK_BINS (1 << TOPK_BITS)
#define TOPK_SHIFT (32 - TOPK_BITS)
#define TOPK_CAP TKD_TOPK_CUDA_CAP             /* candidate slots in shared memory */
#define TOPK_NONE 0xffffffffu
#define TOPK_NO_ROW 0xffffffffffffffffull

/* Order-preserving key: larger float -> larger key; -0.0 and +0.0 share one key, as they compare
 * equal on the CPU. */
static __device__ __forceinline__ uint32_t topk_key(float x)
{
    uint32_t b = __float_as_uint(x);
    if ((b << 1) == 0)
        b = 0;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* The smallest finite float whose key is ≥ key (key = a bin start, low bits zero), so that for a
 * finite x, x >= topk_key_floor(key) exactly when topk_key(x) >= key: one float compare per logit
 * instead of a key. Keys below key(−FLT_MAX) hold only −Inf and NaNs. A NaN result (key above
 * +Inf) makes every compare false, as no finite key reaches it. */
static __device__ __forceinline__ float topk_key_floor(uint32_t key)
{
    if (key <= 0x00800000u)
        return -FLT_MAX;
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

/* Dynamic shared memory of one block (~48 KB, so 4 blocks of 256 threads per SM). */
typedef struct topk_smem {
    uint32_t hist[TOPK_BINS];
    uint32_t ckey[TOPK_CAP], cid[TOPK_CAP]; /* candidates (key, id); the ordered path's winners */
    uint32_t scan[TOPK_WARPS], warp_gt[TOPK_WARPS], warp_eq[TOPK_WARPS];
    float red_m[TOPK_WARPS];
    double red_s[TOPK_WARPS];
    uint32_t cnt;      /* candidates inserted (may pass TOPK_CAP: then some were dropped) */
    uint32_t high;     /* a slot at or past this asks for a refresh */
    uint32_t lost;     /* the buffer overflowed: this row takes the refinement passes */
    uint32_t sel_bin, sel_above; /* topk_find_bin's answer */
    uint32_t prefix, kleft, n_gt, n_eq; /* the ordered collection's threshold and counters */
} topk_smem;

/* Inclusive block scan of one value per thread; *total gets the block sum. Barriers inside. */
static __device__ uint32_t topk_block_scan(uint32_t x, uint32_t *warp_tot, uint32_t *total)
{
    return tkd_cuda::block_scan<TOPK_WARPS>(x, warp_tot, total);
}

/* Block-wide: the bin of hist (nbins, a multiple of the block) holding the want-th largest counted
 * key, with sel_above = the count in higher bins; sel_bin = TOPK_NONE when fewer than want are
 * counted. Thread t scans nbins/THREADS bins downwards from the top, thread 0 owning the highest. */
static __device__ void topk_find_bin(const uint32_t *hist, int nbins, uint32_t want, topk_smem *sm)
{
    const int per = nbins / TOPK_THREADS, top = nbins - 1 - (int)threadIdx.x * per;
    __syncthreads(); /* the histogram is complete; earlier answers were read */
    if (threadIdx.x == 0)
        sm->sel_bin = TOPK_NONE;
    uint32_t sum = 0, total;
    for (int i = 0; i < per; i++)
        sum += hist[top - i];
    const uint32_t incl = topk_block_scan(sum, sm->scan, &total);
    uint32_t acc = incl - sum;
    if (acc < want && want <= incl) {
        for (int i = 0; i < per; i++) {
            const uint32_t c = hist[top - i];
            if (acc + c >= want) {
                sm->sel_bin = (uint32_t)(top - i);
                sm->sel_above = acc;
                break;
            }
            acc += c;
        }
    }
    __syncthreads();
}

/* Keeps, in place and in order, the first n candidates whose key is ≥ lo; returns how many (every
 * thread). A kept entry moves to a slot ≤ its own, and slots of later rounds are read after the
 * round's barriers, so nothing is overwritten before it is read. */
static __device__ uint32_t topk_compact(topk_smem *sm, uint32_t n, uint32_t lo)
{
    uint32_t kept = 0;
    for (uint32_t c = 0; c < n; c += TOPK_THREADS) {
        const uint32_t i = c + threadIdx.x;
        const uint32_t key = i < n ? sm->ckey[i] : 0u, id = i < n ? sm->cid[i] : 0u;
        const uint32_t keep = i < n && key >= lo;
        uint32_t total;
        const uint32_t pos = kept + topk_block_scan(keep, sm->scan, &total) - keep;
        if (keep) {
            sm->ckey[pos] = key;
            sm->cid[pos] = id;
        }
        kept += total;
    }
    return kept;
}

/* Sorts the n candidates by (key desc, id asc) with a bitonic network over the next power of two,
 * padded with entries that sort last. Ids are distinct, so the order is total and exact. */
static __device__ void topk_sort(topk_smem *sm, uint32_t n)
{
    uint32_t P = 1;
    while (P < n)
        P <<= 1;
    for (uint32_t i = n + threadIdx.x; i < P; i += TOPK_THREADS) {
        sm->ckey[i] = 0u; /* below every finite key */
        sm->cid[i] = TOPK_NONE;
    }
    __syncthreads();
    for (uint32_t size = 2; size <= P; size <<= 1) {
        for (uint32_t stride = size >> 1; stride > 0; stride >>= 1) {
            for (uint32_t i = threadIdx.x; i < P / 2; i += TOPK_THREADS) {
                const uint32_t lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                const uint32_t ka = sm->ckey[lo], kb = sm->ckey[hi], ia = sm->cid[lo], ib = sm->cid[hi];
                const bool b_first = kb > ka || (kb == ka && ib < ia);
                if (b_first == ((lo & size) == 0)) { /* this run ascends in output order */
                    sm->ckey[lo] = kb, sm->cid[lo] = ib;
                    sm->ckey[hi] = ka, sm->cid[hi] = ia;
                }
            }
            __syncthreads();
        }
    }
}

/* Writes the first k sorted candidates: ids, and the raw logits read back (-0.0 stays -0.0). */
static __device__ void topk_write_sorted(const topk_smem *sm, const float *row, int k,
                                         uint32_t *out_idx, float *out_val)
{
    for (int i = threadIdx.x; i < k; i += TOPK_THREADS) {
        const uint32_t id = sm->cid[i];
        out_idx[i] = id;
        out_val[i] = row[id];
    }
}

/* Loads one tile: x[j·VEC + e] is logit base + (j·THREADS + t)·VEC + e, coalesced across the warp
 * (float4 when VEC = 4). Returns how many of the thread's groups lie inside the row (groups j ≥
 * that hold −Inf). */
template <int VEC>
static __device__ __forceinline__ int topk_load(const float *row, int64_t V, int64_t base,
                                                float (&x)[TOPK_ITEMS])
{
    const int64_t v0 = base + (int64_t)threadIdx.x * VEC, left = V - v0;
    const int nv = left <= 0 ? 0 : (int)min((int64_t)(TOPK_ITEMS / VEC),
                                            (left + TOPK_THREADS * VEC - 1) / (TOPK_THREADS * VEC));
#pragma unroll
    for (int j = 0; j < TOPK_ITEMS / VEC; j++)
        tkd_cuda::load_or<VEC>(row + v0 + (int64_t)j * TOPK_THREADS * VEC, j < nv, -INFINITY, x + VEC * j);
    return nv;
}

template <int VEC>
static __device__ __forceinline__ uint32_t topk_id(int64_t base, int i)
{
    return (uint32_t)(base + ((int64_t)(i / VEC) * TOPK_THREADS + threadIdx.x) * VEC + i % VEC);
}

/* Puts logit x (item i of the tile at base) into the next candidate slot while there is one;
 * returns the slot taken (≥ TOPK_CAP: dropped, the count still rises). */
template <int VEC>
static __device__ __forceinline__ uint32_t topk_push(topk_smem *sm, float x, int64_t base, int i)
{
    const uint32_t slot = atomicAdd(&sm->cnt, 1u);
    if (slot < TOPK_CAP) {
        sm->ckey[slot] = topk_key(x);
        sm->cid[slot] = topk_id<VEC>(base, i);
    }
    return slot;
}

/* Raises pass 1's threshold to the bin holding the k-th largest key seen so far (the histogram
 * counts every seen key at or above the old threshold, so that bin is exact) and drops the
 * candidates below it; a buffer that overflowed marks the row lost (sm->lost), which stops the
 * collection. Returns the bin (TOPK_NONE when fewer than k keys are counted: only in a row with a
 * NaN). Not inlined: it runs a few times per row, and inlined its registers would add to the hot
 * loop's. */
static __device__ __noinline__ uint32_t topk_refresh(topk_smem *sm, int k)
{
    topk_find_bin(sm->hist, TOPK_BINS, (uint32_t)k, sm);
    const uint32_t bin = sm->sel_bin, n = sm->cnt;
    const bool lost = sm->lost || n > TOPK_CAP;
    uint32_t kept = n;
    if (!lost && bin != TOPK_NONE)
        kept = topk_compact(sm, n, bin << TOPK_SHIFT);
    __syncthreads(); /* every thread has read cnt and lost */
    if (threadIdx.x == 0) {
        sm->cnt = kept;
        sm->lost = lost;
        sm->high = max((uint32_t)TOPK_CAP / 2, (kept + TOPK_CAP) / 2);
    }
    __syncthreads();
    return bin;
}

/* One thread's share of pass 1: its online (max, Σ exp((x − max)/τ)) and the largest |bits|. */
typedef struct topk_part {
    float m;
    double s;
    uint32_t amax;
} topk_part;

/* Folds one tile into the thread's LSE: the tile max first, one rescale (in double, rare), then
 * the 16 terms summed in fp32 (each ≤ 1) and added to the double sum. c2 = log2(e)/τ. */
static __device__ __forceinline__ void topk_lse_tile(const float (&x)[TOPK_ITEMS], float c2,
                                                     double inv_tau, topk_part *p)
{
    float tmax = x[0];
#pragma unroll
    for (int i = 1; i < TOPK_ITEMS; i++)
        tmax = fmaxf(tmax, x[i]);
    if (tmax > p->m) {
        p->s *= exp(((double)p->m - (double)tmax) * inv_tau); /* 0 while m = −Inf and s = 0 */
        p->m = tmax;
    }
    if (p->m > -INFINITY) {
        float t = 0.0f;
#pragma unroll
        for (int i = 0; i < TOPK_ITEMS; i++)
            t += exp2f((x[i] - p->m) * c2); /* −Inf padding adds 0 */
        p->s += (double)t;
    }
}

/* Pass 1 over the row: the LSE parts, finiteness, the histogram of the top 12 bits of every key at
 * or above the threshold, and the candidates at or above it. The first tile is counted whole and
 * sets the threshold to the bin of its k-th largest key (a lower bound for the row's); later
 * refreshes raise it whenever the buffer fills past `high`. */
template <int VEC>
static __device__ topk_part topk_pass_first(const float *row, int64_t V, int k, float tau,
                                            topk_smem *sm)
{
    const float c2 = (float)(1.4426950408889634 / (double)tau);
    const double inv_tau = 1.0 / (double)tau;
    topk_part p = {-INFINITY, 0.0, 0u};
    float f_hist = -FLT_MAX, f_cand = -FLT_MAX;
    bool over = true; /* the first tile always refreshes */
    for (int64_t base = 0; base < V; base += TOPK_TILE) {
        float x[TOPK_ITEMS];
        const int nv = topk_load<VEC>(row, V, base, x);
#pragma unroll
        for (int i = 0; i < TOPK_ITEMS; i++) {
            if (i / VEC < nv)
                p.amax = max(p.amax, __float_as_uint(x[i]) & 0x7fffffffu);
            if (x[i] >= f_hist) /* false for NaN and the −Inf padding */
                atomicAdd(&sm->hist[topk_key(x[i]) >> TOPK_SHIFT], 1u);
        }
        topk_lse_tile(x, c2, inv_tau, &p);
        if (__syncthreads_or(over)) {
            const uint32_t bin = topk_refresh(sm, k);
            if (bin != TOPK_NONE)
                f_hist = topk_key_floor(bin << TOPK_SHIFT);
            f_cand = sm->lost ? INFINITY : f_hist; /* lost is written only inside topk_refresh */
            over = false;
        }
#pragma unroll
        for (int i = 0; i < TOPK_ITEMS; i++) {
            if (x[i] >= f_cand)
                over |= topk_push<VEC>(sm, x[i], base, i) >= sm->high;
        }
    }
    return p;
}

/* Merges two (max, Σ exp((x − max)/τ)) pairs, max in raw logits. */
static __device__ __forceinline__ void topk_lse_merge(float &m, double &s, float m2, double s2,
                                                      double inv_tau)
{
    if (m2 == -INFINITY)
        return;
    if (m2 > m) {
        s = s * exp(((double)m - (double)m2) * inv_tau) + s2;
        m = m2;
    } else {
        s += s2 * exp(((double)m2 - (double)m) * inv_tau);
    }
}

/* Block-wide merge of the per-thread LSE parts; thread 0 gets log Σ exp(x/τ). */
static __device__ double topk_lse_reduce(float m, double s, double inv_tau, topk_smem *sm)
{
    for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_down_sync(0xffffffffu, m, off);
        const double s2 = __shfl_down_sync(0xffffffffu, s, off);
        topk_lse_merge(m, s, m2, s2, inv_tau);
    }
    const int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        sm->red_m[w] = m;
        sm->red_s[w] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < TOPK_WARPS; i++)
            topk_lse_merge(sm->red_m[0], sm->red_s[0], sm->red_m[i], sm->red_s[i], inv_tau);
        return (double)sm->red_m[0] * inv_tau + log(sm->red_s[0]);
    }
    return 0.0;
}

/* Adds 1 to hist[bin] for each lane (TOPK_NONE = none), one shared atomic per distinct bin per
 * warp: in a refinement pass many keys of a row can share a bin (a plateau of equal logits), and
 * plain atomics would serialise on it. All lanes call it together. */
static __device__ __forceinline__ void topk_hist_add(uint32_t *hist, uint32_t bin)
{
    if (!__any_sync(0xffffffffu, bin != TOPK_NONE)) /* most warps hold no key of the bin */
        return;
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    if (bin != TOPK_NONE && (threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1))
        atomicAdd(&hist[bin], (uint32_t)__popc(peers));
}

/* Refinement pass: histogram of (key >> dig_shift) & (nbins − 1) over the keys with
 * key >> match_shift == match. */
template <int VEC>
static __device__ void topk_pass_refine(const float *row, int64_t V, uint32_t match, int match_shift,
                                        int dig_shift, uint32_t nbins, uint32_t *hist)
{
    for (int64_t base = 0; base < V; base += TOPK_TILE) {
        float x[TOPK_ITEMS];
        const int nv = topk_load<VEC>(row, V, base, x);
#pragma unroll
        for (int i = 0; i < TOPK_ITEMS; i++) {
            const uint32_t key = topk_key(x[i]);
            const bool in = i / VEC < nv && (key >> match_shift) == match;
            topk_hist_add(hist, in ? (key >> dig_shift) & (nbins - 1) : TOPK_NONE);
        }
    }
}

/* Collection pass: every logit ≥ f (fewer than TOPK_CAP, known from the histograms) into the
 * candidate buffer, in any order. */
template <int VEC>
static __device__ void topk_pass_collect(const float *row, int64_t V, float f, topk_smem *sm)
{
    for (int64_t base = 0; base < V; base += TOPK_TILE) {
        float x[TOPK_ITEMS];
        topk_load<VEC>(row, V, base, x); /* −Inf padding is below f */
#pragma unroll
        for (int i = 0; i < TOPK_ITEMS; i++) {
            if (x[i] >= f)
                topk_push<VEC>(sm, x[i], base, i);
        }
    }
}

/* Ordered collection once the k-th largest key thr = sm->prefix is exact: every key > thr (exactly
 * k − keq of them) and the first keq keys == thr by id, in tiles of one logit per thread, positions
 * from ballots so the result is deterministic. */
static __device__ void topk_collect_ordered(const float *row, int64_t V, int k, topk_smem *sm)
{
    const uint32_t thr = sm->prefix, keq = sm->kleft, ngt = (uint32_t)k - keq;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const unsigned lt = (1u << lane) - 1u;
    for (int64_t base = 0; base < V; base += TOPK_THREADS) {
        const int64_t v = base + threadIdx.x;
        const uint32_t key = v < V ? topk_key(row[v]) : 0u;
        const bool gt = v < V && key > thr, eq = v < V && key == thr;
        if (!__syncthreads_or(gt || eq)) /* most tiles hold no winner: one barrier, not three */
            continue;
        const unsigned bg = __ballot_sync(0xffffffffu, gt), be = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) {
            sm->warp_gt[w] = (uint32_t)__popc(bg);
            sm->warp_eq[w] = (uint32_t)__popc(be);
        }
        __syncthreads();
        uint32_t og = sm->n_gt + (uint32_t)__popc(bg & lt), oe = sm->n_eq + (uint32_t)__popc(be & lt);
        uint32_t tg = 0, te = 0;
        for (int i = 0; i < TOPK_WARPS; i++) {
            if (i < w) {
                og += sm->warp_gt[i];
                oe += sm->warp_eq[i];
            }
            tg += sm->warp_gt[i];
            te += sm->warp_eq[i];
        }
        if (gt && og < ngt) {
            sm->ckey[og] = key;
            sm->cid[og] = (uint32_t)v;
        }
        if (eq && oe < keq) {
            sm->ckey[ngt + oe] = key;
            sm->cid[ngt + oe] = (uint32_t)v;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            sm->n_gt += tg;
            sm->n_eq += te;
        }
        __syncthreads();
        if (sm->n_gt >= ngt && sm->n_eq >= keq)
            break;
    }
}

/* Rank sort of the k winners by (key desc, id asc) into the outputs; ids are distinct, so ranks
 * are too. */
static __device__ void topk_rank_write(const topk_smem *sm, const float *row, int k,
                                       uint32_t *out_idx, float *out_val)
{
    for (int i = threadIdx.x; i < k; i += TOPK_THREADS) {
        const uint32_t ki = sm->ckey[i], ii = sm->cid[i];
        int rank = 0;
        for (int j = 0; j < k; j++) {
            const uint32_t kj = sm->ckey[j], ij = sm->cid[j];
            rank += kj > ki || (kj == ki && ij < ii);
        }
        out_idx[rank] = ii;
        out_val[rank] = row[ii];
    }
}

/* A row whose buffer overflowed (> TOPK_CAP keys at or above a pass-1 threshold): the k-th key lies
 * in bin b0 of the top 12 bits, `above` keys lie higher. Level 1 bins the next 12 bits of b0's keys;
 * when the keys at or above its bin fit the buffer, one pass collects them for the sort (path 1).
 * Otherwise level 2 bins the last 8 bits, which gives the exact k-th key, and the ordered
 * collection takes the ties at it by id (path 2). Returns the path. */
template <int VEC>
static __device__ int topk_select_refined(const float *row, int64_t V, int k, uint32_t b0,
                                          uint32_t above, topk_smem *sm, uint32_t *out_idx,
                                          float *out_val)
{
    for (int i = threadIdx.x; i < TOPK_BINS; i += TOPK_THREADS)
        sm->hist[i] = 0;
    __syncthreads();
    topk_pass_refine<VEC>(row, V, b0, TOPK_SHIFT, 8, TOPK_BINS, sm->hist);
    const uint32_t kleft = (uint32_t)k - above;
    topk_find_bin(sm->hist, TOPK_BINS, kleft, sm);
    const uint32_t b1 = sm->sel_bin, above1 = sm->sel_above;
    const uint32_t prefix = (b0 << 12) | b1; /* the top 24 bits of the k-th key */
    if (above + above1 + sm->hist[b1] <= TOPK_CAP) {
        if (threadIdx.x == 0) /* cnt was last read before topk_find_bin's barriers */
            sm->cnt = 0;
        __syncthreads();
        topk_pass_collect<VEC>(row, V, topk_key_floor(prefix << 8), sm);
        __syncthreads();
        topk_sort(sm, sm->cnt);
        topk_write_sorted(sm, row, k, out_idx, out_val);
        return 1;
    }
    __syncthreads(); /* every thread has read hist[b1] */
    for (int i = threadIdx.x; i < 256; i += TOPK_THREADS)
        sm->hist[i] = 0;
    __syncthreads();
    topk_pass_refine<VEC>(row, V, prefix, 8, 0, 256, sm->hist);
    topk_find_bin(sm->hist, 256, kleft - above1, sm);
    if (threadIdx.x == 0) {
        sm->prefix = (prefix << 8) | sm->sel_bin;
        sm->kleft = kleft - above1 - sm->sel_above;
        sm->n_gt = sm->n_eq = 0;
    }
    __syncthreads();
    topk_collect_ordered(row, V, k, sm);
    topk_rank_write(sm, row, k, out_idx, out_val);
    return 2;
}

/* One block per row: pass 1 (LSE, finiteness, histogram, candidates), then the exact top k from
 * the candidates (path 0) or, for a row whose candidates overflowed, the refinement passes. */
template <int VEC>
static __global__ void __launch_bounds__(TOPK_THREADS, 4)
    topk_kernel(const float *logits, int64_t V, int k, float tau, uint32_t *out_idx,
                float *out_val, float *out_lse, unsigned long long *flags,
                unsigned long long *paths)
{
    extern __shared__ __align__(16) unsigned char topk_dyn[];
    topk_smem *sm = reinterpret_cast<topk_smem *>(topk_dyn);
    const int64_t r = blockIdx.x;
    const float *row = logits + r * V;
    out_idx += r * k;
    out_val += r * k;
    for (int i = threadIdx.x; i < TOPK_BINS; i += TOPK_THREADS)
        sm->hist[i] = 0;
    if (threadIdx.x == 0)
        sm->cnt = sm->lost = 0;
    __syncthreads();
    const topk_part p = topk_pass_first<VEC>(row, V, k, tau, sm);
    if (__syncthreads_or(p.amax >= 0x7f800000u)) { /* NaN or ±Inf: flagged; outputs unspecified */
        if (threadIdx.x == 0)
            atomicMin(&flags[0], (unsigned long long)r);
        for (int i = threadIdx.x; i < k; i += TOPK_THREADS)
            out_idx[i] = (uint32_t)i, out_val[i] = row[i];
        if (threadIdx.x == 0)
            out_lse[r] = NAN;
        return;
    }
    const double lse = topk_lse_reduce(p.m, p.s, 1.0 / (double)tau, sm);
    if (threadIdx.x == 0)
        out_lse[r] = (float)lse;
    topk_find_bin(sm->hist, TOPK_BINS, (uint32_t)k, sm);
    const uint32_t b0 = sm->sel_bin, above = sm->sel_above, n = sm->cnt;
    int path = 0;
    if (!sm->lost && n <= TOPK_CAP) {
        const uint32_t kept = topk_compact(sm, n, b0 << TOPK_SHIFT);
        topk_sort(sm, kept);
        topk_write_sorted(sm, row, k, out_idx, out_val);
    } else {
        path = topk_select_refined<VEC>(row, V, k, b0, above, sm, out_idx, out_val);
    }
    if (threadIdx.x == 0)
        atomicAdd(&paths[path], 1ull);
}

static tkd_status topk_ws_setup(tkd_topk_cuda_ws *ws)
{
    const size_t bytes = 2 * sizeof(unsigned long long);
    TKD_TRY(tkd_cuda_malloc((void **)&ws->d_flags, bytes, "topk_cuda: error flags", NULL));
    TKD_TRY(tkd_cuda_malloc_host((void **)&ws->h_flags, bytes, "topk_cuda: error flags"));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->d_paths, TKD_TOPK_CUDA_PATHS * sizeof(unsigned long long),
                            "topk_cuda: path counters", NULL));
    TKD_CUDA_CHECK(cudaMemset(ws->d_flags, 0xff, bytes)); /* ~0: no row flagged */
    TKD_CUDA_CHECK(cudaMemset(ws->d_paths, 0, TKD_TOPK_CUDA_PATHS * sizeof(unsigned long long)));
    return TKD_OK;
}

extern "C" void tkd_topk_cuda_ws_free(tkd_topk_cuda_ws *ws)
{
    tkd_cuda_ws_free(ws, [](tkd_topk_cuda_ws *w) {
        tkd_cuda_free(w->d_flags);
        tkd_cuda_free_host(w->h_flags);
        tkd_cuda_free(w->d_paths);
    });
}

extern "C" tkd_status tkd_topk_cuda_ws_create(tkd_topk_cuda_ws **out)
{
    return tkd_cuda_ws_create(out, tkd_topk_cuda_ws_free, "topk_cuda: cannot allocate the workspace",
                              topk_ws_setup);
}

extern "C" tkd_status tkd_topk_cuda(tkd_topk_cuda_ws *ws, const float *d_logits, int64_t C,
                                    int64_t V, int k, float tau, uint32_t *d_idx, float *d_val,
                                    float *d_lse, void *stream)
{
    TKD_TRY(tkd_topk_check_args(C, V, k, tau));
    if (C == 0)
        return TKD_OK;
    if (C > INT32_MAX)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "topk_cuda: %lld rows exceed one grid", (long long)C);
    /* float4 loads need every row on a 16-byte boundary: rows start at r·V floats. */
    const bool vec = V % 4 == 0 && ((uintptr_t)d_logits & 15) == 0;
    const size_t smem = sizeof(topk_smem); /* > 48 KB: the kernel must opt in (per device) */
    cudaStream_t s = (cudaStream_t)stream;
    TKD_CUDA_CHECK(cudaFuncSetAttribute(vec ? topk_kernel<4> : topk_kernel<1>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (vec)
        topk_kernel<4><<<(unsigned)C, TOPK_THREADS, smem, s>>>(d_logits, V, k, tau, d_idx, d_val,
                                                               d_lse, ws->d_flags, ws->d_paths);
    else
        topk_kernel<1><<<(unsigned)C, TOPK_THREADS, smem, s>>>(d_logits, V, k, tau, d_idx, d_val,
                                                               d_lse, ws->d_flags, ws->d_paths);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

extern "C" tkd_status tkd_topk_cuda_sync(tkd_topk_cuda_ws *ws, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    TKD_CUDA_CHECK(cudaMemcpyAsync(ws->h_flags, ws->d_flags, 2 * sizeof(unsigned long long),
                                   cudaMemcpyDeviceToHost, s));
    TKD_CUDA_CHECK(cudaMemsetAsync(ws->d_flags, 0xff, 2 * sizeof(unsigned long long), s));
    TKD_CUDA_CHECK(cudaStreamSynchronize(s));
    if (ws->h_flags[0] != TOPK_NO_ROW)
        return tkd_error_set(TKD_ERR_NUMERIC,
                             "topk_cuda: logits row %llu of the chunk has a non-finite value (NaN or "
                             "Inf): the teacher produced it; check the checkpoint's dtype and weights",
                             ws->h_flags[0]);
    if (ws->h_flags[1] != TOPK_NO_ROW)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "tail_sample_cuda: row %llu has a top-k id >= V; pass the ids from topk",
                             ws->h_flags[1]);
    return TKD_OK;
}

extern "C" tkd_status tkd_topk_cuda_paths(tkd_topk_cuda_ws *ws, void *stream,
                                          unsigned long long counts[TKD_TOPK_CUDA_PATHS])
{
    cudaStream_t s = (cudaStream_t)stream;
    const size_t bytes = TKD_TOPK_CUDA_PATHS * sizeof(unsigned long long);
    TKD_CUDA_CHECK(cudaMemcpyAsync(counts, ws->d_paths, bytes, cudaMemcpyDeviceToHost, s));
    TKD_CUDA_CHECK(cudaMemsetAsync(ws->d_paths, 0, bytes, s));
    TKD_CUDA_CHECK(cudaStreamSynchronize(s));
    return TKD_OK;
}
