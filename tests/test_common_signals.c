/* test_common_signals.c — first signal sets the flag, the second one kills. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/signals.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_signal_sets_flag),
        cmocka_unit_test(test_second_signal_kills),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
