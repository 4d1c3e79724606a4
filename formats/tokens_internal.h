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
} tok_file;

struct tkd_tokens {
    int64_t count, ndocs;
    tok_file *files;
    int nfiles;
    int32_t *flat; /* tkd_tokens_data's copy, made on first use */
};

/* Loading one file (tokens.c). */
tkd_status tkd_tokens_check_payload(const char *path, int64_t count, size_t tsz, uint64_t payload);
tkd_status tkd_tokens_check_fit(const tok_file *f, const char *path);
tkd_status tkd_tokens_map_path(const char *path, const char *what, void **map, size_t *len);
void tkd_tokens_release_file(tok_file *f);
tkd_status tkd_tokens_add_file(tkd_tokens *ds, tok_file *f, const char *path);

/* The headers of the one-file formats (tokens_header.c): the kind and count of the tokens that end
 * the file, checked against its size. */
tkd_status tkd_tokens_bin_header(FILE *fp, const char *path, uint64_t size, tok_kind *kind, int64_t *count);
tkd_status tkd_tokens_npy_header(FILE *fp, const char *path, uint64_t size, tok_kind *kind, int64_t *count);

/* Megatron-LM indexed datasets (tokens_megatron.c). */
int64_t tkd_tokens_mm_doc_start(const tkd_megatron_index *mi, int64_t d);
tkd_status tkd_tokens_load_megatron(tkd_tokens *ds, const char *prefix);
tkd_status tkd_tokens_megatron_prefix(const char *path, char **prefix);
int tkd_tokens_has_suffix(const char *s, const char *suffix);

#endif
