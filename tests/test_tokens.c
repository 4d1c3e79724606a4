/* test_tokens.c — llm.c .bin (every header llm.c writes), .npy and Megatron-LM indexed datasets,
 * lists and globs, documents, vocabulary check, windows, and every broken token file under
 * tests/data/broken/ giving its own error. The files are written here byte by byte from the
 * formats' layouts (docs/data-formats.md). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/signals.h"
#include "common/status.h"
#include "formats/doc_pack.h"
#include "formats/tokens.h"
#include "tests/testutil.h"

#include "tests/tokens_testutil.h"

/* An empty directory name under the group's temp dir (made afresh); its path goes to out. */
static void fresh_subdir(const char *name, char *out, size_t cap)
{
    snprintf(out, cap, "%s/%s", tkd_test_group_dir, name);
    assert_int_equal(tkd_test_rmtree(out), 0);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", out);
    assert_int_equal(system(cmd), 0);
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
    fresh_subdir("shards", sub, sizeof sub);
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
    assert_int_equal(tkd_tokens_sha256(a, ha), TKD_OK);
    assert_int_equal(tkd_tokens_sha256(b, hb), TKD_OK);
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

/* tokens[j] of the document layout used below: sequences of 3, 2, 4, 0 and 1 tokens; documents
 * {seq 0, 1}, {} (empty), {seq 2, 3 (empty)}, {seq 4}. */
static const int MM_SIZES[5] = {3, 2, 4, 0, 1};
static const int64_t MM_DOCS[5] = {0, 2, 2, 4, 5};

static void check_mm_docs(const tkd_tokens *ds, int64_t doc0, int64_t first)
{
    int64_t want[4] = {0, 5, 5, 9}; /* the empty document starts where the next one does */
    for (int d = 0; d < 4; d++)
        assert_int_equal(tkd_tokens_doc_start(ds, doc0 + d), first + want[d]);
}

/* Each integer dtype Megatron writes, opened by prefix, .idx and .bin: the same stream, documents
 * and identity as an llm.c file of those tokens. */
static void test_megatron_dtypes(void **state)
{
    (void)state;
    static const struct { int code; int64_t base, step; } dt[] = {
        {8, 65000, 53}, {4, 100000, 12345}, {5, 7, 1 << 20}, {1, 250, 1}, {2, -5, 13}, {3, -300, 3000},
    };
    int64_t t[10];
    for (size_t k = 0; k < sizeof dt / sizeof dt[0]; k++) {
        seq(t, 10, dt[k].base, dt[k].step);
        if (dt[k].code == 1 || dt[k].code == 8)
            for (int i = 0; i < 10; i++)
                t[i] %= dt[k].code == 1 ? 256 : 65536;
        char name[32];
        snprintf(name, sizeof name, "mm_code%d", dt[k].code);
        const char *prefix = write_megatron(name, dt[k].code, t, MM_SIZES, 5, MM_DOCS, 5);
        char by_idx[4200], by_bin[4200];
        snprintf(by_idx, sizeof by_idx, "%s.idx", prefix);
        snprintf(by_bin, sizeof by_bin, "%s.bin", prefix);
        const char *names[3] = {prefix, by_idx, by_bin};
        for (int w = 0; w < 3; w++) {
            tkd_tokens *ds = NULL;
            assert_int_equal(tkd_tokens_open(names[w], &ds), TKD_OK);
            assert_stream(ds, t, 10);
            assert_int_equal(tkd_tokens_num_files(ds), 1);
            assert_string_equal(tkd_tokens_file(ds, 0, NULL, NULL), by_bin);
            assert_int_equal(tkd_tokens_num_docs(ds), 4);
            check_mm_docs(ds, 0, 0);
            assert_int_equal(tkd_tokens_doc_start(ds, 4), -1);
            assert_int_equal(tkd_tokens_doc_start(ds, -1), -1);
            tkd_tokens_free(ds);
        }
    }
    /* the same tokens as an llm.c file: same identity and windows */
    tkd_tokens *mm = NULL, *lc = NULL;
    seq(t, 10, 65000, 53);
    for (int i = 0; i < 10; i++)
        t[i] %= 65536;
    assert_int_equal(tkd_tokens_open(tmp_path("mm_code8"), &mm), TKD_OK);
    assert_int_equal(tkd_tokens_open(write_bin("mm_same.bin", TKD_TOKENS_MAGIC_U16, t, 10), &lc), TKD_OK);
    char hm[65], hl[65];
    assert_int_equal(tkd_tokens_sha256(mm, hm), TKD_OK);
    assert_int_equal(tkd_tokens_sha256(lc, hl), TKD_OK);
    assert_string_equal(hm, hl);
    assert_int_equal(tkd_tokens_num_docs(lc), 0); /* llm.c files record no documents */
    for (int64_t i = 0; i < tkd_tokens_num_windows(lc, 3, 2, 1); i++) {
        int32_t a[4], b[4], la[3], lb[3];
        assert_int_equal(tkd_tokens_window(mm, 3, 2, 1, i, a, la, NULL), TKD_OK);
        assert_int_equal(tkd_tokens_window(lc, 3, 2, 1, i, b, lb, NULL), TKD_OK);
        assert_memory_equal(a, b, sizeof a);
        assert_memory_equal(la, lb, sizeof la);
    }
    tkd_tokens_free(mm);
    tkd_tokens_free(lc);
}

/* Megatron datasets among other files: a glob takes each dataset once, documents are numbered
 * across files, and a bad id names its document. */
static void test_megatron_mixed(void **state)
{
    (void)state;
    char sub[4096], cmd[4200];
    fresh_subdir("mixed", sub, sizeof sub);
    int64_t a[10], b[4], c[10];
    seq(a, 10, 0, 1);
    seq(b, 4, 100, 1);
    seq(c, 10, 200, 1);
    c[6] = 999; /* in c's document 2 (tokens 5..8) */
    write_megatron("mixed/a", 4, a, MM_SIZES, 5, MM_DOCS, 5);
    write_bin("mixed/b.bin", TKD_TOKENS_MAGIC_U32, b, 4);
    write_megatron("mixed/c", 8, c, MM_SIZES, 5, MM_DOCS, 5);
    write_megatron("mixed/a.d", 4, a, MM_SIZES, 5, MM_DOCS, 5); /* sorts between a.bin and a.idx */
    write_bin("mixed/d.bin", TKD_TOKENS_MAGIC_U16, b, 2);
    write_bytes(tmp_path("mixed/d.notes"), (const uint8_t *)"x", 1);

    tkd_tokens *ds = NULL;
    char pattern[4200];
    snprintf(pattern, sizeof pattern, "%s/*.*", sub); /* a.bin a.d.bin a.d.idx a.idx b.bin c.bin ... d.notes */
    assert_int_equal(tkd_tokens_open(pattern, &ds), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("d.notes: ");
    snprintf(pattern, sizeof pattern, "%s/[abc].*", sub); /* each dataset once, where its .bin sorts */
    assert_int_equal(tkd_tokens_open(pattern, &ds), TKD_OK);
    assert_int_equal(tkd_tokens_num_files(ds), 4);
    assert_non_null(strstr(tkd_tokens_file(ds, 1, NULL, NULL), "mixed/a.d.bin"));
    assert_int_equal(tkd_tokens_count(ds), 34);
    assert_int_equal(tkd_tokens_data(ds)[20], 100);
    assert_int_equal(tkd_tokens_data(ds)[24], 200);
    assert_int_equal(tkd_tokens_num_docs(ds), 12);
    check_mm_docs(ds, 0, 0);
    check_mm_docs(ds, 4, 10);
    check_mm_docs(ds, 8, 24);
    int64_t local;
    assert_non_null(strstr(tkd_tokens_locate(ds, 30, &local), "mixed/c.bin"));
    assert_int_equal(local, 6);
    assert_int_equal(tkd_tokens_check_vocab(ds, 999), TKD_ERR_MISMATCH);
    tkd_test_assert_msg_has("mixed/c.bin: token offset 6 (document 2): id 999 is outside the vocabulary");
    tkd_tokens_free(ds);

    /* only the indexes matched: each dataset where its .idx sorts */
    snprintf(pattern, sizeof pattern, "%s/*.idx", sub);
    assert_int_equal(tkd_tokens_open(pattern, &ds), TKD_OK);
    assert_int_equal(tkd_tokens_num_files(ds), 3);
    assert_non_null(strstr(tkd_tokens_file(ds, 2, NULL, NULL), "mixed/c.bin"));
    tkd_tokens_free(ds);

    /* the .bin of an llm.c file with a stray .idx beside it is still llm.c */
    write_bytes(tmp_path("mixed/d.idx"), (const uint8_t *)"not an index", 12);
    assert_int_equal(tkd_tokens_open(tmp_path("mixed/d.bin"), &ds), TKD_OK);
    assert_stream(ds, b, 2);
    tkd_tokens_free(ds);

    /* a list: the order given, Megatron prefixes and files together */
    char pc[4200];
    snprintf(pc, sizeof pc, "%s/c", sub);
    const char *list[2] = {tmp_path("mixed/b.bin"), pc};
    assert_int_equal(tkd_tokens_open_list(list, 2, &ds), TKD_OK);
    assert_int_equal(tkd_tokens_count(ds), 14);
    check_mm_docs(ds, 0, 4);
    tkd_tokens_free(ds);

    /* a prefix with no .idx is an absent file; an .idx with no .bin names both */
    snprintf(pc, sizeof pc, "%s/nothing", sub);
    assert_int_equal(tkd_tokens_open(pc, &ds), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("mixed/nothing: cannot open token file");
    snprintf(cmd, sizeof cmd, "rm '%s/c.bin'", sub);
    assert_int_equal(system(cmd), 0);
    snprintf(pc, sizeof pc, "%s/c", sub);
    assert_int_equal(tkd_tokens_open(pc, &ds), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("mixed/c.bin: cannot open the data file of Megatron index");
    tkd_test_assert_msg_has("mixed/c.idx");
    assert_null(ds);
}

/* The in-memory index parser: what it reports, and the .bin length it insists on. */
static void test_megatron_parse_memory(void **state)
{
    (void)state;
    int64_t t[10];
    seq(t, 10, 1, 1);
    char path[4200];
    snprintf(path, sizeof path, "%s.idx", write_megatron("mem", 3, t, MM_SIZES, 5, MM_DOCS, 5));
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    uint8_t idx[256];
    size_t n = fread(idx, 1, sizeof idx, f);
    fclose(f);
    assert_int_equal(n, 34 + 12 * 5 + 8 * 5);
    tkd_megatron_index mi;
    assert_int_equal(tkd_tokens_parse_megatron_index("m.idx", idx, n, "m.bin", TKD_MEGATRON_BIN_UNKNOWN, &mi), TKD_OK);
    assert_int_equal(mi.dtype_code, 3);
    assert_int_equal(mi.token_bytes, 2);
    assert_int_equal(mi.num_sequences, 5);
    assert_int_equal(mi.num_documents, 4);
    assert_int_equal(mi.num_tokens, 10);
    assert_int_equal(mi.data_bytes, 20);
    assert_ptr_equal(mi.sizes, idx + 34);
    assert_ptr_equal(mi.doc_idx, idx + 34 + 60);
    assert_int_equal(tkd_tokens_parse_megatron_index("m.idx", idx, n, "m.bin", 20, &mi), TKD_OK);
    assert_int_equal(tkd_tokens_parse_megatron_index("m.idx", idx, n, "m.bin", 22, &mi), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("m.bin: 22 bytes, but the sizes in m.idx add up to 10 tokens of 2 bytes (20 bytes)");
    assert_int_equal(tkd_tokens_parse_megatron_index("m.idx", idx, n - 1, "m.bin", 20, &mi), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("m.idx: sequence_count 5 and document_count 5 make a 134-byte index, but the file holds 133");
    /* one mode byte per sequence after the document indices: the multimodal layout */
    memset(idx + n, 0, 5);
    assert_int_equal(tkd_tokens_parse_megatron_index("m.idx", idx, n + 5, "m.bin", 20, &mi), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("m.idx: a multimodal index");
}

/* The files tests/write_token_files.py wrote by following llm.c's and Megatron's Python writers
 * (a second writer, independent of the C ones above). */
static void test_python_written_files(void **state)
{
    (void)state;
    static const int64_t gpt2[7] = {50256, 15496, 995, 50256, 464, 2068, 65535};
    static const int64_t llama3[8] = {128000, 9906, 1917, 128000, 791, 4062, 128255, 2147483647};
    static const int64_t mm16[6] = {15496, 995, 50256, 464, 2068, 50256};
    static const int64_t mm32[8] = {128000, 9906, 1917, 13, 128001, 791, 4062, 128001};
    static const struct { const char *name; const int64_t *tok; int n, ndocs; int64_t starts[3]; } f[] = {
        {"data/tokens/llmc_gpt2.bin", gpt2, 7, 0, {0}},
        {"data/tokens/llmc_llama3.bin", llama3, 8, 0, {0}},
        {"data/tokens/megatron_uint16", mm16, 6, 2, {0, 3}},
        {"data/tokens/megatron_int32", mm32, 8, 3, {0, 5, 5}}, /* the empty 2nd document starts at the 3rd */
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        tkd_tokens *ds = NULL;
        assert_int_equal(tkd_tokens_open(tkd_test_src(f[i].name), &ds), TKD_OK);
        assert_stream(ds, f[i].tok, f[i].n);
        assert_int_equal(tkd_tokens_num_docs(ds), f[i].ndocs);
        for (int d = 0; d < f[i].ndocs; d++)
            assert_int_equal(tkd_tokens_doc_start(ds, d), f[i].starts[d]);
        tkd_tokens_free(ds);
    }
}

/* tkd_tokens_read across files, and its range check. */
static void test_read_ranges(void **state)
{
    (void)state;
    int64_t t[12];
    seq(t, 12, 1, 1);
    const char *parts[3] = {write_bin("r1.bin", TKD_TOKENS_MAGIC_U16, t, 5), write_bin("r0.bin", TKD_TOKENS_MAGIC_U16, t, 0),
                            write_npy("r2.npy", "<i8", "(7,)", 1, t + 5, 7)};
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open_list(parts, 3, &ds), TKD_OK);
    int32_t out[12];
    for (int first = 0; first <= 12; first++)
        for (int n = 0; first + n <= 12; n++) {
            memset(out, 0x55, sizeof out);
            assert_int_equal(tkd_tokens_read(ds, first, n, out), TKD_OK);
            for (int j = 0; j < n; j++)
                assert_int_equal(out[j], t[first + j]);
            if (n < 12)
                assert_int_equal(out[n], 0x55555555); /* nothing written past n */
        }
    assert_int_equal(tkd_tokens_read(ds, 10, 3, out), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_tokens_read(ds, -1, 1, out), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_tokens_read(ds, 0, -1, out), TKD_ERR_INVALID_ARG);
    tkd_tokens_free(ds);
}

TKD_TEST_OPENER(open_broken, tkd_tokens, tkd_tokens_open)

static void test_broken_files(void **state)
{
    (void)state;
    assert_true(tkd_test_broken_files("tok_", open_broken) >= 47); /* 7 of them flags sidecars */
}

/* A token path that is a FIFO nobody writes to is refused at once (the open used to block
 * forever); in a child, so that a hang fails the test instead of stalling it. */
static void test_fifo_refused(void **state)
{
    (void)state;
    const char *fifo = tmp_path("tokens.fifo");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        tkd_tokens *ds = NULL;
        tkd_status st = tkd_tokens_open(fifo, &ds);
        _exit(st == TKD_ERR_IO && !ds && strstr(tkd_error_msg(), "tokens.fifo: token file is a FIFO") ? 0 : 1);
    }
    assert_int_equal(tkd_test_wait_timeout(pid, 10.0), 0);
}

/* Ctrl-C while a token file is being read ends the read with TKD_ERR_INTERRUPTED naming it. */
static void test_interrupt_ends_the_read(void **state)
{
    (void)state;
    int64_t t[10];
    seq(t, 10, 1, 1);
    const char *path = write_bin("int.bin", TKD_TOKENS_MAGIC_U16, t, 10);
    assert_int_equal(tkd_signals_install(), TKD_OK);
    raise(SIGINT); /* sets the flag only */
    tkd_tokens *ds = NULL;
    tkd_status st = tkd_tokens_open(path, &ds);
    tkd_signals_uninstall();
    assert_int_equal(st, TKD_ERR_INTERRUPTED);
    assert_null(ds);
    tkd_test_assert_msg_has("int.bin: interrupted by SIGINT while reading the token file");
}


/* data.packing: documents (formats/doc_pack.h) on a Megatron dataset whose documents are 3, 1, 7, 2
 * and 12 tokens, at T 5: pieces 3 | 1 | 5+2 | 2 | 5+5+2 packed greedily into 6 sequences, labels
 * never crossing a document, the pieces of a long document keeping their last label, padding and
 * the document starts; a file that records no documents is refused naming it. */
static void test_doc_pack(void **state)
{
    (void)state;
    static const int sizes[5] = {3, 1, 7, 2, 12};
    static const int64_t docs[6] = {0, 1, 2, 3, 4, 5};
    int64_t t[25];
    seq(t, 25, 100, 1); /* token g is 100 + g: a label names its source position */
    const char *prefix = write_megatron("packed", 4, t, sizes, 5, docs, 6);
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(prefix, &ds), TKD_OK);
    tkd_doc_pack *p = NULL;
    assert_int_equal(tkd_doc_pack_build(ds, 5, &p), TKD_OK);
    assert_int_equal(tkd_doc_pack_count(p), 6);
    assert_int_equal(tkd_doc_pack_docs(p), 5);
    assert_int_equal(tkd_doc_pack_labels(p), 2 + 0 + 6 + 1 + 11); /* n − 1 per document */
    enum { X = TKD_TOKENS_IGNORE_LABEL };
    static const int32_t want_tok[6][6] = {
        {100, 101, 102, 103, X, X}, {104, 105, 106, 107, 108, 109}, {109, 110, 111, 112, X, X},
        {113, 114, 115, 116, 117, 118}, {118, 119, 120, 121, 122, 123}, {123, 124, X, X, X, X}};
    static const int32_t want_lab[6][5] = {
        {101, 102, X, X, X}, {105, 106, 107, 108, 109}, {110, X, 112, X, X},
        {114, 115, 116, 117, 118}, {119, 120, 121, 122, 123}, {124, X, X, X, X}};
    static const int32_t want_doc[6][5] = {
        {0, 0, 0, 3, 4}, {0, 0, 0, 0, 0}, {0, 0, 2, 2, 4}, {0, 0, 0, 0, 0}, {0, 0, 0, 0, 0}, {0, 0, 2, 2, 2}};
    static const int want_valid[6] = {2, 5, 2, 5, 5, 1};
    for (int i = 0; i < 6; i++) {
        int32_t tok[6], lab[5], doc[5];
        int nv = -1;
        assert_int_equal(tkd_doc_pack_read(p, i, tok, lab, doc, &nv), TKD_OK);
        assert_memory_equal(tok, want_tok[i], sizeof tok);
        assert_memory_equal(lab, want_lab[i], sizeof lab);
        assert_memory_equal(doc, want_doc[i], sizeof doc);
        assert_int_equal(nv, want_valid[i]);
    }
    int32_t tok[6];
    assert_int_equal(tkd_doc_pack_read(p, 6, tok, NULL, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_doc_pack_free(p);
    tkd_tokens_free(ds);
    /* an llm.c file records no documents */
    const char *bin = write_bin("nodocs.bin", TKD_TOKENS_MAGIC_U16, t, 10);
    assert_int_equal(tkd_tokens_open(bin, &ds), TKD_OK);
    assert_int_equal(tkd_doc_pack_build(ds, 5, &p), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("data.packing: documents: ");
    tkd_test_assert_msg_has("nodocs.bin records no document boundaries");
    assert_null(p);
    tkd_tokens_free(ds);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fifo_refused),
        cmocka_unit_test(test_interrupt_ends_the_read),
        cmocka_unit_test(test_bin_u16_u32),
        cmocka_unit_test(test_llmc_headers),
        cmocka_unit_test(test_megatron_dtypes),
        cmocka_unit_test(test_megatron_mixed),
        cmocka_unit_test(test_megatron_parse_memory),
        cmocka_unit_test(test_python_written_files),
        cmocka_unit_test(test_read_ranges),
        cmocka_unit_test(test_npy_dtypes_and_2d),
        cmocka_unit_test(test_list_glob_locate_vocab),
        cmocka_unit_test(test_windows),
        cmocka_unit_test(test_sha256_identity),
        cmocka_unit_test(test_broken_files),
        cmocka_unit_test(test_doc_pack),
    };
    return cmocka_run_group_tests(tests, tkd_test_group_dir_setup, tkd_test_group_dir_teardown);
}
