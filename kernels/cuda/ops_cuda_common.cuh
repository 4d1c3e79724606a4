/* ops_cuda_common.cuh — device helpers shared by ops_cuda.cu, ops_bwd_cuda.cu and ops_optim_cuda.cu (internal; include
 * only from .cu files): bf16 ↔ fp32 conversion of 8 or W values, the block sum, the flat
 * elementwise skeleton, RoPE (forward and backward) and the cuBLASLt plan helpers. Everything here sits in an anonymous
 * namespace, so each including file gets its own copy and no symbol is exported.
 *
 * Vector helpers move 8 elements per thread: 16 bytes of bf16 (one uint4) or 32 bytes of fp32 (two
 * float4); callers take them only when every pointer is 16-byte aligned (aligned16). Every bf16
 * rounding is common/half.h's tkd_f32_to_bf16, so the device rounds exactly as the host does.
 */
#ifndef TKD_OPS_CUDA_COMMON_CUH
#define TKD_OPS_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "common/half.h"
#include "common/status.h"
#include "kernels/cuda/cuda_check.h"

namespace {

constexpr int kEltThreads = 256;    /* elementwise kernels: block size */
constexpr int kEltMaxBlocks = 4096; /* grid-stride beyond this (≈ 8 waves of 132 SMs × 4) */
constexpr int kRowMaxThreads = 512; /* RMSNorm, forward and backward: ≤ 16 warps per block ... */
constexpr int kRowMaxChunks = 4;    /* ... each thread holding ≤ 4 × 8 values in registers */
constexpr int kRowMaxD = kRowMaxThreads * kRowMaxChunks * 8; /* 16384 */

/* ---- host helpers ----------------------------------------------------------------------------- */

inline bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Blocks of kEltThreads for `units` grid-stride units: at least 1, at most kEltMaxBlocks. */
inline int elt_blocks(int64_t units)
{
    int64_t b = (units + kEltThreads - 1) / kEltThreads;
    return (int)(b < 1 ? 1 : b > kEltMaxBlocks ? kEltMaxBlocks : b);
}

/* The RMSNorm kernels' block for rows of d values: *nt threads (a multiple of 32, ≤ kRowMaxThreads)
 * holding *chunks (1, 2 or kRowMaxChunks) chunks of 8 values each. */
inline void row_shape(int d, int *nt, int *chunks)
{
    const int units = (d + 7) / 8; /* per-thread capacity is 8 values per chunk on both paths */
    *nt = units >= kRowMaxThreads ? kRowMaxThreads : (units + 31) / 32 * 32;
    const int need = (units + *nt - 1) / *nt;
    *chunks = need == 1 ? 1 : need == 2 ? 2 : kRowMaxChunks;
}

/* launch(std::integral_constant<int, CH>(), std::bool_constant<VEC>()) for the RMSNorm kernels'
 * instance of chunks (row_shape) and vec: the dispatch over their template arguments, written once. */
template <bool VEC, class F> void row_dispatch_chunks(int chunks, F launch)
{
    if (chunks == 1)
        launch(std::integral_constant<int, 1>(), std::bool_constant<VEC>());
    else if (chunks == 2)
        launch(std::integral_constant<int, 2>(), std::bool_constant<VEC>());
    else
        launch(std::integral_constant<int, kRowMaxChunks>(), std::bool_constant<VEC>());
}

template <class F> void row_dispatch(bool vec, int chunks, F launch)
{
    if (vec)
        row_dispatch_chunks<true>(chunks, launch);
    else
        row_dispatch_chunks<false>(chunks, launch);
}

/* ---- bf16 / fp32 loads and stores ------------------------------------------------------------- */

__device__ inline float bf(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }

/* 8 bf16 (little-endian pairs in 4 words) to fp32 and back. */
__device__ inline void unpack8(uint4 p, float f[8])
{
    const uint32_t w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        f[2 * j] = __uint_as_float(w[j] << 16);
        f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

__device__ inline uint4 pack8(const float f[8])
{
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
        w[j] = (uint32_t)tkd_f32_to_bf16(f[2 * j]) | ((uint32_t)tkd_f32_to_bf16(f[2 * j + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ inline void load8_f32(const float *p, float f[8])
{
    const float4 a = *reinterpret_cast<const float4 *>(p), b = *reinterpret_cast<const float4 *>(p + 4);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

__device__ inline void store8_f32(float *p, const float f[8])
{
    *reinterpret_cast<float4 *>(p) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4 *>(p + 4) = make_float4(f[4], f[5], f[6], f[7]);
}

/* W consecutive bf16 (W = 8: one 16-byte load; W = 1: one element) as fp32, and back. */
template <int W> __device__ inline void load_bf(const uint16_t *p, float f[W])
{
    if constexpr (W == 8)
        unpack8(*reinterpret_cast<const uint4 *>(p), f);
    else
        f[0] = bf(p[0]);
}

template <int W> __device__ inline void store_bf(uint16_t *p, const float f[W])
{
    if constexpr (W == 8)
        *reinterpret_cast<uint4 *>(p) = pack8(f);
    else
        p[0] = tkd_f32_to_bf16(f[0]);
}

/* W consecutive fp32 (W = 8: two float4; W = 4: one float4; W = 1: one element). */
template <int W> __device__ inline void load_f32(const float *p, float f[W])
{
    if constexpr (W == 8) {
        load8_f32(p, f);
    } else if constexpr (W == 4) {
        const float4 a = *reinterpret_cast<const float4 *>(p);
        f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
    } else {
        f[0] = p[0];
    }
}

template <int W> __device__ inline void store_f32(float *p, const float f[W])
{
    if constexpr (W == 8)
        store8_f32(p, f);
    else if constexpr (W == 4)
        *reinterpret_cast<float4 *>(p) = make_float4(f[0], f[1], f[2], f[3]);
    else
        p[0] = f[0];
}

/* W consecutive values of either element type as fp32 and back, chosen by the pointer's type: for
 * code written once over both (load_bf / load_f32, store_bf / store_f32). */
template <int W> __device__ inline void load_vals(const uint16_t *p, float f[W]) { load_bf<W>(p, f); }
template <int W> __device__ inline void load_vals(const float *p, float f[W]) { load_f32<W>(p, f); }
template <int W> __device__ inline void store_vals(uint16_t *p, const float f[W]) { store_bf<W>(p, f); }
template <int W> __device__ inline void store_vals(float *p, const float f[W]) { store_f32<W>(p, f); }

/* ---- block sum -------------------------------------------------------------------------------- */

/* Sum over the block (blockDim.x a multiple of 32, ≤ 1024) in a fixed tree; every thread gets it.
 * Safe to call repeatedly: a thread reads `total` before it can reach the next call's first
 * barrier, and warp 0 writes it only after that barrier. */
template <class T> __device__ T block_sum(T v)
{
    __shared__ T part[32];
    __shared__ T total;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0)
        part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? part[lane] : (T)0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0)
            total = v;
    }
    __syncthreads();
    return total;
}

/* ---- flat elementwise skeleton ---------------------------------------------------------------- */

/* n elements as n / VEC units of VEC (grid-stride); with VEC = 8 the last n % 8 elements go one per
 * thread to block 0. `Op` maps one unit or one element (op.unit<W>(first element)). */
template <int VEC, class Op>
__global__ void elementwise_kernel(Op op, int64_t n)
{
    const int64_t units = n / VEC;
    for (int64_t u = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; u < units;
         u += (int64_t)gridDim.x * blockDim.x)
        op.template unit<VEC>(u * VEC);
    if (VEC > 1 && blockIdx.x == 0 && threadIdx.x < n - units * VEC)
        op.template unit<1>(units * VEC + threadIdx.x);
}

/* Launches elementwise_kernel over n elements on `stream`: 8 per unit when `vec`, else 1. */
template <class Op>
tkd_status elementwise_run(const Op &op, int64_t n, bool vec, void *stream)
{
    if (n == 0)
        return TKD_OK;
    cudaStream_t s = (cudaStream_t)stream;
    if (vec)
        elementwise_kernel<8, Op><<<elt_blocks(n / 8), kEltThreads, 0, s>>>(op, n);
    else
        elementwise_kernel<1, Op><<<elt_blocks(n), kEltThreads, 0, s>>>(op, n);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

/* ---- RoPE, forward and backward --------------------------------------------------------------- */

struct RopeArgs {
    uint16_t *q, *k;            /* (N, H·dh), (N, Hkv·dh) bf16, in place */
    const float *cos_t, *sin_t; /* (T, dh/2) */
    int64_t n;
    int t, h, hkv, half;
};

/* One unit = VEC pairs (i, i + half) of one head of one row, q heads first, then k heads, rotated
 * in fp32 with one bf16 rounding: forward x_i ← x_i c − x_{i+half} s, x_{i+half} ← x_{i+half} c +
 * x_i s; the backward (kInverse) applies the transposed rotation to the gradients, i.e. s → −s. */
template <int VEC, bool kInverse>
__global__ void rope_kernel(RopeArgs a)
{
    const int heads = a.h + a.hkv, per_head = a.half / VEC;
    const int64_t units = a.n * heads * per_head;
    for (int64_t u = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; u < units;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = u / ((int64_t)heads * per_head);
        const int rem = (int)(u - row * heads * per_head), hh = rem / per_head;
        const int i = (rem - hh * per_head) * VEC;
        uint16_t *x = hh < a.h ? a.q + (row * a.h + hh) * 2 * a.half
                               : a.k + (row * a.hkv + (hh - a.h)) * 2 * a.half;
        const int64_t tab = (row % a.t) * a.half + i;
        float x0[VEC], x1[VEC], c[VEC], s[VEC], o0[VEC], o1[VEC];
        load_bf<VEC>(x + i, x0);
        load_bf<VEC>(x + i + a.half, x1);
        load_f32<VEC>(a.cos_t + tab, c);
        load_f32<VEC>(a.sin_t + tab, s);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            const float sj = kInverse ? -s[j] : s[j];
            o0[j] = x0[j] * c[j] - x1[j] * sj;
            o1[j] = x1[j] * c[j] + x0[j] * sj;
        }
        store_bf<VEC>(x + i, o0);
        store_bf<VEC>(x + i + a.half, o1);
    }
}

/* Checks the shapes (`who` names the op in the message) and rotates q and k in place on `stream`. */
template <bool kInverse>
tkd_status rope_run(uint16_t *q, uint16_t *k, int N, int T, int H, int Hkv, int dh, const float *cos_t,
                    const float *sin_t, void *stream, const char *who)
{
    if (N < 0 || T < 1 || H < 1 || Hkv < 1 || dh < 2 || dh % 2 ||
        (N > 0 && (!q || !k || !cos_t || !sin_t)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: N = %d, T = %d, H = %d, Hkv = %d, dh = %d (even) or a NULL "
                             "tensor", who, N, T, H, Hkv, dh);
    if (N == 0)
        return TKD_OK;
    RopeArgs a = {q, k, cos_t, sin_t, N, T, H, Hkv, dh / 2};
    const int64_t pairs = (int64_t)N * (H + Hkv) * a.half;
    cudaStream_t s = (cudaStream_t)stream;
    if (a.half % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(cos_t) && aligned16(sin_t))
        rope_kernel<8, kInverse><<<elt_blocks(pairs / 8), kEltThreads, 0, s>>>(a);
    else
        rope_kernel<1, kInverse><<<elt_blocks(pairs), kEltThreads, 0, s>>>(a);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

/* ---- cuBLASLt plans --------------------------------------------------------------------------- */

/* A cached cuBLASLt call but its pointers, found by `Key` (the shape and alignments). */
template <class Key> struct LtPlan {
    Key key;
    unsigned long long used; /* 0: free slot */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
};

/* The largest power of two ≤ 256 that p is aligned to (what cuBLASLt's heuristic is told). */
inline int ptr_align(const void *p)
{
    int a = 256;
    while (a > 1 && ((uintptr_t)p & (uintptr_t)(a - 1)))
        a >>= 1;
    return a;
}

/* The start of every plan: its key and its matmul descriptor (fp32 compute and scale, transposes
 * ta and tb). */
template <class Key> tkd_status lt_plan_op(LtPlan<Key> *p, const Key &key, cublasOperation_t ta, cublasOperation_t tb)
{
    p->key = key;
    TKD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    TKD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    TKD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    return TKD_OK;
}

/* Destroys what a plan holds (any part may be NULL) and zeroes it: a free slot again. */
template <class Key> void lt_plan_destroy(LtPlan<Key> *p)
{
    if (p->lc) (void)cublasLtMatrixLayoutDestroy(p->lc);
    if (p->lb) (void)cublasLtMatrixLayoutDestroy(p->lb);
    if (p->la) (void)cublasLtMatrixLayoutDestroy(p->la);
    if (p->op) (void)cublasLtMatmulDescDestroy(p->op);
    memset(p, 0, sizeof *p);
}

/* The cached plan for key among plans[0, n), made by init(slot) (a zeroed slot; returns tkd_status)
 * in place of the least recently used one when missing; *clock counts uses. */
template <class Key, class Init>
tkd_status lt_plan_get(LtPlan<Key> *plans, int n, unsigned long long *clock, const Key &key, Init init,
                       LtPlan<Key> **out)
{
    LtPlan<Key> *victim = &plans[0];
    for (int i = 0; i < n; i++) {
        LtPlan<Key> *p = &plans[i];
        if (p->used && memcmp(&p->key, &key, sizeof key) == 0) {
            p->used = ++*clock;
            *out = p;
            return TKD_OK;
        }
        if (p->used < victim->used)
            victim = p;
    }
    if (victim->used)
        lt_plan_destroy(victim);
    tkd_status st = init(victim);
    if (st != TKD_OK) {
        lt_plan_destroy(victim);
        return st;
    }
    victim->used = ++*clock;
    *out = victim;
    return TKD_OK;
}

/* A table of N cached plans, the least recently used replaced first; zeroed: empty. */
template <class Key, int N> struct LtCache {
    LtPlan<Key> plans[N];
    unsigned long long clock; /* counts uses */
};

/* Destroys every plan in use: the cache's teardown. */
template <class Key, int N> void lt_cache_destroy(LtCache<Key, N> *c)
{
    for (int i = 0; i < N; i++)
        if (c->plans[i].used)
            lt_plan_destroy(&c->plans[i]);
}

/* The cached plan for key, made by init(slot) when missing (lt_plan_get). */
template <class Key, int N, class Init>
tkd_status lt_cache_get(LtCache<Key, N> *c, const Key &key, Init init, LtPlan<Key> **out)
{
    return lt_plan_get(c->plans, N, &c->clock, key, init, out);
}

/* p->algo: the heuristic's first algorithm for p's descriptors within ws_bytes of workspace and
 * pointers aligned to al = {A, B, C, D} bytes. Returns the first failing call's status, and
 * CUBLAS_STATUS_NOT_SUPPORTED also when none fits (the caller says for what). */
template <class Key>
cublasStatus_t lt_plan_algo(cublasLtHandle_t lt, LtPlan<Key> *p, uint64_t ws_bytes, const uint32_t al[4])
{
    const cublasLtMatmulPreferenceAttributes_t which[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    cublasLtMatmulPreference_t pref = NULL;
    cublasStatus_t e = cublasLtMatmulPreferenceCreate(&pref);
    if (e != CUBLAS_STATUS_SUCCESS)
        return e;
    e = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                             sizeof ws_bytes);
    for (int i = 0; i < 4 && e == CUBLAS_STATUS_SUCCESS; i++)
        e = cublasLtMatmulPreferenceSetAttribute(pref, which[i], &al[i], sizeof al[i]);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatmulAlgoGetHeuristic(lt, p->op, p->la, p->lb, p->lc, p->lc, pref, 1, &res, &found);
    (void)cublasLtMatmulPreferenceDestroy(pref);
    if (e == CUBLAS_STATUS_SUCCESS && found == 0)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (e == CUBLAS_STATUS_SUCCESS)
        p->algo = res.algo;
    return e;
}

} // namespace

#endif
