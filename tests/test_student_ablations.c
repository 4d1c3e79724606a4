/* test_student_ablations.c — the files of configs/ablations/: each file is a valid student-train config;
 * applied on top of configs/student-demo.yaml it gives exactly what its lines given as --set
 * overrides give (the sed one-liner of docs/student-train.md turns each "key: value" line into
 * --set key=value); every file changes something of the demo except alpha-0.5 (the demo's own
 * value, kept for symmetric sweeps); and the derived run names all differ. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "student_train/train.h"
#include "student_train/train_config.h"
#include "tests/testutil.h"

#define MAX_SETS 16

/* The --set form of an ablation file, as the documented sed does it: every line that starts with
 * a dotted key, "key: value" -> "key=value" (value up to a space or '#'). Returns the count. */
static int file_sets(const char *path, char sets[MAX_SETS][256])
{
    char *text = tkd_test_read_file(path, NULL);
    assert_non_null(text);
    int n = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        size_t key = strspn(line, "abcdefghijklmnopqrstuvwxyz_.");
        if (key == 0 || line[key] != ':')
            continue;
        const char *v = line + key + 1;
        v += strspn(v, " ");
        size_t vlen = strcspn(v, " #");
        assert_true(n < MAX_SETS);
        snprintf(sets[n++], 256, "%.*s=%.*s", (int)key, line, (int)vlen, v);
    }
    free(text);
    return n;
}

static void test_ablations_combine_with_the_demo(void **state)
{
    (void)state;
    char demo[4096], pattern[4096];
    snprintf(demo, sizeof demo, "%s/configs/student-demo.yaml", TKD_SOURCE_DIR);
    snprintf(pattern, sizeof pattern, "%s/configs/ablations/*.yaml", TKD_SOURCE_DIR);
    glob_t g;
    assert_int_equal(glob(pattern, 0, NULL, &g), 0);
    assert_true(g.gl_pathc >= 6);
    char names[32][512];
    assert_true(g.gl_pathc <= 32);
    tkd_train_config base = {0};
    assert_int_equal(tkd_config_load(&tkd_train_schema, &base, demo, NULL, 0), TKD_OK);
    for (size_t i = 0; i < g.gl_pathc; i++) {
        const char *path = g.gl_pathv[i];
        tkd_train_config alone = {0}, by_file = {0}, by_set = {0};
        /* a valid config by itself (every key known, values in range) */
        if (tkd_config_load(&tkd_train_schema, &alone, path, NULL, 0) != TKD_OK)
            fail_msg("%s: %s", path, tkd_error_msg());
        /* demo + the file, and demo + the file's lines as --set */
        assert_int_equal(tkd_config_load(&tkd_train_schema, &by_file, demo, NULL, 0), TKD_OK);
        assert_int_equal(tkd_config_apply_file(&tkd_train_schema, &by_file, path), TKD_OK);
        char sets[MAX_SETS][256];
        const char *ptrs[MAX_SETS];
        int n = file_sets(path, sets);
        assert_true(n >= 1);
        for (int j = 0; j < n; j++)
            ptrs[j] = sets[j];
        if (tkd_config_load(&tkd_train_schema, &by_set, demo, ptrs, (size_t)n) != TKD_OK)
            fail_msg("%s as --set: %s", path, tkd_error_msg());
        if (!tkd_config_equal(&tkd_train_schema, &by_file, &by_set))
            fail_msg("%s: its --set form gives another config than the file", path);
        if (!strstr(path, "alpha-0.5") && tkd_config_equal(&tkd_train_schema, &by_file, &base))
            fail_msg("%s changes nothing of the demo", path);
        tkd_train_derive_name(names[i], sizeof names[i], demo, ptrs, (size_t)n);
        assert_non_null(strstr(names[i], "student-demo__"));
        for (size_t j = 0; j < i; j++)
            if (strcmp(names[i], names[j]) == 0)
                fail_msg("%s and another ablation derive the same run name %s", path, names[i]);
        tkd_config_free(&tkd_train_schema, &alone);
        tkd_config_free(&tkd_train_schema, &by_file);
        tkd_config_free(&tkd_train_schema, &by_set);
    }
    tkd_config_free(&tkd_train_schema, &base);
    globfree(&g);
}

/* The name a sweep gets without run.name: config base name, then each override that defines the run,
 * a path by its last component, made safe. */
static void test_derived_run_names(void **state)
{
    (void)state;
    char name[256];
    const char *sets[] = {"kd.variant=sampled", "data.cache=demo-out/cache-top20-tail80", "kd.temperature=2"};
    tkd_train_derive_name(name, sizeof name, "configs/student-demo.yaml", sets, 3);
    assert_string_equal(name, "student-demo__kd.variant-sampled__data.cache-cache-top20-tail80__kd.temperature-2");
    tkd_train_derive_name(name, sizeof name, "student-demo.yaml", NULL, 0);
    assert_string_equal(name, "student-demo");
    tkd_train_derive_name(name, 8, "configs/student-demo.yaml", sets, 1); /* truncated, terminated */
    assert_string_equal(name, "student");
}

/* Issue 26: the overrides of a real run, with paths. run.dir and the other output locations are not
 * part of the name, a path is its last component (quotes and a trailing '/' aside, each element of a
 * list), and the rest keeps its order; the full overrides stay in config.yaml. */
static void test_derived_names_with_paths(void **state)
{
    (void)state;
    char name[256];
    const char *sets[] = {"data.cache=/tmp/x/cache", "run.dir=/tmp/x/runs", "train.max_steps=60",
                          "data.val_cache=", "model.path='/models/Qwen2.5-0.5B/'", "dist.dir=/shared/rdzv",
                          "data.tokens=[data/a/train.bin, /b/val.bin]", "train.stop_after=30"};
    tkd_train_derive_name(name, sizeof name, "configs/student-qwen2.5-0.5b.yaml", sets, 3);
    assert_string_equal(name, "student-qwen2.5-0.5b__data.cache-cache__train.max_steps-60");
    tkd_train_derive_name(name, sizeof name, "c.yaml", sets + 1, 7);
    assert_string_equal(name, "c__train.max_steps-60__data.val_cache-__model.path-Qwen2.5-0.5B__data.tokens-train.bin-val.bin");
    assert_null(strstr(name, "tmp"));
    assert_null(strstr(name, "runs"));
    assert_null(strstr(name, "stop_after"));
    /* run.name and run.dir given alone: only the config's stem */
    const char *where[] = {"run.dir=/tmp/x/runs", "run.name=", "train.log_interval=1"};
    tkd_train_derive_name(name, sizeof name, "c.yaml", where, 3);
    assert_string_equal(name, "c");
}

/* A long derived name: its first 87 characters, then "-" and 8 hex digits of the whole name's sha256,
 * 96 in all; the same overrides give the same name, and names differing only past the cut differ. */
static void test_long_derived_names_hashed(void **state)
{
    (void)state;
    char a[256], b[256], again[256];
    const char *sets[] = {"kd.variant=sampled", "kd.temperature=2", "optim.lr=0.001", "optim.min_lr=0.0001",
                          "optim.warmup_steps=100", "train.seed=7", "kd.topk=20"};
    const char *other[] = {"kd.variant=sampled", "kd.temperature=2", "optim.lr=0.001", "optim.min_lr=0.0001",
                           "optim.warmup_steps=100", "train.seed=7", "kd.topk=21"};
    tkd_train_derive_name(a, sizeof a, "configs/student-demo.yaml", sets, 7);
    tkd_train_derive_name(again, sizeof again, "configs/student-demo.yaml", sets, 7);
    tkd_train_derive_name(b, sizeof b, "configs/student-demo.yaml", other, 7);
    assert_int_equal(strlen(a), 96);
    assert_string_equal(a, again);
    assert_string_not_equal(a, b);
    assert_int_equal(strncmp(a, "student-demo__kd.variant-sampled__kd.temperature-2__optim.lr-0.001__optim.min_lr-0.0001__o",
                             87), 0);
    assert_int_equal(a[87], '-');
    assert_int_equal(strspn(a + 88, "0123456789abcdef"), 8);
    assert_int_equal(strncmp(a, b, 88), 0); /* only the hash tells them apart */
}

/* The real-pair student configs next to the teacher templates load by themselves, with the shapes
 * of the models they are named after and data.seq_len following the cache. */
static void check_real_student(const char *file, int arch, int vocab, int hidden, int layers, int heads, int kv,
                               int head_dim)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/configs/%s", TKD_SOURCE_DIR, file);
    tkd_train_config c = {0};
    if (tkd_config_load(&tkd_train_schema, &c, path, NULL, 0) != TKD_OK)
        fail_msg("%s: %s", path, tkd_error_msg());
    assert_int_equal(c.model_arch, arch);
    assert_int_equal(c.vocab_size, vocab);
    assert_int_equal(c.hidden_size, hidden);
    assert_int_equal(c.num_layers, layers);
    assert_int_equal(c.num_heads, heads);
    assert_int_equal(c.num_kv_heads, kv);
    assert_int_equal(c.head_dim, head_dim);
    assert_int_equal(c.seq_len, 0);
    assert_true(c.tie_word_embeddings);
    tkd_config_free(&tkd_train_schema, &c);
}

static void test_real_pair_students(void **state)
{
    (void)state;
    check_real_student("student-qwen2.5-0.5b.yaml", TKD_TRAIN_ARCH_QWEN2, 151936, 896, 24, 14, 2, 64);
    check_real_student("student-llama3.2-1b.yaml", TKD_TRAIN_ARCH_LLAMA, 128256, 2048, 16, 32, 8, 64);
    check_real_student("student-qwen3-0.6b.yaml", TKD_TRAIN_ARCH_QWEN3, 151936, 1024, 28, 16, 8, 128); /* != D/H */
}

TKD_TEST_MAIN(test_ablations_combine_with_the_demo, test_derived_run_names, test_derived_names_with_paths,
    test_long_derived_names_hashed, test_real_pair_students)
