/* signals.c — see signals.h. */
#include "common/signals.h"

#include <errno.h>
#include <signal.h>
#include <string.h>

static volatile sig_atomic_t g_signal;

static void restore_default(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

/* Only async-signal-safe work here: store the number, restore the defaults (sigaction is
 * async-signal-safe), so the next Ctrl-C terminates. */
static void on_signal(int sig)
{
    g_signal = sig;
    restore_default();
}

tkd_status tkd_signals_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    /* No SA_RESTART: an open or read blocked on something slow (a pipe, a hung network mount)
     * returns EINTR, which the input helpers (common/fileio.h) report as TKD_ERR_INTERRUPTED, so the
     * first signal ends it instead of being swallowed. Reads of regular files on local disks,
     * pthread waits and the tools' other work are not interrupted by a caught signal. */
    sa.sa_flags = 0;
    g_signal = 0;
    if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0)
        return tkd_error_set(TKD_ERR_INTERNAL, "cannot install signal handlers: %s", strerror(errno));
    return TKD_OK;
}

int tkd_interrupted(void) { return (int)g_signal; }

void tkd_signals_uninstall(void)
{
    restore_default();
    g_signal = 0;
}
