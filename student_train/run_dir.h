/* run_dir.h — student-train's run directory <run.dir>/<run.name>/: what it owns there, the lock of
 * its one writer, and what a dead run left behind.
 *
 * Ownership (common/owned_dir.h): the directory carries the marker ".topkd-run"; student-train makes
 * only config.yaml, metrics.jsonl, checkpoint/, checkpoint-best/ (train.keep_best) and their temporaries there, and removes one only
 * when it proves that it wrote it (config.yaml by its first line, metrics by its records, a
 * checkpoint directory by its .topkd-built marker, checkpoint.h). --overwrite refuses a directory
 * that holds anything else; every run refuses one holding an entry of those names that fails its
 * proof (docs/what-topkd-deletes.md). Lock (common/dir_lock.h): the run holds
 * ".topkd-lock" from start to end, so a second student-train on the same run is refused at once.
 */
#ifndef TKD_RUN_DIR_H
#define TKD_RUN_DIR_H

#include <stddef.h>

#include "common/dir_lock.h"
#include "common/status.h"
#include "student_train/train_config.h"

/* After a run failed before writing anything (a missing cache, a model that does not load): when
 * this run made the directory (made from tkd_run_dir_open) and it still holds only the marker and
 * the lock (held by the caller, released afterwards), removes them and the folders the run made,
 * so a refused run leaves nothing behind. Anything else there keeps the directory. The failure's
 * message is kept. */
void tkd_run_dir_abandon(const char *run, const char *made);

/* run.name must be one plain path component: not empty, ".", "..", nor holding '/'.
 * TKD_ERR_CONFIG naming the key otherwise. */
tkd_status tkd_run_dir_check_name(const char *name);

/* Opens <cfg->run_dir>/<name> for this run (its path to run, cap bytes): checks the name; refuses a
 * run directory that is, holds or lies inside data.cache or data.val_cache; claims the directory
 * (made when missing; one student-train did not make is refused); takes its lock (TKD_ERR_BUSY
 * naming the other run's pid); proves every entry of student-train's names (TKD_ERR_INVALID_ARG
 * naming the first that fails); then removes the temporaries of a dead run and puts back a
 * checkpoint a crash left renamed aside. The caller releases *lock when the run ends. made (made_cap
 * bytes) gets the shallowest folder this call created ("" when the run directory was there), for
 * tkd_run_dir_abandon. */
tkd_status tkd_run_dir_open(const tkd_train_config *cfg, const char *name, char *run, size_t cap, char *made,
                            size_t made_cap,
                            tkd_dir_lock **lock);

/* --overwrite: empties the run directory of what student-train made (refusing, with nothing
 * removed, when it holds anything else). Only for the lock holder. */
tkd_status tkd_run_dir_clear(const char *run);

#endif /* TKD_RUN_DIR_H */
