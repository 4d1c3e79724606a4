/* progress.c — see progress.h. */
#include "common/progress.h"

#include <math.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

#define TTY_REDRAW_S 0.1

double tkd_progress_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static size_t clamp_len(int n, size_t cap)
{
    if (n < 0)
        return 0;
    return (size_t)n < cap ? (size_t)n : (cap ? cap - 1 : 0);
}

size_t tkd_progress_format_duration(char *buf, size_t cap, double s)
{
    if (!(s >= 0) || isinf(s))
        return clamp_len(snprintf(buf, cap, "--"), cap);
    if (s > 99.0 * 86400)
        return clamp_len(snprintf(buf, cap, ">99d"), cap);
    long t = lround(s);
    if (t < 3600)
        return clamp_len(snprintf(buf, cap, "%ld:%02ld", t / 60, t % 60), cap);
    return clamp_len(snprintf(buf, cap, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60), cap);
}

size_t tkd_progress_format_rate(char *buf, size_t cap, double r)
{
    static const char suffix[] = {'\0', 'k', 'M', 'G', 'T'};
    int i = 0;
    if (!(r >= 0) || isinf(r))
        return clamp_len(snprintf(buf, cap, "--"), cap);
    if (r > 0 && r < 0.995)
        return clamp_len(snprintf(buf, cap, "%.2g", r), cap);
    while (r >= 999.95 && i < 4) {
        r /= 1000.0;
        i++;
    }
    /* 1 decimal below 100 ("45.6k"), none above ("456k") */
    if (r < 99.95)
        return clamp_len(snprintf(buf, cap, "%.1f%.1s", r, &suffix[i]), cap);
    return clamp_len(snprintf(buf, cap, "%.0f%.1s", r, &suffix[i]), cap);
}

size_t tkd_progress_format_bytes(char *buf, size_t cap, double b)
{
    static const char *const unit[] = {"B", "kB", "MB", "GB", "TB", "PB"};
    int i = 0;
    if (!(b >= 0) || isinf(b))
        return clamp_len(snprintf(buf, cap, "--"), cap);
    while (b >= 999.5 && i < 5) {
        b /= 1000.0;
        i++;
    }
    if (i == 0) /* whole bytes */
        return clamp_len(snprintf(buf, cap, "%.0f B", b), cap);
    return clamp_len(snprintf(buf, cap, b < 99.95 ? "%.1f %s" : "%.0f %s", b, unit[i]), cap);
}

size_t tkd_progress_format(char *buf, size_t cap, const char *label, int64_t done, int64_t total,
                           double elapsed_s, const char *unit, int64_t rate_done, const char *rate_unit,
                           const char *extra, bool finished)
{
    char rate[32], dur[32];
    bool own_rate = rate_unit && *rate_unit; /* the rate counts another unit than done */
    double per_s = elapsed_s > 0 ? (double)done / elapsed_s : NAN;
    tkd_progress_format_rate(rate, sizeof rate, own_rate && elapsed_s > 0 ? (double)rate_done / elapsed_s : per_s);
    const char *runit = own_rate ? rate_unit : unit;
    size_t n = 0;
    if (!cap)
        return 0;
    buf[0] = '\0';
    n += clamp_len(snprintf(buf + n, cap - n, "%s %lld", label, (long long)done), cap - n);
    if (total > 0)
        n += clamp_len(snprintf(buf + n, cap - n, "/%lld", (long long)total), cap - n);
    if (own_rate)
        n += clamp_len(snprintf(buf + n, cap - n, " %s", unit), cap - n);
    if (finished) {
        tkd_progress_format_duration(dur, sizeof dur, elapsed_s);
        n += clamp_len(snprintf(buf + n, cap - n, " done in %s  %s %s/s", dur, rate, runit), cap - n);
    } else {
        if (total > 0) {
            double pct = 100.0 * (double)done / (double)total;
            n += clamp_len(snprintf(buf + n, cap - n, " (%.1f%%)", pct > 100 ? 100 : pct), cap - n);
        }
        n += clamp_len(snprintf(buf + n, cap - n, "  %s %s/s", rate, runit), cap - n);
        if (total > 0) {
            double eta = per_s > 0 ? (double)(total > done ? total - done : 0) / per_s : NAN;
            tkd_progress_format_duration(dur, sizeof dur, eta);
            n += clamp_len(snprintf(buf + n, cap - n, "  ETA %s", dur), cap - n);
        }
    }
    if (extra && *extra)
        n += clamp_len(snprintf(buf + n, cap - n, "  %s", extra), cap - n);
    return n;
}

void tkd_progress_begin(tkd_progress *p, const char *label, int64_t total, const char *unit)
{
    memset(p, 0, sizeof *p);
    snprintf(p->label, sizeof p->label, "%s", label ? label : "");
    snprintf(p->unit, sizeof p->unit, "%s", unit ? unit : "items");
    p->total = total;
    p->out = stderr;
    p->tty = isatty(fileno(stderr)) == 1;
    p->enabled = tkd_log_enabled(TKD_LOG_LEVEL_INFO);
    p->interval_s = 5.0;
    p->t_start = p->t_last = tkd_progress_now();
}

void tkd_progress_set_interval(tkd_progress *p, double seconds) { p->interval_s = seconds; }

void tkd_progress_set_rate_unit(tkd_progress *p, const char *rate_unit)
{
    snprintf(p->rate_unit, sizeof p->rate_unit, "%s", rate_unit ? rate_unit : "");
}

static void emit(tkd_progress *p, const char *line, double now, bool finished)
{
    if (p->tty) {
        /* \033[K clears what a longer previous line left on the right */
        fprintf(p->out, "\r%s\033[K%s", line, finished ? "\n" : "");
        tkd_log_set_status_line(!finished);
    } else {
        fprintf(p->out, "%s\n", line);
    }
    fflush(p->out);
    p->t_last = now;
    p->drawn = true;
}

static void draw(tkd_progress *p, double now, bool finished)
{
    char line[256];
    tkd_progress_format(line, sizeof line, p->label, p->done, p->total, now - p->t_start, p->unit, p->rate_done,
                        p->rate_unit, p->extra, finished);
    emit(p, line, now, finished);
}

void tkd_progress_update_rate(tkd_progress *p, int64_t done, int64_t rate_done, const char *extra)
{
    p->done = done;
    p->rate_done = rate_done;
    if (extra)
        snprintf(p->extra, sizeof p->extra, "%s", extra);
    if (!p->enabled)
        return;
    double now = tkd_progress_now();
    /* the first line as soon as there is a rate to show: a first batch can take minutes */
    if ((!p->drawn && done > 0) || now - p->t_last >= (p->tty ? TTY_REDRAW_S : p->interval_s))
        draw(p, now, false);
}

void tkd_progress_update(tkd_progress *p, int64_t done, const char *extra)
{
    tkd_progress_update_rate(p, done, done, extra);
}

void tkd_progress_finish(tkd_progress *p, const char *extra)
{
    if (extra)
        snprintf(p->extra, sizeof p->extra, "%s", extra);
    if (p->enabled)
        draw(p, tkd_progress_now(), true);
}

void tkd_progress_finish_text(tkd_progress *p, const char *text)
{
    char line[512];
    if (!p->enabled)
        return;
    snprintf(line, sizeof line, "%s %s", p->label, text ? text : "");
    emit(p, line, tkd_progress_now(), true);
}
