/* tail_sample_cuda.cu — see tail_sample_cuda.h; the algorithm is in kernels/tail_sample.h. */
#include "common/status.h"
#include "common/ctr_rng.h"
#include "kernels/cuda_check.h"
#include "kernels/tail_sample.h"
#include "kernels/tail_sample_cuda.h"

#define TAIL_THREADS 512
#define TAIL_WARPS (TAIL_THREADS / 32)
#define TAIL_ITEMS 8 /* contiguous tokens per thread per tile */

/* Dynamic shared memory: targets first (8-byte aligned), then the top-k bitmap. */
static size_t tail_smem_bytes(int64_t V, int S)
{
    return (size_t)S * (8 + 8 + 4) + (size_t)((V + 31) / 32) * 4;
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
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    uint64_t incl = x;
    for (int off = 1; off < 32; off <<= 1) {
        uint64_t t = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off)
            incl += t;
    }
    if (lane == 31)
        red[w] = incl;
    __syncthreads();
    uint64_t before = 0, sum = 0;
    for (int i = 0; i < TAIL_WARPS; i++) {
        before += i < w ? red[i] : 0;
        sum += red[i];
    }
    __syncthreads();
    *total = sum;
    return before + incl - x;
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

/* The scan: tile by tile, each thread owns TAIL_ITEMS consecutive tokens and the integer prefix
 * interval [lo, lo + its weight); it serves every sorted target that falls in that interval. */
static __device__ void tail_assign(const float *row, int64_t V, const uint32_t *bits, float m,
                                   double tau, int S, const uint64_t *tsort, const uint32_t *jsort,
                                   uint64_t *red, uint32_t *out)
{
    uint64_t carry = 0;
    const uint64_t last = tsort[S - 1];
    for (int64_t base = 0; base < V; base += (int64_t)TAIL_THREADS * TAIL_ITEMS) {
        const int64_t v0 = base + (int64_t)threadIdx.x * TAIL_ITEMS;
        uint64_t w[TAIL_ITEMS], mine = 0;
        for (int i = 0; i < TAIL_ITEMS; i++) {
            const int64_t v = v0 + i;
            w[i] = (v < V && !tail_in_topk(bits, v)) ? tkd_tail_weight(row[v], m, tau) : 0;
            mine += w[i];
        }
        uint64_t tile;
        const uint64_t lo = carry + tail_block_scan(mine, red, &tile);
        int d = tail_lower_bound(tsort, S, lo);
        uint64_t acc = lo + w[0];
        int i = 0;
        for (; d < S && tsort[d] < lo + mine; d++) {
            while (tsort[d] >= acc)
                acc += w[++i];
            out[jsort[d]] = (uint32_t)(v0 + i);
        }
        carry += tile;
        if (carry > last)
            break;
    }
}

static __global__ void __launch_bounds__(TAIL_THREADS)
    tail_kernel(const float *logits, int64_t V, const uint32_t *topk_idx, int k, double tau, int S,
                uint64_t seed, const int64_t *seq_index, const int32_t *pos, uint32_t *out,
                unsigned long long *flags)
{
    extern __shared__ uint64_t tail_dyn[];
    __shared__ float red_f[TAIL_WARPS];
    __shared__ uint64_t red_u[TAIL_WARPS];
    uint64_t *traw = tail_dyn, *tsort = traw + S;
    uint32_t *jsort = (uint32_t *)(tsort + S), *bits = jsort + S;
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
    float m = -INFINITY;
    for (int64_t v = threadIdx.x; v < V; v += TAIL_THREADS) {
        const float x = row[v];
        bad |= !isfinite(x);
        if (!tail_in_topk(bits, v))
            m = fmaxf(m, x);
    }
    if (__syncthreads_or(bad)) {
        if (threadIdx.x == 0)
            atomicMin(&flags[0], (unsigned long long)r);
        return;
    }
    m = tail_block_max(m, red_f);
    uint64_t W = 0;
    for (int64_t v = threadIdx.x; v < V; v += TAIL_THREADS)
        if (!tail_in_topk(bits, v))
            W += tkd_tail_weight(row[v], m, tau);
    tail_block_scan(W, red_u, &W); /* block sum */
    tail_targets(seed, (uint64_t)seq_index[r], (uint32_t)pos[r], S, W, traw, tsort, jsort);
    tail_assign(row, V, bits, m, tau, S, tsort, jsort, red_u, out + r * S);
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
    const size_t smem = tail_smem_bytes(V, S);
    if (smem > 48 * 1024)
        TKD_CUDA_CHECK(cudaFuncSetAttribute(tail_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem));
    tail_kernel<<<(unsigned)C, TAIL_THREADS, smem, (cudaStream_t)stream>>>(
        d_logits, V, d_topk_idx, k, (double)tau, S, seed, d_seq_index, d_pos, d_out, ws->d_flags);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}
