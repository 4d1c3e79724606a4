/* test_kl_validate_ws.c — validation through the workspace's scratch (no allocation per batch)
 * finds the same errors as tkd_kl_validate, batch after batch: the scratch is left clean. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "common/status.h"
#include "kernels/loss/kl_loss.h"

enum { N = 3, K = 4, V = 50, D = 2 };

static void test_scratch_is_reused_cleanly(void **state)
{
    (void)state;
    int32_t idx[N * K] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    float logit[N * K] = {4, 3, 2, 1, 4, 3, 2, 1, 4, 3, 2, 1};
    int32_t y[N] = {0, 1, 2};
    float h[N * D] = {0}, w[V * D] = {0};
    tkd_kl_params p;
    tkd_kl_params_defaults(&p, K);
    tkd_kl_batch b = {.n = N, .d = D, .v = V, .h = h, .w = w, .topk_idx = idx, .topk_logit = logit, .labels = y};
    tkd_kl_cpu_ws *ws = NULL;
    assert_int_equal(tkd_kl_cpu_ws_create(&ws, &p, N, D, V), TKD_OK);
    /* the same clean batch many times: ids seen in one call must not count as seen in the next */
    for (int rep = 0; rep < 3; rep++)
        assert_int_equal(tkd_kl_cpu_validate(ws, &p, &b), TKD_OK);
    idx[6] = 5; /* row 1 now lists token 5 twice */
    assert_int_equal(tkd_kl_cpu_validate(ws, &p, &b), TKD_ERR_FORMAT);
    assert_non_null(strstr(tkd_error_msg(), "row 1"));
    assert_int_equal(tkd_kl_validate(&p, &b), TKD_ERR_FORMAT); /* the allocating path agrees */
    idx[6] = 7;
    assert_int_equal(tkd_kl_cpu_validate(ws, &p, &b), TKD_OK); /* an error left the scratch clean */
    idx[11] = V; /* out of the vocabulary */
    assert_int_equal(tkd_kl_cpu_validate(ws, &p, &b), TKD_ERR_FORMAT);
    assert_non_null(strstr(tkd_error_msg(), "row 2"));
    idx[11] = 12;
    assert_int_equal(tkd_kl_cpu_validate(ws, &p, &b), TKD_OK);
    tkd_kl_cpu_ws_free(ws);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_scratch_is_reused_cleanly)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
