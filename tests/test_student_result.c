/* test_student_result.c — student-train's closing summary as scripts read it: the RESULT line holds
 * only values that were measured (a run that ended without an evaluation used to print
 * val_ce=nan), and says so in the human-readable part. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

#define BIN TKD_BINARY_DIR "/bin/student-train"

/* Runs student-train as run `name` on the cache in dir (config <dir>/c.yaml) with one extra --set;
 * returns its output. */
static char *run(const char *dir, const char *name, const char *extra)
{
    char cfg[4200], run_name[300], out[4200];
    snprintf(cfg, sizeof cfg, "%s/c.yaml", dir);
    snprintf(run_name, sizeof run_name, "run.name=%s", name);
    snprintf(out, sizeof out, "%s/%s.out", dir, name);
    const char *args[] = {"-q", "--config", cfg, "--set", run_name, "--set", extra, NULL};
    assert_int_equal(tkd_test_run(BIN, args, NULL, out), 0);
    return tkd_test_slurp(out, NULL);
}

/* A tiny student on the cache in <dir>/cache, runs under <dir>/runs: <dir>/c.yaml. */
static void write_config(const char *dir)
{
    char path[4200], text[9000];
    snprintf(path, sizeof path, "%s/c.yaml", dir);
    snprintf(text, sizeof text,
             "run: {dir: '%s/runs'}\n"
             "data: {cache: '%s/cache'}\n"
             "model: {hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 2,\n"
             "        max_position_embeddings: 16}\n"
             "train: {batch_size: 4, max_steps: 6, eval_interval: 0, eval_batches: 2}\n"
             "device: cpu\n",
             dir, dir);
    tkd_test_write_text(path, text);
}

/* The line starting with "RESULT " (a static copy). */
static const char *result_line(const char *text)
{
    static char line[512];
    const char *r = strstr(text, "RESULT ");
    if (!r)
        fail_msg("no RESULT line in:\n%s", text);
    snprintf(line, sizeof line, "%.*s", (int)strcspn(r, "\n"), r);
    return line;
}

static void test_result_line(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    if (access(BIN, X_OK) != 0) /* the build makes it: missing is a broken build, not a pass */
        fail_msg("%s: not built", BIN);
    char cache[4200];
    snprintf(cache, sizeof cache, "%s/cache", dir);
    tkd_test_teacher_opts o = {.vocab = 80, .hidden = 16, .seq_len = 16, .k = 8, .temperature = 1.0f,
                               .num_seq = 40, .shard_seqs = 8, .seed = 5};
    assert_int_equal(tkd_test_teacher_cache(cache, &o), TKD_OK);
    write_config(dir);

    /* stopped at train.stop_after: no evaluation, so no val_* value at all */
    char *text = run(dir, "stopped", "train.stop_after=3");
    const char *line = result_line(text);
    if (strstr(line, "nan") || strstr(line, "val_") || strstr(line, "top1"))
        fail_msg("unmeasured values in '%s'", line);
    assert_non_null(strstr(line, "RESULT steps=3 tokens="));
    assert_non_null(strstr(text, "val       no evaluation in this run\n"));
    free(text);

    /* a finished run evaluates: every value is there and a number */
    text = run(dir, "finished", "kd.alpha=0.5");
    line = result_line(text);
    double ce = 0, ppl = 0, kd = 0, top1 = 0;
    long long steps = 0;
    assert_int_equal(sscanf(line, "RESULT val_ce=%lf val_ppl=%lf val_kd=%lf top1=%lf steps=%lld", &ce, &ppl, &kd,
                            &top1, &steps), 5);
    assert_true(ce > 0 && ppl > 1 && kd > 0 && top1 >= 0 && top1 <= 1);
    assert_int_equal(steps, 6);
    assert_null(strstr(text, "no evaluation"));
    free(text);
}

TKD_TEST_MAIN_EACH_DIR(test_result_line)
