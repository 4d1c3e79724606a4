/* test_common_launch.c — the `--nproc-per-node` launcher (common/launch.h) on its own: it re-runs
 * this test program, whose workers write down the environment they got (rank, world, local rank,
 * the rendezvous point and the job's nonce) or fail on request. Signal forwarding through a real
 * tool is covered by test_teacher_dump_cli. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/fileio.h"
#include "common/launch.h"
#include "common/signals.h"
#include "tests/testutil.h"

static const char *const vars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                   "MASTER_ADDR", "MASTER_PORT", "TKD_JOB_ID"};
#define NVARS (sizeof vars / sizeof vars[0])

/* A worker: writes "NAME=value" lines to <TKD_LAUNCH_TEST_OUT>/rank<RANK>; the rank named by
 * TKD_LAUNCH_TEST_FAIL exits 5, the others then wait for the launcher's SIGTERM. */
static int worker(const char *out)
{
    char text[1024] = "\n", path[4096]; /* every line after a newline, for var_of's search */
    size_t len = 1;
    for (size_t i = 0; i < NVARS; i++) {
        const char *v = getenv(vars[i]);
        len += (size_t)snprintf(text + len, sizeof text - len, "%s=%s\n", vars[i], v ? v : "(unset)");
    }
    snprintf(path, sizeof path, "%s/rank%s", out, getenv("RANK"));
    if (tkd_file_write_atomic(path, text, len) != TKD_OK)
        return 1;
    const char *fail = getenv("TKD_LAUNCH_TEST_FAIL");
    if (!fail)
        return 0;
    if (strcmp(fail, getenv("RANK")) == 0)
        return 5;
    for (int i = 0; i < 1000; i++) /* 10 s at most: the launcher stops us long before */
        nanosleep(&(struct timespec){0, 10000000}, NULL);
    return 0;
}

static char **g_argv;
static int g_argc;

/* The value of name in rank r's file (static buffer). */
static const char *var_of(const char *dir, int r, const char *name)
{
    static char val[256];
    char file[32], key[64];
    snprintf(file, sizeof file, "rank%d", r);
    char *data = tkd_test_slurp(tkd_test_path(dir, file), NULL);
    snprintf(key, sizeof key, "\n%s=", name);
    char *p = strstr(data, key);
    assert_non_null(p);
    p += strlen(key);
    size_t n = strcspn(p, "\n");
    snprintf(val, sizeof val, "%.*s", (int)n, p);
    free(data);
    return val;
}

static tkd_status launch(const char *dir, int n, int *rc)
{
    setenv("TKD_LAUNCH_TEST_OUT", dir, 1);
    tkd_status st = tkd_launch_workers("test", n, g_argc, g_argv, 1.0, rc);
    unsetenv("TKD_LAUNCH_TEST_OUT");
    return st;
}

static void test_workers_get_rank_world_and_rendezvous(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("launch");
    int rc = -1;
    unsetenv("MASTER_PORT");
    assert_int_equal(launch(dir, 3, &rc), TKD_OK);
    assert_int_equal(rc, 0);
    char port[32], job[64];
    snprintf(port, sizeof port, "%s", var_of(dir, 0, "MASTER_PORT"));
    snprintf(job, sizeof job, "%s", var_of(dir, 0, "TKD_JOB_ID"));
    assert_true(atoi(port) > 0 && atoi(port) < 65536);
    assert_true(strlen(job) > 8);
    for (int r = 0; r < 3; r++) {
        char want[8];
        snprintf(want, sizeof want, "%d", r);
        assert_string_equal(var_of(dir, r, "RANK"), want);
        assert_string_equal(var_of(dir, r, "LOCAL_RANK"), want);
        assert_string_equal(var_of(dir, r, "WORLD_SIZE"), "3");
        assert_string_equal(var_of(dir, r, "LOCAL_WORLD_SIZE"), "3");
        assert_string_equal(var_of(dir, r, "MASTER_ADDR"), "127.0.0.1");
        assert_string_equal(var_of(dir, r, "MASTER_PORT"), port);
        assert_string_equal(var_of(dir, r, "TKD_JOB_ID"), job);
    }
    /* the user's MASTER_PORT is kept; every launch has a job id of its own */
    setenv("MASTER_PORT", "29517", 1);
    assert_int_equal(launch(dir, 2, &rc), TKD_OK);
    unsetenv("MASTER_PORT");
    assert_string_equal(var_of(dir, 1, "MASTER_PORT"), "29517");
    assert_string_not_equal(var_of(dir, 1, "TKD_JOB_ID"), job);
    tkd_test_rmdtemp(dir);
}

/* Rank 1 exits 5: the others are stopped, the exit code is 5 and the message names rank 1. */
static void test_failing_rank_ends_the_others(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("launch-fail");
    int rc = -1;
    setenv("TKD_LAUNCH_TEST_FAIL", "1", 1);
    time_t t0 = time(NULL);
    assert_int_equal(launch(dir, 3, &rc), TKD_ERR_IO);
    unsetenv("TKD_LAUNCH_TEST_FAIL");
    assert_true(time(NULL) - t0 < 8); /* the sleepers were stopped, not waited for */
    assert_int_equal(rc, 5);
    tkd_test_assert_msg_has("worker 1 of 3 (pid ");
    tkd_test_assert_msg_has("failed with exit code 5; the others were stopped");
    tkd_test_rmdtemp(dir);
}

/* A launcher that is one rank of another launcher's job would start a job of its own per rank. */
static void test_nested_launch_refused(void **state)
{
    (void)state;
    int rc = -1;
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "2", 1);
    assert_int_equal(tkd_launch_workers("test", 2, g_argc, g_argv, 1.0, &rc), TKD_ERR_CONFIG);
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    tkd_test_assert_msg_has("--nproc-per-node 2 in rank 1 of a job of 2");
}

int main(int argc, char **argv)
{
    const char *out = getenv("TKD_LAUNCH_TEST_OUT");
    if (out && getenv("RANK"))
        return worker(out);
    g_argc = argc;
    g_argv = argv;
    tkd_signals_install();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_workers_get_rank_world_and_rendezvous),
        cmocka_unit_test(test_failing_rank_ends_the_others),
        cmocka_unit_test(test_nested_launch_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
