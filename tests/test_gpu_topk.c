/* test_gpu_topk.c — the CUDA top-k/LSE and tail draws equal the CPU paths on the same inputs:
 * exact ids, bit-identical logits, lse within 1e-5 relative, identical draws. Labelled gpu; skips
 * (77) where no GPU answers or the CUDA backend is not built. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/tail_sample.h"
#include "kernels/tail_sample_cuda.h"
#include "kernels/topk.h"
#include "kernels/topk_cuda.h"

static void *dev_alloc(size_t n)
{
    void *p = NULL;
    assert_int_equal(cudaMalloc(&p, n ? n : 1), cudaSuccess);
    return p;
}

static void to_dev(void *d, const void *h, size_t n)
{
    assert_int_equal(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), cudaSuccess);
}

static void to_host(void *h, const void *d, size_t n)
{
    assert_int_equal(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost), cudaSuccess);
}

static void run_case(tkd_topk_cuda_ws *ws, int64_t C, int64_t V, int k, float tau, tkd_test_fill f,
                     int S, uint64_t seed)
{
    const size_t nx = (size_t)(C * V), nk = (size_t)(C * k), ns = (size_t)(C * S);
    float *x = malloc(nx * 4), *v_cpu = malloc(nk * 4), *v_gpu = malloc(nk * 4);
    float *l_cpu = malloc((size_t)C * 4), *l_gpu = malloc((size_t)C * 4);
    uint32_t *i_cpu = malloc(nk * 4), *i_gpu = malloc(nk * 4);
    uint32_t *t_cpu = malloc(ns * 4 + 4), *t_gpu = malloc(ns * 4 + 4);
    int64_t *seq = malloc((size_t)C * 8);
    int32_t *pos = malloc((size_t)C * 4);
    assert_true(x && v_cpu && v_gpu && l_cpu && l_gpu && i_cpu && i_gpu && t_cpu && t_gpu && seq && pos);
    tkd_test_fill_logits(x, nx, f, seed);
    for (int64_t r = 0; r < C; r++) {
        seq[r] = 123456789012ll + r / 5;
        pos[r] = (int32_t)(r % 5) * 1000;
    }
    float *dx = dev_alloc(nx * 4), *dv = dev_alloc(nk * 4), *dl = dev_alloc((size_t)C * 4);
    uint32_t *di = dev_alloc(nk * 4), *dt = dev_alloc(ns * 4);
    int64_t *dseq = dev_alloc((size_t)C * 8);
    int32_t *dpos = dev_alloc((size_t)C * 4);
    to_dev(dx, x, nx * 4);
    to_dev(dseq, seq, (size_t)C * 8);
    to_dev(dpos, pos, (size_t)C * 4);

    assert_int_equal(tkd_topk_cpu(x, C, V, k, tau, i_cpu, v_cpu, l_cpu), TKD_OK);
    assert_int_equal(tkd_topk_cuda(ws, dx, C, V, k, tau, di, dv, dl, NULL), TKD_OK);
    if (S > 0 && V > k)
        assert_int_equal(tkd_tail_sample_cuda(ws, dx, C, V, di, k, tau, S, 77, dseq, dpos, dt, NULL),
                         TKD_OK);
    assert_int_equal(tkd_topk_cuda_sync(ws, NULL), TKD_OK);
    to_host(i_gpu, di, nk * 4);
    to_host(v_gpu, dv, nk * 4);
    to_host(l_gpu, dl, (size_t)C * 4);
    assert_memory_equal(i_cpu, i_gpu, nk * 4);
    assert_memory_equal(v_cpu, v_gpu, nk * 4); /* the same fp32 bits */
    for (int64_t r = 0; r < C; r++) {
        /* GPU: float exps summed in double, ~1e-7 relative; 1e-5 leaves margin, absolute near 0. */
        if (!tkd_test_close(l_gpu[r], l_cpu[r], 1e-5, 1e-5))
            fail_msg("lse row %lld: gpu %.9g cpu %.9g (C=%lld V=%lld)", (long long)r, l_gpu[r],
                     l_cpu[r], (long long)C, (long long)V);
    }
    if (S > 0 && V > k) {
        assert_int_equal(tkd_tail_sample_cpu(x, C, V, i_cpu, k, tau, S, 77, seq, pos, t_cpu), TKD_OK);
        to_host(t_gpu, dt, ns * 4);
        assert_memory_equal(t_cpu, t_gpu, ns * 4);
    }
    cudaFree(dx), cudaFree(dv), cudaFree(dl), cudaFree(di), cudaFree(dt), cudaFree(dseq), cudaFree(dpos);
    free(x), free(v_cpu), free(v_gpu), free(l_cpu), free(l_gpu), free(i_cpu), free(i_gpu);
    free(t_cpu), free(t_gpu), free(seq), free(pos);
}

static void test_matches_cpu(void **state)
{
    tkd_topk_cuda_ws *ws = *state;
    run_case(ws, 3, 1001, 5, 1.0f, TKD_TEST_FILL_RANDN, 64, 1);       /* V not a multiple of 8 */
    run_case(ws, 1, 37, 1, 1.0f, TKD_TEST_FILL_RANDN, 16, 2);         /* one row, k = 1 */
    run_case(ws, 4, 4099, 128, 0.7f, TKD_TEST_FILL_RANDN, 100, 3);    /* k = 128, τ < 1 */
    run_case(ws, 5, 2003, 100, 2.0f, TKD_TEST_FILL_TIES, 1024, 4);    /* many ties, S at its maximum */
    run_case(ws, 3, 515, 64, 1.0f, TKD_TEST_FILL_EXTREME, 32, 5);     /* ±1e4 */
    run_case(ws, 2, 300, 128, 1.3f, TKD_TEST_FILL_CONST, 50, 6);      /* all equal */
    run_case(ws, 2, 301, 50, 1.0f, TKD_TEST_FILL_ZEROS_SIGNED, 20, 7); /* -0.0 ties +0.0 */
    run_case(ws, 2, 128, 128, 1.0f, TKD_TEST_FILL_RANDN, 0, 8);       /* V == k (no tail) */
    run_case(ws, 2, 1 << 20, 100, 1.0f, TKD_TEST_FILL_RANDN, 1024, 9); /* V = 2^20: > 48 KB shared */
    run_case(ws, 64, 151936, 100, 1.0f, TKD_TEST_FILL_RANDN, 80, 10); /* a real chunk (Qwen2 vocab) */
}

static void test_flags(void **state)
{
    tkd_topk_cuda_ws *ws = *state;
    enum { C = 4, V = 333, K = 8 };
    float x[C * V];
    uint32_t idx[C * K];
    tkd_test_randn(x, C * V, 3, 1.0f);
    x[2 * V + 100] = NAN;
    x[3 * V + 1] = INFINITY;
    float *dx = dev_alloc(sizeof x), *dv = dev_alloc(C * K * 4), *dl = dev_alloc(C * 4);
    uint32_t *di = dev_alloc(C * K * 4), *dt = dev_alloc(C * 4 * 4);
    int64_t seq[C] = {0, 1, 2, 3};
    int32_t pos[C] = {0, 0, 0, 0};
    int64_t *dseq = dev_alloc(sizeof seq);
    int32_t *dpos = dev_alloc(sizeof pos);
    to_dev(dx, x, sizeof x);
    to_dev(dseq, seq, sizeof seq);
    to_dev(dpos, pos, sizeof pos);
    assert_int_equal(tkd_topk_cuda(ws, dx, C, V, K, 1.0f, di, dv, dl, NULL), TKD_OK);
    assert_int_equal(tkd_topk_cuda_sync(ws, NULL), TKD_ERR_NUMERIC);
    assert_non_null(strstr(tkd_error_msg(), "row 2 "));
    assert_int_equal(tkd_topk_cuda_sync(ws, NULL), TKD_OK); /* the flag was cleared */
    /* Tail draws: a top-k id ≥ V in row 1 is flagged. */
    x[2 * V + 100] = 0.0f;
    x[3 * V + 1] = 0.0f;
    to_dev(dx, x, sizeof x);
    for (int i = 0; i < C * K; i++)
        idx[i] = (uint32_t)(i % K);
    idx[1 * K + 3] = V;
    to_dev(di, idx, sizeof idx);
    assert_int_equal(tkd_tail_sample_cuda(ws, dx, C, V, di, K, 1.0f, 4, 1, dseq, dpos, dt, NULL), TKD_OK);
    assert_int_equal(tkd_topk_cuda_sync(ws, NULL), TKD_ERR_INVALID_ARG);
    assert_non_null(strstr(tkd_error_msg(), "row 1 "));
    /* Argument errors come back at once. */
    assert_int_equal(tkd_topk_cuda(ws, dx, C, V, 129, 1.0f, di, dv, dl, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_tail_sample_cuda(ws, dx, C, K, di, K, 1.0f, 4, 1, dseq, dpos, dt, NULL),
                     TKD_ERR_INVALID_ARG);
    cudaFree(dx), cudaFree(dv), cudaFree(dl), cudaFree(di), cudaFree(dt), cudaFree(dseq), cudaFree(dpos);
}

static int setup(void **state)
{
    tkd_topk_cuda_ws *ws = NULL;
    if (tkd_topk_cuda_ws_create(&ws) != TKD_OK)
        return -1;
    *state = ws;
    return 0;
}

static int teardown(void **state)
{
    tkd_topk_cuda_ws_free(*state);
    return 0;
}
#endif /* TKD_HAVE_CUDA */

int main(void)
{
    tkd_test_require_gpu();
#ifdef TKD_HAVE_CUDA
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_cpu),
        cmocka_unit_test(test_flags),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
#else
    return 77;
#endif
}
