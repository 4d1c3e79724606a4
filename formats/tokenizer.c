/* tokenizer.c — reads a Hugging Face tokenizer.json (and tokenizer_config.json beside it) into the
 * tables of tokenizer_internal.h; see tokenizer.h for what is accepted. Every field of the file is
 * either understood or refused by name: an encoder that skipped a field it does not implement
 * would give other ids than Hugging Face without saying so. Here: the whole file, its normalizer,
 * pre-tokenizers, post-processor and decoder, tokenizer_config.json, and the pattern translation;
 * the typed field reading is tokenizer_json.c, the model and added tokens tokenizer_model.c.
 */
#include "formats/tokenizer.h"

#include "common/fileio.h"
#include "formats/tokenizer_load_internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* GPT-2's pattern, which ByteLevel applies when use_regex is true (tokenizers' byte_level.rs). */
static const char gpt2_pattern[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ---- normalizer and pre-tokenizers -------------------------------------------------------- */

static tkd_status load_normalizer(loader *L, const cJSON *norm, const char *where)
{
    static const char *const keys[] = {"type", NULL};
    const char *type;
    if (!norm || cJSON_IsNull(norm))
        return TKD_OK;
    TKD_TRY(tkd_tokjson_node_type(L, norm, where, &type));
    if (type && strcmp(type, "NFC") == 0) {
        L->tok->nfc = true;
        return tkd_tokjson_known_keys(L, norm, where, keys);
    }
    if (type && strcmp(type, "Sequence") == 0)
        return tkd_tokjson_each_member(L, norm, where, "normalizers", load_normalizer);
    return tkd_tokjson_refuse_type(L, where, type);
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
    TKD_TRY(tkd_tokjson_known_keys(L, node, where, keys));
    TKD_TRY(tkd_tokjson_want_off(L, node, where, "invert", J_BOOL, "true or false"));
    TKD_TRY(tkd_tokjson_get_required(L->path, node, where, "behavior", cJSON_String, "a string", &behavior));
    if (strcmp(behavior->valuestring, "Isolated") != 0)
        return tkd_tokjson_refuse(L, tkd_tokjson_at_key(where, "behavior").s, behavior->valuestring);
    jpath pw = tkd_tokjson_at_key(where, "pattern");
    TKD_TRY(tkd_tokjson_get_required(L->path, node, where, "pattern", cJSON_Object, "an object", &pat));
    TKD_TRY(tkd_tokjson_known_keys(L, pat, pw.s, pat_keys));
    TKD_TRY(tkd_tokjson_get_typed(L->path, pat, pw.s, "Regex", cJSON_String, "a string", &rx));
    TKD_TRY(tkd_tokjson_get_typed(L->path, pat, pw.s, "String", cJSON_String, "a string", &lit));
    if (!rx == !lit)
        return tkd_tokjson_malformed(L, pw.s, "neither {\"Regex\": ...} nor {\"String\": ...}");
    tkd_tok_step step = {.kind = TKD_TOK_STEP_SPLIT};
    TKD_TRY(compile_pattern(L, rx ? rx->valuestring : lit->valuestring, !rx, pw.s, &step.re, &step.jit));
    return add_step(L, step, pw.s);
}

static tkd_status load_byte_level(loader *L, const cJSON *node, const char *where)
{
    static const char *const keys[] = {"type", "add_prefix_space", "trim_offsets", "use_regex", NULL};
    bool regex, trim;
    tkd_tok_step step = {.kind = TKD_TOK_STEP_BYTELEVEL};
    TKD_TRY(tkd_tokjson_known_keys(L, node, where, keys));
    TKD_TRY(tkd_tokjson_flag(L, node, where, "add_prefix_space", true, &step.add_prefix_space));
    TKD_TRY(tkd_tokjson_flag(L, node, where, "trim_offsets", true, &trim)); /* offsets only: ids are the same */
    TKD_TRY(tkd_tokjson_flag(L, node, where, "use_regex", true, &regex));
    char what[300];
    snprintf(what, sizeof what, "%.250s (ByteLevel's GPT-2 pattern)", where);
    if (regex)
        TKD_TRY(compile_pattern(L, gpt2_pattern, false, what, &step.re, &step.jit));
    return add_step(L, step, what);
}

static tkd_status load_pre_tokenizer(loader *L, const cJSON *node, const char *where)
{
    const char *type;
    TKD_TRY(tkd_tokjson_node_type(L, node, where, &type));
    if (type && strcmp(type, "Sequence") == 0)
        return tkd_tokjson_each_member(L, node, where, "pretokenizers", load_pre_tokenizer);
    if (L->tok->nsteps > 0 && L->tok->steps[L->tok->nsteps - 1].kind == TKD_TOK_STEP_BYTELEVEL)
        return tkd_tokjson_refuse(L, where, "a pre-tokenizer after ByteLevel");
    if (type && strcmp(type, "Split") == 0)
        return load_split(L, node, where);
    if (type && strcmp(type, "ByteLevel") == 0)
        return load_byte_level(L, node, where);
    return tkd_tokjson_refuse_type(L, where, type);
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
    TKD_TRY(tkd_tokjson_get_typed(L->path, specials, sw, name, cJSON_Object, "an object", &entry));
    if (!entry)
        return tkd_tokjson_malformed(L, tkd_tokjson_at_key(sw, name).s,
                                     "a SpecialToken of the template missing from special_tokens");
    jpath ew = tkd_tokjson_at_key(sw, name);
    TKD_TRY(tkd_tokjson_get_required(L->path, entry, ew.s, "ids", cJSON_Array, "an array", &ids));
    int i = 0;
    for (const cJSON *it = ids->child; it; it = it->next, i++) {
        uint32_t id;
        jpath iw = tkd_tokjson_at_index(ew.s, "ids", i);
        TKD_TRY(tkd_tokjson_id(L->path, it, iw.s, &id));
        if (id >= (uint32_t)L->tok->vocab_size)
            return tkd_tokjson_malformed(L, iw.s, "an id outside the vocabulary");
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
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: an object expected, not %s", L->path, where,
                             tkd_tokjson_kind(item));
    TKD_TRY(tkd_tokjson_known_keys(L, item, where, keys));
    TKD_TRY(tkd_tokjson_get_typed(L->path, item, where, "Sequence", cJSON_Object, "an object", &seq));
    TKD_TRY(tkd_tokjson_get_typed(L->path, item, where, "SpecialToken", cJSON_Object, "an object", &sp));
    if (!seq == !sp)
        return tkd_tokjson_malformed(L, where, "not one of {\"Sequence\": ...} and {\"SpecialToken\": ...}");
    jpath iw = tkd_tokjson_at_key(where, seq ? "Sequence" : "SpecialToken");
    TKD_TRY(tkd_tokjson_get_required(L->path, seq ? seq : sp, iw.s, "id", cJSON_String, "a string", &id));
    if (sp)
        return template_special(L, specials, sw, id->valuestring, *seen_a);
    if (*seen_a || strcmp(id->valuestring, "A") != 0)
        return tkd_tokjson_refuse(L, tkd_tokjson_at_key(iw.s, "id").s, "a template other than one $A");
    *seen_a = true;
    return TKD_OK;
}

static tkd_status load_template(loader *L, const cJSON *node, const char *where)
{
    const cJSON *single, *specials;
    TKD_TRY(tkd_tokjson_get_required(L->path, node, where, "single", cJSON_Array, "an array", &single));
    TKD_TRY(tkd_tokjson_get_typed(L->path, node, where, "special_tokens", cJSON_Object, "an object", &specials));
    jpath sw = tkd_tokjson_at_key(where, "special_tokens");
    bool seen_a = false;
    int i = 0;
    for (const cJSON *it = single->child; it; it = it->next, i++)
        TKD_TRY(template_item(L, it, tkd_tokjson_at_index(where, "single", i).s, sw.s, specials, &seen_a));
    return seen_a ? TKD_OK : tkd_tokjson_malformed(L, tkd_tokjson_at_key(where, "single").s, "no $A");
}

static tkd_status load_post(loader *L, const cJSON *node, const char *where)
{
    const char *type;
    if (!node || cJSON_IsNull(node))
        return TKD_OK;
    TKD_TRY(tkd_tokjson_node_type(L, node, where, &type));
    if (type && strcmp(type, "ByteLevel") == 0) /* trim_offsets: offsets only, ids are unchanged */
        return TKD_OK;
    if (type && strcmp(type, "Sequence") == 0)
        return tkd_tokjson_each_member(L, node, where, "processors", load_post);
    if (type && strcmp(type, "TemplateProcessing") == 0)
        return load_template(L, node, where);
    return tkd_tokjson_refuse_type(L, where, type);
}

static tkd_status load_decoder(loader *L, const cJSON *node)
{
    const char *type;
    if (!node || cJSON_IsNull(node))
        return TKD_OK;
    TKD_TRY(tkd_tokjson_node_type(L, node, "decoder", &type));
    return type && strcmp(type, "ByteLevel") == 0 ? TKD_OK : tkd_tokjson_refuse_type(L, "decoder", type);
}

/* ---- tokenizer_config.json ------------------------------------------------------------------ */

/* bos_token / eos_token: a string, an AddedToken object with "content", or null; NULL when unset. */
static tkd_status config_token(const char *cfg_path, const cJSON *cfg, const char *key, const char **content)
{
    const cJSON *v;
    *content = NULL;
    TKD_TRY(tkd_tokjson_get_typed(cfg_path, cfg, "", key, cJSON_String | cJSON_Object | cJSON_NULL,
                                  "a string, an object with \"content\" or null", &v));
    if (cJSON_IsObject(v))
        TKD_TRY(tkd_tokjson_get_required(cfg_path, v, key, "content", cJSON_String, "a string", &v));
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
    TKD_TRY(tkd_tokjson_get_typed(cfg_path, cfg, "", "add_bos_token", J_BOOL | cJSON_NULL, "true, false or null",
                                  &add_bos));
    TKD_TRY(tkd_tokjson_get_typed(cfg_path, cfg, "", "add_eos_token", J_BOOL | cJSON_NULL, "true, false or null",
                                  &add_eos));
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
    st = tkd_tokjson_read(cfg_path, false, &cfg);
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
    TKD_TRY(tkd_tokjson_known_keys(L, root, "", keys));
    TKD_TRY(tkd_tokjson_want_off(L, root, "", "truncation", cJSON_Object, "an object or null"));
    TKD_TRY(tkd_tokjson_want_off(L, root, "", "padding", cJSON_Object, "an object or null"));
    TKD_TRY(tkd_tokjson_get_typed(L->path, root, "", "added_tokens", cJSON_Array | cJSON_NULL, "an array", &added));
    TKD_TRY(tkd_tokjson_get_typed(L->path, root, "", "model", cJSON_Object, "an object", &model));
    TKD_TRY(tkd_tokjson_get_typed(L->path, root, "", "normalizer", cJSON_Object | cJSON_NULL, "an object or null",
                                  &norm));
    TKD_TRY(tkd_tokjson_get_typed(L->path, root, "", "pre_tokenizer", cJSON_Object | cJSON_NULL, "an object or null",
                                  &pre));
    TKD_TRY(tkd_tokjson_get_typed(L->path, root, "", "post_processor", cJSON_Object | cJSON_NULL, "an object or null",
                                  &post));
    TKD_TRY(tkd_tokjson_get_typed(L->path, root, "", "decoder", cJSON_Object | cJSON_NULL, "an object or null", &dec));
    added = cJSON_IsArray(added) ? added : NULL;
    TKD_TRY(tkd_tokmodel_load(L, model, added));
    /* before the added tokens: a normalized one is matched by its normalized content */
    TKD_TRY(load_normalizer(L, norm, "normalizer"));
    TKD_TRY(tkd_tokmodel_load_added(L, added));
    if (!pre || cJSON_IsNull(pre))
        return tkd_tokjson_refuse(L, "pre_tokenizer", "null (no ByteLevel)");
    TKD_TRY(load_pre_tokenizer(L, pre, "pre_tokenizer"));
    if (L->tok->nsteps == 0 || L->tok->steps[L->tok->nsteps - 1].kind != TKD_TOK_STEP_BYTELEVEL)
        return tkd_tokjson_refuse(L, "pre_tokenizer", "a chain that does not end with ByteLevel");
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
    tkd_tokmodel_byte_alphabet(L.char_byte);
    if (st == TKD_OK && !tkd_file_exists(tok->path))
        st = tkd_error_set(TKD_ERR_NOT_FOUND, "%s: no such file — give a tokenizer.json or the checkpoint directory "
                           "holding one", tok->path);
    cJSON *root = NULL;
    if (st == TKD_OK)
        st = tkd_tokjson_read(tok->path, true, &root);
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
    tkd_tokmodel_byte_alphabet(char_byte);
    uint8_t *buf = malloc(n + 1);
    long nb = buf ? tkd_tokmodel_byte_level_decode(char_byte, content, buf) : -1;
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
