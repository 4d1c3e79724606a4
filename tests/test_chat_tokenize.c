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

/* SYSTEM_MULTITURN through Qwen2.5's template (with or without its {% generation %} blocks) */
static const char *SYSTEM_MULTITURN_QWEN =
    "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    "Hello!<|im_end|>\n<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n1, 2, 3.<|im_end|>\n";

static void test_qwen25_multiturn_system(void **state)
{
    (void)state;
    fixture f;
    fx_open(&f, QWEN25, NULL);
    assert_string_equal(tkd_chat_rule(f.chat), "assistant turns by prefix");
    expect_encoding(&f, SYSTEM_MULTITURN,
                    SYSTEM_MULTITURN_QWEN,
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
                    SYSTEM_MULTITURN_QWEN,
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

/* `teacher-dump tokenize --chat` over the corpus: the token file and its sidecar, read back as a
 * dataset (one document per record, windows labelling only the trained targets). */
static tkd_tokenize_opts chat_opts(const char *out, const char **inputs, int n)
{
    return (tkd_tokenize_opts){.tokenizer = tkd_test_src("data/chat/tokenizer"), .inputs = inputs, .ninputs = n,
                               .output = out, .field = "text", .threads = 2, .chat = true,
                               .chat_template = tkd_test_src(QWEN25)};
}

static void test_tokenize_run_chat(void **state)
{
    const char *dir = *state, *in[1] = {tkd_test_src("data/chat/conversations.jsonl")};
    const char *out = tkd_test_path(dir, "sub/chat.bin");
    tkd_tokenize_opts o = chat_opts(out, in, 1);
    tkd_tokenize_summary sum;
    assert_int_equal(tkd_tokenize_run(&o, &sum), TKD_OK);
    assert_int_equal(sum.docs, 7);
    assert_int_equal(sum.nprefix + sum.nsuffix, 0);
    assert_int_equal(sum.eos_id, -1);
    assert_non_null(strstr(sum.chat_source, "Qwen-Qwen2.5-7B-Instruct.jinja (trained: assistant turns by prefix)"));
    assert_true(tkd_file_exists(tkd_test_path(dir, "sub/chat.bin.flags.npy")));
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(out, &ds), TKD_OK);
    assert_true(tkd_tokens_has_flags(ds));
    assert_int_equal(tkd_tokens_count(ds), sum.tokens);
    assert_int_equal(tkd_tokens_num_trained(ds), sum.trained);
    assert_true(sum.trained > 0 && sum.trained < sum.tokens / 2);
    assert_int_equal(tkd_tokens_num_docs(ds), 7);
    /* each document is one record's encoding: the second one's ids and flags, exactly */
    fixture f;
    fx_open(&f, QWEN25, NULL);
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tkd_read_file(in[0], (void **)&text, &len), TKD_OK);
    const char *rec2 = strchr(text, '\n') + 1;
    assert_int_equal(tkd_chat_encode(f.chat, f.ctx, in[0], 2, rec2, (size_t)(strchr(rec2, '\n') - rec2), &f.ids,
                                     &f.flags), TKD_OK);
    int64_t d1 = tkd_tokens_doc_start(ds, 1), n = (int64_t)f.ids.n;
    assert_int_equal(tkd_tokens_doc_start(ds, 2) - d1, n);
    int32_t *tok = malloc((size_t)n * 4);
    uint8_t *fl = malloc((size_t)n);
    assert_int_equal(tkd_tokens_read(ds, d1, n, tok), TKD_OK);
    assert_int_equal(tkd_tokens_read_flags(ds, d1, n, fl), TKD_OK);
    for (int64_t k = 0; k < n; k++) {
        assert_int_equal(tok[k], (int32_t)f.ids.ids[k]);
        assert_int_equal(fl[k], f.flags.v[k]);
    }
    /* a window over it: labels are the trained targets, -100 elsewhere */
    int32_t win[33], lab[32];
    int valid;
    int64_t w = d1 / 32;
    assert_int_equal(tkd_tokens_window(ds, 32, 32, 1, w, win, lab, &valid), TKD_OK);
    uint8_t wf[33];
    int64_t m = tkd_tokens_count(ds) - w * 32 < 33 ? tkd_tokens_count(ds) - w * 32 : 33;
    assert_int_equal(tkd_tokens_read_flags(ds, w * 32, m, wf), TKD_OK);
    for (int j = 0; j + 1 < m; j++)
        assert_int_equal(lab[j], (wf[j + 1] & TKD_TOKENS_FLAG_TRAINED) ? win[j + 1] : -100);
    free(tok);
    free(fl);
    free(text);
    fx_close(&f);
    tkd_tokens_free(ds);
}

/* Shards: every shard has its sidecar, cut at the same token; the list reads back whole. */
static void test_tokenize_chat_shards(void **state)
{
    const char *dir = *state, *in[1] = {tkd_test_src("data/chat/conversations.jsonl")};
    tkd_tokenize_opts o = chat_opts(tkd_test_path(dir, "s.npy"), in, 1);
    o.shard_tokens = 100;
    tkd_tokenize_summary sum;
    assert_int_equal(tkd_tokenize_run(&o, &sum), TKD_OK);
    assert_true(sum.files >= 3);
    assert_true(tkd_file_exists(tkd_test_path(dir, "s_000001.npy.flags.npy")));
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(tkd_test_path(dir, "s_*.npy"), &ds), TKD_OK);
    assert_int_equal(tkd_tokens_num_files(ds), sum.files);
    assert_int_equal(tkd_tokens_num_trained(ds), sum.trained);
    assert_int_equal(tkd_tokens_num_docs(ds), 7);
    tkd_tokens_free(ds);
}

/* A bad record stops the run naming its file:line; nothing is left, neither tokens nor flags. A
 * plain run with --overwrite over a chat output removes the old sidecar with the old tokens. */
static void test_tokenize_chat_failure_and_overwrite(void **state)
{
    const char *dir = *state;
    const char *bad = tkd_test_path(dir, "bad.jsonl"), *in[1] = {bad};
    FILE *fp = fopen(bad, "w");
    fputs("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": "
          "\"b\"}]}\n\n{\"messages\": 3}\n", fp);
    fclose(fp);
    const char *out = tkd_test_path(dir, "o/bad.bin");
    tkd_tokenize_opts o = chat_opts(out, in, 1);
    tkd_tokenize_summary sum;
    tkd_test_expect_error(tkd_tokenize_run(&o, &sum), TKD_ERR_FORMAT,
                          TKD_TEST_FRAGS("bad.jsonl:3: \"messages\" is not a list of messages"));
    assert_false(tkd_file_exists(out));
    assert_false(tkd_file_exists(tkd_test_path(dir, "o")));

    const char *good[1] = {tkd_test_src("data/chat/conversations.jsonl")};
    out = tkd_test_path(dir, "t.bin");
    o = chat_opts(out, good, 1);
    assert_int_equal(tkd_tokenize_run(&o, &sum), TKD_OK);
    tkd_test_expect_error(tkd_tokenize_run(&o, &sum), TKD_ERR_INVALID_ARG, TKD_TEST_FRAGS("t.bin exists"));
    o.chat = false, o.chat_template = NULL, o.kind = TKD_TEXT_PLAIN, o.eos = "none", o.overwrite = true;
    good[0] = tkd_test_src("data/chat/tokenizer/tokenizer_config.json"); /* any text */
    assert_int_equal(tkd_tokenize_run(&o, &sum), TKD_OK);
    assert_false(tkd_file_exists(tkd_test_path(dir, "t.bin.flags.npy")));
    tkd_tokens *ds = NULL;
    assert_int_equal(tkd_tokens_open(out, &ds), TKD_OK);
    assert_false(tkd_tokens_has_flags(ds));
    tkd_tokens_free(ds);
    /* a sidecar without its token file is an output name too */
    fp = fopen(tkd_test_path(dir, "u.bin.flags.npy"), "w");
    fclose(fp);
    o.output = tkd_test_path(dir, "u.bin"), o.overwrite = false;
    tkd_test_expect_error(tkd_tokenize_run(&o, &sum), TKD_ERR_INVALID_ARG, TKD_TEST_FRAGS("u.bin.flags.npy exists"));
}

static void test_tokenize_chat_flags_parse(void **state)
{
    (void)state;
    tkd_tokenize_opts o;
    bool help;
    int v;
    char *ok[] = {"tokenize", "--chat", "--chat-template", "t.jinja", "--chat-kwargs={\"enable_thinking\": false}",
                  "--tokenizer", "tok", "-o", "o.bin", "in.jsonl"};
    assert_int_equal(tkd_tokenize_parse_args(10, ok, &o, &help, &v), TKD_OK);
    assert_true(o.chat);
    assert_string_equal(o.chat_template, "t.jinja");
    assert_string_equal(o.chat_kwargs, "{\"enable_thinking\": false}");
    tkd_tokenize_opts_free(&o);
    char *eos[] = {"tokenize", "--chat", "--eos", "x", "--tokenizer", "tok", "-o", "o.bin", "in.jsonl"};
    tkd_test_expect_error(tkd_tokenize_parse_args(9, eos, &o, &help, &v), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("--chat does not take --eos"));
    tkd_tokenize_opts_free(&o);
    char *lone[] = {"tokenize", "--chat-template", "t.jinja", "--tokenizer", "tok", "-o", "o.bin", "in.jsonl"};
    tkd_test_expect_error(tkd_tokenize_parse_args(8, lone, &o, &help, &v), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("--chat-template needs --chat"));
    tkd_tokenize_opts_free(&o);
}

/* The binary: it names the template and the fraction trained at the end; a bad record is exit 1
 * and one line naming file:line, nothing written. */
static void test_tokenize_chat_cli(void **state)
{
    const char *dir = *state, *bin = TKD_BINARY_DIR "/bin/teacher-dump";
    const char *const need[] = {bin, NULL};
    tkd_test_require_built(need);
    const char *log = tkd_test_path(dir, "cli.log"), *out = tkd_test_path(dir, "c.npy");
    const char *args[] = {"tokenize", "--chat", "--chat-template", tkd_test_src(QWEN25), "--tokenizer",
                          tkd_test_src("data/chat/tokenizer"), "--output", out,
                          tkd_test_src("data/chat/conversations.jsonl"), NULL};
    assert_int_equal(tkd_test_run(bin, args, NULL, log), 0);
    char *msg = tkd_test_slurp(log, NULL);
    if (!strstr(msg, "teacher-dump tokenize: chat template ") || !strstr(msg, "Qwen-Qwen2.5-7B-Instruct.jinja (trained: "
                                                                                "assistant turns by prefix); ") ||
        !strstr(msg, " tokens are trained targets (") || !strstr(msg, "c.npy.flags.npy"))
        fail_msg("the summary lacks the template or the fraction trained: %s", msg);
    free(msg);
    const char *bad = tkd_test_path(dir, "bad.jsonl");
    tkd_test_write_text(bad, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n{\"prompt\": 1}\n");
    const char *bargs[] = {"tokenize", "--chat", "--chat-template", tkd_test_src(QWEN25), "--tokenizer",
                           tkd_test_src("data/chat/tokenizer"), "--output", tkd_test_path(dir, "b.bin"), bad, NULL};
    assert_int_equal(tkd_test_run(bin, bargs, NULL, log), 1);
    msg = tkd_test_slurp(log, NULL);
    if (!strstr(msg, "bad.jsonl:2: no \"messages\" list, and no \"prompt\" with a \"completion\""))
        fail_msg("no file:line in: %s", msg);
    free(msg);
    assert_false(tkd_file_exists(tkd_test_path(dir, "b.bin")));
    assert_false(tkd_file_exists(tkd_test_path(dir, "b.bin.flags.npy")));
}

/* ---- against transformers (tests/fixtures/chat/, made by tests/chat_mask_reference.py) ---- */

/* The next "<line> <kind> <values...>" of fp: its values into v (at most cap), the message of an
 * error line into msg. Returns the kind ("ids", "mask", "error") or NULL at the end. */
static const char *fixture_line(FILE *fp, int *line, uint32_t *v, size_t cap, size_t *n, char *msg, size_t mcap)
{
    static char buf[1 << 16], kind[16];
    if (!fgets(buf, sizeof buf, fp))
        return NULL;
    int used = 0;
    assert_int_equal(sscanf(buf, "%d %15s %n", line, kind, &used), 2);
    *n = 0;
    if (strcmp(kind, "error") == 0) {
        snprintf(msg, mcap, "%s", buf + used);
        return kind;
    }
    for (char *p = buf + used, *e; *p && *p != '\n'; p = e) {
        unsigned long x = strtoul(p, &e, 10);
        if (e == p)
            break;
        assert_true(*n < cap);
        v[(*n)++] = (uint32_t)x;
    }
    return kind;
}

/* Every record of the corpus through one case of cases.tsv, against the fixture's ids and mask (an
 * error there must be an error here). */
static void check_case(const char *name, const char *tmpl, const char *kwargs)
{
    char path[4200];
    snprintf(path, sizeof path, "fixtures/chat/%s.txt", name);
    FILE *fp = fopen(tkd_test_src(path), "r");
    if (!fp)
        fail_msg("%s: missing (run tests/chat_mask_reference.py)", tkd_test_src(path));
    fixture f;
    fx_open(&f, tmpl, strcmp(kwargs, "{}") ? kwargs : NULL);
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tkd_read_file(tkd_test_src("data/chat/conversations.jsonl"), (void **)&text, &len), TKD_OK);
    static uint32_t v[1 << 14];
    char msg[1024];
    size_t n;
    int line, checked = 0;
    for (const char *kind; (kind = fixture_line(fp, &line, v, 1 << 14, &n, msg, sizeof msg)) != NULL;) {
        const char *rec = text;
        for (int l = 1; l < line; l++)
            rec = strchr(rec, '\n') + 1;
        tkd_status st = tkd_chat_encode(f.chat, f.ctx, "conversations.jsonl", line, rec,
                                        (size_t)(strchr(rec, '\n') - rec), &f.ids, &f.flags);
        if (strcmp(kind, "error") == 0) {
            if (st == TKD_OK)
                fail_msg("%s line %d: transformers raised (%s) but topkd encoded it", name, line, msg);
            continue;
        }
        if (st != TKD_OK)
            fail_msg("%s line %d: %s", name, line, tkd_error_msg());
        assert_int_equal(f.ids.n, n);
        for (size_t k = 0; k < n; k++) {
            uint32_t got = strcmp(kind, "ids") == 0 ? f.ids.ids[k] : (f.flags.v[k] & TKD_TOKENS_FLAG_TRAINED);
            if (got != v[k])
                fail_msg("%s line %d: %s[%zu] = %u, transformers %u", name, line, kind, k, got, v[k]);
        }
        checked++;
    }
    assert_true(checked > 0);
    fclose(fp);
    free(text);
    fx_close(&f);
}

static void test_transformers_fixtures(void **state)
{
    (void)state;
    FILE *fp = fopen(tkd_test_src("data/chat/cases.tsv"), "r");
    assert_non_null(fp);
    char row[1024];
    int cases = 0;
    while (fgets(row, sizeof row, fp)) {
        row[strcspn(row, "\n")] = '\0';
        char *t1 = strchr(row, '\t'), *t2 = t1 ? strchr(t1 + 1, '\t') : NULL;
        assert_non_null(t2);
        *t1 = *t2 = '\0';
        check_case(row, t1 + 1, t2 + 1);
        cases++;
    }
    fclose(fp);
    assert_int_equal(cases, 5);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "fixtures") == 0)
        return TKD_TEST_RUN_WITH(NULL, NULL, TKD_TEST_EACH_NONE, test_transformers_fixtures);
    return TKD_TEST_RUN_WITH(NULL, NULL, TKD_TEST_EACH_DIR, test_qwen25_multiturn_system,
                             test_token_straddling_the_edge, test_llama31, test_qwen3, test_prompt_completion,
                             test_generation_blocks, test_bad_records, test_template_found_beside_tokenizer,
                             test_tokenize_run_chat, test_tokenize_chat_shards,
                             test_tokenize_chat_failure_and_overwrite, test_tokenize_chat_flags_parse,
                             test_tokenize_chat_cli);
}
