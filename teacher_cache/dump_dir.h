/* dump_dir.h — what teacher-dump owns in a cache directory, and the lock of its one writer.
 *
 * Ownership (common/owned_dir.h): a cache directory carries the marker ".topkd-cache"; teacher-dump
 * makes only the names in tkd_dump_dir_kind there, and removes (or writes over) an entry of those
 * names only when it proves that it wrote that very file: a manifest by its first line, a shard by a
 * manifest listing it or its HDF5 "format" attribute, a temporary by its beginning, a lock file by
 * its pid. --overwrite refuses a directory that holds anything else; every run refuses one holding
 * an entry of those names that fails its proof (docs/what-topkd-deletes.md). Locking (common/dir_lock.h): a single-worker dump and merge
 * hold ".topkd-lock" exclusively; worker i of a split dump holds it shared plus
 * ".topkd-lock.worker-<i>" exclusively, so the workers run side by side in one directory while a
 * second process on the same part, or a single-worker dump or merge, is refused at once.
 */
#ifndef TKD_DUMP_DIR_H
#define TKD_DUMP_DIR_H

#include "common/dir_lock.h"
#include "common/owned_dir.h"
#include "common/status.h"
#include "teacher_cache/dump_config.h"

extern const tkd_dir_kind tkd_dump_dir_kind;

/* Takes cfg->output_dir for this run: claims it (made when missing; a directory teacher-dump did
 * not make is refused), takes the lock for this worker (TKD_ERR_BUSY naming the other writer's
 * pid), proves every entry of teacher-dump's names (TKD_ERR_INVALID_ARG naming the first that
 * fails), then removes the temporary files a dead writer of the same part left. *lock is released
 * by the caller (tkd_dir_lock_release) when the run ends. */
tkd_status tkd_dump_dir_open(const tkd_dump_config *cfg, tkd_dir_lock **lock);

/* A run that made dir (made: the shallowest folder it created, tkd_mkdir_p_made; "" when dir was
 * there already) and failed before writing anything into it (the teacher, the tokenizer or the data
 * refused, or every worker of --nproc-per-node failed): removes what tkd_dump_dir_open and the
 * workers put there (the marker and the lock files) and the folders this run made, then releases
 * lock, so a refused first run leaves nothing behind. lock is the exclusive lock of a single-worker
 * run, or NULL: taken here (the launcher, once its workers are gone; held by another writer, nothing
 * is touched). A directory that holds anything else is left as it is, and a folder the user had is
 * never removed. */
void tkd_dump_dir_abandon(const char *dir, const char *made, tkd_dir_lock *lock);

/* The exclusive lock for merge, then every entry of teacher-dump's names proven (merge writes
 * manifest.yaml over the one there). A directory without manifest.worker-0.yaml holds nothing to
 * merge (merge says so): it is left untouched, with *lock = NULL and TKD_OK. */
tkd_status tkd_dump_dir_lock_merge(const char *dir, tkd_dir_lock **lock);

#endif /* TKD_DUMP_DIR_H */
