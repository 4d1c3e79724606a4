/* test_tokenize.c — `teacher-dump tokenize` (teacher_cache/tokenize) and the text reader under it
 * (formats/text_docs): documents from text files (one per file, or cut at a separator) and JSON
 * Lines, the llm.c v7 file written (header and ids, documents in order, EOS after each, the
 * tokenizer's BOS), shards, each error naming its file and line, and the binary's exit codes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "formats/text_docs.h"
#include "formats/tokenizer.h"
#include "formats/tokens.h"
#include "teacher_cache/dump.h"
#include "teacher_cache/tokenize.h"
#include "tests/dump_testutil.h"
#include "tests/testutil.h"

#define BIN TKD_BINARY_DIR "/bin/teacher-dump"
#define QWEN3 TKD_BINARY_DIR "/fixtures/tokenizer/qwen3" /* unpacked by CMake */
#define QWEN3_EOS 151645 /* <|im_end|>, tokenizer_config.json's eos_token */

static const char *tmp(const char *name)
{
    return tkd_test_path(tkd_test_group_dir, name);
}

/* ---- formats/text_docs ------------------------------------------------------------------------- */

/* Reads every record of path; returns how many, each copied into out[] (malloc'd) with its line. */
static int read_all(const char *path, const tkd_text_opts *o, char **out, int64_t *lines, int cap)
{
    tkd_text_reader *r = NULL;
    assert_int_equal(tkd_text_reader_open(path, o, &r), TKD_OK);
    int n = 0;
    for (;;) {
        const char *rec;
        size_t len;
        int64_t line;
        bool eof;
        assert_int_equal(tkd_text_reader_next(r, &rec, &len, &line, &eof), TKD_OK);
        if (eof)
            break;
        assert_true(n < cap);
        out[n] = strndup(rec, len);
        lines[n++] = line;
    }
    tkd_text_reader_close(r);
    return n;
}

static void test_reader_separator(void **state)
{
    (void)state;
    char *rec[8];
    int64_t line[8];
    tkd_test_write_text(tmp("sep.txt"), "one\n\ntwo\nlines\n\n\n\nthree");
    tkd_text_opts o = {.separator = "\n\n"};
    int n = read_all(tmp("sep.txt"), &o, rec, line, 8);
    assert_int_equal(n, 3); /* the empty document between the two separators is skipped */
    assert_string_equal(rec[0], "one");
    assert_string_equal(rec[1], "two\nlines");
    assert_string_equal(rec[2], "three");
    assert_int_equal(line[0], 1);
    assert_int_equal(line[1], 3);
    assert_int_equal(line[2], 8);
    for (int i = 0; i < n; i++)
        free(rec[i]);
    /* No separator: the whole file is one document, newlines and all. */
    n = read_all(tmp("sep.txt"), &(tkd_text_opts){0}, rec, line, 8);
    assert_int_equal(n, 1);
    assert_string_equal(rec[0], "one\n\ntwo\nlines\n\n\n\nthree");
    free(rec[0]);
}

/* A separator that straddles the reader's first 1 MB read, and a document longer than it. */
static void test_reader_large(void **state)
{
    (void)state;
    size_t big = (1u << 20) - 2;
    char *text = malloc(3 * big + 16);
    memset(text, 'a', big);
    memcpy(text + big, "<SEP>", 5);
    memset(text + big + 5, 'b', 2 * big);
    text[3 * big + 5] = 0;
    tkd_test_write_text(tmp("big.txt"), text);
    char *rec[4];
    int64_t line[4];
    int n = read_all(tmp("big.txt"), &(tkd_text_opts){.separator = "<SEP>"}, rec, line, 4);
    assert_int_equal(n, 2);
    assert_int_equal(strlen(rec[0]), big);
    assert_int_equal(strlen(rec[1]), 2 * big);
    assert_true(rec[1][0] == 'b' && rec[1][2 * big - 1] == 'b');
    free(rec[0]);
    free(rec[1]);
    free(text);
}

static void test_reader_jsonl(void **state)
{
    (void)state;
    char *rec[8];
    int64_t line[8];
    tkd_test_write_text(tmp("d.jsonl"), "{\"text\": \"a\"}\r\n\n   \n{\"text\": \"b\\u00e9\\n\", \"n\": 1}\n[1]\n");
    int n = read_all(tmp("d.jsonl"), &(tkd_text_opts){0}, rec, line, 8);
    assert_int_equal(n, 3);
    assert_string_equal(rec[0], "{\"text\": \"a\"}"); /* \r of a CRLF line dropped */
    assert_int_equal(line[1], 4);
    char *t;
    size_t len;
    assert_int_equal(tkd_text_jsonl_field("d.jsonl", 4, rec[1], strlen(rec[1]), "text", &t, &len), TKD_OK);
    assert_string_equal(t, "b\xC3\xA9\n");
    assert_int_equal(len, 4);
    free(t);
    assert_int_equal(tkd_text_jsonl_field("d.jsonl", 4, rec[1], strlen(rec[1]), "body", &t, &len), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("d.jsonl:4: no string field 'body' — name the field that holds the text (--field)");
    assert_int_equal(tkd_text_jsonl_field("d.jsonl", 5, rec[2], strlen(rec[2]), "text", &t, &len), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("d.jsonl:5: not a JSON object");
    for (int i = 0; i < n; i++)
        free(rec[i]);
}

/* ---- tokenize --------------------------------------------------------------------------------- */

/* The tokens of an llm.c v7 file; fails the test unless the header is {20240801, 7, n, 0...}. */
static uint32_t *read_bin(const char *path, size_t *n)
{
    size_t len;
    char *d = tkd_test_slurp(path, &len);
    assert_true(len >= 1024);
    int32_t h[256];
    memcpy(h, d, sizeof h);
    assert_int_equal(h[0], 20240801);
    assert_int_equal(h[1], 7);
    for (int i = 3; i < 256; i++)
        assert_int_equal(h[i], 0);
    *n = (size_t)h[2];
    assert_int_equal(len, 1024 + 4 * *n);
    uint32_t *ids = malloc(4 * *n + 4);
    memcpy(ids, d + 1024, 4 * *n);
    free(d);
    /* and the token reader teacher-dump and student-train use reads the same ids from it */
    tkd_tokens *ds = NULL;
    if (tkd_tokens_open(path, &ds) != TKD_OK)
        fail_msg("%s: %s", path, tkd_error_msg());
    assert_int_equal(tkd_tokens_count(ds), (int64_t)*n);
    int32_t *back = malloc(4 * *n + 4);
    assert_int_equal(tkd_tokens_read(ds, 0, (int64_t)*n, back), TKD_OK);
    for (size_t i = 0; i < *n; i++)
        assert_int_equal((uint32_t)back[i], ids[i]);
    free(back);
    tkd_tokens_free(ds);
    return ids;
}

/* What tokenize must write for these documents: each one's ids, then eos (-1: none), bos before. */
static void expected(const char *tok_path, const char *const *docs, int ndocs, int64_t bos, int64_t eos,
                     tkd_token_ids *want)
{
    tkd_tokenizer *tok = NULL;
    tkd_tokenizer_ctx *ctx = NULL;
    assert_int_equal(tkd_tokenizer_load(tok_path, &tok), TKD_OK);
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    for (int i = 0; i < ndocs; i++) {
        uint32_t b = (uint32_t)bos, e = (uint32_t)eos;
        if (bos >= 0)
            assert_int_equal(tkd_token_ids_push(want, &b, 1), TKD_OK);
        assert_int_equal(tkd_tokenizer_encode(ctx, docs[i], strlen(docs[i]), want), TKD_OK);
        if (eos >= 0)
            assert_int_equal(tkd_token_ids_push(want, &e, 1), TKD_OK);
    }
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
}

static tkd_status run(tkd_tokenize_opts *o, const char *out, const char **inputs, int n, tkd_tokenize_summary *sum)
{
    o->tokenizer = o->tokenizer ? o->tokenizer : QWEN3;
    o->output = out;
    o->inputs = inputs;
    o->ninputs = n;
    o->field = o->field ? o->field : "text";
    o->overwrite = true;
    return tkd_tokenize_run(o, sum);
}

static void assert_ids(const char *path, const tkd_token_ids *want)
{
    size_t n;
    uint32_t *ids = read_bin(path, &n);
    assert_int_equal(n, want->n);
    assert_memory_equal(ids, want->ids, 4 * n);
    free(ids);
}

/* Text files (one document each, and one cut at a separator) and JSON Lines, in the order given. */
static void test_mixed_inputs(void **state)
{
    (void)state;
    tkd_test_write_text(tmp("a.txt"), "Hello world.\nSecond line of the same document.");
    tkd_test_write_text(tmp("b.jsonl"), "{\"text\": \"JSON doc one\"}\n{\"id\": 2, \"text\": \"二つ目 \\ud83d\\ude00\"}\n");
    const char *inputs[] = {tmp("a.txt"), tmp("b.jsonl")};
    tkd_tokenize_opts o = {0};
    tkd_tokenize_summary sum;
    assert_int_equal(run(&o, tmp("mixed.bin"), inputs, 2, &sum), TKD_OK);
    const char *docs[] = {"Hello world.\nSecond line of the same document.", "JSON doc one", "二つ目 \xF0\x9F\x98\x80"};
    tkd_token_ids want = {0};
    expected(QWEN3, docs, 3, -1, QWEN3_EOS, &want);
    assert_ids(tmp("mixed.bin"), &want);
    assert_int_equal(sum.docs, 3);
    assert_int_equal(sum.tokens, (int64_t)want.n);
    assert_int_equal(sum.files, 1);
    assert_int_equal(sum.eos_id, QWEN3_EOS);
    tkd_token_ids_free(&want);
    /* --eos none: no token between documents; --eos TOKEN: that one. */
    o = (tkd_tokenize_opts){.eos = "none"};
    assert_int_equal(run(&o, tmp("mixed.bin"), inputs, 2, &sum), TKD_OK);
    expected(QWEN3, docs, 3, -1, -1, &want);
    assert_ids(tmp("mixed.bin"), &want);
    tkd_token_ids_free(&want);
    o = (tkd_tokenize_opts){.eos = "<|endoftext|>"};
    assert_int_equal(run(&o, tmp("mixed.bin"), inputs, 2, &sum), TKD_OK);
    expected(QWEN3, docs, 3, -1, 151643, &want);
    assert_ids(tmp("mixed.bin"), &want);
    tkd_token_ids_free(&want);
}

/* 10,000 documents (three batches) on 2 threads come out in input order; shards of 1000 tokens
 * hold the same stream. */
static void test_many_docs_and_shards(void **state)
{
    (void)state;
    enum { N = 10000 };
    FILE *f = fopen(tmp("many.txt"), "w");
    char **docs = malloc(N * sizeof *docs);
    for (int i = 0; i < N; i++) {
        docs[i] = malloc(64);
        snprintf(docs[i], 64, "document %d says %x%s", i, i * 2654435761u, i % 7 ? "" : " 中文");
        fprintf(f, "%s%s", i ? "\n---\n" : "", docs[i]);
    }
    fclose(f);
    const char *inputs[] = {tmp("many.txt")};
    tkd_tokenize_opts o = {.separator = "\n---\n", .threads = 2};
    tkd_tokenize_summary sum;
    assert_int_equal(run(&o, tmp("many.bin"), inputs, 1, &sum), TKD_OK);
    tkd_token_ids want = {0};
    expected(QWEN3, (const char *const *)docs, N, -1, QWEN3_EOS, &want);
    assert_ids(tmp("many.bin"), &want);
    assert_int_equal(sum.docs, N);
    o = (tkd_tokenize_opts){.separator = "\n---\n", .threads = 2, .shard_tokens = 1000};
    assert_int_equal(run(&o, tmp("many.bin"), inputs, 1, &sum), TKD_OK);
    assert_int_equal(sum.files, (int)((want.n + 999) / 1000));
    assert_string_equal(sum.first, tmp("many_000000.bin"));
    size_t at = 0;
    for (int i = 0; i < sum.files; i++) {
        char name[64];
        snprintf(name, sizeof name, "many_%06d.bin", i);
        size_t n;
        uint32_t *ids = read_bin(tmp(name), &n);
        assert_int_equal(n, i + 1 < sum.files ? 1000 : want.n - at);
        assert_memory_equal(ids, want.ids + at, 4 * n);
        at += n;
        free(ids);
    }
    assert_int_equal(at, want.n);
    tkd_token_ids_free(&want);
    for (int i = 0; i < N; i++)
        free(docs[i]);
    free(docs);
}

/* A tokenizer whose template adds a BOS: every document starts with it (GPT-2's files with a
 * made-up TemplateProcessing), EOS <|endoftext|> from its tokenizer_config.json. */
static void test_bos_from_template(void **state)
{
    (void)state;
    char *json = tkd_test_slurp(TKD_SOURCE_DIR "/tests/fixtures/tokenizer/gpt2/tokenizer.json", NULL);
    const char *post = "\"post_processor\":{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"trim_offsets\":false,"
                       "\"use_regex\":true}";
    char *at = strstr(json, post);
    assert_non_null(at);
    const char *tmpl = "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":"
                       "\"<|endoftext|>\",\"type_id\":0}},{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"pair\":[],"
                       "\"special_tokens\":{\"<|endoftext|>\":{\"id\":\"<|endoftext|>\",\"ids\":[50256],\"tokens\":"
                       "[\"<|endoftext|>\"]}}}";
    char *mod = malloc(strlen(json) + strlen(tmpl) + 1);
    sprintf(mod, "%.*s%s%s", (int)(at - json), json, tmpl, at + strlen(post));
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", tmp("gpt2bos"));
    assert_int_equal(system(cmd), 0);
    tkd_test_write_text(tmp("gpt2bos/tokenizer.json"), mod);
    tkd_test_write_text(tmp("gpt2bos/tokenizer_config.json"), "{\"eos_token\": \"<|endoftext|>\"}");
    tkd_test_write_text(tmp("two.txt"), "first doc\n\nsecond doc");
    const char *inputs[] = {tmp("two.txt")};
    tkd_tokenize_opts o = {.tokenizer = tmp("gpt2bos"), .separator = "\n\n"};
    tkd_tokenize_summary sum;
    assert_int_equal(run(&o, tmp("bos.bin"), inputs, 1, &sum), TKD_OK);
    const char *docs[] = {"first doc", "second doc"};
    tkd_token_ids want = {0};
    expected(tmp("gpt2bos"), docs, 2, 50256, 50256, &want);
    assert_ids(tmp("bos.bin"), &want);
    assert_int_equal(want.ids[0], 50256);
    assert_int_equal(sum.nprefix, 1);
    tkd_token_ids_free(&want);
    free(mod);
    free(json);
}

static void test_errors(void **state)
{
    (void)state;
    tkd_test_write_text(tmp("bad.jsonl"), "{\"text\": \"ok\"}\n\n{\"body\": \"no text\"}\n");
    const char *inputs[] = {tmp("bad.jsonl")};
    tkd_tokenize_opts o = {0};
    tkd_tokenize_summary sum;
    assert_int_equal(run(&o, tmp("bad.bin"), inputs, 1, &sum), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("bad.jsonl:3: no string field 'text'");
    assert_false(tkd_test_read_file(tmp("bad.bin"), NULL) != NULL); /* nothing left behind */
    o = (tkd_tokenize_opts){.field = "body"};
    assert_int_equal(run(&o, tmp("bad.bin"), inputs, 1, &sum), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("bad.jsonl:1: no string field 'body'");
    o = (tkd_tokenize_opts){.eos = "<|nope|>"};
    assert_int_equal(run(&o, tmp("bad.bin"), inputs, 1, &sum), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("--eos '<|nope|>' is not a token of");
    const char *missing[] = {tmp("missing.txt")};
    o = (tkd_tokenize_opts){0};
    assert_int_equal(run(&o, tmp("bad.bin"), missing, 1, &sum), TKD_ERR_NOT_FOUND);
    /* An existing output is replaced only with overwrite. */
    tkd_test_write_text(tmp("keep.bin"), "mine");
    tkd_test_write_text(tmp("one.txt"), "x");
    const char *one[] = {tmp("one.txt")};
    o = (tkd_tokenize_opts){0};
    o.tokenizer = QWEN3, o.output = tmp("keep.bin"), o.inputs = one, o.ninputs = 1, o.field = "text";
    assert_int_equal(tkd_tokenize_run(&o, &sum), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("keep.bin exists — pass --overwrite");
    char *kept = tkd_test_slurp(tmp("keep.bin"), NULL);
    assert_string_equal(kept, "mine");
    free(kept);
}

static void test_parse_args(void **state)
{
    (void)state;
    char *argv[] = {"tokenize", "--tokenizer", "tok", "-o", "out.bin", "--doc-separator=\\n\\n", "--format", "jsonl",
                    "--shard-tokens", "100", "-vv", "a.txt", "b.txt", NULL};
    tkd_tokenize_opts o;
    bool help;
    int verbosity;
    assert_int_equal(tkd_tokenize_parse_args(13, argv, &o, &help, &verbosity), TKD_OK);
    assert_string_equal(o.tokenizer, "tok");
    assert_string_equal(o.output, "out.bin");
    assert_string_equal(o.separator, "\n\n");
    assert_int_equal(o.kind, TKD_TEXT_JSONL);
    assert_int_equal(o.shard_tokens, 100);
    assert_int_equal(verbosity, 2);
    assert_int_equal(o.ninputs, 2);
    assert_string_equal(o.inputs[1], "b.txt");
    assert_false(help);
    tkd_tokenize_opts_free(&o);
    char *bad[] = {"tokenize", "--tokenizer", "t", "--output", "o", "--shard", "3", "a", NULL};
    assert_int_equal(tkd_tokenize_parse_args(8, bad, &o, &help, &verbosity), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("unknown option '--shard'");
    tkd_tokenize_opts_free(&o);
    char *noin[] = {"tokenize", "--tokenizer", "t", "--output", "o", NULL};
    assert_int_equal(tkd_tokenize_parse_args(5, noin, &o, &help, &verbosity), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("no input files");
    tkd_tokenize_opts_free(&o);
}

/* The binary: 0 with the file written, 2 for a usage error, 1 for bad input, one error line. */
static void test_cli(void **state)
{
    (void)state;
    tkd_test_write_text(tmp("cli.txt"), "Some text for the command line.");
    const char *ok[] = {"tokenize", "--tokenizer", QWEN3, "--output", tmp("cli.bin"), tmp("cli.txt"), NULL};
    assert_int_equal(tkd_test_run(BIN, ok, NULL, tmp("cli.out")), 0);
    size_t n;
    free(read_bin(tmp("cli.bin"), &n));
    assert_true(n > 3);
    assert_int_equal(tkd_test_run(BIN, ok, NULL, tmp("cli.out")), 2); /* exists, no --overwrite */
    char *out = tkd_test_slurp(tmp("cli.out"), NULL);
    assert_non_null(strstr(out, "teacher-dump: tokenize: "));
    free(out);
    const char *bad[] = {"tokenize", "--tokenizer", QWEN3, "--output", tmp("cli2.bin"), "--oops", tmp("cli.txt"), NULL};
    assert_int_equal(tkd_test_run(BIN, bad, NULL, tmp("cli.out")), 2);
    tkd_test_write_text(tmp("cli.jsonl"), "not json\n");
    const char *badin[] = {"tokenize", "--tokenizer", QWEN3, "--output", tmp("cli3.bin"), tmp("cli.jsonl"), NULL};
    assert_int_equal(tkd_test_run(BIN, badin, NULL, tmp("cli.out")), 1);
    const char *help[] = {"tokenize", "--help", NULL};
    assert_int_equal(tkd_test_run(BIN, help, NULL, tmp("cli.out")), 0);
}

/* --output into a folder that is not there: the folders are made (as teacher-dump makes output.dir);
 * a run that fails removes the folders it made, and never one that was there (issue 26). */
static void test_cli_output_into_new_folder(void **state)
{
    (void)state;
    tkd_test_write_text(tmp("new.txt"), "Text for a folder that is not there yet.");
    const char *ok[] = {"tokenize", "--tokenizer", QWEN3, "--output", tmp("fresh/sub/out.bin"), tmp("new.txt"), NULL};
    assert_int_equal(tkd_test_run(BIN, ok, NULL, tmp("new.out")), 0);
    size_t n;
    free(read_bin(tmp("fresh/sub/out.bin"), &n));
    assert_true(n > 3);
    /* a failing run into new folders: they go again */
    tkd_test_write_text(tmp("new.jsonl"), "not json\n");
    const char *bad[] = {"tokenize", "--tokenizer", QWEN3, "--output", tmp("fresh2/sub/out.bin"), tmp("new.jsonl"), NULL};
    assert_int_equal(tkd_test_run(BIN, bad, NULL, tmp("new.out")), 1);
    assert_false(tkd_file_exists(tmp("fresh2")));
    /* below a folder the user had: only what the run made goes */
    const char *below[] = {"tokenize", "--tokenizer", QWEN3, "--output", tmp("fresh/sub2/out.bin"), tmp("new.jsonl"), NULL};
    assert_int_equal(tkd_test_run(BIN, below, NULL, tmp("new.out")), 1);
    assert_false(tkd_file_exists(tmp("fresh/sub2")));
    assert_true(tkd_file_exists(tmp("fresh/sub/out.bin")));
    /* a folder that was there and is empty stays */
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", tmp("mine"));
    assert_int_equal(system(cmd), 0);
    const char *mine[] = {"tokenize", "--tokenizer", QWEN3, "--output", tmp("mine/out.bin"), tmp("new.jsonl"), NULL};
    assert_int_equal(tkd_test_run(BIN, mine, NULL, tmp("new.out")), 1);
    assert_true(tkd_file_exists(tmp("mine")));
    assert_false(tkd_file_exists(tmp("mine/out.bin")));
}

/* The closing line's totals, from the summary: real counts in units that show them. */
static void test_format_totals(void **state)
{
    (void)state;
    char line[256];
    tkd_tokenize_summary s = {.docs = 1200, .tokens = 9876543, .bytes = 45600000, .files = 3, .seconds = 2};
    tkd_tokenize_format_totals(line, sizeof line, &s);
    assert_string_equal(line, "done in 0:02: 3 files, 45.6 MB of text, 1200 documents, 9876543 tokens (4.9M tok/s, "
                              "22.8 MB/s)");
    s = (tkd_tokenize_summary){.docs = 1, .tokens = 4, .bytes = 312, .files = 1, .seconds = 0.25};
    tkd_tokenize_format_totals(line, sizeof line, &s);
    assert_string_equal(line, "done in 0:00: 1 file, 312 B of text, 1 document, 4 tokens (16.0 tok/s, 1.2 kB/s)");
}

/* The binary's closing line on a small input: its real totals, never "0/1 done ... 0.0 MB/s" (the
 * progress counts whole MB) (issue 26). */
static void test_cli_closing_line(void **state)
{
    (void)state;
    tkd_test_write_text(tmp("small.txt"), "one small document");
    tkd_test_write_text(tmp("small2.txt"), "and another one");
    const char *args[] = {"tokenize", "--tokenizer", QWEN3, "--output", tmp("small.bin"), "--overwrite",
                          tmp("small.txt"), tmp("small2.txt"), NULL};
    assert_int_equal(tkd_test_run(BIN, args, NULL, tmp("small.out")), 0);
    size_t n;
    free(read_bin(tmp("small.bin"), &n));
    char *out = tkd_test_slurp(tmp("small.out"), NULL);
    char want[128];
    snprintf(want, sizeof want, " of text, 2 documents, %zu tokens (", n);
    const char *line = strstr(out, "tokenize done in 0:0");
    if (!line || !strstr(line, ": 1 file, 33 B of text, 2 documents, ") || !strstr(line, want) ||
        !strstr(line, " tok/s, ") || !strstr(line, "B/s)\n") || strstr(out, "0/1"))
        fail_msg("closing line without the run's totals (%s):\n%s", want, out);
    free(out);
}

/* A byte-level tokenizer small enough for the llama fixture's 131 ids: printable ASCII (ids 0-93),
 * space 94, newline 95, "he" 96, " t" 97, " the" 98, <|eos|> 99 (its eos_token). */
static const char *ascii_tokenizer(void)
{
    tkd_test_ascii_tokenizer(tmp("ascii"), -1, "\"he\": 96, \"\u0120t\": 97, \"\u0120the\": 98",
                             "\"h e\", \"\u0120 t\", \"\u0120t he\"");
    return tmp("ascii");
}

/* teacher-dump with data.tokenizer: the text is tokenized on the fly into the same token stream as
 * `tokenize` writes (same dataset sha256 and windows as a dump of that file). */
static void test_dump_from_text(void **state)
{
    (void)state;
    char tok[4200];
    snprintf(tok, sizeof tok, "%s", ascii_tokenizer()); /* tmp()'s buffers are reused */
    char text[4096] = "";
    for (int i = 0; i < 40; i++)
        strcat(text, i % 3 ? "the cat sat on the mat. " : "then the end\n");
    tkd_test_write_text(tmp("story.txt"), text);
    tkd_test_write_text(tmp("more.jsonl"), "{\"text\": \"the other one\"}\n{\"text\": \"and the last\"}\n");
    const char *inputs[] = {tmp("story.txt"), tmp("more.jsonl")};
    tkd_tokenize_opts o = {.tokenizer = tok};
    tkd_tokenize_summary tsum;
    assert_int_equal(run(&o, tmp("story.npy"), inputs, 2, &tsum), TKD_OK);
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(tmp("story.npy"), &ds), TKD_OK); /* the .npy output reads as a dataset */
    assert_int_equal(tkd_tokens_count(ds), tsum.tokens);
    assert_int_equal(tkd_tokens_data(ds)[tsum.tokens - 1], 99); /* the EOS after the last document */
    tkd_tokens_free(ds);

    char yaml[9000], extra[4400];
    tkd_dump_summary from_file, from_text;
    tkd_dt_small_yaml(yaml, sizeof yaml, TKD_DT_LLAMA, tmp("story.npy"), tmp("cache-file"), "");
    tkd_dt_run_ok(yaml, &(tkd_dump_opts){.overwrite = true}, &from_file);
    snprintf(extra, sizeof extra, "data: {paths: ['%s', '%s'], tokenizer: '%s'}\n", tmp("story.txt"), tmp("m*.jsonl"), tok);
    tkd_dt_small_yaml(yaml, sizeof yaml, TKD_DT_LLAMA, "unused", tmp("cache-text"), extra);
    tkd_dt_run_ok(yaml, &(tkd_dump_opts){.overwrite = true}, &from_text);
    assert_string_equal(from_text.dataset_sha256, from_file.dataset_sha256);
    assert_int_equal(from_text.range_end, from_file.range_end);
    assert_true(from_text.range_end >= 8);
    /* A data.tokenizer that is not there: an error naming data.tokenizer. */
    snprintf(extra, sizeof extra, "data: {paths: ['%s'], tokenizer: '%s/none'}\n", tmp("story.txt"), tok);
    tkd_dt_small_yaml(yaml, sizeof yaml, TKD_DT_LLAMA, "unused", tmp("cache-text2"), extra);
    assert_int_equal(tkd_dt_run(yaml, &(tkd_dump_opts){.overwrite = true}, &from_text), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("data.tokenizer: ");
}

TKD_TEST_MAIN_WITH(tkd_test_group_dir_setup, tkd_test_group_dir_teardown, TKD_TEST_EACH_NONE,
    test_reader_separator, test_reader_large, test_reader_jsonl, test_mixed_inputs, test_many_docs_and_shards,
    test_bos_from_template, test_errors, test_parse_args, test_cli, test_dump_from_text,
    test_cli_output_into_new_folder, test_format_totals, test_cli_closing_line)
