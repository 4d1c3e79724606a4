/* tokenizer_json.c — reading tokenizer.json's fields as Hugging Face does (tokenizer_load_internal.h):
 * the text checked as serde_json reads it, each field looked up with its type checked, and messages
 * that name the field by its JSON path. A field is understood or refused by name, never skipped.
 */
#include "formats/tokenizer_load_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "formats/json_check.h"
#include "formats/utf8.h"

/* ---- messages ---------------------------------------------------------------------------- */

jpath tkd_tokjson_at_key(const char *where, const char *key)
{
    jpath p;
    snprintf(p.s, sizeof p.s, "%.160s%s%.80s", where, *where ? "." : "", key);
    return p;
}

jpath tkd_tokjson_at_index(const char *where, const char *key, int i)
{
    jpath p;
    snprintf(p.s, sizeof p.s, "%.160s%s%.40s[%d]", where, *where && *key ? "." : "", key, i);
    return p;
}

tkd_status tkd_tokjson_refuse(const loader *L, const char *field, const char *what)
{
    tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: %s: %s is not supported", L->path, field, what);
    return tkd_error_hint(TKD_ERR_UNSUPPORTED, "topkd reads the byte-level BPE tokenizers of GPT-2, Llama 3 and "
                          "Qwen2/2.5/3 (docs/teacher-dump.md, \"Tokenizing text\")");
}

tkd_status tkd_tokjson_malformed(const loader *L, const char *field, const char *what)
{
    return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: %s", L->path, field, what);
}


/* ---- typed fields --------------------------------------------------------------------------- */

const char *tkd_tokjson_kind(const cJSON *v)
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
tkd_status tkd_tokjson_get_typed(const char *file, const cJSON *obj, const char *where, const char *key, int types,
                                 const char *want, const cJSON **out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = NULL;
    if (v && !((v->type & 0xFF) & types))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: %s expected, not %s", file, tkd_tokjson_at_key(where, key).s,
                             want, tkd_tokjson_kind(v));
    *out = v;
    return TKD_OK;
}

/* tkd_tokjson_get_typed for a field that must be there. */
tkd_status tkd_tokjson_get_required(const char *file, const cJSON *obj, const char *where, const char *key, int types,
                                    const char *want, const cJSON **out)
{
    TKD_TRY(tkd_tokjson_get_typed(file, obj, where, key, types, want, out));
    if (!*out)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: missing (%s expected)", file, tkd_tokjson_at_key(where, key).s,
                             want);
    return TKD_OK;
}

/* v as a token id: an integer in [0, TKD_TOKENIZER_MAX_ID]. */
bool tkd_tokjson_id_value(const cJSON *v, uint32_t *id)
{
    *id = 0;
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || v->valuedouble > TKD_TOKENIZER_MAX_ID)
        return false;
    *id = (uint32_t)v->valuedouble; /* in range: the conversion is defined */
    return (double)*id == v->valuedouble;
}

tkd_status tkd_tokjson_bad_id(const char *file, const cJSON *v, const char *field)
{
    if (!cJSON_IsNumber(v))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: a token id (an integer) expected, not %s", file, field,
                             tkd_tokjson_kind(v));
    if (v->valuedouble >= 0 && v->valuedouble <= TKD_TOKENIZER_MAX_ID)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: the token id %.17g is not an integer", file, field,
                             v->valuedouble);
    tkd_error_set(TKD_ERR_FORMAT, "%s: %s: the token id %.17g is outside [0, %d]", file, field, v->valuedouble,
                  TKD_TOKENIZER_MAX_ID);
    return tkd_error_hint(TKD_ERR_FORMAT, "topkd's limit; the largest vocabularies today hold about 262k tokens");
}

tkd_status tkd_tokjson_id(const char *file, const cJSON *v, const char *field, uint32_t *id)
{
    return tkd_tokjson_id_value(v, id) ? TKD_OK : tkd_tokjson_bad_id(file, v, field);
}

tkd_status tkd_tokjson_flag(const loader *L, const cJSON *obj, const char *where, const char *key, bool dflt, bool *out)
{
    const cJSON *v;
    TKD_TRY(tkd_tokjson_get_typed(L->path, obj, where, key, J_BOOL, "true or false", &v));
    *out = v ? cJSON_IsTrue(v) : dflt;
    return TKD_OK;
}

/* A field whose feature is not implemented: absent, null, false, 0 or "" pass (types: the cJSON types
 * it may have besides null); anything else is refused showing the value. */
tkd_status tkd_tokjson_want_off(const loader *L, const cJSON *obj, const char *where, const char *key, int types,
                                const char *want)
{
    const cJSON *v;
    TKD_TRY(tkd_tokjson_get_typed(L->path, obj, where, key, types | cJSON_NULL, want, &v));
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v) || (cJSON_IsNumber(v) && v->valuedouble == 0) ||
        (cJSON_IsString(v) && v->valuestring[0] == '\0'))
        return TKD_OK;
    char what[64];
    char *text = cJSON_PrintUnformatted(v);
    snprintf(what, sizeof what, "%.40s%s", text ? text : "this value", text && strlen(text) > 40 ? "..." : "");
    free(text);
    return tkd_tokjson_refuse(L, tkd_tokjson_at_key(where, key).s, what);
}

/* Every key of obj must be in the NULL-terminated list. */
tkd_status tkd_tokjson_known_keys(const loader *L, const cJSON *obj, const char *where, const char *const *keys)
{
    for (const cJSON *it = obj ? obj->child : NULL; it; it = it->next) {
        bool ok = false;
        for (const char *const *k = keys; *k && !ok; k++)
            ok = strcmp(*k, it->string) == 0;
        if (!ok)
            return tkd_tokjson_refuse(L, tkd_tokjson_at_key(where, it->string).s, "this key");
    }
    return TKD_OK;
}

/* node (at where) must be an object; its "type" (a string) in *type, NULL when it has none. */
tkd_status tkd_tokjson_node_type(const loader *L, const cJSON *node, const char *where, const char **type)
{
    const cJSON *t;
    *type = NULL;
    if (!cJSON_IsObject(node))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s: an object expected, not %s", L->path, where,
                             tkd_tokjson_kind(node));
    TKD_TRY(tkd_tokjson_get_typed(L->path, node, where, "type", cJSON_String, "a string", &t));
    *type = t ? t->valuestring : NULL;
    return TKD_OK;
}

/* A Sequence (normalizer, pre-tokenizer, post-processor): each member of its list_key, in order.
 * The list is required (tokenizers' serde has no default for it); an empty one does nothing, as in
 * tokenizers, where an empty Sequence passes its input through. */
tkd_status tkd_tokjson_each_member(loader *L, const cJSON *node, const char *where, const char *list_key, node_fn fn)
{
    const char *const keys[] = {"type", list_key, NULL};
    const cJSON *list;
    TKD_TRY(tkd_tokjson_known_keys(L, node, where, keys));
    TKD_TRY(tkd_tokjson_get_required(L->path, node, where, list_key, cJSON_Array, "an array", &list));
    int i = 0;
    for (const cJSON *it = list->child; it; it = it->next, i++)
        TKD_TRY(fn(L, it, tkd_tokjson_at_index(where, list_key, i).s));
    return TKD_OK;
}

tkd_status tkd_tokjson_refuse_type(const loader *L, const char *field, const char *type)
{
    char what[96];
    snprintf(what, sizeof what, "type %.60s", type ? type : "(none)");
    return tkd_tokjson_refuse(L, field, what);
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
tkd_status tkd_tokjson_read(const char *path, bool integers_only, cJSON **out)
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

