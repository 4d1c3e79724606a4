/* backend_cuda.cu — the CUDA backend (being written: issue 10). */
#include "kernels/backend.h"

extern "C" tkd_status tkd_backend_cuda_open(int gpu, tkd_backend **out)
{
    (void)gpu;
    *out = NULL;
    return tkd_error_set(TKD_ERR_UNSUPPORTED, "device: cuda: the CUDA backend is not complete yet");
}
