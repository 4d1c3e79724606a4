/* tokens_internal.h — what the parts of the token dataset share: a file's token kind and mapping,
 * the dataset's list of files, and the steps of loading one file. tokens.c holds the dataset (the
 * list, reads, windows), tokens_header.c the headers of llm.c .bin and .npy files, tokens_megatron.c
 * Megatron-LM indexed datasets. Only those files include it.
 */
#ifndef TKD_TOKENS_INTERNAL_H
#define TKD_TOKENS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "formats/tokens.h"

/* How the tokens of one file are stored. */
typedef enum tok_kind { TOK_I32, TOK_U16, TOK_U32, TOK_I64, TOK_U8, TOK_I8, TOK_I16 } tok_kind;

static inline size_t tkd_tokens_kind_size(tok_kind k)
{
    static const size_t bytes[] = {[TOK_I32] = 4, [TOK_U16] = 2, [TOK_U32] = 4, [TOK_I64] = 8,
                                   [TOK_U8] = 1,  [TOK_I8] = 1,  [TOK_I16] = 2};
    return bytes[k];
}

typedef struct tok_file {
    char *path;            /* the token file; a Megatron dataset's .bin */
    int64_t first;         /* global offset of its first token */
    int64_t count;
    tok_kind kind;
    const uint8_t *tok;    /* its first token, inside map; NULL when it holds none */
    void *map, *idx_map;   /* our read-only mappings of the file and of a Megatron index, or NULL */
    size_t map_len, idx_len;
    tkd_megatron_index mm; /* a Megatron dataset's index (mm.doc_idx == NULL for other files) */
    int64_t doc0;          /* global number of its first recorded document */
    /* Its flags sidecar (F.flags.npy, PREFIX.flags.npy), or all NULL / 0 when it has none: */
    char *flags_path;
    void *flags_map;
    size_t flags_len;
    const uint8_t *flags;  // (count,) inside flags_map
    int64_t *flag_docs;    // (nflag_docs,) local offsets of the tokens whose bit 1 is set
    int64_t nflag_docs, ntrained;
} tok_file;

struct tkd_tokens {
    int64_t count, ndocs;
    int64_t ntrained;      /* tokens whose flag bit 0 is set; -1 without flags */
    tok_file *files;
    int nfiles;
    int32_t *flat; /* tkd_tokens_data's copy, made on first use */
};

/* Loading one file (tokens.c). */
tkd_status tkd_tokens_check_payload(const char *path, int64_t count, size_t tsz, uint64_t payload);
tkd_status tkd_tokens_check_fit(const tok_file *f, const char *path);
tkd_status tkd_tokens_map_path(const char *path, const char *what, void **map, size_t *len);
void tkd_tokens_release_file(tok_file *f);
/* f's flags sidecar is flags_base.flags.npy when that exists. */
tkd_status tkd_tokens_add_file(tkd_tokens *ds, tok_file *f, const char *path, const char *flags_base);

/* The flags sidecar (tokens_flags.c): loads flags_path beside f when it exists (its length checked
 * against f->count, its documents and trained tokens counted); f's documents (flags or index); the
 * whole list's check that every file or none has flags. */
tkd_status tkd_tokens_flags_attach(tok_file *f, const char *tok_path, const char *flags_path);
void tkd_tokens_flags_release(tok_file *f);
int64_t tkd_tokens_file_ndocs(const tok_file *f);
int64_t tkd_tokens_file_doc_start(const tok_file *f, int64_t d);
tkd_status tkd_tokens_flags_check_list(tkd_tokens *ds);
/* labels[j] = -100 where token first + j (the label of position first + j - 1) is not trained
 * (labels may be NULL); returns how many of the n are trained. The dataset has flags. */
int64_t tkd_tokens_mask_labels(const tkd_tokens *ds, int64_t first, int64_t n, int32_t *labels /* (n) */);

/* The file holding global offset g in [0, count) (tokens.c); munmap of a mapping that may be NULL. */
int tkd_tokens_file_at(const tkd_tokens *ds, int64_t g);
void tkd_tokens_unmap(void *map, size_t len);

/* The headers of the one-file formats (tokens_header.c): the kind and count of the tokens that end
 * the file, checked against its size. */
tkd_status tkd_tokens_bin_header(FILE *fp, const char *path, uint64_t size, tok_kind *kind, int64_t *count);
tkd_status tkd_tokens_npy_header(FILE *fp, const char *path, uint64_t size, tok_kind *kind, int64_t *count);
/* A flags sidecar's .npy header: dtype uint8 ('|u1'), 1-D; *start is where its bytes begin. */
tkd_status tkd_tokens_npy_flags_header(FILE *fp, const char *path, uint64_t size, int64_t *count, uint64_t *start);

/* Megatron-LM indexed datasets (tokens_megatron.c). */
int64_t tkd_tokens_mm_doc_start(const tkd_megatron_index *mi, int64_t d);
tkd_status tkd_tokens_load_megatron(tkd_tokens *ds, const char *prefix);
tkd_status tkd_tokens_megatron_prefix(const char *path, char **prefix);
int tkd_tokens_has_suffix(const char *s, const char *suffix);

#endif
