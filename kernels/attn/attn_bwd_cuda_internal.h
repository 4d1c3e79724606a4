/* attn_bwd_cuda_internal.h — what the attention backward kernels share beyond attn_cuda.h: the
 * workspace's layout and the prep launch (D and lse in log2 units), so that the Hopper backward
 * (attn_bwd_sm90.cu) reads the same workspace as the flash backward (attn_bwd_cuda.cu). Internal:
 * kernels/ only. C++ (CUDA) only.
 */
#ifndef TKD_ATTN_BWD_CUDA_INTERNAL_H
#define TKD_ATTN_BWD_CUDA_INTERNAL_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/attn/attn_cuda.h"

/* T rounded up to this is the workspace's row count per (b, h): Tp. */
#define TKD_ATTN_BWD_PAD 128

struct tkd_cuda_attn_bwd_ws {
    float *lse2;   /* (B, H, Tp) lse·log2(e), +inf on padded rows */
    float *dsum;   /* (B, H, Tp) D = Σ_d dy·y, 0 on padded rows */
    unsigned *err; /* (1) non-zero after a bounded pipeline wait of attn_bwd_sm90.cu timed out */
    int64_t cap;   /* floats in lse2 and dsum each: B·H·Tp at creation */
    /* attn_bwd_sm90.cu's dQ accumulation, made only where it can run (compute capability 9.0, dh 64
     * or 128), else NULL and dq_dh 0: */
    float *dq_acc;     /* cap·dq_dh floats: (B, H, Tp / 64) tiles of 64 × dh */
    unsigned *dq_cnt;  /* cap / 64 counters: partials added per tile */
    int dq_dh;         /* the head dim dq_acc was made for */
};

/* Fills ws->lse2 and ws->dsum for (B, T, H) from dy, y (B·T, H·dh) and lse (B, H, T) on stream;
 * *Tp receives the padded T. TKD_ERR_INVALID_ARG when ws was made for fewer rows. B, T ≥ 1. */
tkd_status tkd_cuda_attn_bwd_prep(const uint16_t *dy, const uint16_t *y, const float *lse, int B, int T, int H,
                                  int dh, tkd_cuda_attn_bwd_ws *ws, int *Tp, cudaStream_t stream);

#endif /* TKD_ATTN_BWD_CUDA_INTERNAL_H */
