/* text_docs.c — see text_docs.h. One buffer per reader: records are cut out of it in place and
 * the rest moves to the front before more of the file is read, so a record is never copied. */
#include "formats/text_docs.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct tkd_text_reader {
    FILE *fp;
    char *path;
    tkd_text_kind kind;
    const char *sep;    /* NULL: the whole file is one document */
    size_t seplen;
    char *buf;
    size_t cap, beg, end, scanned; /* unconsumed data is buf[beg, end); no separator in [beg, scanned) */
    bool at_eof;        /* the file has been read to its end */
    int64_t line;       /* line number of buf[beg] */
    uint64_t consumed;  /* bytes before buf[beg] */
};

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

tkd_status tkd_text_reader_open(const char *path, const tkd_text_opts *o, tkd_text_reader **out)
{
    *out = NULL;
    tkd_text_reader *r = calloc(1, sizeof *r);
    if (!r || !(r->path = strdup(path))) {
        free(r);
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    }
    r->kind = o->kind;
    if (r->kind == TKD_TEXT_AUTO)
        r->kind = ends_with(path, ".jsonl") || ends_with(path, ".ndjson") ? TKD_TEXT_JSONL : TKD_TEXT_PLAIN;
    r->sep = r->kind == TKD_TEXT_JSONL ? "\n" : o->separator && *o->separator ? o->separator : NULL;
    r->seplen = r->sep ? strlen(r->sep) : 0;
    r->line = 1;
    r->fp = fopen(path, "rb");
    if (!r->fp) {
        int e = errno;
        tkd_text_reader_close(r);
        return tkd_error_set(e == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO, "%s: cannot open: %s", path, strerror(e));
    }
    *out = r;
    return TKD_OK;
}

void tkd_text_reader_close(tkd_text_reader *r)
{
    if (!r)
        return;
    if (r->fp)
        fclose(r->fp);
    free(r->path);
    free(r->buf);
    free(r);
}

tkd_text_kind tkd_text_reader_kind(const tkd_text_reader *r) { return r->kind; }
uint64_t tkd_text_reader_offset(const tkd_text_reader *r) { return r->consumed; }

/* Moves the unconsumed data to the front, grows the buffer when it is full, reads more. */
static tkd_status fill(tkd_text_reader *r)
{
    if (r->beg > 0) {
        memmove(r->buf, r->buf + r->beg, r->end - r->beg);
        r->end -= r->beg, r->scanned -= r->beg, r->beg = 0;
    }
    if (r->end == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 1 << 20;
        char *p = realloc(r->buf, cap);
        if (!p)
            return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory for a %zu-byte record", r->path, cap);
        r->buf = p, r->cap = cap;
    }
    size_t got = fread(r->buf + r->end, 1, r->cap - r->end, r->fp);
    r->end += got;
    if (got == 0) {
        if (ferror(r->fp))
            return tkd_error_set(TKD_ERR_IO, "%s: read failed: %s", r->path, strerror(errno));
        r->at_eof = true;
    }
    return TKD_OK;
}

/* The first occurrence of needle (m > 0 bytes) in s[0, n), or NULL. */
static char *find(char *s, size_t n, const char *needle, size_t m)
{
    for (char *p = s, *e = s + n; e - p >= (ptrdiff_t)m && (p = memchr(p, needle[0], (size_t)(e - p))) != NULL; p++)
        if ((size_t)(e - p) >= m && memcmp(p, needle, m) == 0)
            return p;
    return NULL;
}

static int64_t count_lines(const char *s, size_t n)
{
    int64_t k = 0;
    for (const char *p = s, *e = s + n; (p = memchr(p, '\n', (size_t)(e - p))) != NULL; p++)
        k++;
    return k;
}

/* The next separator-terminated piece (the last one may end at the end of the file): [*a, *b). */
static tkd_status next_piece(tkd_text_reader *r, size_t *a, size_t *b, bool *eof)
{
    for (;;) {
        if (r->sep) {
            size_t from = r->scanned > r->beg ? r->scanned : r->beg;
            char *hit = find(r->buf + from, r->end - from, r->sep, r->seplen);
            if (hit) {
                *a = r->beg, *b = (size_t)(hit - r->buf);
                r->scanned = *b + r->seplen;
                return TKD_OK;
            }
            /* the separator may straddle the end of what is read: rescan its last seplen - 1 bytes */
            r->scanned = r->end - r->beg >= r->seplen ? r->end - r->seplen + 1 : r->beg;
        }
        if (r->at_eof) {
            *eof = r->beg == r->end;
            *a = r->beg, *b = r->end;
            r->scanned = r->end;
            return TKD_OK;
        }
        tkd_status st = fill(r);
        if (st != TKD_OK)
            return st;
    }
}

static bool blank(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n')
            return false;
    return true;
}

tkd_status tkd_text_reader_next(tkd_text_reader *r, const char **rec, size_t *len, int64_t *line, bool *eof)
{
    for (;;) {
        size_t a, b;
        *eof = false;
        tkd_status st = next_piece(r, &a, &b, eof);
        if (st != TKD_OK || *eof)
            return st;
        size_t next = b < r->end ? b + r->seplen : b; /* past the separator, when there was one */
        *rec = r->buf + a, *len = b - a, *line = r->line;
        r->line += count_lines(r->buf + a, next - a);
        r->consumed += next - a;
        r->beg = next;
        if (r->kind == TKD_TEXT_JSONL && *len > 0 && (*rec)[*len - 1] == '\r')
            (*len)--;
        if (*len > 0 && !(r->kind == TKD_TEXT_JSONL && blank(*rec, *len)))
            return TKD_OK;
    }
}

tkd_status tkd_text_jsonl_field(const char *path, int64_t line, const char *rec, size_t len, const char *field,
                                char **text, size_t *tlen)
{
    *text = NULL, *tlen = 0;
    cJSON *obj = cJSON_ParseWithLength(rec, len);
    if (!cJSON_IsObject(obj)) {
        cJSON_Delete(obj);
        return tkd_error_set(TKD_ERR_FORMAT, "%s:%lld: not a JSON object (JSON Lines: one object per line)", path,
                             (long long)line);
    }
    cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, field);
    if (!cJSON_IsString(v)) {
        cJSON_Delete(obj);
        tkd_error_set(TKD_ERR_FORMAT, "%s:%lld: no string field '%s'", path, (long long)line, field);
        return tkd_error_hint(TKD_ERR_FORMAT, "name the field that holds the text (--field)");
    }
    *text = v->valuestring; /* taken over: cJSON_Delete skips a NULL valuestring */
    v->valuestring = NULL;
    *tlen = strlen(*text);
    cJSON_Delete(obj);
    return TKD_OK;
}
