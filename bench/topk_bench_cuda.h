/* topk_bench_cuda.h — the CUDA side of bench/topk_bench.c (bench/topk_bench_cuda.cu, built into
 * the topk_bench target only): realistic random logits made on the device. No CUDA types:
 * topk_bench.c is C.
 */
#ifndef TKD_TOPK_BENCH_CUDA_H
#define TKD_TOPK_BENCH_CUDA_H

#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a chunk of logits looks like. */
typedef enum tkd_topk_bench_fill {
    TKD_TOPK_BENCH_FILL_PEAKED = 0, /* normal(0, 2) plus, for 1 logit in 1000, a bump uniform in
                                     * [4, 16): a few large values over a broad body, as an LM head
                                     * gives; fp32, almost no ties */
    TKD_TOPK_BENCH_FILL_BF16 = 1,   /* the same rounded to bf16 (8 significant bits): the exact ties
                                     * of a bf16 LM head */
    TKD_TOPK_BENCH_FILL_FLOOR = 2,  /* the same floored to integers: ~30 distinct values, each of the
                                     * top ones shared by hundreds of logits */
    TKD_TOPK_BENCH_FILLS = 3,
} tkd_topk_bench_fill;

/* Fills the (C, V) fp32 chunk at d_logits (device) with contents f from seed; synchronises. */
tkd_status tkd_topk_bench_fill_logits(float *d_logits, int64_t C, int64_t V, tkd_topk_bench_fill f,
                                      uint64_t seed);

#ifdef __cplusplus
}
#endif

#endif /* TKD_TOPK_BENCH_CUDA_H */
