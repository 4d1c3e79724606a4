/* loader.h — student-train's data: sequences from a teacher cache (with the teacher's top-k, LSE
 * and tail draws) or, for CE-only runs, windows of token files; a seeded shuffle per epoch;
 * batches handed out in order, read ahead by a background thread (the cache stream).
 *
 * Each epoch visits every sequence of its split exactly once, in the order
 * shuffle(split, rng(seed, epoch)); the last batch of an epoch may be shorter. The position
 * (epoch, offset into that order) is all a checkpoint needs to resume exactly.
 */
#ifndef TKD_LOADER_H
#define TKD_LOADER_H

#include <stdint.h>

#include "common/status.h"
#include "formats/cache_reader.h"
#include "formats/doc_pack.h"
#include "formats/tokens.h"

/* A batch ready for the model and the loss; buffers owned by the loader, valid until the next
 * tkd_loader_next / tkd_loader_close. Teacher arrays are NULL for CE-only sources. */
typedef struct tkd_train_batch {
    int b;                     /* sequences in this batch (<= batch_size) */
    int t;                     /* positions per sequence */
    int k;                     /* teacher columns per position (k'), 0 without a teacher */
    int s;                     /* tail draws per position, 0 when none */
    const int32_t *inputs;     // (b, t) token ids fed to the model
    const int32_t *labels;     // (b, t) next tokens; -100 = no label (padding)
    const int32_t *topk_idx;   // (b·t, k)
    const float *topk_logit;   // (b·t, k)
    const float *teacher_lse;  // (b·t)
    const int32_t *tail_idx;   // (b·t, s)
    const int64_t *seq;        // (b) sequence ids within the source
    const int32_t *doc;        // (b, t) packed documents' starts (tkd_model_forward_docs), or NULL
    int64_t beyond_vocab;      /* teacher entries (top-k' columns and tail draws) of this batch that
                                * were beyond the student's vocabulary (tkd_loader_fit_vocab) */
} tkd_train_batch;

typedef struct tkd_loader tkd_loader;

typedef struct tkd_loader_opts {
    int batch_size;     /* sequences per batch */
    int seq_len;        /* positions used per sequence (<= the source's) */
    int k;              /* teacher columns to read (k' <= cache k); ignored without a cache */
    int with_tail;      /* read /tail/indices */
    int prefetch;       /* ring depth of the cache stream */
    uint64_t seed;      /* shuffle seed; the epoch number selects the stream */
    int shuffle;        /* 0: keep the split's order (evaluation) */
    /* Data parallel (world > 1; 0 or 1: one process): every rank walks the same epoch order in
     * global batches of world·batch_size sequences and takes [rank·batch_size, (rank+1)·batch_size)
     * of each, so the ranks' sequences are disjoint and together are the one-process batch of
     * world·batch_size. The position (offset) counts global batches' sequences, the same on every
     * rank. A rank whose part of an epoch's short last batch is empty gets a batch with b = 0. */
    int rank, world;
    /* A token source cut into packed documents (data.packing: documents; formats/doc_pack.h): the
     * split indexes its sequences instead of windows. NULL: windows. A cache source says itself
     * (its identity's packed) and ignores this. */
    const tkd_doc_pack *pack;
} tkd_loader_opts;

/* A loader over the sequences split[0..n) of a cache (cache != NULL) or of the windows of a token
 * dataset (tokens != NULL, windows of seq_len + 1 every seq_len tokens). The source must outlive
 * the loader; split is copied. *out owned by the caller (tkd_loader_close). */
tkd_status tkd_loader_open(tkd_loader **out, tkd_cache_reader *cache, const tkd_tokens *tokens,
                           const int64_t *split, int64_t n, const tkd_loader_opts *opts);
void tkd_loader_close(tkd_loader *l); /* NULL is a no-op */

/* A student whose vocabulary V is smaller than the cache's (a teacher's embedding padded past its
 * tokenizer, e.g. Qwen2.5-7B's 152064 rows against Qwen2.5-0.5B's 151936): every token of the data
 * must then be < V (otherwise the next batch fails naming the sequence: the extra ids are not
 * unused), and each stored teacher entry beyond V is mapped before the loss sees it:
 *  - a top-k' column gets the logit TKD_LOADER_DROPPED_LOGIT and the id of a token the row does not
 *    otherwise use (the largest such id < V): its teacher probability becomes 0, so `renorm`
 *    renormalises over the other columns and `tail`/`sampled` count its mass in the tail r;
 *  - a tail draw is replaced by the row's first draw within V (a row with none fails).
 * With renorm set, a row whose k' columns all lie beyond V fails (nothing is left to renormalise).
 * The number of mapped entries comes with each batch (beyond_vocab). v >= the cache's: no-op. */
tkd_status tkd_loader_fit_vocab(tkd_loader *l, int v, int renorm);

#define TKD_LOADER_DROPPED_LOGIT (-1e30f) /* exp(t/τ − lse) is 0 for every τ ≥ 0.01, yet finite */

/* Positions the loader at (epoch, offset): the next batch starts at that offset of the epoch's
 * order. Used at start (0, 0) and on resume. */
tkd_status tkd_loader_seek(tkd_loader *l, int64_t epoch, int64_t offset);

/* The next batch of the current epoch; *batch = NULL at the end of the epoch (call seek for the
 * next). Errors (a corrupt shard) name the shard file and sequences. */
tkd_status tkd_loader_next(tkd_loader *l, const tkd_train_batch **batch);

/* Where the next batch starts. */
void tkd_loader_position(const tkd_loader *l, int64_t *epoch, int64_t *offset);

/* Sequences in the split. */
int64_t tkd_loader_size(const tkd_loader *l);

/* The order of an epoch: split shuffled by rng(seed, epoch) (or kept when !shuffle), into
 * order (n). Exposed for tests. */
void tkd_loader_epoch_order(const tkd_loader *l, int64_t epoch, int64_t *order);

#endif /* TKD_LOADER_H */
