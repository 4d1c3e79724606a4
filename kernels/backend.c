/* backend.c — see backend.h: which backend runs, decided in one place. */
#include "kernels/backend.h"

#include "kernels/cpu/tail_sample.h"
#include "kernels/cpu/topk.h"

#include <stdlib.h>

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

/* CUDA asked for where none answers: what to do instead. */
static tkd_status no_cuda(void)
{
    return tkd_error_set(TKD_ERR_UNSUPPORTED, "device: cuda asked for, but %s — use device: cpu (or auto)",
                         tkd_backend_cuda_built() ? "no GPU answers on this machine"
                                                  : "this build has no CUDA backend (nvcc was not found when it was built)");
}

tkd_status tkd_backend_resolve(tkd_device want, tkd_device *got)
{
    int ngpu = tkd_backend_cuda_devices();
    if (want == TKD_DEVICE_CPU) {
        *got = TKD_DEVICE_CPU;
    } else if (want == TKD_DEVICE_CUDA) {
        if (ngpu == 0)
            return no_cuda();
        *got = TKD_DEVICE_CUDA;
    } else {
        *got = ngpu > 0 ? TKD_DEVICE_CUDA : TKD_DEVICE_CPU;
    }
    return TKD_OK;
}

/* dev resolved (CPU or CUDA); n: the GPUs that answer. */
static tkd_status open_on(tkd_device dev, int gpu, int n, tkd_backend **out)
{
    *out = NULL;
    if (dev == TKD_DEVICE_CPU)
        return tkd_backend_cpu_open(out);
    if (dev != TKD_DEVICE_CUDA)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "backend: device %d is not resolved (tkd_backend_resolve first)",
                             (int)dev);
    if (n == 0)
        return no_cuda();
#ifdef TKD_HAVE_CUDA
    if (gpu < 0 || gpu >= n)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "device: GPU %d asked for, but %d answer%s", gpu, n,
                             n == 1 ? "s" : "");
    return tkd_backend_cuda_open(gpu, NULL, out);
#else
    (void)gpu;
    return tkd_error_set(TKD_ERR_INTERNAL, "backend: CUDA resolved in a build without it");
#endif
}

tkd_status tkd_backend_open(tkd_device dev, int gpu, tkd_backend **out)
{
    return open_on(dev, gpu, dev == TKD_DEVICE_CUDA ? tkd_backend_cuda_devices() : 0, out);
}

tkd_status tkd_backend_open_local(tkd_device dev, const tkd_dist_info *d, tkd_backend **out)
{
    int n = dev == TKD_DEVICE_CUDA ? tkd_backend_cuda_devices() : 0;
    return open_on(dev, tkd_dist_local_gpu(d, n), n, out);
}

int tkd_backend_device_data_parallel(tkd_device dev)
{
    return dev != TKD_DEVICE_CPU; /* as backend_cpu.c's data_parallel = 0 */
}

#ifndef TKD_HAVE_CUDA
void *tkd_backend_cuda_stream(tkd_backend *be)
{
    (void)be;
    return NULL;
}
#endif

void tkd_backend_close(tkd_backend *be)
{
    if (be)
        be->op->close(be);
}

tkd_status tkd_backend_lmhead_topk_check(int64_t chunk_rows, int64_t v, int k, float tau, int s)
{
    TKD_TRY(tkd_topk_check_args(chunk_rows, v, k, tau));
    return s > 0 ? tkd_tail_sample_check_args(chunk_rows, v, k, tau, s) : TKD_OK;
}
