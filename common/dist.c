/* dist.c — see dist.h. */
#define _GNU_SOURCE
#include "common/dist.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/fileio.h"
#include "common/progress.h"
#include "common/signals.h"

#define MAX_WORLD (1 << 20)
#define JOB_MAX 128
#define POLL_NS 20000000L /* 20 ms between looks at a file or a refused connection */

/* ---- rank and world from the environment ---------------------------------------------------- */

/* name's value as an integer in [lo, hi]; *found = false when unset. */
static tkd_status env_int(const char *(*get)(const char *), const char *name, long lo, long hi, int *out,
                          bool *found)
{
    const char *v = get(name);
    *found = v && *v; /* set but empty: as unset, like a shell's test -n */
    if (!*found)
        return TKD_OK;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (*end || errno || x < lo || x > hi)
        return tkd_error_set(TKD_ERR_CONFIG, "environment %s=%s: not a number in %ld..%ld", name, v, lo, hi);
    *out = (int)x;
    return TKD_OK;
}

/* SLURM's compressed tasks-per-node list ("4(x2),3": nodes 0 and 1 run 4 tasks, node 2 runs 3)
 * at node; 0 when it cannot be read. */
static int tasks_on_node(const char *list, int node)
{
    const char *p = list;
    while (p && *p) {
        char *end;
        long tasks = strtol(p, &end, 10), reps = 1;
        if (end == p || tasks < 1)
            return 0;
        if (strncmp(end, "(x", 2) == 0) {
            reps = strtol(end + 2, &end, 10);
            if (*end != ')' || reps < 1)
                return 0;
            end++;
        }
        if (node < reps)
            return (int)tasks;
        node -= (int)reps;
        p = *end == ',' ? end + 1 : NULL;
    }
    return 0;
}

static tkd_status from_torch(tkd_dist_info *d, const char *(*get)(const char *))
{
    bool fl, flw;
    d->local_rank = d->rank;
    d->local_world = d->world;
    TKD_TRY(env_int(get, "LOCAL_RANK", 0, MAX_WORLD - 1, &d->local_rank, &fl));
    TKD_TRY(env_int(get, "LOCAL_WORLD_SIZE", 1, MAX_WORLD, &d->local_world, &flw));
    if (fl && !flw && d->local_rank >= d->local_world)
        d->local_world = d->local_rank + 1;
    if (d->local_rank >= d->local_world || d->local_world > d->world)
        return tkd_error_set(TKD_ERR_CONFIG, "environment LOCAL_RANK=%d, LOCAL_WORLD_SIZE=%d, WORLD_SIZE=%d: "
                             "the local rank must be below the local world, which is at most the world",
                             d->local_rank, d->local_world, d->world);
    d->source = TKD_DIST_ENV;
    return TKD_OK;
}

static tkd_status from_slurm(tkd_dist_info *d, const char *(*get)(const char *))
{
    bool found;
    int node = 0;
    d->local_rank = 0;
    TKD_TRY(env_int(get, "SLURM_LOCALID", 0, MAX_WORLD - 1, &d->local_rank, &found));
    TKD_TRY(env_int(get, "SLURM_NODEID", 0, MAX_WORLD - 1, &node, &found));
    d->local_world = tasks_on_node(get("SLURM_STEP_TASKS_PER_NODE"), node);
    if (d->local_world == 0)
        d->local_world = tasks_on_node(get("SLURM_NTASKS_PER_NODE"), 0);
    if (d->local_world <= d->local_rank || d->local_world > d->world)
        d->local_world = d->local_rank + 1; /* unknown: the least that is consistent */
    d->source = TKD_DIST_SLURM;
    return TKD_OK;
}

/* One pair (rank, world): both set, or neither; rank below world. */
static tkd_status rank_pair(const char *(*get)(const char *), const char *rn, const char *wn, tkd_dist_info *d,
                            bool *found)
{
    bool fr, fw;
    TKD_TRY(env_int(get, rn, 0, MAX_WORLD - 1, &d->rank, &fr));
    TKD_TRY(env_int(get, wn, 1, MAX_WORLD, &d->world, &fw));
    *found = fr && fw;
    if (fr != fw)
        return tkd_error_set(TKD_ERR_CONFIG, "environment %s is set without %s — set both or neither",
                             fr ? rn : wn, fr ? wn : rn);
    if (*found && d->rank >= d->world)
        return tkd_error_set(TKD_ERR_CONFIG, "environment %s=%d is not below %s=%d", rn, d->rank, wn, d->world);
    return TKD_OK;
}

/* One of a pair set without the other, where it may still describe a single process: true (and
 * TKD_OK) when it does — rank 0, or a world of 1 — else TKD_ERR_CONFIG naming the variable set and
 * the one missing. A half pair that meant several processes must not run as rank 0 of 1: that
 * process would redo (and overwrite) the work of every other. */
static tkd_status lone_single(const char *(*get)(const char *), const char *rn, const char *wn, const char *missing,
                              const char *setter)
{
    bool fr, fw;
    int r = 0, w = 1;
    TKD_TRY(env_int(get, rn, 0, MAX_WORLD - 1, &r, &fr));
    TKD_TRY(env_int(get, wn, 1, MAX_WORLD, &w, &fw));
    if (r == 0 && w == 1)
        return TKD_OK;
    return tkd_error_set(TKD_ERR_CONFIG, "environment %s=%d is set without %s — set all of them or none (%s)",
                         fr && r != 0 ? rn : wn, fr && r != 0 ? r : w, missing, setter);
}

/* SLURM_PROCID / SLURM_NTASKS: *found when both are set. A batch script run without srun (and an
 * salloc shell) may have only one of them, describing the allocation rather than this process:
 * SLURM_PROCID=0 alone or SLURM_NTASKS=1 alone is one process; any other half pair (a task of a
 * multi-task step that lost the other variable) is an error, as for RANK / WORLD_SIZE. */
static tkd_status slurm_pair(const char *(*get)(const char *), tkd_dist_info *d, bool *found)
{
    const char *p = get("SLURM_PROCID"), *n = get("SLURM_NTASKS");
    const bool hp = p && *p, hn = n && *n;
    *found = hp && hn;
    if (*found)
        return rank_pair(get, "SLURM_PROCID", "SLURM_NTASKS", d, found);
    if (!hp && !hn)
        return TKD_OK;
    return lone_single(get, "SLURM_PROCID", "SLURM_NTASKS", hp ? "SLURM_NTASKS" : "SLURM_PROCID",
                       "srun sets both for each task");
}

const char *tkd_dist_source_name(tkd_dist_source s)
{
    switch (s) {
    case TKD_DIST_SINGLE: return "single";
    case TKD_DIST_ENV: return "env";
    case TKD_DIST_SLURM: return "slurm";
    }
    return "?";
}

tkd_status tkd_dist_from_getenv(tkd_dist_info *out, const char *(*get)(const char *name))
{
    tkd_dist_info d = {.rank = 0, .world = 1, .local_rank = 0, .local_world = 1, .source = TKD_DIST_SINGLE};
    bool found;
    TKD_TRY(rank_pair(get, "RANK", "WORLD_SIZE", &d, &found));
    if (found) {
        TKD_TRY(from_torch(&d, get));
    } else {
        TKD_TRY(slurm_pair(get, &d, &found));
        if (found)
            TKD_TRY(from_slurm(&d, get));
        else
            TKD_TRY(lone_single(get, "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK and WORLD_SIZE",
                                "--nproc-per-node and torchrun set all four"));
    }
    *out = d;
    return TKD_OK;
}

static const char *plain_getenv(const char *name) { return getenv(name); }

tkd_status tkd_dist_from_env(tkd_dist_info *out) { return tkd_dist_from_getenv(out, plain_getenv); }

int tkd_dist_local_gpu(const tkd_dist_info *d, int n_visible)
{
    return n_visible > 0 ? d->local_rank % n_visible : 0;
}

void tkd_dist_job_id(char *buf, size_t cap)
{
    const char *t = getenv("TKD_JOB_ID"), *j = getenv("SLURM_JOB_ID"), *s = getenv("SLURM_STEP_ID");
    const char *e = getenv("TORCHELASTIC_RUN_ID"), *restarts = getenv("SLURM_RESTART_COUNT");
    const bool has_step = s && *s, requeued = restarts && *restarts && strcmp(restarts, "0") != 0;
    if (t && *t)
        snprintf(buf, cap, "%s", t);
    else if (j && *j) /* a requeued job keeps its id and restarts its steps at 0: the count tells them apart */
        snprintf(buf, cap, "%s%s%s%s%s", j, has_step ? "." : "", has_step ? s : "", requeued ? ".r" : "",
                 requeued ? restarts : "");
    else
        snprintf(buf, cap, "%s", e ? e : "");
    for (char *p = buf; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '.' ||
              *p == '-' || *p == '_'))
            *p = '_';
}

tkd_status tkd_rdzv_config_from_env(tkd_rdzv_config *c, int kind, const char *dir, double timeout_s)
{
    const char *host = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
    *c = (tkd_rdzv_config){.kind = TKD_RDZV_FILE, .dir = dir, .host = host, .timeout_s = timeout_s};
    if (kind < 0)
        kind = host && *host && port && *port ? TKD_RDZV_TCP : TKD_RDZV_FILE;
    c->kind = (tkd_rdzv_kind)kind;
    if (kind == TKD_RDZV_FILE) {
        if (!dir || !*dir)
            return tkd_error_set(TKD_ERR_CONFIG, "rendezvous by file needs a directory every rank sees");
        return TKD_OK;
    }
    if (!host || !*host || !port || !*port)
        return tkd_error_set(TKD_ERR_CONFIG, "rendezvous by tcp needs MASTER_ADDR and MASTER_PORT (rank 0's host "
                             "and a free port) in every rank's environment");
    char *end;
    long p = strtol(port, &end, 10);
    if (*end || p < 1 || p > 65535)
        return tkd_error_set(TKD_ERR_CONFIG, "environment MASTER_PORT=%s: not a port (1..65535)", port);
    c->port = (int)p;
    return TKD_OK;
}

/* ---- shared by both exchanges ----------------------------------------------------------------- */

static void nap(void) { nanosleep(&(struct timespec){0, POLL_NS}, NULL); }

static tkd_status interrupted(const char *what)
{
    return tkd_error_set(TKD_ERR_INTERRUPTED, "rendezvous: interrupted by signal %d while %s", tkd_interrupted(),
                         what);
}

/* "1, 2 and 5" of the ranks whose flag in have[1..world) is 0, at most 8 named. */
static void missing_ranks(const unsigned char *have, int world, char *buf, size_t cap)
{
    size_t len = 0;
    int named = 0, total = 0;
    buf[0] = '\0';
    for (int r = 1; r < world; r++)
        total += !have[r];
    for (int r = 1; r < world && named < 8; r++) {
        if (have[r])
            continue;
        named++;
        const char *sep = named == 1 ? "" : named == total ? " and " : ", ";
        int w = snprintf(buf + len, cap - len, "%s%d", sep, r);
        if (w < 0 || (size_t)w >= cap - len)
            return;
        len += (size_t)w;
    }
    if (total > named)
        snprintf(buf + len, cap - len, " (and %d more)", total - named);
}

static tkd_status timed_out(const char *who, double timeout_s, const char *how)
{
    tkd_error_set(TKD_ERR_IO, "rendezvous: %s did not arrive within %.0f s (%s)", who, timeout_s, how);
    return tkd_error_hint(TKD_ERR_IO, "was every rank started (srun with one task per GPU, or --nproc-per-node), "
                          "with the same job and world size? see docs/distributed.md");
}

/* ---- by file ---------------------------------------------------------------------------------- */

#define FILE_MAGIC "topkd-rdzv 1"

static tkd_status file_path(char *out, size_t cap, const char *dir, const char *job, int rank)
{
    char name[JOB_MAX + 32];
    if (rank > 0)
        snprintf(name, sizeof name, ".rdzv-%s.rank%d", job, rank);
    else
        snprintf(name, sizeof name, ".rdzv-%s", job);
    return tkd_path_join(out, cap, dir, name);
}

/* The blob file's header line: magic, job, world, n. */
static int file_header(char *buf, size_t cap, const char *job, int world, size_t n)
{
    return snprintf(buf, cap, "%s job=%s world=%d n=%zu\n", FILE_MAGIC, job, world, n);
}

static tkd_status file_publish(const char *path, const char *job, int world, const void *blob, size_t n)
{
    char head[JOB_MAX + 96];
    int h = file_header(head, sizeof head, job, world, n);
    char *all = malloc((size_t)h + n + 1);
    if (!all)
        return tkd_error_set(TKD_ERR_NOMEM, "rendezvous: out of memory");
    memcpy(all, head, (size_t)h);
    memcpy(all + h, blob, n);
    tkd_status st = tkd_file_write_atomic(path, all, (size_t)h + n);
    free(all);
    return st;
}

/* Checks the blob file's header against this job and copies the blob out. */
static tkd_status file_take(const char *path, const char *job, int world, void *blob, size_t n)
{
    void *data = NULL;
    size_t len = 0;
    TKD_TRY(tkd_read_file(path, &data, &len));
    char want[JOB_MAX + 96];
    int h = file_header(want, sizeof want, job, world, n);
    const char *nl = memchr(data, '\n', len);
    tkd_status st = TKD_OK;
    if (!nl || (size_t)(nl + 1 - (const char *)data) != (size_t)h || memcmp(data, want, (size_t)h) != 0 ||
        len != (size_t)h + n)
        st = tkd_error_set(TKD_ERR_MISMATCH, "rendezvous: %s says '%.*s', this rank expects '%.*s' — a rank of "
                           "another world size or build", path, nl ? (int)(nl - (const char *)data) : 40,
                           (const char *)data, h - 1, want);
    else
        memcpy(blob, (const char *)data + h, n);
    free(data);
    return st;
}

static tkd_status file_rank0(const tkd_rdzv_config *c, const char *job, int world, const void *blob, size_t n)
{
    char path[4096], ack[4096];
    TKD_TRY(file_path(path, sizeof path, c->dir, job, 0));
    TKD_TRY(file_publish(path, job, world, blob, n));
    unsigned char *have = calloc((size_t)world, 1);
    if (!have)
        return tkd_error_set(TKD_ERR_NOMEM, "rendezvous: out of memory");
    int left = world - 1;
    double deadline = tkd_progress_now() + c->timeout_s;
    tkd_status st = TKD_OK;
    while (left > 0 && st == TKD_OK) {
        for (int r = 1; r < world && st == TKD_OK; r++) {
            if (have[r])
                continue;
            st = file_path(ack, sizeof ack, c->dir, job, r);
            if (st == TKD_OK && tkd_file_exists(ack))
                have[r] = 1, left--;
        }
        if (st != TKD_OK || left == 0)
            break;
        if (tkd_interrupted())
            st = interrupted("waiting for the other ranks");
        else if (tkd_progress_now() > deadline) {
            char miss[160], how[4300];
            missing_ranks(have, world, miss, sizeof miss);
            snprintf(how, sizeof how, "no answer file %s.rank<r> in %s", strrchr(path, '/') + 1, c->dir);
            char who[200];
            snprintf(who, sizeof who, "rank%s %s of %d", strchr(miss, ' ') ? "s" : "", miss, world);
            st = timed_out(who, c->timeout_s, how);
        } else
            nap();
    }
    for (int r = 1; r < world; r++)
        if (have[r] && file_path(ack, sizeof ack, c->dir, job, r) == TKD_OK)
            unlink(ack);
    unlink(path); /* every rank holds the blob now, or the job is failing */
    free(have);
    return st;
}

static tkd_status file_other(const tkd_rdzv_config *c, const char *job, const tkd_dist_info *d, void *blob,
                             size_t n)
{
    char path[4096], ack[4096];
    TKD_TRY(file_path(path, sizeof path, c->dir, job, 0));
    TKD_TRY(file_path(ack, sizeof ack, c->dir, job, d->rank));
    double deadline = tkd_progress_now() + c->timeout_s;
    while (!tkd_file_exists(path)) {
        if (tkd_interrupted())
            return interrupted("waiting for rank 0");
        if (tkd_progress_now() > deadline) {
            char how[4200];
            snprintf(how, sizeof how, "no file %s", path);
            return timed_out("rank 0", c->timeout_s, how);
        }
        nap();
    }
    TKD_TRY(file_take(path, job, d->world, blob, n));
    char line[64];
    int len = snprintf(line, sizeof line, "rank %d\n", d->rank);
    return tkd_file_write_atomic(ack, line, (size_t)len);
}

/* ---- by TCP ----------------------------------------------------------------------------------- */

/* One fixed-size message each way: the hello (code = the client's rank) and the answer (code =
 * one of the refusals below, 0 = the blob follows). Integers in network order. */
enum { TCP_OK = 0, TCP_OTHER_JOB = 1, TCP_OTHER_WORLD = 2, TCP_BAD_RANK = 3 };
typedef struct tcp_msg {
    char magic[4]; /* "TKDR" */
    uint32_t version, code, world, n_hi, n_lo;
    char job[JOB_MAX]; /* NUL-padded */
} tcp_msg;
#define TCP_VERSION 1u

static void msg_make(tcp_msg *m, uint32_t code, const char *job, int world, size_t n)
{
    memset(m, 0, sizeof *m);
    memcpy(m->magic, "TKDR", 4);
    m->version = htonl(TCP_VERSION);
    m->code = htonl(code);
    m->world = htonl((uint32_t)world);
    m->n_hi = htonl((uint32_t)((uint64_t)n >> 32));
    m->n_lo = htonl((uint32_t)n);
    snprintf(m->job, sizeof m->job, "%s", job);
}

/* Decodes m in place; false when it is not one of ours. */
static bool msg_read(tcp_msg *m, size_t *n)
{
    if (memcmp(m->magic, "TKDR", 4) != 0 || ntohl(m->version) != TCP_VERSION)
        return false;
    m->code = ntohl(m->code);
    m->world = ntohl(m->world);
    *n = (size_t)(((uint64_t)ntohl(m->n_hi) << 32) | ntohl(m->n_lo));
    m->job[JOB_MAX - 1] = '\0';
    return true;
}

/* Sends or receives exactly len bytes on the non-blocking fd before deadline. */
static tkd_status io_full(int fd, void *buf, size_t len, bool out, double deadline, const char *peer)
{
    char *p = buf;
    while (len > 0) {
        if (tkd_interrupted())
            return interrupted(out ? "sending" : "receiving");
        struct pollfd pf = {.fd = fd, .events = out ? POLLOUT : POLLIN};
        if (poll(&pf, 1, 20) < 0 && errno != EINTR)
            return tkd_error_set(TKD_ERR_IO, "rendezvous: poll: %s", strerror(errno));
        ssize_t k = out ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
        if (k > 0) {
            p += k, len -= (size_t)k;
            continue;
        }
        if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            return tkd_error_set(TKD_ERR_IO, "rendezvous: %s closed the connection%s%s", peer, k ? ": " : "",
                                 k ? strerror(errno) : "");
        if (tkd_progress_now() > deadline)
            return tkd_error_set(TKD_ERR_IO, "rendezvous: %s did not %s in time", peer, out ? "take our message"
                                                                                            : "answer");
    }
    return TKD_OK;
}

static tkd_status tcp_listen(int port, int backlog, int *out)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1;
    if (fd < 0)
        return tkd_error_set(TKD_ERR_IO, "rendezvous: socket: %s", strerror(errno));
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_ANY)};
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, backlog) != 0) {
        int e = errno;
        close(fd);
        tkd_error_set(TKD_ERR_IO, "rendezvous: rank 0 cannot listen on port %d: %s", port, strerror(e));
        return tkd_error_hint(TKD_ERR_IO, "another job may hold MASTER_PORT: pick a free one");
    }
    *out = fd;
    return TKD_OK;
}

/* Rank 0's state while ranks connect. */
typedef struct tcp_server {
    const char *job;
    int world;
    size_t n;
    const void *blob;
    double deadline;
    unsigned char *have; /* have[r]: rank r holds the blob */
    int left;
    char note[256];      /* the last connection refused as not of this job, for the timeout message */
} tcp_server;

/* Answers one accepted connection. A peer of another job or none of ours is refused and noted
 * (the wait goes on); a rank of this job that disagrees ends the exchange. */
static tkd_status tcp_serve(tcp_server *S, int fd, const char *peer)
{
    tcp_msg m, a;
    size_t n = 0;
    double dl = tkd_progress_now() + 2.0 < S->deadline ? tkd_progress_now() + 2.0 : S->deadline;
    if (io_full(fd, &m, sizeof m, false, dl, peer) != TKD_OK || !msg_read(&m, &n)) {
        snprintf(S->note, sizeof S->note, "; a connection from %s that is not a topkd rank was dropped", peer);
        return TKD_OK;
    }
    int rank = (int)m.code;
    uint32_t code = strcmp(m.job, S->job) != 0              ? TCP_OTHER_JOB
                    : (int)m.world != S->world || n != S->n ? TCP_OTHER_WORLD
                    : rank < 1 || rank >= S->world || S->have[rank] ? TCP_BAD_RANK
                                                                    : TCP_OK;
    msg_make(&a, code, S->job, S->world, S->n);
    tkd_status st = io_full(fd, &a, sizeof a, true, S->deadline, peer);
    if (st == TKD_OK && code == TCP_OK)
        st = io_full(fd, (void *)S->blob, S->n, true, S->deadline, peer);
    if (code == TCP_OTHER_JOB) {
        snprintf(S->note, sizeof S->note, "; refused %s of job %.40s (this is job %.40s)", peer, m.job, S->job);
        return TKD_OK;
    }
    if (code == TCP_OTHER_WORLD)
        return tkd_error_set(TKD_ERR_MISMATCH, "rendezvous: rank %d (%s) runs with world %u and n %zu, rank 0 "
                             "with world %d and n %zu — start every rank with the same world size and build",
                             rank, peer, m.world, n, S->world, S->n);
    if (code == TCP_BAD_RANK)
        return tkd_error_set(TKD_ERR_MISMATCH, "rendezvous: %s claims rank %d of %d, which is %s", peer, rank,
                             S->world, rank >= 1 && rank < S->world ? "taken already" : "not a rank");
    TKD_TRY(st);
    S->have[rank] = 1;
    S->left--;
    return TKD_OK;
}

static void peer_name(const struct sockaddr_in *a, char *buf, size_t cap)
{
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    snprintf(buf, cap, "%s:%d", ip, ntohs(a->sin_port));
}

static tkd_status tcp_rank0(const tkd_rdzv_config *c, const char *job, int world, const void *blob, size_t n)
{
    int lfd = -1;
    TKD_TRY(tcp_listen(c->port, world, &lfd));
    tcp_server S = {.job = job, .world = world, .n = n, .blob = blob, .deadline = tkd_progress_now() + c->timeout_s,
                    .have = calloc((size_t)world, 1), .left = world - 1};
    tkd_status st = S.have ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "rendezvous: out of memory");
    while (st == TKD_OK && S.left > 0) {
        struct sockaddr_in a;
        socklen_t al = sizeof a;
        int fd = accept4(lfd, (struct sockaddr *)&a, &al, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
            char peer[64];
            peer_name(&a, peer, sizeof peer);
            st = tcp_serve(&S, fd, peer);
            close(fd);
        } else if (tkd_interrupted()) {
            st = interrupted("waiting for the other ranks");
        } else if (tkd_progress_now() > S.deadline) {
            char miss[160], who[200], how[400];
            missing_ranks(S.have, world, miss, sizeof miss);
            snprintf(who, sizeof who, "rank%s %s of %d", strchr(miss, ' ') ? "s" : "", miss, world);
            snprintf(how, sizeof how, "none connected to port %d%s", c->port, S.note);
            st = timed_out(who, c->timeout_s, how);
        } else {
            struct pollfd pf = {.fd = lfd, .events = POLLIN};
            poll(&pf, 1, 20);
        }
    }
    free(S.have);
    close(lfd);
    return st;
}

/* A connected non-blocking socket to host:port, or TKD_ERR_NOT_FOUND while nobody listens yet. */
static tkd_status tcp_connect(const char *host, int port, double deadline, int *out)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int e = getaddrinfo(host, ps, &hints, &res);
    if (e != 0)
        return tkd_error_set(TKD_ERR_CONFIG, "rendezvous: MASTER_ADDR %s: %s", host, gai_strerror(e));
    tkd_status st = tkd_error_set(TKD_ERR_NOT_FOUND, "rendezvous: nobody listens on %s:%d", host, port);
    for (struct addrinfo *ai = res; ai && st != TKD_OK; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0)
            continue;
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen), err = rc == 0 ? 0 : errno;
        if (err == EINPROGRESS) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            double left = deadline - tkd_progress_now();
            int ms = left > 1.0 ? 1000 : left > 0 ? (int)(left * 1000) + 1 : 1;
            socklen_t l = sizeof err;
            err = poll(&pf, 1, ms) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l) == 0 ? err : ETIMEDOUT;
        }
        if (err == 0) {
            *out = fd;
            st = TKD_OK;
        } else {
            close(fd);
        }
    }
    freeaddrinfo(res);
    return st;
}

static const char *refusal(uint32_t code)
{
    return code == TCP_OTHER_JOB     ? "belongs to another job"
           : code == TCP_OTHER_WORLD ? "runs another world size or build"
                                     : "has this rank already, or it is out of range";
}

static tkd_status tcp_other(const tkd_rdzv_config *c, const char *job, const tkd_dist_info *d, void *blob,
                            size_t n)
{
    double deadline = tkd_progress_now() + c->timeout_s;
    int fd = -1;
    tkd_status st;
    while ((st = tcp_connect(c->host, c->port, deadline, &fd)) == TKD_ERR_NOT_FOUND) {
        if (tkd_interrupted())
            return interrupted("connecting to rank 0");
        if (tkd_progress_now() > deadline) {
            char how[300];
            snprintf(how, sizeof how, "nothing listens on %s:%d", c->host, c->port);
            return timed_out("rank 0", c->timeout_s, how);
        }
        nap();
    }
    TKD_TRY(st);
    char peer[300];
    snprintf(peer, sizeof peer, "rank 0 at %s:%d", c->host, c->port);
    tcp_msg m;
    size_t rn = 0;
    msg_make(&m, (uint32_t)d->rank, job, d->world, n);
    st = io_full(fd, &m, sizeof m, true, deadline, peer);
    if (st == TKD_OK)
        st = io_full(fd, &m, sizeof m, false, deadline, peer);
    if (st == TKD_OK && !msg_read(&m, &rn))
        st = tkd_error_set(TKD_ERR_MISMATCH, "rendezvous: %s is not a topkd rank 0 — check MASTER_ADDR/MASTER_PORT",
                           peer);
    if (st == TKD_OK && m.code != TCP_OK)
        st = tkd_error_set(TKD_ERR_MISMATCH, "rendezvous: %s (job %.40s, world %u, n %zu) refused rank %d (job "
                           "%.40s, world %d, n %zu): it %s", peer, m.job, m.world, rn, d->rank, job, d->world, n,
                           refusal(m.code));
    if (st == TKD_OK)
        st = io_full(fd, blob, n, false, deadline, peer);
    close(fd);
    return st;
}

/* ---- the exchange ----------------------------------------------------------------------------- */

tkd_status tkd_rdzv_share(const tkd_rdzv_config *c, const tkd_dist_info *d, void *blob, size_t n)
{
    if (d->world <= 1)
        return TKD_OK;
    char job[JOB_MAX];
    if (c->job_id)
        snprintf(job, sizeof job, "%s", c->job_id);
    else
        tkd_dist_job_id(job, sizeof job);
    if (!*job || strchr(job, '/'))
        return tkd_error_set(TKD_ERR_CONFIG, "rendezvous: no job id (TKD_JOB_ID or SLURM_JOB_ID) — start the ranks "
                             "with srun or --nproc-per-node, or export the same TKD_JOB_ID to every rank");
    if (c->kind == TKD_RDZV_TCP) {
        if (!c->host || c->port < 1 || c->port > 65535)
            return tkd_error_set(TKD_ERR_CONFIG, "rendezvous by tcp: no MASTER_ADDR/MASTER_PORT");
        return d->rank == 0 ? tcp_rank0(c, job, d->world, blob, n) : tcp_other(c, job, d, blob, n);
    }
    if (!c->dir || !*c->dir)
        return tkd_error_set(TKD_ERR_CONFIG, "rendezvous by file: no directory");
    return d->rank == 0 ? file_rank0(c, job, d->world, blob, n) : file_other(c, job, d, blob, n);
}

/* ---- heartbeats ------------------------------------------------------------------------------- */

static double wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Replaced by rename so a reader sees a whole line; not fsynced: a beat need not survive a crash,
 * and an fsync per step on a shared filesystem would cost more than the step's collectives. */
tkd_status tkd_dist_beat(const char *dir, int rank, int64_t step)
{
    char path[4096], tmp[4200], line[96];
    char name[48];
    snprintf(name, sizeof name, ".beat-rank%d", rank);
    TKD_TRY(tkd_path_join(path, sizeof path, dir, name));
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int len = snprintf(line, sizeof line, "step %lld time %.3f\n", (long long)step, wall_s());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644); /* never through a link */
    if (fd < 0)
        return tkd_error_set(TKD_ERR_IO, "heartbeat %s: %s", tmp, strerror(errno));
    bool ok = write(fd, line, (size_t)len) == len;
    int e = errno;
    close(fd);
    if (!ok || rename(tmp, path) != 0) {
        e = ok ? errno : e;
        unlink(tmp);
        return tkd_error_set(TKD_ERR_IO, "heartbeat %s: %s", path, strerror(e));
    }
    return TKD_OK;
}

/* Rank r's last beat; false when missing or unreadable. */
static bool read_beat(const char *dir, int r, long long *step, double *t)
{
    char path[4096], name[48], line[96] = "";
    snprintf(name, sizeof name, ".beat-rank%d", r);
    if (tkd_path_join(path, sizeof path, dir, name) != TKD_OK)
        return false;
    FILE *f = fopen(path, "re");
    if (!f)
        return false;
    bool ok = fgets(line, sizeof line, f) && sscanf(line, "step %lld time %lf", step, t) == 2;
    fclose(f);
    return ok;
}

void tkd_dist_late_ranks(const char *dir, int world, double stale_s, char *buf, size_t n)
{
    long long *step = calloc((size_t)world, sizeof *step), top = -1;
    double *t = calloc((size_t)world, sizeof *t), now = wall_s();
    bool *ok = calloc((size_t)world, sizeof *ok);
    size_t len = 0;
    if (n)
        buf[0] = '\0';
    if (!step || !t || !ok)
        goto done;
    for (int r = 0; r < world; r++)
        if ((ok[r] = read_beat(dir, r, &step[r], &t[r])) && step[r] > top)
            top = step[r];
    for (int r = 0; r < world && len < n; r++) {
        int w;
        if (!ok[r])
            w = snprintf(buf + len, n - len, "%srank %d (no heartbeat)", len ? ", " : "", r);
        else if (step[r] < top || now - t[r] > stale_s)
            w = snprintf(buf + len, n - len, "%srank %d (last step %lld, %.0f s ago)", len ? ", " : "", r, step[r],
                         now > t[r] ? now - t[r] : 0.0); /* clocks of two nodes may differ a little */
        else
            continue;
        if (w < 0)
            break;
        len += (size_t)w;
    }
done:
    free(step);
    free(t);
    free(ok);
}

tkd_status tkd_dist_free_port(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &l) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return tkd_error_set(TKD_ERR_IO, "cannot find a free TCP port: %s", strerror(e));
    }
    close(fd);
    *port = ntohs(a.sin_port);
    return TKD_OK;
}
