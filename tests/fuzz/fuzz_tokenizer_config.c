/* fuzz_tokenizer_config.c — libFuzzer target for tokenizer_config.json (formats/tokenizer.c): the
 * input is the tokenizer_config.json beside a fixed small tokenizer.json whose added tokens are the
 * ones the seeds name. Built and run by scripts/fuzz.sh; the property is fuzz_tokenizer.h's. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "tests/fuzz/fuzz_tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char tokenizer_json[] =
    "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null, \"added_tokens\": ["
    "{\"id\": 5, \"content\": \"<|endoftext|>\", \"special\": true}, {\"id\": 6, \"content\": \"<|im_end|>\"}, "
    "{\"id\": 7, \"content\": \"<|bos|>\", \"special\": true}, {\"id\": 8, \"content\": \"<|eos|>\"}], "
    "\"normalizer\": null, \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false}, "
    "\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<|bos|>\"}}, "
    "{\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {\"<|bos|>\": {\"id\": \"<|bos|>\", \"ids\": [7]}}}, "
    "\"decoder\": {\"type\": \"ByteLevel\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2, "
    "\"\\u0120\": 3, \"\\u0120ab\": 4}, \"merges\": [\"a b\", \"\\u0120 ab\"]}}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int written;
    if (!written++)
        tkd_fuzz_tok_write("tokenizer.json", (const uint8_t *)tokenizer_json, strlen(tokenizer_json));
    tkd_fuzz_tok_write("tokenizer_config.json", data, size);
    tkd_fuzz_tok_check(data, size);
    return 0;
}
