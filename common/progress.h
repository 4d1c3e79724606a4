/* progress.h — progress display for long work (dumping a dataset, training for hours).
 *
 * On a terminal (stderr is a tty) one line is redrawn in place (\r) at most 10 times a second;
 * otherwise (logs, CI) a plain line is printed every interval_s seconds (default 5). Each line has
 * the label, done/total, percent, rate in units/s, ETA and a caller text (e.g. "3.1 B/token").
 * The first line comes right after the first update with done > 0 (a first batch can take minutes
 * on a CPU), later ones at the pace above. The rate may count another unit than done does
 * (tkd_progress_set_rate_unit): a sequence or a step can take seconds, where "0.0 seq/s" says
 * nothing and "18.2k tok/s" does. finish prints a last line with the total time. Silent when the
 * log level is below info (-q).
 * Time comes from CLOCK_MONOTONIC inside this module; tkd_progress_format is the pure formatter.
 * One tkd_progress belongs to one thread.
 */
#ifndef TKD_PROGRESS_H
#define TKD_PROGRESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tkd_progress {
    char label[48];
    char unit[24];
    int64_t total;       /* <= 0: unknown (no percent, no ETA) */
    int64_t done;
    double t_start;      /* monotonic seconds */
    double t_last;       /* when the last line was drawn */
    double interval_s;   /* non-terminal: seconds between lines */
    bool tty;            /* redraw one line in place */
    bool enabled;        /* false under -q */
    bool drawn;          /* a line was drawn since begin */
    int64_t rate_done;   /* what the rate counts when rate_unit is set (tokens while done counts seq) */
    char rate_unit[24];  /* "": the rate is done per second, in unit */
    FILE *out;           /* stderr */
    char extra[96];
} tkd_progress;

/* Monotonic clock in seconds: the project's one clock for timeouts and rates (progress lines,
 * rendezvous, collectives, checkpoints, the CPU backend's profiler marks). */
double tkd_progress_now(void);

/* Starts timing. unit names what done counts ("tokens", "seq"). */
void tkd_progress_begin(tkd_progress *p, const char *label, int64_t total, const char *unit);

/* Seconds between plain lines when stderr is not a terminal (default 5). */
void tkd_progress_set_interval(tkd_progress *p, double seconds);

/* Shows the rate in rate_unit ("tok") counted by tkd_progress_update_rate, and unit after done. */
void tkd_progress_set_rate_unit(tkd_progress *p, const char *rate_unit);

/* Records done (absolute, not an increment) and extra (NULL keeps the previous text); draws when
 * it is time to. Cheap enough to call every step. */
void tkd_progress_update(tkd_progress *p, int64_t done, const char *extra);

/* As tkd_progress_update, with rate_done (absolute, since begin) in the rate unit. */
void tkd_progress_update_rate(tkd_progress *p, int64_t done, int64_t rate_done, const char *extra);

/* Draws the final line ("... done in 1:02:03 ..."), ending the terminal line. */
void tkd_progress_finish(tkd_progress *p, const char *extra);

/* Ends the progress as tkd_progress_finish does, with the caller's own text after the label in place
 * of done/total and the rate: for a tool whose totals say more than its progress unit does
 * ("tokenize done in 0:02: 3 files, 45.6 MB of text, ..."; a small input is "0/1 MB" in MB). */
void tkd_progress_finish_text(tkd_progress *p, const char *text);

/* "label 1234/10000 (12.3%)  456.7 tokens/s  ETA 0:19  extra" into buf (always NUL-terminated);
 * with finished, "label 10000/10000 done in 0:21  456.7 tokens/s  extra". With a rate_unit (NULL
 * or "": none) the rate is rate_done/elapsed in it and unit follows the counts:
 * "label 3/100 seq (3.0%)  18.2k tok/s  ETA 5:00". Returns strlen(buf). */
size_t tkd_progress_format(char *buf, size_t cap, const char *label, int64_t done, int64_t total,
                           double elapsed_s, const char *unit, int64_t rate_done, const char *rate_unit,
                           const char *extra, bool finished);

/* A duration as "M:SS" under an hour, "H:MM:SS" above, "--" when unknown (negative/NaN/inf). */
size_t tkd_progress_format_duration(char *buf, size_t cap, double seconds);

/* A rate with 2-3 significant digits and a k/M/G suffix: "456", "45.6", "12.3k", "4.6M"; below 1
 * two significant digits ("0.042"), so that a slow rate does not read as zero. */
size_t tkd_progress_format_rate(char *buf, size_t cap, double per_second);

/* A byte count in decimal units with 3 significant digits: "512 B", "45.6 kB", "12.3 MB", "4.6 GB",
 * so that a small file does not read as "0.0 MB"; "--" when negative or not finite. */
size_t tkd_progress_format_bytes(char *buf, size_t cap, double bytes);

#ifdef __cplusplus
}
#endif

#endif /* TKD_PROGRESS_H */
