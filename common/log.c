/* log.c — see log.h. */
#include "common/log.h"

#include <stdarg.h>
#include <string.h>

/* Written once by the CLI before threads start, read everywhere afterwards. */
static tkd_log_level g_level = TKD_LOG_LEVEL_INFO;
static FILE *g_out;
static volatile bool g_status_line;

void tkd_log_set_level(tkd_log_level level) { g_level = level; }
tkd_log_level tkd_log_get_level(void) { return g_level; }
bool tkd_log_enabled(tkd_log_level level) { return level <= g_level; }
void tkd_log_set_stream(FILE *out) { g_out = out; }
void tkd_log_set_status_line(bool active) { g_status_line = active; }

const char *tkd_log_level_name(tkd_log_level level)
{
    switch (level) {
    case TKD_LOG_LEVEL_ERROR: return "error";
    case TKD_LOG_LEVEL_WARN: return "warn";
    case TKD_LOG_LEVEL_INFO: return "info";
    case TKD_LOG_LEVEL_DEBUG: return "debug";
    }
    return "?";
}

void tkd_log_write(tkd_log_level level, const char *fmt, ...)
{
    if (!tkd_log_enabled(level))
        return;
    char line[2048];
    size_t n = 0;
    if (g_status_line)
        n += (size_t)snprintf(line, sizeof line, "\r\033[K");
    /* info is the normal voice of the tools: no level word for it */
    if (level != TKD_LOG_LEVEL_INFO)
        n += (size_t)snprintf(line + n, sizeof line - n, "%s: ", tkd_log_level_name(level));
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - n, fmt, ap);
    va_end(ap);
    if (m > 0)
        n += (size_t)m;
    if (n > sizeof line - 2)
        n = sizeof line - 2; /* truncated: keep the line a line */
    if (n == 0 || line[n - 1] != '\n')
        line[n++] = '\n';
    line[n] = '\0';
    FILE *out = g_out ? g_out : stderr;
    fputs(line, out);
    fflush(out);
}
