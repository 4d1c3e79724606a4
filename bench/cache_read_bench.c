/* cache_read_bench.c — how fast a cache streams back in student-train's order (a program, not a
 * test): batches of --seqs sequences in a seeded shuffle of the cache's first --limit sequences
 * (0: all), through the reader and stream student-train uses (formats/cache_reader.h), for each
 * --max-open count of shard files kept open (0: the reader's default, every shard up to
 * TKD_CACHE_MAX_OPEN_SHARDS). One row per count:
 *   ms/batch   wall time per batch handed out, reading ahead on the stream's thread as in training
 *              (the consumer does nothing else, so this is the reader's own rate);
 *   tok/s      positions per second at that rate: the ceiling a student fed from this cache meets.
 *
 *   cache_read_bench --cache DIR [--seqs 16] [--batches 256] [--limit 0] [--max-open 8,0] [--k 0]
 * Made for the quality table's slow cache-fed rows (docs/PERFORMANCE.md): with 8 of 16 shards open a
 * shuffled read reopened a shard about every other sequence.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/rng.h"
#include "formats/cache_reader.h"

enum { MAX_COUNTS = 8 };

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* "8,0" into out (at most max); the count, or 0 when an item is not a number >= 0. */
static int parse_counts(const char *v, int *out, int max)
{
    int n = 0;
    for (const char *p = v; *p && n < max;) {
        char *end = NULL;
        long x = strtol(p, &end, 10);
        if (end == p || x < 0 || (*end && *end != ','))
            return 0;
        out[n++] = (int)x;
        p = *end ? end + 1 : end;
    }
    return n;
}

typedef struct args {
    const char *cache;
    int seqs, batches, k, n_open;
    int64_t limit;
    int open[MAX_COUNTS];
} args;

static int parse(int argc, char **argv, args *a)
{
    *a = (args){NULL, 16, 256, 0, 2, 0, {8, 0}};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *v = argv[i + 1];
        if (!strcmp(argv[i], "--cache"))
            a->cache = v;
        else if (!strcmp(argv[i], "--seqs"))
            a->seqs = atoi(v);
        else if (!strcmp(argv[i], "--batches"))
            a->batches = atoi(v);
        else if (!strcmp(argv[i], "--limit"))
            a->limit = atoll(v);
        else if (!strcmp(argv[i], "--k"))
            a->k = atoi(v);
        else if (!strcmp(argv[i], "--max-open"))
            a->n_open = parse_counts(v, a->open, MAX_COUNTS);
        else
            return 1;
    }
    return !a->cache || a->seqs < 1 || a->batches < 1 || a->n_open < 1 || (argc % 2) == 0;
}

/* order (n): 0..n-1 in a seeded shuffle, as a run's data order is seeded. */
static void shuffled(int64_t *order, int64_t n)
{
    tkd_rng g;
    tkd_rng_seed(&g, 42);
    for (int64_t i = 0; i < n; i++)
        order[i] = i;
    tkd_rng_shuffle_i64(&g, order, (size_t)n);
}

/* One row: the stream over order with max_open shards open; *ms per batch, *nb batches read. */
static tkd_status run(const args *a, const int64_t *order, int64_t n, int max_open, double *ms, int *nb)
{
    tkd_cache_reader_opts o = {max_open, 0, NULL};
    tkd_cache_reader *r = NULL;
    TKD_TRY(tkd_cache_reader_open(&r, a->cache, &o));
    tkd_cache_stream_opts so = {a->seqs, a->k, 0, 3};
    tkd_cache_stream *s = NULL;
    tkd_status st = tkd_cache_stream_open(&s, r, order, n, &so);
    const tkd_cache_batch *b = NULL;
    double t0 = now_s();
    *nb = 0;
    while (st == TKD_OK && *nb < a->batches && (st = tkd_cache_stream_next(s, &b)) == TKD_OK && b)
        ++*nb;
    *ms = (now_s() - t0) * 1e3 / (*nb ? *nb : 1);
    tkd_cache_stream_close(s);
    tkd_cache_reader_close(r);
    return st;
}

int main(int argc, char **argv)
{
    args a;
    if (parse(argc, argv, &a)) {
        fprintf(stderr, "usage: cache_read_bench --cache DIR [--seqs 16] [--batches 256] [--limit 0] "
                        "[--max-open 8,0] [--k 0]\n");
        return 2;
    }
    tkd_cache_reader *r = NULL;
    if (tkd_cache_reader_open(&r, a.cache, NULL) != TKD_OK)
        return fprintf(stderr, "cache_read_bench: %s\n", tkd_error_msg()), 1;
    const tkd_cache_manifest *m = tkd_cache_reader_manifest(r);
    int64_t n = tkd_cache_reader_num_seq(r), T = m->id.seq_len, shards = m->num_shards;
    tkd_cache_reader_close(r);
    if (a.limit > 0 && a.limit < n)
        n = a.limit;
    int64_t *order = malloc(sizeof *order * (size_t)n);
    if (!order)
        return fprintf(stderr, "cache_read_bench: out of memory\n"), 1;
    shuffled(order, n);
    printf("cache_read_bench: %s, %lld sequences of %lld positions in %lld shards, shuffled; batches of %d\n\n",
           a.cache, (long long)n, (long long)T, (long long)shards, a.seqs);
    printf("| shards open | batches | ms/batch | tok/s |\n|---|---:|---:|---:|\n");
    for (int i = 0; i < a.n_open; i++) {
        double ms = 0;
        int nb = 0;
        if (run(&a, order, n, a.open[i], &ms, &nb) != TKD_OK) {
            fprintf(stderr, "cache_read_bench: %s\n", tkd_error_msg());
            free(order);
            return 1;
        }
        char what[32];
        snprintf(what, sizeof what, a.open[i] ? "%d" : "all (default)", a.open[i]);
        printf("| %s | %d | %.2f | %.0f |\n", what, nb, ms, (double)a.seqs * (double)T * 1e3 / ms);
    }
    free(order);
    return 0;
}
