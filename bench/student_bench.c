/* student_bench.c — student-train's step speed on the CUDA backend at real shapes (a program, not a test).
 *
 * For each shape (random weights from tkd_model_init_random_for_training, no checkpoint) with B
 * sequences of T random tokens and one host teacher batch (top-100 distinct ids per position in
 * decreasing order of a random logit, an LSE a little above their log-sum-exp, labels = each row's
 * teacher top-1; renorm, alpha 0.5, tau 1, the gradient made in the loss's forward — the defaults
 * of student-train), one step is what student_train/train_step.c's tkd_train_step does with grad_accum 1:
 * zero grads, model forward (training), kl_stage, kl_forward (+ kl_backward with --kd-recompute),
 * model backward, clip to 1.0 inside AdamW. Two warm-up
 * steps, then --steps timed steps, each ending with a device sync (host wall clock around them).
 *
 * Columns: tokens/s and step ms (mean of the timed steps); MFU = (6·N_params + 12·L·T·D)·tokens/s
 * ÷ 989 TFLOP/s (dense bf16 peak of an H100/H200 SXM); GiB = device bytes in use after the timed
 * steps minus before the model (nothing is freed in between, so the peak of our allocations,
 * cuBLAS's workspaces included); then the split of one extra step with a device sync between
 * phases (so it sums to a little more than step ms: the stage's copy no longer overlaps the
 * forward): data (kl_stage), fwd (model forward incl. attention), loss (kl forward + backward), bwd
 * (model backward), opt (zero grads + norm + AdamW with the clip inside); and the loss of the last step.
 *
 *   student_bench [--shapes llama1b:8192:1,llama3b:8192:1,qwen05b:4096:4] [--steps 5]
 *                 [--recompute [none|attention|full|full_keep_attention|auto]] [--act-budget GIB] [--kd-recompute]
 *                 [--no-lend-grads]
 *                 [--state-dtype f32|bf16] [--profile] [--memory]
 *
 * --recompute MODE: activation recomputation as train.recompute (model/model.h's tkd_recompute):
 * full keeps only each block's input and backward recomputes the rest (memory down, about one
 * forward more of compute); attention also keeps the MLP's activations and recomputes only the
 * attention side; full_keep_attention is full that keeps the attention's output and statistics; auto
 * picks as student-train's default does, once the rest is allocated (tkd_model_fit_recompute), and
 * prints its pick; --act-budget GIB gives auto that many GiB for the activations instead of the free
 * memory (what it would pick on a smaller GPU). --recompute without a mode is full.
 * --kd-recompute: the loss as kd.grad_in_forward: false does it (the logits chunk made again in
 * kl_backward: 4 GEMMs instead of 3).
 * --no-lend-grads: the activations in their own buffer only (student-train lends them the gradient
 * buffer without accumulation, model.h's tkd_model_set_lend_grads: the memory it saves).
 * --state-dtype: the AdamW moments as optim.state_dtype keeps them (bf16: half the bytes; the
 * ledger of --memory shows it as "AdamW moments").
 * --profile: after the split step, two more steps through kernels/backend_profile.h's wrapper (CUDA
 * events around every backend op on the compute stream, read back after the step: no sync per op;
 * the first step makes the marks' storage, the second is reported),
 * and after the main table one table per shape: per op name its group, calls, total ms, ms per step
 * and % of the step's wall time (host clock around the step, which ends with a device sync), most
 * time first; then the ops' sum and the rest of the step (host work between ops, launch gaps).
 * --memory: after the main table, per shape the device memory by allocation name (the ledger of
 * kernels/cuda/cuda_mem.h after the timed steps) and what the device uses beyond it.
 * --nproc-per-node N: N processes, one per GPU (common/launch.h), training data parallel as
 * student-train does with several ranks (student_train/zero.h: gradients reduced per block during
 * the backward, AdamW on each rank's ZeRO-1 shard, the bf16 weights all-gathered; NCCL, TCP
 * rendezvous on the launcher's MASTER_PORT). B is the batch of each GPU (weak scaling); rank 0
 * prints the table with tok/s summed over the GPUs, and "x N GPUs" in the shape column. Compare
 * against the same command without the flag for the scaling. (--profile is single-process only.)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/dist.h"
#include "common/fileio.h"
#include "common/launch.h"
#include "common/rng.h"
#include "common/signals.h"
#include "common/status.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/backend.h"
#include "kernels/backend_profile.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/loss/kl_loss.h"
#include "bench/bench_util.h"
#include "model/model.h"
#include "model/optim.h"
#include "student_train/zero.h"

#define PEAK_FLOPS 989e12
#define TOPK 100
#define WARMUP 2

/* One host teacher batch (N rows of TOPK) and the student's input tokens (N). */
typedef struct host_batch {
    int32_t *tok, *idx, *labels;
    float *logit, *lse;
} host_batch;

/* The phases of the split step, ms. */
typedef struct split_ms { double data, fwd, loss, bwd, opt; } split_ms;

static int die(const char *what)
{
    fprintf(stderr, "student_bench: %s: %s\n", what, tkd_error_msg());
    return 1;
}

static int desc_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static void free_batch(host_batch *h)
{
    free(h->tok);
    free(h->idx);
    free(h->labels);
    free(h->logit);
    free(h->lse);
}

/* Random tokens in [0, V); per row TOPK distinct ids in [0, V) (rejection against the row's earlier
 * ids) carrying logits drawn uniform in [0, 12) and sorted largest first; the LSE is their
 * log-sum-exp + log(1 + 0.05) (a 5% tail); the label is the row's top-1 id. */
static int make_batch(int64_t n, int v, host_batch *h)
{
    h->tok = malloc(sizeof(int32_t) * n);
    h->labels = malloc(sizeof(int32_t) * n);
    h->lse = malloc(sizeof(float) * n);
    h->idx = malloc(sizeof(int32_t) * n * TOPK);
    h->logit = malloc(sizeof(float) * n * TOPK);
    if (!h->tok || !h->labels || !h->lse || !h->idx || !h->logit)
        return 1;
    uint64_t rng = 42;
    for (int64_t i = 0; i < n; i++) {
        int32_t *id = h->idx + i * TOPK;
        float *lg = h->logit + i * TOPK;
        h->tok[i] = (int32_t)(tkd_rng_splitmix64(&rng) % (uint64_t)v);
        for (int j = 0; j < TOPK; j++) {
            int dup;
            do {
                id[j] = (int32_t)(tkd_rng_splitmix64(&rng) % (uint64_t)v);
                dup = 0;
                for (int q = 0; q < j && !dup; q++)
                    dup = id[q] == id[j];
            } while (dup);
            lg[j] = (float)((tkd_rng_splitmix64(&rng) >> 11) * 0x1.0p-53 * 12.0);
        }
        qsort(lg, TOPK, sizeof(float), desc_float);
        double sum = 0.0;
        for (int j = 0; j < TOPK; j++)
            sum += exp((double)lg[j] - lg[0]);
        h->lse[i] = (float)(lg[0] + log(sum) + log1p(0.05));
        h->labels[i] = id[0];
    }
    return 0;
}

/* Everything one step needs. */
typedef struct bench_ctx {
    tkd_backend *be;
    tkd_model *m;
    tkd_adamw *opt;
    tkd_optim_config ocfg;
    tkd_backend_kl *kl;
    tkd_kl_params kp;
    tkd_kl_batch kb;
    host_batch hb;
    float *dh; /* (N, D) fp32 ∂loss/∂hidden */
    tkd_zero *zero; /* data parallel (--nproc-per-node), else NULL */
    int B, T;
    int64_t step;
    double loss;
} bench_ctx;

/* Waits for the device (every stream) and reports errors enqueued before. */
static tkd_status sync_all(bench_ctx *c)
{
    TKD_TRY(c->be->op->sync(c->be));
    cudaError_t e = cudaDeviceSynchronize();
    return e == cudaSuccess ? TKD_OK : tkd_error_set(TKD_ERR_DEVICE, "cudaDeviceSynchronize: %s", cudaGetErrorString(e));
}

/* Lap timer for the split step: syncs when split is set, then returns ms since *t and resets it. */
static tkd_status lap(bench_ctx *c, int split, double *t, double *ms)
{
    if (!split)
        return TKD_OK;
    TKD_TRY(sync_all(c));
    double n = bench_now_s();
    *ms = (n - *t) * 1e3;
    *t = n;
    return TKD_OK;
}

/* One training step as train_step does it (grad_accum 1); with split, a sync after every phase and
 * the phases' times in *sp. Ends with a device sync either way. */
static tkd_status step_once(bench_ctx *c, int split, split_ms *sp)
{
    const tkd_backend_ops *op = c->be->op;
    double zero_ms = 0, clip_ms = 0;
    if (split)
        TKD_TRY(sync_all(c)); /* the split starts from an idle device */
    double t = bench_now_s();
    if (c->zero)
        tkd_zero_begin_step(c->zero, c->step + 1);
    TKD_TRY(tkd_model_zero_grad(c->m));
    TKD_TRY(lap(c, split, &t, &zero_ms));
    const void *hidden = NULL;
    TKD_TRY(tkd_model_forward(c->m, c->hb.tok, c->B, c->T, 1, &hidden));
    TKD_TRY(lap(c, split, &t, &sp->fwd));
    /* after the forward is enqueued, as train_step.c's micro_step: the host copy overlaps it */
    TKD_TRY(op->kl_stage(c->be, c->kl, &c->kp, &c->kb));
    TKD_TRY(lap(c, split, &t, &sp->data));
    tkd_kl_result r;
    const void *w = tkd_model_lm_head_dev(c->m);
    float *dw = tkd_model_lm_head_grad(c->m);
    if (c->kp.grad_in_forward) {
        TKD_TRY(op->kl_forward(c->be, c->kl, &c->kp, hidden, w, &r, c->dh, dw));
    } else {
        TKD_TRY(op->kl_forward(c->be, c->kl, &c->kp, hidden, w, &r, NULL, NULL));
        TKD_TRY(op->kl_backward(c->be, c->kl, &c->kp, hidden, w, c->kp.grad_scale, c->dh, dw));
    }
    TKD_TRY(lap(c, split, &t, &sp->loss));
    if (!isfinite(r.loss))
        return tkd_error_set(TKD_ERR_NUMERIC, "the loss is %g at step %lld", r.loss, (long long)c->step + 1);
    c->loss = r.loss;
    if (c->zero)
        tkd_zero_arm(c->zero); /* each block's gradients reduced as soon as its backward is done */
    TKD_TRY(tkd_model_backward(c->m, c->dh));
    TKD_TRY(lap(c, split, &t, &sp->bwd));
    double norm = 0;
    if (c->zero)
        TKD_TRY(tkd_zero_update(c->zero, c->opt, tkd_optim_lr(&c->ocfg, c->step), 1.0, &norm)); /* as student-train */
    else
        TKD_TRY(tkd_adamw_clip_step_model(c->opt, c->m, tkd_optim_lr(&c->ocfg, c->step), 1.0, &norm));
    TKD_TRY(lap(c, split, &t, &clip_ms));
    if (split)
        sp->opt = zero_ms + clip_ms;
    c->step++;
    return sync_all(c);
}

static tkd_recompute g_recompute = TKD_RECOMPUTE_NONE;
static tkd_dist_info g_dist; /* this process among --nproc-per-node's (world 1 without it) */

/* Data parallel: the communicator (TCP rendezvous on the launcher's MASTER_ADDR/PORT; heartbeats
 * in /tmp), and the optimizer for this rank's shard only. */
static tkd_status open_zero(bench_ctx *c)
{
    char job[128], dir[512];
    tkd_dist_job_id(job, sizeof job);
    snprintf(dir, sizeof dir, "/tmp/student_bench-%s", job);
    TKD_TRY(tkd_mkdir_p(dir));
    tkd_rdzv_config rc;
    TKD_TRY(tkd_rdzv_config_from_env(&rc, -1, dir, 300.0));
    TKD_TRY(tkd_zero_open(&g_dist, &rc, dir, c->m, &c->zero));
    size_t b, e;
    tkd_zero_shard(c->zero, &b, &e);
    return tkd_adamw_init_shard(&c->ocfg, c->m, b, e, &c->opt);
}

/* --recompute's optional mode: the index of name in TKD_RECOMPUTE_NAMES, or -1. */
static int recompute_mode(const char *name)
{
    static const char *const names[] = TKD_RECOMPUTE_NAMES;
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], name))
            return i;
    return -1;
}

static int g_lend_grads = 1; /* --no-lend-grads: activations in their own buffer only */
static double g_act_budget_gib; /* --act-budget: auto's budget for the activations (0: the free memory) */
static int g_kd_recompute; /* the loss in recompute mode (kd.grad_in_forward: false) */
static tkd_adamw_dtype g_state_dtype = TKD_ADAMW_DTYPE_F32; /* --state-dtype */
static FILE *g_prof;     /* --profile: the per-shape tables, printed after the main one */
static FILE *g_mem;      /* --memory: the per-shape ledgers, printed after the main one */
static char *g_mem_buf;
static size_t g_mem_len;

/* --memory: where the device memory of one shape's step goes, from kernels/cuda/cuda_mem.h's
 * ledger after the timed steps (every topkd allocation by its name; nothing is freed in between,
 * so live = the step's peak of our allocations), against the device's own count. */
static void memory_table(const char *shape, size_t used_bytes)
{
    enum { CAP = 256 };
    static tkd_cuda_mem_use u[CAP];
    const int n = tkd_cuda_mem_ledger(u, CAP);
    const double MiB = 1048576.0;
    size_t sum = 0, small = 0;
    fprintf(g_mem, "\nmemory of %s after the timed steps (kernels/cuda/cuda_mem.h's ledger, most first)\n\n"
                   "| allocation | live MiB | allocations |\n|---|---:|---:|\n", shape);
    for (int i = 0; i < n && i < CAP; i++) {
        sum += u[i].live;
        if (u[i].live >= (size_t)(16 * MiB))
            fprintf(g_mem, "| %s | %.0f | %d |\n", u[i].what, u[i].live / MiB, u[i].count);
        else
            small += u[i].live;
    }
    fprintf(g_mem, "| (the other names, each under 16 MiB) | %.0f | |\n", small / MiB);
    fprintf(g_mem, "| **sum of the ledger** | **%.0f** | |\n", sum / MiB);
    fprintf(g_mem, "| device in use beyond the ledger (CUDA context, cuBLAS/cuDNN internals, allocator) | %.0f | |\n",
            used_bytes > sum ? (used_bytes - sum) / MiB : 0.0);
    fprintf(g_mem, "| **device in use** (cudaMemGetInfo, minus before the backend opened: the GiB column) | **%.0f** | |\n",
            used_bytes / MiB);
}
static char *g_prof_buf;
static size_t g_prof_len;

/* Which part of the step an op belongs to, for the profile table. */
static const char *op_group(const char *op)
{
    static const struct { const char *prefix, *group; } g[] = {
        {"attn_", "attention"}, {"linear_", "linear"}, {"kl_", "KL loss"}, {"adamw_", "optimizer"},
        {"grad_", "optimizer"}, {"rmsnorm_", "norm"}, {"add_rmsnorm_", "norm"}, {"embedding_", "embedding"},
        {"rope_", "rope"}, {"swiglu_", "swiglu"},
    };
    for (size_t i = 0; i < sizeof g / sizeof g[0]; i++)
        if (!strncmp(op, g[i].prefix, strlen(g[i].prefix)))
            return g[i].group;
    return "memory/sync";
}

/* Two steps with the backend wrapped by the profiler (the model's, the optimizer's and ours swapped
 * for them), the first to make the wrapper's and the backend's mark storage, the second measured:
 * its table into g_prof. */
static tkd_status profile_step(bench_ctx *c, const char *shape)
{
    tkd_backend *bare = c->be, *prof = NULL;
    TKD_TRY(tkd_backend_profile_wrap(bare, &prof));
    c->be = c->m->be = c->opt->be = prof;
    split_ms sp;
    tkd_status st = step_once(c, 0, &sp);
    tkd_backend_profile_reset(prof);
    double t0 = bench_now_s();
    if (st == TKD_OK)
        st = step_once(c, 0, &sp);
    double step_ms = (bench_now_s() - t0) * 1e3, sum = 0.0;
    c->be = c->m->be = c->opt->be = bare;
    tkd_profile_row rows[TKD_PROFILE_OPS];
    int n = 0;
    TKD_TRY(bench_profile_take(prof, st, rows, &n));
    fprintf(g_prof, "\nProfile of one %s step (%.1f ms wall):\n\n"
                    "| op | group | calls | total ms | ms per step | %% of step |\n|---|---|---:|---:|---:|---:|\n",
            shape, step_ms);
    for (int i = 0; i < n; i++) {
        sum += rows[i].ms;
        fprintf(g_prof, "| %s | %s | %lld | %.2f | %.2f | %.1f |\n", rows[i].op, op_group(rows[i].op),
                (long long)rows[i].calls, rows[i].ms, rows[i].ms, 100.0 * rows[i].ms / step_ms);
    }
    fprintf(g_prof, "| (all ops) | | | %.2f | %.2f | %.1f |\n", sum, sum, 100.0 * sum / step_ms);
    fprintf(g_prof, "| (outside ops: host, gaps) | | | %.2f | %.2f | %.1f |\n", step_ms - sum, step_ms - sum,
            100.0 * (step_ms - sum) / step_ms);
    return TKD_OK;
}

static int run_one(const run_spec *r, int steps)
{
    tkd_model_config cfg;
    bench_config_of(r->s, r->T, &cfg);
    bench_ctx c;
    memset(&c, 0, sizeof c);
    c.B = r->B;
    c.T = r->T;
    int64_t N = (int64_t)r->B * r->T;
    if (make_batch(N, cfg.vocab_size, &c.hb))
        return fprintf(stderr, "student_bench: out of host memory for the teacher batch\n"), 1;
    c.kb.n = N;
    c.kb.d = cfg.hidden_size;
    c.kb.v = cfg.vocab_size;
    c.kb.topk_idx = c.hb.idx;
    c.kb.topk_logit = c.hb.logit;
    c.kb.teacher_lse = c.hb.lse;
    c.kb.labels = c.hb.labels;
    tkd_kl_params_defaults(&c.kp, TOPK);
    c.kp.variant = TKD_KL_VARIANT_RENORM;
    c.kp.temperature = 1.0f;
    c.kp.alpha = 0.5f;
    c.kp.grad_in_forward = !g_kd_recompute;
    c.kp.grad_scale = 1.0f / (float)g_dist.world; /* the mean over every GPU's rows */
    if (tkd_kl_validate(&c.kp, &c.kb) != TKD_OK)
        return die("teacher batch");

    size_t base = bench_used_bytes();
    if (tkd_backend_open_local(TKD_DEVICE_CUDA, &g_dist, &c.be) != TKD_OK) /* the tools' GPU rule */
        return die("backend");
    double t0 = bench_now_s();
    if (tkd_model_init_random_for_training(&cfg, 1, c.be, &c.m) != TKD_OK)
        return die("init");
    tkd_model_set_recompute(c.m, g_recompute == TKD_RECOMPUTE_AUTO ? TKD_RECOMPUTE_FULL : g_recompute);
    tkd_model_set_lend_grads(c.m, g_lend_grads); /* as student-train does without accumulation */
    if (tkd_model_reserve(c.m, c.B, c.T, 1) != TKD_OK)
        return die("reserve");
    tkd_optim_config_defaults(&c.ocfg);
    c.ocfg.clip_norm = 1.0;
    c.ocfg.total_steps = WARMUP + steps + 1;
    c.ocfg.state_dtype = g_state_dtype;
    if (g_dist.world > 1 ? open_zero(&c) != TKD_OK : tkd_adamw_init_on(&c.ocfg, c.m, &c.opt) != TKD_OK)
        return die("optimizer");
    if (c.be->op->kl_create(c.be, &c.kp, N, cfg.hidden_size, cfg.vocab_size, &c.kl) != TKD_OK)
        return die("loss");
    if (c.be->op->alloc(c.be, (size_t)N * cfg.hidden_size * sizeof(float), "bench: dHidden", (void **)&c.dh) != TKD_OK)
        return die("dHidden");
    if (g_recompute == TKD_RECOMPUTE_AUTO) { /* as student-train: once the rest is allocated */
        static const char *const names[] = TKD_RECOMPUTE_NAMES;
        tkd_recompute_fit f;
        if (tkd_model_fit_recompute(c.m, c.B, c.T, (size_t)(g_act_budget_gib * 1073741824.0), &f) != TKD_OK)
            return die("recompute auto");
        if (g_dist.rank == 0)
            printf("%s: --recompute auto picked %s, the last %d of %d layers whole (activations %.2f GiB of %.2f "
                   "GiB left for them)\n", r->s->name, names[f.mode], f.whole, cfg.num_hidden_layers,
                   f.need / 1073741824.0, f.budget / 1073741824.0);
    }
    double init_s = bench_now_s() - t0;

    split_ms sp = {0};
    for (int i = 0; i < WARMUP; i++)
        if (step_once(&c, 0, &sp) != TKD_OK)
            return die("warm-up step");
    double ts = bench_now_s();
    for (int i = 0; i < steps; i++)
        if (step_once(&c, 0, &sp) != TKD_OK)
            return die("timed step");
    double step_ms = (bench_now_s() - ts) * 1e3 / steps;
    double mem = (double)(bench_used_bytes() - base) / 1073741824.0;
    if (g_mem && g_dist.rank == 0)
        memory_table(r->s->name, bench_used_bytes() - base);
    if (step_once(&c, 1, &sp) != TKD_OK)
        return die("split step");
    if (g_prof && g_dist.world == 1 && profile_step(&c, r->s->name) != TKD_OK)
        return die("profiled step");

    double tps = (double)N * g_dist.world / (step_ms * 1e-3);
    double fpt = 6.0 * (double)c.m->n_params + 12.0 * cfg.num_hidden_layers * (double)r->T * cfg.hidden_size;
    char gpus[32] = "";
    if (g_dist.world > 1)
        snprintf(gpus, sizeof gpus, " x %d GPUs", g_dist.world);
    double mfu = fpt * tps / g_dist.world / PEAK_FLOPS; /* per GPU */
    if (g_dist.rank == 0) {
        printf("| %s%s | %d x %d | %.0f | %.1f | %.0f | %.1f | %.3f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | "
               "%.4f |\n",
               r->s->name, gpus, r->T, r->B, (double)c.m->n_params / 1e6, init_s, tps, step_ms, mfu, mem, sp.fwd,
               sp.loss, sp.bwd, sp.opt, sp.data, sp.fwd + sp.loss + sp.bwd + sp.opt + sp.data, c.loss);
        fflush(stdout);
    }

    tkd_zero_close(c.zero);
    c.be->op->free(c.be, c.dh);
    c.be->op->kl_free(c.be, c.kl);
    tkd_adamw_free(c.opt);
    tkd_model_free(c.m);
    tkd_backend_close(c.be);
    free_batch(&c.hb);
    return 0;
}

int main(int argc, char **argv)
{
    run_spec rs[BENCH_MAX_RUNS];
    int n = 0, steps = 5, nproc = 0;
    if (tkd_launch_take_nproc(&argc, argv, &nproc) != TKD_OK)
        return die("--nproc-per-node");
    if (nproc > 1) { /* the launcher: N copies of this program, one per GPU */
        int rc = 0;
        tkd_signals_install();
        if (tkd_launch_workers("student_bench", nproc, argc, argv, 30.0, &rc) != TKD_OK)
            return die("launch"), rc ? rc : 1;
        return 0;
    }
    if (tkd_dist_from_env(&g_dist) != TKD_OK)
        return die("environment");
    if (bench_take_shapes("student_bench", "llama1b:8192:1,llama3b:8192:1,qwen05b:4096:4", &argc, argv, rs, &n))
        return 2;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
            steps = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--recompute")) { /* alone: full, as it always meant */
            int mode = i + 1 < argc ? recompute_mode(argv[i + 1]) : -1;
            g_recompute = mode < 0 ? TKD_RECOMPUTE_FULL : (tkd_recompute)mode;
            i += mode >= 0;
        } else if (!strcmp(argv[i], "-q")) { /* what the launcher gives ranks above 0 */
        } else if (!strcmp(argv[i], "--no-lend-grads")) {
            g_lend_grads = 0;
        } else if (!strcmp(argv[i], "--kd-recompute")) {
            g_kd_recompute = 1;
        } else if (!strcmp(argv[i], "--act-budget") && i + 1 < argc && atof(argv[i + 1]) > 0) {
            g_act_budget_gib = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--state-dtype") && i + 1 < argc &&
                   (!strcmp(argv[i + 1], "f32") || !strcmp(argv[i + 1], "bf16"))) {
            g_state_dtype = strcmp(argv[++i], "bf16") ? TKD_ADAMW_DTYPE_F32 : TKD_ADAMW_DTYPE_BF16;
        } else if (!strcmp(argv[i], "--memory")) {
            if (!g_mem && !(g_mem = open_memstream(&g_mem_buf, &g_mem_len)))
                return fprintf(stderr, "student_bench: out of memory\n"), 1;
        } else if (!strcmp(argv[i], "--profile")) {
            if (!g_prof && !(g_prof = open_memstream(&g_prof_buf, &g_prof_len)))
                return fprintf(stderr, "student_bench: out of memory\n"), 1;
        } else {
            fprintf(stderr, "usage: student_bench [--shapes NAME:T:B,...] [--steps 5] "
                            "[--recompute [none|attention|full|full_keep_attention|auto]] [--act-budget GIB] [--kd-recompute] "
                            "[--no-lend-grads] [--state-dtype f32|bf16] [--profile] [--memory] [--nproc-per-node N]\n");
            return 2;
        }
    }
    if (steps < 1)
        steps = 5;
    if (g_dist.rank == 0)
        printf("| shape | T x B | params M | init s | tok/s | step ms | MFU | GiB | fwd ms | loss ms | bwd ms | "
               "opt ms | data ms | split sum ms | loss |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < n; i++)
        if (run_one(&rs[i], steps))
            return 1;
    if (g_mem) {
        fclose(g_mem);
        fputs(g_mem_buf, stdout);
        free(g_mem_buf);
    }
    if (g_prof) {
        fclose(g_prof);
        fputs(g_prof_buf, stdout);
        free(g_prof_buf);
    }
    return 0;
}

#else
int main(void)
{
    fprintf(stderr, "student_bench: this build has no CUDA backend\n");
    return 1;
}
#endif
