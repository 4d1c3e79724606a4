/* tokenizer_model.c — the model part of tokenizer.json read into the tables of tokenizer_internal.h
 * (tokenizer_load_internal.h): the byte-level alphabet, the vocabulary and merges of a BPE model with
 * their hash maps, and the added tokens with their matching passes.
 */
#include "formats/tokenizer_load_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* ---- the byte-level alphabet -------------------------------------------------------------- */

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes for
 * U+0100 onwards in byte order. char_byte[c] is the byte that code point c stands for, or -1. */
void tkd_tokmodel_byte_alphabet(int16_t char_byte[324])
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
long tkd_tokmodel_byte_level_decode(const int16_t char_byte[324], const char *s, uint8_t *out)
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

/* Appends n bytes to tok->bytes; returns their offset through *off. */
static tkd_status add_bytes(loader *L, const uint8_t *s, size_t n, uint32_t *off)
{
    tkd_tokenizer *tok = L->tok;
    if (tok->nbytes + n > UINT32_MAX - 1) /* offsets are uint32_t; TKD_TOK_NONE marks "no token" */
        return tkd_tokjson_malformed(L, "model.vocab", "more than 4 GiB of token text");
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

/* ---- model: vocabulary and merges -------------------------------------------------------- */

static jpath vocab_path(const char *key)
{
    jpath p;
    snprintf(p.s, sizeof p.s, "model.vocab[\"%.40s%s\"]", key, strlen(key) > 40 ? "..." : "");
    return p;
}

/* Checks every id of the vocabulary and the added tokens (added: an array of objects, or NULL) and
 * sets the id space, 1 + the largest. An id space far larger than the entries is refused: each id
 * costs 8 bytes of tables, and an id of 3e8 in a small file would allocate gigabytes for nothing. */
static tkd_status scan_ids(const loader *L, const cJSON *vocab, const cJSON *added, int *out)
{
    uint32_t id, best = 0;
    const cJSON *best_at = NULL;
    long best_added = -1; /* index of the added token holding best, -1: a vocabulary entry */
    size_t entries = 0;
    for (const cJSON *it = vocab->child; it; it = it->next, entries++) {
        if (!tkd_tokjson_id_value(it, &id))
            return tkd_tokjson_bad_id(L->path, it, vocab_path(it->string).s);
        if (!best_at || id > best)
            best = id, best_at = it, best_added = -1;
    }
    long i = 0;
    for (const cJSON *it = added ? added->child : NULL; it; it = it->next, i++, entries++) {
        jpath where = tkd_tokjson_at_index("", "added_tokens", (int)i);
        const cJSON *v;
        if (!cJSON_IsObject(it))
            return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: an object expected, not %s", L->path, where.s,
                                 tkd_tokjson_kind(it));
        TKD_TRY(tkd_tokjson_get_required(L->path, it, where.s, "id", cJSON_Number, "a token id (an integer)", &v));
        TKD_TRY(tkd_tokjson_id(L->path, v, tkd_tokjson_at_key(where.s, "id").s, &id));
        if (!best_at || id > best)
            best = id, best_at = it, best_added = i;
    }
    if (!best_at)
        return tkd_tokjson_malformed(L, "model.vocab", "empty");
    if ((size_t)best + 1 > 4 * entries + TKD_TOKENIZER_SPARSE_SLACK) {
        jpath where = best_added < 0
                          ? vocab_path(best_at->string)
                          : tkd_tokjson_at_key(tkd_tokjson_at_index("", "added_tokens", (int)best_added).s, "id");
        tkd_error_set(TKD_ERR_FORMAT, "%s: %s: the id %u leaves most ids without a token (%zu entries in all)", L->path,
                      where.s, best, entries);
        return tkd_error_hint(TKD_ERR_FORMAT, "topkd refuses ids above 4 x the entries + %d", TKD_TOKENIZER_SPARSE_SLACK);
    }
    *out = (int)best + 1; /* best <= TKD_TOKENIZER_MAX_ID < INT_MAX */
    return TKD_OK;
}

static tkd_status alloc_tables(loader *L, size_t nvocab)
{
    tkd_tokenizer *tok = L->tok;
    size_t v = (size_t)tok->vocab_size;
    tok->off = malloc(v * sizeof *tok->off);
    tok->len = calloc(v, sizeof *tok->len);
    tok->vocab.mask = table_size(nvocab) - 1;
    tok->vocab.slots = calloc(tok->vocab.mask + 1, sizeof *tok->vocab.slots);
    L->bytes_cap = 1 << 20; /* never NULL: an empty vocabulary key ("") points into it too */
    tok->bytes = malloc(L->bytes_cap);
    if (!tok->off || !tok->len || !tok->vocab.slots || !tok->bytes)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory for %zu tokens", L->path, v);
    memset(tok->off, 0xFF, v * sizeof *tok->off);
    for (int b = 0; b < 256; b++)
        tok->byte_id[b] = TKD_TOK_NONE;
    return TKD_OK;
}

/* Vocabulary entries in the byte-level alphabet enter the map under their bytes; an entry with
 * other characters can never come out of a byte-level pre-tokenizer, so it is kept for decoding
 * only (as its UTF-8 text). Two entries with one id are refused: the map finds an entry through the
 * bytes its id points to, so the first would silently stop matching. */
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
        uint32_t id = (uint32_t)it->valuedouble; /* checked by scan_ids */
        if (tok->off[id] != TKD_TOK_NONE) {
            st = tkd_error_set(TKD_ERR_FORMAT, "%s: %s: the id %u is already another entry's", L->path,
                               vocab_path(it->string).s, id);
            break;
        }
        long nb = tkd_tokmodel_byte_level_decode(L->char_byte, it->string, buf);
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
        return tkd_tokjson_malformed(L, "model.merges", "a merge longer than 1023 bytes");
    memcpy(tmp, s, n);
    tmp[n] = '\0';
    long nb = tkd_tokmodel_byte_level_decode(L->char_byte, tmp, scratch);
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
            return tkd_tokjson_malformed(L, "model.merges", "a merged token longer than 2048 bytes");
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

tkd_status tkd_tokmodel_load(loader *L, const cJSON *model, const cJSON *added)
{
    static const char *const keys[] = {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                                       "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges", NULL};
    const char *type;
    const cJSON *vocab, *merges, *unk, *fuse;
    if (!model)
        return tkd_tokjson_malformed(L, "model", "missing");
    TKD_TRY(tkd_tokjson_node_type(L, model, "model", &type));
    if (type && strcmp(type, "BPE") != 0)
        return tkd_tokjson_refuse_type(L, "model.type", type);
    TKD_TRY(tkd_tokjson_known_keys(L, model, "model", keys));
    TKD_TRY(tkd_tokjson_want_off(L, model, "model", "dropout", cJSON_Number, "a number or null"));
    TKD_TRY(tkd_tokjson_want_off(L, model, "model", "byte_fallback", J_BOOL, "true or false"));
    TKD_TRY(tkd_tokjson_want_off(L, model, "model", "continuing_subword_prefix", cJSON_String, "a string or null"));
    TKD_TRY(tkd_tokjson_want_off(L, model, "model", "end_of_word_suffix", cJSON_String, "a string or null"));
    TKD_TRY(tkd_tokjson_get_typed(L->path, model, "model", "fuse_unk", J_BOOL, "true or false", &fuse));
    TKD_TRY(tkd_tokjson_get_typed(L->path, model, "model", "unk_token", cJSON_String | cJSON_NULL, "a string or null",
                                  &unk));
    TKD_TRY(tkd_tokjson_flag(L, model, "model", "ignore_merges", false, &L->tok->ignore_merges));
    TKD_TRY(tkd_tokjson_get_required(L->path, model, "model", "vocab", cJSON_Object, "an object", &vocab));
    TKD_TRY(tkd_tokjson_get_required(L->path, model, "model", "merges", cJSON_Array, "an array", &merges));
    TKD_TRY(scan_ids(L, vocab, added, &L->tok->vocab_size));
    TKD_TRY(alloc_tables(L, (size_t)cJSON_GetArraySize(vocab)));
    TKD_TRY(load_vocab(L, vocab));
    TKD_TRY(load_merges(L, merges));
    /* With an unk_token, tokenizers puts it where a byte has no token; we never need to when all
     * 256 bytes have one. Without an unk_token such a byte is dropped, as tokenizers does. */
    for (int b = 0; cJSON_IsString(unk) && b < 256; b++)
        if (L->tok->byte_id[b] == TKD_TOK_NONE)
            return tkd_tokjson_refuse(L, "model.unk_token", "an unk_token with bytes missing from the vocabulary");
    return TKD_OK;
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
    jpath where = tkd_tokjson_at_index("", "added_tokens", (int)i);
    const cJSON *content, *idv;
    bool special;
    /* scan_ids checked that it is an object with an id */
    TKD_TRY(tkd_tokjson_known_keys(L, it, where.s, keys));
    TKD_TRY(tkd_tokjson_get_required(L->path, it, where.s, "content", cJSON_String, "a string", &content));
    if (content->valuestring[0] == '\0')
        return tkd_tokjson_malformed(L, tkd_tokjson_at_key(where.s, "content").s, "empty");
    TKD_TRY(tkd_tokjson_want_off(L, it, where.s, "single_word", J_BOOL, "true or false"));
    TKD_TRY(tkd_tokjson_want_off(L, it, where.s, "lstrip", J_BOOL, "true or false"));
    TKD_TRY(tkd_tokjson_want_off(L, it, where.s, "rstrip", J_BOOL, "true or false"));
    TKD_TRY(tkd_tokjson_flag(L, it, where.s, "normalized", false, normalized));
    TKD_TRY(tkd_tokjson_flag(L, it, where.s, "special", false, &special)); /* special or not, it is matched the same */
    idv = cJSON_GetObjectItemCaseSensitive(it, "id");
    uint32_t id = (uint32_t)idv->valuedouble;
    /* tokenizers matches a normalized token by its content after the normalizer. */
    uint8_t *nfc = *normalized && tok->nfc ? utf8proc_NFC((const uint8_t *)content->valuestring) : NULL;
    const char *text = nfc ? (const char *)nfc : content->valuestring;
    size_t n = strlen(text);
    tkd_status st = add_bytes(L, (const uint8_t *)text, n, &tok->added_off[i]);
    free(nfc);
    tok->added_len[i] = (uint32_t)n;
    tok->added_id[i] = id;
    /* An id in both the vocabulary and the added tokens keeps its vocabulary bytes: they are the
     * vocabulary map's key. */
    if (st == TKD_OK && tok->off[id] == TKD_TOK_NONE) {
        tok->off[id] = tok->added_off[i];
        tok->len[id] = (uint32_t)n;
    }
    return st;
}

tkd_status tkd_tokmodel_load_added(loader *L, const cJSON *added)
{
    tkd_tokenizer *tok = L->tok;
    size_t n = added ? (size_t)cJSON_GetArraySize(added) : 0;
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

