/* dump_testutil.h — header-only helpers for the teacher-dump tests: token files, configs built
 * from YAML text, reading a whole cache back and comparing two caches dataset by dataset. Not a
 * test itself (no test_ prefix). Include after <cmocka.h>. */
#ifndef TKD_DUMP_TESTUTIL_H
#define TKD_DUMP_TESTUTIL_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "formats/cache_reader.h"
#include "model/model.h"
#include "teacher_cache/dump.h"
#include "teacher_cache/dump_config.h"
#include "tests/testutil.h"

#define TKD_DT_LLAMA TKD_SOURCE_DIR "/tests/fixtures/hf/llama_gqa_f32" /* V = 131 */
#define TKD_DT_QWEN TKD_SOURCE_DIR "/tests/fixtures/hf/qwen2_tied_f32"  /* V = 173 */

/* Writes a .npy of element type descr ('<i4', '|u1') and elem bytes, shape (rows, cols) (rows = 0:
 * 1-D of cols), from data. */
static inline void tkd_dt_write_npy_as(const char *path, const char *descr, const void *data, size_t elem, int rows,
                                       int cols)
{
    char shape[64], hdr[128];
    if (rows > 0)
        snprintf(shape, sizeof shape, "(%d, %d)", rows, cols);
    else
        snprintf(shape, sizeof shape, "(%d,)", cols);
    int n = snprintf(hdr, sizeof hdr, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", descr, shape);
    int total = 10 + n + 1, pad = (64 - total % 64) % 64; /* header padded to 64 bytes, ends in \n */
    memset(hdr + n, ' ', (size_t)pad);
    hdr[n + pad] = '\n';
    uint16_t hlen = (uint16_t)(n + pad + 1);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fwrite("\x93NUMPY\x01\x00", 1, 8, f);
    fwrite(&hlen, 2, 1, f);
    fwrite(hdr, 1, hlen, f);
    size_t cnt = (size_t)(rows > 0 ? rows : 1) * (size_t)cols;
    assert_int_equal(fwrite(data, elem, cnt, f), cnt);
    assert_int_equal(fclose(f), 0);
}

/* Writes an int32 .npy of shape (rows, cols) (rows = 0: 1-D of cols). */
static inline void tkd_dt_write_npy(const char *path, const int32_t *data, int rows, int cols)
{
    tkd_dt_write_npy_as(path, "<i4", data, 4, rows, cols);
}

/* n pseudo-random tokens in [0, vocab) written to <dir>/<name>; returns the path (static buffer). */
static inline const char *tkd_dt_random_tokens(const char *dir, const char *name, int n, int vocab, uint64_t seed)
{
    static char path[4096];
    int32_t *t = malloc((size_t)n * sizeof *t);
    assert_non_null(t);
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 7;
    for (int i = 0; i < n; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        t[i] = (int32_t)(s % (uint64_t)vocab);
    }
    snprintf(path, sizeof path, "%s/%s", dir, name);
    tkd_dt_write_npy(path, t, 0, n);
    free(t);
    return path;
}

/* Defaults, then the YAML text (parts split by "---" lines, in order), not finalized. */
static inline void tkd_dt_config_parse_only(tkd_dump_config *cfg, const char *yaml)
{
    memset(cfg, 0, sizeof *cfg);
    assert_int_equal(tkd_config_defaults(&tkd_dump_schema, cfg), TKD_OK);
    /* Parts separated by "---" lines are applied in turn, so a later part overrides keys. */
    for (const char *p = yaml; p;) {
        const char *sep = strstr(p, "\n---\n");
        size_t len = sep ? (size_t)(sep - p) + 1 : strlen(p);
        tkd_status st = tkd_config_apply_string(&tkd_dump_schema, cfg, "test", p, len);
        if (st != TKD_OK)
            fail_msg("%s", tkd_error_msg());
        p = sep ? sep + 5 : NULL;
    }
}

/* A finalized config: tkd_dt_config_parse_only, then tkd_dump_config_finalize. */
static inline void tkd_dt_config(tkd_dump_config *cfg, const char *yaml)
{
    tkd_dt_config_parse_only(cfg, yaml);
    assert_int_equal(tkd_dump_config_finalize(cfg, NULL), TKD_OK);
}

/* The common small setup: llama fixture, seq_len 16, k 8, 4-sequence shards, batches of 2; extra
 * YAML overrides it. */
static inline void tkd_dt_small_yaml(char *buf, size_t cap, const char *teacher, const char *data,
                                     const char *out, const char *extra)
{
    int n = snprintf(buf, cap,
             "teacher: {path: '%s'}\n"
             "data: {paths: ['%s'], seq_len: 16}\n"
             "cache: {k: 8, shard_sequences: 4}\n"
             "run: {batch_size: 2}\n"
             "lm_head: {chunk_rows: 20}\n"
             "output: {dir: '%s'}\n---\n%s",
             teacher, data, out, extra);
    assert_true(n > 0 && (size_t)n < cap); /* a truncated config would test something else */
}

/* tkd_dump_run on the config made from yaml (tkd_dt_config); the message stays in tkd_error_msg. */
static inline tkd_status tkd_dt_run(const char *yaml, const tkd_dump_opts *opts, tkd_dump_summary *sum)
{
    tkd_dump_config cfg;
    tkd_dt_config(&cfg, yaml);
    tkd_status st = tkd_dump_run(&cfg, opts, sum);
    tkd_config_free(&tkd_dump_schema, &cfg);
    return st;
}

/* tkd_dt_run that must succeed (the test fails with the message otherwise). */
static inline void tkd_dt_run_ok(const char *yaml, const tkd_dump_opts *opts, tkd_dump_summary *sum)
{
    if (tkd_dt_run(yaml, opts, sum) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
}

/* The small case of the cache tests: n random tokens (ids below 131, from seed) in <dir>/tok.npy (120
 * make 7 windows of 16: 2 shards) and the tkd_dt_small_yaml config of the llama fixture over them,
 * then extra, into y; out gets the output dir <dir>/cache. Returns the token file's path (static
 * buffer). */
static inline const char *tkd_dt_small_case(const char *dir, int n, uint64_t seed, char *out, size_t out_cap, char *y,
                                            size_t y_cap, const char *extra)
{
    const char *tok = tkd_dt_random_tokens(dir, "tok.npy", n, 131, seed);
    snprintf(out, out_cap, "%s/cache", dir);
    tkd_dt_small_yaml(y, y_cap, TKD_DT_LLAMA, tok, out, extra);
    return tok;
}

/* Writes <dir>/c.yaml for teacher-dump run as a child process: the llama fixture over 300 random
 * tokens (seed tok_seed, written to <dir>/tok.npy), that is 18 windows of 16 tokens, k 8, shards of
 * 4 sequences, batches of 2, lm_head chunks of 24 rows; cache_extra adds cache keys (", seed: 7" or
 * ""). Returns the path (static buffer). */
static inline const char *tkd_dt_cli_config(const char *dir, uint64_t tok_seed, const char *cache_extra)
{
    static char path[4300];
    const char *tok = tkd_dt_random_tokens(dir, "tok.npy", 300, 131, tok_seed);
    char text[9000];
    int n = snprintf(text, sizeof text,
                     "teacher: {path: '%s'}\n"
                     "data: {paths: ['%s'], seq_len: 16}\n"
                     "cache: {k: 8, shard_sequences: 4%s}\n"
                     "run: {batch_size: 2}\n"
                     "lm_head: {chunk_rows: 24}\n",
                     TKD_DT_LLAMA, tok, cache_extra);
    assert_true(n > 0 && (size_t)n < sizeof text);
    snprintf(path, sizeof path, "%s/c.yaml", dir);
    tkd_test_write_text(path, text);
    return path;
}

/* Everything in a cache, read through the reader (manifest.yaml). Free with tkd_cache_batch_free. */
static inline int64_t tkd_dt_read_all(const char *dir, tkd_cache_batch *b, tkd_cache_manifest *m)
{
    tkd_cache_reader *r = NULL;
    tkd_status st = tkd_cache_reader_open(&r, dir, NULL);
    if (st != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    const tkd_cache_manifest *rm = tkd_cache_reader_manifest(r);
    int64_t n = tkd_cache_reader_num_seq(r);
    assert_int_equal(tkd_cache_batch_alloc(b, n, rm->id.seq_len, rm->id.k, rm->id.tail_samples), TKD_OK);
    if (rm->id.packed)
        assert_int_equal(tkd_cache_batch_alloc_doc_start(b), TKD_OK);
    if (rm->id.trained_only)
        assert_int_equal(tkd_cache_batch_alloc_labels(b), TKD_OK);
    st = tkd_cache_reader_read(r, 0, n, b, 0);
    if (st != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    b->num_seq = n;
    if (m)
        assert_int_equal(tkd_cache_manifest_copy(m, rm), TKD_OK);
    tkd_cache_reader_close(r);
    return n;
}

/* Asserts that two caches hold the same values in every dataset (tkd_dt_assert_same_bytes also
 * compares the files). */
static inline void tkd_dt_assert_same_cache(const char *dir_a, const char *dir_b)
{
    tkd_cache_batch a, b;
    tkd_cache_manifest ma, mb;
    tkd_dt_read_all(dir_a, &a, &ma);
    tkd_dt_read_all(dir_b, &b, &mb);
    assert_int_equal(tkd_cache_manifest_check_same(&ma, dir_a, &mb, dir_b), TKD_OK);
    assert_int_equal(a.num_seq, b.num_seq);
    assert_int_equal(ma.num_shards, mb.num_shards);
    size_t n = (size_t)a.num_seq, T = (size_t)a.seq_len, k = (size_t)a.k, S = (size_t)a.tail_samples;
    assert_memory_equal(a.tokens, b.tokens, n * (T + 1) * sizeof *a.tokens);
    assert_memory_equal(a.topk_indices, b.topk_indices, n * T * k * sizeof *a.topk_indices);
    assert_memory_equal(a.topk_logits, b.topk_logits, n * T * k * sizeof *a.topk_logits);
    assert_memory_equal(a.lse, b.lse, n * T * sizeof *a.lse);
    assert_memory_equal(a.seq_index, b.seq_index, n * sizeof *a.seq_index);
    if (S)
        assert_memory_equal(a.tail_indices, b.tail_indices, n * T * S * sizeof *a.tail_indices);
    if (a.doc_start)
        assert_memory_equal(a.doc_start, b.doc_start, n * T * sizeof *a.doc_start);
    if (a.labels)
        assert_memory_equal(a.labels, b.labels, n * T * sizeof *a.labels);
    tkd_cache_batch_free(&a);
    tkd_cache_batch_free(&b);
    tkd_cache_manifest_free(&ma);
    tkd_cache_manifest_free(&mb);
}

/* Asserts that two caches list the same shards with the same sha256, and that the files are equal
 * byte for byte (shard-NNNNN.h5 depends on the data and the cache settings only: docs/cache-format.md). */
static inline void tkd_dt_assert_same_bytes(const char *dir_a, const char *dir_b)
{
    tkd_cache_manifest ma, mb;
    char pa[4400], pb[4400];
    snprintf(pa, sizeof pa, "%s/manifest.yaml", dir_a);
    snprintf(pb, sizeof pb, "%s/manifest.yaml", dir_b);
    assert_int_equal(tkd_cache_manifest_read(&ma, pa), TKD_OK);
    assert_int_equal(tkd_cache_manifest_read(&mb, pb), TKD_OK);
    assert_int_equal(ma.num_shards, mb.num_shards);
    assert_true(ma.num_shards > 0);
    for (int64_t i = 0; i < ma.num_shards; i++) {
        assert_string_equal(ma.shards[i].file, mb.shards[i].file);
        if (strcmp(ma.shards[i].sha256, mb.shards[i].sha256) != 0)
            fail_msg("%s: sha256 %s in %s, %s in %s", ma.shards[i].file, ma.shards[i].sha256, dir_a,
                     mb.shards[i].sha256, dir_b);
        int na = snprintf(pa, sizeof pa, "%s/%s", dir_a, ma.shards[i].file);
        int nb = snprintf(pb, sizeof pb, "%s/%s", dir_b, mb.shards[i].file);
        assert_true(na > 0 && (size_t)na < sizeof pa && nb > 0 && (size_t)nb < sizeof pb);
        if (!tkd_test_files_equal(pa, pb))
            fail_msg("%s and %s differ", pa, pb);
    }
    tkd_cache_manifest_free(&ma);
    tkd_cache_manifest_free(&mb);
}

/* Sleeps into the next second of the wall clock: a file written after it that records a time (as
 * HDF5 does unless told not to) differs from one written before. */
static inline void tkd_dt_next_second(void)
{
    time_t t0 = time(NULL);
    while (time(NULL) == t0)
        usleep(20000);
}

/* A one-layer Llama teacher (V = 64, D = 16, untied head, seeded weights) written as a Hugging Face
 * directory <dir>/<name> for teacher-dump: its LM head is multiplied by head_scale (logits of about
 * that size: a teacher beyond half's or float32's range), and when nan_token >= 0 that token's
 * embedding row is NaN (the hidden states turn NaN from its first occurrence on). Returns the path
 * (static buffer). */
static inline const char *tkd_dt_odd_teacher(const char *dir, const char *name, float head_scale, int nan_token)
{
    static char path[4300];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    tkd_model_config mc;
    tkd_test_tiny_llama(&mc, 64, 16, 2, 64);
    mc.tie_word_embeddings = 0;
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&mc, 5, &m), TKD_OK);
    for (size_t i = 0; i < (size_t)64 * 16; i++)
        m->w.lm_head[i] *= head_scale;
    for (int d = 0; nan_token >= 0 && d < 16; d++)
        m->w.embed[nan_token * 16 + d] = NAN;
    assert_int_equal(tkd_model_save_hf(m, path, TKD_DTYPE_F32), TKD_OK);
    tkd_model_free(m);
    return path;
}

/* Number of files in dir whose name ends with suffix. */
static inline int tkd_dt_count_suffix(const char *dir, const char *suffix)
{
    char cmd[4200];
    if (snprintf(cmd, sizeof cmd, "ls -1 '%s' | grep -c -- '%s$'", dir, suffix) >= (int)sizeof cmd)
        return -1;
    FILE *p = popen(cmd, "r");
    int n = -1;
    if (p) {
        if (fscanf(p, "%d", &n) != 1)
            n = -1;
        pclose(p);
    }
    return n;
}

#endif /* TKD_DUMP_TESTUTIL_H */
