/* test_mxfp4.c — MXFP4 (formats/mxfp4.h): every E2M1 code at every E8M0 scale against an independent
 * formula (decoded from the code's sign/exponent/mantissa bits in double), bit for bit, fp32 and
 * bf16, subnormal results included; the nibble order; a random round trip; refused blocks (scale 0xFF,
 * values >= 2^128); a checkpoint's _blocks/_scales pair read from a safetensors file the test writes,
 * in transformers 5's transposed layout; every broken pair's message; quantization_config.
 * `test_mxfp4 fixtures` (ctest test_mxfp4_transformers, registered once tests/fixtures/mxfp4/
 * exists) checks the reader against transformers' own dequantisation (tests/mxfp4_reference.py).
 * No tolerance anywhere: every result is exact (mxfp4.h says why), so every comparison is bitwise.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "common/mxfp4_bits.h"
#include "common/status.h"
#include "formats/mxfp4.h"
#include "formats/safetensors.h"
#include "tests/testutil.h"

/* ---- the independent formula ------------------------------------------------------------------ */

/* E2M1 code c times 2^(s − 127) in double, from the code's fields: sign bit 3, exponent bits 2..1
 * (bias 1; 0 is subnormal: 0 or 0.5), mantissa bit 0. Exact in double. */
static double e2m1_times_scale(unsigned c, unsigned s)
{
    double sign = (c & 8u) ? -1.0 : 1.0;
    unsigned e = (c >> 1) & 3u, m = c & 1u;
    double mag = e == 0 ? 0.5 * m : (1.0 + 0.5 * m) * ldexp(1.0, (int)e - 1);
    return sign * mag * ldexp(1.0, (int)s - 127);
}

/* 1 when the value does not fit fp32 (the decoders refuse it). */
static int overflows(double v)
{
    return fabs(v) >= ldexp(1.0, 128);
}

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Value j (0..31) of a block b (16 bytes): byte j/2, low nibble first. */
static unsigned code_at(const uint8_t *b, int j)
{
    return j % 2 == 0 ? (b[j / 2] & 15u) : (unsigned)(b[j / 2] >> 4);
}

/* ---- decoding ------------------------------------------------------------------------------------ */

/* Every byte at every scale: the byte repeated over one block, decoded to fp32 and bf16. */
static void test_all_codes_all_scales(void **state)
{
    (void)state;
    uint8_t blk[16];
    float f[32];
    uint16_t h[32];
    int refused = 0, subnormal = 0;
    for (unsigned s = 0; s < 255; s++)
        for (unsigned byte = 0; byte < 256; byte++) {
            memset(blk, (int)byte, sizeof blk);
            uint8_t sc = (uint8_t)s;
            double lo = e2m1_times_scale(byte & 15u, s), hi = e2m1_times_scale(byte >> 4, s);
            tkd_status st = tkd_mxfp4_decode_f32(blk, &sc, 1, 1, f, "t");
            tkd_status sh = tkd_mxfp4_decode_bf16(blk, &sc, 1, 1, h, "t");
            if (overflows(lo) || overflows(hi)) {
                assert_int_equal(st, TKD_ERR_FORMAT);
                assert_int_equal(sh, TKD_ERR_FORMAT);
                refused++;
                continue;
            }
            assert_int_equal(st, TKD_OK);
            assert_int_equal(sh, TKD_OK);
            assert_true((double)(float)lo == lo && (double)(float)hi == hi); /* exact in fp32 */
            for (int j = 0; j < 32; j++) {
                float want = (float)(j % 2 ? hi : lo); /* sign of -0 kept by the cast */
                assert_int_equal(bits_of(f[j]), bits_of(want));
                assert_int_equal(bits_of(f[j]), bits_of(tkd_mxfp4_value(code_at(blk, j), s)));
                assert_int_equal(h[j], bits_of(want) >> 16);
                assert_int_equal(bits_of(tkd_bf16_to_f32(h[j])), bits_of(want)); /* bf16 exact too */
                subnormal += fpclassify(f[j]) == FP_SUBNORMAL;
            }
        }
    /* A nibble of magnitude m overflows at scale s when m·2^(s−127) >= 2^128: at s = 254 the
     * magnitudes 2, 3, 4, 6 (8 codes with the signs), at s = 253 the magnitudes 4, 6 (4 codes),
     * below none. A byte is refused when either nibble overflows: 256 − (16 − big)² bytes. */
    int big254 = 8, big253 = 4;
    assert_int_equal(refused, (256 - (16 - big254) * (16 - big254)) + (256 - (16 - big253) * (16 - big253)));
    assert_true(subnormal > 0); /* s = 0 and 1 reach fp32's subnormals */
}

/* common/mxfp4_bits.h, the decode the CUDA MoE op runs (the layer decoder and the one inside our
 * Hopper GEMM), on the host: every byte in every position of a word, at every scale the codec
 * takes, against tkd_mxfp4_value's bf16 (its fp32 value's upper half). Both ways: the fp32 product
 * (any scale) and, where tkd_mxfp4_fast_scale says so, the bf16 multiply by
 * tkd_mxfp4_fast_multiplier: its two bf16 operands' exact product must be a bf16 (so a correctly
 * rounded multiply returns it unrounded) equal to the reference. The device runs the same source
 * but for its byte permute, whose unread bytes differ; test_gpu_moe holds the kernels to the codec
 * bit for bit. */
static void test_device_bits(void **state)
{
    (void)state;
    int fast = 0;
    for (unsigned s = 0; s < 255; s++)
        for (unsigned byte = 0; byte < 256; byte++)
            for (int at = 0; at < 4; at++) {
                /* byte at position at; the others a different pattern, so pairs cannot mix */
                const uint32_t w = (0x5A3C96E1u & ~(0xFFu << (8 * at))) | (uint32_t)byte << (8 * at);
                uint32_t r[4], q[4];
                tkd_mxfp4_e2m1x8_bits(w, r);
                memcpy(q, r, sizeof q);
                tkd_mxfp4_scale_f32(q, s);
                for (int j = 0; j < 8; j++) {
                    const unsigned code = (w >> (4 * j)) & 15u;
                    const float want = tkd_mxfp4_value(code, s);
                    if (!isfinite(want))
                        continue; /* refused by the codec (a value ≥ 2^128) */
                    const uint16_t got = (uint16_t)(q[j / 2] >> (16 * (j % 2)));
                    if (got != (uint16_t)(bits_of(want) >> 16))
                        fail_msg("scale %u, code %u: fp32 way 0x%04x, the codec 0x%04x", s, code, got,
                                 bits_of(want) >> 16);
                    if (!tkd_mxfp4_fast_scale(s))
                        continue;
                    const uint16_t a = (uint16_t)(r[j / 2] >> (16 * (j % 2)));
                    const uint16_t m = (uint16_t)(tkd_mxfp4_fast_multiplier(s) >> (16 * (j % 2)));
                    assert_int_equal(m, (uint16_t)(tkd_mxfp4_fast_multiplier(s) & 0xFFFFu)); /* both halves */
                    const double prod = (double)tkd_bf16_to_f32(a) * (double)tkd_bf16_to_f32(m);
                    const float pf = (float)prod;
                    if ((double)pf != prod || (bits_of(pf) & 0xFFFFu) != 0 || bits_of(pf) != bits_of(want))
                        fail_msg("scale %u, code %u: the bf16 multiply's exact product %a is not the codec's %a "
                                 "as a bf16", s, code, prod, (double)want);
                    fast++;
                }
            }
    assert_int_equal(fast, 127 * 256 * 4 * 8); /* scales 2..128, every code of every word */
}

static void test_spot_values(void **state)
{
    (void)state;
    /* 0.5 · 2^−127 = 2^−128: a subnormal fp32, held exactly */
    float v = tkd_mxfp4_value(1, 0);
    assert_true(fpclassify(v) == FP_SUBNORMAL);
    assert_true(v == ldexpf(1.0f, -128));
    assert_true(tkd_mxfp4_value(9, 0) == -ldexpf(1.0f, -128));
    assert_true(tkd_mxfp4_value(3, 254) == 1.5f * ldexpf(1.0f, 127)); /* the largest finite one */
    assert_true(signbit(tkd_mxfp4_value(8, 127)) && tkd_mxfp4_value(8, 127) == 0.0f); /* −0 */
    assert_true(tkd_mxfp4_value(7, 127) == 6.0f && tkd_mxfp4_value(15, 128) == -12.0f);
    assert_true(tkd_mxfp4_value(5, 126) == 1.5f);
}

/* The low nibble is the earlier value (transformers: lut[b & 0xF] at even positions). */
static void test_nibble_order(void **state)
{
    (void)state;
    uint8_t blk[16] = {0x71, 0x2A, 0xF0, 0x08};
    uint8_t s = 127; /* scale 1 */
    float f[32];
    assert_int_equal(tkd_mxfp4_decode_f32(blk, &s, 1, 1, f, "t"), TKD_OK);
    const float want[8] = {0.5f, 6.0f, -1.0f, 1.0f, 0.0f, -6.0f, -0.0f, 0.0f};
    for (int j = 0; j < 8; j++)
        assert_int_equal(bits_of(f[j]), bits_of(want[j]));
    for (int j = 8; j < 32; j++)
        assert_int_equal(bits_of(f[j]), 0u);
}

/* xorshift64: deterministic bytes for the random cases. */
static uint64_t rng_next(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* Random blocks (rows, G, 16) and scales in [lo, lo + span) from seed. */
static void random_blocks(uint8_t *blocks, uint8_t *scales, size_t nblk, unsigned lo, unsigned span, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < nblk * 16; i++)
        blocks[i] = (uint8_t)rng_next(&x);
    for (size_t i = 0; i < nblk; i++)
        scales[i] = (uint8_t)(lo + rng_next(&x) % span);
}

static void test_random_rows(void **state)
{
    (void)state;
    enum { R = 5, G = 3 };
    uint8_t blocks[R * G * 16], scales[R * G];
    float f[R * G * 32];
    uint16_t h[R * G * 32];
    random_blocks(blocks, scales, R * G, 0, 255, 7); /* every scale but 0xFF; some overflow */
    for (int i = 0; i < R * G; i++) /* keep the big scales to codes that fit */
        if (scales[i] >= 253)
            memset(blocks + 16 * i, 0x33, 16);
    assert_int_equal(tkd_mxfp4_decode_f32(blocks, scales, R, G, f, "t"), TKD_OK);
    assert_int_equal(tkd_mxfp4_decode_bf16(blocks, scales, R, G, h, "t"), TKD_OK);
    for (int r = 0; r < R; r++)
        for (int k = 0; k < G * 32; k++) {
            int blk = r * G + k / 32;
            float want = (float)e2m1_times_scale(code_at(blocks + 16 * blk, k % 32), scales[blk]);
            assert_int_equal(bits_of(f[r * G * 32 + k]), bits_of(want));
            assert_int_equal(h[r * G * 32 + k], bits_of(want) >> 16);
        }
}

static void test_refused_blocks(void **state)
{
    (void)state;
    enum { R = 2, G = 3 };
    uint8_t blocks[R * G * 16] = {0}, scales[R * G];
    memset(scales, 127, sizeof scales);
    float f[R * G * 32];
    uint16_t h[R * G * 32];
    scales[1 * G + 2] = 0xFF; /* block [1, 2]: E8M0's NaN, even over zeros */
    tkd_test_expect_error(tkd_mxfp4_decode_f32(blocks, scales, R, G, f, "w.safetensors: tensor 'x'"),
                          TKD_ERR_FORMAT, TKD_TEST_FRAGS("w.safetensors: tensor 'x'", "block [1, 2]", "0xFF", "NaN"));
    tkd_test_expect_error(tkd_mxfp4_decode_bf16(blocks, scales, R, G, h, "x"), TKD_ERR_FORMAT,
                          TKD_TEST_FRAGS("block [1, 2]", "0xFF"));
    scales[1 * G + 2] = 127;
    scales[0 * G + 1] = 254; /* zeros at 2^127: fine */
    assert_int_equal(tkd_mxfp4_decode_f32(blocks, scales, R, G, f, "x"), TKD_OK);
    blocks[(0 * G + 1) * 16 + 5] = 0x40; /* code 4 (2.0) in the high nibble: 2^128 */
    tkd_test_expect_error(tkd_mxfp4_decode_f32(blocks, scales, R, G, f, "x"), TKD_ERR_FORMAT,
                          TKD_TEST_FRAGS("x: block [0, 1]", "scale 254 = 2^127", ">= 2^128"));
    blocks[(0 * G + 1) * 16 + 5] = 0x30; /* 1.5 · 2^127 fits */
    assert_int_equal(tkd_mxfp4_decode_bf16(blocks, scales, R, G, h, "x"), TKD_OK);
    assert_int_equal(h[1 * 32 + 11], bits_of(1.5f * ldexpf(1.0f, 127)) >> 16);
}

/* ---- a safetensors image with U8 tensors, written by hand ------------------------------------- */

/* An MXFP4 pair <name>_blocks (E, R, G, 16) / <name>_scales (E, R, G) as two entries. */
static void pair_entries(tkd_test_st_entry out[2], const char *blocks_name, const char *scales_name, int64_t E, int64_t R,
                         int64_t G, const uint8_t *blocks, const uint8_t *scales)
{
    out[0] = (tkd_test_st_entry){blocks_name, "U8", 4, {E, R, G, 16}, blocks, (size_t)(E * R * G * 16)};
    out[1] = (tkd_test_st_entry){scales_name, "U8", 3, {E, R, G}, scales, (size_t)(E * R * G)};
}

static tkd_st_dir *open_st(const char *path)
{
    tkd_st_dir *d = NULL;
    assert_int_equal(tkd_st_open(path, &d), TKD_OK);
    return d;
}

/* By hand: one expert, two rows of one block. Row 0 is bytes 0x21 at scale 1 (0.5, 1.0, 0.5, ...);
 * row 1 is 0x77 then zeros at scale 2 (12, 12, 0, ...). The parameter is (1, 32, 2): column r of the
 * result is row r of the blocks. */
static void test_transposed_by_hand(void **state)
{
    const char *path = tkd_test_path(*state, "model.safetensors");
    uint8_t blocks[2 * 16] = {0}, scales[2] = {127, 128};
    memset(blocks, 0x21, 16);
    blocks[16] = 0x77;
    tkd_test_st_entry e[2];
    pair_entries(e, "w_blocks", "w_scales", 1, 2, 1, blocks, scales);
    tkd_test_write_st(path, e, 2);
    tkd_st_dir *d = open_st(path);
    int found = 0;
    int64_t shape[3];
    assert_int_equal(tkd_mxfp4_probe(d, "w", &found, shape), TKD_OK);
    assert_int_equal(found, 1);
    assert_true(shape[0] == 1 && shape[1] == 32 && shape[2] == 2);
    float f[64];
    uint16_t h[64];
    assert_int_equal(tkd_mxfp4_read(d, "w", shape, TKD_DTYPE_F32, f, 64), TKD_OK);
    assert_int_equal(tkd_mxfp4_read(d, "w", shape, TKD_DTYPE_BF16, h, 64), TKD_OK);
    for (int k = 0; k < 32; k++) {
        float want0 = k % 2 ? 1.0f : 0.5f, want1 = k < 2 ? 12.0f : 0.0f;
        assert_true(f[k * 2 + 0] == want0);
        assert_true(f[k * 2 + 1] == want1);
        assert_true(tkd_bf16_to_f32(h[k * 2 + 0]) == want0 && tkd_bf16_to_f32(h[k * 2 + 1]) == want1);
    }
    assert_int_equal(tkd_mxfp4_probe(d, "v", &found, shape), TKD_OK); /* absent: not MXFP4 */
    assert_int_equal(found, 0);
    tkd_test_expect_error(tkd_mxfp4_read(d, "v", shape, TKD_DTYPE_F32, f, 64), TKD_ERR_NOT_FOUND,
                          TKD_TEST_FRAGS("'v_blocks'", "'v_scales'"));
    tkd_st_close(d);
}

/* out[e][k][r] of <name> read from d is the value of blocks[e][r][k/32] at k % 32, fp32 and bf16. */
static void check_layout(tkd_st_dir *d, const char *name, int64_t E, int64_t R, int64_t G, const uint8_t *blocks,
                         const uint8_t *scales)
{
    int64_t K = G * 32, shape[3] = {E, K, R};
    size_t n = (size_t)(E * K * R);
    float *f = malloc(n * sizeof *f);
    uint16_t *h = malloc(n * sizeof *h);
    assert_true(f && h);
    for (size_t i = 0; i < n; i++)
        f[i] = NAN, h[i] = 0x7FC0; /* poisoned: an element left unwritten fails */
    assert_int_equal(tkd_mxfp4_read(d, name, shape, TKD_DTYPE_F32, f, n), TKD_OK);
    assert_int_equal(tkd_mxfp4_read(d, name, shape, TKD_DTYPE_BF16, h, n), TKD_OK);
    for (int64_t e = 0; e < E; e++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t r = 0; r < R; r++) {
                int64_t blk = (e * R + r) * G + k / 32; /* blocks[e][r][k/32] */
                float want = (float)e2m1_times_scale(code_at(blocks + 16 * blk, (int)(k % 32)), scales[blk]);
                size_t at = (size_t)((e * K + k) * R + r); /* out[e][k][r] */
                assert_int_equal(bits_of(f[at]), bits_of(want));
                assert_int_equal(h[at], bits_of(want) >> 16);
            }
    free(f);
    free(h);
}

/* gpt-oss's two projections (E = 3, I = 64, D = 64: gate_up_proj (E, D, 2I) from blocks
 * (E, 2I, D/32, 16); down_proj from blocks (E, 37, I/32, 16), 37 rows for a partial tile) with random
 * codes and scales, beside an F32 bias, in transformers' transposed layout. */
static void test_gpt_oss_layout(void **state)
{
    const char *path = tkd_test_path(*state, "model.safetensors");
    enum { E = 3, I = 64, D = 64 };
    static uint8_t gu_b[E * 2 * I * (D / 32) * 16], gu_s[E * 2 * I * (D / 32)];
    static uint8_t dn_b[E * 37 * (I / 32) * 16], dn_s[E * 37 * (I / 32)];
    random_blocks(gu_b, gu_s, sizeof gu_s, 110, 30, 1);
    random_blocks(dn_b, dn_s, sizeof dn_s, 0, 20, 2); /* small scales: subnormal results */
    float bias[E * 2 * I] = {0};
    tkd_test_st_entry e[5];
    pair_entries(e, "model.layers.0.mlp.experts.gate_up_proj_blocks", "model.layers.0.mlp.experts.gate_up_proj_scales",
                 E, 2 * I, D / 32, gu_b, gu_s);
    pair_entries(e + 2, "model.layers.0.mlp.experts.down_proj_blocks", "model.layers.0.mlp.experts.down_proj_scales",
                 E, 37, I / 32, dn_b, dn_s);
    e[4] = (tkd_test_st_entry){"model.layers.0.mlp.experts.gate_up_proj_bias", "F32", 2, {E, 2 * I}, bias, sizeof bias};
    tkd_test_write_st(path, e, 5);
    tkd_st_dir *d = open_st(path);
    check_layout(d, "model.layers.0.mlp.experts.gate_up_proj", E, 2 * I, D / 32, gu_b, gu_s);
    check_layout(d, "model.layers.0.mlp.experts.down_proj", E, 37, I / 32, dn_b, dn_s);
    int found = 1;
    int64_t shape[3];
    assert_int_equal(tkd_mxfp4_probe(d, "model.layers.0.mlp.experts.gate_up_proj_bias", &found, shape), TKD_OK);
    assert_int_equal(found, 0); /* a bias is stored as itself */
    tkd_st_close(d);
}

/* ---- broken pairs ------------------------------------------------------------------------------ */

/* Writes entries to a fresh file and expects probe and read of "w" to fail with want and frags. */
static void expect_pair_error(const char *dir, const tkd_test_st_entry *e, int n, tkd_status want,
                              const char *const *frags)
{
    const char *path = tkd_test_path(dir, "bad.safetensors");
    tkd_test_write_st(path, e, n);
    tkd_st_dir *d = open_st(path);
    int found = 0;
    int64_t shape[3] = {2, 64, 3};
    float f[2 * 64 * 3];
    tkd_test_expect_error(tkd_mxfp4_probe(d, "w", &found, shape), want, frags);
    tkd_test_expect_error(tkd_mxfp4_read(d, "w", shape, TKD_DTYPE_F32, f, 2 * 64 * 3), want, frags);
    tkd_st_close(d);
}

static void test_broken_pairs(void **state)
{
    const char *dir = *state;
    uint8_t b[2 * 3 * 2 * 17] = {0}, s[2 * 3 * 3] = {0};
    tkd_test_st_entry e[2];
    pair_entries(e, "w_blocks", "w_scales", 2, 3, 2, b, s);
    expect_pair_error(dir, e, 1, TKD_ERR_FORMAT,
                      TKD_TEST_FRAGS("bad.safetensors", "'w_blocks' has no partner 'w_scales'"));
    expect_pair_error(dir, e + 1, 1, TKD_ERR_FORMAT, TKD_TEST_FRAGS("'w_scales' has no partner 'w_blocks'"));

    tkd_test_st_entry x[2];
    memcpy(x, e, sizeof x);
    x[0].dtype = "I32", x[0].shape[3] = 4; /* the same bytes as I32 (2, 3, 2, 4) */
    expect_pair_error(dir, x, 2, TKD_ERR_FORMAT, TKD_TEST_FRAGS("'w_blocks' is I32, but MXFP4 blocks are U8"));
    memcpy(x, e, sizeof x);
    x[1].dtype = "I32", x[1].ndim = 2, x[1].shape[0] = 3, x[1].shape[1] = 1, x[1].nbytes = 12;
    expect_pair_error(dir, x, 2, TKD_ERR_FORMAT, TKD_TEST_FRAGS("'w_scales' is I32, but MXFP4 scales are U8"));
    memcpy(x, e, sizeof x);
    x[0].shape[3] = 17, x[0].nbytes = 2 * 3 * 2 * 17;
    expect_pair_error(dir, x, 2, TKD_ERR_FORMAT,
                      TKD_TEST_FRAGS("'w_blocks' has shape [2, 3, 2, 17]", "last dimension must be 16"));
    memcpy(x, e, sizeof x);
    x[0].ndim = 3, x[0].shape[0] = 6; /* (6, 2, 16): the same bytes without the expert dim */
    x[0].shape[1] = 2, x[0].shape[2] = 16;
    expect_pair_error(dir, x, 2, TKD_ERR_FORMAT, TKD_TEST_FRAGS("'w_blocks' has shape [6, 2, 16]", "4-D"));
    memcpy(x, e, sizeof x);
    x[1].shape[2] = 3, x[1].nbytes = 2 * 3 * 3; /* scales (2, 3, 3) for blocks (2, 3, 2, 16) */
    expect_pair_error(dir, x, 2, TKD_ERR_FORMAT,
                      TKD_TEST_FRAGS("'w_scales' has shape [2, 3, 3]", "'w_blocks' of shape [2, 3, 2, 16]",
                                     "needs scales [2, 3, 2]"));
}

static void test_read_errors(void **state)
{
    const char *path = tkd_test_path(*state, "m.safetensors");
    uint8_t b[2 * 3 * 2 * 16] = {0}, s[2 * 3 * 2];
    memset(s, 127, sizeof s);
    s[(1 * 3 + 2) * 2 + 0] = 0xFF; /* expert 1, row 2, group 0 */
    tkd_test_st_entry e[2];
    pair_entries(e, "w_blocks", "w_scales", 2, 3, 2, b, s);
    tkd_test_write_st(path, e, 2);
    tkd_st_dir *d = open_st(path);
    float f[2 * 64 * 3];
    int64_t good[3] = {2, 64, 3}, bad[3] = {2, 3, 64};
    tkd_test_expect_error(tkd_mxfp4_read(d, "w", bad, TKD_DTYPE_F32, f, 2 * 64 * 3), TKD_ERR_MISMATCH,
                          TKD_TEST_FRAGS("m.safetensors", "'w_blocks'/'w_scales' dequantise to [2, 64, 3]",
                                         "expected [2, 3, 64]", "config.json"));
    tkd_test_expect_error(tkd_mxfp4_read(d, "w", good, TKD_DTYPE_F32, f, 10), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("384 elements", "holds 10"));
    tkd_test_expect_error(tkd_mxfp4_read(d, "w", good, TKD_DTYPE_I32, f, 2 * 64 * 3), TKD_ERR_INVALID_ARG,
                          TKD_TEST_FRAGS("F32 or BF16, not I32"));
    tkd_test_expect_error(tkd_mxfp4_read(d, "w", good, TKD_DTYPE_F32, f, 2 * 64 * 3), TKD_ERR_FORMAT,
                          TKD_TEST_FRAGS("m.safetensors: tensors 'w_blocks'/'w_scales'", "block [1, 2, 0]",
                                         "0xFF"));
    tkd_st_close(d);
}

/* ---- quantization_config ----------------------------------------------------------------------- */

static tkd_status parse_qc(const char *json, tkd_mxfp4_quant *q)
{
    cJSON *root = cJSON_Parse(json);
    assert_non_null(root);
    q->mxfp4 = 7; /* parse must reset it */
    tkd_status st = tkd_mxfp4_quant_parse(cJSON_GetObjectItemCaseSensitive(root, "quantization_config"),
                                          "cfg/config.json", q);
    cJSON_Delete(root);
    return st;
}

static void test_quant_config(void **state)
{
    (void)state;
    tkd_mxfp4_quant q;
    assert_int_equal(parse_qc("{\"quantization_config\": {\"modules_to_not_convert\": [\"model.layers.*.self_attn\","
                              " \"model.layers.*.mlp.router\", \"model.embed_tokens\", \"lm_head\"],"
                              " \"quant_method\": \"mxfp4\", \"some_future_key\": 3}}",
                              &q),
                     TKD_OK);
    assert_int_equal(q.mxfp4, 1);
    assert_int_equal(q.dequantize, 0);
    assert_int_equal(q.n_not_convert, 4);
    assert_string_equal(q.not_convert[0], "model.layers.*.self_attn");
    assert_string_equal(q.not_convert[3], "lm_head");
    tkd_mxfp4_quant_free(&q);
    assert_int_equal(q.n_not_convert, 0);
    tkd_mxfp4_quant_free(NULL);

    assert_int_equal(parse_qc("{\"quantization_config\": {\"quant_method\": \"mxfp4\", \"dequantize\": true,"
                              " \"modules_to_not_convert\": null}}", &q), TKD_OK);
    assert_true(q.mxfp4 == 1 && q.dequantize == 1 && q.n_not_convert == 0);
    tkd_mxfp4_quant_free(&q);
    assert_int_equal(parse_qc("{\"vocab_size\": 3}", &q), TKD_OK); /* no quantization_config */
    assert_int_equal(q.mxfp4, 0);
    assert_int_equal(parse_qc("{\"quantization_config\": null}", &q), TKD_OK);
    assert_int_equal(q.mxfp4, 0);

    tkd_test_expect_error(parse_qc("{\"quantization_config\": {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\"}}", &q),
                          TKD_ERR_UNSUPPORTED, TKD_TEST_FRAGS("cfg/config.json", "quant_method \"fp8\"", "mxfp4"));
    assert_int_equal(q.mxfp4, 0);
    tkd_test_expect_error(parse_qc("{\"quantization_config\": [1]}", &q), TKD_ERR_FORMAT,
                          TKD_TEST_FRAGS("\"quantization_config\" must be an object"));
    tkd_test_expect_error(parse_qc("{\"quantization_config\": {\"bits\": 4}}", &q), TKD_ERR_FORMAT,
                          TKD_TEST_FRAGS("\"quantization_config.quant_method\" must be a string"));
    tkd_test_expect_error(parse_qc("{\"quantization_config\": {\"quant_method\": \"mxfp4\", \"dequantize\": 1}}", &q),
                          TKD_ERR_FORMAT, TKD_TEST_FRAGS("\"quantization_config.dequantize\""));
    tkd_test_expect_error(parse_qc("{\"quantization_config\": {\"quant_method\": \"mxfp4\","
                                   " \"modules_to_not_convert\": \"lm_head\"}}", &q),
                          TKD_ERR_FORMAT, TKD_TEST_FRAGS("modules_to_not_convert\" must be a list"));
    tkd_test_expect_error(parse_qc("{\"quantization_config\": {\"quant_method\": \"mxfp4\","
                                   " \"modules_to_not_convert\": [\"lm_head\", 3]}}", &q),
                          TKD_ERR_FORMAT, TKD_TEST_FRAGS("modules_to_not_convert\"[1] is not a string"));
    assert_true(q.mxfp4 == 0 && q.n_not_convert == 0 && q.not_convert == NULL); /* nothing half-filled */
}

/* ---- against transformers (tests/mxfp4_reference.py) ------------------------------------------- */

#define FIX_DIR TKD_SOURCE_DIR "/tests/fixtures/mxfp4"

/* expected.safetensors's <stem>.<what> against our read of <stem> from model.safetensors, bitwise. */
static void compare_expected(tkd_st_dir *model, tkd_st_dir *exp, const char *stem, const char *what, int required)
{
    char name[600];
    snprintf(name, sizeof name, "%s.%s", stem, what);
    const tkd_st_tensor *t = tkd_st_find(exp, name);
    if (!t) {
        if (required)
            fail_msg("%s/expected.safetensors: no '%s' (rerun tests/mxfp4_reference.py)", FIX_DIR, name);
        return;
    }
    int found = 0;
    int64_t shape[3];
    assert_int_equal(tkd_mxfp4_probe(model, stem, &found, shape), TKD_OK);
    assert_int_equal(found, 1);
    if (t->ndim != 3 || t->shape[0] != shape[0] || t->shape[1] != shape[1] || t->shape[2] != shape[2])
        fail_msg("'%s' has another shape than our (%lld, %lld, %lld)", name, (long long)shape[0],
                 (long long)shape[1], (long long)shape[2]);
    size_t n = (size_t)(shape[0] * shape[1] * shape[2]);
    int bf = t->dtype == TKD_DTYPE_BF16;
    assert_true(bf || t->dtype == TKD_DTYPE_F32);
    uint32_t *ours = malloc(4 * n), *theirs = malloc(4 * n);
    assert_true(ours && theirs);
    if (bf) {
        uint16_t *h = malloc(2 * n);
        assert_non_null(h);
        assert_int_equal(tkd_mxfp4_read(model, stem, shape, TKD_DTYPE_BF16, h, n), TKD_OK);
        for (size_t i = 0; i < n; i++) {
            uint16_t x;
            memcpy(&x, (const uint8_t *)t->data + 2 * i, 2);
            ours[i] = h[i], theirs[i] = x;
        }
        free(h);
    } else {
        assert_int_equal(tkd_mxfp4_read(model, stem, shape, TKD_DTYPE_F32, (float *)ours, n), TKD_OK);
        memcpy(theirs, t->data, 4 * n);
    }
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; i++)
        if (ours[i] != theirs[i] && bad++ == 0)
            first = i;
    if (bad)
        fail_msg("%s: %zu of %zu elements differ; first at flat index %zu (ours 0x%x, transformers 0x%x)", name, bad,
                 n, first, ours[first], theirs[first]);
    print_message("%s: %zu elements equal bit for bit\n", name, n);
    free(ours);
    free(theirs);
}

static void test_transformers_fixture(void **state)
{
    (void)state;
    tkd_st_dir *model = NULL, *exp = NULL;
    assert_int_equal(tkd_st_open(FIX_DIR "/model.safetensors", &model), TKD_OK);
    assert_int_equal(tkd_st_open(FIX_DIR "/expected.safetensors", &exp), TKD_OK);
    int pairs = 0;
    for (int i = 0; i < tkd_st_count(model); i++) {
        const char *nm = tkd_st_at(model, i)->name;
        size_t len = strlen(nm);
        if (len < 8 || strcmp(nm + len - 7, "_blocks") != 0)
            continue;
        char stem[512];
        snprintf(stem, sizeof stem, "%.*s", (int)(len - 7), nm);
        compare_expected(model, exp, stem, "f32", 1);     /* convert_moe_packed_tensors(dtype=float32) */
        compare_expected(model, exp, stem, "bf16", 1);    /* its default dtype */
        compare_expected(model, exp, stem, "loaded", 0);  /* the parameter from_pretrained made, if written */
        pairs++;
    }
    assert_true(pairs >= 2);
    tkd_st_close(model);
    tkd_st_close(exp);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "fixtures") == 0)
        return TKD_TEST_RUN_WITH(NULL, NULL, TKD_TEST_EACH_NONE, test_transformers_fixture);
    return TKD_TEST_RUN_WITH(NULL, NULL, TKD_TEST_EACH_DIR, test_all_codes_all_scales, test_device_bits, test_spot_values,
                             test_nibble_order, test_random_rows, test_refused_blocks, test_transposed_by_hand,
                             test_gpt_oss_layout, test_broken_pairs, test_read_errors, test_quant_config);
}
