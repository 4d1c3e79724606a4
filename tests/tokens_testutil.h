/* tokens_testutil.h — token files written byte by byte from the formats' layouts
 * (docs/data-formats.md) into the cmocka group's temp dir: llm.c .bin, .npy (also a flags sidecar:
 * descr '|u1') and Megatron-LM datasets. Shared by test_tokens.c and test_tokens_flags.c; static
 * inline, so a test that uses only some of them compiles without unused-function warnings. */
#ifndef TKD_TOKENS_TESTUTIL_H
#define TKD_TOKENS_TESTUTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/tokens.h"
#include "tests/testutil.h"

/* A file in the group's temp dir. */
static inline const char *tmp_path(const char *name)
{
    return tkd_test_path(tkd_test_group_dir, name);
}

/* Stores the low `bytes` bytes of v at p, least significant first (every format here is
 * little-endian), independent of the host's byte order. Returns p + bytes. */
static inline uint8_t *put_le(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (uint8_t)(v >> (8 * i));
    return p + bytes;
}

static inline void write_bytes(const char *path, const uint8_t *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* An llm.c token file as llm.c's dev/data/data_common.py write_datafile lays it out: 256 int32
 * little-endian (magic, version, token count, then 253 zeros), then the tokens as uint16 (magic
 * 20240520) or uint32 (20240801). */
static inline const char *write_llmc(const char *name, int magic, int version, const int64_t *tok, int n)
{
    int tsz = magic == TKD_TOKENS_MAGIC_U16 ? 2 : 4;
    size_t len = 1024 + (size_t)n * (size_t)tsz;
    uint8_t *b = calloc(1, len), *p = b;
    assert_non_null(b);
    p = put_le(p, (uint32_t)magic, 4);
    p = put_le(p, (uint32_t)version, 4);
    put_le(p, (uint32_t)n, 4);
    p = b + 1024;
    for (int i = 0; i < n; i++)
        p = put_le(p, (uint64_t)tok[i], tsz);
    const char *path = tmp_path(name);
    write_bytes(path, b, len);
    free(b);
    return path;
}

/* llm.c .bin with the header llm.c writes for that magic: GPT-2 (v1, uint16) or Llama 3 (v7, uint32). */
static inline const char *write_bin(const char *name, int magic, const int64_t *tok, int n)
{
    int version = magic == TKD_TOKENS_MAGIC_U16 ? TKD_TOKENS_VERSION_U16 : TKD_TOKENS_VERSION_U32;
    return write_llmc(name, magic, version, tok, n);
}

/* .npy with the given descr and shape text, header version major (1 or 2), padded to 64 bytes as
 * numpy does. */
static inline const char *write_npy(const char *name, const char *descr, const char *shape, int major, const int64_t *tok,
                             int n)
{
    const char *path = tmp_path(name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    char h[256];
    int hl = snprintf(h, sizeof h, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", descr, shape);
    int pre = major == 1 ? 10 : 12;
    while ((pre + hl + 1) % 64)
        h[hl++] = ' ';
    h[hl++] = '\n';
    fwrite("\x93NUMPY", 1, 6, f);
    uint8_t ver[2] = {(uint8_t)major, 0};
    fwrite(ver, 1, 2, f);
    uint32_t len = (uint32_t)hl;
    fwrite(&len, major == 1 ? 2 : 4, 1, f);
    fwrite(h, 1, (size_t)hl, f);
    int sz = descr[2] - '0';
    for (int i = 0; i < n; i++)
        fwrite(&tok[i], (size_t)sz, 1, f); /* little-endian host: the low bytes come first */
    fclose(f);
    return path;
}

/* A Megatron-LM indexed dataset PREFIX.bin + PREFIX.idx as megatron/core/datasets/indexed_dataset.py
 * (IndexedDatasetBuilder, _IndexWriter) lays it out. .bin: the sequences' tokens back to back in the
 * dtype of `code`. .idx: "MMIDIDX\0\0", uint64 version 1, uint8 dtype code, uint64 sequence_count,
 * uint64 document_count, then int32 sizes[sequence_count], int64 pointers[sequence_count] (byte
 * offsets of the sequences in .bin) and int64 document_indices[document_count] (0, then the sequence
 * count after each document). tok holds every sequence's tokens in order. Returns the prefix. */
static inline const char *write_megatron(const char *prefix, int code, const int64_t *tok, const int *sizes, int nseq,
                                  const int64_t *docs, int ndocs)
{
    static const int bytes[9] = {0, 1, 1, 2, 4, 8, 8, 4, 2}; /* by dtype code */
    int tsz = bytes[code], ntok = 0;
    for (int s = 0; s < nseq; s++)
        ntok += sizes[s];
    uint8_t *bin = malloc((size_t)ntok * 8 + 1), *p = bin;
    assert_non_null(bin);
    for (int i = 0; i < ntok; i++)
        p = put_le(p, (uint64_t)tok[i], tsz);
    char path[4200];
    snprintf(path, sizeof path, "%s.bin", tmp_path(prefix));
    write_bytes(path, bin, (size_t)ntok * (size_t)tsz);
    free(bin);

    size_t len = 34 + 12 * (size_t)nseq + 8 * (size_t)ndocs;
    uint8_t *idx = malloc(len);
    assert_non_null(idx);
    memcpy(idx, "MMIDIDX\0\0", 9);
    p = put_le(idx + 9, 1, 8);
    p = put_le(p, (uint64_t)code, 1);
    p = put_le(p, (uint64_t)nseq, 8);
    p = put_le(p, (uint64_t)ndocs, 8);
    for (int s = 0; s < nseq; s++)
        p = put_le(p, (uint32_t)sizes[s], 4);
    int64_t at = 0;
    for (int s = 0; s < nseq; s++) {
        p = put_le(p, (uint64_t)at, 8);
        at += (int64_t)sizes[s] * tsz;
    }
    for (int d = 0; d < ndocs; d++)
        p = put_le(p, (uint64_t)docs[d], 8);
    assert_int_equal((size_t)(p - idx), len);
    snprintf(path, sizeof path, "%s.idx", tmp_path(prefix));
    write_bytes(path, idx, len);
    free(idx);
    return tmp_path(prefix);
}

#endif /* TKD_TOKENS_TESTUTIL_H */
