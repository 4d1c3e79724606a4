/* test_student_dense.c — kd.teacher, distilling online from a checkpoint's full distribution (issue
 * 24's dense reference), end to end on the CPU: the CLI runs the teacher on every batch and trains
 * on the dense loss; and it measures what a cache of every token (k = V, float32 logits) made by
 * teacher-dump from the same checkpoint and tokens measures — the check "the dense loss
 * equals the offline loss on a cache with k = V for a small vocabulary" — with the same windows,
 * seed and steps (to fp32 rounding: the teacher's forward runs in other batches); refusals name
 * their keys. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "tests/dump_testutil.h"
#include "tests/testutil.h"

#define TRAIN_BIN TKD_BINARY_DIR "/bin/student-train"
#define DUMP_BIN TKD_BINARY_DIR "/bin/teacher-dump"
enum { V = 64, T = 16, NTOK = T * 37 + 1 };

/* <dir>/teacher (a random 1-layer Llama saved as a checkpoint), <dir>/tok.npy (whole windows only) */
static void make_inputs(const char *dir)
{
    tkd_model_config c;
    tkd_model_config_defaults(&c);
    c.vocab_size = V, c.hidden_size = 48, c.intermediate_size = 96, c.num_hidden_layers = 1;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 12, c.max_position_embeddings = 32;
    c.initializer_range = 0.4f;
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&c, 3, &m), TKD_OK);
    char path[4200];
    snprintf(path, sizeof path, "%s/teacher", dir);
    assert_int_equal(tkd_model_save_hf(m, path, TKD_DTYPE_F32), TKD_OK);
    tkd_model_free(m);
    int32_t tok[NTOK];
    for (int i = 0; i < NTOK; i++)
        tok[i] = (int32_t)((i * 29 + i / 5 + (i * i) % 7) % V);
    snprintf(path, sizeof path, "%s/tok.npy", dir);
    tkd_dt_write_npy(path, tok, 0, NTOK);
}

/* student-train with the common settings and `data` (YAML mapping body for data:, plus kd keys);
 * returns the exit code and the output. */
static int train(const char *dir, const char *name, const char *data, const char *kd, char **out)
{
    char cfg[4200], text[16384], log[4300];
    snprintf(cfg, sizeof cfg, "%s/%s.yaml", dir, name);
    snprintf(text, sizeof text,
             "run: {dir: '%s/runs', name: %s}\n"
             "data: {%s, seq_len: %d}\n"
             "model: {vocab_size: %d, hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2,\n"
             "        num_kv_heads: 2, max_position_embeddings: 32}\n"
             "kd: {alpha: 1.0, temperature: 2.0, %s}\n"
             "optim: {lr: 3e-3, min_lr: 3e-3, warmup_steps: 0}\n"
             "train: {batch_size: 4, max_steps: 6, eval_batches: 0, log_interval: 1, seed: 5}\n"
             "device: cpu\n",
             dir, name, data, T, V, kd);
    tkd_test_write_text(cfg, text);
    snprintf(log, sizeof log, "%s/%s.out", dir, name);
    const char *args[] = {"--config", cfg, NULL};
    int rc = tkd_test_run(TRAIN_BIN, args, NULL, log);
    *out = tkd_test_slurp(log, NULL);
    return rc;
}

static double field(const char *text, const char *key)
{
    const char *r = strstr(text, "RESULT ");
    const char *f = r ? strstr(r, key) : NULL;
    if (!f)
        fail_msg("no %s in the RESULT line of:\n%s", key, text);
    return strtod(f + strlen(key), NULL);
}

static void test_dense_equals_cache_of_every_token(void **state)
{
    const char *dir = *state;
    make_inputs(dir);
    char data[9000], kd[4400], *out = NULL;
    snprintf(data, sizeof data, "tokens: ['%s/tok.npy'], val_tokens: ['%s/tok.npy']", dir, dir);
    snprintf(kd, sizeof kd, "teacher: '%s/teacher'", dir);
    if (train(dir, "dense", data, kd, &out) != 0)
        fail_msg("student-train with kd.teacher failed:\n%s", out);
    assert_non_null(strstr(out, "run online, its full distribution the target"));
    const double dense_kd = field(out, "val_kd="), dense_ce = field(out, "val_ce="), dense_top1 = field(out, "top1=");
    free(out);
    /* the same teacher as a cache of every token */
    char tcfg[4200], text[16384], log[4300];
    snprintf(tcfg, sizeof tcfg, "%s/dump.yaml", dir);
    snprintf(text, sizeof text,
             "teacher: {path: '%s/teacher'}\ndata: {paths: ['%s/tok.npy'], seq_len: %d}\n"
             "cache: {k: %d, logits_dtype: float32, temperature: 2.0, shard_sequences: 64}\n"
             "run: {batch_size: 4}\noutput: {dir: '%s/cache'}\ndevice: cpu\n", dir, dir, T, V, dir);
    tkd_test_write_text(tcfg, text);
    snprintf(log, sizeof log, "%s/dump.out", dir);
    const char *dargs[] = {"--config", tcfg, NULL};
    if (tkd_test_run(DUMP_BIN, dargs, NULL, log) != 0)
        fail_msg("teacher-dump failed:\n%s", tkd_test_slurp(log, NULL));
    snprintf(data, sizeof data, "cache: '%s/cache', val_cache: '%s/cache'", dir, dir);
    if (train(dir, "cache", data, "variant: renorm", &out) != 0)
        fail_msg("student-train on the k = V cache failed:\n%s", out);
    const double cache_kd = field(out, "val_kd="), cache_ce = field(out, "val_ce="), cache_top1 = field(out, "top1=");
    free(out);
    print_message("val_kd: dense %.9f, cache of every token %.9f; val_ce %.9f / %.9f; top-1 agreement %.4f / %.4f\n",
                  dense_kd, cache_kd, dense_ce, cache_ce, dense_top1, cache_top1);
    assert_true(dense_kd > 0.0);
    assert_true(fabs(dense_kd - cache_kd) <= 1e-4 * dense_kd);
    assert_true(fabs(dense_ce - cache_ce) <= 1e-4 * dense_ce);
    /* top-1 agreement: the teacher's argmax (dense) against the cache's first column; the two
     * students differ by rounding only, so a flip is at most a near tie */
    assert_true(cache_top1 > 0.05);
    assert_true(fabs(dense_top1 - cache_top1) <= 0.02);
}

static void test_refusals(void **state)
{
    const char *dir = *state;
    make_inputs(dir);
    char data[9000], kd[4400], *out = NULL;
    snprintf(data, sizeof data, "tokens: ['%s/tok.npy']", dir);
    snprintf(kd, sizeof kd, "teacher: '%s/teacher', variant: tail", dir);
    assert_int_equal(train(dir, "tail", data, kd, &out), 2);
    assert_non_null(strstr(out, "kd.teacher gives the teacher's whole distribution: kd.variant must be renorm"));
    free(out);
    snprintf(kd, sizeof kd, "teacher: '%s/nowhere'", dir);
    assert_int_not_equal(train(dir, "missing", data, kd, &out), 0);
    assert_non_null(strstr(out, "kd.teacher"));
    free(out);
}

TKD_TEST_MAIN_EACH_DIR(test_dense_equals_cache_of_every_token, test_refusals)
