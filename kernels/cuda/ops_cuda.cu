/* ops_cuda.cu — see ops_cuda.h. Row and elementwise kernels (static, one per op) and the linear
 * layer through cuBLASLt.
 *
 * Vector paths move 8 elements per thread: 16 bytes of bf16 (one uint4) or 32 bytes of fp32 (two
 * float4), so a launcher takes them only when every pointer is 16-byte aligned and the row length
 * (D, dh/2) is a multiple of 8, which keeps each row's start aligned too; otherwise the same
 * kernel runs a scalar path. Every bf16 rounding is common/half.h's tkd_f32_to_bf16, so the device
 * rounds exactly as the host does (NaN included).
 */
#include "kernels/cuda/ops_cuda.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/cuda/ops_cuda_common.cuh"

namespace {

constexpr size_t kLtWsBytes = 32u << 20; /* cuBLASLt workspace, allocated once */
constexpr int kLinPlans = 32;          /* cached GEMM plans (a model uses ~6 shapes per pass) */

/* ---- embedding -------------------------------------------------------------------------------- */

/* x[n, d] = float(emb[tok[n], d]); VEC: 8 columns per unit (D % 8 == 0, aligned), else 1. */
template <int VEC>
__global__ void embedding_kernel(const int32_t *tok, int64_t N, const uint16_t *emb, int D, float *x)
{
    const int64_t per_row = D / VEC, units = N * per_row;
    for (int64_t u = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; u < units;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t n = u / per_row, d = (u - n * per_row) * VEC;
        const uint16_t *src = emb + (int64_t)tok[n] * D + d;
        float *dst = x + n * D + d;
        if (VEC == 8) {
            float f[8];
            unpack8(*reinterpret_cast<const uint4 *>(src), f);
            store8_f32(dst, f);
        } else {
            *dst = bf(*src);
        }
    }
}

/* ---- RMSNorm, alone and after the residual add ------------------------------------------------ */

struct RmsArgs {
    const float *x_in;      /* (N, D), or NULL: */
    const uint16_t *x_bf;   /* (N, D) bf16 the input instead (plain RMSNorm only; y may equal it) */
    const uint16_t *branch; /* (N, D) bf16, or NULL: plain RMSNorm */
    float *x_out;           /* (N, D), written when branch != NULL (may equal x_in) */
    const uint16_t *w;      /* (D) bf16 */
    uint16_t *y;            /* (N, D) bf16 */
    float *rstd;            /* (N) or NULL */
    int d;
    float eps;
};

/* One block per row. Thread t holds its CH·8 values of the row in registers between the two
 * passes: with VEC, chunks of 8 consecutive columns (c·nt + t)·8; without, columns j·nt + t.
 * Pass 1 forms x (adding the branch and storing x_out when fusing) and the fp32 sum of squares;
 * pass 2 writes y = bf16(w · (x · rstd)). Each thread reads back only what it wrote itself, so
 * x_out may alias x_in. */
/* 8 (VEC) or 1 input values from flat index i, out of x_in or (BF) x_bf. */
template <bool VEC, bool BF>
__device__ __forceinline__ void load_in(const RmsArgs &a, int64_t i, float *v)
{
    if (BF) {
        if (VEC)
            unpack8(*reinterpret_cast<const uint4 *>(a.x_bf + i), v);
        else
            v[0] = bf(a.x_bf[i]);
    } else {
        if (VEC)
            load8_f32(a.x_in + i, v);
        else
            v[0] = a.x_in[i];
    }
}

template <int CH, bool VEC, bool BF>
__global__ void __launch_bounds__(kRowMaxThreads) rmsnorm_kernel(RmsArgs a)
{
    const int64_t off = (int64_t)blockIdx.x * a.d;
    const int nt = blockDim.x, t = threadIdx.x;
    float v[CH * 8];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < (VEC ? CH : CH * 8); j++) {
        const int e = VEC ? (j * nt + t) * 8 : j * nt + t;
        if (e >= a.d)
            continue;
        float *vj = v + (VEC ? j * 8 : j);
        load_in<VEC, BF>(a, off + e, vj);
        if (a.branch) {
            float b[8];
            if (VEC) {
                unpack8(*reinterpret_cast<const uint4 *>(a.branch + off + e), b);
            } else {
                b[0] = bf(a.branch[off + e]);
            }
#pragma unroll
            for (int i = 0; i < (VEC ? 8 : 1); i++)
                vj[i] += b[i];
            if (VEC) {
                store8_f32(a.x_out + off + e, vj);
            } else {
                a.x_out[off + e] = vj[0];
            }
        }
#pragma unroll
        for (int i = 0; i < (VEC ? 8 : 1); i++)
            ss += vj[i] * vj[i];
    }
    const float r = 1.0f / sqrtf(block_sum(ss) / (float)a.d + a.eps);
    if (t == 0 && a.rstd)
        a.rstd[blockIdx.x] = r;
#pragma unroll
    for (int j = 0; j < (VEC ? CH : CH * 8); j++) {
        const int e = VEC ? (j * nt + t) * 8 : j * nt + t;
        if (e >= a.d)
            continue;
        const float *vj = v + (VEC ? j * 8 : j);
        if (VEC) {
            float w[8], o[8];
            unpack8(*reinterpret_cast<const uint4 *>(a.w + e), w);
#pragma unroll
            for (int i = 0; i < 8; i++)
                o[i] = w[i] * (vj[i] * r);
            *reinterpret_cast<uint4 *>(a.y + off + e) = pack8(o);
        } else {
            a.y[off + e] = tkd_f32_to_bf16(bf(a.w[e]) * (vj[0] * r));
        }
    }
}

/* Short rows (plain RMSNorm, VEC, D ≤ 8·G): G lanes a row, each lane one chunk of 8 columns, 256 / G
 * rows a block. rmsnorm_kernel would give each such row a block of one warp with lanes 8·G.. idle
 * (a Qwen3 q/k norm: 262,144 rows of 128 at T 8192, so one 32-thread block per row). The sum of
 * squares is reduced by xor shuffles over the G lanes, which adds the same values in the same order
 * as block_sum over that one warp (its other lanes hold zeros), so the bits are rmsnorm_kernel's. */
template <int G, bool BF>
__global__ void __launch_bounds__(256) rmsnorm_rows_kernel(RmsArgs a, int N)
{
    const int lane = threadIdx.x % G;
    const int64_t row = (int64_t)blockIdx.x * (256 / G) + threadIdx.x / G;
    if (row >= N) /* whole groups leave together: the shuffles below stay within live groups */
        return;
    const int64_t off = row * a.d;
    const int e = lane * 8;
    float v[8];
    float ss = 0.0f;
    if (e < a.d) {
        load_in<true, BF>(a, off + e, v);
#pragma unroll
        for (int i = 0; i < 8; i++)
            ss += v[i] * v[i];
    }
    const unsigned group = (G == 32 ? 0xffffffffu : ((1u << G) - 1u) << (threadIdx.x % 32 / G * G));
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1)
        ss += __shfl_xor_sync(group, ss, o, G);
    const float r = 1.0f / sqrtf(ss / (float)a.d + a.eps);
    if (lane == 0 && a.rstd)
        a.rstd[row] = r;
    if (e < a.d) {
        float w[8], o[8];
        unpack8(*reinterpret_cast<const uint4 *>(a.w + e), w);
#pragma unroll
        for (int i = 0; i < 8; i++)
            o[i] = w[i] * (v[i] * r);
        *reinterpret_cast<uint4 *>(a.y + off + e) = pack8(o);
    }
}

/* The short-row kernel for G lanes a row, G the power of two ≥ D / 8 (at most 32). */
template <bool BF>
void rmsnorm_rows_launch(const RmsArgs &a, int N, cudaStream_t s)
{
    const int units = a.d / 8;
    const int G = units <= 4 ? 4 : units <= 8 ? 8 : units <= 16 ? 16 : 32;
    const unsigned blocks = (unsigned)((N + 256 / G - 1) / (256 / G));
    if (G == 4)
        rmsnorm_rows_kernel<4, BF><<<blocks, 256, 0, s>>>(a, N);
    else if (G == 8)
        rmsnorm_rows_kernel<8, BF><<<blocks, 256, 0, s>>>(a, N);
    else if (G == 16)
        rmsnorm_rows_kernel<16, BF><<<blocks, 256, 0, s>>>(a, N);
    else
        rmsnorm_rows_kernel<32, BF><<<blocks, 256, 0, s>>>(a, N);
}

tkd_status rmsnorm_run(const RmsArgs &a, int N, void *stream)
{
    if (N < 0 || a.d < 1 || a.d > kRowMaxD || (!a.x_in && !a.x_bf) || !a.w || !a.y || (a.branch && !a.x_out))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "rmsnorm: N = %d, D = %d (1..%d) or a NULL tensor",
                             N, a.d, kRowMaxD);
    if (N == 0)
        return TKD_OK;
    const bool vec = a.d % 8 == 0 && aligned16(a.x_bf ? (const void *)a.x_bf : a.x_in) && aligned16(a.w) &&
                     aligned16(a.y) &&
                     (!a.branch || (aligned16(a.branch) && aligned16(a.x_out)));
    int nt, chunks;
    row_shape(a.d, &nt, &chunks);
    cudaStream_t s = (cudaStream_t)stream;
    if (vec && !a.branch && a.d <= 256) {
        if (a.x_bf)
            rmsnorm_rows_launch<true>(a, N, s);
        else
            rmsnorm_rows_launch<false>(a, N, s);
    } else {
        row_dispatch(vec, chunks, [&](auto ch, auto v) {
            if (a.x_bf)
                rmsnorm_kernel<ch.value, v.value, true><<<N, nt, 0, s>>>(a);
            else
                rmsnorm_kernel<ch.value, v.value, false><<<N, nt, 0, s>>>(a);
        });
    }
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

/* ---- SwiGLU and the conversions: flat elementwise kernels ------------------------------------- */

/* h = bf16(silu(g) · u) with silu(g) = g / (1 + e^−g), as kernels/cpu/cpu_ops.c computes it. */
struct SwigluOp {
    const uint16_t *g, *u;
    uint16_t *h;
    template <int W> __device__ void unit(int64_t e) const
    {
        float gf[8], uf[8], hf[8];
        if (W == 8) {
            unpack8(*reinterpret_cast<const uint4 *>(g + e), gf);
            unpack8(*reinterpret_cast<const uint4 *>(u + e), uf);
        } else {
            gf[0] = bf(g[e]), uf[0] = bf(u[e]);
        }
#pragma unroll
        for (int j = 0; j < W; j++)
            hf[j] = gf[j] / (1.0f + expf(-gf[j])) * uf[j];
        if (W == 8)
            *reinterpret_cast<uint4 *>(h + e) = pack8(hf);
        else
            h[e] = tkd_f32_to_bf16(hf[0]);
    }
};

/* dst = src element for element through fp32: fp32 → bf16 rounds to nearest even, bf16 → fp32 is
 * exact. */
template <class Src, class Dst> struct ConvertOp {
    const Src *src;
    Dst *dst;
    template <int W> __device__ void unit(int64_t e) const
    {
        float f[W];
        load_vals<W>(src + e, f);
        store_vals<W>(dst + e, f);
    }
};

} // namespace

/* ---- launchers -------------------------------------------------------------------------------- */

extern "C" tkd_status tkd_cuda_embedding_fwd(const int32_t *tok, int N, const uint16_t *emb, int D,
                                             float *x, void *stream)
{
    if (N < 0 || D < 1 || (N > 0 && (!tok || !emb || !x)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "embedding: N = %d, D = %d or a NULL tensor", N, D);
    if (N == 0)
        return TKD_OK;
    cudaStream_t s = (cudaStream_t)stream;
    if (D % 8 == 0 && aligned16(emb) && aligned16(x))
        embedding_kernel<8><<<elt_blocks((int64_t)N * (D / 8)), kEltThreads, 0, s>>>(tok, N, emb, D, x);
    else
        embedding_kernel<1><<<elt_blocks((int64_t)N * D), kEltThreads, 0, s>>>(tok, N, emb, D, x);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_rmsnorm_fwd(const float *x, const uint16_t *w, int N, int D, float eps,
                                           uint16_t *y, float *rstd, void *stream)
{
    RmsArgs a = {x, NULL, NULL, NULL, w, y, rstd, D, eps};
    return rmsnorm_run(a, N, stream);
}

extern "C" tkd_status tkd_cuda_rmsnorm_bf16_fwd(const uint16_t *x, const uint16_t *w, int N, int D, float eps,
                                                uint16_t *y, float *rstd, void *stream)
{
    RmsArgs a = {NULL, x, NULL, NULL, w, y, rstd, D, eps};
    return rmsnorm_run(a, N, stream);
}

extern "C" tkd_status tkd_cuda_add_rmsnorm_fwd(const float *x_in, const uint16_t *branch, float *x_out,
                                               const uint16_t *w, int N, int D, float eps, uint16_t *y,
                                               float *rstd, void *stream)
{
    if (!branch)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "add_rmsnorm: branch is NULL");
    RmsArgs a = {x_in, NULL, branch, x_out, w, y, rstd, D, eps};
    return rmsnorm_run(a, N, stream);
}

extern "C" tkd_status tkd_cuda_rope_fwd(uint16_t *q, uint16_t *k, int N, int T, int H, int Hkv, int dh,
                                        const float *cos_t, const float *sin_t, void *stream)
{
    return rope_run<false>(q, k, N, T, H, Hkv, dh, cos_t, sin_t, stream, "rope");
}

extern "C" tkd_status tkd_cuda_swiglu_fwd(const uint16_t *g, const uint16_t *u, int64_t n, uint16_t *h,
                                          void *stream)
{
    if (n < 0 || (n > 0 && (!g || !u || !h)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "swiglu: n = %lld or a NULL tensor", (long long)n);
    SwigluOp op = {g, u, h};
    return elementwise_run(op, n, aligned16(g) && aligned16(u) && aligned16(h), stream);
}

extern "C" tkd_status tkd_cuda_f32_to_bf16(const float *src, uint16_t *dst, size_t n, void *stream)
{
    if (n > (size_t)INT64_MAX || (n > 0 && (!src || !dst)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "f32_to_bf16: n = %zu or a NULL pointer", n);
    ConvertOp<float, uint16_t> op = {src, dst};
    return elementwise_run(op, (int64_t)n, aligned16(src) && aligned16(dst), stream);
}

extern "C" tkd_status tkd_cuda_bf16_to_f32(const uint16_t *src, float *dst, size_t n, void *stream)
{
    if (n > (size_t)INT64_MAX || (n > 0 && (!src || !dst)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "bf16_to_f32: n = %zu or a NULL pointer", n);
    ConvertOp<uint16_t, float> op = {src, dst};
    return elementwise_run(op, (int64_t)n, aligned16(src) && aligned16(dst), stream);
}

/* ---- linear: y = x Wᵀ + b through cuBLASLt ---------------------------------------------------- */

/* cuBLASLt is column-major: our row-major y (N, M) is its D (M × N) with ld M, x (N, K) its
 * (K × N) with ld K and W (M, K) its (K × M) with ld K, so D = op(A)·B with A = W transposed
 * (transa = T) and B = x (transb = N). The bias, length M = D's rows, is added in the epilogue in
 * fp32 before the one rounding to bf16.
 *
 * A plan is everything cuBLASLt needs for one call but the pointers: its key is the shape, whether
 * there is a bias, and the alignment (a power of two ≤ 256) of each pointer, because the heuristic
 * picks kernels for the alignment it is told (the default assumes 256 bytes) and reads the bias
 * pointer's. Plans live in a small table, least recently used replaced first. */
namespace {

struct LinKey {
    int n, k, m, bias;
    int align[4]; /* x, w, y, b (b: 0 without bias) */
};

using LinPlan = LtPlan<LinKey>;

} // namespace

struct tkd_cuda_linear {
    cublasLtHandle_t lt;
    void *ws; /* (kLtWsBytes) */
    LtCache<LinKey, kLinPlans> plans;
};

extern "C" void tkd_cuda_linear_free(tkd_cuda_linear *lin)
{
    tkd_cuda_ws_free(lin, [](tkd_cuda_linear *w) {
        lt_cache_destroy(&w->plans);
        if (w->lt)
            (void)cublasLtDestroy(w->lt);
        tkd_cuda_free(w->ws);
    });
}

static tkd_status linear_init(tkd_cuda_linear *lin)
{
    TKD_CUBLAS_CHECK(cublasLtCreate(&lin->lt));
    return tkd_cuda_malloc(&lin->ws, kLtWsBytes, "cuBLASLt workspace", NULL);
}

extern "C" tkd_status tkd_cuda_linear_create(tkd_cuda_linear **out)
{
    return tkd_cuda_ws_create(out, tkd_cuda_linear_free, "linear: out of host memory", linear_init);
}

extern "C" void tkd_cuda_linear_lt(tkd_cuda_linear *lin, void **handle, void **ws, size_t *ws_bytes)
{
    *handle = (void *)lin->lt;
    *ws = lin->ws;
    *ws_bytes = kLtWsBytes;
}

/* Fills p (zeroed) for key: descriptors, layouts and the heuristic's first algorithm. On failure
 * the caller destroys p. b is the bias pointer the heuristic inspects (NULL without bias). */
static tkd_status plan_init(tkd_cuda_linear *lin, LinPlan *p, const LinKey &key, const void *b)
{
    TKD_TRY(lt_plan_op(p, key, CUBLAS_OP_T, CUBLAS_OP_N));
    if (key.bias) {
        const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        const int32_t bias_type = CUDA_R_16BF;
        TKD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
        TKD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                        &bias_type, sizeof bias_type));
        TKD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b, sizeof b));
    }
    TKD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, key.k, key.m, key.k)); /* W */
    TKD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, key.k, key.n, key.k)); /* x */
    TKD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lc, CUDA_R_16BF, key.m, key.n, key.m)); /* y */

    const uint32_t al[4] = {(uint32_t)key.align[1], (uint32_t)key.align[0], (uint32_t)key.align[2],
                            (uint32_t)key.align[2]}; /* A = W, B = x, C = D = y */
    const cublasStatus_t e = lt_plan_algo(lin->lt, p, kLtWsBytes, al);
    if (e == CUBLAS_STATUS_NOT_SUPPORTED)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "linear: cuBLASLt has no bf16 algorithm for N = %d, K = %d, M = %d%s "
                             "(pointer alignments x %d, w %d, y %d, b %d bytes)",
                             key.n, key.k, key.m, key.bias ? " with bias" : "", key.align[0],
                             key.align[1], key.align[2], key.align[3]);
    TKD_CUBLAS_CHECK(e); /* the preference or heuristic call failed otherwise */
    return TKD_OK;
}

/* The cached plan for key, made (replacing the least recently used) when missing. */
static tkd_status plan_get(tkd_cuda_linear *lin, const LinKey &key, const void *b, LinPlan **out)
{
    return lt_cache_get(&lin->plans, key, [&](LinPlan *p) { return plan_init(lin, p, key, b); }, out);
}

extern "C" tkd_status tkd_cuda_linear_fwd(tkd_cuda_linear *lin, const uint16_t *x, const uint16_t *w,
                                          const uint16_t *b, int N, int K, int M, uint16_t *y,
                                          void *stream)
{
    if (!lin || N < 0 || K < 1 || M < 1 || (N > 0 && (!x || !w || !y)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "linear: N = %d, K = %d, M = %d or a NULL tensor", N,
                             K, M);
    LinKey key;
    memset(&key, 0, sizeof key); /* compared with memcmp */
    key.n = N, key.k = K, key.m = M, key.bias = b != NULL;
    key.align[0] = ptr_align(x), key.align[1] = ptr_align(w), key.align[2] = ptr_align(y);
    key.align[3] = b ? ptr_align(b) : 0;
    if (key.align[0] < 2 || key.align[1] < 2 || key.align[2] < 2 || (b && key.align[3] < 2))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "linear: a bf16 pointer is not 2-byte aligned");
    if (N == 0)
        return TKD_OK;
    LinPlan *p = NULL;
    tkd_status st = plan_get(lin, key, b, &p);
    if (st != TKD_OK)
        return st;
    if (b) /* same alignment as the plan's, maybe another vector */
        TKD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b, sizeof b));
    const float one = 1.0f, zero = 0.0f;
    TKD_CUBLAS_CHECK(cublasLtMatmul(lin->lt, p->op, &one, w, p->la, x, p->lb, &zero, y, p->lc, y, p->lc,
                                    &p->algo, lin->ws, kLtWsBytes, (cudaStream_t)stream));
    return TKD_OK;
}
