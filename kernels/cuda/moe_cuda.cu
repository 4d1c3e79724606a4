/* moe_cuda.cu — see moe_cuda.h. The experts' GEMMs over the rows sorted to each expert, one of:
 *  - ours on Hopper (gemm_sm90/moe_gemm_sm90.h): one persistent wgmma launch for every expert's gate
 *    and up products with the activation in its epilogue, one for the down products, over a tile
 *    list built from the counts;
 *  - ours elsewhere (moe_gemm_cuda.h, mma.sync): the same two products, G and U through memory and
 *    the act kernel between;
 *  - cuBLAS: one grouped call (cublasGemmGroupedBatchedEx) for every expert's gate and up
 *    projections and one for the down projections, or one GEMM per expert and projection.
 * auto (the default) takes ours where the device has the Hopper kernel, else chooses between the
 * two cuBLAS ways per call (auto_grouped); TKD_MOE_GEMM fixes one. MXFP4 experts: ours on Hopper
 * decodes them inside its GEMMs; every other way runs over a bf16 copy of the layer's experts,
 * decoded first (mxfp4_to_bf16_kernel). */
#include "kernels/cuda/moe_cuda.h"

#include <cublas_v2.h>
#include <cub/cub.cuh>
#include <cuda_bf16.h>
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "common/mxfp4_bits.h"
#include "kernels/cuda/moe_gemm_cuda.h"
#include "kernels/gemm_sm90/moe_gemm_sm90.h"

static constexpr int kMoeMaxE = 1024; /* experts a layer may have (the router kernel's shared row) */

/* cublasGemmGroupedBatchedEx's host arrays, one entry per group (an expert with rows). */
struct tkd_cuda_moe_group_args {
    cublasOperation_t ta[kMoeMaxE], tb[kMoeMaxE];
    int m[kMoeMaxE], n[kMoeMaxE], k[kMoeMaxE], lda[kMoeMaxE], ldb[kMoeMaxE], ldc[kMoeMaxE], size[kMoeMaxE];
    float alpha[kMoeMaxE], beta[kMoeMaxE];
};

struct tkd_cuda_moe_ws {
    tkd_moe_params p;
    int max_tokens;
    cudaStream_t stream;
    cublasHandle_t blas;
    float *logits;       /* (max_tokens, E) */
    int32_t *sel;        /* (max_tokens, k) routing: experts */
    float *wts;          /* (max_tokens, k) routing: weights */
    int32_t *pair_iota;  /* (P) 0..P-1, the sort's values */
    int32_t *keys_sorted; /* (P) expert of each sorted row */
    int32_t *pair_of;    /* (P) sorted row -> pair (token·k + slot) */
    int32_t *row_of;     /* (P) pair -> sorted row */
    int32_t *counts;     /* (E) rows per expert, device */
    int32_t *h_counts;   /* (E) the same on the host (pinned) */
    void *sort_tmp;
    size_t sort_bytes;
    uint16_t *xs;        /* (P, D) gathered rows */
    uint16_t *g, *u;     /* (P, I) bf16 each */
    uint16_t *h;         /* (P, I) */
    uint16_t *o;         /* (P, D) bf16 */
    uint16_t *deq;       /* p.mxfp4 decoded a layer at a time: (E, I, D) W_gate, (E, I, D) W_up, (E, D, I)
                          * W_down in bf16, allocated on the first call that needs it */
    int mx_layer;        /* tkd_cuda_moe_ws_set_mxfp4_layer */
    int mx_in_gemm;      /* the last call decoded the MXFP4 experts inside our Hopper GEMM */
    int grouped;         /* TKD_CUDA_MOE_GEMM_*: -1 (default) auto_grouped(), 0 loop, 1 grouped, 2 ours */
    int ran;             /* the mode the last call ran (0, 1 or 2) */
    int no_grouped;      /* this cuBLAS refused the grouped call once: never again */
    int pad;             /* the loop's row counts rounded up to a multiple of this (tkd_cuda_moe_ws_set_pad) */
    /* The grouped calls' problem list, a layer at a time: 9·E pointers (A, B, C of 2 problems per
     * expert for gate/up, then A, B, C of one per expert for down), staged in pinned host memory
     * and copied to the device (cuBLAS reads them there); the per-group sizes stay on the host. */
    const void **h_ptrs, **d_ptrs;
    int *h_rows;         /* (E) rows of each group */
    tkd_cuda_moe_group_args ga; /* the per-group arguments cuBLAS reads on the host */
    /* Our GEMM's M-tiles (moe_gemm_cuda.h), built on the host from h_counts each call and copied
     * from pinned memory: (max_tiles, TKD_MOE_TILE_INTS) int32 each. */
    int32_t *h_tiles, *d_tiles;
    /* Our Hopper GEMM (gemm_sm90/moe_gemm_sm90.h): a workspace (schedule, error flag, stream) for
     * the gate/up launch and one for the down launch, each on its own schedule; NULL where the
     * device is not compute capability 9.0 or ours_kernel asks for mma.sync. The error flags are
     * copied to the host with each call's counts (a stall in the previous call's GEMMs is reported
     * by the next call). With two tile sizes, h_tiles and d_tiles hold the down launch's list after
     * the gate/up one's. */
    tkd_lmhead_sm90_ws *sm90, *sm90_dn;
    int ours_kernel; /* TKD_CUDA_MOE_OURS_* */
    unsigned *h_err; /* (2) */
};

namespace {

constexpr int kRouteWarps = 4;
constexpr int kMaxE = kMoeMaxE, kMaxK = 16;
constexpr double kGroupedMaxFlop = 3e9; /* auto_grouped() */
constexpr int kMaxPad = 256; /* the slack rows of xs, g, u, h and o (padded) */

__device__ __forceinline__ float bf2f(uint16_t x) { return __uint_as_float((unsigned)x << 16); }
__device__ __forceinline__ uint16_t f2bf(float x)
{
    __nv_bfloat16 b = __float2bfloat16_rn(x);
    return *reinterpret_cast<uint16_t *>(&b);
}

/* The lane's best (value, index) among its entries of v (n), largest value first, the lower index
 * on ties, then reduced over the warp the same way. */
__device__ void warp_argmax(const float *v, int n, float &best, int &arg)
{
    const int lane = threadIdx.x & 31;
    best = -INFINITY, arg = -1;
    for (int e = lane; e < n; e += 32)
        if (v[e] > best || arg < 0) /* lanes see increasing indices: > keeps the lower on ties */
            best = v[e], arg = e;
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
        if (oa >= 0 && (arg < 0 || ob > best || (ob == best && oa < arg)))
            best = ob, arg = oa;
    }
}

__device__ float warp_max(float x)
{
    for (int o = 16; o > 0; o >>= 1)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ float warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* One warp per token: its logits (+ bias) into shared memory, then the router of p. Taken entries
 * become -inf (softmax probabilities are ≥ 0, logits finite). */
__global__ void __launch_bounds__(32 * kRouteWarps) route_kernel(const float *logits, const uint16_t *bias, int N,
                                                                 tkd_moe_params p, int32_t *sel, float *wts)
{
    __shared__ float sv[kRouteWarps][kMaxE];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int n = blockIdx.x * kRouteWarps + warp;
    if (n >= N)
        return;
    float *v = sv[warp];
    for (int e = lane; e < p.E; e += 32)
        v[e] = logits[(int64_t)n * p.E + e] + (bias ? bf2f(bias[e]) : 0.0f);
    __syncwarp();
    if (p.router == TKD_MOE_ROUTER_SOFTMAX_TOPK) { /* softmax over E, as moe_softmax */
        float mx = -INFINITY;
        for (int e = lane; e < p.E; e += 32)
            mx = fmaxf(mx, v[e]);
        mx = warp_max(mx);
        float s = 0.0f;
        for (int e = lane; e < p.E; e += 32)
            s += (v[e] = expf(v[e] - mx));
        s = warp_sum(s);
        __syncwarp();
        for (int e = lane; e < p.E; e += 32)
            v[e] /= s;
        __syncwarp();
    }
    float w[kMaxK];
    int id[kMaxK];
    for (int j = 0; j < p.k; j++) {
        warp_argmax(v, p.E, w[j], id[j]);
        __syncwarp();
        if (lane == 0)
            v[id[j]] = -INFINITY;
        __syncwarp();
    }
    if (lane != 0)
        return;
    if (p.router == TKD_MOE_ROUTER_SOFTMAX_TOPK) {
        float s = 0.0f;
        for (int j = 0; j < p.k; j++)
            s += w[j];
        if (p.norm_topk_prob)
            for (int j = 0; j < p.k; j++)
                w[j] /= s;
    } else { /* softmax over the k chosen logits; the first is their max (kept: w[0] is overwritten) */
        const float mx = w[0];
        float s = 0.0f;
        for (int j = 0; j < p.k; j++)
            s += (w[j] = expf(w[j] - mx));
        for (int j = 0; j < p.k; j++)
            w[j] /= s;
    }
    for (int j = 0; j < p.k; j++) {
        sel[(int64_t)n * p.k + j] = id[j];
        wts[(int64_t)n * p.k + j] = w[j];
    }
}

/* counts[e] = rows routed to expert e; row_of[pair] = sorted row; xs[row] = x[token of the row] */
__global__ void count_kernel(const int32_t *sel, int64_t P, int32_t *counts)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < P; i += (int64_t)gridDim.x * blockDim.x)
        atomicAdd(&counts[sel[i]], 1); /* counts only: the order comes from the stable sort */
}

/* One block per sorted row; W = 8: 16-byte copies (D a multiple of 8, x and xs 16-byte aligned),
 * W = 1: one element at a time. */
template <int W>
__global__ void gather_kernel(const uint16_t *x, const int32_t *pair_of, int64_t P, int k, int D, uint16_t *xs,
                              int32_t *row_of)
{
    const int64_t r = blockIdx.x;
    if (r >= P)
        return;
    const int32_t pair = pair_of[r];
    if (threadIdx.x == 0)
        row_of[pair] = (int32_t)r;
    const uint16_t *src = x + (int64_t)(pair / k) * D;
    uint16_t *dst = xs + r * D;
    for (int d = threadIdx.x * W; d < D; d += blockDim.x * W)
        if (W == 8)
            *reinterpret_cast<uint4 *>(dst + d) = *reinterpret_cast<const uint4 *>(src + d);
        else
            dst[d] = src[d];
}

/* h = act(g + b_g, u + b_u) as bf16 for every sorted row (its expert from the sort's keys). */
__global__ void act_kernel(const uint16_t *g, const uint16_t *u, const int32_t *expert_of, const uint16_t *bg,
                           const uint16_t *bu, int64_t P, int I, tkd_moe_params p, uint16_t *h)
{
    const int64_t n = P * I;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / I;
        const int c = (int)(i % I), e = expert_of[r];
        float gv = bf2f(g[i]) + (bg ? bf2f(bg[(int64_t)e * I + c]) : 0.0f);
        float uv = bf2f(u[i]) + (bu ? bf2f(bu[(int64_t)e * I + c]) : 0.0f);
        float out;
        if (p.act == TKD_MOE_ACT_SWIGLU) {
            out = gv / (1.0f + expf(-gv)) * uv;
        } else { /* gpt-oss's clamped SwiGLU, as tkd_cpu_swiglu_clamp_fwd */
            gv = fminf(gv, p.limit);
            uv = fminf(fmaxf(uv, -p.limit), p.limit);
            out = (uv + 1.0f) * (gv / (1.0f + expf(-p.alpha * gv)));
        }
        h[i] = f2bf(out);
    }
}

/* W consecutive bf16 as fp32 (W = 8: one 16-byte load). */
template <int W>
__device__ __forceinline__ void load_w(const uint16_t *q, float (&f)[W])
{
    if (W == 8) {
        const uint4 v = *reinterpret_cast<const uint4 *>(q);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
            f[2 * i] = __uint_as_float(w[i] << 16), f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
        f[0] = bf2f(q[0]);
    }
}

/* y[n] = Σ_j w_j (o[row_j] + b_down[e_j]) over the token's slots in increasing expert order, fp32,
 * one block per token, each thread W consecutive columns (W = 8: D a multiple of 8, o, b_down and y
 * 16-byte aligned); every element the same sum in the same order for either W. */
template <int W>
__global__ void combine_kernel(const uint16_t *o, const int32_t *sel, const float *wts, const int32_t *row_of,
                               const uint16_t *bd, int k, int D, uint16_t *y)
{
    const int64_t n = blockIdx.x;
    __shared__ int64_t s_row[kMaxK], s_bias[kMaxK]; /* in expert order: o's row offset, b_down's */
    __shared__ float s_w[kMaxK];
    if (threadIdx.x == 0) { /* the slots by expert (k ≤ 16: insertion sort) */
        int order[kMaxK];
        for (int j = 0; j < k; j++)
            order[j] = j;
        for (int a = 1; a < k; a++)
            for (int b = a; b > 0 && sel[n * k + order[b]] < sel[n * k + order[b - 1]]; b--) {
                const int t = order[b];
                order[b] = order[b - 1], order[b - 1] = t;
            }
        for (int jj = 0; jj < k; jj++) {
            const int j = order[jj];
            s_row[jj] = (int64_t)row_of[n * k + j] * D, s_bias[jj] = (int64_t)sel[n * k + j] * D;
            s_w[jj] = wts[n * k + j];
        }
    }
    __syncthreads();
    for (int d = threadIdx.x * W; d < D; d += blockDim.x * W) {
        float acc[W];
#pragma unroll
        for (int i = 0; i < W; i++)
            acc[i] = 0.0f;
        for (int jj = 0; jj < k; jj++) {
            float ov[W], bv[W];
            load_w<W>(o + s_row[jj] + d, ov);
            if (bd)
                load_w<W>(bd + s_bias[jj] + d, bv);
#pragma unroll
            for (int i = 0; i < W; i++)
                acc[i] += s_w[jj] * (ov[i] + (bd ? bv[i] : 0.0f));
        }
#pragma unroll
        for (int i = 0; i < W; i++)
            y[n * D + d + i] = f2bf(acc[i]);
    }
}

/* MXFP4 blocks (n_blocks of 16 bytes: 32 E2M1 codes each, 16-byte aligned) with one E8M0 scale
 * each into bf16 (64 bytes a block, 16-byte aligned): value · 2^(s − 127), exact
 * (common/mxfp4_bits.h); one thread a block. */
__global__ void mxfp4_to_bf16_kernel(const uint8_t *blocks, const uint8_t *scales, int64_t n_blocks, uint16_t *out)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n_blocks; i += stride) {
        const uint4 q = reinterpret_cast<const uint4 *>(blocks)[i];
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
        const unsigned s = scales[i];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint32_t r[4];
            tkd_mxfp4_e2m1x8_bits(w[j], r);
            tkd_mxfp4_scale_f32(r, s);
            reinterpret_cast<uint4 *>(out)[4 * i + j] = make_uint4(r[0], r[1], r[2], r[3]);
        }
    }
}

__global__ void iota_kernel(int32_t *v, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        v[i] = (int32_t)i;
}

unsigned grid_for(int64_t n, int threads)
{
    const int64_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : b > 65535 * 4 ? 65535 * 4 : b);
}

bool aligned16(const void *q) { return ((uintptr_t)q & 15u) == 0; }

int bits_for(int E)
{
    int b = 1;
    while ((1 << b) < E)
        b++;
    return b;
}

/* c (m, n) row-major, of type ct (fp32 or bf16) = a (m, kd) bf16 row-major · b (n, kd) bf16 row-majorᵀ,
 * fp32 accumulation */
tkd_status gemm_nt(cublasHandle_t h, const uint16_t *a, const uint16_t *b, int m, int n, int kd, void *c,
                   cudaDataType_t ct)
{
    const float one = 1.0f, zero = 0.0f;
    TKD_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, kd, &one, b, CUDA_R_16BF, kd, a, CUDA_R_16BF, kd,
                                  &zero, c, ct, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return TKD_OK;
}

/* The most M-tiles tkd_moe_gemm_tiles makes from max_tokens · k rows over E experts, with the
 * smallest tile rows used (ping-pong's 64). */
constexpr int kMinTileRows = 64;

/* The Hopper schedules ours runs by default, gate/up and down (TKD_CUDA_MOE_OURS_DEFAULT): ping-pong
 * for both, the fastest at every teacher layer measured once the tiles go by groups (H200,
 * moe_bench: 1.44 against 1.63 ms cooperative at Qwen3-30B-A3B's layer, 3.04 against 3.28 at
 * gpt-oss-20b's, 3.58 against 4.28 at gpt-oss-120b's; docs/PERFORMANCE.md). */
constexpr int kDefaultGateUp = TKD_LMHEAD_SM90_SCHED_PINGPONG, kDefaultDown = TKD_LMHEAD_SM90_SCHED_PINGPONG;
/* With MXFP4 experts both cooperative, the one schedule that decodes them inside the GEMM (its two
 * consumer warpgroups decode each K step's weights together: moe_gemm_sm90.h). */
constexpr int kDefaultMx = TKD_LMHEAD_SM90_SCHED_COOP;
size_t max_tiles(const tkd_cuda_moe_ws *ws)
{
    const size_t P = (size_t)ws->max_tokens * ws->p.k;
    return (P + kMinTileRows - 1) / kMinTileRows + (size_t)ws->p.E;
}

/* One Hopper GEMM workspace on schedule sched and ws's stream into *out; NULL and TKD_OK on a device
 * without the kernel (TKD_ERR_UNSUPPORTED from the create is not an error here). */
tkd_status sm90_ws(const tkd_cuda_moe_ws *ws, int sched, tkd_lmhead_sm90_ws **out)
{
    const tkd_status st = tkd_lmhead_sm90_ws_create(out, sched);
    if (st == TKD_ERR_UNSUPPORTED) {
        tkd_error_clear();
        *out = NULL;
        return TKD_OK;
    }
    TKD_TRY(st);
    tkd_lmhead_sm90_ws_set_stream(*out, ws->stream);
    return TKD_OK;
}

/* ws->sm90 and ws->sm90_dn for ours_kernel: the schedules it names (DEFAULT: kDefaultGateUp and
 * kDefaultDown, with MXFP4 experts kDefaultMx), or none (mma.sync asked for, or a device without the Hopper kernel). */
tkd_status sm90_setup(tkd_cuda_moe_ws *ws)
{
    tkd_lmhead_sm90_ws_free(ws->sm90);
    tkd_lmhead_sm90_ws_free(ws->sm90_dn);
    ws->sm90 = ws->sm90_dn = NULL;
    const int k = ws->ours_kernel;
    if (k == TKD_CUDA_MOE_OURS_MMA_SYNC)
        return TKD_OK;
    const int pp = TKD_LMHEAD_SM90_SCHED_PINGPONG, coop = TKD_LMHEAD_SM90_SCHED_COOP;
    const bool mx = ws->p.mxfp4;
    const int def_gu = mx ? kDefaultMx : kDefaultGateUp, def_dn = mx ? kDefaultMx : kDefaultDown;
    const int gu = k == TKD_CUDA_MOE_OURS_SM90_PINGPONG ? pp : k == TKD_CUDA_MOE_OURS_DEFAULT ? def_gu : coop;
    const int dn = k == TKD_CUDA_MOE_OURS_SM90_COOP ? coop : k == TKD_CUDA_MOE_OURS_DEFAULT ? def_dn : pp;
    TKD_TRY(sm90_ws(ws, gu, &ws->sm90));
    if (ws->sm90)
        TKD_TRY(sm90_ws(ws, dn, &ws->sm90_dn));
    return TKD_OK;
}

tkd_status ws_alloc(tkd_cuda_moe_ws *ws)
{
    const tkd_moe_params &p = ws->p;
    const size_t N = (size_t)ws->max_tokens, P = N * p.k, Ps = P + kMaxPad; /* Ps: with padded()'s slack */
    TKD_CUBLAS_CHECK(cublasCreate(&ws->blas));
    TKD_CUBLAS_CHECK(cublasSetStream(ws->blas, ws->stream));
    const char *h = "MoE workspace: call it on fewer tokens at a time";
    TKD_TRY(tkd_cuda_malloc((void **)&ws->logits, N * p.E * 4, "moe: router logits", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->sel, P * 4, "moe: routing", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->wts, P * 4, "moe: routing", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->pair_iota, P * 4, "moe: sort", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->keys_sorted, P * 4, "moe: sort", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->pair_of, P * 4, "moe: sort", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->row_of, P * 4, "moe: sort", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->counts, (size_t)p.E * 4, "moe: counts", h));
    TKD_TRY(tkd_cuda_malloc_host((void **)&ws->h_counts, (size_t)p.E * 4, "moe: counts"));
    TKD_TRY(tkd_cuda_malloc_host((void **)&ws->h_ptrs, sizeof(void *) * 9 * (size_t)p.E, "moe: grouped GEMM problems"));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->d_ptrs, sizeof(void *) * 9 * (size_t)p.E, "moe: grouped GEMM problems", h));
    const size_t tile_bytes = sizeof(int32_t) * TKD_MOE_TILE_INTS * 2 * max_tiles(ws); /* two lists */
    TKD_TRY(tkd_cuda_malloc_host((void **)&ws->h_tiles, tile_bytes, "moe: our GEMM's tiles"));
    TKD_TRY(tkd_cuda_malloc_host((void **)&ws->h_err, 2 * sizeof *ws->h_err, "moe: our GEMM's error flags"));
    ws->h_err[0] = ws->h_err[1] = 0;
    TKD_TRY(sm90_setup(ws));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->d_tiles, tile_bytes, "moe: our GEMM's tiles", h));
    if (!(ws->h_rows = (int *)malloc(sizeof(int) * (size_t)p.E)))
        return tkd_error_set(TKD_ERR_NOMEM, "moe (cuda): out of host memory");
    TKD_TRY(tkd_cuda_malloc((void **)&ws->xs, Ps * p.D * 2, "moe: gathered rows", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->g, Ps * p.inter * 2, "moe: gate", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->u, Ps * p.inter * 2, "moe: up", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->h, Ps * p.inter * 2, "moe: activations", h));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->o, Ps * p.D * 2, "moe: expert outputs", h));
    TKD_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, ws->sort_bytes, (const int32_t *)nullptr,
                                                   (int32_t *)nullptr, (const int32_t *)nullptr, (int32_t *)nullptr,
                                                   (int64_t)P, 0, bits_for(p.E), ws->stream));
    TKD_TRY(tkd_cuda_malloc(&ws->sort_tmp, ws->sort_bytes + 16, "moe: sort", h));
    iota_kernel<<<grid_for((int64_t)P, 256), 256, 0, ws->stream>>>(ws->pair_iota, (int64_t)P);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

/* A loop GEMM's row count for an expert with c rows: c rounded up to a multiple of ws->pad, so
 * that cuBLAS sees few distinct shapes. Its per-shape heuristics are cached, and the counts change
 * every layer and batch of a dump, so exact counts miss that cache on almost every GEMM. The
 * extra rows read the next expert's rows (or the buffers' kMaxPad slack rows) and write into the
 * next expert's outputs, which that expert's own GEMM overwrites later on the same stream. Only
 * the last expert's spill reaches the slack, and nothing reads it. */
int padded(const tkd_cuda_moe_ws *ws, int c)
{
    return c == 0 ? 0 : (c + ws->pad - 1) / ws->pad * ws->pad;
}

/* h (P, I) = act(G + b_g, U + b_u) for every sorted row, each with its expert's biases. */
tkd_status run_act(tkd_cuda_moe_ws *ws, const tkd_cuda_moe_weights *w, int64_t P)
{
    const int I = ws->p.inter;
    act_kernel<<<grid_for(P * I, 256), 256, 0, ws->stream>>>(ws->g, ws->u, ws->keys_sorted, w->b_gate, w->b_up, P, I,
                                                             ws->p, ws->h);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

/* Per expert with rows: G, U = X_e W_gateᵀ, X_e W_upᵀ; then h for all rows; then O = h_e W_downᵀ. */
tkd_status run_experts_loop(tkd_cuda_moe_ws *ws, const tkd_cuda_moe_weights *w, int64_t P)
{
    const tkd_moe_params &p = ws->p;
    const int D = p.D, I = p.inter;
    int64_t r0 = 0;
    for (int e = 0; e < p.E; r0 += ws->h_counts[e], e++) {
        const int c = padded(ws, ws->h_counts[e]);
        if (c == 0)
            continue;
        TKD_TRY(gemm_nt(ws->blas, ws->xs + r0 * D, w->w_gate + (int64_t)e * I * D, c, I, D, ws->g + r0 * I,
                        CUDA_R_16BF));
        TKD_TRY(gemm_nt(ws->blas, ws->xs + r0 * D, w->w_up + (int64_t)e * I * D, c, I, D, ws->u + r0 * I,
                        CUDA_R_16BF));
    }
    TKD_TRY(run_act(ws, w, P));
    r0 = 0;
    for (int e = 0; e < p.E; r0 += ws->h_counts[e], e++) {
        const int c = padded(ws, ws->h_counts[e]);
        if (c > 0)
            TKD_TRY(gemm_nt(ws->blas, ws->h + r0 * I, w->w_down + (int64_t)e * D * I, c, D, I, ws->o + r0 * D,
                            CUDA_R_16BF));
    }
    return TKD_OK;
}

/* One grouped call over G groups of gs problems each (gs 1 or 2; group g's problems share its
 * row count rows[g]): per problem, row-major C (rows, m) bf16 = B (rows, kd) bf16 · A (m, kd)
 * bf16ᵀ, as gemm_nt (cuBLAS 13.0 takes bf16 in and out, not bf16 in and fp32 out). ptrs (device):
 * the problems' A, then their B, then their C, G·gs each. */
cublasStatus_t grouped_nt(tkd_cuda_moe_ws *ws, int G, int gs, const int *rows, int m, int kd, const void *const *ptrs)
{
    tkd_cuda_moe_group_args &a = ws->ga;
    for (int g = 0; g < G; g++) {
        a.ta[g] = CUBLAS_OP_T, a.tb[g] = CUBLAS_OP_N;
        a.m[g] = m, a.n[g] = rows[g], a.k[g] = kd;
        a.lda[g] = kd, a.ldb[g] = kd, a.ldc[g] = m;
        a.size[g] = gs;
        a.alpha[g] = 1.0f, a.beta[g] = 0.0f;
    }
    const int np = G * gs;
    return cublasGemmGroupedBatchedEx(ws->blas, a.ta, a.tb, a.m, a.n, a.k, a.alpha, ptrs, CUDA_R_16BF, a.lda,
                                      ptrs + np, CUDA_R_16BF, a.ldb, a.beta, (void *const *)(ptrs + 2 * np),
                                      CUDA_R_16BF, a.ldc, G, a.size, CUBLAS_COMPUTE_32F);
}

/* The experts' GEMMs as two grouped calls (gate and up together, then down), the activation
 * between them. CUBLAS_STATUS_NOT_SUPPORTED from the first call (a cuBLAS without bf16 grouped
 * GEMMs) leaves nothing written: the caller falls back to the loop. */
tkd_status run_experts_grouped(tkd_cuda_moe_ws *ws, const tkd_cuda_moe_weights *w, int64_t P, bool *refused)
{
    const tkd_moe_params &p = ws->p;
    const int D = p.D, I = p.inter;
    *refused = false;
    int G = 0;
    for (int e = 0; e < p.E; e++)
        G += ws->h_counts[e] > 0;
    const void **gu = ws->h_ptrs;            /* 6 G: A (gate, up per expert), then B, then C */
    const void **dn = gu + 6 * G;            /* 3 G: A, B, C of the down projections */
    int64_t r0 = 0;
    for (int g = 0, e = 0; e < p.E; r0 += ws->h_counts[e], e++) {
        if (ws->h_counts[e] == 0)
            continue;
        gu[2 * g] = w->w_gate + (int64_t)e * I * D, gu[2 * g + 1] = w->w_up + (int64_t)e * I * D;
        gu[2 * G + 2 * g] = gu[2 * G + 2 * g + 1] = ws->xs + r0 * D;
        gu[4 * G + 2 * g] = ws->g + r0 * I, gu[4 * G + 2 * g + 1] = ws->u + r0 * I;
        dn[g] = w->w_down + (int64_t)e * D * I, dn[G + g] = ws->h + r0 * I, dn[2 * G + g] = ws->o + r0 * D;
        ws->h_rows[g++] = ws->h_counts[e];
    }
    TKD_CUDA_CHECK(cudaMemcpyAsync(ws->d_ptrs, ws->h_ptrs, sizeof(void *) * 9 * (size_t)G, cudaMemcpyHostToDevice,
                                   ws->stream));
    cublasStatus_t st = grouped_nt(ws, G, 2, ws->h_rows, I, D, ws->d_ptrs);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
        *refused = true;
        return TKD_OK;
    }
    TKD_CUBLAS_CHECK(st);
    TKD_TRY(run_act(ws, w, P));
    TKD_CUBLAS_CHECK(grouped_nt(ws, G, 1, ws->h_rows, D, I, ws->d_ptrs + 6 * G));
    return TKD_OK;
}

/* auto's choice for this call's counts: grouped when the average expert with rows has a gate
 * product under kGroupedMaxFlop. cuBLAS 13.0's grouped GEMM beats one GEMM per expert only on
 * many small problems: on an H200 with balanced routing, 2.9 ms against 5.5 at Qwen3-30B-A3B's
 * layer (512 rows an expert, I 768, D 2048: 1.6 GFLOP each), but 6.3 against 3.6 at gpt-oss-20b's
 * (17 GFLOP) and 7.2 against 5.5 at gpt-oss-120b's (4.2 GFLOP) (moe_bench, docs/PERFORMANCE.md). */
bool auto_grouped(const tkd_cuda_moe_ws *ws, int64_t P)
{
    int G = 0;
    for (int e = 0; e < ws->p.E; e++)
        G += ws->h_counts[e] > 0;
    return G > 0 && 2.0 * ((double)P / G) * ws->p.inter * ws->p.D < kGroupedMaxFlop;
}

/* Our grouped GEMM: the tile list from this call's counts (the previous call's copy from h_tiles
 * finished before this call's counts sync), then on Hopper gate and up with the activation in one
 * launch and down in another; elsewhere gate and up in one launch, the activation, and down. */
tkd_status run_experts_ours(tkd_cuda_moe_ws *ws, const tkd_cuda_moe_weights *w, int64_t P, bool mx)
{
    const tkd_moe_params &p = ws->p;
    const int tile_m = ws->sm90 ? tkd_moe_gemm_sm90_tile_rows(ws->sm90) : TKD_MOE_GEMM_TILE_M;
    const int nt = tkd_moe_gemm_tiles(ws->h_counts, p.E, tile_m, ws->h_tiles);
    const int tile_dn = ws->sm90 ? tkd_moe_gemm_sm90_tile_rows(ws->sm90_dn) : tile_m;
    int32_t *h_dn = ws->h_tiles + (size_t)TKD_MOE_TILE_INTS * nt;
    const int nt_dn = tile_dn == tile_m ? 0 : tkd_moe_gemm_tiles(ws->h_counts, p.E, tile_dn, h_dn);
    TKD_CUDA_CHECK(cudaMemcpyAsync(ws->d_tiles, ws->h_tiles,
                                   sizeof(int32_t) * TKD_MOE_TILE_INTS * (size_t)(nt + nt_dn),
                                   cudaMemcpyHostToDevice, ws->stream));
    if (ws->sm90) {
        const int32_t *d_dn = nt_dn ? ws->d_tiles + (size_t)TKD_MOE_TILE_INTS * nt : ws->d_tiles;
        if (mx) {
            TKD_TRY(tkd_moe_gemm_sm90_gate_up_mxfp4(ws->sm90, ws->xs, &w->q, w->b_gate, w->b_up, &p, ws->d_tiles, nt,
                                                    (int)P, p.inter, p.D, ws->h));
            return tkd_moe_gemm_sm90_down_mxfp4(ws->sm90_dn, ws->h, &w->q, p.E, d_dn, nt_dn ? nt_dn : nt, (int)P,
                                                p.D, p.inter, ws->o);
        }
        TKD_TRY(tkd_moe_gemm_sm90_gate_up(ws->sm90, ws->xs, w->w_gate, w->w_up, w->b_gate, w->b_up, &p, ws->d_tiles,
                                          nt, (int)P, p.inter, p.D, ws->h));
        return tkd_moe_gemm_sm90_down(ws->sm90_dn, ws->h, w->w_down, p.E, d_dn, nt_dn ? nt_dn : nt, (int)P, p.D,
                                      p.inter, ws->o);
    }
    TKD_TRY(tkd_cuda_moe_gemm(ws->xs, w->w_gate, w->w_up, ws->d_tiles, nt, (int)P, p.inter, p.D, ws->g, ws->u,
                              ws->stream));
    TKD_TRY(run_act(ws, w, P));
    return tkd_cuda_moe_gemm(ws->h, w->w_down, NULL, ws->d_tiles, nt, (int)P, p.D, p.inter, ws->o, NULL, ws->stream);
}

/* Whether this call runs our GEMM: asked for, or auto where the Hopper kernel takes the shape. */
bool use_ours(const tkd_cuda_moe_ws *ws)
{
    return ws->grouped == TKD_CUDA_MOE_GEMM_OURS ||
           (ws->grouped < 0 && ws->sm90 && ws->p.D % 8 == 0 && ws->p.inter % 8 == 0);
}

/* Whether this call decodes its MXFP4 experts inside our Hopper GEMM: the shapes that GEMM takes
 * (moe_gemm_sm90.h: K steps of whole blocks; the alignment tkd_cuda_moe_fwd checked) and both
 * launches cooperative, the schedule it runs on. */
bool mx_in_gemm(const tkd_cuda_moe_ws *ws)
{
    const tkd_moe_params &p = ws->p;
    return p.mxfp4 && !ws->mx_layer && ws->sm90 && use_ours(ws) && p.D % 64 == 0 && p.inter % 64 == 0 &&
           tkd_moe_gemm_sm90_tile_rows(ws->sm90) == 128 && tkd_moe_gemm_sm90_tile_rows(ws->sm90_dn) == 128;
}

/* The MXFP4 experts of w as a bf16 copy in ws->deq (allocated on first use), pointed to by *wd. */
tkd_status decode_layer(tkd_cuda_moe_ws *ws, const tkd_cuda_moe_weights *w, tkd_cuda_moe_weights *wd)
{
    const tkd_moe_params &p = ws->p;
    const size_t n[3] = {(size_t)p.E * p.inter * p.D, (size_t)p.E * p.inter * p.D, (size_t)p.E * p.D * p.inter};
    if (!ws->deq)
        TKD_TRY(tkd_cuda_malloc((void **)&ws->deq, (n[0] + n[1] + n[2]) * 2, "moe: one layer's MXFP4 experts decoded "
                                "to bf16", "the experts of one layer must fit in bf16 beside the model"));
    uint16_t *dst = ws->deq;
    const uint16_t **to[3] = {&wd->w_gate, &wd->w_up, &wd->w_down};
    for (int j = 0; j < 3; j++) {
        const int64_t nb = (int64_t)n[j] / 32; /* dst stays 16-byte aligned: each stack is 64·nb bytes */
        mxfp4_to_bf16_kernel<<<grid_for(nb, 256), 256, 0, ws->stream>>>(w->q.blocks[j], w->q.scales[j], nb, dst);
        TKD_CUDA_CHECK(cudaGetLastError());
        *to[j] = dst;
        dst += n[j];
    }
    return TKD_OK;
}

tkd_status run_experts(tkd_cuda_moe_ws *ws, const tkd_cuda_moe_weights *w, int64_t P)
{
    ws->mx_in_gemm = mx_in_gemm(ws);
    tkd_cuda_moe_weights wd = *w;
    if (ws->p.mxfp4 && !ws->mx_in_gemm) /* the layer's experts in bf16, then the same GEMMs as bf16 experts */
        TKD_TRY(decode_layer(ws, w, &wd));
    w = &wd;
    if (use_ours(ws)) {
        ws->ran = TKD_CUDA_MOE_GEMM_OURS;
        return run_experts_ours(ws, w, P, ws->mx_in_gemm);
    }
    const bool grouped = ws->grouped > 0 || (ws->grouped < 0 && !ws->no_grouped && auto_grouped(ws, P));
    ws->ran = grouped ? TKD_CUDA_MOE_GEMM_GROUPED : TKD_CUDA_MOE_GEMM_LOOP;
    if (grouped) {
        bool refused = false;
        TKD_TRY(run_experts_grouped(ws, w, P, &refused));
        if (!refused)
            return TKD_OK;
        ws->no_grouped = 1; /* this cuBLAS has no bf16 grouped GEMM: the loop from now on */
        ws->ran = TKD_CUDA_MOE_GEMM_LOOP;
    }
    return run_experts_loop(ws, w, P);
}

} // namespace

extern "C" void tkd_cuda_moe_ws_free(tkd_cuda_moe_ws *ws)
{
    if (!ws)
        return;
    if (ws->blas)
        (void)cublasDestroy(ws->blas);
    void *bufs[] = {ws->logits, ws->sel, ws->wts, ws->pair_iota, ws->keys_sorted, ws->pair_of, ws->row_of,
                    ws->counts, ws->xs, ws->g, ws->u, ws->h, ws->o, ws->sort_tmp, ws->deq, (void *)ws->d_ptrs};
    for (void *b : bufs)
        tkd_cuda_free(b);
    tkd_cuda_free_host(ws->h_counts);
    tkd_cuda_free_host(ws->h_ptrs);
    tkd_cuda_free_host(ws->h_tiles);
    tkd_cuda_free_host(ws->h_err);
    tkd_cuda_free(ws->d_tiles);
    tkd_lmhead_sm90_ws_free(ws->sm90);
    tkd_lmhead_sm90_ws_free(ws->sm90_dn);
    free(ws->h_rows);
    free(ws);
}

extern "C" tkd_status tkd_cuda_moe_ws_create(tkd_cuda_moe_ws **out, const tkd_moe_params *p, int max_tokens,
                                             void *stream)
{
    *out = NULL;
    TKD_TRY(tkd_moe_params_check(p));
    if (p->E > kMaxE || p->k > kMaxK)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "moe (cuda): %d experts, %d per token: at most %d and %d", p->E, p->k,
                             kMaxE, kMaxK);
    if (max_tokens < 1 || (int64_t)max_tokens * p->k > INT32_MAX)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe (cuda): max_tokens %d out of range", max_tokens);
    tkd_cuda_moe_ws *ws = (tkd_cuda_moe_ws *)calloc(1, sizeof *ws);
    if (!ws)
        return tkd_error_set(TKD_ERR_NOMEM, "moe (cuda): out of host memory");
    ws->p = *p;
    ws->max_tokens = max_tokens;
    ws->grouped = -1;
    ws->pad = 1;
    ws->ours_kernel = TKD_CUDA_MOE_OURS_DEFAULT;
    ws->stream = (cudaStream_t)stream;
    tkd_status st = ws_alloc(ws);
    if (st != TKD_OK) {
        tkd_cuda_moe_ws_free(ws);
        return st;
    }
    *out = ws;
    return TKD_OK;
}

extern "C" void tkd_cuda_moe_ws_set_grouped(tkd_cuda_moe_ws *ws, int grouped)
{
    ws->grouped = grouped < 0 ? TKD_CUDA_MOE_GEMM_AUTO
                  : grouped == TKD_CUDA_MOE_GEMM_OURS ? TKD_CUDA_MOE_GEMM_OURS
                                                      : grouped != 0 ? TKD_CUDA_MOE_GEMM_GROUPED : TKD_CUDA_MOE_GEMM_LOOP;
}

extern "C" tkd_status tkd_cuda_moe_ws_set_ours_kernel(tkd_cuda_moe_ws *ws, int kernel)
{
    if (kernel < TKD_CUDA_MOE_OURS_DEFAULT || kernel > TKD_CUDA_MOE_OURS_SM90_MIXED)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe (cuda): our GEMM's kernel %d: expected %d..%d", kernel,
                             TKD_CUDA_MOE_OURS_DEFAULT, TKD_CUDA_MOE_OURS_SM90_MIXED);
    ws->ours_kernel = kernel;
    return sm90_setup(ws);
}

extern "C" void tkd_cuda_moe_ws_set_mxfp4_layer(tkd_cuda_moe_ws *ws, int on) { ws->mx_layer = on != 0; }

extern "C" int tkd_cuda_moe_ws_mxfp4_in_gemm(const tkd_cuda_moe_ws *ws) { return ws->mx_in_gemm; }

extern "C" int tkd_cuda_moe_ws_ours_sm90(const tkd_cuda_moe_ws *ws) { return ws->sm90 != NULL; }

extern "C" int tkd_cuda_moe_ws_grouped(const tkd_cuda_moe_ws *ws) { return ws->ran == TKD_CUDA_MOE_GEMM_GROUPED; }

extern "C" int tkd_cuda_moe_ws_ran(const tkd_cuda_moe_ws *ws) { return ws->ran; }

extern "C" tkd_status tkd_cuda_moe_ws_set_pad(tkd_cuda_moe_ws *ws, int rows)
{
    if (rows < 1 || rows > kMaxPad)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe (cuda): pad %d rows: 1 to %d", rows, kMaxPad);
    ws->pad = rows;
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_moe_fwd(tkd_cuda_moe_ws *ws, const tkd_cuda_moe_weights *w, const uint16_t *x, int N,
                                       uint16_t *y, int32_t *experts, float *weights)
{
    const tkd_moe_params &p = ws->p;
    if (N < 0 || N > ws->max_tokens)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe (cuda): %d tokens, the workspace holds %d", N, ws->max_tokens);
    if (ws->grouped == TKD_CUDA_MOE_GEMM_OURS && (p.D % 8 || p.inter % 8))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "moe (cuda): D %d, I %d: our grouped GEMM needs both multiples of 8 "
                             "(TKD_MOE_GEMM=ours; the other modes take any)", p.D, p.inter);
    for (int j = 0; p.mxfp4 && j < 3; j++)
        if (!aligned16(w->q.blocks[j]) || ((uintptr_t)w->q.scales[j] & 3u))
            return tkd_error_set(TKD_ERR_INVALID_ARG, "moe (cuda): MXFP4 %s: codes must be 16-byte and scales 4-byte "
                                 "aligned", j == 0 ? "W_gate" : j == 1 ? "W_up" : "W_down");
    if (N == 0)
        return TKD_OK;
    const int64_t P = (int64_t)N * p.k;
    cudaStream_t s = ws->stream;
    TKD_TRY(gemm_nt(ws->blas, x, w->router_w, N, p.E, p.D, ws->logits, CUDA_R_32F));
    route_kernel<<<(N + kRouteWarps - 1) / kRouteWarps, 32 * kRouteWarps, 0, s>>>(ws->logits, w->router_b, N, p,
                                                                                  ws->sel, ws->wts);
    TKD_CUDA_CHECK(cudaGetLastError());
    TKD_CUDA_CHECK(cudaMemsetAsync(ws->counts, 0, (size_t)p.E * 4, s));
    count_kernel<<<grid_for(P, 256), 256, 0, s>>>(ws->sel, P, ws->counts);
    TKD_CUDA_CHECK(cudaGetLastError());
    size_t bytes = ws->sort_bytes;
    TKD_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws->sort_tmp, bytes, ws->sel, ws->keys_sorted, ws->pair_iota,
                                                   ws->pair_of, P, 0, bits_for(p.E), s));
    const bool vec = p.D % 8 == 0 && aligned16(x) && aligned16(y) && (!w->b_down || aligned16(w->b_down));
    if (vec)
        gather_kernel<8><<<(unsigned)P, 128, 0, s>>>(x, ws->pair_of, P, p.k, p.D, ws->xs, ws->row_of);
    else
        gather_kernel<1><<<(unsigned)P, 128, 0, s>>>(x, ws->pair_of, P, p.k, p.D, ws->xs, ws->row_of);
    TKD_CUDA_CHECK(cudaGetLastError());
    TKD_CUDA_CHECK(cudaMemcpyAsync(ws->h_counts, ws->counts, (size_t)p.E * 4, cudaMemcpyDeviceToHost, s));
    if (ws->sm90) {
        TKD_CUDA_CHECK(cudaMemcpyAsync(ws->h_err, tkd_lmhead_sm90_ws_error_flag(ws->sm90), sizeof *ws->h_err,
                                       cudaMemcpyDeviceToHost, s));
        TKD_CUDA_CHECK(cudaMemcpyAsync(ws->h_err + 1, tkd_lmhead_sm90_ws_error_flag(ws->sm90_dn),
                                       sizeof *ws->h_err, cudaMemcpyDeviceToHost, s));
    }
    TKD_CUDA_CHECK(cudaStreamSynchronize(s)); /* the GEMMs' shapes */
    if (ws->h_err[0] || ws->h_err[1])
        return tkd_error_set(TKD_ERR_INTERNAL, "moe (cuda): a pipeline wait of the previous call's Hopper GEMM "
                             "timed out; its output is garbage");
    TKD_TRY(run_experts(ws, w, P));
    if (vec)
        combine_kernel<8><<<(unsigned)N, 256, 0, s>>>(ws->o, ws->sel, ws->wts, ws->row_of, w->b_down, p.k, p.D, y);
    else
        combine_kernel<1><<<(unsigned)N, 256, 0, s>>>(ws->o, ws->sel, ws->wts, ws->row_of, w->b_down, p.k, p.D, y);
    TKD_CUDA_CHECK(cudaGetLastError());
    if (experts)
        TKD_CUDA_CHECK(cudaMemcpyAsync(experts, ws->sel, (size_t)P * 4, cudaMemcpyDeviceToDevice, s));
    if (weights)
        TKD_CUDA_CHECK(cudaMemcpyAsync(weights, ws->wts, (size_t)P * 4, cudaMemcpyDeviceToDevice, s));
    return TKD_OK;
}
