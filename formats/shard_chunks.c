/* shard_chunks.c — see shard_chunks.h. */
#include "formats/shard_chunks.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "formats/h5filters.h"

/* One chunk to filter: where its raw bytes are and where the filtered ones go. */
typedef struct chunk_job {
    const uint8_t *src;
    size_t nbytes, elem;
    uint8_t *out;
    size_t cap;
} chunk_job;

struct tkd_shard_chunks {
    int nstreams, threads, level;
    tkd_shard_chunk_stream streams[TKD_SHARD_CHUNKS_MAX_STREAMS];
    int64_t chunk_rows;
    int64_t rows;                                 /* rows appended to each stream so far */
    int64_t pending;                              /* of those, rows waiting in `partial` */
    uint8_t *partial[TKD_SHARD_CHUNKS_MAX_STREAMS]; /* (chunk_rows, row_bytes) per stream */
    tkd_h5_filter_ctx **ctx;                      /* (threads) */
    /* per call; grown to the largest call, never shrunk */
    chunk_job *jobs;
    tkd_shard_chunk *ready;
    size_t njobs, jobs_cap;
    uint8_t *arena;                               /* the filtered chunks */
    size_t arena_cap;
};

void tkd_shard_chunks_free(tkd_shard_chunks *c)
{
    if (!c)
        return;
    for (int s = 0; s < c->nstreams; s++)
        free(c->partial[s]);
    for (int t = 0; c->ctx && t < c->threads; t++)
        tkd_h5_filter_ctx_free(c->ctx[t]);
    free(c->ctx);
    free(c->jobs);
    free(c->ready);
    free(c->arena);
    free(c);
}

tkd_status tkd_shard_chunks_create(tkd_shard_chunks **out, const tkd_shard_chunk_stream *streams,
                                   int nstreams, int64_t chunk_rows, int level, int threads)
{
    *out = NULL;
    if (nstreams < 1 || nstreams > TKD_SHARD_CHUNKS_MAX_STREAMS || chunk_rows < 1 || threads < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "chunk filter: %d streams, %lld rows per chunk, %d threads",
                             nstreams, (long long)chunk_rows, threads);
    tkd_shard_chunks *c = calloc(1, sizeof *c);
    if (!c)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for the chunk filter");
    c->nstreams = nstreams;
    c->threads = threads;
    c->level = level;
    c->chunk_rows = chunk_rows;
    memcpy(c->streams, streams, (size_t)nstreams * sizeof *streams);
    size_t max_chunk = 0;
    tkd_status st = TKD_OK;
    for (int s = 0; s < nstreams; s++) {
        size_t bytes = streams[s].row_bytes * (size_t)chunk_rows;
        max_chunk = bytes > max_chunk ? bytes : max_chunk;
        if (bytes && !(c->partial[s] = malloc(bytes)))
            st = tkd_error_set(TKD_ERR_NOMEM, "out of memory for a chunk buffer (%zu bytes)", bytes);
    }
    c->ctx = st == TKD_OK ? calloc((size_t)threads, sizeof *c->ctx) : NULL;
    if (st == TKD_OK && !c->ctx)
        st = tkd_error_set(TKD_ERR_NOMEM, "out of memory for the chunk filter");
    for (int t = 0; st == TKD_OK && t < threads; t++)
        st = tkd_h5_filter_ctx_create(&c->ctx[t], max_chunk);
    if (st != TKD_OK) {
        tkd_shard_chunks_free(c);
        return st;
    }
    *out = c;
    return TKD_OK;
}

/* Room for n jobs; the ready list grows with them. */
static tkd_status reserve_jobs(tkd_shard_chunks *c, size_t n)
{
    if (n <= c->jobs_cap)
        return TKD_OK;
    chunk_job *j = realloc(c->jobs, n * sizeof *j);
    if (j)
        c->jobs = j;
    tkd_shard_chunk *r = j ? realloc(c->ready, n * sizeof *r) : NULL;
    if (r)
        c->ready = r;
    if (!j || !r)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory listing %zu chunks", n);
    c->jobs_cap = n;
    return TKD_OK;
}

static void add_job(tkd_shard_chunks *c, int s, int64_t first_row, const uint8_t *src)
{
    size_t nbytes = c->streams[s].row_bytes * (size_t)c->chunk_rows;
    c->jobs[c->njobs] = (chunk_job){src, nbytes, c->streams[s].elem, NULL, tkd_h5_filter_bound(nbytes)};
    c->ready[c->njobs] = (tkd_shard_chunk){s, first_row, NULL, 0};
    c->njobs++;
}

/* Carves every job's output out of one arena (grown to the largest call). */
static tkd_status place_outputs(tkd_shard_chunks *c)
{
    size_t need = 0;
    for (size_t i = 0; i < c->njobs; i++)
        need += c->jobs[i].cap;
    if (need > c->arena_cap) {
        uint8_t *a = realloc(c->arena, need);
        if (!a)
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory for %zu bytes of filtered chunks", need);
        c->arena = a;
        c->arena_cap = need;
    }
    size_t off = 0;
    for (size_t i = 0; i < c->njobs; i++) {
        c->jobs[i].out = c->arena + off;
        off += c->jobs[i].cap;
    }
    return TKD_OK;
}

/* Filters every listed job, several at once. Jobs are dealt out one at a time (dynamic), so a
 * thread that drew small chunks takes more of them. */
static tkd_status filter_jobs(tkd_shard_chunks *c)
{
    TKD_TRY(place_outputs(c));
    long n = (long)c->njobs;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(c->threads) if (c->threads > 1 && n > 1) reduction(| : failed)
    for (long i = 0; i < n; i++) {
        chunk_job *j = &c->jobs[i];
        size_t got = tkd_h5_filter_chunk(c->ctx[omp_get_thread_num()], j->src, j->nbytes, j->elem, c->level,
                                         j->out, j->cap);
        c->ready[i].data = j->out;
        c->ready[i].size = got;
        failed |= got == 0;
    }
    if (failed)
        return tkd_error_set(TKD_ERR_INTERNAL, "zstd failed to compress a chunk (level %d)", c->level);
    return TKD_OK;
}

/* Lists the chunks that rows [rows, rows + n) complete for stream s: first the partial chunk
 * (topped up here, so it is a whole chunk when listed), then whole chunks straight from src.
 * Returns how many rows of src are left over for the partial buffer. */
static int64_t plan_stream(tkd_shard_chunks *c, int s, int64_t n, const uint8_t *src)
{
    size_t rb = c->streams[s].row_bytes;
    int64_t used = 0;
    if (c->pending > 0) {
        used = c->chunk_rows - c->pending < n ? c->chunk_rows - c->pending : n;
        memcpy(c->partial[s] + (size_t)c->pending * rb, src, (size_t)used * rb);
        if (c->pending + used == c->chunk_rows)
            add_job(c, s, c->rows - c->pending, c->partial[s]);
    }
    for (; n - used >= c->chunk_rows; used += c->chunk_rows)
        add_job(c, s, c->rows + used, src + (size_t)used * rb);
    return n - used;
}

tkd_status tkd_shard_chunks_add(tkd_shard_chunks *c, int64_t n, const void *const *src)
{
    c->njobs = 0;
    if (n <= 0)
        return TKD_OK;
    TKD_TRY(reserve_jobs(c, (size_t)c->nstreams * (size_t)(n / c->chunk_rows + 1)));
    int64_t left = 0;
    for (int s = 0; s < c->nstreams; s++)
        if (c->streams[s].row_bytes)
            left = plan_stream(c, s, n, src[s]);
    TKD_TRY(filter_jobs(c));
    /* Rows left over start a new partial chunk (the old one, if any, was completed and listed):
     * copied only now, because that old buffer may be the source of a job just filtered. */
    for (int s = 0; s < c->nstreams && left > 0; s++) {
        size_t rb = c->streams[s].row_bytes;
        if (rb)
            memcpy(c->partial[s], (const uint8_t *)src[s] + (size_t)(n - left) * rb, (size_t)left * rb);
    }
    c->rows += n;
    c->pending = (c->pending + n) % c->chunk_rows;
    return TKD_OK;
}

tkd_status tkd_shard_chunks_flush(tkd_shard_chunks *c)
{
    c->njobs = 0;
    if (c->pending == 0)
        return TKD_OK;
    TKD_TRY(reserve_jobs(c, (size_t)c->nstreams));
    for (int s = 0; s < c->nstreams; s++) {
        size_t rb = c->streams[s].row_bytes;
        if (!rb)
            continue;
        memset(c->partial[s] + (size_t)c->pending * rb, 0, (size_t)(c->chunk_rows - c->pending) * rb);
        add_job(c, s, c->rows - c->pending, c->partial[s]);
    }
    TKD_TRY(filter_jobs(c));
    c->pending = 0;
    return TKD_OK;
}

size_t tkd_shard_chunks_ready(const tkd_shard_chunks *c, const tkd_shard_chunk **out)
{
    *out = c->ready;
    return c->njobs;
}
