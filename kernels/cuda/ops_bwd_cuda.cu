/* ops_bwd_cuda.cu — see ops_bwd_cuda.h. Row, elementwise and reduction kernels (static, in an
 * anonymous namespace), the embedding's sort (CUB, shipped with the CUDA toolkit), the linear
 * backward's two GEMMs through cuBLASLt, and the gradient norm; the optimizer's kernels (AdamW,
 * master split / join, scale) are in ops_optim_cuda.cu.
 *
 * Determinism without float atomics: every sum over rows is split into groups whose size depends
 * only on the shape; one block sums a group in row order into a partial (or straight into its own
 * output rows), and a second kernel adds the partials per column in group order. Vector paths move
 * 8 bf16 (one uint4) or 8 fp32 (two float4) per thread, taken only when the pointers are 16-byte
 * aligned and the row length keeps each row's start aligned; otherwise the same kernel runs a
 * scalar path. Every bf16 rounding is common/half.h's tkd_f32_to_bf16, as on the host.
 */
#include "kernels/cuda/ops_bwd_cuda.h"

#include <cub/cub.cuh>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/cuda/ops_cuda_common.cuh"

namespace {

constexpr int kMaxGroups = 512;      /* row groups of a column reduction (partials per column) */
constexpr int kMinGroupRows = 16;    /* ... each at least this many rows */
constexpr int kEmbChunk = 64;        /* embedding: sorted rows per chunk */
constexpr int kEmbThreads = 128;     /* embedding: threads per (chunk, column tile) block */
constexpr int kNormBlocks = 1024;    /* gradient norm: fixed first-pass grid (partials) */
constexpr int kNormThreads = 256;
constexpr size_t kMinPartFloats = (size_t)1 << 20; /* scratch floor: 4 MiB */
constexpr int kBwdPlans = 32;        /* cached linear-backward GEMM plans */

/* ---- small helpers ---------------------------------------------------------------------------- */

/* Row groups for a column reduction over N ≥ 1 rows of `width` ≤ cap columns into (G, width)
 * partials: at least kMinGroupRows rows per group, at most kMaxGroups groups and G·width ≤ cap
 * floats. Depends only on (N, width, cap), so the summation order is fixed for a shape and
 * workspace. */
void row_groups(int N, int width, size_t cap, int *rows_per, int *groups)
{
    int r = (N + kMaxGroups - 1) / kMaxGroups;
    r = r < kMinGroupRows ? kMinGroupRows : r;
    int g = (N + r - 1) / r;
    if ((size_t)g * width > cap) {
        g = (int)(cap / (size_t)width);
        r = (N + g - 1) / g;
        g = (N + r - 1) / r;
    }
    *rows_per = r, *groups = g < 1 ? 1 : g;
}

/* out[c] += Σ_g part[g, c] for c < width: threadIdx.y walks groups y, y + 16, ... in double, then
 * row 0 adds the 16 sums in order. Block (32, 16), grid ceil(width / 32). */
__global__ void __launch_bounds__(512) partials_reduce_kernel(const float *part, // (G, width)
                                                              int G, int width, float *out)
{
    __shared__ double s[16][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    double acc = 0.0;
    if (c < width)
        for (int g = threadIdx.y; g < G; g += 16)
            acc += part[(size_t)g * width + c];
    s[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < width) {
        double t = 0.0;
#pragma unroll
        for (int j = 0; j < 16; j++)
            t += s[j][threadIdx.x];
        out[c] += (float)t; /* one rounding, as the CPU's dw[d] += (float)s */
    }
}

tkd_status partials_reduce(const float *part, int G, int width, float *out, cudaStream_t s)
{
    partials_reduce_kernel<<<(width + 31) / 32, dim3(32, 16), 0, s>>>(part, G, width, out);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

/* ---- embedding: sort, sum per chunk, join the tokens that span chunks ------------------------- */

struct EmbArgs {
    const int32_t *keys; /* (N) token ids, sorted (stable) */
    const int32_t *rows; /* (N) their row indices */
    const float *dx;     /* (N, D) */
    float *demb;         /* (V, D) += */
    float *head, *tail;  /* (chunks, D) scratch: a chunk's first / last token's piece */
    int n, d;
};

/* Chunk c = sorted positions [64c, 64c + len) and a column tile of blockDim.x·VEC columns. Each
 * thread walks the chunk in order summing each token's run of rows. A run that is the token's whole
 * segment goes straight into demb (the chunk alone holds that token); the chunk's first run, when
 * its token began in an earlier chunk, goes to head[c]; its last run, when the token continues in
 * the next chunk, to tail[c] (a run that is both is a head). Rows are loaded 8 ahead. */
template <int VEC>
__global__ void __launch_bounds__(kEmbThreads) emb_pieces_kernel(EmbArgs a)
{
    __shared__ int32_t sk[kEmbChunk], sr[kEmbChunk];
    const int c = blockIdx.x, p0 = c * kEmbChunk, len = min(kEmbChunk, a.n - p0);
    for (int i = threadIdx.x; i < len; i += blockDim.x)
        sk[i] = a.keys[p0 + i], sr[i] = a.rows[p0 + i];
    __syncthreads();
    const int col = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (col >= a.d)
        return;
    const bool prev_same = p0 > 0 && a.keys[p0 - 1] == sk[0];
    const bool next_same = p0 + len < a.n && a.keys[p0 + len] == sk[len - 1];
    float acc[VEC] = {};
    bool first = true; /* the run being summed is the chunk's first */
    for (int i0 = 0; i0 < len; i0 += 8) {
        float v[8][VEC];
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (i0 + j < len)
                load_f32<VEC>(a.dx + (int64_t)sr[i0 + j] * a.d + col, v[j]);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int i = i0 + j;
            if (i >= len)
                break;
#pragma unroll
            for (int k = 0; k < VEC; k++)
                acc[k] += v[j][k];
            if (i + 1 < len && sk[i + 1] == sk[i])
                continue;
            float *dst = first && prev_same            ? a.head + (int64_t)c * a.d + col
                         : i == len - 1 && next_same ? a.tail + (int64_t)c * a.d + col
                                                     : nullptr;
            if (dst) {
                store_f32<VEC>(dst, acc);
            } else {
                float *e = a.demb + (int64_t)sk[i] * a.d + col, o[VEC];
                load_f32<VEC>(e, o);
#pragma unroll
                for (int k = 0; k < VEC; k++)
                    o[k] += acc[k];
                store_f32<VEC>(e, o);
            }
#pragma unroll
            for (int k = 0; k < VEC; k++)
                acc[k] = 0.0f;
            first = false;
        }
    }
}

/* A token that continues past chunk c and did not start before it (else an earlier chunk joins
 * it): demb[token] += tail[c] + head[c + 1] + head[c + 2] + ..., through the chunk where it ends.
 * Same grid as emb_pieces_kernel; blocks of chunks with no such token return at once. */
template <int VEC>
__global__ void __launch_bounds__(kEmbThreads) emb_join_kernel(EmbArgs a, int chunks)
{
    const int c = blockIdx.x, p0 = c * kEmbChunk, len = min(kEmbChunk, a.n - p0);
    const int col = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (col >= a.d)
        return;
    const int32_t first = a.keys[p0], last = a.keys[p0 + len - 1];
    const bool prev_same = p0 > 0 && a.keys[p0 - 1] == first;
    const bool next_same = p0 + len < a.n && a.keys[p0 + len] == last;
    if (!next_same || (prev_same && first == last))
        return;
    float acc[VEC], h[VEC];
    load_f32<VEC>(a.tail + (int64_t)c * a.d + col, acc);
    for (int j = c + 1; j < chunks; j++) {
        load_f32<VEC>(a.head + (int64_t)j * a.d + col, h);
#pragma unroll
        for (int k = 0; k < VEC; k++)
            acc[k] += h[k];
        const int end = min((j + 1) * kEmbChunk, a.n); /* chunk j is [64j, end) */
        if (end >= a.n || a.keys[end - 1] != last || a.keys[end] != last)
            break; /* the token ends inside chunk j */
    }
    float *e = a.demb + (int64_t)last * a.d + col, o[VEC];
    load_f32<VEC>(e, o);
#pragma unroll
    for (int k = 0; k < VEC; k++)
        o[k] += acc[k];
    store_f32<VEC>(e, o);
}

/* ---- RMSNorm backward ------------------------------------------------------------------------- */

struct RmsBwdArgs {
    const uint16_t *dy; /* (N, D) bf16 */
    const float *x;     /* (N, D) */
    const uint16_t *w;  /* (D) bf16 */
    const float *rstd;  /* (N) */
    float *dx;          /* (N, D) +=, or NULL */
    uint16_t *dxb;      /* (N, D) bf16: the new dx rounded, or NULL (may be dy: see below) */
    float *part;        /* (G, D) dw partials, or NULL */
    int n, d, rows_per;
};

/* f(j, e, g, xv) for each access j < J of thread t (of nt) that lies inside the row at off: e its
 * first column ((j·nt + t)·W), g and xv dy and x at e as fp32 (W values). Both passes of the
 * backward read the row this way. */
template <int J, int W, class F>
__device__ __forceinline__ void rms_row_each(const RmsBwdArgs &a, int64_t off, int nt, int t, F f)
{
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int e = (j * nt + t) * W;
        if (e >= a.d)
            continue;
        float g[W], xv[W];
        load_bf<W>(a.dy + off + e, g);
        load_f32<W>(a.x + off + e, xv);
        f(j, e, g, xv);
    }
}

/* Block b = rows [b·R, b·R + R), in order. Thread t owns the same columns as the forward (VEC:
 * chunks of 8 at (j·nt + t)·8; else columns j·nt + t) and keeps their w and its dw partial in
 * registers across the rows. Per row: pass 1 forms Σ g·x (g = dy·w) over the block (only when dx
 * is wanted); pass 2 re-reads the row (L1-resident) for dx += r·(g − x·c) (and its bf16 rounding
 * into dxb) and dw += dy·x·r. dxb may alias dy: each element of dy is read for the last time, by
 * the thread that writes it, in pass 2 before that write (plain loads, no read-only cache). */
template <int CH, bool VEC>
__global__ void __launch_bounds__(kRowMaxThreads) rmsnorm_bwd_kernel(RmsBwdArgs a)
{
    constexpr int W = VEC ? 8 : 1, J = VEC ? CH : CH * 8; /* values per access, accesses */
    const int nt = blockDim.x, t = threadIdx.x;
    const int r0 = blockIdx.x * a.rows_per, r1 = min(a.n, r0 + a.rows_per);
    float w[J * W], acc[J * W];
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int e = (j * nt + t) * W;
#pragma unroll
        for (int i = 0; i < W; i++)
            w[j * W + i] = 0.0f, acc[j * W + i] = 0.0f;
        if (e < a.d)
            load_bf<W>(a.w + e, w + j * W);
    }
    for (int row = r0; row < r1; row++) {
        const int64_t off = (int64_t)row * a.d;
        const float r = a.rstd[row];
        float c = 0.0f;
        if (a.dx) {
            float s = 0.0f;
            rms_row_each<J, W>(a, off, nt, t, [&](int j, int, const float *g, const float *xv) {
#pragma unroll
                for (int i = 0; i < W; i++)
                    s += g[i] * w[j * W + i] * xv[i];
            });
            c = block_sum(s) * r / (float)a.d * r; /* mean(g·x̂), times r again for x̂ */
        }
        rms_row_each<J, W>(a, off, nt, t, [&](int j, int e, const float *g, const float *xv) {
            if (a.dx) {
                float o[W];
                load_f32<W>(a.dx + off + e, o);
#pragma unroll
                for (int i = 0; i < W; i++)
                    o[i] += r * (g[i] * w[j * W + i] - xv[i] * c);
                store_f32<W>(a.dx + off + e, o);
                if (a.dxb)
                    store_bf<W>(a.dxb + off + e, o);
            }
#pragma unroll
            for (int i = 0; i < W; i++)
                acc[j * W + i] += g[i] * (xv[i] * r);
        });
    }
    if (a.part) {
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int e = (j * nt + t) * W;
            if (e < a.d)
                store_f32<W>(a.part + (int64_t)blockIdx.x * a.d + e, acc + j * W);
        }
    }
}

/* ---- flat elementwise kernels: SwiGLU backward ------------------------------------------------ */

/* s = σ(g) = 1 / (1 + e^−g): dg += dh·u·s·(1 + g·(1 − s)), du += dh·g·s, as kernels/cpu/cpu_ops.c. */
struct SwigluBwdOp {
    const uint16_t *dh, *g, *u;
    uint16_t *dg, *du; /* either may be NULL */
    bool acc;          /* add into dg/du (their old values read), else overwrite them */
    /* the gradient to add to: the old one (acc) or zeros, without reading the buffer */
    template <int W> __device__ void old(const uint16_t *p, float *o) const
    {
        if (acc) {
            load_bf<W>(p, o);
            return;
        }
#pragma unroll
        for (int j = 0; j < W; j++)
            o[j] = 0.0f;
    }
    template <int W> __device__ void unit(int64_t e) const
    {
        float d[W], gf[W], uf[W], s[W], o[W];
        load_bf<W>(dh + e, d);
        load_bf<W>(g + e, gf);
        load_bf<W>(u + e, uf);
#pragma unroll
        for (int j = 0; j < W; j++)
            s[j] = 1.0f / (1.0f + expf(-gf[j]));
        if (dg) {
            old<W>(dg + e, o);
#pragma unroll
            for (int j = 0; j < W; j++)
                o[j] += d[j] * uf[j] * s[j] * (1.0f + gf[j] * (1.0f - s[j]));
            store_bf<W>(dg + e, o);
        }
        if (du) {
            old<W>(du + e, o);
#pragma unroll
            for (int j = 0; j < W; j++)
                o[j] += d[j] * gf[j] * s[j];
            store_bf<W>(du + e, o);
        }
    }
};

/* ---- linear backward: bias column sums -------------------------------------------------------- */

/* part[b, m] = Σ_{rows of group b, in order} dy[n, m] in fp32. Grid (G, ceil(M / 256)). */
__global__ void __launch_bounds__(kEltThreads) colsum_bf16_kernel(const uint16_t *dy, // (N, M)
                                                                  int n, int m_cols, int rows_per,
                                                                  float *part) // (G, M)
{
    const int m = blockIdx.y * blockDim.x + threadIdx.x;
    if (m >= m_cols)
        return;
    const int r0 = blockIdx.x * rows_per, r1 = min(n, r0 + rows_per);
    float acc = 0.0f;
#pragma unroll 8
    for (int r = r0; r < r1; r++)
        acc += bf(dy[(int64_t)r * m_cols + m]);
    part[(int64_t)blockIdx.x * m_cols + m] = acc;
}

/* ---- gradient norm ---------------------------------------------------------------------------- */

/* part[b] = Σ g² (double) over block b's grid-stride share of units of VEC; with VEC = 8 block 0
 * adds the last n % 8 elements. The block's sum is a fixed tree, so part is deterministic. */
template <int VEC>
__global__ void __launch_bounds__(kNormThreads) norm2_kernel(const float *g, int64_t n, double *part)
{
    const int64_t units = n / VEC;
    double s = 0.0;
    for (int64_t u = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; u < units;
         u += (int64_t)gridDim.x * blockDim.x) {
        float f[VEC];
        load_f32<VEC>(g + u * VEC, f);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            s += (double)f[j] * f[j]; /* the product is exact in double */
    }
    if (VEC > 1 && blockIdx.x == 0 && threadIdx.x < n - units * VEC) {
        const double f = g[units * VEC + threadIdx.x];
        s += f * f;
    }
    s = block_sum(s);
    if (threadIdx.x == 0)
        part[blockIdx.x] = s;
}

/* *out = Σ part[0, blocks) in a fixed tree; one block of kNormBlocks threads. */
__global__ void __launch_bounds__(kNormBlocks) norm2_final_kernel(const double *part, int blocks,
                                                                  double *out)
{
    double s = threadIdx.x < blocks ? part[threadIdx.x] : 0.0;
    s = block_sum(s);
    if (threadIdx.x == 0)
        *out = s;
}

/* ---- linear backward: cuBLASLt plans ---------------------------------------------------------- */

/* Column-major views (see ops_cuda.cu's linear): dx (N, K) is D = (K × N, ld K), W (M, K) is
 * (K × M, ld K), dy (N, M) is (M × N, ld M), x (N, K) is (K × N, ld K), dW (M, K) is (K × M, ld K).
 *   dgrad: dx (K × N) += W (K × M) · dy (M × N)           A = W, B = dy, no transposes, bf16 out;
 *   wgrad: dW (K × M) += x (K × N) · dyᵀ (N × M)          A = x, B = dy transposed, fp32 out.
 * Both with beta = 1 and C = D, so the old gradient is added in fp32 before the one rounding. */
enum BwdKind { kDgrad = 0, kWgrad = 1 };

struct BwdKey {
    int kind, n, k, m;
    int align[3]; /* A, B, C = D */
};

using BwdPlan = LtPlan<BwdKey>;

} // namespace

struct tkd_cuda_bwd_ws {
    int max_rows, max_d;
    int32_t *iota;  /* (max_rows) 0, 1, ...: the sort's values in */
    int32_t *keys;  /* (max_rows) sorted token ids */
    int32_t *rows;  /* (max_rows) their rows */
    void *sort_tmp; /* CUB's temporary storage */
    size_t sort_bytes;
    float *part;    /* (part_floats) partial sums */
    size_t part_floats;
    double *norm_part; /* (kNormBlocks) */
    LtCache<BwdKey, kBwdPlans> plans;
};

/* ---- workspace -------------------------------------------------------------------------------- */

extern "C" void tkd_cuda_bwd_ws_free(tkd_cuda_bwd_ws *ws)
{
    tkd_cuda_ws_free(ws, [](tkd_cuda_bwd_ws *w) {
        tkd_cuda_free_all(w->iota, w->sort_tmp, w->part, w->norm_part);
        lt_cache_destroy(&w->plans);
    });
}

static tkd_status bwd_ws_init(tkd_cuda_bwd_ws *ws)
{
    const size_t rows = (size_t)ws->max_rows, chunks = (rows + kEmbChunk - 1) / kEmbChunk;
    size_t part = 2 * chunks * (size_t)ws->max_d; /* embedding head + tail */
    if (part < (size_t)kMaxGroups * ws->max_d)
        part = (size_t)kMaxGroups * ws->max_d;
    ws->part_floats = part < kMinPartFloats ? kMinPartFloats : part;
    TKD_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, ws->sort_bytes, (const int32_t *)nullptr,
                                                   (int32_t *)nullptr, (const int32_t *)nullptr,
                                                   (int32_t *)nullptr, ws->max_rows, 0, 32));
    const char *hint = "lower the batch size or sequence length";
    TKD_TRY(tkd_cuda_malloc((void **)&ws->iota, 3 * rows * sizeof(int32_t), "backward sort buffers", hint));
    ws->keys = ws->iota + rows, ws->rows = ws->iota + 2 * rows;
    TKD_TRY(tkd_cuda_malloc(&ws->sort_tmp, ws->sort_bytes, "backward sort scratch", hint));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->part, ws->part_floats * sizeof(float), "backward partial sums", hint));
    TKD_TRY(tkd_cuda_malloc((void **)&ws->norm_part, kNormBlocks * sizeof(double), "gradient norm partials", NULL));
    int32_t *iota = (int32_t *)malloc(rows * sizeof(int32_t));
    if (!iota)
        return tkd_error_set(TKD_ERR_NOMEM, "backward workspace: out of host memory");
    for (size_t i = 0; i < rows; i++)
        iota[i] = (int32_t)i;
    tkd_status st = tkd_cuda_to_device(ws->iota, iota, rows * sizeof(int32_t));
    free(iota);
    return st;
}

extern "C" tkd_status tkd_cuda_bwd_ws_create(int max_rows, int max_d, tkd_cuda_bwd_ws **out)
{
    *out = NULL;
    if (max_rows < 1 || max_d < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "backward workspace: max_rows = %d, max_d = %d (≥ 1)",
                             max_rows, max_d);
    return tkd_cuda_ws_create(out, tkd_cuda_bwd_ws_free, "backward workspace: out of host memory",
                              [&](tkd_cuda_bwd_ws *ws) {
                                  ws->max_rows = max_rows, ws->max_d = max_d;
                                  return bwd_ws_init(ws);
                              });
}


/* ---- launchers: embedding, RMSNorm, RoPE, SwiGLU ---------------------------------------------- */

extern "C" tkd_status tkd_cuda_embedding_bwd(tkd_cuda_bwd_ws *ws, const int32_t *tok, int N,
                                             const float *dx, int D, float *demb, void *stream)
{
    if (!ws || N < 0 || D < 1 || (N > 0 && (!tok || !dx || !demb)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "embedding_bwd: N = %d, D = %d or a NULL tensor", N, D);
    const int chunks = (N + kEmbChunk - 1) / kEmbChunk;
    if (N > ws->max_rows || 2 * (size_t)chunks * D > ws->part_floats)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "embedding_bwd: N = %d, D = %d beyond the workspace's %d rows of width %d",
                             N, D, ws->max_rows, ws->max_d);
    if (N == 0)
        return TKD_OK;
    cudaStream_t s = (cudaStream_t)stream;
    size_t need = 0;
    TKD_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, need, tok, ws->keys, ws->iota, ws->rows, N, 0, 32, s));
    if (need > ws->sort_bytes)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "embedding_bwd: the sort wants %zu bytes, the workspace has %zu",
                             need, ws->sort_bytes);
    TKD_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws->sort_tmp, need, tok, ws->keys, ws->iota, ws->rows, N, 0,
                                                   32, s));
    EmbArgs a = {ws->keys, ws->rows, dx, demb, ws->part, ws->part + (size_t)chunks * D, N, D};
    if (D % 4 == 0 && aligned16(dx) && aligned16(demb)) {
        const dim3 grid(chunks, (D / 4 + kEmbThreads - 1) / kEmbThreads);
        emb_pieces_kernel<4><<<grid, kEmbThreads, 0, s>>>(a);
        emb_join_kernel<4><<<grid, kEmbThreads, 0, s>>>(a, chunks);
    } else {
        const dim3 grid(chunks, (D + kEmbThreads - 1) / kEmbThreads);
        emb_pieces_kernel<1><<<grid, kEmbThreads, 0, s>>>(a);
        emb_join_kernel<1><<<grid, kEmbThreads, 0, s>>>(a, chunks);
    }
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_rmsnorm_bwd(tkd_cuda_bwd_ws *ws, const uint16_t *dy, const float *x,
                                           const uint16_t *w, const float *rstd, int N, int D, float *dx,
                                           uint16_t *dx_bf16, float *dw, void *stream)
{
    if (!ws || N < 0 || D < 1 || D > kRowMaxD || (N > 0 && (dx || dw) && (!dy || !x || !w || !rstd)) ||
        (dx_bf16 && !dx))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "rmsnorm_bwd: N = %d, D = %d (1..%d), a NULL tensor or dx_bf16 without dx", N, D,
                             kRowMaxD);
    if (N == 0 || (!dx && !dw))
        return TKD_OK;
    int rows_per, G;
    row_groups(N, D, ws->part_floats, &rows_per, &G);
    RmsBwdArgs a = {dy, x, w, rstd, dx, dx_bf16, dw ? ws->part : NULL, N, D, rows_per};
    const bool vec = D % 8 == 0 && aligned16(dy) && aligned16(x) && aligned16(w) && (!dx || aligned16(dx)) &&
                     (!dx_bf16 || aligned16(dx_bf16));
    int nt, chunks;
    row_shape(D, &nt, &chunks);
    cudaStream_t s = (cudaStream_t)stream;
    row_dispatch(vec, chunks, [&](auto ch, auto v) { rmsnorm_bwd_kernel<ch.value, v.value><<<G, nt, 0, s>>>(a); });
    TKD_CUDA_CHECK(cudaGetLastError());
    return dw ? partials_reduce(ws->part, G, D, dw, s) : TKD_OK;
}

extern "C" tkd_status tkd_cuda_rope_bwd(uint16_t *dq, uint16_t *dk, int N, int T, int H, int Hkv, int dh,
                                        const float *cos_t, const float *sin_t, void *stream)
{
    return rope_run<true>(dq, dk, N, T, H, Hkv, dh, cos_t, sin_t, stream, "rope_bwd");
}

extern "C" tkd_status tkd_cuda_swiglu_bwd(const uint16_t *dh, const uint16_t *g, const uint16_t *u,
                                          int64_t n, uint16_t *dg, uint16_t *du, int acc, void *stream)
{
    if (n < 0 || (n > 0 && (dg || du) && (!dh || !g || !u)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "swiglu_bwd: n = %lld or a NULL tensor", (long long)n);
    if (!dg && !du)
        return TKD_OK;
    SwigluBwdOp op = {dh, g, u, dg, du, acc != 0};
    const bool vec = aligned16(dh) && aligned16(g) && aligned16(u) && (!dg || aligned16(dg)) &&
                     (!du || aligned16(du));
    return elementwise_run(op, n, vec, stream);
}

/* ---- launchers: linear backward --------------------------------------------------------------- */

/* Fills p (zeroed) for key: descriptors, layouts and the heuristic's first algorithm for lin's
 * workspace size. On failure the caller destroys p. */
static tkd_status bwd_plan_init(cublasLtHandle_t lt, size_t ws_bytes, BwdPlan *p, const BwdKey &key)
{
    const bool wg = key.kind == kWgrad;
    TKD_TRY(lt_plan_op(p, key, CUBLAS_OP_N, wg ? CUBLAS_OP_T : CUBLAS_OP_N));
    if (wg) {
        TKD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, key.k, key.n, key.k)); /* x */
        TKD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, key.m, key.n, key.m)); /* dy */
        TKD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lc, CUDA_R_32F, key.k, key.m, key.k));  /* dW */
    } else {
        TKD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, key.k, key.m, key.k)); /* W */
        TKD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, key.m, key.n, key.m)); /* dy */
        TKD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lc, CUDA_R_16BF, key.k, key.n, key.k)); /* dx */
    }
    const uint32_t al[4] = {(uint32_t)key.align[0], (uint32_t)key.align[1], (uint32_t)key.align[2],
                            (uint32_t)key.align[2]};
    const cublasStatus_t e = lt_plan_algo(lt, p, ws_bytes, al);
    if (e == CUBLAS_STATUS_NOT_SUPPORTED)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "linear_bwd: cuBLASLt has no %s algorithm for N = %d, K = %d, M = %d "
                             "(pointer alignments %s %d, dy %d, %s %d bytes)",
                             wg ? "weight-gradient" : "input-gradient", key.n, key.k, key.m,
                             wg ? "x" : "w", key.align[0], key.align[1], wg ? "dw" : "dx", key.align[2]);
    TKD_CUBLAS_CHECK(e); /* the preference or heuristic call failed otherwise */
    return TKD_OK;
}

/* The cached plan for key, made (replacing the least recently used) when missing. */
static tkd_status bwd_plan_get(tkd_cuda_bwd_ws *ws, cublasLtHandle_t lt, size_t ws_bytes, const BwdKey &key,
                               BwdPlan **out)
{
    return lt_cache_get(&ws->plans, key, [&](BwdPlan *p) { return bwd_plan_init(lt, ws_bytes, p, key); }, out);
}

/* C += op(A)·op(B) with the plan for (kind, N, K, M) and these pointers' alignments. */
static tkd_status bwd_gemm(tkd_cuda_linear *lin, tkd_cuda_bwd_ws *ws, int kind, int N, int K, int M,
                           const void *A, const void *B, void *C, float beta, cudaStream_t s)
{
    BwdKey key;
    memset(&key, 0, sizeof key); /* compared with memcmp */
    key.kind = kind, key.n = N, key.k = K, key.m = M;
    key.align[0] = ptr_align(A), key.align[1] = ptr_align(B), key.align[2] = ptr_align(C);
    void *handle = NULL, *lt_ws = NULL;
    size_t lt_ws_bytes = 0;
    tkd_cuda_linear_lt(lin, &handle, &lt_ws, &lt_ws_bytes);
    cublasLtHandle_t lt = (cublasLtHandle_t)handle;
    BwdPlan *p = NULL;
    TKD_TRY(bwd_plan_get(ws, lt, lt_ws_bytes, key, &p));
    const float one = 1.0f; /* beta 0: C is not read (the first contribution overwrites it) */
    TKD_CUBLAS_CHECK(cublasLtMatmul(lt, p->op, &one, A, p->la, B, p->lb, &beta, C, p->lc, C, p->lc, &p->algo,
                                    lt_ws, lt_ws_bytes, s));
    return TKD_OK;
}

/* db += Σ_n dy: per-group fp32 column sums into the workspace, then the fixed-order reduction. */
static tkd_status bias_grad(tkd_cuda_bwd_ws *ws, const uint16_t *dy, int N, int M, float *db, cudaStream_t s)
{
    if ((size_t)M > ws->part_floats) /* row_groups needs room for one group */
        return tkd_error_set(TKD_ERR_INVALID_ARG, "linear_bwd: M = %d beyond the workspace's %zu partials", M,
                             ws->part_floats);
    int rows_per, G;
    row_groups(N, M, ws->part_floats, &rows_per, &G);
    colsum_bf16_kernel<<<dim3(G, (M + kEltThreads - 1) / kEltThreads), kEltThreads, 0, s>>>(dy, N, M, rows_per,
                                                                                           ws->part);
    TKD_CUDA_CHECK(cudaGetLastError());
    return partials_reduce(ws->part, G, M, db, s);
}

extern "C" tkd_status tkd_cuda_linear_bwd(tkd_cuda_linear *lin, tkd_cuda_bwd_ws *ws, const uint16_t *dy,
                                          const uint16_t *x, const uint16_t *w, int N, int K, int M,
                                          uint16_t *dx, float *dw, float *db, int dx_acc, void *stream)
{
    if (!lin || !ws || N < 0 || K < 1 || M < 1 ||
        (N > 0 && ((!dy && (dx || dw || db)) || (dx && !w) || (dw && !x))))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "linear_bwd: N = %d, K = %d, M = %d or a NULL tensor", N, K,
                             M);
    const void *bf16_ptrs[4] = {dy, x, w, dx};
    for (int i = 0; i < 4; i++)
        if ((uintptr_t)bf16_ptrs[i] & 1u)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "linear_bwd: a bf16 pointer is not 2-byte aligned");
    if (((uintptr_t)dw & 3u) || ((uintptr_t)db & 3u))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "linear_bwd: an fp32 pointer is not 4-byte aligned");
    if (N == 0)
        return TKD_OK; /* no rows: nothing to add */
    cudaStream_t s = (cudaStream_t)stream;
    if (dx)
        TKD_TRY(bwd_gemm(lin, ws, kDgrad, N, K, M, w, dy, dx, dx_acc ? 1.0f : 0.0f, s));
    if (dw)
        TKD_TRY(bwd_gemm(lin, ws, kWgrad, N, K, M, x, dy, dw, 1.0f, s));
    if (db)
        TKD_TRY(bias_grad(ws, dy, N, M, db, s));
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_grad_norm2(tkd_cuda_bwd_ws *ws, const float *g, size_t n, double *norm2,
                                          void *stream)
{
    if (!ws || !norm2 || n > (size_t)INT64_MAX || (n > 0 && !g))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "grad_norm2: n = %zu or a NULL pointer", n);
    cudaStream_t s = (cudaStream_t)stream;
    if (n == 0) {
        TKD_CUDA_CHECK(cudaMemsetAsync(norm2, 0, sizeof(double), s));
        return TKD_OK;
    }
    const bool vec = aligned16(g);
    const int64_t units = (int64_t)n / (vec ? 8 : 1);
    int64_t b = (units + kNormThreads - 1) / kNormThreads;
    const int blocks = (int)(b < 1 ? 1 : b > kNormBlocks ? kNormBlocks : b);
    if (vec)
        norm2_kernel<8><<<blocks, kNormThreads, 0, s>>>(g, (int64_t)n, ws->norm_part);
    else
        norm2_kernel<1><<<blocks, kNormThreads, 0, s>>>(g, (int64_t)n, ws->norm_part);
    TKD_CUDA_CHECK(cudaGetLastError());
    norm2_final_kernel<<<1, kNormBlocks, 0, s>>>(ws->norm_part, blocks, norm2);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}
