/* gpu_testutil.c — see gpu_testutil.h. */
#include "tests/gpu_testutil.h"

#ifdef TKD_HAVE_CUDA
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#include "common/half.h"
#include "tests/testutil.h"

void *tkd_test_dev_alloc(size_t n)
{
    void *p = NULL;
    assert_int_equal(cudaMalloc(&p, n ? n : 1), cudaSuccess);
    return p;
}

void tkd_test_to_dev(void *d, const void *h, size_t n)
{
    assert_int_equal(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), cudaSuccess);
}

void tkd_test_to_host(void *h, const void *d, size_t n, void *stream)
{
    if (stream)
        assert_int_equal(cudaStreamSynchronize((cudaStream_t)stream), cudaSuccess);
    assert_int_equal(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost), cudaSuccess);
}

void tkd_test_poison(void *d, size_t n) { assert_int_equal(cudaMemset(d, 0xff, n), cudaSuccess); }

void *tkd_test_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

void tkd_test_skip_unless_ok(tkd_status st)
{
    if (st == TKD_OK)
        return;
    printf("skipped: %s\n", tkd_error_msg());
    exit(77);
}

void tkd_test_ok(tkd_status st, const char *what)
{
    if (st != TKD_OK)
        fail_msg("%s: %s: %s", what, tkd_status_name(st), tkd_error_msg());
}

uint16_t *tkd_test_rand_bf16(size_t n, uint64_t seed, float std)
{
    float *f = tkd_test_xmalloc(n * 4);
    uint16_t *b = tkd_test_xmalloc(n * 2);
    tkd_test_randn(f, n, seed, std);
    for (size_t i = 0; i < n; i++)
        b[i] = tkd_f32_to_bf16(f[i]);
    free(f);
    return b;
}

void tkd_test_fill_bf16(float *x, uint16_t *xb, int64_t n, uint64_t seed, float std)
{
    tkd_test_randn(x, (size_t)n, seed, std);
    for (int64_t i = 0; i < n; i++) {
        xb[i] = tkd_f32_to_bf16(x[i]);
        x[i] = tkd_bf16_to_f32(xb[i]);
    }
}

void tkd_test_attn_in_make(tkd_test_attn_in *in, int B, int T, int H, int Hkv, int dh, float std, uint64_t seed)
{
    in->nq = (int64_t)B * T * H * dh;
    in->nkv = (int64_t)B * T * Hkv * dh;
    in->nl = (int64_t)B * H * T;
    in->q = tkd_test_xmalloc(sizeof(float) * in->nq), in->dy = tkd_test_xmalloc(sizeof(float) * in->nq);
    in->k = tkd_test_xmalloc(sizeof(float) * in->nkv), in->v = tkd_test_xmalloc(sizeof(float) * in->nkv);
    in->qb = tkd_test_xmalloc(2 * in->nq), in->dyb = tkd_test_xmalloc(2 * in->nq);
    in->kb = tkd_test_xmalloc(2 * in->nkv), in->vb = tkd_test_xmalloc(2 * in->nkv);
    tkd_test_fill_bf16(in->q, in->qb, in->nq, seed * 5 + 1, std);
    tkd_test_fill_bf16(in->k, in->kb, in->nkv, seed * 5 + 2, std);
    tkd_test_fill_bf16(in->v, in->vb, in->nkv, seed * 5 + 3, 1.0f);
    tkd_test_fill_bf16(in->dy, in->dyb, in->nq, seed * 5 + 4, 1.0f);
}

void tkd_test_attn_in_free(tkd_test_attn_in *in)
{
    free(in->q), free(in->k), free(in->v), free(in->dy);
    free(in->qb), free(in->kb), free(in->vb), free(in->dyb);
}

double *tkd_test_bf16_to_f64(const uint16_t *b, size_t n)
{
    double *d = tkd_test_xmalloc(n * 8);
    for (size_t i = 0; i < n; i++)
        d[i] = tkd_bf16_to_f32(b[i]);
    return d;
}
#endif /* TKD_HAVE_CUDA */
