/* test_bf16_split.c — common/half.h's exact split of a float into a bf16 and an int16 residual (the
 * CUDA backend's master weights, kernels/cuda/ops_bwd_cuda.h's AdamW). Over every one of the 2^32 bit
 * patterns in an optimised build (a few seconds), every 7th pattern plus the edges otherwise (the
 * sanitizer build is ~20× slower):
 *   - join(split(x)) has x's exact bits (NaN: a NaN, the payload is not kept);
 *   - hi is tkd_f32_to_bf16(x) (round to nearest even) except at exact ties, where it is the
 *     neighbour away from zero;
 *   - for finite x whose hi is finite, |hi − x| ≤ half a bf16 ulp, measured in double (exact; on
 *     every 5th pattern checked, to keep the run at a few seconds: the RNE equality bounds it too).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cmocka.h>

#include "common/half.h"

/* One pattern's checks (the distance in double only with `dist`, the costly part); returns 0 when
 * they hold, else 1 (with `verbose`, after printing what differed). */
#define FAIL(...) return verbose ? (print_error(__VA_ARGS__), 1) : 1
static int check_pattern(uint32_t u, int dist, int verbose)
{
    const float x = tkd_bits_f32(u);
    int16_t lo = 0;
    const uint16_t hi = tkd_f32_split_bf16(x, &lo);
    const float back = tkd_bf16_join_f32(hi, lo);
    if (isnan(x)) {
        if (isnan(back) && isnan(tkd_bf16_to_f32(hi)))
            return 0;
        FAIL("0x%08x (NaN): split gives hi 0x%04x lo %d, joined 0x%08x: not a NaN\n", u, hi, lo,
             tkd_f32_bits(back));
    }
    if (tkd_f32_bits(back) != u)
        FAIL("0x%08x: split gives hi 0x%04x lo %d, joined back 0x%08x\n", u, hi, lo, tkd_f32_bits(back));
    const int tie = (u & 0xffffu) == 0x8000u;
    const uint16_t rne = tkd_f32_to_bf16(x), away = (uint16_t)((u >> 16) + 1);
    if (hi != (tie ? away : rne))
        FAIL("0x%08x: hi 0x%04x, want 0x%04x (%s)\n", u, hi, tie ? away : rne,
             tie ? "a tie: away from zero" : "round to nearest even");
    const double h = tkd_bf16_to_f32(hi);
    if (!dist || isinf(h))
        return 0; /* x = ±inf or |x| ≥ 0x1.fep127: RNE's bf16 is inf too (checked above) */
    /* the bf16 ulp of the binade x's truncation lies in: the step from it to its next pattern */
    const uint16_t t = (uint16_t)(u >> 16);
    const double ulp = fabs((double)tkd_bf16_to_f32((uint16_t)(t + 1)) - (double)tkd_bf16_to_f32(t));
    if (fabs(h - (double)x) > 0.5 * ulp)
        FAIL("0x%08x (%.9g): hi %.9g is %.3g bf16 ulps away\n", u, x, h, fabs(h - (double)x) / ulp);
    return 0;
}

/* The edges named in half.h: zeros, subnormals, carries into the exponent, the top half-ulp, inf. */
static const uint32_t k_edges[] = {
    0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x00007fffu, 0x00008000u, 0x00008001u,
    0x007fffffu, 0x807fffffu, 0x007f8000u, 0x00800000u, 0x3f7f7fffu, 0x3f7f8000u, 0x3f7fffffu,
    0x3f800000u, 0x3f808000u, 0x3f818000u, 0xbf7f8000u, 0x7f7f7fffu, 0x7f7f8000u, 0x7f7fffffu,
    0xff7f8000u, 0xff7fffffu, 0x7f800000u, 0xff800000u, 0x7f800001u, 0x7fc00000u, 0x7fffffffu,
    0xffffffffu, 0x7fff8000u,
};

static void test_edges(void **state)
{
    (void)state;
    int bad = 0;
    for (size_t i = 0; i < sizeof k_edges / sizeof *k_edges; i++)
        bad += check_pattern(k_edges[i], 1, 1);
    assert_int_equal(bad, 0);
    /* the cases the comments promise, spelled out */
    int16_t lo = 0;
    assert_int_equal(tkd_f32_split_bf16(-0.0f, &lo), 0x8000);
    assert_int_equal(lo, 0);
    assert_int_equal(tkd_f32_split_bf16(tkd_bits_f32(0x3f7f8000u), &lo), 0x3f80); /* tie carries to 1.0 */
    assert_int_equal(lo, -0x8000);
    assert_int_equal(tkd_f32_split_bf16(tkd_bits_f32(0x7f7fffffu), &lo), 0x7f80); /* FLT_MAX: hi = inf */
    assert_int_equal(lo, -1);
}

static void test_all_patterns(void **state)
{
    (void)state;
#ifdef NDEBUG
    const int64_t stride = 1; /* exhaustive */
#else
    const int64_t stride = 7; /* coprime with 2^16: still every low half with many high halves */
#endif
    const int64_t n = ((int64_t)1 << 32) / stride;
    int64_t bad = 0, first = INT64_MAX;
    /* quietly on both cores, then the first failure again with its message; the distance in
     * double on every 5th pattern (RNE equality already bounds it) keeps the run at a few seconds */
#pragma omp parallel for schedule(static) reduction(+ : bad) reduction(min : first)
    for (int64_t i = 0; i < n; i++)
        if (check_pattern((uint32_t)(i * stride), i % 5 == 0, 0)) {
            bad++;
            first = i * stride < first ? i * stride : first;
        }
    if (bad)
        check_pattern((uint32_t)first, 1, 1);
    printf("bf16 split: %lld patterns checked, %lld failed\n", (long long)n, (long long)bad);
    assert_true(bad == 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_edges),
        cmocka_unit_test(test_all_patterns),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
