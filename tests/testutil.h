/* testutil.h — small helpers shared by the cmocka tests. */
#ifndef TKD_TESTUTIL_H
#define TKD_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

/* Makes a fresh empty directory under $TMPDIR (or /tmp) named topkd-<tag>-XXXXXX; returns a
 * malloc'd path the caller frees (after tkd_test_rmtree). Aborts the test on failure. */
char *tkd_test_mkdtemp(const char *tag);

/* Removes a directory tree (rm -rf). Returns 0 on success. */
int tkd_test_rmtree(const char *path);

/* Path of a file under the source tree's tests/ folder (static buffer, overwritten per call). */
const char *tkd_test_src(const char *rel);

/* Exits the process with 77 (ctest "skipped") when no CUDA device answers; GPU tests call it first. */
void tkd_test_require_gpu(void);

/* Relative-or-absolute closeness: |a - b| <= atol + rtol·|b|. */
int tkd_test_close(double a, double b, double atol, double rtol);

/* Fills x[0..n) with a deterministic pseudo-random normal(0, std) sequence from seed. */
void tkd_test_randn(float *x, size_t n, uint64_t seed, float std);

#endif /* TKD_TESTUTIL_H */
