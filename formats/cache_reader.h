/* cache_reader.h — reads a whole teacher cache directory (manifest.yaml + shard-*.h5) by global
 * sequence number, for student-train.
 *
 * Opening checks the cache once: the manifest parses and is format version 1, its shards tile
 * [0, N) with no gap, every listed shard exists with the listed size, and each shard's identity
 * (vocab_size, k, seq_len, temperature, dtype, tail draws, digests) and range equal the
 * manifest's. Reads may ask for only the first k' <= k columns (HDF5 reads just those).
 *
 * Two ways to read: tkd_cache_reader_read (random access, caller's thread) and a stream, where a
 * background thread reads a given order of sequences ahead into a bounded ring of batches and
 * hands them out in order. A reader is not thread-safe, but streams own their shard handles, so
 * several streams and the reader's own reads may run at the same time.
 */
#ifndef TKD_CACHE_READER_H
#define TKD_CACHE_READER_H

#include <stdint.h>

#include "common/status.h"
#include "formats/cache_manifest.h"
#include "formats/cache_shard.h"

typedef struct tkd_cache_reader tkd_cache_reader;

typedef struct tkd_cache_reader_opts {
    int max_open_shards;  /* shard files kept open per reader / stream (LRU); 0 = every shard, up to
                           * TKD_CACHE_MAX_OPEN_SHARDS */
    int verify_sha256;    /* 1: hash every shard at open and compare with the manifest (reads all) */
    const char *manifest; /* manifest file name inside dir; NULL = "manifest.yaml" */
} tkd_cache_reader_opts;

/* The default bound on open shard files per reader / stream (one file descriptor each: student-train's
 * two caches, each a reader and a stream, stay under the usual limit of 1024). */
#define TKD_CACHE_MAX_OPEN_SHARDS 128

/* Opens the cache in `dir` (opts may be NULL). On success *out is the caller's, released with
 * tkd_cache_reader_close. Errors name the file: TKD_ERR_NOT_FOUND (no manifest, missing shard),
 * TKD_ERR_FORMAT (bad YAML with line:col, gap in the shard list, size differs), TKD_ERR_MISMATCH
 * (shard vs manifest), TKD_ERR_UNSUPPORTED (format version), TKD_ERR_CHECKSUM (verify_sha256). */
tkd_status tkd_cache_reader_open(tkd_cache_reader **out, const char *dir,
                                 const tkd_cache_reader_opts *opts);

/* Closes every shard and frees r. NULL-safe. Streams opened on r must be closed first. */
void tkd_cache_reader_close(tkd_cache_reader *r);

/* The manifest read at open (owned by r). */
const tkd_cache_manifest *tkd_cache_reader_manifest(const tkd_cache_reader *r);

/* Sequences in the cache (N). */
int64_t tkd_cache_reader_num_seq(const tkd_cache_reader *r);

/* Reads sequences [seq, seq + count) (global numbering, may cross shards) into slots
 * [slot, slot + count) of b: b->k columns (1..k), tail draws when b->tail_samples > 0. Sets
 * b->cache_seq; leaves b->num_seq alone. Errors name the shard file, dataset and sequences;
 * a corrupt chunk is TKD_ERR_CHECKSUM. */
tkd_status tkd_cache_reader_read(tkd_cache_reader *r, int64_t seq, int64_t count,
                                 tkd_cache_batch *b, int64_t slot);

/* ---- streaming -------------------------------------------------------------------------------- */

typedef struct tkd_cache_stream tkd_cache_stream;

typedef struct tkd_cache_stream_opts {
    int64_t batch_seq; /* sequences per batch (the last batch may be shorter); >= 1 */
    int32_t k;         /* columns to read, 1..k; 0 = all k */
    int with_tail;     /* 1: read /tail/indices too (the cache must have them) */
    int depth;         /* batches in the ring, >= 2 (one handed out, others filling); 0 = 3 */
} tkd_cache_stream_opts;

/* Starts a background thread that reads the sequences order[0..n) (global numbers, any order,
 * copied) in batches of batch_seq. r must outlive the stream. On success *out is the caller's,
 * released with tkd_cache_stream_close. */
tkd_status tkd_cache_stream_open(tkd_cache_stream **out, tkd_cache_reader *r, const int64_t *order,
                                 int64_t n, const tkd_cache_stream_opts *opts);

/* Hands out the next batch in order: *batch points into the ring (owned by the stream) and stays
 * valid until the next call to _next or _close, which give it back. *batch = NULL with TKD_OK at
 * the end. If the thread failed, returns its status and message (shard file, dataset, sequences);
 * the stream is then finished. */
tkd_status tkd_cache_stream_next(tkd_cache_stream *s, const tkd_cache_batch **batch);

/* Stops the thread (without waiting for the rest of the order), joins it and frees everything.
 * NULL-safe. */
void tkd_cache_stream_close(tkd_cache_stream *s);

/* Shard files the stream's thread has opened so far (a diagnostic: with every shard kept open, at
 * most one per shard; each reopen after an eviction counts again). Exact once the stream is at its
 * end; while it reads ahead, at least what the batches handed out needed. */
int64_t tkd_cache_stream_shard_opens(tkd_cache_stream *s);

#endif /* TKD_CACHE_READER_H */
