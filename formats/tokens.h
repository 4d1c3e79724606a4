/* tokens.h — token datasets: llm.c .bin shards and .npy arrays presented as one int32 stream,
 * cut into training windows.
 *
 * A dataset is one file, a glob(3) pattern, or a list of either; files are taken in the order
 * given (a glob's matches sorted by name) and concatenated. Each file is either
 *   - llm.c .bin: 256 x int32 little-endian header ([0] magic, [1] version, [2] token count, the
 *     rest 0), then the tokens. Magic 20240520 with version 1: uint16 tokens (llm.c's GPT-2
 *     files); 20240801 with version 7: uint32 tokens (llm.c's Llama 3 files). 20240801 with
 *     version 2 is topkd's own former spelling of the uint32 header and is still read; or
 *   - .npy (format v1/v2/v3): dtype <i4, <u2, <u4 or <i8, 1-D or 2-D in C order. A 2-D array's
 *     rows are concatenated in order (rows are not treated as separate documents).
 * The kind is recognised by content (the \x93NUMPY magic), not by the file name.
 * Everything is loaded into memory; each file's global token offset is kept so that a message can
 * say "file X, token offset Y".
 *
 * Windows: window i covers tokens [i*stride, i*stride + seq_len + 1): inputs are its first seq_len
 * tokens, labels the last seq_len. The last partial window is either dropped or padded with token 0
 * whose labels are TKD_TOKENS_IGNORE_LABEL (-100).
 */
#ifndef TKD_TOKENS_H
#define TKD_TOKENS_H

#include <stdint.h>

#include "common/status.h"

#define TKD_TOKENS_IGNORE_LABEL (-100)
#define TKD_TOKENS_MAGIC_U16 20240520
#define TKD_TOKENS_MAGIC_U32 20240801
#define TKD_TOKENS_VERSION_U16 1 /* llm.c's GPT-2 header */
#define TKD_TOKENS_VERSION_U32 7 /* llm.c's Llama 3 header */
#define TKD_TOKENS_VERSION_U32_TOPKD 2 /* topkd's former uint32 header: read, never written by llm.c */

typedef struct tkd_tokens tkd_tokens; /* opaque: the loaded dataset */

/* Loads the files named by spec: a path or a glob pattern (a glob that matches nothing is an
 * error naming it). On success *out is owned by the caller (tkd_tokens_free). */
tkd_status tkd_tokens_open(const char *spec, tkd_tokens **out);

/* Same for a list of specs (paths or globs), concatenated in the order given. */
tkd_status tkd_tokens_open_list(const char *const *specs, int nspecs, tkd_tokens **out);

void tkd_tokens_free(tkd_tokens *ds); /* NULL is a no-op */

int64_t tkd_tokens_count(const tkd_tokens *ds);
/* The whole stream; valid until tkd_tokens_free. */
const int32_t *tkd_tokens_data(const tkd_tokens *ds); // (count,)

int tkd_tokens_num_files(const tkd_tokens *ds);
/* File i's path, global offset of its first token, and token count. */
const char *tkd_tokens_file(const tkd_tokens *ds, int i, int64_t *first, int64_t *count);

/* Maps a global token offset to (file path, offset within that file); NULL when out of range. */
const char *tkd_tokens_locate(const tkd_tokens *ds, int64_t global, int64_t *local);

/* TKD_ERR_MISMATCH naming the file and token offset of the first id < 0 or >= vocab. */
tkd_status tkd_tokens_check_vocab(const tkd_tokens *ds, int vocab);

/* Number of windows of seq_len + 1 tokens every stride tokens. pad_tail = 0: only whole windows;
 * 1: windows continue until every token has appeared as a label (when stride <= seq_len), the last
 * one padded; a window never holds zero labels. */
int64_t tkd_tokens_num_windows(const tkd_tokens *ds, int seq_len, int stride, int pad_tail);

/* Fills window i: tokens (seq_len + 1) and labels (seq_len, labels[j] = tokens[j + 1], or -100
 * where that position is padding). Padding tokens are 0. labels may be NULL. Returns the number of
 * real labels through *n_valid when non-NULL. TKD_ERR_INVALID_ARG when i is out of range. */
tkd_status tkd_tokens_window(const tkd_tokens *ds, int seq_len, int stride, int pad_tail, int64_t i,
                             int32_t *tokens /* (seq_len + 1) */, int32_t *labels /* (seq_len) */, int *n_valid);

/* SHA-256 of the token stream as little-endian int32 — the dataset's identity, independent of the
 * files' formats and how the stream is split into files. hex: 64 lowercase digits + NUL. */
void tkd_tokens_sha256(const tkd_tokens *ds, char hex[65]);

#endif /* TKD_TOKENS_H */
