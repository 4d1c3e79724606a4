/* train_internal.h — what the parts of one student-train run share (train.c, train_setup.c,
 * train_step.c, train_ckpt.c; nothing outside student_train/train*.c includes it): the run's state
 * (trainer) and the functions one part calls in another. */
#ifndef TKD_TRAIN_INTERNAL_H
#define TKD_TRAIN_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "common/dist.h"
#include "common/progress.h"
#include "formats/cache_reader.h"
#include "formats/doc_pack.h"
#include "formats/tokens.h"
#include "kernels/backend.h"
#include "kernels/loss/kl_loss.h"
#include "model/model.h"
#include "model/optim.h"
#include "student_train/checkpoint.h"
#include "student_train/loader.h"
#include "student_train/run_dir.h"
#include "student_train/train.h"
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
    tkd_doc_pack *pack, *val_pack; /* data.packing: documents over data.tokens / data.val_tokens, else NULL */
    tkd_loader *train, *val;
    tkd_backend *be; /* where the student, its loss and its optimizer run */
    tkd_model *m;
    tkd_model *teacher;   /* kd.teacher: run on each batch, its full distribution the target (dense) */
    tkd_adamw *opt;
    tkd_optim_config ocfg;
    tkd_kl_params kp;
    tkd_backend_kl *kl;
    float *dh;      // (B·T, D) f32, backend memory: the loss's ∂/∂hidden
    float *logits;  // (EVAL_CHUNK_ROWS, V) host, CPU evaluation only
    uint32_t *top1; // (B·T) host: the student's argmax per row (evaluation)
    uint32_t *top1_teacher; // (B·T) host: kd.teacher's argmax per row (evaluation with a dense teacher)
    float *top1_val, *top1_lse; // (B·T) host: the consumer's other outputs (unused)
    int B, T, V, k_use, S; /* B: sequences per micro-batch on this rank (train.batch_size / world) */
    int64_t total_steps;
    tkd_train_state st;
    char run[RUN_PATH_MAX], ckpt[RUN_PATH_MAX], metrics_path[RUN_PATH_MAX];
    char best_ckpt[RUN_PATH_MAX]; /* <run>/checkpoint-best (train.keep_best) */
    char run_made[RUN_PATH_MAX]; /* the shallowest folder this run made for run (tkd_run_dir_open); "" none */
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

/* train_setup.c: called in this order by tkd_train_run */
tkd_status tkd_train_open_data(trainer *tr);
tkd_status tkd_train_build_model(trainer *tr);
tkd_status tkd_train_build_loss(trainer *tr);
tkd_status tkd_train_build_optimizer(trainer *tr);
tkd_status tkd_train_fit_recompute(trainer *tr);
const char *tkd_train_mem_str(char *buf, size_t n, double bytes); /* "12.3 MiB", "1.2 GiB" */
const char *tkd_train_recompute_plan(char *buf, size_t n, const tkd_recompute_fit *f, int layers);
/* train_step.c: one optimizer step (its micro-batches), and one pass over the held-out split */
tkd_status tkd_train_step(trainer *tr, step_stats *ss);
tkd_status tkd_train_evaluate(trainer *tr, eval_stats *es);
/* train_ckpt.c: metrics lines (rank 0), the run directory before the loop, a checkpoint */
tkd_status tkd_train_log_train(trainer *tr, const step_stats *ss);
tkd_status tkd_train_log_eval(trainer *tr, const eval_stats *es);
tkd_status tkd_train_prepare_run_dir(trainer *tr);
tkd_status tkd_train_save(trainer *tr);
/* train.keep_best: the same checkpoint, into checkpoint-best/ (after an evaluation that improved) */
tkd_status tkd_train_save_best(trainer *tr);

#endif
