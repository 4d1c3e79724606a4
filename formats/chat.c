/* chat.c — see chat.h: finding the template beside the tokenizer, and the context every render
 * shares (special tokens, then the caller's kwargs). Encoding a record is chat_encode.c. */
#include "formats/chat_internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"

void tkd_chat_free(tkd_chat *c)
{
    if (!c)
        return;
    tkd_jinja_free(c->tmpl);
    json_decref(c->base);
    free(c);
}

const char *tkd_chat_source(const tkd_chat *c) { return c->source; }

const char *tkd_chat_rule(const tkd_chat *c)
{
    return tkd_jinja_has_generation(c->tmpl) ? "{% generation %} blocks" : "assistant turns by prefix";
}

void tkd_chat_flags_free(tkd_chat_flags *f)
{
    free(f->v);
    *f = (tkd_chat_flags){0};
}

/* A special token of tokenizer_config.json: a string, or an AddedToken object {"content": ...}. */
static const char *token_text(const cJSON *cfg, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (cJSON_IsObject(v))
        v = cJSON_GetObjectItemCaseSensitive(v, "content");
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} of which
 * transformers takes "default". *src is malloc'd, NULL when there is none. */
static tkd_status config_template(const cJSON *cfg, const char *cfg_path, char **src)
{
    *src = NULL;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    if (cJSON_IsArray(t)) {
        const cJSON *e;
        cJSON_ArrayForEach(e, t)
        {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(e, "name");
            if (cJSON_IsString(name) && strcmp(name->valuestring, "default") == 0) {
                t = cJSON_GetObjectItemCaseSensitive(e, "template");
                break;
            }
        }
        if (cJSON_IsArray(t))
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: chat_template is a list without a \"default\" entry; "
                                 "name one with --chat-template", cfg_path);
    }
    if (t && !cJSON_IsString(t))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: chat_template is neither a string nor a list of named "
                             "templates", cfg_path);
    if (t && !(*src = strdup(t->valuestring)))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", cfg_path);
    return TKD_OK;
}

/* The special tokens transformers passes to every template (its special_tokens_map), as strings. */
static tkd_status add_special_tokens(json_t *base, const cJSON *cfg)
{
    static const char *const keys[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
    for (size_t i = 0; cfg && i < sizeof keys / sizeof keys[0]; i++) {
        const char *s = token_text(cfg, keys[i]);
        if (s && json_object_set_new(base, keys[i], json_string(s)) != 0)
            return tkd_error_set(TKD_ERR_NOMEM, "chat template: out of memory");
    }
    return TKD_OK;
}

/* kwargs (a JSON object) over the special tokens, as transformers' apply_chat_template(**kwargs). */
static tkd_status add_kwargs(json_t *base, const char *kwargs)
{
    if (!kwargs || !*kwargs)
        return TKD_OK;
    json_error_t e;
    json_t *k = json_loads(kwargs, JSON_REJECT_DUPLICATES, &e);
    if (!k || !json_is_object(k)) {
        json_decref(k);
        return tkd_error_set(TKD_ERR_INVALID_ARG, "--chat-kwargs: %s (give a JSON object, e.g. '{\"enable_thinking\": "
                             "false}')", k ? "not a JSON object" : e.text);
    }
    static const char *const own[] = {"messages", "tools", "add_generation_prompt"};
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
        if (json_object_get(k, own[i])) {
            json_decref(k);
            return tkd_error_set(TKD_ERR_INVALID_ARG, "--chat-kwargs: '%s' is set by each record, not by kwargs",
                                 own[i]);
        }
    int rc = json_object_update(base, k);
    json_decref(k);
    return rc == 0 ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "--chat-kwargs: out of memory");
}

/* The template's text and where it came from: the caller's file, else chat_template.jinja beside
 * tokenizer.json (transformers reads it first), else tokenizer_config.json's chat_template. */
static tkd_status find_template(tkd_chat *c, const char *dir, const cJSON *cfg, const char *cfg_path,
                                const tkd_chat_opts *o, char **src, size_t *len)
{
    char jinja[4200];
    snprintf(jinja, sizeof jinja, "%s/chat_template.jinja", dir);
    const char *file = o && o->template_path ? o->template_path : tkd_file_exists(jinja) ? jinja : NULL;
    if (file) {
        snprintf(c->source, sizeof c->source, "%s", file);
        return tkd_read_input(file, "chat template", (void **)src, len);
    }
    TKD_TRY(config_template(cfg, cfg_path, src));
    if (!*src) {
        tkd_error_set(TKD_ERR_NOT_FOUND, "%s: no chat template: neither %s nor a chat_template in it", cfg_path,
                      jinja);
        return tkd_error_hint(TKD_ERR_NOT_FOUND, "give one with --chat-template FILE");
    }
    *len = strlen(*src);
    snprintf(c->source, sizeof c->source, "%s (chat_template)", cfg_path);
    return TKD_OK;
}

/* tokenizer_config.json beside the tokenizer, parsed (NULL when absent). */
static tkd_status read_config(const char *cfg_path, cJSON **cfg)
{
    *cfg = NULL;
    if (!tkd_file_exists(cfg_path))
        return TKD_OK;
    char *text = NULL;
    size_t n = 0;
    TKD_TRY(tkd_read_input(cfg_path, "tokenizer config", (void **)&text, &n));
    *cfg = cJSON_ParseWithLength(text, n);
    free(text);
    return *cfg ? TKD_OK : tkd_error_set(TKD_ERR_FORMAT, "%s: not valid JSON", cfg_path);
}

static tkd_status open_into(tkd_chat *c, const tkd_chat_opts *o)
{
    char dir[4096], cfg_path[4200];
    const char *tp = tkd_tokenizer_path(c->tok), *slash = strrchr(tp, '/');
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - tp) : 1, slash ? tp : ".");
    snprintf(cfg_path, sizeof cfg_path, "%s/tokenizer_config.json", dir);
    cJSON *cfg = NULL;
    char *src = NULL;
    size_t len = 0;
    tkd_status st = read_config(cfg_path, &cfg);
    if (st == TKD_OK)
        st = find_template(c, dir, cfg, cfg_path, o, &src, &len);
    if (st == TKD_OK)
        st = tkd_jinja_parse(src, len, c->source, &c->tmpl);
    if (st == TKD_OK && !(c->base = json_object()))
        st = tkd_error_set(TKD_ERR_NOMEM, "chat template: out of memory");
    if (st == TKD_OK)
        st = add_special_tokens(c->base, cfg);
    if (st == TKD_OK)
        st = add_kwargs(c->base, o ? o->kwargs : NULL);
    free(src);
    cJSON_Delete(cfg);
    return st;
}

tkd_status tkd_chat_open(const tkd_tokenizer *tok, const tkd_chat_opts *o, tkd_chat **out)
{
    *out = NULL;
    tkd_chat *c = calloc(1, sizeof *c);
    if (!c)
        return tkd_error_set(TKD_ERR_NOMEM, "chat template: out of memory");
    c->tok = tok;
    c->now = o ? o->now : -1;
    tkd_status st = open_into(c, o);
    if (st != TKD_OK) {
        tkd_chat_free(c);
        return st;
    }
    *out = c;
    return TKD_OK;
}
