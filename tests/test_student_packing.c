/* test_student_packing.c — student-train on packed documents end to end (data.packing: documents
 * over data.tokens, CE only, on the CPU): the CLI packs the token file's recorded documents (a flags
 * sidecar), trains and evaluates with attention kept inside each document, says how it packed, and
 * measures something else than the same tokens as stream windows; a token file that records no
 * documents is refused as a config error naming data.packing and the file. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/tokens.h"
#include "tests/dump_testutil.h"
#include "tests/testutil.h"

#define BIN TKD_BINARY_DIR "/bin/student-train"
enum { N = 400, V = 64 };

/* <dir>/tok.npy (N ids < V) with, when flags, a sidecar that starts a document every 13 to 37
 * tokens and trains every target; and <dir>/c.yaml, a tiny CE-only student on it. */
static void make_fixture(const char *dir, int flags, const char *packing)
{
    char path[4200], side[4300], cfg[4200], text[12288];
    int32_t tok[N];
    uint8_t fl[N];
    for (int i = 0, next = 0; i < N; i++) {
        tok[i] = (int32_t)((i * 37 + i / 7) % V);
        fl[i] = TKD_TOKENS_FLAG_TRAINED;
        if (i == next) {
            fl[i] |= TKD_TOKENS_FLAG_DOC_START;
            next += 13 + (i * 7) % 25;
        }
    }
    snprintf(path, sizeof path, "%s/tok.npy", dir);
    snprintf(side, sizeof side, "%s.flags.npy", path);
    tkd_dt_write_npy(path, tok, 0, N);
    remove(side);
    if (flags)
        tkd_dt_write_npy_as(side, "|u1", fl, 1, 0, N);
    snprintf(cfg, sizeof cfg, "%s/c.yaml", dir);
    snprintf(text, sizeof text,
             "run: {dir: '%s/runs'}\n"
             "data: {tokens: ['%s'], val_tokens: ['%s'], seq_len: 16, packing: %s}\n"
             "model: {vocab_size: %d, hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2,\n"
             "        num_kv_heads: 2, max_position_embeddings: 16}\n"
             "kd: {alpha: 0}\n"
             "optim: {lr: 1e-3, min_lr: 1e-3, warmup_steps: 0}\n"
             "train: {batch_size: 4, max_steps: 6, eval_batches: 2, log_interval: 1}\n"
             "device: cpu\n",
             dir, path, path, packing, V);
    tkd_test_write_text(cfg, text);
}

static int run_cli(const char *dir, const char *name, char **out)
{
    char cfg[4200], set[300], log[4300];
    snprintf(cfg, sizeof cfg, "%s/c.yaml", dir);
    snprintf(set, sizeof set, "run.name=%s", name);
    snprintf(log, sizeof log, "%s/%s.out", dir, name);
    const char *args[] = {"--config", cfg, "--set", set, NULL};
    int rc = tkd_test_run(BIN, args, NULL, log);
    *out = tkd_test_slurp(log, NULL);
    return rc;
}

static double val_ce(const char *text)
{
    const char *r = strstr(text, "RESULT val_ce=");
    if (!r)
        fail_msg("no RESULT line in:\n%s", text);
    return strtod(r + strlen("RESULT val_ce="), NULL);
}

static void test_packed_training(void **state)
{
    const char *dir = *state;
    char *out = NULL;
    make_fixture(dir, 1, "documents");
    if (run_cli(dir, "docs", &out) != 0)
        fail_msg("student-train on packed documents failed:\n%s", out);
    assert_non_null(strstr(out, "data.packing: documents: "));
    assert_non_null(strstr(out, " sequences of 16 positions"));
    const double docs = val_ce(out);
    assert_true(isfinite(docs) && docs > 0);
    free(out);
    make_fixture(dir, 1, "stream");
    assert_int_equal(run_cli(dir, "stream", &out), 0);
    const double stream = val_ce(out);
    print_message("val_ce: packed documents %.6f, stream windows %.6f\n", docs, stream);
    assert_true(fabs(docs - stream) > 1e-4); /* other sequences, other labels: another measurement */
    free(out);
}

static void test_no_documents_refused(void **state)
{
    const char *dir = *state;
    char *out = NULL;
    make_fixture(dir, 0, "documents");
    assert_int_equal(run_cli(dir, "none", &out), 2);
    assert_non_null(strstr(out, "data.packing: documents: "));
    assert_non_null(strstr(out, "tok.npy records no document boundaries"));
    free(out);
}

TKD_TEST_MAIN_EACH_DIR(test_packed_training, test_no_documents_refused)
