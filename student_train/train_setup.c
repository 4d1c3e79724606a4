/* train_setup.c — a student-train run's inputs (train_internal.h): the data (teacher cache or token
 * files, the held-out split), the student, the fused loss and the optimizer. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/test_hooks.h"
#include "student_train/train_internal.h"

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

/* kd.divergence with kd.variant and the cache's tail draws, as the loss will see them (its one
 * check, tkd_kl_params_check): a bad combination is a config error (exit 2) before anything is built. */
static tkd_status check_divergence(const tkd_train_config *c, const tkd_cache_manifest *m)
{
    tkd_kl_params kp;
    tkd_kl_params_defaults(&kp, m->id.k);
    kp.variant = (tkd_kl_variant)c->kd_variant;
    kp.divergence = (tkd_kl_divergence)c->kd_divergence;
    kp.jsd_beta = (float)c->kd_jsd_beta;
    kp.skew_alpha = (float)c->kd_skew_alpha;
    kp.s = kp.variant == TKD_KL_VARIANT_SAMPLED ? m->id.tail_samples : 0;
    if (tkd_kl_params_check(&kp, (int)m->id.vocab_size) == TKD_OK)
        return TKD_OK;
    char msg[TKD_ERROR_MSG_MAX];
    const char *e = tkd_error_msg(), *lib = "kl_loss: ";
    snprintf(msg, sizeof msg, "%s", strncmp(e, lib, strlen(lib)) == 0 ? e + strlen(lib) : e);
    return tkd_error_set(TKD_ERR_CONFIG, "%s", msg);
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
    return check_divergence(c, m);
}

static tkd_status open_cache_sources(trainer *tr, int64_t **tsplit, int64_t *nt, int64_t **vsplit, int64_t *nv)
{
    const tkd_train_config *c = tr->cfg;
    TKD_TRY(tkd_cache_reader_open(&tr->cache, c->cache, NULL));
    const tkd_cache_manifest *m = tkd_cache_reader_manifest(tr->cache);
    TKD_TRY(check_cache_against_config(tr, m));
    tr->V = (int)m->id.vocab_size;
    tr->T = c->seq_len > 0 ? c->seq_len : m->id.seq_len;
    if (m->id.packed)
        tkd_log_info("%s: sequences of packed documents (teacher-dump's data.packing: documents): attention stays "
                     "inside each document", c->cache);
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
            vm->id.k < tr->k_use || vm->id.seq_len < tr->T || vm->id.tail_samples < tr->S ||
            vm->id.packed != m->id.packed)
            return tkd_error_set(TKD_ERR_MISMATCH,
                                 "%s: the validation cache does not match %s (teacher, vocabulary, k, seq_len, "
                                 "tail draws or packing differ)", c->val_cache, c->cache);
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

/* The sequences of a token source: windows every T tokens (the last padded), or with data.packing:
 * documents its documents packed (*pack made here, owned by the trainer). */
static tkd_status token_sequences(trainer *tr, const tkd_tokens *ds, tkd_doc_pack **pack, int64_t *n)
{
    if (tr->cfg->packing != TKD_PACKING_DOCUMENTS) {
        *n = tkd_tokens_num_windows(ds, tr->T, tr->T, 1);
        return TKD_OK;
    }
    TKD_TRY(tkd_doc_pack_build(ds, tr->T, pack));
    *n = tkd_doc_pack_count(*pack);
    tkd_log_info("data.packing: documents: %lld documents in %lld sequences of %d positions",
                 (long long)tkd_doc_pack_docs(*pack), (long long)*n, tr->T);
    return TKD_OK;
}

static tkd_status open_token_sources(trainer *tr, int64_t **tsplit, int64_t *nt, int64_t **vsplit, int64_t *nv)
{
    const tkd_train_config *c = tr->cfg;
    if (c->kd_alpha > 0 && !*c->kd_teacher)
        return tkd_error_set(TKD_ERR_CONFIG,
                             "kd.alpha = %g needs a teacher: set data.cache (a teacher-dump output) or kd.teacher (a "
                             "checkpoint run online), or kd.alpha = 0 for CE-only training on data.tokens",
                             c->kd_alpha);
    if (c->tokens.n == 0)
        return tkd_error_set(TKD_ERR_CONFIG, "no data: set data.cache (a teacher cache) or data.tokens (token files)");
    if (c->seq_len <= 0)
        return tkd_error_set(TKD_ERR_CONFIG, "data.seq_len must be set for CE-only training on data.tokens");
    tr->T = c->seq_len;
    tr->k_use = 0;
    tr->S = 0;
    TKD_TRY(tkd_tokens_open_list((const char *const *)c->tokens.items, (int)c->tokens.n, &tr->tokens));
    char trained[160];
    if (tkd_tokens_trained_summary(tr->tokens, trained, sizeof trained))
        tkd_log_info("data.tokens: %s", trained);
    int64_t n;
    TKD_TRY(token_sequences(tr, tr->tokens, &tr->pack, &n));
    if (c->val_tokens.n > 0) {
        TKD_TRY(tkd_tokens_open_list((const char *const *)c->val_tokens.items, (int)c->val_tokens.n,
                                     &tr->val_tokens));
        if (tkd_tokens_trained_summary(tr->val_tokens, trained, sizeof trained))
            tkd_log_info("data.val_tokens: %s", trained);
        *nt = c->max_sequences > 0 && c->max_sequences < n ? c->max_sequences : n;
        TKD_TRY(token_sequences(tr, tr->val_tokens, &tr->val_pack, nv));
        *tsplit = range_split(0, *nt);
        *vsplit = range_split(0, *nv);
    } else {
        holdout(n, c->val_fraction, c->max_sequences, nt, nv);
        *tsplit = range_split(0, *nt);
        *vsplit = range_split(n - *nv, *nv);
    }
    return *tsplit && *vsplit ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
}

/* train.keep_best and train.early_stop_patience compare evaluations: they need a validation split,
 * and val_kd needs a KD term. */
static tkd_status check_best(const trainer *tr)
{
    const tkd_train_config *c = tr->cfg;
    const char *key = c->keep_best ? "train.keep_best" : "train.early_stop_patience";
    if (c->best_metric == TKD_TRAIN_BEST_VAL_KD && c->kd_alpha <= 0)
        return tkd_error_set(TKD_ERR_CONFIG, "train.best_metric = val_kd needs kd.alpha > 0 (with kd.alpha = 0 there "
                             "is no KD to compare); use val_ce");
    if ((c->keep_best || c->early_stop_patience > 0) && !tr->val)
        return tkd_error_set(TKD_ERR_CONFIG, "%s needs a validation split to compare evaluations, but it is empty — "
                             "set data.val_fraction > 0 or a separate validation set", key);
    return TKD_OK;
}

tkd_status tkd_train_open_data(trainer *tr)
{
    const tkd_train_config *c = tr->cfg;
    int64_t *ts = NULL, *vs = NULL, nt = 0, nv = 0;
    tkd_status st = *c->cache ? open_cache_sources(tr, &ts, &nt, &vs, &nv) : open_token_sources(tr, &ts, &nt, &vs, &nv);
    if (st == TKD_OK && nt < 1)
        st = tkd_error_set(TKD_ERR_CONFIG, "the training split is empty (%s)", *c->cache ? c->cache : "data.tokens");
    tkd_loader_opts lo = {.batch_size = tr->B, .seq_len = tr->T, .k = tr->k_use, .with_tail = tr->S > 0,
                          .prefetch = c->prefetch, .seed = (uint64_t)c->seed, .shuffle = 1,
                          .rank = tr->dist.rank, .world = tr->dist.world};
    lo.pack = tr->pack;
    if (st == TKD_OK)
        st = tkd_loader_open(&tr->train, tr->cache, tr->cache ? NULL : tr->tokens, ts, nt, &lo);
    lo.shuffle = 0;
    if (st == TKD_OK && nv > 0) {
        tkd_cache_reader *vc = tr->val_cache ? tr->val_cache : tr->cache;
        const tkd_tokens *vt = tr->val_tokens ? tr->val_tokens : tr->tokens;
        lo.pack = tr->val_tokens ? tr->val_pack : tr->pack;
        st = tkd_loader_open(&tr->val, vc, vc ? NULL : vt, vs, nv, &lo);
    }
    free(ts);
    free(vs);
    if (st == TKD_OK)
        st = check_best(tr);
    if (st == TKD_OK)
        tkd_log_info("data: %" PRId64 " training and %" PRId64 " validation sequences of %d tokens%s", nt, nv, tr->T,
                     tr->cache ? "" : " (CE only, no teacher)");
    return st;
}

/* ---- model and loss ---------------------------------------------------------------------------- */

static void student_config(const tkd_train_config *c, int vocab, tkd_model_config *mc)
{
    tkd_model_config_defaults(mc);
    static const tkd_arch archs[] = {[TKD_TRAIN_ARCH_LLAMA] = TKD_ARCH_LLAMA, [TKD_TRAIN_ARCH_QWEN2] = TKD_ARCH_QWEN2,
                                     [TKD_TRAIN_ARCH_QWEN3] = TKD_ARCH_QWEN3};
    mc->arch = archs[c->model_arch];
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

/* kd.teacher: the checkpoint distilled from online, on the student's backend, its vocabulary the
 * student's; its forward runs on every batch (tkd_train_teacher_side). */
static tkd_status open_teacher(trainer *tr)
{
    const tkd_train_config *c = tr->cfg;
    if (!*c->kd_teacher)
        return TKD_OK;
    if (*c->cache)
        return tkd_error_set(TKD_ERR_CONFIG, "kd.teacher and data.cache are two teachers: distil from the cache, or "
                             "set data.cache empty and give data.tokens to distil from kd.teacher online");
    if (c->kd_variant != TKD_KL_VARIANT_RENORM)
        return tkd_error_set(TKD_ERR_CONFIG, "kd.teacher gives the teacher's whole distribution: kd.variant must be "
                             "renorm (%s is for a cache's top-k)", tkd_kl_variant_name((tkd_kl_variant)c->kd_variant));
    tkd_status st = tkd_model_load_hf_on(c->kd_teacher, tr->be, &tr->teacher);
    if (st != TKD_OK)
        return tkd_error_prefix(st, "kd.teacher");
    if (tr->teacher->cfg.vocab_size != tr->V)
        return tkd_error_set(TKD_ERR_MISMATCH, "kd.teacher %s has %d tokens, the student %d: they must share the "
                             "tokenizer", c->kd_teacher, tr->teacher->cfg.vocab_size, tr->V);
    tr->k_use = tr->V; /* every token is a teacher column */
    if (tr->dist.rank == 0)
        tkd_log_info("kd.teacher: %s (%s, %zu parameters) run online, its full distribution the target",
                     c->kd_teacher, tkd_arch_class(tr->teacher->cfg.arch), tr->teacher->n_params);
    return tkd_model_reserve(tr->teacher, tr->B, tr->T, 0);
}

tkd_status tkd_train_build_model(trainer *tr)
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
    /* auto: the least activations until the rest is allocated (tkd_train_fit_recompute) */
    int auto_mode = tr->cfg->recompute == TKD_RECOMPUTE_AUTO;
    tkd_model_set_recompute(tr->m, auto_mode ? TKD_RECOMPUTE_FULL : (tkd_recompute)tr->cfg->recompute);
    /* one forward and backward per zeroing of the gradients: they can hold the activations until
     * each block's backward (the same bits, min(activations, gradients) less memory) */
    tkd_model_set_lend_grads(tr->m, tr->cfg->grad_accum == 1);
    TKD_TRY(tkd_model_reserve(tr->m, tr->B, tr->T, 1));
    return open_teacher(tr);
}

tkd_status tkd_train_build_loss(trainer *tr)
{
    const tkd_train_config *c = tr->cfg;
    tkd_kl_params_defaults(&tr->kp, tr->k_use);
    /* Without a cache the loss is plain CE (alpha = 0, no teacher columns) whatever the variant and divergence. */
    const int teacher = tr->cache || tr->teacher;
    tr->kp.variant = tr->cache ? (tkd_kl_variant)c->kd_variant : TKD_KL_VARIANT_RENORM;
    tr->kp.divergence = teacher ? (tkd_kl_divergence)c->kd_divergence : TKD_KL_DIVERGENCE_FKL;
    tr->kp.dense = tr->teacher != NULL;
    tr->kp.jsd_beta = (float)c->kd_jsd_beta;
    tr->kp.skew_alpha = (float)c->kd_skew_alpha;
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
    tr->top1 = malloc((size_t)n_max * sizeof *tr->top1);
    tr->top1_teacher = tr->teacher ? malloc((size_t)n_max * sizeof *tr->top1_teacher) : NULL;
    if (!tr->top1 || (tr->teacher && !tr->top1_teacher))
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for the evaluation's top-1 buffers");
    if (tkd_backend_host_f32(tr->be)) { /* hidden states read in place: full logits on the host */
        tr->logits = malloc((size_t)EVAL_CHUNK_ROWS * (size_t)tr->V * sizeof(float));
        if (!tr->logits)
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory for the evaluation's logits");
    } else {
        tr->top1_val = malloc((size_t)n_max * sizeof *tr->top1_val);
        tr->top1_lse = malloc((size_t)n_max * sizeof *tr->top1_lse);
        if (!tr->top1_val || !tr->top1_lse)
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

tkd_status tkd_train_build_optimizer(trainer *tr)
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
    tr->ocfg.state_dtype = (tkd_adamw_dtype)c->state_dtype;
    if (!tr->zero)
        return tkd_adamw_init_on(&tr->ocfg, tr->m, &tr->opt);
    size_t b, e;
    tkd_zero_shard(tr->zero, &b, &e);
    return tkd_adamw_init_shard(&tr->ocfg, tr->m, b, e, &tr->opt);
}

/* bytes as "12.3 MiB" or "1.2 GiB" into buf (n bytes); returns buf. */
const char *tkd_train_mem_str(char *buf, size_t n, double bytes)
{
    double mib = bytes / (1024.0 * 1024.0);
    if (mib >= 1024.0)
        snprintf(buf, n, "%.1f GiB", mib / 1024.0);
    else
        snprintf(buf, n, "%.1f MiB", mib);
    return buf;
}

/* train.recompute: auto. Once the weights, gradients, AdamW state, the loss's workspace and any
 * teacher are allocated, the plan that recomputes least among those whose activations fit in what
 * is left, and its activations reserved (tkd_model_fit_recompute). Until now the model held full's,
 * the least; the gradients are the same bits in every plan. */
tkd_status tkd_train_fit_recompute(trainer *tr)
{
    if (tr->cfg->recompute != TKD_RECOMPUTE_AUTO)
        return TKD_OK;
    size_t budget = 0;
#ifdef TKD_TEST_HOOKS
    long hook = tkd_test_hook_env("TKD_TRAIN_TEST_ACT_BUDGET"); /* bytes; the tests' stand-in for free memory */
    if (hook > 0)
        budget = (size_t)hook;
#endif
    tkd_recompute_fit f;
    TKD_TRY(tkd_model_fit_recompute(tr->m, tr->B, tr->T, budget, &f));
    char plan[160];
    tkd_train_recompute_plan(plan, sizeof plan, &f, tr->m->cfg.num_hidden_layers);
    if (f.need > f.budget)
        tkd_log_warn("train.recompute auto: %s — if the run runs out of memory, lower train.batch_size or "
                     "data.seq_len", plan);
    else if (tr->dist.rank == 0)
        tkd_log_info("train.recompute auto: %s", plan);
    return TKD_OK;
}

/* auto's plan in words into buf: "none (activations 10.1 GiB of the 131.1 GiB left for them)",
 * "full_keep_attention, the last 9 of 28 layers keeping everything (...)", or when nothing fits
 * "full, whose activations (...) exceed the ... left for them". */
const char *tkd_train_recompute_plan(char *buf, size_t n, const tkd_recompute_fit *f, int layers)
{
    static const char *const names[] = TKD_RECOMPUTE_NAMES;
    char need[32], budget[32], whole[64] = "";
    tkd_train_mem_str(need, sizeof need, (double)f->need);
    tkd_train_mem_str(budget, sizeof budget, (double)f->budget);
    if (f->whole > 0)
        snprintf(whole, sizeof whole, ", the last %d of %d layers keeping everything", f->whole, layers);
    if (f->need > f->budget)
        snprintf(buf, n, "%s%s, whose activations (%s) exceed the %s left for them", names[f->mode], whole, need, budget);
    else
        snprintf(buf, n, "%s%s (activations %s of the %s left for them)", names[f->mode], whole, need, budget);
    return buf;
}
