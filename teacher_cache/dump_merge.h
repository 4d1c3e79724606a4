/* dump_merge.h — joining the parts of a dump split over workers (teacher-dump merge).
 *
 * Worker i of n dumps a contiguous run of whole shards (dump_config.h), lists them in
 * manifest.worker-<i>.yaml and, once its range is complete, marks it with worker-<i>.done;
 * tkd_dump_merge joins the parts into manifest.yaml. The dump (dump.c) writes the markers through
 * this module, so merge and dump agree on their format; this module needs nothing from dump.c.
 */
#ifndef TKD_DUMP_MERGE_H
#define TKD_DUMP_MERGE_H

#include <stdint.h>

#include "common/status.h"
#include "teacher_cache/dump_config.h"

/* Worker i of n > 1 has finished its range [first, end): writes <output.dir>/worker-<i>.done
 * atomically (no-op for a single worker). merge requires one per worker. */
tkd_status tkd_dump_mark_done(const tkd_dump_config *cfg, int64_t first, int64_t end);

/* Joins dir/manifest.worker-*.yaml into dir/manifest.yaml, which records the worker count (key
 * `workers`). Checks: every worker file in dir (manifest.worker-<i>.yaml, worker-<i>.done) records
 * the same worker count n and an index below it; every worker 0..n-1 is there and has finished its
 * range (worker-<i>.done), its manifest lists that range and every listed shard has its listed
 * size and sha256 (a mismatch names the shard's path); identities equal; the shards tile [0, N)
 * without gap or overlap. A worker that is missing or incomplete is named (index and files) with
 * the command that completes it. *num_seq / *num_shards (may be NULL) get the merged totals. */
tkd_status tkd_dump_merge(const char *dir, int64_t *num_seq, int64_t *num_shards);

/* Before a worker writes into cfg->output_dir (not with --overwrite): the split the directory
 * records is this run's. Every worker manifest and marker must record cfg->worker_count workers,
 * and those of the other workers the ranges this config gives them out of `windows` sequences; a
 * manifest.yaml must be one merged from this many workers. A single worker (count 1) may continue
 * a directory with a manifest.yaml (merged or its own), but not one holding only other workers'
 * parts. TKD_ERR_MISMATCH naming the file that records the other split, both counts and what to do.
 * A manifest.yaml without `workers` (an older merge) counts as merged from the worker manifests
 * beside it when there are any, else as one worker's. */
tkd_status tkd_dump_check_split(const tkd_dump_config *cfg, int64_t windows);

/* --overwrite of worker i of n: removes the worker manifests and markers in cfg->output_dir that
 * record another worker count (parsed as ours first: a file that is not is an error), so that once
 * every worker of the new split has run with --overwrite, nothing of the old split is left. */
tkd_status tkd_dump_drop_other_split(const tkd_dump_config *cfg);

#endif /* TKD_DUMP_MERGE_H */
