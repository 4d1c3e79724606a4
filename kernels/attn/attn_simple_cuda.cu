/* attn_simple_cuda.cu — see attn_cuda.h: tkd_cuda_attn_fwd_simple, causal GQA attention by one warp
 * per (query row, head, batch). Lane j scores key (32c + j) of chunk c; the warp keeps the running
 * max m and sum l (online softmax, fp32); lane d accumulates output dims d, d + 32, ... */
#include "kernels/attn/attn_cuda.h"

#include <cuda_bf16.h>
#include <math.h>

#include "kernels/attn/attn_cuda_common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_fast_math.cuh"

namespace {

constexpr int kMaxDh = 256;
constexpr int kDimsPerLane = kMaxDh / 32;

using tkd_cuda::bf; /* bf16 <-> fp32 and the warp reductions: cuda_fast_math.cuh */
using tkd_cuda::to_bf;
using tkd_cuda::warp_max;
using tkd_cuda::warp_sum;

/* grid (T, H, B), block 32. q row i of head h; keys/values of kv head h / (H / Hkv), rows j ≤ i
 * (and j > i − window when window > 0, j ≥ doc[b·T + i] with doc); sinks (H) or NULL: the sink starts
 * the running max and sum. */
__global__ void attn_row(const uint16_t *q, const uint16_t *k, const uint16_t *v, int T, int H, int Hkv, int dh,
                         float scale, int window, const int32_t *doc, const float *sinks, uint16_t *y, float *lse)
{
    int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, lane = threadIdx.x;
    int64_t qs = (int64_t)H * dh, kvs = (int64_t)Hkv * dh;
    const uint16_t *qi = q + ((int64_t)b * T + i) * qs + (int64_t)h * dh;
    const uint16_t *kb = k + (int64_t)b * T * kvs + (int64_t)(h / (H / Hkv)) * dh;
    const uint16_t *vb = v + (int64_t)b * T * kvs + (int64_t)(h / (H / Hkv)) * dh;
    float m = sinks ? sinks[h] : -INFINITY, l = sinks ? 1.0f : 0.0f, acc[kDimsPerLane] = {0};
    const int first = max(window > 0 ? max(0, i - window + 1) : 0, doc ? doc[(int64_t)b * T + i] : 0);
    for (int j0 = first; j0 <= i; j0 += 32) {
        int j = j0 + lane;
        float s = -INFINITY;
        if (j <= i) {
            s = 0.0f;
            for (int d = 0; d < dh; d++)
                s += bf(qi[d]) * bf(kb[(int64_t)j * kvs + d]);
            s *= scale;
        }
        float mn = fmaxf(m, warp_max(s));
        float p = j <= i ? __expf(s - mn) : 0.0f, corr = __expf(m - mn);
        l = l * corr + warp_sum(p);
        for (int c = 0; c < kDimsPerLane; c++)
            acc[c] *= corr;
        int n = i - j0 + 1 < 32 ? i - j0 + 1 : 32;
        for (int t = 0; t < n; t++) {
            float pt = __shfl_sync(0xffffffffu, p, t);
            const uint16_t *vj = vb + (int64_t)(j0 + t) * kvs;
            for (int c = 0, d = lane; c < kDimsPerLane && d < dh; c++, d += 32)
                acc[c] += pt * bf(vj[d]);
        }
        m = mn;
    }
    uint16_t *yi = y + ((int64_t)b * T + i) * qs + (int64_t)h * dh;
    for (int c = 0, d = lane; c < kDimsPerLane && d < dh; c++, d += 32)
        yi[d] = to_bf(acc[c] / l);
    if (lse && lane == 0)
        lse[((int64_t)b * H + h) * T + i] = m + logf(l);
}

} // namespace

extern "C" tkd_status tkd_cuda_attn_fwd_simple(const uint16_t *q, const uint16_t *k, const uint16_t *v, int B, int T,
                                               int H, int Hkv, int dh, uint16_t *y, float *lse, void *stream)
{
    return tkd_cuda_attn_fwd_simple_masked(q, k, v, B, T, H, Hkv, dh, NULL, y, lse, stream);
}

extern "C" tkd_status tkd_cuda_attn_fwd_simple_masked(const uint16_t *q, const uint16_t *k, const uint16_t *v, int B,
                                                      int T, int H, int Hkv, int dh, const tkd_attn_mask *mask,
                                                      uint16_t *y, float *lse, void *stream)
{
    TKD_TRY(tkd_attn::check_mask("attn_simple", mask));
    if (B <= 0 || T <= 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || dh <= 0 || dh > kMaxDh || T > 65535 * 32)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "attn_simple: B %d, T %d, H %d, Hkv %d, dh %d: need positive sizes, "
                             "H a multiple of Hkv and dh <= %d", B, T, H, Hkv, dh, kMaxDh);
    dim3 grid((unsigned)T, (unsigned)H, (unsigned)B);
    attn_row<<<grid, 32, 0, (cudaStream_t)stream>>>(q, k, v, T, H, Hkv, dh, (float)(1.0 / sqrt((double)dh)),
                                                     mask ? mask->window : 0, mask ? mask->doc : NULL,
                                                     mask ? mask->sinks : NULL, y, lse);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}
