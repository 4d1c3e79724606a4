/* test_tokenizer.c — formats/tokenizer: identical ids to Hugging Face on real tokenizers (GPT-2,
 * Qwen3, Llama 3) over the fixture text of tests/fixtures/tokenizer/ (README there), then the
 * details on small made-up tokenizer.json files: BPE merge order, ignore_merges, added tokens,
 * lossy UTF-8, prefix/suffix from the template and tokenizer_config.json, and every refusal. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "formats/tokenizer.h"
#include "formats/tokenizer_internal.h"
#include "tests/testutil.h"

/* unpacked by CMake from tests/fixtures/tokenizer/qwen3.tar.xz (the JSON is 11 MB) */
#define QWEN3_DIR TKD_BINARY_DIR "/fixtures/tokenizer/qwen3"

/* ---- parity on the committed fixtures ---------------------------------------------------------- */

static tkd_tokenizer *load_ok(const char *path)
{
    tkd_tokenizer *tok = NULL;
    tkd_status st = tkd_tokenizer_load(path, &tok);
    if (st != TKD_OK)
        fail_msg("%s: %s", path, tkd_error_msg());
    return tok;
}

/* Parses "<file> <id> <id> ..." into ids; returns the file name (in line). */
static const char *parse_ref(char *line, tkd_token_ids *ids)
{
    char *save = NULL;
    const char *file = strtok_r(line, " \n", &save);
    for (char *t = strtok_r(NULL, " \n", &save); t; t = strtok_r(NULL, " \n", &save)) {
        uint32_t id = (uint32_t)strtoul(t, NULL, 10);
        assert_int_equal(tkd_token_ids_push(ids, &id, 1), TKD_OK);
    }
    return file;
}

static void assert_same_ids(const char *what, const tkd_token_ids *got, const tkd_token_ids *want)
{
    size_t n = got->n < want->n ? got->n : want->n, i = 0;
    while (i < n && got->ids[i] == want->ids[i])
        i++;
    if (i < n || got->n != want->n)
        fail_msg("%s: ids differ at %zu of %zu (want %zu): got %u, want %u", what, i, got->n, want->n,
                 i < got->n ? got->ids[i] : 0, i < want->n ? want->ids[i] : 0);
}

/* Encodes every fixture document with tok and compares with refs/<name>.txt; each document twice
 * (the second time from the word cache), and once more with a cache of 64 words. */
static void check_refs(const char *tok_path, const char *name)
{
    tkd_tokenizer *tok = load_ok(tok_path);
    tkd_tokenizer_ctx *ctx = NULL, *small = NULL;
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &small), TKD_OK);
    tkd_tok_ctx_limit_cache(small, 64);
    char rel[128];
    snprintf(rel, sizeof rel, "fixtures/tokenizer/refs/%s.txt", name);
    char *refs = tkd_test_slurp(tkd_test_src(rel), NULL);
    int docs = 0;
    char *save = NULL;
    for (char *line = strtok_r(refs, "\n", &save); line; line = strtok_r(NULL, "\n", &save), docs++) {
        tkd_token_ids want = {0}, got = {0};
        const char *file = parse_ref(line, &want);
        char trel[160], what[200];
        snprintf(trel, sizeof trel, "fixtures/tokenizer/text/%s", file);
        size_t len;
        char *text = tkd_test_slurp(tkd_test_src(trel), &len);
        for (int pass = 0; pass < 3; pass++) {
            got.n = 0;
            assert_int_equal(tkd_tokenizer_encode(pass < 2 ? ctx : small, text, len, &got), TKD_OK);
            snprintf(what, sizeof what, "%s %s (pass %d)", name, file, pass);
            assert_same_ids(what, &got, &want);
        }
        free(text);
        tkd_token_ids_free(&want);
        tkd_token_ids_free(&got);
    }
    assert_int_equal(docs, 12);
    free(refs);
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_ctx_free(small);
    tkd_tokenizer_free(tok);
}

static void test_parity_gpt2(void **state)
{
    (void)state;
    check_refs(tkd_test_src("fixtures/tokenizer/gpt2/tokenizer.json"), "gpt2");
}

static void test_parity_qwen3(void **state)
{
    (void)state;
    check_refs(QWEN3_DIR, "qwen3"); /* a directory: its tokenizer.json */
}

/* Llama 3's files are fetched, not committed (fixtures/tokenizer/README.md): skipped without them. */
static void test_parity_llama3(void **state)
{
    (void)state;
    const char *dir = getenv("TKD_LLAMA3_TOKENIZER");
    char path[4200];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir ? dir : TKD_BINARY_DIR "/fixtures/llama3");
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("test_parity_llama3: %s missing (tests/fixtures/tokenizer/fetch_llama3.sh fetches it): skipped\n", path);
        skip();
    }
    fclose(f);
    check_refs(path, "llama3");
}

/* The facts of the real files that the tokenize command relies on. */
static void test_real_specials(void **state)
{
    (void)state;
    const uint32_t *ids;
    tkd_tokenizer *q = load_ok(QWEN3_DIR);
    assert_int_equal(tkd_tokenizer_vocab_size(q), 151669);
    assert_int_equal(tkd_tokenizer_token_id(q, "<|endoftext|>"), 151643);
    assert_int_equal(tkd_tokenizer_token_id(q, "Ġthe"), 279);
    assert_int_equal(tkd_tokenizer_token_id(q, "no such token"), -1);
    assert_int_equal(tkd_tokenizer_eos_id(q), 151645); /* eos_token <|im_end|> */
    assert_int_equal(tkd_tokenizer_prefix(q, &ids), 0); /* add_bos_token: false */
    assert_int_equal(tkd_tokenizer_suffix(q, &ids), 0);
    tkd_tokenizer_free(q);
    tkd_tokenizer *g = load_ok(tkd_test_src("fixtures/tokenizer/gpt2/tokenizer.json"));
    assert_int_equal(tkd_tokenizer_vocab_size(g), 50257);
    assert_int_equal(tkd_tokenizer_eos_id(g), 50256);
    assert_int_equal(tkd_tokenizer_prefix(g, &ids), 0);
    tkd_tokenizer_free(g);
}

/* The bytes of ids into out (cap bytes); returns how many. Every id must have a token. */
static size_t decode_ids(const tkd_tokenizer *tok, const tkd_token_ids *ids, char *out, size_t cap)
{
    size_t at = 0;
    for (size_t i = 0; i < ids->n; i++) {
        size_t k;
        const uint8_t *b = tkd_tokenizer_token_bytes(tok, ids->ids[i], &k);
        assert_non_null(b);
        assert_true(at + k <= cap);
        memcpy(out + at, b, k);
        at += k;
    }
    return at;
}

/* Decoding the ids gives the text back (valid UTF-8 that NFC does not change). */
static void test_decode_round_trip(void **state)
{
    (void)state;
    tkd_tokenizer *tok = load_ok(QWEN3_DIR);
    tkd_tokenizer_ctx *ctx = NULL;
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    const char *files[] = {"00-english.txt", "01-code.txt", "04-cjk.txt", "05-emoji.txt", "11-long_runs.txt"};
    for (size_t f = 0; f < sizeof files / sizeof files[0]; f++) {
        char rel[128];
        snprintf(rel, sizeof rel, "fixtures/tokenizer/text/%s", files[f]);
        size_t len;
        char *text = tkd_test_slurp(tkd_test_src(rel), &len);
        tkd_token_ids ids = {0};
        assert_int_equal(tkd_tokenizer_encode(ctx, text, len, &ids), TKD_OK);
        char *back = malloc(len + 1);
        assert_int_equal(decode_ids(tok, &ids, back, len), len);
        assert_memory_equal(back, text, len);
        free(back);
        free(text);
        tkd_token_ids_free(&ids);
    }
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
}

/* Appends code point c as UTF-8. */
static size_t put_utf8(char *o, uint32_t c)
{
    if (c < 0x80)
        return o[0] = (char)c, 1;
    if (c < 0x800)
        return o[0] = (char)(0xC0 | c >> 6), o[1] = (char)(0x80 | (c & 63)), 2;
    if (c < 0x10000)
        return o[0] = (char)(0xE0 | c >> 12), o[1] = (char)(0x80 | (c >> 6 & 63)), o[2] = (char)(0x80 | (c & 63)), 3;
    o[0] = (char)(0xF0 | c >> 18), o[1] = (char)(0x80 | (c >> 12 & 63));
    return o[2] = (char)(0x80 | (c >> 6 & 63)), o[3] = (char)(0x80 | (c & 63)), 4;
}

/* Random valid UTF-8 (ASCII, whitespace, every plane, <|endoftext|> pieces) goes through GPT-2
 * (no normalizer) and decodes back to itself; random bytes (invalid UTF-8 included) never fail. */
static void test_random_round_trip(void **state)
{
    (void)state;
    tkd_tokenizer *tok = load_ok(tkd_test_src("fixtures/tokenizer/gpt2/tokenizer.json"));
    tkd_tokenizer_ctx *ctx = NULL;
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    uint64_t x = 88172645463325252ull;
    char text[4096], back[8192];
    tkd_token_ids ids = {0};
    for (int iter = 0; iter < 3000; iter++) {
        size_t n = 0;
        int len = (int)((x >> 33) % 300);
        for (int i = 0; i < len; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            uint32_t r = (uint32_t)(x >> 32), c;
            switch (r % 8) {
            case 0: c = " \t\n\r"[r / 8 % 4]; break;
            case 1: c = 0x80 + r / 8 % 0x780; break;
            case 2: c = 0x800 + r / 8 % 0xF800; break;
            case 3: c = 0x10000 + r / 8 % 0x100000; break;
            case 4: memcpy(text + n, "<|endoftext|>", 13), n += (r / 8 % 2) ? 13 : 7; continue;
            default: c = 0x20 + r / 8 % 0x5F; break;
            }
            if (c >= 0xD800 && c < 0xE000)
                c = 'x';
            n += put_utf8(text + n, c);
        }
        bool raw = iter % 3 == 0; /* every third: the same bytes with some flipped (invalid UTF-8) */
        for (size_t i = 0; raw && i < n; i += 1 + (x >> 40) % 7)
            text[i] = (char)(text[i] ^ 0x80);
        ids.n = 0;
        assert_int_equal(tkd_tokenizer_encode(ctx, text, n, &ids), TKD_OK);
        size_t at = decode_ids(tok, &ids, back, sizeof back);
        if (!raw) {
            assert_int_equal(at, n);
            assert_memory_equal(back, text, n);
        }
    }
    tkd_token_ids_free(&ids);
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
}

/* Qwen3 normalizes with NFC, stretch by stretch: decoding its ids must give utf8proc's NFC of the
 * whole text, for random mixes of letters, combining marks (in every order), jamo, precomposed and
 * singleton-decomposing characters. */
static void test_nfc_stretches(void **state)
{
    (void)state;
    static const uint32_t pool[] = {'a', 'e', 'o', 'A', ' ', '>', '=', 0x301, 0x300, 0x308, 0x323, 0x302, 0x338,
                                    0x1100, 0x1161, 0x11A8, 0xAC00, 0xE9, 0xC5, 0x212B, 0x2126, 0xF900, 0x4E2D,
                                    0x304B, 0x3099, 0x0B47, 0x0B3E, 0x1E9B, 0xFB01, 0x0344, 0x2000, 0x1F600};
    tkd_tokenizer *tok = load_ok(QWEN3_DIR);
    tkd_tokenizer_ctx *ctx = NULL;
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    char text[2048], back[4096];
    tkd_token_ids ids = {0};
    for (int iter = 0; iter < 2000; iter++) {
        size_t n = 0;
        for (int i = 0, len = iter % 60 + 1; i < len; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            n += put_utf8(text + n, pool[(x >> 32) % (sizeof pool / sizeof pool[0])]);
        }
        text[n] = 0;
        ids.n = 0;
        assert_int_equal(tkd_tokenizer_encode(ctx, text, n, &ids), TKD_OK);
        size_t at = decode_ids(tok, &ids, back, sizeof back);
        uint8_t *want = utf8proc_NFC((const uint8_t *)text);
        assert_non_null(want);
        if (at != strlen((char *)want) || memcmp(back, want, at) != 0)
            fail_msg("iteration %d: NFC differs for '%s'", iter, text);
        free(want);
    }
    tkd_token_ids_free(&ids);
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
}

/* ---- small made-up tokenizers ------------------------------------------------------------------- */

/* The byte-level character of byte b, as UTF-8 (GPT-2's bytes_to_unicode). */
static void byte_char(int b, char out[4])
{
    int cp = b, next = 256;
    for (int x = 0; x < 256; x++) {
        bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
        if (!printable && x == b)
            cp = next;
        next += !printable;
    }
    if (cp < 0x80) {
        out[0] = (char)cp, out[1] = 0;
    } else {
        out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 0x3F)), out[2] = 0;
    }
}

/* The parts of a made-up tokenizer.json; NULL takes the default. */
typedef struct mini {
    const char *merges;      /* JSON list */
    const char *extra_vocab; /* ", \"tok\": id" entries after the defaults */
    const char *model_extra; /* ", \"key\": value" in model */
    const char *added;       /* JSON list */
    const char *normalizer, *pre, *post, *decoder;
    const char *top_extra;   /* ", \"key\": value" at the top level */
    const char *config;      /* tokenizer_config.json text, or NULL for none */
} mini;

/* Vocabulary: the 256 bytes (id = byte), then he 256, ll 257, hell 258, hello 259, Ġw 260, or 261,
 * Ġwor 262, ld 263, Ġworld 264, Ġhello 265 (no merge makes it); added <|bos|> 266, <|eos|> 267. */
static const char default_merges[] = "[\"h e\", \"l l\", \"he ll\", \"hell o\", \"Ġ w\", \"o r\", \"Ġw or\", \"l d\", "
                                     "\"Ġwor ld\"]";
static const char default_added[] =
    "[{\"id\": 266, \"content\": \"<|bos|>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
    "\"normalized\": false, \"special\": true}, {\"id\": 267, \"content\": \"<|eos|>\", \"single_word\": false, "
    "\"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}]";
static const char byte_level_pre[] = "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
                                     "\"use_regex\": true}";

static const char *write_mini(const mini *m)
{
    const char *dir = tkd_test_path(tkd_test_group_dir, "mini");
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && rm -f '%s/tokenizer_config.json'", dir, dir);
    assert_int_equal(system(cmd), 0);
    const char *path = tkd_test_path(dir, "tokenizer.json");
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null%s,\n\"added_tokens\": %s,\n",
            m->top_extra ? m->top_extra : "", m->added ? m->added : default_added);
    fprintf(f, "\"normalizer\": %s,\n\"pre_tokenizer\": %s,\n\"post_processor\": %s,\n\"decoder\": %s,\n",
            m->normalizer ? m->normalizer : "null", m->pre ? m->pre : byte_level_pre, m->post ? m->post : "null",
            m->decoder ? m->decoder : "{\"type\": \"ByteLevel\"}");
    fprintf(f, "\"model\": {\"type\": \"BPE\", \"unk_token\": null%s, \"vocab\": {",
            m->model_extra ? m->model_extra : "");
    for (int b = 0; b < 256; b++) {
        char c[4];
        byte_char(b, c);
        fprintf(f, "%s\"%s%s\": %d", b ? ", " : "", b == '"' || b == '\\' ? "\\" : "", c, b);
    }
    fprintf(f, ", \"he\": 256, \"ll\": 257, \"hell\": 258, \"hello\": 259, \"Ġw\": 260, \"or\": 261, \"Ġwor\": 262, "
               "\"ld\": 263, \"Ġworld\": 264, \"Ġhello\": 265%s},\n\"merges\": %s}}\n",
            m->extra_vocab ? m->extra_vocab : "", m->merges ? m->merges : default_merges);
    fclose(f);
    if (m->config)
        tkd_test_write_text(tkd_test_path(dir, "tokenizer_config.json"), m->config);
    return path;
}

/* Encodes text with the made-up tokenizer m and compares with want (n ids). */
static void expect_ids(const mini *m, const char *text, const uint32_t *want, size_t n)
{
    tkd_tokenizer *tok = load_ok(write_mini(m));
    tkd_tokenizer_ctx *ctx = NULL;
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    tkd_token_ids got = {0};
    assert_int_equal(tkd_tokenizer_encode(ctx, text, strlen(text), &got), TKD_OK);
    tkd_token_ids w = {(uint32_t *)want, n, n};
    assert_same_ids(text, &got, &w);
    tkd_token_ids_free(&got);
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
}

static void test_bpe_basics(void **state)
{
    (void)state;
    mini m = {0};
    expect_ids(&m, "hello world", (uint32_t[]){259, 264}, 2);
    /* GPT-2's pattern: "hello" " world" "!!" "  " " x" — and <|eos|> cut out before it. */
    expect_ids(&m, "hello<|eos|> world!!   x", (uint32_t[]){259, 267, 264, '!', '!', ' ', ' ', ' ', 'x'}, 9);
    /* Not quite an added token: plain bytes. */
    expect_ids(&m, "<|eos|", (uint32_t[]){'<', '|', 'e', 'o', 's', '|'}, 6);
    /* " hello" is in the vocabulary but no merge makes it: BPE gives Ġ + hello ... */
    expect_ids(&m, " hello", (uint32_t[]){' ', 259}, 2);
    /* ... and ignore_merges takes the whole piece. */
    m.model_extra = ", \"ignore_merges\": true";
    expect_ids(&m, " hello", (uint32_t[]){265}, 1);
}

/* The lowest rank merges first; the leftmost pair on a tie; a later duplicate pair replaces the earlier rank. */
static void test_bpe_merge_order(void **state)
{
    (void)state;
    mini m = {.merges = "[\"l l\", \"h e\", \"he ll\", \"hell o\"]"};
    expect_ids(&m, "hello", (uint32_t[]){259}, 1);
    /* "ll" before "he" cannot change the result here, but "e l" ranked first does: h el l o. */
    m.extra_vocab = ", \"el\": 268";
    m.merges = "[\"e l\", \"h e\", \"l l\", \"he ll\", \"hell o\"]";
    expect_ids(&m, "hello", (uint32_t[]){'h', 268, 'l', 'o'}, 4);
    /* "lll": two overlapping "l l" pairs of one rank: the leftmost merges, ll + l. */
    expect_ids(&m, "lll", (uint32_t[]){257, 'l'}, 2);
    /* The same pair listed again at the end moves "e l" behind "h e": he ll o merges fully. */
    m.merges = "[\"e l\", \"h e\", \"l l\", \"he ll\", \"hell o\", \"e l\"]";
    expect_ids(&m, "hello", (uint32_t[]){259}, 1);
    /* [a, b] lists are the same merges as "a b" strings. */
    m.merges = "[[\"h\", \"e\"], [\"l\", \"l\"], [\"he\", \"ll\"], [\"hell\", \"o\"]]";
    m.extra_vocab = NULL;
    expect_ids(&m, "hello", (uint32_t[]){259}, 1);
}

/* Invalid UTF-8 is encoded as Rust's from_utf8_lossy makes it: one U+FFFD per maximal subpart. */
static void test_lossy_utf8(void **state)
{
    (void)state;
    mini m = {.pre = "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}"};
    const uint32_t R[3] = {0xEF, 0xBF, 0xBD}; /* U+FFFD's bytes, one token each in this vocabulary */
    static const struct {
        const char *text;
        int nrep; /* how many U+FFFD between 'a' and 'b' */
    } cases[] = {
        {"a\x80" "b", 1},             {"a\xC0\x80" "b", 2},     {"a\xE0\x80\x80" "b", 3},
        {"a\xED\xA0\x80" "b", 3},     {"a\xF0\x9F\x98" "b", 1}, {"a\xE4\xB8" "b", 1},
        {"a\xF4\x90\x80\x80" "b", 4}, {"a\xFF\xFE" "b", 2},     {"a\xC3\xC3" "b", 2},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        uint32_t want[2 + 3 * 4];
        size_t n = 0;
        want[n++] = 'a';
        for (int r = 0; r < cases[c].nrep; r++)
            for (int k = 0; k < 3; k++)
                want[n++] = R[k];
        want[n++] = 'b';
        expect_ids(&m, cases[c].text, want, n);
    }
    expect_ids(&m, "a\xE4\xB8", (uint32_t[]){'a', 0xEF, 0xBF, 0xBD}, 4); /* truncated at the end */
}

/* A normalized added token is matched after NFC: "e\u0301" written decomposed becomes é first. */
static void test_added_normalized(void **state)
{
    (void)state;
    mini m = {.normalizer = "{\"type\": \"NFC\"}",
              .added = "[{\"id\": 266, \"content\": \"caf\xC3\xA9\", \"single_word\": false, \"lstrip\": false, "
                       "\"rstrip\": false, \"normalized\": true, \"special\": false}, {\"id\": 267, \"content\": "
                       "\"x\xCC\x81\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
                       "\"normalized\": false, \"special\": true}]"};
    expect_ids(&m, "cafe\xCC\x81", (uint32_t[]){266}, 1);
    /* Its content is normalized too: written decomposed in the file, it still matches. */
    m.added = "[{\"id\": 266, \"content\": \"cafe\xCC\x81\", \"normalized\": true, \"special\": false}]";
    expect_ids(&m, "caf\xC3\xA9", (uint32_t[]){266}, 1);
    expect_ids(&m, "cafe\xCC\x81", (uint32_t[]){266}, 1);
    m.added = "[{\"id\": 266, \"content\": \"caf\xC3\xA9\", \"normalized\": true, \"special\": false}, "
              "{\"id\": 267, \"content\": \"x\xCC\x81\", \"normalized\": false, \"special\": true}]";
    /* A raw (normalized: false) token is matched before NFC, so its combining mark stays its own. */
    expect_ids(&m, "x\xCC\x81", (uint32_t[]){267}, 1);
}

static void test_template_and_config(void **state)
{
    (void)state;
    const uint32_t *ids;
    mini m = {.post = "{\"type\": \"Sequence\", \"processors\": [{\"type\": \"ByteLevel\"}, {\"type\": "
                      "\"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<|bos|>\", \"type_id\": 0}}, "
                      "{\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], \"pair\": [], \"special_tokens\": "
                      "{\"<|bos|>\": {\"id\": \"<|bos|>\", \"ids\": [266], \"tokens\": [\"<|bos|>\"]}}}]}"};
    tkd_tokenizer *tok = load_ok(write_mini(&m));
    assert_int_equal(tkd_tokenizer_prefix(tok, &ids), 1);
    assert_int_equal(ids[0], 266);
    assert_int_equal(tkd_tokenizer_suffix(tok, &ids), 0);
    assert_int_equal(tkd_tokenizer_eos_id(tok), -1);
    tkd_tokenizer_free(tok);
    /* tokenizer_config.json's add_bos_token / add_eos_token, when set, replace the template. */
    m.config = "{\"add_bos_token\": false, \"add_eos_token\": true, \"bos_token\": \"<|bos|>\", "
               "\"eos_token\": {\"content\": \"<|eos|>\"}}";
    tok = load_ok(write_mini(&m));
    assert_int_equal(tkd_tokenizer_prefix(tok, &ids), 0);
    assert_int_equal(tkd_tokenizer_suffix(tok, &ids), 1);
    assert_int_equal(ids[0], 267);
    assert_int_equal(tkd_tokenizer_eos_id(tok), 267);
    tkd_tokenizer_free(tok);
    m.config = "{\"add_bos_token\": true}";
    assert_int_equal(tkd_tokenizer_load(write_mini(&m), &tok), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("add_bos_token is true but bos_token is not set");
    assert_null(tok);
}

/* Each feature that is not implemented is refused with the file and the field named. */
static void test_refusals(void **state)
{
    (void)state;
    static const struct {
        mini m;
        tkd_status st;
        const char *msg;
    } cases[] = {
        {{.model_extra = ", \"byte_fallback\": true"}, TKD_ERR_UNSUPPORTED, "model.byte_fallback: true is not supported"},
        {{.model_extra = ", \"dropout\": 0.1"}, TKD_ERR_UNSUPPORTED, "model.dropout: 0.1 is not supported"},
        {{.model_extra = ", \"continuing_subword_prefix\": \"##\""}, TKD_ERR_UNSUPPORTED, "model.continuing_subword_prefix"},
        {{.model_extra = ", \"vocab_extra\": 1"}, TKD_ERR_UNSUPPORTED, "model.vocab_extra"},
        {{.normalizer = "{\"type\": \"Lowercase\"}"}, TKD_ERR_UNSUPPORTED, "normalizer: type Lowercase"},
        {{.pre = "{\"type\": \"Whitespace\"}"}, TKD_ERR_UNSUPPORTED, "pre_tokenizer: type Whitespace"},
        {{.pre = "null"}, TKD_ERR_UNSUPPORTED, "pre_tokenizer: null"},
        {{.pre = "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"\\\\s+\"}, \"behavior\": \"Isolated\", "
                 "\"invert\": false}"}, TKD_ERR_UNSUPPORTED, "does not end with ByteLevel"},
        {{.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": "
                 "\"\\\\s+\"}, \"behavior\": \"Removed\", \"invert\": false}, {\"type\": \"ByteLevel\"}]}"},
         TKD_ERR_UNSUPPORTED, "pre_tokenizer.pretokenizers[0].behavior: Removed"},
        {{.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": "
                 "\"\\\\w+\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\"}]}"},
         TKD_ERR_UNSUPPORTED, "the escape \\w"},
        {{.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": "
                 "\"[[:alpha:]]+\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\"}]}"},
         TKD_ERR_UNSUPPORTED, "POSIX bracket"},
        {{.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": "
                 "\"(\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\"}]}"},
         TKD_ERR_UNSUPPORTED, "PCRE2 cannot compile"},
        {{.post = "{\"type\": \"RobertaProcessing\"}"}, TKD_ERR_UNSUPPORTED, "post_processor: type RobertaProcessing"},
        {{.decoder = "{\"type\": \"WordPiece\"}"}, TKD_ERR_UNSUPPORTED, "decoder: type WordPiece"},
        {{.top_extra = ", \"extra\": 1"}, TKD_ERR_UNSUPPORTED, "tokenizer.json: extra: this key is not supported — "},
        {{.added = "[{\"id\": 266, \"content\": \"<|bos|>\", \"lstrip\": true}]"}, TKD_ERR_UNSUPPORTED,
         "added_tokens[0].lstrip"},
        {{.extra_vocab = ", \"bad\": -1"}, TKD_ERR_FORMAT, "model.vocab[\"bad\"]: the token id -1 is outside [0, 16777215]"},
        {{.merges = "[\"h e x\"]"}, TKD_ERR_FORMAT, "not two tokens separated by one space"},
        {{.merges = "[\"h zz\"]"}, TKD_ERR_FORMAT, "'zz' is not in model.vocab"},
        {{.merges = "[\"h o\"]"}, TKD_ERR_FORMAT, "the merged token is not in model.vocab"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tkd_tokenizer *tok = (tkd_tokenizer *)1;
        const char *path = write_mini(&cases[i].m);
        tkd_status st = tkd_tokenizer_load(path, &tok);
        if (st != cases[i].st || !strstr(tkd_error_msg(), cases[i].msg) || !strstr(tkd_error_msg(), path))
            fail_msg("case %zu: status %d, message '%s'; want %d and '%s'", i, st, tkd_error_msg(), cases[i].st,
                     cases[i].msg);
        assert_null(tok);
    }
    tkd_tokenizer *tok = NULL;
    assert_int_equal(tkd_tokenizer_load(tkd_test_path(tkd_test_group_dir, "none.json"), &tok), TKD_ERR_NOT_FOUND);
}

/* \s and \S become White_Space (Oniguruma's \s: PCRE2's own also takes U+180E); \uHHHH becomes \x{HHHH}. */
static void test_pattern_translation(void **state)
{
    (void)state;
    char *out = NULL;
    assert_int_equal(tkd_tok_translate_pattern("[^\\s\\p{L}]+|\\s+(?!\\S)|\\u00e9\\.", "p", &out), TKD_OK);
    assert_string_equal(out, "[^\\p{White_Space}\\p{L}]+|\\p{White_Space}+(?!\\P{White_Space})|\\x{00e9}\\.");
    free(out);
    assert_int_equal(tkd_tok_translate_pattern("a\\bc", "p", &out), TKD_ERR_UNSUPPORTED);
    assert_null(out);
    assert_int_equal(tkd_tok_translate_pattern("[:;]+", "p", &out), TKD_OK); /* a class of ':' and ';' */
    free(out);
    /* U+180E (Mongolian vowel separator) is not a space for tokenizers: "a\u180e b" cuts as "a\u180e" " b". */
    mini m = {.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": "
                     "\"\\\\S+|\\\\s+\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", "
                     "\"add_prefix_space\": false, \"use_regex\": false}]}",
              .merges = "[[\"a\", \"\xC3\xA1\"]]", .extra_vocab = ", \"a\xC3\xA1\": 268"};
    expect_ids(&m, "a\xE1\xA0\x8E b", (uint32_t[]){268, 0xA0, 0x8E, ' ', 'b'}, 5);
    /* A {"String": ...} pattern is literal: "l.l" splits "hel.lo" and not "hello" (PCRE2 refused
     * LITERAL with UCP, so no String pattern loaded). */
    m = (mini){.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"String\": "
                      "\"l.l\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", "
                      "\"add_prefix_space\": false, \"use_regex\": false}]}"};
    expect_ids(&m, "hel.lohello", (uint32_t[]){256, 'l', '.', 'l', 'o', 259}, 6);
}

/* Loads m and expects status st with every one of the NULL-terminated needles (and the file's path)
 * in the message. */
static void expect_refusal(const mini *m, tkd_status st, const char *const *needles, const char *what)
{
    tkd_tokenizer *tok = (tkd_tokenizer *)1;
    const char *path = write_mini(m);
    tkd_status got = tkd_tokenizer_load(path, &tok);
    bool ok = got == st && strstr(tkd_error_msg(), m->config ? "tokenizer_config.json" : path);
    for (const char *const *n = needles; *n && ok; n++)
        ok = strstr(tkd_error_msg(), *n) != NULL;
    if (!ok)
        fail_msg("%s: status %d, message '%s'; want %d", what, got, tkd_error_msg(), st);
    assert_null(tok);
}

#define REFUSED(m, st, ...) expect_refusal(&(m), st, (const char *const[]){__VA_ARGS__, NULL}, #m)

/* Issue 20, item 5: a key twice in an object is refused where cJSON took the first and Hugging Face
 * (serde, Python) the last, naming line and column; every field the loader reads has its type
 * checked, the error naming its JSON path; invalid UTF-8 and \u0000 are refused. */
static void test_strict_json(void **state)
{
    (void)state;
    mini m = {.extra_vocab = ", \"he\": 268"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer.json:", "duplicate key \"he\" (first at line");
    m = (mini){.top_extra = ", \"model\": {\"type\": \"BPE\"}"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer.json:", "duplicate key \"model\"");
    m = (mini){.top_extra = ", \"pre_tokenizer\": null"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer.json:4:1: duplicate key \"pre_tokenizer\" (first at line 1, column 57)");
    m = (mini){.config = "{\"eos_token\": \"<|bos|>\",\n \"eos_token\": \"<|eos|>\"}"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer_config.json:2:2: duplicate key \"eos_token\" (first at line 1, column 2)");
    /* types */
    m = (mini){.added = "{\"<|bos|>\": 266}"};
    REFUSED(m, TKD_ERR_FORMAT, "added_tokens: an array expected, not an object");
    m = (mini){.added = "[{\"id\": \"266\", \"content\": \"<|bos|>\"}]"};
    REFUSED(m, TKD_ERR_FORMAT, "added_tokens[0].id: a token id (an integer) expected, not a string");
    m = (mini){.added = "[{\"id\": 266, \"content\": \"<|bos|>\", \"normalized\": \"no\"}]"};
    REFUSED(m, TKD_ERR_FORMAT, "added_tokens[0].normalized: true or false expected, not a string");
    m = (mini){.added = "[266]"};
    REFUSED(m, TKD_ERR_FORMAT, "added_tokens[0]: an object expected, not a number");
    m = (mini){.extra_vocab = ", \"x1\": 268.0"}; /* cJSON reads 268; serde refuses a float for a u32 */
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer.json:7:", ": 268.0: a number with a fraction or an exponent where tokenizers reads an integer (an id)");
    m = (mini){.added = "[{\"id\": 2.66e2, \"content\": \"<|bos|>\"}]"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer.json:2:25: 2.66e2: a number with a fraction");
    m = (mini){.model_extra = ", \"dropout\": 0.0"}; /* the one number that is not an id: 0 is no dropout */
    expect_ids(&m, "hello", (uint32_t[]){259}, 1);
    m = (mini){.extra_vocab = ", \"x1\": 259"};
    REFUSED(m, TKD_ERR_FORMAT, "model.vocab[\"x1\"]: the id 259 is already another entry's");
    m = (mini){.model_extra = ", \"ignore_merges\": 1"};
    REFUSED(m, TKD_ERR_FORMAT, "model.ignore_merges: true or false expected, not a number");
    m = (mini){.model_extra = ", \"unk_token\": 0"}; /* the key given twice is refused first */
    REFUSED(m, TKD_ERR_FORMAT, "duplicate key \"unk_token\"");
    m = (mini){.pre = "{\"type\": \"ByteLevel\", \"add_prefix_space\": \"false\"}"};
    REFUSED(m, TKD_ERR_FORMAT, "pre_tokenizer.add_prefix_space: true or false expected, not a string");
    m = (mini){.pre = "{\"type\": 7}"};
    REFUSED(m, TKD_ERR_FORMAT, "pre_tokenizer.type: a string expected, not a number");
    m = (mini){.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": 5}, "
                      "\"behavior\": \"Isolated\"}, {\"type\": \"ByteLevel\"}]}"};
    REFUSED(m, TKD_ERR_FORMAT, "pre_tokenizer.pretokenizers[0].pattern.Regex: a string expected, not a number");
    m = (mini){.post = "{\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<|bos|>\"}}, "
                       "{\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {\"<|bos|>\": {\"ids\": [266.5]}}}"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer.json:5:165: 266.5: a number with a fraction");
    m.post = "{\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<|bos|>\"}}, "
             "{\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {\"<|bos|>\": {\"ids\": [\"266\"]}}}";
    REFUSED(m, TKD_ERR_FORMAT, "post_processor.special_tokens.<|bos|>.ids[0]: a token id (an integer) expected, not a string");
    m.post = "{\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<|bos|>\"}}, "
             "{\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {\"<|bos|>\": {\"ids\": [268]}}}";
    REFUSED(m, TKD_ERR_FORMAT, "post_processor.special_tokens.<|bos|>.ids[0]: an id outside the vocabulary");
    m = (mini){.model_extra = ", \"vocab\": []"};
    REFUSED(m, TKD_ERR_FORMAT, "duplicate key \"vocab\"");
    m = (mini){.config = "{\"eos_token\": 267}"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer_config.json: eos_token: a string, an object with \"content\" or null expected");
    m = (mini){.config = "{\"eos_token\": {\"content\": [\"<|eos|>\"]}}"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer_config.json: eos_token.content: a string expected, not an array");
    m = (mini){.config = "{\"add_bos_token\": \"true\", \"bos_token\": \"<|bos|>\"}"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer_config.json: add_bos_token: true, false or null expected, not a string");
    m = (mini){.config = "{\"eos_token\": \"<|eos|>\",}"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer_config.json:1:", "not valid JSON");
    /* text serde_json refuses: a vocabulary key that is not UTF-8, a NUL in a string */
    m = (mini){.extra_vocab = ", \"x\xC3\": 268"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer.json:", ": not valid UTF-8");
    m = (mini){.extra_vocab = ", \"he\\u0000x\": 268"};
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer.json:", "\\u0000 escape");
    /* and a file within the rules still loads and encodes */
    m = (mini){.config = "{\"eos_token\": {\"content\": \"<|eos|>\", \"lstrip\": false}, \"add_bos_token\": null}"};
    expect_ids(&m, "hello\\u0000", (uint32_t[]){259, '\\', 'u', '0', '0', '0', '0'}, 7);
}

/* Issue 20, item 11: a Sequence with an empty list passes its input through (tokenizers'
 * Sequence); one without its list, or with another type there, is refused naming the field. It
 * crashed the loader (exit 139). */
static void test_empty_sequences(void **state)
{
    (void)state;
    mini m = {.pre = "{\"type\": \"Sequence\", \"pretokenizers\": []}"};
    REFUSED(m, TKD_ERR_UNSUPPORTED, "pre_tokenizer: a chain that does not end with ByteLevel");
    m.pre = "{\"type\": \"Sequence\"}";
    REFUSED(m, TKD_ERR_FORMAT, "pre_tokenizer.pretokenizers: missing (an array expected)");
    m.pre = "{\"type\": \"Sequence\", \"pretokenizers\": {}}";
    REFUSED(m, TKD_ERR_FORMAT, "pre_tokenizer.pretokenizers: an array expected, not an object");
    m.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Sequence\"}, {\"type\": \"ByteLevel\"}]}";
    REFUSED(m, TKD_ERR_FORMAT, "pre_tokenizer.pretokenizers[0].pretokenizers: missing");
    m.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [null, {\"type\": \"ByteLevel\"}]}";
    REFUSED(m, TKD_ERR_FORMAT, "pre_tokenizer.pretokenizers[0]: an object expected, not null");
    m = (mini){.normalizer = "{\"type\": \"Sequence\"}"};
    REFUSED(m, TKD_ERR_FORMAT, "normalizer.normalizers: missing (an array expected)");
    m = (mini){.post = "{\"type\": \"Sequence\", \"processors\": 1}"};
    REFUSED(m, TKD_ERR_FORMAT, "post_processor.processors: an array expected, not a number");
    m = (mini){.decoder = "{\"type\": \"Sequence\", \"decoders\": []}"};
    REFUSED(m, TKD_ERR_UNSUPPORTED, "decoder: type Sequence is not supported");
    /* empty lists inside a chain that ends with ByteLevel: the same ids as ByteLevel alone */
    m = (mini){.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Sequence\", \"pretokenizers\": []}, "
                      "{\"type\": \"ByteLevel\", \"add_prefix_space\": false}]}",
               .normalizer = "{\"type\": \"Sequence\", \"normalizers\": []}",
               .post = "{\"type\": \"Sequence\", \"processors\": []}"};
    expect_ids(&m, "hello world", (uint32_t[]){259, 264}, 2);
    tkd_tokenizer *tok = load_ok(write_mini(&m));
    const uint32_t *ids;
    assert_int_equal(tkd_tokenizer_prefix(tok, &ids), 0);
    tkd_tokenizer_free(tok);
}

/* Issue 20, item 12: ids above TKD_TOKENIZER_MAX_ID, or an id space far larger than the entries,
 * are refused naming the id (2^31 - 1 reported "out of memory for -2147483648 tokens", 3e8
 * allocated 1.3 GB). */
static void test_id_limits(void **state)
{
    (void)state;
    mini m = {.extra_vocab = ", \"x1\": 2147483647"};
    REFUSED(m, TKD_ERR_FORMAT, "model.vocab[\"x1\"]: the token id 2147483647 is outside [0, 16777215]");
    m.extra_vocab = ", \"x1\": 300000000";
    REFUSED(m, TKD_ERR_FORMAT, "model.vocab[\"x1\"]: the token id 300000000 is outside [0, 16777215]");
    m.extra_vocab = ", \"x1\": 100000000000000000000000000000000000000000";
    REFUSED(m, TKD_ERR_FORMAT, "model.vocab[\"x1\"]: the token id 1e+41 is outside");
    m.extra_vocab = ", \"x1\": 3e8"; /* as serde: an exponent is a float, never an id */
    REFUSED(m, TKD_ERR_FORMAT, "tokenizer.json:7:", ": 3e8: a number with a fraction or an exponent");
    /* 269 entries (267 in the vocabulary, 2 added): ids below 4 x 269 + 2^20 are accepted */
    m.extra_vocab = ", \"x1\": 1049652";
    REFUSED(m, TKD_ERR_FORMAT, "model.vocab[\"x1\"]: the id 1049652 leaves most ids without a token (269 entries in all)");
    m.extra_vocab = NULL;
    m.added = "[{\"id\": 16777215, \"content\": \"<|bos|>\"}]";
    REFUSED(m, TKD_ERR_FORMAT, "added_tokens[0].id: the id 16777215 leaves most ids without a token");
    m.added = "[{\"id\": 16777216, \"content\": \"<|bos|>\"}]";
    REFUSED(m, TKD_ERR_FORMAT, "added_tokens[0].id: the token id 16777216 is outside [0, 16777215]");
    m.added = NULL;
    m.extra_vocab = ", \"x1\": 1049651";
    tkd_tokenizer *tok = load_ok(write_mini(&m));
    assert_int_equal(tkd_tokenizer_vocab_size(tok), 1049652);
    tkd_tokenizer_free(tok);
}

/* Issue 20, item 6: a Split pattern that backtracks over a long piece. (?:ab)+(?=z) runs to the
 * end of 10 KB of "ab" at every position before failing; PCRE2's default JIT stack (32 KiB) ran
 * out and the error was taken for "no more matches", leaving the rest one piece (merged into
 * "abab" tokens here). Each "ab" is its own piece, as in Hugging Face; and a match that does stop
 * at a limit is an error naming the pattern and the byte, never a different cut. */
static void test_split_backtracking(void **state)
{
    (void)state;
    mini m = {.pre = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": "
                     "\"(?:ab)+(?=z)|ab\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", "
                     "\"add_prefix_space\": false, \"use_regex\": false}]}",
              .merges = "[\"a b\", \"ab ab\"]", .extra_vocab = ", \"ab\": 268, \"abab\": 269"};
    enum { PAIRS = 5000 };
    char *text = malloc(2 * PAIRS + 1);
    for (int i = 0; i < PAIRS; i++)
        memcpy(text + 2 * i, "ab", 2);
    text[2 * PAIRS] = '\0';
    tkd_tokenizer *tok = load_ok(write_mini(&m));
    tkd_tokenizer_ctx *ctx = NULL;
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    tkd_token_ids got = {0};
    assert_int_equal(tkd_tokenizer_encode(ctx, text, 2 * PAIRS, &got), TKD_OK);
    assert_int_equal(got.n, PAIRS);
    for (size_t i = 0; i < got.n; i++)
        if (got.ids[i] != 268)
            fail_msg("id %zu of %zu is %u, want 268 (\"ab\")", i, got.n, got.ids[i]);
    /* with a limit this pattern reaches: an error, at the piece where it stopped */
    tkd_tok_ctx_limit_match(ctx, 1000);
    got.n = 0;
    assert_int_equal(tkd_tokenizer_encode(ctx, text, 2 * PAIRS, &got), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("tokenizer.json: pre_tokenizer.pretokenizers[0].pattern: PCRE2 failed to match at byte 0 "
                            "of the text (in a piece of 10000 bytes): match limit exceeded");
    free(text);
    tkd_token_ids_free(&got);
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
}

/* The textbook BPE (tokenizers' word.rs without a heap): repeatedly merge the lowest-ranked pair,
 * the leftmost on a tie. O(n^2): the reference for long pieces. */
static size_t bpe_reference(const tkd_tokenizer *tok, const uint8_t *s, size_t n, uint32_t *ids)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (tok->byte_id[s[i]] != TKD_TOK_NONE)
            ids[k++] = tok->byte_id[s[i]];
    for (;;) {
        size_t best = SIZE_MAX;
        uint32_t rank = UINT32_MAX, merged = 0;
        for (size_t i = 0; i + 1 < k; i++) {
            const tkd_tok_pair_slot *p = tkd_tok_pairmap_get(&tok->merges, ids[i], ids[i + 1]);
            if (p && p->rank < rank)
                best = i, rank = p->rank, merged = p->merged;
        }
        if (best == SIZE_MAX)
            return k;
        ids[best] = merged;
        memmove(ids + best + 1, ids + best + 2, (k - best - 2) * sizeof *ids);
        k--;
    }
}

/* Long single words (one piece each, thousands of bytes: the heap holds thousands of pairs) get the
 * reference's ids: random letters, a run of one letter (ties everywhere), runs of two. */
static void test_long_words(void **state)
{
    (void)state;
    tkd_tokenizer *tok = load_ok(tkd_test_src("fixtures/tokenizer/gpt2/tokenizer.json"));
    tkd_tokenizer_ctx *ctx = NULL;
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    enum { N = 3000 };
    char *text = malloc(N + 1);
    uint32_t *want = malloc(N * sizeof *want);
    uint64_t x = 12345;
    tkd_token_ids got = {0};
    for (int iter = 0; iter < 6; iter++) {
        size_t n = N - (size_t)iter * 7;
        for (size_t i = 0; i < n; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            text[i] = iter == 0 ? 'a' : iter == 1 ? "ab"[x % 2] : iter == 2 ? "eeeeet"[x % 6] : (char)('a' + x % 26);
        }
        got.n = 0;
        assert_int_equal(tkd_tokenizer_encode(ctx, text, n, &got), TKD_OK);
        size_t k = bpe_reference(tok, (const uint8_t *)text, n, want);
        tkd_token_ids w = {want, k, k};
        assert_same_ids("long word", &got, &w);
    }
    free(text);
    free(want);
    tkd_token_ids_free(&got);
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
}

TKD_TEST_MAIN_WITH(tkd_test_group_dir_setup, tkd_test_group_dir_teardown, TKD_TEST_EACH_NONE, test_parity_gpt2,
    test_parity_qwen3, test_parity_llama3, test_real_specials, test_decode_round_trip,
    test_random_round_trip, test_nfc_stretches, test_bpe_basics, test_bpe_merge_order, test_lossy_utf8,
    test_added_normalized, test_template_and_config, test_refusals, test_pattern_translation,
    test_strict_json, test_empty_sequences, test_id_limits, test_split_backtracking, test_long_words)
