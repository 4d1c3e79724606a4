/* dump_merge.c — see dump_merge.h: the worker-<i>.done markers and tkd_dump_merge.
 *
 * Why a marker: a worker's manifest lists the whole shards it has written, but only the worker knows
 * where its range ends, so a worker stopped before its last shard looks just like a finished one.
 * The marker, written atomically once the range is complete, says "worker i of n covered [first, end)".
 */
#include <errno.h>
#include <glob.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/fileio.h"
#include "formats/cache_manifest.h"
#include "teacher_cache/dump_merge.h"
#include "teacher_cache/dump_dir.h"

typedef struct done_mark {
    int index, count;
    long long first, end;
} done_mark;

tkd_status tkd_dump_mark_done(const tkd_dump_config *cfg, int64_t first, int64_t end)
{
    if (cfg->worker_count <= 1)
        return TKD_OK;
    char name[64], path[4096], text[256];
    snprintf(name, sizeof name, "worker-%d.done", cfg->worker_index);
    TKD_TRY(tkd_path_join(path, sizeof path, cfg->output_dir, name));
    int len = snprintf(text, sizeof text, "worker: %d\nworkers: %d\nfirst_seq: %lld\nend_seq: %lld\n",
                       cfg->worker_index, cfg->worker_count, (long long)first, (long long)end);
    return tkd_file_write_atomic(path, text, (size_t)len);
}

/* The marker at path: TKD_ERR_NOT_FOUND when there is none, TKD_ERR_FORMAT (no message) when it is
 * not one of ours. */
static tkd_status load_mark(const char *path, done_mark *d)
{
    void *data = NULL;
    size_t size = 0;
    if (tkd_read_file(path, &data, &size) != TKD_OK)
        return TKD_ERR_NOT_FOUND;
    int got = sscanf(data, "worker: %d\nworkers: %d\nfirst_seq: %lld\nend_seq: %lld", &d->index, &d->count,
                     &d->first, &d->end);
    free(data);
    return got == 4 && d->index >= 0 && d->count > d->index && d->first >= 0 && d->end >= d->first ? TKD_OK
                                                                                                  : TKD_ERR_FORMAT;
}

static tkd_status read_mark(const char *dir, int i, int n, done_mark *d)
{
    char name[64], path[4096];
    snprintf(name, sizeof name, "worker-%d.done", i);
    TKD_TRY(tkd_path_join(path, sizeof path, dir, name));
    tkd_status st = load_mark(path, d);
    if (st == TKD_ERR_NOT_FOUND)
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: missing: worker %d of %d has not finished its range — "
                             "run (or resume) it with workers.index=%d, then merge again", path, i, n, i);
    if (st != TKD_OK || d->index != i || d->count != n)
        return tkd_error_set(TKD_ERR_FORMAT, "%s:1: not a worker %d-of-%d marker — delete it and re-run worker %d",
                             path, i, n, i);
    return TKD_OK;
}

/* workers.count recorded in a worker manifest's config. */
static tkd_status worker_count_of(const tkd_cache_manifest *m, const char *path, tkd_dump_config *cfg)
{
    tkd_status st = tkd_config_defaults(&tkd_dump_schema, cfg);
    if (st == TKD_OK && m->config_text)
        st = tkd_config_apply_string(&tkd_dump_schema, cfg, path, m->config_text, strlen(m->config_text));
    if (st != TKD_OK) {
        tkd_error_prefix(st, "%s: config", path);
        return tkd_error_hint(TKD_ERR_FORMAT, "re-run that worker with --overwrite");
    }
    return TKD_OK;
}

/* ---- the split a directory records ------------------------------------------------------------ */

/* What one file of a split dump records: worker `index` of `count`, covering [first, end) — a
 * marker's range, or the span of a worker manifest's listed shards (first == end: none listed). */
typedef struct split_file {
    const char *path;
    int index, count;
    int64_t first, end;
    bool marker;
} split_file;

static tkd_status manifest_split(const char *path, split_file *f)
{
    tkd_cache_manifest m;
    TKD_TRY(tkd_cache_manifest_read(&m, path));
    tkd_dump_config cfg = {0};
    tkd_status st = worker_count_of(&m, path, &cfg);
    f->index = cfg.worker_index;
    f->count = cfg.worker_count;
    f->first = m.num_shards > 0 ? m.shards[0].first_seq : 0;
    f->end = tkd_cache_manifest_end_seq(&m, f->first);
    tkd_config_free(&tkd_dump_schema, &cfg);
    tkd_cache_manifest_free(&m);
    return st;
}

static tkd_status marker_split(const char *path, split_file *f)
{
    done_mark d;
    const char *base = strrchr(path, '/');
    int i = -1;
    tkd_status st = load_mark(path, &d);
    if (st == TKD_ERR_NOT_FOUND) /* removed since the listing: each_split_file skips it */
        return st;
    if (st != TKD_OK) {
        sscanf(base ? base + 1 : path, "worker-%d.done", &i);
        return tkd_error_set(TKD_ERR_FORMAT, "%s:1: not a worker-finished marker — delete it and re-run worker %d",
                             path, i);
    }
    *f = (split_file){.path = path, .index = d.index, .count = d.count, .first = d.first, .end = d.end, .marker = true};
    return TKD_OK;
}

/* Calls visit(f, user) for every worker manifest and marker in dir, stopping at the first error.
 * A file removed between the listing and its reading (by a worker's --overwrite) is skipped. */
static tkd_status each_split_file(const char *dir, tkd_status (*visit)(const split_file *, void *), void *user)
{
    static const char *const pats[] = {"manifest.worker-[0-9]*.yaml", "worker-[0-9]*.done"};
    tkd_status st = TKD_OK;
    for (int p = 0; p < 2 && st == TKD_OK; p++) {
        char pat[4096];
        TKD_TRY(tkd_path_join(pat, sizeof pat, dir, pats[p]));
        glob_t g;
        memset(&g, 0, sizeof g);
        if (glob(pat, 0, NULL, &g) == 0) {
            for (size_t i = 0; i < g.gl_pathc && st == TKD_OK; i++) {
                split_file f = {.path = g.gl_pathv[i]};
                st = p == 0 ? manifest_split(f.path, &f) : marker_split(f.path, &f);
                if (st == TKD_OK)
                    st = visit(&f, user);
                else if (st == TKD_ERR_NOT_FOUND && !tkd_file_exists(f.path))
                    st = TKD_OK;
            }
        }
        globfree(&g);
    }
    return st;
}

/* A run's place in the split, for messages: "worker 1 of 3", or a single worker. */
static const char *run_name(const tkd_dump_config *cfg, char *buf, size_t cap)
{
    if (cfg->worker_count == 1)
        snprintf(buf, cap, "one worker (no workers.*, RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS)");
    else
        snprintf(buf, cap, "worker %d of %d", cfg->worker_index, cfg->worker_count);
    return buf;
}

/* What to do when the directory records a split into `recorded` workers and this run is another. */
static tkd_status other_split_hint(int recorded)
{
    return tkd_error_hint(TKD_ERR_MISMATCH, "every worker of one cache runs with one count: run it as %s%d worker%s, "
                          "start the cache again with --overwrite on every worker, or use another output.dir",
                          recorded > 1 ? "one of " : "", recorded, recorded > 1 ? "s" : "");
}

/* What tkd_dump_check_split learns from the worker files. */
typedef struct split_scan {
    const tkd_dump_config *cfg;
    int64_t windows;
    int files;
} split_scan;

static tkd_status check_split_file(const split_file *f, void *user)
{
    split_scan *S = user;
    const tkd_dump_config *cfg = S->cfg;
    char me[128];
    S->files++;
    if (f->count != cfg->worker_count) {
        tkd_error_set(TKD_ERR_MISMATCH, "%s: records worker %d of %d, but this run is %s", f->path, f->index, f->count,
                      run_name(cfg, me, sizeof me));
        return other_split_hint(f->count);
    }
    if (f->index == cfg->worker_index) /* its own files: resume checks them (dump.c) */
        return TKD_OK;
    int64_t r0, r1;
    tkd_dump_worker_range(S->windows, cfg->shard_sequences, f->index, f->count, &r0, &r1);
    bool fits = f->marker ? f->first == r0 && f->end == r1 : f->first == f->end || (f->first >= r0 && f->end <= r1);
    if (fits)
        return TKD_OK;
    tkd_error_set(TKD_ERR_MISMATCH, "%s: records sequences [%lld, %lld) for worker %d of %d, where this config gives "
                  "that worker [%lld, %lld)", f->path, (long long)f->first, (long long)f->end, f->index, f->count,
                  (long long)r0, (long long)r1);
    return tkd_error_hint(TKD_ERR_MISMATCH, "the workers split another number of sequences (data.max_sequences or "
                          "the data changed): keep the settings, start the cache again with --overwrite on every "
                          "worker, or use another output.dir");
}

/* manifest.yaml in dir: *exists, and *workers, the count it records (merge writes it; 0 when
 * absent). */
static tkd_status merged_record(const char *dir, char *path, size_t cap, bool *exists, int *workers)
{
    TKD_TRY(tkd_path_join(path, cap, dir, TKD_CACHE_MANIFEST_NAME));
    *exists = tkd_file_exists(path);
    *workers = 0;
    if (!*exists)
        return TKD_OK;
    tkd_cache_manifest m;
    TKD_TRY(tkd_cache_manifest_read(&m, path));
    *workers = m.workers;
    tkd_cache_manifest_free(&m);
    return TKD_OK;
}

tkd_status tkd_dump_check_split(const tkd_dump_config *cfg, int64_t windows)
{
    char path[4096], me[128];
    bool merged_exists;
    int merged_from;
    TKD_TRY(merged_record(cfg->output_dir, path, sizeof path, &merged_exists, &merged_from));
    /* One worker where manifest.yaml is: it continues from that manifest, its own; the worker
     * files beside it (if any) are what was merged into it. */
    if (cfg->worker_count == 1 && merged_exists)
        return TKD_OK;
    split_scan S = {.cfg = cfg, .windows = windows};
    TKD_TRY(each_split_file(cfg->output_dir, check_split_file, &S));
    if (cfg->worker_count == 1 || !merged_exists)
        return TKD_OK;
    /* A manifest.yaml older than the `workers` key is taken as merged from the worker files beside
     * it (all of this run's count, checked above), else as one worker's. */
    int recorded = merged_from > 0 ? merged_from : S.files > 0 ? cfg->worker_count : 1;
    if (recorded == cfg->worker_count)
        return TKD_OK;
    if (recorded == 1)
        tkd_error_set(TKD_ERR_MISMATCH, "%s: was written by one worker, but this run is %s", path,
                      run_name(cfg, me, sizeof me));
    else
        tkd_error_set(TKD_ERR_MISMATCH, "%s: was merged from %d workers, but this run is %s", path, recorded,
                      run_name(cfg, me, sizeof me));
    return other_split_hint(recorded);
}

typedef struct merge_parts {
    int n;
    tkd_cache_manifest *m;  // (n)
    char **names;           // (n)
} merge_parts;

static void parts_free(merge_parts *p)
{
    for (int i = 0; i < p->n; i++) {
        tkd_cache_manifest_free(&p->m[i]);
        free(p->names[i]);
    }
    free(p->m);
    free(p->names);
}

/* --overwrite: a worker file of another count is removed (unlink: the other workers of this split
 * may remove it first). */
static tkd_status drop_other_file(const split_file *f, void *user)
{
    const tkd_dump_config *cfg = user;
    if (f->count == cfg->worker_count || unlink(f->path) == 0 || errno == ENOENT)
        return TKD_OK;
    return tkd_error_set(TKD_ERR_IO, "%s: cannot remove it for --overwrite: %s — check permissions", f->path,
                         strerror(errno));
}

tkd_status tkd_dump_drop_other_split(const tkd_dump_config *cfg)
{
    return each_split_file(cfg->output_dir, drop_other_file, (void *)cfg);
}

/* merge: every worker file in the directory belongs to the split of `first` (worker count n). */
typedef struct merge_scan {
    const char *first;
    int n;
} merge_scan;

static tkd_status check_merge_file(const split_file *f, void *user)
{
    const merge_scan *M = user;
    if (f->count == M->n && f->index < M->n)
        return TKD_OK;
    tkd_error_set(TKD_ERR_MISMATCH, "%s: records worker %d of %d, but %s records a split into %d workers", f->path,
                  f->index, f->count, M->first, M->n);
    return tkd_error_hint(TKD_ERR_MISMATCH, "the directory holds parts of two splits: delete the manifest.worker-<i>.yaml "
                          "and worker-<i>.done of the one you do not want (or start again with --overwrite on every "
                          "worker of one count), then merge again");
}

/* The config of any worker's manifest (the first found: worker 0 may be the one missing) says how
 * many workers there are; every other worker file must agree. */
static tkd_status find_worker_config(const char *dir, tkd_dump_config *cfg0)
{
    char pat[4096];
    TKD_TRY(tkd_path_join(pat, sizeof pat, dir, "manifest.worker-*.yaml"));
    glob_t g;
    memset(&g, 0, sizeof g);
    if (glob(pat, 0, NULL, &g) != 0 || g.gl_pathc == 0) {
        globfree(&g);
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: no manifest.worker-<i>.yaml: nothing to merge — run teacher-dump "
                             "with workers.count > 1 into this directory first", dir);
    }
    tkd_cache_manifest m;
    tkd_status st = tkd_cache_manifest_read(&m, g.gl_pathv[0]);
    if (st == TKD_OK) {
        st = worker_count_of(&m, g.gl_pathv[0], cfg0);
        tkd_cache_manifest_free(&m);
    }
    merge_scan M = {.first = g.gl_pathv[0], .n = cfg0->worker_count};
    if (st == TKD_OK)
        st = each_split_file(dir, check_merge_file, &M);
    globfree(&g);
    return st;
}

/* The first shard m lists whose file is missing or not its listed size and sha256, or
 * m->num_shards when all are good. Several files at a time: hashing a large cache is long. */
static int64_t first_bad_shard(const char *dir, const tkd_cache_manifest *m)
{
    int64_t bad = m->num_shards;
#pragma omp parallel for schedule(dynamic, 1) reduction(min : bad)
    for (int64_t j = 0; j < m->num_shards; j++)
        if (tkd_cache_manifest_verify_shard(dir, &m->shards[j]) != TKD_OK && j < bad)
            bad = j;
    return bad;
}

/* Shard e, listed by worker i of n in path, failed the check: its message, from verify's again in
 * this thread (messages are per thread), "<shard>: listed by worker i of n (path) but ...". */
static tkd_status bad_shard_message(const char *dir, const tkd_cache_shard_entry *e, const char *path, int i, int n)
{
    char shard[4096], what[TKD_ERROR_MSG_MAX];
    TKD_TRY(tkd_path_join(shard, sizeof shard, dir, e->file));
    tkd_status st = tkd_cache_manifest_verify_shard(dir, e);
    if (st == TKD_ERR_NOT_FOUND)
        return tkd_error_set(st, "%s: listed by worker %d of %d (%s) but missing", shard, i, n, path);
    if (st == TKD_OK) /* it changed between the two looks */
        return tkd_error_set(TKD_ERR_CHECKSUM, "%s: listed by worker %d of %d (%s) but changed while merge read it",
                             shard, i, n, path);
    /* verify's "<shard>: <what> — <hint>": keep the what; the hint is to re-run the worker */
    snprintf(what, sizeof what, "%s", tkd_error_msg());
    char *dash = strstr(what, " \xe2\x80\x94 ");
    if (dash)
        *dash = '\0';
    size_t len = strlen(shard);
    const char *detail = strncmp(what, shard, len) == 0 && strncmp(what + len, ": ", 2) == 0 ? what + len + 2 : what;
    return tkd_error_set(st, "%s: listed by worker %d of %d (%s) but not as listed: %s", shard, i, n, path, detail);
}

/* Worker i of n marked [d->first, d->end) done: its manifest must list that whole range (a later
 * re-run may have unlisted shards to re-make them) and each listed file must be in place. */
static tkd_status check_worker_shards(const char *dir, const tkd_cache_manifest *m, const char *path, int i, int n,
                                      const done_mark *d)
{
    if (tkd_cache_manifest_num_seq(m) != d->end - d->first ||
        (m->num_shards > 0 && (m->shards[0].first_seq != d->first || tkd_cache_manifest_end_seq(m, 0) != d->end)))
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: lists %lld of the %lld sequences [%lld, %lld) of worker %d of %d — "
                             "run (or resume) it with workers.index=%d, then merge again", path,
                             (long long)tkd_cache_manifest_num_seq(m), d->end - d->first, d->first, d->end, i, n, i);
    int64_t bad = first_bad_shard(dir, m);
    if (bad == m->num_shards)
        return TKD_OK;
    tkd_status st = bad_shard_message(dir, &m->shards[bad], path, i, n);
    return tkd_error_hint(st, "re-run that worker with workers.index=%d, without --overwrite (it re-makes missing or "
                          "damaged shards), then merge again", i);
}

/* Reads manifest.worker-0..n-1.yaml and checks that each worker finished and that the markers tile. */
static tkd_status read_parts(const char *dir, merge_parts *p, tkd_dump_config *cfg0, int64_t *total)
{
    TKD_TRY(find_worker_config(dir, cfg0));
    tkd_status st;
    int n = cfg0->worker_count;
    p->m = calloc((size_t)n, sizeof *p->m);
    p->names = calloc((size_t)n, sizeof *p->names);
    if (!p->m || !p->names)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    long long expect_first = 0;
    for (int i = 0; i < n; i++) {
        char name[64];
        tkd_dump_manifest_name(i, n, name, sizeof name);
        p->names[i] = malloc(4096);
        if (!p->names[i])
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
        TKD_TRY(tkd_path_join(p->names[i], 4096, dir, name));
        tkd_cache_manifest_init(&p->m[i]);
        p->n = i + 1;
        st = tkd_cache_manifest_read(&p->m[i], p->names[i]);
        if (st == TKD_ERR_NOT_FOUND)
            return tkd_error_set(st, "%s: missing: worker %d of %d has not started — run it with workers.index=%d, "
                                 "then merge again", p->names[i], i, n, i);
        TKD_TRY(st);
        done_mark d;
        TKD_TRY(read_mark(dir, i, n, &d));
        TKD_TRY(check_worker_shards(dir, &p->m[i], p->names[i], i, n, &d));
        if (d.first != expect_first)
            return tkd_error_set(TKD_ERR_MISMATCH, "%s/worker-%d.done: starts at sequence %lld, worker %d ended at %lld "
                                 "— the workers ran with different settings; re-run them with --overwrite",
                                 dir, i, d.first, i - 1, expect_first);
        expect_first = d.end;
    }
    *total = expect_first;
    return TKD_OK;
}

/* The merged manifest's config is that of one worker doing it all. */
static tkd_status single_worker_text(tkd_dump_config *cfg, tkd_cache_manifest *out)
{
    cfg->worker_index = 0;
    cfg->worker_count = 1;
    char *text = NULL;
    TKD_TRY(tkd_config_to_text(&tkd_dump_schema, cfg, &text));
    free(out->config_text);
    out->config_text = text;
    return TKD_OK;
}

tkd_status tkd_dump_merge(const char *dir, int64_t *num_seq, int64_t *num_shards)
{
    merge_parts p = {0};
    tkd_dump_config cfg = {0};
    tkd_cache_manifest out;
    tkd_cache_manifest_init(&out);
    int64_t total = 0;
    tkd_dir_lock *lock = NULL;
    tkd_status st = tkd_dump_dir_lock_merge(dir, &lock);
    if (st == TKD_OK)
        st = read_parts(dir, &p, &cfg, &total);
    if (st == TKD_OK)
        st = tkd_cache_manifest_merge(&out, p.m, p.n, (const char *const *)p.names);
    if (st == TKD_OK && tkd_cache_manifest_end_seq(&out, 0) != total)
        st = tkd_error_set(TKD_ERR_MISMATCH, "%s: the workers' shards end at sequence %lld but their markers at %lld — "
                           "re-run the workers, then merge again", dir, (long long)tkd_cache_manifest_end_seq(&out, 0),
                           (long long)total);
    if (st == TKD_OK) {
        out.workers = p.n; /* the split it joins: a worker of another count is refused (tkd_dump_check_split) */
        st = single_worker_text(&cfg, &out);
    }
    char path[4096];
    if (st == TKD_OK)
        st = tkd_path_join(path, sizeof path, dir, TKD_CACHE_MANIFEST_NAME);
    if (st == TKD_OK)
        st = tkd_cache_manifest_write(&out, path);
    if (st == TKD_OK) {
        if (num_seq)
            *num_seq = tkd_cache_manifest_num_seq(&out);
        if (num_shards)
            *num_shards = out.num_shards;
    }
    tkd_cache_manifest_free(&out);
    tkd_config_free(&tkd_dump_schema, &cfg);
    parts_free(&p);
    tkd_dir_lock_release(lock);
    return st;
}
