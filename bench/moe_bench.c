/* moe_bench.c — the CUDA MoE op (kernels/cuda/moe_cuda.h) at a real layer's shape, against the
 * plain cuBLAS GEMMs of the same FLOPs (a program, not a test; CUDA builds only).
 *
 * The floor: the gate and up projections of all N·k routed rows as one GEMM (N·k, D)·(2I, D)ᵀ,
 * and the down projection as one (N·k, I)·(D, I)ᵀ, bf16 in, fp32 out: the work of a perfectly
 * balanced grouped GEMM. Each mode: the median wall time of --reps calls (each call ends with a
 * stream sync; the op itself syncs once for the routing counts), after 2 untimed ones:
 *   same   the same input every call (identical routing: every GEMM shape seen before);
 *   fresh  a new random input before each call (untimed): the routing, so each expert's row count,
 *          is new every call, as from layer to layer and batch to batch in a dump.
 * Rows: the grouped calls (where this cuBLAS takes them) and the loop of per-expert GEMMs, with
 * exact row counts and with each rounded up to 128 (tkd_cuda_moe_ws_set_pad), auto (the
 * backend's default), and our grouped GEMMs: mma.sync (moe_gemm_cuda.h: one launch for every
 * expert's gate and up products, the act kernel, one launch for the down products) and Hopper's on
 * each schedule (gemm_sm90/moe_gemm_sm90.h: the activation in the first launch's epilogue). First a
 * probe: the status cublasGemmGroupedBatchedEx returns per type combination (0 = success,
 * 15 = CUBLAS_STATUS_NOT_SUPPORTED). With --mxfp4 also the op on the same layer's experts as
 * MXFP4 (random codes, scales 2^-9 .. 2^-6, gpt-oss's checkpoints' range): decoded inside our
 * Hopper GEMM (cooperative, its one schedule), and a layer at a time before the bf16 GEMM (the way
 * of every other device); and our Hopper MXFP4 GEMMs alone beside the bf16 ones.
 *
 *   moe_bench [--shape D:I:E:k:N] [--reps 10] [--mxfp4] [--gemms-only]
 *             (default 2048:768:128:8:8192, Qwen3-30B-A3B; --gemms-only: the floor and our GEMMs alone)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/status.h"
#include "kernels/cuda/moe_cuda.h"
#include "kernels/cuda/moe_gemm_cuda.h"
#include "kernels/gemm_sm90/moe_gemm_sm90.h"

int moe_bench_randn(uint16_t *p, size_t n, float std, uint64_t seed);
int moe_bench_gemm(void *blas, const uint16_t *a, const uint16_t *b, int m, int n, int kd, float *c);
int moe_bench_grouped_probe(void *blas, int ab, int c);
int moe_bench_bytes(uint8_t *p, size_t n, unsigned lo, unsigned span, uint64_t seed);

static void die(const char *what, const char *msg)
{
    fprintf(stderr, "moe_bench: %s: %s\n", what, msg);
    exit(1);
}

static void *dev(size_t bytes)
{
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess)
        die("cudaMalloc", "out of device memory");
    return p;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct setup {
    tkd_moe_params p;
    int N, reps;
    tkd_cuda_moe_weights w; /* bf16 experts, and with --mxfp4 also q: the MXFP4 ones */
    uint16_t *x[2], *y; /* x[0] the same input every call; x[1] drawn anew before each */
} setup;

/* Median ms of reps calls (fresh: the inputs in turn), or -1 when the mode did not run as asked
 * (cuBLAS refused the grouped call, or the device has no Hopper kernel). grouped: a
 * TKD_CUDA_MOE_GEMM_* mode; ours: a TKD_CUDA_MOE_OURS_* kernel; mx: 0 bf16 experts, 1 MXFP4
 * decoded where the op chooses, 2 MXFP4 decoded a layer at a time. */
static double time_op(const setup *s, int grouped, int pad, int ours, int fresh, int mx)
{
    tkd_cuda_moe_ws *ws = NULL;
    tkd_moe_params p = s->p;
    p.mxfp4 = mx > 0;
    if (tkd_cuda_moe_ws_create(&ws, &p, s->N, NULL) != TKD_OK)
        die("tkd_cuda_moe_ws_create", tkd_error_msg());
    tkd_cuda_moe_ws_set_grouped(ws, grouped);
    tkd_cuda_moe_ws_set_mxfp4_layer(ws, mx == 2);
    if (tkd_cuda_moe_ws_set_ours_kernel(ws, ours) != TKD_OK)
        die("tkd_cuda_moe_ws_set_ours_kernel", tkd_error_msg());
    if (ours >= TKD_CUDA_MOE_OURS_SM90_COOP && !tkd_cuda_moe_ws_ours_sm90(ws)) { /* not a Hopper device */
        tkd_cuda_moe_ws_free(ws);
        return -1.0;
    }
    if (tkd_cuda_moe_ws_set_pad(ws, pad) != TKD_OK)
        die("tkd_cuda_moe_ws_set_pad", tkd_error_msg());
    double *ms = malloc(sizeof(double) * (size_t)s->reps);
    for (int i = -2; i < s->reps; i++) {
        if (fresh && moe_bench_randn(s->x[1], (size_t)s->N * s->p.D, 1.0f, 1000 + (uint64_t)i)) /* untimed */
            die("randn", "failed");
        const double t0 = now_ms();
        if (tkd_cuda_moe_fwd(ws, &s->w, s->x[fresh], s->N, s->y, NULL, NULL) != TKD_OK)
            die("tkd_cuda_moe_fwd", tkd_error_msg());
        if (cudaDeviceSynchronize() != cudaSuccess)
            die("cudaDeviceSynchronize", "failed");
        if (i >= 0)
            ms[i] = now_ms() - t0;
    }
    const int ran = (grouped < 0 || tkd_cuda_moe_ws_ran(ws) == grouped) &&
                    (mx != 1 || tkd_cuda_moe_ws_mxfp4_in_gemm(ws));
    tkd_cuda_moe_ws_free(ws);
    qsort(ms, (size_t)s->reps, sizeof(double), cmp_double);
    const double med = ms[s->reps / 2];
    free(ms);
    return ran ? med : -1.0;
}

/* Our Hopper GEMMs alone on schedule sched (which: 0 gate/up with the activation, then down; 1
 * gate/up alone; 2 down alone), the op's routing, sort, gather, host sync and combine left out:
 * every expert N·k / E rows (the remainder to the first ones); mx: the MXFP4 launches. Median ms
 * of reps launches (or pairs), each synced; -1 on a device without the kernel. What the op spends
 * beyond the pair is the rest of the layer. */
static double time_sm90_gemms(const setup *s, int sched, int which, int mx)
{
    tkd_lmhead_sm90_ws *ws = NULL;
    if (tkd_lmhead_sm90_ws_create(&ws, sched) != TKD_OK)
        return -1.0;
    const int E = s->p.E, D = s->p.D, I = s->p.inter, P = s->N * s->p.k;
    const size_t ti = TKD_MOE_TILE_INTS;
    int32_t *counts = malloc(sizeof(int32_t) * (size_t)E);
    int32_t *h_tiles = malloc(sizeof(int32_t) * ti * (size_t)(P / 64 + E));
    for (int e = 0; e < E; e++)
        counts[e] = P / E + (e < P % E);
    const int nt = tkd_moe_gemm_tiles(counts, E, tkd_moe_gemm_sm90_tile_rows(ws), h_tiles);
    int32_t *tiles = dev(sizeof(int32_t) * ti * (size_t)nt);
    uint16_t *xs = dev((size_t)P * D * 2), *h = dev((size_t)P * I * 2), *o = dev((size_t)P * D * 2);
    if (cudaMemcpy(tiles, h_tiles, sizeof(int32_t) * ti * (size_t)nt, cudaMemcpyHostToDevice) != cudaSuccess ||
        moe_bench_randn(xs, (size_t)P * D, 1.0f, 77))
        die("setup", "failed");
    double *ms = malloc(sizeof(double) * (size_t)s->reps);
    for (int i = -2; i < s->reps; i++) {
        const double t0 = now_ms();
        const tkd_status gu = which == 2 ? TKD_OK
                              : mx ? tkd_moe_gemm_sm90_gate_up_mxfp4(ws, xs, &s->w.q, NULL, NULL, &s->p, tiles, nt, P, I,
                                                                     D, h)
                                   : tkd_moe_gemm_sm90_gate_up(ws, xs, s->w.w_gate, s->w.w_up, NULL, NULL, &s->p, tiles,
                                                               nt, P, I, D, h);
        const tkd_status dn = which == 1 || gu ? gu
                              : mx ? tkd_moe_gemm_sm90_down_mxfp4(ws, h, &s->w.q, E, tiles, nt, P, D, I, o)
                                   : tkd_moe_gemm_sm90_down(ws, h, s->w.w_down, E, tiles, nt, P, D, I, o);
        if (dn || tkd_lmhead_sm90_sync(ws))
            die("moe_gemm_sm90", tkd_error_msg());
        if (i >= 0)
            ms[i] = now_ms() - t0;
    }
    qsort(ms, (size_t)s->reps, sizeof(double), cmp_double);
    const double med = ms[s->reps / 2];
    free(ms), free(counts), free(h_tiles);
    cudaFree(tiles), cudaFree(xs), cudaFree(h), cudaFree(o);
    tkd_lmhead_sm90_ws_free(ws);
    return med;
}

/* Median ms of the floor's two GEMMs over the N·k routed rows. */
static double time_floor(const setup *s, void *blas)
{
    const int P = s->N * s->p.k, D = s->p.D, I = s->p.inter;
    uint16_t *xs = dev((size_t)P * (D > I ? D : I) * 2);
    float *c = dev((size_t)P * (2 * I > D ? 2 * I : D) * 4);
    if (moe_bench_randn(xs, (size_t)P * (D > I ? D : I), 1.0f, 99))
        die("randn", "failed");
    double *ms = malloc(sizeof(double) * (size_t)s->reps);
    for (int i = -2; i < s->reps; i++) {
        cudaDeviceSynchronize();
        const double t0 = now_ms();
        /* w_gate and w_up lie back to back for expert 0 onward: (2I, D) rows of the same stack */
        if (moe_bench_gemm(blas, xs, s->w.w_gate, P, 2 * I, D, c) || moe_bench_gemm(blas, xs, s->w.w_down, P, D, I, c))
            die("cublasGemmEx", "failed");
        cudaDeviceSynchronize();
        if (i >= 0)
            ms[i] = now_ms() - t0;
    }
    qsort(ms, (size_t)s->reps, sizeof(double), cmp_double);
    const double med = ms[s->reps / 2];
    free(ms);
    cudaFree(xs);
    cudaFree(c);
    return med;
}

int main(int argc, char **argv)
{
    int D = 2048, I = 768, E = 128, k = 8, N = 8192, reps = 10, mxfp4 = 0, gemms_only = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            if (sscanf(argv[++i], "%d:%d:%d:%d:%d", &D, &I, &E, &k, &N) != 5)
                die("--shape", "expected D:I:E:k:N");
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--mxfp4")) {
            mxfp4 = 1;
        } else if (!strcmp(argv[i], "--gemms-only")) {
            gemms_only = 1;
        } else {
            fprintf(stderr, "usage: moe_bench [--shape D:I:E:k:N] [--reps 10] [--mxfp4] [--gemms-only]\n");
            return 2;
        }
    }
    if (reps < 1 || D < 1 || I < 1 || E < 2 || k < 1 || k > E || N < 1)
        die("arguments", "need reps, D, I, N ≥ 1, E ≥ 2, 1 ≤ k ≤ E");
    if (mxfp4 && (D % 32 || I % 32))
        die("--mxfp4", "needs D and I multiples of 32");
    cublasHandle_t blas;
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS)
        die("cublasCreate", "failed");
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("moe_bench: %s; D %d, I %d, E %d, k %d, N %d; median of %d calls (wall, each synced)\n\n", prop.name, D, I,
           E, k, N, reps);
    static const char *const kType[3] = {"bf16", "fp16", "fp32"};
    printf("cublasGemmGroupedBatchedEx status (0 ok, 15 not supported), compute 32F:");
    for (int ab = 0; ab < 3; ab++)
        for (int c = 0; c < 3; c++)
            if (c >= ab || c == 2)
                printf(" %s->%s %d;", kType[ab], kType[c], moe_bench_grouped_probe(blas, ab, c));
    printf("\n\n");

    setup s = {.p = tkd_moe_params_qwen3(D, I, E, k, 1), .N = N, .reps = reps};
    const size_t nw = (size_t)E * I * D;
    uint16_t *w = dev(3 * nw * 2), *router = dev((size_t)E * D * 2);
    if (moe_bench_randn(w, 3 * nw, 0.02f, 1) || moe_bench_randn(router, (size_t)E * D, 0.02f, 2))
        die("randn", "failed");
    s.w = (tkd_cuda_moe_weights){.router_w = router, .w_gate = w, .w_up = w + nw, .w_down = w + 2 * nw};
    uint8_t *codes = NULL, *scales = NULL;
    if (mxfp4) { /* the three stacks back to back: (E, I, D/2) twice, (E, D, I/2) */
        codes = dev(3 * nw / 2), scales = dev(3 * nw / 32);
        if (moe_bench_bytes(codes, 3 * nw / 2, 0, 256, 3) || moe_bench_bytes(scales, 3 * nw / 32, 118, 4, 4))
            die("random bytes", "failed");
        for (int j = 0; j < 3; j++)
            s.w.q.blocks[j] = codes + (size_t)j * nw / 2, s.w.q.scales[j] = scales + (size_t)j * nw / 32;
    }
    for (int i = 0; i < 2; i++) {
        s.x[i] = dev((size_t)N * D * 2);
        if (moe_bench_randn(s.x[i], (size_t)N * D, 1.0f, 10 + (uint64_t)i))
            die("randn", "failed");
    }
    s.y = dev((size_t)N * D * 2);
    const double fl = time_floor(&s, blas);
    const double flop = 2.0 * N * k * 3.0 * I * D;
    printf("| GEMMs | same ms | fresh ms | fresh / floor | TFLOP/s (fresh) |\n|---|---:|---:|---:|---:|\n");
    printf("| floor: 2 plain GEMMs over N·k rows | %.3f | - | 1.00 | %.0f |\n", fl, flop / (fl * 1e9));
    static const struct { int grouped, pad, ours, mx; const char *name; } kModes[] = {
        {TKD_CUDA_MOE_GEMM_GROUPED, 1, 0, 0, "grouped (2 cuBLAS calls)"},
        {TKD_CUDA_MOE_GEMM_LOOP, 1, 0, 0, "loop (3·E calls), exact rows"},
        {TKD_CUDA_MOE_GEMM_LOOP, 128, 0, 0, "loop, rows to 128"},
        {TKD_CUDA_MOE_GEMM_AUTO, 128, TKD_CUDA_MOE_OURS_DEFAULT, 0, "auto (the default)"},
        {TKD_CUDA_MOE_GEMM_OURS, 1, TKD_CUDA_MOE_OURS_MMA_SYNC, 0, "ours, mma.sync (moe_gemm_cuda, + act kernel)"},
        {TKD_CUDA_MOE_GEMM_OURS, 1, TKD_CUDA_MOE_OURS_SM90_COOP, 0, "ours, Hopper cooperative (moe_gemm_sm90)"},
        {TKD_CUDA_MOE_GEMM_OURS, 1, TKD_CUDA_MOE_OURS_SM90_PINGPONG, 0, "ours, Hopper ping-pong (moe_gemm_sm90)"},
        {TKD_CUDA_MOE_GEMM_OURS, 1, TKD_CUDA_MOE_OURS_SM90_MIXED, 0, "ours, Hopper, gate/up coop, down ping-pong"},
        {TKD_CUDA_MOE_GEMM_AUTO, 128, TKD_CUDA_MOE_OURS_DEFAULT, 1, "MXFP4, auto (the default)"},
        {TKD_CUDA_MOE_GEMM_OURS, 1, TKD_CUDA_MOE_OURS_SM90_COOP, 1, "MXFP4 in our Hopper GEMM (cooperative only)"},
        {TKD_CUDA_MOE_GEMM_OURS, 1, TKD_CUDA_MOE_OURS_DEFAULT, 2, "MXFP4 a layer at a time, then ours"}};
    for (size_t m = 0; m < sizeof kModes / sizeof kModes[0] && !gemms_only; m++) {
        if (kModes[m].mx && !mxfp4)
            continue;
        const double same = time_op(&s, kModes[m].grouped, kModes[m].pad, kModes[m].ours, 0, kModes[m].mx);
        if (same < 0) {
            printf("| %s | refused (this cuBLAS, or not a Hopper device) | | | |\n", kModes[m].name);
            continue;
        }
        const double fresh = time_op(&s, kModes[m].grouped, kModes[m].pad, kModes[m].ours, 1, kModes[m].mx);
        printf("| %s | %.3f | %.3f | %.2f | %.0f |\n", kModes[m].name, same, fresh, fresh / fl, flop / (fresh * 1e9));
    }
    printf("\nour Hopper GEMMs alone (balanced routing: N·k / E rows an expert; no routing, sort, gather, sync, "
           "combine; TFLOP/s of gate/up and down each over their own FLOPs, 2/3 and 1/3 of the pair's):\n\n"
           "| schedule | pair ms | / floor | TFLOP/s | gate/up ms | TFLOP/s | down ms | TFLOP/s |\n"
           "|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int sc = 0; sc < (mxfp4 ? 3 : 2); sc++) { /* MXFP4 runs on the cooperative schedule only */
        const int sched = sc == 1 ? TKD_LMHEAD_SM90_SCHED_PINGPONG : TKD_LMHEAD_SM90_SCHED_COOP, mx = sc == 2;
        const char *name = sc == 0 ? "cooperative" : sc == 1 ? "ping-pong" : "MXFP4, cooperative";
        const double g = time_sm90_gemms(&s, sched, 0, mx);
        if (g < 0) {
            printf("| %s | not a Hopper device | | | | | | |\n", name);
            continue;
        }
        const double gu = time_sm90_gemms(&s, sched, 1, mx), dn = time_sm90_gemms(&s, sched, 2, mx);
        printf("| %s | %.3f | %.2f | %.0f | %.3f | %.0f | %.3f | %.0f |\n", name, g, g / fl, flop / (g * 1e9), gu,
               flop * 2 / 3 / (gu * 1e9), dn, flop / 3 / (dn * 1e9));
    }
    cublasDestroy(blas);
    return 0;
}
