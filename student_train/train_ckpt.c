/* train_ckpt.c — what a student-train run leaves on disk (train_internal.h): metrics.jsonl, the
 * run directory prepared for a new or resumed run, and checkpoints (one process or data-parallel
 * shards), with --resume reading them back. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "common/log.h"
#include "student_train/train_internal.h"

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

tkd_status tkd_train_log_train(trainer *tr, const step_stats *ss)
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

tkd_status tkd_train_log_eval(trainer *tr, const eval_stats *es)
{
    fprintf(tr->metrics, "{\"type\": \"eval\", \"step\": %" PRId64 ", \"tokens\": %" PRId64, tr->st.step,
            tr->st.tokens_seen);
    json_num(tr->metrics, "val_loss", es->loss);
    json_num(tr->metrics, "val_kd", tr->kp.alpha > 0 ? es->kd : NAN);
    json_num(tr->metrics, "val_ce", es->ce);
    json_num(tr->metrics, "val_ppl", exp(es->ce));
    json_num(tr->metrics, "top1_agree", es->top1);
    if (tr->st.best_step >= 0) { /* the best evaluation so far, this one included */
        fprintf(tr->metrics, ", \"best_step\": %" PRId64, tr->st.best_step);
        json_num(tr->metrics, tr->cfg->best_metric == TKD_TRAIN_BEST_VAL_KD ? "best_val_kd" : "best_val_ce",
                 tr->st.best_value);
    }
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
 * validation split), or the run stopped early: a resume has nothing left to do. An evaluation at the last step is only ever
 * the final one (eval_interval skips that step). */
static bool run_finished(const trainer *tr)
{
    if (tr->total_steps <= 0)
        return false;
    /* stopped early (train.early_stop_patience): the checkpoint was written after that evaluation */
    if (tr->cfg->early_stop_patience > 0 && tr->st.bad_evals >= tr->cfg->early_stop_patience)
        return true;
    if (tr->st.step < tr->total_steps)
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
        st = tkd_checkpoint_load_shard(tr->ckpt, tr->m, tr->dist.rank, tr->dist.world, tr->opt->cfg.state_dtype, mm,
                                       vv, &adamw_step, &tr->st);
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
    if (tr->st.best_step >= 0)
        tkd_log_info("best evaluation so far: step %" PRId64 " (%s %.6f), %" PRId64 " evaluation%s since", tr->st.best_step,
                     tr->cfg->best_metric == TKD_TRAIN_BEST_VAL_KD ? "val_kd" : "val_ce", tr->st.best_value,
                     tr->st.bad_evals, tr->st.bad_evals == 1 ? "" : "s");
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
tkd_status tkd_train_prepare_run_dir(trainer *tr)
{
    const tkd_train_opts *o = tr->opts;
    TKD_TRY(tkd_path_join(tr->ckpt, sizeof tr->ckpt, tr->run, "checkpoint"));
    TKD_TRY(tkd_path_join(tr->metrics_path, sizeof tr->metrics_path, tr->run, "metrics.jsonl"));
    TKD_TRY(tkd_path_join(tr->best_ckpt, sizeof tr->best_ckpt, tr->run, "checkpoint-best"));
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
static tkd_status save_sharded(trainer *tr, const char *dir)
{
    TKD_TRY(tkd_zero_gather_master(tr->zero));
    size_t n = tr->opt->n;
    float *mm = n ? malloc(n * sizeof(float)) : NULL, *vv = n ? malloc(n * sizeof(float)) : NULL;
    tkd_status st = n && (!mm || !vv) ? tkd_error_set(TKD_ERR_NOMEM, "out of host memory for the optimizer shard")
                                      : TKD_OK;
    if (st == TKD_OK && n)
        st = tkd_adamw_moments_get(tr->opt, mm, vv);
    if (st == TKD_OK)
        st = tkd_checkpoint_save_shard(dir, tr->job_id, tr->st.step, tr->dist.rank, tr->dist.world,
                                       tr->opt->cfg.state_dtype, tr->m->n_params, mm, vv);
    free(mm);
    free(vv);
    if (st == TKD_OK && tr->dist.rank == 0)
        st = tkd_checkpoint_commit(dir, tr->job_id, tr->st.step, tr->m, tr->opt->step, tr->dist.world,
                                   tr->opt->cfg.state_dtype, &tr->st, tr->config_yaml, tr->dist_timeout_s);
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
                             "(its log says why); the previous checkpoint stays valid", dir, tr->st.step);
    return st;
}

static tkd_status save_to(trainer *tr, const char *dir)
{
    if (tr->zero)
        TKD_TRY(save_sharded(tr, dir));
    else
        TKD_TRY(tkd_checkpoint_save(dir, tr->m, tr->opt, &tr->st, tr->config_yaml));
    if (tr->dist.rank == 0)
        tkd_log_info("checkpoint: %s (step %" PRId64 ")", dir, tr->st.step);
    return TKD_OK;
}

tkd_status tkd_train_save(trainer *tr)
{
    return save_to(tr, tr->ckpt);
}

tkd_status tkd_train_save_best(trainer *tr)
{
    return save_to(tr, tr->best_ckpt);
}
