/* fuzz_megatron.c — libFuzzer target for the Megatron-LM index parser
 * (tkd_tokens_parse_megatron_index in formats/tokens_megatron.c), fed the fuzz input as the .idx bytes.
 *
 * Not built by CMake. Build and run it from the repository root with clang's libFuzzer:
 *
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -I. -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE \
 *       tests/fuzz/fuzz_megatron.c formats/tokens*.c common/status.c common/sha256.c common/fileio.c \
 *       common/signals.c -o /tmp/fuzz_mm
 *   mkdir -p /tmp/mm_corpus && cp tests/data/broken/tok_mm_*.idx /tmp/mm_corpus/
 *   /tmp/fuzz_mm -max_total_time=60 -max_len=4096 /tmp/mm_corpus
 *
 * The property: an index either is refused with TKD_ERR_FORMAT or TKD_ERR_UNSUPPORTED and a one-line
 * message naming it, or it parses, and then
 *   - it parses again, identically, against a .bin of exactly data_bytes bytes, and is refused with
 *     TKD_ERR_FORMAT naming the .bin against one byte fewer or more;
 *   - data_bytes = num_tokens * token_bytes, and the views lie inside the input;
 *   - document_indices run from 0 to num_sequences without decreasing, and sequence s starts at
 *     byte pointers[s] = the sum of the sizes before it.
 * Nothing crashes, reads outside the input or leaks.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "formats/tokens.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void refused_properly(tkd_status st, const char *name)
{
    const char *msg = tkd_error_msg();
    if ((st != TKD_ERR_FORMAT && st != TKD_ERR_UNSUPPORTED) || !strstr(msg, name) || strchr(msg, '\n'))
        abort();
}

static int64_t at64(const uint8_t *p, int64_t i)
{
    int64_t v;
    memcpy(&v, p + 8 * i, 8);
    return v;
}

/* The layout invariants of an accepted index (see the property above). */
static void check_accepted(const tkd_megatron_index *mi, const uint8_t *data, size_t size)
{
    if (mi->data_bytes != (uint64_t)mi->num_tokens * (uint64_t)mi->token_bytes)
        abort();
    if (mi->sizes < data || mi->doc_idx + 8 * (mi->num_documents + 1) > data + size)
        abort();
    if (at64(mi->doc_idx, 0) != 0 || at64(mi->doc_idx, mi->num_documents) != mi->num_sequences)
        abort();
    for (int64_t d = 1; d <= mi->num_documents; d++)
        if (at64(mi->doc_idx, d) < at64(mi->doc_idx, d - 1))
            abort();
    int64_t at = 0;
    for (int64_t s = 0; s < mi->num_sequences; s++) {
        int32_t n;
        memcpy(&n, mi->sizes + 4 * s, 4);
        if (n < 0 || at64(mi->pointers, s) != at)
            abort();
        at += (int64_t)n * mi->token_bytes;
    }
    if ((uint64_t)at != mi->data_bytes)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tkd_megatron_index mi, again;
    tkd_status st = tkd_tokens_parse_megatron_index("fuzz.idx", data, size, "fuzz.bin", TKD_MEGATRON_BIN_UNKNOWN, &mi);
    if (st != TKD_OK) {
        refused_properly(st, "fuzz.idx");
        return 0;
    }
    check_accepted(&mi, data, size);
    if (tkd_tokens_parse_megatron_index("fuzz.idx", data, size, "fuzz.bin", mi.data_bytes, &again) != TKD_OK ||
        memcmp(&mi, &again, sizeof mi) != 0)
        abort();
    uint64_t wrong[2] = {mi.data_bytes + 1, mi.data_bytes - 1}; /* no "one fewer" below 0 bytes */
    for (int i = 0; i < (mi.data_bytes > 0 ? 2 : 1); i++) {
        st = tkd_tokens_parse_megatron_index("fuzz.idx", data, size, "fuzz.bin", wrong[i], &again);
        if (st != TKD_ERR_FORMAT || !strstr(tkd_error_msg(), "fuzz.bin"))
            abort();
    }
    return 0;
}
