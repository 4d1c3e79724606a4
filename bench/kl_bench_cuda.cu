/* kl_bench_cuda.cu — see kl_bench_cuda.h. Benchmark code only: the product
 * (kernels/kl_loss_cuda.cu) knows nothing of floors, profiles or random fills; this file composes
 * its per-chunk stages. */
#include "bench/kl_bench_cuda.h"

#include <cuda_bf16.h>
#include <stdlib.h>

#include "kernels/cuda_check.h"
#include "kernels/kl_loss_cuda_internal.h"

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

/* One recompute forward + backward (gif = 0: stages 0..5) or one grad_in_forward forward (gif = 1:
 * stages 6..9), the product's stages in the product's order, a mark before each. */
tkd_status prof_pass(tkd_kl_cuda_ws *ws, const tkd_kl_params *p, const tkd_kl_cuda_batch *b,
                     int gif, float *dh, float *dw, ProfRec *pr)
{
    const int base = gif ? TKD_KL_BENCH_PROF_GIF_LOGITS : TKD_KL_BENCH_PROF_LOGITS_FWD;
    TKD_TRY(tkd_kl_cuda_count_kept(ws, p, b));
    for (int pass = 0; pass < (gif ? 1 : 2); pass++)
        for (long long row0 = 0; row0 < b->n; row0 += ws->chunk) {
            const int rows = chunk_len(ws, b, row0);
            const tkd_kl_cuda_rows_mode mode = gif    ? TKD_KL_CUDA_ROWS_STATS_GRAD
                                               : pass ? TKD_KL_CUDA_ROWS_GRAD
                                                      : TKD_KL_CUDA_ROWS_STATS;
            TKD_TRY(prof_mark(pr, base + 2 * pass)); /* logits fwd / bwd / gif */
            TKD_TRY(tkd_kl_cuda_chunk_logits(ws, b, row0, rows));
            TKD_TRY(prof_mark(pr, base + 2 * pass + 1)); /* stats / grad / gif rows */
            TKD_TRY(tkd_kl_cuda_chunk_rows(ws, p, b, mode, row0, rows, 1.0f));
            if (!gif && pass == 0)
                continue;
            TKD_TRY(prof_mark(pr, base + (gif ? 2 : 4))); /* dH GEMM */
            TKD_TRY(tkd_kl_cuda_chunk_dh(ws, b, row0, rows, ws->chunk_buf, dh));
            TKD_TRY(prof_mark(pr, base + (gif ? 3 : 5))); /* dW GEMM */
            TKD_TRY(tkd_kl_cuda_chunk_dw(ws, b, row0, rows, ws->chunk_buf, dw));
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
                                              float *dw)
{
    const int passes = recompute ? 2 : 1; /* recompute: the logits once per forward and backward */
    for (int pass = 0; pass < passes; pass++)
        for (long long row0 = 0; row0 < b->n; row0 += ws->chunk) {
            const int rows = chunk_len(ws, b, row0);
            TKD_TRY(tkd_kl_cuda_chunk_logits(ws, b, row0, rows));
            if (pass == passes - 1) {
                TKD_TRY(tkd_kl_cuda_chunk_dh(ws, b, row0, rows, ds, dh));
                TKD_TRY(tkd_kl_cuda_chunk_dw(ws, b, row0, rows, ds, dw));
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
    return st;
}

extern "C" tkd_status tkd_kl_bench_set_rows(tkd_kl_cuda_ws *ws, int threads, int vec)
{
    return tkd_kl_cuda_ws_set_rows(ws, threads, vec);
}

extern "C" tkd_status tkd_kl_bench_fill_bf16(uint16_t *dev, size_t n, uint64_t seed, float std)
{
    fill_bf16_kernel<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16 *>(dev), n, seed, std);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}
