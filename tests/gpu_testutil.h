/* gpu_testutil.h — host helpers shared by the CUDA tests (tests/test_gpu_*.c): device buffers and
 * copies that fail the test on any CUDA error, NaN poisoning, random bf16 inputs and the status
 * check. Built into the test_gpu_* executables only; everything here exists only where the build
 * has the CUDA backend (TKD_HAVE_CUDA). */
#ifndef TKD_GPU_TESTUTIL_H
#define TKD_GPU_TESTUTIL_H

/* A GPU test's main: exits 77 (skipped) where no GPU answers or the build has no CUDA backend, else
 * runs `tests` (a CMUnitTest array, defined only where TKD_HAVE_CUDA is) between setup and teardown.
 * The file includes cmocka.h first. */
#ifdef TKD_HAVE_CUDA
#define TKD_TEST_GPU_MAIN(tests, setup, teardown)                                                            \
    int main(void)                                                                                           \
    {                                                                                                        \
        tkd_test_require_gpu();                                                                              \
        return cmocka_run_group_tests(tests, setup, teardown);                                               \
    }
#else
#define TKD_TEST_GPU_MAIN(tests, setup, teardown)                                                            \
    int main(void)                                                                                           \
    {                                                                                                        \
        tkd_test_require_gpu();                                                                              \
        return 77;                                                                                           \
    }
#endif

#ifdef TKD_HAVE_CUDA
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* cudaMalloc of n bytes (1 when n is 0); the caller cudaFrees it. Fails the test on error. */
void *tkd_test_dev_alloc(size_t n);

/* n bytes host → device (synchronous cudaMemcpy). */
void tkd_test_to_dev(void *d, const void *h, size_t n);

/* n bytes device → host; first synchronizes `stream` (a cudaStream_t) when it is not NULL, for
 * results of launches on a non-blocking stream. */
void tkd_test_to_host(void *h, const void *d, size_t n, void *stream);

/* Sets n bytes of device memory to all ones (bf16 and fp32 NaN), so an element a kernel skips
 * fails its check. */
void tkd_test_poison(void *d, size_t n);

/* malloc of n bytes (1 when n is 0); fails the test when it returns NULL. */
void *tkd_test_xmalloc(size_t n);

/* Exits 77 (skipped), printing "skipped: message", unless st is TKD_OK: for a test whose hardware or
 * library (sm90, cuDNN) is missing. */
void tkd_test_skip_unless_ok(tkd_status st);

/* Fails the test with "what: STATUS_NAME: message" unless st is TKD_OK. */
void tkd_test_ok(tkd_status st, const char *what);

/* n bf16 values of normal(0, std) from seed (tkd_test_randn, rounded); the caller frees. */
uint16_t *tkd_test_rand_bf16(size_t n, uint64_t seed, float std);

/* x[0..n) = normal(0, std) from seed rounded to bf16, xb the bf16 bits: x holds exactly what xb does. */
void tkd_test_fill_bf16(float *x, uint16_t *xb, int64_t n, uint64_t seed, float std);

/* An attention case's random inputs (tests/test_gpu_attn*_bwd.c): q, k ~ normal(0, std²), v, dy ~
 * normal(0, 1), all bf16-rounded (the floats hold exactly the bits), from seed. */
typedef struct tkd_test_attn_in {
    int64_t nq, nkv, nl;   /* elements of q / dy / dq, of k / v / dk / dv, of lse (B·H·T) */
    float *q, *k, *v, *dy; // (B·T, H·dh), (B·T, Hkv·dh) ×2, (B·T, H·dh)
    uint16_t *qb, *kb, *vb, *dyb;
} tkd_test_attn_in;

void tkd_test_attn_in_make(tkd_test_attn_in *in, int B, int T, int H, int Hkv, int dh, float std, uint64_t seed);
void tkd_test_attn_in_free(tkd_test_attn_in *in);

/* One RoPE case of tkd_cuda_rope_fwd (backward 0) or tkd_cuda_rope_bwd (1) on `stream`: q (N, H·dh)
 * and k (N, Hkv·dh) of normal(0, 1.5²) bf16 from seed_q, seed_k at `off` elements past 16-byte
 * alignment, tables of theta for T positions, both outputs against ref64's rotation: each bf16
 * output within 2^-8·|ref| (its rounding) + 2^-21·(|x| + |y|) of its pair (fp32 x·c ∓ y·s). */
typedef struct tkd_test_rope {
    int N, T, H, Hkv, dh, off, backward;
    double theta;
    uint64_t seed_q, seed_k;
} tkd_test_rope;

void tkd_test_rope_case(const tkd_test_rope *r, void *stream);

/* Every RoPE shape of the GPU tests in one direction (seeds base + dh and base + 100 + dh): one row,
 * sequences of 5 (t = n % T), long sequences, GQA 1, 2 and 7, dh 2 to 128 (half = 10: the scalar
 * path), one element off 16-byte alignment; then an odd dh and Hkv = 0 refused (TKD_ERR_INVALID_ARG). */
void tkd_test_rope_cases(int backward, uint64_t seed_base, void *stream);

/* The n bf16 values of b as doubles; the caller frees. */
double *tkd_test_bf16_to_f64(const uint16_t *b, size_t n);

#endif /* TKD_HAVE_CUDA */
#endif
