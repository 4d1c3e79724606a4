/* test_dump_actions.c — every message of teacher-dump and of the cache reader that proposes an
 * action, tested by taking that action: the failure is made, the message checked, the action it
 * names taken, and the outcome checked (the run succeeds; where it yields a whole cache, that cache
 * equals one uninterrupted run's).
 *
 * Messages whose action is tested elsewhere: repair of missing / damaged / half-repaired shards
 * and the reader's messages about them (test_teacher_dump.c: test_repair_missing_and_damaged,
 * test_resume_after_stop; test_teacher_dump_cli.c: test_rerun_repairs_a_missing_shard), values the
 * cache cannot hold (test_teacher_dump.c: test_logits_beyond_half, test_lse_beyond_float32,
 * test_nan_in_teacher_output), another config against a cache (test_other_config_needs_overwrite),
 * Ctrl-C and SIGKILL (test_resume_after_stop, test_teacher_dump_cli.c), merge's missing or
 * incomplete workers (test_merge_names_the_missing_worker, test_two_workers_and_merge), a file
 * locked by another program (test_cache_broken.c: test_locked_shard, test_teacher_dump_cli.c:
 * test_locked_file_message), a full disk (test_disk_full.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "teacher_cache/dump_merge.h"
#include "tests/dump_testutil.h"

/* 300 random tokens of the llama fixture (18 windows of 16) in the group dir. */
static const char *tokens(void)
{
    static char path[4300];
    if (!path[0])
        snprintf(path, sizeof path, "%s", tkd_dt_random_tokens(tkd_test_group_dir, "tok.npy", 300, 131, 21));
    return path;
}

/* The standard small config over tokens() into <group dir>/<out>, then extra YAML (static buffer). */
static const char *yaml(const char *out, const char *extra)
{
    static char y[8192];
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tokens(), tkd_test_path(tkd_test_group_dir, out), extra);
    return y;
}

/* One uninterrupted run of yaml("ref", ""), made once; returns its directory. */
static const char *ref_cache(void)
{
    static char dir[4300];
    if (!dir[0]) {
        tkd_dt_run_ok(yaml("ref", ""), NULL, NULL);
        snprintf(dir, sizeof dir, "%s", tkd_test_path(tkd_test_group_dir, "ref"));
    }
    return dir;
}

static void expect(tkd_status got, tkd_status want, const char *needle)
{
    if (got != want)
        fail_msg("got %s (%s), want %s", tkd_status_name(got), tkd_error_msg(), tkd_status_name(want));
    tkd_test_assert_msg_has(needle);
}

/* Replaces the first `from` after `after` in the file with `to`. */
static void edit_file(const char *path, const char *after, const char *from, const char *to)
{
    char *text = tkd_test_slurp(path, NULL);
    char *a = strstr(text, after);
    char *p = a ? strstr(a, from) : NULL;
    assert_non_null(p);
    char *out = malloc(strlen(text) + strlen(to) + 1);
    assert_non_null(out);
    sprintf(out, "%.*s%s%s", (int)(p - text), text, to, p + strlen(from));
    tkd_test_write_text(path, out);
    free(out);
    free(text);
}

/* ---- teacher-dump ------------------------------------------------------------------------------ */

/* A manifest that does not parse: "fix or delete it, or pass --overwrite". Deleting it makes the run
 * start the cache again, to the same cache. */
static void test_unreadable_manifest_delete_it(void **state)
{
    (void)state;
    const char *out = tkd_test_path(tkd_test_group_dir, "badyaml");
    tkd_dt_run_ok(yaml("badyaml", ""), NULL, NULL);
    /* its first line as teacher-dump writes it (without, it is not proven teacher-dump's:
     * test_owned_entries.c), then YAML that does not parse */
    tkd_test_write_text(tkd_test_path(out, "manifest.yaml"),
                        "# topkd teacher cache manifest: see docs/cache-format.md\nformat: topkd-cache\nversion: [1\n");
    expect(tkd_dt_run(yaml("badyaml", ""), NULL, NULL), TKD_ERR_FORMAT, "fix or delete it, or pass --overwrite");
    assert_int_equal(unlink(tkd_test_path(out, "manifest.yaml")), 0);
    tkd_dt_run_ok(yaml("badyaml", ""), NULL, NULL);
    tkd_dt_assert_same_cache(ref_cache(), out);
}

/* The config saved in the manifest does not parse: "pass --overwrite to replace the cache". */
static void test_unreadable_saved_config_overwrite(void **state)
{
    (void)state;
    const char *out = tkd_test_path(tkd_test_group_dir, "badcfg");
    tkd_dt_run_ok(yaml("badcfg", ""), NULL, NULL);
    edit_file(tkd_test_path(out, "manifest.yaml"), "config: |", "    k: 8", "    kk: 8");
    expect(tkd_dt_run(yaml("badcfg", ""), NULL, NULL), TKD_ERR_FORMAT,
           "cannot read the config it was made with");
    tkd_test_assert_msg_has("pass --overwrite to replace the cache");
    tkd_dump_opts ow = {.overwrite = true};
    tkd_dt_run_ok(yaml("badcfg", ""), &ow, NULL);
    tkd_dt_assert_same_cache(ref_cache(), out);
}

/* data.max_sequences lowered below what the cache holds: "keep workers.* and data.max_sequences as
 * before, or pass --overwrite". Keeping it as before: the cache is complete. */
static void test_range_changed_keep_it(void **state)
{
    (void)state;
    tkd_dt_run_ok(yaml("range", ""), NULL, NULL);
    expect(tkd_dt_run(yaml("range", "data: {max_sequences: 6}\n"), NULL, NULL), TKD_ERR_MISMATCH,
           "keep workers.* and data.max_sequences as before, or pass --overwrite");
    tkd_dump_summary sum;
    tkd_dt_run_ok(yaml("range", ""), NULL, &sum);
    assert_int_equal(sum.seqs_run, 0);
    tkd_dt_assert_same_cache(ref_cache(), tkd_test_path(tkd_test_group_dir, "range"));
}

/* Settings refused before anything is written, each followed by the change its message names. */
static void test_settings_then_the_named_change(void **state)
{
    (void)state;
    const char *out = tkd_test_path(tkd_test_group_dir, "settings");
    expect(tkd_dt_run(yaml("settings", "device: cuda\n"), NULL, NULL), TKD_ERR_UNSUPPORTED, "use device: cpu (or auto)");
    tkd_dt_run_ok(yaml("settings", "device: cpu\n"), NULL, NULL);
    tkd_dt_assert_same_cache(ref_cache(), out);

    expect(tkd_dt_run(yaml("seqlen", "data: {seq_len: 65}\n"), NULL, NULL), TKD_ERR_CONFIG, "lower data.seq_len");
    tkd_dt_run_ok(yaml("seqlen", "data: {seq_len: 64}\n"), NULL, NULL);

    /* a dataset shorter than one window */
    char y[8192], tiny[4300];
    snprintf(tiny, sizeof tiny, "%s", tkd_dt_random_tokens(tkd_test_group_dir, "tiny.npy", 40, 131, 22));
    const char *tiny_out = tkd_test_path(tkd_test_group_dir, "tiny");
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tiny, tiny_out, "data: {seq_len: 50}\n");
    expect(tkd_dt_run(y, NULL, NULL), TKD_ERR_CONFIG, "use a shorter seq_len or data.last_window: pad");
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tiny, tiny_out, "data: {seq_len: 50, last_window: pad}\n");
    tkd_dt_run_ok(y, NULL, NULL);
    tkd_cache_batch b;
    assert_int_equal(tkd_dt_read_all(tiny_out, &b, NULL), 1);
    tkd_cache_batch_free(&b);
}

/* cache.k above the teacher's vocabulary (64): "lower cache.k". */
static void test_k_above_vocab_lower_it(void **state)
{
    (void)state;
    char teacher[4300], tok[4300], y[8192];
    snprintf(teacher, sizeof teacher, "%s", tkd_dt_odd_teacher(tkd_test_group_dir, "v64", 1.0f, -1));
    snprintf(tok, sizeof tok, "%s", tkd_dt_random_tokens(tkd_test_group_dir, "tok64.npy", 100, 64, 23));
    const char *out = tkd_test_path(tkd_test_group_dir, "k");
    tkd_dt_small_yaml(y, sizeof y, teacher, tok, out, "cache: {k: 100}\n");
    expect(tkd_dt_run(y, NULL, NULL), TKD_ERR_CONFIG, "lower cache.k");
    tkd_dt_small_yaml(y, sizeof y, teacher, tok, out, "cache: {k: 64}\n");
    tkd_dt_run_ok(y, NULL, NULL);
}

/* A token id beyond the teacher's vocabulary: "use the tokenizer of teacher ...". With tokens of
 * that vocabulary the dump runs. */
static void test_token_beyond_vocab_retokenize(void **state)
{
    (void)state;
    int32_t t[100];
    for (int i = 0; i < 100; i++)
        t[i] = i == 37 ? 500 : i;
    const char *npy = tkd_test_path(tkd_test_group_dir, "oov.npy");
    const char *out = tkd_test_path(tkd_test_group_dir, "oov");
    char y[8192];
    tkd_dt_write_npy(npy, t, 0, 100);
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, npy, out, "");
    expect(tkd_dt_run(y, NULL, NULL), TKD_ERR_MISMATCH, "use the tokenizer of teacher");
    t[37] = 37;
    tkd_dt_write_npy(npy, t, 0, 100);
    tkd_dt_run_ok(y, NULL, NULL);
}

/* Config assembly: a bad RANK ("unset it or set workers.* in the config") and each missing
 * required key ("--set key=...") pass once the named change is made. */
static void test_config_messages_then_the_named_change(void **state)
{
    (void)state;
    static const char *const sets[][2] = {
        {"teacher.path: not set", "teacher.path=DIR"},
        {"data.paths: not set", "data.paths=[a.bin]"},
        {"output.dir: not set", "output.dir=DIR"},
    };
    tkd_dump_config cfg;
    memset(&cfg, 0, sizeof cfg);
    assert_int_equal(tkd_config_defaults(&tkd_dump_schema, &cfg), TKD_OK);
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++) {
        expect(tkd_dump_config_finalize(&cfg, NULL), TKD_ERR_CONFIG, sets[i][0]);
        char hint[64];
        snprintf(hint, sizeof hint, "(--set %s)", sets[i][1]); /* the message's own example */
        tkd_test_assert_msg_has(hint);
        assert_int_equal(tkd_config_apply_set(&tkd_dump_schema, &cfg, sets[i][1]), TKD_OK);
    }
    assert_int_equal(tkd_dump_config_finalize(&cfg, NULL), TKD_OK);
    assert_int_equal(setenv("RANK", "x1", 1), 0);
    assert_int_equal(setenv("WORLD_SIZE", "2", 1), 0);
    tkd_error_saved bad; /* asserted once the environment is clean again, for the other tests */
    tkd_error_save(&bad, tkd_dump_config_finalize(&cfg, NULL));
    tkd_status good = tkd_config_apply_set(&tkd_dump_schema, &cfg, "workers.index=1");
    if (good == TKD_OK)
        good = tkd_config_apply_set(&tkd_dump_schema, &cfg, "workers.count=2");
    if (good == TKD_OK)
        good = tkd_dump_config_finalize(&cfg, NULL);
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    assert_int_equal(good, TKD_OK);
    expect(tkd_error_restore(&bad), TKD_ERR_CONFIG,
           "environment RANK=x1: not a number in 0..1048575 — unset it or set workers.* in the config");
    assert_int_equal(cfg.worker_index, 1);
    tkd_config_free(&tkd_dump_schema, &cfg);
}

/* ---- merge ------------------------------------------------------------------------------------- */

static const char *worker_yaml(const char *out, int i, const char *extra)
{
    char e[256];
    snprintf(e, sizeof e, "workers: {index: %d, count: 2}\n%s", i, extra);
    return yaml(out, e);
}

/* A damaged worker marker ("delete it and re-run worker i"), a worker manifest whose saved config
 * does not parse ("re-run that worker with --overwrite") and workers that ran with different
 * settings ("re-run them with --overwrite"): after each action merge gives the one-worker cache. */
static void test_merge_messages_then_the_named_action(void **state)
{
    (void)state;
    const char *out = tkd_test_path(tkd_test_group_dir, "merge");
    tkd_dt_run_ok(worker_yaml("merge", 0, ""), NULL, NULL);
    tkd_dt_run_ok(worker_yaml("merge", 1, ""), NULL, NULL);

    tkd_test_write_text(tkd_test_path(out, "worker-1.done"), "worker: 1\n");
    expect(tkd_dump_merge(out, NULL, NULL), TKD_ERR_FORMAT, "delete it and re-run worker 1");
    assert_int_equal(unlink(tkd_test_path(out, "worker-1.done")), 0);
    tkd_dt_run_ok(worker_yaml("merge", 1, ""), NULL, NULL);
    assert_int_equal(tkd_dump_merge(out, NULL, NULL), TKD_OK);
    tkd_dt_assert_same_cache(ref_cache(), out);

    edit_file(tkd_test_path(out, "manifest.worker-0.yaml"), "config: |", "    k: 8", "    kk: 8");
    expect(tkd_dump_merge(out, NULL, NULL), TKD_ERR_FORMAT, "re-run that worker with --overwrite");
    tkd_dump_opts ow = {.overwrite = true};
    tkd_dt_run_ok(worker_yaml("merge", 0, ""), &ow, NULL);
    assert_int_equal(tkd_dump_merge(out, NULL, NULL), TKD_OK);
    tkd_dt_assert_same_cache(ref_cache(), out);

    /* worker 0 again with a smaller data.max_sequences: its range ends at 4, worker 1's starts at 8 */
    tkd_dt_run_ok(worker_yaml("merge", 0, "data: {max_sequences: 10}\n"), &ow, NULL);
    expect(tkd_dump_merge(out, NULL, NULL), TKD_ERR_MISMATCH, "the workers ran with different settings; re-run them with --overwrite");
    tkd_dt_run_ok(worker_yaml("merge", 0, ""), &ow, NULL);
    tkd_dt_run_ok(worker_yaml("merge", 1, ""), &ow, NULL);
    assert_int_equal(tkd_dump_merge(out, NULL, NULL), TKD_OK);
    tkd_dt_assert_same_cache(ref_cache(), out);
}

/* ---- the cache reader (what student-train says) -------------------------------------------------- */

static tkd_status open_reader(const char *dir)
{
    tkd_cache_reader *r = NULL;
    tkd_status st = tkd_cache_reader_open(&r, dir, NULL);
    tkd_cache_reader_close(r);
    return st;
}

/* No manifest ("teacher-dump writes one"), a dump stopped before its first shard ("run teacher-dump
 * until one completes"), a truncated shard (the repair command): each fixed by running teacher-dump. */
static void test_reader_messages_then_teacher_dump(void **state)
{
    (void)state;
    const char *out = tkd_test_path(tkd_test_group_dir, "reader");
    expect(open_reader(out), TKD_ERR_NOT_FOUND, "no manifest — not a teacher cache directory (teacher-dump writes one)");
    tkd_dump_opts stop = {.stop_after_batches = 1};
    assert_int_equal(tkd_dt_run(yaml("reader", ""), &stop, NULL), TKD_ERR_INTERRUPTED);
    expect(open_reader(out), TKD_ERR_FORMAT, "lists no finished shard — run teacher-dump until one completes");
    tkd_dt_run_ok(yaml("reader", ""), NULL, NULL);
    assert_int_equal(open_reader(out), TKD_OK);

    assert_int_equal(truncate(tkd_test_path(out, "shard-00002.h5"), 1000), 0);
    expect(open_reader(out), TKD_ERR_FORMAT, "shard-00002.h5: 1000 bytes, the manifest lists ");
    tkd_test_assert_msg_has("truncated or was replaced; " TKD_CACHE_REPAIR_HINT);
    tkd_dump_summary sum;
    tkd_dt_run_ok(yaml("reader", ""), NULL, &sum);
    assert_int_equal(sum.shards_damaged, 1);
    tkd_dt_assert_same_cache(ref_cache(), out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unreadable_manifest_delete_it),
        cmocka_unit_test(test_unreadable_saved_config_overwrite),
        cmocka_unit_test(test_range_changed_keep_it),
        cmocka_unit_test(test_settings_then_the_named_change),
        cmocka_unit_test(test_k_above_vocab_lower_it),
        cmocka_unit_test(test_token_beyond_vocab_retokenize),
        cmocka_unit_test(test_config_messages_then_the_named_change),
        cmocka_unit_test(test_merge_messages_then_the_named_action),
        cmocka_unit_test(test_reader_messages_then_teacher_dump),
    };
    return cmocka_run_group_tests(tests, tkd_test_group_dir_setup, tkd_test_group_dir_teardown);
}
