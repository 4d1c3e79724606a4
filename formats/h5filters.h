/* h5filters.h — the shard's HDF5 filter pipeline (shuffle → zstd → fletcher32) as plain functions,
 * so the shard writer can filter chunks on several threads itself and hand HDF5 finished chunks
 * (H5Dwrite_chunk with filter mask 0) instead of letting H5Dwrite filter them one at a time.
 *
 * Each step makes the bytes HDF5's own filter makes — shuffle and fletcher32 follow HDF5's built-in
 * filters 2 and 3 byte for byte, zstd is our filter 32015 (h5zstd.c) — so a chunk filtered here is
 * the chunk H5Dwrite would have stored, and every HDF5 reader (h5dump, h5py, ours) reads it back
 * through its normal pipeline. tests/test_h5filters.c compares them with chunks HDF5 wrote.
 */
#ifndef TKD_H5FILTERS_H
#define TKD_H5FILTERS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* HDF5's shuffle with element size `elem` (the filter's cd_values[0], the datatype size): byte j of
 * element i goes to dst[j·n + i] for the n = nbytes / elem whole elements, and the nbytes % elem
 * bytes left over are copied after them. With elem 1 or n <= 1 that is a plain copy, which is also
 * what HDF5 leaves. dst and src hold nbytes each and must not overlap. */
void tkd_h5_shuffle(void *dst, const void *src, size_t nbytes, size_t elem);

/* HDF5's Fletcher-32 checksum of len bytes: 16-bit words read big-endian (a trailing odd byte as
 * its high half), both sums starting at 0 and folded to 16 bits every 360 words and at the end,
 * result sum2 << 16 | sum1. The fletcher32 filter stores it after the data, least significant byte
 * first (tkd_h5_filter_chunk does). */
uint32_t tkd_h5_fletcher32(const void *data, size_t len);

/* One thread's working state for tkd_h5_filter_chunk: a zstd context and a shuffle buffer. */
typedef struct tkd_h5_filter_ctx tkd_h5_filter_ctx;

/* Creates a context for chunks of up to max_bytes. *out is the caller's (tkd_h5_filter_ctx_free). */
tkd_status tkd_h5_filter_ctx_create(tkd_h5_filter_ctx **out, size_t max_bytes);

/* NULL-safe. */
void tkd_h5_filter_ctx_free(tkd_h5_filter_ctx *c);

/* Bytes a filtered chunk of nbytes may need: the zstd bound plus the 4-byte checksum. */
size_t tkd_h5_filter_bound(size_t nbytes);

/* Runs shuffle (element size elem) → zstd (level) → fletcher32 over nbytes of src (at most the
 * context's max_bytes) into out, which holds cap >= tkd_h5_filter_bound(nbytes) bytes. Returns the
 * filtered size, or 0 when zstd fails or the sizes do not fit. Touches only c, src and out, so
 * threads with their own contexts may filter different chunks at once. */
size_t tkd_h5_filter_chunk(tkd_h5_filter_ctx *c, const void *src, size_t nbytes, size_t elem, int level,
                           void *out, size_t cap);

#endif /* TKD_H5FILTERS_H */
