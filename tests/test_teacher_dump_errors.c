/* test_teacher_dump_errors.c — teacher-dump in-process, what it refuses: bad inputs and settings,
 * a cache another config or another process owns (--overwrite, the writer lock), and teacher values
 * the cache cannot hold (beyond half, rounded too coarsely, an LSE beyond float32, NaN). The caches it
 * writes and resumes are test_teacher_dump.c's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "common/fileio.h"
#include "common/signals.h"
#include "kernels/backend.h"
#include "teacher_cache/dump_merge.h"
#include "teacher_cache/dump_dir.h"
#include "tests/dump_testutil.h"

#define run_ok tkd_dt_run_ok

static tkd_status run_status(const char *yaml, const tkd_dump_opts *opts) { return tkd_dt_run(yaml, opts, NULL); }

/* ---- bad inputs ---------------------------------------------------------------------------------- */

static void test_token_out_of_vocab(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    int32_t t[200];
    for (int i = 0; i < 200; i++)
        t[i] = i % 100;
    t[137] = 131; /* the llama fixture has V = 131 */
    char npy[4200], out[4200], y[8192];
    snprintf(npy, sizeof npy, "%s/bad.npy", dir);
    snprintf(out, sizeof out, "%s/cache", dir);
    tkd_dt_write_npy(npy, t, 0, 200);
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, npy, out, "");
    assert_int_equal(run_status(y, NULL), TKD_ERR_MISMATCH);
    assert_non_null(strstr(tkd_error_msg(), "bad.npy"));
    assert_non_null(strstr(tkd_error_msg(), "137"));
    assert_non_null(strstr(tkd_error_msg(), "vocab"));
}

/* A dump refused for its inputs (a token file that is not there, a tokenizer that does not load)
 * leaves no directory behind: neither output.dir nor the folders above it that the run made; a
 * folder the user had stays (issue 26). */
static void test_refused_dump_leaves_no_directory(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("dump-refused");
    char out[4200], y[8192], extra[9000], missing[4200], tok[4200], text[4200];
    snprintf(missing, sizeof missing, "%s/missing.npy", dir);
    snprintf(out, sizeof out, "%s/new/caches/c1", dir);
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, missing, out, "");
    assert_int_equal(run_status(y, NULL), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("missing.npy: cannot open token file");
    assert_false(tkd_file_exists(tkd_test_path(dir, "new")));

    /* a tokenizer.json that does not parse, into a folder the user made: it stays, empty */
    snprintf(tok, sizeof tok, "%s/tok", dir);
    assert_int_equal(tkd_mkdir_p(tok), TKD_OK);
    tkd_test_write_text(tkd_test_path(tok, "tokenizer.json"), "{\"model\": ");
    snprintf(text, sizeof text, "%s/doc.txt", dir);
    tkd_test_write_text(text, "some text to tokenize");
    assert_int_equal(tkd_mkdir_p(tkd_test_path(dir, "have")), TKD_OK);
    snprintf(out, sizeof out, "%s/have/c2", dir);
    snprintf(extra, sizeof extra, "data: {paths: ['%s'], tokenizer: '%s'}\n", text, tok);
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, "unused", out, extra);
    assert_int_not_equal(run_status(y, NULL), TKD_OK);
    tkd_test_assert_msg_has("data.tokenizer: ");
    tkd_test_assert_msg_has("tokenizer.json");
    assert_false(tkd_file_exists(out));
    assert_true(tkd_file_exists(tkd_test_path(dir, "have")));
    /* an output.dir that was there already (empty) stays, and gets nothing */
    assert_int_equal(tkd_mkdir_p(out), TKD_OK);
    assert_int_not_equal(run_status(y, NULL), TKD_OK);
    assert_true(tkd_file_exists(out));
    tkd_test_rmtree(dir);
    free(dir);
}

/* Ctrl-C while the inputs are still being read: the message says what was being read (there is no
 * cache yet to report on) and nothing is written. */
static void test_interrupt_while_reading_inputs(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char out[4200], y[8192];
    tkd_dt_small_case(dir, 120, 3, out, sizeof out, y, sizeof y, "");
    assert_int_equal(tkd_signals_install(), TKD_OK);
    raise(SIGINT);
    tkd_status st = run_status(y, NULL);
    tkd_signals_uninstall();
    assert_int_equal(st, TKD_ERR_INTERRUPTED);
    tkd_test_assert_msg_has("data.paths: ");
    tkd_test_assert_msg_has("tok.npy: interrupted by SIGINT while reading the token file");
    /* the directory and its lock come first (a second writer is refused before any hashing), but
     * no manifest or shard is written */
    assert_false(tkd_file_exists(tkd_test_path(out, "manifest.yaml")));
    assert_int_equal(tkd_dt_count_suffix(out, ".h5"), 0);
}

static void test_other_config_needs_overwrite(void **state)
{
    char out[4200], y[8192];
    const char *tok = tkd_dt_small_case(*state, 120, 2, out, sizeof out, y, sizeof y, "");
    run_ok(y, NULL, NULL);

    /* another k */
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tok, out, "cache: {k: 4}\n");
    assert_int_equal(run_status(y, NULL), TKD_ERR_MISMATCH);
    assert_non_null(strstr(tkd_error_msg(), "manifest.yaml"));
    assert_non_null(strstr(tkd_error_msg(), "--overwrite"));
    /* another teacher (another vocabulary) */
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_QWEN, tok, out, "");
    assert_int_equal(run_status(y, NULL), TKD_ERR_MISMATCH);
    assert_non_null(strstr(tkd_error_msg(), "vocab"));
    /* another shard size: not in the identity, still refused */
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tok, out, "cache: {shard_sequences: 3}\n");
    assert_int_equal(run_status(y, NULL), TKD_ERR_MISMATCH);
    assert_non_null(strstr(tkd_error_msg(), "cache.shard_sequences"));

    /* --overwrite replaces it: the old shards are gone, the new cache reads back with k 4 */
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tok, out, "cache: {k: 4, shard_sequences: 3}\n");
    tkd_dump_opts ow = {.overwrite = true};
    run_ok(y, &ow, NULL);
    tkd_cache_batch b;
    tkd_cache_manifest m;
    assert_int_equal(tkd_dt_read_all(out, &b, &m), 7);
    assert_int_equal(m.id.k, 4);
    assert_int_equal(m.num_shards, 3);
    assert_int_equal(tkd_dt_count_suffix(out, ".h5"), 3);
    tkd_cache_batch_free(&b);
    tkd_cache_manifest_free(&m);
}

/* --overwrite removes only a cache teacher-dump made, and only its own files: a user's file among
 * them (here one the old "manifest*.yaml" clean-up took) makes it refuse with nothing removed; a
 * directory of other files is never taken as output.dir; a cache of an older version without the
 * marker is recognised by its names and manifest. */
static void test_overwrite_removes_only_ours(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char out[4200], notes[4300], y[8192];
    const char *tok = tkd_dt_small_case(dir, 120, 2, out, sizeof out, y, sizeof y, "");
    run_ok(y, NULL, NULL);
    assert_int_equal(tkd_dt_count_suffix(out, ".h5"), 2);

    snprintf(notes, sizeof notes, "%s/manifest-notes.yaml", out);
    tkd_test_write_text(notes, "mine\n");
    tkd_dump_opts ow = {.overwrite = true};
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tok, out, "cache: {k: 4}\n");
    assert_int_equal(run_status(y, &ow), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(out);
    tkd_test_assert_msg_has("'manifest-notes.yaml'");
    assert_true(tkd_file_exists(notes));
    assert_int_equal(tkd_dt_count_suffix(out, ".h5"), 2);
    assert_true(tkd_file_exists(tkd_test_path(out, "manifest.yaml")));
    assert_int_equal(remove(notes), 0);
    assert_true(tkd_file_exists(tkd_test_path(out, ".topkd-cache")));

    /* an older version's cache (no marker): taken over, then replaced */
    assert_int_equal(remove(tkd_test_path(out, ".topkd-cache")), 0);
    run_ok(y, &ow, NULL);
    assert_true(tkd_file_exists(tkd_test_path(out, ".topkd-cache")));
    tkd_cache_batch b;
    tkd_cache_manifest m;
    assert_int_equal(tkd_dt_read_all(out, &b, &m), 7);
    assert_int_equal(m.id.k, 4);
    tkd_cache_batch_free(&b);
    tkd_cache_manifest_free(&m);

    /* a directory of other files (the token file's own) is refused before anything is written */
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tok, dir, "");
    assert_int_equal(run_status(y, &ow), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("not a teacher cache");
    assert_false(tkd_file_exists(tkd_test_path(dir, "manifest.yaml")));
    assert_false(tkd_file_exists(tkd_test_path(dir, ".topkd-cache")));
    assert_true(tkd_file_exists(tok));
    /* nor does merge leave a lock file in a directory that holds nothing to merge */
    assert_int_equal(tkd_dump_merge(dir, NULL, NULL), TKD_ERR_NOT_FOUND);
    assert_false(tkd_file_exists(tkd_test_path(dir, ".topkd-lock")));
}

/* One writer per cache directory: while another process holds the lock, a dump refuses at once
 * naming it; a worker of a split dump is refused only by a writer of its own part (or a single
 * writer); once the holder is SIGKILLed, nothing stale is left. */
static void test_one_writer_per_cache(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    const char *tok = tkd_dt_random_tokens(dir, "tok.npy", 120, 131, 2);
    char out[4200], y[8192], want[64];
    snprintf(out, sizeof out, "%s/cache", dir);
    assert_int_equal(tkd_owned_dir_claim(&tkd_dump_dir_kind, out), TKD_OK); /* as the holder's dump did */
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tok, out, "");

    pid_t pid = tkd_test_lock_holder(out, ".topkd-lock", NULL);
    snprintf(want, sizeof want, "another teacher-dump (pid %ld)", (long)pid);
    assert_int_equal(run_status(y, NULL), TKD_ERR_BUSY);
    tkd_test_assert_msg_has(want);
    assert_false(tkd_file_exists(tkd_test_path(out, "manifest.yaml")));
    tkd_test_kill_holder(pid);
    run_ok(y, NULL, NULL);

    /* worker 1 of 2 is being written by someone else: worker 0 goes ahead, worker 1 and a
     * single-worker dump (which would rewrite worker 1's shards) are refused */
    char w0[8400], w1[8400];
    snprintf(w0, sizeof w0, "%s\n---\nworkers: {index: 0, count: 2}\n", y);
    snprintf(w1, sizeof w1, "%s\n---\nworkers: {index: 1, count: 2}\n", y);
    tkd_dump_opts ow = {.overwrite = true};
    pid = tkd_test_lock_holder(out, ".topkd-lock", "worker-1");
    snprintf(want, sizeof want, "(pid %ld)", (long)pid);
    assert_int_equal(run_status(w1, &ow), TKD_ERR_BUSY);
    tkd_test_assert_msg_has(want);
    assert_int_equal(run_status(y, &ow), TKD_ERR_BUSY);
    tkd_test_assert_msg_has(want);
    assert_int_equal(run_status(w0, &ow), TKD_OK);
    assert_true(tkd_file_exists(tkd_test_path(out, "worker-0.done")));
    tkd_test_kill_holder(pid);
    assert_int_equal(run_status(w1, NULL), TKD_OK);
    int64_t nseq = 0;
    assert_int_equal(tkd_dump_merge(out, &nseq, NULL), TKD_OK);
    assert_int_equal(nseq, 7);
}

static void test_bad_settings(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char out[4200], y[8192];
    const char *tok = tkd_dt_small_case(dir, 100, 3, out, sizeof out, y, sizeof y, "device: cuda\n");
    if (tkd_backend_cuda_devices() == 0) { /* where a GPU answers, the GPU tests run this */
        assert_int_equal(run_status(y, NULL), TKD_ERR_UNSUPPORTED);
        assert_non_null(strstr(tkd_error_msg(), "device: cuda asked for"));
        assert_non_null(strstr(tkd_error_msg(), "use device: cpu"));
    }
    /* longer sequences than the teacher's positions */
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tok, out, "data: {seq_len: 65}\n");
    assert_int_equal(run_status(y, NULL), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "max_position_embeddings"));
    /* a dataset too short for one window */
    const char *tiny = tkd_dt_random_tokens(dir, "tiny.npy", 40, 131, 4);
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tiny, out, "data: {seq_len: 50}\n");
    assert_int_equal(run_status(y, NULL), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "no window"));
    /* a teacher directory that does not exist */
    tkd_dt_small_yaml(y, sizeof y, "/nonexistent/teacher", tok, out, "");
    assert_int_not_equal(run_status(y, NULL), TKD_OK);
    assert_non_null(strstr(tkd_error_msg(), "/nonexistent/teacher"));
}

/* ---- values the cache cannot hold ---------------------------------------------------------------- */

/* A refused dump and the action its message proposes: the dump of teacher over tok into out with the
 * YAML `refused` (options o) stops with TKD_ERR_NUMERIC, its message holding frags, and leaves no
 * shard; then, unless action is NULL, the dump with the YAML `action` and --overwrite runs. */
typedef struct refusal {
    const char *teacher, *tok, *out, *refused;
    const tkd_dump_opts *o;
    const char *action;
} refusal;

static void expect_refusal(char *y, size_t cap, refusal r, const char *const *frags)
{
    tkd_dt_small_yaml(y, cap, r.teacher, r.tok, r.out, r.refused);
    tkd_test_expect_error(run_status(y, r.o), TKD_ERR_NUMERIC, frags);
    assert_int_equal(tkd_dt_count_suffix(r.out, ".h5"), 0);
    if (r.action) {
        tkd_dt_small_yaml(y, cap, r.teacher, r.tok, r.out, r.action);
        run_ok(y, &(tkd_dump_opts){.overwrite = true}, NULL);
    }
}

/* A teacher whose logits are about 1e6: half cannot hold them (largest 65504) and the run stops at
 * the first one, naming it, with no shard written. bfloat16 has their range but rounds them by up to
 * 2048 (8 significant bits), which would scale a stored probability by e^2048: it is refused too,
 * and float32 (what both messages propose) holds them exactly. */
static void test_logits_beyond_half(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char teacher[4300], tok[4300], half[4300], f32[4300], y[8192];
    snprintf(teacher, sizeof teacher, "%s", tkd_dt_odd_teacher(dir, "big", 1e7f, -1));
    snprintf(tok, sizeof tok, "%s", tkd_dt_random_tokens(dir, "tok.npy", 200, 64, 6));
    snprintf(half, sizeof half, "%s/half", dir);
    snprintf(f32, sizeof f32, "%s/f32", dir);

    tkd_dt_small_yaml(y, sizeof y, teacher, tok, f32, "cache: {logits_dtype: float32}\n");
    run_ok(y, NULL, NULL);
    tkd_cache_batch want;
    int64_t n = tkd_dt_read_all(f32, &want, NULL);
    assert_true(fabsf(want.topk_logits[0]) > 65504.0f); /* the case under test: sequence 0, position 0 */

    expect_refusal(y, sizeof y, (refusal){teacher, tok, half, "", NULL, NULL},
                   TKD_TEST_FRAGS("sequence 0, position 0: the teacher's logit ",
                                  "does not fit cache.logits_dtype half (largest magnitude 65504)",
                                  "set cache.logits_dtype: float32, which holds it"));
    assert_int_equal(tkd_dt_count_suffix(half, ".tmp"), 0);

    tkd_dump_opts ow = {.overwrite = true};
    expect_refusal(y, sizeof y,
                   (refusal){teacher, tok, half, "cache: {logits_dtype: bfloat16}\n", &ow,
                             "cache: {logits_dtype: float32}\n"},
                   TKD_TEST_FRAGS("sequence 0, position 0: the teacher's logit ",
                                  "in cache.logits_dtype bfloat16",
                                  "more than 0.125 x cache.temperature",
                                  "set cache.logits_dtype: float32, which holds it"));

    /* the action (float32, replacing the failed, empty cache) gave the same values as the first run */
    tkd_cache_batch got;
    assert_int_equal(tkd_dt_read_all(half, &got, NULL), n);
    size_t nk = (size_t)n * 16 * 8;
    assert_memory_equal(got.topk_indices, want.topk_indices, nk * sizeof *got.topk_indices);
    assert_memory_equal(got.topk_logits, want.topk_logits, nk * sizeof *got.topk_logits);
    tkd_cache_batch_free(&got);
    tkd_cache_batch_free(&want);
}

/* Logits near 45,000 are in half's range, but half's spacing there is 32: stored ±16 off, the row's
 * probabilities exp(t − lse) would sum to millions and tail / sampled train on that (issue 20). The
 * dump refuses the first such logit, naming it and what it would be stored as; float32 holds it.
 * A teacher whose logits are about 100 is held by half (spacing 1/16) but not by bfloat16 (spacing
 * 1/2): the rule is the rounding, not the range. The same teacher at cache.temperature 8 is held by
 * bfloat16 too: the bound is in units of τ, as exp(t/τ − lse) is. */
static void test_logits_rounded_too_coarsely(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char teacher[4300], tok[4300], out[4300], y[8192];
    snprintf(tok, sizeof tok, "%s", tkd_dt_random_tokens(dir, "tok.npy", 200, 64, 6));
    snprintf(out, sizeof out, "%s/out", dir);
    /* the hidden states do not depend on the head: logits scale with head_scale; find the scale that
     * puts the first top-1 logit at 45,000.3 */
    snprintf(teacher, sizeof teacher, "%s", tkd_dt_odd_teacher(dir, "unit", 1.0f, -1));
    tkd_dt_small_yaml(y, sizeof y, teacher, tok, out, "cache: {logits_dtype: float32}\n");
    run_ok(y, NULL, NULL);
    tkd_cache_batch unit;
    tkd_dt_read_all(out, &unit, NULL);
    const float x1 = unit.topk_logits[0];
    tkd_cache_batch_free(&unit);
    assert_true(fabsf(x1) > 0.01f);
    tkd_dump_opts ow = {.overwrite = true};

    snprintf(teacher, sizeof teacher, "%s", tkd_dt_odd_teacher(dir, "t45k", 45000.3f / x1, -1));
    expect_refusal(y, sizeof y,
                   (refusal){teacher, tok, out, "", &ow, "cache: {logits_dtype: float32, tail_samples: 4}\n"},
                   TKD_TEST_FRAGS("sequence 0, position 0: the teacher's logit 45000.",
                                  "(top-k column 0) would be stored as ",
                                  "in cache.logits_dtype half",
                                  "set cache.logits_dtype: float32, which holds it"));

    snprintf(teacher, sizeof teacher, "%s", tkd_dt_odd_teacher(dir, "t100", 100.3f / x1, -1));
    tkd_dt_small_yaml(y, sizeof y, teacher, tok, out, "cache: {logits_dtype: bfloat16}\n");
    tkd_test_expect_error(run_status(y, &ow), TKD_ERR_NUMERIC,
                          TKD_TEST_FRAGS("in cache.logits_dtype bfloat16",
                                         "set cache.logits_dtype: half or float32, which hold it"));
    tkd_dt_small_yaml(y, sizeof y, teacher, tok, out, "cache: {logits_dtype: half}\n");
    run_ok(y, &ow, NULL);
    tkd_cache_batch got;
    int64_t n = tkd_dt_read_all(out, &got, NULL);
    /* what the trainer checks: every row's stored mass within the promised bound */
    for (int64_t r = 0; r < n * 16; r++) {
        double mass = 0.0;
        for (int j = 0; j < 8; j++)
            mass += exp((double)got.topk_logits[r * 8 + j] - got.lse[r]);
        assert_true(mass <= TKD_KL_MASS_MAX);
    }
    tkd_cache_batch_free(&got);
    tkd_dt_small_yaml(y, sizeof y, teacher, tok, out, "cache: {logits_dtype: bfloat16, temperature: 8}\n");
    run_ok(y, &ow, NULL);
}

/* Logits near 1e36 at cache.temperature 0.001: the LSE (≈ 1e39) does not fit float32. The run
 * stops naming it; the proposed action (a higher temperature) works. */
static void test_lse_beyond_float32(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char teacher[4300], tok[4300], out[4300], y[8192];
    snprintf(teacher, sizeof teacher, "%s", tkd_dt_odd_teacher(dir, "huge", 1e37f, -1));
    snprintf(tok, sizeof tok, "%s", tkd_dt_random_tokens(dir, "tok.npy", 200, 64, 7));
    snprintf(out, sizeof out, "%s/out", dir);
    expect_refusal(y, sizeof y,
                   (refusal){teacher, tok, out, "cache: {logits_dtype: float32, temperature: 0.001}\n", NULL,
                             "cache: {logits_dtype: float32, temperature: 1}\n"},
                   TKD_TEST_FRAGS("sequence 0, position 0: the log-sum-exp of the teacher's logits at "
                                  "cache.temperature 0.001 is inf",
                                  "raise cache.temperature"));
    tkd_cache_batch b;
    int64_t n = tkd_dt_read_all(out, &b, NULL);
    for (int64_t i = 0; i < n * 16; i++)
        assert_true(isfinite(b.lse[i]) && b.lse[i] > 1e30f);
    tkd_cache_batch_free(&b);
}

/* NaN in the teacher's output: token 9's embedding is NaN and token 9 first appears as the input at
 * sequence 2, position 7, so the hidden states (and every logit) turn NaN from there. The message
 * names that place; with the teacher's weights fixed the dump runs (after the --overwrite that the
 * identity check then asks for, as the teacher's digest changed). */
static void test_nan_in_teacher_output(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    int32_t t[200];
    for (int i = 0; i < 200; i++)
        t[i] = (i * 13 + 5) % 64 == 9 ? 10 : (i * 13 + 5) % 64;
    t[2 * 16 + 7] = 9;
    char npy[4300], teacher[4300], out[4300], y[8192];
    snprintf(npy, sizeof npy, "%s/tok.npy", dir);
    tkd_dt_write_npy(npy, t, 0, 200);
    snprintf(teacher, sizeof teacher, "%s", tkd_dt_odd_teacher(dir, "teacher", 1.0f, 9));
    snprintf(out, sizeof out, "%s/out", dir);
    /* the logit prints as nan or -nan */
    expect_refusal(y, sizeof y, (refusal){teacher, npy, out, "", NULL, NULL},
                   TKD_TEST_FRAGS("sequence 2, position 7: the teacher's logit for token 0 is ",
                                  "nan —",
                                  "check the teacher's weights"));

    tkd_dt_odd_teacher(dir, "teacher", 1.0f, -1); /* the weights fixed */
    assert_int_equal(run_status(y, NULL), TKD_ERR_MISMATCH);
    tkd_test_assert_msg_has("pass --overwrite");
    tkd_dump_opts ow = {.overwrite = true};
    run_ok(y, &ow, NULL);
    tkd_cache_batch b;
    assert_int_equal(tkd_dt_read_all(out, &b, NULL), 12);
    tkd_cache_batch_free(&b);
}

TKD_TEST_MAIN_EACH_DIR(test_token_out_of_vocab, test_refused_dump_leaves_no_directory,
    test_interrupt_while_reading_inputs, test_other_config_needs_overwrite, test_overwrite_removes_only_ours,
    test_one_writer_per_cache, test_bad_settings, test_logits_beyond_half, test_logits_rounded_too_coarsely,
    test_lse_beyond_float32, test_nan_in_teacher_output)
