/* run_dir.c — see run_dir.h. */
#include "student_train/run_dir.h"

#include <stdbool.h>
#include <string.h>

#include "common/fileio.h"
#include "common/owned_dir.h"

#define LOCK_NAME ".topkd-lock"

/* Every entry student-train ever makes in a run directory (checkpoint.tmp-* and checkpoint.old come
 * from tkd_rename_dir_atomic, checkpoint.building-* from a data-parallel checkpoint that a dead rank
 * left unfinished (checkpoint.h), the other temporaries from tkd_file_write_atomic). */
static const char *const run_names[] = {
    "config.yaml", "config.yaml.tmp-*", "metrics.jsonl", "metrics.jsonl.tmp-*", "checkpoint", "checkpoint.tmp-*",
    "checkpoint.old", "checkpoint.building-*", ".topkd-run", ".topkd-run.tmp-*", LOCK_NAME, NULL,
};

static const tkd_dir_kind run_kind = {
    .tool = "student-train",
    .what = "run directory",
    .marker = ".topkd-run",
    .names = run_names,
    /* every version wrote the effective config first, beginning with this line */
    .sign_name = "config.yaml",
    .sign_text = "# effective config of student-train",
};

tkd_status tkd_run_dir_check_name(const char *name)
{
    if (!*name || !strcmp(name, ".") || !strcmp(name, "..") || strchr(name, '/'))
        return tkd_error_set(TKD_ERR_CONFIG, "run.name: '%s' is not a plain directory name — use one name without "
                             "'/', other than '.' and '..' (the run goes to <run.dir>/<run.name>/)", name);
    return TKD_OK;
}

/* A run directory that is, holds or lies inside the cache being read would mix the two: --overwrite
 * would reach the cache, and teacher-dump would find foreign files in it. */
static tkd_status check_apart(const char *run, const char *cache, const char *key)
{
    bool inside = false, around = false;
    if (!*cache)
        return TKD_OK;
    TKD_TRY(tkd_path_within(run, cache, &inside));
    TKD_TRY(tkd_path_within(cache, run, &around));
    if (inside || around)
        return tkd_error_set(TKD_ERR_CONFIG, "run.dir/run.name: the run directory %s %s the cache %s (%s) — "
                             "put runs apart from caches", run, inside ? "lies inside" : "holds", cache, key);
    return TKD_OK;
}

/* What a dead run leaves: half-written temporaries, and (a crash between the two renames of a
 * checkpoint) the previous checkpoint renamed aside. */
static tkd_status clean_after_crash(const char *run)
{
    static const char *const temps[] = {"checkpoint.tmp-*", "config.yaml.tmp-*", "metrics.jsonl.tmp-*", NULL};
    char ckpt[4096];
    TKD_TRY(tkd_owned_dir_remove(run, temps));
    TKD_TRY(tkd_path_join(ckpt, sizeof ckpt, run, "checkpoint"));
    return tkd_rename_dir_recover(ckpt);
}

tkd_status tkd_run_dir_open(const tkd_train_config *cfg, const char *name, char *run, size_t cap,
                            tkd_dir_lock **lock)
{
    *lock = NULL;
    TKD_TRY(tkd_run_dir_check_name(name));
    TKD_TRY(tkd_path_join(run, cap, cfg->run_dir, name));
    TKD_TRY(check_apart(run, cfg->cache, "data.cache"));
    TKD_TRY(check_apart(run, cfg->val_cache, "data.val_cache"));
    TKD_TRY(tkd_owned_dir_claim(&run_kind, run));
    TKD_TRY(tkd_dir_lock_take(run, LOCK_NAME, "student-train", lock));
    tkd_status st = clean_after_crash(run);
    if (st != TKD_OK) {
        tkd_dir_lock_release(*lock);
        *lock = NULL;
    }
    return st;
}

tkd_status tkd_run_dir_clear(const char *run)
{
    static const char *const keep[] = {LOCK_NAME, NULL};
    return tkd_owned_dir_clear(&run_kind, run, keep);
}
