/* test_gpu_topk.c — the CUDA top-k/LSE and tail draws equal the CPU paths on the same inputs:
 * exact ids, bit-identical logits, lse within 1e-5 relative, identical draws; each case through
 * the float4 and the scalar loads where V allows both, and rows built for each of the top-k's
 * three selection paths, which must each take it. Labelled gpu; skips (77) where no GPU answers or
 * the CUDA backend is not built. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "tests/gpu_testutil.h"
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cpu/tail_sample.h"
#include "kernels/cuda/tail_sample_cuda.h"
#include "kernels/cpu/topk.h"
#include "kernels/cuda/topk_cuda.h"
#include "kernels/cuda/topk_cuda_internal.h"

/* Row contents built for one selection path of the CUDA top-k (kernels/cuda/topk_cuda.h). */
typedef enum row_kind {
    ROW_RANDN,   /* normal(0, 1): pass 1 alone (path 0) */
    ROW_BAND,    /* 20000 logits in [8, 9) on 8192 levels (ties), the rest normal(0, 1): more than
                  * the 4096 candidate slots in the k-th 12-bit bin, few in its 24-bit sub-bin:
                  * path 1 */
    ROW_PLATEAU, /* 30 logits in [9, 10), 6000 copies of 8.5, the rest normal(0, 1): the k-th key
                  * is shared by more than 4096 logits: path 2 (ties at it by id) */
    ROW_ASCENDING, /* logit = id / 1000: every tile after the first beats the first's threshold, so
                    * the buffer overflows in the middle of a tile: path 1 */
    ROW_DESCENDING, /* logit = −id / 1000: the first tile holds the winners: path 0 */
    ROW_TIES3000,   /* 3000 copies of 8.5, the rest normal(0, 1): ties at the k-th key that still
                     * fit the buffer: path 0 with a 4096-entry sort */
} row_kind;

/* Fills one row of kind kd; positions of the special logits are pseudo-random from seed. */
static void fill_row(float *row, int64_t V, row_kind kd, uint64_t seed)
{
    tkd_test_randn(row, (size_t)V, seed, 1.0f);
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 7;
    for (int64_t i = 0; i < V; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        const uint64_t u = s >> 11;
        switch (kd) {
        case ROW_RANDN: break;
        case ROW_BAND:
            if (u % (uint64_t)V < 20000)
                row[i] = 8.0f + (float)((u >> 20) % 8192) / 8192.0f;
            break;
        case ROW_PLATEAU:
            if (u % (uint64_t)V < 6000)
                row[i] = 8.5f;
            else if (u % (uint64_t)V < 6030)
                row[i] = 9.0f + (float)((u >> 20) % 1024) / 1024.0f;
            break;
        case ROW_ASCENDING: row[i] = (float)i / 1000.0f; break;
        case ROW_DESCENDING: row[i] = -(float)i / 1000.0f; break;
        case ROW_TIES3000:
            if (u % (uint64_t)V < 3000)
                row[i] = 8.5f;
            break;
        }
    }
}

/* Reports the first (row, rank) where the GPU's ids or values differ from the CPU's. */
static void check_topk(const uint32_t *i_cpu, const float *v_cpu, const uint32_t *i_gpu,
                       const float *v_gpu, int64_t C, int64_t V, int k, const char *what)
{
    for (int64_t j = 0; j < C * k; j++) {
        uint32_t bc, bg;
        memcpy(&bc, &v_cpu[j], 4);
        memcpy(&bg, &v_gpu[j], 4);
        if (i_cpu[j] != i_gpu[j] || bc != bg)
            fail_msg("%s C=%lld V=%lld k=%d: row %lld rank %lld: gpu id %u value %.9g (bits %08x), "
                     "cpu id %u value %.9g (bits %08x)", what, (long long)C, (long long)V, k,
                     (long long)(j / k), (long long)(j % k), i_gpu[j], v_gpu[j], bg, i_cpu[j],
                     v_cpu[j], bc);
    }
}

/* Runs the CUDA top-k (and S tail draws) on the host logits x (C, V), placed `offset` floats past
 * a 256-byte-aligned device allocation (an odd offset forces the scalar loads), and compares with
 * the CPU. paths, when not NULL, is how many rows must take each selection path. */
static void run_logits(tkd_topk_cuda_ws *ws, const float *x, int64_t C, int64_t V, int k, float tau,
                       int S, int offset, const unsigned long long *paths, const char *what)
{
    const size_t nx = (size_t)(C * V), nk = (size_t)(C * k), ns = (size_t)(C * S);
    float *v_cpu = malloc(nk * 4), *v_gpu = malloc(nk * 4);
    float *l_cpu = malloc((size_t)C * 4), *l_gpu = malloc((size_t)C * 4);
    uint32_t *i_cpu = malloc(nk * 4), *i_gpu = malloc(nk * 4);
    uint32_t *t_cpu = malloc(ns * 4 + 4), *t_gpu = malloc(ns * 4 + 4);
    int64_t *seq = malloc((size_t)C * 8);
    int32_t *pos = malloc((size_t)C * 4);
    assert_true(v_cpu && v_gpu && l_cpu && l_gpu && i_cpu && i_gpu && t_cpu && t_gpu && seq && pos);
    for (int64_t r = 0; r < C; r++) {
        seq[r] = 123456789012ll + r / 5;
        pos[r] = (int32_t)(r % 5) * 1000;
    }
    float *dx0 = tkd_test_dev_alloc((nx + (size_t)offset) * 4), *dv = tkd_test_dev_alloc(nk * 4);
    float *dl = tkd_test_dev_alloc((size_t)C * 4), *dx = dx0 + offset;
    uint32_t *di = tkd_test_dev_alloc(nk * 4), *dt = tkd_test_dev_alloc(ns * 4);
    int64_t *dseq = tkd_test_dev_alloc((size_t)C * 8);
    int32_t *dpos = tkd_test_dev_alloc((size_t)C * 4);
    tkd_test_to_dev(dx, x, nx * 4);
    tkd_test_to_dev(dseq, seq, (size_t)C * 8);
    tkd_test_to_dev(dpos, pos, (size_t)C * 4);

    unsigned long long got[TKD_TOPK_CUDA_PATHS];
    assert_int_equal(tkd_topk_cuda_paths(ws, NULL, got), TKD_OK); /* zeroes the counters */
    assert_int_equal(tkd_topk_cpu(x, C, V, k, tau, i_cpu, v_cpu, l_cpu), TKD_OK);
    assert_int_equal(tkd_topk_cuda(ws, dx, C, V, k, tau, di, dv, dl, NULL), TKD_OK);
    if (S > 0 && V > k)
        assert_int_equal(tkd_tail_sample_cuda(ws, dx, C, V, di, k, tau, S, 77, dseq, dpos, dt, NULL),
                         TKD_OK);
    assert_int_equal(tkd_topk_cuda_sync(ws, NULL), TKD_OK);
    assert_int_equal(tkd_topk_cuda_paths(ws, NULL, got), TKD_OK);
    tkd_test_to_host(i_gpu, di, nk * 4, NULL);
    tkd_test_to_host(v_gpu, dv, nk * 4, NULL);
    tkd_test_to_host(l_gpu, dl, (size_t)C * 4, NULL);
    check_topk(i_cpu, v_cpu, i_gpu, v_gpu, C, V, k, what); /* the same ids, the same fp32 bits */
    for (int64_t r = 0; r < C; r++) {
        /* GPU: fp32 exps of 16 logits summed in fp32, then in double: ~1e-7 relative; 1e-5 leaves
         * margin, absolute near 0. */
        if (!tkd_test_close(l_gpu[r], l_cpu[r], 1e-5, 1e-5))
            fail_msg("%s: lse row %lld: gpu %.9g cpu %.9g (C=%lld V=%lld)", what, (long long)r,
                     l_gpu[r], l_cpu[r], (long long)C, (long long)V);
    }
    if (paths && memcmp(paths, got, sizeof got) != 0)
        fail_msg("%s C=%lld V=%lld k=%d: rows per path (one pass, refined, exact) %llu %llu %llu, "
                 "expected %llu %llu %llu", what, (long long)C, (long long)V, k, got[0], got[1],
                 got[2], paths[0], paths[1], paths[2]);
    if (S > 0 && V > k) {
        assert_int_equal(tkd_tail_sample_cpu(x, C, V, i_cpu, k, tau, S, 77, seq, pos, t_cpu), TKD_OK);
        tkd_test_to_host(t_gpu, dt, ns * 4, NULL);
        for (size_t j = 0; j < ns; j++)
            if (t_cpu[j] != t_gpu[j])
                fail_msg("%s C=%lld V=%lld: tail draw %zu of row %zu: gpu %u cpu %u", what,
                         (long long)C, (long long)V, j % (size_t)S, j / (size_t)S, t_gpu[j], t_cpu[j]);
    }
    cudaFree(dx0), cudaFree(dv), cudaFree(dl), cudaFree(di), cudaFree(dt), cudaFree(dseq), cudaFree(dpos);
    free(v_cpu), free(v_gpu), free(l_cpu), free(l_gpu), free(i_cpu), free(i_gpu);
    free(t_cpu), free(t_gpu), free(seq), free(pos);
}

static void run_case(tkd_topk_cuda_ws *ws, int64_t C, int64_t V, int k, float tau, tkd_test_fill f,
                     int S, uint64_t seed)
{
    float *x = malloc((size_t)(C * V) * 4);
    assert_non_null(x);
    tkd_test_fill_logits(x, (size_t)(C * V), f, seed);
    char what[64];
    snprintf(what, sizeof what, "fill %d seed %llu", (int)f, (unsigned long long)seed);
    run_logits(ws, x, C, V, k, tau, S, 0, NULL, what);
    if (V % 4 == 0) /* the same rows through the scalar loads */
        run_logits(ws, x, C, V, k, tau, S, 1, NULL, what);
    free(x);
}

/* C rows of kinds kinds[r % nk]; each kind must take its path (kind_path). */
static void run_rows(tkd_topk_cuda_ws *ws, int64_t C, int64_t V, int k, const row_kind *kinds,
                     int nk, int S, uint64_t seed)
{
    static const int kind_path[] = {
        [ROW_RANDN] = TKD_TOPK_CUDA_PATH_ONE_PASS,  [ROW_BAND] = TKD_TOPK_CUDA_PATH_REFINED,
        [ROW_PLATEAU] = TKD_TOPK_CUDA_PATH_EXACT,   [ROW_ASCENDING] = TKD_TOPK_CUDA_PATH_REFINED,
        [ROW_DESCENDING] = TKD_TOPK_CUDA_PATH_ONE_PASS, [ROW_TIES3000] = TKD_TOPK_CUDA_PATH_ONE_PASS,
    };
    float *x = malloc((size_t)(C * V) * 4);
    assert_non_null(x);
    unsigned long long paths[TKD_TOPK_CUDA_PATHS] = {0};
    for (int64_t r = 0; r < C; r++) {
        fill_row(x + r * V, V, kinds[r % nk], seed + (uint64_t)r);
        paths[kind_path[kinds[r % nk]]]++;
    }
    char what[64];
    snprintf(what, sizeof what, "row kinds from %d, seed %llu", (int)kinds[0], (unsigned long long)seed);
    run_logits(ws, x, C, V, k, 1.0f, S, 0, paths, what);
    if (V % 4 == 0)
        run_logits(ws, x, C, V, k, 1.0f, S, 1, paths, what); /* the scalar loads */
    free(x);
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
    /* float4 loads (V % 4 == 0), each also through the scalar loads: */
    run_case(ws, 3, 5000, 100, 1.0f, TKD_TEST_FILL_RANDN, 64, 11);    /* a partial second tile */
    run_case(ws, 3, 8192, 100, 0.5f, TKD_TEST_FILL_TIES, 64, 12);     /* two whole tiles, ties */
    run_case(ws, 3, 516, 64, 1.0f, TKD_TEST_FILL_EXTREME, 32, 13);
    run_case(ws, 2, 10000, 128, 1.0f, TKD_TEST_FILL_CONST, 50, 14);   /* all equal, > 4096: path 2 */
    run_case(ws, 2, 304, 50, 1.0f, TKD_TEST_FILL_ZEROS_SIGNED, 20, 15);
    run_case(ws, 2, 70000, 100, 1.0f, TKD_TEST_FILL_EXTREME, 40, 16); /* 10000 copies of 1e4 */
    run_case(ws, 4, 128256, 100, 1.0f, TKD_TEST_FILL_TIES, 80, 17);   /* Llama-3 vocab, ties */
    run_case(ws, 2, 128, 1, 1.0f, TKD_TEST_FILL_RANDN, 4, 18);        /* one float4 group per thread */
    /* tail draws over 256-logit segments: a last segment of one logit; whole segments, 7 draws */
    run_case(ws, 3, 257, 5, 1.0f, TKD_TEST_FILL_RANDN, 1024, 19);
    run_case(ws, 3, 1024, 100, 0.8f, TKD_TEST_FILL_RANDN, 7, 20);
}

static void test_paths(void **state)
{
    tkd_topk_cuda_ws *ws = *state;
    const row_kind all[] = {ROW_RANDN, ROW_BAND, ROW_PLATEAU, ROW_ASCENDING, ROW_DESCENDING,
                            ROW_TIES3000};
    run_rows(ws, 12, 65536, 100, all, 6, 40, 100);  /* float4 loads, whole tiles */
    run_rows(ws, 6, 65537, 100, all, 6, 40, 200);   /* scalar loads, a 1-logit last tile */
    run_rows(ws, 6, 151936, 128, all, 6, 80, 300);  /* k at its maximum */
    /* k = 1: the plateau row's winner lies above its plateau, in a bin of 30: path 0, left out */
    const row_kind k1[] = {ROW_RANDN, ROW_BAND, ROW_ASCENDING, ROW_DESCENDING, ROW_TIES3000};
    run_rows(ws, 5, 100000, 1, k1, 5, 8, 400);
    const row_kind band[] = {ROW_BAND}, plateau[] = {ROW_PLATEAU};
    run_rows(ws, 3, 40004, 17, band, 1, 16, 500);
    run_rows(ws, 3, 40003, 99, plateau, 1, 16, 600);
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
    float *dx = tkd_test_dev_alloc(sizeof x), *dv = tkd_test_dev_alloc(C * K * 4),
          *dl = tkd_test_dev_alloc(C * 4);
    uint32_t *di = tkd_test_dev_alloc(C * K * 4), *dt = tkd_test_dev_alloc(C * 4 * 4);
    int64_t seq[C] = {0, 1, 2, 3};
    int32_t pos[C] = {0, 0, 0, 0};
    int64_t *dseq = tkd_test_dev_alloc(sizeof seq);
    int32_t *dpos = tkd_test_dev_alloc(sizeof pos);
    tkd_test_to_dev(dx, x, sizeof x);
    tkd_test_to_dev(dseq, seq, sizeof seq);
    tkd_test_to_dev(dpos, pos, sizeof pos);
    assert_int_equal(tkd_topk_cuda(ws, dx, C, V, K, 1.0f, di, dv, dl, NULL), TKD_OK);
    assert_int_equal(tkd_topk_cuda_sync(ws, NULL), TKD_ERR_NUMERIC);
    assert_non_null(strstr(tkd_error_msg(), "row 2 "));
    assert_int_equal(tkd_topk_cuda_sync(ws, NULL), TKD_OK); /* the flag was cleared */
    /* Tail draws: a top-k id ≥ V in row 1 is flagged. */
    x[2 * V + 100] = 0.0f;
    x[3 * V + 1] = 0.0f;
    tkd_test_to_dev(dx, x, sizeof x);
    for (int i = 0; i < C * K; i++)
        idx[i] = (uint32_t)(i % K);
    idx[1 * K + 3] = V;
    tkd_test_to_dev(di, idx, sizeof idx);
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

static const struct CMUnitTest kTests[] = {
    cmocka_unit_test(test_matches_cpu),
    cmocka_unit_test(test_paths),
    cmocka_unit_test(test_flags),
};
#endif /* TKD_HAVE_CUDA */

TKD_TEST_GPU_MAIN(kTests, setup, teardown)
