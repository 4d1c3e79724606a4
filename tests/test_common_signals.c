/* test_common_signals.c — first signal sets the flag (and ends a blocking open), the second one
 * kills. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/signals.h"
#include "tests/testutil.h"

static void test_first_signal_sets_flag(void **state)
{
    (void)state;
    assert_int_equal(tkd_signals_install(), TKD_OK);
    assert_int_equal(tkd_interrupted(), 0);
    raise(SIGTERM);
    assert_int_equal(tkd_interrupted(), SIGTERM); /* still alive, flag set */
    tkd_signals_uninstall();
    assert_int_equal(tkd_interrupted(), 0);
    assert_int_equal(tkd_signals_install(), TKD_OK);
    raise(SIGINT);
    assert_int_equal(tkd_interrupted(), SIGINT);
    tkd_signals_uninstall();
}

static void test_second_signal_kills(void **state)
{
    (void)state;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (tkd_signals_install() != TKD_OK)
            _exit(2);
        raise(SIGINT);
        if (tkd_interrupted() != SIGINT)
            _exit(3);
        raise(SIGINT); /* default action now: terminate */
        _exit(0);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGINT);
}

/* Waits until process pid sleeps in the kernel (state 'S' in /proc/<pid>/stat). */
static void wait_until_blocked(pid_t pid)
{
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    for (int i = 0; i < 1000; i++) {
        FILE *f = fopen(path, "r");
        assert_non_null(f);
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = '\0';
        const char *paren = strrchr(buf, ')'); /* "pid (comm) S ..." */
        if (paren && paren[1] == ' ' && paren[2] == 'S')
            return;
        usleep(5000);
    }
    fail_msg("child %d never blocked", (int)pid);
}

/* The first SIGINT ends an open that blocks on a FIFO nobody writes to (with SA_RESTART the open
 * would be restarted and the signal swallowed): the open fails with EINTR, the flag is set. */
static void test_first_signal_ends_a_blocking_open(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("signals");
    const char *fifo = tkd_test_path(dir, "fifo");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    int sync[2];
    pid_t pid = tkd_test_fork(sync);
    if (pid == 0) {
        if (tkd_signals_install() != TKD_OK || write(sync[1], "r", 1) != 1)
            _exit(2);
        int fd = open(fifo, O_RDONLY); /* blocks: no writer */
        _exit(fd < 0 && errno == EINTR && tkd_interrupted() == SIGINT ? 0 : 3);
    }
    char c;
    assert_int_equal(read(sync[0], &c, 1), 1);
    wait_until_blocked(pid);
    assert_int_equal(kill(pid, SIGINT), 0);
    assert_int_equal(tkd_test_wait_timeout(pid, 1.0), 0); /* within a second, and by the open's EINTR */
    close(sync[0]);
    close(sync[1]);
    tkd_test_rmdtemp(dir);
}

TKD_TEST_MAIN(test_first_signal_sets_flag, test_second_signal_kills, test_first_signal_ends_a_blocking_open)
