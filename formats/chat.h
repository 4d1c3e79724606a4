/* chat.h — conversations to token ids and per-token flags through the teacher's chat template:
 * what `teacher-dump tokenize --chat` writes (a token file and its flags sidecar, tokens.h).
 *
 * A record is one JSON Lines object, either
 *   {"messages": [{"role": ..., "content": ..., ...}, ...], "tools": [...]?}   or
 *   {"prompt": P, "completion": C}  with P and C strings (one user turn, one assistant turn) or
 *                                   lists of messages (TRL's conversational prompt-completion).
 * It is rendered with the chat template (formats/jinja.h) as transformers' apply_chat_template does
 * (context: the tokenizer's special tokens bos_token, eos_token, unk_token, pad_token, then the
 * caller's kwargs, then messages, tools and add_generation_prompt = false), and the rendered text is
 * tokenized with add_special_tokens=False: the template writes every special token itself (a
 * Llama 3 template emits bos_token, Qwen's none), so the ids are exactly apply_chat_template's and
 * no BOS is ever doubled.
 *
 * Trained targets (flag bit 0): the tokens of the spans below; bit 1 marks the document's first token.
 *   - prompt/completion: what the whole render adds after render(prompt, add_generation_prompt =
 *     true) — the completion and its end-of-turn text;
 *   - a template with `{% generation %}` blocks: the text those blocks write (transformers'
 *     return_assistant_tokens_mask);
 *   - otherwise, for each assistant message i: what render(messages[:i+1]) adds after
 *     render(messages[:i], add_generation_prompt = true) (TRL's completion-only rule). Both must be
 *     prefixes of the whole render; a template that renders history differently (Qwen3 drops the
 *     reasoning of earlier turns) is refused for that record, naming the message.
 * Spans are bytes of the rendered text; a token is trained when its bytes overlap a span, so a token
 * that straddles a span's edge is trained (transformers maps a span to the tokens holding its first
 * and last characters: the same tokens). Token offsets come from the ids' own bytes (the ByteLevel
 * decoder), which must spell the rendered text exactly; a tokenizer whose normalizer changes the
 * text (NFC on decomposed characters) is refused for that record rather than guessed.
 */
#ifndef TKD_CHAT_H
#define TKD_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "formats/tokenizer.h"

typedef struct tkd_chat tkd_chat; /* opaque: a template with its context; read-only once open */

typedef struct tkd_chat_opts {
    const char *template_path; /* a .jinja file; NULL: the tokenizer's (chat_template.jinja beside
                                  tokenizer.json, else tokenizer_config.json's chat_template) */
    const char *kwargs;        /* NULL, or a JSON object whose members join the template's context
                                  ({"enable_thinking": false}) */
    long long now;             /* strftime_now's clock, seconds since the epoch; < 0: the system's */
} tkd_chat_opts;

/* Finds and parses the template for tok (loaded from a path whose folder also holds its
 * tokenizer_config.json). TKD_ERR_NOT_FOUND when there is none; errors of the template or of kwargs
 * name their place. *out is the caller's (tkd_chat_free). */
tkd_status tkd_chat_open(const tkd_tokenizer *tok, const tkd_chat_opts *o, tkd_chat **out);
void tkd_chat_free(tkd_chat *c); /* NULL is a no-op */

/* Where the template came from ("DIR/tokenizer_config.json (chat_template)", "FILE", ...) and which
 * rule marks the trained tokens ("{% generation %} blocks" or "assistant turns by prefix"). Valid
 * until tkd_chat_free. */
const char *tkd_chat_source(const tkd_chat *c);
const char *tkd_chat_rule(const tkd_chat *c);

/* One document's flags beside its ids: a growable byte buffer the caller zeroes and frees. */
typedef struct tkd_chat_flags {
    uint8_t *v; // (n,)
    size_t n, cap;
} tkd_chat_flags;
void tkd_chat_flags_free(tkd_chat_flags *f);

/* Encodes record rec[0, len) (line `line` of path) on the calling thread's ctx: ids and flags are
 * replaced (same length). Every problem is TKD_ERR_FORMAT (or the tokenizer's status) with one line
 * "path:line: what" (a template error adds the template's line:col). Thread-safe for one c. */
tkd_status tkd_chat_encode(const tkd_chat *c, tkd_tokenizer_ctx *ctx, const char *path, int64_t line,
                           const char *rec, size_t len, tkd_token_ids *ids, tkd_chat_flags *flags);

#endif /* TKD_CHAT_H */
