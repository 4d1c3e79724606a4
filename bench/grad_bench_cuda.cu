/* grad_bench_cuda.cu — see grad_bench_cuda.h. */
#include "bench/grad_bench_cuda.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/gemm_sm90/lmhead_grad_sm90.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"
#include "kernels/gemm_sm90/lmhead_sm90_tuning.h"

namespace {

__global__ void fill_kernel(__nv_bfloat16 *x, size_t n, uint32_t seed, float lo, float hi)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        x[i] = __float2bfloat16(lo + (hi - lo) * (h >> 8) * (1.0f / 16777216.0f));
    }
}

__global__ void fill_f32_kernel(float *x, size_t n, float v)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = v;
}

__global__ void scale_rows(float *dh, const float *sigma, long long rows, int d)
{
    const long long n = rows * d;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dh[i] *= sigma[i / d];
}

struct Bufs {
    uint16_t *e, *w, *x, *b16;
    float *sigma, *dh, *dh2, *dw, *dw2;
};

/* ‖a − b‖ / ‖b‖ of two device arrays; NaN when they cannot be read or b is all zeros (a comparison
 * that cannot be made must not print as agreement). */
double rel_diff(const float *a, const float *b, size_t n)
{
    float *ha = (float *)malloc(n * 4), *hb = (float *)malloc(n * 4);
    double num = 0, den = 0;
    const bool ok = ha && hb && cudaMemcpy(ha, a, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess &&
                    cudaMemcpy(hb, b, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
    for (size_t i = 0; ok && i < n; i++) {
        num += ((double)ha[i] - hb[i]) * ((double)ha[i] - hb[i]);
        den += (double)hb[i] * hb[i];
    }
    free(ha), free(hb);
    return ok && den > 0 ? sqrt(num / den) : NAN;
}

} // namespace

extern "C" tkd_status tkd_grad_bench_run(int64_t rows, int d, int v, int reps, int sched, double ms[GB_N],
                                         double *maxrel)
{
    const long long lde = ((long long)v + 15) / 16 * 16;
    Bufs b = {};
    tkd_lmhead_sm90_ws *lw = NULL;
    cublasHandle_t blas = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    double *t = (double *)calloc((size_t)GB_N * reps, sizeof(double));
    tkd_status st = t ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "grad_bench: host");
#define GB_TRY(x) do { if (st == TKD_OK) st = (x); } while (0)
    GB_TRY(tkd_cuda_malloc((void **)&b.e, (size_t)rows * lde * 2, "E", NULL));
    GB_TRY(tkd_cuda_malloc((void **)&b.w, (size_t)v * d * 2, "W", NULL));
    GB_TRY(tkd_cuda_malloc((void **)&b.x, (size_t)rows * d * 2, "X", NULL));
    GB_TRY(tkd_cuda_malloc((void **)&b.b16, (size_t)v * d * 2, "bf16 out", NULL));
    GB_TRY(tkd_cuda_malloc((void **)&b.sigma, (size_t)rows * 4, "sigma", NULL));
    GB_TRY(tkd_cuda_malloc((void **)&b.dh, (size_t)rows * d * 4, "dH", NULL));
    GB_TRY(tkd_cuda_malloc((void **)&b.dh2, (size_t)rows * d * 4, "dH", NULL));
    GB_TRY(tkd_cuda_malloc((void **)&b.dw, (size_t)v * d * 4, "dW", NULL));
    GB_TRY(tkd_cuda_malloc((void **)&b.dw2, (size_t)v * d * 4, "dW", NULL));
    GB_TRY(tkd_lmhead_sm90_ws_create(&lw, TKD_LMHEAD_SM90_SCHED_PINGPONG));
    if (lw)
        tkd_lmhead_grad_sm90_set_schedule(lw, sched);
    if (st == TKD_OK) {
        fill_kernel<<<4096, 256>>>((__nv_bfloat16 *)b.e, (size_t)rows * lde, 1, 0.0f, 1e-4f); /* E ~ softmax-sized */
        fill_kernel<<<4096, 256>>>((__nv_bfloat16 *)b.w, (size_t)v * d, 2, -0.05f, 0.05f);
        fill_kernel<<<4096, 256>>>((__nv_bfloat16 *)b.x, (size_t)rows * d, 3, -1.0f, 1.0f);
        fill_f32_kernel<<<64, 256>>>(b.sigma, (size_t)rows, 0.7f);
        fill_f32_kernel<<<4096, 256>>>(b.dw, (size_t)v * d, 0.0f);
        fill_f32_kernel<<<4096, 256>>>(b.dw2, (size_t)v * d, 0.0f);
        if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS)
            st = tkd_error_set(TKD_ERR_DEVICE, "grad_bench: cublasCreate");
    }
    if (st == TKD_OK && (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess))
        st = tkd_error_set(TKD_ERR_DEVICE, "grad_bench: events");
    const float one = 1.0f, zero = 0.0f;
    for (int r = -1; r < reps && st == TKD_OK; r++) /* r = -1: warm-up, then the accuracy check */
        for (int k = 0; k < GB_N && st == TKD_OK; k++) {
            cudaEventRecord(e0, 0);
            cublasStatus_t bs = CUBLAS_STATUS_SUCCESS;
            switch (k) {
            case GB_OURS_DH:
                st = tkd_lmhead_grad_sm90_dh(lw, b.e, lde, b.w, rows, d, v, b.sigma, b.dh);
                break;
            case GB_CUBLAS_DH:
                bs = cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, d, (int)rows, v, &one, b.w, CUDA_R_16BF, d, b.e,
                                  CUDA_R_16BF, (int)lde, &zero, b.dh2, CUDA_R_32F, d, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT);
                scale_rows<<<4096, 256>>>(b.dh2, b.sigma, rows, d);
                break;
            case GB_OURS_DW:
                st = tkd_lmhead_grad_sm90_dw(lw, b.e, lde, b.x, rows, d, v, b.dw, 1);
                break;
            case GB_CUBLAS_DW:
                bs = cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, d, v, (int)rows, &one, b.x, CUDA_R_16BF, d, b.e,
                                  CUDA_R_16BF, (int)lde, &one, b.dw2, CUDA_R_32F, d, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT);
                break;
            case GB_PLAIN_DH:
                bs = cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, d, (int)rows, v, &one, b.w, CUDA_R_16BF, d, b.e,
                                  CUDA_R_16BF, (int)lde, &zero, b.b16, CUDA_R_16BF, d, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT);
                break;
            case GB_OURS_DW0:
                st = tkd_lmhead_grad_sm90_dw(lw, b.e, lde, b.x, rows, d, v, b.dw2, 0);
                break;
            default:
                bs = cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, d, v, (int)rows, &one, b.x, CUDA_R_16BF, d, b.e,
                                  CUDA_R_16BF, (int)lde, &zero, b.b16, CUDA_R_16BF, d, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT);
            }
            if (bs != CUBLAS_STATUS_SUCCESS)
                st = tkd_error_set(TKD_ERR_DEVICE, "grad_bench: cublasGemmEx: %d", (int)bs);
            cudaEventRecord(e1, 0);
            float f = 0;
            if (st == TKD_OK && cudaEventSynchronize(e1) == cudaSuccess && cudaEventElapsedTime(&f, e0, e1) == cudaSuccess) {
                if (r >= 0)
                    t[(size_t)k * reps + r] = f;
            } else if (st == TKD_OK) {
                st = tkd_error_set(TKD_ERR_DEVICE, "grad_bench: %s", cudaGetErrorString(cudaGetLastError()));
            }
            if (r == -1 && k == GB_PLAIN_DW && st == TKD_OK) { /* after one accumulate each: same dW */
                const double rh = rel_diff(b.dh, b.dh2, (size_t)rows * d), rw = rel_diff(b.dw, b.dw2, (size_t)v * d);
                *maxrel = isnan(rh) || isnan(rw) ? NAN : fmax(rh, rw); /* fmax would drop a NaN */
            }
        }
    GB_TRY(tkd_lmhead_sm90_sync(lw));
    for (int k = 0; k < GB_N && st == TKD_OK; k++) {
        double *x = t + (size_t)k * reps;
        for (int i = 1; i < reps; i++) /* insertion sort: reps is small */
            for (int j = i; j > 0 && x[j] < x[j - 1]; j--) {
                double s = x[j];
                x[j] = x[j - 1], x[j - 1] = s;
            }
        ms[k] = x[reps / 2];
    }
#undef GB_TRY
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (blas) cublasDestroy(blas);
    tkd_lmhead_sm90_ws_free(lw);
    tkd_cuda_free(b.e), tkd_cuda_free(b.w), tkd_cuda_free(b.x), tkd_cuda_free(b.b16);
    tkd_cuda_free(b.sigma), tkd_cuda_free(b.dh), tkd_cuda_free(b.dh2), tkd_cuda_free(b.dw), tkd_cuda_free(b.dw2);
    free(t);
    return st;
}
