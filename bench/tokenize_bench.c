/* tokenize_bench.c — how fast formats/tokenizer turns text into ids (a program, not a test).
 *
 * For each tokenizer given (default: the fixtures' gpt2 and qwen3, and Llama 3 where
 * fetch_llama3.sh put it), encodes the texts (default: the .txt files of
 * tests/fixtures/tokenizer/text/, 393 KB of English, code, digits, whitespace runs, CJK, emoji,
 * invalid UTF-8 ...) --reps times over and prints one row per thread count:
 *   MB/s        text bytes per second, all threads together;
 *   MB/s/core   the same divided by the thread count;
 *   Mtok/s      ids per second;
 *   cold MB/s   the first pass of one thread over the texts with a new context (empty word cache).
 * Each thread has its own context (as teacher-dump tokenize does); the texts are cut at the first
 * newline after every 16 KB so that the threads share the work evenly. Each row is the fastest of
 * --reps passes over all texts (the least disturbed on a shared machine).
 *
 *   tokenize_bench [--tokenizer PATH]... [--reps 5] [--threads 1,2] [FILE ...]
 * --threads defaults to 1 and the CPUs this process may use.
 */
#include <glob.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/fileio.h"
#include "formats/tokenizer.h"

typedef struct text {
    char *data;
    size_t len;
} text;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void die(const char *what)
{
    fprintf(stderr, "tokenize_bench: %s: %s\n", what, tkd_error_msg());
    exit(1);
}

/* One pass of `threads` threads over all texts; returns seconds, adds the ids made to *ntok. */
static double pass(tkd_tokenizer_ctx **ctx, int threads, const text *t, int nt, size_t *ntok)
{
    size_t total = 0;
    int failed = 0;
    double t0 = now_s();
#pragma omp parallel num_threads(threads) reduction(+ : total, failed)
    {
        tkd_token_ids ids = {0};
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < nt; i++) {
            ids.n = 0;
            failed += tkd_tokenizer_encode(ctx[omp_get_thread_num()], t[i].data, t[i].len, &ids) != TKD_OK;
            total += ids.n;
        }
        tkd_token_ids_free(&ids);
    }
    double s = now_s() - t0;
    if (failed)
        die("encode");
    *ntok = total;
    return s;
}

static void bench_one(const char *path, const text *t, int nt, size_t bytes, const int *threads, int nthreads,
                      int reps)
{
    tkd_tokenizer *tok = NULL;
    if (tkd_tokenizer_load(path, &tok) != TKD_OK)
        die(path);
    int maxt = 1;
    for (int i = 0; i < nthreads; i++)
        maxt = threads[i] > maxt ? threads[i] : maxt;
    tkd_tokenizer_ctx **ctx = calloc((size_t)maxt, sizeof *ctx);
    for (int i = 0; i < maxt; i++)
        if (tkd_tokenizer_ctx_create(tok, &ctx[i]) != TKD_OK)
            die("context");
    size_t ntok = 0;
    double cold = pass(ctx, 1, t, nt, &ntok);
    printf("%s: %zu ids, %.3f ids/byte, cold %.1f MB/s\n", path, ntok, (double)ntok / (double)bytes,
           (double)bytes / cold / 1e6);
    printf("  threads      MB/s  MB/s/core    Mtok/s\n");
    for (int i = 0; i < nthreads; i++) {
        double best = 1e30;
        for (int r = 0; r < reps; r++) {
            double s = pass(ctx, threads[i], t, nt, &ntok);
            best = s < best ? s : best;
        }
        double mbs = (double)bytes / best / 1e6;
        printf("  %7d %9.2f %10.2f %9.3f\n", threads[i], mbs, mbs / threads[i], (double)ntok / best / 1e6);
    }
    for (int i = 0; i < maxt; i++)
        tkd_tokenizer_ctx_free(ctx[i]);
    free(ctx);
    tkd_tokenizer_free(tok);
}

static int parse_threads(const char *s, int *out, int cap)
{
    int n = 0;
    for (char *end; *s && n < cap; s = *end ? end + 1 : end)
        out[n++] = (int)strtol(s, &end, 10);
    return n;
}

/* Cuts t at the first newline after every 16 KB into out (pointers into t); returns the count. */
static int cut(text t, text *out)
{
    int n = 0;
    for (size_t at = 0; at < t.len;) {
        size_t end = at + 16384 < t.len ? at + 16384 : t.len;
        while (end < t.len && t.data[end - 1] != '\n')
            end++;
        if (out)
            out[n] = (text){t.data + at, end - at};
        n++;
        at = end;
    }
    return n;
}

static int load_texts(char **files, int nfiles, text **out, size_t *bytes)
{
    glob_t g = {0};
    if (nfiles == 0) {
        glob(TKD_BENCH_SOURCE_DIR "/tests/fixtures/tokenizer/text/*.txt", 0, NULL, &g);
        files = g.gl_pathv, nfiles = (int)g.gl_pathc;
    }
    *out = calloc((size_t)nfiles + 1, sizeof **out);
    *bytes = 0;
    for (int i = 0; i < nfiles; i++) {
        void *d;
        if (tkd_read_file(files[i], &d, &(*out)[i].len) != TKD_OK)
            die(files[i]);
        (*out)[i].data = d;
        *bytes += (*out)[i].len;
    }
    globfree(&g);
    return nfiles;
}

static int cut_all(const text *t, int nt, text **pieces)
{
    int n = 0;
    for (int i = 0; i < nt; i++)
        n += cut(t[i], NULL);
    *pieces = calloc((size_t)n + 1, sizeof **pieces);
    for (int i = 0, k = 0; i < nt; i++)
        k += cut(t[i], *pieces + k);
    return n;
}

int main(int argc, char **argv)
{
    const char *toks[8];
    int ntoks = 0, reps = 5, threads[16] = {1, omp_get_max_threads()}, nthreads = omp_get_max_threads() > 1 ? 2 : 1;
    char **files = calloc((size_t)argc, sizeof *files);
    int nfiles = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tokenizer") == 0 && i + 1 < argc && ntoks < 8)
            toks[ntoks++] = argv[++i];
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            nthreads = parse_threads(argv[++i], threads, 16);
        else
            files[nfiles++] = argv[i];
    }
    if (ntoks == 0) {
        toks[ntoks++] = TKD_BENCH_SOURCE_DIR "/tests/fixtures/tokenizer/gpt2";
        toks[ntoks++] = TKD_BENCH_BINARY_DIR "/fixtures/tokenizer/qwen3";
        if (tkd_file_exists(TKD_BENCH_BINARY_DIR "/fixtures/llama3/tokenizer.json"))
            toks[ntoks++] = TKD_BENCH_BINARY_DIR "/fixtures/llama3";
    }
    text *t;
    size_t bytes;
    int nt = load_texts(files, nfiles, &t, &bytes);
    text *pieces;
    int np = cut_all(t, nt, &pieces);
    printf("tokenize_bench: %d texts (%d pieces), %zu bytes, %d reps\n", nt, np, bytes, reps);
    for (int i = 0; i < ntoks; i++)
        bench_one(toks[i], pieces, np, bytes, threads, nthreads, reps);
    free(pieces);
    for (int i = 0; i < nt; i++)
        free(t[i].data);
    free(t);
    free(files);
    return 0;
}
