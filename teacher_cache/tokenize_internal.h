/* tokenize_internal.h — what tokenize.c (arguments, batches, the run) and tokenize_out.c (the output
 * files: llm.c .bin or .npy tokens, maybe sharded, each with its flags sidecar in --chat mode,
 * staged under temporary names until the run succeeds) share. */
#ifndef TKD_TOKENIZE_INTERNAL_H
#define TKD_TOKENIZE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/fileio.h"
#include "teacher_cache/tokenize.h"

/* A file this run reads (an input, the tokenizer's files): no output may be the same file. */
typedef struct file_id {
    dev_t dev;
    ino_t ino;
    const char *path;
    const char *role; /* "input", "tokenizer file" */
} file_id;

/* A finished output file under its temporary name, renamed to its final name by tkd_tokout_publish. */
typedef struct staged {
    char *tmp, *path;
} staged;

typedef struct out_writer {
    const tkd_tokenize_opts *o;
    tkd_atomic_file af;
    tkd_atomic_file flags_af; /* --chat: the open file's flags sidecar (F.flags.npy) */
    bool open;
    int shard;          /* files opened so far */
    int64_t in_file;    /* tokens in the open file */
    char path[4096];    /* the open file */
    staged *done;       // (ndone,) finished, not yet renamed; tmp NULL once renamed
    int ndone, cap_done;
    file_id *reads;     // (nreads,) the files this run reads
    int nreads;
} out_writer;

/* An output named *.npy writes NumPy arrays, anything else llm.c .bin files. */
bool tkd_tokenize_is_npy(const tkd_tokenize_opts *o);
/* The directory of path ("." when none) into dir; *base = its last component. */
void tkd_tokenize_split_path(const char *path, char *dir, size_t cap, const char **base);
/* OUT.bin (or OUT.npy) itself, or OUT_%06d.bin for shard i (the extension kept). */
tkd_status tkd_tokenize_shard_path(const tkd_tokenize_opts *o, int i, char *out, size_t cap);

/* The writer (tokenize_out.c): refuses existing outputs up front (check_outputs), opens shard after
 * shard as tokens arrive (put: ids and, in --chat mode, their flags), stages finished files
 * (finish_file) and renames them all at the end (publish); free removes whatever was not published. */
tkd_status tkd_tokout_add_read(out_writer *w, const char *path, const char *role);
tkd_status tkd_tokout_check_outputs(const out_writer *w);
tkd_status tkd_tokout_open_file(out_writer *w);
tkd_status tkd_tokout_put(out_writer *w, const uint32_t *ids, const uint8_t *flags, size_t n);
tkd_status tkd_tokout_finish_file(out_writer *w);
tkd_status tkd_tokout_publish(out_writer *w);
void tkd_tokout_free(out_writer *w);

#endif /* TKD_TOKENIZE_INTERNAL_H */
