/* test_demo_data.c — the committed demo token files (data/brown-*.bin) are well formed.
 *
 * They are made by scripts/make_demo_data.py (see data/README.md): llm.c-style files with a
 * 256 x int32 little-endian header (magic 20240520, version 1, token count) and uint16 tokens of a
 * 4096-token GPT-2 BPE vocabulary. Read raw here so the test depends on no other module. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEMO_MAGIC 20240520
#define DEMO_VERSION 1
#define DEMO_HEADER_INTS 256
#define DEMO_VOCAB 4096
#define DEMO_NEWLINE 198 /* GPT-2 "\n"; the text "\n\n" before a word encodes as 198 198 */

typedef struct {
    uint16_t *tok; // (n,)
    size_t n;
} demo_tokens;

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Reads data/<name> whole and checks its header against its size; the caller frees out->tok. */
static void demo_read(const char *name, demo_tokens *out)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/data/%s", TKD_SOURCE_DIR, name);
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("%s: cannot open (run scripts/make_demo_data.py, see data/README.md)", path);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long size = ftell(f);
    assert_true(size >= DEMO_HEADER_INTS * 4);
    rewind(f);
    unsigned char *buf = malloc((size_t)size);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)size, f), (size_t)size);
    fclose(f);

    assert_int_equal(le32(buf), DEMO_MAGIC);
    assert_int_equal(le32(buf + 4), DEMO_VERSION);
    for (int i = 3; i < DEMO_HEADER_INTS; i++)
        assert_int_equal(le32(buf + 4 * i), 0); /* reserved words stay zero */
    size_t n = le32(buf + 8);
    assert_int_equal((size_t)size, DEMO_HEADER_INTS * 4 + 2 * n);

    out->n = n;
    out->tok = malloc(n * sizeof *out->tok);
    assert_non_null(out->tok);
    const unsigned char *p = buf + DEMO_HEADER_INTS * 4;
    for (size_t i = 0; i < n; i++)
        out->tok[i] = (uint16_t)(p[2 * i] | p[2 * i + 1] << 8);
    free(buf);
}

/* Checks every id is in the vocabulary; returns the number of distinct ids and counts the
 * document boundaries (the separator "\n\n" never occurs inside a document). */
static size_t demo_scan(const demo_tokens *t, size_t *boundaries)
{
    static unsigned char seen[DEMO_VOCAB];
    memset(seen, 0, sizeof seen);
    size_t distinct = 0;
    *boundaries = 0;
    for (size_t i = 0; i < t->n; i++) {
        if (t->tok[i] >= DEMO_VOCAB)
            fail_msg("token %zu is %u, outside the %d-token vocabulary", i, t->tok[i], DEMO_VOCAB);
        distinct += !seen[t->tok[i]];
        seen[t->tok[i]] = 1;
        if (i > 0 && t->tok[i] == DEMO_NEWLINE && t->tok[i - 1] == DEMO_NEWLINE)
            (*boundaries)++;
    }
    return distinct;
}

static void test_train_file(void **state)
{
    (void)state;
    demo_tokens t;
    size_t boundaries;
    demo_read("brown-train.bin", &t);
    assert_in_range(t.n, 1500000, 1800000); /* ~1.64 M tokens, see data/README.md */
    size_t distinct = demo_scan(&t, &boundaries);
    assert_true(distinct >= 3500); /* a real BPE vocabulary, nearly all of it used */
    assert_int_equal(boundaries, 475 - 1); /* 475 training documents */
    free(t.tok);
}

static void test_val_file(void **state)
{
    (void)state;
    demo_tokens t;
    size_t boundaries;
    demo_read("brown-val.bin", &t);
    assert_in_range(t.n, 60000, 120000); /* ~85 k tokens, ~5 % of the corpus */
    demo_scan(&t, &boundaries);
    assert_int_equal(boundaries, 25 - 1); /* documents 0, 20, ..., 480 */
    /* Brown ca01 begins "The Fulton County Grand Jury said Friday"; ids from
     * `scripts/make_demo_data.py --encode` (GPT-2's own ids: 464 = "The", 531 = " said"). */
    static const uint16_t first[] = {464, 376, 586, 261, 3418, 1902, 392, 449, 1601, 531, 3217};
    for (size_t i = 0; i < sizeof first / sizeof first[0]; i++)
        assert_int_equal(t.tok[i], first[i]);
    free(t.tok);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_train_file),
        cmocka_unit_test(test_val_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
