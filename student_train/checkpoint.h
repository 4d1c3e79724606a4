/* checkpoint.h — a training checkpoint directory, written whole or not at all.
 *
 * <dir>/config.json + model.safetensors  the student in Hugging Face form (F32: resume is exact)
 * <dir>/optimizer.safetensors            AdamW moments "adamw.m", "adamw.v" (n,) F32
 * <dir>/state.json                       step, loader position (epoch, offset), tokens seen, RNG
 * <dir>/config.yaml                      the effective student-train config
 * The directory is built under a temporary name and renamed into place (common/fileio.h), so a
 * crash or a full disk leaves the previous checkpoint intact.
 */
#ifndef TKD_CHECKPOINT_H
#define TKD_CHECKPOINT_H

#include <stdint.h>

#include "common/rng.h"
#include "common/status.h"
#include "model/model.h"
#include "model/optim.h"

typedef struct tkd_train_state {
    int64_t step;        /* optimizer steps taken */
    int64_t epoch;       /* loader position: epoch ... */
    int64_t offset;      /* ... and the offset of the next batch in that epoch's order */
    int64_t tokens_seen; /* training tokens consumed (labels counted, padding excluded) */
    tkd_rng_state rng;   /* the trainer's generator (reserved for stochastic features) */
} tkd_train_state;

/* Writes the checkpoint to dir (replacing an older one atomically). config_yaml may be NULL. */
tkd_status tkd_checkpoint_save(const char *dir, const tkd_model *m, const tkd_adamw *opt,
                               const tkd_train_state *st, const char *config_yaml);

/* Restores m's parameters, opt's moments and step, and *st from dir. The checkpoint's
 * architecture must equal m's: otherwise TKD_ERR_CONFIG (m was built from a config other than the
 * run's, a usage error), naming the directory. */
tkd_status tkd_checkpoint_load(const char *dir, tkd_model *m, tkd_adamw *opt, tkd_train_state *st);

#endif /* TKD_CHECKPOINT_H */
