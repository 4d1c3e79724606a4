/* moe.h — the mixture-of-experts layer's contract, shared by its CPU path (kernels/cpu/cpu_moe.h:
 * the maths as transformers 5.x computes it, the op's weight layout, the tie order), its CUDA path
 * (kernels/cuda/moe_cuda.h) and the backend seam (kernels/backend.h: moe_create, moe_fwd): which
 * router, which activation, the sizes. Plain C. */
#ifndef TKD_MOE_H
#define TKD_MOE_H

#include <stdint.h>

#include "common/half.h" /* TKD_HD: tkd_moe_tile_of runs on the host and the device */
#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How the router turns logits into k weights. */
typedef enum tkd_moe_router {
    TKD_MOE_ROUTER_SOFTMAX_TOPK = 0, /* Qwen3-MoE: softmax over E, top-k, optional renormalise */
    TKD_MOE_ROUTER_TOPK_SOFTMAX = 1, /* gpt-oss: top-k of the logits, softmax over those k */
} tkd_moe_router;

/* The experts' gated activation h = act(g, u). */
typedef enum tkd_moe_act {
    TKD_MOE_ACT_SWIGLU = 0,       /* silu(g) · u */
    TKD_MOE_ACT_SWIGLU_CLAMP = 1, /* gpt-oss: g' = min(g, limit), u' = clamp(u, ±limit),
                                     (u' + 1) · g' · sigmoid(α g') */
} tkd_moe_act;

typedef struct tkd_moe_params {
    int D;              /* hidden size */
    int inter;          /* I: one expert's intermediate size (not "I": complex.h defines it) */
    int E;              /* experts */
    int k;              /* experts per token, 1..E */
    tkd_moe_router router;
    int norm_topk_prob; /* SOFTMAX_TOPK only: divide the k weights by their sum */
    tkd_moe_act act;
    float limit;        /* SWIGLU_CLAMP only, > 0 */
    float alpha;        /* SWIGLU_CLAMP only */
    int mxfp4;          /* 1: the experts' W_gate, W_up, W_down come as MXFP4 stacks (the weights' q_*),
                         * decoded an expert at a time; D and I multiples of 32. 0: act stacks */
} tkd_moe_params;

/* The params of Qwen3-MoE (SOFTMAX_TOPK, SWIGLU) and of gpt-oss (TOPK_SOFTMAX, SWIGLU_CLAMP with
 * α 1.702 and the given limit). */
tkd_moe_params tkd_moe_params_qwen3(int D, int inter, int E, int k, int norm_topk_prob);
tkd_moe_params tkd_moe_params_gpt_oss(int D, int inter, int E, int k, float swiglu_limit);

/* The MXFP4 stacks of a layer's experts, as the op takes them (kernels/cpu/cpu_moe.h's layout; blocks
 * and scales as common/mxfp4_codec.h): kind j = 0 W_gate, 1 W_up (E, I, D), 2 W_down (E, D, I), each
 * blocks (E, rows, cols/32, 16) and scales (E, rows, cols/32), backend memory. */
typedef struct tkd_moe_mxfp4 {
    const uint8_t *blocks[3];
    const uint8_t *scales[3];
} tkd_moe_mxfp4;

/* TKD_ERR_INVALID_ARG naming the field when p is not a layer this op computes. */
tkd_status tkd_moe_params_check(const tkd_moe_params *p);

/* The M-tiles of a grouped GEMM over rows sorted by expert (the CUDA op's own GEMMs: moe_gemm_cuda.h,
 * gemm_sm90/moe_gemm_sm90.h), TKD_MOE_TILE_INTS ints each: {expert, first row, rows, first, count},
 * rows 1..the tile rows; the tile belongs to a group of `count` consecutive tiles of its expert (at
 * most TKD_MOE_GROUP_TILES) starting at list index `first`, which moe_gemm_sm90 sweeps together along
 * N (the mma.sync kernel reads only the first three ints). */
#define TKD_MOE_TILE_INTS 5
#define TKD_MOE_GROUP_TILES 16
#define TKD_MOE_TILE_M_MAX 128 /* the largest tile rows a GEMM takes */

/* Fills tiles (TKD_MOE_TILE_INTS ints each) with the M-tiles of E experts whose rows lie back to
 * back from row 0 in expert order, counts[e] rows each: expert e's rows cut into runs of tile_m
 * (1..TKD_MOE_TILE_M_MAX), the last one shorter, and an expert's tiles into groups of
 * TKD_MOE_GROUP_TILES (the last one smaller). Returns the number of tiles, at most
 * ceil(Σ counts / tile_m) + E (size tiles for that). */
int tkd_moe_gemm_tiles(const int32_t *counts, int E, int tile_m, int32_t *tiles);

/* Output tile t (0 ≤ t < tiles · ntiles) of a grouped GEMM with ntiles N-tiles, in the order
 * moe_gemm_sm90 runs them: group by group, N-tile by N-tile with the group's M-tiles innermost. A
 * group of c M-tiles at list index g0 owns tiles g0·ntiles .. (g0 + c)·ntiles − 1, so t / ntiles is
 * an M-tile of t's own group. *li the M-tile's list index, *nj the N-tile. (The device's code; the
 * CPU tests hold it to be a bijection.) */
static inline TKD_HD void tkd_moe_tile_of(const int32_t *tiles, int ntiles, long long t, int *li, int *nj)
{
    const int32_t *g = tiles + TKD_MOE_TILE_INTS * (t / ntiles);
    const int g0 = g[3], c = g[4];
    const long long local = t - (long long)g0 * ntiles;
    *li = g0 + (int)(local % c);
    *nj = (int)(local / c);
}

#ifdef __cplusplus
}
#endif

#endif /* TKD_MOE_H */
