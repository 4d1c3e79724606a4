/* bench_util.h — what student_bench.c and teacher_bench.c share: the table of real model shapes,
 * --shapes NAME:T:B parsing, the model config of a shape, the wall clock, device bytes in use and
 * a median. Static inline, benchmark programs only (CUDA builds). */
#ifndef TKD_BENCH_UTIL_H
#define TKD_BENCH_UTIL_H

#ifdef TKD_HAVE_CUDA
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "model/model.h"

#define BENCH_MAX_RUNS 16 /* --shapes entries at most */

typedef struct shape_def {
    const char *name;
    int arch, V, D, F, L, H, Hkv, tied, bias;
    double theta;
} shape_def;

static const shape_def kShapes[] = {
    {"llama8b", TKD_ARCH_LLAMA, 128256, 4096, 14336, 32, 32, 8, 0, 0, 500000.0},
    {"llama3b", TKD_ARCH_LLAMA, 128256, 3072, 8192, 28, 24, 8, 1, 0, 500000.0},
    {"llama1b", TKD_ARCH_LLAMA, 128256, 2048, 8192, 16, 32, 8, 1, 0, 500000.0},
    {"qwen05b", TKD_ARCH_QWEN2, 151936, 896, 4864, 24, 14, 2, 1, 1, 1000000.0},
};

typedef struct run_spec { const shape_def *s; int T, B; } run_spec;

static inline double bench_now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Device bytes in use (total − free), all processes'. */
static inline size_t bench_used_bytes(void)
{
    size_t f = 0, t = 0;
    cudaMemGetInfo(&f, &t);
    return t - f;
}

/* The median of x[0..n) (sorts x in place). */
static inline double bench_median(double *x, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && x[j] < x[j - 1]; j--) {
            double t = x[j]; x[j] = x[j - 1]; x[j - 1] = t;
        }
    return x[n / 2];
}

/* The model config of shape s for sequences of T tokens (random-init range 0.02). */
static inline void bench_config_of(const shape_def *s, int T, tkd_model_config *c)
{
    tkd_model_config_defaults(c);
    c->arch = s->arch;
    c->vocab_size = s->V;
    c->hidden_size = s->D;
    c->intermediate_size = s->F;
    c->num_hidden_layers = s->L;
    c->num_attention_heads = s->H;
    c->num_key_value_heads = s->Hkv;
    c->head_dim = s->D / s->H;
    c->max_position_embeddings = T > 8192 ? T : 8192;
    c->rope_theta = s->theta;
    c->tie_word_embeddings = s->tied;
    c->attention_bias = s->bias;
    c->initializer_range = 0.02f;
}

/* Parses "NAME:T:B,..." into rs[0..*n) (at most BENCH_MAX_RUNS); prints why to stderr, prefixed
 * with prog, and returns 1 on a malformed entry or an unknown name. */
static inline int bench_parse_shapes(const char *prog, const char *arg, run_spec *rs, int *n)
{
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", arg);
    *n = 0;
    for (char *tok = strtok(buf, ","); tok && *n < BENCH_MAX_RUNS; tok = strtok(NULL, ",")) {
        char name[64];
        int T = 0, B = 0;
        if (sscanf(tok, "%63[^:]:%d:%d", name, &T, &B) != 3 || T <= 0 || B <= 0)
            return fprintf(stderr, "%s: --shapes wants NAME:T:B, e.g. llama1b:8192:1\n", prog), 1;
        const shape_def *s = NULL;
        for (size_t i = 0; i < sizeof kShapes / sizeof kShapes[0]; i++)
            if (!strcmp(kShapes[i].name, name))
                s = &kShapes[i];
        if (!s)
            return fprintf(stderr, "%s: unknown shape %s (llama8b, llama3b, llama1b, qwen05b)\n", prog,
                           name), 1;
        rs[(*n)++] = (run_spec){s, T, B};
    }
    return 0;
}

/* The runs of a bench: the list def, or the one given by "--shapes NAME:T:B,...", which is taken out
 * of argv (*argc shrinks) so that the caller's loop sees only its own flags. Returns 1, with why on
 * stderr, on a malformed list. */
static inline int bench_take_shapes(const char *prog, const char *def, int *argc, char **argv, run_spec *rs, int *n)
{
    if (bench_parse_shapes(prog, def, rs, n))
        return 1;
    int kept = 1;
    for (int i = 1; i < *argc; i++) {
        if (!strcmp(argv[i], "--shapes") && i + 1 < *argc) {
            if (bench_parse_shapes(prog, argv[++i], rs, n))
                return 1;
        } else {
            argv[kept++] = argv[i];
        }
    }
    *argc = kept;
    argv[kept] = NULL;
    return 0;
}

#endif /* TKD_HAVE_CUDA */
#endif
