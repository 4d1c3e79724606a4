/* fuzz_tokens.c — libFuzzer target for token files (formats/tokens*.c): the .npy header dict and the
 * llm.c .bin header, from a file holding the fuzz input. Built and run by scripts/fuzz.sh.
 *
 * The property: any file either opens (its windows then read without error) or is refused with
 * TKD_ERR_FORMAT or TKD_ERR_UNSUPPORTED (TKD_ERR_NOMEM) and a one-line message naming it. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "formats/tokens.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const tkd_status refusals[] = {TKD_ERR_FORMAT, TKD_ERR_UNSUPPORTED, TKD_ERR_NOMEM};
    const char *path = tkd_fuzz_write_file(".tok", data, size);
    tkd_tokens *ds = NULL;
    tkd_status st = tkd_tokens_open(path, &ds);
    if (st != TKD_OK) {
        tkd_fuzz_expect_refusal(st, refusals, 3);
        if (ds || !strstr(tkd_error_msg(), path))
            abort();
        return 0;
    }
    int64_t n = tkd_tokens_num_windows(ds, 4, 3, 1);
    int32_t win[5], labels[4];
    for (int64_t i = 0; i < n && i < 64; i++)
        if (tkd_tokens_window(ds, 4, 3, 1, i, win, labels, NULL) != TKD_OK)
            abort();
    tkd_tokens_free(ds);
    return 0;
}
