/* test_common_progress.c — the pure formatter: rate, ETA, durations, truncation. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/progress.h"

static const char *dur(double s)
{
    static char b[32];
    tkd_progress_format_duration(b, sizeof b, s);
    return b;
}

static const char *rate(double r)
{
    static char b[32];
    tkd_progress_format_rate(b, sizeof b, r);
    return b;
}

static void test_duration_and_rate(void **state)
{
    (void)state;
    assert_string_equal(dur(0), "0:00");
    assert_string_equal(dur(59.4), "0:59");
    assert_string_equal(dur(59.6), "1:00");
    assert_string_equal(dur(3599), "59:59");
    assert_string_equal(dur(3600), "1:00:00");
    assert_string_equal(dur(90061), "25:01:01");
    assert_string_equal(dur(-1), "--");
    assert_string_equal(dur(NAN), "--");
    assert_string_equal(dur(INFINITY), "--");
    assert_string_equal(dur(1e9), ">99d");
    assert_string_equal(rate(0), "0.0");
    assert_string_equal(rate(456.74), "457");
    assert_string_equal(rate(45.67), "45.7");
    assert_string_equal(rate(999.96), "1.0k");
    assert_string_equal(rate(12345), "12.3k");
    assert_string_equal(rate(4.56e6), "4.6M");
    assert_string_equal(rate(123.4e9), "123G");
    assert_string_equal(rate(NAN), "--");
}

static void test_format_line(void **state)
{
    (void)state;
    char buf[256];
    /* 2500 of 10000 in 5 s: 500/s, 7500 left -> 15 s */
    size_t n = tkd_progress_format(buf, sizeof buf, "dump", 2500, 10000, 5.0, "tokens",
                                   "3.1 B/token", false);
    assert_string_equal(buf, "dump 2500/10000 (25.0%)  500 tokens/s  ETA 0:15  3.1 B/token");
    assert_int_equal(n, strlen(buf));
    /* nothing done yet: no rate, no ETA */
    tkd_progress_format(buf, sizeof buf, "dump", 0, 10000, 0.0, "tokens", NULL, false);
    assert_string_equal(buf, "dump 0/10000 (0.0%)  -- tokens/s  ETA --");
    /* unknown total */
    tkd_progress_format(buf, sizeof buf, "train", 300, 0, 60.0, "steps", "loss 2.31", false);
    assert_string_equal(buf, "train 300  5.0 steps/s  loss 2.31");
    /* past the total: percent capped, ETA zero */
    tkd_progress_format(buf, sizeof buf, "x", 12, 10, 1.0, "seq", "", false);
    assert_string_equal(buf, "x 12/10 (100.0%)  12.0 seq/s  ETA 0:00");
    /* the final line */
    tkd_progress_format(buf, sizeof buf, "dump", 10000, 10000, 3725.0, "tokens", "ok", true);
    assert_string_equal(buf, "dump 10000/10000 done in 1:02:05  2.7 tokens/s  ok");
    /* a small buffer truncates safely */
    char small[12];
    n = tkd_progress_format(small, sizeof small, "dump", 2500, 10000, 5.0, "tokens", NULL, false);
    assert_string_equal(small, "dump 2500/1");
    assert_int_equal(n, 11);
}

static void test_plain_lines_when_not_a_terminal(void **state)
{
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    tkd_progress p;
    tkd_progress_begin(&p, "dump", 4, "seq");
    p.out = mem;
    p.tty = false;
    tkd_progress_set_interval(&p, 1e9); /* no periodic lines within this test */
    tkd_progress_update(&p, 1, "a");
    tkd_progress_update(&p, 4, NULL);
    tkd_progress_finish(&p, NULL);
    fclose(mem);
    assert_non_null(strstr(buf, "dump 4/4 done in 0:00"));
    assert_non_null(strstr(buf, "seq/s  a\n")); /* extra kept from the earlier update */
    assert_null(strchr(buf, '\r'));
    assert_int_equal(strchr(buf, '\n') - buf + 1, (long)len); /* exactly one line */
    free(buf);
    /* quiet: nothing at all */
    buf = NULL;
    mem = open_memstream(&buf, &len);
    tkd_log_set_level(TKD_LOG_LEVEL_WARN);
    tkd_progress_begin(&p, "dump", 4, "seq");
    p.out = mem;
    tkd_progress_finish(&p, NULL);
    tkd_log_set_level(TKD_LOG_LEVEL_INFO);
    fclose(mem);
    assert_int_equal(len, 0);
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_duration_and_rate),
        cmocka_unit_test(test_format_line),
        cmocka_unit_test(test_plain_lines_when_not_a_terminal),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
