/* text_docs.c — see text_docs.h. One buffer per reader: records are cut out of it in place and
 * the rest moves to the front before more of the file is read, so a record is never copied. */
#include "formats/text_docs.h"

#include <errno.h>
#include <jansson.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/utf8.h"

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

/* Jansson, not cJSON, for records: cJSON ends every string at its first NUL, and a record is read
 * strictly (RFC 8259, as Python's json.loads): one value, whitespace only space/tab/CR/LF, no raw
 * control characters in strings. Numbers are read as doubles: a record's other fields are never
 * used, and so an id of 20 digits (past int64, fine for Python) is no error. */
#define JSONL_FLAGS (JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL | JSON_DECODE_INT_AS_REAL)

/* The offset in s[0, n) of byte `at` of its lossy conversion (tkd_utf8_lossy). */
static size_t lossy_source_offset(const char *s, size_t n, size_t at)
{
    size_t i = 0, o = 0;
    while (i < n && o < at) {
        long l = tkd_utf8_seq((const uint8_t *)s + i, n - i);
        i += l > 0 ? (size_t)l : (size_t)-l;
        o += l > 0 ? (size_t)l : 3;
    }
    return i;
}

/* The first byte of s[0, n) below 0x20 other than tab, CR and LF, or n. JSON has none anywhere
 * (a string escapes them), and checking here keeps Jansson from seeing one: it drops a NUL that
 * follows a number or a literal ({"n":1<NUL>} reads as {"n":1}). */
static size_t first_control(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 && s[i] != '\t' && s[i] != '\r' && s[i] != '\n')
            return i;
    return n;
}

/* Where Jansson's error is in buf[0, len), 0-based. Its position is where the lexer stopped: past
 * the token its message quotes ("... near 'tok'"), at a tab or newline inside a string (put back
 * before the message), or anywhere near the end when the record ends too soon ("near end of
 * file": the column is then the one after the last byte). */
static size_t error_offset(const json_error_t *e, const char *buf, size_t len)
{
    size_t pos = e->position > 0 ? (size_t)e->position : 0;
    pos = pos < len ? pos : len;
    if (strncmp(e->text, "control character", 17) == 0 || strncmp(e->text, "unexpected newline", 18) == 0)
        return pos;
    if (strstr(e->text, " near end of file"))
        return len; /* something is missing after the last byte */
    const char *near = strstr(e->text, " near '");
    size_t tl = near ? strlen(near += 7) : 0; /* the token and its closing quote */
    if (tl > 1 && near[tl - 1] == '\'' && tl - 1 <= pos && memcmp(buf + pos - (tl - 1), near, tl - 1) == 0)
        pos -= tl - 1;
    return pos;
}

/* The key whose closing quote is buf[end - 1] starts at the first quote before it that no backslash
 * escapes: a string holds no unescaped quote. */
static size_t key_start(const char *buf, size_t end)
{
    for (size_t q = end > 1 ? end - 1 : 0; q-- > 0;) {
        size_t k = 0;
        while (buf[q] == '"' && k < q && buf[q - 1 - k] == '\\')
            k++;
        if (buf[q] == '"' && k % 2 == 0)
            return q;
    }
    return 0;
}

/* "path:line:col: what" for a record Jansson refused; buf is what it parsed (rec itself, or its
 * lossy conversion when `lossy`). */
static tkd_status parse_error(const char *path, int64_t line, const char *rec, size_t len, const char *buf,
                              size_t blen, bool lossy, const json_error_t *e)
{
    bool dup = json_error_code(e) == json_error_duplicate_key;
    size_t pos = e->position > 0 && (size_t)e->position < blen ? (size_t)e->position : blen;
    size_t at = dup ? key_start(buf, pos) : error_offset(e, buf, blen);
    size_t col = (lossy ? lossy_source_offset(rec, len, at) : at) + 1;
    if (dup) {
        size_t klen = pos > at + 2 ? pos - at - 2 : 0;
        tkd_error_set(TKD_ERR_FORMAT, "%s:%lld:%zu: duplicate key \"%.*s\"", path, (long long)line, col,
                      (int)(klen < 80 ? klen : 80), buf + at + 1);
        return tkd_error_hint(TKD_ERR_FORMAT, "a JSON Lines record names each key once (Python would keep the "
                                              "last value, other readers the first)");
    }
    tkd_error_set(TKD_ERR_FORMAT, "%s:%lld:%zu: %s", path, (long long)line, col, e->text);
    return tkd_error_hint(TKD_ERR_FORMAT, "a JSON Lines record is one JSON object on one line (RFC 8259)");
}

/* rec parsed; text that is not valid UTF-8 is first converted as the tokenizer converts text
 * (formats/utf8.h). Converting the raw record is the same as converting the decoded string: an
 * escape decodes to whole characters, never to a byte that could continue a sequence before it. */
static tkd_status parse_record(const char *path, int64_t line, const char *rec, size_t len, json_t **out)
{
    *out = NULL;
    size_t c = first_control(rec, len);
    if (c < len) {
        tkd_error_set(TKD_ERR_FORMAT, "%s:%lld:%zu: a raw control character (0x%02x)", path, (long long)line, c + 1,
                      (unsigned char)rec[c]);
        return tkd_error_hint(TKD_ERR_FORMAT, "JSON allows none, a string escapes them (\\u%04x)", (unsigned char)rec[c]);
    }
    json_error_t e;
    *out = json_loadb(rec, len, JSONL_FLAGS, &e);
    if (*out)
        return TKD_OK;
    if (json_error_code(&e) != json_error_invalid_utf8)
        return parse_error(path, line, rec, len, rec, len, false, &e);
    uint8_t *clean = malloc(3 * len);
    if (!clean)
        return tkd_error_set(TKD_ERR_NOMEM, "%s:%lld: out of memory for a %zu-byte record", path, (long long)line,
                             len);
    size_t n = tkd_utf8_lossy((const uint8_t *)rec, len, clean);
    tkd_status st = TKD_OK;
    if (!(*out = json_loadb((const char *)clean, n, JSONL_FLAGS, &e)))
        st = parse_error(path, line, rec, len, (const char *)clean, n, true, &e);
    free(clean);
    return st;
}

tkd_status tkd_text_jsonl_parse(const char *path, int64_t line, const char *rec, size_t len, json_t **out)
{
    return parse_record(path, line, rec, len, out);
}

tkd_status tkd_text_jsonl_field(const char *path, int64_t line, const char *rec, size_t len, const char *field,
                                char **text, size_t *tlen)
{
    *text = NULL, *tlen = 0;
    json_t *obj;
    TKD_TRY(parse_record(path, line, rec, len, &obj));
    if (!json_is_object(obj)) {
        json_decref(obj);
        return tkd_error_set(TKD_ERR_FORMAT, "%s:%lld: not a JSON object (JSON Lines: one object per line)", path,
                             (long long)line);
    }
    json_t *v = json_object_get(obj, field);
    if (!json_is_string(v)) {
        json_decref(obj);
        tkd_error_set(TKD_ERR_FORMAT, "%s:%lld: no string field '%s'", path, (long long)line, field);
        return tkd_error_hint(TKD_ERR_FORMAT, "name the field that holds the text (--field)");
    }
    size_t n = json_string_length(v); /* with any NUL inside: Python keeps "\u0000" in the text */
    *text = malloc(n + 1);
    if (*text) {
        memcpy(*text, json_string_value(v), n + 1);
        *tlen = n;
    }
    json_decref(obj);
    return *text ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "%s:%lld: out of memory for a %zu-byte text", path,
                                          (long long)line, n);
}

tkd_status tkd_text_unescape(const char *s, const char *what, tkd_status code, char **out)
{
    *out = NULL;
    char *r = malloc(strlen(s) + 1), *o = r;
    if (!r)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    for (const char *p = s; *p; p++) {
        if (*p != '\\') {
            *o++ = *p;
            continue;
        }
        const char *esc = p[1] ? strchr("ntr\\", p[1]) : NULL;
        if (!esc) {
            free(r);
            tkd_error_set(code, "%s: '%.*s' in '%.80s' is not an escape it knows", what, p[1] ? 2 : 1, p, s);
            return tkd_error_hint(code, "\\n, \\t, \\r and \\\\ (a backslash) are understood");
        }
        *o++ = "\n\t\r\\"[esc - "ntr\\"];
        p++;
    }
    *o = '\0';
    *out = r;
    return TKD_OK;
}
