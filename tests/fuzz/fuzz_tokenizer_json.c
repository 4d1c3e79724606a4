/* fuzz_tokenizer_json.c — libFuzzer target for tokenizer.json (formats/tokenizer*.c, cJSON
 * underneath): the input is the tokenizer.json of a directory without a tokenizer_config.json.
 * Built and run by scripts/fuzz.sh; the property is fuzz_tokenizer.h's. */
#include <stddef.h>
#include <stdint.h>

#include "tests/fuzz/fuzz_tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tkd_fuzz_tok_write("tokenizer.json", data, size);
    tkd_fuzz_tok_check(data, size);
    return 0;
}
