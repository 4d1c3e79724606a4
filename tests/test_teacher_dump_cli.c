/* test_teacher_dump_cli.c — build/bin/teacher-dump as child processes: a SIGKILL in the middle of a
 * shard then a re-run gives the same cache as one uninterrupted run; SIGINT leaves a valid manifest,
 * no .tmp, exit 130 and a one-line hint; two concurrent workers + `merge` give the same cache as one
 * worker (tail draws included); merge refuses an unfinished split; errors are one line. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/dump_testutil.h"

#define BIN TKD_BINARY_DIR "/bin/teacher-dump"

typedef struct child {
    pid_t pid;
    char err_path[4300];
} child;

/* Starts teacher-dump with args (NULL-terminated, argv[0] excluded) and one optional extra
 * environment assignment "NAME=value"; stdout and stderr go to <dir>/<tag>.err. */
static void spawn(child *c, const char *dir, const char *tag, const char *env, const char *const *args)
{
    snprintf(c->err_path, sizeof c->err_path, "%s/%s.err", dir, tag);
    const char *argv[32] = {BIN};
    int n = 1;
    for (; args[n - 1]; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
    fflush(NULL);
    c->pid = fork();
    assert_true(c->pid >= 0);
    if (c->pid == 0) {
        FILE *f = freopen(c->err_path, "w", stderr);
        if (!f || dup2(fileno(stderr), 1) < 0)
            _exit(99);
        if (env)
            putenv((char *)env);
        execv(BIN, (char *const *)argv);
        _exit(98);
    }
}

/* Waits; returns the exit code, or 1000 + signal number when killed by a signal. */
static int wait_child(child *c)
{
    int status = 0;
    assert_int_equal(waitpid(c->pid, &status, 0), c->pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
}

static int run(const char *dir, const char *tag, const char *env, const char *const *args)
{
    child c;
    spawn(&c, dir, tag, env, args);
    return wait_child(&c);
}

/* The child's whole stderr (static buffer). */
static const char *child_err(const char *dir, const char *tag)
{
    static char buf[8192];
    char path[4300];
    snprintf(path, sizeof path, "%s/%s.err", dir, tag);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* The last line of the child's stderr must be one "teacher-dump: ... — ..." error line. */
static void assert_error_line(const char *dir, const char *tag, const char *needle)
{
    const char *err = child_err(dir, tag);
    size_t len = strlen(err);
    assert_true(len > 0 && err[len - 1] == '\n');
    const char *last = err + len - 1;
    while (last > err && last[-1] != '\n')
        last--;
    if (strncmp(last, "teacher-dump: ", 14) != 0 || !strstr(last, " — ") || !strstr(last, needle))
        fail_msg("stderr of %s does not end in a one-line error with '%s':\n%s", tag, needle, err);
}

/* <dir>/c.yaml: 18 windows of 16 tokens in shards of 4, batches of 2, k 8, 3 tail draws. */
static const char *setup(const char *dir)
{
    static char cfg_path[4300];
    const char *tok = tkd_dt_random_tokens(dir, "tok.npy", 300, 131, 11);
    snprintf(cfg_path, sizeof cfg_path, "%s/c.yaml", dir);
    FILE *f = fopen(cfg_path, "w");
    assert_non_null(f);
    fprintf(f,
            "teacher: {path: '%s'}\n"
            "data: {paths: ['%s'], seq_len: 16}\n"
            "cache: {k: 8, shard_sequences: 4, tail_samples: 3, seed: 7}\n"
            "run: {batch_size: 2}\n"
            "lm_head: {chunk_rows: 24}\n",
            TKD_DT_LLAMA, tok);
    fclose(f);
    return cfg_path;
}

static void set_out(char *buf, size_t cap, const char *dir, const char *name)
{
    snprintf(buf, cap, "output.dir=%s/%s", dir, name);
}

static void test_kill_mid_shard_then_resume(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("dumpcli-kill");
    const char *cfg = setup(dir);
    char ref[4300], out[4300], ref_dir[4300], out_dir[4300];
    set_out(ref, sizeof ref, dir, "ref");
    set_out(out, sizeof out, dir, "out");
    snprintf(ref_dir, sizeof ref_dir, "%s/ref", dir);
    snprintf(out_dir, sizeof out_dir, "%s/out", dir);
    assert_int_equal(run(dir, "ref", NULL, (const char *[]){"--config", cfg, "--set", ref, NULL}), 0);

    /* Batch 3 is the first half of shard 1: the process dies with shard 0 listed and shard 1's
     * .tmp half written. */
    int rc = run(dir, "kill", "TKD_DUMP_TEST_KILL_AFTER_BATCHES=3",
                 (const char *[]){"--config", cfg, "--set", out, NULL});
    assert_int_equal(rc, 1000 + SIGKILL);
    assert_int_equal(tkd_dt_count_suffix(out_dir, ".h5.tmp"), 1);
    assert_int_equal(tkd_dt_count_suffix(out_dir, ".h5"), 1);

    assert_int_equal(run(dir, "resume", NULL, (const char *[]){"--config", cfg, "--set", out, NULL}), 0);
    assert_int_equal(tkd_dt_count_suffix(out_dir, ".tmp"), 0);
    tkd_dt_assert_same_cache(ref_dir, out_dir);
    tkd_test_rmtree(dir);
    free(dir);
}

static void test_sigint_leaves_valid_manifest(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("dumpcli-sigint");
    const char *cfg = setup(dir);
    char ref[4300], out[4300], ref_dir[4300], out_dir[4300];
    set_out(ref, sizeof ref, dir, "ref");
    set_out(out, sizeof out, dir, "out");
    snprintf(ref_dir, sizeof ref_dir, "%s/ref", dir);
    snprintf(out_dir, sizeof out_dir, "%s/out", dir);
    assert_int_equal(run(dir, "ref", NULL, (const char *[]){"--config", cfg, "--set", ref, NULL}), 0);

    int rc = run(dir, "int", "TKD_DUMP_TEST_SIGINT_AFTER_BATCHES=5",
                 (const char *[]){"--config", cfg, "--set", out, NULL});
    assert_int_equal(rc, 130);
    assert_error_line(dir, "int", "re-run the same command to resume");
    assert_int_equal(tkd_dt_count_suffix(out_dir, ".tmp"), 0);
    /* the manifest reads back and lists whole shards only: two of four sequences each */
    tkd_cache_batch b;
    tkd_cache_manifest m;
    assert_int_equal(tkd_dt_read_all(out_dir, &b, &m), 8);
    assert_int_equal(m.num_shards, 2);
    tkd_cache_batch_free(&b);
    tkd_cache_manifest_free(&m);

    assert_int_equal(run(dir, "resume", NULL, (const char *[]){"--config", cfg, "--set", out, NULL}), 0);
    tkd_dt_assert_same_cache(ref_dir, out_dir);
    tkd_test_rmtree(dir);
    free(dir);
}

static void test_two_workers_and_merge(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("dumpcli-workers");
    const char *cfg = setup(dir);
    char ref[4300], out[4300], ref_dir[4300], out_dir[4300];
    set_out(ref, sizeof ref, dir, "ref");
    set_out(out, sizeof out, dir, "out");
    snprintf(ref_dir, sizeof ref_dir, "%s/ref", dir);
    snprintf(out_dir, sizeof out_dir, "%s/out", dir);
    assert_int_equal(run(dir, "ref", NULL, (const char *[]){"--config", cfg, "--set", ref, NULL}), 0);

    /* Worker 1 only: merge must refuse (worker 0 missing). Then worker 0 via WORLD_SIZE/RANK, both
     * processes at once (worker 1 re-run finds its range complete). */
    assert_int_equal(run(dir, "w1", NULL, (const char *[]){"--config", cfg, "--set", out, "--set", "workers.index=1",
                                                           "--set", "workers.count=2", NULL}), 0);
    assert_int_not_equal(run(dir, "merge1", NULL, (const char *[]){"merge", out_dir, NULL}), 0);
    assert_error_line(dir, "merge1", "worker");
    child c0, c1;
    spawn(&c0, dir, "w0", "RANK=0", (const char *[]){"--config", cfg, "--set", out, "--set", "workers.count=2", NULL});
    spawn(&c1, dir, "w1b", NULL, (const char *[]){"--config", cfg, "--set", out, "--set", "workers.index=1",
                                                  "--set", "workers.count=2", NULL});
    assert_int_equal(wait_child(&c0), 0);
    assert_int_equal(wait_child(&c1), 0);
    assert_int_equal(run(dir, "merge", NULL, (const char *[]){"merge", out_dir, NULL}), 0);
    tkd_dt_assert_same_cache(ref_dir, out_dir);

    /* The merged cache is a finished single-worker cache: a plain re-run has nothing to do. */
    assert_int_equal(run(dir, "again", NULL, (const char *[]){"--config", cfg, "--set", out, NULL}), 0);
    assert_non_null(strstr(child_err(dir, "again"), "nothing to do"));
    tkd_test_rmtree(dir);
    free(dir);
}

static void test_cli_errors(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("dumpcli-errors");
    const char *cfg = setup(dir);
    char out[4300];
    set_out(out, sizeof out, dir, "out");
    /* an unknown key: config error, exit 2 */
    assert_int_equal(run(dir, "key", NULL, (const char *[]){"--config", cfg, "--set", "cache.kk=3", NULL}), 2);
    assert_true(strncmp(child_err(dir, "key"), "teacher-dump: ", 14) == 0);
    assert_non_null(strstr(child_err(dir, "key"), "cache.kk"));
    /* a different config against an existing cache */
    assert_int_equal(run(dir, "first", NULL, (const char *[]){"--config", cfg, "--set", out, "--set",
                                                              "data.max_sequences=4", NULL}), 0);
    assert_int_equal(run(dir, "other", NULL, (const char *[]){"--config", cfg, "--set", out, "--set", "cache.k=5", NULL}), 1);
    assert_error_line(dir, "other", "--overwrite");
    /* --print-config: YAML with the resolved stride; --help: every key */
    assert_int_equal(run(dir, "print", NULL, (const char *[]){"--config", cfg, "--set", out, "--print-config", NULL}), 0);
    assert_non_null(strstr(child_err(dir, "print"), "stride: 16"));
    assert_int_equal(run(dir, "help", NULL, (const char *[]){"--help", NULL}), 0);
    assert_non_null(strstr(child_err(dir, "help"), "lm_head.chunk_rows"));
    assert_non_null(strstr(child_err(dir, "help"), "merge DIR"));
    tkd_test_rmtree(dir);
    free(dir);
}

int main(void)
{
    if (access(BIN, X_OK) != 0) {
        printf("skipped: %s not built\n", BIN);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kill_mid_shard_then_resume),
        cmocka_unit_test(test_sigint_leaves_valid_manifest),
        cmocka_unit_test(test_two_workers_and_merge),
        cmocka_unit_test(test_cli_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
