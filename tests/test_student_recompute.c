/* test_student_recompute.c — train.recompute: auto (docs/student-train.md, Device): student-train
 * picks the mode once everything else is allocated and says which; with room for every activation
 * it keeps them all (none), with a budget for attention and two of the four layers whole it takes
 * that plan, and with a budget nothing fits (the test build's stand-in for a full GPU) it runs
 * full and warns. Every plan trains the same bits: the checkpoint's weights, AdamW
 * state and metrics equal those of an explicit `none` run. The choice at every budget is
 * tests/test_model.c's test_pick_recompute. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "tests/testutil.h"

#define BIN TKD_BINARY_DIR "/bin/student-train-testhooks"

/* A cache in <dir>/cache and <dir>/c.yaml: a four-layer student (batches of 4 × 16 tokens), 6 steps,
 * one checkpoint at the end. */
static void make_fixture(const char *dir)
{
    char cache[4200], path[4200], text[9000];
    snprintf(cache, sizeof cache, "%s/cache", dir);
    tkd_test_teacher_opts o = {.vocab = 64, .hidden = 16, .seq_len = 16, .k = 8, .temperature = 1.0f,
                               .num_seq = 24, .shard_seqs = 12, .seed = 5};
    assert_int_equal(tkd_test_teacher_cache(cache, &o), TKD_OK);
    snprintf(path, sizeof path, "%s/c.yaml", dir);
    snprintf(text, sizeof text,
             "run: {dir: '%s/runs'}\n"
             "data: {cache: '%s', val_fraction: 0.25}\n"
             "model: {hidden_size: 32, intermediate_size: 64, num_layers: 4, num_heads: 4, num_kv_heads: 2,\n"
             "        max_position_embeddings: 16}\n"
             "kd: {alpha: 0.5}\n"
             "train: {batch_size: 4, max_steps: 6, eval_interval: 3, checkpoint_interval: 6, log_interval: 1}\n"
             "device: cpu\n",
             dir, cache);
    tkd_test_write_text(path, text);
}

/* Runs the test build on <dir>/c.yaml as run `name` with the override `set` (NULL: none) and the
 * environment assignment env (NULL: none); returns its output (malloc'd) after checking exit 0. */
static char *train(const char *dir, const char *name, const char *set, const char *env)
{
    char cfg[4200], nm[300], log[4300];
    snprintf(cfg, sizeof cfg, "%s/c.yaml", dir);
    snprintf(nm, sizeof nm, "run.name=%s", name);
    snprintf(log, sizeof log, "%s/%s.out", dir, name);
    const char *args[] = {"--config", cfg, "--set", nm, set ? "--set" : NULL, set, NULL};
    int rc = tkd_test_run(BIN, args, env, log);
    char *out = tkd_test_slurp(log, NULL);
    if (rc != 0)
        fail_msg("run %s exited %d:\n%s", name, rc, out);
    return out;
}

static void assert_same_run(const char *dir, const char *a, const char *b)
{
    static const char *const files[] = {"checkpoint/model.safetensors", "checkpoint/optimizer.safetensors"};
    for (int i = 0; i < 2; i++) {
        char fa[4600], fb[4600];
        snprintf(fa, sizeof fa, "%s/runs/%s/%s", dir, a, files[i]);
        snprintf(fb, sizeof fb, "%s/runs/%s/%s", dir, b, files[i]);
        if (!tkd_test_files_equal(fa, fb))
            fail_msg("%s differs between runs %s and %s", files[i], a, b);
    }
    char ma[4600], mb[4600];
    snprintf(ma, sizeof ma, "%s/runs/%s/metrics.jsonl", dir, a);
    snprintf(mb, sizeof mb, "%s/runs/%s/metrics.jsonl", dir, b);
    char *ta = tkd_test_metrics_without_time(ma), *tb = tkd_test_metrics_without_time(mb);
    assert_string_equal(ta, tb);
    free(ta);
    free(tb);
}

/* Fails unless what is in out; prints the line that holds it. */
static void expect_in(const char *out, const char *what)
{
    const char *p = strstr(out, what);
    if (!p)
        fail_msg("expected \"%s\" in:\n%s", what, out);
    const char *b = p;
    while (b > out && b[-1] != '\n')
        b--;
    printf("  %.*s\n", (int)strcspn(b, "\n"), b);
}

/* The activation bytes of a plan for the fixture's student as student-train builds it (the same
 * config, the gradients lent: no accumulation): the budget that makes auto pick that plan. */
static size_t fixture_plan_bytes(tkd_recompute mode, int whole)
{
    tkd_model_config c;
    tkd_model_config_defaults(&c);
    c.vocab_size = 64, c.hidden_size = 32, c.intermediate_size = 64, c.num_hidden_layers = 4;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 8, c.max_position_embeddings = 16;
    c.tie_word_embeddings = 0;
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&c, 1, &m), TKD_OK);
    tkd_model_set_lend_grads(m, 1);
    size_t n = 0;
    assert_int_equal(tkd_model_recompute_bytes(m, mode, whole, 4, 16, &n), TKD_OK);
    tkd_model_free(m);
    return n;
}

static void test_auto_picks_and_trains_the_same(void **state)
{
    const char *dir = *state;
    make_fixture(dir);
    char *none = train(dir, "none", "train.recompute=none", NULL);
    if (strstr(none, "train.recompute auto"))
        fail_msg("an explicit mode is not picked:\n%s", none);
    char *roomy = train(dir, "auto", NULL, NULL); /* the default */
    expect_in(roomy, "train.recompute auto: none (activations");
    char *tight = train(dir, "tight", NULL, "TKD_TRAIN_TEST_ACT_BUDGET=1");
    expect_in(tight, "train.recompute auto: full, whose activations");
    expect_in(tight, "lower train.batch_size or data.seq_len");
    /* between: at T 16 attention recomputes the fewest FLOPs (the q/k/v GEMMs and a 16-key attention
     * against the whole block's GEMMs); with room for two blocks whole but not three */
    size_t two = fixture_plan_bytes(TKD_RECOMPUTE_ATTENTION, 2), three = fixture_plan_bytes(TKD_RECOMPUTE_ATTENTION, 3);
    printf("  attention with 2 blocks whole: %zu bytes; 3: %zu; none: %zu\n", two, three,
           fixture_plan_bytes(TKD_RECOMPUTE_NONE, 0));
    assert_true(two < three);
    char env[64];
    snprintf(env, sizeof env, "TKD_TRAIN_TEST_ACT_BUDGET=%zu", two);
    char *part = train(dir, "part", NULL, env);
    expect_in(part, "train.recompute auto: attention, the last 2 of 4 layers keeping everything (activations");
    assert_same_run(dir, "none", "auto");
    assert_same_run(dir, "none", "tight");
    assert_same_run(dir, "none", "part");
    free(part);
    free(none);
    free(roomy);
    free(tight);
}

TKD_TEST_MAIN_EACH_DIR(test_auto_picks_and_trains_the_same)
