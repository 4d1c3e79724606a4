/* topk_bench.c — the speed of tkd_topk_cuda (and the tail draws that read the same chunk) against
 * the bandwidth floor (a program, not a test; built only with the CUDA backend).
 *
 * For each vocabulary size and each kind of logits (bench/topk_bench_cuda.h: peaked fp32, the same
 * rounded to bf16, the same floored), one chunk of --rows rows is filled on the device, then --reps
 * rounds each time, with a cudaEvent pair around each launch, in turn: a device-to-device copy of
 * the chunk's bytes (it reads and writes them: 2·C·V·4 bytes), tkd_topk_cuda (k = --k), and
 * tkd_tail_sample_cuda (S = --tail draws, skipped when 0). Printed: medians in ms; the top-k's read
 * rate C·V·4 / t (pass 1 reads the chunk once on the common path); the copy's rate 2·C·V·4 / t; the
 * top-k's time over the copy's (0.5 = one read at copy speed); how many rows took each selection
 * path (kernels/cuda/topk_cuda_internal.h); the tail draws' time and its ratio to the copy.
 *
 *   topk_bench [--rows 4096] [--vocabs 151936,128256] [--k 100] [--tail 80] [--reps 7]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "bench/topk_bench_cuda.h"
#include "kernels/cuda/tail_sample_cuda.h"
#include "kernels/cuda/topk_cuda.h"
#include "kernels/cuda/topk_cuda_internal.h"

#define MAX_VOCABS 8
#define MAX_REPS 101

static const char *const kFillNames[TKD_TOPK_BENCH_FILLS] = {"peaked", "bf16", "floor"};

typedef struct opts {
    int64_t rows;
    int64_t vocabs[MAX_VOCABS];
    int nv, k, tail, reps;
} opts;

static void die(const char *what, const char *msg)
{
    fprintf(stderr, "topk_bench: %s: %s\n", what, msg);
    exit(1);
}

#define CUDA(expr) do { cudaError_t e_ = (expr); if (e_ != cudaSuccess) die(#expr, cudaGetErrorString(e_)); } while (0)
#define TKD(expr) do { if ((expr) != TKD_OK) die(#expr, tkd_error_msg()); } while (0)

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return t[n / 2];
}

/* The device buffers of one vocabulary size. */
typedef struct bufs {
    float *x, *copy, *val, *lse;
    uint32_t *idx, *draws;
    int64_t *seq;
    int32_t *pos;
} bufs;

/* Milliseconds between two events recorded around what ran between them. */
static double elapsed(cudaEvent_t a, cudaEvent_t b)
{
    float ms = 0.0f;
    CUDA(cudaEventSynchronize(b));
    CUDA(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

static void run_fill(const opts *o, int64_t V, tkd_topk_bench_fill f, tkd_topk_cuda_ws *ws, bufs *b)
{
    const int64_t C = o->rows;
    const size_t bytes = (size_t)(C * V) * sizeof(float);
    double t_copy[MAX_REPS], t_topk[MAX_REPS], t_tail[MAX_REPS];
    unsigned long long paths[TKD_TOPK_CUDA_PATHS];
    cudaEvent_t e0, e1;
    CUDA(cudaEventCreate(&e0));
    CUDA(cudaEventCreate(&e1));
    TKD(tkd_topk_bench_fill_logits(b->x, C, V, f, 1000 + (uint64_t)f));
    TKD(tkd_topk_cuda(ws, b->x, C, V, o->k, 1.0f, b->idx, b->val, b->lse, NULL)); /* warm-up */
    TKD(tkd_topk_cuda_sync(ws, NULL));
    TKD(tkd_topk_cuda_paths(ws, NULL, paths)); /* rows per path of one launch */
    for (int r = 0; r < o->reps; r++) {
        CUDA(cudaEventRecord(e0, 0));
        CUDA(cudaMemcpyAsync(b->copy, b->x, bytes, cudaMemcpyDeviceToDevice, 0));
        CUDA(cudaEventRecord(e1, 0));
        t_copy[r] = elapsed(e0, e1);
        CUDA(cudaEventRecord(e0, 0));
        TKD(tkd_topk_cuda(ws, b->x, C, V, o->k, 1.0f, b->idx, b->val, b->lse, NULL));
        CUDA(cudaEventRecord(e1, 0));
        t_topk[r] = elapsed(e0, e1);
        t_tail[r] = 0.0;
        if (o->tail > 0) {
            CUDA(cudaEventRecord(e0, 0));
            TKD(tkd_tail_sample_cuda(ws, b->x, C, V, b->idx, o->k, 1.0f, o->tail, 7, b->seq, b->pos,
                                     b->draws, NULL));
            CUDA(cudaEventRecord(e1, 0));
            t_tail[r] = elapsed(e0, e1);
        }
        TKD(tkd_topk_cuda_sync(ws, NULL));
    }
    unsigned long long more[TKD_TOPK_CUDA_PATHS];
    TKD(tkd_topk_cuda_paths(ws, NULL, more)); /* zeroes the counters for the next fill */
    const double mc = median(t_copy, o->reps), mt = median(t_topk, o->reps);
    const double ml = median(t_tail, o->reps);
    printf("%7lld %-7s %9.3f %8.0f %9.3f %8.0f %7.2f %7llu %7llu %7llu", (long long)V, kFillNames[f],
           mt, bytes / mt * 1e-6, mc, 2.0 * bytes / mc * 1e-6, mt / mc, paths[0], paths[1], paths[2]);
    if (o->tail > 0)
        printf(" %9.3f %7.2f", ml, ml / mc);
    printf("\n");
    CUDA(cudaEventDestroy(e0));
    CUDA(cudaEventDestroy(e1));
}

static void run_vocab(const opts *o, int64_t V, tkd_topk_cuda_ws *ws)
{
    const int64_t C = o->rows;
    const size_t bytes = (size_t)(C * V) * sizeof(float);
    bufs b;
    CUDA(cudaMalloc((void **)&b.x, bytes));
    CUDA(cudaMalloc((void **)&b.copy, bytes));
    CUDA(cudaMalloc((void **)&b.val, (size_t)(C * o->k) * 4));
    CUDA(cudaMalloc((void **)&b.idx, (size_t)(C * o->k) * 4));
    CUDA(cudaMalloc((void **)&b.lse, (size_t)C * 4));
    CUDA(cudaMalloc((void **)&b.draws, (size_t)(C * (o->tail > 0 ? o->tail : 1)) * 4));
    CUDA(cudaMalloc((void **)&b.seq, (size_t)C * 8));
    CUDA(cudaMalloc((void **)&b.pos, (size_t)C * 4));
    CUDA(cudaMemset(b.seq, 0, (size_t)C * 8));
    CUDA(cudaMemset(b.pos, 0, (size_t)C * 4));
    for (int f = 0; f < TKD_TOPK_BENCH_FILLS; f++)
        run_fill(o, V, (tkd_topk_bench_fill)f, ws, &b);
    cudaFree(b.x), cudaFree(b.copy), cudaFree(b.val), cudaFree(b.idx), cudaFree(b.lse);
    cudaFree(b.draws), cudaFree(b.seq), cudaFree(b.pos);
}

static int parse_vocabs(const char *s, opts *o)
{
    o->nv = 0;
    while (*s && o->nv < MAX_VOCABS) {
        char *end;
        const long long v = strtoll(s, &end, 10);
        if (end == s || v <= 0)
            return -1;
        o->vocabs[o->nv++] = v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            return -1;
    }
    return o->nv > 0 ? 0 : -1;
}

int main(int argc, char **argv)
{
    opts o = {.rows = 4096, .vocabs = {151936, 128256}, .nv = 2, .k = 100, .tail = 80, .reps = 7};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--rows") == 0 && i + 1 < argc) {
            o.rows = atoll(argv[++i]);
        } else if (strcmp(argv[i], "--vocabs") == 0 && i + 1 < argc) {
            if (parse_vocabs(argv[++i], &o) != 0)
                die("--vocabs wants V[,V...]", argv[i]);
        } else if (strcmp(argv[i], "--k") == 0 && i + 1 < argc) {
            o.k = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--tail") == 0 && i + 1 < argc) {
            o.tail = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            o.reps = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: topk_bench [--rows 4096] [--vocabs 151936,128256] [--k 100] "
                            "[--tail 80] [--reps 7]\n");
            return 2;
        }
    }
    if (o.rows <= 0 || o.reps < 1 || o.reps > MAX_REPS)
        die("options", "--rows must be > 0 and --reps in 1..101");
    struct cudaDeviceProp prop;
    CUDA(cudaGetDeviceProperties(&prop, 0));
    printf("topk_bench: %s, %lld rows, k %d, tail draws %d, median of %d reps\n", prop.name,
           (long long)o.rows, o.k, o.tail, o.reps);
    printf("%7s %-7s %9s %8s %9s %8s %7s %7s %7s %7s", "V", "fill", "topk_ms", "rd_GB/s", "copy_ms",
           "cp_GB/s", "t/copy", "path0", "path1", "path2");
    if (o.tail > 0)
        printf(" %9s %7s", "tail_ms", "t/copy");
    printf("\n");
    tkd_topk_cuda_ws *ws = NULL;
    TKD(tkd_topk_cuda_ws_create(&ws));
    for (int i = 0; i < o.nv; i++)
        run_vocab(&o, o.vocabs[i], ws);
    tkd_topk_cuda_ws_free(ws);
    return 0;
}

#else
int main(void)
{
    fprintf(stderr, "topk_bench: built without the CUDA backend\n");
    return 1;
}
#endif
