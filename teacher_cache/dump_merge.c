/* dump_merge.c — see dump_merge.h: the worker-<i>.done markers and tkd_dump_merge.
 *
 * Why a marker: a worker's manifest lists the whole shards it has written, but only the worker knows
 * where its range ends, so a worker stopped before its last shard looks just like a finished one.
 * The marker, written atomically once the range is complete, says "worker i of n covered [first, end)".
 */
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static tkd_status read_mark(const char *dir, int i, int n, done_mark *d)
{
    char name[64], path[4096];
    snprintf(name, sizeof name, "worker-%d.done", i);
    TKD_TRY(tkd_path_join(path, sizeof path, dir, name));
    void *data = NULL;
    size_t size = 0;
    if (tkd_read_file(path, &data, &size) != TKD_OK)
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: missing: worker %d of %d has not finished its range — "
                             "run (or resume) it with workers.index=%d, then merge again", path, i, n, i);
    int got = sscanf(data, "worker: %d\nworkers: %d\nfirst_seq: %lld\nend_seq: %lld", &d->index, &d->count,
                     &d->first, &d->end);
    free(data);
    if (got != 4 || d->index != i || d->count != n || d->first < 0 || d->end < d->first)
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

/* The config of any worker's manifest (the first found: worker 0 may be the one missing) says how
 * many workers there are. */
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
    globfree(&g);
    return st;
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
    for (int64_t j = 0; j < m->num_shards; j++) {
        char p[4096];
        uint64_t bytes = 0;
        TKD_TRY(tkd_path_join(p, sizeof p, dir, m->shards[j].file));
        if (tkd_file_size(p, &bytes) != TKD_OK || bytes != m->shards[j].bytes)
            return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: listed by worker %d of %d (%s) but missing or not %llu bytes "
                                 "— re-run that worker with workers.index=%d, without --overwrite (it re-makes missing "
                                 "or damaged shards), then merge again", p, i, n, path,
                                 (unsigned long long)m->shards[j].bytes, i);
    }
    return TKD_OK;
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
    if (st == TKD_OK)
        st = single_worker_text(&cfg, &out);
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
