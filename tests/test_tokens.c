/* test_tokens.c — llm.c .bin (every header llm.c writes) and .npy token files, lists and globs, vocabulary check, windows, and
 * every broken token file under tests/data/broken/ giving its own error. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "formats/tokens.h"
#include "tests/testutil.h"

/* A file in the group's temp dir. */
static const char *tmp_path(const char *name)
{
    return tkd_test_path(tkd_test_group_dir, name);
}

/* Stores the low `bytes` bytes of v at p, least significant first (every format here is
 * little-endian), independent of the host's byte order. Returns p + bytes. */
static uint8_t *put_le(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (uint8_t)(v >> (8 * i));
    return p + bytes;
}

static void write_bytes(const char *path, const uint8_t *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* An llm.c token file as llm.c's dev/data/data_common.py write_datafile lays it out: 256 int32
 * little-endian (magic, version, token count, then 253 zeros), then the tokens as uint16 (magic
 * 20240520) or uint32 (20240801). */
static const char *write_llmc(const char *name, int magic, int version, const int64_t *tok, int n)
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
static const char *write_bin(const char *name, int magic, const int64_t *tok, int n)
{
    int version = magic == TKD_TOKENS_MAGIC_U16 ? TKD_TOKENS_VERSION_U16 : TKD_TOKENS_VERSION_U32;
    return write_llmc(name, magic, version, tok, n);
}

/* .npy with the given descr and shape text, header version major (1 or 2), padded to 64 bytes as
 * numpy does. */
static const char *write_npy(const char *name, const char *descr, const char *shape, int major, const int64_t *tok,
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

static void seq(int64_t *t, int n, int64_t base, int64_t step)
{
    for (int i = 0; i < n; i++)
        t[i] = base + step * i;
}

static void assert_stream(const tkd_tokens *ds, const int64_t *want, int n)
{
    assert_int_equal(tkd_tokens_count(ds), n);
    const int32_t *d = tkd_tokens_data(ds);
    for (int i = 0; i < n; i++)
        if (d[i] != want[i])
            fail_msg("token %d: %d != %lld", i, d[i], (long long)want[i]);
}

static void test_bin_u16_u32(void **state)
{
    (void)state;
    int64_t t[300];
    seq(t, 300, 65000, 3); /* crosses 65535 only in the u32 file below */
    for (int i = 0; i < 300; i++)
        t[i] %= 65536;
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(write_bin("a.bin", TKD_TOKENS_MAGIC_U16, t, 300), &ds), TKD_OK);
    assert_stream(ds, t, 300);
    assert_int_equal(tkd_tokens_num_files(ds), 1);
    tkd_tokens_free(ds);

    seq(t, 300, 100000, 7919);
    assert_int_equal(tkd_tokens_open(write_bin("b.bin", TKD_TOKENS_MAGIC_U32, t, 300), &ds), TKD_OK);
    assert_stream(ds, t, 300);
    tkd_tokens_free(ds);
}

static void test_npy_dtypes_and_2d(void **state)
{
    (void)state;
    int64_t t[24];
    tkd_tokens *ds = NULL;
    seq(t, 24, -3, 1000); /* <i4 keeps negatives (check_vocab refuses them later) */
    assert_int_equal(tkd_tokens_open(write_npy("i4.npy", "<i4", "(24,)", 1, t, 24), &ds), TKD_OK);
    assert_stream(ds, t, 24);
    tkd_tokens_free(ds);

    seq(t, 24, 60000, 200);
    for (int i = 0; i < 24; i++)
        t[i] %= 65536;
    /* 2-D: rows concatenated in C order */
    assert_int_equal(tkd_tokens_open(write_npy("u2.npy", "<u2", "(4, 6)", 1, t, 24), &ds), TKD_OK);
    assert_stream(ds, t, 24);
    tkd_tokens_free(ds);

    seq(t, 24, 2000000000, 5000000); /* up to 2.115e9 < 2^31 */
    assert_int_equal(tkd_tokens_open(write_npy("u4.npy", "<u4", "(3,8)", 2, t, 24), &ds), TKD_OK);
    assert_stream(ds, t, 24);
    tkd_tokens_free(ds);

    seq(t, 24, 7, 123456);
    assert_int_equal(tkd_tokens_open(write_npy("i8.npy", "<i8", "(24,)", 2, t, 24), &ds), TKD_OK);
    assert_stream(ds, t, 24);
    tkd_tokens_free(ds);

    t[5] = (int64_t)1 << 40;
    assert_int_equal(tkd_tokens_open(write_npy("i8big.npy", "<i8", "(24,)", 1, t, 24), &ds), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("i8big.npy: token 1099511627776 at token offset 5 does not fit in int32");
    assert_null(ds);
}

static void test_list_glob_locate_vocab(void **state)
{
    (void)state;
    char sub[4096];
    snprintf(sub, sizeof sub, "%s/shards", tkd_test_group_dir);
    assert_int_equal(tkd_test_rmtree(sub), 0);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", sub);
    assert_int_equal(system(cmd), 0);
    int64_t a[10], b[6], c[5];
    seq(a, 10, 0, 1);
    seq(b, 6, 100, 1);
    seq(c, 5, 200, 1);
    b[4] = 5000; /* out of a 1000-token vocabulary */
    write_bin("shards/s1.bin", TKD_TOKENS_MAGIC_U16, a, 10);
    write_npy("shards/s2.npy", "<i4", "(2, 3)", 1, b, 6);
    write_bin("shards/s3.bin", TKD_TOKENS_MAGIC_U32, c, 5);
    write_bin("shards/s0_empty.bin", TKD_TOKENS_MAGIC_U16, a, 0); /* sorts first, holds nothing */

    tkd_tokens *ds = NULL;
    char pattern[4200];
    snprintf(pattern, sizeof pattern, "%s/s*", sub);
    assert_int_equal(tkd_tokens_open(pattern, &ds), TKD_OK);
    assert_int_equal(tkd_tokens_count(ds), 21);
    assert_int_equal(tkd_tokens_num_files(ds), 4);
    int64_t first, count;
    const char *f = tkd_tokens_file(ds, 2, &first, &count);
    assert_non_null(strstr(f, "s2.npy"));
    assert_int_equal(first, 10);
    assert_int_equal(count, 6);
    assert_int_equal(tkd_tokens_data(ds)[16], 200);

    int64_t local;
    assert_non_null(strstr(tkd_tokens_locate(ds, 0, &local), "s1.bin"));
    assert_int_equal(local, 0);
    assert_non_null(strstr(tkd_tokens_locate(ds, 14, &local), "s2.npy"));
    assert_int_equal(local, 4);
    assert_non_null(strstr(tkd_tokens_locate(ds, 20, &local), "s3.bin"));
    assert_int_equal(local, 4);
    assert_null(tkd_tokens_locate(ds, 21, &local));

    assert_int_equal(tkd_tokens_check_vocab(ds, 5001), TKD_OK);
    assert_int_equal(tkd_tokens_check_vocab(ds, 1000), TKD_ERR_MISMATCH);
    tkd_test_assert_msg_has("s2.npy: token offset 4: id 5000 is outside the vocabulary [0, 1000)");
    assert_int_equal(tkd_tokens_check_vocab(ds, 204), TKD_ERR_MISMATCH); /* 5000 comes before 204 */
    tkd_tokens_free(ds);

    /* a list, in the order given (not sorted) */
    const char *list[2] = {tmp_path("shards/s3.bin"), tmp_path("shards/s1.bin")};
    assert_int_equal(tkd_tokens_open_list(list, 2, &ds), TKD_OK);
    assert_int_equal(tkd_tokens_count(ds), 15);
    assert_int_equal(tkd_tokens_data(ds)[0], 200);
    assert_int_equal(tkd_tokens_data(ds)[5], 0);
    tkd_tokens_free(ds);

    /* negative ids are refused by the vocabulary check */
    int64_t neg[3] = {1, -7, 2};
    assert_int_equal(tkd_tokens_open(write_npy("neg.npy", "<i4", "(3,)", 1, neg, 3), &ds), TKD_OK);
    assert_int_equal(tkd_tokens_check_vocab(ds, 10), TKD_ERR_MISMATCH);
    tkd_test_assert_msg_has("neg.npy: token offset 1: id -7");
    tkd_tokens_free(ds);

    snprintf(pattern, sizeof pattern, "%s/*.nothing", sub);
    assert_int_equal(tkd_tokens_open(pattern, &ds), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("*.nothing: the glob matches no files");
    assert_int_equal(tkd_tokens_open(tmp_path("absent.bin"), &ds), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("absent.bin: cannot open");
    assert_int_equal(tkd_tokens_open(tmp_path("shards/s0_empty.bin"), &ds), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("s0_empty.bin: the dataset holds no tokens");
    assert_null(ds);
}

/* Checks window count and contents against the definition, for many shapes. */
static void check_windows(const tkd_tokens *ds, int L, int stride, int pad)
{
    int64_t n = tkd_tokens_count(ds);
    const int32_t *d = tkd_tokens_data(ds);
    int64_t nw = tkd_tokens_num_windows(ds, L, stride, pad);
    int32_t tok[40], lab[40];
    char *covered = calloc((size_t)n, 1);
    for (int64_t i = 0; i < nw; i++) {
        int valid = -1;
        assert_int_equal(tkd_tokens_window(ds, L, stride, pad, i, tok, lab, &valid), TKD_OK);
        int64_t s = i * stride;
        int real = 0;
        for (int j = 0; j <= L; j++)
            assert_int_equal(tok[j], s + j < n ? d[s + j] : 0);
        for (int j = 0; j < L; j++) {
            if (s + j + 1 < n) {
                assert_int_equal(lab[j], d[s + j + 1]);
                covered[s + j + 1] = 1;
                real++;
            } else {
                assert_int_equal(lab[j], TKD_TOKENS_IGNORE_LABEL);
            }
        }
        assert_int_equal(valid, real);
        if (!pad)
            assert_int_equal(valid, L); /* drop mode: only whole windows */
        assert_true(valid > 0);
    }
    if (pad) /* every token after the first is a label somewhere, when windows overlap or touch */
        for (int64_t p = 1; p < n && stride <= L; p++)
            assert_true(covered[p]);
    if (!pad) /* one more window would not fit */
        assert_true(nw * stride + L + 1 > n);
    free(covered);
    assert_int_equal(tkd_tokens_window(ds, L, stride, pad, nw, tok, lab, NULL), TKD_ERR_INVALID_ARG);
}

static void test_windows(void **state)
{
    (void)state;
    int64_t t[37];
    seq(t, 37, 1, 1);
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(write_bin("w.bin", TKD_TOKENS_MAGIC_U16, t, 10), &ds), TKD_OK);
    /* the worked example from the docs: 10 tokens, seq_len 4, stride 4 */
    assert_int_equal(tkd_tokens_num_windows(ds, 4, 4, 0), 2);
    assert_int_equal(tkd_tokens_num_windows(ds, 4, 4, 1), 3);
    int32_t tok[5], lab[4];
    int valid;
    assert_int_equal(tkd_tokens_window(ds, 4, 4, 1, 2, tok, lab, &valid), TKD_OK);
    int32_t want_tok[5] = {9, 10, 0, 0, 0}, want_lab[4] = {10, -100, -100, -100};
    assert_memory_equal(tok, want_tok, sizeof tok);
    assert_memory_equal(lab, want_lab, sizeof lab);
    assert_int_equal(valid, 1);
    assert_int_equal(tkd_tokens_num_windows(ds, 9, 1, 0), 1);
    assert_int_equal(tkd_tokens_num_windows(ds, 10, 1, 0), 0);
    assert_int_equal(tkd_tokens_num_windows(ds, 10, 1, 1), 1);
    assert_int_equal(tkd_tokens_num_windows(ds, 4, 0, 0), 0);
    tkd_tokens_free(ds);

    for (int n = 1; n <= 37; n += 3) {
        assert_int_equal(tkd_tokens_open(write_bin("w.bin", TKD_TOKENS_MAGIC_U16, t, n), &ds), TKD_OK);
        for (int L = 1; L <= 9; L += 2)
            for (int stride = 1; stride <= 11; stride += 2)
                for (int pad = 0; pad < 2; pad++)
                    check_windows(ds, L, stride, pad);
        tkd_tokens_free(ds);
    }
}

static void test_sha256_identity(void **state)
{
    (void)state;
    int64_t t[10];
    seq(t, 10, 1, 1);
    tkd_tokens *a = NULL, *b = NULL;
    assert_int_equal(tkd_tokens_open(write_bin("h.bin", TKD_TOKENS_MAGIC_U16, t, 10), &a), TKD_OK);
    const char *parts[2] = {write_npy("h1.npy", "<i8", "(4,)", 1, t, 4),
                            write_bin("h2.bin", TKD_TOKENS_MAGIC_U32, t + 4, 6)};
    assert_int_equal(tkd_tokens_open_list(parts, 2, &b), TKD_OK);
    char ha[65], hb[65];
    tkd_tokens_sha256(a, ha);
    tkd_tokens_sha256(b, hb);
    /* python3: hashlib.sha256(struct.pack('<10i', *range(1, 11))).hexdigest() */
    assert_string_equal(ha, "272bc3456b7ce85de2ce18d1964316879e840a1201a4664e967ef42ba3f76b96");
    assert_string_equal(hb, ha); /* same tokens, other files and formats: same identity */
    tkd_tokens_free(a);
    tkd_tokens_free(b);
}

/* Every header llm.c's write_datafile writes, and topkd's former uint32 header. */
static void test_llmc_headers(void **state)
{
    (void)state;
    tkd_tokens *ds = NULL;
    /* GPT-2: EOT 50256 before each document, ids up to 50256 (uint16) */
    int64_t gpt2[6] = {50256, 15496, 995, 50256, 40, 65535};
    assert_int_equal(tkd_tokens_open(write_llmc("gpt2.bin", 20240520, 1, gpt2, 6), &ds), TKD_OK);
    assert_stream(ds, gpt2, 6);
    tkd_tokens_free(ds);

    /* Llama 3: magic 20240801 version 7, uint32; <|begin_of_text|> 128000 starts each document */
    int64_t llama3[7] = {128000, 9906, 1917, 128000, 128255, 70000, 2147483647};
    assert_int_equal(tkd_tokens_open(write_llmc("llama3.bin", 20240801, 7, llama3, 7), &ds), TKD_OK);
    assert_stream(ds, llama3, 7);
    assert_int_equal(tkd_tokens_check_vocab(ds, 128256), TKD_ERR_MISMATCH); /* 2^31 - 1 is no Llama 3 id */
    tkd_test_assert_msg_has("llama3.bin: token offset 6: id 2147483647 is outside the vocabulary [0, 128256)");
    tkd_tokens_free(ds);

    /* version 2: what topkd asked for before it read llm.c's own files; still read */
    assert_int_equal(tkd_tokens_open(write_llmc("former.bin", 20240801, 2, llama3, 5), &ds), TKD_OK);
    assert_stream(ds, llama3, 5);
    tkd_tokens_free(ds);

    /* a uint32 token past int32 */
    llama3[2] = 2147483648;
    assert_int_equal(tkd_tokens_open(write_llmc("llama3_big.bin", 20240801, 7, llama3, 7), &ds), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("llama3_big.bin: token 2147483648 at token offset 2 does not fit in int32");
    assert_null(ds);
    assert_int_equal(tkd_tokens_open(write_llmc("v1_u32.bin", 20240801, 1, llama3, 2), &ds), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("version 1 does not go with magic 20240801 (expected 7, or topkd's former 2)");
}

static tkd_status open_broken(const char *path)
{
    tkd_tokens *ds = NULL;
    tkd_status st = tkd_tokens_open(path, &ds);
    assert_null(ds);
    return st;
}

static void test_broken_files(void **state)
{
    (void)state;
    assert_true(tkd_test_broken_files("tok_", open_broken) >= 16);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bin_u16_u32),
        cmocka_unit_test(test_llmc_headers),
        cmocka_unit_test(test_npy_dtypes_and_2d),
        cmocka_unit_test(test_list_glob_locate_vocab),
        cmocka_unit_test(test_windows),
        cmocka_unit_test(test_sha256_identity),
        cmocka_unit_test(test_broken_files),
    };
    return cmocka_run_group_tests(tests, tkd_test_group_dir_setup, tkd_test_group_dir_teardown);
}
