/* sweep.h — `student-train sweep`: several ablations of one base config, run one after another,
 * each in its own run directory <dir>/<name>/ (name: the ablation file's base name), then one table.
 *
 * <dir>/sweep.md, sweep.csv   the table: per run its status, validation CE, perplexity, KD, top-1
 *                             agreement (its last evaluation), tokens/s, best step (train.best_metric),
 *                             steps and, for a failed run, the error
 * <dir>/sweep.svg             the validation CE of every evaluation, one curve per run
 * <dir>/.topkd-sweep-lock     held while the sweep runs (a second sweep there is refused)
 * Resumable as a whole: a run with a checkpoint is resumed (a finished one does nothing and keeps its
 * row; its tokens/s comes from the previous sweep.csv), one without is started over. A failing run is
 * a row of the table, not the end of the sweep; a signal ends the sweep after writing the table. The
 * three files are written atomically, and only over files this tool wrote (their first line). */
#ifndef TKD_SWEEP_H
#define TKD_SWEEP_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/status.h"

typedef struct tkd_sweep_opts {
    const char *dir;                  /* the sweep directory (made when missing) */
    const char *base_config;          /* --config: applied before each ablation file; NULL: none */
    const char *const *files;         /* the ablation configs, in order; each name must differ */
    size_t nfiles;
    const char *const *sets;          /* --set overrides applied to every run, after its file */
    size_t nsets;
    int64_t kill_after_steps;         /* test builds: tkd_train_opts's hook, passed on to every run */
} tkd_sweep_opts;

typedef struct tkd_sweep_summary {
    int runs;   /* ablations in the table */
    int failed; /* of which failed */
} tkd_sweep_summary;

/* Runs the sweep and writes its files; the table also goes to out (the terminal). TKD_OK when every
 * ablation was tried, failed ones included (sum->failed); TKD_ERR_INVALID_ARG before any run for two
 * files of one name or a sweep file student-train did not write; TKD_ERR_INTERRUPTED after a
 * signal (the table of what ran is written first). */
tkd_status tkd_sweep_run(const tkd_sweep_opts *o, FILE *out, tkd_sweep_summary *sum);

/* The run name of an ablation file: its base name without the extension, characters outside
 * [A-Za-z0-9._-] as '-'. Truncated to cap. */
void tkd_sweep_name(char *out, size_t cap, const char *path);

#endif /* TKD_SWEEP_H */
