/* tokenizer.h — a Hugging Face tokenizer.json of the byte-level BPE family (GPT-2, Llama 3,
 * Qwen2/2.5/3), encoding text to the same ids as Hugging Face `tokenizers`.
 *
 * What is read (docs/teacher-dump.md, "Tokenizing text", lists it for users):
 *   - model: BPE with merges ("a b" strings or [a, b] lists), ignore_merges; no dropout,
 *     byte_fallback, continuing_subword_prefix or end_of_word_suffix;
 *   - added_tokens (special or not), matched leftmost-longest before pre-tokenization, on the raw
 *     text (normalized: false) or on the normalized text (normalized: true);
 *   - normalizer: none, NFC, or a Sequence of NFC;
 *   - pre_tokenizer: Split (a Regex or String pattern, behavior Isolated) and ByteLevel
 *     (add_prefix_space, use_regex = GPT-2's pattern), alone or in a Sequence that ends with ByteLevel;
 *   - post_processor: ByteLevel (offsets only), TemplateProcessing (its `single` template), or a
 *     Sequence of them; decoder: ByteLevel;
 *   - beside it, tokenizer_config.json: add_bos_token / add_eos_token with bos_token / eos_token.
 * Anything else is refused (TKD_ERR_UNSUPPORTED) with a message naming the file and the field.
 * Both files are read as Hugging Face (serde_json) reads them: a key twice in one object, a field
 * of another JSON type than the one read, text that is not UTF-8, an id that is not an integer in
 * [0, TKD_TOKENIZER_MAX_ID] are TKD_ERR_FORMAT naming the file and the place (line:column or the
 * field's JSON path, e.g. added_tokens[3].id).
 *
 * Text is bytes. Hugging Face encodes Rust strings, so text that is not valid UTF-8 is first
 * converted as Python's bytes.decode("utf-8", "replace") and Rust's String::from_utf8_lossy do:
 * each maximal ill-formed subsequence becomes U+FFFD (Unicode 15, section 3.9, "U+FFFD Substitution
 * of Maximal Subparts").
 *
 * Split patterns run on PCRE2 (with its JIT). Hugging Face compiles them with Oniguruma, whose \s
 * is Unicode White_Space while PCRE2's also takes U+180E: \s and \S are rewritten to
 * \p{White_Space} / \P{White_Space}. Escapes whose meaning differs between the two engines (\w,
 * \b, \h, ...) and POSIX brackets are refused.
 *
 * Threads: a tkd_tokenizer is read-only once loaded and may be shared; each thread encodes with its
 * own tkd_tokenizer_ctx (scratch buffers, regex match data and a word -> ids cache).
 */
#ifndef TKD_TOKENIZER_H
#define TKD_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* The largest token id topkd reads (2^24 - 1; the largest vocabularies today hold about 262k
 * tokens), and the slack of the id space: 1 + the largest id may be at most 4 x the number of
 * vocabulary entries and added tokens + TKD_TOKENIZER_SPARSE_SLACK. Each id costs tables. */
#define TKD_TOKENIZER_MAX_ID ((1 << 24) - 1)
#define TKD_TOKENIZER_SPARSE_SLACK (1 << 20)

typedef struct tkd_tokenizer tkd_tokenizer;         /* opaque: the loaded tokenizer */
typedef struct tkd_tokenizer_ctx tkd_tokenizer_ctx; /* opaque: one thread's encoding state */

/* A growable id buffer owned by the caller: zero it, pass it to tkd_tokenizer_encode as often as
 * needed (ids are appended), free it with tkd_token_ids_free. */
typedef struct tkd_token_ids {
    uint32_t *ids; // (n,)
    size_t n, cap;
} tkd_token_ids;

void tkd_token_ids_free(tkd_token_ids *v); /* frees ids and zeroes v; a zeroed v is a no-op */
tkd_status tkd_token_ids_push(tkd_token_ids *v, const uint32_t *ids, size_t n);

/* Loads path: a tokenizer.json file, or a directory holding one (a Hugging Face checkpoint
 * directory). tokenizer_config.json is read from the same directory when it is there. On success
 * *out is owned by the caller (tkd_tokenizer_free). */
tkd_status tkd_tokenizer_load(const char *path, tkd_tokenizer **out);
void tkd_tokenizer_free(tkd_tokenizer *tok); /* NULL is a no-op */

/* 1 + the largest id of the vocabulary and the added tokens. */
int tkd_tokenizer_vocab_size(const tkd_tokenizer *tok);

/* The path of the tokenizer.json that was loaded. */
const char *tkd_tokenizer_path(const tkd_tokenizer *tok);

/* The id of an added token or vocabulary entry given as text (its content, e.g. "<|endoftext|>");
 * -1 when there is none. */
int64_t tkd_tokenizer_token_id(const tkd_tokenizer *tok, const char *content);

/* A token's bytes as the ByteLevel decoder gives them (an added token: its content); NULL for an id
 * without a token. Valid until tkd_tokenizer_free. */
const uint8_t *tkd_tokenizer_token_bytes(const tkd_tokenizer *tok, uint32_t id, size_t *len);

/* The ids Hugging Face adds around one sequence with add_special_tokens=True: tokenizer_config.json's
 * add_bos_token / add_eos_token when it sets them, else the post_processor's TemplateProcessing
 * `single` template, else none. *ids stays valid until tkd_tokenizer_free. */
int tkd_tokenizer_prefix(const tkd_tokenizer *tok, const uint32_t **ids);
int tkd_tokenizer_suffix(const tkd_tokenizer *tok, const uint32_t **ids);

/* The end-of-sequence token tokenizer_config.json names (eos_token), else -1. */
int64_t tkd_tokenizer_eos_id(const tkd_tokenizer *tok);

tkd_status tkd_tokenizer_ctx_create(const tkd_tokenizer *tok, tkd_tokenizer_ctx **out);
void tkd_tokenizer_ctx_free(tkd_tokenizer_ctx *ctx); /* NULL is a no-op */

/* Appends the ids of text[0, len) to out, as tokenizers' encode(text, add_special_tokens=False)
 * gives them: added tokens found in the text become their ids, the prefix/suffix are not added.
 * Fails with TKD_ERR_NOMEM, or TKD_ERR_UNSUPPORTED where a Split pattern's match
 * stops at one of PCRE2's limits (the message names the pattern's place in tokenizer.json and the
 * byte of the text): the ids are then never a guess. */
tkd_status tkd_tokenizer_encode(tkd_tokenizer_ctx *ctx, const char *text, size_t len, tkd_token_ids *out);

#endif /* TKD_TOKENIZER_H */
