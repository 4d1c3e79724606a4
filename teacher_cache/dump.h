/* dump.h — teacher-dump as a library: run the teacher over a token dataset once and write the
 * top-k cache (docs/teacher-dump.md; file layout in docs/cache-format.md), and merge the
 * manifests of split workers.
 *
 * Per batch of sequences: teacher forward (no activations kept) → final hidden states (B·T, D);
 * the LM head runs chunk by chunk over those rows, logits (C, V) = H_c Wᵀ, each chunk reduced at
 * once to top-k (sorted, raw logits) + full-vocabulary LSE at the cache temperature (+ S tail
 * draws), so (B·T, V) never exists. Each finished batch is checked to fit the cache (every top-k
 * logit within cache.logits_dtype's range, every LSE finite: whichever top-k path made it, no inf
 * or NaN reaches a shard), then goes to the writer thread (writer_thread.h).
 *
 * Resume and repair: a worker's manifest lists whole shards only; a re-run with the same identity
 * checks every listed shard against its listed size and sha256, keeps (does not touch) those that
 * pass, and computes every shard of its range that is not kept: the rest of an interrupted run,
 * and any shard found missing or damaged, so the cache ends as one uninterrupted run makes it. A
 * different identity (teacher and dataset digests and paths, k, dtype, temperature, seq_len,
 * stride, tail settings, shard size, last-window rule) against an existing cache is an error
 * unless overwrite.
 *
 * Workers: worker i of n dumps a contiguous run of whole shards (dump_config.h), lists them in
 * manifest.worker-<i>.yaml and, once its range is complete, writes worker-<i>.done;
 * tkd_dump_merge (dump_merge.h) joins the parts into manifest.yaml. A worker whose count or range
 * differs from what the directory's files record is refused before it writes
 * (tkd_dump_check_split); with overwrite it removes the files of the other split instead.
 *
 * Library code: nothing is printed; progress goes to a callback; Ctrl-C / SIGTERM are polled with
 * tkd_interrupted() (common/signals.h) between LM-head chunks.
 */
#ifndef TKD_DUMP_H
#define TKD_DUMP_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "teacher_cache/dump_config.h"

/* What the progress callback sees (sequences of this worker's range). */
typedef struct tkd_dump_progress {
    int64_t seq_done;      /* done, counting the shards kept from an earlier run */
    int64_t seq_total;     /* this worker's range */
    int64_t seq_start;     /* in the shards kept from an earlier run (resume, repair) */
    int64_t tokens_run;    /* positions computed by this run */
    double elapsed_s;      /* since compute started */
    uint64_t bytes_written;  /* shard bytes finished by this run */
    int64_t tokens_written;  /* positions in those shards */
} tkd_dump_progress;

typedef void (*tkd_dump_progress_fn)(const tkd_dump_progress *p, void *user);

typedef struct tkd_dump_opts {
    bool overwrite;                /* replace an existing cache of another identity */
    tkd_dump_progress_fn progress; /* called after every batch; may be NULL */
    void *progress_user;
    /* Test hooks (0 = off), honoured only in test builds (TKD_TEST_HOOKS, common/test_hooks.h);
     * the shipped teacher-dump ignores them. stop: act as if Ctrl-C came after this many batches.
     * kill: wait until that many batches are written, then SIGKILL the process (a crash in the
     * middle of a shard). */
    int64_t stop_after_batches;
    int64_t kill_after_batches;
    /* A teacher already on a backend (borrowed; benchmarks use it for random weights without a
     * checkpoint file): used instead of loading teacher.path, which then only labels the cache,
     * and the cache's teacher_sha256 is the digest of the model's parameter list and init seed
     * (teacher_seed), not of weight files. NULL: load teacher.path. */
    struct tkd_model *teacher;
    uint64_t teacher_seed;
} tkd_dump_opts;

typedef struct tkd_dump_summary {
    int64_t range_first, range_end; /* this worker's windows */
    int64_t resumed_at;             /* first window computed by this run (== range_end: nothing to do) */
    int64_t shards_damaged;         /* listed shards found missing or damaged, re-made by this run */
    char damaged_note[1024];        /* why the first of them was (its file, sizes and digests) */
    int64_t seqs_run;               /* sequences computed by this run */
    int64_t tokens_run;             /* positions computed (seqs_run · seq_len) */
    int64_t shards_run;             /* shards finished by this run */
    uint64_t bytes_run;             /* their bytes */
    int64_t tokens_written;         /* positions in those shards */
    double seconds;                 /* compute + write time of this run */
    double raw_bytes_per_token;     /* uncompressed size of one position's row */
    char manifest[4096];            /* path of this worker's manifest */
    char teacher_sha256[65];
    char dataset_sha256[65];
} tkd_dump_summary;

/* Runs (or resumes) the dump described by cfg (after tkd_dump_config_finalize). sum may be NULL.
 * Errors are one line naming the file and place and what to do. TKD_ERR_INTERRUPTED on a signal
 * (or the stop hook): the shard in progress is removed and the manifest lists the whole shards. */
tkd_status tkd_dump_run(const tkd_dump_config *cfg, const tkd_dump_opts *opts, tkd_dump_summary *sum);

/* sha256 identity of a teacher checkpoint directory: the sha256 of the text with one line
 * "<file name> <sha256 of the file>\n" for config.json and every *.safetensors file (sorted by
 * name), so a changed weight file or config changes it. */
tkd_status tkd_dump_teacher_sha256(const char *dir, char hex[65]);

#endif /* TKD_DUMP_H */
