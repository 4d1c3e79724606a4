/* zero.c — see zero.h. */
#include "student_train/zero.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/progress.h"
#include "kernels/grad_clip.h"
#include "kernels/comm/comm_nccl.h"

struct tkd_zero {
    tkd_dist_info d;
    tkd_comm *comm;
    tkd_model *m;
    size_t begin, end, chunk; /* this rank's shard and the shard size (tkd_zero_range) */
    char beat_dir[4096];
    double stale_s;           /* a heartbeat older than this names its rank as late */
    int64_t step;
    double last_beat;         /* tkd_progress_now() of the last beat (beat: at most one a second) */
    int armed;                /* the hook reduces during this backward */
    int next_layer;           /* the next block whose bucket is due (backward runs L-1 .. 0) */
    int rest_done;            /* the bucket of the tensors outside the blocks was launched */
};

static void late_ranks(void *ctx, char *buf, size_t n)
{
    tkd_zero *z = ctx;
    tkd_dist_late_ranks(z->beat_dir, z->d.world, z->stale_s, buf, n);
}

/* This rank's heartbeat, at most once a second whoever calls (a step, or a collective's wait): a
 * file write per step is shared-filesystem traffic, and a lost beat only weakens a later message. */
static void beat(void *ctx)
{
    tkd_zero *z = ctx;
    const double now = tkd_progress_now();
    if (now - z->last_beat < 1.0)
        return;
    z->last_beat = now;
    (void)tkd_dist_beat(z->beat_dir, z->d.rank, z->step);
}

static tkd_status reduce(tkd_zero *z, size_t b, size_t e)
{
    return tkd_comm_reduce_range(z->comm, z->m->grads, b, e, z->m->n_params, z->chunk);
}

/* Block l's bucket: its tensors are contiguous in the flat arrays. */
static tkd_status reduce_layer(tkd_zero *z, int l)
{
    size_t b, e;
    tkd_model_layer_range(z->m, l, &b, &e);
    return reduce(z, b, e);
}

/* The last bucket: the embedding before the blocks, the final norm and the LM head after them. */
static tkd_status reduce_rest(tkd_zero *z)
{
    size_t b0, e0, bl, el;
    tkd_model_layer_range(z->m, 0, &b0, &e0);
    tkd_model_layer_range(z->m, z->m->cfg.num_hidden_layers - 1, &bl, &el);
    TKD_TRY(reduce(z, 0, b0));
    TKD_TRY(reduce(z, el, z->m->n_params));
    z->rest_done = 1;
    return TKD_OK;
}

/* The model's gradient hook: block `layer` (or, at -1, everything) is final for this backward. */
static tkd_status grad_hook(void *ctx, tkd_model *m, int layer)
{
    (void)m;
    tkd_zero *z = ctx;
    if (!z->armed)
        return TKD_OK;
    if (layer >= 0) {
        if (layer != z->next_layer)
            return tkd_error_set(TKD_ERR_INTERNAL, "zero: block %d's gradients came before block %d's", layer,
                                 z->next_layer);
        z->next_layer--;
        return reduce_layer(z, layer);
    }
    z->armed = 0;
    return reduce_rest(z);
}

tkd_status tkd_zero_open(const tkd_dist_info *d, const tkd_rdzv_config *rc, const char *beat_dir, tkd_model *m,
                         tkd_zero **out)
{
    *out = NULL;
    if (!m->grads || !m->master_lo || !m->be->data_parallel)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "data parallel: the student must train on CUDA (device: cuda), "
                             "with its gradients allocated (tkd_model_reserve)");
    tkd_zero *z = calloc(1, sizeof *z);
    if (!z)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    z->d = *d;
    z->m = m;
    z->stale_s = rc->timeout_s / 2;
    snprintf(z->beat_dir, sizeof z->beat_dir, "%s", beat_dir);
    tkd_zero_range(m->n_params, d->world, d->rank, &z->begin, &z->end, &z->chunk);
    tkd_comm_id id = {{0}};
    tkd_status st = d->rank == 0 ? tkd_comm_make_id(&id) : TKD_OK;
    if (st == TKD_OK)
        st = tkd_rdzv_share(rc, d, &id, sizeof id);
    tkd_comm_opts co = {.rank = d->rank, .world = d->world, .timeout_s = rc->timeout_s, .late = late_ranks,
                        .waiting = beat, .ctx = z};
    if (st == TKD_OK)
        st = tkd_comm_init(&id, &co, m->be, &z->comm);
    if (st != TKD_OK) {
        free(z);
        return tkd_error_prefix(st, "data parallel (rank %d of %d)", d->rank, d->world);
    }
    tkd_model_set_grad_hook(m, grad_hook, z);
    *out = z;
    return TKD_OK;
}

void tkd_zero_close(tkd_zero *z)
{
    if (!z)
        return;
    tkd_model_set_grad_hook(z->m, NULL, NULL);
    tkd_comm_free(z->comm);
    free(z);
}

void tkd_zero_shard(const tkd_zero *z, size_t *begin, size_t *end)
{
    *begin = z->begin;
    *end = z->end;
}

tkd_status tkd_zero_sum(tkd_zero *z, double *v, int n, const char *what)
{
    return tkd_comm_allreduce_sum(z->comm, v, n, what);
}

void tkd_zero_begin_step(tkd_zero *z, int64_t step)
{
    z->step = step;
    beat(z);
}

void tkd_zero_arm(tkd_zero *z)
{
    z->armed = 1;
    z->next_layer = z->m->cfg.num_hidden_layers - 1;
    z->rest_done = 0;
}

/* After the last micro-step: reduces what the hook did not (every bucket when this rank's part of
 * the batch was empty, so the ranks issue the same collectives in the same order) and waits. On
 * return this rank's shard of m->grads holds the summed gradients. */
static tkd_status finish_grads(tkd_zero *z)
{
    z->armed = 0;
    for (; z->next_layer >= 0; z->next_layer--)
        TKD_TRY(reduce_layer(z, z->next_layer));
    if (!z->rest_done)
        TKD_TRY(reduce_rest(z));
    return tkd_comm_wait(z->comm, "gradient reduce-scatter");
}

/* The global gradient norm from the all-reduced shard sums of squares and the clip coefficient
 * (1: none) for tkd_adamw_step_model_scaled; the gradients are not touched. */
static tkd_status clip_coef(tkd_zero *z, double max_norm, double *norm_out, float *coef)
{
    tkd_backend *be = z->m->be;
    float *g = z->m->grads + z->begin;
    size_t n = z->end - z->begin;
    double norm2 = 0;
    if (n > 0)
        TKD_TRY(be->op->grad_norm2(be, g, n, &norm2));
    TKD_TRY(tkd_zero_sum(z, &norm2, 1, "gradient norm all-reduce"));
    double norm = sqrt(norm2);
    if (norm_out)
        *norm_out = norm;
    *coef = 1.0f;
    return tkd_grad_clip_coef(norm, max_norm, coef);
}

/* After the shard's AdamW update: every rank's shard of the bf16 compute weights gathered. */
static tkd_status gather_weights(tkd_zero *z)
{
    return tkd_comm_gather_shards(z->comm, NULL, z->m->dparams, z->m->be->act_size, z->m->n_params, z->chunk,
                                  "compute-weight all-gather");
}

tkd_status tkd_zero_gather_master(tkd_zero *z)
{
    /* the compute copy is gathered after every step: the residuals complete the fp32 master */
    return tkd_comm_gather_shards(z->comm, NULL, z->m->master_lo, z->m->be->master_lo_size, z->m->n_params,
                                  z->chunk, "master-weight residual all-gather");
}

tkd_status tkd_zero_update(tkd_zero *z, tkd_adamw *o, double lr, double max_norm, double *norm_out)
{
    float coef = 1.0f; /* clipping rides in the update: no pass scales the gradients in place */
    TKD_TRY(finish_grads(z));
    TKD_TRY(clip_coef(z, max_norm, norm_out, &coef));
    TKD_TRY(tkd_adamw_step_model_scaled(o, z->m, lr, coef));
    return gather_weights(z);
}
