/* gpu_check.h — the GPU tests' one checker (tests/test_gpu_*.c): an output array against a float64
 * reference, each element held to |got − ref| ≤ abs + rel·|ref| (+ a per-element extra), the
 * tolerance carrying the sentence that says why. It counts the elements it checked and the ones off,
 * keeps the worst (its index decoded by a caller's formatter: "b=0 t=5 h=1 d=3"), and fails on a NaN
 * or infinite output (an unwritten element of a buffer poisoned with tkd_test_poison) as on any other
 * element out of tolerance. Built into the test_gpu_* executables only. */
#ifndef TKD_GPU_CHECK_H
#define TKD_GPU_CHECK_H

#include <stddef.h>
#include <stdint.h>

/* |got − ref| ≤ abs + rel·|ref|; why: the reason for these numbers, printed on failure. */
typedef struct tkd_test_tol {
    double abs, rel;
    const char *why;
} tkd_test_tol;

/* Writes where element i of the checked array is into buf (cap bytes), e.g. "[row 3, col 17]". */
typedef void (*tkd_test_where_fn)(char *buf, size_t cap, int64_t i, const void *ctx);

/* One check in progress: tkd_test_check_begin, tkd_test_check_add per element, tkd_test_check_end. */
typedef struct tkd_test_check {
    const char *what;      /* names the output in messages: "rope N 17 T 5: q" */
    tkd_test_tol tol;
    tkd_test_where_fn where;
    const void *ctx;       /* the formatter's */
    int64_t n, bad;        /* elements checked, elements out of tolerance (NaN included) */
    double worst;          /* max |Δ| / allowed (NaN once a NaN output or reference was seen) */
    int64_t worst_i;
    double worst_got, worst_ref, worst_allowed;
    double num, den;       /* Σ Δ², Σ ref²: for tkd_test_check_norm */
} tkd_test_check;

void tkd_test_check_begin(tkd_test_check *k, const char *what, tkd_test_tol tol, tkd_test_where_fn where,
                          const void *ctx);

/* Element i: got against ref, allowed abs + rel·|ref| + extra. Returns |Δ| / allowed (NaN for NaN). */
double tkd_test_check_add(tkd_test_check *k, int64_t i, double got, double ref, double extra);

/* ‖got − ref‖₂ / ‖ref‖₂ over the elements added (‖ref‖ taken as 1 when it is 0). */
double tkd_test_check_norm(const tkd_test_check *k);

/* "what: 3 of 4096 elements off (tolerance 0.01 + 0.01·|ref|: why); worst b=0 t=5: got .. ref .." */
void tkd_test_check_describe(const tkd_test_check *k, char *buf, size_t cap);

/* Fails the test with tkd_test_check_describe's line when an element was off or none was checked. */
void tkd_test_check_end(const tkd_test_check *k);

/* Whole arrays: got[i] (bf16 bits, fp32 or float64) against ref[i] for i < n, extra (may be NULL)
 * added to each element's allowance; fails with the worst element. */
void tkd_test_check_bf16(const char *what, const uint16_t *got, const double *ref, size_t n, tkd_test_tol tol,
                         const double *extra, tkd_test_where_fn where, const void *ctx);
void tkd_test_check_f32(const char *what, const float *got, const double *ref, size_t n, tkd_test_tol tol,
                        const double *extra, tkd_test_where_fn where, const void *ctx);
void tkd_test_check_f64(const char *what, const double *got, const double *ref, size_t n, tkd_test_tol tol,
                        const double *extra, tkd_test_where_fn where, const void *ctx);

/* The same for a (n / cols, cols) matrix: the worst element named "[row r, col c]". */
void tkd_test_check_bf16_mat(const char *what, const uint16_t *got, const double *ref, size_t n, size_t cols,
                             tkd_test_tol tol, const double *extra);
void tkd_test_check_f32_mat(const char *what, const float *got, const double *ref, size_t n, size_t cols,
                            tkd_test_tol tol, const double *extra);

/* Formatters: ctx points to a size_t column count ("[row r, col c]"), or is unused ("[i]", and
 * "step i + 1" for a training curve's losses). */
void tkd_test_where_rowcol(char *buf, size_t cap, int64_t i, const void *cols);
void tkd_test_where_index(char *buf, size_t cap, int64_t i, const void *unused);
void tkd_test_where_step(char *buf, size_t cap, int64_t i, const void *unused);

#endif
