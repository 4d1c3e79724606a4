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
#include <stddef.h>
#include <zstd.h>

#include "common/status.h"

#define TKD_H5ZSTD_FILTER_ID 32015
#define TKD_H5ZSTD_DEFAULT_LEVEL 3

/* The filter class (H5Z_class2_t) that H5Zregister and the plugin entry point hand to HDF5. */
extern const H5Z_class2_t tkd_h5zstd_class;

/* Compresses n bytes of src into dst (cap bytes, at least ZSTD_compressBound(n)) exactly as the
 * filter's forward pass does with cd_values[0] = level (an out-of-range level falls back to the
 * default, as there): one frame with its content size, from a context that may be reused (one per
 * thread). The shard writer uses it to filter chunks itself before H5Dwrite_chunk. Returns the frame
 * size, 0 on a zstd error. */
size_t tkd_h5zstd_compress_into(ZSTD_CCtx *cctx, void *dst, size_t cap, const void *src, size_t n,
                                int level);

/* Registers the filter with the HDF5 library of this process. Idempotent and thread-safe (the
 * first call does the work; later calls return its result). Also switches off HDF5's automatic
 * error-stack printing for the default stack, because our library turns HDF5 failures into
 * tkd_status messages and must never print. */
tkd_status tkd_h5zstd_register(void);

#endif /* TKD_H5ZSTD_H */
