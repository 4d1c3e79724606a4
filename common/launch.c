/* launch.c — see launch.h. */
#define _GNU_SOURCE
#include "common/launch.h"

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/dist.h"
#include "common/log.h"
#include "common/progress.h"
#include "common/signals.h"

#define MAX_PROCS 1024
#define ERROR_FD_VAR "TKD_LAUNCH_ERROR_FD"
#define WORKER_MSG_MAX 1024 /* a worker's error line (TKD_ERROR_MSG_MAX) */
static const char flag[] = "--nproc-per-node";

tkd_status tkd_launch_take_nproc(int *argc, char **argv, int *nproc)
{
    *nproc = 0;
    int out = 1;
    for (int i = 1; i < *argc; i++) {
        const char *a = argv[i], *val = NULL;
        if (strcmp(a, "--") == 0) { /* the rest are positional: copied untouched */
            while (i < *argc)
                argv[out++] = argv[i++];
            break;
        }
        if (strcmp(a, flag) == 0)
            val = i + 1 < *argc ? argv[++i] : "";
        else if (strncmp(a, flag, sizeof flag - 1) == 0 && a[sizeof flag - 1] == '=')
            val = a + sizeof flag;
        if (!val) {
            argv[out++] = argv[i];
            continue;
        }
        int64_t n;
        if (tkd_cli_parse_int(flag, val, 1, MAX_PROCS, &n) != TKD_OK)
            return tkd_error_hint(TKD_ERR_INVALID_ARG, "give one process per GPU, 1 to %d", MAX_PROCS);
        *nproc = (int)n;
    }
    *argc = out;
    argv[out] = NULL;
    return TKD_OK;
}

/* What every worker shares: the rendezvous point and the job's nonce. */
typedef struct launch_env {
    const char *tool;
    char port[16];
    char job[40];
} launch_env;

static tkd_status launch_env_make(launch_env *e, const char *tool)
{
    e->tool = tool;
    const char *p = getenv("MASTER_PORT");
    int port = 0;
    if (p && *p)
        snprintf(e->port, sizeof e->port, "%s", p);
    else
        TKD_TRY(tkd_dist_free_port(&port));
    if (port)
        snprintf(e->port, sizeof e->port, "%d", port);
    /* unique among launches: the clock, the pid and a few random bytes */
    uint32_t r = 0;
    FILE *f = fopen("/dev/urandom", "re");
    if (!f || fread(&r, sizeof r, 1, f) != 1)
        r = (uint32_t)clock();
    if (f)
        fclose(f);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(e->job, sizeof e->job, "L%lx-%ld-%08x", (long)ts.tv_sec, (long)getpid(), r);
    return TKD_OK;
}

static void set_env_int(const char *name, int v)
{
    char num[16];
    snprintf(num, sizeof num, "%d", v);
    setenv(name, num, 1);
}

/* In the child after fork: the worker's environment and flags, then exec; never returns. */
static void exec_worker(const launch_env *e, int i, int n, pid_t launcher, int argc, char **argv, int err_fd)
{
    setpgid(0, 0);
    /* The launcher may have died before prctl: then nobody would forward a signal. */
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != launcher)
        _exit(127);
    /* The launcher forked with SIGINT/SIGTERM blocked: a signal forwarded before this point stays
     * pending and, now that the default action is back, ends the worker instead of running the
     * launcher's handler in the child and being lost at exec. */
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    sigprocmask(SIG_UNBLOCK, &stop, NULL);
    set_env_int("RANK", i);
    set_env_int("LOCAL_RANK", i);
    set_env_int("WORLD_SIZE", n);
    set_env_int("LOCAL_WORLD_SIZE", n);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", e->port, 1);
    setenv("TKD_JOB_ID", e->job, 1);
    /* the one descriptor the worker keeps across exec: where its error line goes */
    if (fcntl(err_fd, F_SETFD, 0) != 0)
        _exit(127);
    set_env_int(ERROR_FD_VAR, err_fd);
    /* argv[0] stays the name the user typed; -q goes before the others (a "--" may end the flags) */
    char **a = calloc((size_t)argc + 2, sizeof *a);
    if (!a)
        _exit(127);
    int k = 0;
    a[k++] = argv[0];
    if (i > 0)
        a[k++] = "-q";
    for (int j = 1; j < argc; j++)
        a[k++] = argv[j];
    execv("/proc/self/exe", a);
    fprintf(stderr, "%s: worker %d: cannot run /proc/self/exe: %s\n", e->tool, i, strerror(errno));
    _exit(127);
}

/* The exit code a shell would show for a wait status. */
static int exit_code_of(int ws)
{
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
}

static void signal_all(const pid_t *pids, int n, int sig)
{
    for (int i = 0; i < n; i++)
        if (pids[i] > 0)
            kill(pids[i], sig);
}

/* The launcher's state while workers run: pids[i] > 0 while worker i runs. */
typedef struct launch {
    pid_t *pids;
    int *err_fds;            /* err_fds[i]: the launcher's end of worker i's error channel, -1 once read */
    char (*msgs)[WORKER_MSG_MAX]; /* msgs[i]: worker i's error line ("" when it sent none) */
    int *codes;              /* codes[i]: worker i's exit code once it ended */
    int n, running;
    int forwarded;           /* a signal to the launcher was sent on: exits are then expected */
    int failed, failed_code; /* the first worker that failed, -1 while none */
    pid_t failed_pid;
    double kill_at;          /* when stopping after a failure: SIGKILL at this time, else 0 */
} launch;

/* Worker i has exited: its error line, if it sent one, is whole in the channel (a line is far
 * below a socket's buffer, so the worker never waited on us to write it). */
static void read_error(launch *L, int i)
{
    size_t len = 0;
    ssize_t k;
    while (L->err_fds[i] >= 0 && len < WORKER_MSG_MAX - 1 &&
           (k = recv(L->err_fds[i], L->msgs[i] + len, WORKER_MSG_MAX - 1 - len, MSG_DONTWAIT)) > 0)
        len += (size_t)k;
    L->msgs[i][len] = '\0';
    if (L->err_fds[i] >= 0)
        close(L->err_fds[i]);
    L->err_fds[i] = -1;
}

/* Reaps every worker that has exited; the first failure stops the others. */
static void reap(launch *L, double grace_s)
{
    int ws;
    pid_t pid;
    while ((pid = waitpid(-1, &ws, WNOHANG)) > 0) {
        for (int i = 0; i < L->n; i++) {
            if (L->pids[i] != pid)
                continue;
            L->pids[i] = 0;
            L->running--;
            int code = exit_code_of(ws);
            L->codes[i] = code;
            read_error(L, i);
            if (code != 0 && L->failed < 0 && !L->forwarded) {
                L->failed = i;
                L->failed_code = code;
                L->failed_pid = pid;
                signal_all(L->pids, L->n, SIGTERM);
                L->kill_at = tkd_progress_now() + grace_s;
            }
        }
    }
}

/* Started by another launcher (RANK/WORLD_SIZE set): each of its processes would start its own n.
 * SLURM's variables are not enough to tell: a batch script run without srun has them too. */
static tkd_status refuse_nested(int n)
{
    tkd_dist_info d;
    TKD_TRY(tkd_dist_from_env(&d));
    if (d.world <= 1 || d.source != TKD_DIST_ENV)
        return TKD_OK;
    tkd_error_set(TKD_ERR_CONFIG, "--nproc-per-node %d in rank %d of a job of %d (from %s variables)", n, d.rank,
                  d.world, tkd_dist_source_name(d.source));
    return tkd_error_hint(TKD_ERR_CONFIG, "let one launcher start the processes: the other, or this one alone");
}

static void launch_free(launch *L)
{
    for (int i = 0; L->err_fds && i < L->n; i++)
        if (L->err_fds[i] >= 0)
            close(L->err_fds[i]);
    free(L->pids);
    free(L->err_fds);
    free(L->msgs);
    free(L->codes);
}

static tkd_status launch_alloc(launch *L, int n)
{
    *L = (launch){.n = n, .failed = -1, .pids = calloc((size_t)n, sizeof(pid_t)),
                  .err_fds = malloc((size_t)n * sizeof(int)), .msgs = calloc((size_t)n, WORKER_MSG_MAX),
                  .codes = calloc((size_t)n, sizeof(int))};
    for (int i = 0; L->err_fds && i < n; i++)
        L->err_fds[i] = -1;
    if (!L->pids || !L->err_fds || !L->msgs || !L->codes) {
        launch_free(L);
        return tkd_error_set(TKD_ERR_NOMEM, "--nproc-per-node: out of memory");
    }
    return TKD_OK;
}

/* Forks worker i with its error channel (a socket pair: a worker whose launcher is gone gets an
 * error writing to it, not a SIGPIPE). Returns the pid, or -1 with errno set. */
static pid_t start_worker(launch *L, const launch_env *env, int i, pid_t self, int argc, char **argv)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return -1;
    sigset_t stop, old;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    fflush(NULL);
    sigprocmask(SIG_BLOCK, &stop, &old); /* no signal between fork and the child's reset */
    pid_t pid = fork();
    if (pid == 0)
        exec_worker(env, i, L->n, self, argc, argv, sv[1]);
    int e = errno;
    sigprocmask(SIG_SETMASK, &old, NULL);
    close(sv[1]);
    if (pid < 0) {
        close(sv[0]);
        errno = e;
        return -1;
    }
    L->err_fds[i] = sv[0];
    return pid;
}

/* A worker that ended on its own error, not because it was stopped (after the first failure, or
 * a signal the launcher forwarded). */
static bool failed_itself(const launch *L, int i)
{
    int c = L->codes[i];
    return c != 0 && c != 128 + SIGINT && c != 128 + SIGTERM && c != 128 + SIGKILL;
}

/* The one error line of a failed launch: the first failed worker's own error, after what became
 * of the others (those that failed too are counted, and their errors logged at -v, not printed
 * again: N workers failing to open one device must not give N lines). */
static tkd_status failure_message(const launch *L, const char *tool)
{
    const int f = L->failed;
    int same = 0, other = 0, stopped = 0;
    for (int i = 0; i < L->n; i++) {
        if (i == f)
            continue;
        if (!failed_itself(L, i)) {
            stopped += L->codes[i] != 0;
        } else if (strcmp(L->msgs[i], L->msgs[f]) == 0) {
            same++;
        } else {
            other++;
            if (L->msgs[i][0])
                tkd_log_debug("%s: worker %d of %d also failed (exit code %d): %s", tool, i, L->n, L->codes[i],
                              L->msgs[i]);
        }
    }
    char note[160] = "";
    size_t len = 0;
    if (same)
        len += (size_t)snprintf(note + len, sizeof note - len, "%s%d other%s the same way", len ? ", " : "", same,
                                same > 1 ? "s" : "");
    if (other)
        len += (size_t)snprintf(note + len, sizeof note - len, "%s%d other%s with another error, shown by -v",
                                len ? ", " : "", other, other > 1 ? "s" : "");
    if (stopped)
        snprintf(note + len, sizeof note - len, "%sthe others were stopped", len ? ", " : "");
    if (L->msgs[f][0]) /* its own message says what to do: a start-up error has nothing to resume */
        return tkd_error_set(TKD_ERR_IO, "worker %d of %d (pid %ld) failed with exit code %d%s%s%s: %s", f, L->n,
                             (long)L->failed_pid, L->failed_code, note[0] ? " (" : "", note, note[0] ? ")" : "",
                             L->msgs[f]);
    tkd_error_set(TKD_ERR_IO, "worker %d of %d (pid %ld) failed with exit code %d%s%s", f, L->n, (long)L->failed_pid,
                  L->failed_code, note[0] ? "; " : "", note);
    return tkd_error_hint(TKD_ERR_IO, "it left no error message (a signal or a crash: its output, if any, is above); "
                          "fix the cause and re-run the same command (it resumes)");
}

tkd_status tkd_launch_workers(const char *tool, int n, int argc, char **argv, double grace_s, int *exit_code)
{
    *exit_code = 0;
    launch_env env;
    TKD_TRY(refuse_nested(n));
    TKD_TRY(launch_env_make(&env, tool));
    launch L;
    TKD_TRY(launch_alloc(&L, n));
    pid_t self = getpid();
    tkd_status st = TKD_OK;
    for (int i = 0; i < n && !tkd_interrupted(); i++) {
        pid_t pid = start_worker(&L, &env, i, self, argc, argv);
        if (pid < 0) {
            st = tkd_error_set(TKD_ERR_IO, "--nproc-per-node: cannot start worker %d of %d: %s", i, n, strerror(errno));
            *exit_code = 1;
            signal_all(L.pids, n, SIGTERM);
            break;
        }
        L.pids[i] = pid;
        L.running++;
        tkd_log_info("%s: started worker %d of %d (pid %ld)", tool, i, n, (long)pid);
    }
    /* Poll rather than block in waitpid: a signal that lands just before a blocking wait would
     * otherwise wait for workers that were never told to stop. */
    while (L.running > 0) {
        reap(&L, grace_s);
        int sig = tkd_interrupted();
        if (sig && !L.forwarded) {
            signal_all(L.pids, n, sig);
            L.forwarded = 1;
        }
        if (L.kill_at > 0 && tkd_progress_now() > L.kill_at) {
            signal_all(L.pids, n, SIGKILL);
            L.kill_at = 0;
        }
        if (L.running > 0)
            nanosleep(&(struct timespec){0, 20000000}, NULL);
    }
    if (st == TKD_OK && L.failed >= 0) {
        *exit_code = L.failed_code;
        st = failure_message(&L, tool);
    } else if (st == TKD_OK && tkd_interrupted()) {
        *exit_code = 128 + tkd_interrupted();
        for (int i = 0; i < n; i++) /* each says how far it got; the line below says what to do */
            if (L.msgs[i][0])
                tkd_log_debug("%s: worker %d of %d: %s", tool, i, n, L.msgs[i]);
        st = tkd_error_set(TKD_ERR_INTERRUPTED, "interrupted: the %d workers stopped — re-run the same command to resume",
                           n);
    }
    launch_free(&L);
    return st;
}

bool tkd_launch_send_error(const char *msg)
{
    const char *v = getenv(ERROR_FD_VAR);
    char *end;
    long fd = v && *v ? strtol(v, &end, 10) : -1;
    struct stat sb;
    /* only the socket the launcher gave us: a stale variable must not make us write to another file */
    if (fd < 0 || *end || fd > 1 << 20 || fstat((int)fd, &sb) != 0 || !S_ISSOCK(sb.st_mode))
        return false;
    size_t len = strlen(msg);
    return send((int)fd, msg, len, MSG_NOSIGNAL) == (ssize_t)len;
}
