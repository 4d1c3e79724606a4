/* bench_util.h — what student_bench.c and teacher_bench.c share: the table of real model shapes,
 * --shapes NAME:T:B parsing, the model config of a shape, the wall clock, device bytes in use, a
 * median, and the tail of --profile. Static inline, benchmark programs only (CUDA builds). */
#ifndef TKD_BENCH_UTIL_H
#define TKD_BENCH_UTIL_H

#ifdef TKD_HAVE_CUDA
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "kernels/backend_profile.h"
#include "model/model.h"

#define BENCH_MAX_RUNS 16 /* --shapes entries at most */

/* --profile's tail: after a measured pass that returned st, the profiler prof's rows since its last
 * reset into rows (*n of them, TKD_PROFILE_OPS at most), then the wrapper closed (inner stays). */
static inline tkd_status bench_profile_take(tkd_backend *prof, tkd_status st, tkd_profile_row *rows, int *n)
{
    *n = 0;
    if (st == TKD_OK)
        st = tkd_backend_profile_report(prof, rows, n);
    tkd_backend_close(prof);
    return st;
}

typedef struct shape_def {
    const char *name;
    int arch, V, D, F, L, H, Hkv, tied, bias;
    double theta;
    void (*more)(tkd_model_config *c); /* what a family adds (head dim, experts, windows, YaRN), or NULL */
} shape_def;

/* Qwen3-30B-A3B's config.json: head dim 128 (≠ D/H), 128 experts of width 768, 8 a token, every
 * layer sparse. */
static inline void bench_more_qwen3_30b_a3b(tkd_model_config *c)
{
    c->head_dim = 128;
    c->num_experts = 128;
    c->num_experts_per_tok = 8;
    c->moe_intermediate_size = 768;
    c->norm_topk_prob = 1;
    for (int l = 0; l < c->num_hidden_layers; l++)
        c->layer_moe[l] = 1;
}

/* gpt-oss-20b's config.json: head dim 64, sinks (the arch's), even layers sliding over 128 tokens,
 * YaRN (factor 32 over 4096, β 32/1, not truncated), 32 experts of width 2880, 4 a token, biases,
 * the clamped SwiGLU (limit 7). */
static inline void bench_more_gpt_oss_20b(tkd_model_config *c)
{
    c->head_dim = 64;
    c->sliding_window = 128;
    for (int l = 0; l < c->num_hidden_layers; l++)
        c->layer_sliding[l] = l % 2 == 0, c->layer_moe[l] = 1;
    tkd_model_config_gpt_oss_yarn(c);
    c->num_experts = 32;
    c->num_experts_per_tok = 4;
    c->moe_intermediate_size = 2880;
    c->swiglu_limit = 7.0f;
    c->rms_norm_eps = 1e-5f;
    c->max_position_embeddings = 131072;
}

/* gpt-oss-120b: gpt-oss-20b's layer with 128 experts over 36 layers, the experts MXFP4 as released
 * (kept so where the MoE op takes them: be->moe_mxfp4; else they would need ~230 GB of bf16). */
static inline void bench_more_gpt_oss_120b(tkd_model_config *c)
{
    bench_more_gpt_oss_20b(c);
    c->num_experts = 128;
    c->quant_mxfp4 = 1;
}

static const shape_def kShapes[] = {
    {"llama8b", TKD_ARCH_LLAMA, 128256, 4096, 14336, 32, 32, 8, 0, 0, 500000.0, NULL},
    {"llama3b", TKD_ARCH_LLAMA, 128256, 3072, 8192, 28, 24, 8, 1, 0, 500000.0, NULL},
    {"llama1b", TKD_ARCH_LLAMA, 128256, 2048, 8192, 16, 32, 8, 1, 0, 500000.0, NULL},
    {"qwen05b", TKD_ARCH_QWEN2, 151936, 896, 4864, 24, 14, 2, 1, 1, 1000000.0, NULL},
    {"qwen3-8b", TKD_ARCH_QWEN3, 151936, 4096, 12288, 36, 32, 8, 0, 0, 1000000.0, NULL},
    {"qwen3-30b-a3b", TKD_ARCH_QWEN3_MOE, 151936, 2048, 6144, 48, 32, 4, 0, 0, 1000000.0, bench_more_qwen3_30b_a3b},
    {"gpt-oss-20b", TKD_ARCH_GPT_OSS, 201088, 2880, 2880, 24, 64, 8, 0, 1, 150000.0, bench_more_gpt_oss_20b},
    {"gpt-oss-120b", TKD_ARCH_GPT_OSS, 201088, 2880, 2880, 36, 64, 8, 0, 1, 150000.0, bench_more_gpt_oss_120b},
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
    if (s->more)
        s->more(c);
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
            return fprintf(stderr, "%s: unknown shape %s (llama8b, llama3b, llama1b, qwen05b, qwen3-8b, qwen3-30b-a3b, gpt-oss-20b, gpt-oss-120b)\n", prog,
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
