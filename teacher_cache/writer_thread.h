/* writer_thread.h — teacher-dump's background shard writer: double-buffered hand-off of computed
 * batches to one thread that compresses and writes them into shards and keeps the manifest.
 *
 * Why a thread: zstd compression and HDF5 writes cost about as much as a small teacher's forward;
 * with two batch buffers the compute thread fills one while the writer drains the other, so compute
 * waits only when the disk cannot keep up, and memory stays at two batches whatever the dataset size.
 *
 * The writer owns the shard files and the manifest of one worker. Batches arrive in cache order
 * (skipping shards the caller keeps) and never span a shard boundary (the caller cuts them so). A shard is opened when a batch starts at a
 * shard boundary, finished (renamed into place, digest taken) when it holds its planned sequences
 * (shard_sequences, or fewer for the worker's last one), and then the manifest is rewritten
 * atomically, so the manifest only ever lists whole shards. On abort, or on any error, the open
 * shard's .tmp file is removed.
 */
#ifndef TKD_WRITER_THREAD_H
#define TKD_WRITER_THREAD_H

#include <stdint.h>

#include "common/status.h"
#include "formats/cache_manifest.h"
#include "formats/cache_shard.h"

typedef struct tkd_dump_writer tkd_dump_writer;

typedef struct tkd_dump_writer_opts {
    const char *dir;                    /* the cache directory (exists) */
    const char *manifest_path;          /* this worker's manifest file */
    const tkd_cache_manifest *manifest; /* identity + shards already listed; copied at start */
    int64_t range_end;                  /* end of this worker's windows: the last shard may be short */
    int64_t shard_sequences;
    tkd_shard_writer_opts shard;        /* zstd level, tail seed, compression threads */
    int64_t batch_capacity;             /* sequences per batch buffer */
} tkd_dump_writer_opts;

/* Counters for the progress line (finished shards only). */
typedef struct tkd_dump_writer_stats {
    int64_t shards;   /* shards finished by this writer */
    int64_t seqs;     /* sequences in them */
    uint64_t bytes;   /* their file sizes */
} tkd_dump_writer_stats;

/* Allocates the two batch buffers and starts the thread. *out is the caller's: end it with
 * tkd_dump_writer_finish or tkd_dump_writer_abort. */
tkd_status tkd_dump_writer_start(tkd_dump_writer **out, const tkd_dump_writer_opts *o);

/* Waits for a free batch buffer and lends it to the caller (*b; its num_seq is 0) until submit.
 * Returns the writer's error instead once the writer has failed. */
tkd_status tkd_dump_writer_acquire(tkd_dump_writer *w, tkd_cache_batch **b);

/* Hands a buffer from acquire, holding b->num_seq sequences at cache positions
 * [first_seq, first_seq + num_seq), to the writer thread. A batch continues the open shard, or,
 * when none is open, starts a shard: any shard, so a caller may skip shards that are already done
 * (resume, repair); each new shard is listed in its place in the manifest. */
tkd_status tkd_dump_writer_submit(tkd_dump_writer *w, tkd_cache_batch *b, int64_t first_seq);

/* Waits until every submitted batch is written; returns the writer's status. */
tkd_status tkd_dump_writer_drain(tkd_dump_writer *w);

/* Drains, stops the thread and frees w. A shard left incomplete (the caller stopped early) is
 * removed, not listed. Returns the first error the writer met. */
tkd_status tkd_dump_writer_finish(tkd_dump_writer *w);

/* Stops without writing what is queued: the open shard's .tmp is removed, the manifest keeps only
 * whole shards. Frees w. NULL-safe. */
void tkd_dump_writer_abort(tkd_dump_writer *w);

/* A consistent snapshot of the counters (any thread). */
void tkd_dump_writer_get_stats(tkd_dump_writer *w, tkd_dump_writer_stats *s);

#endif /* TKD_WRITER_THREAD_H */
