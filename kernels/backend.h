/* backend.h — which compute backend runs: CPU always, CUDA when built in and a GPU answers.
 * The same binary serves both; `device: auto` picks CUDA when tkd_backend_cuda_devices() > 0. */
#ifndef TKD_BACKEND_H
#define TKD_BACKEND_H

#include "common/status.h"

typedef enum tkd_device {
    TKD_DEVICE_AUTO = 0,
    TKD_DEVICE_CPU = 1,
    TKD_DEVICE_CUDA = 2,
} tkd_device;

/* 1 when this binary was built with the CUDA backend. */
int tkd_backend_cuda_built(void);

/* Number of CUDA devices that answer (0 without the backend, a driver or a GPU). */
int tkd_backend_cuda_devices(void);

/* Resolves AUTO to CPU or CUDA; asking for CUDA where none answers is TKD_ERR_UNSUPPORTED. */
tkd_status tkd_backend_resolve(tkd_device want, tkd_device *got);

/* Parses "auto" | "cpu" | "cuda"; -1 when unknown. And the reverse. */
int tkd_device_parse(const char *name);
const char *tkd_device_name(tkd_device d);

#endif /* TKD_BACKEND_H */
