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

/* Where a process's rank came from. */
typedef enum tkd_dist_source {
    TKD_DIST_SINGLE = 0, /* no variables: rank 0 of 1 */
    TKD_DIST_ENV = 1,    /* RANK / WORLD_SIZE (--nproc-per-node, torchrun-style launchers) */
    TKD_DIST_SLURM = 2,  /* SLURM_PROCID / SLURM_NTASKS (srun) */
} tkd_dist_source;

/* "single", "env" or "slurm" (messages, logs); "?" for anything else. */
const char *tkd_dist_source_name(tkd_dist_source s);

typedef struct tkd_dist_info {
    int rank;               /* 0 .. world-1 */
    int world;              /* number of processes; 1 = not distributed */
    int local_rank;         /* index among this node's processes: the GPU it takes (modulo those visible) */
    int local_world;        /* processes on this node */
    tkd_dist_source source; /* where it came from */
} tkd_dist_info;

/* Reads the environment as above. Partial or contradicting variables (RANK without WORLD_SIZE,
 * rank >= world, non-numbers) are TKD_ERR_CONFIG naming the variable and its value. Half of the
 * SLURM pair, or LOCAL_RANK / LOCAL_WORLD_SIZE without RANK and WORLD_SIZE, is an error too unless
 * it describes one process (SLURM_PROCID=0 or SLURM_NTASKS=1 alone: a batch script or salloc shell
 * run without srun; LOCAL_RANK=0, LOCAL_WORLD_SIZE=1): the message names the variable set and the
 * one missing. */
tkd_status tkd_dist_from_env(tkd_dist_info *out);

/* The same with another lookup than getenv (tests; teacher-dump's config finalize takes one).
 * Order: RANK/WORLD_SIZE when set (a launcher started inside a SLURM allocation, e.g.
 * `--nproc-per-node` in an sbatch script, sets them for its children while the script's
 * SLURM_PROCID=0 still describes the batch step), else SLURM_PROCID/SLURM_NTASKS when both are
 * set, else rank 0 of 1. LOCAL_RANK defaults to RANK, LOCAL_WORLD_SIZE to WORLD_SIZE; under SLURM
 * the local world comes from SLURM_STEP_TASKS_PER_NODE ("4(x2),3") at SLURM_NODEID, else
 * SLURM_NTASKS_PER_NODE. */
tkd_status tkd_dist_from_getenv(tkd_dist_info *out, const char *(*get)(const char *name));

/* The GPU this process takes among the n_visible that answer: its local rank, modulo n_visible (a
 * launcher that gives each task only its own GPUs — srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES
 * of one device — leaves fewer visible than the local ranks count); 0 when none answer. The one
 * rule both tools follow (kernels/backend.h's tkd_backend_open_local). */
int tkd_dist_local_gpu(const tkd_dist_info *d, int n_visible);

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

/* How the exchange works (both ways check the job id, the world size and n, so a file or a
 * connection of another job, or a rank started with another world, is a clear error, never a
 * silently wrong communicator); a SIGINT/SIGTERM (common/signals.h) ends any wait with
 * TKD_ERR_INTERRUPTED. With world 1 nothing is exchanged.
 * FILE: rank 0 writes <dir>/.rdzv-<job> (temp + rename; dir must exist: rank 0 does not make it);
 *   every other rank polls for it, reads it and answers with <dir>/.rdzv-<job>.rank<r>; rank 0
 *   waits for every answer, then removes them and the blob file. A crash leaves small files whose
 *   names carry a job id that is never reused (SLURM job, step and restart count, or the
 *   launcher's nonce), so they are harmless and never taken by a later job.
 * TCP: rank 0 listens on port (all addresses), every other rank connects to host:port (retrying
 *   while rank 0 is not up yet) and sends (magic, job, world, rank, n); rank 0 answers with the
 *   blob or a refusal that says what differs. A connection of another job is refused and waited
 *   past (its client gets the error); a rank of this job with another world or n ends the
 *   exchange with an error on both sides. */

/* The job id tkd_rdzv_share uses when c->job_id is NULL: TKD_JOB_ID (the launcher's nonce), else
 * SLURM_JOB_ID[.SLURM_STEP_ID][.r<SLURM_RESTART_COUNT> when a requeue made it non-zero], else
 * TORCHELASTIC_RUN_ID; characters other than [A-Za-z0-9._-]
 * become '_'. "" when none is set (then a world > 1 exchange is TKD_ERR_CONFIG). */
void tkd_dist_job_id(char *buf, size_t cap);

/* Fills c for kind (-1 = auto: TCP when MASTER_ADDR and MASTER_PORT are both set, else FILE in
 * dir), host and port from MASTER_ADDR / MASTER_PORT (host points into the environment), job_id
 * NULL. TCP without MASTER_ADDR/MASTER_PORT, a bad port, or FILE without dir: TKD_ERR_CONFIG. */
tkd_status tkd_rdzv_config_from_env(tkd_rdzv_config *c, int kind, const char *dir, double timeout_s);

/* A TCP port free on this host now (bound to port 0 and released): what `--nproc-per-node` gives
 * its ranks as MASTER_PORT. Another process may take it before rank 0 listens; then rank 0's
 * listen fails with a message naming the port. */
tkd_status tkd_dist_free_port(int *port);

/* Heartbeats in dir (one small file per rank, replaced atomically): a rank beats as its steps start
 * and while it waits in a collective, at most once a second (student_train/zero.c);
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
