/* topk_cuda.cu — see topk_cuda.h. */
#include "common/status.h"
#include "kernels/cuda_check.h"
#include "kernels/cuda_mem.h"
#include "kernels/topk.h"
#include "kernels/topk_cuda.h"

#include <math.h>
#include <stdlib.h>

#define TOPK_THREADS 1024 /* one block per row: a chunk of C rows rarely fills the GPU, so go wide */
#define TOPK_WARPS (TOPK_THREADS / 32)
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

/* Adds 1 to hist[bin] for each lane (bin 256 = none), one shared atomic per distinct bin per warp:
 * logits of a row share few top bytes, and plain atomics would serialise on them. */
static __device__ __forceinline__ void topk_hist_add(uint32_t *hist, uint32_t bin)
{
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    if (bin < 256 && (threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1))
        atomicAdd(&hist[bin], (uint32_t)__popc(peers));
}

/* Merges two (max, Σ exp(z − max)) pairs. */
static __device__ __forceinline__ void topk_lse_merge(float &m, double &s, float m2, double s2)
{
    if (m2 == -INFINITY)
        return;
    if (m2 > m) {
        s = s * exp((double)m - (double)m2) + s2;
        m = m2;
    } else {
        s += s2 * exp((double)m2 - (double)m);
    }
}

/* Warp 0 picks the digit of this pass: the bin holding the kleft-th largest remaining key.
 * Lane l owns bins 255−8l … 248−8l, so a lane scan runs from the top bin down. */
static __device__ void topk_pick_digit(const uint32_t *hist, int shift, uint32_t *prefix,
                                       uint32_t *kleft)
{
    const int lane = threadIdx.x & 31;
    uint32_t c[8], sum = 0;
    for (int i = 0; i < 8; i++) {
        c[i] = hist[255 - 8 * lane - i];
        sum += c[i];
    }
    uint32_t incl = sum;
    for (int off = 1; off < 32; off <<= 1) {
        uint32_t t = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off)
            incl += t;
    }
    const uint32_t excl = incl - sum, want = *kleft;
    __syncwarp();
    if (excl < want && want <= incl) {
        uint32_t acc = excl;
        for (int i = 0; i < 8; i++) {
            if (acc + c[i] >= want) {
                *prefix |= (uint32_t)(255 - 8 * lane - i) << shift;
                *kleft = want - acc;
                break;
            }
            acc += c[i];
        }
    }
}

/* Pass 1: histogram of the top byte, online LSE of z = x/τ, finiteness. */
static __device__ void topk_pass_first(const float *row, int64_t V, float tau, uint32_t *hist,
                                       float *m_out, double *s_out, int *bad_out)
{
    float m = -INFINITY;
    double s = 0.0;
    int bad = 0;
    for (int64_t base = 0; base < V; base += TOPK_THREADS) {
        const int64_t v = base + threadIdx.x;
        uint32_t bin = 256;
        if (v < V) {
            const float x = row[v];
            bad |= !isfinite(x);
            const float z = x / tau;
            if (z > m) {
                s = s * (double)expf(m - z) + 1.0;
                m = z;
            } else {
                s += (double)expf(z - m);
            }
            bin = topk_key(x) >> 24;
        }
        topk_hist_add(hist, bin);
    }
    *m_out = m;
    *s_out = s;
    *bad_out = bad;
}

/* Block-wide merge of the per-thread LSE pairs; thread 0 gets the result. */
static __device__ double topk_lse_reduce(float m, double s, float *red_m, double *red_s)
{
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_down_sync(0xffffffffu, m, off);
        double s2 = __shfl_down_sync(0xffffffffu, s, off);
        topk_lse_merge(m, s, m2, s2);
    }
    const int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        red_m[w] = m;
        red_s[w] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < TOPK_WARPS; i++)
            topk_lse_merge(red_m[0], red_s[0], red_m[i], red_s[i]);
        return (double)red_m[0] + log(red_s[0]);
    }
    return 0.0;
}

typedef struct topk_smem {
    uint32_t hist[256];
    uint32_t cand_key[TKD_TOPK_MAX_K];
    uint32_t cand_idx[TKD_TOPK_MAX_K];
    uint32_t warp_gt[TOPK_WARPS], warp_eq[TOPK_WARPS];
    float red_m[TOPK_WARPS];
    double red_s[TOPK_WARPS];
    uint32_t prefix, kleft, n_gt, n_eq;
} topk_smem;

/* Ordered collection: every key > thr (exactly k − keq of them) and the first keq keys == thr by
 * id, in tiles of one element per thread, positions from ballots so the result is deterministic. */
static __device__ void topk_collect(const float *row, int64_t V, int k, topk_smem *sm)
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
            sm->cand_key[og] = key;
            sm->cand_idx[og] = (uint32_t)v;
        }
        if (eq && oe < keq) {
            sm->cand_key[ngt + oe] = key;
            sm->cand_idx[ngt + oe] = (uint32_t)v;
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

/* One block per row. */
static __global__ void __launch_bounds__(TOPK_THREADS)
    topk_kernel(const float *logits, int64_t V, int k, float tau, uint32_t *out_idx,
                float *out_val, float *out_lse, unsigned long long *flags)
{
    __shared__ topk_smem sm;
    const int64_t r = blockIdx.x;
    const float *row = logits + r * V;
    for (int i = threadIdx.x; i < 256; i += TOPK_THREADS)
        sm.hist[i] = 0;
    if (threadIdx.x == 0) {
        sm.prefix = 0;
        sm.kleft = (uint32_t)k;
        sm.n_gt = sm.n_eq = 0;
    }
    __syncthreads();
    float m;
    double s;
    int bad;
    topk_pass_first(row, V, tau, sm.hist, &m, &s, &bad);
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        atomicMin(&flags[0], (unsigned long long)r);
    const double lse = topk_lse_reduce(m, s, sm.red_m, sm.red_s);
    if (threadIdx.x == 0)
        out_lse[r] = (float)lse;
    if (threadIdx.x < 32)
        topk_pick_digit(sm.hist, 24, &sm.prefix, &sm.kleft);
    __syncthreads();
    for (int shift = 16; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += TOPK_THREADS)
            sm.hist[i] = 0;
        __syncthreads();
        const uint32_t mask = 0xffffffffu << (shift + 8), prefix = sm.prefix;
        for (int64_t base = 0; base < V; base += TOPK_THREADS) {
            const int64_t v = base + threadIdx.x;
            uint32_t bin = 256;
            if (v < V) {
                const uint32_t key = topk_key(row[v]);
                if ((key & mask) == prefix)
                    bin = (key >> shift) & 255u;
            }
            if (__any_sync(0xffffffffu, bin < 256)) /* most warps hold no candidate by now */
                topk_hist_add(sm.hist, bin);
        }
        __syncthreads();
        if (threadIdx.x < 32)
            topk_pick_digit(sm.hist, shift, &sm.prefix, &sm.kleft);
        __syncthreads();
    }
    topk_collect(row, V, k, &sm);
    /* Rank sort of the k winners by (key desc, id asc); ids are distinct, so ranks are too. */
    for (int i = threadIdx.x; i < k; i += TOPK_THREADS) {
        const uint32_t ki = sm.cand_key[i], ii = sm.cand_idx[i];
        int rank = 0;
        for (int j = 0; j < k; j++) {
            const uint32_t kj = sm.cand_key[j], ij = sm.cand_idx[j];
            rank += kj > ki || (kj == ki && ij < ii);
        }
        out_idx[r * k + rank] = ii;
        out_val[r * k + rank] = row[ii];
    }
}

static tkd_status topk_ws_setup(tkd_topk_cuda_ws *ws)
{
    const size_t bytes = 2 * sizeof(unsigned long long);
    TKD_TRY(tkd_cuda_malloc((void **)&ws->d_flags, bytes, "topk_cuda: error flags", NULL));
    TKD_TRY(tkd_cuda_malloc_host((void **)&ws->h_flags, bytes, "topk_cuda: error flags"));
    TKD_CUDA_CHECK(cudaMemset(ws->d_flags, 0xff, bytes)); /* ~0: no row flagged */
    return TKD_OK;
}

extern "C" tkd_status tkd_topk_cuda_ws_create(tkd_topk_cuda_ws **out)
{
    *out = NULL;
    tkd_topk_cuda_ws *ws = (tkd_topk_cuda_ws *)calloc(1, sizeof *ws);
    if (!ws)
        return tkd_error_set(TKD_ERR_NOMEM, "topk_cuda: cannot allocate the workspace");
    tkd_status st = topk_ws_setup(ws);
    if (st != TKD_OK) {
        tkd_topk_cuda_ws_free(ws);
        return st;
    }
    *out = ws;
    return TKD_OK;
}

extern "C" void tkd_topk_cuda_ws_free(tkd_topk_cuda_ws *ws)
{
    if (!ws)
        return;
    tkd_cuda_free(ws->d_flags);
    tkd_cuda_free_host(ws->h_flags);
    free(ws);
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
    topk_kernel<<<(unsigned)C, TOPK_THREADS, 0, (cudaStream_t)stream>>>(d_logits, V, k, tau, d_idx,
                                                                       d_val, d_lse, ws->d_flags);
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
