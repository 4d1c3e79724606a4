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

/* fmt(x[i]) for each of the n values must be the i-th space-separated word of want (each checked
 * on its own, so a failure names the value and both texts). */
static void expect_each(const char *(*fmt)(double), const double *x, size_t n, const char *want)
{
    for (size_t i = 0; i < n; i++) {
        size_t len = strcspn(want, " ");
        const char *got = fmt(x[i]);
        if (strlen(got) != len || strncmp(got, want, len) != 0)
            fail_msg("format(%g) = \"%s\", want \"%.*s\"", x[i], got, (int)len, want);
        want += len + (want[len] == ' ');
    }
    assert_string_equal(want, ""); /* as many words as values */
}

static void test_duration_and_rate(void **state)
{
    (void)state;
    const double secs[] = {0, 59.4, 59.6, 3599, 3600, 90061, -1, NAN, INFINITY, 1e9};
    expect_each(dur, secs, sizeof secs / sizeof secs[0], "0:00 0:59 1:00 59:59 1:00:00 25:01:01 -- -- -- >99d");
    const double rates[] = {0, 456.74, 45.67, 999.96, 12345, 4.56e6, 123.4e9, NAN};
    expect_each(rate, rates, sizeof rates / sizeof rates[0], "0.0 457 45.7 1.0k 12.3k 4.6M 123G --");
    /* below 1/s two significant digits, never "0.0" for a rate that is not zero */
    const double slow[] = {0.042, 0.5, 0.994, 18234, 2.5e6};
    expect_each(rate, slow, sizeof slow / sizeof slow[0], "0.042 0.5 0.99 18.2k 2.5M");
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

/* Byte counts in the unit that shows them, and a closing line of the caller's own text. */
static void test_bytes_and_finish_text(void **state)
{
    (void)state;
    char b[32];
    static const struct { double v; const char *s; } cases[] = {
        {0, "0 B"}, {312, "312 B"}, {999, "999 B"}, {999.6, "1.0 kB"}, {1234, "1.2 kB"}, {45.6e6, "45.6 MB"},
        {123.4e9, "123 GB"}, {NAN, "--"}, {-1, "--"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tkd_progress_format_bytes(b, sizeof b, cases[i].v);
        assert_string_equal(b, cases[i].s);
    }
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    tkd_progress p;
    tkd_progress_begin(&p, "tokenize", 1, "MB");
    p.out = mem;
    p.tty = false;
    tkd_progress_finish_text(&p, "done in 0:00: 1 file");
    fclose(mem);
    assert_string_equal(buf, "tokenize done in 0:00: 1 file\n");
    free(buf);
}

TKD_TEST_MAIN(test_duration_and_rate, test_format_line, test_format_rate_in_another_unit,
    test_plain_lines_when_not_a_terminal, test_bytes_and_finish_text)
