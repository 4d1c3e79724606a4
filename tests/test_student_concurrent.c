/* test_student_concurrent.c — several student-train processes read one cache at the same time
 * (the ablation workflow): each finishes, and each gets exactly the weights it gets alone. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/testutil.h"

#define BIN TKD_BINARY_DIR "/bin/student-train"
#define PATH_CAP 4400

/* The student-train command for run `name` on the cache; extra is more --set flags. */
static void command(char *out, size_t cap, const char *dir, const char *name, const char *extra)
{
    int n = snprintf(out, cap,
                     "'%s' -q --set run.dir='%s/runs' --set run.name=%s --set data.cache='%s/cache' "
                     "--set model.hidden_size=32 --set model.intermediate_size=64 --set model.num_layers=1 "
                     "--set model.num_heads=2 --set model.num_kv_heads=2 --set model.max_position_embeddings=16 "
                     "--set train.batch_size=4 --set train.max_steps=10 --set train.eval_interval=0 "
                     "--set train.eval_batches=2 --set device=cpu %s > '%s/%s.out' 2>&1",
                     BIN, dir, name, dir, extra, dir, name);
    assert_true(n > 0 && (size_t)n < cap);
}

static void test_three_runs_share_one_cache(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char path[PATH_CAP], cmd[4 * PATH_CAP], a[PATH_CAP], b[PATH_CAP];
    snprintf(path, sizeof path, "%s/cache", dir);
    tkd_test_teacher_opts o = {.vocab = 80, .hidden = 16, .seq_len = 16, .k = 8, .tail_samples = 4,
                               .temperature = 1.0f, .num_seq = 40, .shard_seqs = 8, .seed = 3};
    assert_int_equal(tkd_test_teacher_cache(path, &o), TKD_OK);

    /* three ablations at once, each in its own process, all reading the same shards */
    const char *names[3] = {"renorm", "tail", "sampled"};
    const char *extra[3] = {"--set kd.variant=renorm", "--set kd.variant=tail", "--set kd.variant=sampled"};
    size_t off = 0;
    off += (size_t)snprintf(cmd + off, sizeof cmd - off, "(");
    for (int i = 0; i < 3; i++) {
        command(cmd + off, sizeof cmd - off, dir, names[i], extra[i]);
        off = strlen(cmd);
        off += (size_t)snprintf(cmd + off, sizeof cmd - off, " & ");
    }
    snprintf(cmd + off, sizeof cmd - off, "wait) && grep -q RESULT '%s/renorm.out' && grep -q RESULT '%s/tail.out' "
             "&& grep -q RESULT '%s/sampled.out'", dir, dir, dir);
    if (system(cmd) != 0) {
        snprintf(cmd, sizeof cmd, "cat '%s'/*.out", dir);
        (void)system(cmd);
        fail_msg("a concurrent run failed");
    }
    /* the same run alone gives the same bytes: nothing leaked between the readers */
    command(cmd, sizeof cmd, dir, "sampled-alone", extra[2]);
    assert_int_equal(system(cmd), 0);
    snprintf(a, sizeof a, "%s/runs/sampled/checkpoint/model.safetensors", dir);
    snprintf(b, sizeof b, "%s/runs/sampled-alone/checkpoint/model.safetensors", dir);
    assert_true(tkd_test_files_equal(a, b));
    /* and the variants really differ (the check above compares something that can differ) */
    snprintf(b, sizeof b, "%s/runs/renorm/checkpoint/model.safetensors", dir);
    assert_false(tkd_test_files_equal(a, b));
}

TKD_TEST_MAIN_EACH_DIR(test_three_runs_share_one_cache)
