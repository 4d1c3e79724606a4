/* train.h — one student-train run: sources, student, fused loss, AdamW, evaluation, metrics and
 * checkpoints under <run.dir>/<run.name>/. The CLI (main.c) parses flags and prints; this module
 * does the work and reports through tkd_status + message. */
#ifndef TKD_TRAIN_H
#define TKD_TRAIN_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "student_train/train_config.h"

typedef struct tkd_train_opts {
    const tkd_train_config *cfg;
    const char *run_name;    /* resolved name (never empty) */
    const char *config_yaml; /* the effective config as YAML, saved with every output */
    bool resume;             /* continue from <run>/checkpoint */
    bool overwrite;          /* empty an existing run directory first (only what student-train made there) */
    int64_t kill_after_steps; /* test builds only (TKD_TEST_HOOKS): SIGKILL after this many steps of the process */
} tkd_train_opts;

/* What a finished run measured last (the demo prints these). NaN where not applicable. */
typedef struct tkd_train_result {
    int64_t steps;
    int64_t tokens;
    double train_loss;   /* last logged training loss */
    double val_loss;     /* alpha·KD + (1 − alpha)·CE on the validation split */
    double val_kd;
    double val_ce;       /* nats per token on the true next tokens */
    double val_ppl;
    double top1_agree;   /* fraction of positions where the student's argmax is the teacher's top-1 */
    double seconds;      /* wall-clock time of this process's training loop */
    int64_t tokens_run;  /* training tokens of this process (tokens less those before a --resume) */
    int64_t best_step;   /* the best evaluation's step (train.best_metric), -1 when none */
    double best_value;   /* its train.best_metric */
    const char *best_metric; /* "val_ce" or "val_kd" */
    bool early_stopped;  /* train.early_stop_patience ended the run */
    bool finished_before; /* --resume found the run finished: nothing was done or written */
    char run_path[4096];
} tkd_train_result;

/* What training over `world` data-parallel ranks needs from the config: train.batch_size (the global
 * batch) a multiple of world, and (world > 1) a CUDA device; `device` is the resolved device, or
 * the configured one (auto passes) before the ranks start. TKD_ERR_CONFIG naming the rule. */
tkd_status tkd_train_check_world(const tkd_train_config *c, int world, int device);

/* Runs training (or only evaluation when train.max_steps resolves to 0 steps). */
tkd_status tkd_train_run(const tkd_train_opts *o, tkd_train_result *res);

/* A run name from the config file's base name and the --set overrides that define the run, e.g.
 * demo.yaml with kd.variant=sampled, data.cache=/caches/top20/, run.dir=/tmp/runs ->
 * "demo__kd.variant-sampled__data.cache-top20": a path value by its last component, the output
 * locations (run.dir, run.name, dist.dir) and the settings that never change what is trained
 * (train.stop_after, the log and checkpoint intervals, train.keep_best, data.prefetch, dist.*) left out, only
 * [A-Za-z0-9._-] kept. A name longer than 96 characters keeps its first 87 and "-" plus 8 hex digits
 * of the whole name's sha256. The full overrides are in the run's config.yaml. Truncated to cap. */
void tkd_train_derive_name(char *out, size_t cap, const char *config_path, const char *const *sets,
                           size_t nsets);

#endif /* TKD_TRAIN_H */
