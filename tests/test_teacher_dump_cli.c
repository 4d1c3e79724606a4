/* test_teacher_dump_cli.c — build/bin/teacher-dump (teacher-dump-testhooks where a test hook kills
 * or interrupts it) as child processes: a SIGKILL in the middle of a shard then a re-run gives the
 * same cache as one uninterrupted run; SIGINT leaves a valid manifest, no .tmp, exit 130 and a
 * one-line hint; two concurrent workers + `merge` give the same cache as one worker (tail draws
 * included); merge refuses an unfinished split; errors are one line. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "teacher_cache/dump_dir.h"
#include "tests/dump_testutil.h"

#define BIN TKD_BINARY_DIR "/bin/teacher-dump"
#define BIN_HOOKS TKD_BINARY_DIR "/bin/teacher-dump-testhooks" /* the test build: hooks compiled in */

/* Starts teacher-dump with args (NULL-terminated, argv[0] excluded) and one optional extra
 * environment assignment "NAME=value"; stdout and stderr go to <dir>/<tag>.err. A test hook
 * (TKD_DUMP_TEST_*) exists only in the test build, so that is the binary those runs start. */
static pid_t spawn(const char *dir, const char *tag, const char *env, const char *const *args)
{
    char err_path[4300];
    snprintf(err_path, sizeof err_path, "%s/%s.err", dir, tag);
    int hook = env && strncmp(env, "TKD_DUMP_TEST_", 14) == 0;
    return tkd_test_spawn(hook ? BIN_HOOKS : BIN, args, env, err_path);
}

/* spawn, then wait: the exit code, or 1000 + signal number when killed by a signal. */
static int run(const char *dir, const char *tag, const char *env, const char *const *args)
{
    return tkd_test_wait(spawn(dir, tag, env, args));
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

/* One test's files: a temp dir with the config (18 windows of 16 tokens in shards of 4, batches
 * of 2, k 8, 3 tail draws), the cache under test <dir>/out and, for the
 * tests that compare against one, the reference cache <dir>/ref. */
typedef struct cli_case {
    const char *dir;
    const char *cfg;
    char out[4400];                    /* "output.dir=<dir>/out" */
    char ref_dir[4300], out_dir[4300]; /* <dir>/ref, <dir>/out */
} cli_case;

static const char *const NO_ARGS[] = {NULL};

/* Starts teacher-dump --config <cfg> --set output.dir=<dir>/out, then extra (NULL-terminated);
 * output to <dir>/<tag>.err as spawn. */
static pid_t spawn_out(const cli_case *c, const char *tag, const char *env, const char *const *extra)
{
    const char *args[16] = {"--config", c->cfg, "--set", c->out};
    int n = 4;
    for (; extra[n - 4]; n++) {
        assert_true(n < 15);
        args[n] = extra[n - 4];
    }
    args[n] = NULL;
    return spawn(c->dir, tag, env, args);
}

static int run_out(const cli_case *c, const char *tag, const char *env, const char *const *extra)
{
    return tkd_test_wait(spawn_out(c, tag, env, extra));
}

/* Makes the case in dir (the test's own, TKD_TEST_EACH_DIR); with_ref: also the reference cache,
 * one uninterrupted run into <dir>/ref. */
static void case_begin(cli_case *c, const char *dir, int with_ref)
{
    c->dir = dir;
    c->cfg = tkd_dt_cli_config(c->dir, 11, ", tail_samples: 3, seed: 7");
    snprintf(c->ref_dir, sizeof c->ref_dir, "%s/ref", c->dir);
    snprintf(c->out_dir, sizeof c->out_dir, "%s/out", c->dir);
    snprintf(c->out, sizeof c->out, "output.dir=%s", c->out_dir);
    if (with_ref) {
        char ref[4400];
        snprintf(ref, sizeof ref, "output.dir=%s", c->ref_dir);
        assert_int_equal(run(c->dir, "ref", NULL, (const char *[]){"--config", c->cfg, "--set", ref, NULL}), 0);
    }
}

/* A finished cache (run "first") with shard-00002.h5 deleted. */
static void finished_without_shard_2(const cli_case *c)
{
    assert_int_equal(run_out(c, "first", NULL, NO_ARGS), 0);
    assert_int_equal(unlink(tkd_test_path(c->out_dir, "shard-00002.h5")), 0);
}

static void test_kill_mid_shard_then_resume(void **state)
{
    cli_case c;
    case_begin(&c, *state, 1);
    /* Batch 3 is the first half of shard 1: the process dies with shard 0 listed and shard 1's
     * .tmp half written. */
    assert_int_equal(run_out(&c, "kill", "TKD_DUMP_TEST_KILL_AFTER_BATCHES=3", NO_ARGS), 1000 + SIGKILL);
    assert_int_equal(tkd_dt_count_suffix(c.out_dir, ".h5.tmp"), 1);
    assert_int_equal(tkd_dt_count_suffix(c.out_dir, ".h5"), 1);

    assert_int_equal(run_out(&c, "resume", NULL, NO_ARGS), 0);
    assert_int_equal(tkd_dt_count_suffix(c.out_dir, ".tmp"), 0);
    tkd_dt_assert_same_cache(c.ref_dir, c.out_dir);
}

/* A finished cache with a shard deleted: the same command (no --overwrite) re-makes it, says so, and
 * the cache equals the uninterrupted one. */
static void test_rerun_repairs_a_missing_shard(void **state)
{
    cli_case c;
    case_begin(&c, *state, 1);
    finished_without_shard_2(&c);
    assert_int_equal(run_out(&c, "repair", NULL, NO_ARGS), 0);
    assert_non_null(strstr(child_err(c.dir, "repair"), "re-made 1 listed shard(s) found missing or damaged; the first: "));
    assert_non_null(strstr(child_err(c.dir, "repair"), "shard-00002.h5: listed in the manifest but missing\n"));
    tkd_dt_assert_same_cache(c.ref_dir, c.out_dir);
}

/* A shard's temporary file left behind and still held (flock) by another program: it is a temporary
 * of this cache, so the re-run, which holds the cache's own lock, removes it and re-makes the shard;
 * HDF5's own lock error never shows (its message for a locked shard that is read is checked by
 * test_cache_broken's test_locked_shard). */
static void test_locked_file_message(void **state)
{
    cli_case c;
    case_begin(&c, *state, 1);
    finished_without_shard_2(&c);
    int fd = open(tkd_test_path(c.out_dir, "shard-00002.h5.tmp"), O_RDWR | O_CREAT, 0644);
    assert_true(fd >= 0);
    assert_int_equal(flock(fd, LOCK_EX | LOCK_NB), 0);
    assert_int_equal(run_out(&c, "locked", NULL, NO_ARGS), 0);
    assert_null(strstr(child_err(c.dir, "locked"), "HDF5-DIAG"));
    assert_null(strstr(child_err(c.dir, "locked"), "errno"));
    close(fd);
    tkd_dt_assert_same_cache(c.ref_dir, c.out_dir);
}

static void test_sigint_leaves_valid_manifest(void **state)
{
    cli_case c;
    case_begin(&c, *state, 1);
    assert_int_equal(run_out(&c, "int", "TKD_DUMP_TEST_SIGINT_AFTER_BATCHES=5", NO_ARGS), 130);
    assert_error_line(c.dir, "int", "re-run the same command to resume");
    assert_int_equal(tkd_dt_count_suffix(c.out_dir, ".tmp"), 0);
    /* the manifest reads back and lists whole shards only: two of four sequences each */
    tkd_cache_batch b;
    tkd_cache_manifest m;
    assert_int_equal(tkd_dt_read_all(c.out_dir, &b, &m), 8);
    assert_int_equal(m.num_shards, 2);
    tkd_cache_batch_free(&b);
    tkd_cache_manifest_free(&m);

    assert_int_equal(run_out(&c, "resume", NULL, NO_ARGS), 0);
    tkd_dt_assert_same_cache(c.ref_dir, c.out_dir);
}

static void test_two_workers_and_merge(void **state)
{
    cli_case c;
    case_begin(&c, *state, 1);
    const char *worker1[] = {"--set", "workers.index=1", "--set", "workers.count=2", NULL};
    const char *merge[] = {"merge", c.out_dir, NULL};

    /* Worker 1 only: merge must refuse (worker 0 missing). Then worker 0 via WORLD_SIZE/RANK, both
     * processes at once (worker 1 re-run finds its range complete). */
    assert_int_equal(run_out(&c, "w1", NULL, worker1), 0);
    assert_int_not_equal(run(c.dir, "merge1", NULL, merge), 0);
    assert_error_line(c.dir, "merge1", "worker 0 of 2 has not started — run it with workers.index=0");
    pid_t w0 = spawn_out(&c, "w0", "RANK=0", (const char *[]){"--set", "workers.count=2", NULL});
    pid_t w1 = spawn_out(&c, "w1b", NULL, worker1);
    assert_int_equal(tkd_test_wait(w0), 0);
    assert_int_equal(tkd_test_wait(w1), 0);
    assert_int_equal(run(c.dir, "merge", NULL, merge), 0);
    tkd_dt_assert_same_cache(c.ref_dir, c.out_dir);

    /* The merged cache is a finished single-worker cache: a plain re-run has nothing to do. */
    assert_int_equal(run_out(&c, "again", NULL, NO_ARGS), 0);
    assert_non_null(strstr(child_err(c.dir, "again"), "nothing to do"));
}

/* --nproc-per-node 2: the launcher runs both workers and the merge; the cache equals one worker's. */
static void test_nproc_per_node(void **state)
{
    cli_case c;
    case_begin(&c, *state, 1);
    assert_int_equal(run_out(&c, "launch", NULL, (const char *[]){"--nproc-per-node", "2", NULL}), 0);
    assert_non_null(strstr(child_err(c.dir, "launch"), "started worker 1 of 2 (pid "));
    assert_non_null(strstr(child_err(c.dir, "launch"), "2 workers done; merged "));
    tkd_dt_assert_same_cache(c.ref_dir, c.out_dir);
    /* workers.* are the launcher's to set; a malformed N is a usage error */
    assert_int_equal(run_out(&c, "count", NULL, (const char *[]){"--nproc-per-node=2", "--set", "workers.count=2", NULL}),
                     2);
    assert_error_line(c.dir, "count", "workers.index/workers.count are set (0/2) with --nproc-per-node 2");
    assert_int_equal(run_out(&c, "bad-n", NULL, (const char *[]){"--nproc-per-node", "two", NULL}), 2);
    assert_error_line(c.dir, "bad-n", "--nproc-per-node: 'two' is not an integer");
}

/* The pids of the launcher's workers, from its "started worker i of n (pid P)" lines. */
static void launched_pids(const char *dir, const char *tag, pid_t pids[2])
{
    const char *err = child_err(dir, tag);
    for (int i = 0; i < 2; i++) {
        char key[48];
        snprintf(key, sizeof key, "started worker %d of 2 (pid ", i);
        const char *p = strstr(err, key);
        if (!p)
            fail_msg("no '%s' in the stderr of %s:\n%s", key, tag, err);
        pids[i] = (pid_t)atol(p + strlen(key));
    }
}

/* Each worker has exited and been reaped (by the launcher: none is left behind). */
static void assert_gone(const pid_t pids[2])
{
    for (int i = 0; i < 2; i++) {
        errno = 0;
        if (kill(pids[i], 0) == 0 || errno != ESRCH) {
            kill(pids[i], SIGKILL);
            fail_msg("worker %d (pid %ld) outlived the launcher", i, (long)pids[i]);
        }
    }
}

/* Worker 1 fails (exit 3) while worker 0 waits for a signal: the launcher stops worker 0, exits 3
 * and names worker 1 with its pid. */
static void test_nproc_failing_worker_stops_the_others(void **state)
{
    cli_case c;
    case_begin(&c, *state, 0);
    setenv("TKD_DUMP_TEST_STALL_AFTER_BATCHES", "1", 1); /* inherited: spawn passes one variable */
    pid_t pid = spawn_out(&c, "launch", "TKD_DUMP_TEST_FAIL_RANK=1", (const char *[]){"--nproc-per-node", "2", NULL});
    unsetenv("TKD_DUMP_TEST_STALL_AFTER_BATCHES");
    int rc = tkd_test_wait_timeout(pid, 120.0);
    if (rc != 3)
        fail_msg("exit %d, not 3:\n%s", rc, child_err(c.dir, "launch"));
    pid_t pids[2];
    launched_pids(c.dir, "launch", pids);
    char want[96];
    snprintf(want, sizeof want, "worker 1 of 2 (pid %ld) failed with exit code 3; the others were stopped",
             (long)pids[1]);
    assert_error_line(c.dir, "launch", want);
    assert_gone(pids);
}

/* SIGTERM to the launcher reaches the workers (stalled, so only a signal ends them): all stop,
 * the launcher exits 143 with the resume hint, no worker outlives it. */
static void test_nproc_sigterm_stops_the_workers(void **state)
{
    cli_case c;
    case_begin(&c, *state, 0);
    pid_t pid = spawn_out(&c, "launch", "TKD_DUMP_TEST_STALL_AFTER_BATCHES=1", (const char *[]){"--nproc-per-node", "2", NULL});
    /* both workers started (the second's line is written once it is forked) */
    const char *err_path = tkd_test_path(c.dir, "launch.err");
    for (int t = 0; t < 6000 && (access(err_path, F_OK) != 0 || !strstr(child_err(c.dir, "launch"), "started worker 1 of 2"));
         t++)
        usleep(10000);
    assert_int_equal(kill(pid, SIGTERM), 0);
    assert_int_equal(tkd_test_wait_timeout(pid, 120.0), 143);
    pid_t pids[2];
    launched_pids(c.dir, "launch", pids);
    assert_error_line(c.dir, "launch", "re-run the same command to resume");
    assert_gone(pids);
}

/* A second writer on a cache directory stops at once with one line naming the holder's pid (exit
 * 1), and so does merge; after the holder is SIGKILLed the same command runs. */
static void test_second_writer_refused(void **state)
{
    cli_case c;
    case_begin(&c, *state, 0);
    assert_int_equal(tkd_owned_dir_claim(&tkd_dump_dir_kind, c.out_dir), TKD_OK);
    pid_t pid = tkd_test_lock_holder(c.out_dir, ".topkd-lock", NULL);
    char want[64];
    snprintf(want, sizeof want, "another teacher-dump (pid %ld) is writing there", (long)pid);
    assert_int_equal(run_out(&c, "busy", NULL, NO_ARGS), 1);
    assert_error_line(c.dir, "busy", want);
    /* merge takes the lock before it reads a worker's manifest (so this one need not be real) */
    char w0[4400];
    snprintf(w0, sizeof w0, "%s/manifest.worker-0.yaml", c.out_dir);
    tkd_test_write_text(w0, "x");
    assert_int_equal(run(c.dir, "merge", NULL, (const char *[]){"merge", c.out_dir, NULL}), 1);
    assert_error_line(c.dir, "merge", want);
    assert_int_equal(remove(w0), 0);
    tkd_test_kill_holder(pid);
    assert_int_equal(run_out(&c, "free", NULL, NO_ARGS), 0);
}

static void test_cli_errors(void **state)
{
    cli_case c;
    case_begin(&c, *state, 0);
    /* an unknown key: config error, exit 2 */
    assert_int_equal(run(c.dir, "key", NULL, (const char *[]){"--config", c.cfg, "--set", "cache.kk=3", NULL}), 2);
    assert_true(strncmp(child_err(c.dir, "key"), "teacher-dump: ", 14) == 0);
    assert_non_null(strstr(child_err(c.dir, "key"), "cache.kk"));
    /* a different config against an existing cache */
    assert_int_equal(run_out(&c, "first", NULL, (const char *[]){"--set", "data.max_sequences=4", NULL}), 0);
    assert_int_equal(run_out(&c, "other", NULL, (const char *[]){"--set", "cache.k=5", NULL}), 1);
    assert_error_line(c.dir, "other", "--overwrite");
    /* --print-config: YAML with the resolved stride; --help: every key */
    assert_int_equal(run_out(&c, "print", NULL, (const char *[]){"--print-config", NULL}), 0);
    assert_non_null(strstr(child_err(c.dir, "print"), "stride: 16"));
    assert_int_equal(run(c.dir, "help", NULL, (const char *[]){"--help", NULL}), 0);
    assert_non_null(strstr(child_err(c.dir, "help"), "lm_head.chunk_rows"));
    assert_non_null(strstr(child_err(c.dir, "help"), "merge DIR"));
    assert_null(strstr(child_err(c.dir, "help"), "--resume")); /* a re-run resumes */
    /* --resume is still accepted (old scripts), with a note, and does what a re-run does */
    assert_int_equal(run_out(&c, "resume-flag", NULL, (const char *[]){"--set", "data.max_sequences=4", "--resume", NULL}),
                     0);
    assert_non_null(strstr(child_err(c.dir, "resume-flag"), "teacher-dump: --resume is not needed"));
    assert_non_null(strstr(child_err(c.dir, "resume-flag"), "is complete"));
}

/* A FIFO nobody writes to, given as the token file or as the config, is refused at once with a
 * one-line error naming it (teacher-dump used to hang in open). */
static void test_fifo_inputs_refused(void **state)
{
    cli_case c;
    case_begin(&c, *state, 0);
    char fifo[4400], paths[4500];
    snprintf(fifo, sizeof fifo, "%s/tokens.fifo", c.dir);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    snprintf(paths, sizeof paths, "data.paths=[%s]", fifo);
    pid_t pid = spawn_out(&c, "tok", NULL, (const char *[]){"--set", paths, NULL});
    assert_int_equal(tkd_test_wait_timeout(pid, 60.0), 1);
    assert_error_line(c.dir, "tok", "tokens.fifo: token file is a FIFO (named pipe), not a regular file");
    pid = spawn(c.dir, "cfg", NULL, (const char *[]){"--config", fifo, NULL});
    assert_int_equal(tkd_test_wait_timeout(pid, 60.0), 1);
    assert_error_line(c.dir, "cfg", "tokens.fifo: config file is a FIFO (named pipe)");
}

int main(void)
{
    tkd_test_require_built((const char *[]){BIN, BIN_HOOKS, NULL});
    return TKD_TEST_RUN_WITH(NULL, NULL, TKD_TEST_EACH_DIR, test_kill_mid_shard_then_resume,
                             test_sigint_leaves_valid_manifest, test_locked_file_message,
                             test_rerun_repairs_a_missing_shard, test_two_workers_and_merge, test_nproc_per_node,
                             test_nproc_failing_worker_stops_the_others, test_nproc_sigterm_stops_the_workers,
                             test_second_writer_refused, test_cli_errors, test_fifo_inputs_refused);
}
