/* h5zstd_plugin.c — entry points that make the zstd filter a loadable HDF5 plugin.
 * HDF5 dlopens every library in HDF5_PLUGIN_PATH and asks it for its type and class; this file is
 * built only into build/plugins/libh5zstd.so, never into the tkd_formats library. */
#include <H5PLextern.h>

#include "formats/h5zstd.h"

H5PL_type_t H5PLget_plugin_type(void) { return H5PL_TYPE_FILTER; }

const void *H5PLget_plugin_info(void) { return &tkd_h5zstd_class; }
