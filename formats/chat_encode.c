/* chat_encode.c — one JSON Lines record to ids and flags (chat.h): the record read as a
 * conversation, rendered whole, its trained spans found (generation blocks, or renders of its
 * prefixes), the text tokenized once, and each token's bytes laid over the spans. */
#include "formats/chat_internal.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/text_docs.h"
#include "formats/tokens.h"

/* A record read as a conversation. */
typedef struct conv {
    json_t *msgs;   /* the messages to render (a reference this struct holds) */
    json_t *tools;  /* the record's "tools", borrowed from the record, or NULL */
    size_t nprompt; /* prompt/completion: the messages of the prompt; 0 for a "messages" record */
    bool pc;        /* a prompt/completion record */
} conv;

/* "path:line: what" for the record. */
static tkd_status rec_fail(const char *path, int64_t line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static tkd_status rec_fail(const char *path, int64_t line, const char *fmt, ...)
{
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return tkd_error_set(TKD_ERR_FORMAT, "%s:%lld: %s", path, (long long)line, what);
}

/* Any string inside v holding a NUL: a template's context is read by cJSON, which would cut it. */
static bool has_nul(const json_t *v)
{
    if (json_is_string(v))
        return strlen(json_string_value(v)) != json_string_length(v);
    for (size_t i = 0; json_is_array(v) && i < json_array_size(v); i++)
        if (has_nul(json_array_get(v, i)))
            return true;
    for (void *it = json_is_object(v) ? json_object_iter((json_t *)v) : NULL; it;
         it = json_object_iter_next((json_t *)v, it))
        if (has_nul(json_object_iter_value(it)))
            return true;
    return false;
}

/* A list of messages, each an object with a string "role"; what names it ("messages", "prompt"). */
static tkd_status check_messages(const char *path, int64_t line, const json_t *m, const char *what)
{
    if (!json_is_array(m))
        return rec_fail(path, line, "\"%s\" is not a list of messages", what);
    for (size_t i = 0; i < json_array_size(m); i++) {
        const json_t *e = json_array_get(m, i);
        if (!json_is_object(e))
            return rec_fail(path, line, "%s[%zu] is not an object", what, i);
        if (!json_is_string(json_object_get(e, "role")))
            return rec_fail(path, line, "%s[%zu] has no string \"role\"", what, i);
    }
    return TKD_OK;
}

/* A prompt or completion: a string becomes one message of role `role`; a list is taken as it is. */
static tkd_status pc_part(const char *path, int64_t line, json_t *v, const char *what, const char *role,
                          json_t *into)
{
    if (json_is_string(v)) {
        json_t *m = json_pack("{s:s,s:O}", "role", role, "content", v);
        return m && json_array_append_new(into, m) == 0 ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    }
    TKD_TRY(check_messages(path, line, v, what));
    return json_array_extend(into, v) == 0 ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
}

static tkd_status read_conv(const char *path, int64_t line, json_t *obj, conv *cv)
{
    if (!json_is_object(obj))
        return rec_fail(path, line, "not a JSON object (JSON Lines: one object per line)");
    json_t *msgs = json_object_get(obj, "messages"), *p = json_object_get(obj, "prompt"),
           *c = json_object_get(obj, "completion");
    cv->tools = json_object_get(obj, "tools");
    if (cv->tools && !json_is_array(cv->tools) && !json_is_null(cv->tools))
        return rec_fail(path, line, "\"tools\" is not a list");
    if (has_nul(obj))
        return rec_fail(path, line, "a string holds a NUL character (\\u0000), which a chat template cannot render");
    if (msgs) {
        TKD_TRY(check_messages(path, line, msgs, "messages"));
        cv->msgs = json_incref(msgs);
        return TKD_OK;
    }
    if (!p || !c)
        return rec_fail(path, line, "no \"messages\" list, and no \"prompt\" with a \"completion\"");
    if (!(cv->msgs = json_array()))
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    cv->pc = true;
    TKD_TRY(pc_part(path, line, p, "prompt", "user", cv->msgs));
    cv->nprompt = json_array_size(cv->msgs);
    TKD_TRY(pc_part(path, line, c, "completion", "assistant", cv->msgs));
    if (json_array_size(cv->msgs) == cv->nprompt)
        return rec_fail(path, line, "\"completion\" holds no message");
    return TKD_OK;
}

/* Renders messages [0, n) of cv (add_generation_prompt as given) into *out (malloc'd, *len bytes);
 * g, when not NULL, gets the generation blocks' spans. */
static tkd_status render(const tkd_chat *c, const conv *cv, size_t n, bool gen_prompt, tkd_jinja_spans *g,
                         const char *path, int64_t line, char **out, size_t *len)
{
    /* a deep copy: other threads render from c->base too, and a shallow copy would change the
     * reference counts of its values */
    json_t *ctx = json_deep_copy(c->base), *msgs = json_array();
    for (size_t i = 0; msgs && i < n; i++)
        json_array_append(msgs, json_array_get(cv->msgs, i));
    char *js = NULL;
    if (ctx && msgs && json_object_set(ctx, "messages", msgs) == 0 &&
        json_object_set_new(ctx, "add_generation_prompt", json_boolean(gen_prompt)) == 0 &&
        (!cv->tools || json_object_set(ctx, "tools", cv->tools) == 0))
        js = json_dumps(ctx, JSON_COMPACT);
    json_decref(msgs);
    json_decref(ctx);
    if (!js)
        return tkd_error_set(TKD_ERR_NOMEM, "%s:%lld: out of memory", path, (long long)line);
    tkd_jinja_render_opts ro = {.now = c->now, .generation = g};
    tkd_status st = tkd_jinja_render(c->tmpl, js, strlen(js), &ro, out, len);
    free(js);
    return st == TKD_OK ? st : tkd_error_prefix(st, "%s:%lld", path, (long long)line);
}

static tkd_status push_span(tkd_jinja_spans *s, size_t start, size_t end)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 8;
        tkd_jinja_span *v = realloc(s->v, cap * sizeof *v);
        if (!v)
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
        s->v = v, s->cap = cap;
    }
    s->v[s->n++] = (tkd_jinja_span){start, end};
    return TKD_OK;
}

static bool starts_with(const char *s, size_t n, const char *p, size_t pn)
{
    return pn <= n && memcmp(s, p, pn) == 0;
}

/* The text messages [a, b) add: render(messages[:b]) after render(messages[:a], generation prompt),
 * both beginning the whole render full[0, nfull) (b = all messages: full itself). */
static tkd_status prefix_span(const tkd_chat *c, const conv *cv, size_t a, size_t b, const char *full,
                              size_t nfull, const char *path, int64_t line, tkd_jinja_spans *out)
{
    char *p = NULL, *q = NULL;
    size_t np = 0, nq = nfull;
    size_t n = json_array_size(cv->msgs);
    tkd_status st = render(c, cv, a, true, NULL, path, line, &p, &np);
    if (st == TKD_OK && b < n)
        st = render(c, cv, b, false, NULL, path, line, &q, &nq);
    if (st == TKD_OK && !(starts_with(full, nfull, p, np) && starts_with(q ? q : full, nq, p, np) &&
                          (!q || starts_with(full, nfull, q, nq)))) {
        if (cv->pc)
            rec_fail(path, line, "the prompt rendered with add_generation_prompt=true is not the start of the "
                     "prompt and completion rendered together, so the completion's tokens cannot be told apart");
        else
            rec_fail(path, line, "messages[%zu] (assistant): the template renders the conversation before or up "
                     "to it differently from the start of the whole conversation (as Qwen3 drops earlier turns' "
                     "reasoning), so the turn's tokens cannot be told apart", a);
        st = tkd_error_hint(TKD_ERR_FORMAT, "use a template with {%% generation %%} blocks (--chat-template)");
    }
    if (st == TKD_OK)
        st = push_span(out, np, nq);
    free(p);
    free(q);
    return st;
}

/* The spans of full[0, nfull) that are trained (chat.h's rules); g already holds the generation
 * blocks' spans when the template has them. */
static tkd_status trained_spans(const tkd_chat *c, const conv *cv, const char *full, size_t nfull,
                                const char *path, int64_t line, tkd_jinja_spans *g)
{
    size_t n = json_array_size(cv->msgs);
    if (cv->pc) {
        g->n = 0;
        return prefix_span(c, cv, cv->nprompt, n, full, nfull, path, line, g);
    }
    if (tkd_jinja_has_generation(c->tmpl))
        return TKD_OK;
    for (size_t i = 0; i < n; i++) {
        const char *role = json_string_value(json_object_get(json_array_get(cv->msgs, i), "role"));
        if (strcmp(role, "assistant") == 0)
            TKD_TRY(prefix_span(c, cv, i, i + 1, full, nfull, path, line, g));
    }
    return TKD_OK;
}

static int span_cmp(const void *x, const void *y)
{
    const tkd_jinja_span *a = x, *b = y;
    return a->start < b->start ? -1 : a->start > b->start;
}

static tkd_status flags_reserve(tkd_chat_flags *f, size_t n)
{
    if (n > f->cap) {
        uint8_t *v = realloc(f->v, n);
        if (!v)
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory for %zu flags", n);
        f->v = v, f->cap = n;
    }
    f->n = n;
    return TKD_OK;
}

/* Lays each token's bytes over the text: flags[k] = trained when token k overlaps a span (sorted,
 * empty ones skipped); the first token starts the document. */
static tkd_status lay_flags(const tkd_chat *c, const char *full, size_t nfull, tkd_jinja_spans *sp,
                            const tkd_token_ids *ids, tkd_chat_flags *flags, const char *path, int64_t line)
{
    if (sp->n > 1) /* qsort of a NULL array, even empty, is undefined */
        qsort(sp->v, sp->n, sizeof *sp->v, span_cmp);
    TKD_TRY(flags_reserve(flags, ids->n));
    size_t off = 0, s = 0;
    for (size_t k = 0; k < ids->n; k++) {
        size_t bl = 0;
        const uint8_t *b = tkd_tokenizer_token_bytes(c->tok, ids->ids[k], &bl);
        if (!b || off + bl > nfull || memcmp(full + off, b, bl) != 0) {
            rec_fail(path, line, "token %zu (id %u) does not spell the rendered conversation at byte %zu, so its "
                     "place is unknown (a tokenizer normalizer such as NFC changed the text)", k, ids->ids[k], off);
            return tkd_error_hint(TKD_ERR_FORMAT, "normalize the record's text (NFC) before tokenizing");
        }
        while (s < sp->n && (sp->v[s].end <= off || sp->v[s].start == sp->v[s].end))
            s++;
        bool trained = s < sp->n && sp->v[s].start < off + bl;
        flags->v[k] = (uint8_t)((trained ? TKD_TOKENS_FLAG_TRAINED : 0) | (k == 0 ? TKD_TOKENS_FLAG_DOC_START : 0));
        off += bl;
    }
    if (off != nfull)
        return rec_fail(path, line, "the tokens spell %zu of the rendered conversation's %zu bytes", off, nfull);
    return TKD_OK;
}

static tkd_status encode_conv(const tkd_chat *c, tkd_tokenizer_ctx *ctx, const conv *cv, const char *path,
                              int64_t line, tkd_token_ids *ids, tkd_chat_flags *flags)
{
    tkd_jinja_spans sp = {0};
    char *full = NULL;
    size_t nfull = 0;
    tkd_status st = render(c, cv, json_array_size(cv->msgs), false, &sp, path, line, &full, &nfull);
    if (st == TKD_OK)
        st = trained_spans(c, cv, full, nfull, path, line, &sp);
    ids->n = 0;
    if (st == TKD_OK)
        st = tkd_tokenizer_encode(ctx, full, nfull, ids);
    if (st == TKD_OK)
        st = lay_flags(c, full, nfull, &sp, ids, flags, path, line);
    free(full);
    tkd_jinja_spans_free(&sp);
    return st;
}

tkd_status tkd_chat_encode(const tkd_chat *c, tkd_tokenizer_ctx *ctx, const char *path, int64_t line,
                           const char *rec, size_t len, tkd_token_ids *ids, tkd_chat_flags *flags)
{
    ids->n = 0;
    flags->n = 0;
    json_t *obj = NULL;
    TKD_TRY(tkd_text_jsonl_parse(path, line, rec, len, &obj));
    conv cv = {0};
    tkd_status st = read_conv(path, line, obj, &cv);
    if (st == TKD_OK)
        st = encode_conv(c, ctx, &cv, path, line, ids, flags);
    json_decref(cv.msgs);
    json_decref(obj);
    if (st != TKD_OK)
        ids->n = 0, flags->n = 0;
    return st;
}
