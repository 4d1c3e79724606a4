/* test_common_cli.c — shared CLI flags and the log level filter. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/log.h"
#include "tests/testutil.h"

#define ARGC(a) ((int)(sizeof(a) / sizeof((a)[0])))

static void test_parse_all_flags(void **state)
{
    (void)state;
    char *argv[] = {"teacher-dump", "merge", "--config", "c.yaml", "--set", "kd.k=8",
                    "--set=a.b=x=y", "--print-config", "-vv", "--quiet", "--resume", "out/dir",
                    "--", "--not-a-flag", "-"};
    tkd_cli cli;
    assert_int_equal(tkd_cli_parse(&cli, ARGC(argv), argv), TKD_OK);
    assert_string_equal(cli.config_path, "c.yaml");
    assert_int_equal(cli.nsets, 2);
    assert_string_equal(cli.sets[0], "kd.k=8");
    assert_string_equal(cli.sets[1], "a.b=x=y"); /* only the first '=' after --set splits */
    assert_true(cli.print_config);
    assert_true(cli.resume);
    assert_false(cli.overwrite);
    assert_false(cli.help);
    assert_int_equal(cli.verbosity, 1);
    assert_int_equal(tkd_cli_log_level(&cli), TKD_LOG_LEVEL_DEBUG);
    assert_int_equal(cli.nargs, 4);
    assert_string_equal(cli.args[0], "merge");
    assert_string_equal(cli.args[1], "out/dir");
    assert_string_equal(cli.args[2], "--not-a-flag");
    assert_string_equal(cli.args[3], "-");
    tkd_cli_free(&cli);
    tkd_cli_free(&cli);

    char *argv2[] = {"x", "--config=a.yaml", "-h", "-q", "-q", "--overwrite"};
    assert_int_equal(tkd_cli_parse(&cli, ARGC(argv2), argv2), TKD_OK);
    assert_string_equal(cli.config_path, "a.yaml");
    assert_true(cli.help);
    assert_true(cli.overwrite);
    assert_int_equal(tkd_cli_log_level(&cli), TKD_LOG_LEVEL_ERROR);
    assert_int_equal(cli.nargs, 0);
    tkd_cli_free(&cli);
}

static void expect_parse_error(int argc, char **argv, const char *frag)
{
    tkd_cli cli;
    assert_int_equal(tkd_cli_parse(&cli, argc, argv), TKD_ERR_INVALID_ARG);
    if (!strstr(tkd_error_msg(), frag))
        fail_msg("'%s' lacks '%s'", tkd_error_msg(), frag);
    assert_null(cli.sets); /* nothing left to free after an error */
}

static void test_parse_errors(void **state)
{
    (void)state;
    char *a1[] = {"x", "--overwirte"};
    expect_parse_error(2, a1, "unknown option '--overwirte' (did you mean '--overwrite'?)");
    char *a2[] = {"x", "--set"};
    expect_parse_error(2, a2, "--set needs key=value");
    char *a3[] = {"x", "--set", "novalue"};
    expect_parse_error(3, a3, "--set needs key=value");
    char *a4[] = {"x", "--config"};
    expect_parse_error(2, a4, "--config needs a file name");
    char *a5[] = {"x", "-x"};
    expect_parse_error(2, a5, "unknown option '-x'");
    char *a6[] = {"x", "--resume", "--overwrite"};
    expect_parse_error(3, a6, "--resume and --overwrite");
    char *a7[] = {"x", "--config", "a", "--config", "b"};
    expect_parse_error(5, a7, "--config given twice");
    char *a8[] = {"x", "--print-config=yes"};
    expect_parse_error(2, a8, "unknown option '--print-config'");
    /* the next flag is not taken for the missing file name (it was, and the tool exited 1 on
     * "--print-config: cannot open config file") */
    char *a9[] = {"x", "--config", "--print-config"};
    expect_parse_error(3, a9, "--config needs a file name, got the option '--print-config'");
    char *a10[] = {"x", "--config", "-v", "--set", "a.b=1"};
    expect_parse_error(5, a10, "--config needs a file name, got the option '-v'");
    char *ok[] = {"x", "--config=-odd.yaml"};
    tkd_cli cli;
    assert_int_equal(tkd_cli_parse(&cli, 2, ok), TKD_OK);
    assert_string_equal(cli.config_path, "-odd.yaml");
    tkd_cli_free(&cli);
}

typedef struct small_cfg {
    int n;
    double t;
} small_cfg;

static const tkd_config_field small_fields[] = {
    TKD_CFG_INT(small_cfg, n, "a.n", "3", 0, 100, "A count."),
    TKD_CFG_FLOAT(small_cfg, t, "a.t", "1.5", 0, 10, "A temperature."),
};
static const tkd_config_schema small = TKD_CONFIG_SCHEMA("small", small_fields);

static void test_load_config_and_help(void **state)
{
    (void)state;
    char *argv[] = {"x", "--set", "a.n=7", "--set=a.t=2.5"};
    tkd_cli cli;
    small_cfg c = {0};
    assert_int_equal(tkd_cli_parse(&cli, ARGC(argv), argv), TKD_OK);
    assert_int_equal(tkd_cli_load_config(&cli, &small, &c), TKD_OK);
    assert_int_equal(c.n, 7);
    assert_true(c.t == 2.5);
    tkd_cli_free(&cli);

    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    tkd_cli_print_help(mem, "small [options] DIR", &small);
    fclose(mem);
    assert_non_null(strstr(buf, "usage: small [options] DIR\n"));
    assert_non_null(strstr(buf, "--set KEY=VALUE"));
    assert_non_null(strstr(buf, "  a.t  (float, default 1.5, range [0, 10])\n      A temperature."));
    assert_null(strstr(buf, "--resume")); /* the usage does not offer it */
    free(buf);
    buf = NULL;
    mem = open_memstream(&buf, &len);
    tkd_cli_print_help(mem, "small [--resume | --overwrite] DIR", &small);
    fclose(mem);
    assert_non_null(strstr(buf, "  --resume           continue an interrupted run"));
    free(buf);
}

static void test_log_levels(void **state)
{
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    tkd_log_set_stream(mem);
    tkd_log_set_level(TKD_LOG_LEVEL_WARN);
    tkd_log_info("hidden %d", 1);
    tkd_log_debug("hidden %d", 2);
    tkd_log_warn("shard %d is slow", 3);
    tkd_log_error("disk full\n"); /* a trailing newline is not doubled */
    tkd_log_set_level(TKD_LOG_LEVEL_INFO);
    tkd_log_info("step %d", 4);
    assert_false(tkd_log_enabled(TKD_LOG_LEVEL_DEBUG));
    tkd_log_set_stream(NULL);
    fclose(mem);
    assert_string_equal(buf, "warn: shard 3 is slow\nerror: disk full\nstep 4\n");
    free(buf);
}

/* Both tools: a --config without its file is a usage error, exit 2, naming the problem. */
static void test_tools_missing_config_file(void **state)
{
    (void)state;
    const char *tools[] = {TKD_BINARY_DIR "/bin/teacher-dump", TKD_BINARY_DIR "/bin/student-train"};
    for (int i = 0; i < 2; i++)
        if (access(tools[i], X_OK) != 0) /* the build makes them: missing is a broken build */
            fail_msg("%s: not built", tools[i]);
    char *dir = tkd_test_mkdtemp("cli");
    const char *out = tkd_test_path(dir, "out.txt");
    for (int i = 0; i < 2; i++) {
        const char *args[] = {"--config", "--print-config", NULL};
        assert_int_equal(tkd_test_run(tools[i], args, NULL, out), 2);
        char *text = tkd_test_slurp(out, NULL);
        if (!strstr(text, "--config needs a file name, got the option '--print-config'"))
            fail_msg("%s printed: %s", tools[i], text);
        free(text);
    }
    tkd_test_rmdtemp(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_all_flags),
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_load_config_and_help),
        cmocka_unit_test(test_log_levels),
        cmocka_unit_test(test_tools_missing_config_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
