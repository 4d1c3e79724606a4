/* test_cuda_policy.c — the CUDA kernel choices (kernels/cuda/cuda_policy.h), parsed once, one rule for
 * every variable: each knob's listed values (switches also 1 / 0), unset or empty = the default,
 * anything else an error naming the variable and its values; the retired spellings refused naming
 * their replacement; the printed form lists every knob; determinism named. CPU only: the policy is
 * plain C, so a typo is caught here without a GPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_policy.h"
#include "tests/testutil.h"

/* A fake environment: name=value pairs. */
static const char *const *g_env;
static const char *fake_getenv(const char *name)
{
    for (const char *const *e = g_env; e && *e; e += 2)
        if (strcmp(e[0], name) == 0)
            return e[1];
    return NULL;
}

static tkd_status parse(const char *const *env, tkd_cuda_policy *p)
{
    g_env = env;
    return tkd_cuda_policy_from_env(p, fake_getenv);
}

/* Every knob of p, one assertion each (so a failure names the knob), against want. */
static void expect_knobs(const tkd_cuda_policy *p, tkd_cuda_policy want)
{
    assert_int_equal(p->attn_bwd, want.attn_bwd);
    assert_int_equal(p->cudnn, want.cudnn);
    assert_int_equal(p->cudnn_bwd_nondet, want.cudnn_bwd_nondet);
    assert_int_equal(p->kl_sm90, want.kl_sm90);
    assert_int_equal(p->kl_fused, want.kl_fused);
    assert_int_equal(p->kl_grad, want.kl_grad);
    assert_int_equal(p->topk_fused, want.topk_fused);
    assert_int_equal(p->lmhead_sched, want.lmhead_sched);
    assert_int_equal(p->moe_gemm, want.moe_gemm);
    assert_int_equal(p->moe_mxfp4, want.moe_mxfp4);
}

static void test_defaults(void **state)
{
    (void)state;
    tkd_cuda_policy p, d = tkd_cuda_policy_default();
    const char *const none[] = {NULL};
    assert_int_equal(parse(none, &p), TKD_OK);
    assert_memory_equal(&p, &d, sizeof p);
    expect_knobs(&p, (tkd_cuda_policy){.attn_bwd = TKD_POLICY_ATTN_BWD_WGMMA, .cudnn = 1, .cudnn_bwd_nondet = 0,
                                       .kl_sm90 = 1, .kl_fused = 1, .kl_grad = TKD_POLICY_KL_GRAD_AUTO,
                                       .topk_fused = 0, .lmhead_sched = TKD_POLICY_LMHEAD_SCHED_PINGPONG,
                                       .moe_gemm = TKD_POLICY_MOE_GEMM_AUTO, .moe_mxfp4 = TKD_POLICY_MOE_MXFP4_GEMM});
    /* an empty variable is the default too (a shell's VAR= to clear it) */
    const char *const empty[] = {"TKD_ATTN_BWD", "", "TKD_KL_SM90", "", NULL};
    assert_int_equal(parse(empty, &p), TKD_OK);
    assert_memory_equal(&p, &d, sizeof p);
    assert_true(tkd_cuda_policy_deterministic(&p, NULL));
}

static void test_every_value(void **state)
{
    (void)state;
    tkd_cuda_policy p;
    const char *const env[] = {"TKD_ATTN_BWD", "flash", "TKD_CUDNN", "off", "TKD_CUDNN_BWD_NONDET", "1",
                               "TKD_KL_SM90", "0", "TKD_KL_FUSED", "off", "TKD_KL_GRAD_SM90", "both",
                               "TKD_TOPK_FUSED", "on", "TKD_LMHEAD_SM90_SCHED", "coop", "TKD_MOE_GEMM", "loop",
                               "TKD_MOE_MXFP4", "layer", NULL};
    assert_int_equal(parse(env, &p), TKD_OK);
    expect_knobs(&p, (tkd_cuda_policy){.attn_bwd = TKD_POLICY_ATTN_BWD_FLASH, .cudnn = 0, .cudnn_bwd_nondet = 1,
                                       .kl_sm90 = 0, .kl_fused = 0, .kl_grad = TKD_POLICY_KL_GRAD_BOTH,
                                       .topk_fused = 1, .lmhead_sched = TKD_POLICY_LMHEAD_SCHED_COOP,
                                       .moe_gemm = TKD_POLICY_MOE_GEMM_LOOP, .moe_mxfp4 = TKD_POLICY_MOE_MXFP4_LAYER});
    char buf[512];
    int n = tkd_cuda_policy_format(&p, buf, sizeof buf);
    assert_int_equal(n, (int)strlen(buf));
    assert_string_equal(buf, "TKD_ATTN_BWD=flash TKD_CUDNN=off TKD_CUDNN_BWD_NONDET=on TKD_KL_SM90=off "
                             "TKD_KL_FUSED=off TKD_KL_GRAD_SM90=both TKD_TOPK_FUSED=on TKD_LMHEAD_SM90_SCHED=coop "
                             "TKD_MOE_GEMM=loop TKD_MOE_MXFP4=layer");
    /* truncation: the length it would have, a terminated prefix */
    char small[16];
    assert_int_equal(tkd_cuda_policy_format(&p, small, sizeof small), n);
    assert_int_equal(strlen(small), sizeof small - 1);
    const char *why = NULL;
    assert_false(tkd_cuda_policy_deterministic(&p, &why));
    assert_string_equal(why, "TKD_CUDNN_BWD_NONDET");
    const char *const kl[] = {"TKD_KL_GRAD_SM90", "cublas", "TKD_ATTN_BWD", "cudnn", NULL};
    assert_int_equal(parse(kl, &p), TKD_OK);
    assert_int_equal(p.kl_grad, TKD_POLICY_KL_GRAD_CUBLAS);
    assert_int_equal(p.attn_bwd, TKD_POLICY_ATTN_BWD_CUDNN);
    /* ours: the last value, so the earlier values keep their numbers (a manifest's record of them) */
    const char *const moe[] = {"TKD_MOE_GEMM", "ours", NULL};
    assert_int_equal(parse(moe, &p), TKD_OK);
    assert_int_equal(p.moe_gemm, TKD_POLICY_MOE_GEMM_OURS);
    assert_int_equal(TKD_POLICY_MOE_GEMM_OURS, 3);
    tkd_cuda_policy_format(&p, buf, sizeof buf);
    assert_non_null(strstr(buf, " TKD_MOE_GEMM=ours"));
}

/* One rule: a value the knob does not list is an error naming the variable, the value and the
 * values it takes — a typo never silently picks a path (TKD_LMHEAD_SM90_SCHED=coopp used to run
 * ping-pong, TKD_KL_SM90=no kept our GEMM). */
static void test_typos_refused(void **state)
{
    (void)state;
    static const char *const cases[][3] = {
        {"TKD_LMHEAD_SM90_SCHED", "coopp", "expected one of pingpong|coop"},
        {"TKD_KL_SM90", "no", "expected one of on|off (or 1|0)"},
        {"TKD_TOPK_FUSED", "yes", "expected one of off|on (or 1|0)"},
        {"TKD_KL_GRAD_SM90", "1", "expected one of auto|cublas|dh|dw|both"},
        {"TKD_ATTN_BWD", "CUDNN", "expected one of wgmma|cudnn|flash"},
        {"TKD_CUDNN_BWD_NONDET", "true", "TKD_CUDNN_BWD_NONDET=true"},
        {"TKD_MOE_GEMM", "our", "expected one of auto|grouped|loop|ours"},
        {"TKD_MOE_MXFP4", "bf16", "expected one of gemm|layer"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *const env[] = {cases[i][0], cases[i][1], NULL};
        tkd_cuda_policy p;
        assert_int_equal(parse(env, &p), TKD_ERR_CONFIG);
        char want[128];
        snprintf(want, sizeof want, "%s=%s: ", cases[i][0], cases[i][1]);
        tkd_test_assert_msg_has(want);
        tkd_test_assert_msg_has(cases[i][2]);
        assert_null(strchr(tkd_error_msg(), '\n'));
    }
}

/* The retired spellings are refused naming what replaced them, instead of being ignored. */
static void test_retired_names(void **state)
{
    (void)state;
    tkd_cuda_policy p;
    const char *const no_cudnn[] = {"TKD_NO_CUDNN", "1", NULL};
    assert_int_equal(parse(no_cudnn, &p), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("TKD_NO_CUDNN is no longer read: use TKD_CUDNN=off");
    const char *const old_bwd[] = {"TKD_CUDNN_BWD", "0", NULL};
    assert_int_equal(parse(old_bwd, &p), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("TKD_CUDNN_BWD is no longer read: use TKD_ATTN_BWD=flash");
}

/* The note a run's config.yaml and a cache's manifest get: a YAML comment line after the text. */
static void test_append_note(void **state)
{
    (void)state;
    tkd_cuda_policy p = tkd_cuda_policy_default();
    char *text = strdup("kd:\n  alpha: 1"); /* no final newline: one is added before the note */
    assert_int_equal(tkd_cuda_policy_append_note(&p, &text), TKD_OK);
    assert_string_equal(text, "kd:\n  alpha: 1\n# CUDA kernel choices (docs/config.md): TKD_ATTN_BWD=wgmma "
                              "TKD_CUDNN=on TKD_CUDNN_BWD_NONDET=off TKD_KL_SM90=on TKD_KL_FUSED=on "
                              "TKD_KL_GRAD_SM90=auto TKD_TOPK_FUSED=off TKD_LMHEAD_SM90_SCHED=pingpong "
                              "TKD_MOE_GEMM=auto TKD_MOE_MXFP4=gemm\n");
    free(text);
    text = NULL;
    assert_int_equal(tkd_cuda_policy_append_note(&p, &text), TKD_OK);
    assert_true(strncmp(text, "# CUDA kernel choices", 21) == 0);
    free(text);
}

/* The knob table (for the docs' one table) lists every knob once, with its values. */
static void test_knob_table(void **state)
{
    (void)state;
    int n = 0, nondet = 0;
    for (const tkd_cuda_knob_info *k; (k = tkd_cuda_policy_knob(n)) != NULL; n++) {
        assert_true(strncmp(k->name, "TKD_", 4) == 0);
        assert_non_null(strchr(k->values, '|'));
        assert_true(strlen(k->help) > 10);
        nondet += k->nondeterministic;
    }
    assert_int_equal(n, 10);
    assert_int_equal(nondet, 1);
    assert_null(tkd_cuda_policy_knob(-1));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),      cmocka_unit_test(test_every_value),
        cmocka_unit_test(test_typos_refused), cmocka_unit_test(test_retired_names),
        cmocka_unit_test(test_knob_table),    cmocka_unit_test(test_append_note),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
