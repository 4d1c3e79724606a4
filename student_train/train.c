/* train.c — see train.h. The run is a small state machine over one struct (trainer): open the
 * data, build the student and the loss, then alternate training steps, evaluations and
 * checkpoints until the step budget, an error, a NaN or a signal ends it. */
#include "student_train/train.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dist.h"
#include "common/fileio.h"
#include "common/log.h"
#include "common/progress.h"
#include "common/signals.h"
#include "formats/cache_reader.h"
#include "formats/tokens.h"
#include "kernels/backend.h"
#include "kernels/loss/kl_loss.h"
#include "model/model.h"
#include "model/optim.h"
#include "student_train/checkpoint.h"
#include "student_train/loader.h"
#include "student_train/run_dir.h"
#include "student_train/zero.h"

#define RUN_PATH_MAX 4096
#define EVAL_CHUNK_ROWS 256 /* rows of full logits held at once for the top-1 agreement (CPU) */
#define EVAL_CHUNK_BYTES ((size_t)1 << 30) /* the same on a device: about 1 GiB of fp32 logits */

typedef struct trainer {
    const tkd_train_config *cfg;
    const tkd_train_opts *opts;
    char *config_yaml;    /* opts->config_yaml plus the CUDA kernel choices, as config.yaml and checkpoints record it */
    tkd_cache_reader *cache, *val_cache;
    tkd_tokens *tokens, *val_tokens;
    tkd_loader *train, *val;
    tkd_backend *be; /* where the student, its loss and its optimizer run */
    tkd_model *m;
    tkd_adamw *opt;
    tkd_optim_config ocfg;
    tkd_kl_params kp;
    tkd_backend_kl *kl;
    float *dh;      // (B·T, D) f32, backend memory: the loss's ∂/∂hidden
    float *logits;  // (EVAL_CHUNK_ROWS, V) host, CPU evaluation only
    uint32_t *top1; // (B·T) host: the student's argmax per row (evaluation on a device)
    float *top1_val, *top1_lse; // (B·T) host: the consumer's other outputs (unused)
    int B, T, V, k_use, S; /* B: sequences per micro-batch on this rank (train.batch_size / world) */
    int64_t total_steps;
    tkd_train_state st;
    char run[RUN_PATH_MAX], ckpt[RUN_PATH_MAX], metrics_path[RUN_PATH_MAX];
    FILE *metrics;
    tkd_dir_lock *lock;   /* the run directory's, held from start to end */
    double t0;            /* when the loop started (monotonic) */
    int64_t tokens0;      /* tokens seen at that time (non-zero after a resume) */
    int64_t step0;        /* the step the loop started at */
    bool finished_before; /* --resume of a run that had already finished: nothing to do */
    int64_t beyond_vocab; /* teacher entries beyond the student's vocabulary since the last record */
    int64_t beyond_total; /* the same over this process's training steps (reported at the end) */
    tkd_progress progress;
    /* data parallel (zero.h): NULL for a single process that no launcher started */
    tkd_dist_info dist;
    char job_id[128];            /* data parallel: this launch's id (rendezvous, checkpoint staging) */
    tkd_zero *zero;
    char dist_dir[RUN_PATH_MAX]; /* rendezvous file and heartbeats: <run.dir>/.<run.name>.dist */
    double dist_timeout_s;       /* dist.timeout_s: the longest a rank waits for the others */
    int stop_signal;             /* a signal any rank saw (agreed with the step's statistics) */
} trainer;

typedef struct step_stats {
    double loss, kd, ce, grad_norm, lr;
    int64_t rows, tokens, beyond;
} step_stats;

typedef struct eval_stats {
    double loss, kd, ce, top1;
    int64_t rows;
} eval_stats;

/* ---- data ------------------------------------------------------------------------------------ */

/* Sequence ids [first, first + n) as a split. */
static int64_t *range_split(int64_t first, int64_t n)
{
    int64_t *s = malloc(((size_t)n + 1) * sizeof *s);
    for (int64_t i = 0; s && i < n; i++)
        s[i] = first + i;
    return s;
}

/* Splits n sequences into train (the first ones) and a held-out tail of val_fraction. */
static void holdout(int64_t n, double frac, int64_t max_train, int64_t *n_train, int64_t *n_val)
{
    int64_t v = frac > 0 ? (int64_t)ceil((double)n * frac) : 0;
    if (v >= n)
        v = n - 1;
    *n_val = v;
    *n_train = n - v;
    if (max_train > 0 && *n_train > max_train)
        *n_train = max_train;
}

static tkd_status check_cache_against_config(trainer *tr, const tkd_cache_manifest *m)
{
    const tkd_train_config *c = tr->cfg;
    if (*c->expect_teacher_sha256 && strcmp(c->expect_teacher_sha256, m->id.teacher_sha256) != 0)
        return tkd_error_set(TKD_ERR_MISMATCH,
                             "%s: the cache was made by teacher %.12s…, the config expects %.12s… "
                             "(data.expect_teacher_sha256) — point data.cache at the right cache",
                             c->cache, m->id.teacher_sha256, c->expect_teacher_sha256);
    if (c->kd_topk > m->id.k)
        return tkd_error_set(TKD_ERR_CONFIG, "kd.topk = %d but the cache %s stores only k = %d", c->kd_topk,
                             c->cache, m->id.k);
    if (c->seq_len > m->id.seq_len)
        return tkd_error_set(TKD_ERR_CONFIG, "data.seq_len = %d but the cache %s holds sequences of %d — lower "
                             "data.seq_len (0 takes the cache's)", c->seq_len, c->cache, m->id.seq_len);
    if (c->kd_variant == TKD_KL_VARIANT_SAMPLED && m->id.tail_samples == 0)
        return tkd_error_set(TKD_ERR_CONFIG,
                             "kd.variant = sampled needs tail draws, but the cache %s has none — "
                             "re-run teacher-dump with cache.tail_samples > 0, or use renorm/tail", c->cache);
    if (c->kd_variant != TKD_KL_VARIANT_RENORM && fabs(c->kd_temperature - m->id.temperature) > 1e-6)
        return tkd_error_set(TKD_ERR_CONFIG,
                             "kd.variant = %s needs kd.temperature = the cache's temperature %g (got %g)",
                             tkd_kl_variant_name((tkd_kl_variant)c->kd_variant), (double)m->id.temperature,
                             c->kd_temperature);
    return TKD_OK;
}

static tkd_status open_cache_sources(trainer *tr, int64_t **tsplit, int64_t *nt, int64_t **vsplit, int64_t *nv)
{
    const tkd_train_config *c = tr->cfg;
    TKD_TRY(tkd_cache_reader_open(&tr->cache, c->cache, NULL));
    const tkd_cache_manifest *m = tkd_cache_reader_manifest(tr->cache);
    TKD_TRY(check_cache_against_config(tr, m));
    tr->V = (int)m->id.vocab_size;
    tr->T = c->seq_len > 0 ? c->seq_len : m->id.seq_len;
    if (tr->T < m->id.seq_len)
        tkd_log_info("data.seq_len = %d: training on the first %d of each sequence's %d cached positions "
                     "(0 takes them all)", tr->T, tr->T, m->id.seq_len);
    tr->k_use = c->kd_topk > 0 ? c->kd_topk : m->id.k;
    tr->S = c->kd_variant == TKD_KL_VARIANT_SAMPLED ? m->id.tail_samples : 0;
    int64_t n = tkd_cache_reader_num_seq(tr->cache);
    if (*c->val_cache) {
        TKD_TRY(tkd_cache_reader_open(&tr->val_cache, c->val_cache, NULL));
        const tkd_cache_manifest *vm = tkd_cache_reader_manifest(tr->val_cache);
        if (vm->id.vocab_size != m->id.vocab_size || strcmp(vm->id.teacher_sha256, m->id.teacher_sha256) != 0 ||
            vm->id.k < tr->k_use || vm->id.seq_len < tr->T || vm->id.tail_samples < tr->S)
            return tkd_error_set(TKD_ERR_MISMATCH,
                                 "%s: the validation cache does not match %s (teacher, vocabulary, k, seq_len "
                                 "or tail draws differ)", c->val_cache, c->cache);
        *nt = c->max_sequences > 0 && c->max_sequences < n ? c->max_sequences : n;
        *nv = tkd_cache_reader_num_seq(tr->val_cache);
        *tsplit = range_split(0, *nt);
        *vsplit = range_split(0, *nv);
    } else {
        holdout(n, c->val_fraction, c->max_sequences, nt, nv);
        *tsplit = range_split(0, *nt);
        *vsplit = range_split(n - *nv, *nv);
    }
    return *tsplit && *vsplit ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
}

static tkd_status open_token_sources(trainer *tr, int64_t **tsplit, int64_t *nt, int64_t **vsplit, int64_t *nv)
{
    const tkd_train_config *c = tr->cfg;
    if (c->kd_alpha > 0)
        return tkd_error_set(TKD_ERR_CONFIG,
                             "kd.alpha = %g needs a teacher: set data.cache (a teacher-dump output), or kd.alpha = 0 "
                             "for CE-only training on data.tokens", c->kd_alpha);
    if (c->tokens.n == 0)
        return tkd_error_set(TKD_ERR_CONFIG, "no data: set data.cache (a teacher cache) or data.tokens (token files)");
    if (c->seq_len <= 0)
        return tkd_error_set(TKD_ERR_CONFIG, "data.seq_len must be set for CE-only training on data.tokens");
    tr->T = c->seq_len;
    tr->k_use = 0;
    tr->S = 0;
    TKD_TRY(tkd_tokens_open_list((const char *const *)c->tokens.items, (int)c->tokens.n, &tr->tokens));
    int64_t n = tkd_tokens_num_windows(tr->tokens, tr->T, tr->T, 1);
    if (c->val_tokens.n > 0) {
        TKD_TRY(tkd_tokens_open_list((const char *const *)c->val_tokens.items, (int)c->val_tokens.n,
                                     &tr->val_tokens));
        *nt = c->max_sequences > 0 && c->max_sequences < n ? c->max_sequences : n;
        *nv = tkd_tokens_num_windows(tr->val_tokens, tr->T, tr->T, 1);
        *tsplit = range_split(0, *nt);
        *vsplit = range_split(0, *nv);
    } else {
        holdout(n, c->val_fraction, c->max_sequences, nt, nv);
        *tsplit = range_split(0, *nt);
        *vsplit = range_split(n - *nv, *nv);
    }
    return *tsplit && *vsplit ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
}

static tkd_status open_data(trainer *tr)
{
    const tkd_train_config *c = tr->cfg;
    int64_t *ts = NULL, *vs = NULL, nt = 0, nv = 0;
    tkd_status st = *c->cache ? open_cache_sources(tr, &ts, &nt, &vs, &nv) : open_token_sources(tr, &ts, &nt, &vs, &nv);
    if (st == TKD_OK && nt < 1)
        st = tkd_error_set(TKD_ERR_CONFIG, "the training split is empty (%s)", *c->cache ? c->cache : "data.tokens");
    tkd_loader_opts lo = {.batch_size = tr->B, .seq_len = tr->T, .k = tr->k_use, .with_tail = tr->S > 0,
                          .prefetch = c->prefetch, .seed = (uint64_t)c->seed, .shuffle = 1,
                          .rank = tr->dist.rank, .world = tr->dist.world};
    if (st == TKD_OK)
        st = tkd_loader_open(&tr->train, tr->cache, tr->cache ? NULL : tr->tokens, ts, nt, &lo);
    lo.shuffle = 0;
    if (st == TKD_OK && nv > 0) {
        tkd_cache_reader *vc = tr->val_cache ? tr->val_cache : tr->cache;
        const tkd_tokens *vt = tr->val_tokens ? tr->val_tokens : tr->tokens;
        st = tkd_loader_open(&tr->val, vc, vc ? NULL : vt, vs, nv, &lo);
    }
    free(ts);
    free(vs);
    if (st == TKD_OK)
        tkd_log_info("data: %" PRId64 " training and %" PRId64 " validation sequences of %d tokens%s", nt, nv, tr->T,
                     tr->cache ? "" : " (CE only, no teacher)");
    return st;
}

/* ---- model and loss ---------------------------------------------------------------------------- */

static void student_config(const tkd_train_config *c, int vocab, tkd_model_config *mc)
{
    tkd_model_config_defaults(mc);
    mc->arch = c->model_arch == TKD_TRAIN_ARCH_QWEN2 ? TKD_ARCH_QWEN2 : TKD_ARCH_LLAMA;
    mc->vocab_size = vocab;
    mc->hidden_size = c->hidden_size;
    mc->intermediate_size = c->intermediate_size;
    mc->num_hidden_layers = c->num_layers;
    mc->num_attention_heads = c->num_heads;
    mc->num_key_value_heads = c->num_kv_heads;
    mc->head_dim = c->head_dim > 0 ? c->head_dim : c->hidden_size / c->num_heads;
    mc->max_position_embeddings = c->max_position_embeddings;
    mc->rope_theta = c->rope_theta;
    mc->rms_norm_eps = (float)c->rms_norm_eps;
    mc->tie_word_embeddings = c->tie_word_embeddings;
    mc->attention_bias = mc->arch == TKD_ARCH_QWEN2;
    mc->initializer_range = (float)c->init_std;
}

/* A cache whose vocabulary is padded past the student's (same tokenizer, a larger embedding): the
 * loaders check that the data never uses the extra ids and map teacher entries beyond mv. */
static tkd_status fit_vocab(trainer *tr, int mv)
{
    int renorm = tr->cfg->kd_variant == TKD_KL_VARIANT_RENORM;
    TKD_TRY(tkd_loader_fit_vocab(tr->train, mv, renorm));
    if (tr->val)
        TKD_TRY(tkd_loader_fit_vocab(tr->val, mv, renorm));
    tkd_log_info("vocabulary: the cache's %d ids exceed the student's %d; the data must not use ids >= %d, and "
                 "teacher entries beyond them are %s (counted as beyond_vocab in metrics.jsonl)", tr->V, mv, mv,
                 renorm ? "dropped and the rest renormalised" : "counted in the tail mass");
    return TKD_OK;
}

static tkd_status build_model(trainer *tr)
{
    const tkd_train_config *c = tr->cfg;
    if (c->model_init == TKD_TRAIN_INIT_HF) {
        if (!*c->model_path)
            return tkd_error_set(TKD_ERR_CONFIG, "model.init = hf needs model.path (a Hugging Face checkpoint dir)");
        TKD_TRY(tkd_model_load_hf_for_training(c->model_path, tr->be, &tr->m));
    } else {
        /* model.vocab_size, when set, builds that student, so a cache of another vocabulary is
         * reported below with both sizes */
        int vocab = c->vocab_size > 0 ? c->vocab_size : tr->V;
        if (vocab <= 0)
            return tkd_error_set(TKD_ERR_CONFIG, "model.vocab_size must be set for a random student without a cache");
        tkd_model_config mc;
        student_config(c, vocab, &mc);
        TKD_TRY(tkd_model_config_validate(&mc));
        TKD_TRY(tkd_model_init_random_for_training(&mc, (uint64_t)c->seed, tr->be, &tr->m));
    }
    int mv = tr->m->cfg.vocab_size;
    if (tr->V > 0 && mv > tr->V)
        return tkd_error_set(TKD_ERR_MISMATCH,
                             "vocabulary mismatch: the student has %d tokens, the cache %s has %d — the student "
                             "must use the teacher's tokenizer", mv, c->cache, tr->V);
    if (tr->V > mv)
        TKD_TRY(fit_vocab(tr, mv));
    if (c->vocab_size > 0 && c->vocab_size != mv)
        return tkd_error_set(TKD_ERR_MISMATCH, "model.vocab_size = %d but the student has %d tokens", c->vocab_size, mv);
    tr->V = mv;
    if (tr->T > tr->m->cfg.max_position_embeddings)
        return tkd_error_set(TKD_ERR_CONFIG, "seq_len %d exceeds the student's max_position_embeddings %d — raise %s, "
                             "or lower data.seq_len", tr->T, tr->m->cfg.max_position_embeddings,
                             c->model_init == TKD_TRAIN_INIT_HF ? "max_position_embeddings in model.path's config.json"
                                                               : "model.max_position_embeddings");
    if (tr->tokens)
        TKD_TRY(tkd_tokens_check_vocab(tr->tokens, mv));
    if (tr->val_tokens)
        TKD_TRY(tkd_tokens_check_vocab(tr->val_tokens, mv));
    tkd_model_set_recompute(tr->m, tr->cfg->recompute);
    return tkd_model_reserve(tr->m, tr->B, tr->T, 1);
}

static tkd_status build_loss(trainer *tr)
{
    const tkd_train_config *c = tr->cfg;
    tkd_kl_params_defaults(&tr->kp, tr->k_use);
    /* Without a cache the loss is plain CE (alpha = 0, no teacher columns) whatever the variant. */
    tr->kp.variant = tr->cache ? (tkd_kl_variant)c->kd_variant : TKD_KL_VARIANT_RENORM;
    tr->kp.temperature = (float)c->kd_temperature;
    tr->kp.alpha = (float)c->kd_alpha;
    tr->kp.k = tr->k_use;
    tr->kp.k_use = tr->k_use;
    tr->kp.s = tr->S;
    tr->kp.chunk_rows = c->kd_chunk_size;
    tr->kp.grad_in_forward = c->kd_grad_in_forward;
    tr->kp.grad_scale = 1.0f / (float)c->grad_accum;
    int64_t n_max = (int64_t)tr->B * tr->T;
    int d = tr->m->cfg.hidden_size;
    TKD_TRY(tr->be->op->kl_create(tr->be, &tr->kp, n_max, d, tr->V, &tr->kl));
    TKD_TRY(tr->be->op->alloc(tr->be, (size_t)n_max * (size_t)d * sizeof(float), "loss: dHidden", (void **)&tr->dh));
    if (tkd_backend_host_f32(tr->be)) { /* hidden states read in place: full logits on the host */
        tr->logits = malloc((size_t)EVAL_CHUNK_ROWS * (size_t)tr->V * sizeof(float));
        if (!tr->logits)
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory for the evaluation's logits");
    } else {
        tr->top1 = malloc((size_t)n_max * sizeof *tr->top1);
        tr->top1_val = malloc((size_t)n_max * sizeof *tr->top1_val);
        tr->top1_lse = malloc((size_t)n_max * sizeof *tr->top1_lse);
        if (!tr->top1 || !tr->top1_val || !tr->top1_lse)
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory for the evaluation's top-1 buffers");
    }
    return TKD_OK;
}

/* Steps the run takes: train.max_steps, else as many as epochs and max_tokens allow. */
static int64_t plan_steps(const trainer *tr)
{
    const tkd_train_config *c = tr->cfg;
    if (c->eval_only)
        return 0;
    if (c->max_steps > 0)
        return c->max_steps;
    int64_t per_step = (int64_t)c->batch_size * c->grad_accum;
    int64_t n = tkd_loader_size(tr->train);
    int64_t steps = (n * c->epochs + per_step - 1) / per_step;
    if (c->max_tokens > 0) {
        int64_t by_tokens = (c->max_tokens + per_step * tr->T - 1) / (per_step * tr->T);
        if (by_tokens < steps)
            steps = by_tokens;
    }
    return steps;
}

static tkd_status build_optimizer(trainer *tr)
{
    const tkd_train_config *c = tr->cfg;
    tkd_optim_config_defaults(&tr->ocfg);
    tr->total_steps = plan_steps(tr);
    tr->ocfg.lr = c->lr;
    tr->ocfg.min_lr = c->min_lr;
    tr->ocfg.warmup_steps = c->warmup_steps;
    tr->ocfg.total_steps = tr->total_steps > 0 ? tr->total_steps : 1;
    tr->ocfg.beta1 = c->beta1;
    tr->ocfg.beta2 = c->beta2;
    tr->ocfg.eps = c->eps;
    tr->ocfg.weight_decay = c->weight_decay;
    tr->ocfg.clip_norm = c->grad_clip;
    if (!tr->zero)
        return tkd_adamw_init_on(&tr->ocfg, tr->m, &tr->opt);
    size_t b, e;
    tkd_zero_shard(tr->zero, &b, &e);
    return tkd_adamw_init_shard(&tr->ocfg, tr->m, b, e, &tr->opt);
}

/* ---- one step ---------------------------------------------------------------------------------- */

/* The teacher side of a batch for the backend's loss (kl_stage); h and w come with kl_forward. */
static void kl_batch_of(const trainer *tr, const tkd_train_batch *b, tkd_kl_batch *kb)
{
    memset(kb, 0, sizeof *kb);
    kb->n = (int64_t)b->b * b->t;
    kb->d = tr->m->cfg.hidden_size;
    kb->v = tr->V;
    kb->topk_idx = b->topk_idx;
    kb->topk_logit = b->topk_logit;
    kb->teacher_lse = b->teacher_lse;
    kb->tail_idx = b->tail_idx;
    kb->labels = b->labels;
}

/* The next training batch, moving to the next epoch when this one is used up. */
static tkd_status next_batch(trainer *tr, const tkd_train_batch **b)
{
    TKD_TRY(tkd_loader_next(tr->train, b));
    if (*b)
        return TKD_OK;
    int64_t epoch, offset;
    tkd_loader_position(tr->train, &epoch, &offset);
    TKD_TRY(tkd_loader_seek(tr->train, epoch + 1, 0));
    TKD_TRY(tkd_loader_next(tr->train, b));
    if (!*b)
        return tkd_error_set(TKD_ERR_INTERNAL, "the training split gave no batch after a new epoch");
    return TKD_OK;
}

static int64_t count_labels(const tkd_train_batch *b)
{
    int64_t n = 0;
    for (int64_t i = 0; i < (int64_t)b->b * b->t; i++)
        n += b->labels[i] != -100;
    return n;
}

/* Data parallel: the loss of this rank's rows scaled by their share of the global batch's label
 * tokens (all-reduced before the backward), so the gradients the ranks sum are the one-process
 * gradient of the global batch: Σ_r (n_r / N)·mean_r = (1 / N)·Σ rows. One rank: n_r / N = 1 and
 * the scale is the plain path's bit for bit. */
static tkd_status global_scale(trainer *tr, int64_t labels, float *scale)
{
    double n = (double)labels;
    TKD_TRY(tkd_zero_sum(tr->zero, &n, 1, "label-count all-reduce"));
    *scale = n > 0 ? *scale * (float)((double)labels / n) : 0.0f;
    return TKD_OK;
}

/* The teacher batch goes to the backend once the model's forward is enqueued: on CUDA the forward
 * only queues work, so kl_stage's host copy into pinned memory (1.5–2 ms at the 0.5B shape) and its
 * transfer on the copy stream run while the GPU computes the forward, instead of before it starts.
 * backend.h's contract still holds: kl_stage comes before the kl_forward of its batch, and the
 * pinned staging is free again (the previous micro-batch's kl_forward and kl_backward returned
 * after a host sync, and kl_stage itself waits for the last copy out of it). The loss validates
 * the batch before using it, as it always has. `last`: the step's last micro-batch (data parallel:
 * its backward starts the gradient reductions). */
static tkd_status micro_step(trainer *tr, const tkd_train_batch *b, int last, step_stats *ss)
{
    const tkd_backend_ops *op = tr->be->op;
    int64_t labels = b->b > 0 ? count_labels(b) : 0;
    float scale = 1.0f / (float)tr->cfg->grad_accum;
    if (tr->zero) {
        TKD_TRY(global_scale(tr, labels, &scale));
        if (last)
            tkd_zero_arm(tr->zero);
    }
    if (b->b == 0) /* this rank's part of an epoch's short last batch is empty */
        return TKD_OK;
    tr->kp.grad_scale = scale;
    const void *hidden = NULL;
    TKD_TRY(tkd_model_forward(tr->m, b->inputs, b->b, b->t, 1, &hidden));
    tkd_kl_batch kb;
    kl_batch_of(tr, b, &kb);
    TKD_TRY(op->kl_stage(tr->be, tr->kl, &tr->kp, &kb));
    ss->beyond += b->beyond_vocab;
    tkd_kl_result r;
    const void *w = tkd_model_lm_head_dev(tr->m);
    float *dw = tkd_model_lm_head_grad(tr->m);
    if (tr->kp.grad_in_forward) {
        TKD_TRY(op->kl_forward(tr->be, tr->kl, &tr->kp, hidden, w, &r, tr->dh, dw));
    } else {
        TKD_TRY(op->kl_forward(tr->be, tr->kl, &tr->kp, hidden, w, &r, NULL, NULL));
        TKD_TRY(op->kl_backward(tr->be, tr->kl, &tr->kp, hidden, w, scale, tr->dh, dw));
    }
    if (!isfinite(r.loss))
        return tkd_error_set(TKD_ERR_NUMERIC, "the loss is %g at step %" PRId64 " (sequence %" PRId64 " …)", r.loss,
                             tr->st.step + 1, b->seq[0]);
    TKD_TRY(tkd_model_backward(tr->m, tr->dh));
    ss->loss += r.loss * (double)r.n_kept;
    ss->kd += r.kd * (double)r.n_kept;
    ss->ce += r.ce * (double)r.n_kept;
    ss->rows += r.n_kept;
    ss->tokens += labels;
    return TKD_OK;
}

/* Says which step and which cache sequences a failing micro-batch held: the loss names only a row
 * of the batch (row r = slot r / t, position r % t). */
static tkd_status batch_error(tkd_status st, const trainer *tr, const tkd_train_batch *b)
{
    char seqs[192];
    int o = 0;
    for (int j = 0; j < b->b && j < 8 && o < (int)sizeof seqs - 24; j++)
        o += snprintf(seqs + o, sizeof seqs - (size_t)o, "%s%" PRId64, j ? ", " : "", b->seq[j]);
    if (b->b > 8)
        snprintf(seqs + o, sizeof seqs - (size_t)o, ", …");
    return tkd_error_prefix(st, "step %" PRId64 ", sequences [%s] (row r: position r %% %d of the sequence number r / %d "
                            "in this list)", tr->st.step + 1, seqs, b->t, b->t);
}

/* Data parallel: this rank's shard of the summed gradients, clipped by the global norm, AdamW on
 * the shard, and the updated compute weights gathered from every rank. */
static tkd_status zero_update(trainer *tr, step_stats *ss)
{
    ss->lr = tkd_optim_lr(&tr->ocfg, tr->st.step);
    return tkd_zero_update(tr->zero, tr->opt, ss->lr, tr->cfg->grad_clip, &ss->grad_norm);
}

static tkd_status plain_update(trainer *tr, step_stats *ss)
{
    ss->lr = tkd_optim_lr(&tr->ocfg, tr->st.step);
    /* clipping rides in the update: no pass scales the gradients in place */
    return tkd_adamw_clip_step_model(tr->opt, tr->m, ss->lr, tr->cfg->grad_clip, &ss->grad_norm);
}

/* Data parallel: the step's sums over every rank (rank 0 logs them, every rank counts the same
 * tokens), and whether any rank saw a signal, so all stop at the same step. */
static tkd_status agree_stats(trainer *tr, step_stats *ss)
{
    int sig = tkd_interrupted();
    double v[7] = {ss->loss, ss->kd, ss->ce, (double)ss->rows, (double)ss->tokens, (double)ss->beyond, sig != 0};
    TKD_TRY(tkd_zero_sum(tr->zero, v, 7, "step statistics all-reduce"));
    ss->loss = v[0], ss->kd = v[1], ss->ce = v[2];
    ss->rows = (int64_t)v[3], ss->tokens = (int64_t)v[4], ss->beyond = (int64_t)v[5];
    tr->stop_signal = sig ? sig : v[6] > 0 ? SIGTERM : 0;
    return TKD_OK;
}

static tkd_status train_step(trainer *tr, step_stats *ss)
{
    memset(ss, 0, sizeof *ss);
    if (tr->zero)
        tkd_zero_begin_step(tr->zero, tr->st.step + 1);
    TKD_TRY(tkd_model_zero_grad(tr->m));
    for (int a = 0; a < tr->cfg->grad_accum; a++) {
        const tkd_train_batch *b = NULL;
        tkd_status st = next_batch(tr, &b);
        if (st != TKD_OK)
            return tkd_error_prefix(st, "step %" PRId64, tr->st.step + 1);
        /* The step's gradients were just zeroed and the loss writes the LM head's first: its
         * first micro-batch may write that dW instead of adding to zeros (a V·D·4-byte read less). */
        tr->kp.dw_overwrite = a == 0;
        st = micro_step(tr, b, a + 1 == tr->cfg->grad_accum, ss);
        if (st != TKD_OK)
            return b->b > 0 ? batch_error(st, tr, b) : tkd_error_prefix(st, "step %" PRId64, tr->st.step + 1);
    }
    tkd_status st = tr->zero ? zero_update(tr, ss) : plain_update(tr, ss);
    if (st == TKD_OK && tr->zero)
        st = agree_stats(tr, ss);
    if (st != TKD_OK)
        return tkd_error_prefix(st, "step %" PRId64, tr->st.step + 1);
    tr->st.step++;
    tr->st.tokens_seen += ss->tokens;
    tr->beyond_vocab += ss->beyond;
    tr->beyond_total += ss->beyond;
    tkd_loader_position(tr->train, &tr->st.epoch, &tr->st.offset);
    if (ss->rows > 0) {
        ss->loss /= (double)ss->rows;
        ss->kd /= (double)ss->rows;
        ss->ce /= (double)ss->rows;
    }
    return TKD_OK;
}

/* ---- evaluation -------------------------------------------------------------------------------- */

/* Positions (label kept) where the student's argmax equals the teacher's top-1, on a device: the
 * backend's LM-head consumer with k = 1 (ties to the smaller id, as the host's first maximum). */
static tkd_status top1_hits_dev(trainer *tr, const tkd_train_batch *b, const void *hidden, int64_t *hits)
{
    int64_t n = (int64_t)b->b * b->t;
    size_t chunk = EVAL_CHUNK_BYTES / (sizeof(float) * (size_t)tr->V);
    tkd_lmhead_topk_args a = {.hidden = hidden, .w = tkd_model_lm_head_dev(tr->m), .rows = n,
                              .d = tr->m->cfg.hidden_size, .v = tr->V, .k = 1, .tau = 1.0f,
                              .chunk_rows = chunk < 1 ? 1 : chunk > (size_t)n ? (int)n : (int)chunk,
                              .idx = tr->top1, .val = tr->top1_val, .lse = tr->top1_lse};
    TKD_TRY(tr->be->op->lmhead_topk(tr->be, &a));
    *hits = 0;
    for (int64_t i = 0; i < n; i++)
        if (b->labels[i] != -100)
            *hits += (int32_t)tr->top1[i] == b->topk_idx[i * b->k];
    return TKD_OK;
}

/* The same where hidden states and head are host fp32 (tkd_backend_host_f32, the CPU): full logits
 * EVAL_CHUNK_ROWS at a time. */
static tkd_status top1_hits(trainer *tr, const tkd_train_batch *b, const float *hidden, int64_t *out)
{
    int64_t n = (int64_t)b->b * b->t, hits = 0;
    int d = tr->m->cfg.hidden_size;
    for (int64_t r0 = 0; r0 < n; r0 += EVAL_CHUNK_ROWS) {
        int64_t rows = n - r0 < EVAL_CHUNK_ROWS ? n - r0 : EVAL_CHUNK_ROWS;
        TKD_TRY(tkd_model_logits(tr->m, hidden + r0 * d, rows, tr->logits));
        for (int64_t i = 0; i < rows; i++) {
            if (b->labels[r0 + i] == -100)
                continue;
            const float *row = tr->logits + i * tr->V;
            int best = 0;
            for (int v = 1; v < tr->V; v++)
                if (row[v] > row[best])
                    best = v;
            hits += best == b->topk_idx[(r0 + i) * b->k];
        }
    }
    *out = hits;
    return TKD_OK;
}

static tkd_status evaluate(trainer *tr, eval_stats *es)
{
    memset(es, 0, sizeof *es);
    if (!tr->val)
        return TKD_OK;
    TKD_TRY(tkd_loader_seek(tr->val, 0, 0));
    int64_t hits = 0;
    tkd_kl_params kp = tr->kp;
    kp.grad_in_forward = 0;
    for (int nb = 0; tr->cfg->eval_batches == 0 || nb < tr->cfg->eval_batches; nb++) {
        const tkd_train_batch *b = NULL;
        TKD_TRY(tkd_loader_next(tr->val, &b));
        if (!b)
            break;
        if (b->b == 0) /* data parallel: this rank's part of the last batch is empty */
            continue;
        tkd_kl_batch kb;
        kl_batch_of(tr, b, &kb);
        TKD_TRY(tr->be->op->kl_stage(tr->be, tr->kl, &kp, &kb));
        const void *hidden = NULL;
        TKD_TRY(tkd_model_forward(tr->m, b->inputs, b->b, b->t, 0, &hidden));
        tkd_kl_result r;
        TKD_TRY(tr->be->op->kl_forward(tr->be, tr->kl, &kp, hidden, tkd_model_lm_head_dev(tr->m), &r, NULL, NULL));
        es->loss += r.loss * (double)r.n_kept;
        es->kd += r.kd * (double)r.n_kept;
        es->ce += r.ce * (double)r.n_kept;
        es->rows += r.n_kept;
        int64_t h = 0;
        if (b->k > 0 && tkd_backend_host_f32(tr->be))
            TKD_TRY(top1_hits(tr, b, hidden, &h));
        else if (b->k > 0)
            TKD_TRY(top1_hits_dev(tr, b, hidden, &h));
        hits += h;
    }
    if (tr->zero) {
        double v[5] = {es->loss, es->kd, es->ce, (double)es->rows, (double)hits};
        TKD_TRY(tkd_zero_sum(tr->zero, v, 5, "evaluation all-reduce"));
        es->loss = v[0], es->kd = v[1], es->ce = v[2], es->rows = (int64_t)v[3], hits = (int64_t)v[4];
    }
    if (es->rows > 0) {
        es->loss /= (double)es->rows;
        es->kd /= (double)es->rows;
        es->ce /= (double)es->rows;
        es->top1 = tr->k_use > 0 ? (double)hits / (double)es->rows : NAN;
    }
    return TKD_OK;
}

/* ---- run directory, metrics, checkpoints ---------------------------------------------------- */

static void json_num(FILE *f, const char *key, double v)
{
    if (isfinite(v))
        fprintf(f, ", \"%s\": %.9g", key, v);
    else
        fprintf(f, ", \"%s\": null", key);
}

/* A lost metrics line must not pass silently: a full disk is an error like any other write. */
static tkd_status metrics_flush(trainer *tr)
{
    if (fflush(tr->metrics) != 0 || ferror(tr->metrics))
        return tkd_error_set(errno == ENOSPC ? TKD_ERR_NOSPACE : TKD_ERR_IO, "%s: writing metrics failed: %s%s",
                             tr->metrics_path, strerror(errno), errno == ENOSPC ? " (disk full — free space and --resume)" : "");
    return TKD_OK;
}

static tkd_status log_train(trainer *tr, const step_stats *ss)
{
    double el = tkd_progress_now() - tr->t0;
    fprintf(tr->metrics, "{\"type\": \"train\", \"step\": %" PRId64 ", \"tokens\": %" PRId64, tr->st.step,
            tr->st.tokens_seen);
    json_num(tr->metrics, "loss", ss->loss);
    json_num(tr->metrics, "kd", tr->kp.alpha > 0 ? ss->kd : NAN);
    json_num(tr->metrics, "ce", ss->ce);
    json_num(tr->metrics, "lr", ss->lr);
    json_num(tr->metrics, "grad_norm", ss->grad_norm);
    json_num(tr->metrics, "elapsed_s", el);
    if (tr->V < (int)(tr->cache ? tkd_cache_reader_manifest(tr->cache)->id.vocab_size : 0))
        fprintf(tr->metrics, ", \"beyond_vocab\": %" PRId64, tr->beyond_vocab);
    tr->beyond_vocab = 0;
    fprintf(tr->metrics, "}\n");
    return metrics_flush(tr);
}

static tkd_status log_eval(trainer *tr, const eval_stats *es)
{
    fprintf(tr->metrics, "{\"type\": \"eval\", \"step\": %" PRId64 ", \"tokens\": %" PRId64, tr->st.step,
            tr->st.tokens_seen);
    json_num(tr->metrics, "val_loss", es->loss);
    json_num(tr->metrics, "val_kd", tr->kp.alpha > 0 ? es->kd : NAN);
    json_num(tr->metrics, "val_ce", es->ce);
    json_num(tr->metrics, "val_ppl", exp(es->ce));
    json_num(tr->metrics, "top1_agree", es->top1);
    fprintf(tr->metrics, "}\n");
    TKD_TRY(metrics_flush(tr));
    tkd_log_info("eval  step %" PRId64 ": val CE %.4f (ppl %.2f)%s", tr->st.step, es->ce, exp(es->ce), "");
    if (tr->kp.alpha > 0 && es->rows > 0)
        tkd_log_info("      val KD %.4f, top-1 agreement with the teacher %.3f", es->kd, es->top1);
    return TKD_OK;
}

/* Length of the metrics.jsonl record starting at line, its '\n' included (text ends at end). */
static size_t record_len(const char *line, const char *end)
{
    const char *nl = memchr(line, '\n', (size_t)(end - line));
    return nl ? (size_t)(nl - line) + 1 : (size_t)(end - line);
}

/* A record's step, and whether it is an evaluation (is_eval may be NULL); log_train and log_eval
 * write these exact spellings. */
static int64_t record_step(const char *line, size_t n, bool *is_eval)
{
    const char *sp = strstr(line, "\"step\": ");
    const char *ev = strstr(line, "\"type\": \"eval\"");
    if (is_eval)
        *is_eval = ev && ev < line + n;
    return sp && sp < line + n ? atoll(sp + 8) : 0;
}

/* Keeps the metrics lines of steps <= step (a resumed run rewrites what came after). */
static tkd_status trim_metrics(const char *path, int64_t step)
{
    void *data = NULL;
    size_t len = 0;
    if (!tkd_file_exists(path))
        return TKD_OK;
    TKD_TRY(tkd_read_file(path, &data, &len));
    char *text = data, *out = malloc(len + 1);
    size_t o = 0;
    for (char *line = text; out && line < text + len;) {
        size_t n = record_len(line, text + len);
        if (record_step(line, n, NULL) <= step) {
            memcpy(out + o, line, n);
            o += n;
        }
        line += n;
    }
    tkd_status st = out ? tkd_file_write_atomic(path, out, o) : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    free(out);
    free(data);
    return st;
}

/* The checkpoint is at the last step and the final evaluation is in the metrics (or there is no
 * validation split): a resume has nothing left to do. An evaluation at the last step is only ever
 * the final one (eval_interval skips that step). */
static bool run_finished(const trainer *tr)
{
    if (tr->total_steps <= 0 || tr->st.step < tr->total_steps)
        return false;
    if (!tr->val)
        return true;
    void *data = NULL;
    size_t len = 0;
    bool found = false;
    if (tkd_read_file(tr->metrics_path, &data, &len) != TKD_OK)
        return false;
    for (char *line = data, *end = line + len; !found && line < end;) {
        size_t n = record_len(line, end);
        bool is_eval;
        found = record_step(line, n, &is_eval) == tr->st.step && is_eval;
        line += n;
    }
    free(data);
    return found;
}

/* --resume: the checkpoint's state, and the metrics cut back to it. A finished run is left as it
 * is (tr->finished_before): resuming it again appended its final records twice. */
/* Data parallel: each rank restores the weights and its shard of the moments, whatever the number
 * of ranks that wrote the checkpoint (checkpoint.h re-shards). */
static tkd_status load_sharded(trainer *tr)
{
    size_t n = tr->opt->n;
    float *mm = n ? malloc(n * sizeof(float)) : NULL, *vv = n ? malloc(n * sizeof(float)) : NULL;
    int64_t adamw_step = 0;
    tkd_status st = n && (!mm || !vv) ? tkd_error_set(TKD_ERR_NOMEM, "out of host memory for the optimizer shard")
                                      : TKD_OK;
    if (st == TKD_OK)
        st = tkd_checkpoint_load_shard(tr->ckpt, tr->m, tr->dist.rank, tr->dist.world, mm, vv, &adamw_step, &tr->st);
    if (st == TKD_OK && n)
        st = tkd_adamw_moments_set(tr->opt, mm, vv);
    if (st == TKD_OK)
        tr->opt->step = adamw_step;
    free(mm);
    free(vv);
    return st;
}

static tkd_status resume(trainer *tr)
{
    TKD_TRY(tr->zero ? load_sharded(tr) : tkd_checkpoint_load(tr->ckpt, tr->m, tr->opt, &tr->st));
    if (run_finished(tr)) {
        tr->finished_before = true;
        return TKD_OK;
    }
    if (tr->dist.rank > 0) /* rank 0 owns the metrics and says what happens */
        return TKD_OK;
    TKD_TRY(trim_metrics(tr->metrics_path, tr->st.step));
    tkd_log_info("resumed %s at step %" PRId64 " (epoch %" PRId64 ", sequence %" PRId64 ")", tr->ckpt, tr->st.step,
                 tr->st.epoch, tr->st.offset);
    const char *why = NULL;
    if (tr->be->policy && !tkd_cuda_policy_deterministic(tr->be->policy, &why))
        tkd_log_warn("%s is on: from here the run is not bit-identical to one that was never stopped (unset it "
                     "for an exact resume; docs/config.md)", why);
    return TKD_OK;
}

/* Ranks > 0 on --resume: the same checkpoint as rank 0 (which found it before the rendezvous). */
static tkd_status follow_resume(trainer *tr)
{
    TKD_TRY(resume(tr));
    return tr->finished_before ? TKD_OK : tkd_loader_seek(tr->train, tr->st.epoch, tr->st.offset);
}

/* tr->run is open and locked (tkd_run_dir_open) on rank 0. */
static tkd_status prepare_run_dir(trainer *tr)
{
    const tkd_train_opts *o = tr->opts;
    TKD_TRY(tkd_path_join(tr->ckpt, sizeof tr->ckpt, tr->run, "checkpoint"));
    TKD_TRY(tkd_path_join(tr->metrics_path, sizeof tr->metrics_path, tr->run, "metrics.jsonl"));
    if (tr->dist.rank > 0) /* the other ranks only read a checkpoint to resume from */
        return o->resume ? follow_resume(tr) : tkd_loader_seek(tr->train, 0, 0);
    if (o->overwrite)
        TKD_TRY(tkd_run_dir_clear(tr->run));
    if (!o->resume && !tr->cfg->eval_only && tkd_file_exists(tr->metrics_path))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s already holds a run — add --resume to continue it, --overwrite to start over, "
                             "or choose another run.name", tr->run);
    if (o->resume && !tkd_file_exists(tr->ckpt))
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: no checkpoint to resume from", tr->ckpt);
    if (o->resume) {
        TKD_TRY(resume(tr));
        if (tr->finished_before)
            return TKD_OK;
    }
    char path[RUN_PATH_MAX];
    TKD_TRY(tkd_path_join(path, sizeof path, tr->run, "config.yaml"));
    TKD_TRY(tkd_file_write_atomic(path, tr->config_yaml, strlen(tr->config_yaml)));
    tr->metrics = fopen(tr->metrics_path, o->resume ? "a" : "w");
    if (!tr->metrics)
        return tkd_error_set(errno == ENOSPC ? TKD_ERR_NOSPACE : TKD_ERR_IO,
                             "%s: cannot open the metrics file for writing: %s — check the run directory's "
                             "permissions and free space", tr->metrics_path, strerror(errno));
    return tkd_loader_seek(tr->train, tr->st.epoch, tr->st.offset);
}

/* Data parallel (checkpoint.h's protocol): every rank writes its shard of the AdamW moments into
 * the checkpoint being built, rank 0 the weights (the master made whole first) and the state, and
 * commits once every shard is there; all ranks then learn whether the checkpoint counts. */
static tkd_status save_sharded(trainer *tr)
{
    TKD_TRY(tkd_zero_gather_master(tr->zero));
    size_t n = tr->opt->n;
    float *mm = n ? malloc(n * sizeof(float)) : NULL, *vv = n ? malloc(n * sizeof(float)) : NULL;
    tkd_status st = n && (!mm || !vv) ? tkd_error_set(TKD_ERR_NOMEM, "out of host memory for the optimizer shard")
                                      : TKD_OK;
    if (st == TKD_OK && n)
        st = tkd_adamw_moments_get(tr->opt, mm, vv);
    if (st == TKD_OK)
        st = tkd_checkpoint_save_shard(tr->ckpt, tr->job_id, tr->st.step, tr->dist.rank, tr->dist.world,
                                       tr->m->n_params, mm, vv);
    free(mm);
    free(vv);
    if (st == TKD_OK && tr->dist.rank == 0)
        st = tkd_checkpoint_commit(tr->ckpt, tr->job_id, tr->st.step, tr->m, tr->opt->step, tr->dist.world, &tr->st,
                                   tr->config_yaml, tr->dist_timeout_s);
    /* a rank that failed says so to the others, so none goes on believing the checkpoint counts */
    double failed = st != TKD_OK;
    tkd_error_saved keep;
    tkd_error_save(&keep, st);
    tkd_status agree = tkd_zero_sum(tr->zero, &failed, 1, "checkpoint agreement all-reduce");
    st = tkd_error_restore(&keep);
    if (st == TKD_OK && agree != TKD_OK)
        return agree;
    if (st == TKD_OK && failed > 0)
        return tkd_error_set(TKD_ERR_IO, "checkpoint %s at step %" PRId64 ": another rank failed to write its part "
                             "(its log says why); the previous checkpoint stays valid", tr->ckpt, tr->st.step);
    return st;
}

static tkd_status save(trainer *tr)
{
    if (tr->zero)
        TKD_TRY(save_sharded(tr));
    else
        TKD_TRY(tkd_checkpoint_save(tr->ckpt, tr->m, tr->opt, &tr->st, tr->config_yaml));
    if (tr->dist.rank == 0)
        tkd_log_info("checkpoint: %s (step %" PRId64 ")", tr->ckpt, tr->st.step);
    return TKD_OK;
}

/* ---- the loop ----------------------------------------------------------------------------------- */

/* The progress line counts steps and shows the token rate (a step can take seconds on a CPU, where
 * "0.0 steps/s" would say nothing); the extra text carries the loss. */
static void progress_line(trainer *tr, const step_stats *ss)
{
    char extra[96];
    snprintf(extra, sizeof extra, "loss %.4f  ce %.4f  lr %.2e", ss->loss, ss->ce, ss->lr);
    tkd_progress_update_rate(&tr->progress, tr->st.step - tr->step0, tr->st.tokens_seen - tr->tokens0, extra);
}

static tkd_status eval_and_log(trainer *tr, eval_stats *es)
{
    TKD_TRY(evaluate(tr, es));
    if (es->rows > 0 && tr->dist.rank == 0)
        TKD_TRY(log_eval(tr, es));
    return TKD_OK;
}

/* train.stop_after: a checkpoint and no final evaluation, so that a run continued with --resume
 * writes the same metrics and weights as one that never stopped. */
static tkd_status stop_early(trainer *tr, tkd_train_result *res)
{
    const tkd_train_config *c = tr->cfg;
    if (c->checkpoint_interval <= 0 || tr->st.step % c->checkpoint_interval != 0)
        TKD_TRY(save(tr));
    if (tr->dist.rank == 0) {
        tkd_progress_finish(&tr->progress, NULL);
        tkd_log_info("stopped after step %" PRId64 " of %" PRId64 " (train.stop_after) — continue with --resume",
                     tr->st.step, tr->total_steps);
    }
    res->val_loss = res->val_kd = res->val_ce = res->val_ppl = res->top1_agree = NAN;
    return TKD_OK;
}

static tkd_status loop(trainer *tr, tkd_train_result *res)
{
    const tkd_train_config *c = tr->cfg;
    step_stats ss = {0};
    eval_stats es = {0};
    while (tr->st.step < tr->total_steps) {
        tkd_status st = train_step(tr, &ss);
        if (st != TKD_OK && !tkd_file_exists(tr->ckpt))
            return tkd_error_prefix(st, "training stopped (no checkpoint written yet)");
        if (st != TKD_OK)
            return tkd_error_prefix(st, "training stopped (last good checkpoint: %s)", tr->ckpt);
        res->train_loss = ss.loss;
        if (tr->dist.rank == 0 && (tr->st.step % c->log_interval == 0 || tr->st.step == tr->total_steps))
            TKD_TRY(log_train(tr, &ss));
        if (tr->dist.rank == 0)
            progress_line(tr, &ss);
        if (c->eval_interval > 0 && tr->st.step % c->eval_interval == 0 && tr->st.step < tr->total_steps)
            TKD_TRY(eval_and_log(tr, &es));
        if (c->checkpoint_interval > 0 && tr->st.step % c->checkpoint_interval == 0)
            TKD_TRY(save(tr));
        /* == (not >=): resuming with the same overrides (a derived run name includes them) goes on */
        if (c->stop_after > 0 && tr->st.step == c->stop_after && tr->st.step < tr->total_steps)
            return stop_early(tr, res);
        int sig = tr->zero ? tr->stop_signal : tkd_interrupted();
        if (sig) {
            TKD_TRY(save(tr));
            return tkd_error_set(TKD_ERR_INTERRUPTED, "interrupted by signal %d at step %" PRId64
                                 "; checkpoint saved — continue with --resume", sig, tr->st.step);
        }
    }
    if (tr->total_steps > 0 && tr->dist.rank == 0)
        tkd_progress_finish(&tr->progress, NULL);
    if (tr->beyond_total > 0 && tr->dist.rank == 0)
        tkd_log_info("teacher entries beyond the student's vocabulary: %" PRId64 " in training (%s)", tr->beyond_total,
                     tr->kp.variant == TKD_KL_VARIANT_RENORM ? "dropped, the rest renormalised" : "mass in the tail");
    TKD_TRY(eval_and_log(tr, &es));
    if (tr->total_steps > 0)
        TKD_TRY(save(tr));
    res->val_loss = es.rows ? es.loss : NAN;
    res->val_kd = es.rows && tr->kp.alpha > 0 ? es.kd : NAN;
    res->val_ce = es.rows ? es.ce : NAN;
    res->val_ppl = es.rows ? exp(es.ce) : NAN;
    res->top1_agree = es.rows ? es.top1 : NAN;
    return TKD_OK;
}

static void trainer_free(trainer *tr)
{
    free(tr->config_yaml);
    if (tr->metrics)
        fclose(tr->metrics);
    tkd_loader_close(tr->train);
    tkd_loader_close(tr->val);
    tkd_cache_reader_close(tr->cache);
    tkd_cache_reader_close(tr->val_cache);
    tkd_tokens_free(tr->tokens);
    tkd_tokens_free(tr->val_tokens);
    tkd_zero_close(tr->zero);
    if (tr->be) {
        tr->be->op->kl_free(tr->be, tr->kl);
        tr->be->op->free(tr->be, tr->dh);
    }
    tkd_adamw_free(tr->opt);
    tkd_model_free(tr->m);
    tkd_backend_close(tr->be);
    free(tr->logits);
    free(tr->top1);
    free(tr->top1_val);
    free(tr->top1_lse);
    tkd_dir_lock_release(tr->lock);
}

/* device: auto | cpu | cuda resolved before anything is made (cuda where no GPU answers is refused
 * here, with the hint to use cpu); the backend itself opens after the run directory's lock. */
static tkd_status pick_device(const tkd_train_config *c, tkd_device *got)
{
    return tkd_backend_resolve((tkd_device)c->device, got);
}

static tkd_status open_backend(trainer *tr, tkd_device dev)
{
    TKD_TRY(tkd_backend_open_local(dev, &tr->dist, &tr->be)); /* the GPU of this rank on its node */
    if (tr->dist.rank == 0)
        tkd_log_info("device: %s%s", tr->be->name,
                     tr->be->master_lo_size > 0 ? " (bf16 compute, fp32 master weights)" : "");
    if (!(tr->config_yaml = strdup(tr->opts->config_yaml)))
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    if (!tr->be->policy)
        return TKD_OK;
    char text[512];
    tkd_cuda_policy_format(tr->be->policy, text, sizeof text);
    if (tr->dist.rank == 0)
        tkd_log_debug("CUDA kernel choices: %s", text);
    return tkd_cuda_policy_append_note(tr->be->policy, &tr->config_yaml);
}

tkd_status tkd_train_check_world(const tkd_train_config *c, int world, int device)
{
    if (world > 1 && !tkd_backend_device_data_parallel((tkd_device)device))
        return tkd_error_set(TKD_ERR_CONFIG, "%d ranks need device: cuda — data-parallel training runs over NCCL "
                             "between GPUs; start one process for the CPU", world);
    if (c->batch_size % world != 0)
        return tkd_error_set(TKD_ERR_CONFIG, "train.batch_size = %d is the global batch: it must be a multiple of the "
                             "%d ranks (each takes batch_size / ranks sequences)", c->batch_size, world);
    return TKD_OK;
}

/* Who this process is: one process (world 1, no launcher: the plain path), or a rank of a run a
 * launcher started (`--nproc-per-node`, srun; even with one rank: the NCCL path). Sets the
 * per-rank batch: train.batch_size is the global batch, split evenly over the ranks. */
static tkd_status dist_setup(trainer *tr, tkd_device dev)
{
    const tkd_train_config *c = tr->cfg;
    TKD_TRY(tkd_dist_from_env(&tr->dist));
    tr->dist_timeout_s = c->dist_timeout_s;
    tr->B = c->batch_size;
    if (tr->dist.source == TKD_DIST_SINGLE)
        return TKD_OK;
    TKD_TRY(tkd_train_check_world(c, tr->dist.world, dev));
    /* on CUDA the rendezvous and every checkpoint's staging need it, even in a world of one where
     * the rendezvous exchanges nothing: refused now rather than at the first checkpoint. The CPU
     * (a world of one) would not use it, but is held to the same rule, so a launch line that is
     * refused on one device is not accepted on the other. */
    tkd_dist_job_id(tr->job_id, sizeof tr->job_id);
    if (!*tr->job_id)
        return tkd_error_set(TKD_ERR_CONFIG, "rank %d of %d (%s) has no job id (TKD_JOB_ID, SLURM_JOB_ID or "
                             "TORCHELASTIC_RUN_ID) — start the ranks with srun or --nproc-per-node, or export the same "
                             "TKD_JOB_ID to every rank", tr->dist.rank, tr->dist.world,
                             tkd_dist_source_name(tr->dist.source));
    tr->B = c->batch_size / tr->dist.world;
    return TKD_OK;
}

/* Rank 0 claims and locks the run directory as a single process does; the others only need its
 * path (a resume reads the checkpoint there) and make the rendezvous directory beside it. */
static tkd_status open_run_dir(trainer *tr)
{
    const tkd_train_config *c = tr->cfg;
    if (tr->dist.rank == 0)
        TKD_TRY(tkd_run_dir_open(c, tr->opts->run_name, tr->run, sizeof tr->run, &tr->lock));
    else
        TKD_TRY(tkd_path_join(tr->run, sizeof tr->run, c->run_dir, tr->opts->run_name));
    if (tr->dist.source == TKD_DIST_SINGLE)
        return TKD_OK;
    if (c->dist_dir && c->dist_dir[0]) {
        snprintf(tr->dist_dir, sizeof tr->dist_dir, "%s", c->dist_dir);
    } else { /* beside the run directory, not in it: its entries are the tool's own (run_dir.h) */
        char name[512];
        snprintf(name, sizeof name, ".%s.dist", tr->opts->run_name);
        TKD_TRY(tkd_path_join(tr->dist_dir, sizeof tr->dist_dir, c->run_dir, name));
    }
    return tkd_mkdir_p(tr->dist_dir);
}

/* After the student exists (its gradients sized): the communicator, the shard and the hook. */
static tkd_status open_zero(trainer *tr)
{
    if (tr->dist.source == TKD_DIST_SINGLE || !tr->be->data_parallel)
        return TKD_OK;
    tkd_rdzv_config rc;
    TKD_TRY(tkd_rdzv_config_from_env(&rc, tkd_train_rdzv_kind(tr->cfg->dist_rendezvous), tr->dist_dir,
                                     tr->dist_timeout_s));
    rc.job_id = tr->job_id; /* read once, in dist_setup */
    TKD_TRY(tkd_zero_open(&tr->dist, &rc, tr->dist_dir, tr->m, &tr->zero));
    size_t b, e;
    tkd_zero_shard(tr->zero, &b, &e);
    if (tr->dist.rank == 0)
        tkd_log_info("data parallel: %d ranks (%s), %d sequences each per micro-batch; rank 0 updates parameters "
                     "[%zu, %zu) of %zu (ZeRO-1)", tr->dist.world, tkd_dist_source_name(tr->dist.source), tr->B, b,
                     e, tr->m->n_params);
    return TKD_OK;
}

tkd_status tkd_train_run(const tkd_train_opts *o, tkd_train_result *res)
{
    trainer tr = {.cfg = o->cfg, .opts = o};
    memset(res, 0, sizeof *res);
    tkd_device dev = TKD_DEVICE_CPU;
    tkd_status st = pick_device(o->cfg, &dev);
    if (st == TKD_OK) st = dist_setup(&tr, dev);
    /* the run directory and its lock first: a second run on it is refused before anything loads */
    if (st == TKD_OK) st = open_run_dir(&tr);
    if (st == TKD_OK) st = open_backend(&tr, dev);
    if (st == TKD_OK) st = open_data(&tr);
    if (st == TKD_OK) st = build_model(&tr);
    if (st == TKD_OK) st = open_zero(&tr);
    if (st == TKD_OK) st = build_loss(&tr);
    if (st == TKD_OK) st = build_optimizer(&tr);
    if (st == TKD_OK) st = prepare_run_dir(&tr);
    res->finished_before = tr.finished_before;
    res->val_loss = res->val_kd = res->val_ce = res->val_ppl = res->top1_agree = NAN;
    if (st == TKD_OK && !tr.finished_before) {
        tr.t0 = tkd_progress_now();
        tr.tokens0 = tr.st.tokens_seen;
        /* the rate and ETA are about this run: steps before a resume are not counted */
        tr.step0 = tr.st.step;
        tkd_progress_begin(&tr.progress, "train", tr.total_steps - tr.step0, "steps");
        tkd_progress_set_rate_unit(&tr.progress, "tok");
        if (tr.dist.rank == 0)
            tkd_log_info("student: %zu parameters, %d layers, D=%d, V=%d; %" PRId64 " steps of %d x %d x %d tokens",
                     tr.m->n_params, tr.m->cfg.num_hidden_layers, tr.m->cfg.hidden_size, tr.V, tr.total_steps,
                     o->cfg->batch_size, o->cfg->grad_accum, tr.T);
        st = loop(&tr, res);
    }
    res->steps = tr.st.step;
    res->tokens = tr.st.tokens_seen;
    res->seconds = tr.t0 > 0 ? tkd_progress_now() - tr.t0 : 0;
    snprintf(res->run_path, sizeof res->run_path, "%s", tr.run);
    /* keep the message of the first failure while the buffers are released */
    /* every line was flushed and checked; a failing close can still lose the last ones (NFS) */
    if (tr.metrics && fclose(tr.metrics) != 0 && st == TKD_OK)
        st = tkd_error_set(TKD_ERR_IO, "%s: closing the metrics file failed: %s — its last lines may be missing",
                           tr.metrics_path, strerror(errno));
    tr.metrics = NULL;
    tkd_error_saved keep;
    tkd_error_save(&keep, st);
    trainer_free(&tr);
    return tkd_error_restore(&keep);
}

void tkd_train_derive_name(char *out, size_t cap, const char *config_path, const char *const *sets, size_t nsets)
{
    size_t o = 0;
    const char *base = config_path ? strrchr(config_path, '/') : NULL;
    base = base ? base + 1 : (config_path ? config_path : "run");
    const char *dot = strrchr(base, '.');
    size_t blen = dot && dot > base ? (size_t)(dot - base) : strlen(base);
    char tmp[1024];
    int n = snprintf(tmp, sizeof tmp, "%.*s", (int)blen, base);
    for (size_t i = 0; i < nsets && n > 0 && (size_t)n < sizeof tmp; i++)
        n += snprintf(tmp + n, sizeof tmp - (size_t)n, "__%s", sets[i]);
    for (const char *p = tmp; *p && o + 1 < cap; p++) {
        char ch = *p;
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
                 ch == '_' || ch == '-';
        out[o++] = ok ? ch : '-';
    }
    if (cap)
        out[o] = '\0';
}
