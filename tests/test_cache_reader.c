/* test_cache_reader.c — manifest.yaml round trip (and a shard list out of order) and merge,
 * whole-cache random access across shards (all columns and the first k'), and the streaming loader
 * (any order, partial last batch, early close). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "formats/cache_manifest.h"
#include "formats/cache_reader.h"
#include "tests/cache_testutil.h"
#include "tests/testutil.h"

/* Checks slot j of got against what the generator wrote for global sequence g (half logits). */
static void check_slot(const tkd_cache_batch *got, int64_t j, const tkd_cache_identity *id, int64_t g)
{
    tkd_cache_batch want;
    assert_int_equal(tkd_cache_batch_alloc(&want, 1, id->seq_len, got->k, got->tail_samples), TKD_OK);
    tkd_test_cache_fill(&want, id, g, 1);
    size_t T = (size_t)id->seq_len, k = (size_t)got->k;
    assert_int_equal(got->cache_seq[j], g);
    assert_int_equal(got->seq_index[j], want.seq_index[0]);
    assert_memory_equal(got->tokens + (size_t)j * (T + 1), want.tokens, (T + 1) * 4);
    assert_memory_equal(got->lse + (size_t)j * T, want.lse, T * 4);
    assert_memory_equal(got->topk_indices + (size_t)j * T * k, want.topk_indices, T * k * 4);
    for (size_t i = 0; i < T * k; i++) {
        float w = tkd_f16_to_f32(tkd_f32_to_f16(want.topk_logits[i]));
        assert_memory_equal(&got->topk_logits[(size_t)j * T * k + i], &w, 4);
    }
    if (got->tail_samples)
        assert_memory_equal(got->tail_indices + (size_t)j * T * (size_t)got->tail_samples,
                            want.tail_indices, T * (size_t)got->tail_samples * 4);
    tkd_cache_batch_free(&want);
}

/* The manifest at path with its one `from` replaced by `to`, read back: the status (message set). */
static tkd_status read_edited(const char *path, const char *from, const char *to)
{
    char *text = tkd_test_slurp(path, NULL);
    char *at = strstr(text, from);
    assert_non_null(at);
    char edited[8192];
    int n = snprintf(edited, sizeof edited, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    assert_true(n > 0 && (size_t)n < sizeof edited);
    char epath[4300];
    snprintf(epath, sizeof epath, "%s.edited", path);
    tkd_test_write_text(epath, edited);
    free(text);
    tkd_cache_manifest r;
    tkd_status st = tkd_cache_manifest_read(&r, epath);
    if (st == TKD_OK)
        tkd_cache_manifest_free(&r);
    return st;
}

/* A shard re-made into a gap of the list goes in its place; overlaps on either side are refused. */
static void test_manifest_insert_shard(void **state)
{
    (void)state;
    tkd_cache_identity id = tkd_test_cache_identity(4, 3, 0, TKD_CACHE_DTYPE_HALF);
    tkd_cache_manifest m;
    tkd_test_cache_manifest(&m, &id);
    tkd_cache_shard_entry e = {"shard-00002.h5", 20, 10, 1, {0}};
    memset(e.sha256, 'c', 64);
    assert_int_equal(tkd_cache_manifest_insert_shard(&m, &e), TKD_OK); /* into an empty list */
    e = (tkd_cache_shard_entry){"shard-00000.h5", 0, 10, 1, {0}};
    assert_int_equal(tkd_cache_manifest_insert_shard(&m, &e), TKD_OK); /* at the front */
    e = (tkd_cache_shard_entry){"shard-00004.h5", 40, 5, 1, {0}};
    assert_int_equal(tkd_cache_manifest_insert_shard(&m, &e), TKD_OK); /* at the end */
    e = (tkd_cache_shard_entry){"shard-00001.h5", 12, 10, 1, {0}};
    assert_int_equal(tkd_cache_manifest_insert_shard(&m, &e), TKD_ERR_INVALID_ARG); /* runs into 20 */
    tkd_test_assert_msg_has("shard-00002.h5 starts at sequence 20, before the end (22) of shard-00001.h5");
    e.first_seq = 8;
    assert_int_equal(tkd_cache_manifest_insert_shard(&m, &e), TKD_ERR_INVALID_ARG); /* starts inside 0 */
    tkd_test_assert_msg_has("shard-00001.h5 starts at sequence 8, before the end (10) of shard-00000.h5");
    e.first_seq = 10;
    snprintf(e.file, sizeof e.file, "shard-00004.h5");
    assert_int_equal(tkd_cache_manifest_insert_shard(&m, &e), TKD_ERR_INVALID_ARG); /* name listed */
    snprintf(e.file, sizeof e.file, "shard-00001.h5");
    assert_int_equal(tkd_cache_manifest_insert_shard(&m, &e), TKD_OK); /* the gap, exactly */
    assert_int_equal(m.num_shards, 4);
    for (int i = 0; i < 3; i++)
        assert_true(m.shards[i].first_seq < m.shards[i + 1].first_seq);
    assert_string_equal(m.shards[1].file, "shard-00001.h5");
    assert_int_equal(tkd_cache_manifest_end_seq(&m, 0), 45);
    tkd_cache_manifest_free(&m);
}

static void test_manifest_roundtrip(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("manifest");
    char path[4200];
    snprintf(path, sizeof path, "%s/manifest.worker-1.yaml", dir);
    tkd_cache_identity id = tkd_test_cache_identity(4, 3, 2, TKD_CACHE_DTYPE_BFLOAT16);
    id.temperature = 0.7f; /* not exactly representable in decimal: must still round-trip */
    tkd_cache_manifest m, r;
    tkd_test_cache_manifest(&m, &id);
    tkd_cache_shard_entry e = {"shard-00007.h5", 70, 10, 12345, {0}};
    memset(e.sha256, 'c', 64);
    assert_int_equal(tkd_cache_manifest_add_shard(&m, &e), TKD_OK);
    e.first_seq = 80;
    snprintf(e.file, sizeof e.file, "shard-00008.h5");
    assert_int_equal(tkd_cache_manifest_add_shard(&m, &e), TKD_OK);
    e.first_seq = 85; /* overlaps the previous shard */
    snprintf(e.file, sizeof e.file, "shard-00009.h5");
    assert_int_equal(tkd_cache_manifest_add_shard(&m, &e), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cache_manifest_write(&m, path), TKD_OK);
    assert_int_equal(tkd_cache_manifest_read(&r, path), TKD_OK);
    assert_int_equal(tkd_cache_manifest_check_same(&m, "written", &r, "read"), TKD_OK);
    assert_true(r.id.temperature == 0.7f);
    assert_string_equal(r.teacher_path, m.teacher_path);
    assert_string_equal(r.teacher_arch, "LlamaForCausalLM");
    assert_string_equal(r.config_text, m.config_text);
    assert_string_equal(r.tool_version, "0.1.0");
    assert_int_equal(r.dataset_tokens, 123456);
    assert_int_equal(r.tail_seed, 7);
    assert_int_equal(r.num_shards, 2);
    assert_int_equal(tkd_cache_manifest_num_seq(&r), 20);
    assert_int_equal(tkd_cache_manifest_end_seq(&r, 0), 90);
    assert_string_equal(r.shards[1].file, "shard-00008.h5");
    assert_int_equal(r.shards[1].bytes, 12345);
    assert_string_equal(r.shards[1].sha256, e.sha256);
    /* the atomic write leaves no temp file behind */
    assert_int_equal(tkd_test_count_visible(dir), 1);
    /* a shard list out of order is a format error that keeps what the list's check found, after
     * the place in the file */
    assert_int_equal(read_edited(path, "first_seq: 80", "first_seq: 75"), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("manifest.worker-1.yaml.edited:");
    tkd_test_assert_msg_has(": manifest: shard shard-00008.h5 starts at sequence 75, before the end (80) of "
                            "shard-00007.h5");
    tkd_cache_manifest_free(&m);
    tkd_cache_manifest_free(&r);
    tkd_test_rmdtemp(dir);
}

static void test_manifest_merge(void **state)
{
    (void)state;
    tkd_cache_identity id = tkd_test_cache_identity(4, 3, 0, TKD_CACHE_DTYPE_HALF);
    tkd_cache_manifest w[3], out;
    const char *names[3] = {"manifest.worker-0.yaml", "manifest.worker-1.yaml", "manifest.worker-2.yaml"};
    int64_t ranges[3][2] = {{0, 4}, {4, 3}, {7, 5}};
    for (int i = 0; i < 3; i++) {
        tkd_test_cache_manifest(&w[i], &id);
        tkd_cache_shard_entry e = {"", ranges[i][0], ranges[i][1], 100, {0}};
        snprintf(e.file, sizeof e.file, "shard-%05d.h5", i);
        memset(e.sha256, '0' + i, 64);
        assert_int_equal(tkd_cache_manifest_add_shard(&w[i], &e), TKD_OK);
    }
    /* parts in any order: worker 2's list first */
    tkd_cache_manifest parts[3] = {w[2], w[0], w[1]};
    const char *pn[3] = {names[2], names[0], names[1]};
    assert_int_equal(tkd_cache_manifest_merge(&out, parts, 3, pn), TKD_OK);
    assert_int_equal(out.num_shards, 3);
    assert_int_equal(tkd_cache_manifest_num_seq(&out), 12);
    for (int i = 0; i < 3; i++)
        assert_int_equal(out.shards[i].first_seq, ranges[i][0]);
    tkd_cache_manifest_free(&out);
    /* a missing worker leaves a gap */
    tkd_cache_manifest gap[2] = {w[0], w[2]};
    const char *gn[2] = {names[0], names[2]};
    assert_int_equal(tkd_cache_manifest_merge(&out, gap, 2, gn), TKD_ERR_MISMATCH);
    assert_non_null(strstr(tkd_error_msg(), "gap"));
    assert_non_null(strstr(tkd_error_msg(), "shard-00002.h5"));
    /* a different teacher cannot be merged */
    parts[2].id.teacher_sha256[0] = 'f'; /* parts[2] is worker 1 */
    assert_int_equal(tkd_cache_manifest_merge(&out, parts, 3, pn), TKD_ERR_MISMATCH);
    assert_non_null(strstr(tkd_error_msg(), "teacher_sha256"));
    for (int i = 0; i < 3; i++)
        tkd_cache_manifest_free(&w[i]);
}

static void test_reader_random_access(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("reader");
    tkd_cache_identity id = tkd_test_cache_identity(5, 4, 2, TKD_CACHE_DTYPE_HALF);
    assert_int_equal(tkd_test_cache_make(dir, &id, 3, 5, 2, 2), TKD_OK); /* 5 + 5 + 2 sequences */
    tkd_cache_reader *r = NULL;
    tkd_cache_reader_opts o = {2, 1, NULL}; /* 2 open shards: forces LRU eviction; verify sha256 */
    assert_int_equal(tkd_cache_reader_open(&r, dir, &o), TKD_OK);
    assert_int_equal(tkd_cache_reader_num_seq(r), 12);
    assert_int_equal(tkd_cache_reader_manifest(r)->id.k, 4);
    tkd_cache_batch b;
    assert_int_equal(tkd_cache_batch_alloc(&b, 12, 5, 4, 2), TKD_OK);
    for (int64_t g = 11; g >= 0; g--) /* backwards, one at a time */
        assert_int_equal(tkd_cache_reader_read(r, g, 1, &b, g), TKD_OK);
    for (int64_t g = 0; g < 12; g++)
        check_slot(&b, g, &id, g);
    /* one read spanning all three shards, k' = 2 columns, no tail */
    tkd_cache_batch p;
    assert_int_equal(tkd_cache_batch_alloc(&p, 12, 5, 2, 0), TKD_OK);
    assert_int_equal(tkd_cache_reader_read(r, 3, 9, &p, 1), TKD_OK);
    for (int64_t j = 1; j < 10; j++)
        check_slot(&p, j, &id, j + 2);
    assert_int_equal(tkd_cache_reader_read(r, 10, 3, &p, 0), TKD_ERR_INVALID_ARG); /* past the end */
    tkd_cache_batch_free(&p);
    tkd_cache_batch_free(&b);
    tkd_cache_reader_close(r);
    tkd_test_rmdtemp(dir);
}

static void run_stream(tkd_cache_reader *r, const tkd_cache_identity *id, const int64_t *order,
                       int64_t n, int64_t batch, int depth, int32_t kp, int tail)
{
    tkd_cache_stream *s = NULL;
    tkd_cache_stream_opts o = {batch, kp, tail, depth};
    assert_int_equal(tkd_cache_stream_open(&s, r, order, n, &o), TKD_OK);
    int64_t seen = 0;
    const tkd_cache_batch *b;
    while (tkd_cache_stream_next(s, &b) == TKD_OK && b) {
        int64_t expect = n - seen < batch ? n - seen : batch;
        assert_int_equal(b->num_seq, expect);
        assert_int_equal(b->k, kp ? kp : id->k);
        for (int64_t j = 0; j < b->num_seq; j++)
            check_slot(b, j, id, order[seen + j]);
        seen += b->num_seq;
    }
    assert_null(b);
    assert_int_equal(seen, n);
    assert_int_equal(tkd_cache_stream_next(s, &b), TKD_OK); /* stays at the end */
    assert_null(b);
    tkd_cache_stream_close(s);
}

/* A shuffled epoch over a cache of more shards than the old default of 8 open opens each shard once
 * by default (it reopened one on about every other read before: 10x slower, docs/PERFORMANCE.md),
 * and an explicit max_open_shards still bounds them (so evicts and reopens). */
static int64_t epoch_opens(tkd_cache_reader *r, const int64_t *order, int64_t n)
{
    tkd_cache_stream *s = NULL;
    tkd_cache_stream_opts o = {3, 0, 0, 2};
    assert_int_equal(tkd_cache_stream_open(&s, r, order, n, &o), TKD_OK);
    const tkd_cache_batch *b;
    while (tkd_cache_stream_next(s, &b) == TKD_OK && b)
        ;
    int64_t opens = tkd_cache_stream_shard_opens(s);
    tkd_cache_stream_close(s);
    return opens;
}

static void test_stream_keeps_shards_open(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("shards");
    tkd_cache_identity id = tkd_test_cache_identity(2, 2, 0, TKD_CACHE_DTYPE_HALF);
    assert_int_equal(tkd_test_cache_make(dir, &id, 12, 2, 2, 1), TKD_OK); /* 12 shards of 2 */
    int64_t order[24];
    for (int64_t i = 0; i < 24; i++)
        order[i] = (i * 7) % 24; /* 7 is prime to 24: every sequence once, shards interleaved */
    tkd_cache_reader *r = NULL;
    assert_int_equal(tkd_cache_reader_open(&r, dir, NULL), TKD_OK);
    assert_int_equal(epoch_opens(r, order, 24), 12);
    tkd_cache_reader_close(r);
    tkd_cache_reader_opts few = {4, 0, NULL};
    assert_int_equal(tkd_cache_reader_open(&r, dir, &few), TKD_OK);
    assert_true(epoch_opens(r, order, 24) > 12);
    tkd_cache_reader_close(r);
    tkd_test_rmdtemp(dir);
}

static void test_stream_any_order(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("stream");
    tkd_cache_identity id = tkd_test_cache_identity(3, 3, 1, TKD_CACHE_DTYPE_HALF);
    assert_int_equal(tkd_test_cache_make(dir, &id, 4, 4, 3, 3), TKD_OK); /* 15 sequences */
    tkd_cache_reader *r = NULL;
    assert_int_equal(tkd_cache_reader_open(&r, dir, NULL), TKD_OK);
    int64_t order[15 * 2];
    for (int64_t i = 0; i < 15; i++)
        order[i] = i; /* sequential: runs cross shard boundaries */
    run_stream(r, &id, order, 15, 4, 2, 0, 1);
    uint64_t x = 12345;
    for (int64_t i = 14; i > 0; i--) { /* a seeded shuffle, and every sequence twice */
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int64_t j = (int64_t)((x >> 33) % (uint64_t)(i + 1)), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (int64_t i = 0; i < 15; i++)
        order[15 + i] = order[14 - i];
    run_stream(r, &id, order, 30, 7, 3, 2, 0);
    run_stream(r, &id, order, 1, 7, 0, 1, 1);
    run_stream(r, &id, order, 0, 7, 0, 0, 0); /* empty order: immediately at the end */
    /* closing early, with the thread blocked on a full ring, does not hang */
    tkd_cache_stream *s = NULL;
    tkd_cache_stream_opts o = {1, 0, 0, 2};
    assert_int_equal(tkd_cache_stream_open(&s, r, order, 30, &o), TKD_OK);
    const tkd_cache_batch *b;
    assert_int_equal(tkd_cache_stream_next(s, &b), TKD_OK);
    check_slot(b, 0, &id, order[0]);
    tkd_cache_stream_close(s);
    /* bad arguments are refused before a thread starts */
    int64_t bad = 15;
    assert_int_equal(tkd_cache_stream_open(&s, r, &bad, 1, &o), TKD_ERR_INVALID_ARG);
    o.depth = 1;
    assert_int_equal(tkd_cache_stream_open(&s, r, order, 1, &o), TKD_ERR_INVALID_ARG);
    tkd_cache_reader_close(r);
    tkd_test_rmdtemp(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_manifest_roundtrip),
        cmocka_unit_test(test_manifest_insert_shard),
        cmocka_unit_test(test_manifest_merge),
        cmocka_unit_test(test_reader_random_access),
        cmocka_unit_test(test_stream_any_order),
        cmocka_unit_test(test_stream_keeps_shards_open),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
