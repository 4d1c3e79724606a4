/* cache_testutil.h — header-only helpers for the teacher-cache tests: a deterministic generator of
 * shard contents (every value is a function of the global sequence number, so any reader can
 * recompute what it should see), a shard writer loop, and a stderr capture that checks HDF5
 * printed nothing. Not a test itself (no test_ prefix: tests/ globs test_*.c). */
#ifndef TKD_CACHE_TESTUTIL_H
#define TKD_CACHE_TESTUTIL_H

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "formats/cache_manifest.h"
#include "formats/cache_shard.h"

static inline tkd_cache_identity tkd_test_cache_identity(int32_t T, int32_t k, int32_t S,
                                                         tkd_cache_dtype dt)
{
    tkd_cache_identity id;
    memset(&id, 0, sizeof id);
    id.vocab_size = 1000;
    id.k = k;
    id.seq_len = T;
    id.temperature = 1.0f;
    id.logits_dtype = dt;
    id.tail_samples = S;
    memset(id.teacher_sha256, 'a', 64);
    memset(id.dataset_sha256, 'b', 64);
    return id;
}

static inline uint32_t tkd_test_cache_hash(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* Fills n sequences (global numbers g0..g0+n-1) into slots 0..n-1 of b, using b->k columns of a
 * k = id->k row (so a k'-column batch holds the first k' columns of the full row). Logits are
 * strictly decreasing along a row and span several binades, exercising rounding. */
static inline void tkd_test_cache_fill(tkd_cache_batch *b, const tkd_cache_identity *id,
                                       int64_t g0, int64_t n)
{
    size_t T = (size_t)id->seq_len, k = (size_t)b->k;
    for (int64_t j = 0; j < n; j++) {
        uint64_t g = (uint64_t)(g0 + j);
        b->seq_index[j] = (int64_t)(1000 + 7 * g);
        for (size_t t = 0; t <= T; t++)
            b->tokens[(size_t)j * (T + 1) + t] = (int32_t)(tkd_test_cache_hash(g * 131 + t) % (uint32_t)id->vocab_size);
        for (size_t t = 0; t < T; t++) {
            size_t row = (size_t)j * T + t;
            uint64_t key = g * 65537 + t;
            float top = 20.0f * (float)(tkd_test_cache_hash(key) % 1000) / 1000.0f - 5.0f;
            b->lse[row] = top + 0.5f + (float)(tkd_test_cache_hash(key + 1) % 100) / 64.0f;
            for (size_t c = 0; c < k; c++) {
                b->topk_indices[row * k + c] = (uint32_t)((key * 31 + c * 7) % (uint64_t)id->vocab_size);
                b->topk_logits[row * k + c] = top - 0.37f * (float)c - (float)(tkd_test_cache_hash(key + c) % 97) / 1000.0f;
            }
            for (int32_t s = 0; b->tail_indices && s < b->tail_samples; s++)
                b->tail_indices[row * (size_t)b->tail_samples + (size_t)s] =
                    tkd_test_cache_hash(key * 3 + (uint64_t)s) % (uint32_t)id->vocab_size;
        }
    }
    b->num_seq = n;
}

/* Writes a whole shard of num_seq sequences starting at global g0, appending `batch` at a time. */
static inline tkd_status tkd_test_cache_write_shard(const char *path, const tkd_cache_identity *id,
                                                    int64_t g0, int64_t num_seq, int64_t batch,
                                                    int64_t chunk, tkd_cache_shard_entry *entry)
{
    tkd_cache_batch b;
    TKD_TRY(tkd_cache_batch_alloc(&b, batch, id->seq_len, id->k, id->tail_samples));
    tkd_shard_writer *w = NULL;
    tkd_shard_writer_opts o = {.zstd_level = 3, .chunk_seqs = chunk, .tail_seed = 42};
    tkd_status st = tkd_shard_writer_open(&w, path, id, g0, &o);
    for (int64_t i = 0; st == TKD_OK && i < num_seq; i += batch) {
        tkd_test_cache_fill(&b, id, g0 + i, num_seq - i < batch ? num_seq - i : batch);
        st = tkd_shard_writer_append(w, &b);
    }
    if (st == TKD_OK)
        st = tkd_shard_writer_finish(w, entry);
    else
        tkd_shard_writer_abort(w);
    tkd_cache_batch_free(&b);
    return st;
}

/* A manifest for id with the demo-ish metadata the tests use (shards added by the caller). */
static inline void tkd_test_cache_manifest(tkd_cache_manifest *m, const tkd_cache_identity *id)
{
    tkd_cache_manifest_init(m);
    m->id = *id;
    tkd_cache_manifest_set_str(&m->teacher_path, "/models/teacher: \"quoted\" path");
    tkd_cache_manifest_set_str(&m->teacher_arch, "LlamaForCausalLM");
    tkd_cache_manifest_set_str(&m->dataset_path, "data/tokens-*.bin");
    tkd_cache_manifest_set_str(&m->tool_version, "0.1.0");
    tkd_cache_manifest_set_str(&m->config_text, "seq_len: 4\nk: 3  # comment\nlist:\n  - a\n");
    m->dataset_tokens = 123456;
    m->stride = id->seq_len;
    m->tail_seed = 7;
}

/* Writes a cache of `nshards` shards of `per` sequences (the last one `last`) into dir, with
 * manifest.yaml listing them. Returns the first failing status. */
static inline tkd_status tkd_test_cache_make(const char *dir, const tkd_cache_identity *id,
                                             int nshards, int64_t per, int64_t last, int64_t chunk)
{
    tkd_cache_manifest m;
    tkd_test_cache_manifest(&m, id);
    tkd_status st = TKD_OK;
    int64_t g = 0;
    for (int i = 0; st == TKD_OK && i < nshards; i++) {
        char path[4200];
        snprintf(path, sizeof path, "%s/shard-%05d.h5", dir, i);
        int64_t n = i == nshards - 1 ? last : per;
        tkd_cache_shard_entry e;
        st = tkd_test_cache_write_shard(path, id, g, n, 3, chunk, &e);
        if (st == TKD_OK)
            st = tkd_cache_manifest_add_shard(&m, &e);
        g += n;
    }
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/manifest.yaml", dir);
    if (st == TKD_OK)
        st = tkd_cache_manifest_write(&m, mpath);
    tkd_cache_manifest_free(&m);
    return st;
}

/* Redirects stderr (fd 2) into a temp file; tkd_test_stderr_end returns how many bytes were
 * printed meanwhile and restores it. Used to assert that HDF5 never prints its error stack. */
typedef struct tkd_test_stderr_capture {
    int saved;
    FILE *tmp;
} tkd_test_stderr_capture;

static inline void tkd_test_stderr_begin(tkd_test_stderr_capture *c)
{
    fflush(stderr);
    c->tmp = tmpfile();
    c->saved = dup(2);
    dup2(fileno(c->tmp), 2);
}

static inline long tkd_test_stderr_end(tkd_test_stderr_capture *c)
{
    fflush(stderr);
    dup2(c->saved, 2);
    close(c->saved);
    long n = ftell(c->tmp) >= 0 ? lseek(fileno(c->tmp), 0, SEEK_END) : -1;
    if (n > 0) { /* show what leaked, to make the failure easy to read */
        char buf[2048];
        lseek(fileno(c->tmp), 0, SEEK_SET);
        ssize_t r = read(fileno(c->tmp), buf, sizeof buf - 1);
        buf[r > 0 ? r : 0] = 0;
        fprintf(stderr, "unexpected stderr output:\n%s\n", buf);
    }
    fclose(c->tmp);
    return n;
}

#endif /* TKD_CACHE_TESTUTIL_H */
