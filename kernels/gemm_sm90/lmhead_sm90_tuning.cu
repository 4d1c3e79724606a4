/* lmhead_sm90_tuning.cu — the Hopper GEMMs' tuning hooks (lmhead_sm90_tuning.h): the benchmark's
 * main loop without an epilogue, the grid cap and the schedule setters. Built into
 * tkd_kernels_tuning, which only bench/ and tests/ link (kernels/CMakeLists.txt); the product never
 * calls these. Built for sm_90a only.
 */
#include "kernels/gemm_sm90/lmhead_sm90_tuning.h"

#include "kernels/gemm_sm90/lmhead_sm90_logits.cuh"

namespace {

/* The logits GEMM with no epilogue: the accumulators go to a store guarded by p.sink, which is NULL
 * at run time; the compiler must keep every wgmma result, so the main loop is timed as it runs. */
struct MainLoop : LogitsLoads {
    __device__ static __forceinline__ void epilogue(float (&acc)[kAcc], const Params &p, const Fx &, Frag,
                                                    const Tile &)
    {
        if (p.sink) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < kAcc; i++)
                s += acc[i];
            p.sink[threadIdx.x] = s;
        }
    }
};

tkd_lmhead_sm90_sched sched_of(int sched)
{
    return sched == TKD_LMHEAD_SM90_SCHED_COOP ? TKD_LMHEAD_SM90_SCHED_COOP : TKD_LMHEAD_SM90_SCHED_PINGPONG;
}

} // namespace

extern "C" tkd_status tkd_lmhead_sm90_mainloop(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                               const uint16_t *w, int64_t n, int d, int v)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    return launch_problem<MainLoop>(ws, h, w, d, params_of(ws, n, d, v));
}

extern "C" void tkd_lmhead_sm90_ws_set_max_ctas(tkd_lmhead_sm90_ws *ws, int max_ctas)
{
    ws->max_ctas = max_ctas > 0 ? max_ctas : 0;
}

extern "C" void tkd_lmhead_sm90_ws_set_schedule(tkd_lmhead_sm90_ws *ws, tkd_lmhead_sm90_sched sched)
{
    ws->sched = sched_of(sched);
}

extern "C" void tkd_lmhead_grad_sm90_set_schedule(tkd_lmhead_sm90_ws *ws, int sched)
{
    ws->grad_sched = sched == TKD_LMHEAD_SM90_SCHED_PINGPONG || sched == TKD_LMHEAD_SM90_SCHED_COOP
                         ? 1 + sched
                         : 0;
}
