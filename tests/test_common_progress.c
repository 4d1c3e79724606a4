/* test_common_progress.c — the pure formatter (rate and its unit, ETA, durations, truncation) and
 * when lines are drawn. */
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
#include "tests/testutil.h"

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
    /* below 1/s two significant digits, never "0.0" for a rate that is not zero */
    assert_string_equal(rate(0.042), "0.042");
    assert_string_equal(rate(0.5), "0.5");
    assert_string_equal(rate(0.994), "0.99");
    assert_string_equal(rate(18234), "18.2k");
    assert_string_equal(rate(2.5e6), "2.5M");
}

static void test_format_line(void **state)
{
    (void)state;
    char buf[256];
    /* 2500 of 10000 in 5 s: 500/s, 7500 left -> 15 s */
    size_t n = tkd_progress_format(buf, sizeof buf, "dump", 2500, 10000, 5.0, "tokens", 0, NULL,
                                   "3.1 B/token", false);
    assert_string_equal(buf, "dump 2500/10000 (25.0%)  500 tokens/s  ETA 0:15  3.1 B/token");
    assert_int_equal(n, strlen(buf));
    /* nothing done yet: no rate, no ETA */
    tkd_progress_format(buf, sizeof buf, "dump", 0, 10000, 0.0, "tokens", 0, NULL, NULL, false);
    assert_string_equal(buf, "dump 0/10000 (0.0%)  -- tokens/s  ETA --");
    /* unknown total */
    tkd_progress_format(buf, sizeof buf, "train", 300, 0, 60.0, "steps", 0, NULL, "loss 2.31", false);
    assert_string_equal(buf, "train 300  5.0 steps/s  loss 2.31");
    /* past the total: percent capped, ETA zero */
    tkd_progress_format(buf, sizeof buf, "x", 12, 10, 1.0, "seq", 0, NULL, "", false);
    assert_string_equal(buf, "x 12/10 (100.0%)  12.0 seq/s  ETA 0:00");
    /* the final line */
    tkd_progress_format(buf, sizeof buf, "dump", 10000, 10000, 3725.0, "tokens", 0, "", "ok", true);
    assert_string_equal(buf, "dump 10000/10000 done in 1:02:05  2.7 tokens/s  ok");
    /* a small buffer truncates safely */
    char small[12];
    n = tkd_progress_format(small, sizeof small, "dump", 2500, 10000, 5.0, "tokens", 0, NULL, NULL, false);
    assert_string_equal(small, "dump 2500/1");
    assert_int_equal(n, 11);
}

/* A sequence of 1024 positions every 50 s: 0.02 seq/s would print "0.0 seq/s"; in tokens it is
 * 20.5 tok/s, and a fast run reads with a k/M suffix. */
static void test_format_rate_in_another_unit(void **state)
{
    (void)state;
    char buf[256];
    tkd_progress_format(buf, sizeof buf, "teacher-dump", 3, 100, 150.0, "seq", 3 * 1024, "tok", "3.1 B/token", false);
    assert_string_equal(buf, "teacher-dump 3/100 seq (3.0%)  20.5 tok/s  ETA 1:20:50  3.1 B/token");
    tkd_progress_format(buf, sizeof buf, "train", 40, 1000, 2.0, "steps", 36470, "tok", NULL, false);
    assert_string_equal(buf, "train 40/1000 steps (4.0%)  18.2k tok/s  ETA 0:48");
    tkd_progress_format(buf, sizeof buf, "teacher-dump", 5000, 5000, 4.0, "seq", 10000000, "tok", NULL, true);
    assert_string_equal(buf, "teacher-dump 5000/5000 seq done in 0:04  2.5M tok/s");
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
    tkd_progress_update(&p, 0, "a");    /* nothing done yet: no line */
    tkd_progress_update(&p, 1, NULL);   /* the first batch done: a line at once */
    tkd_progress_update(&p, 2, NULL);   /* then only every interval */
    tkd_progress_update(&p, 4, NULL);
    tkd_progress_finish(&p, NULL);
    fclose(mem);
    assert_null(strchr(buf, '\r'));
    char *second = strchr(buf, '\n') + 1;
    assert_int_equal(strncmp(buf, "dump 1/4 (25.0%)  ", 18), 0);
    assert_non_null(strstr(buf, "seq/s  ETA "));
    assert_non_null(strstr(second, "dump 4/4 done in 0:00"));
    assert_non_null(strstr(second, "seq/s  a\n")); /* extra kept from the earlier update */
    assert_int_equal(strchr(second, '\n') - buf + 1, (long)len); /* exactly two lines */
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

TKD_TEST_MAIN(test_duration_and_rate, test_format_line, test_format_rate_in_another_unit,
              test_plain_lines_when_not_a_terminal)
