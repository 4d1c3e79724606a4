/* dump_dir.c — see dump_dir.h. */
#include "teacher_cache/dump_dir.h"

#include <stdio.h>
#include <unistd.h>

#include "common/fileio.h"
#include "formats/cache_manifest.h"

#define LOCK_NAME ".topkd-lock"

/* Every entry teacher-dump ever makes in a cache directory. */
static const char *const cache_names[] = {
    TKD_CACHE_MANIFEST_NAME,     "manifest.worker-[0-9]*.yaml", "manifest*.yaml.tmp-*",
    "shard-[0-9]*.h5",           "shard-[0-9]*.h5.tmp",         "worker-[0-9]*.done",
    "worker-[0-9]*.done.tmp-*",  ".topkd-cache",                ".topkd-cache.tmp-*",
    LOCK_NAME,                   LOCK_NAME ".worker-[0-9]*",    NULL,
};

const tkd_dir_kind tkd_dump_dir_kind = {
    .tool = "teacher-dump",
    .what = "teacher cache",
    .marker = ".topkd-cache",
    .names = cache_names,
    /* every version wrote a manifest at once, with this first line */
    .sign_name = "manifest*.yaml",
    .sign_text = "# topkd teacher cache manifest",
};

tkd_status tkd_dump_dir_lock_merge(const char *dir, tkd_dir_lock **lock)
{
    char path[4096];
    *lock = NULL;
    TKD_TRY(tkd_path_join(path, sizeof path, dir, "manifest.worker-0.yaml"));
    if (!tkd_file_exists(path))
        return TKD_OK;
    return tkd_dir_lock_take(dir, LOCK_NAME, "teacher-dump", lock);
}

/* Temporary files of a dead writer: all of them under the exclusive lock; a worker's own only. */
static tkd_status remove_temps(const tkd_dump_config *cfg)
{
    if (cfg->worker_count == 1) {
        static const char *const all[] = {"manifest*.yaml.tmp-*", "shard-[0-9]*.h5.tmp", "worker-[0-9]*.done.tmp-*",
                                          NULL};
        return tkd_owned_dir_remove(cfg->output_dir, all);
    }
    char manifest[96], done[96];
    snprintf(manifest, sizeof manifest, "manifest.worker-%d.yaml.tmp-*", cfg->worker_index);
    snprintf(done, sizeof done, "worker-%d.done.tmp-*", cfg->worker_index);
    const char *const own[] = {manifest, done, NULL};
    return tkd_owned_dir_remove(cfg->output_dir, own);
}

tkd_status tkd_dump_dir_open(const tkd_dump_config *cfg, tkd_dir_lock **lock)
{
    *lock = NULL;
    TKD_TRY(tkd_owned_dir_claim(&tkd_dump_dir_kind, cfg->output_dir));
    if (cfg->worker_count == 1) {
        TKD_TRY(tkd_dir_lock_take(cfg->output_dir, LOCK_NAME, "teacher-dump", lock));
    } else {
        char part[32];
        snprintf(part, sizeof part, "worker-%d", cfg->worker_index);
        TKD_TRY(tkd_dir_lock_take_part(cfg->output_dir, LOCK_NAME, part, "teacher-dump", lock));
    }
    tkd_status st = remove_temps(cfg);
    if (st != TKD_OK) {
        tkd_dir_lock_release(*lock);
        *lock = NULL;
    }
    return st;
}

void tkd_dump_dir_abandon(const tkd_dump_config *cfg, tkd_dir_lock *lock)
{
    char marker[4096], lockf[4096];
    if (cfg->worker_count == 1 && lock &&
        tkd_path_join(marker, sizeof marker, cfg->output_dir, tkd_dump_dir_kind.marker) == TKD_OK &&
        tkd_path_join(lockf, sizeof lockf, cfg->output_dir, LOCK_NAME) == TKD_OK) {
        /* the lock file goes while still held: a writer that opened it meanwhile is refused anyway,
         * and one that comes later makes a new directory */
        unlink(marker);
        unlink(lockf);
        rmdir(cfg->output_dir); /* fails, keeping the directory, when anything else is in it */
    }
    tkd_dir_lock_release(lock);
}
