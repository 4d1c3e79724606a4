/* jinja.h — a Jinja2 interpreter for the chat templates of Hugging Face tokenizers.
 *
 * A chat template (tokenizer_config.json's "chat_template", or chat_template.jinja) is parsed once
 * into a tree and rendered with a context given as a JSON document: `messages`, `tools`,
 * `add_generation_prompt`, `bos_token`, `eos_token`, `enable_thinking`, ... The semantics are those
 * of Hugging Face's own implementation, @huggingface/jinja (the reference of tests/test_jinja.c),
 * run the way transformers runs chat templates: trim_blocks and lstrip_blocks on, the globals
 * raise_exception, strftime_now, namespace and range, and transformers' tojson (no ASCII escaping,
 * indent when given). docs/chat-templates.md lists what is supported.
 *
 * Anything outside the supported subset is refused, never guessed: a statement, filter, test or
 * method the interpreter lacks gives TKD_ERR_UNSUPPORTED with "name:line:col: unsupported <kind>
 * '<construct>'" (at parse time for statements, at render time for the rest, as the reference
 * does). Errors of the template itself (syntax, raise_exception, type errors) are TKD_ERR_FORMAT
 * with the same place prefix.
 */
#ifndef TKD_JINJA_H
#define TKD_JINJA_H

#include <stddef.h>

#include "common/status.h"

typedef struct tkd_jinja_template tkd_jinja_template;

/* Parses src (len bytes, UTF-8) into *out. name is used in error messages (a path, or a model
 * name). On error *out is NULL and the message says name:line:col. The caller frees *out with
 * tkd_jinja_free. */
tkd_status tkd_jinja_parse(const char *src, size_t len, const char *name, tkd_jinja_template **out);

/* Frees a template; NULL is a no-op. */
void tkd_jinja_free(tkd_jinja_template *t);

/* Byte spans [start, end) of a render's output. A zeroed tkd_jinja_spans is empty; the caller frees
 * it with tkd_jinja_spans_free. */
typedef struct tkd_jinja_span {
    size_t start, end;
} tkd_jinja_span;
typedef struct tkd_jinja_spans {
    tkd_jinja_span *v; // (n,)
    size_t n, cap;
} tkd_jinja_spans;
void tkd_jinja_spans_free(tkd_jinja_spans *s);

typedef struct tkd_jinja_render_opts {
    /* The clock of strftime_now, in seconds since the epoch (UTC); a negative value reads the
     * system clock. Pinned in tests so that outputs are reproducible. */
    long long now;
    /* NULL, or where a render puts the spans of the output that `{% generation %}` blocks wrote, in
     * order (emptied first): transformers' return_assistant_tokens_mask spans. A block rendered into
     * a `{% set %}` capture or a macro's result is not recorded (transformers' tracker sees only
     * the template's top-level output too). */
    tkd_jinja_spans *generation;
} tkd_jinja_render_opts;

/* Whether t holds a `{% generation %}` block (the blocks' text is rendered as if they were not there). */
int tkd_jinja_has_generation(const tkd_jinja_template *t);

/* Renders t with the context, a JSON object (ctx_len bytes) whose members become the template's
 * variables. opts may be NULL (system clock). On success *out is a malloc'd NUL-terminated string
 * of *out_len bytes the caller frees; on error *out is NULL and the message names the template's
 * line:col. A template is not modified by rendering, so one may be rendered from several threads. */
tkd_status tkd_jinja_render(const tkd_jinja_template *t, const char *ctx_json, size_t ctx_len,
                            const tkd_jinja_render_opts *opts, char **out, size_t *out_len);

#endif /* TKD_JINJA_H */
