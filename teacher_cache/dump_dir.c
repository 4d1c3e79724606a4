/* dump_dir.c — see dump_dir.h. */
#include "teacher_cache/dump_dir.h"

#include <dirent.h>
#include <fnmatch.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fileio.h"
#include "formats/cache_manifest.h"
#include "formats/cache_shard.h"

#define LOCK_NAME ".topkd-lock"
/* The first line of every manifest teacher-dump writes (cache_manifest.c), every version alike. */
#define MANIFEST_HEAD "# topkd teacher cache manifest"
/* The signature at the start of an HDF5 file, which H5Fcreate writes at once. */
static const char hdf5_sig[] = "\x89HDF\r\n\x1a\n";

/* ---- proofs: what shows that an entry of a cache directory is one teacher-dump wrote ------------ */

/* A manifest, and its temporary: its beginning, or less (created, then the writer died). */
TKD_OWNED_HEAD_PROOFS(prove_manifest, MANIFEST_HEAD)

/* The shard names the directory's manifests list, sorted (the proof context of a cache). */
typedef struct listed {
    char **names; // (n)
    size_t n, cap;
} listed;

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void listed_free(void *ctx)
{
    listed *l = ctx;
    for (size_t i = 0; l && i < l->n; i++)
        free(l->names[i]);
    if (l)
        free(l->names);
    free(l);
}

static tkd_status listed_add(listed *l, const tkd_cache_manifest *m)
{
    for (int64_t j = 0; j < m->num_shards; j++) {
        if (l->n == l->cap) {
            size_t cap = l->cap ? 2 * l->cap : 64;
            char **p = realloc(l->names, cap * sizeof *p);
            if (!p)
                return tkd_error_set(TKD_ERR_NOMEM, "out of memory listing a cache's shards");
            l->names = p;
            l->cap = cap;
        }
        if (!(l->names[l->n] = strdup(m->shards[j].file)))
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory listing a cache's shards");
        l->n++;
    }
    return TKD_OK;
}

/* Reads every manifest in dir that teacher-dump wrote; one that does not parse lists nothing (its
 * shards are then proven by their content). */
static tkd_status listed_open(const char *dir, void **ctx)
{
    listed *l = calloc(1, sizeof *l);
    char pat[4096];
    tkd_status st = l ? tkd_path_join(pat, sizeof pat, dir, "manifest*.yaml")
                      : tkd_error_set(TKD_ERR_NOMEM, "out of memory listing a cache's shards");
    glob_t g;
    memset(&g, 0, sizeof g);
    if (st == TKD_OK && glob(pat, 0, NULL, &g) == 0) {
        for (size_t i = 0; st == TKD_OK && i < g.gl_pathc; i++) {
            struct stat sb;
            tkd_cache_manifest m;
            if (lstat(g.gl_pathv[i], &sb) != 0 || !S_ISREG(sb.st_mode) || !prove_manifest(g.gl_pathv[i], NULL) ||
                tkd_cache_manifest_read(&m, g.gl_pathv[i]) != TKD_OK)
                continue;
            st = listed_add(l, &m);
            tkd_cache_manifest_free(&m);
        }
    }
    globfree(&g);
    if (st != TKD_OK) {
        listed_free(l);
        return st;
    }
    if (l->n)
        qsort(l->names, l->n, sizeof *l->names, cmp_str);
    *ctx = l;
    return TKD_OK;
}

/* A shard: listed by a manifest there, or an HDF5 file of the cache's format (written and renamed,
 * and the writer died before its manifest listed it). */
static bool prove_shard(const char *path, void *ctx)
{
    const listed *l = ctx;
    const char *slash = strrchr(path, '/'), *name = slash ? slash + 1 : path;
    if (l && l->n && bsearch(&name, l->names, l->n, sizeof *l->names, cmp_str))
        return true;
    return tkd_shard_has_cache_format(path);
}

/* A shard being written (or left by a dead writer): empty, or HDF5 from its first bytes on. */
static bool prove_shard_tmp(const char *path, void *ctx)
{
    (void)ctx;
    return tkd_owned_file_begins(path, hdf5_sig, sizeof hdf5_sig - 1, true);
}

/* worker-<i>.done as tkd_dump_mark_done writes it: it begins with "worker: <i>\n", i its name's (merge
 * reads and checks the rest). */
static bool prove_done(const char *path, void *ctx)
{
    (void)ctx;
    char want[48];
    const char *slash = strrchr(path, '/');
    int named = -1;
    if (sscanf(slash ? slash + 1 : path, "worker-%d.done", &named) != 1)
        return false;
    int n = snprintf(want, sizeof want, "worker: %d\n", named);
    return tkd_owned_file_begins(path, want, (size_t)n, false);
}

static bool prove_done_tmp(const char *path, void *ctx)
{
    (void)ctx;
    return tkd_owned_file_begins(path, "worker: ", 8, true);
}

#define NOT_MANIFEST "it does not begin with '" MANIFEST_HEAD "'"

/* Every entry teacher-dump ever makes in a cache directory (the marker aside), with its proof. */
static const tkd_owned_name cache_names[] = {
    {TKD_CACHE_MANIFEST_NAME, prove_manifest, NOT_MANIFEST, NULL, false},
    {"manifest.worker-[0-9]*.yaml", prove_manifest, NOT_MANIFEST, NULL, false},
    {"manifest*.yaml.tmp-*", prove_manifest_tmp, "it is neither empty nor begins like a manifest", NULL, false},
    {"shard-[0-9]*.h5", prove_shard, "no manifest there lists it, and it is not an HDF5 file of format "
                                     "'" TKD_CACHE_FORMAT_NAME "'", NULL, false},
    {"shard-[0-9]*.h5.tmp", prove_shard_tmp, "it is neither empty nor an HDF5 file", NULL, false},
    {"worker-[0-9]*.done", prove_done, "it does not begin with the worker line its name calls for", NULL, false},
    {"worker-[0-9]*.done.tmp-*", prove_done_tmp, "it is neither empty nor begins like a done marker", NULL, false},
    {LOCK_NAME, tkd_dir_lock_file_proof, "it holds something other than a pid", NULL, false},
    {LOCK_NAME ".worker-[0-9]*", tkd_dir_lock_file_proof, "it holds something other than a pid", NULL, false},
    {NULL, NULL, NULL, NULL, false},
};

static const char *const cache_keep[] = {LOCK_NAME, LOCK_NAME ".worker-[0-9]*", NULL};

const tkd_dir_kind tkd_dump_dir_kind = {
    .tool = "teacher-dump",
    .what = "teacher cache",
    .marker = ".topkd-cache",
    .names = cache_names,
    .keep = cache_keep,
    /* every version wrote a manifest at once, with this first line */
    .sign_name = "manifest*.yaml",
    .sign_text = MANIFEST_HEAD,
    .proofs_open = listed_open,
    .proofs_close = listed_free,
};

tkd_status tkd_dump_dir_lock_merge(const char *dir, tkd_dir_lock **lock)
{
    char path[4096];
    *lock = NULL;
    TKD_TRY(tkd_path_join(path, sizeof path, dir, "manifest.worker-0.yaml"));
    if (!tkd_file_exists(path))
        return TKD_OK;
    TKD_TRY(tkd_dir_lock_take(dir, LOCK_NAME, "teacher-dump", lock));
    /* merge writes manifest.yaml over the one there: only over one teacher-dump wrote */
    tkd_status st = tkd_owned_dir_tidy(&tkd_dump_dir_kind, dir, NULL);
    if (st != TKD_OK) {
        tkd_dir_lock_release(*lock);
        *lock = NULL;
    }
    return st;
}

/* Every entry of a teacher-dump name proven, then the temporary files of a dead writer removed: all
 * of them under the exclusive lock; a worker's own only. */
static tkd_status remove_temps(const tkd_dump_config *cfg)
{
    if (cfg->worker_count == 1) {
        static const char *const all[] = {"manifest*.yaml.tmp-*", "shard-[0-9]*.h5.tmp", "worker-[0-9]*.done.tmp-*",
                                          NULL};
        return tkd_owned_dir_tidy(&tkd_dump_dir_kind, cfg->output_dir, all);
    }
    char manifest[96], done[96];
    snprintf(manifest, sizeof manifest, "manifest.worker-%d.yaml.tmp-*", cfg->worker_index);
    snprintf(done, sizeof done, "worker-%d.done.tmp-*", cfg->worker_index);
    const char *const own[] = {manifest, done, NULL};
    return tkd_owned_dir_tidy(&tkd_dump_dir_kind, cfg->output_dir, own);
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

/* Holds dir nothing but what tkd_dump_dir_open and the launcher put there: the marker and lock files? */
static bool only_open_leftovers(const char *dir)
{
    const char *const open_files[] = {tkd_dump_dir_kind.marker, LOCK_NAME, LOCK_NAME ".worker-[0-9]*", NULL};
    return tkd_dir_holds_only(dir, open_files);
}

static void unlink_in(const char *dir, const char *name)
{
    char path[4096];
    if (tkd_path_join(path, sizeof path, dir, name) == TKD_OK)
        unlink(path);
}

void tkd_dump_dir_abandon(const char *dir, const char *made, tkd_dir_lock *lock)
{
    tkd_error_saved failure; /* the message of why the run failed, which the caller still prints */
    tkd_error_save(&failure, TKD_ERR_IO);
    /* lock NULL and the lock held by another writer: its directory now, left alone */
    if (made[0] && (lock || tkd_dir_lock_take(dir, LOCK_NAME, "teacher-dump", &lock) == TKD_OK) &&
        only_open_leftovers(dir)) {
        /* the lock file goes while still held: a writer that opened it meanwhile is refused anyway,
         * and one that comes later makes a new directory */
        glob_t g;
        char pat[4096];
        if (tkd_path_join(pat, sizeof pat, dir, LOCK_NAME ".worker-[0-9]*") == TKD_OK && glob(pat, 0, NULL, &g) == 0) {
            for (size_t i = 0; i < g.gl_pathc; i++)
                unlink(g.gl_pathv[i]);
            globfree(&g);
        }
        unlink_in(dir, tkd_dump_dir_kind.marker);
        unlink_in(dir, LOCK_NAME);
        tkd_rmdir_made(dir, made); /* rmdir only: anything that appeared meanwhile keeps its folder */
    }
    tkd_dir_lock_release(lock);
    tkd_error_restore(&failure);
}
