/* test_dump_text.c — teacher-dump with data.tokenizer (teacher_cache/dump_text): a token id beyond
 * the teacher's vocabulary is named by its text file and line (the token file it was written to is
 * a temporary the user never sees), and a first run that fails before writing anything leaves no
 * cache directory and no temporary tokens behind (issue 20, items 11 and 12). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "teacher_cache/dump.h"
#include "teacher_cache/dump_config.h"
#include "tests/dump_testutil.h"
#include "tests/testutil.h"

static const char *tmp(const char *name)
{
    return tkd_test_path(tkd_test_group_dir, name);
}

/* A byte-level tokenizer: printable ASCII at ids 0-93, space 94, newline 95, <|eos|> 99, except
 * 'Z', which is id `z_id` (200: beyond the llama fixture's 131 ids). Written to <group>/<name>. */
static void write_tokenizer(const char *name, int z_id)
{
    tkd_test_ascii_tokenizer(tmp(name), z_id, "", "");
}

/* Entries in dir other than . and .. (-1 when it cannot be listed). */
static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

static int setup(void **state)
{
    if (tkd_test_group_dir_setup(state) != 0)
        return -1;
    write_tokenizer("tok-z200", 200);
    write_tokenizer("tok-ok", 96);
    char text[2048] = "";
    for (int i = 0; i < 30; i++)
        strcat(text, "{\"text\": \"the cat sat on the mat and looked at the dog.\"}\n");
    tkd_test_write_text(tmp("good.jsonl"), text);
    strcat(text, "{\"text\": \"and then Zed came\"}\n"); /* line 31 */
    tkd_test_write_text(tmp("zed.jsonl"), text);
    /* the temporary tokens go under $TMPDIR: one of the test's own, to be seen empty */
    assert_int_equal(mkdir(tmp("tmpdir"), 0755), 0);
    return setenv("TMPDIR", tmp("tmpdir"), 1);
}

static void yaml_for(char *y, size_t cap, const char *tokenizer, const char *text, const char *out)
{
    char extra[4400], tok[4300];
    snprintf(tok, sizeof tok, "%s", tmp(tokenizer));
    snprintf(extra, sizeof extra, "data: {paths: ['%s'], tokenizer: '%s'}\n", tmp(text), tok);
    tkd_dt_small_yaml(y, cap, TKD_DT_LLAMA, "unused", out, extra);
}

/* An id the teacher does not have: the message names the text file and its line, not the
 * temporary token file; nothing is left behind (no cache directory, no temporary tokens). */
static void test_id_beyond_vocab_names_the_text(void **state)
{
    (void)state;
    char y[9000], out[4300];
    snprintf(out, sizeof out, "%s", tmp("cache-zed"));
    yaml_for(y, sizeof y, "tok-z200", "zed.jsonl", out);
    tkd_test_expect_error(tkd_dt_run(y, NULL, NULL), TKD_ERR_MISMATCH,
                          TKD_TEST_FRAGS("data.tokenizer: ", "/zed.jsonl:31: the tokenizer ",
                                         "gives id 200 (token 9 of the document), "
                                         "beyond the teacher's vocabulary of 131"));
    assert_null(strstr(tkd_error_msg(), "tokens.npy"));
    assert_false(exists(out));
    assert_int_equal(count_entries(tmp("tmpdir")), 0);
    /* the same tokenizer on text without a 'Z' is fine: the check is on the ids, not the vocabulary */
    yaml_for(y, sizeof y, "tok-z200", "good.jsonl", out);
    tkd_dt_run_ok(y, NULL, NULL);
    assert_int_equal(count_entries(tmp("tmpdir")), 0);
}

/* A first run that fails before writing anything (a missing tokenizer, a missing teacher) removes
 * the directory it made; a cache directory that was there before is kept as it was. */
static void test_failed_first_run_leaves_nothing(void **state)
{
    (void)state;
    char y[9000], out[4300];
    snprintf(out, sizeof out, "%s", tmp("cache-fail"));
    yaml_for(y, sizeof y, "tok-none", "good.jsonl", out);
    assert_int_equal(tkd_dt_run(y, NULL, NULL), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("data.tokenizer: ");
    assert_false(exists(out));
    assert_int_equal(count_entries(tmp("tmpdir")), 0);

    tkd_dt_small_yaml(y, sizeof y, "/nonexistent/teacher", tmp("good.jsonl"), out, "");
    assert_int_not_equal(tkd_dt_run(y, NULL, NULL), TKD_OK);
    tkd_test_assert_msg_has("/nonexistent/teacher");
    assert_false(exists(out));

    /* a cache made before: a failing run leaves it whole */
    yaml_for(y, sizeof y, "tok-ok", "good.jsonl", out);
    tkd_dt_run_ok(y, NULL, NULL);
    int before = count_entries(out);
    assert_true(before >= 3); /* marker, lock, manifest, shards */
    yaml_for(y, sizeof y, "tok-none", "good.jsonl", out);
    assert_int_equal(tkd_dt_run(y, NULL, NULL), TKD_ERR_NOT_FOUND);
    assert_int_equal(count_entries(out), before);
}

/* data.format: chat: the conversations are rendered (here by a small template with generation
 * blocks, over the ASCII tokenizer), the flags mark the assistant's tokens, and the cache's /tokens
 * still hold every real token (an untrained target is the next position's input, not padding); the
 * temporary tokens and their sidecar are gone after the run. */
static void test_chat_format(void **state)
{
    (void)state;
    tkd_test_write_text(tmp("chat.jinja"), "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}"
                                           "{% generation %}{{ m.content }}.{% endgeneration %}{% else %}"
                                           "{{ m.content }}{% endif %}\n{% endfor %}");
    char text[4096] = "";
    for (int i = 0; i < 12; i++)
        strcat(text, "{\"messages\": [{\"role\": \"user\", \"content\": \"the cat\"}, {\"role\": \"assistant\", "
                     "\"content\": \"sat on the mat\"}]}\n");
    tkd_test_write_text(tmp("chat.jsonl"), text);
    char y[9000], out[4300], extra[9000];
    snprintf(out, sizeof out, "%s", tmp("cache-chat"));
    snprintf(extra, sizeof extra, "data: {paths: ['%s'], tokenizer: '%s', format: chat, chat_template: '%s'}\n",
             tmp("chat.jsonl"), tmp("tok-ok"), tmp("chat.jinja"));
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, "unused", out, extra);
    tkd_dt_run_ok(y, NULL, NULL);
    assert_int_equal(count_entries(tmp("tmpdir")), 0);
    tkd_cache_batch b = {0};
    int64_t n = tkd_dt_read_all(out, &b, NULL);
    assert_true(n >= 10); /* 12 x 39 tokens in windows of 17 */
    for (int64_t i = 0; i < n * 17; i++)
        assert_true(b.tokens[i] >= 0 && b.tokens[i] < 96);
    tkd_cache_batch_free(&b);

    /* data.format and the chat keys are refused where they mean nothing */
    static const struct { const char *data, *frag; } kRefused[] = {
        {"format: chat", "data.format: chat needs data.tokenizer"},
        {"tokenizer: '%s', chat_kwargs: '{}'", "data.chat_kwargs: set, but data.format is not chat"},
        {"tokenizer: '%s', format: chat, chat_kwargs: '[1]'", "data.chat_kwargs: '[1]' is not a JSON object"},
    };
    for (size_t i = 0; i < sizeof kRefused / sizeof kRefused[0]; i++) {
        char data[1024];
        snprintf(data, sizeof data, kRefused[i].data, tmp("tok-ok"));
        snprintf(extra, sizeof extra, "data: {%s}\n", data);
        tkd_dump_config cfg;
        tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, "unused", out, extra);
        tkd_dt_config_parse_only(&cfg, y);
        tkd_test_expect_error(tkd_dump_config_finalize(&cfg, tkd_test_getenv), TKD_ERR_CONFIG,
                              TKD_TEST_FRAGS(kRefused[i].frag));
        tkd_config_free(&tkd_dump_schema, &cfg);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_id_beyond_vocab_names_the_text),
        cmocka_unit_test(test_failed_first_run_leaves_nothing),
        cmocka_unit_test(test_chat_format),
    };
    return cmocka_run_group_tests(tests, setup, tkd_test_group_dir_teardown);
}
