/* fuzz_jsonl.c — libFuzzer target for one JSON Lines record (formats/text_docs.c:
 * tkd_text_jsonl_field, Jansson underneath) and the document separator's escapes
 * (tkd_text_unescape). Built and run by scripts/fuzz.sh.
 *
 * The properties, besides no crash, leak or UB:
 * - a refusal is TKD_ERR_FORMAT (TKD_ERR_NOMEM) with one line "f.jsonl:7: ..." or, for a record
 *   that is not JSON, "f.jsonl:7:COL: ..." with 1 <= COL <= size + 1;
 * - an accepted record is strict JSON on its face (checked without a parser): its first and last
 *   bytes other than space, tab, CR and LF are '{' and '}', and it holds no other byte below 0x20;
 * - the text is valid UTF-8 (invalid bytes became U+FFFD), NUL-terminated, and no longer than the
 *   record (than 3 x the record when the record itself is not valid UTF-8);
 * - the text round-trips: written back by this file's own encoder as {"text":"..."} (quote,
 *   backslash and bytes below 0x20 escaped, \u0000 for NUL) it reads as the same bytes, same length;
 * - the separator rule: the input as a string either unescapes to one no longer than it, or is
 *   refused naming the key. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/text_docs.h"
#include "formats/utf8.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fail(const char *what, const uint8_t *data, size_t size)
{
    fprintf(stderr, "fuzz: %s (record of %zu bytes; message '%s')\n", what, size, tkd_error_msg());
    (void)data;
    abort();
}

static int ws(uint8_t c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

/* The refusal's message names the record, and the column lies in it (or just past it). */
static void check_refusal(tkd_status st, size_t size)
{
    static const tkd_status refusals[] = {TKD_ERR_FORMAT, TKD_ERR_NOMEM};
    tkd_fuzz_expect_refusal(st, refusals, 2);
    const char *m = tkd_error_msg();
    if (st == TKD_ERR_FORMAT && strncmp(m, "f.jsonl:7:", 10) != 0)
        fail("the message does not name the file and line", NULL, size);
    if (st == TKD_ERR_FORMAT && m[10] >= '0' && m[10] <= '9') {
        unsigned long long col = strtoull(m + 10, NULL, 10);
        if (col < 1 || col > size + 1)
            fail("the column lies outside the record", NULL, size);
    }
}

/* The record looks like one JSON object and no more, without parsing it. */
static void check_strict(const uint8_t *d, size_t n)
{
    size_t a = 0, b = n;
    while (a < n && ws(d[a]))
        a++;
    while (b > a && ws(d[b - 1]))
        b--;
    if (b - a < 2 || d[a] != '{' || d[b - 1] != '}')
        fail("accepted a record that is not one object", d, n);
    for (size_t i = 0; i < n; i++)
        if (d[i] < 0x20 && !ws(d[i]))
            fail("accepted a raw control byte", d, n);
}

/* {"text":"<t escaped>"} in out (capacity 6 * tlen + 16). Returns its length. */
static size_t encode(const char *t, size_t tlen, char *out)
{
    size_t o = (size_t)sprintf(out, "{\"text\":\"");
    for (size_t i = 0; i < tlen; i++) {
        unsigned char c = (unsigned char)t[i];
        if (c == '"' || c == '\\')
            out[o++] = '\\', out[o++] = (char)c;
        else if (c < 0x20)
            o += (size_t)sprintf(out + o, "\\u%04x", c);
        else
            out[o++] = (char)c;
    }
    memcpy(out + o, "\"}", 2);
    return o + 2;
}

static void check_text(const uint8_t *data, size_t size, const char *t, size_t tlen)
{
    bool valid = tkd_utf8_valid_prefix(data, size) == size;
    if (!t || t[tlen] != '\0' || tlen > (valid ? size : 3 * size))
        fail("the text is longer than the record allows, or not terminated", data, size);
    if (tkd_utf8_valid_prefix((const uint8_t *)t, tlen) != tlen)
        fail("the text is not valid UTF-8", data, size);
    char *rec = malloc(6 * tlen + 16);
    if (!rec)
        abort();
    size_t n = encode(t, tlen, rec);
    char *back = NULL;
    size_t blen = 0;
    if (tkd_text_jsonl_field("f.jsonl", 7, rec, n, "text", &back, &blen) != TKD_OK || blen != tlen ||
        memcmp(back, t, tlen) != 0)
        fail("the text does not round-trip", data, size);
    free(back);
    free(rec);
}

static void check_unescape(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1), *out = NULL;
    if (!s)
        abort();
    memcpy(s, data, size);
    s[size] = '\0';
    tkd_status st = tkd_text_unescape(s, "data.doc_separator", TKD_ERR_CONFIG, &out);
    if (st == TKD_OK && (!out || strlen(out) > strlen(s)))
        fail("an unescaped separator grew", data, size);
    if (st != TKD_OK && (out || (st == TKD_ERR_CONFIG && strncmp(tkd_error_msg(), "data.doc_separator: ", 20) != 0)))
        fail("a refused separator does not name the key", data, size);
    if (st != TKD_OK) {
        static const tkd_status refusals[] = {TKD_ERR_CONFIG, TKD_ERR_NOMEM};
        tkd_fuzz_expect_refusal(st, refusals, 2);
    }
    free(out);
    free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *t = NULL;
    size_t tlen = 0;
    tkd_status st = tkd_text_jsonl_field("f.jsonl", 7, (const char *)data, size, "text", &t, &tlen);
    if (st != TKD_OK) {
        if (t || tlen)
            fail("a refusal left a text", data, size);
        check_refusal(st, size);
    } else {
        check_strict(data, size);
        check_text(data, size, t, tlen);
    }
    free(t);
    check_unescape(data, size);
    return 0;
}
