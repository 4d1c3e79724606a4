/* attn_bench.c — the speed of tkd_cuda_attn_fwd and tkd_cuda_attn_bwd, the causal GQA attention
 * forward and backward (a program, not a test; built only with the CUDA backend).
 *
 * For each shape (bf16 q, k, v, dy uniform in [-1, 1)): the median of --reps timed launches
 * (cudaEvent pairs around each call, after 2 untimed ones) of the forward with and without the lse
 * output, and of the backward (all three gradients, from the forward's y and lse). FLOPs, causal:
 * forward 4·B·H·T²·dh/2 (its two matrix products over the causal half); backward 2.5 × that (the
 * usual convention, as FlashAttention's benchmarks count it: five products, not the seven our
 * deterministic backward does); fwd+bwd 3.5 × (over the sum of the lse forward's and the backward's
 * times). Shapes: Llama 3 8B (H 32, Hkv 8, dh 128) and Qwen2 0.5B (H 14, Hkv 2, dh 64) at T = 8192
 * and 32768 (the teachers), Llama 3.2 1B (32/8/64, T 8192), the ~3B student (24/8/128, T 8192)
 * and Qwen2.5 0.5B (B 4, T 4096, 14/2/64) (issue 11's students), or those given with --shapes.
 *
 *   attn_bench [--reps 10] [--shapes BxTxHxHkvxDH,...]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/attn_cuda.h"

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

/* The buffers of one shape. */
typedef struct bufs {
    uint16_t *q, *k, *v, *y, *dy, *dq, *dk, *dv;
    float *lse;
    tkd_cuda_attn_bwd_ws *ws;
} bufs;

/* One call of what is timed: 0 forward with lse, 1 forward without, 2 backward. */
static void call(const shape *s, bufs *b, int what)
{
    tkd_status st = what == 2
        ? tkd_cuda_attn_bwd(b->dy, b->q, b->k, b->v, b->y, b->lse, s->b, s->t, s->h, s->hkv, s->dh, b->dq,
                            b->dk, b->dv, b->ws, NULL)
        : tkd_cuda_attn_fwd(b->q, b->k, b->v, s->b, s->t, s->h, s->hkv, s->dh, b->y, what == 0 ? b->lse : NULL,
                            NULL);
    if (st != TKD_OK)
        die(what == 2 ? "tkd_cuda_attn_bwd" : "tkd_cuda_attn_fwd", tkd_error_msg());
}

/* Median milliseconds of reps calls. */
static double time_call(const shape *s, bufs *b, int what, int reps)
{
    cudaEvent_t e0, e1;
    float *ms = malloc(sizeof(float) * (size_t)reps);
    CUDA(cudaEventCreate(&e0));
    CUDA(cudaEventCreate(&e1));
    for (int i = -2; i < reps; i++) {
        CUDA(cudaEventRecord(e0, 0));
        call(s, b, what);
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

static void bench_shape(const shape *s, int reps)
{
    size_t nq = (size_t)s->b * s->t * s->h * s->dh, nkv = (size_t)s->b * s->t * s->hkv * s->dh;
    bufs b;
    CUDA(cudaMalloc((void **)&b.q, nq * 2));
    CUDA(cudaMalloc((void **)&b.k, nkv * 2));
    CUDA(cudaMalloc((void **)&b.v, nkv * 2));
    CUDA(cudaMalloc((void **)&b.y, nq * 2));
    CUDA(cudaMalloc((void **)&b.dy, nq * 2));
    CUDA(cudaMalloc((void **)&b.dq, nq * 2));
    CUDA(cudaMalloc((void **)&b.dk, nkv * 2));
    CUDA(cudaMalloc((void **)&b.dv, nkv * 2));
    CUDA(cudaMalloc((void **)&b.lse, sizeof(float) * (size_t)s->b * s->h * s->t));
    if (tkd_cuda_attn_bwd_ws_create(&b.ws, s->b, s->t, s->h, s->dh) != TKD_OK)
        die("tkd_cuda_attn_bwd_ws_create", tkd_error_msg());
    fill_dev(b.q, nq, 1), fill_dev(b.k, nkv, 2), fill_dev(b.v, nkv, 3), fill_dev(b.dy, nq, 4);
    CUDA(cudaMemset(b.dq, 0, nq * 2));
    CUDA(cudaMemset(b.dk, 0, nkv * 2));
    CUDA(cudaMemset(b.dv, 0, nkv * 2));
    double flop = 4.0 * s->b * s->h * (double)s->t * s->t * s->dh / 2.0;
    double ms_lse = time_call(s, &b, 0, reps), ms = time_call(s, &b, 1, reps);
    call(s, &b, 0); /* y and lse for the backward */
    double ms_bwd = time_call(s, &b, 2, reps);
    printf("| %-12s | %d | %6d | %3d | %3d | %3d | %9.3f | %7.1f | %11.3f | %7.1f | %9.3f | %7.1f | %7.1f |\n",
           s->name, s->b, s->t, s->h, s->hkv, s->dh, ms_lse, flop / ms_lse * 1e-9, ms, flop / ms * 1e-9, ms_bwd,
           2.5 * flop / ms_bwd * 1e-9, 3.5 * flop / (ms_lse + ms_bwd) * 1e-9);
    tkd_cuda_attn_bwd_ws_free(b.ws);
    uint16_t *p16[] = {b.q, b.k, b.v, b.y, b.dy, b.dq, b.dk, b.dv};
    for (size_t i = 0; i < sizeof p16 / sizeof p16[0]; i++)
        CUDA(cudaFree(p16[i]));
    CUDA(cudaFree(b.lse));
}

int main(int argc, char **argv)
{
    shape shapes[16] = {
        {1, 8192, 32, 8, 128, "llama3-8b"},  {1, 32768, 32, 8, 128, "llama3-8b"},
        {1, 8192, 14, 2, 64, "qwen2-0.5b"},  {1, 32768, 14, 2, 64, "qwen2-0.5b"},
        {1, 8192, 32, 8, 64, "llama3.2-1b"}, {1, 8192, 24, 8, 128, "student-3b"},
        {4, 4096, 14, 2, 64, "qwen2.5-0.5b"},
    };
    int n = 7, reps = 10;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            reps = atoi(argv[++i]);
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
            fprintf(stderr, "usage: attn_bench [--reps 10] [--shapes BxTxHxHkvxDH,...]\n");
            return 2;
        }
    }
    if (reps < 1)
        die("--reps", "must be at least 1");
    struct cudaDeviceProp p;
    CUDA(cudaGetDeviceProperties(&p, 0));
    printf("attn_bench: %s, %d SMs, median of %d launches; TFLOP/s: forward 4·B·H·T²·dh/2 / time, "
           "backward 2.5 × that (convention), fwd+bwd 3.5 × that / (fwd with lse + bwd)\n\n",
           p.name, p.multiProcessorCount, reps);
    printf("| shape        | B |      T |   H | Hkv |  dh | fwd ms (lse) | TFLOP/s | fwd ms (no lse) | TFLOP/s "
           "| bwd ms | TFLOP/s | fwd+bwd TFLOP/s |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < n; i++)
        bench_shape(&shapes[i], reps);
    return 0;
}

#else /* built without CUDA (bench/CMakeLists.txt leaves this program out then) */

int main(void)
{
    printf("attn_bench: this build has no CUDA backend (configure with -DTOPKD_CUDA=ON)\n");
    return 0;
}

#endif
