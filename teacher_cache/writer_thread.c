/* writer_thread.c — see writer_thread.h. */
#include "teacher_cache/writer_thread.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"

#define NBUF 2 /* double buffering: one filling on the compute thread, one being written */

struct tkd_dump_writer {
    tkd_dump_writer_opts o;
    char *dir, *manifest_path;
    tkd_cache_manifest manifest;      /* this worker's listed shards; touched by the thread only */
    tkd_cache_batch bufs[NBUF];
    int64_t first_seq[NBUF];          /* cache position of each queued buffer */

    pthread_mutex_t mu;
    pthread_cond_t cv;
    int free_list[NBUF], nfree;       /* buffers the compute thread may take */
    int queue[NBUF], qhead, qlen;     /* submitted buffers, FIFO */
    bool busy;                        /* the thread is writing a buffer */
    bool stop, abort;
    tkd_error_saved err;              /* first error of the thread (err.st == TKD_OK: none) */
    tkd_dump_writer_stats stats;

    /* thread-only state */
    pthread_t thread;
    bool thread_started;
    tkd_shard_writer *shard;          /* the open shard, or NULL */
    int64_t shard_planned;            /* sequences the open shard must hold */
    int64_t next_seq;                 /* where the next batch of the open shard must start */
};

static void set_error_locked(tkd_dump_writer *w, tkd_status st)
{
    if (w->err.st == TKD_OK)
        tkd_error_save(&w->err, st); /* handed to the compute thread by error_locked */
}

static tkd_status shard_open(tkd_dump_writer *w, int64_t first_seq)
{
    int64_t ss = w->o.shard_sequences;
    if (first_seq % ss != 0)
        return tkd_error_set(TKD_ERR_INTERNAL, "%s: a shard would start at sequence %lld, not a multiple "
                             "of cache.shard_sequences %lld — this is a bug", w->dir,
                             (long long)first_seq, (long long)ss);
    char name[64], path[4096];
    snprintf(name, sizeof name, "shard-%05lld.h5", (long long)(first_seq / ss));
    TKD_TRY(tkd_path_join(path, sizeof path, w->dir, name));
    int64_t end = first_seq + ss < w->o.range_end ? first_seq + ss : w->o.range_end;
    w->shard_planned = end - first_seq;
    return tkd_shard_writer_open(&w->shard, path, &w->manifest.id, first_seq, &w->o.shard);
}

/* The open shard holds all its sequences: publish it, list it, rewrite the manifest. */
static tkd_status shard_close(tkd_dump_writer *w)
{
    tkd_cache_shard_entry e;
    tkd_status st = tkd_shard_writer_finish(w->shard, &e);
    w->shard = NULL;
    TKD_TRY(st);
    /* insert, not append: a shard re-made into a gap of the list (repair) goes in its place */
    TKD_TRY(tkd_cache_manifest_insert_shard(&w->manifest, &e));
    st = tkd_cache_manifest_write(&w->manifest, w->manifest_path);
    if (st != TKD_OK) {
        /* The shard is complete but unlisted: a re-run rewrites it. Remove it so nothing
         * unlisted lies around looking finished. */
        char path[4096];
        if (tkd_path_join(path, sizeof path, w->dir, e.file) == TKD_OK)
            remove(path);
        return st;
    }
    pthread_mutex_lock(&w->mu);
    w->stats.shards++;
    w->stats.seqs += e.num_seq;
    w->stats.bytes += e.bytes;
    pthread_mutex_unlock(&w->mu);
    return TKD_OK;
}

static tkd_status write_batch(tkd_dump_writer *w, const tkd_cache_batch *b, int64_t first_seq)
{
    /* Between shards the next batch may start any shard (the caller skips the shards it keeps). */
    if (!w->shard) {
        TKD_TRY(shard_open(w, first_seq));
        w->next_seq = first_seq;
    }
    if (first_seq != w->next_seq)
        return tkd_error_set(TKD_ERR_INTERNAL, "%s: batch at sequence %lld, expected %lld — this is a bug",
                             w->dir, (long long)first_seq, (long long)w->next_seq);
    if (tkd_shard_writer_num_seq(w->shard) + b->num_seq > w->shard_planned)
        return tkd_error_set(TKD_ERR_INTERNAL, "%s: batch of %lld sequences at %lld crosses a shard "
                             "boundary — this is a bug", w->dir, (long long)b->num_seq, (long long)first_seq);
    TKD_TRY(tkd_shard_writer_append(w->shard, b));
    w->next_seq += b->num_seq;
    if (tkd_shard_writer_num_seq(w->shard) == w->shard_planned)
        TKD_TRY(shard_close(w));
    return TKD_OK;
}

static void *thread_main(void *arg)
{
    tkd_dump_writer *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (w->qlen == 0 && !w->stop)
            pthread_cond_wait(&w->cv, &w->mu);
        if (w->abort || (w->stop && w->qlen == 0))
            break;
        int i = w->queue[w->qhead];
        w->qhead = (w->qhead + 1) % NBUF;
        w->qlen--;
        w->busy = true;
        bool failed = w->err.st != TKD_OK;
        pthread_mutex_unlock(&w->mu);

        tkd_status st = failed ? TKD_OK : write_batch(w, &w->bufs[i], w->first_seq[i]);

        pthread_mutex_lock(&w->mu);
        if (st != TKD_OK)
            set_error_locked(w, st);
        w->bufs[i].num_seq = 0;
        w->free_list[w->nfree++] = i;
        w->busy = false;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    /* Stopped with a shard open: it is incomplete (interrupt, error, or a caller that stopped
     * early), so it must not be published. */
    tkd_shard_writer_abort(w->shard);
    w->shard = NULL;
    return NULL;
}

static void writer_free(tkd_dump_writer *w)
{
    for (int i = 0; i < NBUF; i++)
        tkd_cache_batch_free(&w->bufs[i]);
    tkd_cache_manifest_free(&w->manifest);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w->dir);
    free(w->manifest_path);
    free(w);
}

tkd_status tkd_dump_writer_start(tkd_dump_writer **out, const tkd_dump_writer_opts *o)
{
    *out = NULL;
    tkd_dump_writer *w = calloc(1, sizeof *w);
    if (!w)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory starting the shard writer");
    w->o = *o;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    tkd_cache_manifest_init(&w->manifest);
    w->dir = strdup(o->dir);
    w->manifest_path = strdup(o->manifest_path);
    tkd_status st = w->dir && w->manifest_path ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    if (st == TKD_OK)
        st = tkd_cache_manifest_copy(&w->manifest, o->manifest);
    const tkd_cache_identity *id = &o->manifest->id;
    for (int i = 0; st == TKD_OK && i < NBUF; i++) {
        st = tkd_cache_batch_alloc(&w->bufs[i], o->batch_capacity, id->seq_len, id->k, id->tail_samples);
        if (st == TKD_OK && id->packed)
            st = tkd_cache_batch_alloc_doc_start(&w->bufs[i]);
        if (st == TKD_OK && id->trained_only)
            st = tkd_cache_batch_alloc_labels(&w->bufs[i]);
        w->free_list[w->nfree++] = i;
    }
    if (st == TKD_OK) {
        if (pthread_create(&w->thread, NULL, thread_main, w) != 0)
            st = tkd_error_set(TKD_ERR_INTERNAL, "cannot start the shard writer thread");
        else
            w->thread_started = true;
    }
    if (st != TKD_OK) {
        writer_free(w);
        return st;
    }
    *out = w;
    return TKD_OK;
}

static tkd_status error_locked(tkd_dump_writer *w) { return tkd_error_restore(&w->err); }

tkd_status tkd_dump_writer_acquire(tkd_dump_writer *w, tkd_cache_batch **b)
{
    *b = NULL;
    pthread_mutex_lock(&w->mu);
    while (w->nfree == 0 && w->err.st == TKD_OK)
        pthread_cond_wait(&w->cv, &w->mu);
    tkd_status st = w->err.st;
    if (st != TKD_OK)
        error_locked(w);
    else
        *b = &w->bufs[w->free_list[--w->nfree]];
    pthread_mutex_unlock(&w->mu);
    return st;
}

tkd_status tkd_dump_writer_submit(tkd_dump_writer *w, tkd_cache_batch *b, int64_t first_seq)
{
    int i = (int)(b - w->bufs);
    if (i < 0 || i >= NBUF)
        return tkd_error_set(TKD_ERR_INTERNAL, "submit of a buffer the writer did not lend — this is a bug");
    pthread_mutex_lock(&w->mu);
    w->first_seq[i] = first_seq;
    w->queue[(w->qhead + w->qlen) % NBUF] = i;
    w->qlen++;
    tkd_status st = w->err.st;
    if (st != TKD_OK)
        error_locked(w);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return st;
}

tkd_status tkd_dump_writer_drain(tkd_dump_writer *w)
{
    pthread_mutex_lock(&w->mu);
    while ((w->qlen > 0 || w->busy) && w->err.st == TKD_OK)
        pthread_cond_wait(&w->cv, &w->mu);
    tkd_status st = w->err.st;
    if (st != TKD_OK)
        error_locked(w);
    pthread_mutex_unlock(&w->mu);
    return st;
}

static void stop_and_join(tkd_dump_writer *w, bool abort)
{
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    w->abort = abort;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (w->thread_started)
        pthread_join(w->thread, NULL);
}

tkd_status tkd_dump_writer_finish(tkd_dump_writer *w)
{
    stop_and_join(w, false);
    tkd_status st = w->err.st;
    if (st != TKD_OK)
        tkd_error_restore(&w->err);
    writer_free(w);
    return st;
}

void tkd_dump_writer_abort(tkd_dump_writer *w)
{
    if (!w)
        return;
    stop_and_join(w, true);
    writer_free(w);
}

void tkd_dump_writer_get_stats(tkd_dump_writer *w, tkd_dump_writer_stats *s)
{
    pthread_mutex_lock(&w->mu);
    *s = w->stats;
    pthread_mutex_unlock(&w->mu);
}
