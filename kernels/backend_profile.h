/* backend_profile.h — time every op of a backend, by op name, so the next gap in a training step is
 * measured rather than guessed (bench/student_bench --profile prints the table).
 *
 * tkd_backend_profile_wrap(inner) returns a backend whose op table forwards each call to inner's
 * and records, around every op that returns a tkd_status, two of inner's timing marks (backend.h's
 * mark: on CUDA events on the compute stream, on the CPU the monotonic clock) and the op's name.
 * Nothing is read back until tkd_backend_profile_report, which waits for the last mark and sums the
 * marks' intervals per op: no synchronisation per op, so the step runs as it would unwrapped (plus
 * two event records per call, a few microseconds each). An op's time is its span on the compute
 * stream: on CUDA the time from the stream reaching the op's first kernel to finishing its last (the
 * KL loss, which runs on the legacy default stream and returns after a host sync, is timed from its
 * start mark to the compute stream's next mark after it returned: its whole run). Ops that return
 * nothing or a size (close, free, host_free, adamw_free, kl_free, attn_saved_bytes) and the marks
 * themselves are forwarded untimed. Results are bit-identical to inner's: the wrapper adds no work
 * to the data (tests/test_backend_profile.c).
 *
 * The wrapper borrows inner (which must outlive it) and is closed with tkd_backend_close, which
 * frees the wrapper only. Objects an op makes (tkd_backend_kl, tkd_backend_adamw, memory) belong to
 * inner and may be used through either. Not thread-safe, as backends are not.
 */
#ifndef TKD_BACKEND_PROFILE_H
#define TKD_BACKEND_PROFILE_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rows a report can have: one per timed op of backend.h's table. */
#define TKD_PROFILE_OPS 37

/* One op's totals since the wrap or the last reset. */
typedef struct tkd_profile_row {
    const char *op; /* the op's field name in tkd_backend_ops, e.g. "attn_bwd" (static) */
    int64_t calls;
    double ms;      /* summed over its calls */
} tkd_profile_row;

/* *out = a profiling backend over inner (borrowed). TKD_ERR_UNSUPPORTED when inner has no timing
 * marks; TKD_ERR_NOMEM. */
tkd_status tkd_backend_profile_wrap(tkd_backend *inner, tkd_backend **out);

/* The ops called since the wrap or the last reset, most time first (ties: by name), in rows
 * (capacity TKD_PROFILE_OPS), their number in *n. Waits for the last recorded mark. prof must come
 * from tkd_backend_profile_wrap (else TKD_ERR_INVALID_ARG). */
tkd_status tkd_backend_profile_report(tkd_backend *prof, tkd_profile_row *rows, int *n);

/* Forgets the calls recorded so far (the marks are reused). */
void tkd_backend_profile_reset(tkd_backend *prof);

#ifdef __cplusplus
}
#endif

#endif /* TKD_BACKEND_PROFILE_H */
