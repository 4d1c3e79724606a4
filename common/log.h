/* log.h — leveled messages to stderr for the command-line tools.
 *
 * One global level (set once by the CLI from -v / -q, before threads start) filters messages.
 * Each message is one line ("warn: ...", "error: ...", "debug: ...", info without a level word)
 * written with a single fputs, so lines from different
 * threads never interleave. When a progress line is on the terminal (common/progress.h) it is
 * cleared first so the message does not land in the middle of it.
 * Library code reports errors through tkd_status, not through here; it may log at debug level.
 */
#ifndef TKD_LOG_H
#define TKD_LOG_H

#include <stdbool.h>
#include <stdio.h>

typedef enum tkd_log_level {
    TKD_LOG_LEVEL_ERROR = 0,
    TKD_LOG_LEVEL_WARN = 1,
    TKD_LOG_LEVEL_INFO = 2, /* the default */
    TKD_LOG_LEVEL_DEBUG = 3,
} tkd_log_level;

/* Messages above level are dropped. */
void tkd_log_set_level(tkd_log_level level);
tkd_log_level tkd_log_get_level(void);

/* True when a message at level would be written (skip costly formatting otherwise). */
bool tkd_log_enabled(tkd_log_level level);

/* Where messages go; NULL restores stderr. For tests. */
void tkd_log_set_stream(FILE *out);

/* Set by common/progress.c: a "\r" status line is on the terminal and must be cleared first. */
void tkd_log_set_status_line(bool active);

/* Level name as printed: "error", "warn", "info", "debug". */
const char *tkd_log_level_name(tkd_log_level level);

void tkd_log_write(tkd_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define tkd_log_error(...) tkd_log_write(TKD_LOG_LEVEL_ERROR, __VA_ARGS__)
#define tkd_log_warn(...) tkd_log_write(TKD_LOG_LEVEL_WARN, __VA_ARGS__)
#define tkd_log_info(...) tkd_log_write(TKD_LOG_LEVEL_INFO, __VA_ARGS__)
#define tkd_log_debug(...) tkd_log_write(TKD_LOG_LEVEL_DEBUG, __VA_ARGS__)

#endif /* TKD_LOG_H */
