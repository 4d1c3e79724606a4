/* signals.h — Ctrl-C / SIGTERM as a request to stop cleanly.
 *
 * The first SIGINT or SIGTERM only sets a flag: the tools poll tkd_interrupted() between steps,
 * finish or discard the current unit of work (a shard, a checkpoint), and exit with
 * TKD_ERR_INTERRUPTED, so nothing half-written is left behind. The handler also restores the
 * default action, so a second Ctrl-C kills the process at once for a user who will not wait.
 * The handlers are installed without SA_RESTART: an open or read blocked on a slow file returns
 * EINTR on the first signal (reported by common/fileio.h's input helpers as TKD_ERR_INTERRUPTED).
 */
#ifndef TKD_SIGNALS_H
#define TKD_SIGNALS_H

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Installs the SIGINT and SIGTERM handlers and clears the flag. Call once from main. */
tkd_status tkd_signals_install(void);

/* The signal number received (SIGINT, SIGTERM) or 0. Cheap; safe to call from any thread. */
int tkd_interrupted(void);

/* Clears the flag and puts the default actions back (tests, and tools that stop listening). */
void tkd_signals_uninstall(void);

#ifdef __cplusplus
}
#endif

#endif /* TKD_SIGNALS_H */
