/* fuzz_shard.c — libFuzzer target for the shard reader (formats/cache_shard_read.c) and the zstd filter
 * (formats/h5zstd.c) behind it. Built and run by scripts/fuzz.sh.
 *
 * The input is a recipe, not the file. HDF5 1.10 (the system's library, not instrumented) has
 * memory errors of its own on crafted metadata — fuzzing raw files found a heap overflow inside
 * H5Aexists within minutes — which we cannot fix and which would make this target fail at random.
 * So the harness writes a real shard with the project's writer, shaped by the first input bytes,
 * then changes it only through HDF5's API (root attributes deleted or rewritten with another type
 * or value) and by flipping bytes inside the stored chunks (the compressed, checksummed data our
 * reader and filter must judge), and reads it back.
 *
 * Input: [0] bits 0-1 logits dtype, bit 2 tail draws  [1] k - 1  [2] seq_len - 1  [3] num_seq - 1
 *        [4] n attribute edits (0..3), then n edits of 10 bytes: attribute, operation, 8 value bytes
 *        the rest: XOR mask over the bytes of the stored chunks, in file order.
 * The property: untouched, the shard reads back exactly what was written; changed, it opens and
 * reads, or is refused with a one-line message; nothing crashes or leaks.
 */
#include <hdf5.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/cache_shard.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const attr_names[] = {"format", "version", "vocab_size", "k", "seq_len", "temperature",
                                         "teacher_sha256", "dataset_sha256", "logits_dtype", "first_seq",
                                         "num_seq", "tail_samples", "tail_seed"};
#define NATTR (sizeof attr_names / sizeof attr_names[0])
static const char *const ds_names[] = {"/tokens", "/topk/indices", "/topk/logits", "/lse", "/seq_index",
                                       "/tail/indices"};

/* Deterministic contents for b's num_seq sequences: tokens and indices below vocab, logits falling
 * along each row (exact in every dtype: small integers), LSE above them. */
static void fill(tkd_cache_batch *b, int64_t vocab)
{
    size_t T = (size_t)b->seq_len, k = (size_t)b->k, S = (size_t)b->tail_samples;
    for (size_t j = 0; j < (size_t)b->num_seq; j++) {
        b->seq_index[j] = (int64_t)(7 * j + 3);
        for (size_t t = 0; t <= T; t++)
            b->tokens[j * (T + 1) + t] = (int32_t)((j * 31 + t * 7) % (size_t)vocab);
        for (size_t t = 0; t < T; t++) {
            size_t row = j * T + t;
            b->lse[row] = (float)(k + 2);
            for (size_t c = 0; c < k; c++) {
                b->topk_indices[row * k + c] = (uint32_t)((row * 13 + c) % (size_t)vocab);
                b->topk_logits[row * k + c] = (float)(k - c);
            }
            for (size_t s = 0; s < S; s++)
                b->tail_indices[row * S + s] = (uint32_t)((row * 17 + s + 500) % (size_t)vocab);
        }
    }
}

/* Writes the shard the first 4 bytes describe into path (the identity lands in *id, the contents
 * in *b). */
static void write_shard(const uint8_t *d, const char *path, tkd_cache_identity *id, tkd_cache_batch *b)
{
    memset(id, 0, sizeof *id);
    id->vocab_size = 1000;
    id->logits_dtype = (tkd_cache_dtype)(d[0] & 3) > TKD_CACHE_DTYPE_FLOAT32 ? TKD_CACHE_DTYPE_HALF
                                                                              : (tkd_cache_dtype)(d[0] & 3);
    id->tail_samples = d[0] & 4 ? 2 : 0;
    id->k = 1 + d[1] % 8;
    id->seq_len = 1 + d[2] % 8;
    id->temperature = 1.0f;
    memset(id->teacher_sha256, 'a', 64);
    memset(id->dataset_sha256, 'b', 64);
    if (tkd_cache_batch_alloc(b, 1 + d[3] % 6, id->seq_len, id->k, id->tail_samples) != TKD_OK)
        abort();
    b->num_seq = b->capacity;
    fill(b, id->vocab_size);
    tkd_shard_writer *w = NULL;
    if (tkd_shard_writer_open(&w, path, id, 0, NULL) != TKD_OK || tkd_shard_writer_append(w, b) != TKD_OK ||
        tkd_shard_writer_finish(w, NULL) != TKD_OK) {
        fprintf(stderr, "fuzz: the writer failed: %s\n", tkd_error_msg());
        abort();
    }
}

/* One attribute edit e (10 bytes): delete it, or write it back as an int64, a double or an 8-byte
 * string made of the value bytes. */
static void edit_attr(hid_t f, const uint8_t *e)
{
    const char *name = attr_names[e[0] % NATTR];
    if (H5Aexists(f, name) > 0)
        H5Adelete(f, name);
    int op = e[1] % 4;
    if (op == 0)
        return;
    hid_t ftype = op == 1 ? H5T_STD_I64LE : op == 2 ? H5T_IEEE_F64LE : H5Tcopy(H5T_C_S1);
    hid_t mtype = op == 1 ? H5T_NATIVE_INT64 : op == 2 ? H5T_NATIVE_DOUBLE : ftype;
    if (op == 3)
        H5Tset_size(ftype, 8);
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(f, name, ftype, sp, H5P_DEFAULT, H5P_DEFAULT);
    if (a >= 0) {
        H5Awrite(a, mtype, e + 2);
        H5Aclose(a);
    }
    H5Sclose(sp);
    if (op == 3)
        H5Tclose(ftype);
}

/* XORs mask over the stored bytes of every chunk of every dataset, in dataset and chunk order. */
static void flip_chunks(const char *path, const uint8_t *mask, size_t n)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    FILE *fp = fopen(path, "r+b");
    if (f < 0 || !fp)
        abort();
    size_t used = 0;
    for (size_t d = 0; d < sizeof ds_names / sizeof ds_names[0] && used < n; d++) {
        hid_t ds = H5Lexists(f, ds_names[d], H5P_DEFAULT) > 0 ? H5Dopen2(f, ds_names[d], H5P_DEFAULT) : -1;
        hid_t sp = ds >= 0 ? H5Dget_space(ds) : -1;
        hsize_t nchunks = 0;
        if (sp >= 0)
            H5Dget_num_chunks(ds, sp, &nchunks);
        for (hsize_t c = 0; c < nchunks && used < n; c++) {
            hsize_t off[H5S_MAX_RANK], bytes = 0;
            unsigned filter_mask;
            haddr_t addr;
            if (H5Dget_chunk_info(ds, sp, c, off, &filter_mask, &addr, &bytes) < 0)
                continue;
            for (hsize_t i = 0; i < bytes && used < n; i++, used++) {
                if (!mask[used] || fseek(fp, (long)(addr + i), SEEK_SET) != 0)
                    continue;
                int v = fgetc(fp);
                fseek(fp, (long)(addr + i), SEEK_SET);
                fputc(v ^ mask[used], fp);
            }
        }
        if (sp >= 0)
            H5Sclose(sp);
        if (ds >= 0)
            H5Dclose(ds);
    }
    H5Fclose(f);
    fclose(fp);
}

/* Every sequence of s, read back into r (same shape as b): equal to b when exact, else either read or
 * refused as corrupt. */
static void read_back(tkd_shard *s, const tkd_cache_batch *b, int exact)
{
    static const tkd_status refusals[] = {TKD_ERR_CHECKSUM, TKD_ERR_FORMAT, TKD_ERR_IO};
    const tkd_shard_info *in = tkd_shard_get_info(s);
    if (in->num_seq != b->num_seq || in->id.k != b->k || in->id.seq_len != b->seq_len ||
        in->id.tail_samples != b->tail_samples) {
        if (exact)
            abort();
        return; /* the edited attributes disagree with the datasets' shapes yet opened: fine */
    }
    tkd_cache_batch r;
    if (tkd_cache_batch_alloc(&r, b->num_seq, b->seq_len, b->k, b->tail_samples) != TKD_OK)
        abort();
    tkd_status st = tkd_shard_read(s, 0, b->num_seq, &r, 0);
    if (st != TKD_OK && exact) {
        fprintf(stderr, "fuzz: an untouched shard does not read: %s\n", tkd_error_msg());
        abort();
    }
    if (st != TKD_OK)
        tkd_fuzz_expect_refusal(st, refusals, 3);
    size_t rows = (size_t)b->num_seq * (size_t)b->seq_len;
    if (st == TKD_OK && exact &&
        (memcmp(r.tokens, b->tokens, (size_t)b->num_seq * (size_t)(b->seq_len + 1) * 4) != 0 ||
         memcmp(r.topk_indices, b->topk_indices, rows * (size_t)b->k * 4) != 0 ||
         memcmp(r.topk_logits, b->topk_logits, rows * (size_t)b->k * 4) != 0 ||
         memcmp(r.lse, b->lse, rows * 4) != 0 || memcmp(r.seq_index, b->seq_index, (size_t)b->num_seq * 8) != 0 ||
         (b->tail_samples && memcmp(r.tail_indices, b->tail_indices, rows * (size_t)b->tail_samples * 4) != 0)))
        abort(); /* the round trip changed a value */
    tkd_cache_batch_free(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const tkd_status refusals[] = {TKD_ERR_FORMAT, TKD_ERR_CHECKSUM, TKD_ERR_UNSUPPORTED,
                                          TKD_ERR_NOT_FOUND, TKD_ERR_NOMEM};
    if (size < 5)
        return 0;
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    const char *path = tkd_fuzz_write_file(".h5", data, 0); /* the path; the writer replaces the file */
    tkd_cache_identity id;
    tkd_cache_batch b;
    write_shard(data, path, &id, &b);
    size_t nedit = data[4] % 4, at = 5;
    int exact = 1;
    if (nedit && size >= at + 10) {
        hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
        for (size_t e = 0; e < nedit && at + 10 <= size; e++, at += 10)
            edit_attr(f, data + at);
        H5Fclose(f);
        exact = 0;
    }
    for (size_t i = at; i < size && exact; i++)
        exact = data[i] == 0;
    if (at < size)
        flip_chunks(path, data + at, size - at);
    tkd_shard *s = NULL;
    tkd_status st = tkd_shard_open(&s, path, 0);
    if (st != TKD_OK && exact) {
        fprintf(stderr, "fuzz: an untouched shard does not open: %s\n", tkd_error_msg());
        abort();
    }
    if (st != TKD_OK)
        tkd_fuzz_expect_refusal(st, refusals, 5);
    else
        read_back(s, &b, exact);
    tkd_shard_close(s);
    tkd_cache_batch_free(&b);
    return 0;
}
