/* test_status.c — status names are stable and messages compose. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "common/half.h"
#include "common/status.h"
#include "tests/testutil.h"

static void test_error_set_and_prefix(void **state)
{
    (void)state;
    tkd_status st = tkd_error_set(TKD_ERR_FORMAT, "bad magic %d", 7);
    assert_int_equal(st, TKD_ERR_FORMAT);
    assert_string_equal(tkd_error_msg(), "bad magic 7");
    tkd_error_prefix(st, "shard-%05d.h5", 3);
    assert_string_equal(tkd_error_msg(), "shard-00003.h5: bad magic 7");
    assert_string_equal(tkd_status_name(TKD_ERR_CHECKSUM), "TKD_ERR_CHECKSUM");
    assert_int_equal(TKD_ERR_NOSPACE, -13); /* values are part of the contract */
    tkd_error_clear();
    assert_string_equal(tkd_error_msg(), "");
}

static void test_error_hint_and_save(void **state)
{
    (void)state;
    tkd_error_set(TKD_ERR_CHECKSUM, "shard-00001.h5: checksum mismatch");
    assert_int_equal(tkd_error_hint(TKD_ERR_CHECKSUM, "re-run teacher-dump %s", "cfg.yaml"), TKD_ERR_CHECKSUM);
    assert_string_equal(tkd_error_msg(), "shard-00001.h5: checksum mismatch \xe2\x80\x94 re-run teacher-dump cfg.yaml");
    tkd_error_saved keep;
    tkd_error_save(&keep, TKD_ERR_CHECKSUM);
    tkd_error_set(TKD_ERR_IO, "cleanup said something else");
    assert_int_equal(tkd_error_restore(&keep), TKD_ERR_CHECKSUM);
    assert_string_equal(tkd_error_msg(), "shard-00001.h5: checksum mismatch \xe2\x80\x94 re-run teacher-dump cfg.yaml");
    /* a message at the limit keeps its own text rather than a cut hint */
    char big[TKD_ERROR_MSG_MAX];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    tkd_error_set(TKD_ERR_IO, "%s", big);
    tkd_error_hint(TKD_ERR_IO, "hint");
    assert_int_equal(strlen(tkd_error_msg()), TKD_ERROR_MSG_MAX - 1);
    assert_null(strstr(tkd_error_msg(), "hint"));
}

/* Quoted input with a newline (a JSON key "\nvocab_size", found by fuzz_hf_config) must not split
 * the message: control characters print as '?' through set, prefix and hint. */
static void test_messages_stay_one_line(void **state)
{
    (void)state;
    tkd_error_set(TKD_ERR_FORMAT, "duplicate key \"%s\"", "\nvocab\tsize\r\x7f");
    assert_string_equal(tkd_error_msg(), "duplicate key \"?vocab?size??\"");
    tkd_error_prefix(TKD_ERR_FORMAT, "a\nb.json");
    assert_string_equal(tkd_error_msg(), "a?b.json: duplicate key \"?vocab?size??\"");
    tkd_error_hint(TKD_ERR_FORMAT, "fix %s", "line\n2");
    assert_string_equal(tkd_error_msg(), "a?b.json: duplicate key \"?vocab?size??\" \xe2\x80\x94 fix line?2");
}

static void test_half_roundtrip_exhaustive(void **state)
{
    (void)state;
    /* every finite half and every bf16 survives half -> float -> half */
    for (uint32_t h = 0; h < 65536; h++) {
        if (((h >> 10) & 0x1f) != 0x1f)
            assert_int_equal(tkd_f32_to_f16(tkd_f16_to_f32((uint16_t)h)), h);
        if (((h >> 7) & 0xff) != 0xff)
            assert_int_equal(tkd_f32_to_bf16(tkd_bf16_to_f32((uint16_t)h)), h);
    }
    /* round to nearest even at a tie: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 */
    assert_int_equal(tkd_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
    assert_int_equal(tkd_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
    assert_int_equal(tkd_f32_to_f16(65520.0f), 0x7c00);  /* overflow to inf */
    assert_int_equal(tkd_f32_to_f16(1e4f), 0x70e2);
}

TKD_TEST_MAIN(test_error_set_and_prefix, test_error_hint_and_save, test_messages_stay_one_line,
              test_half_roundtrip_exhaustive)
