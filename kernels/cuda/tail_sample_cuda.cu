/* tail_sample_cuda.cu — see tail_sample_cuda.h; the algorithm is in kernels/cpu/tail_sample.h. */
#include "common/status.h"
#include "common/ctr_rng.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_fast_math.cuh"
#include "kernels/cpu/tail_sample.h"
#include "kernels/cuda/tail_sample_cuda.h"

#define TAIL_THREADS 512
#define TAIL_WARPS (TAIL_THREADS / 32)
#define TAIL_ITEMS 16                           /* max pass: logits per thread per tile */
#define TAIL_TILE (TAIL_THREADS * TAIL_ITEMS)
#define TAIL_SEG 256                            /* logits per segment: one warp, 8 per lane */
#define TAIL_SEG_ITEMS (TAIL_SEG / 32)
#define TAIL_SCAN_PER 8                         /* segments per thread in the segment scan */

static_assert(TKD_TAIL_MAX_V <= (int64_t)TAIL_SEG * TAIL_SCAN_PER * TAIL_THREADS,
              "the segment scan holds every segment of the largest vocabulary");

static int64_t tail_nseg(int64_t V)
{
    return (V + TAIL_SEG - 1) / TAIL_SEG;
}

/* Dynamic shared memory: the targets and the segment sums first (8-byte aligned), then the draw
 * numbers and the top-k bitmap. */
static size_t tail_smem_bytes(int64_t V, int S)
{
    return (size_t)S * (8 + 8 + 4) + (size_t)(tail_nseg(V) + 1) * 8 + (size_t)((V + 31) / 32) * 4;
}

static __device__ __forceinline__ bool tail_in_topk(const uint32_t *bits, int64_t v)
{
    return (bits[v >> 5] >> (v & 31)) & 1u;
}

/* Block max of a float (exact, so order-free); every thread gets it. */
static __device__ float tail_block_max(float m, float *red)
{
    for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = m;
    __syncthreads();
    float r = red[0];
    for (int i = 1; i < TAIL_WARPS; i++)
        r = fmaxf(r, red[i]);
    __syncthreads();
    return r;
}

/* Exclusive block scan of u64 values; *total gets the block sum (every thread). */
static __device__ uint64_t tail_block_scan(uint64_t x, uint64_t *red, uint64_t *total)
{
    return tkd_cuda::block_scan<TAIL_WARPS>(x, red, total) - x;
}

/* First index d in sorted t[0..n) with t[d] >= x. */
static __device__ int tail_lower_bound(const uint64_t *t, int n, uint64_t x)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (t[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Draw targets, rank-sorted by (target, draw) into (tsort, jsort). */
static __device__ void tail_targets(uint64_t seed, uint64_t seq, uint32_t pos, int S, uint64_t W,
                                    uint64_t *traw, uint64_t *tsort, uint32_t *jsort)
{
    for (int j = threadIdx.x; j < S; j += TAIL_THREADS)
        traw[j] = tkd_tail_target(tkd_ctr_rng_u64(seed, seq, pos, (uint32_t)j), W);
    __syncthreads();
    for (int j = threadIdx.x; j < S; j += TAIL_THREADS) {
        const uint64_t tj = traw[j];
        int rank = 0;
        for (int i = 0; i < S; i++)
            rank += traw[i] < tj || (traw[i] == tj && i < j);
        tsort[rank] = tj;
        jsort[rank] = (uint32_t)j;
    }
    __syncthreads();
}

/* Pass 1: the largest tail logit and finiteness. Tiles of 16 logits per thread, all loaded before
 * use: x[j·VEC + e] is logit base + (j·THREADS + t)·VEC + e (float4 loads when VEC = 4; a float4
 * starts at a multiple of 4, so its four logits share one bitmap word). */
template <int VEC>
static __device__ float tail_pass_max(const float *row, int64_t V, const uint32_t *bits, int *bad)
{
    float m = -INFINITY;
    for (int64_t base = 0; base < V; base += TAIL_TILE) {
        float x[TAIL_ITEMS];
        const int64_t v0 = base + (int64_t)threadIdx.x * VEC;
#pragma unroll
        for (int j = 0; j < TAIL_ITEMS / VEC; j++) {
            const int64_t v = v0 + (int64_t)j * TAIL_THREADS * VEC;
            tkd_cuda::load_or<VEC>(row + v, v < V, 0.0f, x + VEC * j);
        }
#pragma unroll
        for (int j = 0; j < TAIL_ITEMS / VEC; j++) {
            const int64_t v = v0 + (int64_t)j * TAIL_THREADS * VEC;
            if (v < V) {
                const uint32_t word = bits[v >> 5];
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    const float xe = x[j * VEC + e];
                    *bad |= !isfinite(xe);
                    if (!((word >> ((v + e) & 31)) & 1u))
                        m = fmaxf(m, xe);
                }
            }
        }
    }
    return m;
}

/* Pass 2: seg[s] = Σ tail weights of segment s (logits [s·256, s·256 + 256)), one warp per
 * segment; lane l holds logits s·256 + (j·32 + l)·VEC + e, coalesced. Integer sums, so the order
 * is free. */
template <int VEC>
static __device__ void tail_pass_weights(const float *row, int64_t V, const uint32_t *bits, float m,
                                         double tau, uint64_t *seg)
{
    const int lane = threadIdx.x & 31;
    const int64_t nseg = (V + TAIL_SEG - 1) / TAIL_SEG;
    for (int64_t s = threadIdx.x >> 5; s < nseg; s += TAIL_WARPS) {
        float x[TAIL_SEG_ITEMS];
        const int64_t v0 = s * TAIL_SEG + (int64_t)lane * VEC;
#pragma unroll
        for (int j = 0; j < TAIL_SEG_ITEMS / VEC; j++) {
            const int64_t v = v0 + (int64_t)j * 32 * VEC;
            tkd_cuda::load_or<VEC>(row + v, v < V, 0.0f, x + VEC * j);
        }
        uint64_t sum = 0;
#pragma unroll
        for (int i = 0; i < TAIL_SEG_ITEMS; i++) {
            const int64_t v = v0 + (int64_t)(i / VEC) * 32 * VEC + i % VEC;
            if (v < V && !tail_in_topk(bits, v))
                sum += tkd_tail_weight(x[i], m, tau);
        }
        for (int off = 16; off > 0; off >>= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (lane == 0)
            seg[s] = sum;
    }
}

/* In place: seg[s] becomes the weight before segment s (exclusive prefix), seg[nseg] = W. Thread t
 * holds segments [8t, 8t + 8); TKD_TAIL_MAX_V / 256 = 8 · TAIL_THREADS, so they all fit. */
static __device__ uint64_t tail_seg_scan(uint64_t *seg, int nseg, uint64_t *red)
{
    uint64_t v[TAIL_SCAN_PER], mine = 0;
#pragma unroll
    for (int i = 0; i < TAIL_SCAN_PER; i++) {
        const int s = (int)threadIdx.x * TAIL_SCAN_PER + i;
        v[i] = s < nseg ? seg[s] : 0;
        mine += v[i];
    }
    uint64_t W;
    uint64_t before = tail_block_scan(mine, red, &W); /* barriers: every seg[] was read */
#pragma unroll
    for (int i = 0; i < TAIL_SCAN_PER; i++) {
        const int s = (int)threadIdx.x * TAIL_SCAN_PER + i;
        if (s < nseg)
            seg[s] = before;
        before += v[i];
    }
    if (threadIdx.x == 0)
        seg[nseg] = W;
    __syncthreads();
    return W;
}

/* Pass 3: only the segments that hold a target. In such a segment lane l owns the 8 consecutive
 * logits s·256 + 8l … and the integer prefix interval [lo, lo + its weight); it serves every sorted
 * target in that interval. */
static __device__ void tail_assign(const float *row, int64_t V, const uint32_t *bits, float m,
                                   double tau, int S, const uint64_t *tsort, const uint32_t *jsort,
                                   const uint64_t *seg, int nseg, uint32_t *out)
{
    const int lane = threadIdx.x & 31;
    for (int s = threadIdx.x >> 5; s < nseg; s += TAIL_WARPS) {
        const int d0 = tail_lower_bound(tsort, S, seg[s]);
        if (d0 == S || tsort[d0] >= seg[s + 1]) /* no target here: the usual case when S is small */
            continue;
        const int64_t v0 = (int64_t)s * TAIL_SEG + lane * TAIL_SEG_ITEMS;
        uint64_t w[TAIL_SEG_ITEMS], mine = 0;
        for (int i = 0; i < TAIL_SEG_ITEMS; i++) {
            const int64_t v = v0 + i;
            w[i] = (v < V && !tail_in_topk(bits, v)) ? tkd_tail_weight(row[v], m, tau) : 0;
            mine += w[i];
        }
        uint64_t incl = mine;
        for (int off = 1; off < 32; off <<= 1) {
            const uint64_t t = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off)
                incl += t;
        }
        const uint64_t lo = seg[s] + incl - mine;
        int d = tail_lower_bound(tsort, S, lo);
        uint64_t acc = lo + w[0];
        int i = 0;
        for (; d < S && tsort[d] < lo + mine; d++) {
            while (tsort[d] >= acc)
                acc += w[++i];
            out[jsort[d]] = (uint32_t)(v0 + i);
        }
    }
}

/* One block per row: the top-k bitmap, pass 1 (tail max), pass 2 (segment weights), the segment
 * scan (W), the S targets sorted, pass 3 (the segments holding targets). */
template <int VEC>
static __global__ void __launch_bounds__(TAIL_THREADS, 2) /* 2 blocks of 512 per SM: 64 registers */
    tail_kernel(const float *logits, int64_t V, const uint32_t *topk_idx, int k, double tau, int S,
                uint64_t seed, const int64_t *seq_index, const int32_t *pos, uint32_t *out,
                unsigned long long *flags)
{
    extern __shared__ uint64_t tail_dyn[];
    __shared__ float red_f[TAIL_WARPS];
    __shared__ uint64_t red_u[TAIL_WARPS];
    const int nseg = (int)((V + TAIL_SEG - 1) / TAIL_SEG);
    uint64_t *traw = tail_dyn, *tsort = traw + S, *seg = tsort + S;
    uint32_t *jsort = (uint32_t *)(seg + nseg + 1), *bits = jsort + S;
    const int64_t r = blockIdx.x, nwords = (V + 31) / 32;
    const float *row = logits + r * V;
    for (int64_t i = threadIdx.x; i < nwords; i += TAIL_THREADS)
        bits[i] = 0;
    __syncthreads();
    int bad = 0;
    for (int i = threadIdx.x; i < k; i += TAIL_THREADS) {
        const uint32_t id = topk_idx[r * k + i];
        if (id < V)
            atomicOr(&bits[id >> 5], 1u << (id & 31));
        else
            bad = 1;
    }
    if (__syncthreads_or(bad)) {
        if (threadIdx.x == 0)
            atomicMin(&flags[1], (unsigned long long)r);
        return;
    }
    float m = tail_pass_max<VEC>(row, V, bits, &bad);
    if (__syncthreads_or(bad)) {
        if (threadIdx.x == 0)
            atomicMin(&flags[0], (unsigned long long)r);
        return;
    }
    m = tail_block_max(m, red_f);
    tail_pass_weights<VEC>(row, V, bits, m, tau, seg);
    __syncthreads();
    const uint64_t W = tail_seg_scan(seg, nseg, red_u);
    tail_targets(seed, (uint64_t)seq_index[r], (uint32_t)pos[r], S, W, traw, tsort, jsort);
    tail_assign(row, V, bits, m, tau, S, tsort, jsort, seg, nseg, out + r * S);
}

extern "C" tkd_status tkd_tail_sample_cuda(tkd_topk_cuda_ws *ws, const float *d_logits, int64_t C,
                                           int64_t V, const uint32_t *d_topk_idx, int k, float tau,
                                           int S, uint64_t seed, const int64_t *d_seq_index,
                                           const int32_t *d_pos, uint32_t *d_out, void *stream)
{
    TKD_TRY(tkd_tail_sample_check_args(C, V, k, tau, S));
    if (C == 0 || S == 0)
        return TKD_OK;
    if (C > INT32_MAX)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tail_sample_cuda: %lld rows exceed one grid",
                             (long long)C);
    /* float4 loads need every row on a 16-byte boundary: rows start at r·V floats. */
    const bool vec = V % 4 == 0 && ((uintptr_t)d_logits & 15) == 0;
    const size_t smem = tail_smem_bytes(V, S);
    cudaStream_t s = (cudaStream_t)stream;
    if (smem > 48 * 1024)
        TKD_CUDA_CHECK(cudaFuncSetAttribute(vec ? tail_kernel<4> : tail_kernel<1>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (vec)
        tail_kernel<4><<<(unsigned)C, TAIL_THREADS, smem, s>>>(
            d_logits, V, d_topk_idx, k, (double)tau, S, seed, d_seq_index, d_pos, d_out, ws->d_flags);
    else
        tail_kernel<1><<<(unsigned)C, TAIL_THREADS, smem, s>>>(
            d_logits, V, d_topk_idx, k, (double)tau, S, seed, d_seq_index, d_pos, d_out, ws->d_flags);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}
