/* kl_bench_cuda.cu — see kl_bench_cuda.h. Benchmark code only: the product
 * (kernels/loss/kl_loss_cuda.cu) knows nothing of floors, profiles or random fills; this file composes
 * its per-chunk stages. */
#include "bench/kl_bench_cuda.h"

#include <cuda_bf16.h>
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/loss/kl_loss_cuda_internal.h"
#include "kernels/loss/kl_loss_cuda_tuning.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"
#include "kernels/gemm_sm90/lmhead_sm90_tuning.h"

namespace {

/* Rows of chunk [row0, row0 + chunk) that exist. */
int chunk_len(const tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, long long row0)
{
    return (int)(b->n - row0 < ws->chunk ? b->n - row0 : ws->chunk);
}

/* ---- profile: events around every stage of every chunk, summed per stage after one sync ------ */

constexpr int kMaxMarks = 2048;

struct ProfRec {
    cudaEvent_t ev[kMaxMarks];
    int stage[kMaxMarks]; /* stage timed from this mark to the next; -1 for the last mark */
    int n;
};

tkd_status prof_mark(ProfRec *pr, int stage)
{
    if (pr->n >= kMaxMarks)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "kl_bench: profile: more than %d stage marks; "
                             "use a bigger --chunk", kMaxMarks);
    TKD_CUDA_CHECK(cudaEventCreate(&pr->ev[pr->n]));
    pr->n++; /* counted once created, so that it is destroyed even if recording fails */
    TKD_CUDA_CHECK(cudaEventRecord(pr->ev[pr->n - 1], 0));
    pr->stage[pr->n - 1] = stage;
    return TKD_OK;
}

/* The product's per-chunk stage marks (0 logits, 1 rows, 2 dH, 3 dW) mapped to this pass's
 * indices of ms. */
struct MarkCtx {
    ProfRec *pr;
    int map[4];
};

tkd_status mark_cb(void *ctx, int stage)
{
    MarkCtx *m = static_cast<MarkCtx *>(ctx);
    return prof_mark(m->pr, m->map[stage]);
}

/* One recompute forward + backward (gif = 0: stages 0..5) or one grad_in_forward forward (gif = 1:
 * stages 6..9): the product's own chunk function (tkd_kl_cuda_run_chunk), which marks each stage. */
tkd_status prof_pass(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b,
                     int gif, float *dh, float *dw, ProfRec *pr)
{
    TKD_TRY(tkd_kl_cuda_count_kept(ws, p, b));
    for (int pass = 0; pass < (gif ? 1 : 2); pass++) {
        const tkd_kl_cuda_rows_mode mode = gif    ? TKD_KL_CUDA_ROWS_STATS_GRAD
                                           : pass ? TKD_KL_CUDA_ROWS_GRAD
                                                  : TKD_KL_CUDA_ROWS_STATS;
        MarkCtx m = {pr, {0, 1, 4, 5}};
        if (gif)
            m = {pr, {TKD_KL_BENCH_PROF_GIF_LOGITS, TKD_KL_BENCH_PROF_GIF_ROWS,
                      TKD_KL_BENCH_PROF_GIF_DH_GEMM, TKD_KL_BENCH_PROF_GIF_DW_GEMM}};
        else if (pass)
            m = {pr, {TKD_KL_BENCH_PROF_LOGITS_BWD, TKD_KL_BENCH_PROF_GRAD_ROWS,
                      TKD_KL_BENCH_PROF_DH_GEMM, TKD_KL_BENCH_PROF_DW_GEMM}};
        const int chunk = tkd_kl_cuda_chunk_for(ws, p, mode != TKD_KL_CUDA_ROWS_STATS, b->n);
        for (long long row0 = 0; row0 < b->n; row0 += chunk) {
            const int rows = (int)(b->n - row0 < chunk ? b->n - row0 : chunk);
            TKD_TRY(tkd_kl_cuda_run_chunk(ws, p, b, mode, row0, rows, 1.0f, dh, dw, mark_cb, &m));
        }
    }
    return prof_mark(pr, -1);
}

/* Waits for the pass, adds its stage times to ms and destroys its events. */
tkd_status prof_collect(ProfRec *pr, tkd_status st, double *ms)
{
    cudaError_t ce = cudaDeviceSynchronize();
    if (st == TKD_OK && ce != cudaSuccess)
        st = tkd_error_set(tkd_cuda_status(ce), "kl_bench: profile: %s", cudaGetErrorString(ce));
    for (int i = 0; i + 1 < pr->n && st == TKD_OK; i++) {
        float t = 0.0f;
        cudaError_t e = cudaEventElapsedTime(&t, pr->ev[i], pr->ev[i + 1]);
        if (e != cudaSuccess)
            st = tkd_error_set(TKD_ERR_DEVICE, "kl_bench: profile: cudaEventElapsedTime: %s",
                               cudaGetErrorString(e));
        ms[pr->stage[i]] += t;
    }
    for (int i = 0; i < pr->n; i++)
        (void)cudaEventDestroy(pr->ev[i]); /* teardown errors are not actionable */
    pr->n = 0;
    return st;
}

/* ---- random data ----------------------------------------------------------------------------- */

__device__ inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* x[i] (n) = std · Irwin–Hall(4) of hash(seed, i), scaled to unit variance: cheap, deterministic,
 * normal enough for benchmarks. Grid-stride. */
__global__ void fill_bf16_kernel(__nv_bfloat16 *x, size_t n, uint64_t seed, float std)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t h = mix64(seed * 0x9e3779b97f4a7c15ull + i);
        float u = 0.0f;
        for (int j = 0; j < 4; j++)
            u += (float)((h >> (16 * j)) & 0xffffu) * (1.0f / 65536.0f);
        x[i] = __float2bfloat16_rn((u - 2.0f) * 1.7320508f * std);
    }
}

} // namespace

extern "C" tkd_status tkd_kl_bench_gemm_floor(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b,
                                              int recompute, const uint16_t *ds, float *dh,
                                              float *dw, int overwrite)
{
    const int passes = recompute ? 2 : 1; /* recompute: the logits once per forward and backward */
    for (int pass = 0; pass < passes; pass++)
        for (long long row0 = 0; row0 < b->n; row0 += ws->chunk) {
            const int rows = chunk_len(ws, b, row0);
            TKD_TRY(tkd_kl_cuda_chunk_logits(ws, b, row0, rows));
            if (pass == passes - 1) {
                TKD_TRY(tkd_kl_cuda_chunk_dh(ws, b, row0, rows, ds, dh));
                TKD_TRY(tkd_kl_cuda_chunk_dw(ws, b, row0, rows, ds, dw, !(overwrite && row0 == 0)));
            }
        }
    TKD_CUDA_CHECK(cudaDeviceSynchronize());
    return TKD_OK;
}

extern "C" tkd_status tkd_kl_bench_dense_floor(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int kind,
                                               const uint16_t *ds, float *dh, float *dw, int overwrite)
{
    const int passes = kind == TKD_KL_BENCH_DENSE_RECOMPUTE ? 2 : 1;
    for (int pass = 0; pass < passes; pass++)
        for (long long row0 = 0; row0 < b->n; row0 += ws->chunk) {
            const int rows = chunk_len(ws, b, row0);
            TKD_TRY(tkd_kl_cuda_chunk_logits(ws, b, row0, rows));
            TKD_TRY(tkd_kl_cuda_chunk_teacher_logits(ws, b, row0, rows));
            if (kind != TKD_KL_BENCH_DENSE_LOGITS && pass == passes - 1) {
                TKD_TRY(tkd_kl_cuda_chunk_dh(ws, b, row0, rows, ds, dh));
                TKD_TRY(tkd_kl_cuda_chunk_dw(ws, b, row0, rows, ds, dw, !(overwrite && row0 == 0)));
            }
        }
    TKD_CUDA_CHECK(cudaDeviceSynchronize());
    return TKD_OK;
}

extern "C" size_t tkd_kl_bench_ds_elems(const tkd_kl_cuda_ws *ws)
{
    return (size_t)ws->chunk * 2 * ws->ldl;
}

extern "C" tkd_status tkd_kl_bench_profile(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                           const tkd_kl_cuda_batch *b, float *dh, float *dw,
                                           double ms[TKD_KL_BENCH_PROF_STAGES])
{
    TKD_TRY(tkd_kl_cuda_check_call(ws, p, b, 1, dh, dw));
    ProfRec *pr = (ProfRec *)calloc(1, sizeof *pr);
    if (!pr)
        return tkd_error_set(TKD_ERR_NOMEM, "kl_bench: profile: host allocation failed");
    for (int i = 0; i < TKD_KL_BENCH_PROF_STAGES; i++)
        ms[i] = 0.0;
    tkd_status st = TKD_OK;
    for (int gif = 0; gif < 2 && st == TKD_OK; gif++)
        st = prof_collect(pr, prof_pass(ws, p, b, gif, dh, dw, pr), ms);
    free(pr);
    if (st == TKD_OK)
        st = tkd_kl_cuda_sm90_check(ws);
    return st;
}

extern "C" tkd_status tkd_kl_bench_set_rows(tkd_kl_cuda_ws *ws, int threads, int vec)
{
    return tkd_kl_cuda_ws_set_rows(ws, threads, vec);
}

extern "C" tkd_status tkd_kl_bench_set_sm90(tkd_kl_cuda_ws *ws, int on)
{
    return tkd_kl_cuda_ws_set_sm90(ws, on);
}

extern "C" tkd_status tkd_kl_bench_set_fused(tkd_kl_cuda_ws *ws, int on)
{
    return tkd_kl_cuda_ws_set_fused(ws, on);
}

extern "C" int tkd_kl_bench_fused_on(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p)
{
    return tkd_kl_cuda_fused_grad_on(ws, p);
}

extern "C" int tkd_kl_bench_chunk_for(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p, int grad,
                                      int64_t n)
{
    return tkd_kl_cuda_chunk_for(ws, p, grad, n);
}

extern "C" tkd_status tkd_kl_bench_fill_bf16(uint16_t *dev, size_t n, uint64_t seed, float std)
{
    fill_bf16_kernel<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16 *>(dev), n, seed, std);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

extern "C" tkd_status tkd_kl_bench_lmhead(tkd_kl_cuda_ws *ws, tkd_lmhead_sm90_ws *lw,
                                          const tkd_kl_params *p, const tkd_kl_cuda_batch *b,
                                          int kind, float *part, float *lse1, float *lset)
{
    if (kind == TKD_KL_BENCH_LM_CUBLAS_ROWS || kind == TKD_KL_BENCH_LM_SM90_ROWS)
        TKD_TRY(tkd_kl_cuda_count_kept(ws, p, b)); /* the row kernel's loss sums start at zero */
    for (long long row0 = 0; row0 < b->n; row0 += ws->chunk) {
        const int rows = chunk_len(ws, b, row0);
        const uint16_t *h = b->h + row0 * b->d;
        switch (kind) {
        case TKD_KL_BENCH_LM_CUBLAS:
            TKD_TRY(tkd_kl_cuda_chunk_logits(ws, b, row0, rows));
            break;
        case TKD_KL_BENCH_LM_CUBLAS_ROWS:
            TKD_TRY(tkd_kl_cuda_chunk_logits(ws, b, row0, rows));
            TKD_TRY(tkd_kl_cuda_chunk_rows(ws, p, b, TKD_KL_CUDA_ROWS_STATS, row0, rows, 1.0f));
            break;
        case TKD_KL_BENCH_LM_SM90_STATS:
            TKD_TRY(tkd_lmhead_sm90_stats(lw, h, b->w, rows, b->d, b->v, p->temperature, part));
            TKD_TRY(tkd_lmhead_sm90_lse(part, rows, b->v, p->temperature, lse1 + row0, lset + row0));
            break;
        case TKD_KL_BENCH_LM_SM90_LOGITS_STATS:
        case TKD_KL_BENCH_LM_SM90_ROWS:
            TKD_TRY(tkd_lmhead_sm90_logits_stats(lw, h, b->w, rows, b->d, b->v, p->temperature,
                                                 ws->chunk_buf, ws->ldl, part));
            if (kind == TKD_KL_BENCH_LM_SM90_LOGITS_STATS) {
                TKD_TRY(tkd_lmhead_sm90_lse(part, rows, b->v, p->temperature, lse1 + row0, lset + row0));
                break;
            }
            /* the loss's stage: the LSEs into ws, the row kernel takes them */
            TKD_TRY(tkd_lmhead_sm90_lse(part, rows, b->v, p->temperature, ws->lse_one + row0,
                                        ws->lse_tau + row0));
            TKD_TRY(tkd_kl_cuda_chunk_rows(ws, p, b, (tkd_kl_cuda_rows_mode)(TKD_KL_CUDA_ROWS_STATS |
                                           TKD_KL_CUDA_ROWS_LSE_GIVEN), row0, rows, 1.0f));
            break;
        case TKD_KL_BENCH_LM_SM90_LOGITS:
            TKD_TRY(tkd_lmhead_sm90_logits(lw, h, b->w, rows, b->d, b->v, ws->chunk_buf, ws->ldl));
            break;
        default:
            TKD_TRY(tkd_lmhead_sm90_mainloop(lw, h, b->w, rows, b->d, b->v));
        }
    }
    TKD_CUDA_CHECK(cudaDeviceSynchronize());
    return lw ? tkd_lmhead_sm90_sync(lw) : TKD_OK;
}

/* max_i |a_i − b_i| of two device float arrays of n. */
static tkd_status max_abs_diff(const float *a, const float *b, size_t n, double *out)
{
    float *ha = (float *)malloc(n * 4 + 4), *hb = (float *)malloc(n * 4 + 4);
    tkd_status st = ha && hb ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "kl_bench: lmhead check");
    if (st == TKD_OK && cudaMemcpy(ha, a, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess &&
        cudaMemcpy(hb, b, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess) {
        double m = 0.0;
        for (size_t i = 0; i < n; i++)
            m = fmax(m, isfinite(ha[i]) && isfinite(hb[i]) ? fabs((double)ha[i] - hb[i]) : INFINITY);
        *out = m;
    } else if (st == TKD_OK) {
        st = tkd_error_set(TKD_ERR_DEVICE, "kl_bench: lmhead check: copy failed");
    }
    free(ha), free(hb);
    return st;
}

/* The largest |our − cuBLAS| logit over the largest |cuBLAS logit|, on rows (ldl apart, first V
 * columns) of two device (rows, ldl) fp32 buffers. */
static tkd_status logits_rel_diff(const float *ours, const float *ref, int rows, long long ldl, int v,
                                  double *out)
{
    const size_t nz = (size_t)rows * ldl;
    float *ho = (float *)malloc(nz * 4), *hr = (float *)malloc(nz * 4);
    tkd_status st = ho && hr ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "kl_bench: lmhead check");
    if (st == TKD_OK && (cudaMemcpy(ho, ours, nz * 4, cudaMemcpyDeviceToHost) != cudaSuccess ||
                         cudaMemcpy(hr, ref, nz * 4, cudaMemcpyDeviceToHost) != cudaSuccess))
        st = tkd_error_set(TKD_ERR_DEVICE, "kl_bench: lmhead check: copy failed");
    double dmax = 0.0, zmax = 0.0;
    for (int r = 0; st == TKD_OK && r < rows; r++)
        for (int c = 0; c < v; c++) {
            const double o = ho[r * ldl + c], x = hr[r * ldl + c];
            dmax = fmax(dmax, isfinite(o) ? fabs(o - x) : INFINITY);
            zmax = fmax(zmax, fabs(x));
        }
    *out = zmax > 0.0 ? dmax / zmax : dmax;
    free(ho), free(hr);
    return st;
}

extern "C" tkd_status tkd_kl_bench_lmhead_check(tkd_kl_cuda_ws *ws, tkd_lmhead_sm90_ws *lw,
                                                const tkd_kl_cuda_batch *b, const float *lse1,
                                                const float *lset, double *max_d1, double *max_dt,
                                                double *logits_rel)
{
    TKD_TRY(max_abs_diff(lse1, ws->lse_one, (size_t)b->n, max_d1));
    TKD_TRY(max_abs_diff(lset, ws->lse_tau, (size_t)b->n, max_dt));
    const int rows = b->n < 4 ? (int)b->n : 4;
    float *ours = NULL;
    TKD_TRY(tkd_cuda_malloc((void **)&ours, (size_t)rows * ws->ldl * 4, "kl_bench: lmhead check", NULL));
    tkd_status st = tkd_lmhead_sm90_logits(lw, b->h, b->w, rows, b->d, b->v, ours, ws->ldl);
    if (st == TKD_OK)
        st = tkd_lmhead_sm90_sync(lw);
    if (st == TKD_OK)
        st = tkd_kl_cuda_chunk_logits(ws, b, 0, rows);
    if (st == TKD_OK)
        st = logits_rel_diff(ours, ws->chunk_buf, rows, ws->ldl, b->v, logits_rel);
    tkd_cuda_free(ours);
    return st;
}
