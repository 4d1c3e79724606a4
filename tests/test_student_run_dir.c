/* test_student_run_dir.c — what student-train may do to <run.dir>/<run.name>/: run.name is one plain
 * name; a run directory that is, holds or lies inside the cache is refused; --overwrite removes only
 * a run directory student-train made, and only its own files; one run at a time holds it; the
 * leftovers of a run killed during a checkpoint write are cleaned by the next; --resume of a
 * finished run changes nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "student_train/checkpoint.h"
#include "student_train/train.h"
#include "tests/testutil.h"

typedef tkd_test_student_dir fixture;

enum { NEW = 0, RESUME = 1, OVERWRITE = 2 }; /* tkd_test_student_train's modes */

/* A tiny student on the fixture's cache (4 steps, evaluation at the end), run `name` under run_dir
 * (NULL: the fixture's runs) in mode NEW / RESUME / OVERWRITE, then extra settings. */
static tkd_status run(const fixture *f, const char *run_dir, const char *name, int mode, const char *extra,
                      tkd_train_result *res)
{
    return tkd_test_tiny_student(f, run_dir, name, mode, extra, res);
}

/* The cache is still whole: its manifest and first shard are there. */
static void assert_cache_intact(const fixture *f)
{
    assert_true(tkd_file_exists(tkd_test_path(f->cache, "manifest.yaml")));
    assert_true(tkd_file_exists(tkd_test_path(f->cache, "shard-00000.h5")));
}

/* "..", "." and "a/b" would put the run (and what --overwrite removes) elsewhere. */
static void test_run_name_is_one_plain_name(void **state)
{
    fixture *f = *state;
    const char *bad[] = {"..", ".", "a/b", "../cache", ""};
    for (int i = 0; i < 5; i++) {
        assert_int_equal(run(f, NULL, bad[i], OVERWRITE, NULL, NULL), TKD_ERR_CONFIG);
        tkd_test_assert_msg_has("run.name");
        assert_cache_intact(f);
    }
    assert_false(tkd_file_exists(tkd_test_path(f->runs, "a")));
}

/* The run directory must be apart from the cache it reads: not the cache, not inside it, not
 * around it — with --overwrite each of these removed the cache. */
static void test_run_dir_apart_from_cache(void **state)
{
    fixture *f = *state;
    char parent[4300], base[4300];
    snprintf(parent, sizeof parent, "%s", f->dir);
    snprintf(base, sizeof base, "%s", f->dir);
    assert_int_equal(run(f, f->dir, "cache", OVERWRITE, NULL, NULL), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("data.cache");
    assert_int_equal(run(f, f->cache, "inside", OVERWRITE, NULL, NULL), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("lies inside");
    assert_false(tkd_file_exists(tkd_test_path(f->cache, "inside")));
    assert_int_equal(run(f, dirname(parent), basename(base), OVERWRITE, NULL, NULL), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("holds the cache");
    assert_cache_intact(f);
}

/* --overwrite: a folder of the user's, another tool's output, or a run with a foreign file in it is
 * refused with nothing removed; a run student-train made is emptied and run again; a run of an
 * older version (no marker) is recognised by its config.yaml. */
static void test_overwrite_removes_only_ours(void **state)
{
    fixture *f = *state;
    assert_int_equal(tkd_mkdir_p(tkd_test_path(f->runs, "photos")), TKD_OK);
    tkd_test_write_text(tkd_test_in_run(f, "photos", "a.jpg"), "jpeg");
    assert_int_equal(run(f, NULL, "photos", OVERWRITE, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("'a.jpg'");
    assert_true(tkd_file_exists(tkd_test_in_run(f, "photos", "a.jpg")));
    tkd_test_teacher_opts o = {.vocab = 64, .hidden = 16, .seq_len = 8, .k = 4, .temperature = 1.0f,
                               .num_seq = 4, .shard_seqs = 4, .seed = 9};
    assert_int_equal(tkd_test_teacher_cache(tkd_test_path(f->runs, "acache"), &o), TKD_OK);
    assert_int_equal(run(f, NULL, "acache", OVERWRITE, NULL, NULL), TKD_ERR_INVALID_ARG);
    assert_true(tkd_file_exists(tkd_test_in_run(f, "acache", "manifest.yaml")));

    assert_int_equal(run(f, NULL, "r", NEW, NULL, NULL), TKD_OK);
    assert_true(tkd_file_exists(tkd_test_in_run(f, "r", ".topkd-run")));
    tkd_test_write_text(tkd_test_in_run(f, "r", "notes.txt"), "mine");
    assert_int_equal(run(f, NULL, "r", OVERWRITE, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(tkd_test_path(f->runs, "r"));
    tkd_test_assert_msg_has("'notes.txt'");
    assert_true(tkd_file_exists(tkd_test_in_run(f, "r", "notes.txt")));
    assert_true(tkd_file_exists(tkd_test_in_run(f, "r", "checkpoint/state.json")));
    assert_int_equal(remove(tkd_test_in_run(f, "r", "notes.txt")), 0);
    assert_int_equal(remove(tkd_test_in_run(f, "r", ".topkd-run")), 0); /* as an older version left it */
    /* what a rank that died during a data-parallel checkpoint leaves is ours too */
    assert_int_equal(tkd_built_dir_make(&tkd_checkpoint_kind, tkd_test_in_run(f, "r", "checkpoint.building-job7-12")),
                     TKD_OK);
    tkd_test_write_text(tkd_test_in_run(f, "r", "checkpoint.building-job7-12/optimizer-rank0-of2.safetensors"), "x");
    tkd_train_result res;
    assert_int_equal(run(f, NULL, "r", OVERWRITE, "train.max_steps=2", &res), TKD_OK);
    assert_int_equal(res.steps, 2);
    double loss[8];
    assert_int_equal(tkd_test_metrics(tkd_test_in_run(f, "r", "metrics.jsonl"), "train", "loss", loss, 8), 2);
    assert_true(tkd_file_exists(tkd_test_in_run(f, "r", ".topkd-run")));
    assert_false(tkd_file_exists(tkd_test_in_run(f, "r", "checkpoint.building-job7-12")));
}

/* One student-train per run directory: while another process holds its lock, a run stops at once
 * naming that pid; after a SIGKILL of the holder nothing stale is left. */
static void test_one_run_per_directory(void **state)
{
    fixture *f = *state;
    assert_int_equal(run(f, NULL, "locked", NEW, NULL, NULL), TKD_OK);
    pid_t pid = tkd_test_lock_holder(tkd_test_path(f->runs, "locked"), ".topkd-lock", NULL);
    char want[64];
    snprintf(want, sizeof want, "another student-train (pid %ld) is writing there", (long)pid);
    assert_int_equal(run(f, NULL, "locked", OVERWRITE, NULL, NULL), TKD_ERR_BUSY);
    tkd_test_assert_msg_has(want);
    assert_true(tkd_file_exists(tkd_test_in_run(f, "locked", "checkpoint/state.json")));
    tkd_test_kill_holder(pid);
    assert_int_equal(run(f, NULL, "locked", OVERWRITE, NULL, NULL), TKD_OK);
}

/* What a SIGKILL during a checkpoint write leaves — the half-built checkpoint.tmp-*, a metrics
 * temporary, or (killed between the two renames) the previous checkpoint renamed to checkpoint.old
 * with no checkpoint — is cleaned up by the next run, which resumes from the checkpoint put back. */
static void test_dead_run_leftovers_cleaned(void **state)
{
    fixture *f = *state;
    assert_int_equal(run(f, NULL, "crash", NEW, "train.stop_after=2", NULL), TKD_OK);
    char tmp[4400];
    assert_int_equal(tkd_built_dir_make_temp(&tkd_checkpoint_kind, tkd_test_in_run(f, "crash", "checkpoint"), tmp,
                                             sizeof tmp),
                     TKD_OK);
    tkd_test_write_text(tkd_test_path(tmp, "model.safetensors"), "half");
    /* the metrics rewritten on a resume, cut short in its second record */
    tkd_test_write_text(tkd_test_in_run(f, "crash", "metrics.jsonl.tmp-Ab12Cd"),
                        "{\"type\": \"train\", \"step\": 1}\n{\"type\": \"tr");
    assert_int_equal(rename(tkd_test_in_run(f, "crash", "checkpoint"), tkd_test_in_run(f, "crash", "checkpoint.old")),
                     0);

    tkd_train_result res;
    assert_int_equal(run(f, NULL, "crash", RESUME, "train.stop_after=2", &res), TKD_OK);
    assert_int_equal(res.steps, 4);
    assert_false(tkd_file_exists(tmp));
    assert_false(tkd_file_exists(tkd_test_in_run(f, "crash", "metrics.jsonl.tmp-Ab12Cd")));
    assert_false(tkd_file_exists(tkd_test_in_run(f, "crash", "checkpoint.old")));
    assert_true(tkd_file_exists(tkd_test_in_run(f, "crash", "checkpoint/state.json")));
}

/* --resume of a finished run writes nothing (it used to append the final records again); one that
 * stopped before its final evaluation (a signal at the last step) makes it once. */
static void test_resume_finished_run_is_noop(void **state)
{
    fixture *f = *state;
    assert_int_equal(run(f, NULL, "done", NEW, NULL, NULL), TKD_OK);
    size_t len = 0;
    char *before = tkd_test_slurp(tkd_test_in_run(f, "done", "metrics.jsonl"), &len);
    char *cfg_before = tkd_test_slurp(tkd_test_in_run(f, "done", "config.yaml"), NULL);
    tkd_train_result res;
    assert_int_equal(run(f, NULL, "done", RESUME, NULL, &res), TKD_OK);
    assert_true(res.finished_before);
    assert_int_equal(res.steps, 4);
    char *after = tkd_test_slurp(tkd_test_in_run(f, "done", "metrics.jsonl"), NULL);
    assert_string_equal(after, before);
    free(after);
    after = tkd_test_slurp(tkd_test_in_run(f, "done", "config.yaml"), NULL);
    assert_string_equal(after, cfg_before);
    free(after);
    free(cfg_before);

    /* without its final evaluation record the run is not finished: resuming adds exactly one */
    double v[4];
    assert_int_equal(tkd_test_metrics(tkd_test_in_run(f, "done", "metrics.jsonl"), "eval", "val_ce", v, 4), 1);
    char *last = before + len - 1;
    while (last > before && last[-1] != '\n')
        last--;
    *last = '\0';
    tkd_test_write_text(tkd_test_in_run(f, "done", "metrics.jsonl"), before);
    assert_int_equal(tkd_test_metrics(tkd_test_in_run(f, "done", "metrics.jsonl"), "eval", "val_ce", v, 4), 0);
    assert_int_equal(run(f, NULL, "done", RESUME, NULL, &res), TKD_OK);
    assert_false(res.finished_before);
    assert_int_equal(tkd_test_metrics(tkd_test_in_run(f, "done", "metrics.jsonl"), "eval", "val_ce", v, 4), 1);
    free(before);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_run_name_is_one_plain_name),
        cmocka_unit_test(test_run_dir_apart_from_cache),
        cmocka_unit_test(test_overwrite_removes_only_ours),
        cmocka_unit_test(test_one_run_per_directory),
        cmocka_unit_test(test_dead_run_leftovers_cleaned),
        cmocka_unit_test(test_resume_finished_run_is_noop),
    };
    return cmocka_run_group_tests(tests, tkd_test_tiny_student_setup, tkd_test_student_teardown);
}
