/* text_docs.h — documents out of the text files users bring: plain text (one document per file,
 * or cut at a separator string) and JSON Lines (one JSON object per line, the document in one of
 * its string fields). Read as a stream, so a file of any size needs memory for one record only.
 *
 * A reader hands out records: for plain text the document itself, for JSON Lines the raw line,
 * whose field tkd_text_jsonl_field extracts — a separate step so that callers can parse the lines
 * on many threads.
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
 * line): *text is malloc'd (the caller frees it), *tlen its length. TKD_ERR_FORMAT naming the file,
 * the line and the field when the line is not an object or the field is missing or not a string. */
tkd_status tkd_text_jsonl_field(const char *path, int64_t line, const char *rec, size_t len, const char *field,
                                char **text, size_t *tlen);

#endif /* TKD_TEXT_DOCS_H */
