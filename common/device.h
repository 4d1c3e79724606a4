/* device.h — the one choice of where the model runs: the enum and its names.
 *
 * Both tools' configs read `device: auto | cpu | cuda` through tkd_device_names (the config schema
 * parses and prints it); kernels/backend.h turns the choice into a backend (auto = CUDA when this
 * build has it and a GPU answers). */
#ifndef TKD_DEVICE_H
#define TKD_DEVICE_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tkd_device {
    TKD_DEVICE_AUTO = 0,
    TKD_DEVICE_CPU = 1,
    TKD_DEVICE_CUDA = 2,
} tkd_device;

/* NULL-terminated, indexed by tkd_device: the allowed values of every `device` config key. */
extern const char *const tkd_device_names[];

#ifdef __cplusplus
}
#endif

#endif /* TKD_DEVICE_H */
