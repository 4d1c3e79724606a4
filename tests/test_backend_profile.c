/* test_backend_profile.c — the op profiler (kernels/backend_profile.h) over the CPU backend: a
 * two-layer model's training forward and backward through the wrapped backend give bit-identical
 * hidden states and gradients to the same model on the bare backend, and the report counts each op
 * as often as the model's structure calls it (derived below from model/model_fwd_bwd.c, not copied from a
 * run); failures pass through with their message; a backend without timing marks is refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/backend.h"
#include "kernels/backend_profile.h"
#include "kernels/loss/kl_loss.h"
#include "model/model.h"
#include "tests/testutil.h"

enum { L = 2, B = 2, T = 5, N = B * T, V = 37, D = 8 };

static tkd_model *make_model(tkd_backend *be)
{
    tkd_model_config mc;
    tkd_test_tiny_llama(&mc, V, D, 1, 16);
    mc.num_hidden_layers = L;
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random_for_training(&mc, 3, be, &m), TKD_OK);
    return m;
}

/* zero_grad, a training forward and the backward of dh; the hidden states into hidden. */
static void step(tkd_model *m, const int32_t *tok, const float *dh, float *hidden)
{
    const void *h = NULL;
    assert_int_equal(tkd_model_zero_grad(m), TKD_OK);
    assert_int_equal(tkd_model_forward(m, tok, B, T, 1, &h), TKD_OK);
    memcpy(hidden, h, sizeof(float) * N * D);
    assert_int_equal(tkd_model_backward(m, dh), TKD_OK);
}

/* The calls of one step() on the CPU (act = fp32: no f32_to_act; buffers reserved by an earlier
 * step: no alloc), from model/model_fwd_bwd.c with recompute off:
 *   zero_grad: memset0 1.
 *   forward: upload 1 (tokens), embedding_fwd 1, rmsnorm_fwd 1 (layer 0's input norm); per layer
 *     (block_fwd_body + block_fwd): linear_fwd 7 (q, k, v, o, gate, up, down), rope_fwd 1,
 *     attn_fwd 1, add_rmsnorm_fwd 2 (after attention; after the MLP, into the next norm),
 *     swiglu_fwd 1.
 *   backward: memset0 1 (dx), rmsnorm_bwd 1 (final norm), embedding_bwd 1; per layer but the
 *     last (block_recompute: the norms' outputs and the SwiGLU product are not kept) rmsnorm_fwd 2
 *     and swiglu_fwd 1; per layer (block_bwd): linear_bwd 7, swiglu_bwd 1, rmsnorm_bwd 2,
 *     attn_bwd 1, rope_bwd 1, and no memset0 (each activation gradient's first contribution
 *     overwrites it; the gradients are not lent: no zeroing of lent ranges). */
typedef struct want {
    const char *op;
    int64_t calls;
} want;

static const want kWant[] = {
    {"memset0", 1 + 1},
    {"upload", 1},
    {"embedding_fwd", 1},
    {"rmsnorm_fwd", 1 + 2 * (L - 1)},
    {"linear_fwd", 7 * L},
    {"rope_fwd", L},
    {"attn_fwd", L},
    {"add_rmsnorm_fwd", 2 * L},
    {"swiglu_fwd", L + (L - 1)},
    {"rmsnorm_bwd", 1 + 2 * L},
    {"embedding_bwd", 1},
    {"linear_bwd", 7 * L},
    {"swiglu_bwd", L},
    {"attn_bwd", L},
    {"rope_bwd", L},
};

static void test_same_results_and_counts(void **s)
{
    (void)s;
    tkd_backend *bare = NULL, *inner = NULL, *prof = NULL;
    assert_int_equal(tkd_backend_cpu_open(&bare), TKD_OK);
    assert_int_equal(tkd_backend_cpu_open(&inner), TKD_OK);
    assert_int_equal(tkd_backend_profile_wrap(inner, &prof), TKD_OK);
    assert_int_equal(prof->device, TKD_DEVICE_CPU);
    assert_int_equal(prof->act_size, sizeof(float));
    tkd_model *m0 = make_model(bare), *m1 = make_model(prof);
    assert_int_equal(m0->n_params, m1->n_params);
    int32_t tok[N];
    for (int i = 0; i < N; i++)
        tok[i] = (i * 11 + 3) % V;
    float dh[N * D], h0[N * D], h1[N * D];
    tkd_test_randn(dh, N * D, 5, 1.0f);
    step(m0, tok, dh, h0);
    step(m1, tok, dh, h1); /* reserves the activations: allocs and their uploads happen here */
    tkd_backend_profile_reset(prof);
    step(m0, tok, dh, h0);
    step(m1, tok, dh, h1);
    assert_memory_equal(h0, h1, sizeof h0);
    assert_memory_equal(m0->grads, m1->grads, sizeof(float) * m0->n_params);

    tkd_profile_row rows[TKD_PROFILE_OPS];
    int n = 0;
    assert_int_equal(tkd_backend_profile_report(prof, rows, &n), TKD_OK);
    const int nw = (int)(sizeof kWant / sizeof kWant[0]);
    for (int i = 0; i < n; i++) {
        print_message("%-16s %3lld calls %8.3f ms\n", rows[i].op, (long long)rows[i].calls, rows[i].ms);
        assert_true(rows[i].ms >= 0.0);
        if (i > 0)
            assert_true(rows[i - 1].ms >= rows[i].ms); /* most time first */
    }
    for (int w = 0; w < nw; w++) {
        int64_t got = 0;
        for (int i = 0; i < n; i++)
            if (!strcmp(rows[i].op, kWant[w].op))
                got = rows[i].calls;
        if (got != kWant[w].calls)
            fail_msg("%s: %lld calls reported, the model's structure makes %lld", kWant[w].op, (long long)got,
                     (long long)kWant[w].calls);
    }
    if (n != nw) /* and no other op: every reported row is one of kWant */
        fail_msg("%d ops reported, %d expected (an op the structure does not call was counted)", n, nw);

    tkd_backend_profile_reset(prof);
    assert_int_equal(tkd_backend_profile_report(prof, rows, &n), TKD_OK);
    assert_int_equal(n, 0);
    tkd_model_free(m0);
    tkd_model_free(m1);
    tkd_backend_close(prof); /* the wrapper only: inner is still usable */
    void *p = NULL;
    assert_int_equal(inner->op->alloc(inner, 16, "after close", &p), TKD_OK);
    inner->op->free(inner, p);
    tkd_backend_close(inner);
    tkd_backend_close(bare);
}

/* An op's failure reaches the caller with its own status and message, and is still counted. */
static void test_errors_pass_through(void **s)
{
    (void)s;
    tkd_backend *inner = NULL, *prof = NULL;
    assert_int_equal(tkd_backend_cpu_open(&inner), TKD_OK);
    assert_int_equal(tkd_backend_profile_wrap(inner, &prof), TKD_OK);
    /* a refused argument, not an out-of-memory: ASan aborts on a huge allocation instead of
     * returning NULL */
    tkd_kl_params kp;
    tkd_kl_params_defaults(&kp, 8);
    tkd_backend_kl *kl = NULL;
    assert_int_equal(prof->op->kl_create(prof, &kp, 0, 16, 64, &kl), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("n_max 0");
    assert_null(kl);
    tkd_profile_row rows[TKD_PROFILE_OPS];
    int n = 0;
    assert_int_equal(tkd_backend_profile_report(prof, rows, &n), TKD_OK);
    assert_int_equal(n, 1);
    assert_string_equal(rows[0].op, "kl_create");
    assert_int_equal(rows[0].calls, 1);
    assert_int_equal(tkd_backend_profile_report(inner, rows, &n), TKD_ERR_INVALID_ARG);
    tkd_backend_close(prof);

    /* a backend without timing marks cannot be profiled */
    tkd_backend_ops no_marks = *inner->op;
    no_marks.mark = NULL;
    tkd_backend fake = *inner;
    fake.op = &no_marks;
    assert_int_equal(tkd_backend_profile_wrap(&fake, &prof), TKD_ERR_UNSUPPORTED);
    assert_null(prof);
    tkd_backend_close(inner);
}

/* An op that takes 5 ms: the profile must put its time on that op's row (a wrapper that marked
 * both ends before or after the call would show ~0). */
static tkd_status (*g_swiglu_fwd)(tkd_backend *, const void *, const void *, int64_t, void *);
static tkd_status slow_swiglu_fwd(tkd_backend *be, const void *g, const void *u, int64_t n, void *h)
{
    nanosleep(&(struct timespec){0, 5 * 1000 * 1000}, NULL);
    return g_swiglu_fwd(be, g, u, n, h);
}

static void test_time_lands_on_its_op(void **s)
{
    (void)s;
    tkd_backend *inner = NULL, *prof = NULL;
    assert_int_equal(tkd_backend_cpu_open(&inner), TKD_OK);
    tkd_backend_ops slow = *inner->op;
    g_swiglu_fwd = slow.swiglu_fwd;
    slow.swiglu_fwd = slow_swiglu_fwd;
    const tkd_backend_ops *orig = inner->op;
    inner->op = &slow;
    assert_int_equal(tkd_backend_profile_wrap(inner, &prof), TKD_OK);
    tkd_model *m = make_model(prof);
    int32_t tok[N];
    for (int i = 0; i < N; i++)
        tok[i] = (i * 7 + 1) % V;
    float dh[N * D], h[N * D];
    tkd_test_randn(dh, N * D, 6, 1.0f);
    tkd_backend_profile_reset(prof);
    step(m, tok, dh, h);
    tkd_profile_row rows[TKD_PROFILE_OPS];
    int n = 0;
    assert_int_equal(tkd_backend_profile_report(prof, rows, &n), TKD_OK);
    assert_true(n > 0);
    assert_string_equal(rows[0].op, "swiglu_fwd"); /* most time first */
    assert_int_equal(rows[0].calls, L + (L - 1)); /* the forward's, and the backward's remakes */
    assert_true(rows[0].ms >= 5.0 * (2 * L - 1) - 0.1);
    tkd_model_free(m);
    tkd_backend_close(prof);
    inner->op = orig;
    tkd_backend_close(inner);
}

/* The CPU's marks: the interval between two marks is the monotonic clock's. */
static void test_cpu_marks(void **s)
{
    (void)s;
    tkd_backend *be = NULL;
    assert_int_equal(tkd_backend_cpu_open(&be), TKD_OK);
    assert_int_equal(be->op->mark(be, 3), TKD_OK);
    nanosleep(&(struct timespec){0, 20 * 1000 * 1000}, NULL); /* 20 ms the interval must show */
    assert_int_equal(be->op->mark(be, 1000), TKD_OK);         /* grows */
    double ms = -1;
    assert_int_equal(be->op->mark_ms(be, 3, 1000, &ms), TKD_OK);
    assert_true(ms >= 19.9 && ms < 1000.0);
    assert_int_equal(be->op->mark(be, -1), TKD_ERR_INVALID_ARG);
    assert_int_equal(be->op->mark_ms(be, 3, 1 << 20, &ms), TKD_ERR_INVALID_ARG);
    assert_int_equal(be->op->mark_ms(be, 3, 500, &ms), TKD_ERR_INVALID_ARG); /* in range, never recorded */
    tkd_backend_close(be);
}

TKD_TEST_MAIN(test_same_results_and_counts, test_errors_pass_through, test_cpu_marks, test_time_lands_on_its_op)
