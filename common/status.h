/* status.h — status codes and the per-thread error message.
 *
 * Library code returns a tkd_status (0 = ok, negative = error; values are stable and may be
 * relied upon by callers and scripts). On error it records a one-line message with
 * tkd_error_set(); only the CLIs (teacher_cache/, student_train/) print it and pick an exit code.
 * The message is thread-local, so a loader thread's error never clobbers the main thread's.
 */
#ifndef TKD_STATUS_H
#define TKD_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tkd_status {
    TKD_OK = 0,
    TKD_ERR_INVALID_ARG = -1,  /* caller passed something meaningless */
    TKD_ERR_NOMEM = -2,        /* host allocation failed */
    TKD_ERR_IO = -3,           /* open/read/write/rename failed (errno text in the message) */
    TKD_ERR_FORMAT = -4,       /* a file is malformed: bad header, truncated, wrong shape */
    TKD_ERR_CONFIG = -5,       /* config: unknown key, wrong type, out of range */
    TKD_ERR_MISMATCH = -6,     /* two inputs disagree: vocab, k, teacher identity */
    TKD_ERR_CHECKSUM = -7,     /* checksum / fletcher32 failure: data is corrupt */
    TKD_ERR_UNSUPPORTED = -8,  /* valid input we do not handle (e.g. MoE, sliding window) */
    TKD_ERR_DEVICE = -9,       /* CUDA / cuBLAS failure */
    TKD_ERR_DEVICE_OOM = -10,  /* device out of memory */
    TKD_ERR_NUMERIC = -11,     /* NaN / Inf where a finite value is required */
    TKD_ERR_INTERRUPTED = -12, /* SIGINT / SIGTERM observed */
    TKD_ERR_NOSPACE = -13,     /* disk full (ENOSPC) */
    TKD_ERR_NOT_FOUND = -14,   /* a file, dataset or tensor does not exist */
    TKD_ERR_INTERNAL = -15,    /* a bug: an invariant did not hold */
    TKD_ERR_BUSY = -16,        /* another process is writing the same directory (its lock is held) */
} tkd_status;

/* Short stable name of a status, e.g. "TKD_ERR_FORMAT". Never NULL. */
const char *tkd_status_name(tkd_status st);

/* Records a printf-style message for the calling thread and returns st, so that library code can
 * write `return tkd_error_set(TKD_ERR_FORMAT, "%s: bad magic", path);`. A message is one line:
 * control characters in it (a newline inside a quoted key) become '?' (here, in _prefix and _hint). */
tkd_status tkd_error_set(tkd_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prefixes the current message with "prefix: " (adds context on the way up). Returns st. */
tkd_status tkd_error_prefix(tkd_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The calling thread's last message ("" when none). Valid until the next tkd_error_* call. */
const char *tkd_error_msg(void);

/* Clears the calling thread's message. */
void tkd_error_clear(void);

/* Copies another thread's message in (a worker hands its error to the main thread). */
void tkd_error_copy(tkd_status st, const char *msg);

/* Appends " — <hint>" to the calling thread's message (what to do next) and returns st. Use it
 * instead of saving the message and re-setting it around the hint. */
tkd_status tkd_error_hint(tkd_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A message kept across cleanup code that may set messages of its own (closing files, removing a
 * temp dir): tkd_error_save() before the cleanup, tkd_error_restore() after it. */
typedef struct tkd_error_saved {
    tkd_status st;
    char msg[1024]; /* TKD_ERROR_MSG_MAX, defined below */
} tkd_error_saved;
void tkd_error_save(tkd_error_saved *s, tkd_status st);
tkd_status tkd_error_restore(const tkd_error_saved *s); /* puts the message back, returns s->st */

/* Evaluates expr; on a non-zero status returns it from the enclosing function. */
#define TKD_TRY(expr)                        \
    do {                                     \
        tkd_status tkd_try_st_ = (expr);     \
        if (tkd_try_st_ != TKD_OK)           \
            return tkd_try_st_;              \
    } while (0)

#define TKD_ERROR_MSG_MAX 1024

#ifdef __cplusplus
}
#endif

#endif /* TKD_STATUS_H */
