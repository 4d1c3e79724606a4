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

/* Joins dir/manifest.worker-*.yaml into dir/manifest.yaml. Checks: every worker 0..n-1 is there
 * and has finished its range (worker-<i>.done), its manifest lists that range and its shards are
 * in place, identities equal, the shards tile [0, N) without gap or overlap. A worker that is
 * missing or incomplete is named (index and files) with the command that completes it.
 * *num_seq / *num_shards (may be NULL) get the merged totals. */
tkd_status tkd_dump_merge(const char *dir, int64_t *num_seq, int64_t *num_shards);

#endif /* TKD_DUMP_MERGE_H */
