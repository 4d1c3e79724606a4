/* test_optim_state.c — optim.state_dtype bf16 (AdamW moments kept as bf16, model/optim.h):
 * kernels/cpu/adamw.h's tkd_adamw_update with bf16 moments against a scalar reference written here
 * (fp32 maths on moments widened from bf16, rounded back to nearest even by a rounding of its own, not
 * common/half.h's) over awkward sizes, with and without weight-decay segments and gaps, with a
 * clip scale; the optimizer on a model's CPU backend (whole and as ZeRO-1 shards) against the host
 * one; the moments' fp32 get / set; the f32 default. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/adamw.h"
#include "model/model.h"
#include "model/optim.h"
#include "tests/optim_testutil.h"
#include "tests/testutil.h"

static uint32_t bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static float from_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* x to the nearest bf16, ties to the even one: x's two bf16 neighbours (the truncation and the next
 * one away from zero) compared in double. Finite x below the largest bf16 only (all this test makes). */
static uint16_t ref_bf16(float x)
{
    const uint32_t t = bits(x) & 0xffff0000u, up = t + 0x10000u;
    const double dt = fabs((double)x - from_bits(t)), du = fabs((double)from_bits(up) - x);
    if (dt != du)
        return (uint16_t)((dt < du ? t : up) >> 16);
    return (uint16_t)(((t >> 16) & 1u ? up : t) >> 16);
}

static float ref_widen(uint16_t b) { return from_bits((uint32_t)b << 16); }

/* One AdamW update of the segments' elements, element by element as torch's single-tensor fp32
 * AdamW after g *= s, the moments read from bf16 and written back rounded (adamw.h's contract). */
static void ref_update(float *p, const float *g, float s, uint16_t *m, uint16_t *v, const tkd_adamw_seg *segs,
                       int n_segs, const tkd_adamw_hparams *h, int64_t step)
{
    const double bc1 = 1.0 - pow(h->beta1, (double)step), bc2 = 1.0 - pow(h->beta2, (double)step);
    const float one_m_b1 = (float)(1.0 - h->beta1), b2 = (float)h->beta2, one_m_b2 = (float)(1.0 - h->beta2);
    const float eps = (float)h->eps, step_size = (float)(h->lr / bc1), bc2_sqrt = (float)sqrt(bc2);
    for (int k = 0; k < n_segs; k++) {
        const float keep = (float)(1.0 - h->lr * (segs[k].decay ? h->weight_decay : 0.0));
        for (size_t i = segs[k].offset; i < segs[k].offset + segs[k].numel; i++) {
            const float gi = g[i] * s;
            float mi = ref_widen(m[i]), vi = ref_widen(v[i]);
            p[i] = p[i] * keep;
            mi = mi + one_m_b1 * (gi - mi);
            vi = vi * b2 + (one_m_b2 * gi) * gi;
            const float denom = sqrtf(vi) / bc2_sqrt + eps;
            p[i] = p[i] - step_size * (mi / denom);
            m[i] = ref_bf16(mi);
            v[i] = ref_bf16(vi);
        }
    }
}

/* Segments over n elements: one decayed segment (split 0), or decayed / not decayed / a one-element
 * gap no segment covers / decayed (split 1, n ≥ 4). Returns the count; *gap = the gap's index or −1. */
static int make_segs(size_t n, int split, tkd_adamw_seg segs[3], long *gap)
{
    *gap = -1;
    if (!split || n < 4) {
        segs[0] = (tkd_adamw_seg){0, n, !split};
        return 1;
    }
    const size_t a = n / 3, b = a + (n - a) / 2;
    segs[0] = (tkd_adamw_seg){0, a, 1};
    segs[1] = (tkd_adamw_seg){a, b - a, 0};
    segs[2] = (tkd_adamw_seg){b + 1, n - b - 1, 1};
    *gap = (long)b;
    return 3;
}

static void assert_bits(const char *what, const void *got, const void *want, size_t n, size_t elt, size_t sz)
{
    if (memcmp(got, want, n * elt) == 0)
        return;
    size_t i = 0;
    while (memcmp((const char *)got + i * elt, (const char *)want + i * elt, elt) == 0)
        i++;
    fail_msg("%s (n = %zu): element %zu differs", what, sz, i);
}

/* Four steps (the second and fourth with clip scales 0.37 and 1.7) from random moments, sizes 1, 7,
 * 33 and 32769 (past the OpenMP threshold of 32768), with and without decay segments and a gap:
 * weights and bf16 moments equal the reference bit for bit; the gap's weight and moments stay; the
 * stored moments really are rounded (an fp32 state run ends elsewhere). */
static void test_update_bf16_matches_reference(void **state)
{
    (void)state;
    const size_t sizes[] = {1, 7, 33, 32769};
    const tkd_adamw_hparams h0 = {.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        for (int split = 0; split < 2; split++) {
            const size_t n = sizes[si];
            tkd_adamw_seg segs[3];
            long gap;
            const int ns = make_segs(n, split, segs, &gap);
            float *p = malloc(n * 4), *q = malloc(n * 4), *g = malloc(n * 4), *pf = malloc(n * 4);
            float *mf = malloc(n * 4), *vf = malloc(n * 4);
            uint16_t *m = malloc(n * 2), *v = malloc(n * 2), *rm = malloc(n * 2), *rv = malloc(n * 2);
            tkd_test_randn(p, n, 10 + si, 0.5f);
            tkd_test_randn(mf, n, 20 + si, 0.01f);
            tkd_test_randn(vf, n, 30 + si, 0.01f);
            for (size_t i = 0; i < n; i++) {
                m[i] = rm[i] = ref_bf16(mf[i]);
                v[i] = rv[i] = ref_bf16(vf[i] * vf[i]);
                mf[i] = ref_widen(m[i]), vf[i] = ref_widen(v[i]);
            }
            memcpy(q, p, n * 4);
            memcpy(pf, p, n * 4);
            for (int64_t step = 1; step <= 4; step++) {
                tkd_test_randn(g, n, 40 + 10 * si + (size_t)step, step == 3 ? 2.0f : 0.02f);
                const float s = step == 2 ? 0.37f : step == 4 ? 1.7f : 1.0f;
                tkd_adamw_hparams h = h0;
                h.lr = h0.lr * (double)step / 4.0;
                tkd_adamw_update(p, g, s, m, v, TKD_ADAMW_DTYPE_BF16, segs, ns, &h, step);
                ref_update(q, g, s, rm, rv, segs, ns, &h, step);
                tkd_adamw_update(pf, g, s, mf, vf, TKD_ADAMW_DTYPE_F32, segs, ns, &h, step);
                assert_bits("weights", p, q, n, 4, n);
                assert_bits("m", m, rm, n, 2, n);
                assert_bits("v", v, rv, n, 2, n);
            }
            if (gap >= 0) { /* untouched: the start's weight and first moment, made again */
                tkd_test_randn(mf, n, 10 + si, 0.5f);
                tkd_test_randn(vf, n, 20 + si, 0.01f);
                assert_true(bits(p[gap]) == bits(mf[gap]));
                assert_true(m[gap] == ref_bf16(vf[gap]));
            }
            size_t differ = 0;
            for (size_t i = 0; i < n; i++)
                differ += bits(pf[i]) != bits(p[i]);
            if (n >= 33)
                assert_true(differ > 0); /* the rounding of the stored moments shows in the weights */
            free(p), free(q), free(g), free(pf), free(mf), free(vf), free(m), free(v), free(rm), free(rv);
        }
    }
}

static tkd_model *make_model(uint64_t seed)
{
    tkd_model_config mc;
    tkd_test_tiny_llama(&mc, 40, 16, 2, 16);
    tkd_model *m = NULL;
    if (tkd_model_init_random(&mc, seed, &m) != TKD_OK || tkd_model_reserve(m, 1, 4, 1) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    return m;
}

/* The optimizer on the model's CPU backend with bf16 state (tkd_adamw_clip_step_model, clipping
 * on two of three steps) against the host bf16 state stepped by tests/optim_testutil.h after the
 * same clip: weights and moments the same bits. A ZeRO-1 shard [b, e) of a third model updates
 * exactly those elements as the whole-model state does, its moments that range of the whole's. */
static void test_backend_and_shard_bf16(void **state)
{
    (void)state;
    tkd_model *a = make_model(5), *b = make_model(5), *z = make_model(5);
    const size_t n = a->n_params;
    int n_info = 0;
    const tkd_param_info *info = tkd_model_params(a, &n_info);
    tkd_optim_config c;
    tkd_optim_config_defaults(&c);
    c.state_dtype = TKD_ADAMW_DTYPE_BF16;
    tkd_adamw *oa = NULL, *ob = NULL, *oz = NULL;
    assert_int_equal(tkd_adamw_init_on(&c, a, &oa), TKD_OK);
    assert_int_equal(tkd_adamw_init(&c, n, &ob), TKD_OK);
    const size_t zb = n / 3 + 1, ze = 2 * n / 3 + 3;
    assert_int_equal(tkd_adamw_init_shard(&c, z, zb, ze, &oz), TKD_OK);
    assert_true(oa->m == NULL && oa->m_bf16 != NULL && ((uintptr_t)oa->v_bf16 & 15) == 0);
    float *g = malloc(n * 4), *ma = malloc(n * 4), *va = malloc(n * 4), *mb = malloc(n * 4), *vb = malloc(n * 4);
    const double caps[3] = {0.5, 1e9, 0.25};
    for (int step = 0; step < 3; step++) {
        tkd_test_randn(g, n, 70 + step, 0.3f);
        memcpy(a->grads, g, n * 4);
        memcpy(z->grads, g, n * 4);
        double na = 0, nb = 0;
        assert_int_equal(tkd_adamw_clip_step_model(oa, a, 1e-2, caps[step], &na), TKD_OK);
        assert_int_equal(tkd_optim_clip(g, n, caps[step], &nb), TKD_OK);
        tkd_adamw_step(ob, b->params, g, info, n_info, 1e-2);
        assert_true(na == nb);
        double nz = 0;
        assert_int_equal(tkd_adamw_clip_step_model(oz, z, 1e-2, caps[step], &nz), TKD_OK);
        assert_memory_equal(a->params, b->params, n * 4);
        assert_memory_equal(z->params + zb, a->params + zb, (ze - zb) * 4);
    }
    assert_int_equal(tkd_adamw_moments_get(oa, ma, va), TKD_OK);
    assert_int_equal(tkd_adamw_moments_get(ob, mb, vb), TKD_OK);
    assert_memory_equal(ma, mb, n * 4);
    assert_memory_equal(va, vb, n * 4);
    assert_int_equal(tkd_adamw_moments_get(oz, mb, vb), TKD_OK);
    assert_memory_equal(mb, ma + zb, (ze - zb) * 4);
    assert_memory_equal(vb, va + zb, (ze - zb) * 4);
    /* outside the shard the weights are the start's */
    tkd_model *fresh = make_model(5);
    assert_memory_equal(z->params, fresh->params, zb * 4);
    assert_memory_equal(z->params + ze, fresh->params + ze, (n - ze) * 4);
    tkd_model_free(fresh);
    free(g), free(ma), free(va), free(mb), free(vb);
    tkd_adamw_free(oa), tkd_adamw_free(ob), tkd_adamw_free(oz);
    tkd_model_free(a), tkd_model_free(b), tkd_model_free(z);
}

/* moments_set rounds fp32 to nearest even bf16 (ties included), moments_get widens exactly, so what
 * came out goes back in unchanged; on the host and in a backend's memory alike. */
static void test_moments_get_set_bf16(void **state)
{
    (void)state;
    tkd_model *md = make_model(9);
    const size_t n = md->n_params;
    tkd_optim_config c;
    tkd_optim_config_defaults(&c);
    c.state_dtype = TKD_ADAMW_DTYPE_BF16;
    float *m = malloc(n * 4), *v = malloc(n * 4), *m2 = malloc(n * 4), *v2 = malloc(n * 4);
    tkd_test_randn(m, n, 90, 1.0f);
    tkd_test_randn(v, n, 91, 1e-3f);
    m[0] = from_bits(0x3f808000u); /* a tie: rounds to the even 0x3f80 */
    m[1] = from_bits(0x3f818000u); /* a tie: rounds up to the even 0x3f82 */
    for (int on = 0; on < 2; on++) {
        tkd_adamw *o = NULL;
        assert_int_equal(on ? tkd_adamw_init_on(&c, md, &o) : tkd_adamw_init(&c, n, &o), TKD_OK);
        assert_int_equal(tkd_adamw_moments_set(o, m, v), TKD_OK);
        assert_int_equal(tkd_adamw_moments_get(o, m2, v2), TKD_OK);
        for (size_t i = 0; i < n; i++)
            if (bits(m2[i]) != (uint32_t)ref_bf16(m[i]) << 16 || bits(v2[i]) != (uint32_t)ref_bf16(v[i]) << 16)
                fail_msg("%s state: element %zu: got m 0x%08x v 0x%08x from 0x%08x, 0x%08x", on ? "backend" : "host",
                         i, bits(m2[i]), bits(v2[i]), bits(m[i]), bits(v[i]));
        assert_true(bits(m2[0]) == 0x3f800000u && bits(m2[1]) == 0x3f820000u);
        float *m3 = malloc(n * 4), *v3 = malloc(n * 4);
        assert_int_equal(tkd_adamw_moments_set(o, m2, v2), TKD_OK);
        assert_int_equal(tkd_adamw_moments_get(o, m3, v3), TKD_OK);
        assert_memory_equal(m3, m2, n * 4);
        assert_memory_equal(v3, v2, n * 4);
        free(m3), free(v3);
        tkd_adamw_free(o);
    }
    free(m), free(v), free(m2), free(v2);
    tkd_model_free(md);
}

/* The default is fp32 moments (the pointers say so); a dtype outside the enum is refused. */
static void test_default_f32_and_bad_dtype(void **state)
{
    (void)state;
    tkd_optim_config c;
    tkd_optim_config_defaults(&c);
    assert_int_equal(c.state_dtype, TKD_ADAMW_DTYPE_F32);
    tkd_adamw *o = NULL;
    assert_int_equal(tkd_adamw_init(&c, 5, &o), TKD_OK);
    assert_true(o->m != NULL && o->v == o->m + 5 && o->m_bf16 == NULL && o->v_bf16 == NULL);
    tkd_adamw_free(o);
    assert_string_equal(tkd_adamw_dtype_name(TKD_ADAMW_DTYPE_BF16), "bf16");
    assert_int_equal(tkd_adamw_dtype_size(TKD_ADAMW_DTYPE_BF16), 2);
    assert_int_equal(tkd_adamw_dtype_size(TKD_ADAMW_DTYPE_F32), 4);
    c.state_dtype = (tkd_adamw_dtype)7;
    assert_int_equal(tkd_adamw_init(&c, 5, &o), TKD_ERR_INVALID_ARG);
    assert_null(o);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_update_bf16_matches_reference),
        cmocka_unit_test(test_backend_and_shard_bf16),
        cmocka_unit_test(test_moments_get_set_bf16),
        cmocka_unit_test(test_default_f32_and_bad_dtype),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
