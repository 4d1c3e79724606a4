/* test_common_sha256.c — FIPS 180 test vectors, streaming in odd pieces, files. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/sha256.h"
#include "tests/testutil.h"

static const char *hex_of(const void *data, size_t len)
{
    static char hex[TKD_SHA256_HEX_LEN];
    uint8_t d[TKD_SHA256_BYTES];
    tkd_sha256_buffer(data, len, d);
    tkd_sha256_hex(d, hex);
    return hex;
}

static const char *const TWO_BLOCK = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
static const char *const TWO_BLOCK_HEX =
    "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1";
static const char *const MILLION_A_HEX =
    "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";

static void test_fips_vectors(void **state)
{
    (void)state;
    assert_string_equal(hex_of("abc", 3),
                        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    assert_string_equal(hex_of("", 0),
                        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    assert_string_equal(hex_of(TWO_BLOCK, strlen(TWO_BLOCK)), TWO_BLOCK_HEX); /* 448 bits */
    char *a = malloc(1000000);
    memset(a, 'a', 1000000);
    assert_string_equal(hex_of(a, 1000000), MILLION_A_HEX);
    free(a);
}

static void test_streaming_pieces(void **state)
{
    (void)state;
    /* the 56-byte message fed in pieces of every size 1..57 gives the same digest */
    for (size_t piece = 1; piece <= 57; piece++) {
        tkd_sha256 c;
        uint8_t d[TKD_SHA256_BYTES];
        char hex[TKD_SHA256_HEX_LEN];
        tkd_sha256_init(&c);
        size_t len = strlen(TWO_BLOCK);
        for (size_t off = 0; off < len; off += piece)
            tkd_sha256_update(&c, TWO_BLOCK + off, len - off < piece ? len - off : piece);
        tkd_sha256_final(&c, d);
        tkd_sha256_hex(d, hex);
        assert_string_equal(hex, TWO_BLOCK_HEX);
    }
    /* a million 'a' in 1000 pieces of 1000 */
    tkd_sha256 c;
    uint8_t d[TKD_SHA256_BYTES];
    char hex[TKD_SHA256_HEX_LEN], a[1000];
    memset(a, 'a', sizeof a);
    tkd_sha256_init(&c);
    for (int i = 0; i < 1000; i++)
        tkd_sha256_update(&c, a, sizeof a);
    tkd_sha256_final(&c, d);
    tkd_sha256_hex(d, hex);
    assert_string_equal(hex, MILLION_A_HEX);
}

static void test_file(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("sha256");
    char path[4200];
    snprintf(path, sizeof path, "%s/m", dir);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    for (int i = 0; i < 1000000; i++)
        fputc('a', fp);
    fclose(fp);
    char hex[TKD_SHA256_HEX_LEN];
    assert_int_equal(tkd_sha256_file_hex(path, hex), TKD_OK);
    assert_string_equal(hex, MILLION_A_HEX);
    snprintf(path, sizeof path, "%s/missing", dir);
    assert_int_equal(tkd_sha256_file_hex(path, hex), TKD_ERR_NOT_FOUND);
    assert_non_null(strstr(tkd_error_msg(), path));
    tkd_test_rmdtemp(dir);
}

/* Random files of awkward lengths (around the 64-byte block and the 55/56-byte padding edge, and a
 * few MB) against coreutils' sha256sum, an independent implementation: whichever block function
 * this machine runs (SHA extensions or scalar) must agree with it. Run once more with
 * TKD_SHA256_SCALAR=1 by the ctest entry test_common_sha256_scalar, so both paths are checked. */
static void test_random_files_vs_sha256sum(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("sha256r");
    const size_t sizes[] = {0, 1, 55, 56, 63, 64, 65, 119, 120, 127, 128, 1000, 65537, 3000001};
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        char path[4200], cmd[8600], want[TKD_SHA256_HEX_LEN] = {0}, hex[TKD_SHA256_HEX_LEN];
        snprintf(path, sizeof path, "%s/r%zu", dir, i);
        FILE *fp = fopen(path, "wb");
        assert_non_null(fp);
        for (size_t j = 0; j < sizes[i]; j++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            fputc((int)(x & 0xff), fp);
        }
        fclose(fp);
        snprintf(cmd, sizeof cmd, "sha256sum '%s'", path);
        FILE *p = popen(cmd, "r");
        assert_non_null(p);
        assert_int_equal(fread(want, 1, 64, p), 64);
        pclose(p);
        assert_int_equal(tkd_sha256_file_hex(path, hex), TKD_OK);
        if (strcmp(hex, want) != 0)
            fail_msg("%zu bytes: ours %s, sha256sum %s", sizes[i], hex, want);
    }
    tkd_test_rmdtemp(dir);
}

TKD_TEST_MAIN(test_fips_vectors, test_streaming_pieces, test_file, test_random_files_vs_sha256sum)
