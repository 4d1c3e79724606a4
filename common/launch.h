/* launch.h — `--nproc-per-node N`: one command starts the N processes of a run on this node, for
 * teacher-dump (N workers splitting the dump) and student-train (N data-parallel ranks).
 *
 * The launcher re-executes its own binary (/proc/self/exe) N times with the same arguments; worker
 * i of N gets RANK=i, WORLD_SIZE=N, LOCAL_RANK=i, LOCAL_WORLD_SIZE=N (what torchrun would set, so
 * the workers split the work and pick their GPU exactly as under any other launcher),
 * MASTER_ADDR=127.0.0.1, MASTER_PORT (the user's when set, else a free port picked once) and
 * TKD_JOB_ID (a fresh nonce: a rendezvous of this launch never takes another's files, see
 * common/dist.h) and, for i > 0, an extra -q so that one progress line is shown. The workers inherit stdout/stderr. Each runs in its own process
 * group (a Ctrl-C on the terminal reaches the launcher only, which forwards it once) and gets
 * SIGTERM if the launcher dies without forwarding (PR_SET_PDEATHSIG), so none is left orphaned.
 * A worker's final error line goes to the launcher (tkd_launch_send_error), which prints one line
 * for the whole launch.
 */
#ifndef TKD_LAUNCH_H
#define TKD_LAUNCH_H

#include <stdbool.h>

#include "common/status.h"

/* Removes "--nproc-per-node N" / "--nproc-per-node=N" from argv[1..*argc) in place (the other
 * arguments keep their order; argv[*argc] stays NULL). *nproc = N (1..1024), 0 when absent.
 * A missing or malformed N: TKD_ERR_INVALID_ARG. */
tkd_status tkd_launch_take_nproc(int *argc, char **argv, int *nproc);

/* Starts n workers as above with argv[1..argc) and waits for all of them; tool ("teacher-dump")
 * prefixes the log lines. A launcher that is itself one rank of several started by another launcher
 * (RANK/WORLD_SIZE of a world > 1 in its environment) is refused (TKD_ERR_CONFIG). Call after
 * tkd_signals_install: a SIGINT/SIGTERM the launcher receives is sent on to every running worker,
 * which stop cleanly; then TKD_ERR_INTERRUPTED. A worker that fails (non-zero exit or killed)
 * stops the others (SIGTERM, SIGKILL after grace_s) and gives an error naming it (index, pid,
 * exit code) followed by the worker's own error line when it sent one (tkd_launch_send_error):
 * one line for the launch however many workers failed the same way, the others counted, their
 * lines logged at debug level. *exit_code is its exit code (128 + signal when killed), else 0. */
tkd_status tkd_launch_workers(const char *tool, int n, int argc, char **argv, double grace_s, int *exit_code);

/* In a worker: hands msg (its final error, without the tool's prefix) to the launcher that started
 * it, which prints the launch's one error line. False when this process was not started by
 * tkd_launch_workers (or the launcher is gone): the caller prints msg itself. Each worker gets an
 * inherited socket for this, named by TKD_LAUNCH_ERROR_FD. */
bool tkd_launch_send_error(const char *msg);

#endif /* TKD_LAUNCH_H */
