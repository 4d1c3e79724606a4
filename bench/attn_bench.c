/* attn_bench.c — the speed of tkd_cuda_attn_fwd and tkd_cuda_attn_bwd, the causal GQA attention
 * forward and backward, next to cuDNN's fused attention forward through tkd_cudnn_attn_fwd (a
 * program, not a test; built only with the CUDA backend).
 *
 * For each shape (bf16 q, k, v, dy uniform in [-1, 1)): the median of --reps timed calls (cudaEvent
 * pairs around each call, after 2 untimed ones). Two tables:
 *  - forward: ours, then cuDNN's, each with and without the lse output; cuDNN's first call per
 *    shape also builds its plan (that wall time is the "plan ms" column, with lse, then without),
 *    and the last column is the largest |difference| between the two's y and lse over the whole
 *    output, a sanity check (tests/test_gpu_attn.c holds the tolerances). A shape cuDNN
 *    refuses shows "refused" and its message goes to stderr.
 *  - backward (ours; all three gradients from our forward's y and lse), next to our forward with
 *    lse, and the two summed (one training step's attention); cuDNN's backward under its default
 *    workspace budget (the calls it makes and cuDNN's workspace per call), and in one call over
 *    the whole shape (its workspace and time; the same time when the budget already makes one);
 *    cuDNN's non-deterministic backward (tkd_cudnn_attn_set_bwd_nondet: fp32 dQ accumulation), "-"
 *    where cuDNN offers none, and whether the engine it took is noted non-deterministic: the
 *    difference to the deterministic column is what determinism costs; our Hopper wgmma backward
 *    (tkd_cuda_attn_bwd_sm90, "-" where the device is not compute capability 9.0 or dh is not 64
 *    or 128), its forward+backward with cuDNN's forward (what training would run), and the
 *    relative L2 difference of its dq, dk, dv from our flash backward's on the same inputs (a
 *    sanity check: bf16 roundings put it near 1e-3–1e-2; garbage is ~1;
 *    tests/test_gpu_attn_cudnn_bwd.c holds the tolerances). Its bounded pipeline waits are checked
 *    after each shape (the run stops on a timeout).
 * FLOPs, causal: forward 4·B·H·T²·dh/2 (its two matrix products over the causal half); backward
 * 2.5 × that (the usual convention, as FlashAttention's benchmarks count it: five products, not the
 * seven our deterministic backward does); fwd+bwd 3.5 × that over the sum of the two times.
 * Shapes: Llama 3 8B (H 32, Hkv 8, dh 128) and Qwen2 0.5B (H 14, Hkv 2, dh 64) at T = 8192 and
 * 32768 (the teachers), Llama 3.2 1B (32/8/64, T 8192), the ~3B student (24/8/128, T 8192) and
 * Qwen2.5 0.5B (B 4, T 4096, 14/2/64) (issue 11's students), or those given with --shapes.
 *
 * With --docs L,...: a third table, packed documents (bench_docs).
 *
 *   attn_bench [--reps 10] [--shapes BxTxHxHkvxDH,...] [--docs L,...]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/half.h"
#include "common/status.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/attn/attn_bwd_simple_cuda.h"
#include "kernels/attn/attn_bwd_sm90.h"
#include "kernels/attn/attn_cuda.h"
#include "kernels/attn/attn_cudnn.h"

typedef struct shape { int b, t, h, hkv, dh; const char *name; } shape;

static void die(const char *what, const char *msg)
{
    fprintf(stderr, "attn_bench: %s: %s\n", what, msg);
    exit(1);
}

#define CUDA(expr) do { cudaError_t e_ = (expr); if (e_ != cudaSuccess) die(#expr, cudaGetErrorString(e_)); } while (0)

/* n bf16 values uniform in [-1, 1) into device memory at d. */
static void fill_dev(uint16_t *d, size_t n, uint64_t seed)
{
    uint16_t *h = malloc(n * 2);
    if (!h)
        die("malloc", "out of host memory");
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        float f = (float)((s >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
        uint32_t u;
        memcpy(&u, &f, 4);
        h[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    CUDA(cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice));
    free(h);
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static double wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* The device buffers of one shape. */
typedef struct bufs {
    uint16_t *q, *k, *v, *y, *dy, *dq, *dk, *dv; /* q, y, dy, dq (B·T, H·dh); the rest (B·T, Hkv·dh) */
    float *lse;                                  /* (B, H, T) */
    tkd_cuda_attn_bwd_ws *ws;
    int32_t *doc;                                /* (B·T) packed documents' starts (--docs), else NULL */
    float *delta;                                /* (B, H, T) the masked backward's scratch (--docs) */
} bufs;

/* The head sizes tkd_cuda_attn_bwd_masked takes (the backend's flash_takes): elsewhere the masked
 * backward the backend runs is tkd_cuda_attn_bwd_simple_masked. */
static int flash_takes(int dh) { return dh == 48 || dh == 64 || dh == 80 || dh == 96 || dh == 128; }

/* What one timed call does. */
typedef enum what { FWD_LSE, FWD_NO_LSE, BWD, BWD_CUDNN, BWD_CUDNN_ONE, BWD_WGMMA, FWD_DOCS, BWD_DOCS } what;

/* One call: the forward (ours when cudnn is NULL, else cuDNN's) with or without lse, our backward
 * (cudnn ignored) or cuDNN's (it overwrites dq, dk, dv) from the y and lse in b. */
static tkd_status call(tkd_cudnn_attn *cudnn, const shape *s, bufs *b, what w)
{
    if (w == BWD_WGMMA)
        return tkd_cuda_attn_bwd_sm90(b->dy, b->q, b->k, b->v, b->y, b->lse, s->b, s->t, s->h, s->hkv, s->dh,
                                      b->dq, b->dk, b->dv, b->ws, NULL);
    if (w == BWD_CUDNN || w == BWD_CUDNN_ONE) { /* ONE: no workspace budget, one call over the shape */
        tkd_cudnn_attn_set_bwd_budget(cudnn, w == BWD_CUDNN_ONE ? 0 : TKD_CUDNN_ATTN_BWD_BUDGET);
        return tkd_cudnn_attn_bwd(cudnn, b->dy, b->q, b->k, b->v, b->y, b->lse, s->b, s->t, s->h, s->hkv, s->dh,
                                  b->dq, b->dk, b->dv, NULL);
    }
    if (w == BWD)
        return tkd_cuda_attn_bwd(b->dy, b->q, b->k, b->v, b->y, b->lse, s->b, s->t, s->h, s->hkv, s->dh,
                                 b->dq, b->dk, b->dv, b->ws, NULL);
    if (w == BWD_DOCS) { /* the masked backwards add into dq, dk, dv: as the backend, zero them first */
        const tkd_attn_mask m = {0, NULL, b->doc};
        size_t nq = (size_t)s->b * s->t * s->h * s->dh * 2, nkv = (size_t)s->b * s->t * s->hkv * s->dh * 2;
        CUDA(cudaMemsetAsync(b->dq, 0, nq, 0));
        CUDA(cudaMemsetAsync(b->dk, 0, nkv, 0));
        CUDA(cudaMemsetAsync(b->dv, 0, nkv, 0));
        if (flash_takes(s->dh))
            return tkd_cuda_attn_bwd_masked(b->dy, b->q, b->k, b->v, b->y, b->lse, s->b, s->t, s->h, s->hkv, s->dh,
                                            &m, b->dq, b->dk, b->dv, b->ws, NULL);
        return tkd_cuda_attn_bwd_simple_masked(b->dy, b->q, b->k, b->v, b->y, b->lse, s->b, s->t, s->h, s->hkv,
                                               s->dh, &m, b->dq, b->dk, b->dv, b->delta, NULL);
    }
    if (w == FWD_DOCS) {
        const tkd_attn_mask m = {0, NULL, b->doc};
        return tkd_cuda_attn_fwd_masked(b->q, b->k, b->v, s->b, s->t, s->h, s->hkv, s->dh, &m, b->y, b->lse, NULL);
    }
    float *lse = w == FWD_LSE ? b->lse : NULL;
    if (!cudnn)
        return tkd_cuda_attn_fwd(b->q, b->k, b->v, s->b, s->t, s->h, s->hkv, s->dh, b->y, lse, NULL);
    return tkd_cudnn_attn_fwd(cudnn, b->q, b->k, b->v, s->b, s->t, s->h, s->hkv, s->dh, b->y, lse, NULL);
}

static const char *call_name(const tkd_cudnn_attn *cudnn, const shape *s, what w)
{
    return w == BWD_WGMMA ? "tkd_cuda_attn_bwd_sm90"
           : w == BWD_CUDNN || w == BWD_CUDNN_ONE ? "tkd_cudnn_attn_bwd"
           : w == BWD     ? "tkd_cuda_attn_bwd"
           : w == FWD_DOCS ? "tkd_cuda_attn_fwd_masked (documents)"
           : w == BWD_DOCS ? (flash_takes(s->dh) ? "tkd_cuda_attn_bwd_masked (documents)"
                                                  : "tkd_cuda_attn_bwd_simple_masked (documents)")
           : cudnn        ? "tkd_cudnn_attn_fwd"
                          : "tkd_cuda_attn_fwd";
}

/* Median milliseconds of reps calls, or -1 when cuDNN refuses the shape (message on stderr).
 * *first_ms: wall time of the first (untimed) call, through its completion. */
static double time_call(tkd_cudnn_attn *cudnn, const shape *s, bufs *b, what w, int reps, double *first_ms)
{
    cudaEvent_t e0, e1;
    float *ms = malloc(sizeof(float) * (size_t)reps);
    if (!ms)
        die("malloc", "out of host memory");
    CUDA(cudaDeviceSynchronize());
    const double t0 = wall_ms();
    tkd_status st = call(cudnn, s, b, w);
    CUDA(cudaDeviceSynchronize());
    *first_ms = wall_ms() - t0;
    if (st == TKD_ERR_UNSUPPORTED && (cudnn || w == BWD_WGMMA) && w != BWD) {
        fprintf(stderr, "attn_bench: %dx%dx%dx%dx%d %s: %s\n", s->b, s->t, s->h, s->hkv, s->dh,
                w == FWD_LSE ? "with lse" : w == FWD_NO_LSE ? "without lse" : "backward", tkd_error_msg());
        free(ms);
        return -1.0;
    }
    if (st != TKD_OK)
        die(call_name(cudnn, s, w), tkd_error_msg());
    CUDA(cudaEventCreate(&e0));
    CUDA(cudaEventCreate(&e1));
    for (int i = -1; i < reps; i++) {
        CUDA(cudaEventRecord(e0, 0));
        if ((st = call(cudnn, s, b, w)) != TKD_OK)
            die(call_name(cudnn, s, w), tkd_error_msg());
        CUDA(cudaEventRecord(e1, 0));
        CUDA(cudaEventSynchronize(e1));
        if (i >= 0)
            CUDA(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    qsort(ms, (size_t)reps, sizeof(float), cmp_float);
    double med = ms[reps / 2];
    CUDA(cudaEventDestroy(e0));
    CUDA(cudaEventDestroy(e1));
    free(ms);
    return med;
}

/* max |y_ours − y_cudnn| and max |lse_ours − lse_cudnn| over the whole output (a sanity check
 * next to the timings: the test holds the tolerances). Leaves cuDNN's y and lse in b. */
static void compare(tkd_cudnn_attn *cudnn, const shape *s, bufs *b, double *dy, double *dl)
{
    size_t nq = (size_t)s->b * s->t * s->h * s->dh, nl = (size_t)s->b * s->h * s->t;
    uint16_t *y0 = malloc(nq * 2), *y1 = malloc(nq * 2);
    float *l0 = malloc(nl * 4), *l1 = malloc(nl * 4);
    if (!y0 || !y1 || !l0 || !l1)
        die("malloc", "out of host memory");
    if (call(NULL, s, b, FWD_LSE) != TKD_OK)
        die("tkd_cuda_attn_fwd", tkd_error_msg());
    CUDA(cudaMemcpy(y0, b->y, nq * 2, cudaMemcpyDeviceToHost));
    CUDA(cudaMemcpy(l0, b->lse, nl * 4, cudaMemcpyDeviceToHost));
    if (call(cudnn, s, b, FWD_LSE) != TKD_OK)
        die("tkd_cudnn_attn_fwd", tkd_error_msg());
    CUDA(cudaMemcpy(y1, b->y, nq * 2, cudaMemcpyDeviceToHost));
    CUDA(cudaMemcpy(l1, b->lse, nl * 4, cudaMemcpyDeviceToHost));
    *dy = *dl = 0.0;
    for (size_t i = 0; i < nq; i++) {
        double d = fabs((double)tkd_bf16_to_f32(y0[i]) - tkd_bf16_to_f32(y1[i]));
        *dy = d > *dy || d != d ? d : *dy;
    }
    for (size_t i = 0; i < nl; i++) {
        double d = fabs((double)l0[i] - l1[i]);
        *dl = d > *dl || d != d ? d : *dl;
    }
    free(y0), free(y1), free(l0), free(l1);
}

/* Our flash backward once on zeroed gradients, then the wgmma backward once: the relative L2
 * difference ‖wgmma − ours‖ / ‖ours‖ over dq, dk and dv together; dies when a wgmma pipeline wait
 * timed out. */
static double wgmma_vs_ours(const shape *s, bufs *b)
{
    size_t n[3] = {(size_t)s->b * s->t * s->h * s->dh, (size_t)s->b * s->t * s->hkv * s->dh, 0};
    n[2] = n[1];
    uint16_t *g[3] = {b->dq, b->dk, b->dv}, *h[3][2];
    for (int x = 0; x < 3; x++)
        CUDA(cudaMemset(g[x], 0, n[x] * 2));
    for (int run = 0; run < 2; run++) {
        tkd_status st = call(NULL, s, b, run ? BWD_WGMMA : BWD);
        if (st == TKD_OK && run)
            st = tkd_cuda_attn_bwd_sm90_check(b->ws);
        if (st != TKD_OK)
            die(call_name(NULL, s, run ? BWD_WGMMA : BWD), tkd_error_msg());
        for (int x = 0; x < 3; x++) {
            if (!(h[x][run] = malloc(n[x] * 2)))
                die("malloc", "out of host memory");
            CUDA(cudaMemcpy(h[x][run], g[x], n[x] * 2, cudaMemcpyDeviceToHost));
        }
    }
    double d2 = 0, r2 = 0;
    for (int x = 0; x < 3; x++) {
        for (size_t i = 0; i < n[x]; i++) {
            const double o = tkd_bf16_to_f32(h[x][0][i]), w = tkd_bf16_to_f32(h[x][1][i]);
            d2 += (w - o) * (w - o), r2 += o * o;
        }
        free(h[x][0]), free(h[x][1]);
    }
    return r2 > 0 ? sqrt(d2 / r2) : sqrt(d2);
}


/* "| ms | TFLOP/s " cells of one timing, or "refused" ones. */
static void print_cells(double ms, double flop)
{
    if (ms < 0)
        printf("| %9s | %7s ", "refused", "-");
    else
        printf("| %9.3f | %7.1f ", ms, flop / ms * 1e-9);
}

static void print_shape(const shape *s)
{
    printf("| %-12s | %d | %6d | %3d | %3d | %3d ", s->name, s->b, s->t, s->h, s->hkv, s->dh);
}

static void bufs_alloc(bufs *b, const shape *s)
{
    size_t nq = (size_t)s->b * s->t * s->h * s->dh, nkv = (size_t)s->b * s->t * s->hkv * s->dh;
    CUDA(cudaMalloc((void **)&b->q, nq * 2));
    CUDA(cudaMalloc((void **)&b->k, nkv * 2));
    CUDA(cudaMalloc((void **)&b->v, nkv * 2));
    CUDA(cudaMalloc((void **)&b->y, nq * 2));
    CUDA(cudaMalloc((void **)&b->dy, nq * 2));
    CUDA(cudaMalloc((void **)&b->dq, nq * 2));
    CUDA(cudaMalloc((void **)&b->dk, nkv * 2));
    CUDA(cudaMalloc((void **)&b->dv, nkv * 2));
    CUDA(cudaMalloc((void **)&b->lse, sizeof(float) * (size_t)s->b * s->h * s->t));
    b->doc = NULL;
    b->delta = NULL;
    if (tkd_cuda_attn_bwd_ws_create(&b->ws, s->b, s->t, s->h, s->dh) != TKD_OK)
        die("tkd_cuda_attn_bwd_ws_create", tkd_error_msg());
    fill_dev(b->q, nq, 1), fill_dev(b->k, nkv, 2), fill_dev(b->v, nkv, 3), fill_dev(b->dy, nq, 4);
    CUDA(cudaMemset(b->dq, 0, nq * 2));
    CUDA(cudaMemset(b->dk, 0, nkv * 2));
    CUDA(cudaMemset(b->dv, 0, nkv * 2));
}

static void bufs_free(bufs *b)
{
    tkd_cuda_attn_bwd_ws_free(b->ws);
    uint16_t *p16[] = {b->q, b->k, b->v, b->y, b->dy, b->dq, b->dk, b->dv};
    for (size_t i = 0; i < sizeof p16 / sizeof p16[0]; i++)
        CUDA(cudaFree(p16[i]));
    CUDA(cudaFree(b->lse));
}

/* The backward table's timings of one shape: ms_fwd ours [0] and cuDNN's [1] (with lse), ms_bwd
 * ours [0], cuDNN's under the default workspace budget [1], in one call [2] and non-deterministic
 * [3] (-1: refused or no cuDNN), our Hopper wgmma backward's [4] (-1: refused or not sm_90) and
 * its relative difference from ours [5] (-1: not run); how cuDNN's runs under the budget,
 * deterministic and not. */
typedef struct bwd_row {
    double ms_fwd[2], ms_bwd[6];
    tkd_cudnn_attn_bwd_info info, info_nd;
} bwd_row;

/* Times one shape: prints its forward-table row now and fills r for the backward table. */
static void bench_shape(tkd_cudnn_attn *cudnn, tkd_cudnn_attn *cudnn_nd, const shape *s, int reps, bwd_row *r)
{
    bufs b;
    bufs_alloc(&b, s);
    double flop = 4.0 * s->b * s->h * (double)s->t * s->t * s->dh / 2.0, first[4] = {0, 0, 0, 0};
    double ms[4] = {time_call(NULL, s, &b, FWD_LSE, reps, &first[0]),
                    time_call(NULL, s, &b, FWD_NO_LSE, reps, &first[1]), -1.0, -1.0};
    if (cudnn) {
        ms[2] = time_call(cudnn, s, &b, FWD_LSE, reps, &first[2]);
        ms[3] = time_call(cudnn, s, &b, FWD_NO_LSE, reps, &first[3]);
    }
    print_shape(s);
    for (int i = 0; i < 4; i++)
        print_cells(ms[i], flop);
    if (cudnn && ms[2] >= 0) {
        double dy, dl;
        compare(cudnn, s, &b, &dy, &dl);
        printf("| %6.0f / %-6.0f | %.2g / %.2g |\n", first[2], first[3], dy, dl);
    } else {
        printf("| %15s | - |\n", cudnn ? "refused" : "no cuDNN");
    }
    fflush(stdout);
    if (call(NULL, s, &b, FWD_LSE) != TKD_OK) /* our y and lse for the backward (compare left cuDNN's) */
        die("tkd_cuda_attn_fwd", tkd_error_msg());
    double first_bwd;
    r->ms_fwd[0] = ms[0], r->ms_fwd[1] = ms[2];
    r->ms_bwd[0] = time_call(NULL, s, &b, BWD, reps, &first_bwd);
    r->ms_bwd[1] = r->ms_bwd[2] = r->ms_bwd[3] = -1.0;
    memset(&r->info, 0, sizeof r->info);
    memset(&r->info_nd, 0, sizeof r->info_nd);
    if (cudnn_nd && tkd_cudnn_attn_bwd_plan(cudnn_nd, s->b, s->t, s->h, s->hkv, s->dh, &r->info_nd) == TKD_OK)
        r->ms_bwd[3] = time_call(cudnn_nd, s, &b, BWD_CUDNN, reps, &first_bwd);
    else if (cudnn_nd)
        fprintf(stderr, "attn_bench: %dx%dx%dx%dx%d non-deterministic backward: %s\n", s->b, s->t, s->h, s->hkv,
                s->dh, tkd_error_msg());
    if (cudnn) {
        r->ms_bwd[1] = time_call(cudnn, s, &b, BWD_CUDNN, reps, &first_bwd);
        if (tkd_cudnn_attn_bwd_plan(cudnn, s->b, s->t, s->h, s->hkv, s->dh, &r->info) != TKD_OK)
            die("tkd_cudnn_attn_bwd_plan", tkd_error_msg());
        r->ms_bwd[2] = r->info.calls > 1 ? time_call(cudnn, s, &b, BWD_CUDNN_ONE, reps, &first_bwd) : r->ms_bwd[1];
        tkd_cudnn_attn_set_bwd_budget(cudnn, TKD_CUDNN_ATTN_BWD_BUDGET);
    }
    r->ms_bwd[4] = time_call(NULL, s, &b, BWD_WGMMA, reps, &first_bwd);
    r->ms_bwd[5] = r->ms_bwd[4] >= 0 ? wgmma_vs_ours(s, &b) : -1.0;
    bufs_free(&b);
}

/* Packed documents (--docs L): the forward with lse over B·T tokens cut into documents of L tokens
 * (tkd_attn_mask.doc), against the plain causal forward over the same B×T (the same tokens as one
 * document each) and over the documents run alone (B·T/L sequences of L: the work a packed batch
 * must do at least); then the backward training takes on packed documents (the CUDA backend's
 * masked one: tkd_cuda_attn_bwd_masked where it takes dh, else tkd_cuda_attn_bwd_simple_masked)
 * against the documents alone under the backward training takes without documents (our Hopper
 * wgmma one, else our flash one), and under our flash backward (the same kernels unmasked: what
 * the mask costs them; "-" where flash does not take dh). */
static void bench_docs(const shape *s, int L, int reps)
{
    if (L < 1 || s->t % L != 0) {
        fprintf(stderr, "attn_bench: --docs %d does not divide T %d: skipped\n", L, s->t);
        return;
    }
    bufs b;
    bufs_alloc(&b, s);
    const size_t n = (size_t)s->b * s->t;
    int32_t *h = malloc(n * sizeof *h);
    if (!h)
        die("malloc", "out of host memory");
    for (size_t i = 0; i < n; i++)
        h[i] = (int32_t)((i % (size_t)s->t) / (size_t)L * (size_t)L);
    CUDA(cudaMalloc((void **)&b.doc, n * sizeof *h));
    CUDA(cudaMemcpy(b.doc, h, n * sizeof *h, cudaMemcpyHostToDevice));
    free(h);
    CUDA(cudaMalloc((void **)&b.delta, tkd_cuda_attn_bwd_simple_ws_bytes(s->b, s->t, s->h)));
    double first;
    const shape alone = {(int)(n / (size_t)L), L, s->h, s->hkv, s->dh, s->name};
    const double plain = time_call(NULL, s, &b, FWD_LSE, reps, &first);
    const double one = time_call(NULL, &alone, &b, FWD_LSE, reps, &first);
    const double packed = time_call(NULL, s, &b, FWD_DOCS, reps, &first); /* leaves the masked lse in b */
    const double bwd_packed = time_call(NULL, s, &b, BWD_DOCS, reps, &first);
    if (call(NULL, &alone, &b, FWD_LSE) != TKD_OK)
        die("tkd_cuda_attn_fwd", tkd_error_msg());
    double bwd_one = time_call(NULL, &alone, &b, BWD_WGMMA, reps, &first);
    const char *bwd_kind = "wgmma";
    if (bwd_one < 0) {
        bwd_one = time_call(NULL, &alone, &b, BWD, reps, &first);
        bwd_kind = "flash";
    }
    const double flash_one = bwd_kind[0] == 'f' ? bwd_one
                             : flash_takes(s->dh) ? time_call(NULL, &alone, &b, BWD, reps, &first) : -1.0;
    const double flop = 4.0 * alone.b * s->h * (double)L * L * s->dh / 2; /* the documents' causal work */
    printf("| %-12s | %d | %6d | %3d | %3d | %3d | %6d | %8.3f | %8.3f | %7.1f | %8.3f | %7.1f | %.3f "
           "| %9.3f | %7.1f | %9.3f (%s) | %7.1f | %.2f ", s->name, s->b, s->t, s->h, s->hkv, s->dh, L, plain,
           packed, flop / (packed * 1e9), one, flop / (one * 1e9), packed / one, bwd_packed,
           2.5 * flop / (bwd_packed * 1e9), bwd_one, bwd_kind, 2.5 * flop / (bwd_one * 1e9), bwd_packed / bwd_one);
    if (flash_one < 0)
        printf("| - | - |\n");
    else
        printf("| %9.3f | %.2f |\n", flash_one, bwd_packed / flash_one);
    CUDA(cudaFree(b.doc));
    CUDA(cudaFree(b.delta));
    b.doc = NULL;
    bufs_free(&b);
}

static void print_bwd_row(const shape *s, const bwd_row *r)
{
    double flop = 4.0 * s->b * s->h * (double)s->t * s->t * s->dh / 2.0;
    print_shape(s);
    print_cells(r->ms_fwd[0], flop);
    print_cells(r->ms_bwd[0], 2.5 * flop);
    print_cells(r->ms_fwd[0] + r->ms_bwd[0], 3.5 * flop);
    print_cells(r->ms_bwd[1], 2.5 * flop);
    print_cells(r->ms_fwd[1] < 0 || r->ms_bwd[1] < 0 ? -1.0 : r->ms_fwd[1] + r->ms_bwd[1], 3.5 * flop);
    printf("| %2d x %8.1f | %9.1f ", r->info.calls, r->info.ws_call / 1048576.0, r->info.ws_one_call / 1048576.0);
    print_cells(r->ms_bwd[2], 2.5 * flop);
    print_cells(r->ms_bwd[3], 2.5 * flop);
    printf("| %s ", r->ms_bwd[3] < 0 ? "-" : r->info_nd.nondet ? "yes" : "no");
    print_cells(r->ms_bwd[4], 2.5 * flop);
    print_cells(r->ms_fwd[1] < 0 || r->ms_bwd[4] < 0 ? -1.0 : r->ms_fwd[1] + r->ms_bwd[4], 3.5 * flop);
    if (r->ms_bwd[5] < 0)
        printf("| - |\n");
    else
        printf("| %.1e |\n", r->ms_bwd[5]);
}

int main(int argc, char **argv)
{
    shape shapes[16] = {
        {1, 8192, 32, 8, 128, "llama3-8b"},  {1, 32768, 32, 8, 128, "llama3-8b"},
        {1, 8192, 14, 2, 64, "qwen2-0.5b"},  {1, 32768, 14, 2, 64, "qwen2-0.5b"},
        {1, 8192, 32, 8, 64, "llama3.2-1b"}, {1, 8192, 24, 8, 128, "student-3b"},
        {4, 4096, 14, 2, 64, "qwen2.5-0.5b"},
    };
    int n = 7, reps = 10, ndocs = 0, docs[8];
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--docs") == 0 && i + 1 < argc) {
            for (char *tok = strtok(argv[++i], ","); tok && ndocs < 8; tok = strtok(NULL, ","))
                docs[ndocs++] = atoi(tok);
        } else if (strcmp(argv[i], "--shapes") == 0 && i + 1 < argc) {
            n = 0;
            for (char *tok = strtok(argv[++i], ","); tok && n < 16; tok = strtok(NULL, ",")) {
                shape *s = &shapes[n];
                if (sscanf(tok, "%dx%dx%dx%dx%d", &s->b, &s->t, &s->h, &s->hkv, &s->dh) != 5)
                    die("--shapes", "expected BxTxHxHkvxDH,...");
                s->name = "custom";
                n++;
            }
        } else {
            fprintf(stderr, "usage: attn_bench [--reps 10] [--shapes BxTxHxHkvxDH,...] [--docs L,...]\n");
            return 2;
        }
    }
    if (reps < 1)
        die("--reps", "must be at least 1");
    struct cudaDeviceProp p;
    CUDA(cudaGetDeviceProperties(&p, 0));
    tkd_cudnn_attn *cudnn = NULL, *cudnn_nd = NULL;
    if (tkd_cudnn_attn_create(&cudnn) != TKD_OK)
        fprintf(stderr, "attn_bench: no cuDNN column: %s\n", tkd_error_msg());
    else if (tkd_cudnn_attn_create(&cudnn_nd) == TKD_OK)
        tkd_cudnn_attn_set_bwd_nondet(cudnn_nd, 1);
    printf("attn_bench: %s, %d SMs, median of %d calls; TFLOP/s: forward 4·B·H·T²·dh/2 / time, "
           "backward 2.5 × that (convention), fwd+bwd 3.5 × that / (fwd with lse + bwd)\n\n",
           p.name, p.multiProcessorCount, reps);
    printf("forward\n\n");
    printf("| shape        | B |      T |   H | Hkv |  dh | ours ms (lse) | TFLOP/s | ours ms (no lse) | TFLOP/s "
           "| cuDNN ms (lse) | TFLOP/s | cuDNN ms (no lse) | TFLOP/s | cuDNN plan ms (lse / no) "
           "| max abs diff y / lse |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    bwd_row rows[16];
    for (int i = 0; i < n; i++)
        bench_shape(cudnn, cudnn_nd, &shapes[i], reps, &rows[i]);
    printf("\nbackward (ours; cuDNN's: its forward with lse + tkd_cudnn_attn_bwd; wgmma: our Hopper backward, "
           "its fwd+bwd with cuDNN's forward; rel diff: wgmma's gradients vs ours)\n\n");
    printf("| shape        | B |      T |   H | Hkv |  dh | fwd ms (lse) | TFLOP/s | bwd ms | TFLOP/s "
           "| fwd+bwd ms | TFLOP/s | cuDNN bwd ms | TFLOP/s | cuDNN fwd+bwd ms | TFLOP/s "
           "| cuDNN calls x ws MiB | one call ws MiB | cuDNN one call bwd ms | TFLOP/s "
           "| cuDNN non-det. bwd ms | TFLOP/s | noted non-det. "
           "| wgmma bwd ms | TFLOP/s | wgmma fwd+bwd ms | TFLOP/s | rel diff |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
           "---|---|---|---|---|\n");
    for (int i = 0; i < n; i++)
        print_bwd_row(&shapes[i], &rows[i]);
    if (ndocs > 0) {
        printf("\npacked documents (forward with lse, ours): the B×T tokens as documents of L tokens, against the "
               "plain causal forward over B×T and the documents run alone as B·T/L sequences; TFLOP/s over the "
               "documents' causal work; then the masked backward (tkd_cuda_attn_bwd_masked; "
               "tkd_cuda_attn_bwd_simple_masked where dh is not 48, 64, 80, 96 or 128) against the documents alone "
               "under our unmasked backward (wgmma, else flash), and under our flash backward\n\n");
        printf("| shape        | B |      T |   H | Hkv |  dh |      L | plain ms | packed ms | TFLOP/s | alone ms "
               "| TFLOP/s | packed / alone | bwd packed ms | TFLOP/s | bwd alone ms | TFLOP/s | bwd packed / alone "
               "| bwd alone flash ms | bwd packed / flash alone |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for (int i = 0; i < n; i++)
            for (int d = 0; d < ndocs; d++)
                bench_docs(&shapes[i], docs[d], reps);
    }
    tkd_cudnn_attn_free(cudnn);
    tkd_cudnn_attn_free(cudnn_nd);
    return 0;
}

#else /* built without CUDA (bench/CMakeLists.txt leaves this program out then) */

int main(void)
{
    printf("attn_bench: this build has no CUDA backend (configure with -DTOPKD_CUDA=ON)\n");
    return 0;
}

#endif
