/* moe.c — see moe.h: the layer's parameter presets and their check, for every path. */
#include "kernels/moe.h"

#include <math.h>

tkd_moe_params tkd_moe_params_qwen3(int D, int inter, int E, int k, int norm_topk_prob)
{
    tkd_moe_params p = {D, inter, E, k, TKD_MOE_ROUTER_SOFTMAX_TOPK, norm_topk_prob != 0,
                        TKD_MOE_ACT_SWIGLU, 0.0f, 0.0f, 0};
    return p;
}

tkd_moe_params tkd_moe_params_gpt_oss(int D, int inter, int E, int k, float swiglu_limit)
{
    tkd_moe_params p = {D, inter, E, k, TKD_MOE_ROUTER_TOPK_SOFTMAX, 0, TKD_MOE_ACT_SWIGLU_CLAMP,
                        swiglu_limit, 1.702f, 0};
    return p;
}

tkd_status tkd_moe_params_check(const tkd_moe_params *p)
{
    if (p->D < 1 || p->inter < 1 || p->E < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe: hidden %d, intermediate %d and experts %d must be >= 1",
                             p->D, p->inter, p->E);
    if (p->k < 1 || p->k > p->E)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe: experts per token %d must lie in 1..%d (the experts)",
                             p->k, p->E);
    if (p->router != TKD_MOE_ROUTER_SOFTMAX_TOPK && p->router != TKD_MOE_ROUTER_TOPK_SOFTMAX)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe: unknown router %d", (int)p->router);
    if (p->act != TKD_MOE_ACT_SWIGLU && p->act != TKD_MOE_ACT_SWIGLU_CLAMP)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe: unknown activation %d", (int)p->act);
    if (p->act == TKD_MOE_ACT_SWIGLU_CLAMP && !(p->limit > 0.0f && isfinite(p->limit)))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe: swiglu_limit %g must be finite and > 0",
                             (double)p->limit);
    if (p->mxfp4 && (p->D % 32 != 0 || p->inter % 32 != 0))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "moe: MXFP4 experts need hidden %d and intermediate %d to be "
                             "multiples of 32 (one scale a block of 32)", p->D, p->inter);
    return TKD_OK;
}

int tkd_moe_gemm_tiles(const int32_t *counts, int E, int tile_m, int32_t *tiles)
{
    int nt = 0;
    int32_t r0 = 0;
    for (int e = 0; e < E; r0 += counts[e], e++) {
        const int n_e = (counts[e] + tile_m - 1) / tile_m, first = nt;
        for (int32_t r = 0; r < counts[e]; r += tile_m, nt++) {
            int32_t *t = tiles + (int64_t)nt * TKD_MOE_TILE_INTS;
            const int g = (nt - first) / TKD_MOE_GROUP_TILES * TKD_MOE_GROUP_TILES; /* within e */
            t[0] = e, t[1] = r0 + r, t[2] = counts[e] - r < tile_m ? counts[e] - r : tile_m;
            t[3] = first + g;
            t[4] = n_e - g < TKD_MOE_GROUP_TILES ? n_e - g : TKD_MOE_GROUP_TILES;
        }
    }
    return nt;
}
