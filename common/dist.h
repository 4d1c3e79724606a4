/* dist.h — who this process is among the ranks of a multi-process job (one process per GPU), the
 * one-time exchange of a small blob from rank 0 to every rank (the NCCL unique id), per-rank
 * heartbeats that name a rank that died or hangs, and the ZeRO-1 split of a flat parameter array.
 *
 * Rank, world size and local rank come from SLURM (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID)
 * or from RANK / WORLD_SIZE / LOCAL_RANK (set by `--nproc-per-node N` and by torchrun-style
 * launchers); with neither, the process is rank 0 of 1. The exchange goes through a file in a
 * directory every rank sees, or a TCP connection to MASTER_ADDR:MASTER_PORT (rank 0 listens).
 * docs/distributed.md is the user's side of this.
 */
#ifndef TKD_DIST_H
#define TKD_DIST_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct tkd_dist_info {
    int rank;        /* 0 .. world-1 */
    int world;       /* number of processes; 1 = not distributed */
    int local_rank;  /* index among this node's processes: the GPU it takes (modulo those visible) */
    int local_world; /* processes on this node */
    char source[16]; /* where it came from: "slurm", "env" or "single" */
} tkd_dist_info;

/* Reads the environment as above. Partial or contradicting variables (RANK without WORLD_SIZE,
 * rank >= world, non-numbers) are TKD_ERR_CONFIG naming the variable and its value. */
tkd_status tkd_dist_from_env(tkd_dist_info *out);

typedef enum tkd_rdzv_kind { TKD_RDZV_FILE = 0, TKD_RDZV_TCP = 1 } tkd_rdzv_kind;

typedef struct tkd_rdzv_config {
    tkd_rdzv_kind kind;
    const char *dir;    /* FILE: a directory every rank sees (e.g. the run directory) */
    const char *host;   /* TCP: rank 0's address (MASTER_ADDR) */
    int port;           /* TCP: MASTER_PORT */
    const char *job_id; /* tells this job's exchange from an older one's (SLURM_JOB_ID, or a nonce
                         * the launcher exports as TKD_JOB_ID); NULL: taken from the environment */
    double timeout_s;   /* how long a rank waits for the others before failing, naming them */
} tkd_rdzv_config;

/* Rank 0 publishes blob[0..n); every other rank waits for it and receives it into blob. Returns
 * once this rank holds the blob; ranks that never arrive within timeout_s are an error naming
 * them (TKD_ERR_IO). */
tkd_status tkd_rdzv_share(const tkd_rdzv_config *c, const tkd_dist_info *d, void *blob, size_t n);

/* Heartbeats in dir (one small file per rank, replaced atomically): a rank beats once per step;
 * when a collective times out, tkd_dist_late_ranks writes into buf the ranks whose last beat is
 * missing, older than stale_s or behind the others' step, e.g. "rank 1 (last step 41, 95 s ago)"
 * ("" when none is). */
tkd_status tkd_dist_beat(const char *dir, int rank, int64_t step);
void tkd_dist_late_ranks(const char *dir, int world, double stale_s, char *buf, size_t n);

/* ZeRO-1 split of n parameters over world ranks: every rank owns `chunk` slots (n rounded up to
 * world·chunk, chunk a multiple of 64 so each shard starts 256-byte aligned in fp32), rank r the
 * parameters [begin, end) = [min(r·chunk, n), min((r+1)·chunk, n)) — possibly empty for the last
 * ranks. Reduce-scatter and all-gather buffers are world·chunk long (the tail is padding). */
static inline void tkd_zero_range(size_t n, int world, int rank, size_t *begin, size_t *end,
                                  size_t *chunk)
{
    size_t c = (n + (size_t)world - 1) / (size_t)world;
    c = (c + 63) / 64 * 64;
    size_t b = (size_t)rank * c, e = b + c;
    *begin = b < n ? b : n;
    *end = e < n ? e : n;
    *chunk = c;
}

#endif /* TKD_DIST_H */
