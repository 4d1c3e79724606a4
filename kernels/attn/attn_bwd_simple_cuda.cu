/* attn_bwd_simple_cuda.cu — see attn_bwd_simple_cuda.h: tkd_cuda_attn_bwd_simple, one warp per
 * query row (δ and dq), then one warp per key row and kv head (dk and dv). Lane j of a warp takes
 * pair (i, 32c + j) of chunk c and computes its P and dP over all dh; the chunk's values are then
 * broadcast lane to lane while lane d accumulates output dims d, d + 32, ... */
#include "kernels/attn/attn_bwd_simple_cuda.h"

#include <cuda_bf16.h>
#include <math.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_fast_math.cuh"

namespace {

constexpr int kMaxDh = 256;
constexpr int kDimsPerLane = kMaxDh / 32;
constexpr unsigned kFull = 0xffffffffu;

struct BwdArgs {
    const uint16_t *dy, *q, *k, *v; /* (B·T, H·dh), (B·T, H·dh), (B·T, Hkv·dh) x 2 */
    const float *lse;               /* (B, H, T) */
    uint16_t *dq, *dk, *dv;
    float *delta;                   /* (B, H, T) */
    int T, H, Hkv, dh;
    float scale;
    int window;         /* tkd_attn_mask's: 0 or the sliding window */
    const int32_t *doc; /* (B·T) or NULL: each query's document start */
};

/* The first key query i of sequence b sees (window and document; 0: causal only). */
__device__ __forceinline__ int first_key(const BwdArgs &a, int b, int i)
{
    const int w = a.window > 0 ? max(0, i - a.window + 1) : 0;
    return a.doc ? max(w, a.doc[(int64_t)b * a.T + i]) : w;
}

using tkd_cuda::bf; /* bf16 <-> fp32 and the warp sum: cuda_fast_math.cuh */
using tkd_cuda::to_bf;
using tkd_cuda::warp_sum;

/* For one (query, key) pair: *p = exp(scale·q·k − lse), *dp = dy·v. q and dy are the query row's,
 * staged in fp32 (shared memory); k and v the key row's, bf16. The dot products run d = 0, 1, ...
 * in both kernels, so both see the same P. */
__device__ void pair_terms(const float *q, const float *dy, const uint16_t *k, const uint16_t *v, int dh,
                           float scale, float lse, float *p, float *dp)
{
    float s = 0.0f, t = 0.0f;
    for (int d = 0; d < dh; d++) {
        s += q[d] * bf(k[d]);
        t += dy[d] * bf(v[d]);
    }
    *p = expf(s * scale - lse);
    *dp = t;
}

/* The same with the key row staged (k, v fp32 in shared memory) and the query row in bf16. */
__device__ void pair_terms_kv(const uint16_t *q, const uint16_t *dy, const float *k, const float *v, int dh,
                              float scale, float lse, float *p, float *dp)
{
    float s = 0.0f, t = 0.0f;
    for (int d = 0; d < dh; d++) {
        s += bf(q[d]) * k[d];
        t += bf(dy[d]) * v[d];
    }
    *p = expf(s * scale - lse);
    *dp = t;
}

/* grid (T, H, B), block 32: query row i of head h. δ_i = Σ_{j ≤ i} P_ij dP_ij (saved for the dk/dv
 * kernel), then dq_i += scale Σ_{j ≤ i} P_ij (dP_ij − δ_i) k_j. */
__global__ void attn_bwd_dq(BwdArgs a)
{
    __shared__ float sq[kMaxDh], sdy[kMaxDh];
    const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, lane = threadIdx.x;
    const int64_t qs = (int64_t)a.H * a.dh, kvs = (int64_t)a.Hkv * a.dh;
    const int64_t row = ((int64_t)b * a.T + i) * qs + (int64_t)h * a.dh;
    const int64_t kv0 = (int64_t)b * a.T * kvs + (int64_t)(h / (a.H / a.Hkv)) * a.dh;
    for (int d = lane; d < a.dh; d += 32) {
        sq[d] = bf(a.q[row + d]);
        sdy[d] = bf(a.dy[row + d]);
    }
    __syncwarp();
    const int64_t stat = ((int64_t)b * a.H + h) * a.T + i;
    const float lse = a.lse[stat];
    float p, dp, delta = 0.0f;
    const int lo = first_key(a, b, i);
    for (int j = lo + lane; j <= i; j += 32) {
        pair_terms(sq, sdy, a.k + kv0 + j * kvs, a.v + kv0 + j * kvs, a.dh, a.scale, lse, &p, &dp);
        delta += p * dp;
    }
    delta = warp_sum(delta);
    if (lane == 0)
        a.delta[stat] = delta;
    float acc[kDimsPerLane] = {0};
    for (int j0 = lo; j0 <= i; j0 += 32) {
        float ds = 0.0f;
        if (j0 + lane <= i) {
            pair_terms(sq, sdy, a.k + kv0 + (j0 + lane) * kvs, a.v + kv0 + (j0 + lane) * kvs, a.dh, a.scale, lse,
                       &p, &dp);
            ds = p * (dp - delta);
        }
        const int n = i - j0 + 1 < 32 ? i - j0 + 1 : 32;
        for (int t = 0; t < n; t++) {
            const float dst = __shfl_sync(kFull, ds, t);
            const uint16_t *kj = a.k + kv0 + (j0 + t) * kvs;
            for (int c = 0, d = lane; c < kDimsPerLane && d < a.dh; c++, d += 32)
                acc[c] += dst * bf(kj[d]);
        }
    }
    for (int c = 0, d = lane; c < kDimsPerLane && d < a.dh; c++, d += 32)
        a.dq[row + d] = to_bf(bf(a.dq[row + d]) + a.scale * acc[c]);
}

/* grid (T, Hkv, B), block 32: key row j of kv head g. Over the group's query heads h and rows
 * i ≥ j: dv_j += Σ P_ij dy_i, dk_j += scale Σ P_ij (dP_ij − δ_i) q_i. */
__global__ void attn_bwd_dkv(BwdArgs a)
{
    __shared__ float sk[kMaxDh], sv[kMaxDh];
    const int j = blockIdx.x, g = blockIdx.y, b = blockIdx.z, lane = threadIdx.x;
    const int64_t qs = (int64_t)a.H * a.dh, kvs = (int64_t)a.Hkv * a.dh;
    const int64_t row = ((int64_t)b * a.T + j) * kvs + (int64_t)g * a.dh;
    for (int d = lane; d < a.dh; d += 32) {
        sk[d] = bf(a.k[row + d]);
        sv[d] = bf(a.v[row + d]);
    }
    __syncwarp();
    const int G = a.H / a.Hkv;
    float ak[kDimsPerLane] = {0}, av[kDimsPerLane] = {0};
    for (int h = g * G; h < (g + 1) * G; h++) {
        const int64_t q0 = (int64_t)b * a.T * qs + (int64_t)h * a.dh, s0 = ((int64_t)b * a.H + h) * a.T;
        /* the queries that see key j: i ≥ j while first_key(i) ≤ j (non-decreasing in i) */
        for (int i0 = j; i0 < a.T && first_key(a, b, i0) <= j; i0 += 32) {
            const int i = i0 + lane;
            float p = 0.0f, ds = 0.0f, dp;
            if (i < a.T && first_key(a, b, i) <= j) {
                pair_terms_kv(a.q + q0 + i * qs, a.dy + q0 + i * qs, sk, sv, a.dh, a.scale, a.lse[s0 + i], &p, &dp);
                ds = p * (dp - a.delta[s0 + i]);
            }
            const int n = a.T - i0 < 32 ? a.T - i0 : 32;
            for (int t = 0; t < n; t++) {
                const float pt = __shfl_sync(kFull, p, t), dst = __shfl_sync(kFull, ds, t);
                const uint16_t *qi = a.q + q0 + (i0 + t) * qs, *dyi = a.dy + q0 + (i0 + t) * qs;
                for (int c = 0, d = lane; c < kDimsPerLane && d < a.dh; c++, d += 32) {
                    av[c] += pt * bf(dyi[d]);
                    ak[c] += dst * bf(qi[d]);
                }
            }
        }
    }
    for (int c = 0, d = lane; c < kDimsPerLane && d < a.dh; c++, d += 32) {
        a.dk[row + d] = to_bf(bf(a.dk[row + d]) + a.scale * ak[c]);
        a.dv[row + d] = to_bf(bf(a.dv[row + d]) + av[c]);
    }
}

} // namespace

extern "C" size_t tkd_cuda_attn_bwd_simple_ws_bytes(int B, int T, int H)
{
    return sizeof(float) * (size_t)(B > 0 ? B : 0) * (size_t)(H > 0 ? H : 0) * (size_t)(T > 0 ? T : 0);
}

extern "C" tkd_status tkd_cuda_attn_bwd_simple(const uint16_t *dy, const uint16_t *q, const uint16_t *k,
                                               const uint16_t *v, const uint16_t *y, const float *lse, int B, int T,
                                               int H, int Hkv, int dh, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                               float *delta, void *stream)
{
    return tkd_cuda_attn_bwd_simple_masked(dy, q, k, v, y, lse, B, T, H, Hkv, dh, NULL, dq, dk, dv, delta, stream);
}

extern "C" tkd_status tkd_cuda_attn_bwd_simple_masked(const uint16_t *dy, const uint16_t *q, const uint16_t *k,
                                                      const uint16_t *v, const uint16_t *y, const float *lse, int B,
                                                      int T, int H, int Hkv, int dh, const tkd_attn_mask *mask,
                                                      uint16_t *dq, uint16_t *dk, uint16_t *dv, float *delta,
                                                      void *stream)
{
    (void)y;
    if (mask && (mask->window < 0 || mask->sinks))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "attn_bwd_simple: %s", mask->sinks ? "no backward takes attention "
                             "sinks (teachers only)" : "a negative window");
    if (B <= 0 || T <= 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || dh <= 0 || dh > kMaxDh || B > 65535 ||
        H > 65535)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "attn_bwd_simple: B %d, T %d, H %d, Hkv %d, dh %d: need positive "
                             "sizes, H a multiple of Hkv, dh <= %d, B and H <= 65535", B, T, H, Hkv, dh, kMaxDh);
    if (!dy || !q || !k || !v || !lse || !dq || !dk || !dv || !delta)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "attn_bwd_simple: a NULL tensor or scratch");
    BwdArgs a = {dy, q, k, v, lse, dq, dk, dv, delta, T, H, Hkv, dh, (float)(1.0 / sqrt((double)dh)),
                 mask ? mask->window : 0, mask ? mask->doc : NULL};
    cudaStream_t s = (cudaStream_t)stream;
    attn_bwd_dq<<<dim3((unsigned)T, (unsigned)H, (unsigned)B), 32, 0, s>>>(a);
    TKD_CUDA_CHECK(cudaGetLastError());
    attn_bwd_dkv<<<dim3((unsigned)T, (unsigned)Hkv, (unsigned)B), 32, 0, s>>>(a);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}
