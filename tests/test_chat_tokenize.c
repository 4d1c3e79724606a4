/* test_chat_tokenize.c — conversations through chat templates into ids and flags (formats/chat.h)
 * and `teacher-dump tokenize --chat` (teacher_cache/tokenize.h), with the small Qwen-style tokenizer
 * of tests/data/chat/tokenizer/ and the released templates of tests/data/chat_templates/.
 *
 * Each case checks the ids against the tokenizer's ids of the text the template must render (written
 * out here by hand from the template), and the flags by the text their trained tokens spell.
 * `test_chat_tokenize fixtures` (ctest test_chat_tokenize_transformers, registered once
 * tests/fixtures/chat/ exists) compares ids and masks with transformers' (tests/chat_mask_reference.py). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/fileio.h"
#include "common/status.h"
#include "formats/chat.h"
#include "formats/tokenizer.h"
#include "formats/tokens.h"
#include "teacher_cache/tokenize.h"
#include "tests/testutil.h"

#define QWEN25 "data/chat_templates/Qwen-Qwen2.5-7B-Instruct.jinja"
#define QWEN3 "data/chat_templates/Qwen-Qwen3-0.6B.jinja"
#define LLAMA31 "data/chat_templates/meta-llama-Llama-3.1-8B-Instruct.jinja"
#define MISTRAL "data/chat_templates/mistralai-Mistral-7B-Instruct-v0.3.jinja"
#define QWEN25_GEN "data/chat/qwen2.5-generation.jinja"
#define QWEN_SYSTEM "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
#define LLAMA_SYSTEM                                                                                   \
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December " \
    "2023\nToday Date: 26 Jul 2024\n\n"

/* One template over the test tokenizer, and what encoding a record gave. */
typedef struct fixture {
    tkd_tokenizer *tok;
    tkd_tokenizer_ctx *ctx;
    tkd_chat *chat;
    tkd_token_ids ids;
    tkd_chat_flags flags;
} fixture;

static void fx_open(fixture *f, const char *tmpl_rel, const char *kwargs)
{
    memset(f, 0, sizeof *f);
    assert_int_equal(tkd_tokenizer_load(tkd_test_src("data/chat/tokenizer"), &f->tok), TKD_OK);
    assert_int_equal(tkd_tokenizer_ctx_create(f->tok, &f->ctx), TKD_OK);
    tkd_chat_opts o = {tmpl_rel ? tkd_test_src(tmpl_rel) : NULL, kwargs, 0};
    tkd_status st = tkd_chat_open(f->tok, &o, &f->chat);
    if (st != TKD_OK)
        fail_msg("tkd_chat_open: %s", tkd_error_msg());
}

static void fx_close(fixture *f)
{
    tkd_token_ids_free(&f->ids);
    tkd_chat_flags_free(&f->flags);
    tkd_chat_free(f->chat);
    tkd_tokenizer_ctx_free(f->ctx);
    tkd_tokenizer_free(f->tok);
}

static tkd_status fx_encode(fixture *f, const char *rec)
{
    return tkd_chat_encode(f->chat, f->ctx, "x.jsonl", 5, rec, strlen(rec), &f->ids, &f->flags);
}

/* The bytes of the tokens whose flag has `bit` (0: every token), concatenated into buf. */
static const char *spell(const fixture *f, unsigned bit, char *buf, size_t cap)
{
    size_t n = 0;
    for (size_t k = 0; k < f->ids.n; k++) {
        if (bit && !(f->flags.v[k] & bit))
            continue;
        size_t bl;
        const uint8_t *b = tkd_tokenizer_token_bytes(f->tok, f->ids.ids[k], &bl);
        assert_non_null(b);
        assert_true(n + bl < cap);
        memcpy(buf + n, b, bl);
        n += bl;
    }
    buf[n] = '\0';
    return buf;
}

/* rec encodes to exactly the tokenizer's ids of `text` (nothing added: no BOS, no EOS), the first
 * token alone starts a document, and the trained tokens spell `trained`. */
static void expect_encoding(fixture *f, const char *rec, const char *text, const char *trained)
{
    if (fx_encode(f, rec) != TKD_OK)
        fail_msg("encoding %s: %s", rec, tkd_error_msg());
    tkd_token_ids want = {0};
    assert_int_equal(tkd_tokenizer_encode(f->ctx, text, strlen(text), &want), TKD_OK);
    assert_int_equal(f->ids.n, want.n);
    assert_memory_equal(f->ids.ids, want.ids, want.n * sizeof *want.ids);
    tkd_token_ids_free(&want);
    assert_int_equal(f->flags.n, f->ids.n);
    for (size_t k = 0; k < f->flags.n; k++)
        assert_int_equal(!!(f->flags.v[k] & TKD_TOKENS_FLAG_DOC_START), k == 0);
    static char buf[8192];
    const char *got = spell(f, TKD_TOKENS_FLAG_TRAINED, buf, sizeof buf);
    if (strcmp(got, trained) != 0)
        fail_msg("trained tokens spell [%s], want [%s]", got, trained);
}

static const char *SYSTEM_MULTITURN =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be terse.\"}, {\"role\": \"user\", \"content\": \"Hi\"}, "
    "{\"role\": \"assistant\", \"content\": \"Hello!\"}, {\"role\": \"user\", \"content\": \"Count.\"}, "
    "{\"role\": \"assistant\", \"content\": \"1, 2, 3.\"}]}";

static void test_qwen25_multiturn_system(void **state)
{
    (void)state;
    fixture f;
    fx_open(&f, QWEN25, NULL);
    assert_string_equal(tkd_chat_rule(f.chat), "assistant turns by prefix");
    expect_encoding(&f, SYSTEM_MULTITURN,
                    "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                    "Hello!<|im_end|>\n<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n1, 2, 3.<|im_end|>\n",
                    "Hello!<|im_end|>\n1, 2, 3.<|im_end|>\n");
    /* empty assistant content: its end-of-turn is still a target; unicode: bytes of one character
     * may be split over tokens, all of them trained */
    expect_encoding(&f, "{\"messages\": [{\"role\": \"user\", \"content\": \"Say nothing.\"}, {\"role\": \"assistant\", "
                        "\"content\": \"\"}]}",
                    QWEN_SYSTEM "<|im_start|>user\nSay nothing.<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n",
                    "<|im_end|>\n");
    expect_encoding(&f, "{\"messages\": [{\"role\": \"user\", \"content\": \"\\u00e9t\\u00e9 \\ud83d\\ude42\"}, "
                        "{\"role\": \"assistant\", \"content\": \"\xe5\xa4\x8f\xe5\xa4\xa9 \xe2\x80\x94 l'\xc3\xa9t\xc3\xa9\"}]}",
                    QWEN_SYSTEM "<|im_start|>user\n\xc3\xa9t\xc3\xa9 \xf0\x9f\x99\x82<|im_end|>\n<|im_start|>assistant\n"
                                "\xe5\xa4\x8f\xe5\xa4\xa9 \xe2\x80\x94 l'\xc3\xa9t\xc3\xa9<|im_end|>\n",
                    "\xe5\xa4\x8f\xe5\xa4\xa9 \xe2\x80\x94 l'\xc3\xa9t\xc3\xa9<|im_end|>\n");
    fx_close(&f);
}

/* The assistant's text begins with a newline: the tokenizer merges it with the template's newline
 * before it into one "\n\n" token that straddles the turn's edge. It is trained (it holds the turn's
 * first character), as transformers' char_to_token(start) makes it. */
static void test_token_straddling_the_edge(void **state)
{
    (void)state;
    const char *rec = "{\"messages\": [{\"role\": \"user\", \"content\": \"Go\"}, {\"role\": \"assistant\", \"content\": "
                      "\"\\nDone.\"}]}";
    const char *text = QWEN_SYSTEM "<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n\nDone.<|im_end|>\n";
    fixture f;
    fx_open(&f, QWEN25, NULL);
    expect_encoding(&f, rec, text, "\n\nDone.<|im_end|>\n"); /* the template's "\n" comes with it */
    int64_t nl2 = -1;
    for (size_t k = 0; k < f.ids.n; k++) {
        size_t bl;
        const uint8_t *b = tkd_tokenizer_token_bytes(f.tok, f.ids.ids[k], &bl);
        if (bl == 2 && memcmp(b, "\n\n", 2) == 0)
            nl2 = (int64_t)k;
    }
    assert_true(nl2 > 0);
    assert_true(f.flags.v[nl2] & TKD_TOKENS_FLAG_TRAINED);
    assert_false(f.flags.v[nl2 - 1] & TKD_TOKENS_FLAG_TRAINED); /* "assistant" */
    fx_close(&f);
    fx_open(&f, QWEN25_GEN, NULL); /* the same rule through a {% generation %} block */
    expect_encoding(&f, rec, text, "\n\nDone.<|im_end|>");
    fx_close(&f);
}

/* Llama 3.1 writes <|begin_of_text|> itself: it is in the ids once, and nothing is added. */
static void test_llama31(void **state)
{
    (void)state;
    fixture f;
    fx_open(&f, LLAMA31, NULL);
    expect_encoding(&f, SYSTEM_MULTITURN,
                    LLAMA_SYSTEM "Be terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                                 "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>"
                                 "user<|end_header_id|>\n\nCount.<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
                                 "\n\n1, 2, 3.<|eot_id|>",
                    "Hello!<|eot_id|>1, 2, 3.<|eot_id|>");
    int64_t bos = tkd_tokenizer_token_id(f.tok, "<|begin_of_text|>");
    size_t nbos = 0;
    for (size_t k = 0; k < f.ids.n; k++)
        nbos += f.ids.ids[k] == (uint32_t)bos;
    assert_int_equal(nbos, 1);
    assert_int_equal(f.ids.ids[0], bos);
    fx_close(&f);
}

/* Qwen3: the last assistant turn carries an empty think block; with enable_thinking=false the
 * generation prompt already holds it, so it is context, not target. Multi-turn is refused: the
 * template drops earlier turns' reasoning, so renders of a prefix do not begin the whole render. */
static void test_qwen3(void **state)
{
    (void)state;
    const char *rec = "{\"messages\": [{\"role\": \"user\", \"content\": \"Capital of France?\"}, {\"role\": "
                      "\"assistant\", \"content\": \"Paris.\"}]}";
    const char *text = "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                       "Paris.<|im_end|>\n";
    fixture f;
    fx_open(&f, QWEN3, NULL);
    expect_encoding(&f, rec, text, "<think>\n\n</think>\n\nParis.<|im_end|>\n");
    tkd_test_expect_error(fx_encode(&f, SYSTEM_MULTITURN), TKD_ERR_FORMAT,
                          TKD_TEST_FRAGS("x.jsonl:5: messages[2] (assistant)", "cannot be told apart",
                                         "{% generation %} blocks (--chat-template)"));
    fx_close(&f);
    fx_open(&f, QWEN3, "{\"enable_thinking\": false}");
    expect_encoding(&f, rec, text, "Paris.<|im_end|>\n");
    fx_close(&f);
}

/* prompt/completion: strings are one user and one assistant message; lists are messages. The
 * completion is what the whole render adds after the prompt's with add_generation_prompt. */
static void test_prompt_completion(void **state)
{
    (void)state;
    fixture f;
    fx_open(&f, QWEN25, NULL);
    expect_encoding(&f, "{\"prompt\": \"2 + 2 =\", \"completion\": \"4\"}",
                    QWEN_SYSTEM "<|im_start|>user\n2 + 2 =<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
                    "4<|im_end|>\n");
    expect_encoding(&f, "{\"prompt\": [{\"role\": \"system\", \"content\": \"One word.\"}, {\"role\": \"user\", "
                        "\"content\": \"Sky?\"}], \"completion\": [{\"role\": \"assistant\", \"content\": \"Blue\"}]}",
                    "<|im_start|>system\nOne word.<|im_end|>\n<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\n"
                    "Blue<|im_end|>\n",
                    "Blue<|im_end|>\n");
    fx_close(&f);
    fx_open(&f, LLAMA31, NULL);
    expect_encoding(&f, "{\"prompt\": \"2 + 2 =\", \"completion\": \"4\"}",
                    LLAMA_SYSTEM "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2 + 2 =<|eot_id|>"
                                 "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
                    "4<|eot_id|>");
    fx_close(&f);
}

/* A template with {% generation %} blocks: the blocks' text is what is trained. */
static void test_generation_blocks(void **state)
{
    (void)state;
    fixture f;
    fx_open(&f, QWEN25_GEN, NULL);
    assert_string_equal(tkd_chat_rule(f.chat), "{% generation %} blocks");
    expect_encoding(&f, SYSTEM_MULTITURN,
                    "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                    "Hello!<|im_end|>\n<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n1, 2, 3.<|im_end|>\n",
                    "Hello!<|im_end|>1, 2, 3.<|im_end|>");
    fx_close(&f);
}

static void expect_record_error(fixture *f, const char *rec, const char *const *frags)
{
    tkd_test_expect_error(fx_encode(f, rec), TKD_ERR_FORMAT, frags);
    assert_int_equal(f->ids.n, 0);
    assert_int_equal(f->flags.n, 0);
    assert_null(strchr(tkd_error_msg(), '\n'));
}

static void test_bad_records(void **state)
{
    (void)state;
    fixture f;
    fx_open(&f, QWEN25, NULL);
    expect_record_error(&f, "[1, 2]", TKD_TEST_FRAGS("x.jsonl:5: not a JSON object"));
    expect_record_error(&f, "{\"messages\": [}", TKD_TEST_FRAGS("x.jsonl:5:15: "));
    expect_record_error(&f, "{\"text\": \"hi\"}",
                        TKD_TEST_FRAGS("x.jsonl:5: no \"messages\" list, and no \"prompt\" with a \"completion\""));
    expect_record_error(&f, "{\"prompt\": \"hi\"}", TKD_TEST_FRAGS("x.jsonl:5: no \"messages\" list"));
    expect_record_error(&f, "{\"messages\": \"hi\"}", TKD_TEST_FRAGS("x.jsonl:5: \"messages\" is not a list of messages"));
    expect_record_error(&f, "{\"messages\": [{\"content\": \"hi\"}]}",
                        TKD_TEST_FRAGS("x.jsonl:5: messages[0] has no string \"role\""));
    expect_record_error(&f, "{\"prompt\": \"a\", \"completion\": []}",
                        TKD_TEST_FRAGS("x.jsonl:5: \"completion\" holds no message"));
    expect_record_error(&f, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\\u0000b\"}]}",
                        TKD_TEST_FRAGS("x.jsonl:5: a string holds a NUL character"));
    /* NFC recomposes e + U+0301: the tokens no longer spell the rendered text, and no offset is guessed */
    expect_record_error(&f, "{\"messages\": [{\"role\": \"user\", \"content\": \"cafe\\u0301\"}, {\"role\": "
                            "\"assistant\", \"content\": \"ok\"}]}",
                        TKD_TEST_FRAGS("x.jsonl:5: token", "does not spell the rendered conversation",
                                       "normalize the record's text (NFC)"));
    fx_close(&f);
    /* a role the template rejects, through its raise_exception */
    fx_open(&f, MISTRAL, NULL);
    expect_record_error(&f, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"user\", \"content\": "
                            "\"b\"}]}",
                        TKD_TEST_FRAGS("x.jsonl:5: ", "mistralai-Mistral-7B-Instruct-v0.3.jinja:",
                                       "conversation roles must alternate user/assistant"));
    fx_close(&f);
    fx_open(&f, LLAMA31, NULL);
    expect_record_error(&f, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", "
                            "\"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": {}}}, {\"function\": "
                            "{\"name\": \"g\", \"arguments\": {}}}]}]}",
                        TKD_TEST_FRAGS("x.jsonl:5: ", "meta-llama-Llama-3.1-8B-Instruct.jinja:",
                                       "This model only supports single tool-calls at once!"));
    fx_close(&f);
}

/* Where the template is found: --chat-template, else chat_template.jinja beside tokenizer.json,
 * else tokenizer_config.json's chat_template (a string, or a list whose "default" is taken). */
static void test_template_found_beside_tokenizer(void **state)
{
    const char *dir = *state;
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'/", tkd_test_src("data/chat/tokenizer/tokenizer.json"), dir);
    assert_int_equal(system(cmd), 0);
    tkd_tokenizer *tok = NULL;
    assert_int_equal(tkd_tokenizer_load(dir, &tok), TKD_OK);
    tkd_chat *c = NULL;
    tkd_test_expect_error(tkd_chat_open(tok, NULL, &c), TKD_ERR_NOT_FOUND,
                          TKD_TEST_FRAGS("tokenizer_config.json: no chat template", "chat_template.jinja",
                                         "--chat-template FILE"));
    assert_null(c);
    FILE *fp = fopen(tkd_test_path(dir, "tokenizer_config.json"), "w");
    fputs("{\"bos_token\": {\"content\": \"<|begin_of_text|>\"}, \"chat_template\": [{\"name\": \"tool_use\", "
          "\"template\": \"T\"}, {\"name\": \"default\", \"template\": \"{{ bos_token }}D{{ messages|length }}\"}]}",
          fp);
    fclose(fp);
    tkd_tokenizer_free(tok);
    assert_int_equal(tkd_tokenizer_load(dir, &tok), TKD_OK);
    assert_int_equal(tkd_chat_open(tok, NULL, &c), TKD_OK);
    assert_non_null(strstr(tkd_chat_source(c), "tokenizer_config.json (chat_template)"));
    tkd_tokenizer_ctx *ctx = NULL;
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    tkd_token_ids ids = {0};
    tkd_chat_flags fl = {0};
    const char *rec = "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}";
    assert_int_equal(tkd_chat_encode(c, ctx, "r.jsonl", 1, rec, strlen(rec), &ids, &fl), TKD_OK);
    assert_int_equal(ids.n, 3); /* <|begin_of_text|> D 1: the "default" template, bos_token from the config */
    assert_int_equal(ids.ids[0], tkd_tokenizer_token_id(tok, "<|begin_of_text|>"));
    assert_int_equal(fl.v[0], TKD_TOKENS_FLAG_DOC_START); /* no assistant: nothing trained */
    tkd_chat_free(c);
    fp = fopen(tkd_test_path(dir, "chat_template.jinja"), "w");
    fputs("J", fp);
    fclose(fp);
    assert_int_equal(tkd_chat_open(tok, NULL, &c), TKD_OK); /* the file wins, as in transformers */
    assert_non_null(strstr(tkd_chat_source(c), "/chat_template.jinja"));
    tkd_chat_free(c);
    tkd_chat_opts o = {tkd_test_src(QWEN25), "[1]", 0};
    tkd_test_expect_error(tkd_chat_open(tok, &o, &c), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("--chat-kwargs: not a JSON object"));
    o.kwargs = "{\"add_generation_prompt\": true}";
    tkd_test_expect_error(tkd_chat_open(tok, &o, &c), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("--chat-kwargs: 'add_generation_prompt' is set by each record"));
    o.kwargs = "{\"enable_thinking\": ";
    tkd_test_expect_error(tkd_chat_open(tok, &o, &c), TKD_ERR_INVALID_ARG, TKD_TEST_FRAGS("--chat-kwargs: "));
    tkd_token_ids_free(&ids);
    tkd_chat_flags_free(&fl);
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
}

TKD_TEST_MAIN_EACH_DIR(test_qwen25_multiturn_system, test_token_straddling_the_edge, test_llama31, test_qwen3,
                       test_prompt_completion, test_generation_blocks, test_bad_records,
                       test_template_found_beside_tokenizer)
