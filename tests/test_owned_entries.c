/* test_owned_entries.c — the tools remove (or write over) only what they can prove they wrote, end
 * to end (issue 20, item 1; common/owned_dir.h, docs/what-topkd-deletes.md). Each entry below has a
 * name the tool uses but was not written by it — a user's directory shard-00099.h5/, a plain file
 * shard-00050.h5 that no manifest lists and that is not HDF5, a manifest.worker-7.yaml no worker
 * wrote, a symbolic link named like a shard, a copy checkpoint.tmp-keep/ of a checkpoint — and each
 * makes teacher-dump --overwrite, its start-up clean-up, merge, student-train --overwrite and
 * --resume refuse, naming it, with nothing removed. The entries the tools did write are still
 * removed (a shard no manifest lists yet, a dead writer's temporaries), and run directories and
 * checkpoints of the version before markers are still resumed and replaced. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/fileio.h"
#include "common/owned_dir.h"
#include "student_train/checkpoint.h"
#include "student_train/train.h"
#include "teacher_cache/dump_merge.h"
#include "tests/dump_testutil.h"

/* ---- helpers ----------------------------------------------------------------------------------- */

/* Copies the regular files of directory src into dst (made), byte for byte: what cp -r does. */
static void copy_dir(const char *src, const char *dst)
{
    assert_int_equal(tkd_mkdir_p(dst), TKD_OK);
    DIR *d = opendir(src);
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.' && (!e->d_name[1] || (e->d_name[1] == '.' && !e->d_name[2])))
            continue;
        char a[4600], b[4600];
        snprintf(a, sizeof a, "%s/%s", src, e->d_name);
        snprintf(b, sizeof b, "%s/%s", dst, e->d_name);
        size_t len = 0;
        char *data = tkd_test_slurp(a, &len);
        FILE *f = fopen(b, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(data, 1, len, f), len);
        assert_int_equal(fclose(f), 0);
        free(data);
    }
    closedir(d);
}

/* Shards (*.h5) in dir. */
static int shards_in(const char *dir)
{
    return tkd_dt_count_suffix(dir, ".h5");
}

/* ---- teacher-dump ------------------------------------------------------------------------------ */

typedef struct dump_case {
    const char *dir;    /* the test's own temp dir (TKD_TEST_EACH_DIR) */
    char tok[4300];     /* token file: 120 tokens, 7 windows of 16, 2 shards of 4 */
    char out[4300];     /* <dir>/cache */
    char y[8192];       /* the config */
    char y_k4[8192];    /* the same with another k: a run that needs --overwrite */
} dump_case;

static void dump_begin(dump_case *c, const char *dir)
{
    c->dir = dir;
    const char *tok = tkd_dt_small_case(dir, 120, 2, c->out, sizeof c->out, c->y, sizeof c->y, "");
    snprintf(c->tok, sizeof c->tok, "%s", tok);
    tkd_dt_small_yaml(c->y_k4, sizeof c->y_k4, TKD_DT_LLAMA, c->tok, c->out, "cache: {k: 4}\n");
    tkd_dt_run_ok(c->y, NULL, NULL);
    assert_int_equal(shards_in(c->out), 2);
}

/* The cache is untouched: both shards and the manifest, which still says k 8. */
static void assert_cache_kept(const dump_case *c)
{
    tkd_cache_manifest m;
    assert_true(tkd_file_exists(tkd_test_path(c->out, "shard-00000.h5")));
    assert_true(tkd_file_exists(tkd_test_path(c->out, "shard-00001.h5")));
    assert_int_equal(tkd_cache_manifest_read(&m, tkd_test_path(c->out, "manifest.yaml")), TKD_OK);
    assert_int_equal(m.id.k, 8);
    tkd_cache_manifest_free(&m);
}

/* The reported entries, and a symbolic link named like a shard (to a real shard of another cache):
 * --overwrite refuses naming each, and removes nothing at all. */
static void test_dump_overwrite_refuses_what_it_did_not_write(void **state)
{
    dump_case c;
    dump_begin(&c, *state);
    char elsewhere[4400];
    snprintf(elsewhere, sizeof elsewhere, "%s/precious.h5", c.dir);
    copy_dir(c.out, tkd_test_path(c.dir, "copy")); /* a real shard outside the cache, for the link */
    assert_int_equal(rename(tkd_test_path(c.dir, "copy/shard-00000.h5"), elsewhere), 0);
    tkd_dump_opts ow = {.overwrite = true};
    struct {
        const char *name, *why;
    } cases[] = {
        {"shard-00099.h5", "holds 'shard-00099.h5', a directory, where teacher-dump writes only a file"},
        {"shard-00050.h5", "holds 'shard-00050.h5', a file teacher-dump did not write (no manifest there lists it, "
                           "and it is not an HDF5 file of format 'topkd-cache')"},
        {"manifest.worker-7.yaml", "holds 'manifest.worker-7.yaml', a file teacher-dump did not write (it does not "
                                   "begin with '# topkd teacher cache manifest')"},
        {"shard-00077.h5", "holds 'shard-00077.h5', a symbolic link"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char entry[4400];
        snprintf(entry, sizeof entry, "%s/%s", c.out, cases[i].name);
        if (i == 0) {
            assert_int_equal(tkd_mkdir_p(entry), TKD_OK);
            tkd_test_write_text(tkd_test_path(entry, "notes.txt"), "mine");
        } else if (i == 3) {
            assert_int_equal(symlink(elsewhere, entry), 0);
        } else {
            tkd_test_write_text(entry, "worker: 7 — my notes, not a cache file\n");
        }
        assert_int_equal(tkd_dt_run(c.y_k4, &ow, NULL), TKD_ERR_INVALID_ARG);
        tkd_test_assert_msg_has(c.out);
        tkd_test_assert_msg_has(cases[i].why);
        assert_true(tkd_file_exists(entry));
        assert_cache_kept(&c);
        if (i == 0)
            assert_true(tkd_file_exists(tkd_test_path(entry, "notes.txt")));
        /* a worker's --overwrite (which removes only its own part) refuses the same */
        char w[8400];
        snprintf(w, sizeof w, "%s\n---\nworkers: {index: 1, count: 2}\n", c.y_k4);
        assert_int_equal(tkd_dt_run(w, &ow, NULL), TKD_ERR_INVALID_ARG);
        tkd_test_assert_msg_has(cases[i].why);
        assert_cache_kept(&c);
        assert_int_equal(i == 0 ? tkd_test_rmtree(entry) : unlink(entry), 0);
    }
    assert_true(tkd_file_exists(elsewhere));
}

/* What teacher-dump did write goes, proven by content: a whole shard no manifest lists yet (the
 * writer died between the rename and the manifest), a dead writer's temporaries (empty, or HDF5 and
 * manifest text cut short). */
static void test_dump_overwrite_removes_what_it_wrote(void **state)
{
    dump_case c;
    dump_begin(&c, *state);
    copy_dir(c.out, tkd_test_path(c.dir, "copy"));
    assert_int_equal(rename(tkd_test_path(c.dir, "copy/shard-00001.h5"), tkd_test_path(c.out, "shard-00060.h5")), 0);
    tkd_test_write_text(tkd_test_path(c.out, "shard-00061.h5.tmp"), "");
    tkd_test_write_text(tkd_test_path(c.out, "shard-00062.h5.tmp"), "\x89HDF\r\n\x1a\nrest");
    tkd_test_write_text(tkd_test_path(c.out, "manifest.yaml.tmp-Ab12Cd"), "# topkd teacher cache");
    tkd_dump_opts ow = {.overwrite = true};
    tkd_dt_run_ok(c.y_k4, &ow, NULL);
    assert_false(tkd_file_exists(tkd_test_path(c.out, "shard-00060.h5")));
    assert_false(tkd_file_exists(tkd_test_path(c.out, "shard-00061.h5.tmp")));
    assert_false(tkd_file_exists(tkd_test_path(c.out, "shard-00062.h5.tmp")));
    assert_false(tkd_file_exists(tkd_test_path(c.out, "manifest.yaml.tmp-Ab12Cd")));
    tkd_cache_batch b;
    tkd_cache_manifest m;
    assert_int_equal(tkd_dt_read_all(c.out, &b, &m), 7);
    assert_int_equal(m.id.k, 4);
    tkd_cache_batch_free(&b);
    tkd_cache_manifest_free(&m);
}

/* Without --overwrite: the start-up clean-up of a dead writer's temporaries, and the run that would
 * write shards over names already there, refuse an entry of their names they did not write — a
 * user's file or a symbolic link named like a shard's temporary (whose target HDF5 would truncate),
 * a foreign shard-00001.h5 the run would rename a new shard over. */
static void test_dump_start_refuses_what_it_did_not_write(void **state)
{
    dump_case c;
    dump_begin(&c, *state);
    char precious[4400];
    snprintf(precious, sizeof precious, "%s/precious.txt", c.dir);
    tkd_test_write_text(precious, "the user's text\n");
    const char *tmp = tkd_test_path(c.out, "shard-00001.h5.tmp");
    tkd_test_write_text(tmp, "the user's text\n");
    assert_int_equal(tkd_dt_run(c.y, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("holds 'shard-00001.h5.tmp', a file teacher-dump did not write (it is neither empty "
                            "nor an HDF5 file)");
    tkd_test_assert_msg_has("so it stops here with nothing removed");
    assert_true(tkd_file_exists(tmp));
    assert_int_equal(unlink(tmp), 0);
    assert_int_equal(symlink(precious, tmp), 0);
    assert_int_equal(tkd_dt_run(c.y, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("holds 'shard-00001.h5.tmp', a symbolic link");
    assert_int_equal(unlink(tmp), 0);
    char *text = tkd_test_slurp(precious, NULL);
    assert_string_equal(text, "the user's text\n");
    free(text);
    /* a shard name no manifest lists, of a file that is not a shard: the run would write over it */
    tkd_test_write_text(tkd_test_path(c.out, "shard-00005.h5"), "mine\n");
    assert_int_equal(tkd_dt_run(c.y, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("holds 'shard-00005.h5', a file teacher-dump did not write");
    assert_true(tkd_file_exists(tkd_test_path(c.out, "shard-00005.h5")));
    assert_int_equal(unlink(tkd_test_path(c.out, "shard-00005.h5")), 0);
    /* a worker's own temporaries are its to clean; one that is not teacher-dump's stops it */
    char w1[8400];
    snprintf(w1, sizeof w1, "%s\n---\nworkers: {index: 1, count: 2}\n", c.y);
    const char *wtmp = tkd_test_path(c.out, "manifest.worker-1.yaml.tmp-keep01");
    tkd_test_write_text(wtmp, "my draft\n");
    assert_int_equal(tkd_dt_run(w1, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("'manifest.worker-1.yaml.tmp-keep01'");
    assert_true(tkd_file_exists(wtmp));
    assert_int_equal(unlink(wtmp), 0);
    tkd_dt_run_ok(c.y, NULL, NULL); /* and with those gone, the cache resumes as it was */
    assert_cache_kept(&c);
}

/* merge writes manifest.yaml: not over a user's file of that name. */
static void test_merge_refuses_a_foreign_manifest(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char out[4300], y[8192], w[8400];
    tkd_dt_small_case(dir, 120, 2, out, sizeof out, y, sizeof y, "");
    for (int i = 0; i < 2; i++) {
        snprintf(w, sizeof w, "%s\n---\nworkers: {index: %d, count: 2}\n", y, i);
        tkd_dt_run_ok(w, NULL, NULL);
    }
    const char *manifest = tkd_test_path(out, "manifest.yaml");
    tkd_test_write_text(manifest, "my own manifest\n");
    assert_int_equal(tkd_dump_merge(out, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("holds 'manifest.yaml', a file teacher-dump did not write");
    char *text = tkd_test_slurp(tkd_test_path(out, "manifest.yaml"), NULL);
    assert_string_equal(text, "my own manifest\n");
    free(text);
    assert_int_equal(unlink(tkd_test_path(out, "manifest.yaml")), 0);
    int64_t nseq = 0;
    assert_int_equal(tkd_dump_merge(out, &nseq, NULL), TKD_OK);
    assert_int_equal(nseq, 7);
    assert_int_equal(tkd_dump_merge(out, &nseq, NULL), TKD_OK); /* over its own manifest.yaml */
}

/* ---- student-train ----------------------------------------------------------------------------- */

typedef tkd_test_student_dir fixture;

enum { NEW = 0, RESUME = 1, OVERWRITE = 2 }; /* tkd_test_student_train's modes */

/* A tiny student (4 steps) on the fixture's cache, run `name` in mode NEW / RESUME / OVERWRITE. */
static tkd_status train(const fixture *f, const char *name, int mode, const char *extra, tkd_train_result *res)
{
    return tkd_test_tiny_student(f, NULL, name, mode, extra, res);
}

/* checkpoint.tmp-keep/: a user's copy of the checkpoint (cp -r, the marker copied along) under a
 * staging name. --resume (whose start-up clean-up took every checkpoint.tmp-*) and --overwrite
 * refuse naming it and remove nothing; once it is moved away both run. */
static void test_train_keeps_a_copy_of_the_checkpoint(void **state)
{
    fixture *f = *state;
    assert_int_equal(train(f, "keep", NEW, "train.stop_after=2", NULL), TKD_OK);
    const char *keep = tkd_test_in_run(f, "keep", "checkpoint.tmp-keep");
    copy_dir(tkd_test_in_run(f, "keep", "checkpoint"), keep);
    assert_true(tkd_file_exists(tkd_test_path(keep, TKD_BUILT_MARKER)));
    for (int mode = RESUME; mode <= OVERWRITE; mode++) {
        assert_int_equal(train(f, "keep", mode, NULL, NULL), TKD_ERR_INVALID_ARG);
        tkd_test_assert_msg_has(tkd_test_path(f->runs, "keep"));
        tkd_test_assert_msg_has("'checkpoint.tmp-keep', a directory student-train did not build (its " TKD_BUILT_MARKER
                                " was written into another directory: this one is a copy)");
        assert_true(tkd_file_exists(tkd_test_path(keep, "model.safetensors")));
        assert_true(tkd_file_exists(tkd_test_path(keep, "state.json")));
        assert_true(tkd_file_exists(tkd_test_in_run(f, "keep", "checkpoint/state.json")));
    }
    /* the user's directory under another name: a plain directory, not a copy */
    assert_int_equal(tkd_test_rmtree(keep), 0);
    assert_int_equal(tkd_mkdir_p(keep), TKD_OK);
    tkd_test_write_text(tkd_test_path(keep, "notes.txt"), "mine");
    assert_int_equal(train(f, "keep", RESUME, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("holds 'notes.txt', which a checkpoint never holds");
    assert_true(tkd_file_exists(tkd_test_path(keep, "notes.txt")));
    assert_int_equal(tkd_test_rmtree(keep), 0);
    tkd_train_result res;
    assert_int_equal(train(f, "keep", RESUME, NULL, &res), TKD_OK);
    assert_int_equal(res.steps, 4);
}

/* Files named like the run's own that student-train did not write: a config.yaml of other text, a
 * metrics.jsonl that is not its records, a symbolic link named checkpoint. */
static void test_train_refuses_foreign_files_of_its_names(void **state)
{
    fixture *f = *state;
    assert_int_equal(train(f, "files", NEW, "train.stop_after=2", NULL), TKD_OK);
    const char *metrics = tkd_test_in_run(f, "files", "metrics.jsonl.tmp-Ab12Cd");
    tkd_test_write_text(metrics, "step,loss\n1,2.5\n");
    assert_int_equal(train(f, "files", RESUME, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("'metrics.jsonl.tmp-Ab12Cd', a file student-train did not write");
    assert_true(tkd_file_exists(metrics));
    assert_int_equal(unlink(metrics), 0);
    /* the checkpoint swapped for a link to it: --overwrite does not follow it */
    assert_int_equal(rename(tkd_test_in_run(f, "files", "checkpoint"), tkd_test_in_run(f, "files", "../files-ckpt")),
                     0);
    assert_int_equal(symlink("../files-ckpt", tkd_test_in_run(f, "files", "checkpoint")), 0);
    assert_int_equal(train(f, "files", OVERWRITE, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("'checkpoint', a symbolic link");
    assert_true(tkd_file_exists(tkd_test_in_run(f, "files", "../files-ckpt/state.json")));
    assert_int_equal(unlink(tkd_test_in_run(f, "files", "checkpoint")), 0);
    assert_int_equal(train(f, "files", OVERWRITE, NULL, NULL), TKD_OK);
    assert_true(tkd_file_exists(tkd_test_in_run(f, "files", "../files-ckpt/model.safetensors")));
}

/* A run directory of the version before markers (no .topkd-run, a checkpoint without .topkd-built):
 * resumed, its checkpoint replaced by the next one (marked then); --overwrite clears one too. */
static void test_train_takes_over_a_run_of_the_older_version(void **state)
{
    fixture *f = *state;
    const char *names[] = {"old-resume", "old-overwrite"};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(train(f, names[i], NEW, "train.stop_after=2", NULL), TKD_OK);
        assert_true(tkd_file_exists(tkd_test_in_run(f, names[i], "checkpoint/" TKD_BUILT_MARKER)));
        assert_int_equal(unlink(tkd_test_in_run(f, names[i], ".topkd-run")), 0);
        assert_int_equal(unlink(tkd_test_in_run(f, names[i], "checkpoint/" TKD_BUILT_MARKER)), 0);
        tkd_train_result res;
        assert_int_equal(train(f, names[i], i ? OVERWRITE : RESUME, NULL, &res), TKD_OK);
        assert_int_equal(res.steps, 4);
        assert_true(tkd_file_exists(tkd_test_in_run(f, names[i], ".topkd-run")));
        assert_true(tkd_file_exists(tkd_test_in_run(f, names[i], "checkpoint/" TKD_BUILT_MARKER)));
        assert_false(tkd_file_exists(tkd_test_in_run(f, names[i], "checkpoint.old")));
    }
    /* its staging directories must carry the marker: an unmarked one is named, not removed */
    const char *old_tmp = tkd_test_in_run(f, "old-resume", "checkpoint.tmp-Ab12Cd");
    copy_dir(tkd_test_in_run(f, "old-resume", "checkpoint"), old_tmp);
    assert_int_equal(unlink(tkd_test_path(old_tmp, TKD_BUILT_MARKER)), 0);
    assert_int_equal(train(f, "old-resume", RESUME, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("'checkpoint.tmp-Ab12Cd', a directory student-train did not build");
    assert_true(tkd_file_exists(tkd_test_path(old_tmp, "state.json")));
}

int main(void)
{
    int failed = TKD_TEST_RUN_WITH(NULL, NULL, TKD_TEST_EACH_DIR, test_dump_overwrite_refuses_what_it_did_not_write,
                                   test_dump_overwrite_removes_what_it_wrote,
                                   test_dump_start_refuses_what_it_did_not_write,
                                   test_merge_refuses_a_foreign_manifest);
    return failed + TKD_TEST_RUN_WITH(tkd_test_tiny_student_setup, tkd_test_student_teardown, TKD_TEST_EACH_NONE,
                                      test_train_keeps_a_copy_of_the_checkpoint,
                                      test_train_refuses_foreign_files_of_its_names,
                                      test_train_takes_over_a_run_of_the_older_version);
}
