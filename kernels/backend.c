/* backend.c — see backend.h. */
#include "kernels/backend.h"

#include <string.h>

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

int tkd_backend_cuda_built(void)
{
#ifdef TKD_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

int tkd_backend_cuda_devices(void)
{
#ifdef TKD_HAVE_CUDA
    int n = 0;
    /* No driver or no GPU is a normal CPU-only machine, not an error. */
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
#else
    return 0;
#endif
}

tkd_status tkd_backend_resolve(tkd_device want, tkd_device *got)
{
    int ngpu = tkd_backend_cuda_devices();
    if (want == TKD_DEVICE_CPU) {
        *got = TKD_DEVICE_CPU;
    } else if (want == TKD_DEVICE_CUDA) {
        if (ngpu == 0)
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "device: cuda asked for, but %s",
                                 tkd_backend_cuda_built() ? "no GPU answers on this machine"
                                                          : "this build has no CUDA backend");
        *got = TKD_DEVICE_CUDA;
    } else {
        *got = ngpu > 0 ? TKD_DEVICE_CUDA : TKD_DEVICE_CPU;
    }
    return TKD_OK;
}

int tkd_device_parse(const char *name)
{
    if (strcmp(name, "auto") == 0) return TKD_DEVICE_AUTO;
    if (strcmp(name, "cpu") == 0) return TKD_DEVICE_CPU;
    if (strcmp(name, "cuda") == 0) return TKD_DEVICE_CUDA;
    return -1;
}

const char *tkd_device_name(tkd_device d)
{
    switch (d) {
    case TKD_DEVICE_AUTO: return "auto";
    case TKD_DEVICE_CPU: return "cpu";
    case TKD_DEVICE_CUDA: return "cuda";
    }
    return "?";
}
