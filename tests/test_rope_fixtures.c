/* test_rope_fixtures.c — our RoPE frequencies against transformers' own (tests/fixtures/rope/yarn.json,
 * written by tests/fixtures/make_rope_fixtures.py with transformers 5.17 on the GPU machine): YaRN
 * with gpt-oss's defaults (no truncation) and a truncated YaRN on a Qwen3 config. inv_freq must
 * match within 2 fp32 ulp (both compute in fp32 in the same order; torch's pow may round the last
 * bit differently from powf), the attention factor to 1e-6 (a double computed once, stored in
 * fp32). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "kernels/rope_table.h"
#include "tests/testutil.h"

static double num(const cJSON *o, const char *k, double dflt)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(x) ? x->valuedouble : dflt;
}

/* ulps between two finite positive floats */
static int64_t ulps(float a, float b)
{
    int32_t ia, ib;
    memcpy(&ia, &a, 4), memcpy(&ib, &b, 4);
    return llabs((long long)ia - (long long)ib);
}

static void check_case(const cJSON *c)
{
    const char *name = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(c, "name"));
    const int dh = (int)num(c, "head_dim", 0);
    const cJSON *inv_ref = cJSON_GetObjectItemCaseSensitive(c, "inv_freq_bits");
    assert_non_null(name);
    assert_true(dh >= 2 && dh <= 512 && cJSON_GetArraySize(inv_ref) == dh / 2);
    const cJSON *trunc = cJSON_GetObjectItemCaseSensitive(c, "truncate");
    float *inv = calloc((size_t)dh / 2, sizeof(float)), af = 0;
    assert_non_null(inv);
    tkd_rope_inv_freq_yarn(num(c, "theta", 0), dh, num(c, "factor", 0), num(c, "beta_fast", 32), num(c, "beta_slow", 1),
                           (int)num(c, "original_max_position_embeddings", 0), !cJSON_IsFalse(trunc),
                           num(c, "attention_factor", 0), inv, &af);
    int64_t worst = 0;
    for (int i = 0; i < dh / 2; i++) {
        const int32_t bits = (int32_t)cJSON_GetArrayItem(inv_ref, i)->valuedouble;
        float want;
        memcpy(&want, &bits, 4);
        const int64_t u = ulps(inv[i], want);
        if (u > 2)
            fail_msg("%s: inv_freq[%d] = %.9g, transformers %.9g (%lld ulp)", name, i, (double)inv[i], (double)want,
                     (long long)u);
        worst = u > worst ? u : worst;
    }
    const double want_af = num(c, "attention_scaling", NAN);
    if (!(fabs(af - want_af) <= 1e-6))
        fail_msg("%s: attention factor %.9g, transformers %.9g", name, (double)af, want_af);
    print_message("%s: inv_freq within %lld ulp of transformers' (%d values), attention factor %.7f\n", name,
                  (long long)worst, dh / 2, (double)af);
    free(inv);
}

static void test_yarn(void **state)
{
    (void)state;
    char *txt = tkd_test_slurp(tkd_test_src("fixtures/rope/yarn.json"), NULL);
    cJSON *doc = cJSON_Parse(txt);
    assert_non_null(doc);
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(doc, "cases"), *c;
    assert_true(cJSON_GetArraySize(cases) >= 2);
    cJSON_ArrayForEach(c, cases) check_case(c);
    cJSON_Delete(doc);
    free(txt);
}

TKD_TEST_MAIN(test_yarn)
