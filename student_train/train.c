/* train.c — see train.h. The run is a small state machine over one struct (trainer,
 * train_internal.h): open the data, build the student and the loss (train_setup.c), then alternate
 * training steps, evaluations (train_step.c) and checkpoints (train_ckpt.c) until the step budget,
 * an error, a NaN or a signal ends it. This file: the device, the ranks, the run directory's lock,
 * the loop and the run's start and end. */
#include "student_train/train.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/signals.h"
#include "student_train/train_internal.h"

/* ---- the loop ----------------------------------------------------------------------------------- */

/* The progress line counts steps and shows the token rate (a step can take seconds on a CPU, where
 * "0.0 steps/s" would say nothing); the extra text carries the loss. */
static void progress_line(trainer *tr, const step_stats *ss)
{
    char extra[96];
    snprintf(extra, sizeof extra, "loss %.4f  ce %.4f  lr %.2e", ss->loss, ss->ce, ss->lr);
    tkd_progress_update_rate(&tr->progress, tr->st.step - tr->step0, tr->st.tokens_seen - tr->tokens0, extra);
}

/* What the run reports of its last evaluation es (NaN where there was none), and its best. */
static void set_eval_result(const trainer *tr, const eval_stats *es, tkd_train_result *res)
{
    res->val_loss = es->rows ? es->loss : NAN;
    res->val_kd = es->rows && tr->kp.alpha > 0 ? es->kd : NAN;
    res->val_ce = es->rows ? es->ce : NAN;
    res->val_ppl = es->rows ? exp(es->ce) : NAN;
    res->top1_agree = es->rows ? es->top1 : NAN;
}

/* Test builds: a SIGKILL once this process has taken opts->kill_after_steps steps (counted over
 * every run of the process, so a sweep dies inside whichever ablation reaches the count), after
 * that step's evaluation and checkpoint: the crash a --resume (or a sweep re-run) recovers from. */
static void test_kill(const trainer *tr)
{
#ifdef TKD_TEST_HOOKS
    static int64_t steps;
    if (tr->opts->kill_after_steps > 0 && ++steps == tr->opts->kill_after_steps)
        raise(SIGKILL);
#else
    (void)tr;
#endif
}

static const char *best_name(const tkd_train_config *c)
{
    return c->best_metric == TKD_TRAIN_BEST_VAL_KD ? "val_kd" : "val_ce";
}

/* Whether this evaluation is the best so far by train.best_metric (lower is better; a NaN never
 * is), counting those that are not for train.early_stop_patience. Every rank sees the same
 * all-reduced values, so every rank agrees. */
static bool note_best(trainer *tr, const eval_stats *es)
{
    double v = tr->cfg->best_metric == TKD_TRAIN_BEST_VAL_KD ? es->kd : es->ce;
    tkd_train_state *s = &tr->st;
    if (isnan(v) || (s->best_step >= 0 && !(v < s->best_value))) {
        s->bad_evals++;
        return false;
    }
    s->best_step = s->step, s->best_value = v, s->bad_evals = 0;
    return true;
}

/* An evaluation, its record (with the best so far) and, when it is a new best, checkpoint-best/
 * (train.keep_best). The state the next checkpoint saves holds the best, so a resumed run goes on
 * comparing with it. */
static tkd_status eval_and_log(trainer *tr, eval_stats *es)
{
    TKD_TRY(tkd_train_evaluate(tr, es));
    if (es->rows == 0)
        return TKD_OK;
    bool best = note_best(tr, es);
    if (tr->dist.rank == 0)
        TKD_TRY(tkd_train_log_eval(tr, es));
    if (best && tr->cfg->keep_best && tr->total_steps > 0)
        TKD_TRY(tkd_train_save_best(tr));
    return TKD_OK;
}

/* train.early_stop_patience evaluations in a row without a new best: the run ends here as a
 * finished one (a checkpoint, the evaluation just made as its last; --resume has nothing to do). */
static bool patience_spent(const trainer *tr)
{
    int p = tr->cfg->early_stop_patience;
    return p > 0 && tr->st.bad_evals >= p;
}

static tkd_status stop_no_progress(trainer *tr, const eval_stats *es, tkd_train_result *res)
{
    const tkd_train_config *c = tr->cfg;
    if (c->checkpoint_interval <= 0 || tr->st.step % c->checkpoint_interval != 0)
        TKD_TRY(tkd_train_save(tr));
    if (tr->dist.rank == 0) {
        tkd_progress_finish(&tr->progress, NULL);
        tkd_log_info("early stop after step %" PRId64 " of %" PRId64 ": no better %s in %d evaluations "
                     "(train.early_stop_patience); best step %" PRId64 " (%s %.6f)", tr->st.step, tr->total_steps,
                     best_name(c), c->early_stop_patience, tr->st.best_step, best_name(c), tr->st.best_value);
    }
    res->early_stopped = true;
    set_eval_result(tr, es, res);
    return TKD_OK;
}

/* train.stop_after: a checkpoint and no final evaluation, so that a run continued with --resume
 * writes the same metrics and weights as one that never stopped. */
static tkd_status stop_early(trainer *tr, tkd_train_result *res)
{
    const tkd_train_config *c = tr->cfg;
    if (c->checkpoint_interval <= 0 || tr->st.step % c->checkpoint_interval != 0)
        TKD_TRY(tkd_train_save(tr));
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
        tkd_status st = tkd_train_step(tr, &ss);
        if (st != TKD_OK && !tkd_file_exists(tr->ckpt))
            return tkd_error_prefix(st, "training stopped (no checkpoint written yet)");
        if (st != TKD_OK)
            return tkd_error_prefix(st, "training stopped (last good checkpoint: %s)", tr->ckpt);
        res->train_loss = ss.loss;
        if (tr->dist.rank == 0 && (tr->st.step % c->log_interval == 0 || tr->st.step == tr->total_steps))
            TKD_TRY(tkd_train_log_train(tr, &ss));
        if (tr->dist.rank == 0)
            progress_line(tr, &ss);
        bool evaluated = c->eval_interval > 0 && tr->st.step % c->eval_interval == 0 && tr->st.step < tr->total_steps;
        if (evaluated)
            TKD_TRY(eval_and_log(tr, &es));
        if (c->checkpoint_interval > 0 && tr->st.step % c->checkpoint_interval == 0)
            TKD_TRY(tkd_train_save(tr));
        if (evaluated && patience_spent(tr))
            return stop_no_progress(tr, &es, res);
        test_kill(tr);
        /* == (not >=): a run resumed with the same overrides goes on */
        if (c->stop_after > 0 && tr->st.step == c->stop_after && tr->st.step < tr->total_steps)
            return stop_early(tr, res);
        int sig = tr->zero ? tr->stop_signal : tkd_interrupted();
        if (sig) {
            TKD_TRY(tkd_train_save(tr));
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
        TKD_TRY(tkd_train_save(tr));
    set_eval_result(tr, &es, res);
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
    tkd_doc_pack_free(tr->pack);
    tkd_doc_pack_free(tr->val_pack);
    tkd_tokens_free(tr->tokens);
    tkd_tokens_free(tr->val_tokens);
    tkd_zero_close(tr->zero);
    if (tr->be) {
        tr->be->op->kl_free(tr->be, tr->kl);
        tr->be->op->free(tr->be, tr->dh);
    }
    tkd_adamw_free(tr->opt);
    tkd_model_free(tr->m);
    tkd_model_free(tr->teacher);
    tkd_backend_close(tr->be);
    free(tr->logits);
    free(tr->top1);
    free(tr->top1_teacher);
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
        TKD_TRY(tkd_run_dir_open(c, tr->opts->run_name, tr->run, sizeof tr->run, tr->run_made, sizeof tr->run_made,
                                 &tr->lock));
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

/* What the run holds in backend memory, once at the start: the state per parameter (weights and
 * the exact fp32 master, the fp32 gradients, the AdamW moments: 16 bytes, 12 with bf16 moments;
 * data parallel: the moments of this rank's shard only, so an upper bound) and the activations,
 * with the part that lives in the gradient buffer until each layer's backward (docs/student-train.md). */
static void log_memory(const trainer *tr, const tkd_train_config *c)
{
    size_t per = 8 + (c->state_dtype == TKD_ADAMW_DTYPE_BF16 ? 4 : 8);
    size_t lent = tkd_model_activation_lent_bytes(tr->m);
    char a[32], b[32], l[32], more[96] = "";
    if (lent)
        snprintf(more, sizeof more, ", and %s more in the gradient buffer",
                 tkd_train_mem_str(l, sizeof l, (double)lent));
    tkd_log_info("memory: %s of weights, gradients and AdamW state (%zu bytes a parameter); activations %s%s",
                 tkd_train_mem_str(a, sizeof a, (double)tr->m->n_params * (double)per), per,
                 tkd_train_mem_str(b, sizeof b, (double)tkd_model_activation_bytes(tr->m)), more);
}

tkd_status tkd_train_run(const tkd_train_opts *o, tkd_train_result *res)
{
    trainer tr = {.cfg = o->cfg, .opts = o, .st.best_step = -1};
    memset(res, 0, sizeof *res);
    tkd_device dev = TKD_DEVICE_CPU;
    tkd_status st = pick_device(o->cfg, &dev);
    if (st == TKD_OK) st = dist_setup(&tr, dev);
    /* the run directory and its lock first: a second run on it is refused before anything loads */
    if (st == TKD_OK) st = open_run_dir(&tr);
    if (st == TKD_OK) st = open_backend(&tr, dev);
    if (st == TKD_OK) st = tkd_train_open_data(&tr);
    if (st == TKD_OK) st = tkd_train_build_model(&tr);
    if (st == TKD_OK) st = open_zero(&tr);
    if (st == TKD_OK) st = tkd_train_build_loss(&tr);
    if (st == TKD_OK) st = tkd_train_build_optimizer(&tr);
    if (st == TKD_OK) st = tkd_train_fit_recompute(&tr);
    if (st == TKD_OK) st = tkd_train_prepare_run_dir(&tr);
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
        if (tr.dist.rank == 0)
            log_memory(&tr, o->cfg);
        st = loop(&tr, res);
    }
    res->steps = tr.st.step;
    res->tokens = tr.st.tokens_seen;
    res->best_step = tr.st.best_step;
    res->best_value = tr.st.best_step >= 0 ? tr.st.best_value : NAN;
    res->best_metric = best_name(o->cfg);
    res->seconds = tr.t0 > 0 ? tkd_progress_now() - tr.t0 : 0;
    res->tokens_run = tr.st.tokens_seen - tr.tokens0;
    snprintf(res->run_path, sizeof res->run_path, "%s", tr.run);
    /* keep the message of the first failure while the buffers are released */
    /* every line was flushed and checked; a failing close can still lose the last ones (NFS) */
    if (tr.metrics && fclose(tr.metrics) != 0 && st == TKD_OK)
        st = tkd_error_set(TKD_ERR_IO, "%s: closing the metrics file failed: %s — its last lines may be missing",
                           tr.metrics_path, strerror(errno));
    tr.metrics = NULL;
    tkd_error_saved keep;
    tkd_error_save(&keep, st);
    if (st != TKD_OK && tr.lock) /* refused before it wrote anything: the directory it made goes */
        tkd_run_dir_abandon(tr.run, tr.run_made);
    trainer_free(&tr);
    return tkd_error_restore(&keep);
}

/* ---- the derived run name --------------------------------------------------------------------- */

/* Overrides a derived run name leaves out: where the outputs go (the name is a folder of run.dir:
 * a path in it would only repeat that), and settings that change how a run goes but never what it
 * trains, so that a sweep's names show what it sweeps and a run resumed with another stop_after is
 * the same run. */
static const char *const unnamed_keys[] = {
    "run.dir", "run.name", "dist.dir",                                               /* locations */
    "dist.rendezvous", "dist.timeout_s", "data.prefetch", "train.stop_after", "train.log_interval",
    "train.checkpoint_interval", "train.keep_best", NULL,
};

/* A derived name longer than this keeps its first characters and a hash of the whole name. */
#define RUN_NAME_MAX 96
#define RUN_NAME_HASH 8 /* hex digits of the sha256 of the whole name */

static bool name_leaves_out(const char *set)
{
    size_t klen = strcspn(set, "=");
    for (const char *const *k = unnamed_keys; *k; k++)
        if (strlen(*k) == klen && strncmp(*k, set, klen) == 0)
            return true;
    return false;
}

/* One value of an override as it goes into a name: without YAML quotes and spaces around it, a
 * path by its last component ("/caches/qwen-top100/" -> "qwen-top100"). [a, e) in, appended at
 * out[*n], cap bytes. */
static void name_put_value(char *out, size_t cap, size_t *n, const char *a, const char *e)
{
    while (a < e && (*a == ' ' || *a == '\'' || *a == '"'))
        a++;
    while (e > a && (e[-1] == ' ' || e[-1] == '\'' || e[-1] == '"' || (e[-1] == '/' && e - 1 > a)))
        e--;
    for (const char *c = e; c > a; c--)
        if (c[-1] == '/') {
            a = c;
            break;
        }
    int w = snprintf(out + *n, cap - *n, "%.*s", (int)(e - a), a);
    *n += w < 0 ? 0 : (size_t)w < cap - *n ? (size_t)w : cap - *n - 1;
}

/* "__key=value" for one override; a list "[a/x.bin, b/y.bin]" gives each element its last
 * component, joined by ','. */
static void name_put_set(char *out, size_t cap, size_t *n, const char *set)
{
    size_t klen = strcspn(set, "=");
    int w = snprintf(out + *n, cap - *n, "__%.*s=", (int)klen, set);
    *n += w < 0 ? 0 : (size_t)w < cap - *n ? (size_t)w : cap - *n - 1;
    const char *v = set[klen] ? set + klen + 1 : set + klen, *end = v + strlen(v);
    bool list = v[0] == '[' && end > v + 1 && end[-1] == ']';
    if (!list) {
        name_put_value(out, cap, n, v, end);
        return;
    }
    for (const char *p = v + 1; p <= end - 1;) {
        const char *comma = memchr(p, ',', (size_t)(end - 1 - p));
        const char *e = comma ? comma : end - 1;
        if (p > v + 1 && *n + 1 < cap)
            out[(*n)++] = ',', out[*n] = '\0';
        name_put_value(out, cap, n, p, e);
        p = e + 1;
    }
}

void tkd_train_derive_name(char *out, size_t cap, const char *config_path, const char *const *sets, size_t nsets)
{
    char full[8192];
    const char *base = config_path ? strrchr(config_path, '/') : NULL;
    base = base ? base + 1 : (config_path ? config_path : "run");
    const char *dot = strrchr(base, '.');
    size_t blen = dot && dot > base ? (size_t)(dot - base) : strlen(base);
    int w = snprintf(full, sizeof full, "%.*s", (int)blen, base);
    size_t n = w < 0 ? 0 : (size_t)w < sizeof full ? (size_t)w : sizeof full - 1;
    for (size_t i = 0; i < nsets; i++)
        if (!name_leaves_out(sets[i]))
            name_put_set(full, sizeof full, &n, sets[i]);
    for (char *c = full; *c; c++) { /* one folder name, readable in a shell */
        bool ok = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '.' ||
                  *c == '_' || *c == '-';
        *c = ok ? *c : '-';
    }
    if (n > RUN_NAME_MAX) { /* the first part stays readable; the hash tells long names apart, run to run alike */
        uint8_t d[TKD_SHA256_BYTES];
        char hex[TKD_SHA256_HEX_LEN];
        tkd_sha256_buffer(full, n, d);
        tkd_sha256_hex(d, hex);
        size_t keep = RUN_NAME_MAX - RUN_NAME_HASH - 1;
        while (keep > 0 && (full[keep - 1] == '_' || full[keep - 1] == '-' || full[keep - 1] == '.'))
            keep--;
        snprintf(full + keep, sizeof full - keep, "-%.*s", RUN_NAME_HASH, hex);
    }
    if (cap)
        snprintf(out, cap, "%s", full);
}
