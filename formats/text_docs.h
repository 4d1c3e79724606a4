/* text_docs.h — documents out of the text files users bring: plain text (one document per file,
 * or cut at a separator string) and JSON Lines (one JSON object per line, the document in one of
 * its string fields). Read as a stream, so a file of any size needs memory for one record only.
 *
 * A reader hands out records: for plain text the document itself, for JSON Lines the raw line,
 * whose field tkd_text_jsonl_field extracts — a separate step so that callers can parse the lines
 * on many threads. Records are parsed with Jansson, not the cJSON of our other JSON files: cJSON
 * cannot hold a string with a NUL inside, which a JSON Lines text may have ("\u0000").
 */
#ifndef TKD_TEXT_DOCS_H
#define TKD_TEXT_DOCS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum tkd_text_kind {
    TKD_TEXT_AUTO = 0,  /* by the file name: .jsonl / .ndjson are JSON Lines, anything else text */
    TKD_TEXT_PLAIN = 1,
    TKD_TEXT_JSONL = 2,
} tkd_text_kind;

typedef struct tkd_text_opts {
    tkd_text_kind kind;
    const char *separator; /* plain text: cut documents at each occurrence; NULL or "": one per file */
} tkd_text_opts;

typedef struct tkd_text_reader tkd_text_reader; /* opaque */

/* Opens path. On success *out is owned by the caller (tkd_text_reader_close). */
tkd_status tkd_text_reader_open(const char *path, const tkd_text_opts *o, tkd_text_reader **out);
void tkd_text_reader_close(tkd_text_reader *r); /* NULL is a no-op */

/* The kind this reader reads (AUTO resolved). */
tkd_text_kind tkd_text_reader_kind(const tkd_text_reader *r);

/* The next record: *rec / *len point into the reader's buffer, valid until the next call; *line
 * is the 1-based line where it starts. Empty documents and blank JSON Lines are skipped. *eof is
 * set (and nothing else) at the end of the file. */
tkd_status tkd_text_reader_next(tkd_text_reader *r, const char **rec, size_t *len, int64_t *line, bool *eof);

/* Bytes of the file consumed so far (for progress). */
uint64_t tkd_text_reader_offset(const tkd_text_reader *r);

/* The string `field` of the JSON object in rec[0, len) (one JSON Lines record of path, starting at
 * line): *text is malloc'd (the caller frees it; NUL-terminated for convenience), *tlen its length,
 * which counts any NUL inside ("\u0000" is kept, as Python keeps it). The record is read as strictly
 * as Python's json.loads reads it (RFC 8259): exactly one value, whitespace only space, tab, CR and
 * LF, no raw control character in a string; and no key twice in an object (Python would keep the
 * last, other readers the first); bytes that are not valid UTF-8 are first
 * converted as the tokenizer converts them (each maximal ill-formed subsequence -> U+FFFD).
 * TKD_ERR_FORMAT "path:line:col: what" when the record is not such JSON, "path:line: ..." when it
 * is not an object or the field is missing or not a string. Thread-safe. */
tkd_status tkd_text_jsonl_field(const char *path, int64_t line, const char *rec, size_t len, const char *field,
                                char **text, size_t *tlen);

/* The JSON value of one JSON Lines record rec[0, len) of path (starting at line), read as strictly as
 * tkd_text_jsonl_field reads it (same messages). *out is a Jansson json_t the caller releases with
 * json_decref (declared here without Jansson's header: struct json_t). Thread-safe. */
struct json_t;
tkd_status tkd_text_jsonl_parse(const char *path, int64_t line, const char *rec, size_t len, struct json_t **out);

/* The one escape rule of a document separator, for both tokenize's --doc-separator and the dump's
 * data.doc_separator (so that one text gives one dataset): s with \n, \t, \r and \\ replaced by
 * newline, tab, CR and a backslash -> *out (malloc'd; the caller frees it). Any other backslash
 * (an unknown escape, a lone one at the end) is refused with `code`, the message naming `what`
 * (the flag or the key). */
tkd_status tkd_text_unescape(const char *s, const char *what, tkd_status code, char **out);

#endif /* TKD_TEXT_DOCS_H */
