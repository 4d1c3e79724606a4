/* device.c — see device.h. */
#include "common/device.h"

#include <stddef.h>

const char *const tkd_device_names[] = {"auto", "cpu", "cuda", NULL};
