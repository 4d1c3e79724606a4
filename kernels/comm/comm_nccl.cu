/* comm_nccl.cu — see comm_nccl.h. Every NCCL call goes through settle() (a non-blocking
 * communicator answers ncclInProgress while it works in the background) and every wait for the
 * GPU through wait_event(); both poll with the deadline and abort the communicator on failure. */
#ifdef TKD_HAVE_NCCL
#include "kernels/comm/comm_nccl.h"

#include <nccl.h>
#include <new>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/progress.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"

static_assert(sizeof(ncclUniqueId) == TKD_COMM_ID_BYTES, "tkd_comm_id must hold an ncclUniqueId");

constexpr int kMaxSum = 16; /* scalars one all-reduce carries */

struct tkd_comm {
    ncclComm_t comm = nullptr;
    tkd_comm_opts o{};
    cudaStream_t compute = nullptr; /* the backend's (borrowed) */
    cudaStream_t stream = nullptr;  /* NCCL's own, non-blocking: the loss's legacy-stream work never
                                     * waits behind a collective that hangs */
    cudaEvent_t compute_done = nullptr, comm_done = nullptr;
    double *d_sum = nullptr; // (kMaxSum) device: the all-reduce's buffer
    double *h_sum = nullptr; // (kMaxSum) pinned: its host side
    bool broken = false;     /* aborted: every later call fails at once */
};

namespace {

/* The poll interval: 20 µs while a collective is likely about to finish, 1 ms after that (a
 * spinning host core is all a wait costs). */
void pause_for(double waited)
{
    struct timespec ts = {0, waited < 1e-2 ? 20000L : 1000000L};
    nanosleep(&ts, nullptr);
}

/* Aborts the communicator and sets "NCCL <what> (rank r of w): <why>; late: <who>". */
tkd_status fail(tkd_comm *c, tkd_status st, const char *what, const char *why)
{
    char late[512] = "";
    if (c->o.late)
        c->o.late(c->o.ctx, late, sizeof late);
    if (c->comm)
        (void)ncclCommAbort(c->comm);
    c->comm = nullptr;
    c->broken = true;
    return tkd_error_set(st, "NCCL %s (rank %d of %d): %s%s%s — communicator aborted", what, c->o.rank, c->o.world,
                         why, *late ? "; late: " : "; no rank is known to be late", late);
}

/* One turn of a wait loop: the heartbeat about once a second, then false once past the deadline. */
bool keep_waiting(tkd_comm *c, double t0, double *beat)
{
    double t = tkd_progress_now();
    if (c->o.waiting && t - *beat >= 1.0) {
        c->o.waiting(c->o.ctx);
        *beat = t;
    }
    if (t - t0 > c->o.timeout_s)
        return false;
    pause_for(t - t0);
    return true;
}

/* r is what a non-blocking NCCL call returned: waits while the communicator says ncclInProgress. */
tkd_status settle(tkd_comm *c, ncclResult_t r, const char *call, const char *what)
{
    double t0 = tkd_progress_now(), beat = t0;
    while (r == ncclInProgress && c->comm) {
        if (!keep_waiting(c, t0, &beat)) {
            char why[256];
            snprintf(why, sizeof why, "%s did not complete within %g s (dist.timeout_s)", call, c->o.timeout_s);
            return fail(c, TKD_ERR_IO, what, why);
        }
        if (ncclCommGetAsyncError(c->comm, &r) != ncclSuccess)
            r = ncclInternalError;
    }
    if (r == ncclSuccess)
        return TKD_OK;
    char why[512];
    snprintf(why, sizeof why, "%s failed: %s (%s)", call, ncclGetErrorString(r),
             c->comm ? ncclGetLastError(c->comm) : "no communicator");
    return fail(c, TKD_ERR_DEVICE, what, why);
}

/* Waits for ev (recorded on the comm stream) with the deadline, watching NCCL's asynchronous errors
 * (a peer that died shows up there before the deadline where NCCL notices it). */
tkd_status wait_event(tkd_comm *c, cudaEvent_t ev, const char *what)
{
    double t0 = tkd_progress_now(), beat = t0;
    char why[512];
    for (;;) {
        cudaError_t e = cudaEventQuery(ev);
        if (e == cudaSuccess)
            return TKD_OK;
        if (e != cudaErrorNotReady) {
            snprintf(why, sizeof why, "the GPU reported %s", cudaGetErrorString(e));
            return fail(c, TKD_ERR_DEVICE, what, why);
        }
        ncclResult_t a = ncclSuccess;
        if (ncclCommGetAsyncError(c->comm, &a) != ncclSuccess || (a != ncclSuccess && a != ncclInProgress)) {
            snprintf(why, sizeof why, "%s (%s)", ncclGetErrorString(a), ncclGetLastError(c->comm));
            return fail(c, TKD_ERR_DEVICE, what, why);
        }
        if (!keep_waiting(c, t0, &beat)) {
            snprintf(why, sizeof why, "did not finish within %g s (dist.timeout_s)", c->o.timeout_s);
            return fail(c, TKD_ERR_IO, what, why);
        }
    }
}

tkd_status usable(const tkd_comm *c, const char *what)
{
    if (!c || !c->comm || c->broken)
        return tkd_error_set(TKD_ERR_DEVICE, "NCCL %s: the communicator was aborted after an earlier failure", what);
    return TKD_OK;
}

/* The comm stream's next work waits for the compute stream's work so far. */
tkd_status after_compute(tkd_comm *c)
{
    TKD_CUDA_CHECK(cudaEventRecord(c->compute_done, c->compute));
    TKD_CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->compute_done, 0));
    return TKD_OK;
}

/* The host waits (deadline) for the comm stream's work so far; the compute stream's later work
 * is ordered after it too. */
tkd_status drain(tkd_comm *c, const char *what)
{
    TKD_CUDA_CHECK(cudaEventRecord(c->comm_done, c->stream));
    TKD_TRY(wait_event(c, c->comm_done, what));
    TKD_CUDA_CHECK(cudaStreamWaitEvent(c->compute, c->comm_done, 0));
    return TKD_OK;
}

/* This rank's part [b, e) of [begin, end) for owner r: the shard [r·chunk, (r+1)·chunk) ∩ [0, n). */
bool owner_part(int r, size_t begin, size_t end, size_t n, size_t chunk, size_t *b, size_t *e)
{
    size_t s0 = (size_t)r * chunk, s1 = s0 + chunk;
    *b = begin > s0 ? begin : s0;
    *e = end < s1 ? end : s1;
    if (*e > n)
        *e = n;
    return *b < *e;
}

/* One group of per-owner operations over [begin, end) of buf: ncclReduce into each owner (src
 * NULL, fp32 sums) or ncclBroadcast of each owner's bytes (from src, this rank's shard, or in place
 * where src is buf itself). */
tkd_status owner_group(tkd_comm *c, const char *src, char *buf, size_t elem, size_t begin, size_t end, size_t n,
                       size_t chunk, const char *what)
{
    int reduce = src == nullptr;
    TKD_TRY(settle(c, ncclGroupStart(), "ncclGroupStart", what));
    ncclResult_t first = ncclSuccess;
    for (int r = 0; r < c->o.world; r++) {
        size_t b, e;
        if (!owner_part(r, begin, end, n, chunk, &b, &e))
            continue;
        void *p = buf + b * elem;
        const void *from = src == buf ? p : src; /* a broadcast reads its sendbuff on the root only */
        ncclResult_t x = reduce ? ncclReduce(p, p, e - b, ncclFloat, ncclSum, r, c->comm, c->stream)
                                : ncclBroadcast(from, p, (e - b) * elem, ncclInt8, r, c->comm, c->stream);
        if (first == ncclSuccess && x != ncclSuccess && x != ncclInProgress)
            first = x;
    }
    ncclResult_t end_r = ncclGroupEnd(); /* a group once started is always ended */
    TKD_TRY(settle(c, first, reduce ? "ncclReduce" : "ncclBroadcast", what));
    return settle(c, end_r, "ncclGroupEnd", what);
}

} // namespace

extern "C" int tkd_comm_built(void) { return 1; }

extern "C" tkd_status tkd_comm_make_id(tkd_comm_id *id)
{
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess)
        return tkd_error_set(TKD_ERR_DEVICE, "ncclGetUniqueId failed: %s — NCCL needs a network interface it can "
                             "bind (NCCL_SOCKET_IFNAME)", ncclGetErrorString(r));
    memcpy(id->bytes, &u, sizeof u);
    return TKD_OK;
}

static tkd_status comm_setup(tkd_comm *c, const tkd_comm_id *id)
{
    TKD_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    TKD_CUDA_CHECK(cudaEventCreateWithFlags(&c->compute_done, cudaEventDisableTiming));
    TKD_CUDA_CHECK(cudaEventCreateWithFlags(&c->comm_done, cudaEventDisableTiming));
    TKD_TRY(tkd_cuda_malloc((void **)&c->d_sum, kMaxSum * sizeof(double), "NCCL all-reduce buffer", nullptr));
    TKD_TRY(tkd_cuda_malloc_host((void **)&c->h_sum, kMaxSum * sizeof(double), "NCCL all-reduce staging"));
    ncclUniqueId u;
    memcpy(&u, id->bytes, sizeof u);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; /* every call returns at once; settle() waits with the deadline */
    ncclResult_t r = ncclCommInitRankConfig(&c->comm, c->o.world, u, c->o.rank, &cfg);
    return settle(c, r, "ncclCommInitRankConfig", "init");
}

extern "C" tkd_status tkd_comm_init(const tkd_comm_id *id, const tkd_comm_opts *opts, tkd_backend *be,
                                    tkd_comm **out)
{
    *out = nullptr;
    /* the stream, not the device field: a profiling wrapper reports CUDA too but has no stream of
     * its own, and the collectives must be ordered after the compute stream's work */
    if (!be || !tkd_backend_cuda_stream(be))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "NCCL: data-parallel training needs the CUDA backend itself "
                             "(got %s)", be ? be->name : "none");
    if (opts->world < 1 || opts->rank < 0 || opts->rank >= opts->world || !(opts->timeout_s > 0))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "NCCL: rank %d of %d with timeout %g s is not a valid rank",
                             opts->rank, opts->world, opts->timeout_s);
    tkd_comm *c = new (std::nothrow) tkd_comm;
    if (!c)
        return tkd_error_set(TKD_ERR_NOMEM, "NCCL: out of memory");
    c->o = *opts;
    c->compute = static_cast<cudaStream_t>(tkd_backend_cuda_stream(be));
    tkd_status st = comm_setup(c, id);
    if (st != TKD_OK) {
        tkd_error_saved keep;
        tkd_error_save(&keep, st);
        tkd_comm_free(c);
        return tkd_error_restore(&keep);
    }
    *out = c;
    return TKD_OK;
}

extern "C" void tkd_comm_free(tkd_comm *c)
{
    if (!c)
        return;
    tkd_error_saved keep; /* finalizing may fail; the caller's message stays */
    tkd_error_save(&keep, TKD_OK);
    if (c->comm && !c->broken && settle(c, ncclCommFinalize(c->comm), "ncclCommFinalize", "finalize") == TKD_OK)
        (void)ncclCommDestroy(c->comm);
    else if (c->comm)
        (void)ncclCommAbort(c->comm);
    (void)tkd_error_restore(&keep);
    tkd_cuda_release(cudaStreamSynchronize, c->stream);
    tkd_cuda_release(cudaEventDestroy, c->compute_done);
    tkd_cuda_release(cudaEventDestroy, c->comm_done);
    tkd_cuda_release(cudaStreamDestroy, c->stream);
    tkd_cuda_free(c->d_sum);
    tkd_cuda_free_host(c->h_sum);
    delete c;
}

extern "C" tkd_status tkd_comm_allreduce_sum(tkd_comm *c, double *v, int n, const char *what)
{
    TKD_TRY(usable(c, what));
    if (n < 1 || n > kMaxSum)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "NCCL %s: %d values (1 to %d)", what, n, kMaxSum);
    size_t bytes = (size_t)n * sizeof(double);
    memcpy(c->h_sum, v, bytes);
    TKD_CUDA_CHECK(cudaMemcpyAsync(c->d_sum, c->h_sum, bytes, cudaMemcpyHostToDevice, c->stream));
    TKD_TRY(settle(c, ncclAllReduce(c->d_sum, c->d_sum, (size_t)n, ncclDouble, ncclSum, c->comm, c->stream),
                   "ncclAllReduce", what));
    TKD_CUDA_CHECK(cudaMemcpyAsync(c->h_sum, c->d_sum, bytes, cudaMemcpyDeviceToHost, c->stream));
    TKD_TRY(drain(c, what));
    memcpy(v, c->h_sum, bytes);
    return TKD_OK;
}

extern "C" tkd_status tkd_comm_reduce_range(tkd_comm *c, float *g, size_t begin, size_t end, size_t n, size_t chunk)
{
    const char *what = "gradient reduce-scatter";
    TKD_TRY(usable(c, what));
    if (begin > end || end > n || chunk == 0 || (size_t)c->o.world * chunk < n)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "NCCL %s: range [%zu, %zu) of %zu in shards of %zu", what, begin,
                             end, n, chunk);
    if (begin == end)
        return TKD_OK;
    TKD_TRY(after_compute(c));
    return owner_group(c, nullptr, reinterpret_cast<char *>(g), sizeof(float), begin, end, n, chunk, what);
}

extern "C" tkd_status tkd_comm_gather_shards(tkd_comm *c, const void *src, void *buf, size_t elem_size, size_t n,
                                             size_t chunk, const char *what)
{
    TKD_TRY(usable(c, what));
    if (chunk == 0 || (size_t)c->o.world * chunk < n || elem_size == 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "NCCL %s: %zu elements in shards of %zu", what, n, chunk);
    TKD_TRY(after_compute(c));
    const char *from = src ? static_cast<const char *>(src) : static_cast<const char *>(buf);
    TKD_TRY(owner_group(c, from, static_cast<char *>(buf), elem_size, 0, n, n, chunk, what));
    return drain(c, what);
}

extern "C" tkd_status tkd_comm_wait(tkd_comm *c, const char *what)
{
    TKD_TRY(usable(c, what));
    return drain(c, what);
}

extern "C" tkd_status tkd_comm_barrier(tkd_comm *c, const char *what)
{
    double one = 1.0;
    return tkd_comm_allreduce_sum(c, &one, 1, what);
}

#endif /* TKD_HAVE_NCCL */
