/* grad_bench_cuda.h — the CUDA side of bench/grad_bench.c: the LM head's gradient GEMMs of the fused
 * KL loss, ours (kernels/gemm_sm90/lmhead_grad_sm90.h) against cuBLAS doing the same work, on random data. */
#ifndef TKD_GRAD_BENCH_CUDA_H
#define TKD_GRAD_BENCH_CUDA_H

#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Indices of ms (median device time per call, ms). */
enum {
    GB_OURS_DH = 0,   /* tkd_lmhead_grad_sm90_dh: sigma ⊙ (E·W), fp32 out */
    GB_CUBLAS_DH = 1, /* cuBLAS E·W (fp32 out) + the loss's scaling pass: what the loss ran before */
    GB_OURS_DW = 2,   /* tkd_lmhead_grad_sm90_dw accumulate: dW += Eᵀ·X */
    GB_CUBLAS_DW = 3, /* cuBLAS Eᵀ·X with beta 1 into fp32 dW */
    GB_PLAIN_DH = 4,  /* cuBLAS E·W with bf16 out: the plain GEMM of the same size (PyTorch's) */
    GB_PLAIN_DW = 5,  /* cuBLAS Eᵀ·X with bf16 out */
    GB_OURS_DW0 = 6,  /* tkd_lmhead_grad_sm90_dw overwrite: dW = Eᵀ·X (the epilogue reads no dW) */
    GB_N = 7,
};

/* Times each kind `reps` times (alternating rep by rep) at rows x D x V, ours on schedule `sched`
 * (tkd_lmhead_grad_sm90_set_schedule: -1 the defaults); *maxrel: the largest relative norm
 * difference of ours against cuBLAS (dH, dW). */
tkd_status tkd_grad_bench_run(int64_t rows, int d, int v, int reps, int sched, double ms[GB_N], double *maxrel);

#ifdef __cplusplus
}
#endif

#endif
