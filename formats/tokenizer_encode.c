/* tokenizer_encode.c — text -> ids with a loaded tokenizer, in the order Hugging Face tokenizers
 * applies its stages (tokenizer.rs: encode_single_sequence):
 *   1. lossy UTF-8: each maximal ill-formed subsequence -> U+FFFD;
 *   2. added tokens with normalized: false are cut out of the raw text (leftmost-longest);
 *   3. each remaining piece is normalized (NFC), then added tokens with normalized: true are cut out;
 *   4. the pre-tokenizers cut each piece further (Split: matches and the gaps between them;
 *      ByteLevel: a prefix space, GPT-2's pattern);
 *   5. BPE on each final piece, merging the lowest-ranked pair first (leftmost on a tie) exactly as
 *      tokenizers' word.rs does, with a per-context cache of piece -> ids.
 * The byte-level alphabet never appears here: the vocabulary and merges were turned into bytes at
 * load time, so a piece's bytes are its symbols.
 */
#include "formats/tokenizer.h"

#include "formats/tokenizer_internal.h"
#include "formats/utf8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* Word cache: pieces up to CACHE_MAX_WORD bytes. When any part is full it is emptied at once
 * (cheaper than evicting, and the common words come back within a few documents). */
#define CACHE_SLOTS (1u << 17)
#define CACHE_ENTRIES (1u << 16)
#define CACHE_KEY_BYTES (1u << 22)
#define CACHE_IDS (1u << 20)
#define CACHE_MAX_WORD 256

typedef struct word_cache {
    uint64_t *slots;    // (CACHE_SLOTS,): hash32 << 32 | (entry + 1); 0 = empty
    uint32_t *key_off;  // (CACHE_ENTRIES,) into keys
    uint32_t *ids_off;  // (CACHE_ENTRIES,) into ids
    uint16_t *key_len;  // (CACHE_ENTRIES,)
    uint16_t *nids;     // (CACHE_ENTRIES,)
    uint8_t *keys;      // (CACHE_KEY_BYTES,)
    uint32_t *ids;      // (CACHE_IDS,)
    size_t nentries, nkeys, nidsused;
    size_t max_entries; /* CACHE_ENTRIES, or less (tkd_tok_ctx_limit_cache) */
} word_cache;

/* Split patterns: the JIT stack a context may grow to, and the interpreter's limits (PCRE2's
 * defaults: a 32 KiB JIT stack, 10M match steps, 20 GB of heap). A pattern that backtracks over
 * a long piece, such as (?:ab)+(?=z) on 10 KB of "ab", needs far more than 32 KiB; one that still
 * hits a limit is an error, never taken as "no more matches" (which would cut the piece otherwise
 * than Hugging Face). The large stack is address space reserved at once, so a context makes it
 * only when a match first runs out of the default one. */
#define JIT_STACK_START (64u << 10)
#define JIT_STACK_MAX (256u << 20)
#define MATCH_LIMIT 1000000000u /* steps of one match: seconds, not hours */
#define HEAP_LIMIT_KIB (1u << 20) /* 1 GiB for the interpreter's backtracking frames */

/* A growable byte buffer. */
typedef struct bytebuf {
    uint8_t *p;
    size_t cap;
} bytebuf;

struct tkd_tokenizer_ctx {
    const tkd_tokenizer *tok;
    pcre2_match_data *md;
    pcre2_match_context *mctx; /* the limits above, and jit_stack once made */
    pcre2_jit_stack *jit_stack; /* NULL until a match needs it */
    /* For messages: the text being encoded, and where ctx->prefixed's piece was copied from. */
    const uint8_t *text;
    size_t text_len;
    const uint8_t *prefixed_from;
    bytebuf clean;            /* the text after lossy UTF-8 */
    bytebuf prefixed;         /* " " + piece for ByteLevel's add_prefix_space */
    bytebuf normed;           /* a piece after NFC */
    utf8proc_int32_t *ucs;    /* NFC of one stretch: code points, then its UTF-8 in place */
    size_t ucs_cap;
    /* BPE on one piece of n bytes: symbols (n) and the merge heap (2n: n - 1 pairs at first; a
     * merge pops one and pushes at most two, and there are at most n - 1 merges). 28 bytes per
     * byte of the piece. */
    uint32_t *sym_id;          // (n,) TKD_TOK_NONE: merged into the symbol before it
    int32_t *sym_prev, *sym_next; // (n,) -1: none
    uint64_t *heap;            // (2n,) rank << 32 | position
    size_t sym_cap;
    word_cache cache;
};

/* A capacity of at least need: cap (first when 0) doubled as often as it takes. */
static size_t grown(size_t cap, size_t need, size_t first)
{
    cap = cap ? cap : first;
    while (cap < need)
        cap *= 2;
    return cap;
}

static bool reserve(bytebuf *b, size_t n)
{
    if (n <= b->cap)
        return true;
    size_t cap = grown(b->cap, n, 4096);
    uint8_t *p = realloc(b->p, cap);
    if (!p)
        return false;
    b->p = p, b->cap = cap;
    return true;
}

void tkd_token_ids_free(tkd_token_ids *v)
{
    free(v->ids);
    v->ids = NULL;
    v->n = v->cap = 0;
}

tkd_status tkd_token_ids_push(tkd_token_ids *v, const uint32_t *ids, size_t n)
{
    if (n == 0) /* ids may be NULL then (an empty prefix) */
        return TKD_OK;
    if (v->n + n > v->cap) {
        size_t cap = grown(v->cap, v->n + n, 1024);
        uint32_t *p = realloc(v->ids, cap * sizeof *p);
        if (!p)
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory for %zu token ids", cap);
        v->ids = p, v->cap = cap;
    }
    memcpy(v->ids + v->n, ids, n * sizeof *ids);
    v->n += n;
    return TKD_OK;
}

/* ---- context -------------------------------------------------------------------------------- */

static bool cache_init(word_cache *c)
{
    c->slots = calloc(CACHE_SLOTS, sizeof *c->slots);
    c->key_off = malloc(CACHE_ENTRIES * sizeof *c->key_off);
    c->ids_off = malloc(CACHE_ENTRIES * sizeof *c->ids_off);
    c->key_len = malloc(CACHE_ENTRIES * sizeof *c->key_len);
    c->nids = malloc(CACHE_ENTRIES * sizeof *c->nids);
    c->keys = malloc(CACHE_KEY_BYTES);
    c->ids = malloc(CACHE_IDS * sizeof *c->ids);
    c->max_entries = CACHE_ENTRIES;
    return c->slots && c->key_off && c->ids_off && c->key_len && c->nids && c->keys && c->ids;
}

static void cache_free(word_cache *c)
{
    free(c->slots);
    free(c->key_off);
    free(c->ids_off);
    free(c->key_len);
    free(c->nids);
    free(c->keys);
    free(c->ids);
}

tkd_status tkd_tokenizer_ctx_create(const tkd_tokenizer *tok, tkd_tokenizer_ctx **out)
{
    *out = NULL;
    tkd_tokenizer_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    ctx->tok = tok;
    ctx->md = pcre2_match_data_create(1, NULL);
    ctx->mctx = pcre2_match_context_create(NULL);
    if (ctx->mctx) {
        pcre2_set_match_limit(ctx->mctx, MATCH_LIMIT);
        pcre2_set_depth_limit(ctx->mctx, MATCH_LIMIT);
        pcre2_set_heap_limit(ctx->mctx, HEAP_LIMIT_KIB);
    }
    if (!ctx->md || !ctx->mctx || !cache_init(&ctx->cache)) {
        tkd_tokenizer_ctx_free(ctx);
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for a tokenizer context");
    }
    *out = ctx;
    return TKD_OK;
}

void tkd_tokenizer_ctx_free(tkd_tokenizer_ctx *ctx)
{
    if (!ctx)
        return;
    pcre2_match_data_free(ctx->md);
    pcre2_match_context_free(ctx->mctx);
    pcre2_jit_stack_free(ctx->jit_stack);
    free(ctx->clean.p);
    free(ctx->prefixed.p);
    free(ctx->normed.p);
    free(ctx->ucs);
    free(ctx->sym_id);
    free(ctx->sym_prev);
    free(ctx->sym_next);
    free(ctx->heap);
    cache_free(&ctx->cache);
    free(ctx);
}

void tkd_tok_ctx_limit_match(tkd_tokenizer_ctx *ctx, uint32_t steps)
{
    pcre2_set_match_limit(ctx->mctx, steps);
}

void tkd_tok_ctx_limit_cache(tkd_tokenizer_ctx *ctx, size_t entries)
{
    word_cache *c = &ctx->cache;
    c->max_entries = entries < CACHE_ENTRIES ? entries : CACHE_ENTRIES;
    memset(c->slots, 0, CACHE_SLOTS * sizeof *c->slots);
    c->nentries = c->nkeys = c->nidsused = 0;
}

/* ---- 1. lossy UTF-8 ------------------------------------------------------------------------- */

/* The text itself when it is valid UTF-8, else a copy in ctx->clean with U+FFFD substituted
 * (formats/utf8.h; the JSON Lines reader converts its records with the same routine). */
static tkd_status lossy_utf8(tkd_tokenizer_ctx *ctx, const uint8_t *s, size_t n, const uint8_t **out, size_t *nout)
{
    *out = s, *nout = n;
    if (tkd_utf8_valid_prefix(s, n) == n)
        return TKD_OK;
    if (!reserve(&ctx->clean, 3 * n)) /* one U+FFFD (3 bytes) per byte at most */
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for %zu bytes of text", n);
    *out = ctx->clean.p, *nout = tkd_utf8_lossy(s, n, ctx->clean.p);
    return TKD_OK;
}

/* ---- 5. BPE ----------------------------------------------------------------------------------- */

/* The merge heap: a 4-ary min-heap of rank << 32 | position, so that the lowest rank pops first and
 * the leftmost of a rank on a tie (tokenizers' word.rs orders its BinaryHeap the same way). Four
 * children of 8 bytes share a cache line: half the depth of a binary heap, which matters when a
 * piece of megabytes puts millions of pairs in it. */
static void heap_sift_down(uint64_t *h, size_t n, size_t i)
{
    uint64_t x = h[i];
    for (;;) {
        size_t c = 4 * i + 1, best = c;
        if (c >= n)
            break;
        for (size_t j = c + 1; j < c + 4 && j < n; j++)
            best = h[j] < h[best] ? j : best;
        if (h[best] >= x)
            break;
        h[i] = h[best];
        i = best;
    }
    h[i] = x;
}

static void heap_push(uint64_t *h, size_t *n, uint64_t x)
{
    size_t i = (*n)++;
    while (i > 0 && x < h[(i - 1) / 4]) {
        h[i] = h[(i - 1) / 4];
        i = (i - 1) / 4;
    }
    h[i] = x;
}

static uint64_t heap_pop(uint64_t *h, size_t *n)
{
    uint64_t top = h[0];
    h[0] = h[--(*n)];
    if (*n > 0)
        heap_sift_down(h, *n, 0);
    return top;
}

/* Sized to the piece (not doubled past it): a long piece is rare and its buffers are the largest
 * the context holds. */
static bool reserve_symbols(tkd_tokenizer_ctx *ctx, size_t n)
{
    if (n <= ctx->sym_cap)
        return true;
    size_t cap = n < 2 * ctx->sym_cap ? 2 * ctx->sym_cap : n < 256 ? 256 : n;
    uint32_t *id = realloc(ctx->sym_id, cap * sizeof *id);
    ctx->sym_id = id ? id : ctx->sym_id;
    int32_t *prev = realloc(ctx->sym_prev, cap * sizeof *prev);
    ctx->sym_prev = prev ? prev : ctx->sym_prev;
    int32_t *next = realloc(ctx->sym_next, cap * sizeof *next);
    ctx->sym_next = next ? next : ctx->sym_next;
    uint64_t *heap = realloc(ctx->heap, 2 * cap * sizeof *heap);
    ctx->heap = heap ? heap : ctx->heap;
    if (!id || !prev || !next || !heap)
        return false;
    ctx->sym_cap = cap;
    return true;
}

/* The merge of symbol pos with its next one, or NULL when that pair does not merge. */
static const tkd_tok_pair_slot *pair_at(const tkd_tokenizer_ctx *ctx, int32_t pos)
{
    if (pos < 0 || ctx->sym_next[pos] < 0)
        return NULL;
    return tkd_tok_pairmap_get(&ctx->tok->merges, ctx->sym_id[pos], ctx->sym_id[ctx->sym_next[pos]]);
}

static void push_pair(tkd_tokenizer_ctx *ctx, size_t *nheap, int32_t pos)
{
    const tkd_tok_pair_slot *m = pair_at(ctx, pos);
    if (m)
        heap_push(ctx->heap, nheap, (uint64_t)m->rank << 32 | (uint32_t)pos);
}

/* Builds the piece's symbols, one per byte (a byte without a token is dropped, as tokenizers drops
 * a character it has no id for when there is no unk_token); returns how many. */
static size_t init_symbols(tkd_tokenizer_ctx *ctx, const uint8_t *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t id = ctx->tok->byte_id[s[i]];
        if (id == TKD_TOK_NONE)
            continue;
        ctx->sym_id[k] = id;
        ctx->sym_prev[k] = (int32_t)k - 1;
        ctx->sym_next[k] = (int32_t)k + 1;
        k++;
    }
    if (k > 0)
        ctx->sym_next[k - 1] = -1;
    return k;
}

/* The heap of the k symbols' first pairs, built in O(k) (Floyd) rather than by k pushes. */
static size_t init_heap(tkd_tokenizer_ctx *ctx, size_t k)
{
    size_t n = 0;
    for (size_t i = 0; i + 1 < k; i++) {
        const tkd_tok_pair_slot *m = pair_at(ctx, (int32_t)i);
        if (m)
            ctx->heap[n++] = (uint64_t)m->rank << 32 | i;
    }
    for (size_t i = n / 4 + 1; i-- > 0;)
        if (i < n)
            heap_sift_down(ctx->heap, n, i);
    return n;
}

/* tokenizers' Word::merge_all: pop the lowest (rank, position); skip an entry made stale by an
 * earlier merge; merge; push the new pairs with the neighbours. An entry is stale when the pair at
 * its position is no longer the one it was pushed for: the pair's rank differs (a pair has one
 * rank: a later duplicate in merges replaced the earlier, tkd_tok_pairmap), which is tokenizers'
 * test (the merged id differs), since symbols only grow and the same position can never hold
 * another pair of the same bytes. The symbols left, in order, are the piece's ids, appended to
 * out. O(n log n) in the piece's length n, 28 bytes of buffers per byte. */
static tkd_status bpe_merge_word(tkd_tokenizer_ctx *ctx, const uint8_t *s, size_t n, tkd_token_ids *out)
{
    if (n > INT32_MAX)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: a piece of %zu bytes (a word, after pre-tokenizing) is longer "
                             "than 2^31 - 1 bytes", ctx->tok->path, n);
    if (!reserve_symbols(ctx, n))
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for a %zu-byte word", n);
    size_t k = init_symbols(ctx, s, n), nheap = init_heap(ctx, k);
    while (nheap > 0) {
        uint64_t top = heap_pop(ctx->heap, &nheap);
        int32_t pos = (int32_t)(uint32_t)top;
        if (ctx->sym_id[pos] == TKD_TOK_NONE)
            continue;
        const tkd_tok_pair_slot *m = pair_at(ctx, pos);
        if (!m || m->rank != (uint32_t)(top >> 32))
            continue;
        int32_t nx = ctx->sym_next[pos];
        ctx->sym_id[pos] = m->merged;
        ctx->sym_id[nx] = TKD_TOK_NONE;
        ctx->sym_next[pos] = ctx->sym_next[nx];
        if (ctx->sym_next[nx] >= 0)
            ctx->sym_prev[ctx->sym_next[nx]] = pos;
        push_pair(ctx, &nheap, ctx->sym_prev[pos]);
        push_pair(ctx, &nheap, pos);
    }
    /* The first symbol is never merged away (merges absorb the right one): walk from it, packing
     * the ids to the front of sym_id. */
    size_t m = 0;
    for (int32_t i = k > 0 ? 0 : -1; i >= 0; i = ctx->sym_next[i])
        ctx->sym_id[m++] = ctx->sym_id[i];
    return tkd_token_ids_push(out, ctx->sym_id, m);
}

static const uint32_t *cache_get(const word_cache *c, const uint8_t *s, size_t n, uint64_t h, size_t *nids)
{
    uint32_t h32 = (uint32_t)(h >> 32);
    for (size_t i = (size_t)h & (CACHE_SLOTS - 1);; i = (i + 1) & (CACHE_SLOTS - 1)) {
        uint64_t slot = c->slots[i];
        if (slot == 0)
            return NULL;
        size_t e = (uint32_t)slot - 1;
        if ((uint32_t)(slot >> 32) == h32 && c->key_len[e] == n && memcmp(c->keys + c->key_off[e], s, n) == 0) {
            *nids = c->nids[e];
            return c->ids + c->ids_off[e];
        }
    }
}

static void cache_put(word_cache *c, const uint8_t *s, size_t n, uint64_t h, const uint32_t *ids, size_t nids)
{
    if (c->nentries == c->max_entries || c->nkeys + n > CACHE_KEY_BYTES || c->nidsused + nids > CACHE_IDS) {
        memset(c->slots, 0, CACHE_SLOTS * sizeof *c->slots);
        c->nentries = c->nkeys = c->nidsused = 0;
    }
    size_t e = c->nentries++;
    memcpy(c->keys + c->nkeys, s, n);
    if (nids > 0)
        memcpy(c->ids + c->nidsused, ids, nids * sizeof *ids);
    c->key_off[e] = (uint32_t)c->nkeys, c->key_len[e] = (uint16_t)n;
    c->ids_off[e] = (uint32_t)c->nidsused, c->nids[e] = (uint16_t)nids;
    c->nkeys += n, c->nidsused += nids;
    size_t i = (size_t)h & (CACHE_SLOTS - 1);
    while (c->slots[i] != 0)
        i = (i + 1) & (CACHE_SLOTS - 1);
    c->slots[i] = (h >> 32) << 32 | (uint64_t)(e + 1);
}

/* One final piece -> ids (tokenizers' BPE::tokenize_with_cache). */
static tkd_status bpe(tkd_tokenizer_ctx *ctx, const uint8_t *s, size_t n, tkd_token_ids *out)
{
    const tkd_tokenizer *tok = ctx->tok;
    if (n == 0)
        return TKD_OK;
    if (n == 1)
        return tok->byte_id[s[0]] == TKD_TOK_NONE ? TKD_OK : tkd_token_ids_push(out, &tok->byte_id[s[0]], 1);
    if (tok->ignore_merges) {
        uint32_t id = tkd_tok_strmap_get(tok, &tok->vocab, s, n);
        if (id != TKD_TOK_NONE)
            return tkd_token_ids_push(out, &id, 1);
    }
    if (n > CACHE_MAX_WORD)
        return bpe_merge_word(ctx, s, n, out);
    uint64_t h = tkd_tok_hash(s, n);
    size_t nids;
    const uint32_t *hit = cache_get(&ctx->cache, s, n, h, &nids);
    if (hit)
        return tkd_token_ids_push(out, hit, nids);
    size_t first = out->n;
    tkd_status st = bpe_merge_word(ctx, s, n, out);
    if (st == TKD_OK) /* a piece of bytes without tokens has no ids, and out->ids may still be NULL */
        cache_put(&ctx->cache, s, n, h, out->n > first ? out->ids + first : NULL, out->n - first);
    return st;
}

/* ---- 4. pre-tokenizers ------------------------------------------------------------------------ */

static tkd_status pretokenize(tkd_tokenizer_ctx *ctx, int step, const uint8_t *s, size_t n, tkd_token_ids *out);

/* The piece handed on by step: to the next pre-tokenizer, or to BPE after the last. */
static tkd_status hand_on(tkd_tokenizer_ctx *ctx, int step, const uint8_t *s, size_t n, tkd_token_ids *out)
{
    if (n == 0)
        return TKD_OK;
    return step + 1 < ctx->tok->nsteps ? pretokenize(ctx, step + 1, s, n, out) : bpe(ctx, s, n, out);
}

static size_t utf8_len(uint8_t b) { return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

/* "byte X of the text" for p, a place in a piece, into buf: a piece points into the text given to
 * tkd_tokenizer_encode or into one of the context's copies of it. */
static void describe_place(const tkd_tokenizer_ctx *ctx, const uint8_t *p, char *buf, size_t cap)
{
    uintptr_t at = (uintptr_t)p, pre = (uintptr_t)ctx->prefixed.p;
    if (ctx->prefixed_from && at >= pre && at < pre + ctx->prefixed.cap) /* " " + a piece */
        at = (uintptr_t)ctx->prefixed_from + (at > pre ? at - pre - 1 : 0);
    const struct {
        const uint8_t *base;
        size_t n;
        const char *what;
    } texts[] = {{ctx->text, ctx->text_len, "the text"},
                 {ctx->clean.p, ctx->clean.cap, "the text with invalid UTF-8 replaced"},
                 {ctx->normed.p, ctx->normed.cap, "the text after NFC"}};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        if (texts[i].base && at >= (uintptr_t)texts[i].base && at <= (uintptr_t)texts[i].base + texts[i].n) {
            snprintf(buf, cap, "byte %zu of %s", (size_t)(at - (uintptr_t)texts[i].base), texts[i].what);
            return;
        }
    snprintf(buf, cap, "a piece of the text");
}

/* A match that ended with an error (a limit), not "no match": stopping there would cut the piece
 * otherwise than Hugging Face does, so the encode fails naming the pattern and the place. */
static tkd_status match_failed(const tkd_tokenizer_ctx *ctx, const tkd_tok_step *step, int rc, const uint8_t *p,
                               size_t piece)
{
    PCRE2_UCHAR msg[256];
    char place[128];
    pcre2_get_error_message(rc, msg, sizeof msg);
    describe_place(ctx, p, place, sizeof place);
    tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: %s: PCRE2 failed to match at %s (in a piece of %zu bytes): %s",
                  ctx->tok->path, step->where, place, piece, (const char *)msg);
    return tkd_error_hint(TKD_ERR_UNSUPPORTED, "the pattern backtracks too far over this piece; cut the text there");
}

/* One match of step's pattern in s[0, n) from `from`: PCRE2's status. A match that runs out of
 * the default JIT stack is run again on the large one, made then. */
static int match_at(tkd_tokenizer_ctx *ctx, const tkd_tok_step *st, const uint8_t *s, size_t n, size_t from)
{
    for (;;) {
        int rc = st->jit ? pcre2_jit_match(st->re, s, n, from, 0, ctx->md, ctx->mctx)
                         : pcre2_match(st->re, s, n, from, PCRE2_NO_UTF_CHECK, ctx->md, ctx->mctx);
        if (rc != PCRE2_ERROR_JIT_STACKLIMIT || ctx->jit_stack)
            return rc;
        ctx->jit_stack = pcre2_jit_stack_create(JIT_STACK_START, JIT_STACK_MAX, NULL);
        if (!ctx->jit_stack)
            return rc;
        pcre2_jit_stack_assign(ctx->mctx, NULL, ctx->jit_stack);
    }
}

/* Behavior Isolated: every match is a piece, and so is the text between two matches. The
 * ovector is read before handing on, since a later step reuses the match data. */
static tkd_status split_isolated(tkd_tokenizer_ctx *ctx, int step, const uint8_t *s, size_t n, tkd_token_ids *out)
{
    const tkd_tok_step *st = &ctx->tok->steps[step];
    size_t gap = 0, from = 0;
    while (from < n) {
        int rc = match_at(ctx, st, s, n, from);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0)
            return match_failed(ctx, st, rc, s + from, n);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(ctx->md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* an empty match cuts nothing; search on from the next character */
            from = ms + utf8_len(s[ms]);
            continue;
        }
        tkd_status st = hand_on(ctx, step, s + gap, ms - gap, out);
        if (st == TKD_OK)
            st = hand_on(ctx, step, s + ms, me - ms, out);
        if (st != TKD_OK)
            return st;
        gap = from = me;
    }
    return hand_on(ctx, step, s + gap, n - gap, out);
}

static tkd_status pretokenize(tkd_tokenizer_ctx *ctx, int step, const uint8_t *s, size_t n, tkd_token_ids *out)
{
    const tkd_tok_step *st = &ctx->tok->steps[step];
    if (st->kind == TKD_TOK_STEP_BYTELEVEL && st->add_prefix_space && s[0] != ' ') {
        if (!reserve(&ctx->prefixed, n + 1))
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory for a %zu-byte piece", n);
        ctx->prefixed.p[0] = ' ';
        memcpy(ctx->prefixed.p + 1, s, n);
        ctx->prefixed_from = s;
        s = ctx->prefixed.p, n++;
    }
    if (!st->re)
        return hand_on(ctx, step, s, n, out);
    return split_isolated(ctx, step, s, n, out);
}

/* ---- 2, 3. added tokens and the normalizer ---------------------------------------------------- */

static tkd_status after_normalize(tkd_tokenizer_ctx *ctx, const uint8_t *s, size_t n, tkd_token_ids *out);

/* The pieces between added tokens go on to the next stage (pass 0: normalize; pass 1:
 * pre-tokenize); the added tokens become their ids. */
static tkd_status next_stage(tkd_tokenizer_ctx *ctx, int pass, const uint8_t *s, size_t n, tkd_token_ids *out)
{
    if (n == 0)
        return TKD_OK;
    return pass == 0 ? after_normalize(ctx, s, n, out) : pretokenize(ctx, 0, s, n, out);
}

/* The longest added token of this pass starting at s[0, n), or -1. */
static long added_at(const tkd_tokenizer *tok, const tkd_tok_added *a, const uint8_t *s, size_t n)
{
    for (uint32_t j = a->start[s[0]]; j < a->start[s[0] + 1]; j++) {
        uint32_t t = a->order[j];
        if (tok->added_len[t] <= n && memcmp(tok->bytes + tok->added_off[t], s, tok->added_len[t]) == 0)
            return t;
    }
    return -1;
}

static tkd_status split_added(tkd_tokenizer_ctx *ctx, int pass, const uint8_t *s, size_t n, tkd_token_ids *out)
{
    const tkd_tokenizer *tok = ctx->tok;
    const tkd_tok_added *a = pass == 0 ? &tok->added_raw : &tok->added_norm;
    if (a->n == 0)
        return next_stage(ctx, pass, s, n, out);
    size_t gap = 0;
    for (size_t i = 0; i < n;) {
        long t = a->start[s[i]] == a->start[s[i] + 1] ? -1 : added_at(tok, a, s + i, n - i);
        if (t < 0) {
            i++;
            continue;
        }
        tkd_status st = next_stage(ctx, pass, s + gap, i - gap, out);
        if (st == TKD_OK)
            st = tkd_token_ids_push(out, &tok->added_id[t], 1);
        if (st != TKD_OK)
            return st;
        i += tok->added_len[t];
        gap = i;
    }
    return next_stage(ctx, pass, s + gap, n - gap, out);
}

/* True when NFC leaves the code point c as it is whatever surrounds it: no decomposition, combining
 * class 0, and never the second of a canonical composition (those are all marks, Mn/Mc, or Hangul
 * jamo, which compose algorithmically). A text of such code points is its own NFC. */
static bool nfc_inert(utf8proc_int32_t c)
{
    if (c < 0x80)
        return true;
    if ((c >= 0x1100 && c <= 0x11FF) || (c >= 0xA960 && c <= 0xA97F) || (c >= 0xD7B0 && c <= 0xD7FF))
        return false;
    const utf8proc_property_t *p = utf8proc_get_property(c);
    return p->combining_class == 0 && p->decomp_seqindex == UINT16_MAX && p->category != UTF8PROC_CATEGORY_MN &&
           p->category != UTF8PROC_CATEGORY_MC && p->category != UTF8PROC_CATEGORY_ME;
}

/* Appends NFC(s[0, n)) to ctx->normed through utf8proc (decompose to code points in ctx->ucs,
 * compose, re-encode in place). */
static tkd_status nfc_segment(tkd_tokenizer_ctx *ctx, const uint8_t *s, size_t n, size_t *at)
{
    utf8proc_option_t opt = UTF8PROC_STABLE | UTF8PROC_COMPOSE;
    for (;;) {
        utf8proc_ssize_t got = utf8proc_decompose(s, (utf8proc_ssize_t)n, ctx->ucs, (utf8proc_ssize_t)ctx->ucs_cap, opt);
        if (got < 0)
            return tkd_error_set(TKD_ERR_INTERNAL, "NFC: %s", utf8proc_errmsg(got));
        if ((size_t)got < ctx->ucs_cap) {
            got = utf8proc_reencode(ctx->ucs, got, opt);
            if (got < 0)
                return tkd_error_set(TKD_ERR_INTERNAL, "NFC: %s", utf8proc_errmsg(got));
            if (!reserve(&ctx->normed, *at + (size_t)got))
                return tkd_error_set(TKD_ERR_NOMEM, "out of memory for %zu bytes of text", *at + (size_t)got);
            memcpy(ctx->normed.p + *at, ctx->ucs, (size_t)got);
            *at += (size_t)got;
            return TKD_OK;
        }
        size_t cap = (size_t)got + 1;
        utf8proc_int32_t *p = realloc(ctx->ucs, cap * sizeof *p);
        if (!p)
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory for %zu code points", cap);
        ctx->ucs = p, ctx->ucs_cap = cap;
    }
}

static tkd_status copy_normed(tkd_tokenizer_ctx *ctx, const uint8_t *s, size_t n, size_t *at)
{
    if (n == 0) /* the buffer may not exist yet */
        return TKD_OK;
    if (!reserve(&ctx->normed, *at + n))
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for %zu bytes of text", *at + n);
    memcpy(ctx->normed.p + *at, s, n);
    *at += n;
    return TKD_OK;
}

/* NFC of s[0, n). Text is cut before every inert code point (NFC never joins across such a cut:
 * the code point neither changes nor combines with what precedes it), the stretches between cuts
 * that hold a code point NFC could change go through utf8proc, the rest is copied. Text with no
 * such code point is left where it is (the common case: no copy). */
static tkd_status nfc(tkd_tokenizer_ctx *ctx, const uint8_t **s, size_t *n)
{
    const uint8_t *t = *s;
    size_t cut = 0, copied = 0, at = 0, seg = 0;
    bool dirty = false, any = false;
    tkd_status st = TKD_OK;
    for (size_t i = 0; i < *n && st == TKD_OK;) {
        utf8proc_int32_t c = t[i];
        utf8proc_ssize_t l = 1;
        if (c >= 0x80 && (l = utf8proc_iterate(t + i, (utf8proc_ssize_t)(*n - i), &c)) <= 0)
            return tkd_error_set(TKD_ERR_INTERNAL, "NFC: invalid UTF-8 after the lossy conversion");
        if (nfc_inert(c)) {
            if (dirty)
                st = nfc_segment(ctx, t + seg, i - seg, &at);
            copied = dirty ? i : copied;
            dirty = false;
            cut = i;
        } else if (!dirty) {
            st = copy_normed(ctx, t + copied, cut - copied, &at);
            seg = cut, dirty = any = true;
        }
        i += (size_t)l;
    }
    if (st != TKD_OK || !any)
        return st;
    st = dirty ? nfc_segment(ctx, t + seg, *n - seg, &at) : copy_normed(ctx, t + copied, *n - copied, &at);
    *s = ctx->normed.p, *n = at;
    return st;
}

static tkd_status after_normalize(tkd_tokenizer_ctx *ctx, const uint8_t *s, size_t n, tkd_token_ids *out)
{
    if (ctx->tok->nfc) {
        tkd_status st = nfc(ctx, &s, &n);
        if (st != TKD_OK)
            return st;
    }
    return split_added(ctx, 1, s, n, out);
}

tkd_status tkd_tokenizer_encode(tkd_tokenizer_ctx *ctx, const char *text, size_t len, tkd_token_ids *out)
{
    const uint8_t *s;
    size_t n;
    ctx->text = (const uint8_t *)text, ctx->text_len = len, ctx->prefixed_from = NULL;
    tkd_status st = lossy_utf8(ctx, (const uint8_t *)text, len, &s, &n);
    return st == TKD_OK ? split_added(ctx, 0, s, n, out) : st;
}
