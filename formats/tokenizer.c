/* tokenizer.c — reads a Hugging Face tokenizer.json (and tokenizer_config.json beside it) into the
 * tables of tokenizer_internal.h; see tokenizer.h for what is accepted. Every field of the file is
 * either understood or refused by name: an encoder that skipped a field it does not implement
 * would give other ids than Hugging Face without saying so.
 */
#include "formats/tokenizer.h"

#include "common/fileio.h"
#include "formats/json_check.h"
#include "formats/tokenizer_internal.h"
#include "formats/utf8.h"

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

/* A field's JSON path for messages: where.key (key alone at the top level), where.key[i]. */
typedef struct jpath {
    char s[256];
} jpath;

static jpath at_key(const char *where, const char *key)
{
    jpath p;
    snprintf(p.s, sizeof p.s, "%.160s%s%.80s", where, *where ? "." : "", key);
    return p;
}

static jpath at_index(const char *where, const char *key, int i)
{
    jpath p;
    snprintf(p.s, sizeof p.s, "%.160s%s%.40s[%d]", where, *where && *key ? "." : "", key, i);
    return p;
}

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
    if (tok->nbytes + n > UINT32_MAX - 1) /* offsets are uint32_t; TKD_TOK_NONE marks "no token" */
        return malformed(L, "model.vocab", "more than 4 GiB of token text");
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

/* ---- typed fields --------------------------------------------------------------------------- */

/* Every field read is checked for its type here, so that a file Hugging Face refuses (serde) is not
 * read with a default in its place. cJSON type bits name the types a field may have. */
#define J_BOOL (cJSON_True | cJSON_False)

static const char *json_kind(const cJSON *v)
{
    if (!v)
        return "nothing";
    if (cJSON_IsNull(v))
        return "null";
    if (cJSON_IsBool(v))
        return "a boolean";
    if (cJSON_IsNumber(v))
        return "a number";
    if (cJSON_IsString(v))
        return "a string";
    return cJSON_IsArray(v) ? "an array" : "an object";
}

/* obj[key] into *out when its type is one of `types`; *out = NULL when obj has no such key. Any
 * other type is TKD_ERR_FORMAT naming file, where.key and want. */
static tkd_status get_typed(const char *file, const cJSON *obj, const char *where, const char *key, int types,
                            const char *want, const cJSON **out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = NULL;
    if (v && !((v->type & 0xFF) & types))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: %s expected, not %s", file, at_key(where, key).s, want,
                             json_kind(v));
    *out = v;
    return TKD_OK;
}

/* get_typed for a field that must be there. */
static tkd_status get_required(const char *file, const cJSON *obj, const char *where, const char *key, int types,
                               const char *want, const cJSON **out)
{
    TKD_TRY(get_typed(file, obj, where, key, types, want, out));
    if (!*out)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: missing (%s expected)", file, at_key(where, key).s, want);
    return TKD_OK;
}

/* v as a token id: an integer in [0, TKD_TOKENIZER_MAX_ID]. */
static bool id_value(const cJSON *v, uint32_t *id)
{
    *id = 0;
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || v->valuedouble > TKD_TOKENIZER_MAX_ID)
        return false;
    *id = (uint32_t)v->valuedouble; /* in range: the conversion is defined */
    return (double)*id == v->valuedouble;
}

static tkd_status bad_id(const char *file, const cJSON *v, const char *field)
{
    if (!cJSON_IsNumber(v))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: a token id (an integer) expected, not %s", file, field,
                             json_kind(v));
    if (v->valuedouble >= 0 && v->valuedouble <= TKD_TOKENIZER_MAX_ID)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: the token id %.17g is not an integer", file, field,
                             v->valuedouble);
    tkd_error_set(TKD_ERR_FORMAT, "%s: %s: the token id %.17g is outside [0, %d]", file, field, v->valuedouble,
                  TKD_TOKENIZER_MAX_ID);
    return tkd_error_hint(TKD_ERR_FORMAT, "topkd's limit; the largest vocabularies today hold about 262k tokens");
}

static tkd_status json_id(const char *file, const cJSON *v, const char *field, uint32_t *id)
{
    return id_value(v, id) ? TKD_OK : bad_id(file, v, field);
}

static tkd_status flag(const loader *L, const cJSON *obj, const char *where, const char *key, bool dflt, bool *out)
{
    const cJSON *v;
    TKD_TRY(get_typed(L->path, obj, where, key, J_BOOL, "true or false", &v));
    *out = v ? cJSON_IsTrue(v) : dflt;
    return TKD_OK;
}

/* A field whose feature is not implemented: absent, null, false, 0 or "" pass (types: the cJSON types
 * it may have besides null); anything else is refused showing the value. */
static tkd_status want_off(const loader *L, const cJSON *obj, const char *where, const char *key, int types,
                           const char *want)
{
    const cJSON *v;
    TKD_TRY(get_typed(L->path, obj, where, key, types | cJSON_NULL, want, &v));
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v) || (cJSON_IsNumber(v) && v->valuedouble == 0) ||
        (cJSON_IsString(v) && v->valuestring[0] == '\0'))
        return TKD_OK;
    char what[64];
    char *text = cJSON_PrintUnformatted(v);
    snprintf(what, sizeof what, "%.40s%s", text ? text : "this value", text && strlen(text) > 40 ? "..." : "");
    free(text);
    return refuse(L, at_key(where, key).s, what);
}

/* Every key of obj must be in the NULL-terminated list. */
static tkd_status known_keys(const loader *L, const cJSON *obj, const char *where, const char *const *keys)
{
    for (const cJSON *it = obj ? obj->child : NULL; it; it = it->next) {
        bool ok = false;
        for (const char *const *k = keys; *k && !ok; k++)
            ok = strcmp(*k, it->string) == 0;
        if (!ok)
            return refuse(L, at_key(where, it->string).s, "this key");
    }
    return TKD_OK;
}

/* node (at where) must be an object; its "type" (a string) in *type, NULL when it has none. */
static tkd_status node_type(const loader *L, const cJSON *node, const char *where, const char **type)
{
    const cJSON *t;
    *type = NULL;
    if (!cJSON_IsObject(node))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: an object expected, not %s", L->path, where, json_kind(node));
    TKD_TRY(get_typed(L->path, node, where, "type", cJSON_String, "a string", &t));
    *type = t ? t->valuestring : NULL;
    return TKD_OK;
}

typedef tkd_status (*node_fn)(loader *L, const cJSON *node, const char *where);

/* A Sequence (normalizer, pre-tokenizer, post-processor): each member of its list_key, in order.
 * The list is required (tokenizers' serde has no default for it); an empty one does nothing, as in
 * tokenizers, where an empty Sequence passes its input through. */
static tkd_status each_member(loader *L, const cJSON *node, const char *where, const char *list_key, node_fn fn)
{
    const char *const keys[] = {"type", list_key, NULL};
    const cJSON *list;
    TKD_TRY(known_keys(L, node, where, keys));
    TKD_TRY(get_required(L->path, node, where, list_key, cJSON_Array, "an array", &list));
    int i = 0;
    for (const cJSON *it = list->child; it; it = it->next, i++)
        TKD_TRY(fn(L, it, at_index(where, list_key, i).s));
    return TKD_OK;
}

static tkd_status refuse_type(const loader *L, const char *field, const char *type)
{
    char what[96];
    snprintf(what, sizeof what, "type %.60s", type ? type : "(none)");
    return refuse(L, field, what);
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
        if (!id_value(it, &id))
            return bad_id(L->path, it, vocab_path(it->string).s);
        if (!best_at || id > best)
            best = id, best_at = it, best_added = -1;
    }
    long i = 0;
    for (const cJSON *it = added ? added->child : NULL; it; it = it->next, i++, entries++) {
        jpath where = at_index("", "added_tokens", (int)i);
        const cJSON *v;
        if (!cJSON_IsObject(it))
            return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: an object expected, not %s", L->path, where.s, json_kind(it));
        TKD_TRY(get_required(L->path, it, where.s, "id", cJSON_Number, "a token id (an integer)", &v));
        TKD_TRY(json_id(L->path, v, at_key(where.s, "id").s, &id));
        if (!best_at || id > best)
            best = id, best_at = it, best_added = i;
    }
    if (!best_at)
        return malformed(L, "model.vocab", "empty");
    if ((size_t)best + 1 > 4 * entries + TKD_TOKENIZER_SPARSE_SLACK) {
        jpath where = best_added < 0 ? vocab_path(best_at->string) : at_key(at_index("", "added_tokens", (int)best_added).s, "id");
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
    const char *type;
    const cJSON *vocab, *merges, *unk, *fuse;
    if (!model)
        return malformed(L, "model", "missing");
    TKD_TRY(node_type(L, model, "model", &type));
    if (type && strcmp(type, "BPE") != 0)
        return refuse_type(L, "model.type", type);
    TKD_TRY(known_keys(L, model, "model", keys));
    TKD_TRY(want_off(L, model, "model", "dropout", cJSON_Number, "a number or null"));
    TKD_TRY(want_off(L, model, "model", "byte_fallback", J_BOOL, "true or false"));
    TKD_TRY(want_off(L, model, "model", "continuing_subword_prefix", cJSON_String, "a string or null"));
    TKD_TRY(want_off(L, model, "model", "end_of_word_suffix", cJSON_String, "a string or null"));
    TKD_TRY(get_typed(L->path, model, "model", "fuse_unk", J_BOOL, "true or false", &fuse));
    TKD_TRY(get_typed(L->path, model, "model", "unk_token", cJSON_String | cJSON_NULL, "a string or null", &unk));
    TKD_TRY(flag(L, model, "model", "ignore_merges", false, &L->tok->ignore_merges));
    TKD_TRY(get_required(L->path, model, "model", "vocab", cJSON_Object, "an object", &vocab));
    TKD_TRY(get_required(L->path, model, "model", "merges", cJSON_Array, "an array", &merges));
    TKD_TRY(scan_ids(L, vocab, added, &L->tok->vocab_size));
    TKD_TRY(alloc_tables(L, (size_t)cJSON_GetArraySize(vocab)));
    TKD_TRY(load_vocab(L, vocab));
    TKD_TRY(load_merges(L, merges));
    /* With an unk_token, tokenizers puts it where a byte has no token; we never need to when all
     * 256 bytes have one. Without an unk_token such a byte is dropped, as tokenizers does. */
    for (int b = 0; cJSON_IsString(unk) && b < 256; b++)
        if (L->tok->byte_id[b] == TKD_TOK_NONE)
            return refuse(L, "model.unk_token", "an unk_token with bytes missing from the vocabulary");
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
    jpath where = at_index("", "added_tokens", (int)i);
    const cJSON *content, *idv;
    bool special;
    /* scan_ids checked that it is an object with an id */
    TKD_TRY(known_keys(L, it, where.s, keys));
    TKD_TRY(get_required(L->path, it, where.s, "content", cJSON_String, "a string", &content));
    if (content->valuestring[0] == '\0')
        return malformed(L, at_key(where.s, "content").s, "empty");
    TKD_TRY(want_off(L, it, where.s, "single_word", J_BOOL, "true or false"));
    TKD_TRY(want_off(L, it, where.s, "lstrip", J_BOOL, "true or false"));
    TKD_TRY(want_off(L, it, where.s, "rstrip", J_BOOL, "true or false"));
    TKD_TRY(flag(L, it, where.s, "normalized", false, normalized));
    TKD_TRY(flag(L, it, where.s, "special", false, &special)); /* special or not, it is matched the same */
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

static tkd_status load_added(loader *L, const cJSON *added)
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

/* ---- normalizer and pre-tokenizers -------------------------------------------------------- */

static tkd_status load_normalizer(loader *L, const cJSON *norm, const char *where)
{
    static const char *const keys[] = {"type", NULL};
    const char *type;
    if (!norm || cJSON_IsNull(norm))
        return TKD_OK;
    TKD_TRY(node_type(L, norm, where, &type));
    if (type && strcmp(type, "NFC") == 0) {
        L->tok->nfc = true;
        return known_keys(L, norm, where, keys);
    }
    if (type && strcmp(type, "Sequence") == 0)
        return each_member(L, norm, where, "normalizers", load_normalizer);
    return refuse_type(L, where, type);
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
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP); /* PCRE2 refuses LITERAL with UCP */
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

/* Appends step; where names its place in the file (for the encoder's messages). */
static tkd_status add_step(loader *L, tkd_tok_step step, const char *where)
{
    tkd_tokenizer *tok = L->tok;
    tkd_tok_step *p = realloc(tok->steps, (size_t)(tok->nsteps + 1) * sizeof *p);
    if (!p) {
        pcre2_code_free(step.re);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", L->path);
    }
    snprintf(step.where, sizeof step.where, "%.300s", where);
    tok->steps = p;
    tok->steps[tok->nsteps++] = step;
    return TKD_OK;
}

static tkd_status load_split(loader *L, const cJSON *node, const char *where)
{
    static const char *const keys[] = {"type", "pattern", "behavior", "invert", NULL};
    static const char *const pat_keys[] = {"Regex", "String", NULL};
    const cJSON *behavior, *pat, *rx, *lit;
    TKD_TRY(known_keys(L, node, where, keys));
    TKD_TRY(want_off(L, node, where, "invert", J_BOOL, "true or false"));
    TKD_TRY(get_required(L->path, node, where, "behavior", cJSON_String, "a string", &behavior));
    if (strcmp(behavior->valuestring, "Isolated") != 0)
        return refuse(L, at_key(where, "behavior").s, behavior->valuestring);
    jpath pw = at_key(where, "pattern");
    TKD_TRY(get_required(L->path, node, where, "pattern", cJSON_Object, "an object", &pat));
    TKD_TRY(known_keys(L, pat, pw.s, pat_keys));
    TKD_TRY(get_typed(L->path, pat, pw.s, "Regex", cJSON_String, "a string", &rx));
    TKD_TRY(get_typed(L->path, pat, pw.s, "String", cJSON_String, "a string", &lit));
    if (!rx == !lit)
        return malformed(L, pw.s, "neither {\"Regex\": ...} nor {\"String\": ...}");
    tkd_tok_step step = {.kind = TKD_TOK_STEP_SPLIT};
    TKD_TRY(compile_pattern(L, rx ? rx->valuestring : lit->valuestring, !rx, pw.s, &step.re, &step.jit));
    return add_step(L, step, pw.s);
}

static tkd_status load_byte_level(loader *L, const cJSON *node, const char *where)
{
    static const char *const keys[] = {"type", "add_prefix_space", "trim_offsets", "use_regex", NULL};
    bool regex, trim;
    tkd_tok_step step = {.kind = TKD_TOK_STEP_BYTELEVEL};
    TKD_TRY(known_keys(L, node, where, keys));
    TKD_TRY(flag(L, node, where, "add_prefix_space", true, &step.add_prefix_space));
    TKD_TRY(flag(L, node, where, "trim_offsets", true, &trim)); /* offsets only: ids are the same */
    TKD_TRY(flag(L, node, where, "use_regex", true, &regex));
    char what[300];
    snprintf(what, sizeof what, "%.250s (ByteLevel's GPT-2 pattern)", where);
    if (regex)
        TKD_TRY(compile_pattern(L, gpt2_pattern, false, what, &step.re, &step.jit));
    return add_step(L, step, what);
}

static tkd_status load_pre_tokenizer(loader *L, const cJSON *node, const char *where)
{
    const char *type;
    TKD_TRY(node_type(L, node, where, &type));
    if (type && strcmp(type, "Sequence") == 0)
        return each_member(L, node, where, "pretokenizers", load_pre_tokenizer);
    if (L->tok->nsteps > 0 && L->tok->steps[L->tok->nsteps - 1].kind == TKD_TOK_STEP_BYTELEVEL)
        return refuse(L, where, "a pre-tokenizer after ByteLevel");
    if (type && strcmp(type, "Split") == 0)
        return load_split(L, node, where);
    if (type && strcmp(type, "ByteLevel") == 0)
        return load_byte_level(L, node, where);
    return refuse_type(L, where, type);
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

/* The ids of special_tokens[name].ids (specials at sw) go to the prefix before $A, to the suffix
 * after it. */
static tkd_status template_special(loader *L, const cJSON *specials, const char *sw, const char *name, bool seen_a)
{
    const cJSON *entry, *ids;
    TKD_TRY(get_typed(L->path, specials, sw, name, cJSON_Object, "an object", &entry));
    if (!entry)
        return malformed(L, at_key(sw, name).s, "a SpecialToken of the template missing from special_tokens");
    jpath ew = at_key(sw, name);
    TKD_TRY(get_required(L->path, entry, ew.s, "ids", cJSON_Array, "an array", &ids));
    int i = 0;
    for (const cJSON *it = ids->child; it; it = it->next, i++) {
        uint32_t id;
        jpath iw = at_index(ew.s, "ids", i);
        TKD_TRY(json_id(L->path, it, iw.s, &id));
        if (id >= (uint32_t)L->tok->vocab_size)
            return malformed(L, iw.s, "an id outside the vocabulary");
        TKD_TRY(seen_a ? push_id(L, &L->tok->suffix, &L->tok->nsuffix, id)
                       : push_id(L, &L->tok->prefix, &L->tok->nprefix, id));
    }
    return TKD_OK;
}

/* One item of TemplateProcessing's `single` (at where): {"Sequence": {"id": "A"}} once, or
 * {"SpecialToken": {"id": name}}. */
static tkd_status template_item(loader *L, const cJSON *item, const char *where, const char *sw,
                                const cJSON *specials, bool *seen_a)
{
    static const char *const keys[] = {"Sequence", "SpecialToken", NULL};
    const cJSON *seq, *sp, *id;
    if (!cJSON_IsObject(item))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: an object expected, not %s", L->path, where, json_kind(item));
    TKD_TRY(known_keys(L, item, where, keys));
    TKD_TRY(get_typed(L->path, item, where, "Sequence", cJSON_Object, "an object", &seq));
    TKD_TRY(get_typed(L->path, item, where, "SpecialToken", cJSON_Object, "an object", &sp));
    if (!seq == !sp)
        return malformed(L, where, "not one of {\"Sequence\": ...} and {\"SpecialToken\": ...}");
    jpath iw = at_key(where, seq ? "Sequence" : "SpecialToken");
    TKD_TRY(get_required(L->path, seq ? seq : sp, iw.s, "id", cJSON_String, "a string", &id));
    if (sp)
        return template_special(L, specials, sw, id->valuestring, *seen_a);
    if (*seen_a || strcmp(id->valuestring, "A") != 0)
        return refuse(L, at_key(iw.s, "id").s, "a template other than one $A");
    *seen_a = true;
    return TKD_OK;
}

static tkd_status load_template(loader *L, const cJSON *node, const char *where)
{
    const cJSON *single, *specials;
    TKD_TRY(get_required(L->path, node, where, "single", cJSON_Array, "an array", &single));
    TKD_TRY(get_typed(L->path, node, where, "special_tokens", cJSON_Object, "an object", &specials));
    jpath sw = at_key(where, "special_tokens");
    bool seen_a = false;
    int i = 0;
    for (const cJSON *it = single->child; it; it = it->next, i++)
        TKD_TRY(template_item(L, it, at_index(where, "single", i).s, sw.s, specials, &seen_a));
    return seen_a ? TKD_OK : malformed(L, at_key(where, "single").s, "no $A");
}

static tkd_status load_post(loader *L, const cJSON *node, const char *where)
{
    const char *type;
    if (!node || cJSON_IsNull(node))
        return TKD_OK;
    TKD_TRY(node_type(L, node, where, &type));
    if (type && strcmp(type, "ByteLevel") == 0) /* trim_offsets: offsets only, ids are unchanged */
        return TKD_OK;
    if (type && strcmp(type, "Sequence") == 0)
        return each_member(L, node, where, "processors", load_post);
    if (type && strcmp(type, "TemplateProcessing") == 0)
        return load_template(L, node, where);
    return refuse_type(L, where, type);
}

static tkd_status load_decoder(loader *L, const cJSON *node)
{
    const char *type;
    if (!node || cJSON_IsNull(node))
        return TKD_OK;
    TKD_TRY(node_type(L, node, "decoder", &type));
    return type && strcmp(type, "ByteLevel") == 0 ? TKD_OK : refuse_type(L, "decoder", type);
}

/* ---- reading JSON as Hugging Face does ------------------------------------------------------- */

/* True when the number literal at text[at] is the value of a "dropout" key: the one number in
 * tokenizer.json that is not an integer. */
static bool dropout_value(const char *text, size_t at)
{
    size_t i = at;
    while (i > 0 && strchr(" \t\r\n", text[i - 1]))
        i--;
    if (i == 0 || text[--i] != ':')
        return false;
    while (i > 0 && strchr(" \t\r\n", text[i - 1]))
        i--;
    return i >= 10 && memcmp(text + i - 9, "\"dropout\"", 9) == 0 && text[i - 10] != '\\';
}

/* The offset of the first thing in text[0, n) that serde_json (Hugging Face) refuses and cJSON
 * would take: a byte that is not UTF-8; a \u0000 escape (cJSON ends the C string there, so a key
 * "a\u0000b" would read as "a"); with integers_only (tokenizer.json, whose numbers are ids but for
 * model.dropout), a number written with a fraction or an exponent, which serde refuses for an
 * integer field and cJSON cannot tell from an integer (266.0). n when there is none; *why says
 * which, and *len_out how many bytes of the text to show (the number), else 0. */
static size_t json_text_check(const char *text, size_t n, bool integers_only, const char **why, int *len_out)
{
    const uint8_t *s = (const uint8_t *)text;
    bool in_string = false;
    for (size_t i = 0; i < n; i++) {
        if (s[i] >= 0x80) {
            long l = tkd_utf8_seq(s + i, n - i);
            if (l < 0) {
                *why = "not valid UTF-8";
                return i;
            }
            i += (size_t)l - 1;
        } else if (s[i] == '\\' && i + 1 < n) {
            if (n - i >= 6 && s[i + 1] == 'u' && memcmp(s + i + 2, "0000", 4) == 0) {
                *why = "a \\u0000 escape (a NUL character) is not supported";
                return i;
            }
            i++; /* the escaped character */
        } else if (s[i] == '"') {
            in_string = !in_string;
        } else if (!in_string && integers_only && (s[i] == '-' || (s[i] >= '0' && s[i] <= '9'))) {
            size_t len = 1; /* the literal's length (text need not end with a NUL) */
            while (i + len < n && strchr("0123456789+-.eE", text[i + len]) && text[i + len])
                len++;
            if ((memchr(text + i, '.', len) || memchr(text + i, 'e', len) || memchr(text + i, 'E', len)) &&
                !dropout_value(text, i)) {
                *why = "a number with a fraction or an exponent where tokenizers reads an integer (an id)";
                *len_out = len < 40 ? (int)len : 40;
                return i;
            }
            i += len - 1;
        }
    }
    return n;
}

/* path's text parsed into *out, one JSON object, as Hugging Face's serde_json reads it or refused with
 * path:line:col: valid UTF-8, and no key twice in an object (json_check.h; Python and serde keep
 * the last, cJSON's lookups the first). */
static tkd_status read_json(const char *path, bool integers_only, cJSON **out)
{
    void *data = NULL;
    size_t n = 0;
    *out = NULL;
    TKD_TRY(tkd_read_file(path, &data, &n));
    const char *text = data, *why = NULL, *end = NULL;
    int shown = 0;
    size_t bad = json_text_check(text, n, integers_only, &why, &shown);
    cJSON *root = bad == n ? cJSON_ParseWithLengthOpts(text, n, &end, false) : NULL;
    tkd_status st = TKD_OK;
    int line, col;
    if (bad < n || !root) {
        tkd_json_line_col(text, n, bad < n ? bad : (size_t)(end - text), &line, &col);
        st = tkd_error_set(TKD_ERR_FORMAT, "%s:%d:%d: %.*s%s%s", path, line, col, shown, text + (bad < n ? bad : 0),
                           shown ? ": " : "", bad < n ? why : "not valid JSON");
    } else if (!cJSON_IsObject(root)) {
        st = tkd_error_set(TKD_ERR_FORMAT, "%s: not a JSON object", path);
    } else {
        st = tkd_json_unique_keys(root, text, n, path);
    }
    free(data);
    if (st != TKD_OK) {
        cJSON_Delete(root);
        return st;
    }
    *out = root;
    return TKD_OK;
}

/* ---- tokenizer_config.json ------------------------------------------------------------------ */

/* bos_token / eos_token: a string, an AddedToken object with "content", or null; NULL when unset. */
static tkd_status config_token(const char *cfg_path, const cJSON *cfg, const char *key, const char **content)
{
    const cJSON *v;
    *content = NULL;
    TKD_TRY(get_typed(cfg_path, cfg, "", key, cJSON_String | cJSON_Object | cJSON_NULL,
                      "a string, an object with \"content\" or null", &v));
    if (cJSON_IsObject(v))
        TKD_TRY(get_required(cfg_path, v, key, "content", cJSON_String, "a string", &v));
    *content = cJSON_IsString(v) ? v->valuestring : NULL;
    return TKD_OK;
}

static tkd_status config_special(loader *L, const char *cfg_path, const cJSON *cfg, const char *key, int64_t *id)
{
    const char *content;
    TKD_TRY(config_token(cfg_path, cfg, key, &content));
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
    const cJSON *add_bos, *add_eos;
    TKD_TRY(config_special(L, cfg_path, cfg, "bos_token", &bos));
    TKD_TRY(config_special(L, cfg_path, cfg, "eos_token", &eos));
    TKD_TRY(get_typed(cfg_path, cfg, "", "add_bos_token", J_BOOL | cJSON_NULL, "true, false or null", &add_bos));
    TKD_TRY(get_typed(cfg_path, cfg, "", "add_eos_token", J_BOOL | cJSON_NULL, "true, false or null", &add_eos));
    if (eos >= 0)
        tok->eos_id = eos;
    if (!cJSON_IsBool(add_bos) && !cJSON_IsBool(add_eos))
        return TKD_OK;
    tok->nprefix = tok->nsuffix = 0;
    if (cJSON_IsTrue(add_bos) && bos < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: add_bos_token is true but bos_token is not set", cfg_path);
    if (cJSON_IsTrue(add_eos) && eos < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: add_eos_token is true but eos_token is not set", cfg_path);
    if (cJSON_IsTrue(add_bos))
        TKD_TRY(push_id(L, &tok->prefix, &tok->nprefix, (uint32_t)bos));
    if (cJSON_IsTrue(add_eos))
        TKD_TRY(push_id(L, &tok->suffix, &tok->nsuffix, (uint32_t)eos));
    return TKD_OK;
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
    cJSON *cfg = NULL;
    st = read_json(cfg_path, false, &cfg);
    if (st == TKD_OK)
        st = apply_config(L, cfg_path, cfg);
    cJSON_Delete(cfg);
    free(cfg_path);
    return st;
}

/* ---- the whole file ------------------------------------------------------------------------- */

static tkd_status load_json(loader *L, const cJSON *root)
{
    static const char *const keys[] = {"version", "truncation", "padding", "added_tokens", "normalizer",
                                       "pre_tokenizer", "post_processor", "decoder", "model", NULL};
    const cJSON *added, *model, *norm, *pre, *post, *dec;
    TKD_TRY(known_keys(L, root, "", keys));
    TKD_TRY(want_off(L, root, "", "truncation", cJSON_Object, "an object or null"));
    TKD_TRY(want_off(L, root, "", "padding", cJSON_Object, "an object or null"));
    TKD_TRY(get_typed(L->path, root, "", "added_tokens", cJSON_Array | cJSON_NULL, "an array", &added));
    TKD_TRY(get_typed(L->path, root, "", "model", cJSON_Object, "an object", &model));
    TKD_TRY(get_typed(L->path, root, "", "normalizer", cJSON_Object | cJSON_NULL, "an object or null", &norm));
    TKD_TRY(get_typed(L->path, root, "", "pre_tokenizer", cJSON_Object | cJSON_NULL, "an object or null", &pre));
    TKD_TRY(get_typed(L->path, root, "", "post_processor", cJSON_Object | cJSON_NULL, "an object or null", &post));
    TKD_TRY(get_typed(L->path, root, "", "decoder", cJSON_Object | cJSON_NULL, "an object or null", &dec));
    added = cJSON_IsArray(added) ? added : NULL;
    TKD_TRY(load_model(L, model, added));
    /* before the added tokens: a normalized one is matched by its normalized content */
    TKD_TRY(load_normalizer(L, norm, "normalizer"));
    TKD_TRY(load_added(L, added));
    if (!pre || cJSON_IsNull(pre))
        return refuse(L, "pre_tokenizer", "null (no ByteLevel)");
    TKD_TRY(load_pre_tokenizer(L, pre, "pre_tokenizer"));
    if (L->tok->nsteps == 0 || L->tok->steps[L->tok->nsteps - 1].kind != TKD_TOK_STEP_BYTELEVEL)
        return refuse(L, "pre_tokenizer", "a chain that does not end with ByteLevel");
    TKD_TRY(load_post(L, post, "post_processor"));
    TKD_TRY(load_decoder(L, dec));
    if (L->tok->nsuffix > 0)
        L->tok->eos_id = L->tok->suffix[L->tok->nsuffix - 1];
    return TKD_OK;
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
    if (st == TKD_OK && !tkd_file_exists(tok->path))
        st = tkd_error_set(TKD_ERR_NOT_FOUND, "%s: no such file — give a tokenizer.json or the checkpoint directory "
                           "holding one", tok->path);
    cJSON *root = NULL;
    if (st == TKD_OK)
        st = read_json(tok->path, true, &root);
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
