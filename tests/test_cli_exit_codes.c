/* test_cli_exit_codes.c — teacher-dump and student-train give the same exit status for the same
 * outcome (README.md, "Exit codes"): the mapping itself, then both shipped tools as child
 * processes: SIGTERM in the middle of a run gives 143 and SIGINT 130; a config error gives 2, also
 * one found only once the teacher or the cache is loaded; a missing input gives 1. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/fileio.h" /* tkd_file_exists */
#include "tests/dump_testutil.h"

#define DUMP TKD_BINARY_DIR "/bin/teacher-dump"
#define TRAIN TKD_BINARY_DIR "/bin/student-train"

static void test_mapping(void **state)
{
    (void)state;
    assert_int_equal(tkd_cli_exit_code(TKD_OK, 0), 0);
    assert_int_equal(tkd_cli_exit_code(TKD_ERR_CONFIG, 0), 2);
    assert_int_equal(tkd_cli_exit_code(TKD_ERR_INVALID_ARG, 0), 2);
    assert_int_equal(tkd_cli_exit_code(TKD_ERR_IO, 0), 1);
    assert_int_equal(tkd_cli_exit_code(TKD_ERR_MISMATCH, 0), 1);
    assert_int_equal(tkd_cli_exit_code(TKD_ERR_NOSPACE, 0), 1);
    assert_int_equal(tkd_cli_exit_code(TKD_ERR_INTERRUPTED, SIGINT), 130);
    assert_int_equal(tkd_cli_exit_code(TKD_ERR_INTERRUPTED, SIGTERM), 143);
    assert_int_equal(tkd_cli_exit_code(TKD_ERR_INTERRUPTED, 0), 130); /* a stop without a signal */
    /* a signal that came while the run failed for another reason does not hide that reason */
    assert_int_equal(tkd_cli_exit_code(TKD_ERR_CONFIG, SIGTERM), 2);
}

/* ---- the tools as child processes ------------------------------------------------------------ */

/* The group's files, under tkd_test_group_dir: dump.yaml (the llama fixture over 400,000 tokens:
 * 25,000 windows, seconds of work, so a signal always finds the dump running), cache/ (a teacher
 * cache of 40 sequences of 8 tokens) and train.yaml (a tiny student on it for a million steps). */
static char dump_cfg[4300], train_cfg[4300];

static void write_configs(const char *dir)
{
    char text[9000];
    const char *tok = tkd_dt_random_tokens(dir, "long.npy", 400000, 131, 3);
    snprintf(text, sizeof text,
             "teacher: {path: '%s'}\ndata: {paths: ['%s'], seq_len: 16}\ncache: {k: 8, shard_sequences: 64}\n"
             "run: {batch_size: 2}\nlm_head: {chunk_rows: 24}\n", TKD_DT_LLAMA, tok);
    snprintf(dump_cfg, sizeof dump_cfg, "%s/dump.yaml", dir);
    tkd_test_write_text(dump_cfg, text);

    const char *cache = tkd_test_path(dir, "cache");
    tkd_test_teacher_opts o = {.vocab = 80, .hidden = 16, .seq_len = 8, .k = 6, .temperature = 1.0f,
                               .num_seq = 40, .shard_seqs = 16, .seed = 5};
    assert_int_equal(tkd_test_teacher_cache(cache, &o), TKD_OK);
    snprintf(text, sizeof text,
             "run: {dir: '%s/runs'}\ndata: {cache: '%s', val_fraction: 0.125}\n"
             "model: {hidden_size: 16, intermediate_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 2,"
             " max_position_embeddings: 8}\n"
             "train: {batch_size: 4, max_steps: 1000000, eval_interval: 0, log_interval: 1000}\ndevice: cpu\n",
             dir, cache);
    snprintf(train_cfg, sizeof train_cfg, "%s/train.yaml", dir);
    tkd_test_write_text(train_cfg, text);
}

static int group_setup(void **state)
{
    tkd_test_group_dir_setup(state);
    write_configs(tkd_test_group_dir);
    return 0;
}

/* teacher-dump -q --config dump.yaml --set output.dir=<dir>/<tag> [--set extra]: its pid, its
 * output in <dir>/<tag>.out. */
static pid_t dump(const char *tag, const char *extra)
{
    char out[4400];
    snprintf(out, sizeof out, "output.dir=%s", tkd_test_path(tkd_test_group_dir, tag));
    const char *args[] = {"-q", "--config", dump_cfg, "--set", out, extra ? "--set" : NULL, extra, NULL};
    char log[4400];
    snprintf(log, sizeof log, "%s.out", tkd_test_path(tkd_test_group_dir, tag));
    return tkd_test_spawn(DUMP, args, NULL, log);
}

/* student-train -q --config train.yaml --set run.name=<tag> [--set extra] [flag value], as dump. */
static pid_t train_flag(const char *tag, const char *extra, const char *flag, const char *value)
{
    char name[256];
    snprintf(name, sizeof name, "run.name=%s", tag);
    const char *args[] = {"-q", "--config", train_cfg, "--set", name, flag, value, NULL, NULL, NULL};
    if (extra)
        args[flag ? 7 : 5] = "--set", args[flag ? 8 : 6] = extra;
    char log[4400];
    snprintf(log, sizeof log, "%s.out", tkd_test_path(tkd_test_group_dir, tag));
    return tkd_test_spawn(TRAIN, args, NULL, log);
}

static pid_t train(const char *tag, const char *extra) { return train_flag(tag, extra, NULL, NULL); }

/* The dump's output directory and the run's metrics.jsonl are made after the signal handlers are
 * installed: once they exist, a signal is a request to stop, not the default death. */
static void test_signals(void **state)
{
    (void)state;
    const char *dir = tkd_test_group_dir;
    assert_int_equal(tkd_test_signal_when(dump("dump-term", NULL), tkd_test_path(dir, "dump-term"), SIGTERM), 143);
    assert_int_equal(tkd_test_signal_when(dump("dump-int", NULL), tkd_test_path(dir, "dump-int"), SIGINT), 130);
    assert_int_equal(tkd_test_signal_when(train("train-term", NULL), tkd_test_path(dir, "runs/train-term/metrics.jsonl"),
                                          SIGTERM), 143);
    assert_int_equal(tkd_test_signal_when(train("train-int", NULL), tkd_test_path(dir, "runs/train-int/metrics.jsonl"),
                                          SIGINT), 130);
}

static void test_config_errors(void **state)
{
    (void)state;
    assert_int_equal(tkd_test_wait(dump("dump-key", "cache.kk=3")), 2);
    /* found only after the teacher is loaded: its max_position_embeddings is 64 */
    assert_int_equal(tkd_test_wait(dump("dump-seqlen", "data.seq_len=100")), 2);
    assert_int_equal(tkd_test_wait(train("train-key", "train.kk=3")), 2);
    /* found only after the cache is open: its sequences have 8 positions */
    assert_int_equal(tkd_test_wait(train("train-seqlen", "data.seq_len=9")), 2);
}

static void test_runtime_errors(void **state)
{
    (void)state;
    char path[4400];
    snprintf(path, sizeof path, "teacher.path=%s", tkd_test_path(tkd_test_group_dir, "no-teacher"));
    assert_int_equal(tkd_test_wait(dump("dump-missing", path)), 1);
    snprintf(path, sizeof path, "data.cache=%s", tkd_test_path(tkd_test_group_dir, "no-cache"));
    assert_int_equal(tkd_test_wait(train("train-missing", path)), 1);
}

static int count_of(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(text, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* student-train --nproc-per-node: a bad N and a config error are one usage error each (exit 2,
 * the error once: checked before any rank starts); a SIGTERM to the launcher reaches the rank,
 * which stops with its checkpoint: 143 as without the launcher. */
static void test_train_nproc_per_node(void **state)
{
    (void)state;
    const char *dir = tkd_test_group_dir;
    assert_int_equal(tkd_test_wait(train_flag("np-bad", NULL, "--nproc-per-node", "two")), 2);
    char *out = tkd_test_slurp(tkd_test_path(dir, "np-bad.out"), NULL);
    assert_non_null(strstr(out, "student-train: --nproc-per-node: 'two' is not an integer"));
    free(out);
    assert_int_equal(tkd_test_wait(train_flag("np-key", "train.kk=3", "--nproc-per-node", "2")), 2);
    out = tkd_test_slurp(tkd_test_path(dir, "np-key.out"), NULL);
    assert_non_null(strstr(out, "train.kk"));
    assert_int_equal(count_of(out, "student-train:"), 1); /* one error line, no rank started */
    free(out);
    /* what the ranks would refuse, refused once before any starts: the config says device: cpu,
     * and a global batch of 4 does not split over 3 ranks */
    assert_int_equal(tkd_test_wait(train_flag("np-cpu", NULL, "--nproc-per-node", "2")), 2);
    out = tkd_test_slurp(tkd_test_path(dir, "np-cpu.out"), NULL);
    assert_non_null(strstr(out, "2 ranks need device: cuda"));
    assert_int_equal(count_of(out, "student-train:"), 1);
    free(out);
    assert_int_equal(tkd_test_wait(train_flag("np-batch", "device=auto", "--nproc-per-node", "3")), 2);
    out = tkd_test_slurp(tkd_test_path(dir, "np-batch.out"), NULL);
    assert_non_null(strstr(out, "train.batch_size = 4 is the global batch: it must be a multiple of the 3 ranks"));
    assert_int_equal(count_of(out, "student-train:"), 1);
    free(out);
    /* a rank of a world of one with no job id is refused at once, not at its first checkpoint */
    for (const char *const *v = (const char *const[]){"TKD_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID",
                                                       "SLURM_PROCID", NULL}; *v; v++)
        unsetenv(*v);
    setenv("WORLD_SIZE", "1", 1);
    char log[4400];
    snprintf(log, sizeof log, "%s.out", tkd_test_path(dir, "no-job"));
    pid_t pid = tkd_test_spawn(TRAIN, (const char *[]){"-q", "--config", train_cfg, "--set", "run.name=no-job", NULL},
                               "RANK=0", log);
    unsetenv("WORLD_SIZE");
    assert_int_equal(tkd_test_wait(pid), 2);
    out = tkd_test_slurp(log, NULL);
    assert_non_null(strstr(out, "rank 0 of 1 (env) has no job id"));
    free(out);
    assert_int_equal(tkd_test_signal_when(train_flag("np-term", NULL, "--nproc-per-node", "1"),
                                          tkd_test_path(dir, "runs/np-term/metrics.jsonl"), SIGTERM), 143);
    assert_true(tkd_file_exists(tkd_test_path(dir, "runs/np-term/checkpoint/state.json")));
}

int main(void)
{
    tkd_test_require_built((const char *[]){DUMP, TRAIN, NULL});
    return TKD_TEST_RUN_WITH(group_setup, tkd_test_group_dir_teardown, TKD_TEST_EACH_NONE, test_mapping,
                             test_train_nproc_per_node, test_signals, test_config_errors, test_runtime_errors);
}
