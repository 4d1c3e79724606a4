/* kl_loss_cuda_tuning.cu — see kl_loss_cuda_tuning.h. In tkd_kernels_tuning, not the product. */
#include "kernels/loss/kl_loss_cuda_tuning.h"

#include "kernels/loss/kl_loss_cuda_rows.cuh"

using tkd_klc::row_shape_ok;

extern "C" tkd_status tkd_kl_cuda_ws_set_sm90(tkd_kl_cuda_ws *ws, int on)
{
    if (on && !ws->lm)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "kl_loss_cuda: this workspace has no sm90 logits "
                             "GEMM (not compute capability 9.0, D %% 8 != 0, or TKD_KL_SM90=0 when "
                             "it was made)");
    ws->use_sm90 = on != 0;
    return TKD_OK;
}

extern "C" tkd_status tkd_kl_cuda_ws_set_fused(tkd_kl_cuda_ws *ws, int on)
{
    if (on && !ws->lm)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "kl_loss_cuda: this workspace has no sm90 GEMM, "
                             "so no fused path");
    ws->fused = on != 0;
    return TKD_OK;
}

extern "C" tkd_status tkd_kl_cuda_ws_set_rows(tkd_kl_cuda_ws *ws, int threads, int vec)
{
    if (threads == 0 && vec == 0) {
        threads = TKD_KL_CUDA_ROW_THREADS;
        vec = TKD_KL_CUDA_ROW_VEC;
    }
    if (!row_shape_ok(threads, vec))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "kl_loss_cuda: row kernels: %d threads x %d float4: use vec 4 with "
                             "128/256/512 threads, vec 8 with 128/256, or 0, 0 for the default",
                             threads, vec);
    ws->row_threads = threads;
    ws->row_vec = vec;
    return TKD_OK;
}
