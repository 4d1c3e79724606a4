/* tokens.h — token datasets: llm.c .bin shards, .npy arrays and Megatron-LM indexed datasets,
 * presented as one int32 stream, cut into training windows.
 *
 * A dataset is one spec or a list of them: a file, a Megatron dataset's prefix, or a glob(3)
 * pattern. Files are taken in the order given (a glob's matches sorted by name) and concatenated.
 * Each is (layouts in docs/data-formats.md)
 *   - llm.c .bin: 256 x int32 little-endian header ([0] magic, [1] version, [2] token count, the
 *     rest 0), then the tokens. Magic 20240520 with version 1: uint16 tokens (llm.c's GPT-2
 *     files); 20240801 with version 7: uint32 tokens (llm.c's Llama 3 files). 20240801 with
 *     version 2 is topkd's own former spelling of the uint32 header and is still read;
 *   - .npy (format v1/v2/v3): dtype <i4, <u2, <u4 or <i8, 1-D or 2-D in C order. A 2-D array's
 *     rows are concatenated in order (rows are not treated as separate documents);
 *   - a Megatron-LM indexed dataset: PREFIX.idx (the "MMIDIDX" index: dtype, sequence lengths,
 *     pointers, document indices) and PREFIX.bin (the sequences back to back), named by PREFIX,
 *     PREFIX.idx or PREFIX.bin. Integer dtypes only. A glob that matches both files of one
 *     dataset takes it once, where its .bin sorts.
 * llm.c and .npy are told apart by content (the \x93NUMPY magic), not by name; a .bin is a
 * Megatron data file when a PREFIX.idx beginning with the MMIDIDX magic lies beside it.
 *
 * Files are memory-mapped, not loaded: tokens are converted to int32 where they are read
 * (windows, tkd_tokens_read), so a dataset larger than memory works. The files must not change
 * while the dataset is open. Opening checks every header and index, and that uint32 / int64
 * tokens fit in int32; each file's global token offset is kept so that a message can say "file X,
 * token offset Y".
 *
 * Documents: the stream is the concatenation of all tokens, and windows cut across document
 * boundaries for every format (as llm.c and Megatron's GPT dataset do): documents are told apart
 * inside the stream by the BOS/EOS token the tokenizer wrote. A Megatron index also records where
 * each document starts, and so do flags sidecars (below); those boundaries are kept
 * (tkd_tokens_num_docs / tkd_tokens_doc_start) and a message about a token names its document.
 *
 * Flags: a token file F may have a sidecar F.flags.npy (a Megatron dataset PREFIX.flags.npy): a
 * NumPy 1-D uint8 array of one byte per token of F. Bit 0 (TKD_TOKENS_FLAG_TRAINED): the token is a
 * trained target, i.e. the label of the position before it; bit 1 (TKD_TOKENS_FLAG_DOC_START): the
 * token starts a document; bits 2-7 are reserved and refused. Every file of a list has one or none
 * does; a sidecar's length must equal its file's token count. A glob's matches named *.flags.npy
 * are sidecars, never token files of their own ("data_*.npy" takes data_0.npy with its sidecar). When flags exist, their document
 * starts are the dataset's documents (tkd_tokens_num_docs / tkd_tokens_doc_start), and windows label
 * only the trained targets (below). `teacher-dump tokenize --chat` writes them.
 *
 * Windows: window i covers tokens [i*stride, i*stride + seq_len + 1): inputs are its first seq_len
 * tokens, labels the last seq_len. The last partial window is either dropped or padded with token 0
 * whose labels are TKD_TOKENS_IGNORE_LABEL (-100). With flags, a label whose token is not a trained
 * target is -100 too.
 */
#ifndef TKD_TOKENS_H
#define TKD_TOKENS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define TKD_TOKENS_IGNORE_LABEL (-100)
#define TKD_TOKENS_FLAG_TRAINED 1u   /* flags bit 0: the token is a trained target */
#define TKD_TOKENS_FLAG_DOC_START 2u /* flags bit 1: the token starts a document */
#define TKD_TOKENS_MAGIC_U16 20240520
#define TKD_TOKENS_MAGIC_U32 20240801
#define TKD_TOKENS_VERSION_U16 1 /* llm.c's GPT-2 header */
#define TKD_TOKENS_VERSION_U32 7 /* llm.c's Llama 3 header */
#define TKD_TOKENS_VERSION_U32_TOPKD 2 /* topkd's former uint32 header: read, never written by llm.c */

typedef struct tkd_tokens tkd_tokens; /* opaque: the opened dataset */

/* Opens the files named by spec: a path, a Megatron prefix or a glob pattern (a glob that matches
 * nothing is an error naming it). On success *out is owned by the caller (tkd_tokens_free), and
 * keeps the files mapped until then. */
tkd_status tkd_tokens_open(const char *spec, tkd_tokens **out);

/* Same for a list of specs (paths, Megatron prefixes or globs), concatenated in the order given. */
tkd_status tkd_tokens_open_list(const char *const *specs, int nspecs, tkd_tokens **out);

void tkd_tokens_free(tkd_tokens *ds); /* NULL is a no-op */

int64_t tkd_tokens_count(const tkd_tokens *ds);
/* Copies tokens [first, first + n) of the stream into out as int32. TKD_ERR_INVALID_ARG when the
 * range is not inside the stream. */
tkd_status tkd_tokens_read(const tkd_tokens *ds, int64_t first, int64_t n, int32_t *out /* (n) */);

/* The whole stream as one int32 array, copied on the first call (count x 4 bytes; NULL when that
 * does not fit in memory) and valid until tkd_tokens_free. For tests and small datasets; the first
 * call must not race another call on the same ds. The tools use tkd_tokens_window. */
const int32_t *tkd_tokens_data(const tkd_tokens *ds); // (count,)

int tkd_tokens_num_files(const tkd_tokens *ds);
/* File i's path, global offset of its first token, and token count. */
const char *tkd_tokens_file(const tkd_tokens *ds, int i, int64_t *first, int64_t *count);

/* Maps a global token offset to (file path, offset within that file); NULL when out of range. */
const char *tkd_tokens_locate(const tkd_tokens *ds, int64_t global, int64_t *local);

/* Whether the files have flags sidecars (all of them do, or none). */
bool tkd_tokens_has_flags(const tkd_tokens *ds);

/* Copies the flags of tokens [first, first + n) of the stream into out. TKD_ERR_INVALID_ARG when the
 * dataset has no flags or the range is not inside the stream. */
tkd_status tkd_tokens_read_flags(const tkd_tokens *ds, int64_t first, int64_t n, uint8_t *out /* (n) */);

/* The number of tokens whose flag bit 0 (trained) is set, counted when the dataset opened; -1 without
 * flags. Divided by tkd_tokens_count: the fraction of positions trained. */
int64_t tkd_tokens_num_trained(const tkd_tokens *ds);

/* "flags: 1234 of 5678 tokens are trained targets (21.7 %), 12 documents" into buf (what the tools
 * print once at start); returns 0 and writes nothing when the dataset has no flags. */
size_t tkd_tokens_trained_summary(const tkd_tokens *ds, char *buf, size_t cap);

/* Documents the files record (flags sidecars' bit 1 when the files have them; else Megatron
 * indexes; llm.c and .npy files without flags record none), in stream order. Document d starts at global token offset tkd_tokens_doc_start(ds, d) and ends where
 * the next one starts, or at the end of its file; an empty document starts where the next one does.
 * doc_start returns -1 when d is not in [0, num_docs). */
int64_t tkd_tokens_num_docs(const tkd_tokens *ds);
int64_t tkd_tokens_doc_start(const tkd_tokens *ds, int64_t d);

/* TKD_ERR_MISMATCH naming the file and token offset (and document, when the file records
 * documents) of the first id < 0 or >= vocab. */
tkd_status tkd_tokens_check_vocab(const tkd_tokens *ds, int vocab);

/* Number of windows of seq_len + 1 tokens every stride tokens. pad_tail = 0: only whole windows;
 * 1: windows continue until every token has appeared as a label (when stride <= seq_len), the last
 * one padded; a window never holds zero labels. */
int64_t tkd_tokens_num_windows(const tkd_tokens *ds, int seq_len, int stride, int pad_tail);

/* Fills window i: tokens (seq_len + 1) and labels (seq_len, labels[j] = tokens[j + 1], or -100
 * where that position is padding or, with flags, where tokens[j + 1] is not a trained target).
 * Padding tokens are 0. labels may be NULL. Returns the number of labels that are not -100 through
 * *n_valid when non-NULL. TKD_ERR_INVALID_ARG when i is out of range. */
tkd_status tkd_tokens_window(const tkd_tokens *ds, int seq_len, int stride, int pad_tail, int64_t i,
                             int32_t *tokens /* (seq_len + 1) */, int32_t *labels /* (seq_len) */, int *n_valid);

/* SHA-256 of the token stream as little-endian int32 — the dataset's identity, independent of the
 * files' formats and how the stream is split into files — followed, when the dataset has flags
 * sidecars, by a marker and the flags' bytes (a different trained mask is a different dataset).
 * hex: 64 lowercase digits + NUL. */
tkd_status tkd_tokens_sha256(const tkd_tokens *ds, char hex[65]); /* TKD_ERR_INTERRUPTED on a signal */

/* ---- Megatron-LM index (.idx), parsed from memory (the loader and the fuzz target use it) ---- */

#define TKD_MEGATRON_BIN_UNKNOWN UINT64_MAX /* bin_bytes when there is no data file to check against */

typedef struct tkd_megatron_index {
    int dtype_code;         /* Megatron's DType code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16 */
    int token_bytes;        /* 1, 2, 4 or 8 */
    int64_t num_sequences;  /* sequence_count */
    int64_t num_documents;  /* document_count - 1 (document_indices starts with 0) */
    int64_t num_tokens;     /* the sum of sizes */
    uint64_t data_bytes;    /* num_tokens * token_bytes: the length of the .bin */
    /* views into the index bytes, little-endian and unaligned: */
    const uint8_t *sizes;    // (num_sequences,) int32 tokens per sequence
    const uint8_t *pointers; // (num_sequences,) int64 byte offset of each sequence in the .bin
    const uint8_t *doc_idx;  // (num_documents + 1,) int64: document d holds sequences [doc_idx[d], doc_idx[d+1])
} tkd_megatron_index;

/* Checks the index idx[0..size) completely and describes it in *out: the MMIDIDX magic, version 1,
 * an integer dtype code, counts that match the index's length, sizes >= 0, pointers inside a data
 * file of bin_bytes bytes and stored back to back as Megatron's builder writes them, document
 * indices from 0 to sequence_count that never decrease, and (unless bin_bytes is
 * TKD_MEGATRON_BIN_UNKNOWN) sizes that add up to exactly bin_bytes. Messages name idx_name (and
 * bin_name) and the field. *out points into idx, which must outlive it. */
tkd_status tkd_tokens_parse_megatron_index(const char *idx_name, const void *idx, size_t size, const char *bin_name,
                                           uint64_t bin_bytes, tkd_megatron_index *out);

#endif /* TKD_TOKENS_H */
