/* device.c — see device.h. */
#include "common/device.h"

#include <string.h>

const char *const tkd_device_names[] = {"auto", "cpu", "cuda", NULL};

int tkd_device_parse(const char *name)
{
    for (int i = 0; tkd_device_names[i]; i++)
        if (strcmp(name, tkd_device_names[i]) == 0)
            return i;
    return -1;
}

const char *tkd_device_name(tkd_device d)
{
    return d >= TKD_DEVICE_AUTO && d <= TKD_DEVICE_CUDA ? tkd_device_names[d] : "?";
}
