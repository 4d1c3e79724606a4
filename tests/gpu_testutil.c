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
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cuda/ops_bwd_cuda.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/rope_table.h"
#include "tests/gpu_check.h"
#include "tests/ref64.h"
#include "tests/testutil.h"

#define ROPE_F32_ABS 4.76837158203125e-07 /* 2^-21, times |x| + |y| of the pair */

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

void tkd_test_rope_case(const tkd_test_rope *r, void *stream)
{
    static const tkd_test_tol tol = {0.0, 0.00390625, "bf16 2^-8, + 2^-21·(|x| + |y|) of the pair (fp32 x·c ∓ y·s)"};
    char what[160], wq[200];
    snprintf(what, sizeof what, "rope_%s N %d T %d H %d Hkv %d dh %d offset %d", r->backward ? "bwd" : "fwd", r->N,
             r->T, r->H, r->Hkv, r->dh, r->off);
    const int half = r->dh / 2, off = r->off;
    const size_t nq = (size_t)r->N * r->H * r->dh, nk = (size_t)r->N * r->Hkv * r->dh, nt = (size_t)r->T * half;
    float *inv = tkd_test_xmalloc((size_t)half * 4), *c = tkd_test_xmalloc(nt * 4), *s = tkd_test_xmalloc(nt * 4);
    tkd_rope_inv_freq(r->theta, r->dh, 0, 1.0, 1.0, 4.0, 8192, inv);
    tkd_rope_table(inv, r->dh, r->T, c, s);
    uint16_t *q = tkd_test_rand_bf16(nq, r->seed_q, 1.5f), *k = tkd_test_rand_bf16(nk, r->seed_k, 1.5f);
    double *qref, *kref, *qabs, *kabs;
    tkd_ref64_rope(q, r->N, r->T, r->H, r->dh, c, s, r->backward, ROPE_F32_ABS, &qref, &qabs);
    tkd_ref64_rope(k, r->N, r->T, r->Hkv, r->dh, c, s, r->backward, ROPE_F32_ABS, &kref, &kabs);
    uint16_t *d_q = tkd_test_dev_alloc((nq + off) * 2), *d_k = tkd_test_dev_alloc((nk + off) * 2);
    float *d_c = tkd_test_dev_alloc((nt + off) * 4), *d_s = tkd_test_dev_alloc((nt + off) * 4);
    tkd_test_to_dev(d_q + off, q, nq * 2), tkd_test_to_dev(d_k + off, k, nk * 2);
    tkd_test_to_dev(d_c + off, c, nt * 4), tkd_test_to_dev(d_s + off, s, nt * 4);
    tkd_test_ok((r->backward ? tkd_cuda_rope_bwd : tkd_cuda_rope_fwd)(d_q + off, d_k + off, r->N, r->T, r->H, r->Hkv,
                                                                    r->dh, d_c + off, d_s + off, stream),
                what);
    tkd_test_to_host(q, d_q + off, nq * 2, stream);
    tkd_test_to_host(k, d_k + off, nk * 2, stream);
    snprintf(wq, sizeof wq, "%s: %sq", what, r->backward ? "d" : "");
    tkd_test_check_bf16_mat(wq, q, qref, nq, (size_t)r->H * r->dh, tol, qabs);
    snprintf(wq, sizeof wq, "%s: %sk", what, r->backward ? "d" : "");
    tkd_test_check_bf16_mat(wq, k, kref, nk, (size_t)r->Hkv * r->dh, tol, kabs);
    cudaFree(d_q), cudaFree(d_k), cudaFree(d_c), cudaFree(d_s);
    free(inv), free(c), free(s), free(q), free(k), free(qref), free(kref), free(qabs), free(kabs);
}

void tkd_test_rope_cases(int backward, uint64_t seed_base, void *stream)
{
    static const struct {
        int N, T, H, Hkv, dh, off;
        double theta;
    } shapes[] = {
        {1, 1, 1, 1, 64, 0, 10000.0},        /* one row, position 0 only */
        {17, 5, 14, 2, 64, 0, 1e6},          /* 4 sequences of 5 (t = n % T), H/Hkv = 7 */
        {1000, 1000, 7, 1, 128, 0, 500000.0}, /* one long sequence, H/Hkv = 7 */
        {1000, 1000, 14, 2, 64, 0, 10000.0},
        {17, 17, 4, 2, 48, 0, 10000.0},      /* dh = 48: half = 24 */
        {33, 8, 14, 2, 80, 0, 10000.0},
        {5, 3, 2, 2, 96, 0, 10000.0},        /* H/Hkv = 1 */
        {1000, 250, 2, 1, 128, 0, 10000.0},  /* H/Hkv = 2 */
        {17, 5, 3, 1, 20, 0, 10000.0},       /* half = 10: scalar path */
        {9, 4, 2, 2, 2, 0, 10000.0},         /* dh = 2 */
        {17, 17, 4, 2, 48, 1, 10000.0},      /* one element off alignment: scalar path */
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const tkd_test_rope r = {shapes[i].N, shapes[i].T, shapes[i].H, shapes[i].Hkv, shapes[i].dh, shapes[i].off,
                                 backward, shapes[i].theta, seed_base + (uint64_t)shapes[i].dh,
                                 seed_base + 100 + (uint64_t)shapes[i].dh};
        tkd_test_rope_case(&r, stream);
    }
    tkd_status (*const rope)(uint16_t *, uint16_t *, int, int, int, int, int, const float *, const float *, void *) =
        backward ? tkd_cuda_rope_bwd : tkd_cuda_rope_fwd;
    uint16_t *d = tkd_test_dev_alloc(64);
    float *f = tkd_test_dev_alloc(64);
    assert_int_equal(rope(d, d, 1, 1, 1, 1, 63, f, f, stream), TKD_ERR_INVALID_ARG); /* odd dh */
    assert_int_equal(rope(d, d, 1, 1, 1, 0, 64, f, f, stream), TKD_ERR_INVALID_ARG); /* Hkv 0 */
    cudaFree(d), cudaFree(f);
}
#endif /* TKD_HAVE_CUDA */
