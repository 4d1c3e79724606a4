/* cache_reader.c — see cache_reader.h. */
#include "formats/cache_reader.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/fileio.h"

/* ---- a small LRU of open shards (one per reader and one per stream) --------------------------- */

typedef struct shard_slot {
    int64_t shard; /* index into the manifest's shard list; -1 = empty */
    tkd_shard *s;
    uint64_t used;
} shard_slot;

typedef struct shard_pool {
    const tkd_cache_reader *r;
    int n;
    shard_slot *slots;
    uint64_t tick;
    int64_t opens; /* shard files opened so far (tkd_cache_stream_shard_opens) */
} shard_pool;

struct tkd_cache_reader {
    char *dir;
    char *mpath;  /* the manifest file */
    tkd_cache_manifest m;
    char **paths; /* (num_shards) full path of each shard */
    int max_open;
    int64_t num_seq;
    shard_pool pool;
};

static tkd_status pool_init(shard_pool *p, const tkd_cache_reader *r)
{
    p->r = r;
    p->n = r->max_open;
    p->tick = 0;
    p->opens = 0;
    p->slots = calloc((size_t)p->n, sizeof *p->slots);
    if (!p->slots)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", r->dir);
    for (int i = 0; i < p->n; i++)
        p->slots[i].shard = -1;
    return TKD_OK;
}

static void pool_free(shard_pool *p)
{
    for (int i = 0; p->slots && i < p->n; i++)
        tkd_shard_close(p->slots[i].s);
    free(p->slots);
    p->slots = NULL;
}

/* A shard must say what the manifest says about it. */
static tkd_status reader_check_shard(const tkd_cache_reader *r, int64_t i, const tkd_shard *s)
{
    const tkd_shard_info *in = tkd_shard_get_info(s);
    const tkd_cache_shard_entry *e = &r->m.shards[i];
    if (tkd_cache_identity_compare(&r->m.id, r->mpath, &in->id, r->paths[i]) != TKD_OK)
        return tkd_error_hint(TKD_ERR_MISMATCH, "the shard belongs to another cache; " TKD_CACHE_REPAIR_HINT);
    if (in->first_seq != e->first_seq || in->num_seq != e->num_seq)
        return tkd_error_set(TKD_ERR_MISMATCH,
                             "%s: holds sequences %lld..+%lld but the manifest lists %lld..+%lld — the file was replaced; " TKD_CACHE_REPAIR_HINT,
                             r->paths[i], (long long)in->first_seq, (long long)in->num_seq,
                             (long long)e->first_seq, (long long)e->num_seq);
    return TKD_OK;
}

/* The open handle of shard i, opening it (and closing the least recently used) when needed. */
static tkd_status pool_get(shard_pool *p, int64_t i, tkd_shard **out)
{
    shard_slot *victim = &p->slots[0];
    for (int j = 0; j < p->n; j++) {
        shard_slot *sl = &p->slots[j];
        if (sl->shard == i) {
            sl->used = ++p->tick;
            *out = sl->s;
            return TKD_OK;
        }
        if (sl->used < victim->used)
            victim = sl;
    }
    tkd_shard_close(victim->s);
    victim->s = NULL;
    victim->shard = -1;
    tkd_shard *s = NULL;
    TKD_TRY(tkd_shard_open(&s, p->r->paths[i], 0));
    p->opens++;
    tkd_status st = reader_check_shard(p->r, i, s);
    if (st != TKD_OK) {
        tkd_shard_close(s);
        return st;
    }
    victim->s = s;
    victim->shard = i;
    victim->used = ++p->tick;
    *out = s;
    return TKD_OK;
}

/* Index of the shard holding global sequence seq (shards tile [0, N), checked at open). */
static int64_t reader_find_shard(const tkd_cache_reader *r, int64_t seq)
{
    int64_t lo = 0, hi = r->m.num_shards - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (r->m.shards[mid].first_seq <= seq)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static tkd_status pool_read(shard_pool *p, int64_t seq, int64_t count, tkd_cache_batch *b, int64_t slot)
{
    const tkd_cache_reader *r = p->r;
    if (seq < 0 || count < 1 || seq + count > r->num_seq)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: sequences %lld..+%lld are outside the cache's [0, %lld)",
                             r->dir, (long long)seq, (long long)count, (long long)r->num_seq);
    while (count > 0) {
        int64_t i = reader_find_shard(r, seq);
        const tkd_cache_shard_entry *e = &r->m.shards[i];
        int64_t n = e->first_seq + e->num_seq - seq;
        n = n < count ? n : count;
        tkd_shard *s;
        TKD_TRY(pool_get(p, i, &s));
        TKD_TRY(tkd_shard_read(s, seq - e->first_seq, n, b, slot));
        seq += n;
        slot += n;
        count -= n;
    }
    return TKD_OK;
}

/* ---- opening ---------------------------------------------------------------------------------- */

/* Shards tile [0, N): a gap means per-worker manifests were not merged or a shard is unlisted. */
static tkd_status reader_check_tiling(tkd_cache_reader *r, const char *mpath)
{
    const tkd_cache_manifest *m = &r->m;
    if (m->num_shards == 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: lists no finished shard — run teacher-dump until one completes",
                             mpath);
    int64_t end = 0;
    for (int64_t i = 0; i < m->num_shards; i++) {
        if (m->shards[i].first_seq != end)
            return tkd_error_set(TKD_ERR_FORMAT,
                                 "%s: %s starts at sequence %lld, expected %lld — sequences are missing: if the dump was split over workers, run every worker and then teacher-dump merge; else re-run the teacher-dump command that made this cache (without --overwrite) to complete it",
                                 mpath, m->shards[i].file, (long long)m->shards[i].first_seq, (long long)end);
        end += m->shards[i].num_seq;
    }
    r->num_seq = end;
    return TKD_OK;
}

/* Each listed shard exists with its listed size and says what the manifest says. */
static tkd_status reader_check_shards(tkd_cache_reader *r, int verify)
{
    for (int64_t i = 0; i < r->m.num_shards; i++) {
        const tkd_cache_shard_entry *e = &r->m.shards[i];
        TKD_TRY(tkd_path_join_alloc(&r->paths[i], r->dir, e->file));
        struct stat st;
        if (stat(r->paths[i], &st) != 0 && errno == ENOENT)
            return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: listed in the manifest but missing — " TKD_CACHE_REPAIR_HINT,
                                 r->paths[i]);
        if (stat(r->paths[i], &st) != 0)
            return tkd_error_set(TKD_ERR_IO, "%s: %s — check the file and its directory's permissions", r->paths[i],
                                 strerror(errno));
        if ((uint64_t)st.st_size != e->bytes)
            return tkd_error_set(TKD_ERR_FORMAT,
                                 "%s: %lld bytes, the manifest lists %llu — the shard is truncated or was replaced; " TKD_CACHE_REPAIR_HINT,
                                 r->paths[i], (long long)st.st_size, (unsigned long long)e->bytes);
        if (verify)
            TKD_TRY(tkd_cache_manifest_verify_shard(r->dir, e));
        tkd_shard *s = NULL;
        TKD_TRY(tkd_shard_open(&s, r->paths[i], 0));
        tkd_status st2 = reader_check_shard(r, i, s);
        tkd_shard_close(s);
        TKD_TRY(st2);
    }
    return TKD_OK;
}

/* How many shards a pool keeps open. Shuffled batches touch every shard: a pool smaller than the
 * cache reopens a shard (HDF5 file, datasets, attributes checked again) on about every read, which
 * made reading 16 × 64 tokens from a 16-shard cache take ~33 ms on one core (3.3 ms with every shard
 * open). So by default every shard stays open, up to TKD_CACHE_MAX_OPEN_SHARDS. */
static void open_limits(tkd_cache_reader *r, const tkd_cache_reader_opts *o)
{
    int64_t shards = r->m.num_shards < TKD_CACHE_MAX_OPEN_SHARDS ? r->m.num_shards : TKD_CACHE_MAX_OPEN_SHARDS;
    r->max_open = o->max_open_shards > 0 ? o->max_open_shards : shards > 0 ? (int)shards : 1;
}

tkd_status tkd_cache_reader_open(tkd_cache_reader **out, const char *dir,
                                 const tkd_cache_reader_opts *opts)
{
    *out = NULL;
    tkd_cache_reader_opts o = opts ? *opts : (tkd_cache_reader_opts){0, 0, NULL};
    tkd_cache_reader *r = calloc(1, sizeof *r);
    if (!r || !(r->dir = strdup(dir))) {
        free(r);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", dir);
    }
    tkd_status st = tkd_path_join_alloc(&r->mpath, dir, o.manifest ? o.manifest : TKD_CACHE_MANIFEST_NAME);
    const char *mpath = r->mpath;
    if (st == TKD_OK)
        st = tkd_cache_manifest_read(&r->m, mpath);
    if (st == TKD_ERR_NOT_FOUND)
        st = tkd_error_set(st, "%s: no manifest — not a teacher cache directory (teacher-dump writes one)", mpath);
    if (st == TKD_OK)
        st = reader_check_tiling(r, mpath);
    if (st == TKD_OK && !(r->paths = calloc((size_t)r->m.num_shards, sizeof *r->paths)))
        st = tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", dir);
    if (st == TKD_OK)
        st = reader_check_shards(r, o.verify_sha256);
    if (st == TKD_OK) {
        open_limits(r, &o);
        st = pool_init(&r->pool, r);
    }
    if (st != TKD_OK) {
        tkd_cache_reader_close(r);
        return st;
    }
    *out = r;
    return TKD_OK;
}

void tkd_cache_reader_close(tkd_cache_reader *r)
{
    if (!r)
        return;
    pool_free(&r->pool);
    for (int64_t i = 0; r->paths && i < r->m.num_shards; i++)
        free(r->paths[i]);
    free(r->paths);
    tkd_cache_manifest_free(&r->m);
    free(r->mpath);
    free(r->dir);
    free(r);
}

const tkd_cache_manifest *tkd_cache_reader_manifest(const tkd_cache_reader *r) { return &r->m; }

int64_t tkd_cache_reader_num_seq(const tkd_cache_reader *r) { return r->num_seq; }

tkd_status tkd_cache_reader_read(tkd_cache_reader *r, int64_t seq, int64_t count,
                                 tkd_cache_batch *b, int64_t slot)
{
    return pool_read(&r->pool, seq, count, b, slot);
}

/* ---- streaming -------------------------------------------------------------------------------- */

enum { RING_FREE = 0, RING_FILLED = 1 };

struct tkd_cache_stream {
    tkd_cache_reader *r;
    shard_pool pool;   /* the thread's own shard handles */
    int64_t *order;    // (n) global sequence numbers, in hand-out order
    int64_t n, batch_seq, num_batches;
    int depth;
    tkd_cache_batch *ring; // (depth)
    int *state;            // (depth) RING_FREE / RING_FILLED
    tkd_status *status;    // (depth) result of filling each slot
    int64_t next_out;      /* batch number _next hands out next */
    int held;              /* ring slot the consumer holds, -1 none */
    int stop, failed, thread_started;
    tkd_error_saved err;   /* the reader thread's failure, for the consumer's thread */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
};

/* Fills ring slot with batch number bi, reading runs of consecutive sequences in one call. */
static tkd_status stream_fill(tkd_cache_stream *s, int64_t bi, tkd_cache_batch *b)
{
    int64_t first = bi * s->batch_seq;
    int64_t n = s->n - first < s->batch_seq ? s->n - first : s->batch_seq;
    const int64_t *ord = s->order + first;
    for (int64_t i = 0; i < n;) {
        int64_t run = 1;
        while (i + run < n && ord[i + run] == ord[i] + run)
            run++;
        TKD_TRY(pool_read(&s->pool, ord[i], run, b, i));
        i += run;
    }
    b->num_seq = n;
    return TKD_OK;
}

static void *stream_main(void *arg)
{
    tkd_cache_stream *s = arg;
    for (int64_t bi = 0; bi < s->num_batches; bi++) {
        int slot = (int)(bi % s->depth);
        pthread_mutex_lock(&s->mu);
        while (!s->stop && s->state[slot] != RING_FREE)
            pthread_cond_wait(&s->cv, &s->mu);
        int stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop)
            break;
        tkd_status st = stream_fill(s, bi, &s->ring[slot]); /* outside the lock: the slow part */
        pthread_mutex_lock(&s->mu);
        s->status[slot] = st;
        s->state[slot] = RING_FILLED;
        if (st != TKD_OK)
            tkd_error_save(&s->err, st);
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        if (st != TKD_OK)
            break;
    }
    return NULL;
}

static void stream_free(tkd_cache_stream *s)
{
    for (int i = 0; s->ring && i < s->depth; i++)
        tkd_cache_batch_free(&s->ring[i]);
    free(s->ring);
    free(s->state);
    free(s->status);
    free(s->order);
    pool_free(&s->pool);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

static tkd_status stream_check_args(const tkd_cache_reader *r, const int64_t *order, int64_t n,
                                    const tkd_cache_stream_opts *o)
{
    const tkd_cache_identity *id = &r->m.id;
    if (n < 0 || (n > 0 && !order) || o->batch_seq < 1 || o->k < 0 || o->k > id->k ||
        o->depth == 1 || o->depth < 0 || (o->with_tail && id->tail_samples == 0))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: stream of %lld sequences, batch %lld, k' %d (cache k %d), depth %d, tail %d (cache S %d) is not possible",
                             r->dir, (long long)n, (long long)o->batch_seq, o->k, id->k, o->depth,
                             o->with_tail, id->tail_samples);
    for (int64_t i = 0; i < n; i++)
        if (order[i] < 0 || order[i] >= r->num_seq)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: order[%lld] = %lld is outside the cache's [0, %lld)",
                                 r->dir, (long long)i, (long long)order[i], (long long)r->num_seq);
    return TKD_OK;
}

static tkd_status stream_alloc(tkd_cache_stream *s, const tkd_cache_stream_opts *o)
{
    const tkd_cache_identity *id = &s->r->m.id;
    s->ring = calloc((size_t)s->depth, sizeof *s->ring);
    s->state = calloc((size_t)s->depth, sizeof *s->state);
    s->status = calloc((size_t)s->depth, sizeof *s->status);
    if (!s->ring || !s->state || !s->status)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory for the stream ring", s->r->dir);
    for (int i = 0; i < s->depth; i++)
    {
        TKD_TRY(tkd_cache_batch_alloc(&s->ring[i], s->batch_seq, id->seq_len, o->k ? o->k : id->k,
                                      o->with_tail ? id->tail_samples : 0));
        if (id->packed) /* the documents' starts, for the forward */
            TKD_TRY(tkd_cache_batch_alloc_doc_start(&s->ring[i]));
        if (id->trained_only) /* the labels: −100 where the dataset trains no target */
            TKD_TRY(tkd_cache_batch_alloc_labels(&s->ring[i]));
    }
    return pool_init(&s->pool, s->r);
}

tkd_status tkd_cache_stream_open(tkd_cache_stream **out, tkd_cache_reader *r, const int64_t *order,
                                 int64_t n, const tkd_cache_stream_opts *opts)
{
    *out = NULL;
    TKD_TRY(stream_check_args(r, order, n, opts));
    tkd_cache_stream *s = calloc(1, sizeof *s);
    if (!s)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", r->dir);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->r = r;
    s->n = n;
    s->batch_seq = opts->batch_seq;
    s->num_batches = (n + opts->batch_seq - 1) / opts->batch_seq;
    s->depth = opts->depth ? opts->depth : 3;
    s->held = -1;
    s->order = malloc((size_t)(n ? n : 1) * sizeof *s->order);
    tkd_status st = s->order ? stream_alloc(s, opts)
                             : tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", r->dir);
    if (st == TKD_OK) {
        if (n > 0)
            memcpy(s->order, order, (size_t)n * sizeof *order);
        if (pthread_create(&s->thread, NULL, stream_main, s) != 0)
            st = tkd_error_set(TKD_ERR_INTERNAL, "%s: cannot start the loader thread", r->dir);
        else
            s->thread_started = 1;
    }
    if (st != TKD_OK) {
        stream_free(s);
        return st;
    }
    *out = s;
    return TKD_OK;
}

tkd_status tkd_cache_stream_next(tkd_cache_stream *s, const tkd_cache_batch **batch)
{
    *batch = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->held >= 0) { /* give the previous batch back to the thread */
        s->state[s->held] = RING_FREE;
        s->held = -1;
        pthread_cond_broadcast(&s->cv);
    }
    if (s->failed || s->next_out >= s->num_batches) {
        pthread_mutex_unlock(&s->mu);
        return TKD_OK;
    }
    int slot = (int)(s->next_out % s->depth);
    while (s->state[slot] != RING_FILLED)
        pthread_cond_wait(&s->cv, &s->mu);
    tkd_status st = s->status[slot];
    if (st != TKD_OK) {
        s->failed = 1;
        tkd_error_restore(&s->err);
    } else {
        s->held = slot;
        s->next_out++;
        *batch = &s->ring[slot];
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

void tkd_cache_stream_close(tkd_cache_stream *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->thread_started)
        pthread_join(s->thread, NULL);
    stream_free(s);
}

int64_t tkd_cache_stream_shard_opens(tkd_cache_stream *s)
{
    pthread_mutex_lock(&s->mu); /* the stream's thread counts; its batches were handed out under mu */
    int64_t n = s->pool.opens;
    pthread_mutex_unlock(&s->mu);
    return n;
}
