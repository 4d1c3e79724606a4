/* launch.c — see launch.h. */
#define _GNU_SOURCE
#include "common/launch.h"

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/dist.h"
#include "common/log.h"
#include "common/progress.h"
#include "common/signals.h"

#define MAX_PROCS 1024
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
static void exec_worker(const launch_env *e, int i, int n, pid_t launcher, int argc, char **argv)
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
    int n, running;
    int forwarded;           /* a signal to the launcher was sent on: exits are then expected */
    int failed, failed_code; /* the first worker that failed, -1 while none */
    pid_t failed_pid;
    double kill_at;          /* when stopping after a failure: SIGKILL at this time, else 0 */
} launch;

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

tkd_status tkd_launch_workers(const char *tool, int n, int argc, char **argv, double grace_s, int *exit_code)
{
    *exit_code = 0;
    launch_env env;
    TKD_TRY(refuse_nested(n));
    TKD_TRY(launch_env_make(&env, tool));
    launch L = {.pids = calloc((size_t)n, sizeof(pid_t)), .n = n, .failed = -1};
    if (!L.pids)
        return tkd_error_set(TKD_ERR_NOMEM, "--nproc-per-node: out of memory");
    pid_t self = getpid();
    tkd_status st = TKD_OK;
    sigset_t stop, old;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    for (int i = 0; i < n && !tkd_interrupted(); i++) {
        fflush(NULL);
        sigprocmask(SIG_BLOCK, &stop, &old); /* no signal between fork and the child's reset */
        pid_t pid = fork();
        if (pid == 0)
            exec_worker(&env, i, n, self, argc, argv);
        sigprocmask(SIG_SETMASK, &old, NULL);
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
    free(L.pids);
    if (st != TKD_OK)
        return st;
    if (L.failed >= 0) {
        *exit_code = L.failed_code;
        tkd_error_set(TKD_ERR_IO, "worker %d of %d (pid %ld) failed with exit code %d; the others were stopped", L.failed,
                      n, (long)L.failed_pid, L.failed_code);
        return tkd_error_hint(TKD_ERR_IO, "its error is above; fix it and re-run the same command (it resumes)");
    }
    if (tkd_interrupted()) {
        *exit_code = 128 + tkd_interrupted();
        return tkd_error_set(TKD_ERR_INTERRUPTED, "interrupted: the %d workers stopped — re-run the same command to resume",
                             n);
    }
    return TKD_OK;
}
