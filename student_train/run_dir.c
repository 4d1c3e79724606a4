/* run_dir.c — see run_dir.h. */
#include "student_train/run_dir.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/fileio.h"
#include "common/owned_dir.h"
#include "student_train/checkpoint.h"

#define LOCK_NAME ".topkd-lock"
/* The first line of the effective config student-train writes (common/config.c), every version alike. */
#define CONFIG_HEAD "# effective config of student-train"
/* The first bytes of every metrics record (train_ckpt.c's tkd_train_log_train and tkd_train_log_eval). */
#define RECORD_HEAD "{\"type\": \""

/* ---- proofs: what shows that an entry of a run directory is one student-train wrote ------------- */

/* config.yaml and its temporary */
TKD_OWNED_HEAD_PROOFS(prove_config, CONFIG_HEAD)

/* metrics.jsonl (or its temporary): every line one record as student-train writes them, beginning
 * with {"type": " and ending with }; the last one may be cut short (a crash while appending). */
static bool prove_metrics(const char *path, void *ctx)
{
    (void)ctx;
    void *data = NULL;
    size_t len = 0, hl = strlen(RECORD_HEAD);
    if (!tkd_owned_file_begins(path, RECORD_HEAD, hl, true) || tkd_read_file(path, &data, &len) != TKD_OK)
        return false;
    const char *t = data, *end = t + len;
    bool ok = true;
    while (ok && t < end) {
        const char *nl = memchr(t, '\n', (size_t)(end - t));
        size_t n = nl ? (size_t)(nl - t) : (size_t)(end - t);
        ok = memcmp(t, RECORD_HEAD, n < hl ? n : hl) == 0 && (!nl || (n > hl && t[n - 1] == '}'));
        t += n + (nl ? 1 : 0);
    }
    free(data);
    return ok;
}

/* Every entry student-train ever makes in a run directory (the marker aside), with its proof:
 * checkpoint.tmp-* and checkpoint.old come from tkd_built_dir_rename (checkpoint-best.* alike, train.keep_best), checkpoint.building-* from a
 * data-parallel checkpoint that a dead rank left unfinished (checkpoint.h), the other temporaries
 * from tkd_file_write_atomic. Only checkpoint/ itself may be one of an older version without the
 * marker (it is what --resume reads); the others must carry it. */
static const tkd_owned_name run_names[] = {
    {"config.yaml", prove_config, "it does not begin with '" CONFIG_HEAD "'", NULL, false},
    {"config.yaml.tmp-*", prove_config_tmp, "it is neither empty nor begins like student-train's config", NULL, false},
    {"metrics.jsonl", prove_metrics, "its lines are not student-train's metrics records", NULL, false},
    {"metrics.jsonl.tmp-*", prove_metrics, "its lines are not student-train's metrics records", NULL, false},
    {"checkpoint", NULL, NULL, &tkd_checkpoint_kind, true},
    {"checkpoint.tmp-*", NULL, NULL, &tkd_checkpoint_kind, false},
    {"checkpoint.old", NULL, NULL, &tkd_checkpoint_kind, false},
    {"checkpoint.building-*", NULL, NULL, &tkd_checkpoint_kind, false},
    {"checkpoint-best", NULL, NULL, &tkd_checkpoint_kind, false}, /* train.keep_best: always marked */
    {"checkpoint-best.tmp-*", NULL, NULL, &tkd_checkpoint_kind, false},
    {"checkpoint-best.old", NULL, NULL, &tkd_checkpoint_kind, false},
    {"checkpoint-best.building-*", NULL, NULL, &tkd_checkpoint_kind, false},
    {LOCK_NAME, tkd_dir_lock_file_proof, "it holds something other than a pid", NULL, false},
    {NULL, NULL, NULL, NULL, false},
};

static const char *const run_keep[] = {LOCK_NAME, NULL};

static const tkd_dir_kind run_kind = {
    .tool = "student-train",
    .what = "run directory",
    .marker = ".topkd-run",
    .names = run_names,
    .keep = run_keep,
    /* every version wrote the effective config first, beginning with this line */
    .sign_name = "config.yaml",
    .sign_text = CONFIG_HEAD,
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
 * checkpoint) the previous checkpoint renamed aside. Every entry of student-train's names is
 * proven first: one it did not write stops the run, with nothing removed. */
static tkd_status clean_after_crash(const char *run)
{
    static const char *const temps[] = {"checkpoint.tmp-*", "checkpoint-best.tmp-*", "config.yaml.tmp-*",
                                        "metrics.jsonl.tmp-*", NULL};
    static const char *const built[] = {"checkpoint", "checkpoint-best", NULL};
    char ckpt[4096];
    TKD_TRY(tkd_owned_dir_tidy(&run_kind, run, temps));
    for (const char *const *b = built; *b; b++) {
        TKD_TRY(tkd_path_join(ckpt, sizeof ckpt, run, *b));
        TKD_TRY(tkd_built_dir_recover(&tkd_checkpoint_kind, ckpt));
    }
    return TKD_OK;
}

tkd_status tkd_run_dir_open(const tkd_train_config *cfg, const char *name, char *run, size_t cap, char *made,
                            size_t made_cap, tkd_dir_lock **lock)
{
    *lock = NULL;
    made[0] = '\0';
    TKD_TRY(tkd_run_dir_check_name(name));
    TKD_TRY(tkd_path_join(run, cap, cfg->run_dir, name));
    TKD_TRY(check_apart(run, cfg->cache, "data.cache"));
    TKD_TRY(check_apart(run, cfg->val_cache, "data.val_cache"));
    TKD_TRY(tkd_mkdir_p_made(run, made, made_cap)); /* what the claim below would make, recorded */
    TKD_TRY(tkd_owned_dir_claim(&run_kind, run));
    TKD_TRY(tkd_dir_lock_take(run, LOCK_NAME, "student-train", lock));
    tkd_status st = clean_after_crash(run);
    if (st != TKD_OK) {
        tkd_dir_lock_release(*lock);
        *lock = NULL;
    }
    return st;
}

void tkd_run_dir_abandon(const char *run, const char *made)
{
    const char *const opened[] = {run_kind.marker, LOCK_NAME, NULL};
    if (!made[0] || !tkd_dir_holds_only(run, opened))
        return;
    char path[4096];
    for (const char *const *n = opened; *n; n++) /* the lock file goes while still held */
        if (tkd_path_join(path, sizeof path, run, *n) == TKD_OK)
            unlink(path);
    tkd_rmdir_made(run, made);
}

tkd_status tkd_run_dir_clear(const char *run)
{
    return tkd_owned_dir_clear(&run_kind, run, NULL, NULL);
}
