/* test_model_docs.c — packed documents in the model (tkd_model_forward_docs, issue 23): a batch of
 * sequences holding several documents computes each document as if it ran alone — its final hidden
 * states, and in training the weights' gradients of a loss over them (the sum of the per-document
 * runs' gradients) — for Llama with biases and Qwen3 (per-head q/k norms, head_dim ≠ D/H), with and
 * without a sliding window; a malformed document array is refused naming the position.
 *
 * Tolerances: the packed run and the per-document runs do the same per-row arithmetic but through
 * GEMMs of different row counts (OpenBLAS may block them differently), so values agree to fp32
 * rounding, not bit for bit: 1e-5 of the largest magnitude.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "model/model_internal.h" /* the per-token RoPE rows (acts->rope_tok) */
#include "tests/model_testutil.h"
#include "tests/testutil.h"

enum { B = 2, T = 14 };
/* The documents of each sequence: start positions, -1 ends the list. */
static const int kStarts[B][5] = {{0, 1, 6, 11, -1}, {0, 9, -1}};

static void doc_array(int32_t *doc)
{
    tkd_test_doc_starts(&kStarts[0][0], 5, B, T, doc);
}

static tkd_model *make(const tkd_model_config *c)
{
    tkd_model *m = NULL;
    if (tkd_model_init_random(c, 5, &m) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    return m;
}

static double max_abs(const float *x, size_t n)
{
    double a = 0;
    for (size_t i = 0; i < n; i++)
        a = fmax(a, fabs(x[i]));
    return a;
}

static void expect_near(const char *what, const float *got, const float *want, size_t n)
{
    double tol = 1e-5 * fmax(max_abs(want, n), 1e-30);
    for (size_t i = 0; i < n; i++)
        if (!(fabs((double)got[i] - want[i]) <= tol))
            fail_msg("%s[%zu]: packed %.9g, documents alone %.9g (tolerance %.3g)", what, i, got[i], want[i], tol);
}

/* The packed batch against each document alone: hidden states, and (training) the gradients of
 * Σ hidden · R with R a fixed random (N, D). */
static void check_config(const tkd_model_config *c, const char *what)
{
    const int D = c->hidden_size, N = B * T;
    int32_t tok[B * T], doc[B * T];
    for (int i = 0; i < N; i++)
        tok[i] = (i * 11 + 3) % c->vocab_size;
    doc_array(doc);
    float *r = malloc(sizeof(float) * N * D), *hp = malloc(sizeof(float) * N * D), *ha = malloc(sizeof(float) * N * D);
    assert_true(r && hp && ha);
    tkd_test_randn(r, (size_t)N * D, 77, 1.0f);
    tkd_model *mp = make(c), *ma = make(c);
    const void *h = NULL;
    if (tkd_model_forward_docs(mp, tok, doc, B, T, 1, &h) != TKD_OK)
        fail_msg("%s: packed forward: %s", what, tkd_error_msg());
    memcpy(hp, h, sizeof(float) * N * D);
    /* RoPE restarts at each document (relative positions alone would hide it: the scores depend only
     * on i − j): token n's rows are the tables' rows at its offset in its document */
    const size_t half = (size_t)c->head_dim / 2;
    for (int n = 0; n < N; n++) {
        size_t pos = (size_t)(n % T - doc[n]);
        assert_memory_equal(mp->acts->rope_tok + n * half, mp->rope_cos + pos * half, sizeof(float) * half);
        assert_memory_equal(mp->acts->rope_tok + (N + n) * half, mp->rope_sin + pos * half, sizeof(float) * half);
    }
    assert_int_equal(tkd_model_backward(mp, r), TKD_OK);
    for (int b = 0; b < B; b++)
        for (int d = 0; kStarts[b][d] >= 0; d++) {
            int s0 = kStarts[b][d], s1 = kStarts[b][d + 1] >= 0 ? kStarts[b][d + 1] : T, n = s1 - s0;
            size_t r0 = (size_t)b * T + s0;
            if (tkd_model_forward(ma, tok + r0, 1, n, 1, &h) != TKD_OK)
                fail_msg("%s: document alone: %s", what, tkd_error_msg());
            memcpy(ha + r0 * D, h, sizeof(float) * n * D);
            assert_int_equal(tkd_model_backward(ma, r + r0 * D), TKD_OK); /* adds into the gradients */
        }
    char w[160];
    snprintf(w, sizeof w, "%s: hidden", what);
    expect_near(w, hp, ha, (size_t)N * D);
    snprintf(w, sizeof w, "%s: gradients", what);
    expect_near(w, mp->grads, ma->grads, mp->n_params);
    /* the documents matter: the same batch run as plain sequences differs */
    assert_int_equal(tkd_model_forward(mp, tok, B, T, 0, &h), TKD_OK);
    assert_true(fabs(((const float *)h)[(size_t)(T - 1) * D] - hp[(size_t)(T - 1) * D]) > 1e-6);
    tkd_model_free(mp);
    tkd_model_free(ma);
    free(r), free(hp), free(ha);
}

static void test_llama_bias(void **s)
{
    (void)s;
    tkd_model_config c = small_cfg(0, 1);
    check_config(&c, "llama with q/k/v bias");
}

static void test_qwen3(void **s)
{
    (void)s;
    tkd_model_config c = qwen3_cfg();
    check_config(&c, "qwen3");
}

/* A window shorter than the documents and the sequence (3 < 5, 8, 9) with documents: each
 * document alone runs under the same window. */
static void test_window(void **s)
{
    (void)s;
    tkd_model_config c = qwen3_cfg();
    c.sliding_window = 3;
    c.layer_sliding[1] = 1;
    check_config(&c, "qwen3, window 3 on layer 1");
}

static void test_bad_doc_array(void **s)
{
    (void)s;
    tkd_model_config c = small_cfg(1, 0);
    tkd_model *m = make(&c);
    int32_t tok[B * T] = {0}, doc[B * T];
    doc_array(doc);
    doc[T + 4] = 2; /* sequence 1's position 4 names a start that is neither itself nor position 3's */
    assert_int_equal(tkd_model_forward_docs(m, tok, doc, B, T, 0, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("document start 2 at batch row 1, position 4");
    doc_array(doc);
    doc[0] = 1;
    assert_int_equal(tkd_model_forward_docs(m, tok, doc, B, T, 0, NULL), TKD_ERR_INVALID_ARG);
    tkd_model_free(m);
}

TKD_TEST_MAIN(test_llama_bias, test_qwen3, test_window, test_bad_doc_array)
