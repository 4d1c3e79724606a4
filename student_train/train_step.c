/* train_step.c — one training step of a student-train run (train_internal.h): micro-batches through
 * the student and the fused loss, the gradients summed over the ranks, the update; and the
 * evaluation on the held-out split (loss, top-1 agreement with the teacher). */
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/signals.h"
#include "student_train/train_internal.h"

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

/* kd.teacher: the teacher's forward on the batch (its own activations; documents as the student's),
 * its hidden states and LM head the dense loss's teacher side (tkd_kl_params.dense). */
static tkd_status teacher_side(const trainer *tr, const tkd_train_batch *b, tkd_kl_batch *kb)
{
    if (!tr->teacher)
        return TKD_OK;
    const void *th = NULL;
    TKD_TRY(tkd_model_forward_docs(tr->teacher, b->inputs, b->doc, b->b, b->t, 0, &th));
    kb->teacher_h = th;
    kb->teacher_w = tkd_model_lm_head_dev(tr->teacher); /* backend memory, as th (CUDA: bf16) */
    kb->teacher_d = tr->teacher->cfg.hidden_size;
    return TKD_OK;
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
    TKD_TRY(tkd_model_forward_docs(tr->m, b->inputs, b->doc, b->b, b->t, 1, &hidden));
    tkd_kl_batch kb;
    kl_batch_of(tr, b, &kb);
    TKD_TRY(teacher_side(tr, b, &kb));
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

tkd_status tkd_train_step(trainer *tr, step_stats *ss)
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

/* Each of n rows' argmax over m's logits of hidden into idx (ties to the smaller id). On a device:
 * the backend's LM-head consumer with k = 1; where hidden states and head are host fp32
 * (tkd_backend_host_f32, the CPU): full logits EVAL_CHUNK_ROWS at a time. */
static tkd_status argmax_rows(trainer *tr, const tkd_model *m, const void *hidden, int64_t n, uint32_t *idx)
{
    const int d = m->cfg.hidden_size;
    if (!tkd_backend_host_f32(tr->be)) {
        size_t chunk = EVAL_CHUNK_BYTES / (sizeof(float) * (size_t)tr->V);
        tkd_lmhead_topk_args a = {.hidden = hidden, .w = tkd_model_lm_head_dev(m), .rows = n, .d = d, .v = tr->V,
                                  .k = 1, .tau = 1.0f,
                                  .chunk_rows = chunk < 1 ? 1 : chunk > (size_t)n ? (int)n : (int)chunk,
                                  .idx = idx, .val = tr->top1_val, .lse = tr->top1_lse};
        return tr->be->op->lmhead_topk(tr->be, &a);
    }
    const float *h = hidden;
    for (int64_t r0 = 0; r0 < n; r0 += EVAL_CHUNK_ROWS) {
        int64_t rows = n - r0 < EVAL_CHUNK_ROWS ? n - r0 : EVAL_CHUNK_ROWS;
        TKD_TRY(tkd_model_logits(m, h + r0 * d, rows, tr->logits));
        for (int64_t i = 0; i < rows; i++) {
            const float *row = tr->logits + i * tr->V;
            uint32_t best = 0;
            for (int v = 1; v < tr->V; v++)
                if (row[v] > row[best])
                    best = (uint32_t)v;
            idx[r0 + i] = best;
        }
    }
    return TKD_OK;
}

/* Positions (label kept) where the student's argmax equals the teacher's top-1: the cache's first
 * column, or with kd.teacher the teacher's own argmax over its logits of kb->teacher_h. */
static tkd_status top1_hits(trainer *tr, const tkd_train_batch *b, const tkd_kl_batch *kb, const void *hidden,
                            int64_t *hits)
{
    const int64_t n = (int64_t)b->b * b->t;
    TKD_TRY(argmax_rows(tr, tr->m, hidden, n, tr->top1));
    if (tr->teacher)
        TKD_TRY(argmax_rows(tr, tr->teacher, kb->teacher_h, n, tr->top1_teacher));
    *hits = 0;
    for (int64_t i = 0; i < n; i++)
        if (b->labels[i] != -100)
            *hits += tr->top1[i] == (tr->teacher ? tr->top1_teacher[i] : (uint32_t)b->topk_idx[i * b->k]);
    return TKD_OK;
}

tkd_status tkd_train_evaluate(trainer *tr, eval_stats *es)
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
        TKD_TRY(teacher_side(tr, b, &kb));
        TKD_TRY(tr->be->op->kl_stage(tr->be, tr->kl, &kp, &kb));
        const void *hidden = NULL;
        TKD_TRY(tkd_model_forward_docs(tr->m, b->inputs, b->doc, b->b, b->t, 0, &hidden));
        tkd_kl_result r;
        TKD_TRY(tr->be->op->kl_forward(tr->be, tr->kl, &kp, hidden, tkd_model_lm_head_dev(tr->m), &r, NULL, NULL));
        es->loss += r.loss * (double)r.n_kept;
        es->kd += r.kd * (double)r.n_kept;
        es->ce += r.ce * (double)r.n_kept;
        es->rows += r.n_kept;
        int64_t h = 0;
        if (b->k > 0 || tr->teacher)
            TKD_TRY(top1_hits(tr, b, &kb, hidden, &h));
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
