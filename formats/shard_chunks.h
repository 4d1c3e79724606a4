/* shard_chunks.h — the shard writer's parallel chunk filter.
 *
 * Rows (whole sequences) appended to the datasets of a shard are cut into HDF5 chunks of chunk_rows
 * rows; every chunk an append completes is run through the shard's filter pipeline
 * (tkd_h5_filter_chunk: shuffle → zstd → fletcher32) on up to `threads` OpenMP threads at once, and
 * the filtered chunks are listed for the caller, which writes them in order with H5Dwrite_chunk.
 * Rows that do not fill a chunk wait in a per-dataset buffer for the next append; the last partial
 * chunk is padded with zero bytes at flush, as HDF5 fills the unwritten part of an edge chunk.
 * Nothing here calls HDF5: only the caller's thread does, because the library is not thread-safe.
 * Memory: one chunk per dataset for held rows, per thread a zstd context and a chunk of shuffle
 * space, and room for the filtered chunks of the largest append (about its raw size), all grown
 * once and reused.
 */
#ifndef TKD_SHARD_CHUNKS_H
#define TKD_SHARD_CHUNKS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define TKD_SHARD_CHUNKS_MAX_STREAMS 8

/* One dataset as the filter sees it: bytes per row in file layout (0 = unused, skipped) and the
 * element size shuffle transposes by. */
typedef struct tkd_shard_chunk_stream {
    size_t row_bytes;
    size_t elem;
} tkd_shard_chunk_stream;

/* A filtered chunk, ready for H5Dwrite_chunk at row offset first_row of dataset `stream`. */
typedef struct tkd_shard_chunk {
    int stream;
    int64_t first_row;
    const void *data; /* valid until the next _add, _flush or _free */
    size_t size;
} tkd_shard_chunk;

typedef struct tkd_shard_chunks tkd_shard_chunks;

/* Sets up nstreams (<= TKD_SHARD_CHUNKS_MAX_STREAMS) streams of chunk_rows rows per chunk, zstd at
 * `level`, `threads` >= 1 filtering threads (their contexts are made here, once). *out is the
 * caller's (tkd_shard_chunks_free). */
tkd_status tkd_shard_chunks_create(tkd_shard_chunks **out, const tkd_shard_chunk_stream *streams,
                                   int nstreams, int64_t chunk_rows, int level, int threads);

/* NULL-safe. */
void tkd_shard_chunks_free(tkd_shard_chunks *c);

/* Appends n rows to every used stream (src[s] holds n · row_bytes bytes, only read) and filters the
 * chunks this completes; tkd_shard_chunks_ready lists them afterwards. On error the object is only
 * good for _free. */
tkd_status tkd_shard_chunks_add(tkd_shard_chunks *c, int64_t n, const void *const *src);

/* Pads the partial chunk of each stream with zeros and filters it (nothing when none is pending). */
tkd_status tkd_shard_chunks_flush(tkd_shard_chunks *c);

/* The chunks the last _add or _flush filtered, streams in order and rows ascending within each;
 * returns their count and points *out at them. */
size_t tkd_shard_chunks_ready(const tkd_shard_chunks *c, const tkd_shard_chunk **out);

#endif /* TKD_SHARD_CHUNKS_H */
