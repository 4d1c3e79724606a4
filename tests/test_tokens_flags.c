/* test_tokens_flags.c — the per-token flags sidecar (F.flags.npy, PREFIX.flags.npy; tokens.h):
 * reading it over a list of files, the documents it records, windows whose untrained labels are -100,
 * and the files refused (a list with flags for some files only, a length that differs from the
 * token file's, reserved bits, another dtype). */
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

#include "tests/tokens_testutil.h"

/* The sidecar of token file `of` (a path, or a Megatron prefix): n bytes of flags. */
static void write_flags(const char *of, const uint8_t *flags, int n)
{
    char name[4200], shape[32];
    const char *base = strrchr(of, '/');
    snprintf(name, sizeof name, "%s.flags.npy", base ? base + 1 : of);
    snprintf(shape, sizeof shape, "(%d,)", n);
    int64_t v[64];
    assert_true(n <= 64);
    for (int i = 0; i < n; i++)
        v[i] = flags[i];
    write_npy(name, "|u1", shape, 1, v, n);
}

static void seq(int64_t *t, int n, int64_t base)
{
    for (int i = 0; i < n; i++)
        t[i] = base + i;
}

/* Two documents per file: D = doc start, T = trained, DT both. The stream (tokens 1..12):
 *   a.bin  1:D 2 3:T 4:T 5:D 6 7:T       b.npy  8:DT 9 10:T 11 12:T */
enum { D = TKD_TOKENS_FLAG_DOC_START, T = TKD_TOKENS_FLAG_TRAINED };
static const uint8_t FLAGS_A[7] = {D, 0, T, T, D, 0, T};
static const uint8_t FLAGS_B[5] = {D | T, 0, T, 0, T};

static tkd_tokens *open_two(void)
{
    int64_t t[12];
    seq(t, 12, 1);
    const char *specs[2] = {write_bin("a.bin", TKD_TOKENS_MAGIC_U32, t, 7), write_npy("b.npy", "<i4", "(5,)", 1, t + 7, 5)};
    write_flags(specs[0], FLAGS_A, 7);
    write_flags(specs[1], FLAGS_B, 5);
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open_list(specs, 2, &ds), TKD_OK);
    return ds;
}

static void test_flags_read_and_documents(void **state)
{
    (void)state;
    tkd_tokens *ds = open_two();
    assert_true(tkd_tokens_has_flags(ds));
    assert_int_equal(tkd_tokens_num_trained(ds), 6);
    uint8_t got[12], want[12];
    memcpy(want, FLAGS_A, 7);
    memcpy(want + 7, FLAGS_B, 5);
    assert_int_equal(tkd_tokens_read_flags(ds, 0, 12, got), TKD_OK);
    assert_memory_equal(got, want, 12);
    assert_int_equal(tkd_tokens_read_flags(ds, 5, 4, got), TKD_OK); /* across the two files */
    assert_memory_equal(got, want + 5, 4);
    tkd_test_expect_error(tkd_tokens_read_flags(ds, 10, 3, got), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("flags [10, 10 + 3)", "stream of 12"));
    assert_int_equal(tkd_tokens_num_docs(ds), 3);
    assert_int_equal(tkd_tokens_doc_start(ds, 0), 0);
    assert_int_equal(tkd_tokens_doc_start(ds, 1), 4);
    assert_int_equal(tkd_tokens_doc_start(ds, 2), 7);
    assert_int_equal(tkd_tokens_doc_start(ds, 3), -1);
    char line[160];
    assert_true(tkd_tokens_trained_summary(ds, line, sizeof line) > 0);
    assert_string_equal(line, "flags: 6 of 12 tokens are trained targets (50.0 %), 3 documents");
    /* a message about a token names the document the flags record */
    tkd_test_expect_error(tkd_tokens_check_vocab(ds, 6), TKD_ERR_MISMATCH,
                          TKD_TEST_FRAGS("a.bin: token offset 5 (document 1): id 6"));
    tkd_tokens_free(ds);
}

/* Label j of a window is token start + j + 1, kept only when that token's bit 0 is set. */
static void test_flags_mask_window_labels(void **state)
{
    (void)state;
    tkd_tokens *ds = open_two();
    int32_t tok[6], lab[5];
    int valid = -1;
    /* window 1 of seq_len 5, stride 5: tokens 6..11, labels are tokens 7..11 = flags T, DT, 0, T, 0 */
    assert_int_equal(tkd_tokens_window(ds, 5, 5, 1, 1, tok, lab, &valid), TKD_OK);
    int32_t want_tok[6] = {6, 7, 8, 9, 10, 11}, want_lab[5] = {7, 8, -100, 10, -100};
    assert_memory_equal(tok, want_tok, sizeof tok);
    assert_memory_equal(lab, want_lab, sizeof lab);
    assert_int_equal(valid, 3);
    /* the padded last window: token 12 is trained, the padding stays -100 */
    assert_int_equal(tkd_tokens_window(ds, 5, 5, 1, 2, tok, lab, &valid), TKD_OK);
    int32_t want_tok2[6] = {11, 12, 0, 0, 0, 0}, want_lab2[5] = {12, -100, -100, -100, -100};
    assert_memory_equal(tok, want_tok2, sizeof tok);
    assert_memory_equal(lab, want_lab2, sizeof lab);
    assert_int_equal(valid, 1);
    /* every window of every shape: labels are the trained targets exactly */
    for (int L = 1; L <= 6; L++)
        for (int stride = 1; stride <= 4; stride++) {
            int64_t nw = tkd_tokens_num_windows(ds, L, stride, 1);
            for (int64_t i = 0; i < nw; i++) {
                int32_t tk[7], lb[6];
                assert_int_equal(tkd_tokens_window(ds, L, stride, 1, i, tk, lb, &valid), TKD_OK);
                int n = 0;
                for (int j = 0; j < L; j++) {
                    int64_t g = i * stride + j + 1; /* the label's token */
                    uint8_t f = g < 7 ? FLAGS_A[g] : g < 12 ? FLAGS_B[g - 7] : 0;
                    assert_int_equal(lb[j], g < 12 && (f & T) ? (int32_t)(g + 1) : -100);
                    n += lb[j] != -100;
                }
                assert_int_equal(valid, n);
            }
        }
    tkd_tokens_free(ds);
}

/* A Megatron dataset's PREFIX.flags.npy: its document starts replace the index's. */
static void test_flags_megatron(void **state)
{
    (void)state;
    int64_t t[6];
    seq(t, 6, 10);
    int sizes[2] = {4, 2};
    int64_t docs[3] = {0, 1, 2};
    const char *prefix = write_megatron("mm", 4, t, sizes, 2, docs, 3);
    const uint8_t f[6] = {D, T, T, D | T, 0, T};
    write_flags(prefix, f, 6);
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(prefix, &ds), TKD_OK);
    assert_true(tkd_tokens_has_flags(ds));
    assert_int_equal(tkd_tokens_num_trained(ds), 4);
    assert_int_equal(tkd_tokens_num_docs(ds), 2);
    assert_int_equal(tkd_tokens_doc_start(ds, 1), 3); /* the flags' start, not the index's 4 */
    tkd_tokens_free(ds);
}

/* A glob that matches a sidecar too ("g_*" takes g_x.bin.flags.npy) reads it as the sidecar only. */
static void test_glob_skips_sidecars(void **state)
{
    (void)state;
    int64_t t[4] = {1, 2, 3, 4};
    const uint8_t f[4] = {D, T, 0, T};
    write_flags(write_bin("g_x.bin", TKD_TOKENS_MAGIC_U16, t, 4), f, 4);
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(tmp_path("g_*"), &ds), TKD_OK);
    assert_int_equal(tkd_tokens_num_files(ds), 1);
    assert_int_equal(tkd_tokens_num_trained(ds), 2);
    tkd_tokens_free(ds);
}

/* Without a sidecar nothing changes: no flags, labels are every next token. */
static void test_no_flags_unchanged(void **state)
{
    (void)state;
    int64_t t[5];
    seq(t, 5, 1);
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(write_bin("plain.bin", TKD_TOKENS_MAGIC_U16, t, 5), &ds), TKD_OK);
    assert_false(tkd_tokens_has_flags(ds));
    assert_int_equal(tkd_tokens_num_trained(ds), -1);
    char line[64] = "x";
    assert_int_equal(tkd_tokens_trained_summary(ds, line, sizeof line), 0);
    assert_int_equal(tkd_tokens_num_docs(ds), 0);
    int32_t tok[5], lab[4];
    int valid;
    assert_int_equal(tkd_tokens_window(ds, 4, 4, 0, 0, tok, lab, &valid), TKD_OK);
    int32_t want[4] = {2, 3, 4, 5};
    assert_memory_equal(lab, want, sizeof lab);
    assert_int_equal(valid, 4);
    uint8_t fl[2];
    tkd_test_expect_error(tkd_tokens_read_flags(ds, 0, 2, fl), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("plain.bin: the token files have no flags sidecar"));
    tkd_tokens_free(ds);
}

static void expect_open_error(const char *const *specs, int n, tkd_status want, const char *const *frags)
{
    tkd_tokens *ds = NULL;
    tkd_test_expect_error(tkd_tokens_open_list(specs, n, &ds), want, frags);
    assert_null(ds);
}

static void test_flags_refused(void **state)
{
    (void)state;
    int64_t t[6];
    seq(t, 6, 1);
    const char *with = write_bin("with.bin", TKD_TOKENS_MAGIC_U16, t, 3);
    write_flags(with, FLAGS_A, 3);
    const char *without = write_bin("without.bin", TKD_TOKENS_MAGIC_U16, t, 3);
    const char *mixed[2] = {with, without};
    expect_open_error(mixed, 2, TKD_ERR_MISMATCH,
                      TKD_TEST_FRAGS("without.bin has no flags sidecar, but", "with.bin has one",
                                     "with.bin.flags.npy", "for every file or for none"));
    const char *mixed2[2] = {without, with};
    expect_open_error(mixed2, 2, TKD_ERR_MISMATCH, TKD_TEST_FRAGS("without.bin has no flags sidecar"));

    const char *len = write_bin("len.bin", TKD_TOKENS_MAGIC_U16, t, 6);
    write_flags(len, FLAGS_A, 5);
    expect_open_error(&len, 1, TKD_ERR_MISMATCH,
                      TKD_TEST_FRAGS("len.bin.flags.npy: 5 flags", "len.bin holds 6 tokens"));

    const char *bits = write_bin("bits.bin", TKD_TOKENS_MAGIC_U16, t, 3);
    const uint8_t bad[3] = {T, 4 | T, 0};
    write_flags(bits, bad, 3);
    expect_open_error(&bits, 1, TKD_ERR_FORMAT,
                      TKD_TEST_FRAGS("bits.bin.flags.npy: byte 1 is 0x05", "bits 2-7 are reserved"));

    const char *dtype = write_bin("dtype.bin", TKD_TOKENS_MAGIC_U16, t, 3);
    write_npy("dtype.bin.flags.npy", "<i4", "(3,)", 1, t, 3);
    expect_open_error(&dtype, 1, TKD_ERR_UNSUPPORTED,
                      TKD_TEST_FRAGS("dtype.bin.flags.npy: npy dtype '<i4' is not supported for a flags sidecar"));

    const char *twod = write_bin("twod.bin", TKD_TOKENS_MAGIC_U16, t, 4);
    write_npy("twod.bin.flags.npy", "|u1", "(2, 2)", 1, t, 4);
    expect_open_error(&twod, 1, TKD_ERR_UNSUPPORTED, TKD_TEST_FRAGS("twod.bin.flags.npy", "a flags sidecar is 1-D"));
}

TKD_TEST_MAIN_WITH(tkd_test_group_dir_setup, tkd_test_group_dir_teardown, TKD_TEST_EACH_NONE,
                   test_flags_read_and_documents, test_flags_mask_window_labels, test_flags_megatron,
                   test_glob_skips_sidecars, test_no_flags_unchanged, test_flags_refused)
