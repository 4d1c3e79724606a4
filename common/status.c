/* status.c — see status.h. */
#include "common/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char tkd_errbuf[TKD_ERROR_MSG_MAX];

/* Messages quote what users and files supply (keys, values, names), which may hold a newline or
 * another control character; each becomes '?' so that a message stays one printable line. */
static void one_line(char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f)
            *s = '?';
}

const char *tkd_status_name(tkd_status st)
{
    switch (st) {
    case TKD_OK: return "TKD_OK";
    case TKD_ERR_INVALID_ARG: return "TKD_ERR_INVALID_ARG";
    case TKD_ERR_NOMEM: return "TKD_ERR_NOMEM";
    case TKD_ERR_IO: return "TKD_ERR_IO";
    case TKD_ERR_FORMAT: return "TKD_ERR_FORMAT";
    case TKD_ERR_CONFIG: return "TKD_ERR_CONFIG";
    case TKD_ERR_MISMATCH: return "TKD_ERR_MISMATCH";
    case TKD_ERR_CHECKSUM: return "TKD_ERR_CHECKSUM";
    case TKD_ERR_UNSUPPORTED: return "TKD_ERR_UNSUPPORTED";
    case TKD_ERR_DEVICE: return "TKD_ERR_DEVICE";
    case TKD_ERR_DEVICE_OOM: return "TKD_ERR_DEVICE_OOM";
    case TKD_ERR_NUMERIC: return "TKD_ERR_NUMERIC";
    case TKD_ERR_INTERRUPTED: return "TKD_ERR_INTERRUPTED";
    case TKD_ERR_NOSPACE: return "TKD_ERR_NOSPACE";
    case TKD_ERR_NOT_FOUND: return "TKD_ERR_NOT_FOUND";
    case TKD_ERR_INTERNAL: return "TKD_ERR_INTERNAL";
    case TKD_ERR_BUSY: return "TKD_ERR_BUSY";
    }
    return "TKD_ERR_UNKNOWN";
}

tkd_status tkd_error_set(tkd_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tkd_errbuf, sizeof tkd_errbuf, fmt, ap);
    va_end(ap);
    one_line(tkd_errbuf);
    return st;
}

tkd_status tkd_error_prefix(tkd_status st, const char *fmt, ...)
{
    char old[TKD_ERROR_MSG_MAX];
    char pre[TKD_ERROR_MSG_MAX];
    va_list ap;
    memcpy(old, tkd_errbuf, sizeof old);
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    /* Truncation is fine here: the message is for people and stays bounded. */
    size_t n = strlen(pre);
    if (n > sizeof tkd_errbuf - 3)
        n = sizeof tkd_errbuf - 3;
    memcpy(tkd_errbuf, pre, n);
    memcpy(tkd_errbuf + n, ": ", 2);
    size_t rest = sizeof tkd_errbuf - n - 2;
    size_t m = strnlen(old, rest - 1);
    memcpy(tkd_errbuf + n + 2, old, m);
    tkd_errbuf[n + 2 + m] = '\0';
    one_line(tkd_errbuf);
    return st;
}

const char *tkd_error_msg(void) { return tkd_errbuf; }

void tkd_error_clear(void) { tkd_errbuf[0] = '\0'; }

void tkd_error_copy(tkd_status st, const char *msg)
{
    (void)st;
    snprintf(tkd_errbuf, sizeof tkd_errbuf, "%s", msg ? msg : "");
}

tkd_status tkd_error_hint(tkd_status st, const char *fmt, ...)
{
    size_t n = strnlen(tkd_errbuf, sizeof tkd_errbuf - 1);
    /* " — " is 5 bytes in UTF-8; a message already at the limit keeps its own text. */
    if (n + 6 >= sizeof tkd_errbuf)
        return st;
    memcpy(tkd_errbuf + n, " \xe2\x80\x94 ", 5);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tkd_errbuf + n + 5, sizeof tkd_errbuf - n - 5, fmt, ap);
    va_end(ap);
    one_line(tkd_errbuf + n + 5);
    return st;
}

void tkd_error_save(tkd_error_saved *s, tkd_status st)
{
    s->st = st;
    snprintf(s->msg, sizeof s->msg, "%s", tkd_errbuf);
}

tkd_status tkd_error_restore(const tkd_error_saved *s)
{
    snprintf(tkd_errbuf, sizeof tkd_errbuf, "%s", s->msg);
    return s->st;
}
