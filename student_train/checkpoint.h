/* checkpoint.h — a training checkpoint directory, written whole or not at all.
 *
 * <dir>/config.json + model.safetensors  the student in Hugging Face form (F32: resume is exact)
 * <dir>/optimizer.safetensors            AdamW moments "adamw.m", "adamw.v" (n,) F32, or BF16 when
 *                                        optim.state_dtype is bf16 (the dtype they are kept in, so
 *                                        resume is exact; one process)
 * <dir>/optimizer-rank<r>-of<W>.safetensors  instead, with W data-parallel ranks: rank r's moments
 *                                        of [begin, end) = tkd_zero_range(n, W, r), (end - begin,)
 * <dir>/state.json                       step, loader position (epoch, offset), tokens seen, RNG,
 *                                        AdamW step, n, the optimizer's world W and its moments'
 *                                        dtype (optimizer_state_dtype "f32" | "bf16"; absent: f32),
 *                                        the best evaluation so far (best_step, best_value, bad_evals)
 * <dir>/config.yaml                      the effective student-train config
 * <dir>/.topkd-built                     the marker: student-train built it (common/owned_dir.h)
 * The directory is built under a temporary name and renamed into place (common/owned_dir.h), so a
 * crash or a full disk leaves the previous checkpoint intact. student-train removes a checkpoint
 * directory (an old one, a staging one) only when it carries the marker and holds nothing but the
 * files above; a checkpoint of a version from before markers (no marker, state.json among those
 * files) is still read, and replaced the same way once it has been proven so.
 */
#ifndef TKD_CHECKPOINT_H
#define TKD_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "common/owned_dir.h"
#include "common/rng.h"
#include "common/status.h"
#include "model/model.h"
#include "model/optim.h"

/* What a checkpoint directory holds (the proof that lets student-train remove one). */
extern const tkd_built_kind tkd_checkpoint_kind;

typedef struct tkd_train_state {
    int64_t step;        /* optimizer steps taken */
    int64_t epoch;       /* loader position: epoch ... */
    int64_t offset;      /* ... and the offset of the next batch in that epoch's order */
    int64_t tokens_seen; /* training tokens consumed (labels counted, padding excluded) */
    tkd_rng_state rng;   /* the trainer's generator (reserved for stochastic features) */
    /* the best evaluation so far (train.best_metric), so that a resumed run keeps improving on it */
    int64_t best_step;   /* -1: none yet (also a checkpoint from before these keys) */
    double best_value;   /* its train.best_metric (stored as a decimal string that reads back exactly) */
    int64_t bad_evals;   /* evaluations since the best one (train.early_stop_patience counts these) */
} tkd_train_state;

/* Writes the checkpoint to dir (replacing an older one atomically). config_yaml may be NULL. */
tkd_status tkd_checkpoint_save(const char *dir, const tkd_model *m, const tkd_adamw *opt,
                               const tkd_train_state *st, const char *config_yaml);

/* Restores m's parameters, opt's moments and step, and *st from dir. The checkpoint's
 * architecture must equal m's, and its moments' dtype opt's (opt->cfg.state_dtype: moments are not
 * converted): otherwise TKD_ERR_CONFIG (m or opt was built from a config other than the run's, a
 * usage error), naming the directory (and both dtypes). */
tkd_status tkd_checkpoint_load(const char *dir, tkd_model *m, tkd_adamw *opt, tkd_train_state *st);

/* ---- data-parallel checkpoints (world > 1, ZeRO-1) ----------------------------------------------
 * Every rank holds its shard of the AdamW moments; the checkpoint counts only once every shard is
 * in it. At a checkpoint step:
 *   1. every rank (0 included) calls tkd_checkpoint_save_shard: its shard goes into the staging
 *      directory "<dir>.building-<job>-<step>" (made, with its marker, by whichever rank comes
 *      first; each file is written atomically, so one that exists is whole);
 *   2. rank 0 calls tkd_checkpoint_commit: the weights, state.json and config.yaml go into the same
 *      staging directory, it waits until all W shard files are there (a barrier between 1 and 2
 *      makes the wait immediate; without one the wait is the synchronisation), then renames the
 *      staging directory over <dir> (tkd_built_dir_rename: the rename is what makes it count).
 * A rank that dies before writing its shard: commit times out naming the missing file(s), removes
 * the staging directory and leaves the previous <dir> untouched. Staging directories of other jobs
 * or steps (a crash) are removed by the next successful commit (when proven: marker and checkpoint
 * files only). The job id keeps a staging
 * directory of a crashed job (whose shards may be stale) from being completed by a new one.
 * Moments are host arrays: a GPU caller copies its shard to the host first. */

/* Writes rank's moments m, v (end - begin floats each, [begin, end) = tkd_zero_range(n, world,
 * rank); may be NULL when empty), kept as dt, for the checkpoint `dir` of `step`. */
tkd_status tkd_checkpoint_save_shard(const char *dir, const char *job_id, int64_t step, int rank, int world,
                                     tkd_adamw_dtype dt, size_t n, const float *m, const float *v);

/* Rank 0: writes the model (its full parameters, e.g. all-gathered), the state (adamw_step is the
 * optimizer's step count; the optimizer's world and its moments' dtype dt are recorded) and
 * config_yaml (may be NULL), waits up to timeout_s for the world's shards, then makes the
 * checkpoint count as above. */
tkd_status tkd_checkpoint_commit(const char *dir, const char *job_id, int64_t step, const tkd_model *m,
                                 int64_t adamw_step, int world, tkd_adamw_dtype dt, const tkd_train_state *st,
                                 const char *config_yaml, double timeout_s);

/* Every rank on resume: restores m's parameters (all of them) and *st as tkd_checkpoint_load does,
 * *adamw_step, and this rank's moments of [begin, end) = tkd_zero_range(n, world, rank) into
 * mom_m, mom_v (end - begin floats each). The checkpoint may come from any world: the same (each
 * rank reads its own shard), another (the range is assembled from the old shards that overlap it)
 * or a one-process optimizer.safetensors (read as world 1). A missing shard is TKD_ERR_NOT_FOUND
 * naming the file; moments kept as another dtype than dt TKD_ERR_CONFIG naming both. */
tkd_status tkd_checkpoint_load_shard(const char *dir, tkd_model *m, int rank, int world, tkd_adamw_dtype dt,
                                     float *mom_m, float *mom_v, int64_t *adamw_step, tkd_train_state *st);

#endif /* TKD_CHECKPOINT_H */
