/* ops_optim_cuda.cu — see ops_bwd_cuda.h (its optimizer half): the fused multi-tensor AdamW over
 * the flat master weights (bf16 + int16 residual; moments fp32 or bf16), the exact split of fp32
 * masters into those two halves and the join back, and the gradient scale. Split from ops_bwd_cuda.cu, which keeps the
 * backward ops and the gradient norm (it sums into the backward workspace's partials). Every bf16
 * rounding is common/half.h's, as on the host; purely elementwise, so any grid gives the same bits.
 */
#include "kernels/cuda/ops_bwd_cuda.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/cuda/ops_cuda_common.cuh"

namespace {

constexpr int kAdamChunk = 32768;    /* AdamW: elements per table chunk */
constexpr int kAdamThreads = 256;

/* ---- flat elementwise kernels: scale, master split / join ------------------------------------- */

/* g *= f (one IEEE multiply per element, as tkd_optim_scale). */
struct ScaleOp {
    float *g;
    float f;
    template <int W> __device__ void unit(int64_t e) const
    {
        float v[W];
        load_f32<W>(g + e, v);
#pragma unroll
        for (int j = 0; j < W; j++)
            v[j] = __fmul_rn(v[j], f);
        store_f32<W>(g + e, v);
    }
};

/* The master weights' exact split of fp32 src into bf16 hi and int16 lo (common/half.h), and the
 * join back; elementwise, W at a time (the vector path only needs the pointers 16-byte aligned:
 * 8 floats, 8 halves of each). */
struct SplitOp {
    const float *src;
    uint16_t *hi;
    int16_t *lo;
    template <int W> __device__ void unit(int64_t e) const
    {
#pragma unroll
        for (int j = 0; j < W; j++)
            hi[e + j] = tkd_f32_split_bf16(src[e + j], &lo[e + j]);
    }
};

struct JoinOp {
    const uint16_t *hi;
    const int16_t *lo;
    float *dst;
    template <int W> __device__ void unit(int64_t e) const
    {
#pragma unroll
        for (int j = 0; j < W; j++)
            dst[e + j] = tkd_bf16_join_f32(hi[e + j], lo[e + j]);
    }
};

/* ---- AdamW ------------------------------------------------------------------------------------ */

struct AdamChunk {
    int64_t off; /* first element */
    int32_t len; /* ≤ kAdamChunk */
    int32_t decay;
};

/* M: how the moments are kept, float or uint16_t (bf16 bits: optim.state_dtype bf16). */
template <typename M> struct AdamArgs {
    const AdamChunk *chunks;
    int n_chunks;
    bool vec; /* g 16-byte, m, v 16-byte (float) or 8-byte (bf16), hi, lo 8-byte aligned: 4-wide where
               * the offset allows */
    uint16_t *hi;  /* the master weights: bf16 compute copy ... */
    int16_t *lo;   /* ... and int16 residuals (common/half.h's split) */
    const float *g;
    M *m, *v;
    float gscale, keep_decay, one_m_b1, b2, one_m_b2, eps, step_size, bc2_sqrt;
};

/* The moments in and out of fp32: a float as it is; bf16 widened exactly, stored rounded to nearest
 * even by common/half.h, as kernels/cpu/adamw.c does. One element at i, or four from i (a multiple
 * of 4: one 16-byte or 8-byte access). */
__device__ inline float mom_load(const float *p, int64_t i) { return p[i]; }
__device__ inline float mom_load(const uint16_t *p, int64_t i) { return tkd_bf16_to_f32(p[i]); }
__device__ inline void mom_store(float *p, int64_t i, float x) { p[i] = x; }
__device__ inline void mom_store(uint16_t *p, int64_t i, float x) { p[i] = tkd_f32_to_bf16(x); }

__device__ inline void mom_load4(const float *p, int64_t i, float out[4])
{
    const float4 q = *reinterpret_cast<const float4 *>(p + i);
    out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
}
__device__ inline void mom_load4(const uint16_t *p, int64_t i, float out[4])
{
    const uint2 q = *reinterpret_cast<const uint2 *>(p + i);
    out[0] = tkd_bf16_to_f32((uint16_t)q.x), out[1] = tkd_bf16_to_f32((uint16_t)(q.x >> 16));
    out[2] = tkd_bf16_to_f32((uint16_t)q.y), out[3] = tkd_bf16_to_f32((uint16_t)(q.y >> 16));
}
__device__ inline void mom_store4(float *p, int64_t i, const float x[4])
{
    *reinterpret_cast<float4 *>(p + i) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ inline void mom_store4(uint16_t *p, int64_t i, const float x[4])
{
    const uint32_t b[4] = {tkd_f32_to_bf16(x[0]), tkd_f32_to_bf16(x[1]), tkd_f32_to_bf16(x[2]), tkd_f32_to_bf16(x[3])};
    *reinterpret_cast<uint2 *>(p + i) = make_uint2(b[0] | b[1] << 16, b[2] | b[3] << 16);
}

/* model/optim.c's adamw_span for one element after the clip's g *= s, every operation IEEE-rounded
 * (the _rn intrinsics keep nvcc from fusing multiply-adds, which the host's fp32 code does not do
 * either). g·1 is g exactly, so s = 1 is no scaling. The same fp32 maths whatever M is. */
template <typename M>
__device__ inline void adamw_update(float &p, float g, float &m, float &v, float keep, const AdamArgs<M> &a)
{
    g = __fmul_rn(g, a.gscale);
    p = __fmul_rn(p, keep);
    m = __fadd_rn(m, __fmul_rn(a.one_m_b1, __fsub_rn(g, m)));
    v = __fadd_rn(__fmul_rn(v, a.b2), __fmul_rn(__fmul_rn(a.one_m_b2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), a.bc2_sqrt), a.eps);
    p = __fsub_rn(p, __fmul_rn(a.step_size, __fdiv_rn(m, denom)));
}

/* Per element: the exact fp32 master from (hi, lo), the update, both halves written back. */
template <typename M> __device__ inline void adamw_one(const AdamArgs<M> &a, int64_t i, float keep)
{
    float p = tkd_bf16_join_f32(a.hi[i], a.lo[i]), m = mom_load(a.m, i), v = mom_load(a.v, i);
    adamw_update(p, a.g[i], m, v, keep, a);
    mom_store(a.m, i, m), mom_store(a.v, i, v);
    a.hi[i] = tkd_f32_split_bf16(p, &a.lo[i]);
}

/* Four elements from i (a multiple of 4): 8-byte loads of hi and lo, 16-byte ones of g, and of m, v
 * (8-byte when bf16). */
template <typename M> __device__ inline void adamw_four(const AdamArgs<M> &a, int64_t i, float keep)
{
    const uint2 h = *reinterpret_cast<const uint2 *>(a.hi + i), l = *reinterpret_cast<const uint2 *>(a.lo + i);
    const uint32_t hw[2] = {h.x, h.y}, lw[2] = {l.x, l.y};
    float p[4], mm[4], vv[4];
    mom_load4(a.m, i, mm);
    mom_load4(a.v, i, vv);
    const float4 g = *reinterpret_cast<const float4 *>(a.g + i);
    const float gg[4] = {g.x, g.y, g.z, g.w};
    uint32_t ho[2] = {0, 0}, lo[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int sh = 16 * (j & 1);
        p[j] = tkd_bf16_join_f32((uint16_t)(hw[j / 2] >> sh), (int16_t)(uint16_t)(lw[j / 2] >> sh));
        adamw_update(p[j], gg[j], mm[j], vv[j], keep, a);
        int16_t r;
        ho[j / 2] |= (uint32_t)tkd_f32_split_bf16(p[j], &r) << sh;
        lo[j / 2] |= (uint32_t)(uint16_t)r << sh;
    }
    mom_store4(a.m, i, mm);
    mom_store4(a.v, i, vv);
    *reinterpret_cast<uint2 *>(a.hi + i) = make_uint2(ho[0], ho[1]);
    *reinterpret_cast<uint2 *>(a.lo + i) = make_uint2(lo[0], lo[1]);
}

/* Blocks walk the chunk table (grid-stride). In a chunk: scalar elements up to the first 16-byte
 * boundary, 4-wide units, a scalar tail; without `vec`, all scalar. Purely elementwise, so any grid
 * gives the same result. */
template <typename M> __global__ void __launch_bounds__(kAdamThreads) adamw_kernel(AdamArgs<M> a)
{
    for (int c = blockIdx.x; c < a.n_chunks; c += gridDim.x) {
        const AdamChunk ch = a.chunks[c];
        const float keep = ch.decay ? a.keep_decay : 1.0f; /* (float)(1 − lr·0) on the CPU */
        const int head = a.vec ? min((int)((4 - (ch.off & 3)) & 3), ch.len) : ch.len;
        const int units = (ch.len - head) / 4, body_end = head + units * 4;
        for (int i = threadIdx.x; i < head; i += blockDim.x)
            adamw_one(a, ch.off + i, keep);
        for (int u = threadIdx.x; u < units; u += blockDim.x)
            adamw_four(a, ch.off + head + 4 * (int64_t)u, keep);
        for (int i = body_end + threadIdx.x; i < ch.len; i += blockDim.x)
            adamw_one(a, ch.off + i, keep);
    }
}

} // namespace

struct tkd_cuda_adamw {
    AdamChunk *chunks; /* device (n_chunks) */
    int n_chunks;
};

/* ---- launchers: optimizer --------------------------------------------------------------------- */

extern "C" void tkd_cuda_adamw_free(tkd_cuda_adamw *a)
{
    tkd_cuda_ws_free(a, [](tkd_cuda_adamw *w) {
        tkd_cuda_free(w->chunks);
    });
}

static int seg_cmp(const void *pa, const void *pb)
{
    const tkd_cuda_param_seg *a = (const tkd_cuda_param_seg *)pa, *b = (const tkd_cuda_param_seg *)pb;
    return a->offset < b->offset ? -1 : a->offset > b->offset;
}

/* Segments must not overlap (an element updated twice would race); sorted copy checked in order. */
static tkd_status segs_check(const tkd_cuda_param_seg *segs, int n, size_t *chunks)
{
    tkd_cuda_param_seg *s = (tkd_cuda_param_seg *)malloc((size_t)(n ? n : 1) * sizeof *s);
    if (!s)
        return tkd_error_set(TKD_ERR_NOMEM, "adamw: out of host memory");
    if (n > 0)
        memcpy(s, segs, (size_t)n * sizeof *s);
    qsort(s, (size_t)n, sizeof *s, seg_cmp);
    *chunks = 0;
    for (int i = 0; i < n; i++) {
        const size_t off = s[i].offset, len = s[i].numel, end = off + len;
        if (end < off || end > (size_t)INT64_MAX || (i + 1 < n && end > s[i + 1].offset)) {
            free(s);
            return tkd_error_set(TKD_ERR_INVALID_ARG,
                                 "adamw: segment at offset %zu (%zu elements) overlaps the next or overflows",
                                 off, len);
        }
        *chunks += (len + kAdamChunk - 1) / kAdamChunk;
    }
    free(s);
    return *chunks > (size_t)INT32_MAX
               ? tkd_error_set(TKD_ERR_INVALID_ARG, "adamw: %zu chunks are too many", *chunks)
               : TKD_OK;
}

static tkd_status adamw_init(tkd_cuda_adamw *a, const tkd_cuda_param_seg *segs, int n_segs)
{
    size_t n_chunks = 0;
    TKD_TRY(segs_check(segs, n_segs, &n_chunks));
    AdamChunk *h = (AdamChunk *)malloc((n_chunks ? n_chunks : 1) * sizeof *h);
    if (!h)
        return tkd_error_set(TKD_ERR_NOMEM, "adamw: out of host memory");
    size_t c = 0;
    for (int i = 0; i < n_segs; i++)
        for (size_t o = 0; o < segs[i].numel; o += kAdamChunk) {
            const size_t len = segs[i].numel - o < (size_t)kAdamChunk ? segs[i].numel - o : kAdamChunk;
            h[c++] = AdamChunk{(int64_t)(segs[i].offset + o), (int32_t)len, segs[i].decay ? 1 : 0};
        }
    a->n_chunks = (int)n_chunks;
    tkd_status st = tkd_cuda_malloc((void **)&a->chunks, (n_chunks ? n_chunks : 1) * sizeof *h,
                                    "AdamW chunk table", NULL);
    if (st == TKD_OK && n_chunks)
        st = tkd_cuda_to_device(a->chunks, h, n_chunks * sizeof *h);
    free(h);
    return st;
}

extern "C" tkd_status tkd_cuda_adamw_create(const tkd_cuda_param_seg *segs, int n_segs, tkd_cuda_adamw **out)
{
    *out = NULL;
    if (n_segs < 0 || (n_segs > 0 && !segs))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "adamw: %d segments or a NULL table", n_segs);
    return tkd_cuda_ws_create(out, tkd_cuda_adamw_free, "adamw: out of host memory",
                              [&](tkd_cuda_adamw *a) { return adamw_init(a, segs, n_segs); });
}

static bool aligned8(const void *p) { return ((uintptr_t)p & 7u) == 0; }

/* 4-wide moment accesses: float4 for fp32 moments, uint2 for bf16 ones. */
static bool mom_aligned(const float *p) { return aligned16(p); }
static bool mom_aligned(const uint16_t *p) { return aligned8(p); }

/* tkd_cuda_adamw_step and its bf16-moment sibling: one launch of adamw_kernel<M>. */
template <typename M>
static tkd_status adamw_launch(const tkd_cuda_adamw *a, uint16_t *w_hi, int16_t *w_lo, const float *grads, M *m, M *v,
                               double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                               float grad_scale, void *stream)
{
    if (!a || step < 1 || (a->n_chunks > 0 && (!w_hi || !w_lo || !grads || !m || !v)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "adamw: step = %lld or a NULL tensor", (long long)step);
    if (a->n_chunks == 0)
        return TKD_OK;
    /* the scalars exactly as model/optim.c's tkd_adamw_step forms them */
    const double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
    AdamArgs<M> k;
    k.chunks = a->chunks, k.n_chunks = a->n_chunks;
    k.vec = aligned16(grads) && mom_aligned(m) && mom_aligned(v) && aligned8(w_hi) && aligned8(w_lo);
    k.hi = w_hi, k.lo = w_lo, k.g = grads, k.m = m, k.v = v;
    k.gscale = grad_scale;
    k.keep_decay = (float)(1.0 - lr * weight_decay);
    k.one_m_b1 = (float)(1.0 - beta1), k.b2 = (float)beta2, k.one_m_b2 = (float)(1.0 - beta2);
    k.eps = (float)eps, k.step_size = (float)(lr / bc1), k.bc2_sqrt = (float)sqrt(bc2);
    const int blocks = a->n_chunks < kEltMaxBlocks ? a->n_chunks : kEltMaxBlocks;
    adamw_kernel<M><<<blocks, kAdamThreads, 0, (cudaStream_t)stream>>>(k);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_adamw_step(const tkd_cuda_adamw *a, uint16_t *w_hi, int16_t *w_lo, const float *grads,
                                          float *m, float *v, double lr, double beta1, double beta2, double eps,
                                          double weight_decay, int64_t step, float grad_scale, void *stream)
{
    return adamw_launch(a, w_hi, w_lo, grads, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale, stream);
}

extern "C" tkd_status tkd_cuda_adamw_step_bf16(const tkd_cuda_adamw *a, uint16_t *w_hi, int16_t *w_lo,
                                               const float *grads, uint16_t *m, uint16_t *v, double lr, double beta1,
                                               double beta2, double eps, double weight_decay, int64_t step,
                                               float grad_scale, void *stream)
{
    return adamw_launch(a, w_hi, w_lo, grads, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale, stream);
}

extern "C" tkd_status tkd_cuda_master_split(const float *src, uint16_t *w_hi, int16_t *w_lo, size_t n, void *stream)
{
    if (n > (size_t)INT64_MAX || (n > 0 && (!src || !w_hi || !w_lo)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "master_split: n = %zu or a NULL pointer", n);
    SplitOp op = {src, w_hi, w_lo};
    return elementwise_run(op, (int64_t)n, aligned16(src) && aligned16(w_hi) && aligned16(w_lo), stream);
}

extern "C" tkd_status tkd_cuda_master_join(const uint16_t *w_hi, const int16_t *w_lo, float *dst, size_t n,
                                           void *stream)
{
    if (n > (size_t)INT64_MAX || (n > 0 && (!dst || !w_hi || !w_lo)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "master_join: n = %zu or a NULL pointer", n);
    JoinOp op = {w_hi, w_lo, dst};
    return elementwise_run(op, (int64_t)n, aligned16(dst) && aligned16(w_hi) && aligned16(w_lo), stream);
}

extern "C" tkd_status tkd_cuda_scale(float *g, size_t n, float factor, void *stream)
{
    if (n > (size_t)INT64_MAX || (n > 0 && !g))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "scale: n = %zu or a NULL pointer", n);
    ScaleOp op = {g, factor};
    return elementwise_run(op, (int64_t)n, aligned16(g), stream);
}
