/* test_safetensors.c — safetensors writer/reader round trips, sharded directories, and every broken
 * file under tests/data/broken/ giving its own error. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/half.h"
#include "common/status.h"
#include "formats/safetensors.h"
#include "tests/testutil.h"

/* Writes a, b (2-D), s (0-D scalar), z (empty) with values from seed. */
static void write_sample(const char *path, tkd_dtype dt, float *a, float *b, float *s)
{
    tkd_test_randn(a, 7, 1, 1.0f);
    tkd_test_randn(b, 15, 2, 3.0f);
    s[0] = 0.1f;
    tkd_st_writer *w = NULL;
    assert_int_equal(tkd_st_writer_init(&w, dt), TKD_OK);
    int64_t sa[1] = {7}, sb[2] = {3, 5}, sz[2] = {0, 4};
    assert_int_equal(tkd_st_writer_add(w, "model.a", 1, sa, a), TKD_OK);
    assert_int_equal(tkd_st_writer_add(w, "model.b", 2, sb, b), TKD_OK);
    assert_int_equal(tkd_st_writer_add(w, "model.s", 0, NULL, s), TKD_OK);
    assert_int_equal(tkd_st_writer_add(w, "model.z", 2, sz, NULL), TKD_OK);
    assert_int_equal(tkd_st_writer_add(w, "model.a", 1, sa, a), TKD_ERR_INVALID_ARG); /* twice */
    assert_int_equal(tkd_st_writer_finish(w, path), TKD_OK);
    tkd_st_writer_free(w);
}

static void test_roundtrip_f32(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    const char *path = tkd_test_path(dir, "model.safetensors");
    float a[7], b[15], s[1];
    write_sample(path, TKD_DTYPE_F32, a, b, s);
    assert_int_equal(tkd_test_count_visible(dir), 1); /* no temp file left behind */

    size_t n;
    uint8_t *raw = (uint8_t *)tkd_test_slurp(path, &n);
    uint64_t hl = 0;
    memcpy(&hl, raw, 8);
    assert_int_equal(hl % 8, 0); /* data region 8-byte aligned */
    assert_non_null(strstr((char *)raw + 8, "\"__metadata__\":{\"format\":\"pt\"}"));
    assert_int_equal(n, 8 + hl + (7 + 15 + 1) * 4);
    free(raw);

    tkd_st_dir *d = NULL;
    assert_int_equal(tkd_st_open(dir, &d), TKD_OK); /* a directory */
    assert_int_equal(tkd_st_count(d), 4);
    assert_string_equal(tkd_st_at(d, 0)->name, "model.a"); /* sorted by name */
    const tkd_st_tensor *tb = tkd_st_find(d, "model.b");
    assert_non_null(tb);
    assert_int_equal(tb->dtype, TKD_DTYPE_F32);
    assert_int_equal(tb->ndim, 2);
    assert_int_equal(tb->shape[0], 3);
    assert_int_equal(tb->shape[1], 5);
    assert_int_equal(tkd_st_find(d, "model.s")->ndim, 0);
    assert_int_equal(tkd_st_find(d, "model.z")->nbytes, 0);
    assert_null(tkd_st_find(d, "model.c"));

    float got[15];
    int64_t eb[2] = {3, 5};
    assert_int_equal(tkd_st_read_f32(d, "model.b", 2, eb, got, 15), TKD_OK);
    assert_memory_equal(got, b, sizeof b); /* F32 is bit exact */
    int64_t ea[1] = {7};
    assert_int_equal(tkd_st_read_f32(d, "model.a", 1, ea, got, 7), TKD_OK);
    assert_memory_equal(got, a, sizeof a);
    assert_int_equal(tkd_st_read_f32(d, "model.s", 0, NULL, got, 1), TKD_OK);
    assert_true(got[0] == 0.1f);
    tkd_st_close(d);

    /* the file itself opens too */
    assert_int_equal(tkd_st_open(path, &d), TKD_OK);
    assert_int_equal(tkd_st_count(d), 4);
    tkd_st_close(d);
}

static void test_roundtrip_bf16(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    const char *path = tkd_test_path(dir, "w.safetensors");
    float a[7], b[15], s[1];
    write_sample(path, TKD_DTYPE_BF16, a, b, s);
    tkd_st_dir *d = NULL;
    assert_int_equal(tkd_st_open(path, &d), TKD_OK);
    const tkd_st_tensor *tb = tkd_st_find(d, "model.b");
    assert_int_equal(tb->dtype, TKD_DTYPE_BF16);
    assert_int_equal(tb->nbytes, 30);
    float got[15];
    int64_t eb[2] = {3, 5};
    assert_int_equal(tkd_st_read_f32(d, "model.b", 2, eb, got, 15), TKD_OK);
    for (int i = 0; i < 15; i++) /* exactly the round-to-nearest-even bf16 of the input */
        assert_true(got[i] == tkd_bf16_to_f32(tkd_f32_to_bf16(b[i])));
    assert_true(got[0] != b[0] || got[1] != b[1]); /* it really was rounded */
    tkd_st_close(d);
}

/* A hand-made image: F16 and I32 tensors after an odd-length header, so the data is unaligned. */
static size_t make_f16_image(uint8_t *buf)
{
    const char *hdr = "{\"h\":{\"dtype\":\"F16\",\"shape\":[2,2],\"data_offsets\":[0,8]},"
                      "\"i\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[8,12]}}";
    uint64_t n = strlen(hdr);
    memcpy(buf + 8, hdr, n);
    if (n % 2 == 0)
        buf[8 + n++] = ' '; /* odd length: every tensor starts at an odd address */
    memcpy(buf, &n, 8);
    uint16_t h[4] = {0x3c00, 0xc000, 0x3555, 0x0001}; /* 1, -2, 0.333251953125, 2^-24 */
    memcpy(buf + 8 + n, h, 8);
    int32_t i = 42;
    memcpy(buf + 8 + n + 8, &i, 4);
    return 8 + n + 12;
}

static void test_f16_unaligned_and_errors(void **state)
{
    (void)state;
    uint8_t buf[512];
    size_t n = make_f16_image(buf);
    tkd_st_dir *d = NULL;
    assert_int_equal(tkd_st_open_memory("mem.safetensors", buf, n, &d), TKD_OK);
    float got[4];
    int64_t s22[2] = {2, 2}, s41[2] = {4, 1};
    assert_int_equal(tkd_st_read_f32(d, "h", 2, s22, got, 4), TKD_OK);
    assert_true(got[0] == 1.0f && got[1] == -2.0f);
    assert_true(got[2] == 0.333251953125f);
    assert_true(got[3] == 0x1p-24f);

    assert_int_equal(tkd_st_read_f32(d, "h", 2, s41, got, 4), TKD_ERR_MISMATCH);
    tkd_test_assert_msg_has("mem.safetensors: tensor 'h' has shape [2, 2], expected [4, 1]");
    assert_int_equal(tkd_st_read_f32(d, "h", 1, s41, got, 4), TKD_ERR_MISMATCH);
    tkd_test_assert_msg_has("expected [4]");
    assert_int_equal(tkd_st_read_f32(d, "h", 2, s22, got, 3), TKD_ERR_INVALID_ARG);
    int64_t s1[1] = {1};
    assert_int_equal(tkd_st_read_f32(d, "i", 1, s1, got, 1), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("tensor 'i' is I32");
    assert_int_equal(tkd_st_read_f32(d, "lm_head.weight", 1, s1, got, 1), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("tensor 'lm_head.weight' is missing");
    tkd_st_close(d);
}

/* Every strict prefix of a valid file is refused (never read past the end: ASan watches). */
static void test_every_truncation_refused(void **state)
{
    (void)state;
    uint8_t buf[512];
    size_t n = make_f16_image(buf);
    for (size_t k = 0; k < n; k++) {
        uint8_t *copy = malloc(k ? k : 1); /* exact-size copy so ASan sees any overread */
        memcpy(copy, buf, k);
        tkd_st_dir *d = NULL;
        tkd_status st = tkd_st_open_memory("cut.safetensors", copy, k, &d);
        if (st != TKD_ERR_FORMAT)
            fail_msg("prefix of %zu bytes: status %s", k, tkd_status_name(st));
        assert_null(d);
        tkd_test_assert_msg_has("cut.safetensors: ");
        free(copy);
    }
}

/* Each single-byte corruption of the header either parses or is a format error; no crash. */
static void test_header_byte_flips(void **state)
{
    (void)state;
    uint8_t buf[512];
    size_t n = make_f16_image(buf);
    int refused = 0;
    for (size_t k = 0; k < 8 + 100; k++)
        for (int bit = 0; bit < 8; bit += 3) {
            uint8_t *copy = malloc(n);
            memcpy(copy, buf, n);
            copy[k] ^= (uint8_t)(1u << bit);
            tkd_st_dir *d = NULL;
            tkd_status st = tkd_st_open_memory("flip", copy, n, &d);
            assert_true(st == TKD_OK || st == TKD_ERR_FORMAT);
            refused += st != TKD_OK;
            tkd_st_close(d);
            free(copy);
        }
    assert_true(refused > 100); /* most flips break something */
}

TKD_TEST_OPENER(open_broken, tkd_st_dir, tkd_st_open)

/* A header holding only __metadata__ is a file without tensors (fuzz_safetensors found the parser
 * doing pointer arithmetic on the still-NULL tensor list: undefined behaviour UBSan stops at). */
static void test_metadata_only(void **state)
{
    (void)state;
    static const char hdr[] = "{\"__metadata__\": {\"format\": \"pt\"}}";
    uint8_t buf[64] = {sizeof hdr - 1};
    memcpy(buf + 8, hdr, sizeof hdr - 1);
    tkd_st_dir *d = NULL;
    assert_int_equal(tkd_st_open_memory("meta.safetensors", buf, 8 + sizeof hdr - 1, &d), TKD_OK);
    assert_int_equal(tkd_st_count(d), 0);
    tkd_st_close(d);
}

static void test_broken_files(void **state)
{
    (void)state;
    assert_true(tkd_test_broken_files("st_", open_broken) >= 20);
}

/* Two shards and an index, as transformers writes them. */
static void write_shards(const char *dir, const float *x)
{
    int64_t s4[1] = {4};
    tkd_st_writer *w = NULL;
    assert_int_equal(tkd_st_writer_init(&w, TKD_DTYPE_F32), TKD_OK);
    assert_int_equal(tkd_st_writer_add(w, "a", 1, s4, x), TKD_OK);
    assert_int_equal(tkd_st_writer_add(w, "b", 1, s4, x + 4), TKD_OK);
    assert_int_equal(tkd_st_writer_finish(w, tkd_test_path(dir, "model-00001-of-00002.safetensors")), TKD_OK);
    tkd_st_writer_free(w);
    assert_int_equal(tkd_st_writer_init(&w, TKD_DTYPE_BF16), TKD_OK);
    assert_int_equal(tkd_st_writer_add(w, "c", 1, s4, x + 8), TKD_OK);
    assert_int_equal(tkd_st_writer_finish(w, tkd_test_path(dir, "model-00002-of-00002.safetensors")), TKD_OK);
    tkd_st_writer_free(w);
}

static const char *index_json(const char *a, const char *b, const char *c)
{
    static char buf[1024];
    snprintf(buf, sizeof buf,
             "{\"metadata\": {\"total_size\": 40}, \"weight_map\": {\"a\": \"%s\", \"b\": \"%s\", \"c\": \"%s\"}}",
             a, b, c);
    return buf;
}

static void test_sharded(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    float x[12] = {1, 2, 3, 4, 5, 6, 7, 8, 0.5f, 1.5f, -2, 1024};
    write_shards(dir, x);
    const char *s1 = "model-00001-of-00002.safetensors", *s2 = "model-00002-of-00002.safetensors";
    const char *ix = tkd_test_path(dir, "model.safetensors.index.json");
    tkd_st_dir *d = NULL;

    assert_int_equal(tkd_st_open(dir, &d), TKD_ERR_NOT_FOUND); /* no index yet */
    tkd_test_assert_msg_has("neither model.safetensors nor model.safetensors.index.json");

    tkd_test_write_text(ix, index_json(s1, s1, s2));
    assert_int_equal(tkd_st_open(dir, &d), TKD_OK);
    assert_int_equal(tkd_st_count(d), 3);
    float got[4];
    int64_t s4[1] = {4};
    assert_int_equal(tkd_st_read_f32(d, "c", 1, s4, got, 4), TKD_OK);
    assert_memory_equal(got, x + 8, sizeof got); /* these values are exact in bf16 */
    assert_non_null(strstr(tkd_st_find(d, "c")->file, s2));
    assert_int_equal(tkd_st_read_f32(d, "b", 1, s4, got, 4), TKD_OK);
    assert_memory_equal(got, x + 4, sizeof got);
    tkd_st_close(d);

    tkd_test_write_text(ix, index_json(s1, s2, s2)); /* b is really in shard 1 */
    assert_int_equal(tkd_st_open(dir, &d), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("weight_map puts tensor 'b' in model-00002-of-00002.safetensors, but it is in");

    tkd_test_write_text(ix, "{\"weight_map\": {\"a\": \"model-00001-of-00002.safetensors\", \"q\": "
                   "\"model-00002-of-00002.safetensors\"}}");
    assert_int_equal(tkd_st_open(dir, &d), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("tensor 'q' in model-00002-of-00002.safetensors, but that shard lacks it");

    tkd_test_write_text(ix, index_json(s1, s1, "model-00003-of-00003.safetensors"));
    assert_int_equal(tkd_st_open(dir, &d), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("model-00003-of-00003.safetensors (weight_map[\"c\"]) does not exist");

    tkd_test_write_text(ix, index_json(s1, s1, "../etc/passwd"));
    assert_int_equal(tkd_st_open(dir, &d), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("is not a shard file name");

    tkd_test_write_text(ix, "{\"weight_map\": [");
    assert_int_equal(tkd_st_open(dir, &d), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("model.safetensors.index.json: not valid JSON");

    /* the same tensor in two shards */
    int64_t s4b[1] = {4};
    tkd_st_writer *w = NULL;
    assert_int_equal(tkd_st_writer_init(&w, TKD_DTYPE_F32), TKD_OK);
    assert_int_equal(tkd_st_writer_add(w, "a", 1, s4b, x), TKD_OK);
    assert_int_equal(tkd_st_writer_finish(w, tkd_test_path(dir, "extra.safetensors")), TKD_OK);
    tkd_st_writer_free(w);
    tkd_test_write_text(ix, "{\"weight_map\": {\"a\": \"model-00001-of-00002.safetensors\", \"x\": \"extra.safetensors\"}}");
    assert_int_equal(tkd_st_open(dir, &d), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("tensor 'a' is defined twice");

    /* model.safetensors wins over the index, as in transformers */
    assert_int_equal(rename(tkd_test_path(dir, "extra.safetensors"), tkd_test_path(dir, "model.safetensors")), 0);
    assert_int_equal(tkd_st_open(dir, &d), TKD_OK);
    assert_int_equal(tkd_st_count(d), 1);
    tkd_st_close(d);

    assert_int_equal(tkd_st_open(tkd_test_path(dir, "nope"), &d), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("nope");
}

/* Checkpoints written by transformers (tests/fixtures/hf/): every tensor opens, tied heads are
 * absent, and the bf16 file holds exactly the bf16 rounding of the f32 file (torch rounds to
 * nearest even, as tkd_f32_to_bf16 does). */
static void test_transformers_fixtures(void **state)
{
    (void)state;
    static const char *pairs[][2] = {{"fixtures/hf/llama_gqa_f32", "fixtures/hf/llama_gqa_bf16"},
                                     {"fixtures/hf/qwen2_tied_f32", "fixtures/hf/qwen2_tied_bf16"}};
    for (int p = 0; p < 2; p++) {
        tkd_st_dir *f = NULL, *b = NULL;
        char fp[4096];
        snprintf(fp, sizeof fp, "%s", tkd_test_src(pairs[p][0]));
        assert_int_equal(tkd_st_open(fp, &f), TKD_OK);
        assert_int_equal(tkd_st_open(tkd_test_src(pairs[p][1]), &b), TKD_OK);
        assert_int_equal(tkd_st_count(f), tkd_st_count(b));
        assert_true(tkd_st_count(f) >= 2 + 2 * 9);
        assert_non_null(tkd_st_find(f, "model.layers.1.mlp.down_proj.weight"));
        if (p == 1) { /* qwen2: tied head, q/k/v bias */
            assert_null(tkd_st_find(f, "lm_head.weight"));
            assert_non_null(tkd_st_find(f, "model.layers.0.self_attn.k_proj.bias"));
        } else {
            assert_non_null(tkd_st_find(f, "lm_head.weight"));
        }
        for (int i = 0; i < tkd_st_count(f); i++) {
            const tkd_st_tensor *t = tkd_st_at(f, i);
            assert_int_equal(t->dtype, TKD_DTYPE_F32);
            size_t n = t->nbytes / 4;
            float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
            assert_int_equal(tkd_st_read_f32(f, t->name, t->ndim, t->shape, x, n), TKD_OK);
            assert_int_equal(tkd_st_read_f32(b, t->name, t->ndim, t->shape, y, n), TKD_OK);
            for (size_t k = 0; k < n; k++)
                if (tkd_bf16_to_f32(tkd_f32_to_bf16(x[k])) != y[k])
                    fail_msg("%s[%zu]: bf16(%g) != %g", t->name, k, (double)x[k], (double)y[k]);
            free(x);
            free(y);
        }
        tkd_st_close(f);
        tkd_st_close(b);
    }
}

static void test_writer_refuses(void **state)
{
    (void)state;
    tkd_st_writer *w = NULL;
    assert_int_equal(tkd_st_writer_init(&w, TKD_DTYPE_I32), TKD_ERR_INVALID_ARG);
    assert_null(w);
    assert_int_equal(tkd_st_writer_init(&w, TKD_DTYPE_F32), TKD_OK);
    int64_t neg[1] = {-1};
    float x = 0;
    assert_int_equal(tkd_st_writer_add(w, "n", 1, neg, &x), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_st_writer_add(w, "__metadata__", 0, NULL, &x), TKD_ERR_INVALID_ARG);
    /* an unwritable place leaves nothing and says where */
    assert_int_equal(tkd_st_writer_finish(w, "/nonexistent-dir/model.safetensors"), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("/nonexistent-dir/model.safetensors");
    tkd_st_writer_free(w);
    tkd_st_writer_free(NULL);
    tkd_st_close(NULL);
}

TKD_TEST_MAIN_EACH_DIR(test_roundtrip_f32, test_roundtrip_bf16, test_f16_unaligned_and_errors,
    test_every_truncation_refused, test_header_byte_flips, test_broken_files, test_metadata_only, test_sharded,
    test_transformers_fixtures, test_writer_refuses)
