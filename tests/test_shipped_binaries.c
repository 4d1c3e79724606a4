/* test_shipped_binaries.c — the test hooks live only in the test build (common/test_hooks.h): the
 * shipped teacher-dump and student-train hold no TKD_*_TEST_* name (the test builds do: the search
 * can find one), and the shipped teacher-dump run with the hook variables set ignores them and
 * writes the whole cache. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/dump_testutil.h"

#define DUMP TKD_BINARY_DIR "/bin/teacher-dump"
#define TRAIN TKD_BINARY_DIR "/bin/student-train"
#define DUMP_HOOKS TKD_BINARY_DIR "/bin/teacher-dump-testhooks"

/* 1 when the file at path holds the bytes of needle anywhere. */
static int file_has(const char *path, const char *needle)
{
    size_t len = 0, n = strlen(needle);
    char *data = tkd_test_slurp(path, &len);
    int found = 0;
    for (size_t i = 0; !found && i + n <= len; i++)
        found = memcmp(data + i, needle, n) == 0;
    free(data);
    return found;
}

static void test_no_hook_names(void **state)
{
    (void)state;
    /* every hook variable is TKD_<TOOL>_TEST_<WHAT> */
    assert_true(file_has(DUMP_HOOKS, "TKD_DUMP_TEST_KILL_AFTER_BATCHES"));
    assert_true(file_has(DUMP_HOOKS, "_TEST_"));
    assert_false(file_has(DUMP, "_TEST_"));
    assert_false(file_has(TRAIN, "_TEST_"));
}

/* Each hook variable that would kill or interrupt the test build after the first batch. */
static void test_hook_variables_ignored(void **state)
{
    (void)state;
    const char *env[] = {"TKD_DUMP_TEST_KILL_AFTER_BATCHES=1", "TKD_DUMP_TEST_SIGINT_AFTER_BATCHES=1"};
    char *dir = tkd_test_mkdtemp("shipped-hooks");
    const char *cfg = tkd_dt_cli_config(dir, 11, "");
    for (int i = 0; i < 2; i++) {
        char out[4300], set[4400];
        snprintf(out, sizeof out, "%s/out%d", dir, i);
        snprintf(set, sizeof set, "output.dir=%s", out);
        const char *args[] = {"-q", "--config", cfg, "--set", set, NULL};
        assert_int_equal(tkd_test_run(DUMP, args, env[i], tkd_test_path(dir, "log")), 0);
        tkd_cache_batch b;
        assert_int_equal(tkd_dt_read_all(out, &b, NULL), 18); /* every window of the config */
        tkd_cache_batch_free(&b);
        assert_int_equal(tkd_dt_count_suffix(out, ".tmp"), 0);
    }
    tkd_test_rmdtemp(dir);
}

int main(void)
{
    if (access(DUMP, X_OK) != 0 || access(TRAIN, X_OK) != 0 || access(DUMP_HOOKS, X_OK) != 0) {
        printf("skipped: the tools are not built\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_hook_names),
        cmocka_unit_test(test_hook_variables_ignored),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
