/* kl_bench.c — the CUDA fused chunked KL loss against its GEMM floor (a program, not a test).
 *
 * For each shape N×D×V (bf16 H and W, renorm, k = k' = 100, random data, 3% of rows masked):
 * median ms of forward + backward in recompute mode and of forward in grad_in_forward mode (dW
 * written, as student-train's first micro-batch of a step does: tkd_kl_params.dw_overwrite), each
 * on the product's path (where the device is compute capability 9.0 the fused one: our logits GEMM
 * with the statistics, the gather and the bf16 gradient tile in its epilogue), on the sm90
 * fp32-logits path and on the cuBLAS fallback, on one workspace in the same run; the
 * effective TFLOP/s (8·N·D·V resp. 6·N·D·V over the time), the time of the plain cuBLAS GEMMs the
 * method must do measured in the same run (four per chunk in recompute — H Wᵀ twice, dS W,
 * dSᵀ H — three in grad_in_forward; same shapes, dtypes, layouts and chunking, through
 * tkd_kl_bench_gemm_floor) and the ratio to it, the peak device memory above the inputs, and a
 * naive path that materialises all N×V fp32 logits (the same code with one chunk of N rows) where
 * it fits. Peak memory is the drop in cudaMemGetInfo's free bytes from just after the inputs are
 * on the device to just after the timed runs (all of dH, dW, the workspace and cuBLAS's handle;
 * nothing is freed in between, so that is the peak).
 *
 *   kl_bench [--shapes 4096x4096x128256,...] [--reps 5] [--chunk 0] [--rows THREADSxVEC]
 *            [--profile] [--no-naive] [--divergence fkl|rkl|jsd|skl|srkl|tvd]
 * --divergence times the loss with another kd.divergence (default fkl; jsd_beta 0.5, skew_alpha 0.1):
 * over renorm at α = 1 the dense KD gradient is 0, so on the fused path every row rescales its E
 * tile (kl_loss_cuda_rows.cu, kMinDenseShare) — the divergences' slowest case.
 * --profile adds, per shape and path, the device time of each stage (summed over chunks) and, on
 * the paths whose row kernels read the fp32 logits, their effective bandwidth (stats: reads N·V·4
 * bytes; grad: reads N·V·4, writes N·V·2; grad_in_forward rows: reads twice, writes once; the fused
 * path's row kernels read k'+S+1 values per row, so none is printed). --rows runs the row kernels with another launch
 * shape (a sweep; the product always runs its own, kernels/loss/kl_loss_cuda_internal.h).
 * The floor, the profile, --rows and the random fill are in kl_bench_cuda.cu.
 *
 *   kl_bench --lmhead [--tau 2] [--shapes ...] [--reps 5] [--chunk 0]
 * times the LM head's logits pass alone, in the loss's chunks of rows (issue 13): our Hopper GEMM
 * with the row statistics in its epilogue (kernels/gemm_sm90/lmhead_sm90.h: GEMM + per-tile partials +
 * combine into LSE at 1 and 1/τ), with and without the fp32 logits written in the same pass, and
 * that plus the row kernel taking the LSEs (the loss's forward stage), against cuBLAS's bf16 ->
 * fp32 logits GEMM alone (the floor it replaces) and cuBLAS + today's statistics row kernel (the
 * pass it replaces); and our GEMM's fp32 epilogue against cuBLAS (the GEMM core) and with no
 * epilogue (the main loop alone); each of ours in both schedules (ping-pong, cooperative); ms,
 * TFLOP/s (2·N·D·V) and the ratio to cuBLAS alone.
 * It then checks our fused pass's LSEs against the row kernel's and our logits against cuBLAS's
 * (4 rows).
 *
 *   kl_bench --dense [--teacher-d 4096] [--tau 2] [--divergence D] [--shapes ...] [--reps 5]
 *            [--chunk 0] [--profile]
 * times the dense mode (tkd_kl_params.dense, kd.teacher: the teacher online, its full distribution
 * the target; kernels/loss/kl_loss_cuda_dense.cu) at alpha 0.5 with a teacher of hidden size Dt
 * (default shapes 4096 and 8192 x 2048 x 151552, Dt 4096): forward alone (the loss, as evaluation
 * runs it), forward + backward in recompute mode, and forward with grad_in_forward (dW written),
 * each beside its floor, the plain cuBLAS GEMMs it must do in the same chunks
 * (tkd_kl_bench_dense_floor): forward the two LM-head GEMMs Zs = H_c Wᵀ and Zt = Ht_c Wtᵀ;
 * recompute those twice plus dH = dS W and dW = dSᵀ H_c; grad_in_forward those once plus dH and dW.
 * TFLOP/s count 2·N·V·(D + Dt) per logits pair and 4·N·V·D for dH + dW. --profile adds the stage
 * times and the dense row kernel's bandwidth (stats: reads both fp32 rows, 8 bytes per element, and
 * again for a divergence other than fkl; grad: reads 8, writes 2).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "kernels/loss/kl_loss.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "bench/kl_bench_cuda.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/loss/kl_loss_cuda.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"
#include "kernels/gemm_sm90/lmhead_sm90_tuning.h"

/* The kernel choices, from the environment through the one parser (kernels/cuda/cuda_policy.h), so the
 * A/B variables that steer student-train steer this benchmark too. */
static tkd_cuda_policy g_policy;

#define BENCH_K 100
#define MIB (1024.0 * 1024.0)

typedef struct shape { int64_t n; int d, v; } shape;

typedef struct bench_opts {
    shape shapes[16];
    int n_shapes, reps, chunk, profile, naive;
    int row_threads, row_vec; /* --rows; 0, 0: the product's launch shape */
    int lmhead;               /* --lmhead: the logits pass alone (bench_lmhead) */
    int divergence;           /* --divergence: tkd_kl_divergence (fkl by default) */
    float tau;                /* --tau, for --lmhead and --dense */
    int dense;                /* --dense: the teacher online (bench_dense) */
    int teacher_d;            /* --teacher-d: Dt for --dense */
} bench_opts;

typedef struct bench_data {
    tkd_kl_cuda_batch b;
    float *dh, *dw; /* (N, D), (V, D) fp32 */
} bench_data;

typedef struct mode_result {
    int ok;           /* 0: skipped (text in note) */
    int sm90;         /* ran the sm90 path */
    char note[64];
    double ms, floor_ms;
    double peak_mib, budget_mib;
    int chunk;
    double loss;
} mode_result;

static int die(tkd_status st, const char *what)
{
    fprintf(stderr, "kl_bench: %s: %s: %s\n", what, tkd_status_name(st), tkd_error_msg());
    exit(1);
}
#define CHECK(expr) do { tkd_status st_ = (expr); if (st_ != TKD_OK) die(st_, #expr); } while (0)

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Teacher side on the host: k distinct ids per row spread over V, descending logits, an LSE
 * above their log-sum-exp (so tail mass r > 0), labels with 3% ignored. */
static void make_teacher(const shape *s, int32_t *idx, float *tl, float *lse, int32_t *labels)
{
    uint64_t rng = 1234;
    int step = s->v / BENCH_K;
    for (int64_t i = 0; i < s->n; i++) {
        int start = (int)(splitmix(&rng) % (uint64_t)s->v);
        double m = 0.0, sum = 0.0;
        for (int j = 0; j < BENCH_K; j++) {
            idx[i * BENCH_K + j] = (int32_t)((start + (int64_t)j * step) % s->v);
            float t = 8.0f - 0.05f * j + (float)(splitmix(&rng) % 1000) * 1e-5f;
            tl[i * BENCH_K + j] = t;
            if (j == 0)
                m = t;
            sum += exp(t - m);
        }
        lse[i] = (float)(m + log(sum) + 0.7);
        uint64_t u = splitmix(&rng);
        labels[i] = (u % 100) < 3 ? -100 : (int32_t)((u >> 8) % (uint64_t)s->v);
    }
}

static void data_init(bench_data *x, const shape *s)
{
    memset(x, 0, sizeof *x);
    x->b.n = s->n, x->b.d = s->d, x->b.v = s->v;
    size_t nh = (size_t)s->n * s->d, nw = (size_t)s->v * s->d, nk = (size_t)s->n * BENCH_K;
    CHECK(tkd_cuda_malloc((void **)&x->b.h, nh * 2, "H", NULL));
    CHECK(tkd_cuda_malloc((void **)&x->b.w, nw * 2, "W", NULL));
    /* logits s = h·w with std ≈ 2: a realistic spread, never zeros */
    CHECK(tkd_kl_bench_fill_bf16((uint16_t *)x->b.h, nh, 1, 1.0f));
    CHECK(tkd_kl_bench_fill_bf16((uint16_t *)x->b.w, nw, 2, 2.0f / sqrtf((float)s->d)));
    int32_t *idx = malloc(nk * 4), *labels = malloc((size_t)s->n * 4);
    float *tl = malloc(nk * 4), *lse = malloc((size_t)s->n * 4);
    if (!idx || !labels || !tl || !lse) {
        fprintf(stderr, "kl_bench: host out of memory\n");
        exit(1);
    }
    make_teacher(s, idx, tl, lse, labels);
    CHECK(tkd_cuda_malloc((void **)&x->b.topk_idx, nk * 4, "teacher ids", NULL));
    CHECK(tkd_cuda_malloc((void **)&x->b.topk_logit, nk * 4, "teacher logits", NULL));
    CHECK(tkd_cuda_malloc((void **)&x->b.teacher_lse, (size_t)s->n * 4, "teacher LSE", NULL));
    CHECK(tkd_cuda_malloc((void **)&x->b.labels, (size_t)s->n * 4, "labels", NULL));
    CHECK(tkd_cuda_to_device((void *)x->b.topk_idx, idx, nk * 4));
    CHECK(tkd_cuda_to_device((void *)x->b.topk_logit, tl, nk * 4));
    CHECK(tkd_cuda_to_device((void *)x->b.teacher_lse, lse, (size_t)s->n * 4));
    CHECK(tkd_cuda_to_device((void *)x->b.labels, labels, (size_t)s->n * 4));
    free(idx), free(labels), free(tl), free(lse);
}

static void data_free(bench_data *x) { tkd_kl_cuda_batch_free(&x->b); }

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* What one timed repetition runs. */
typedef enum run_kind {
    RUN_RECOMPUTE, RUN_GIF, RUN_RECOMPUTE_CUBLAS, RUN_GIF_CUBLAS, RUN_RECOMPUTE_F32, RUN_GIF_F32,
    RUN_FLOOR4, RUN_FLOOR3,
    RUN_FORWARD, /* forward alone, no gradients (--dense) */
    RUN_DENSE_FLOOR_FWD, RUN_DENSE_FLOOR_GIF, RUN_DENSE_FLOOR_REC, /* tkd_kl_bench_dense_floor's kinds */
    RUN_LM_FIRST, /* RUN_LM_FIRST + TKD_KL_BENCH_LM_*: tkd_kl_bench_lmhead of that kind */
} run_kind;

typedef struct run_ctx {
    tkd_kl_cuda_ws *ws;
    tkd_kl_params p;
    bench_data *x;
    const uint16_t *ds; /* floor's dS stand-in */
    double loss;
    int has_sm90;                    /* ws has the sm90 GEMM: the method runs on both paths */
    tkd_lmhead_sm90_ws *lw;          /* --lmhead: NULL where our GEMM is unsupported */
    float *part, *lse1, *lset;       /* --lmhead: (3, chunk, V/256) partials, (N) LSEs */
} run_ctx;

static void run_once(run_ctx *c, run_kind kind)
{
    tkd_kl_result res;
    tkd_kl_params p = c->p;
    if (kind <= RUN_GIF_F32 && c->has_sm90) { /* the path: 0 fused, 1 cuBLAS, 2 sm90 fp32 logits */
        const int q = kind / 2;
        CHECK(tkd_kl_bench_set_sm90(c->ws, q != 1));
        CHECK(tkd_kl_bench_set_fused(c->ws, q == 0));
    }
    switch (kind) {
    case RUN_RECOMPUTE:
    case RUN_RECOMPUTE_CUBLAS:
    case RUN_RECOMPUTE_F32:
        p.grad_in_forward = 0;
        CHECK(tkd_kl_cuda_forward(c->ws, &p, &c->x->b, &res, NULL, NULL));
        CHECK(tkd_kl_cuda_backward(c->ws, &p, &c->x->b, 1.0f, c->x->dh, c->x->dw));
        c->loss = res.loss;
        break;
    case RUN_GIF:
    case RUN_GIF_CUBLAS:
    case RUN_GIF_F32:
        p.grad_in_forward = 1;
        CHECK(tkd_kl_cuda_forward(c->ws, &p, &c->x->b, &res, c->x->dh, c->x->dw));
        c->loss = res.loss;
        break;
    case RUN_FORWARD:
        p.grad_in_forward = 0;
        CHECK(tkd_kl_cuda_forward(c->ws, &p, &c->x->b, &res, NULL, NULL));
        c->loss = res.loss;
        break;
    case RUN_DENSE_FLOOR_FWD:
    case RUN_DENSE_FLOOR_GIF:
    case RUN_DENSE_FLOOR_REC:
        CHECK(tkd_kl_bench_dense_floor(c->ws, &c->x->b, (int)kind - RUN_DENSE_FLOOR_FWD, c->ds, c->x->dh,
                                       c->x->dw, c->p.dw_overwrite));
        break;
    case RUN_FLOOR4:
    case RUN_FLOOR3:
        CHECK(tkd_kl_bench_gemm_floor(c->ws, &c->x->b, kind == RUN_FLOOR4, c->ds, c->x->dh,
                                     c->x->dw, c->p.dw_overwrite));
        break;
    default:
        CHECK(tkd_kl_bench_lmhead(c->ws, c->lw, &p, &c->x->b, (int)kind - RUN_LM_FIRST, c->part,
                                  c->lse1, c->lset));
    }
}

/* Device ms of one run (every run ends synchronised: the API syncs). */
static double time_once(run_ctx *c, run_kind kind)
{
    cudaEvent_t e0, e1;
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) {
        fprintf(stderr, "kl_bench: cudaEventCreate failed\n");
        exit(1);
    }
    cudaEventRecord(e0, 0);
    run_once(c, kind);
    cudaEventRecord(e1, 0);
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ms;
}

static double median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof t[0], cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

#define MAX_REPS 64

static size_t free_bytes(void)
{
    size_t f = 0, tot = 0;
    CHECK(tkd_cuda_mem_info(&f, &tot));
    return f;
}

/* One path's stage times; rows_bw: its row kernels read the fp32 logits (bandwidth printed). */
static void print_profile(const shape *s, int chunk, const double *ms, int rows_bw)
{
    double nv = (double)s->n * s->v;
    char bw[3][32] = {"", "", ""};
    const double bytes[3] = {4, 6, 10};
    const int stage[3] = {1, 3, 7};
    for (int i = 0; rows_bw && i < 3; i++)
        snprintf(bw[i], sizeof bw[i], " (%.0f GB/s)", nv * bytes[i] / (ms[stage[i]] * 1e6));
    printf("  profile %lldx%dx%d chunk %d (ms): recompute: logits %.2f, stats rows %.2f%s, logits "
           "%.2f, grad rows %.2f%s, dH %.2f, dW %.2f | grad_in_forward: logits %.2f, rows %.2f%s, "
           "dH %.2f, dW %.2f\n",
           (long long)s->n, s->d, s->v, chunk, ms[0], ms[1], bw[0], ms[2], ms[3], bw[1], ms[4], ms[5],
           ms[6], ms[7], bw[2], ms[8], ms[9]);
}

/* Chunked method with `chunk` rows (0 = auto): times n_modes modes (recompute, then
 * grad_in_forward), each on the product's path (out[m]: fused where the workspace has the sm90
 * GEMM), the cuBLAS path (out[2 + m]) and the sm90 fp32-logits path (out[4 + m]), and, with
 * do_floor, both GEMM floors. */
static void bench_chunked(const shape *s, const bench_opts *o, int chunk, int n_modes,
                          int do_floor, int profile, mode_result out[6])
{
    bench_data x;
    data_init(&x, s);
    size_t f0 = free_bytes();
    CHECK(tkd_cuda_malloc((void **)&x.dh, (size_t)s->n * s->d * 4, "dH", NULL));
    CHECK(tkd_cuda_malloc((void **)&x.dw, (size_t)s->v * s->d * 4, "dW", NULL));
    CHECK(tkd_cuda_memzero(x.dw, (size_t)s->v * s->d * 4));
    run_ctx c = {0};
    c.x = &x;
    tkd_kl_params_defaults(&c.p, BENCH_K);
    c.p.chunk_rows = chunk;
    c.p.divergence = (tkd_kl_divergence)o->divergence;
    c.p.dw_overwrite = 1; /* as student-train's first micro-batch of a step calls it (and PyTorch
                           * writes its dW): every timed run then makes the same dW */
    tkd_status st = tkd_kl_cuda_ws_create(&c.ws, &c.p, &g_policy, s->n, s->d, s->v);
    if (st == TKD_ERR_DEVICE_OOM) {
        for (int m = 0; m < 6; m++) {
            out[m].ok = 0;
            snprintf(out[m].note, sizeof out[m].note, "does not fit");
        }
        tkd_cuda_free(x.dh), tkd_cuda_free(x.dw);
        data_free(&x);
        return;
    }
    CHECK(st);
    CHECK(tkd_kl_bench_set_rows(c.ws, o->row_threads, o->row_vec));
    c.has_sm90 = tkd_kl_bench_set_sm90(c.ws, 1) == TKD_OK;
    int cr = tkd_kl_cuda_ws_chunk_rows(c.ws);
    double chunk_mib = (double)cr * ((s->v + 15) / 16 * 16) * 4 / MIB;
    double budget = ((double)s->n * s->d * 4 + (double)s->v * s->d * 4) / MIB + chunk_mib + 512.0;
    /* method m (recompute, gif) on path q (0 fused, 1 cuBLAS, 2 sm90 fp32) is out[2q + m] */
#define METHOD_KIND(q, m) ((run_kind)(2 * (q) + (m)))
    const int paths = c.has_sm90 ? 3 : 1, q0 = c.has_sm90 ? 0 : 1;
    for (int q = q0; q < q0 + paths; q++) /* warm-up: handles, kernels, cuBLAS heuristics */
        for (int m = 0; m < n_modes; m++) {
            mode_result *r = &out[2 * q + m];
            run_once(&c, METHOD_KIND(q, m));
            r->loss = c.loss;
            r->ok = 1;
            r->sm90 = q != 1;
            r->chunk = tkd_kl_bench_chunk_for(c.ws, &c.p, 1, s->n); /* the gradient pass's, either mode */
            r->budget_mib = budget;
            r->floor_ms = NAN;
        }
    if (!c.has_sm90)
        for (int m = 0; m < 2; m++) {
            snprintf(out[m].note, sizeof out[m].note, "no sm90 GEMM here");
            snprintf(out[4 + m].note, sizeof out[4 + m].note, "no sm90 GEMM here");
        }
    double peak = (double)(f0 - free_bytes()) / MIB; /* nothing was freed: this is the peak */
    for (int m = 0; m < 6; m++)
        out[m].peak_mib = peak;
    static const char *const path_name[3] = {
        "fused (sm90 GEMM: statistics, gather and the bf16 gradient tile in its epilogue)",
        "cuBLAS", "sm90 fp32 logits (statistics in the epilogue)"};
    for (int q = q0; profile && q < q0 + paths; q++) {
        double ms[TKD_KL_BENCH_PROF_STAGES];
        if (c.has_sm90) {
            CHECK(tkd_kl_bench_set_sm90(c.ws, q != 1));
            CHECK(tkd_kl_bench_set_fused(c.ws, q == 0));
        }
        printf("  profile path: %s\n", path_name[q]);
        CHECK(tkd_kl_bench_profile(c.ws, &c.p, &x.b, x.dh, x.dw, ms));
        print_profile(s, tkd_kl_bench_chunk_for(c.ws, &c.p, 1, s->n), ms, !tkd_kl_bench_fused_on(c.ws, &c.p));
    }
    void *ds = NULL;
    if (do_floor) {
        size_t nds = tkd_kl_bench_ds_elems(c.ws);
        CHECK(tkd_cuda_malloc(&ds, nds * 2, "dS stand-in", NULL));
        CHECK(tkd_kl_bench_fill_bf16((uint16_t *)ds, nds, 3, 1e-6f)); /* dS-sized values */
        c.ds = (const uint16_t *)ds;
        run_once(&c, RUN_FLOOR4);
    }
    /* Methods and floor alternate rep by rep, so clock and temperature drift hit all alike. */
    double t[8][MAX_REPS];
    const int reps = o->reps < MAX_REPS ? o->reps : MAX_REPS;
    for (int r = 0; r < reps; r++)
        for (int m = 0; m < n_modes; m++) {
            for (int q = q0; q < q0 + paths; q++)
                t[2 * q + m][r] = time_once(&c, METHOD_KIND(q, m));
            if (do_floor)
                t[6 + m][r] = time_once(&c, m == 0 ? RUN_FLOOR4 : RUN_FLOOR3);
        }
    for (int m = 0; m < n_modes; m++)
        for (int q = q0; q < q0 + paths; q++) {
            out[2 * q + m].ms = median(t[2 * q + m], reps);
            if (do_floor)
                out[2 * q + m].floor_ms = median(t[6 + m], reps);
        }
#undef METHOD_KIND
    tkd_cuda_free(ds);
    tkd_kl_cuda_ws_free(c.ws);
    tkd_cuda_free(x.dh), tkd_cuda_free(x.dw);
    data_free(&x);
}

static void print_row(const shape *s, const char *mode, const mode_result *r, double flops,
                      double floor_ms)
{
    char sh[48];
    snprintf(sh, sizeof sh, "%lldx%dx%d", (long long)s->n, s->d, s->v);
    if (!r->ok) {
        printf("| %-18s | %-24s | %6s | %9s | %7s | %9s | %6s | %9s | %9s | %s\n", sh, mode, "-",
               "-", "-", "-", "-", "-", "-", r->note);
        return;
    }
    double ratio = r->ms / floor_ms;
    printf("| %-18s | %-24s | %6d | %9.2f | %7.1f | %9.2f | %6.3f | %9.0f | %9.0f | loss %.4f %s\n",
           sh, mode, r->chunk, r->ms, flops / (r->ms * 1e-3) / 1e12, floor_ms, ratio, r->peak_mib,
           r->budget_mib, r->loss,
           (ratio <= 1.10 && r->peak_mib <= r->budget_mib) ? "" : "(target missed)");
}

/* One timed pass of --lmhead: a kind (TKD_KL_BENCH_LM_*) and, for ours, a schedule. */
typedef struct lm_pass {
    int kind;
    tkd_lmhead_sm90_sched sched;
    const char *name;
} lm_pass;

static const lm_pass k_lm_passes[] = {
    {TKD_KL_BENCH_LM_CUBLAS, 0, "cuBLAS logits"},
    {TKD_KL_BENCH_LM_CUBLAS_ROWS, 0, "cuBLAS + stats rows"},
    {TKD_KL_BENCH_LM_SM90_ROWS, TKD_LMHEAD_SM90_SCHED_PINGPONG, "pp logits+stats+rows"},
    {TKD_KL_BENCH_LM_SM90_ROWS, TKD_LMHEAD_SM90_SCHED_COOP, "co logits+stats+rows"},
    {TKD_KL_BENCH_LM_SM90_LOGITS_STATS, TKD_LMHEAD_SM90_SCHED_PINGPONG, "pp logits+stats"},
    {TKD_KL_BENCH_LM_SM90_LOGITS_STATS, TKD_LMHEAD_SM90_SCHED_COOP, "co logits+stats"},
    {TKD_KL_BENCH_LM_SM90_STATS, TKD_LMHEAD_SM90_SCHED_PINGPONG, "pp GEMM+stats"},
    {TKD_KL_BENCH_LM_SM90_STATS, TKD_LMHEAD_SM90_SCHED_COOP, "co GEMM+stats"},
    {TKD_KL_BENCH_LM_SM90_LOGITS, TKD_LMHEAD_SM90_SCHED_PINGPONG, "pp fp32 logits"},
    {TKD_KL_BENCH_LM_SM90_LOGITS, TKD_LMHEAD_SM90_SCHED_COOP, "co fp32 logits"},
    {TKD_KL_BENCH_LM_SM90_NONE, TKD_LMHEAD_SM90_SCHED_PINGPONG, "pp no epilogue"},
    {TKD_KL_BENCH_LM_SM90_NONE, TKD_LMHEAD_SM90_SCHED_COOP, "co no epilogue"},
};
#define LM_PASSES ((int)(sizeof k_lm_passes / sizeof k_lm_passes[0]))

static void run_lm_pass(run_ctx *c, int i, int timed, double *ms)
{
    if (c->lw)
        tkd_lmhead_sm90_ws_set_schedule(c->lw, k_lm_passes[i].sched);
    if (timed)
        *ms = time_once(c, (run_kind)(RUN_LM_FIRST + k_lm_passes[i].kind));
    else
        run_once(c, (run_kind)(RUN_LM_FIRST + k_lm_passes[i].kind));
}

/* --lmhead, one shape: the passes of k_lm_passes (ours only where tkd_lmhead_sm90 runs; "pp" =
 * ping-pong, "co" = cooperative schedule), alternating rep by rep, then the checks. */
static void bench_lmhead(const shape *s, const bench_opts *o)
{
    bench_data x;
    data_init(&x, s);
    run_ctx c = {0};
    c.x = &x;
    tkd_kl_params_defaults(&c.p, BENCH_K);
    c.p.chunk_rows = o->chunk;
    c.p.temperature = o->tau;
    CHECK(tkd_kl_cuda_ws_create(&c.ws, &c.p, &g_policy, s->n, s->d, s->v));
    const int cr = tkd_kl_cuda_ws_chunk_rows(c.ws);
    tkd_status st = tkd_lmhead_sm90_ws_create(&c.lw, g_policy.lmhead_sched);
    if (st != TKD_OK)
        printf("  sm90 GEMM not timed: %s\n", tkd_error_msg());
    else {
        CHECK(tkd_cuda_malloc((void **)&c.part, tkd_lmhead_sm90_part_floats(cr, s->v) * 4, "partials", NULL));
        CHECK(tkd_cuda_malloc((void **)&c.lse1, (size_t)s->n * 4, "LSE", NULL));
        CHECK(tkd_cuda_malloc((void **)&c.lset, (size_t)s->n * 4, "LSE at tau", NULL));
    }
    const int passes = c.lw ? LM_PASSES : 2, reps = o->reps < MAX_REPS ? o->reps : MAX_REPS;
    double t[LM_PASSES][MAX_REPS];
    for (int k = 0; k < passes; k++) /* warm-up: handles, heuristics, module load */
        run_lm_pass(&c, k, 0, NULL);
    for (int r = 0; r < reps; r++)
        for (int k = 0; k < passes; k++)
            run_lm_pass(&c, k, 1, &t[k][r]);
    const double flops = 2.0 * (double)s->n * s->d * s->v, base = median(t[0], reps);
    for (int k = 0; k < passes; k++) {
        const double ms = k ? median(t[k], reps) : base;
        printf("| %6lldx%dx%-6d | %5d | %-21s | %9.3f | %7.1f | %6.3f |\n", (long long)s->n, s->d, s->v,
               cr, k_lm_passes[k].name, ms, flops / (ms * 1e-3) / 1e12, ms / base);
    }
    if (c.lw) { /* the fused pass (default schedule) into lse1/lset, the row kernel's into ws */
        double d1 = 0, dt = 0, zr = 0;
        tkd_lmhead_sm90_ws_set_schedule(c.lw, TKD_LMHEAD_SM90_SCHED_PINGPONG);
        run_once(&c, (run_kind)(RUN_LM_FIRST + TKD_KL_BENCH_LM_SM90_LOGITS_STATS));
        run_once(&c, (run_kind)(RUN_LM_FIRST + TKD_KL_BENCH_LM_CUBLAS_ROWS));
        CHECK(tkd_kl_bench_lmhead_check(c.ws, c.lw, &x.b, c.lse1, c.lset, &d1, &dt, &zr));
        printf("  check: max |LSE ours (logits+stats) - row kernel| over %lld rows: %.3g at 1, %.3g at "
               "1/tau; logits (4 rows) max |ours - cuBLAS| / max |z| = %.3g%s\n", (long long)s->n, d1,
               dt, zr, d1 <= 1e-3 && dt <= 1e-3 && zr <= 1e-5 ? "" : "  (MISMATCH: look before trusting the times)");
    }
    tkd_cuda_free(c.part), tkd_cuda_free(c.lse1), tkd_cuda_free(c.lset);
    tkd_lmhead_sm90_ws_free(c.lw);
    tkd_kl_cuda_ws_free(c.ws);
    data_free(&x);
    fflush(stdout);
}

/* ---- --dense: the teacher online ---------------------------------------------------------------- */

/* A dense batch on the device: H (N, D), W (V, D), the teacher's Ht (N, Dt), Wt (V, Dt), bf16 with
 * logits of std ~2 on both sides; labels with 3% ignored. */
static void dense_data_init(bench_data *x, const shape *s, int dt)
{
    memset(x, 0, sizeof *x);
    x->b.n = s->n, x->b.d = s->d, x->b.v = s->v, x->b.teacher_d = dt;
    const size_t nh = (size_t)s->n * s->d, nw = (size_t)s->v * s->d;
    const size_t nth = (size_t)s->n * dt, ntw = (size_t)s->v * dt;
    CHECK(tkd_cuda_malloc((void **)&x->b.h, nh * 2, "H", NULL));
    CHECK(tkd_cuda_malloc((void **)&x->b.w, nw * 2, "W", NULL));
    CHECK(tkd_cuda_malloc((void **)&x->b.teacher_h, nth * 2, "teacher H", NULL));
    CHECK(tkd_cuda_malloc((void **)&x->b.teacher_w, ntw * 2, "teacher W", NULL));
    CHECK(tkd_kl_bench_fill_bf16((uint16_t *)x->b.h, nh, 1, 1.0f));
    CHECK(tkd_kl_bench_fill_bf16((uint16_t *)x->b.w, nw, 2, 2.0f / sqrtf((float)s->d)));
    CHECK(tkd_kl_bench_fill_bf16((uint16_t *)x->b.teacher_h, nth, 4, 1.0f));
    CHECK(tkd_kl_bench_fill_bf16((uint16_t *)x->b.teacher_w, ntw, 5, 2.0f / sqrtf((float)dt)));
    int32_t *labels = malloc((size_t)s->n * 4);
    if (!labels) {
        fprintf(stderr, "kl_bench: host out of memory\n");
        exit(1);
    }
    uint64_t rng = 4321;
    for (int64_t i = 0; i < s->n; i++) {
        uint64_t u = splitmix(&rng);
        labels[i] = (u % 100) < 3 ? -100 : (int32_t)((u >> 8) % (uint64_t)s->v);
    }
    CHECK(tkd_cuda_malloc((void **)&x->b.labels, (size_t)s->n * 4, "labels", NULL));
    CHECK(tkd_cuda_to_device((void *)x->b.labels, labels, (size_t)s->n * 4));
    free(labels);
}

/* Stage times of one recompute forward + backward and one grad_in_forward forward (ms summed over
 * chunks; the logits stage is both GEMMs) and the row kernel's effective bandwidth. */
static void print_dense_profile(const shape *s, int chunk, int div, const double *ms)
{
    const double nv = (double)s->n * s->v, stats = 8.0 * (1 + div);
    printf("  profile %lldx%dx%d chunk %d (ms): recompute: logits pair %.2f, stats rows %.2f (%.0f GB/s), logits "
           "pair %.2f, grad rows %.2f (%.0f GB/s), dH %.2f, dW %.2f | grad_in_forward: logits pair %.2f, rows "
           "%.2f (%.0f GB/s), dH %.2f, dW %.2f\n",
           (long long)s->n, s->d, s->v, chunk, ms[0], ms[1], nv * stats / (ms[1] * 1e6), ms[2], ms[3],
           nv * 10.0 / (ms[3] * 1e6), ms[4], ms[5], ms[6], ms[7], nv * (stats + 10.0) / (ms[7] * 1e6), ms[8],
           ms[9]);
}

static void print_dense_row(const shape *s, int dt, const char *mode, int chunk, double ms, double floor_ms,
                            double flops, double peak, double loss)
{
    char sh[48];
    snprintf(sh, sizeof sh, "%lldx%dx%d", (long long)s->n, s->d, s->v);
    printf("| %-18s | %5d | %-16s | %6d | %9.2f | %7.1f | %9.2f | %6.3f | %9.0f | loss %.4f%s\n", sh, dt, mode,
           chunk, ms, flops / (ms * 1e-3) / 1e12, floor_ms, ms / floor_ms, peak, loss,
           ms / floor_ms <= 1.15 ? "" : " (above 1.15x)");
}

/* --dense, one shape: forward, recompute and grad_in_forward beside their GEMM floors, alternating
 * rep by rep. */
static void bench_dense(const shape *s, const bench_opts *o)
{
    bench_data x;
    dense_data_init(&x, s, o->teacher_d);
    size_t f0 = free_bytes();
    CHECK(tkd_cuda_malloc((void **)&x.dh, (size_t)s->n * s->d * 4, "dH", NULL));
    CHECK(tkd_cuda_malloc((void **)&x.dw, (size_t)s->v * s->d * 4, "dW", NULL));
    run_ctx c = {0};
    c.x = &x;
    tkd_kl_params_defaults(&c.p, s->v);
    c.p.dense = 1;
    c.p.temperature = o->tau;
    c.p.alpha = 0.5f;
    c.p.divergence = (tkd_kl_divergence)o->divergence;
    c.p.chunk_rows = o->chunk;
    c.p.dw_overwrite = 1; /* as student-train's first micro-batch of a step */
    tkd_status st = tkd_kl_cuda_ws_create(&c.ws, &c.p, &g_policy, s->n, s->d, s->v);
    if (st == TKD_ERR_DEVICE_OOM) {
        printf("| %lldx%dx%d | %5d | does not fit: %s\n", (long long)s->n, s->d, s->v, o->teacher_d, tkd_error_msg());
        tkd_cuda_free(x.dh), tkd_cuda_free(x.dw);
        data_free(&x);
        return;
    }
    CHECK(st);
    const int chunk = tkd_kl_cuda_ws_chunk_rows(c.ws);
    enum { M = 3 };
    const run_kind method[M] = {RUN_FORWARD, RUN_RECOMPUTE, RUN_GIF};
    const run_kind floor[M] = {RUN_DENSE_FLOOR_FWD, RUN_DENSE_FLOOR_REC, RUN_DENSE_FLOOR_GIF};
    double loss[M];
    for (int m = 0; m < M; m++) { /* warm-up: handles, kernels, cuBLAS heuristics */
        run_once(&c, method[m]);
        loss[m] = c.loss;
    }
    const double peak = (double)(f0 - free_bytes()) / MIB; /* nothing was freed: this is the peak */
    void *ds = NULL;
    size_t nds = tkd_kl_bench_ds_elems(c.ws);
    CHECK(tkd_cuda_malloc(&ds, nds * 2, "dS stand-in", NULL));
    CHECK(tkd_kl_bench_fill_bf16((uint16_t *)ds, nds, 3, 1e-6f));
    c.ds = (const uint16_t *)ds;
    for (int m = 0; m < M; m++)
        run_once(&c, floor[m]);
    if (o->profile) {
        double ms[TKD_KL_BENCH_PROF_STAGES];
        CHECK(tkd_kl_bench_profile(c.ws, &c.p, &x.b, x.dh, x.dw, ms));
        print_dense_profile(s, chunk, c.p.divergence != TKD_KL_DIVERGENCE_FKL, ms);
    }
    double t[2 * M][MAX_REPS];
    const int reps = o->reps < MAX_REPS ? o->reps : MAX_REPS;
    for (int r = 0; r < reps; r++)
        for (int m = 0; m < M; m++) {
            t[2 * m][r] = time_once(&c, method[m]);
            t[2 * m + 1][r] = time_once(&c, floor[m]);
        }
    const double nv = (double)s->n * s->v, pair = 2.0 * nv * (s->d + o->teacher_d), grads = 4.0 * nv * s->d;
    const double flops[M] = {pair, 2.0 * pair + grads, pair + grads};
    const char *name[M] = {"forward (loss)", "recompute", "grad_in_forward"};
    for (int m = 0; m < M; m++)
        print_dense_row(s, o->teacher_d, name[m], chunk, median(t[2 * m], reps), median(t[2 * m + 1], reps),
                        flops[m], peak, loss[m]);
    fflush(stdout);
    tkd_cuda_free(ds);
    tkd_kl_cuda_ws_free(c.ws);
    tkd_cuda_free(x.dh), tkd_cuda_free(x.dw);
    data_free(&x);
}

static int parse_shapes(const char *arg, bench_opts *o)
{
    o->n_shapes = 0;
    const char *p = arg;
    while (*p && o->n_shapes < 16) {
        long long n;
        int d, v, used = 0;
        if (sscanf(p, "%lldx%dx%d%n", &n, &d, &v, &used) != 3 || n < 1 || d < 1 || v < 1)
            return -1;
        o->shapes[o->n_shapes++] = (shape){n, d, v};
        p += used;
        if (*p == ',')
            p++;
        else if (*p)
            return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    bench_opts o = {.n_shapes = 4, .reps = 5, .chunk = 0, .profile = 0, .naive = 1, .tau = 2.0f, .teacher_d = 4096};
    int shapes_given = 0;
    o.shapes[0] = (shape){4096, 4096, 128256};
    o.shapes[1] = (shape){8192, 2048, 151552};
    o.shapes[2] = (shape){32768, 2880, 201088};
    o.shapes[3] = (shape){262144, 4096, 128256};
    if (tkd_cuda_policy_from_env(&g_policy, NULL) != TKD_OK) {
        fprintf(stderr, "kl_bench: %s\n", tkd_error_msg());
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--shapes") == 0 && i + 1 < argc) {
            if (parse_shapes(argv[++i], &o) != 0) {
                fprintf(stderr, "kl_bench: --shapes wants NxDxV[,NxDxV...], got %s\n", argv[i]);
                return 2;
            }
            shapes_given = 1;
        } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            o.reps = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--chunk") == 0 && i + 1 < argc) {
            o.chunk = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--rows") == 0 && i + 1 < argc) {
            int t = 0, vec = 0;
            if (sscanf(argv[++i], "%dx%d", &t, &vec) != 2) {
                fprintf(stderr, "kl_bench: --rows wants THREADSxVEC, e.g. 256x8\n");
                return 2;
            }
            o.row_threads = t;
            o.row_vec = vec;
        } else if (strcmp(argv[i], "--profile") == 0) {
            o.profile = 1;
        } else if (strcmp(argv[i], "--no-naive") == 0) {
            o.naive = 0;
        } else if (strcmp(argv[i], "--lmhead") == 0) {
            o.lmhead = 1;
        } else if (strcmp(argv[i], "--dense") == 0) {
            o.dense = 1;
        } else if (strcmp(argv[i], "--teacher-d") == 0 && i + 1 < argc) {
            if ((o.teacher_d = atoi(argv[++i])) < 1) {
                fprintf(stderr, "kl_bench: --teacher-d wants the teacher's hidden size >= 1, got %s\n", argv[i]);
                return 2;
            }
        } else if (strcmp(argv[i], "--tau") == 0 && i + 1 < argc) {
            o.tau = (float)atof(argv[++i]);
        } else if (strcmp(argv[i], "--divergence") == 0 && i + 1 < argc) {
            if ((o.divergence = tkd_kl_divergence_parse(argv[++i])) < 0) {
                fprintf(stderr, "kl_bench: --divergence wants fkl, rkl, jsd, skl, srkl or tvd, got %s\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "usage: kl_bench [--shapes NxDxV,...] [--reps R] [--chunk C] "
                            "[--rows THREADSxVEC] [--profile] [--no-naive] [--divergence D] | --lmhead "
                            "[--tau T] | --dense [--teacher-d DT] [--tau T] [--divergence D] [--profile]\n");
            return 2;
        }
    }
    if (o.reps < 1)
        o.reps = 1;
    if (!(o.tau > 0.0f)) {
        fprintf(stderr, "kl_bench: --tau wants a temperature > 0\n");
        return 2;
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        printf("kl_bench: no CUDA device answers\n");
        return 1;
    }
    printf("device: %s, %d SMs; reps %d (median), bf16 H/W, renorm, k = %d, kd.divergence %s; dH and dW fp32\n",
           prop.name, prop.multiProcessorCount, o.reps, BENCH_K,
           tkd_kl_divergence_name((tkd_kl_divergence)o.divergence));
    if (o.dense) {
        if (!shapes_given) {
            o.n_shapes = 2;
            o.shapes[0] = (shape){4096, 2048, 151552};
            o.shapes[1] = (shape){8192, 2048, 151552};
        }
        printf("dense (the teacher online): teacher hidden size Dt %d, tau %g, alpha 0.5, over all V; GEMM floor = the "
               "plain cuBLAS GEMMs in the same chunks: forward Zs + Zt (two LM-head GEMMs), recompute 2 (Zs + Zt) + dH + "
               "dW, grad_in_forward Zs + Zt + dH + dW; ratio = ms / GEMM ms; peak MiB as below\n",
               o.teacher_d, (double)o.tau);
        printf("| %-18s | %5s | %-16s | %6s | %9s | %7s | %9s | %6s | %9s |\n", "N x D x V", "Dt", "mode", "chunk",
               "ms", "TFLOP/s", "GEMM ms", "ratio", "peak MiB");
        for (int i = 0; i < o.n_shapes; i++)
            bench_dense(&o.shapes[i], &o);
        return 0;
    }
    if (o.lmhead) {
        printf("LM-head logits pass alone, tau %g, chunks of rows as the loss (TFLOP/s = 2NDV / time; "
               "ratio = time / cuBLAS logits)\n", (double)o.tau);
        printf("| %-20s | %5s | %-21s | %9s | %7s | %6s |\n", "N x D x V", "chunk", "pass", "ms",
               "TFLOP/s", "ratio");
        for (int i = 0; i < o.n_shapes; i++)
            bench_lmhead(&o.shapes[i], &o);
        return 0;
    }
    if (o.row_threads)
        printf("row kernels: %d threads x %d float4 in flight (--rows; not the product's shape)\n",
               o.row_threads, o.row_vec);
    printf("peak MiB = drop of cudaMemGetInfo free bytes after the inputs are on the device; "
           "budget = dH + dW(fp32) + chunk buffer + 512 MiB\n");
    printf("| %-18s | %-24s | %6s | %9s | %7s | %9s | %6s | %9s | %9s |\n", "N x D x V", "mode",
           "chunk", "ms", "TFLOP/s", "GEMM ms", "ratio", "peak MiB", "budget");
    for (int i = 0; i < o.n_shapes; i++) {
        const shape *s = &o.shapes[i];
        double ndv = (double)s->n * s->d * s->v;
        mode_result r[6];
        memset(r, 0, sizeof r);
        bench_chunked(s, &o, o.chunk, 2, 1, o.profile, r);
        print_row(s, "recompute fused", &r[0], 8 * ndv, r[2].floor_ms);
        print_row(s, "recompute sm90 fp32", &r[4], 8 * ndv, r[2].floor_ms);
        print_row(s, "recompute cuBLAS", &r[2], 8 * ndv, r[2].floor_ms);
        print_row(s, "grad_in_forward fused", &r[1], 6 * ndv, r[3].floor_ms);
        print_row(s, "grad_in_forward sm90 f32", &r[5], 6 * ndv, r[3].floor_ms);
        print_row(s, "grad_in_forward cuBLAS", &r[3], 6 * ndv, r[3].floor_ms);
        /* naive: all N×V fp32 logits at once, where they fit with a GiB to spare */
        mode_result nv[6];
        memset(nv, 0, sizeof nv);
        double logits = (double)s->n * ((s->v + 15) / 16 * 16) * 4;
        double need = logits + (double)s->n * s->d * 6 + (double)s->v * s->d * 6 + 1024 * MIB;
        if (!o.naive) {
            nv[0].ok = 0;
            snprintf(nv[0].note, sizeof nv[0].note, "skipped (--no-naive)");
        } else if (need < (double)free_bytes()) {
            bench_chunked(s, &o, (int)s->n, 1, 0, 0, nv);
        } else {
            nv[0].ok = 0;
            snprintf(nv[0].note, sizeof nv[0].note, "does not fit (%.0f GiB of logits)",
                     logits / (1024 * MIB));
        }
        const mode_result *nr = nv[0].ok || !nv[2].ok ? &nv[0] : &nv[2]; /* sm90 where it ran */
        print_row(s, nr->sm90 ? "naive recompute sm90" : "naive recompute", nr, 8 * ndv,
                  r[2].floor_ms);
        fflush(stdout);
    }
    return 0;
}

#else /* built without CUDA */

int main(void)
{
    printf("kl_bench: this build has no CUDA backend (configure with -DTOPKD_CUDA=ON)\n");
    return 0;
}

#endif
