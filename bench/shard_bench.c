/* shard_bench.c — how fast the shard writer turns cache rows into a published shard (a program,
 * not a test).
 *
 * Writes --batches batches of --seqs sequences × --seq-len positions of synthetic top-k rows through
 * the API teacher-dump uses (tkd_shard_writer_open / _append / _finish) into --out, for each zstd
 * level of --levels, once through the reference path (H5Dwrite: HDF5 filters every chunk on the
 * calling thread) and once per --threads count through the default path (the writer filters whole
 * chunks on that many threads and hands them to H5Dwrite_chunk), and prints one row per run:
 *   append s   time inside tkd_shard_writer_append (convert, filter, write: the steady state);
 *   finish s   tkd_shard_writer_finish (close, fsync, sha256 of the file, rename);
 *   sha256 s   tkd_sha256_file_hex of the published file again (page cache warm), to show its share;
 *   raw MB/s   raw row bytes (positions × (4 + 2)·k + 4, the rows teacher-dump hands over) per second
 *              of append, and per second of append + finish;
 *   pos/s      positions per second of append + finish;
 *   ratio      raw row bytes / file bytes.
 * --h5dwrite 0 skips the reference rows (e.g. to profile the parallel path alone with perf).
 * Each row is the fastest of --reps runs (append + finish), the least disturbed on a shared machine.
 * finish s − sha256 s is about what closing, fsync and the rename cost.
 * Rows look like a real teacher's: per position k distinct ids drawn log-uniformly over the vocabulary
 * (frequent tokens low, as in BPE vocabularies), logits falling from a N(15, 3) top by exponential
 * gaps (about 8 nats over 100 columns), LSE a little above the top, Zipf-like tokens. Two batches are
 * generated before timing and written alternately.
 *
 *   shard_bench [--batches 64] [--seqs 16] [--seq-len 2048] [--k 100] [--vocab 151936]
 *               [--levels 1,3] [--threads 1,2,4,8] [--reps 1] [--h5dwrite 1] [--out DIR]
 * --threads defaults to 1, 2, 4, ... up to the CPUs this process may use; "auto" in the table
 * marks the count a writer picks by itself (cache.writer_threads: 0).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/fileio.h"
#include "common/rng.h"
#include "common/sha256.h"
#include "common/status.h"
#include "formats/cache_shard.h"

#define NGEN 2 /* distinct batches generated before timing */

typedef struct bench_args {
    int batches, seqs, seq_len, k;
    int64_t vocab;
    int levels[8], nlevels;
    int threads[16], nthreads;
    int reps, h5dwrite;
    const char *out;
} bench_args;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* A log-uniform id in [0, vocab): P(id) ~ 1/(id + 1), a Zipf law with exponent 1. */
static uint32_t zipf_id(tkd_rng *r, int64_t vocab)
{
    double x = exp(tkd_rng_double(r) * log((double)vocab + 1.0)) - 1.0;
    return x >= (double)vocab ? (uint32_t)(vocab - 1) : (uint32_t)x;
}

/* One position's row: k distinct ids (stamp[id] == mark means taken) and falling logits. */
static void fill_row(tkd_rng *r, int64_t vocab, int k, uint32_t *stamp, uint32_t mark, uint32_t *idx,
                     float *logits, float *lse)
{
    float v = 15.0f + 3.0f * (float)tkd_rng_normal(r);
    *lse = v + 0.5f + 2.0f * tkd_rng_float(r);
    for (int c = 0; c < k; c++) {
        uint32_t id;
        do
            id = zipf_id(r, vocab);
        while (stamp[id] == mark);
        stamp[id] = mark;
        idx[c] = id;
        logits[c] = v;
        v -= 0.08f * (float)-log(1.0 - tkd_rng_double(r));
    }
}

static void fill_batch(tkd_cache_batch *b, int64_t vocab, uint64_t seed, uint32_t *stamp)
{
    tkd_rng r;
    tkd_rng_seed(&r, seed);
    size_t T = (size_t)b->seq_len, k = (size_t)b->k;
    uint32_t mark = 0;
    for (int64_t s = 0; s < b->capacity; s++) {
        b->seq_index[s] = (int64_t)(seed * 1000003u) + s;
        for (size_t t = 0; t <= T; t++)
            b->tokens[(size_t)s * (T + 1) + t] = (int32_t)zipf_id(&r, vocab);
        for (size_t t = 0; t < T; t++) {
            size_t row = (size_t)s * T + t;
            fill_row(&r, vocab, b->k, stamp, ++mark, b->topk_indices + row * k, b->topk_logits + row * k,
                     b->lse + row);
        }
    }
    b->num_seq = b->capacity;
}

typedef struct run_result {
    double append_s, finish_s, sha_s;
    uint64_t bytes;
} run_result;

static tkd_status run_one(const bench_args *a, const tkd_cache_identity *id, const tkd_shard_writer_opts *o,
                          tkd_cache_batch *gen, run_result *res)
{
    char path[4096];
    TKD_TRY(tkd_path_join(path, sizeof path, a->out, "shard-bench.h5"));
    tkd_shard_writer *w = NULL;
    TKD_TRY(tkd_shard_writer_open(&w, path, id, 0, o));
    double t0 = now_s();
    tkd_status st = TKD_OK;
    for (int i = 0; st == TKD_OK && i < a->batches; i++)
        st = tkd_shard_writer_append(w, &gen[i % NGEN]);
    double t1 = now_s();
    if (st != TKD_OK) {
        tkd_shard_writer_abort(w);
        return st;
    }
    tkd_cache_shard_entry e;
    TKD_TRY(tkd_shard_writer_finish(w, &e));
    double t2 = now_s();
    char hex[TKD_SHA256_HEX_LEN];
    st = tkd_sha256_file_hex(path, hex);
    res->sha_s = now_s() - t2;
    res->append_s = t1 - t0;
    res->finish_s = t2 - t1;
    res->bytes = e.bytes;
    unlink(path);
    return st;
}

/* A comma-separated list of integers in [lo, hi] into out (at most cap). Returns the count, -1 if bad. */
static int parse_list(const char *s, int *out, int cap, int lo, int hi)
{
    int n = 0;
    for (char *end; *s && n < cap; s = *end ? end + 1 : end) {
        long v = strtol(s, &end, 10);
        if (end == s || v < lo || v > hi)
            return -1;
        out[n++] = (int)v;
    }
    return n > 0 ? n : -1;
}

static int parse_args(int argc, char **argv, bench_args *a)
{
    *a = (bench_args){64, 16, 2048, 100, 151936, {1, 3}, 2, {1}, 1, 1, 1, "/tmp"};
    for (int t = 2; t <= omp_get_num_procs() && a->nthreads < 16; t *= 2)
        a->threads[a->nthreads++] = t;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *f = argv[i], *v = argv[i + 1];
        if (!strcmp(f, "--batches")) a->batches = atoi(v);
        else if (!strcmp(f, "--seqs")) a->seqs = atoi(v);
        else if (!strcmp(f, "--seq-len")) a->seq_len = atoi(v);
        else if (!strcmp(f, "--k")) a->k = atoi(v);
        else if (!strcmp(f, "--vocab")) a->vocab = atoll(v);
        else if (!strcmp(f, "--levels")) { if ((a->nlevels = parse_list(v, a->levels, 8, 1, 22)) < 0) return -1; }
        else if (!strcmp(f, "--threads")) { if ((a->nthreads = parse_list(v, a->threads, 16, 1, 256)) < 0) return -1; }
        else if (!strcmp(f, "--reps")) a->reps = atoi(v);
        else if (!strcmp(f, "--h5dwrite")) a->h5dwrite = atoi(v);
        else if (!strcmp(f, "--out")) a->out = v;
        else return -1;
    }
    if (argc % 2 == 0 || a->reps < 1 || a->batches < 1 || a->seqs < 1 || a->seq_len < 1 || a->k < 1 || a->vocab < a->k)
        return -1;
    return 0;
}

static void print_row(const bench_args *a, const char *path, int level, double raw_mb, const run_result *r)
{
    double pos = (double)a->batches * a->seqs * a->seq_len;
    double total = r->append_s + r->finish_s;
    printf("| %-18s | %5d | %8.0f | %8.3f | %8.3f | %8.3f | %8.1f | %8.1f | %9.0f | %5.2f |\n", path, level,
           raw_mb, r->append_s, r->finish_s, r->sha_s, raw_mb / r->append_s, raw_mb / total, pos / total,
           raw_mb * 1e6 / (double)r->bytes);
    fflush(stdout);
}

/* The fastest of a->reps runs. */
static tkd_status run_best(const bench_args *a, const tkd_cache_identity *id, const tkd_shard_writer_opts *o,
                           tkd_cache_batch *gen, run_result *best)
{
    for (int r = 0; r < a->reps; r++) {
        run_result x;
        TKD_TRY(run_one(a, id, o, gen, &x));
        if (r == 0 || x.append_s + x.finish_s < best->append_s + best->finish_s)
            *best = x;
    }
    return TKD_OK;
}

/* The reference path, then each thread count of the parallel one, at one level. */
static tkd_status run_level(const bench_args *a, const tkd_cache_identity *id, int level, double raw_mb,
                            tkd_cache_batch *gen)
{
    tkd_shard_writer_opts o = {.zstd_level = level, .h5dwrite = 1};
    run_result r = {0, 0, 0, 0};
    if (a->h5dwrite) {
        TKD_TRY(run_best(a, id, &o, gen, &r));
        print_row(a, "H5Dwrite", level, raw_mb, &r);
    }
    int autot = tkd_shard_writer_threads(0);
    for (int i = 0; i < a->nthreads; i++) {
        o = (tkd_shard_writer_opts){.zstd_level = level, .threads = a->threads[i]};
        TKD_TRY(run_best(a, id, &o, gen, &r));
        char name[32];
        snprintf(name, sizeof name, "chunks, %d thr%s", a->threads[i], a->threads[i] == autot ? " auto" : "");
        print_row(a, name, level, raw_mb, &r);
    }
    return TKD_OK;
}

int main(int argc, char **argv)
{
    bench_args a;
    if (parse_args(argc, argv, &a)) {
        fprintf(stderr, "usage: shard_bench [--batches N] [--seqs B] [--seq-len T] [--k K] [--vocab V] "
                        "[--levels 1,3] [--threads 1,2,4] [--reps R] [--h5dwrite 0|1] [--out DIR]\n");
        return 2;
    }
    tkd_cache_identity id;
    memset(&id, 0, sizeof id);
    id.vocab_size = a.vocab;
    id.k = a.k;
    id.seq_len = a.seq_len;
    id.temperature = 1.0f;
    id.logits_dtype = TKD_CACHE_DTYPE_HALF;
    memset(id.teacher_sha256, 'a', 64);
    memset(id.dataset_sha256, 'b', 64);
    tkd_cache_batch gen[NGEN];
    memset(gen, 0, sizeof gen);
    uint32_t *stamp = calloc((size_t)a.vocab, sizeof *stamp);
    tkd_status st = stamp ? tkd_mkdir_p(a.out) : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    for (int g = 0; g < NGEN; g++)
        if (st == TKD_OK && (st = tkd_cache_batch_alloc(&gen[g], a.seqs, a.seq_len, a.k, 0)) == TKD_OK)
            fill_batch(&gen[g], a.vocab, 1 + (uint64_t)g, stamp);
    free(stamp);
    double pos = (double)a.batches * a.seqs * a.seq_len;
    double raw_mb = pos * tkd_cache_raw_bytes_per_token(&id) / 1e6;
    printf("shard_bench: %d batches of %d × %d positions, k %d, vocab %lld, half logits, chunk %lld seqs, "
           "%d CPUs, best of %d\n\n", a.batches, a.seqs, a.seq_len, a.k, (long long)a.vocab,
           (long long)tkd_shard_default_chunk_seqs(&id), omp_get_num_procs(), a.reps);
    printf("| path               | level |   raw MB | append s | finish s | sha256 s | raw MB/s | MB/s all |     pos/s | ratio |\n");
    printf("|--------------------|------:|---------:|---------:|---------:|---------:|---------:|---------:|----------:|------:|\n");
    for (int l = 0; st == TKD_OK && l < a.nlevels; l++)
        st = run_level(&a, &id, a.levels[l], raw_mb, gen);
    for (int g = 0; g < NGEN; g++)
        tkd_cache_batch_free(&gen[g]);
    if (st != TKD_OK) {
        fprintf(stderr, "shard_bench: %s\n", tkd_error_msg());
        return 1;
    }
    return 0;
}
