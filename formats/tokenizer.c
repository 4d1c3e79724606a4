/* tokenizer.c — reads a Hugging Face tokenizer.json (and tokenizer_config.json beside it) into the
 * tables of tokenizer_internal.h; see tokenizer.h for what is accepted. Every field of the file is
 * either understood or refused by name: an encoder that skipped a field it does not implement
 * would give other ids than Hugging Face without saying so.
 */
#include "formats/tokenizer.h"

#include "common/fileio.h"
#include "formats/tokenizer_internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <utf8proc.h>

/* GPT-2's pattern, which ByteLevel applies when use_regex is true (tokenizers' byte_level.rs). */
static const char gpt2_pattern[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ---- the byte-level alphabet -------------------------------------------------------------- */

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes for
 * U+0100 onwards in byte order. char_byte[c] is the byte that code point c stands for, or -1. */
static void byte_alphabet(int16_t char_byte[324])
{
    for (int c = 0; c < 324; c++)
        char_byte[c] = -1;
    int next = 256;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        char_byte[printable ? b : next++] = (int16_t)b;
    }
}

/* Decodes one UTF-8 code point from the NUL-terminated s; returns its length. A malformed
 * sequence gives cp = UINT32_MAX and length 1 (it is then outside the byte-level alphabet). */
static int utf8_next(const uint8_t *s, uint32_t *cp)
{
    int need = s[0] < 0x80 ? 0 : s[0] < 0xC0 ? -1 : s[0] < 0xE0 ? 1 : s[0] < 0xF0 ? 2 : 3;
    for (int i = 1; i <= need; i++)
        if ((s[i] & 0xC0) != 0x80)
            need = -1;
    if (need < 0) {
        *cp = UINT32_MAX;
        return 1;
    }
    if (s[0] < 0x80) {
        *cp = s[0];
        return 1;
    }
    if (s[0] < 0xE0) {
        *cp = (uint32_t)(s[0] & 0x1F) << 6 | (s[1] & 0x3F);
        return 2;
    }
    if (s[0] < 0xF0) {
        *cp = (uint32_t)(s[0] & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
        return 3;
    }
    *cp = (uint32_t)(s[0] & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 | (uint32_t)(s[2] & 0x3F) << 6 | (s[3] & 0x3F);
    return 4;
}

/* A vocabulary string in the byte-level alphabet -> its bytes in out (capacity >= strlen(s)).
 * Returns the byte count, or -1 when s holds a character outside the alphabet. */
static long byte_level_decode(const int16_t char_byte[324], const char *s, uint8_t *out)
{
    const uint8_t *p = (const uint8_t *)s;
    long n = 0;
    while (*p) {
        uint32_t cp;
        p += utf8_next(p, &cp);
        if (cp >= 324 || char_byte[cp] < 0)
            return -1;
        out[n++] = (uint8_t)char_byte[cp];
    }
    return n;
}

/* ---- maps ------------------------------------------------------------------------------------ */

static size_t table_size(size_t n)
{
    size_t cap = 16;
    while (cap < 2 * n)
        cap <<= 1;
    return cap;
}

uint32_t tkd_tok_strmap_get(const tkd_tokenizer *tok, const tkd_tok_strmap *m, const uint8_t *s, size_t n)
{
    uint64_t h = tkd_tok_hash(s, n);
    uint32_t h32 = (uint32_t)(h >> 32);
    for (size_t i = (size_t)h & m->mask;; i = (i + 1) & m->mask) {
        uint64_t slot = m->slots[i];
        if (slot == 0)
            return TKD_TOK_NONE;
        uint32_t id = (uint32_t)slot - 1;
        if ((uint32_t)(slot >> 32) == h32 && tok->len[id] == n && memcmp(tok->bytes + tok->off[id], s, n) == 0)
            return id;
    }
}

/* Inserts id (whose bytes are already in tok->bytes) unless its bytes are there already. */
static void strmap_put(tkd_tokenizer *tok, tkd_tok_strmap *m, uint32_t id)
{
    const uint8_t *s = tok->bytes + tok->off[id];
    if (tkd_tok_strmap_get(tok, m, s, tok->len[id]) != TKD_TOK_NONE)
        return;
    uint64_t h = tkd_tok_hash(s, tok->len[id]);
    size_t i = (size_t)h & m->mask;
    while (m->slots[i] != 0)
        i = (i + 1) & m->mask;
    m->slots[i] = (h >> 32) << 32 | ((uint64_t)id + 1);
}

/* A later duplicate of a pair replaces the earlier one, as tokenizers' HashMap collect does. */
static void pairmap_put(tkd_tok_pairmap *m, uint32_t left, uint32_t right, uint32_t rank, uint32_t merged)
{
    uint64_t key = (uint64_t)left << 32 | right;
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t)(h >> 20) & m->mask;
    while (m->slots[i].key != UINT64_MAX && m->slots[i].key != key)
        i = (i + 1) & m->mask;
    m->slots[i] = (tkd_tok_pair_slot){key, rank, merged};
}

/* ---- loading state ----------------------------------------------------------------------- */

typedef struct loader {
    tkd_tokenizer *tok;
    const char *path;   /* tokenizer.json, for messages */
    int16_t char_byte[324];
    size_t bytes_cap;
} loader;

static tkd_status refuse(const loader *L, const char *field, const char *what)
{
    tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: %s: %s is not supported", L->path, field, what);
    return tkd_error_hint(TKD_ERR_UNSUPPORTED, "topkd reads the byte-level BPE tokenizers of GPT-2, Llama 3 and "
                          "Qwen2/2.5/3 (docs/teacher-dump.md, \"Tokenizing text\")");
}

static tkd_status malformed(const loader *L, const char *field, const char *what)
{
    return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: %s", L->path, field, what);
}

/* Appends n bytes to tok->bytes; returns their offset through *off. */
static tkd_status add_bytes(loader *L, const uint8_t *s, size_t n, uint32_t *off)
{
    tkd_tokenizer *tok = L->tok;
    if (tok->nbytes + n > L->bytes_cap) {
        size_t cap = L->bytes_cap ? L->bytes_cap * 2 : 1 << 20;
        while (cap < tok->nbytes + n)
            cap *= 2;
        uint8_t *p = realloc(tok->bytes, cap);
        if (!p)
            return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", L->path);
        tok->bytes = p;
        L->bytes_cap = cap;
    }
    memcpy(tok->bytes + tok->nbytes, s, n);
    *off = (uint32_t)tok->nbytes;
    tok->nbytes += n;
    return TKD_OK;
}

/* A JSON value that must be null, false, 0, "" or absent (the feature it turns on is not
 * implemented); the message shows the value found. */
static tkd_status want_off(const loader *L, const cJSON *obj, const char *key, const char *where)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v))
        return TKD_OK;
    if (cJSON_IsNumber(v) && v->valuedouble == 0)
        return TKD_OK;
    if (cJSON_IsString(v) && v->valuestring[0] == '\0')
        return TKD_OK;
    char field[96], what[64];
    char *text = cJSON_PrintUnformatted(v);
    snprintf(field, sizeof field, "%s%s%s", where, *where ? "." : "", key);
    snprintf(what, sizeof what, "%.40s%s", text ? text : "this value", text && strlen(text) > 40 ? "..." : "");
    free(text);
    return refuse(L, field, what);
}

/* Every key of obj must be in the NULL-terminated list. */
static tkd_status known_keys(const loader *L, const cJSON *obj, const char *where, const char *const *keys)
{
    for (const cJSON *it = obj ? obj->child : NULL; it; it = it->next) {
        bool ok = false;
        for (const char *const *k = keys; *k && !ok; k++)
            ok = strcmp(*k, it->string) == 0;
        if (!ok) {
            char field[128];
            snprintf(field, sizeof field, "%s%s%s", where, *where ? "." : "", it->string);
            return refuse(L, field, "this key");
        }
    }
    return TKD_OK;
}

static const char *type_of(const cJSON *obj)
{
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(obj, "type");
    return cJSON_IsString(t) ? t->valuestring : NULL;
}

static bool flag(const cJSON *obj, const char *key, bool dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
}

typedef tkd_status (*node_fn)(loader *L, const cJSON *node);

/* A Sequence (normalizer, pre-tokenizer, post-processor): each member of its list_key, in order. */
static tkd_status each_member(loader *L, const cJSON *node, const char *list_key, node_fn fn)
{
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(node, list_key);
    for (const cJSON *it = cJSON_IsArray(list) ? list->child : NULL; it; it = it->next)
        TKD_TRY(fn(L, it));
    return TKD_OK;
}

static tkd_status refuse_type(const loader *L, const char *field, const char *type)
{
    char what[96];
    snprintf(what, sizeof what, "type %s", type ? type : "(none)");
    return refuse(L, field, what);
}

/* ---- model: vocabulary and merges -------------------------------------------------------- */

static tkd_status max_id(const loader *L, const cJSON *vocab, const cJSON *added, int *out)
{
    long best = -1;
    for (const cJSON *it = vocab->child; it; it = it->next) {
        if (!cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble >= (1u << 31) || it->valuedouble != (long)it->valuedouble)
            return malformed(L, "model.vocab", "an id that is not an integer in [0, 2^31)");
        best = it->valueint > best ? it->valueint : best;
    }
    for (const cJSON *it = added ? added->child : NULL; it; it = it->next) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "id");
        if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= (1u << 31))
            return malformed(L, "added_tokens", "an entry without an integer id in [0, 2^31)");
        best = id->valueint > best ? id->valueint : best;
    }
    if (best < 0)
        return malformed(L, "model.vocab", "empty");
    *out = (int)best + 1;
    return TKD_OK;
}

static tkd_status alloc_tables(loader *L, int nvocab)
{
    tkd_tokenizer *tok = L->tok;
    size_t v = (size_t)tok->vocab_size;
    tok->off = malloc(v * sizeof *tok->off);
    tok->len = calloc(v, sizeof *tok->len);
    tok->vocab.mask = table_size((size_t)nvocab) - 1;
    tok->vocab.slots = calloc(tok->vocab.mask + 1, sizeof *tok->vocab.slots);
    if (!tok->off || !tok->len || !tok->vocab.slots)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory for %d tokens", L->path, tok->vocab_size);
    memset(tok->off, 0xFF, v * sizeof *tok->off);
    for (int b = 0; b < 256; b++)
        tok->byte_id[b] = TKD_TOK_NONE;
    return TKD_OK;
}

/* Vocabulary entries in the byte-level alphabet enter the map under their bytes; an entry with
 * other characters can never come out of a byte-level pre-tokenizer, so it is kept for decoding
 * only (as its UTF-8 text). */
static tkd_status load_vocab(loader *L, const cJSON *vocab)
{
    tkd_tokenizer *tok = L->tok;
    uint8_t *buf = NULL;
    size_t bufcap = 0;
    tkd_status st = TKD_OK;
    for (const cJSON *it = vocab->child; it && st == TKD_OK; it = it->next) {
        size_t n = strlen(it->string);
        if (n + 1 > bufcap) {
            bufcap = 2 * (n + 1);
            uint8_t *p = realloc(buf, bufcap);
            if (!p) {
                st = tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", L->path);
                break;
            }
            buf = p;
        }
        uint32_t id = (uint32_t)it->valueint;
        long nb = byte_level_decode(L->char_byte, it->string, buf);
        st = add_bytes(L, nb >= 0 ? buf : (const uint8_t *)it->string, nb >= 0 ? (size_t)nb : n, &tok->off[id]);
        if (st != TKD_OK)
            break;
        tok->len[id] = nb >= 0 ? (uint32_t)nb : (uint32_t)n;
        if (nb < 0)
            continue;
        strmap_put(tok, &tok->vocab, id);
        if (nb == 1 && tok->byte_id[buf[0]] == TKD_TOK_NONE)
            tok->byte_id[buf[0]] = id;
    }
    free(buf);
    return st;
}

/* One side of a merge (a vocabulary string) -> its id; the error names the merge. */
static tkd_status merge_side(loader *L, const char *s, size_t n, long idx, uint32_t *id, uint8_t *scratch)
{
    char tmp[1024];
    if (n >= sizeof tmp)
        return malformed(L, "model.merges", "a merge longer than 1023 bytes");
    memcpy(tmp, s, n);
    tmp[n] = '\0';
    long nb = byte_level_decode(L->char_byte, tmp, scratch);
    *id = nb < 0 ? TKD_TOK_NONE : tkd_tok_strmap_get(L->tok, &L->tok->vocab, scratch, (size_t)nb);
    if (*id == TKD_TOK_NONE)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: model.merges[%ld]: '%s' is not in model.vocab", L->path, idx, tmp);
    return TKD_OK;
}

/* Merge i as its two sides: "a b" (one space) or ["a", "b"]. */
static tkd_status merge_parts(const loader *L, const cJSON *m, long i, const char **a, size_t *na, const char **b,
                              size_t *nb)
{
    if (cJSON_IsString(m)) {
        const char *sp = strchr(m->valuestring, ' ');
        if (!sp || strchr(sp + 1, ' '))
            return tkd_error_set(TKD_ERR_FORMAT, "%s: model.merges[%ld]: '%s' is not two tokens separated by one space",
                                 L->path, i, m->valuestring);
        *a = m->valuestring, *na = (size_t)(sp - m->valuestring);
        *b = sp + 1, *nb = strlen(sp + 1);
        return TKD_OK;
    }
    if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) && cJSON_IsString(m->child->next)) {
        *a = m->child->valuestring, *na = strlen(*a);
        *b = m->child->next->valuestring, *nb = strlen(*b);
        return TKD_OK;
    }
    return tkd_error_set(TKD_ERR_FORMAT, "%s: model.merges[%ld]: neither \"a b\" nor [\"a\", \"b\"]", L->path, i);
}

static tkd_status load_merges(loader *L, const cJSON *merges)
{
    tkd_tokenizer *tok = L->tok;
    long n = cJSON_GetArraySize(merges);
    tok->merges.mask = table_size((size_t)n) - 1;
    tok->merges.slots = malloc((tok->merges.mask + 1) * sizeof *tok->merges.slots);
    if (!tok->merges.slots)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory for %ld merges", L->path, n);
    memset(tok->merges.slots, 0xFF, (tok->merges.mask + 1) * sizeof *tok->merges.slots);
    uint8_t scratch[2048];
    long i = 0;
    for (const cJSON *m = merges->child; m; m = m->next, i++) {
        const char *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        uint32_t ia, ib;
        tkd_status st = merge_parts(L, m, i, &a, &na, &b, &nb);
        if (st == TKD_OK)
            st = merge_side(L, a, na, i, &ia, scratch);
        if (st == TKD_OK)
            st = merge_side(L, b, nb, i, &ib, scratch);
        if (st != TKD_OK)
            return st;
        size_t la = tok->len[ia], lb = tok->len[ib];
        if (la + lb > sizeof scratch)
            return malformed(L, "model.merges", "a merged token longer than 2048 bytes");
        memcpy(scratch, tok->bytes + tok->off[ia], la);
        memcpy(scratch + la, tok->bytes + tok->off[ib], lb);
        uint32_t merged = tkd_tok_strmap_get(tok, &tok->vocab, scratch, la + lb);
        if (merged == TKD_TOK_NONE)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: model.merges[%ld]: the merged token is not in model.vocab",
                                 L->path, i);
        pairmap_put(&tok->merges, ia, ib, (uint32_t)i, merged);
    }
    return TKD_OK;
}

static tkd_status load_model(loader *L, const cJSON *model, const cJSON *added)
{
    static const char *const keys[] = {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                                       "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges", NULL};
    const char *type = type_of(model);
    if (!cJSON_IsObject(model))
        return malformed(L, "model", "missing");
    if (type && strcmp(type, "BPE") != 0)
        return refuse_type(L, "model.type", type);
    tkd_status st = known_keys(L, model, "model", keys);
    if (st == TKD_OK)
        st = want_off(L, model, "dropout", "model");
    if (st == TKD_OK)
        st = want_off(L, model, "byte_fallback", "model");
    if (st == TKD_OK)
        st = want_off(L, model, "continuing_subword_prefix", "model");
    if (st == TKD_OK)
        st = want_off(L, model, "end_of_word_suffix", "model");
    if (st != TKD_OK)
        return st;
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!cJSON_IsObject(vocab) || !cJSON_IsArray(merges))
        return malformed(L, "model", "vocab (an object) and merges (a list) are required");
    L->tok->ignore_merges = flag(model, "ignore_merges", false);
    st = max_id(L, vocab, added, &L->tok->vocab_size);
    if (st == TKD_OK)
        st = alloc_tables(L, cJSON_GetArraySize(vocab));
    if (st == TKD_OK)
        st = load_vocab(L, vocab);
    if (st == TKD_OK)
        st = load_merges(L, merges);
    /* With an unk_token, tokenizers puts it where a byte has no token; we never need to when all
     * 256 bytes have one. Without an unk_token such a byte is dropped, as tokenizers does. */
    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    for (int b = 0; st == TKD_OK && cJSON_IsString(unk) && b < 256; b++)
        if (L->tok->byte_id[b] == TKD_TOK_NONE)
            st = refuse(L, "model.unk_token", "an unk_token with bytes missing from the vocabulary");
    return st;
}

/* ---- added tokens -------------------------------------------------------------------------- */

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Sorts one pass's tokens by first byte, longest first within a byte (leftmost-longest matching,
 * as tokenizers' aho-corasick with MatchKind::LeftmostLongest). */
static tkd_status build_added_pass(loader *L, tkd_tok_added *pass, const bool *in_pass)
{
    tkd_tokenizer *tok = L->tok;
    pass->order = malloc((tok->n_added + 1) * sizeof *pass->order);
    if (!pass->order)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", L->path);
    size_t count[257] = {0};
    for (size_t i = 0; i < tok->n_added; i++)
        if (in_pass[i])
            count[tok->bytes[tok->added_off[i]] + 1]++;
    for (int b = 0; b < 256; b++)
        count[b + 1] += count[b];
    for (int b = 0; b <= 256; b++)
        pass->start[b] = (uint32_t)count[b];
    for (size_t i = 0; i < tok->n_added; i++)
        if (in_pass[i])
            pass->order[count[tok->bytes[tok->added_off[i]]]++] = (uint32_t)i;
    pass->n = pass->start[256];
    /* Within a bucket: longest first, then file order (keys: ~length << 32 | index). */
    uint64_t *keys = malloc((pass->n + 1) * sizeof *keys);
    if (!keys)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", L->path);
    for (size_t j = 0; j < pass->n; j++)
        keys[j] = (uint64_t)(~tok->added_len[pass->order[j]]) << 32 | pass->order[j];
    for (int b = 0; b < 256; b++)
        qsort(keys + pass->start[b], pass->start[b + 1] - pass->start[b], sizeof *keys, cmp_u64);
    for (size_t j = 0; j < pass->n; j++)
        pass->order[j] = (uint32_t)keys[j];
    free(keys);
    return TKD_OK;
}

static tkd_status added_entry(loader *L, const cJSON *it, size_t i, bool *normalized)
{
    static const char *const keys[] = {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special", NULL};
    tkd_tokenizer *tok = L->tok;
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
    if (!cJSON_IsString(content) || content->valuestring[0] == '\0')
        return malformed(L, "added_tokens", "an entry without a non-empty content");
    char where[96];
    snprintf(where, sizeof where, "added_tokens[%zu]", i);
    tkd_status st = known_keys(L, it, where, keys);
    if (st == TKD_OK)
        st = want_off(L, it, "single_word", where);
    if (st == TKD_OK)
        st = want_off(L, it, "lstrip", where);
    if (st == TKD_OK)
        st = want_off(L, it, "rstrip", where);
    if (st != TKD_OK)
        return st;
    uint32_t id = (uint32_t)cJSON_GetObjectItemCaseSensitive(it, "id")->valueint;
    *normalized = flag(it, "normalized", false);
    /* tokenizers matches a normalized token by its content after the normalizer. */
    uint8_t *nfc = *normalized && tok->nfc ? utf8proc_NFC((const uint8_t *)content->valuestring) : NULL;
    const char *text = nfc ? (const char *)nfc : content->valuestring;
    size_t n = strlen(text);
    st = add_bytes(L, (const uint8_t *)text, n, &tok->added_off[i]);
    free(nfc);
    tok->added_len[i] = (uint32_t)n;
    tok->added_id[i] = id;
    /* An id in both the vocabulary and the added tokens keeps its vocabulary bytes: they are the
     * vocabulary map's key. */
    if (tok->off[id] == TKD_TOK_NONE) {
        tok->off[id] = tok->added_off[i];
        tok->len[id] = (uint32_t)n;
    }
    *normalized = flag(it, "normalized", false);
    return st;
}

static tkd_status load_added(loader *L, const cJSON *added)
{
    tkd_tokenizer *tok = L->tok;
    size_t n = cJSON_IsArray(added) ? (size_t)cJSON_GetArraySize(added) : 0;
    tok->added_id = malloc((n + 1) * sizeof *tok->added_id);
    tok->added_off = malloc((n + 1) * sizeof *tok->added_off);
    tok->added_len = malloc((n + 1) * sizeof *tok->added_len);
    bool *norm = calloc(n + 1, sizeof *norm), *raw = calloc(n + 1, sizeof *raw);
    tkd_status st = tok->added_id && tok->added_off && tok->added_len && norm && raw ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", L->path);
    size_t i = 0;
    for (const cJSON *it = n ? added->child : NULL; it && st == TKD_OK; it = it->next, i++) {
        st = added_entry(L, it, i, &norm[i]);
        raw[i] = !norm[i];
    }
    tok->n_added = i;
    if (st == TKD_OK)
        st = build_added_pass(L, &tok->added_raw, raw);
    if (st == TKD_OK)
        st = build_added_pass(L, &tok->added_norm, norm);
    free(norm);
    free(raw);
    return st;
}

/* ---- normalizer and pre-tokenizers -------------------------------------------------------- */

static tkd_status load_normalizer(loader *L, const cJSON *norm)
{
    if (!norm || cJSON_IsNull(norm))
        return TKD_OK;
    const char *type = type_of(norm);
    if (type && strcmp(type, "NFC") == 0) {
        L->tok->nfc = true;
        return TKD_OK;
    }
    if (type && strcmp(type, "Sequence") == 0)
        return each_member(L, norm, "normalizers", load_normalizer);
    return refuse_type(L, "normalizer", type);
}

static tkd_status compile_pattern(loader *L, const char *pattern, bool literal, const char *what, pcre2_code **out,
                                  bool *jit)
{
    char *translated = NULL;
    tkd_status st = literal ? TKD_OK : tkd_tok_translate_pattern(pattern, what, &translated);
    if (st != TKD_OK)
        return tkd_error_prefix(st, "%s: ", L->path);
    int err;
    PCRE2_SIZE at;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    *out = pcre2_compile((PCRE2_SPTR)(literal ? pattern : translated), PCRE2_ZERO_TERMINATED, opts, &err, &at, NULL);
    free(translated);
    if (!*out) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: %s: PCRE2 cannot compile the pattern at offset %zu: %s", L->path,
                             what, (size_t)at, (const char *)msg);
    }
    *jit = pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE) == 0; /* else pcre2_match interprets it */
    return TKD_OK;
}

static tkd_status add_step(loader *L, tkd_tok_step step)
{
    tkd_tokenizer *tok = L->tok;
    tkd_tok_step *p = realloc(tok->steps, (size_t)(tok->nsteps + 1) * sizeof *p);
    if (!p) {
        pcre2_code_free(step.re);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", L->path);
    }
    tok->steps = p;
    tok->steps[tok->nsteps++] = step;
    return TKD_OK;
}

static tkd_status load_split(loader *L, const cJSON *node)
{
    static const char *const keys[] = {"type", "pattern", "behavior", "invert", NULL};
    tkd_status st = known_keys(L, node, "pre_tokenizer(Split)", keys);
    if (st == TKD_OK)
        st = want_off(L, node, "invert", "pre_tokenizer(Split)");
    if (st != TKD_OK)
        return st;
    const cJSON *behavior = cJSON_GetObjectItemCaseSensitive(node, "behavior");
    if (!cJSON_IsString(behavior) || strcmp(behavior->valuestring, "Isolated") != 0)
        return refuse(L, "pre_tokenizer(Split).behavior", cJSON_IsString(behavior) ? behavior->valuestring : "(none)");
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(node, "pattern");
    const cJSON *rx = cJSON_GetObjectItemCaseSensitive(pat, "Regex"), *lit = cJSON_GetObjectItemCaseSensitive(pat, "String");
    if (!cJSON_IsString(rx) && !cJSON_IsString(lit))
        return malformed(L, "pre_tokenizer(Split).pattern", "neither {\"Regex\": ...} nor {\"String\": ...}");
    tkd_tok_step step = {.kind = TKD_TOK_STEP_SPLIT};
    st = compile_pattern(L, cJSON_IsString(rx) ? rx->valuestring : lit->valuestring, !cJSON_IsString(rx),
                         "pre_tokenizer(Split).pattern", &step.re, &step.jit);
    return st == TKD_OK ? add_step(L, step) : st;
}

static tkd_status load_byte_level(loader *L, const cJSON *node)
{
    static const char *const keys[] = {"type", "add_prefix_space", "trim_offsets", "use_regex", NULL};
    tkd_status st = known_keys(L, node, "pre_tokenizer(ByteLevel)", keys);
    if (st != TKD_OK)
        return st;
    tkd_tok_step step = {.kind = TKD_TOK_STEP_BYTELEVEL, .add_prefix_space = flag(node, "add_prefix_space", true)};
    if (flag(node, "use_regex", true))
        st = compile_pattern(L, gpt2_pattern, false, "pre_tokenizer(ByteLevel)", &step.re, &step.jit);
    return st == TKD_OK ? add_step(L, step) : st;
}

static tkd_status load_pre_tokenizer(loader *L, const cJSON *node)
{
    const char *type = type_of(node);
    if (type && strcmp(type, "Sequence") == 0)
        return each_member(L, node, "pretokenizers", load_pre_tokenizer);
    if (L->tok->nsteps > 0 && L->tok->steps[L->tok->nsteps - 1].kind == TKD_TOK_STEP_BYTELEVEL)
        return refuse(L, "pre_tokenizer", "a pre-tokenizer after ByteLevel");
    if (type && strcmp(type, "Split") == 0)
        return load_split(L, node);
    if (type && strcmp(type, "ByteLevel") == 0)
        return load_byte_level(L, node);
    return refuse_type(L, "pre_tokenizer", type);
}

/* ---- post-processor, decoder ---------------------------------------------------------------- */

static tkd_status push_id(loader *L, uint32_t **ids, int *n, uint32_t id)
{
    uint32_t *p = realloc(*ids, (size_t)(*n + 1) * sizeof *p);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", L->path);
    *ids = p;
    p[(*n)++] = id;
    return TKD_OK;
}

/* One item of TemplateProcessing's `single`: the special token's ids go to the prefix before $A
 * and to the suffix after it. */
static tkd_status template_item(loader *L, const cJSON *item, const cJSON *specials, bool *seen_a)
{
    const cJSON *seq = cJSON_GetObjectItemCaseSensitive(item, "Sequence");
    const cJSON *sp = cJSON_GetObjectItemCaseSensitive(item, "SpecialToken");
    if (seq) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(seq, "id");
        if (*seen_a || !cJSON_IsString(id) || strcmp(id->valuestring, "A") != 0)
            return refuse(L, "post_processor(TemplateProcessing).single", "a template other than one $A");
        *seen_a = true;
        return TKD_OK;
    }
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(sp, "id");
    const cJSON *entry = cJSON_IsString(name) ? cJSON_GetObjectItemCaseSensitive(specials, name->valuestring) : NULL;
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(entry, "ids");
    if (!cJSON_IsArray(ids))
        return malformed(L, "post_processor(TemplateProcessing)", "a SpecialToken missing from special_tokens");
    for (const cJSON *it = ids->child; it; it = it->next) {
        if (!cJSON_IsNumber(it) || it->valueint < 0 || it->valueint >= L->tok->vocab_size)
            return malformed(L, "post_processor(TemplateProcessing).special_tokens", "an id outside the vocabulary");
        tkd_status st = *seen_a ? push_id(L, &L->tok->suffix, &L->tok->nsuffix, (uint32_t)it->valueint)
                                : push_id(L, &L->tok->prefix, &L->tok->nprefix, (uint32_t)it->valueint);
        if (st != TKD_OK)
            return st;
    }
    return TKD_OK;
}

static tkd_status load_post(loader *L, const cJSON *node)
{
    if (!node || cJSON_IsNull(node))
        return TKD_OK;
    const char *type = type_of(node);
    if (type && strcmp(type, "ByteLevel") == 0) /* trim_offsets: offsets only, ids are unchanged */
        return TKD_OK;
    if (type && strcmp(type, "Sequence") == 0)
        return each_member(L, node, "processors", load_post);
    if (type && strcmp(type, "TemplateProcessing") == 0) {
        const cJSON *single = cJSON_GetObjectItemCaseSensitive(node, "single");
        const cJSON *specials = cJSON_GetObjectItemCaseSensitive(node, "special_tokens");
        bool seen_a = false;
        for (const cJSON *it = cJSON_IsArray(single) ? single->child : NULL; it; it = it->next) {
            tkd_status st = template_item(L, it, specials, &seen_a);
            if (st != TKD_OK)
                return st;
        }
        return seen_a ? TKD_OK : malformed(L, "post_processor(TemplateProcessing).single", "no $A");
    }
    return refuse_type(L, "post_processor", type);
}

static tkd_status load_decoder(loader *L, const cJSON *node)
{
    const char *type = type_of(node);
    if (!node || cJSON_IsNull(node) || (type && strcmp(type, "ByteLevel") == 0))
        return TKD_OK;
    return refuse_type(L, "decoder", type);
}

/* ---- tokenizer_config.json ------------------------------------------------------------------ */

/* bos_token / eos_token: a string, or an AddedToken object with "content"; NULL when unset. */
static const char *config_token(const cJSON *cfg, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (cJSON_IsObject(v))
        v = cJSON_GetObjectItemCaseSensitive(v, "content");
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static tkd_status config_special(loader *L, const char *cfg_path, const cJSON *cfg, const char *key, int64_t *id)
{
    const char *content = config_token(cfg, key);
    *id = content ? tkd_tokenizer_token_id(L->tok, content) : -1;
    if (content && *id < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s '%s' is not a token of %s", cfg_path, key, content, L->path);
    return TKD_OK;
}

/* add_bos_token / add_eos_token, when the config sets either, decide the prefix and suffix (as
 * transformers' LlamaTokenizerFast rebuilds its template from them); eos_token names the EOS. */
static tkd_status apply_config(loader *L, const char *cfg_path, const cJSON *cfg)
{
    tkd_tokenizer *tok = L->tok;
    int64_t bos, eos;
    tkd_status st = config_special(L, cfg_path, cfg, "bos_token", &bos);
    if (st == TKD_OK)
        st = config_special(L, cfg_path, cfg, "eos_token", &eos);
    if (st != TKD_OK)
        return st;
    if (eos >= 0)
        tok->eos_id = eos;
    const cJSON *add_bos = cJSON_GetObjectItemCaseSensitive(cfg, "add_bos_token");
    const cJSON *add_eos = cJSON_GetObjectItemCaseSensitive(cfg, "add_eos_token");
    if (!cJSON_IsBool(add_bos) && !cJSON_IsBool(add_eos))
        return TKD_OK;
    tok->nprefix = tok->nsuffix = 0;
    if (cJSON_IsTrue(add_bos) && bos < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: add_bos_token is true but bos_token is not set", cfg_path);
    if (cJSON_IsTrue(add_eos) && eos < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: add_eos_token is true but eos_token is not set", cfg_path);
    if (cJSON_IsTrue(add_bos))
        st = push_id(L, &tok->prefix, &tok->nprefix, (uint32_t)bos);
    if (st == TKD_OK && cJSON_IsTrue(add_eos))
        st = push_id(L, &tok->suffix, &tok->nsuffix, (uint32_t)eos);
    return st;
}

static tkd_status load_config(loader *L)
{
    char *dir = strdup(L->path), *cfg_path = NULL;
    if (!dir)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    char *slash = strrchr(dir, '/');
    if (slash)
        slash[1] = '\0';
    tkd_status st = tkd_path_join_alloc(&cfg_path, slash ? dir : ".", "tokenizer_config.json");
    free(dir);
    if (st != TKD_OK || !tkd_file_exists(cfg_path)) {
        free(cfg_path);
        return st;
    }
    void *text = NULL;
    size_t n = 0;
    st = tkd_read_file(cfg_path, &text, &n);
    cJSON *cfg = st == TKD_OK ? cJSON_ParseWithLength(text, n) : NULL;
    if (st == TKD_OK && !cJSON_IsObject(cfg))
        st = tkd_error_set(TKD_ERR_FORMAT, "%s: not a JSON object", cfg_path);
    if (st == TKD_OK)
        st = apply_config(L, cfg_path, cfg);
    cJSON_Delete(cfg);
    free(text);
    free(cfg_path);
    return st;
}

/* ---- the whole file ------------------------------------------------------------------------- */

static tkd_status load_json(loader *L, const cJSON *root)
{
    static const char *const keys[] = {"version", "truncation", "padding", "added_tokens", "normalizer",
                                       "pre_tokenizer", "post_processor", "decoder", "model", NULL};
    tkd_status st = known_keys(L, root, "", keys);
    if (st == TKD_OK)
        st = want_off(L, root, "truncation", "");
    if (st == TKD_OK)
        st = want_off(L, root, "padding", "");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (st == TKD_OK)
        st = load_model(L, cJSON_GetObjectItemCaseSensitive(root, "model"), added);
    if (st == TKD_OK) /* before the added tokens: a normalized one is matched by its normalized content */
        st = load_normalizer(L, cJSON_GetObjectItemCaseSensitive(root, "normalizer"));
    if (st == TKD_OK)
        st = load_added(L, added);
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    if (st == TKD_OK && (!pre || cJSON_IsNull(pre)))
        st = refuse(L, "pre_tokenizer", "null (no ByteLevel)");
    if (st == TKD_OK)
        st = load_pre_tokenizer(L, pre);
    if (st == TKD_OK && L->tok->steps[L->tok->nsteps - 1].kind != TKD_TOK_STEP_BYTELEVEL)
        st = refuse(L, "pre_tokenizer", "a chain that does not end with ByteLevel");
    if (st == TKD_OK)
        st = load_post(L, cJSON_GetObjectItemCaseSensitive(root, "post_processor"));
    if (st == TKD_OK)
        st = load_decoder(L, cJSON_GetObjectItemCaseSensitive(root, "decoder"));
    if (st == TKD_OK && L->tok->nsuffix > 0)
        L->tok->eos_id = L->tok->suffix[L->tok->nsuffix - 1];
    return st;
}

/* path or path/tokenizer.json, malloc'd. */
static tkd_status resolve_path(const char *path, char **out)
{
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        return tkd_path_join_alloc(out, path, "tokenizer.json");
    *out = strdup(path);
    return *out ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
}

tkd_status tkd_tokenizer_load(const char *path, tkd_tokenizer **out)
{
    *out = NULL;
    tkd_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    tok->eos_id = -1;
    tkd_status st = resolve_path(path, &tok->path);
    loader L = {.tok = tok, .path = tok->path};
    byte_alphabet(L.char_byte);
    void *text = NULL;
    size_t n = 0;
    if (st == TKD_OK && !tkd_file_exists(tok->path))
        st = tkd_error_set(TKD_ERR_NOT_FOUND, "%s: no such file — give a tokenizer.json or the checkpoint directory "
                           "holding one", tok->path);
    if (st == TKD_OK)
        st = tkd_read_file(tok->path, &text, &n);
    cJSON *root = st == TKD_OK ? cJSON_ParseWithLength(text, n) : NULL;
    free(text);
    if (st == TKD_OK && !cJSON_IsObject(root))
        st = tkd_error_set(TKD_ERR_FORMAT, "%s: not a JSON object", tok->path);
    if (st == TKD_OK)
        st = load_json(&L, root);
    cJSON_Delete(root);
    if (st == TKD_OK)
        st = load_config(&L);
    if (st != TKD_OK) {
        tkd_tokenizer_free(tok);
        return st;
    }
    *out = tok;
    return TKD_OK;
}

void tkd_tokenizer_free(tkd_tokenizer *tok)
{
    if (!tok)
        return;
    for (int i = 0; i < tok->nsteps; i++)
        pcre2_code_free(tok->steps[i].re);
    free(tok->steps);
    free(tok->path);
    free(tok->bytes);
    free(tok->off);
    free(tok->len);
    free(tok->vocab.slots);
    free(tok->merges.slots);
    free(tok->added_id);
    free(tok->added_off);
    free(tok->added_len);
    free(tok->added_raw.order);
    free(tok->added_norm.order);
    free(tok->prefix);
    free(tok->suffix);
    free(tok);
}

int tkd_tokenizer_vocab_size(const tkd_tokenizer *tok) { return tok->vocab_size; }
const char *tkd_tokenizer_path(const tkd_tokenizer *tok) { return tok->path; }
int64_t tkd_tokenizer_eos_id(const tkd_tokenizer *tok) { return tok->eos_id; }

int tkd_tokenizer_prefix(const tkd_tokenizer *tok, const uint32_t **ids)
{
    *ids = tok->prefix;
    return tok->nprefix;
}

int tkd_tokenizer_suffix(const tkd_tokenizer *tok, const uint32_t **ids)
{
    *ids = tok->suffix;
    return tok->nsuffix;
}

const uint8_t *tkd_tokenizer_token_bytes(const tkd_tokenizer *tok, uint32_t id, size_t *len)
{
    if (id >= (uint32_t)tok->vocab_size || tok->off[id] == TKD_TOK_NONE)
        return NULL;
    *len = tok->len[id];
    return tok->bytes + tok->off[id];
}

int64_t tkd_tokenizer_token_id(const tkd_tokenizer *tok, const char *content)
{
    size_t n = strlen(content);
    for (size_t i = 0; i < tok->n_added; i++)
        if (tok->added_len[i] == n && memcmp(tok->bytes + tok->added_off[i], content, n) == 0)
            return tok->added_id[i];
    int16_t char_byte[324];
    byte_alphabet(char_byte);
    uint8_t *buf = malloc(n + 1);
    long nb = buf ? byte_level_decode(char_byte, content, buf) : -1;
    uint32_t id = nb < 0 ? TKD_TOK_NONE : tkd_tok_strmap_get(tok, &tok->vocab, buf, (size_t)nb);
    free(buf);
    return id == TKD_TOK_NONE ? -1 : (int64_t)id;
}

/* ---- pattern translation ------------------------------------------------------------------ */

typedef struct strbuf {
    char *s;
    size_t n, cap;
    bool oom;
} strbuf;

static void sb_put(strbuf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->cap + n + 1) * 2;
        char *p = realloc(b->s, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->s = p, b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

/* Escapes whose meaning is the same in Oniguruma and PCRE2 (with UTF and UCP), copied as they are:
 * control characters, \d/\D (both: Unicode Nd), and \p{..}/\P{..}/\x{..} with their braces. */
static bool same_escape(char c)
{
    return strchr("rntfve0aDdpPx", c) != NULL || !((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '1' && c <= '9'));
}

/* "[:name:]" or "[:^name:]" at p. */
static bool posix_class(const char *p)
{
    if (p[0] != '[' || p[1] != ':')
        return false;
    p += p[2] == '^' ? 3 : 2;
    size_t n = strspn(p, "abcdefghijklmnopqrstuvwxyz");
    return n > 0 && p[n] == ':' && p[n + 1] == ']';
}

tkd_status tkd_tok_translate_pattern(const char *pat, const char *what, char **out)
{
    strbuf b = {0};
    *out = NULL;
    sb_put(&b, "", 0);
    for (const char *p = pat; *p; p++) {
        if (posix_class(p)) {
            free(b.s);
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: POSIX bracket classes ([:name:]) are not supported", what);
        }
        if (*p != '\\') {
            sb_put(&b, p, 1);
            continue;
        }
        char c = p[1];
        if (c == 's' || c == 'S') {
            sb_put(&b, c == 's' ? "\\p{White_Space}" : "\\P{White_Space}", 15);
        } else if (c == 'u' && strspn(p + 2, "0123456789abcdefABCDEF") >= 4) {
            char esc[16];
            snprintf(esc, sizeof esc, "\\x{%.4s}", p + 2);
            sb_put(&b, esc, strlen(esc));
            p += 4;
        } else if (c != '\0' && same_escape(c)) {
            sb_put(&b, p, 2);
        } else {
            free(b.s);
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: the escape \\%c is not supported (its meaning differs "
                                 "between Oniguruma, which Hugging Face uses, and PCRE2)", what, c ? c : ' ');
        }
        p++;
    }
    if (b.oom) {
        free(b.s);
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    }
    *out = b.s;
    return TKD_OK;
}
