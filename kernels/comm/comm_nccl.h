/* comm_nccl.h — the collectives of data-parallel student training (one process per GPU) over
 * NCCL: a communicator made from the unique id rank 0 draws (common/dist.h's tkd_rdzv_share
 * carries it to the others), all-reduce of a few host scalars, the ZeRO-1 reduce-scatter of
 * gradient ranges into their owners' shards, the all-gather of every rank's shard, a barrier.
 *
 * Beside the backend seam, not in it: only the CUDA backend has a communicator (the CPU backend
 * with one process needs none and never opens one), and the collectives take backend memory plus
 * the backend for its compute stream. NCCL runs on a stream of its own; events order it after the
 * compute stream's work so far (reductions) and the compute stream after it (gathers).
 *
 * Shards: rank r owns the elements [r·chunk, (r+1)·chunk) ∩ [0, n) of a flat array of n
 * (tkd_zero_range's split). The collectives over a range are one NCCL group of per-owner
 * operations (ncclReduce into the owner, ncclBroadcast from it), so a range need not line up with
 * the shards (a layer's gradients cross a shard border) and no buffer needs padding to world·chunk.
 *
 * No wait is unbounded: the communicator is non-blocking (ncclConfig_t.blocking = 0), and every
 * call that waits polls ncclCommGetAsyncError and CUDA events until timeout_s. On a timeout or an
 * asynchronous NCCL error the communicator is aborted (ncclCommAbort) and the error names the
 * operation and what opts->late says (common/dist.h's tkd_dist_late_ranks: the late rank); every
 * later call fails at once. Builds without NCCL get stubs that return TKD_ERR_UNSUPPORTED.
 */
#ifndef TKD_COMM_NCCL_H
#define TKD_COMM_NCCL_H

#include <stddef.h>

#include "common/status.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TKD_COMM_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */

typedef struct tkd_comm_id {
    char bytes[TKD_COMM_ID_BYTES];
} tkd_comm_id;

typedef struct tkd_comm tkd_comm;

typedef struct tkd_comm_opts {
    int rank, world;
    double timeout_s; /* the longest any call waits (dist.timeout_s) */
    /* Writes into buf who is late, e.g. "rank 1 (last step 41, 95 s ago)" ("" if unknown); NULL: the
     * error names no rank. Called once, when a wait fails. */
    void (*late)(void *ctx, char *buf, size_t n);
    /* Called about once a second while a call waits (a heartbeat: this rank is alive); NULL ok. */
    void (*waiting)(void *ctx);
    void *ctx;
} tkd_comm_opts;

/* 1 when this build has NCCL. */
int tkd_comm_built(void);

/* A new unique id (rank 0 only; the others receive it). TKD_ERR_DEVICE when NCCL fails. */
tkd_status tkd_comm_make_id(tkd_comm_id *id);

/* Joins the communicator of opts->world ranks named by id as opts->rank, on be's GPU (be: a CUDA
 * backend, borrowed, outliving the communicator). Waits for every rank up to opts->timeout_s.
 * *out owned by the caller (tkd_comm_free). */
tkd_status tkd_comm_init(const tkd_comm_id *id, const tkd_comm_opts *opts, tkd_backend *be, tkd_comm **out);

/* Finalizes and destroys the communicator (aborts it where a call failed, or where finalizing
 * does not end within the timeout). NULL is a no-op. */
void tkd_comm_free(tkd_comm *c);

/* v[0..n) (host) = the sum over the ranks of each rank's v, in double; n <= 16. After the comm
 * stream's earlier work; returns when the result is on the host. `what` names it in errors. */
tkd_status tkd_comm_allreduce_sum(tkd_comm *c, double *v, int n, const char *what);

/* Reduce-scatter of a range: g[begin, end) (fp32, backend memory, n elements in all, shards of
 * chunk) summed over the ranks into each element's owner; elements this rank does not own are
 * left as they were. Enqueued on the comm stream after the compute stream's work so far (the
 * gradients of the range are final); does not wait (tkd_comm_wait). */
tkd_status tkd_comm_reduce_range(tkd_comm *c, float *g, size_t begin, size_t end, size_t n, size_t chunk);

/* All-gather: every rank's shard copied into buf (n elements of elem_size bytes, backend memory)
 * on every rank. The shard comes from src (this rank's shard alone, its shard-size elements) or,
 * with src NULL, from its own place in buf. After the compute stream's work so far; the compute
 * stream's later work is ordered after it, and the call returns when it is done (the wait has the
 * deadline). */
tkd_status tkd_comm_gather_shards(tkd_comm *c, const void *src, void *buf, size_t elem_size, size_t n,
                                  size_t chunk, const char *what);

/* Waits (deadline) for all enqueued comm work and orders the compute stream after it. */
tkd_status tkd_comm_wait(tkd_comm *c, const char *what);

/* Returns when every rank has called it (an all-reduce of nothing). */
tkd_status tkd_comm_barrier(tkd_comm *c, const char *what);

#ifdef __cplusplus
}
#endif

#endif /* TKD_COMM_NCCL_H */
