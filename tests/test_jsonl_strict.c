/* test_jsonl_strict.c — JSON Lines records read as strictly as Python's json.loads reads them
 * (formats/text_docs: tkd_text_jsonl_field), and the one escape rule of a document separator
 * (tkd_text_unescape) shared by `tokenize --doc-separator` and the dump's data.doc_separator.
 *
 * Issue 20, item 4: cJSON read "\u0000" (and a raw NUL) as the end of the text, dropped a second
 * object on the line, accepted trailing junk, comments and a leading control byte, and took the
 * first of two "text" keys. Item 9: data.doc_separator kept "\n\n" literally where the flag
 * unescaped it, so one text gave two datasets. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/text_docs.h"
#include "formats/tokenizer.h"
#include "formats/tokens.h"
#include "teacher_cache/dump_config.h"
#include "teacher_cache/dump_text.h"
#include "teacher_cache/tokenize.h"
#include "tests/testutil.h"

#define QWEN3 TKD_BINARY_DIR "/fixtures/tokenizer/qwen3" /* unpacked by CMake */
#define QWEN3_EOS 151645                                 /* <|im_end|>, tokenizer_config.json's eos_token */

static const char *tmp(const char *name)
{
    return tkd_test_path(tkd_test_group_dir, name);
}

/* A record given by its bytes (it may hold a NUL), sizeof - 1 of a literal. */
#define REC(s) s, sizeof(s) - 1

static void write_bytes(const char *path, const char *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

/* The ids tokenize writes for `inputs` with opts o (tokenizer Qwen3, output .npy). */
static tkd_tokens *tokenize(tkd_tokenize_opts o, const char *out, const char **inputs, int n)
{
    o.tokenizer = QWEN3, o.output = out, o.inputs = inputs, o.ninputs = n, o.overwrite = true;
    o.field = o.field ? o.field : "text";
    tkd_tokenize_summary sum;
    if (tkd_tokenize_run(&o, &sum) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(out, &ds), TKD_OK);
    return ds;
}

/* Asserts that ds holds exactly: the ids of each text (texts[i], lens[i] bytes) followed by EOS. */
static void assert_docs(const tkd_tokens *ds, const char *const *texts, const size_t *lens, int n)
{
    tkd_tokenizer *tok = NULL;
    tkd_tokenizer_ctx *ctx = NULL;
    assert_int_equal(tkd_tokenizer_load(QWEN3, &tok), TKD_OK);
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    tkd_token_ids want = {0};
    uint32_t eos = QWEN3_EOS;
    for (int i = 0; i < n; i++) {
        assert_int_equal(tkd_tokenizer_encode(ctx, texts[i], lens[i], &want), TKD_OK);
        assert_int_equal(tkd_token_ids_push(&want, &eos, 1), TKD_OK);
    }
    assert_int_equal(tkd_tokens_count(ds), (int64_t)want.n);
    for (size_t i = 0; i < want.n; i++)
        assert_int_equal((uint32_t)tkd_tokens_data(ds)[i], want.ids[i]);
    tkd_token_ids_free(&want);
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
}

/* ---- item 4: one JSON object per line, strings with their length ------------------------------ */

/* "\u0000" is a NUL inside the text, as Python keeps it; the tokenizer gets all 7 bytes. */
static void test_escaped_nul_kept(void **state)
{
    (void)state;
    char *t;
    size_t len;
    assert_int_equal(tkd_text_jsonl_field("f.jsonl", 1, REC("{\"text\":\"abc\\u0000def\"}"), "text", &t, &len), TKD_OK);
    assert_int_equal(len, 7);
    assert_memory_equal(t, "abc\0def", 8);
    free(t);
    /* Jansson keeps no NUL in a key (Python does): refused, never cut to "te" */
    assert_int_equal(tkd_text_jsonl_field("f.jsonl", 1, REC("{\"te\\u0000xt\":\"a\",\"text\":\"b\"}"), "text", &t, &len),
                     TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("f.jsonl:1:2: NUL byte in object key not supported");

    tkd_test_write_text(tmp("nul.jsonl"), "{\"text\":\"abc\\u0000def\"}\n{\"text\":\"\\u0000\"}\n");
    const char *inputs[] = {tmp("nul.jsonl")};
    tkd_tokens *ds = tokenize((tkd_tokenize_opts){0}, tmp("nul.npy"), inputs, 1);
    const char *texts[] = {"abc\0def", ""};
    const size_t lens[] = {7, 1};
    assert_docs(ds, texts, lens, 2);
    tkd_tokens_free(ds);
}

typedef struct bad_record {
    const char *rec;
    size_t len;
    const char *msg; /* what the message must hold, after "f.jsonl:3:" */
} bad_record;

/* Each refused with TKD_ERR_FORMAT, naming the file, the line and the column of what is wrong. */
static void test_loose_records_refused(void **state)
{
    (void)state;
    static const bad_record bad[] = {
        {REC("{\"text\":\"abc\0def\"}"), "13: a raw control character (0x00) — JSON allows none, a string escapes them (\\u0000)"},
        {REC("{\"n\":1\0,\"text\":\"a\"}"), "7: a raw control character (0x00)"}, /* Jansson alone drops it */
        {REC("{\"text\":\"a\tb\"}"), "11: control character 0x9"},                 /* a raw tab in a string */
        {REC("{\"text\":\"a\"}{\"text\":\"b\"}"), "13: end of file expected near '{'"}, /* two objects */
        {REC("{\"text\":\"a\"} junk"), "14: end of file expected near 'junk'"},
        {REC("{\"text\":\"a\"} // c"), "14: end of file expected near '/'"},
        {REC("{\"text\":\"a\"} /* c */"), "14: end of file expected near '/'"},
        {REC("\x01{\"text\":\"a\"}"), "1: a raw control character (0x01)"},         /* whitespace to cJSON */
        {REC("{\"text\":\x0b\"a\"}"), "9: a raw control character (0x0b)"},
        {REC("{\"text\":\"a\"}\x0c"), "13: a raw control character (0x0c)"},
        {REC("{\"text\":\"a\",\"text\":\"b\"}"), "13: duplicate key \"text\" — a JSON Lines record names each key once"},
        {REC("{\"a\":{\"k\\\"\":1, \"k\\\"\" :2},\"text\":\"b\"}"), "16: duplicate key \"k\\\"\""}, /* nested, escaped */
        {REC("{\"text\":\"\\ud800\"}"), "9: invalid Unicode '\\uD800'"},           /* Python keeps a lone surrogate, */
        {REC("{\"text\":\"a\",}"), "13: string or '}' expected"},                  /* which tokenizers refuses */
        {REC("{text:\"a\"}"), "2: string or '}' expected near 'text'"},
        {REC("{\"text\":'a'}"), "9: invalid token near '''"},
        {REC("{\"text\":\"a\""), "12: '}' expected near end of file"},
        {REC("\"text\""), "1: '[' or '{' expected near '\"text\"'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *t = (char *)1;
        size_t len = 99;
        tkd_status st = tkd_text_jsonl_field("f.jsonl", 3, bad[i].rec, bad[i].len, "text", &t, &len);
        char want[256];
        snprintf(want, sizeof want, "f.jsonl:3:%s", bad[i].msg);
        if (st != TKD_ERR_FORMAT || !strstr(tkd_error_msg(), want))
            fail_msg("record %zu: %s (%s), want '%s'", i, tkd_status_name(st), tkd_error_msg(), want);
        assert_null(t);
        assert_int_equal(len, 0);
        assert_null(strchr(tkd_error_msg(), '\n'));
    }
}

/* What RFC 8259 (and Python) accept still reads: space, tab and CR around the tokens, escapes,
 * any other fields (an integer past int64 included), nested values. */
static void test_strict_but_not_stricter(void **state)
{
    (void)state;
    static const struct {
        const char *rec, *text;
        size_t tlen;
    } good[] = {
        {" \t{ \"text\" :\t\"a b\" }\r\t ", "a b", 3},
        {"{\"id\":123456789012345678901234567890,\"x\":[{\"text\":1}],\"text\":\"\\t\\\"\\/\"}", "\t\"/", 3},
        {"{\"text\":\"\\ud83d\\ude00 \\u00e9\"}", "\xF0\x9F\x98\x80 \xC3\xA9", 7},
        {"{\"text\":\"\"}", "", 0},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        char *t;
        size_t len;
        if (tkd_text_jsonl_field("f.jsonl", 1, good[i].rec, strlen(good[i].rec), "text", &t, &len) != TKD_OK)
            fail_msg("record %zu: %s", i, tkd_error_msg());
        assert_int_equal(len, good[i].tlen);
        assert_memory_equal(t, good[i].text, len + 1);
        free(t);
    }
}

/* Bytes that are not UTF-8 are read as the tokenizer reads them (docs/teacher-dump.md: Python's
 * decode("utf-8", "replace")): each maximal ill-formed subsequence becomes U+FFFD, so a JSON Lines
 * text and the same text in a plain file give the same ids. A column after such bytes counts the
 * bytes of the file. */
static void test_invalid_utf8_replaced(void **state)
{
    (void)state;
    char *t;
    size_t len;
    assert_int_equal(tkd_text_jsonl_field("f.jsonl", 1, REC("{\"text\":\"caf\xe9 \xf0\x9f\x98 \xff!\"}"), "text", &t, &len),
                     TKD_OK);
    assert_string_equal(t, "caf\xEF\xBF\xBD \xEF\xBF\xBD \xEF\xBF\xBD!");
    free(t);
    assert_int_equal(tkd_text_jsonl_field("f.jsonl", 2, REC("{\"text\":\"\xff\xfe\"} x"), "text", &t, &len),
                     TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("f.jsonl:2:15: end of file expected near 'x'");

    tkd_test_write_text(tmp("bad8.jsonl"), "{\"text\":\"caf\xe9 \xf0\x9f\x98 \xff!\"}\n");
    tkd_test_write_text(tmp("bad8.txt"), "caf\xe9 \xf0\x9f\x98 \xff!");
    const char *inputs[] = {tmp("bad8.jsonl"), tmp("bad8.txt")};
    tkd_tokens *ds = tokenize((tkd_tokenize_opts){0}, tmp("bad8.npy"), inputs, 2);
    const char *texts[] = {"caf\xe9 \xf0\x9f\x98 \xff!", "caf\xe9 \xf0\x9f\x98 \xff!"};
    const size_t lens[] = {11, 11};
    assert_docs(ds, texts, lens, 2);
    tkd_tokens_free(ds);
}

/* tokenize stops at a loose record with one line naming file:line:col, and writes nothing. */
static void test_tokenize_refuses(void **state)
{
    (void)state;
    write_bytes(tmp("raw.jsonl"), REC("{\"text\":\"ok\"}\n{\"text\":\"abc\0def\"}\n"));
    const char *inputs[] = {tmp("raw.jsonl")};
    tkd_tokenize_opts o = {.tokenizer = QWEN3, .output = tmp("raw.bin"), .inputs = inputs, .ninputs = 1,
                           .field = "text"};
    tkd_tokenize_summary sum;
    assert_int_equal(tkd_tokenize_run(&o, &sum), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("raw.jsonl:2:13: a raw control character (0x00)");
    assert_null(tkd_test_read_file(tmp("raw.bin"), NULL));
    tkd_test_write_text(tmp("dup.jsonl"), "{\"text\":\"first\",\"text\":\"last\"}\n");
    inputs[0] = tmp("dup.jsonl");
    assert_int_equal(tkd_tokenize_run(&o, &sum), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("dup.jsonl:1:17: duplicate key \"text\"");
}

/* ---- item 9: one escape rule for --doc-separator and data.doc_separator ------------------------- */

static void test_unescape(void **state)
{
    (void)state;
    char *s;
    assert_int_equal(tkd_text_unescape("\\n\\n", "--x", TKD_ERR_INVALID_ARG, &s), TKD_OK);
    assert_string_equal(s, "\n\n");
    free(s);
    assert_int_equal(tkd_text_unescape("a\\\\n\\t\\r<>", "--x", TKD_ERR_INVALID_ARG, &s), TKD_OK);
    assert_string_equal(s, "a\\n\t\r<>");
    free(s);
    assert_int_equal(tkd_text_unescape("\n--\n", "--x", TKD_ERR_INVALID_ARG, &s), TKD_OK); /* YAML "\n--\n" */
    assert_string_equal(s, "\n--\n");
    free(s);
    s = (char *)1;
    assert_int_equal(tkd_text_unescape("<\\x>", "data.doc_separator", TKD_ERR_CONFIG, &s), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("data.doc_separator: '\\x' in '<\\x>' is not an escape it knows — \\n, \\t, \\r and \\\\");
    assert_null(s);
    assert_int_equal(tkd_text_unescape("end\\", "--doc-separator", TKD_ERR_INVALID_ARG, &s), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("--doc-separator: '\\' in 'end\\' is not an escape");
}

/* A dump config with data.tokenizer and data.doc_separator `sep` over `path` (finalized). */
static tkd_status text_config(tkd_dump_config *cfg, const char *path, const char *sep)
{
    memset(cfg, 0, sizeof *cfg);
    assert_int_equal(tkd_config_defaults(&tkd_dump_schema, cfg), TKD_OK);
    char set[4400];
    const char *sets[] = {"teacher.path=unused", "output.dir=unused", set, "data.tokenizer=" QWEN3, sep};
    snprintf(set, sizeof set, "data.paths=['%s']", path);
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        assert_int_equal(tkd_config_apply_set(&tkd_dump_schema, cfg, sets[i]), TKD_OK);
    return tkd_dump_config_finalize(cfg, NULL);
}

/* The same text with the same separator gives the same ids through the flag and the config key. */
static void test_separator_one_rule(void **state)
{
    (void)state;
    const char *text = "one\n\ntwo \\n\\n lines\n\n\nthree";
    tkd_test_write_text(tmp("sep.txt"), text);
    const char *argv[] = {"tokenize", "--tokenizer", QWEN3, "-o", "x.bin", "--doc-separator", "\\n\\n", tmp("sep.txt"), NULL};
    tkd_tokenize_opts o;
    bool help;
    int verbosity;
    assert_int_equal(tkd_tokenize_parse_args(8, (char **)argv, &o, &help, &verbosity), TKD_OK);
    assert_string_equal(o.separator, "\n\n");
    const char *inputs[] = {tmp("sep.txt")};
    tkd_tokens *by_flag = tokenize(o, tmp("flag.npy"), inputs, 1);
    tkd_tokenize_opts_free(&o);
    const char *texts[] = {"one", "two \\n\\n lines", "\nthree"};
    const size_t lens[] = {3, 14, 6};
    assert_docs(by_flag, texts, lens, 3);

    /* --set (a plain YAML scalar keeps the backslashes), single quotes (the same), double quotes
     * (YAML turns \n into a newline itself, which no rule changes): one dataset. */
    const char *seps[] = {"data.doc_separator=\\n\\n", "data.doc_separator='\\n\\n'", "data.doc_separator=\"\\n\\n\""};
    for (size_t i = 0; i < 3; i++) {
        tkd_dump_config cfg;
        if (text_config(&cfg, tmp("sep.txt"), seps[i]) != TKD_OK)
            fail_msg("%s: %s", seps[i], tkd_error_msg());
        tkd_tokens *by_config = NULL;
        if (tkd_dump_open_dataset(&cfg, 0, &by_config) != TKD_OK) /* 0: no vocabulary limit */
            fail_msg("%s: %s", seps[i], tkd_error_msg());
        assert_int_equal(tkd_tokens_count(by_config), tkd_tokens_count(by_flag));
        assert_memory_equal(tkd_tokens_data(by_config), tkd_tokens_data(by_flag), 4 * (size_t)tkd_tokens_count(by_flag));
        tkd_tokens_free(by_config);
        tkd_config_free(&tkd_dump_schema, &cfg);
    }
    tkd_tokens_free(by_flag);

    /* An unknown escape is refused by both, naming the flag or the key. */
    const char *bad[] = {"tokenize", "--tokenizer", QWEN3, "-o", "x.bin", "--doc-separator=\\s", tmp("sep.txt"), NULL};
    assert_int_equal(tkd_tokenize_parse_args(7, (char **)bad, &o, &help, &verbosity), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("tokenize: --doc-separator: '\\s' in '\\s' is not an escape it knows");
    tkd_tokenize_opts_free(&o);
    tkd_dump_config cfg;
    assert_int_equal(text_config(&cfg, tmp("sep.txt"), "data.doc_separator='\\s'"), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("data.doc_separator: '\\s' in '\\s' is not an escape it knows");
    tkd_config_free(&tkd_dump_schema, &cfg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_escaped_nul_kept),        cmocka_unit_test(test_loose_records_refused),
        cmocka_unit_test(test_strict_but_not_stricter), cmocka_unit_test(test_invalid_utf8_replaced),
        cmocka_unit_test(test_tokenize_refuses),        cmocka_unit_test(test_unescape),
        cmocka_unit_test(test_separator_one_rule),
    };
    return cmocka_run_group_tests(tests, tkd_test_group_dir_setup, tkd_test_group_dir_teardown);
}
