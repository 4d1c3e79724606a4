/* test_common_dir_lock.c — one writer per directory (common/dir_lock.h), across processes: a second
 * writer is refused at once with the holder's pid, a SIGKILLed holder leaves no stale lock, workers
 * holding parts run side by side but exclude an exclusive writer and a second holder of their part. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/dir_lock.h"
#include "tests/testutil.h"

/* The message of a refusal must name the tool and the holder's pid. */
static void assert_busy_names(tkd_status st, pid_t pid)
{
    char want[64];
    snprintf(want, sizeof want, "(pid %ld)", (long)pid);
    assert_int_equal(st, TKD_ERR_BUSY);
    tkd_test_assert_msg_has("another tool ");
    tkd_test_assert_msg_has(want);
    tkd_test_assert_msg_has("is writing there");
}

static void test_second_writer_refused_until_holder_dies(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    pid_t pid = tkd_test_lock_holder(dir, ".lock", NULL);
    tkd_dir_lock *l = NULL;
    assert_busy_names(tkd_dir_lock_take(dir, ".lock", "tool", &l), pid);
    assert_null(l);
    tkd_test_assert_msg_has(dir);
    /* a worker's part is refused too while an exclusive writer holds the directory */
    assert_busy_names(tkd_dir_lock_take_part(dir, ".lock", "worker-0", "tool", &l), pid);
    assert_null(l);

    /* SIGKILL: the kernel drops the lock, nothing stale is left */
    tkd_test_kill_holder(pid);
    assert_int_equal(tkd_dir_lock_take(dir, ".lock", "tool", &l), TKD_OK);
    assert_non_null(l);
    /* a second handle in the same process is refused as well (flock is per open file) */
    tkd_dir_lock *again = NULL;
    assert_busy_names(tkd_dir_lock_take(dir, ".lock", "tool", &again), getpid());
    tkd_dir_lock_release(l);
    assert_int_equal(tkd_dir_lock_take(dir, ".lock", "tool", &again), TKD_OK);
    tkd_dir_lock_release(again);
    tkd_dir_lock_release(NULL);
}

static void test_parts_run_side_by_side(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    pid_t w0 = tkd_test_lock_holder(dir, ".lock", "worker-0"), w1 = tkd_test_lock_holder(dir, ".lock", "worker-1");
    tkd_dir_lock *l = NULL;
    /* the same part again: refused naming that part's holder */
    assert_busy_names(tkd_dir_lock_take_part(dir, ".lock", "worker-1", "tool", &l), w1);
    /* an exclusive writer: refused naming both workers (in directory order) */
    assert_int_equal(tkd_dir_lock_take(dir, ".lock", "tool", &l), TKD_ERR_BUSY);
    tkd_test_assert_msg_has("another tool (pid ");
    char want[2][64];
    snprintf(want[0], sizeof want[0], "%ld", (long)w0);
    snprintf(want[1], sizeof want[1], "%ld", (long)w1);
    tkd_test_assert_msg_has(want[0]);
    tkd_test_assert_msg_has(want[1]);
    /* a third part is free */
    assert_int_equal(tkd_dir_lock_take_part(dir, ".lock", "worker-2", "tool", &l), TKD_OK);
    tkd_dir_lock_release(l);
    assert_int_equal(tkd_dir_lock_take_part(dir, ".lock", "a/b", "tool", &l), TKD_ERR_INVALID_ARG);

    tkd_test_kill_holder(w0);
    assert_int_equal(tkd_dir_lock_take(dir, ".lock", "tool", &l), TKD_ERR_BUSY); /* worker 1 still runs */
    tkd_test_kill_holder(w1);
    assert_int_equal(tkd_dir_lock_take(dir, ".lock", "tool", &l), TKD_OK);
    tkd_dir_lock_release(l);
}

static void test_missing_directory(void **state)
{
    (void)state;
    tkd_dir_lock *l = NULL;
    assert_int_equal(tkd_dir_lock_take("/nonexistent/topkd-dir", ".lock", "tool", &l), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("/nonexistent/topkd-dir/.lock");
    assert_null(l);
}

TKD_TEST_MAIN_EACH_DIR(test_second_writer_refused_until_holder_dies, test_parts_run_side_by_side,
    test_missing_directory)
