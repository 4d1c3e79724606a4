/* tokenizer_internal.h — the loaded tokenizer's tables, shared by tokenizer.c (reading
 * tokenizer.json into them) and tokenizer_encode.c (encoding with them). Only formats/ and tests/
 * include it.
 */
#ifndef TKD_TOKENIZER_INTERNAL_H
#define TKD_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "formats/tokenizer.h"

#define TKD_TOK_NONE UINT32_MAX

/* Open-addressing map from a byte string (a token's bytes, kept in tkd_tokenizer.bytes) to its id.
 * slots hold (hash, id + 1); 0 is an empty slot. */
typedef struct tkd_tok_strmap {
    uint64_t *slots; // (mask + 1,): hash << 32 | (id + 1)
    size_t mask;
} tkd_tok_strmap;

/* Open-addressing map from a merge pair (left id, right id) to its rank and the merged id. */
typedef struct tkd_tok_pair_slot {
    uint64_t key; /* left << 32 | right; UINT64_MAX = empty */
    uint32_t rank, merged;
} tkd_tok_pair_slot;

typedef struct tkd_tok_pairmap {
    tkd_tok_pair_slot *slots; // (mask + 1,)
    size_t mask;
} tkd_tok_pairmap;

/* Added tokens of one matching pass (raw text or normalized text): bucket b lists, longest first,
 * the tokens whose content starts with byte b, so the first hit at a position is the longest. */
typedef struct tkd_tok_added {
    uint32_t *order;       // (n,) indices into tkd_tokenizer.added_*
    uint32_t start[257];   /* bucket b is order[start[b], start[b + 1]) */
    size_t n;
} tkd_tok_added;

typedef enum tkd_tok_step_kind { TKD_TOK_STEP_SPLIT = 0, TKD_TOK_STEP_BYTELEVEL = 1 } tkd_tok_step_kind;

/* One pre-tokenizer, in order. Split cuts each piece at the pattern's matches (behavior Isolated:
 * matches and the text between them are pieces). ByteLevel, always the last step, adds a space in
 * front of a piece that does not start with one (add_prefix_space) and cuts with GPT-2's pattern
 * (use_regex). */
typedef struct tkd_tok_step {
    tkd_tok_step_kind kind;
    pcre2_code *re; /* Split, or ByteLevel with use_regex; NULL otherwise */
    bool jit;       /* re is JIT-compiled: pcre2_jit_match (no UTF check: the text is valid) */
    bool add_prefix_space;
    char where[320]; /* its place in tokenizer.json, e.g. "pre_tokenizer.pretokenizers[0].pattern" */
} tkd_tok_step;

struct tkd_tokenizer {
    char *path;
    int vocab_size;        /* 1 + the largest id */
    /* Every token's bytes (vocabulary entries decoded from the byte-level alphabet, added tokens as
     * their content): token i is bytes[off[i], off[i] + len[i]); off[i] == TKD_TOK_NONE: no token. */
    uint8_t *bytes;
    size_t nbytes;
    uint32_t *off, *len;   // (vocab_size,)
    tkd_tok_strmap vocab;  /* the model's vocabulary: bytes -> id */
    uint32_t byte_id[256]; /* the vocabulary id of each single byte; TKD_TOK_NONE when absent */
    tkd_tok_pairmap merges;
    bool ignore_merges;    /* a piece that is itself in the vocabulary is taken whole */
    /* Added tokens: content (bytes[added_off[i], + added_len[i])) and id, matched in two passes. */
    uint32_t *added_id, *added_off, *added_len; // (n_added,)
    size_t n_added;
    tkd_tok_added added_raw;  /* normalized: false — matched on the text as given */
    tkd_tok_added added_norm; /* normalized: true — matched on the normalized text */
    bool nfc;              /* normalizer: NFC */
    tkd_tok_step *steps;   // (nsteps,)
    int nsteps;
    uint32_t *prefix, *suffix; /* ids added around a sequence (tkd_tokenizer_prefix/suffix) */
    int nprefix, nsuffix;
    int64_t eos_id;
};

/* FNV-1a, 64-bit: the hash of the byte-string maps and of the encoder's word cache. */
static inline uint64_t tkd_tok_hash(const uint8_t *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 1099511628211ull;
    return h;
}

/* The id of bytes s[0, n) in the vocabulary map, TKD_TOK_NONE when absent. */
uint32_t tkd_tok_strmap_get(const tkd_tokenizer *tok, const tkd_tok_strmap *m, const uint8_t *s, size_t n);

/* The merge of (left, right): its slot, or NULL when the pair does not merge. */
static inline const tkd_tok_pair_slot *tkd_tok_pairmap_get(const tkd_tok_pairmap *m, uint32_t left, uint32_t right)
{
    uint64_t key = (uint64_t)left << 32 | right;
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    for (size_t i = (size_t)(h >> 20) & m->mask;; i = (i + 1) & m->mask) {
        if (m->slots[i].key == key)
            return &m->slots[i];
        if (m->slots[i].key == UINT64_MAX)
            return NULL;
    }
}

/* Caps the context's word cache at `entries` words (at most its built-in size), so that tests see
 * the cache emptied and refilled within a small text. */
void tkd_tok_ctx_limit_cache(tkd_tokenizer_ctx *ctx, size_t entries);

/* Sets the context's PCRE2 match limit (steps of one match), so that tests see a match that stops at
 * a limit become an error. */
void tkd_tok_ctx_limit_match(tkd_tokenizer_ctx *ctx, uint32_t steps);

/* Rewrites a Hugging Face (Oniguruma) pattern for PCRE2 into a malloc'd string: \s -> \p{White_Space},
 * \S -> \P{White_Space}. TKD_ERR_UNSUPPORTED naming the construct for escapes or classes whose
 * meaning differs between the engines. what names the pattern's place in messages. */
tkd_status tkd_tok_translate_pattern(const char *pattern, const char *what, char **out);

#endif /* TKD_TOKENIZER_INTERNAL_H */
