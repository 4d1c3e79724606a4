/* loader.c — see loader.h. */
#include "student_train/loader.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"

struct tkd_loader {
    tkd_loader_opts o;
    tkd_cache_reader *cache;
    const tkd_tokens *tokens;
    int64_t *split;  // (n)
    int64_t *order;  // (n) the current epoch's order
    int64_t *mine;   // (n) data parallel: this rank's part of the order from the seek offset on
    int world;       /* ranks (>= 1) */
    int64_t n;
    int64_t epoch, offset;
    tkd_cache_stream *stream;
    int src_seq_len; /* positions per sequence in the source */
    int src_k;       /* columns the source batch holds */
    int vocab;       /* the student's vocabulary when smaller than the cache's, else 0 */
    int renorm;      /* the loss renormalises over the top-k' (tkd_loader_fit_vocab) */
    /* the batch handed out (repacked to seq_len and int32 ids) */
    tkd_train_batch out;
    int32_t *inputs, *labels, *topk_idx, *tail_idx, *doc;
    float *topk_logit, *lse;
    int64_t *seq;
    int32_t *window; // (seq_len + 1) scratch for token windows
};

void tkd_loader_epoch_order(const tkd_loader *l, int64_t epoch, int64_t *order)
{
    memcpy(order, l->split, (size_t)l->n * sizeof *order);
    if (l->o.shuffle) {
        tkd_rng r;
        tkd_rng_seed_stream(&r, l->o.seed, (uint64_t)epoch);
        tkd_rng_shuffle_i64(&r, order, (size_t)l->n);
    }
}

static tkd_status alloc_buffers(tkd_loader *l)
{
    size_t bt = (size_t)l->o.batch_size * (size_t)l->o.seq_len;
    int k = l->cache ? l->o.k : 0;
    int s = l->cache && l->o.with_tail ? tkd_cache_reader_manifest(l->cache)->id.tail_samples : 0;
    l->inputs = malloc(bt * sizeof(int32_t));
    l->labels = malloc(bt * sizeof(int32_t));
    l->seq = malloc((size_t)l->o.batch_size * sizeof(int64_t));
    l->window = malloc(((size_t)l->o.seq_len + 1) * sizeof(int32_t));
    int packed = l->cache ? tkd_cache_reader_manifest(l->cache)->id.packed : l->o.pack != NULL;
    if (packed && !(l->doc = malloc(bt * sizeof(int32_t))))
        return tkd_error_set(TKD_ERR_NOMEM, "loader: out of memory for a batch of %d x %d", l->o.batch_size,
                             l->o.seq_len);
    if (k > 0) {
        l->topk_idx = malloc(bt * (size_t)k * sizeof(int32_t));
        l->topk_logit = malloc(bt * (size_t)k * sizeof(float));
        l->lse = malloc(bt * sizeof(float));
    }
    if (s > 0)
        l->tail_idx = malloc(bt * (size_t)s * sizeof(int32_t));
    if (!l->inputs || !l->labels || !l->seq || !l->window || (k > 0 && (!l->topk_idx || !l->topk_logit || !l->lse)) ||
        (s > 0 && !l->tail_idx))
        return tkd_error_set(TKD_ERR_NOMEM, "loader: out of memory for a batch of %d x %d", l->o.batch_size,
                             l->o.seq_len);
    l->out.k = k;
    l->out.s = s;
    l->out.t = l->o.seq_len;
    l->out.inputs = l->inputs;
    l->out.labels = l->labels;
    l->out.topk_idx = l->topk_idx;
    l->out.topk_logit = l->topk_logit;
    l->out.teacher_lse = l->lse;
    l->out.tail_idx = l->tail_idx;
    l->out.seq = l->seq;
    l->out.doc = l->doc;
    return TKD_OK;
}

tkd_status tkd_loader_open(tkd_loader **out, tkd_cache_reader *cache, const tkd_tokens *tokens,
                           const int64_t *split, int64_t n, const tkd_loader_opts *opts)
{
    *out = NULL;
    if ((!cache) == (!tokens) || n < 0 || opts->batch_size < 1 || opts->seq_len < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "loader: give exactly one source, a batch size and a seq_len");
    tkd_loader *l = calloc(1, sizeof *l);
    if (!l)
        return tkd_error_set(TKD_ERR_NOMEM, "loader: out of memory");
    l->o = *opts;
    l->cache = cache;
    l->tokens = tokens;
    l->n = n;
    if (cache) {
        const tkd_cache_manifest *m = tkd_cache_reader_manifest(cache);
        l->src_seq_len = m->id.seq_len;
        if (l->o.k <= 0 || l->o.k > m->id.k)
            l->o.k = m->id.k;
        if (l->o.with_tail && m->id.tail_samples == 0) {
            free(l);
            return tkd_error_set(TKD_ERR_MISMATCH, "loader: the cache has no tail draws (/tail/indices)");
        }
    } else {
        l->src_seq_len = opts->seq_len;
    }
    if (l->o.seq_len > l->src_seq_len) {
        int have = l->src_seq_len;
        free(l);
        return tkd_error_set(TKD_ERR_MISMATCH, "loader: data.seq_len %d is longer than the cache's %d",
                             opts->seq_len, have);
    }
    l->world = opts->world > 1 ? opts->world : 1;
    l->o.rank = l->world > 1 ? opts->rank : 0;
    if (l->o.rank < 0 || l->o.rank >= l->world) {
        free(l);
        return tkd_error_set(TKD_ERR_INVALID_ARG, "loader: rank %d of %d", opts->rank, opts->world);
    }
    l->split = malloc(((size_t)n + 1) * sizeof(int64_t));
    l->order = malloc(((size_t)n + 1) * sizeof(int64_t));
    l->mine = malloc(((size_t)n + 1) * sizeof(int64_t));
    tkd_status st = l->split && l->order && l->mine ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "loader: out of memory");
    if (st == TKD_OK) {
        memcpy(l->split, split, (size_t)n * sizeof(int64_t));
        st = alloc_buffers(l);
    }
    if (st != TKD_OK) {
        tkd_loader_close(l);
        return st;
    }
    *out = l;
    return TKD_OK;
}

void tkd_loader_close(tkd_loader *l)
{
    if (!l)
        return;
    tkd_cache_stream_close(l->stream);
    free(l->split);
    free(l->order);
    free(l->mine);
    free(l->inputs);
    free(l->labels);
    free(l->doc);
    free(l->topk_idx);
    free(l->topk_logit);
    free(l->lse);
    free(l->tail_idx);
    free(l->seq);
    free(l->window);
    free(l);
}

/* This rank's part [*first, *first + *count) of the order in the global batch that starts at off. */
static void rank_share(const tkd_loader *l, int64_t off, int64_t *first, int64_t *count)
{
    int64_t bs = l->o.batch_size, b = off + l->o.rank * bs, e = b + bs;
    b = b < l->n ? b : l->n;
    e = e < l->n ? e : l->n;
    *first = b;
    *count = e - b;
}

/* l->mine = this rank's parts of the global batches from offset to the end of the epoch, in order
 * (with one rank: the order itself from offset). Returns how many. The cache stream reads them in
 * batches of batch_size: every part but an epoch's last is exactly one batch. */
static int64_t rank_order(tkd_loader *l, int64_t offset)
{
    int64_t n = 0, step = (int64_t)l->world * l->o.batch_size;
    for (int64_t off = offset; off < l->n; off += step) {
        int64_t first, count;
        rank_share(l, off, &first, &count);
        memcpy(l->mine + n, l->order + first, (size_t)count * sizeof(int64_t));
        n += count;
    }
    return n;
}

/* Moves the position past the global batch this rank just took its part of. */
static void advance(tkd_loader *l)
{
    int64_t step = (int64_t)l->world * l->o.batch_size;
    l->offset = l->n - l->offset < step ? l->n : l->offset + step;
}

tkd_status tkd_loader_seek(tkd_loader *l, int64_t epoch, int64_t offset)
{
    if (offset < 0 || offset > l->n)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "loader: offset %lld outside the split of %lld sequences",
                             (long long)offset, (long long)l->n);
    tkd_cache_stream_close(l->stream);
    l->stream = NULL;
    l->epoch = epoch;
    l->offset = offset;
    tkd_loader_epoch_order(l, epoch, l->order);
    int64_t n_mine = rank_order(l, offset);
    if (l->cache && n_mine > 0) {
        tkd_cache_stream_opts so = {.batch_seq = l->o.batch_size, .k = l->o.k, .with_tail = l->o.with_tail,
                                    .depth = l->o.prefetch < 2 ? 2 : l->o.prefetch};
        return tkd_cache_stream_open(&l->stream, l->cache, l->mine, n_mine, &so);
    }
    return TKD_OK;
}

tkd_status tkd_loader_fit_vocab(tkd_loader *l, int v, int renorm)
{
    if (!l->cache || v < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "loader: fit_vocab needs a cache and a vocabulary size");
    l->vocab = v < (int)tkd_cache_reader_manifest(l->cache)->id.vocab_size ? v : 0;
    l->renorm = renorm;
    return TKD_OK;
}

static int has_id(const int32_t *ids, int n, int32_t id)
{
    for (int e = 0; e < n; e++)
        if (ids[e] == id)
            return 1;
    return 0;
}

/* The largest id < v that the row's columns (k) and draws (s) do not hold: a column's stand-in. */
static int32_t free_id(const int32_t *idx, int k, const int32_t *dr, int s, int v)
{
    int32_t u = v - 1;
    while (u > 0 && (has_id(idx, k, u) || has_id(dr, s, u)))
        u--;
    return u; /* k + s < v (checked by the loss's parameters), so one is found */
}

/* Maps one position's teacher entries beyond the student's vocabulary (see tkd_loader_fit_vocab);
 * idx (k), logit (k), dr (s). Returns the entries mapped, or -1 when the row cannot be mapped. */
static int fit_row(int32_t *idx, float *logit, int k, int32_t *dr, int s, int v, int renorm)
{
    int n = 0, kept = 0;
    int32_t first_draw = -1;
    for (int d = 0; d < s && first_draw < 0; d++)
        first_draw = (uint32_t)dr[d] < (uint32_t)v ? dr[d] : -1;
    for (int d = 0; d < s; d++)
        if ((uint32_t)dr[d] >= (uint32_t)v) {
            if (first_draw < 0)
                return -1;
            dr[d] = first_draw;
            n++;
        }
    for (int j = 0; j < k; j++) {
        if ((uint32_t)idx[j] < (uint32_t)v) {
            kept++;
            continue;
        }
        idx[j] = v; /* out of [0, v) and not a free id: keeps free_id from picking this slot's old id */
        idx[j] = free_id(idx, k, dr, s, v);
        logit[j] = TKD_LOADER_DROPPED_LOGIT;
        n++;
    }
    return renorm && k > 0 && kept == 0 ? -1 : n;
}

/* Checks slot j's tokens against the student's vocabulary and maps its teacher entries. */
static tkd_status fit_seq(tkd_loader *l, int j)
{
    int t = l->o.seq_len, k = l->out.k, s = l->out.s, v = l->vocab;
    for (int p = 0; p < t; p++) {
        int32_t x = l->inputs[(size_t)j * t + p], y = l->labels[(size_t)j * t + p];
        if (x >= v || y >= v)
            return tkd_error_hint(tkd_error_set(TKD_ERR_MISMATCH, "sequence %" PRId64 " position %d holds token %d, "
                                                "beyond the student's vocabulary of %d (the cache's has %d)", l->seq[j], p,
                                                x >= v ? x : y, v,
                                                (int)tkd_cache_reader_manifest(l->cache)->id.vocab_size),
                                  "the cache's extra ids are not unused: the student needs a vocabulary covering the data");
    }
    for (int p = 0; p < t; p++) {
        size_t r = (size_t)j * t + p;
        int n = fit_row(l->topk_idx + r * k, l->topk_logit + r * k, k, s ? l->tail_idx + r * s : NULL, s, v, l->renorm);
        if (n < 0)
            return tkd_error_set(TKD_ERR_FORMAT, "sequence %" PRId64 " position %d: every teacher %s lies beyond the "
                                 "student's vocabulary of %d — nothing is left to distil there", l->seq[j], p,
                                 l->renorm ? "top-k' token" : "tail draw", v);
        l->out.beyond_vocab += n;
    }
    return TKD_OK;
}

/* Copies sequence i of a cache batch into slot j, keeping the first t positions. A negative token
 * marks padding (teacher-dump's padded last window): the model sees 0 there, the loss no label. */
static void pack_cache_seq(tkd_loader *l, const tkd_cache_batch *cb, int64_t i, int j)
{
    int t = l->o.seq_len, k = l->out.k, s = l->out.s, src_t = cb->seq_len;
    const int32_t *tok = cb->tokens + i * (src_t + 1);
    /* a packed cache: no label across a document start (the next token is another document's) */
    const int32_t *ds = cb->doc_start ? cb->doc_start + i * src_t : NULL;
    for (int p = 0; p < t; p++) {
        int cross = ds && p + 1 < src_t && ds[p + 1] == p + 1;
        l->inputs[(size_t)j * t + p] = tok[p] < 0 ? 0 : tok[p];
        l->labels[(size_t)j * t + p] = cb->labels ? cb->labels[i * src_t + p] /* trained_only: as stored */
                                       : tok[p + 1] < 0 || cross ? -100 : tok[p + 1];
    }
    if (ds)
        memcpy(l->doc + (size_t)j * t, ds, (size_t)t * sizeof(int32_t));
    size_t dst = (size_t)j * t, src = (size_t)i * src_t;
    /* uint32 ids < 2^31 (checked by the kernel's validation) reinterpret as int32 unchanged */
    memcpy(l->topk_idx + dst * k, cb->topk_indices + src * cb->k, (size_t)t * k * sizeof(int32_t));
    memcpy(l->topk_logit + dst * k, cb->topk_logits + src * cb->k, (size_t)t * k * sizeof(float));
    memcpy(l->lse + dst, cb->lse + src, (size_t)t * sizeof(float));
    if (s > 0)
        memcpy(l->tail_idx + dst * s, cb->tail_indices + src * s, (size_t)t * s * sizeof(int32_t));
    l->seq[j] = cb->cache_seq ? cb->cache_seq[i] : cb->seq_index[i];
}

static tkd_status next_from_cache(tkd_loader *l, const tkd_train_batch **batch)
{
    const tkd_cache_batch *cb = NULL;
    int64_t first, count;
    rank_share(l, l->offset, &first, &count);
    if (count > 0)
        TKD_TRY(tkd_cache_stream_next(l->stream, &cb));
    if (!cb && count > 0)
        return tkd_error_set(TKD_ERR_INTERNAL, "loader: the cache stream ended before offset %lld of %lld",
                             (long long)l->offset, (long long)l->n);
    l->out.beyond_vocab = 0;
    if (!cb) { /* this rank's part of the epoch's short last batch is empty */
        l->out.b = 0;
        advance(l);
        *batch = &l->out;
        return TKD_OK;
    }
    for (int64_t i = 0; i < cb->num_seq; i++) {
        pack_cache_seq(l, cb, i, (int)i);
        if (l->vocab > 0)
            TKD_TRY(fit_seq(l, (int)i));
    }
    l->out.b = (int)cb->num_seq;
    advance(l);
    *batch = &l->out;
    return TKD_OK;
}

static tkd_status next_from_tokens(tkd_loader *l, const tkd_train_batch **batch)
{
    int t = l->o.seq_len;
    int64_t first, nb;
    rank_share(l, l->offset, &first, &nb);
    for (int64_t j = 0; j < nb; j++) {
        int64_t w = l->order[first + j];
        if (l->o.pack) {
            TKD_TRY(tkd_doc_pack_read(l->o.pack, w, l->window, l->labels + (size_t)j * t, l->doc + (size_t)j * t,
                                      NULL));
            for (int p = 0; p < t; p++) /* padding (−100) reads as token 0 */
                l->window[p] = l->window[p] < 0 ? 0 : l->window[p];
        } else {
            TKD_TRY(tkd_tokens_window(l->tokens, t, t, 1, w, l->window, l->labels + (size_t)j * t, NULL));
        }
        memcpy(l->inputs + (size_t)j * t, l->window, (size_t)t * sizeof(int32_t));
        l->seq[j] = w;
    }
    l->out.b = (int)nb;
    advance(l);
    *batch = &l->out;
    return TKD_OK;
}

tkd_status tkd_loader_next(tkd_loader *l, const tkd_train_batch **batch)
{
    *batch = NULL;
    if (l->offset >= l->n)
        return TKD_OK;
    return l->cache ? next_from_cache(l, batch) : next_from_tokens(l, batch);
}

void tkd_loader_position(const tkd_loader *l, int64_t *epoch, int64_t *offset)
{
    *epoch = l->epoch;
    *offset = l->offset;
}

int64_t tkd_loader_size(const tkd_loader *l) { return l->n; }
