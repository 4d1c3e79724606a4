/* tokenize.h — `teacher-dump tokenize`: text files or JSON Lines -> token files in llm.c's format
 * with the teacher's own Hugging Face tokenizer (formats/tokenizer.h), in parallel over documents.
 *
 * Each document becomes prefix + ids + suffix (the BOS/EOS that tokenizer_config.json or the
 * tokenizer's TemplateProcessing asks for, as transformers' encode(text) adds them), then the EOS
 * token unless the suffix already ends with it (or --eos none), so document boundaries are in the
 * token stream, as llm.c's own writers keep them. Documents are written in input order.
 *
 * --chat: each JSON Lines record is a conversation, rendered with the chat template and tokenized
 * as formats/chat.h says (exactly apply_chat_template's ids: no prefix, suffix or EOS added), and
 * every token file F gets its flags sidecar F.flags.npy (formats/tokens.h: trained targets, document
 * starts), staged and renamed with it.
 *
 * Output: llm.c's .bin layout as its dev/data/data_common.py writes Llama 3 tokens: a header of
 * 256 little-endian int32 {20240801, 7, number of tokens, 0, ...}, then the tokens as
 * little-endian uint32; or, for an output named *.npy, a NumPy 1-D '<u4' array. One file, or shards
 * of shard_tokens tokens (OUT_000000.bin, ...). Each file is written under a temporary name and
 * fsynced; all of them are renamed to their final names only once the whole run has succeeded, so
 * a run that fails or is interrupted leaves no output name (and removes its temporaries).
 *
 * The output's directory is made when missing (mkdir -p, as teacher-dump makes output.dir); a run
 * that fails removes the folders it made, never one that was there before.
 *
 * Safety: the run holds the lock .<output name>.topkd-lock in the output's directory
 * (common/dir_lock.h; a second run into the same output is TKD_ERR_BUSY naming the holder's pid);
 * an output name that is a file the run reads (an input, tokenizer.json, tokenizer_config.json;
 * compared by device and inode) is refused, and so, without overwrite, is any output name that
 * exists (for shards: any OUT_<digits>.ext in the directory), all before anything is tokenized.
 */
#ifndef TKD_TOKENIZE_H
#define TKD_TOKENIZE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "formats/text_docs.h"

#define TKD_TOKENIZE_VERSION 7 /* llm.c's header version for uint32 tokens */

typedef struct tkd_tokenize_progress {
    uint64_t bytes_done, bytes_total; /* input bytes read and tokenized / all inputs' sizes */
    int64_t docs, tokens;
    double elapsed_s;
} tkd_tokenize_progress;

typedef struct tkd_tokenize_opts {
    const char *tokenizer;   /* a tokenizer.json, or the checkpoint directory holding one */
    const char **inputs;     /* text or JSON Lines files, read in this order (owned: tkd_tokenize_opts_free) */
    int ninputs;
    const char *output;      /* OUT.bin; with shard_tokens, OUT_000000.bin, OUT_000001.bin, ... */
    tkd_text_kind kind;      /* AUTO: .jsonl / .ndjson are JSON Lines, anything else text */
    const char *field;       /* JSON Lines: the field holding the text ("text") */
    char *separator;         /* text: the document separator (escapes decoded; owned); NULL: one per file */
    const char *eos;         /* NULL: the tokenizer's EOS; "none": no token between documents; else a token */
    int64_t shard_tokens;    /* tokens per output file; 0: one file. At most INT32_MAX for .bin (int32 count) */
    int threads;             /* 0: OpenMP's default (OMP_NUM_THREADS, else the CPUs); at most 4096 */
    bool overwrite;          /* replace an existing output file */
    int64_t vocab_limit;     /* > 0: an id >= this stops the run naming the file and line (teacher-dump's
                                data.tokenizer passes the teacher's vocabulary); 0: no limit */
    bool no_lock;            /* no lock file: the caller made the output's directory and is its only writer */
    bool chat;               /* --chat: JSON Lines conversations through the chat template (formats/chat.h),
                                each file written with its flags sidecar F.flags.npy */
    const char *chat_template; /* --chat-template FILE; NULL: the tokenizer's own */
    const char *chat_kwargs;   /* --chat-kwargs JSON object; NULL: none */
    long long chat_now;        /* strftime_now's clock for tests; 0 or less: the system's */
    void (*progress)(const tkd_tokenize_progress *p, void *user); /* after each batch; may be NULL */
    void *progress_user;
} tkd_tokenize_opts;

typedef struct tkd_tokenize_summary {
    int64_t docs, tokens;
    uint64_t bytes;          /* input bytes */
    int files;               /* output files written */
    double seconds;
    int64_t eos_id;          /* the token put between documents, -1 for none */
    int nprefix, nsuffix;    /* ids added before / after each document by the tokenizer's config */
    char first[4096];        /* the first output file */
    char stale[4096];        /* an older shard beyond the last one written ("" when none) */
    int64_t trained;         /* --chat: tokens flagged as trained targets */
    char chat_source[4400];  /* --chat: where the template came from, and its rule for trained tokens */
} tkd_tokenize_summary;

/* Parses the arguments after "tokenize" (argv[0] is "tokenize") into o (defaults first). *help is
 * set for -h/--help; *verbosity counts -v minus -q. TKD_ERR_INVALID_ARG names a bad flag or value.
 * o owns what it allocates: tkd_tokenize_opts_free, also after an error. */
tkd_status tkd_tokenize_parse_args(int argc, char **argv, tkd_tokenize_opts *o, bool *help, int *verbosity);
void tkd_tokenize_opts_free(tkd_tokenize_opts *o);

/* The `tokenize` usage text (flags and what they do), for --help. */
extern const char tkd_tokenize_usage[];

/* The totals of a finished run for the closing progress line, e.g. "done in 0:02: 3 files, 45.6 MB
 * of text, 1200 documents, 9876543 tokens (4.9M tok/s, 22.8 MB/s)": the real counts, whatever the
 * size of the input. Returns strlen(buf). */
size_t tkd_tokenize_format_totals(char *buf, size_t cap, const tkd_tokenize_summary *s);

/* Runs it. A Ctrl-C (common/signals.h) stops after the current batch: TKD_ERR_INTERRUPTED, every
 * file this run wrote removed (an existing output untouched), so running it again starts afresh. */
tkd_status tkd_tokenize_run(const tkd_tokenize_opts *o, tkd_tokenize_summary *sum);

#endif /* TKD_TOKENIZE_H */
