/* teacher_bench.c — teacher-dump's GPU speed at real shapes (a program, not a test).
 *
 * For each shape (random weights drawn on the device, teacher_bench_cuda.cu; no checkpoint file) on
 * the CUDA backend, with B sequences of T random tokens:
 *   fwd       the model forward alone (to the final hidden states), median of --reps;
 *   fwd+topk  forward + the LM head with top-k 100 + LSE copied to the host (what a dump computes);
 *   dump      the whole teacher-dump (tkd_dump_run with the model in memory): --batches batches
 *             (shards of 8 batches, so every 8th batch also pays a shard finish: fsync, sha256, manifest)
 *             computed, top-k'd and written as zstd HDF5 shards under --out by the writer thread;
 *   floor     the plain cuBLAS bf16 GEMMs the forward must do (q, k, v, o, gate, up, down per layer
 *             and the LM head into fp32), measured in the same run: the GEMM rate and our ratio to it;
 *             the LM head's GEMM alone is reported too, and fwd+head = the forward with its logits
 *             GEMM (what transformers' forward computes) = fwd + that GEMM's time.
 * MFU = (2·N_params + 4·L·T·D) · tokens/s ÷ 989 TFLOP/s (dense bf16 peak of an H100/H200 SXM), with
 * N_params the parameters a token uses (an MoE layer's k experts of E). Shapes: llama8b, llama3b,
 * llama1b, qwen05b, and issue 22's teachers qwen3-8b, qwen3-30b-a3b, gpt-oss-20b, gpt-oss-120b (MXFP4
 * experts; fits one H200 only once the CUDA MoE op keeps them MXFP4) (bench_util.h).
 * Memory: device bytes in use after the run minus before the model (nothing is freed in between,
 * so it is the peak of our allocations; cuBLAS's own workspaces included).
 *
 * --profile: after the timed runs, two more forward + top-k passes through kernels/backend_profile.h's
 * wrapper, the second measured: a table per shape of where the forward's time goes, op by op
 * (printed after the main table).
 *
 *   teacher_bench [--shapes llama8b:8192:1,qwen05b:2048:16] [--reps 3] [--batches 16] [--out DIR]
 *                 [--profile]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <errno.h>

#include "common/fileio.h"
#include "common/status.h"

#ifdef TKD_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/backend.h"
#include "bench/bench_util.h"
#include "model/model.h"
#include "teacher_cache/dump.h"
#include "teacher_cache/dump_config.h"

#define PEAK_FLOPS 989e12
#define TOPK 100

int bench_fill_weights_cuda(tkd_model *m, uint64_t seed); /* teacher_bench_cuda.cu */

static FILE *g_prof; /* --profile: the per-shape tables, printed after the main one */
static char *g_prof_buf;
static size_t g_prof_len;

static int die(const char *what)
{
    fprintf(stderr, "teacher_bench: %s: %s\n", what, tkd_error_msg());
    return 1;
}

typedef struct timings { double fwd, topk, floor_ms, head_ms, dump_tps, dump_s; int ok; } timings;

typedef struct host_out { uint32_t *idx; float *val, *lse; int64_t *seq; int32_t *pos; } host_out;

static tkd_status fwd_once(tkd_model *m, const int32_t *tok, int B, int T, host_out *o, int topk)
{
    const void *h = NULL;
    TKD_TRY(tkd_model_forward(m, tok, B, T, 0, &h));
    if (!topk)
        return m->be->op->sync(m->be);
    tkd_lmhead_topk_args a = {.hidden = h, .w = tkd_model_lm_head_dev(m), .rows = (int64_t)B * T,
                              .d = m->cfg.hidden_size, .v = m->cfg.vocab_size, .k = TOPK, .tau = 1.0f,
                              .chunk_rows = 4096, .s = 0, .seed = 1, .row_seq = o->seq, .row_pos = o->pos,
                              .idx = o->idx, .val = o->val, .lse = o->lse, .tail = NULL};
    return m->be->op->lmhead_topk(m->be, &a);
}

/* One cuBLAS bf16 GEMM y (N, M) = x (N, K) · Wᵀ with fp32 accumulation (out fp32 when out32). */
static int gemm(cublasHandle_t h, const void *x, const void *w, void *y, int N, int K, int M, int out32)
{
    const float one = 1.0f, zero = 0.0f;
    return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, M, N, K, &one, w, CUDA_R_16BF, K, x, CUDA_R_16BF, K, &zero, y,
                        out32 ? CUDA_R_32F : CUDA_R_16BF, M, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) !=
           CUBLAS_STATUS_SUCCESS;
}

/* Layer l's MLP GEMMs on scratch buffers: the dense SwiGLU's three, or an MoE layer's router and its
 * experts' three as if the N·k rows routed to them were one GEMM each (the grouped GEMM's floor). */
static int mlp_gemms(cublasHandle_t h, const tkd_model_config *c, int l, void *x, void *w, void *y, int N)
{
    int D = c->hidden_size, F = c->intermediate_size;
    if (!tkd_model_config_moe(c, l))
        return gemm(h, x, w, y, N, D, F, 0) | gemm(h, x, w, y, N, D, F, 0) | gemm(h, x, w, y, N, F, D, 0);
    int P = N * c->num_experts_per_tok, I = c->moe_intermediate_size;
    return gemm(h, x, w, y, N, D, c->num_experts, 0) | gemm(h, x, w, y, P, D, I, 0) | gemm(h, x, w, y, P, D, I, 0) |
           gemm(h, x, w, y, P, I, D, 0);
}

/* The forward's GEMMs on scratch buffers: ms of one pass (median of reps), and in *head_ms the LM
 * head's N x D x V GEMM into fp32 alone (the part of a forward that makes the logits). */
static double gemm_floor(const tkd_model_config *c, int N, int reps, double *head_ms)
{
    size_t D = c->hidden_size, Q = (size_t)c->num_attention_heads * c->head_dim;
    size_t F = tkd_model_config_has_moe(c) && (size_t)c->moe_intermediate_size > (size_t)c->intermediate_size
                   ? (size_t)c->moe_intermediate_size : (size_t)c->intermediate_size;
    size_t rows = (size_t)N * (tkd_model_config_has_moe(c) ? c->num_experts_per_tok : 1);
    size_t KV = (size_t)c->num_key_value_heads * c->head_dim, V = c->vocab_size;
    size_t wmax = F * D > V * D ? F * D : V * D, amax = rows * (F > Q ? F : Q > D ? Q : D);
    void *x = NULL, *w = NULL, *y = NULL;
    cublasHandle_t h = NULL;
    double t[16], th[16], ms = -1;
    size_t ybytes = (size_t)N * V * 4 > rows * (F > D ? F : D) * 4 ? (size_t)N * V * 4 : rows * (F > D ? F : D) * 4;
    if (cudaMalloc(&x, amax * 2) || cudaMalloc(&w, wmax * 2) || cudaMalloc(&y, ybytes) || cublasCreate(&h))
        goto out;
    cudaMemset(x, 0, amax * 2);
    cudaMemset(w, 0, wmax * 2);
    for (int r = 0; r < reps + 1 && r < 16; r++) {
        cudaDeviceSynchronize();
        double t0 = bench_now_s();
        int bad = 0;
        for (int l = 0; l < c->num_hidden_layers; l++) {
            bad |= gemm(h, x, w, y, N, D, Q, 0) | gemm(h, x, w, y, N, D, KV, 0) | gemm(h, x, w, y, N, D, KV, 0);
            bad |= gemm(h, x, w, y, N, Q, D, 0) | mlp_gemms(h, c, l, x, w, y, N);
        }
        cudaDeviceSynchronize();
        double t1 = bench_now_s();
        bad |= gemm(h, x, w, y, N, D, V, 1);
        cudaDeviceSynchronize();
        if (bad)
            goto out;
        t[r] = (bench_now_s() - t0) * 1e3;
        th[r] = (bench_now_s() - t1) * 1e3;
    }
    ms = bench_median(t + 1, reps);
    *head_ms = bench_median(th + 1, reps);
out:
    if (h)
        cublasDestroy(h);
    cudaFree(x);
    cudaFree(w);
    cudaFree(y);
    return ms;
}

/* Two forward + top-k passes with the model's backend wrapped by the profiler, the first to make
 * the wrapper's mark storage, the second measured: its table into g_prof. */
static tkd_status profile_fwd(tkd_model *m, const int32_t *tok, const run_spec *r, host_out *o)
{
    tkd_backend *bare = m->be, *prof = NULL;
    TKD_TRY(tkd_backend_profile_wrap(bare, &prof));
    m->be = prof;
    tkd_status st = fwd_once(m, tok, r->B, r->T, o, 1);
    tkd_backend_profile_reset(prof);
    const double t0 = bench_now_s();
    if (st == TKD_OK)
        st = fwd_once(m, tok, r->B, r->T, o, 1);
    const double ms = (bench_now_s() - t0) * 1e3;
    m->be = bare;
    tkd_profile_row rows[TKD_PROFILE_OPS];
    int n = 0;
    TKD_TRY(bench_profile_take(prof, st, rows, &n));
    double sum = 0.0;
    fprintf(g_prof, "\nProfile of one %s forward + top-k, T %d x B %d (%.1f ms wall):\n\n"
                    "| op | calls | ms | %% of the pass |\n|---|---:|---:|---:|\n", r->s->name, r->T, r->B, ms);
    for (int i = 0; i < n; i++) {
        sum += rows[i].ms;
        fprintf(g_prof, "| %s | %lld | %.2f | %.1f |\n", rows[i].op, (long long)rows[i].calls, rows[i].ms,
                100.0 * rows[i].ms / ms);
    }
    fprintf(g_prof, "| (all ops) | | %.2f | %.1f |\n| (outside ops: host, gaps) | | %.2f | %.1f |\n", sum,
            100.0 * sum / ms, ms - sum, 100.0 * (ms - sum) / ms);
    return TKD_OK;
}

static tkd_status write_npy_tokens(const char *path, int64_t n, int V)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return tkd_error_set(TKD_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    char hdr[128];
    int len = snprintf(hdr, sizeof hdr, "{'descr': '<i4', 'fortran_order': False, 'shape': (%lld,), }",
                       (long long)n);
    int pad = 64 - (10 + len + 1) % 64;
    fwrite("\x93NUMPY\x01\x00", 1, 8, f);
    uint16_t hl = (uint16_t)(len + pad + 1);
    fwrite(&hl, 2, 1, f);
    fwrite(hdr, 1, len, f);
    for (int i = 0; i < pad; i++)
        fputc(' ', f);
    fputc('\n', f);
    uint64_t s = 12345;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        int32_t t = (int32_t)((s >> 33) % (uint64_t)V);
        fwrite(&t, 4, 1, f);
    }
    return fclose(f) == 0 ? TKD_OK : tkd_error_set(TKD_ERR_IO, "%s: write failed", path);
}

/* The whole dump: --batches batches of B sequences written under out/<shape>. */
static tkd_status whole_dump(tkd_model *m, const run_spec *r, int batches, const char *out, timings *tm)
{
    char dir[4096], tok[4200], yaml[16384];
    snprintf(dir, sizeof dir, "%s/%s-%dx%d", out, r->s->name, r->T, r->B);
    snprintf(tok, sizeof tok, "%s.npy", dir);
    int64_t nseq = (int64_t)batches * r->B;
    TKD_TRY(tkd_mkdir_p(out));
    TKD_TRY(write_npy_tokens(tok, nseq * r->T + 1, r->s->V));
    snprintf(yaml, sizeof yaml,
             "teacher: {path: 'random:%s'}\ndata: {paths: ['%s'], seq_len: %d}\n"
             "cache: {k: %d, shard_sequences: %d}\nrun: {batch_size: %d}\nlm_head: {chunk_rows: 0}\n"
             "device: cuda\noutput: {dir: '%s'}\n",
             r->s->name, tok, r->T, TOPK, r->B * 8, r->B, dir);
    tkd_dump_config cfg;
    memset(&cfg, 0, sizeof cfg);
    TKD_TRY(tkd_config_defaults(&tkd_dump_schema, &cfg));
    tkd_status st = tkd_config_apply_string(&tkd_dump_schema, &cfg, "teacher_bench", yaml, strlen(yaml));
    if (st == TKD_OK)
        st = tkd_dump_config_finalize(&cfg, NULL);
    tkd_dump_opts o = {.overwrite = true, .teacher = m, .teacher_seed = 1};
    tkd_dump_summary sum;
    if (st == TKD_OK)
        st = tkd_dump_run(&cfg, &o, &sum);
    tkd_config_free(&tkd_dump_schema, &cfg);
    if (st == TKD_OK) {
        tm->dump_s = sum.seconds;
        tm->dump_tps = sum.tokens_run / sum.seconds;
    }
    return st;
}

/* Weights a token's per-layer GEMMs multiply by (no embedding, norms or LM head); an MoE layer
 * counts its router and the k experts a token uses. */
static double gemm_params(const tkd_model_config *c)
{
    double D = c->hidden_size, F = c->intermediate_size, Q = (double)c->num_attention_heads * c->head_dim;
    double KV = (double)c->num_key_value_heads * c->head_dim, n = 0;
    for (int l = 0; l < c->num_hidden_layers; l++)
        n += D * Q + 2 * D * KV + Q * D +
             (tkd_model_config_moe(c, l) ? D * c->num_experts + 3.0 * D * c->moe_intermediate_size * c->num_experts_per_tok
                                        : 3 * D * F);
    return n;
}

/* Parameters a token uses (MFU's N): all of a dense model's; an MoE model's without the experts
 * its router did not pick (E − k of each MoE layer's). */
static double params_of(const tkd_model *m)
{
    const tkd_model_config *c = &m->cfg;
    double unused = 0, kept = 0; /* kept: MXFP4 experts, outside the layout's n_params */
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (tkd_model_config_moe(c, l)) {
            unused += 3.0 * c->hidden_size * c->moe_intermediate_size * (c->num_experts - c->num_experts_per_tok);
            kept += c->experts_mxfp4 ? 3.0 * c->hidden_size * c->moe_intermediate_size * c->num_experts : 0.0;
        }
    return (double)m->n_params + kept - unused;
}

static int run_one(const run_spec *r, int reps, int batches, const char *out)
{
    tkd_model_config c;
    bench_config_of(r->s, r->T, &c);
    size_t base = bench_used_bytes();
    tkd_backend *be = NULL;
    tkd_model *m = NULL;
    if (tkd_backend_open(TKD_DEVICE_CUDA, 0, &be) != TKD_OK)
        return die("backend");
    double t0 = bench_now_s();
    if (tkd_model_create_unset(&c, be, &m) != TKD_OK)
        return die("model");
    if (bench_fill_weights_cuda(m, 1))
        return fprintf(stderr, "teacher_bench: filling the weights on the device failed\n"), 1;
    double init_s = bench_now_s() - t0;
    int N = r->B * r->T;
    int32_t *tok = malloc(sizeof(int32_t) * N);
    for (int i = 0; i < N; i++)
        tok[i] = (int32_t)((i * 2654435761u) % (unsigned)c.vocab_size);
    host_out o;
    be->op->host_alloc(be, sizeof(uint32_t) * N * TOPK, (void **)&o.idx);
    be->op->host_alloc(be, sizeof(float) * N * TOPK, (void **)&o.val);
    be->op->host_alloc(be, sizeof(float) * N, (void **)&o.lse);
    o.seq = calloc(N, sizeof *o.seq);
    o.pos = calloc(N, sizeof *o.pos);
    timings tm = {0};
    double tf[16], tt[16];
    for (int i = 0; i < reps + 1 && i < 16; i++) {
        double a = bench_now_s();
        if (fwd_once(m, tok, r->B, r->T, &o, 0) != TKD_OK)
            return die("forward");
        double b = bench_now_s();
        if (fwd_once(m, tok, r->B, r->T, &o, 1) != TKD_OK)
            return die("forward + top-k");
        tf[i] = (b - a) * 1e3;
        tt[i] = (bench_now_s() - b) * 1e3;
    }
    tm.fwd = bench_median(tf + 1, reps);
    tm.topk = bench_median(tt + 1, reps);
    if (g_prof && profile_fwd(m, tok, r, &o) != TKD_OK)
        return die("profiled forward");
    if (out && whole_dump(m, r, batches, out, &tm) != TKD_OK)
        return die("dump");
    double mem = (bench_used_bytes() - base) / 1073741824.0;
    tm.floor_ms = gemm_floor(&c, N, reps, &tm.head_ms);
    double fpt = 2 * params_of(m) + 4.0 * c.num_hidden_layers * r->T * c.hidden_size;
    double gemm_fpt = 2.0 * (gemm_params(&c) + (double)c.vocab_size * c.hidden_size); /* the floor's work */
    double tps_f = N / (tm.fwd * 1e-3), tps_t = N / (tm.topk * 1e-3);
    double dump_ms = out ? N / tm.dump_tps * 1e3 : 0;
    printf("| %s | %d x %d | %.1f | %.0f | %.0f | %.0f | %.0f | %.3f | %.3f | %.1f | %.1f | %.3f | %.3f | %.3f | %.1f | "
           "%.1f |\n",
           r->s->name, r->T, r->B, init_s, tps_f, N / ((tm.fwd + tm.head_ms) * 1e-3), tps_t, tm.dump_tps,
           out ? dump_ms / tm.fwd : 0, out ? dump_ms / (tm.fwd + tm.head_ms) : 0, tm.floor_ms, tm.head_ms,
           tm.fwd / (tm.floor_ms - tm.head_ms), fpt * tps_t / PEAK_FLOPS, fpt * tm.dump_tps / PEAK_FLOPS, mem,
           gemm_fpt * N / (tm.floor_ms * 1e-3) / 1e12);
    fflush(stdout);
    be->op->host_free(be, o.idx);
    be->op->host_free(be, o.val);
    be->op->host_free(be, o.lse);
    free(o.seq);
    free(o.pos);
    free(tok);
    tkd_model_free(m);
    tkd_backend_close(be);
    return 0;
}

int main(int argc, char **argv)
{
    run_spec rs[BENCH_MAX_RUNS];
    int n = 0, reps = 3, batches = 16;
    const char *out = NULL;
    if (bench_take_shapes("teacher_bench", "llama8b:8192:1,qwen05b:2048:16,qwen05b:8192:4", &argc, argv, rs, &n))
        return 2;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--batches") && i + 1 < argc) {
            batches = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--out") && i + 1 < argc) {
            out = argv[++i];
        } else if (!strcmp(argv[i], "--profile")) {
            if (!g_prof && !(g_prof = open_memstream(&g_prof_buf, &g_prof_len)))
                return fprintf(stderr, "teacher_bench: --profile: out of memory\n"), 2;
        } else {
            fprintf(stderr, "usage: teacher_bench [--shapes NAME:T:B,...] [--reps 3] [--batches 16] [--out DIR] "
                            "[--profile]\n");
            return 2;
        }
    }
    if (reps < 1 || reps > 15)
        reps = 3;
    printf("| shape | T x B | init s | fwd tok/s | fwd+head tok/s | fwd+top-k tok/s | dump tok/s | dump/fwd | "
           "dump/(fwd+head) | GEMM floor ms | head GEMM ms | fwd/body floor | MFU fwd+top-k | MFU dump | GiB | "
           "floor TFLOP/s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < n; i++)
        if (run_one(&rs[i], reps, batches, out))
            return 1;
    if (g_prof) {
        fclose(g_prof);
        fwrite(g_prof_buf, 1, g_prof_len, stdout);
        free(g_prof_buf);
    }
    return 0;
}

#else
int main(void)
{
    fprintf(stderr, "teacher_bench: this build has no CUDA backend\n");
    return 1;
}
#endif
