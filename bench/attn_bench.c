/* attn_bench.c — the speed of tkd_cuda_attn_fwd, the causal GQA attention forward, next to cuDNN's
 * fused attention through tkd_cudnn_attn_fwd (a program, not a test; built only with the CUDA
 * backend).
 *
 * For each shape (B = 1, bf16 q, k, v uniform in [-1, 1)): the median of --reps timed launches
 * (cudaEvent pairs around each launch, after 2 untimed ones), with and without the lse output,
 * and TFLOP/s counting the two matrix products over the causal half: 4·B·H·T²·dh / 2; ours first,
 * then cuDNN's, whose first call per shape also builds its plan (that wall time is the "plan ms"
 * column, with lse, then without), and the last column is the largest |difference| between the
 * two's y and lse over the whole output, a sanity check (tests/test_gpu_attn_cudnn.c holds the
 * tolerances). A shape cuDNN refuses shows "refused" and its message goes to stderr.
 * Shapes: Llama 3 8B (H 32, Hkv 8, dh 128) and Qwen2 0.5B (H 14, Hkv 2, dh 64) at T = 8192 and
 * 32768, or those given with --shapes.
 *
 *   attn_bench [--reps 10] [--shapes BxTxHxHkvxDH,...]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/status.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/attn_cuda.h"
#include "kernels/attn_cudnn.h"

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

/* One forward: ours when cudnn is NULL, else cuDNN's. */
static tkd_status fwd(tkd_cudnn_attn *cudnn, const shape *s, const uint16_t *q, const uint16_t *k,
                      const uint16_t *v, uint16_t *y, float *lse)
{
    if (!cudnn)
        return tkd_cuda_attn_fwd(q, k, v, s->b, s->t, s->h, s->hkv, s->dh, y, lse, NULL);
    return tkd_cudnn_attn_fwd(cudnn, q, k, v, s->b, s->t, s->h, s->hkv, s->dh, y, lse, NULL);
}

/* Median milliseconds of reps launches, or -1 when cuDNN refuses the shape (message on stderr).
 * *first_ms: wall time of the first (untimed) call, through its completion. */
static double time_fwd(tkd_cudnn_attn *cudnn, const shape *s, const uint16_t *q, const uint16_t *k,
                       const uint16_t *v, uint16_t *y, float *lse, int reps, double *first_ms)
{
    cudaEvent_t e0, e1;
    float *ms = malloc(sizeof(float) * (size_t)reps);
    CUDA(cudaDeviceSynchronize());
    const double t0 = wall_ms();
    tkd_status st = fwd(cudnn, s, q, k, v, y, lse);
    CUDA(cudaDeviceSynchronize());
    *first_ms = wall_ms() - t0;
    if (st == TKD_ERR_UNSUPPORTED && cudnn) {
        fprintf(stderr, "attn_bench: %dx%dx%dx%dx%d %s lse: %s\n", s->b, s->t, s->h, s->hkv, s->dh,
                lse ? "with" : "without", tkd_error_msg());
        free(ms);
        return -1.0;
    }
    if (st != TKD_OK)
        die(cudnn ? "tkd_cudnn_attn_fwd" : "tkd_cuda_attn_fwd", tkd_error_msg());
    CUDA(cudaEventCreate(&e0));
    CUDA(cudaEventCreate(&e1));
    for (int i = -1; i < reps; i++) {
        CUDA(cudaEventRecord(e0, 0));
        st = fwd(cudnn, s, q, k, v, y, lse);
        if (st != TKD_OK)
            die(cudnn ? "tkd_cudnn_attn_fwd" : "tkd_cuda_attn_fwd", tkd_error_msg());
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

static float bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* max |y_ours − y_cudnn| and max |lse_ours − lse_cudnn| over the whole output (a sanity check
 * next to the timings: the test holds the tolerances). */
static void compare(tkd_cudnn_attn *cudnn, const shape *s, const uint16_t *q, const uint16_t *k,
                    const uint16_t *v, uint16_t *y, float *lse, double *dy, double *dl)
{
    size_t nq = (size_t)s->b * s->t * s->h * s->dh, nl = (size_t)s->b * s->h * s->t;
    uint16_t *y0 = malloc(nq * 2), *y1 = malloc(nq * 2);
    float *l0 = malloc(nl * 4), *l1 = malloc(nl * 4);
    if (!y0 || !y1 || !l0 || !l1)
        die("malloc", "out of host memory");
    if (fwd(NULL, s, q, k, v, y, lse) != TKD_OK)
        die("tkd_cuda_attn_fwd", tkd_error_msg());
    CUDA(cudaMemcpy(y0, y, nq * 2, cudaMemcpyDeviceToHost));
    CUDA(cudaMemcpy(l0, lse, nl * 4, cudaMemcpyDeviceToHost));
    if (fwd(cudnn, s, q, k, v, y, lse) != TKD_OK)
        die("tkd_cudnn_attn_fwd", tkd_error_msg());
    CUDA(cudaMemcpy(y1, y, nq * 2, cudaMemcpyDeviceToHost));
    CUDA(cudaMemcpy(l1, lse, nl * 4, cudaMemcpyDeviceToHost));
    *dy = *dl = 0.0;
    for (size_t i = 0; i < nq; i++) {
        double d = fabs((double)bf16_to_f32(y0[i]) - bf16_to_f32(y1[i]));
        *dy = d > *dy || d != d ? d : *dy;
    }
    for (size_t i = 0; i < nl; i++) {
        double d = fabs((double)l0[i] - l1[i]);
        *dl = d > *dl || d != d ? d : *dl;
    }
    free(y0), free(y1), free(l0), free(l1);
}

/* "| ms | TFLOP/s " cells of one timing, or "refused" ones. */
static void print_cells(double ms, double flop)
{
    if (ms < 0)
        printf("| %9s | %7s ", "refused", "-");
    else
        printf("| %9.3f | %7.1f ", ms, flop / ms * 1e-9);
}

static void bench_shape(tkd_cudnn_attn *cudnn, const shape *s, int reps)
{
    size_t nq = (size_t)s->b * s->t * s->h * s->dh, nkv = (size_t)s->b * s->t * s->hkv * s->dh;
    uint16_t *q, *k, *v, *y;
    float *lse;
    CUDA(cudaMalloc((void **)&q, nq * 2));
    CUDA(cudaMalloc((void **)&k, nkv * 2));
    CUDA(cudaMalloc((void **)&v, nkv * 2));
    CUDA(cudaMalloc((void **)&y, nq * 2));
    CUDA(cudaMalloc((void **)&lse, sizeof(float) * (size_t)s->b * s->h * s->t));
    fill_dev(q, nq, 1), fill_dev(k, nkv, 2), fill_dev(v, nkv, 3);
    double flop = 4.0 * s->b * s->h * (double)s->t * s->t * s->dh / 2.0, first[4] = {0, 0, 0, 0};
    double ms[4] = {time_fwd(NULL, s, q, k, v, y, lse, reps, &first[0]),
                    time_fwd(NULL, s, q, k, v, y, NULL, reps, &first[1]), -1.0, -1.0};
    if (cudnn) {
        ms[2] = time_fwd(cudnn, s, q, k, v, y, lse, reps, &first[2]);
        ms[3] = time_fwd(cudnn, s, q, k, v, y, NULL, reps, &first[3]);
    }
    printf("| %-12s | %d | %6d | %3d | %3d | %3d ", s->name, s->b, s->t, s->h, s->hkv, s->dh);
    for (int i = 0; i < 4; i++)
        print_cells(ms[i], flop);
    if (cudnn && ms[2] >= 0) {
        double dy, dl;
        compare(cudnn, s, q, k, v, y, lse, &dy, &dl);
        printf("| %6.0f / %-6.0f | %.2g / %.2g |\n", first[2], first[3], dy, dl);
    } else {
        printf("| %15s | - |\n", cudnn ? "refused" : "no cuDNN");
    }
    CUDA(cudaFree(q));
    CUDA(cudaFree(k));
    CUDA(cudaFree(v));
    CUDA(cudaFree(y));
    CUDA(cudaFree(lse));
}

int main(int argc, char **argv)
{
    shape shapes[16] = {
        {1, 8192, 32, 8, 128, "llama3-8b"}, {1, 32768, 32, 8, 128, "llama3-8b"},
        {1, 8192, 14, 2, 64, "qwen2-0.5b"}, {1, 32768, 14, 2, 64, "qwen2-0.5b"},
    };
    int n = 4, reps = 10;
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
    tkd_cudnn_attn *cudnn = NULL;
    if (tkd_cudnn_attn_create(&cudnn) != TKD_OK)
        fprintf(stderr, "attn_bench: no cuDNN column: %s\n", tkd_error_msg());
    printf("attn_bench: %s, %d SMs, median of %d launches; TFLOP/s = 4·B·H·T²·dh/2 / time\n\n", p.name,
           p.multiProcessorCount, reps);
    printf("| shape        | B |      T |   H | Hkv |  dh | ours ms (lse) | TFLOP/s | ours ms (no lse) | TFLOP/s "
           "| cuDNN ms (lse) | TFLOP/s | cuDNN ms (no lse) | TFLOP/s | cuDNN plan ms (lse / no) "
           "| max abs diff y / lse |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < n; i++)
        bench_shape(cudnn, &shapes[i], reps);
    tkd_cudnn_attn_free(cudnn);
    return 0;
}

#else /* built without CUDA (bench/CMakeLists.txt leaves this program out then) */

int main(void)
{
    printf("attn_bench: this build has no CUDA backend (configure with -DTOPKD_CUDA=ON)\n");
    return 0;
}

#endif
