/* device.h — the one choice of where the model runs: the enum, its names and its parser.
 *
 * Both tools' configs read `device: auto | cpu | cuda` through tkd_device_names; kernels/backend.h
 * turns the choice into a backend (auto = CUDA when this build has it and a GPU answers). */
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

/* Parses "auto" | "cpu" | "cuda"; -1 when unknown. */
int tkd_device_parse(const char *name);

/* "auto", "cpu", "cuda" ("?" for anything else). */
const char *tkd_device_name(tkd_device d);

#ifdef __cplusplus
}
#endif

#endif /* TKD_DEVICE_H */
