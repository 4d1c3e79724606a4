/* h5zstd.h — the HDF5 zstd filter (registered filter id 32015, cd_values[0] = compression level).
 *
 * The same filter code serves two users: our own tools register it in-process with
 * tkd_h5zstd_register() (no environment variable needed), and h5zstd_plugin.c wraps it as a
 * loadable HDF5 plugin (build/plugins/libh5zstd.so) so that stock h5dump and h5py read our shards
 * with HDF5_PLUGIN_PATH pointing at that folder. Each chunk is stored as one standard zstd frame
 * with its content size in the header, the layout every other 32015 implementation reads.
 */
#ifndef TKD_H5ZSTD_H
#define TKD_H5ZSTD_H

#include <hdf5.h>

#include "common/status.h"

#define TKD_H5ZSTD_FILTER_ID 32015
#define TKD_H5ZSTD_DEFAULT_LEVEL 3

/* The filter class (H5Z_class2_t) that H5Zregister and the plugin entry point hand to HDF5. */
extern const H5Z_class2_t tkd_h5zstd_class;

/* Registers the filter with the HDF5 library of this process. Idempotent and thread-safe (the
 * first call does the work; later calls return its result). Also switches off HDF5's automatic
 * error-stack printing for the default stack, because our library turns HDF5 failures into
 * tkd_status messages and must never print. */
tkd_status tkd_h5zstd_register(void);

#endif /* TKD_H5ZSTD_H */
