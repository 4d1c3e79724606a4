/* fuzz_util.h — shared by the libFuzzer targets in tests/fuzz/ (header-only): the property every
 * target checks on a refusal, and the fuzz input as a file for readers that take a path. */
#ifndef TKD_FUZZ_UTIL_H
#define TKD_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/status.h"

/* A refused input must give one of the statuses listed (n of them) and a one-line message;
 * anything else is a bug, reported by aborting (libFuzzer saves the input). */
static inline void tkd_fuzz_expect_refusal(tkd_status st, const tkd_status *allowed, int n)
{
    int ok = 0;
    for (int i = 0; i < n; i++)
        ok |= st == allowed[i];
    const char *msg = tkd_error_msg();
    if (!ok || !msg[0] || strchr(msg, '\n')) {
        fprintf(stderr, "fuzz: unexpected refusal %s: '%s'\n", tkd_status_name(st), msg);
        abort();
    }
}

/* Writes data to "$TMPDIR/topkd-fuzz-<pid><suffix>" (the same path each call; removed at exit) and
 * returns that path. Aborts when it cannot. */
static char tkd_fuzz_path_[4096];
static inline void tkd_fuzz_remove_(void) { unlink(tkd_fuzz_path_); }
static inline const char *tkd_fuzz_write_file(const char *suffix, const uint8_t *data, size_t size)
{
    if (!tkd_fuzz_path_[0]) {
        const char *tmp = getenv("TMPDIR");
        snprintf(tkd_fuzz_path_, sizeof tkd_fuzz_path_, "%s/topkd-fuzz-%d%s", tmp && *tmp ? tmp : "/tmp",
                 (int)getpid(), suffix);
        atexit(tkd_fuzz_remove_);
    }
    FILE *f = fopen(tkd_fuzz_path_, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0)
        abort();
    return tkd_fuzz_path_;
}

#endif /* TKD_FUZZ_UTIL_H */
