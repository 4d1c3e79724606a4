/* test_student_best.c — train.keep_best and train.early_stop_patience (docs/student-train.md,
 * "Best checkpoint and early stopping"): on a student that overfits four training sequences, so
 * that its validation CE falls and then rises, checkpoint-best/ holds the evaluation of the lowest
 * val_ce beside the last checkpoint; a run killed (SIGKILL, the test build's hook) and resumed keeps
 * the same best step and writes the same files as one never stopped; early stopping ends the run
 * patience evaluations after the best one, the same way after a kill, and a --resume of it has
 * nothing to do; the settings that cannot work are refused with their key. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "student_train/train.h"
#include "tests/testutil.h"

#define BIN TKD_BINARY_DIR "/bin/student-train-testhooks"
#define KILL_ENV "TKD_TRAIN_TEST_KILL_AFTER_STEPS"

/* A cache in <dir>/cache and a config <dir>/c.yaml of a tiny student that overfits: 4 training
 * sequences (one batch per epoch) at a high learning rate, evaluated every 4 steps on 8 held-out
 * ones, a checkpoint every 4 steps, 40 steps. extra: more YAML lines. */
static void make_fixture(const char *dir, const char *extra)
{
    char cache[4200], path[4200], text[9000];
    snprintf(cache, sizeof cache, "%s/cache", dir);
    tkd_test_teacher_opts o = {.vocab = 64, .hidden = 16, .seq_len = 16, .k = 8, .temperature = 1.0f,
                               .num_seq = 40, .shard_seqs = 20, .seed = 11};
    assert_int_equal(tkd_test_teacher_cache(cache, &o), TKD_OK);
    snprintf(path, sizeof path, "%s/c.yaml", dir);
    snprintf(text, sizeof text,
             "run: {dir: '%s/runs'}\n"
             "data: {cache: '%s', max_sequences: 4, val_fraction: 0.2}\n"
             "model: {hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 2,\n"
             "        max_position_embeddings: 16}\n"
             "kd: {alpha: 0.5}\n"
             "optim: {lr: 1e-3, min_lr: 1e-3, warmup_steps: 0, weight_decay: 0}\n"
             "train: {batch_size: 4, max_steps: 40, eval_interval: 4, checkpoint_interval: 4, log_interval: 1,\n"
             "        keep_best: true}\n"
             "device: cpu\n%s",
             dir, cache, extra);
    tkd_test_write_text(path, text);
}

/* Runs the test build of student-train on <dir>/c.yaml as run `name` (resume: --resume) with the
 * kill hook at kill_after steps (0: none); returns its exit code, its output in *out (malloc'd). */
static int run_cli(const char *dir, const char *name, int resume, int kill_after, char **out)
{
    char cfg[4200], set[300], log[4300], env[64];
    snprintf(cfg, sizeof cfg, "%s/c.yaml", dir);
    snprintf(set, sizeof set, "run.name=%s", name);
    snprintf(log, sizeof log, "%s/%s-%d.out", dir, name, resume);
    snprintf(env, sizeof env, KILL_ENV "=%d", kill_after);
    const char *args[] = {"-q", "--config", cfg, "--set", set, resume ? "--resume" : NULL, NULL};
    int rc = tkd_test_run(BIN, args, kill_after ? env : NULL, log);
    *out = tkd_test_slurp(log, NULL);
    return rc;
}

static const char *in_run(const char *dir, const char *name, const char *file)
{
    static char buf[2][4600];
    static int k;
    k ^= 1;
    snprintf(buf[k], sizeof buf[k], "%s/runs/%s/%s", dir, name, file);
    return buf[k];
}

/* The value of "key=" in the RESULT line of text; fails when it is missing. */
static double result_field(const char *text, const char *key)
{
    const char *r = strstr(text, "RESULT ");
    if (!r)
        fail_msg("no RESULT line in:\n%s", text);
    char pat[64];
    snprintf(pat, sizeof pat, " %s=", key);
    const char *v = strstr(r, pat);
    const char *nl = strchr(r, '\n');
    if (!v || (nl && v > nl))
        fail_msg("no %s in %.*s", key, (int)(nl ? nl - r : 200), r);
    return atof(v + strlen(pat));
}

/* The step of the lowest val_ce among the run's evaluation records (the first of equals). */
static long long argmin_eval(const char *metrics, double *best)
{
    double ce[64], step[64];
    int n = tkd_test_metrics(metrics, "eval", "val_ce", ce, 64);
    assert_int_equal(tkd_test_metrics(metrics, "eval", "step", step, 64), n);
    assert_true(n > 0);
    int b = 0;
    for (int i = 1; i < n; i++)
        if (ce[i] < ce[b])
            b = i;
    *best = ce[b];
    return (long long)step[b];
}

/* The three files of a checkpoint directory equal byte for byte between two runs. */
static void assert_same_checkpoint(const char *dir, const char *a, const char *b, const char *ckpt)
{
    static const char *const files[] = {"model.safetensors", "optimizer.safetensors", "state.json"};
    for (int i = 0; i < 3; i++) {
        char fa[4600], fb[4600];
        snprintf(fa, sizeof fa, "%s/%s", in_run(dir, a, ckpt), files[i]);
        snprintf(fb, sizeof fb, "%s/%s", in_run(dir, b, ckpt), files[i]);
        if (!tkd_test_files_equal(fa, fb))
            fail_msg("%s/%s differs between runs %s and %s", ckpt, files[i], a, b);
    }
}

static void assert_same_metrics(const char *dir, const char *a, const char *b)
{
    char *ma = tkd_test_metrics_without_time(in_run(dir, a, "metrics.jsonl"));
    char *mb = tkd_test_metrics_without_time(in_run(dir, b, "metrics.jsonl"));
    assert_string_equal(ma, mb);
    free(ma);
    free(mb);
}

/* checkpoint-best/ is the lowest val_ce's step (before the last: the student overfits; step 16 when
 * written), reported in the RESULT line and the eval records; a run killed before or after that
 * step and resumed ends with the same best step and the same files. */
static void test_best_checkpoint_survives_a_kill(void **state)
{
    const char *dir = *state;
    make_fixture(dir, "");
    char *straight = NULL, *killed = NULL, *resumed = NULL;
    assert_int_equal(run_cli(dir, "straight", 0, 0, &straight), 0);
    double best_ce;
    long long best = argmin_eval(in_run(dir, "straight", "metrics.jsonl"), &best_ce);
    printf("  best val_ce %.4f at step %lld of 40\n", best_ce, best);
    assert_true(best > 0 && best < 40); /* the fixture overfits: otherwise the test shows nothing */
    assert_int_equal((long long)result_field(straight, "best_step"), best);
    assert_true(tkd_test_close(result_field(straight, "best_val_ce"), best_ce, 1e-6, 0));
    assert_int_equal((long long)result_field(straight, "steps"), 40);
    char *st = tkd_test_slurp(in_run(dir, "straight", "checkpoint-best/state.json"), NULL);
    char want[64];
    snprintf(want, sizeof want, "\"step\":\t\"%lld\"", best);
    if (!strstr(st, want))
        fail_msg("checkpoint-best/state.json is not step %lld:\n%s", best, st);
    free(st);
    double bs[64];
    int ne = tkd_test_metrics(in_run(dir, "straight", "metrics.jsonl"), "eval", "best_step", bs, 64);
    assert_int_equal(ne, 10);
    assert_int_equal((long long)bs[ne - 1], best);

    /* killed after step 14 (the resumed run improves on its best of step 12) and after step 18 (it
     * must remember the best of step 16: a later evaluation is worse), each resumed */
    assert_true(best > 12 && best < 18);
    const char *names[] = {"killed-14", "killed-18"};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(run_cli(dir, names[i], 0, i ? 18 : 14, &killed), 1000 + 9);
        assert_int_equal(access(in_run(dir, names[i], "checkpoint/state.json"), F_OK), 0);
        assert_int_equal(run_cli(dir, names[i], 1, 0, &resumed), 0);
        assert_int_equal((long long)result_field(resumed, "best_step"), best);
        assert_true(result_field(resumed, "best_val_ce") == result_field(straight, "best_val_ce"));
        assert_same_checkpoint(dir, "straight", names[i], "checkpoint-best");
        assert_same_checkpoint(dir, "straight", names[i], "checkpoint");
        assert_same_metrics(dir, "straight", names[i]);
        free(killed);
        free(resumed);
    }
    free(straight);
}

/* Patience 2 at an evaluation every 4 steps: the run ends 8 steps after the best evaluation, with
 * early_stop=1; killed in the middle it stops at the same step with the same files; a --resume of
 * the stopped run has nothing to do. */
static void test_early_stop(void **state)
{
    const char *dir = *state;
    make_fixture(dir, "train.early_stop_patience: 2\n");
    char *straight = NULL, *killed = NULL, *resumed = NULL, *again = NULL;
    assert_int_equal(run_cli(dir, "straight", 0, 0, &straight), 0);
    long long best = (long long)result_field(straight, "best_step");
    long long steps = (long long)result_field(straight, "steps");
    printf("  best step %lld, stopped at step %lld of 40\n", best, steps);
    assert_int_equal(steps, best + 8);
    assert_true(steps < 40);
    assert_true(result_field(straight, "early_stop") == 1);
    double ce[64], step[64];
    int n = tkd_test_metrics(in_run(dir, "straight", "metrics.jsonl"), "eval", "val_ce", ce, 64);
    assert_int_equal(tkd_test_metrics(in_run(dir, "straight", "metrics.jsonl"), "eval", "step", step, 64), n);
    assert_int_equal((long long)step[n - 1], steps); /* the stop's evaluation is the last record */
    assert_true(ce[n - 1] > ce[n - 3] - 1e-12 && ce[n - 2] >= ce[n - 3] - 1e-12);

    /* killed one step after the first evaluation without improvement, then resumed */
    assert_int_equal(run_cli(dir, "split", 0, (int)best + 5, &killed), 1000 + 9);
    assert_int_equal(run_cli(dir, "split", 1, 0, &resumed), 0);
    assert_int_equal((long long)result_field(resumed, "steps"), steps);
    assert_int_equal((long long)result_field(resumed, "best_step"), best);
    assert_true(result_field(resumed, "early_stop") == 1);
    assert_same_checkpoint(dir, "straight", "split", "checkpoint-best");
    assert_same_checkpoint(dir, "straight", "split", "checkpoint");
    assert_same_metrics(dir, "straight", "split");

    /* a resume of the stopped run finds it finished */
    assert_int_equal(run_cli(dir, "split", 1, 0, &again), 0);
    if (!strstr(again, "finished at step"))
        fail_msg("resume of an early-stopped run: %s", again);
    assert_null(strstr(again, "RESULT"));
    assert_same_metrics(dir, "straight", "split");
    free(straight);
    free(killed);
    free(resumed);
    free(again);
}

/* Settings that cannot work are config errors naming the key, before anything is written. */
static void test_best_refusals(void **state)
{
    const char *dir = *state;
    char cache[4200], set_cache[4300], runs[4200];
    snprintf(cache, sizeof cache, "%s/cache", dir);
    snprintf(runs, sizeof runs, "%s/runs", dir);
    snprintf(set_cache, sizeof set_cache, "data.cache=%s", cache);
    tkd_test_teacher_opts o = {.vocab = 64, .hidden = 16, .seq_len = 8, .k = 4, .temperature = 1.0f,
                               .num_seq = 16, .shard_seqs = 16, .seed = 3};
    assert_int_equal(tkd_test_teacher_cache(cache, &o), TKD_OK);
    const char *kd0[] = {set_cache, "kd.alpha=0", "train.best_metric=val_kd", "train.keep_best=true", "device=cpu"};
    tkd_test_expect_error(tkd_test_student_train(runs, "kd0", kd0, 5, 0, NULL), TKD_ERR_CONFIG,
                          TKD_TEST_FRAGS("train.best_metric = val_kd needs kd.alpha > 0"));
    const char *noval[] = {set_cache, "data.val_fraction=0", "train.early_stop_patience=3", "device=cpu"};
    tkd_test_expect_error(tkd_test_student_train(runs, "noval", noval, 4, 0, NULL), TKD_ERR_CONFIG,
                          TKD_TEST_FRAGS("train.early_stop_patience needs a validation split", "data.val_fraction"));
    assert_int_equal(access(tkd_test_path(runs, "kd0"), F_OK), -1); /* refused runs leave no directory */
    assert_int_equal(access(tkd_test_path(runs, "noval"), F_OK), -1);

    /* a checkpoint whose best_value is not a number is refused on --resume, naming file and key */
    const char *ok[] = {set_cache, "data.val_fraction=0.25", "train.keep_best=true", "train.max_steps=2",
                        "train.eval_interval=1", "train.batch_size=4", "model.hidden_size=16",
                        "model.intermediate_size=32", "model.num_heads=2", "model.num_kv_heads=2",
                        "model.max_position_embeddings=8", "device=cpu"};
    assert_int_equal(tkd_test_student_train(runs, "bad", ok, 12, 0, NULL), TKD_OK);
    char state_path[4600];
    snprintf(state_path, sizeof state_path, "%s/bad/checkpoint/state.json", runs);
    char *text = tkd_test_slurp(state_path, NULL);
    char *v = strstr(text, "\"best_value\":\t\"");
    assert_non_null(v);
    v += strlen("\"best_value\":\t\"");
    memset(v, 'x', strcspn(v, "\""));
    tkd_test_write_text(state_path, text);
    free(text);
    tkd_test_expect_error(tkd_test_student_train(runs, "bad", ok, 12, 1, NULL), TKD_ERR_FORMAT,
                          TKD_TEST_FRAGS("bad/checkpoint/state.json", "\"best_value\" missing or not a finite number"));
}

TKD_TEST_MAIN_EACH_DIR(test_best_checkpoint_survives_a_kill, test_early_stop, test_best_refusals)
