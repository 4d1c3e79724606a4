/* fuzz_hf_config.c — libFuzzer target for config.json (formats/hf_config.c, cJSON underneath).
 * Built and run by scripts/fuzz.sh.
 *
 * The property: any text either gives a valid model config or is refused with TKD_ERR_FORMAT,
 * TKD_ERR_CONFIG or TKD_ERR_UNSUPPORTED (TKD_ERR_NOMEM) and a one-line message; a config that
 * reads writes back as a config.json that reads to the same values, its sliding windows included. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "formats/hf_config.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const tkd_status refusals[] = {TKD_ERR_FORMAT, TKD_ERR_CONFIG, TKD_ERR_UNSUPPORTED, TKD_ERR_NOMEM};
    tkd_model_config c, back;
    tkd_status st = tkd_hf_config_parse((const char *)data, size, "config.json", &c);
    if (st != TKD_OK) {
        tkd_fuzz_expect_refusal(st, refusals, 4);
        return 0;
    }
    const char *path = tkd_fuzz_write_file(".json", (const uint8_t *)"", 0);
    if (tkd_hf_config_write(path, &c, "float32") != TKD_OK || tkd_hf_config_read(path, &back) != TKD_OK) {
        fprintf(stderr, "fuzz: a config that read does not round-trip: %s\n", tkd_error_msg());
        abort();
    }
    if (back.vocab_size != c.vocab_size || back.hidden_size != c.hidden_size || back.arch != c.arch ||
        back.num_key_value_heads != c.num_key_value_heads || back.head_dim != c.head_dim ||
        back.rope_theta != c.rope_theta || back.rope_scaling != c.rope_scaling ||
        back.tie_word_embeddings != c.tie_word_embeddings || back.sliding_window != c.sliding_window ||
        memcmp(back.layer_sliding, c.layer_sliding, sizeof c.layer_sliding) != 0 ||
        memcmp(back.layer_moe, c.layer_moe, sizeof c.layer_moe) != 0 ||
        (tkd_model_config_has_moe(&c) &&
         (back.num_experts != c.num_experts || back.num_experts_per_tok != c.num_experts_per_tok ||
          back.moe_intermediate_size != c.moe_intermediate_size || back.norm_topk_prob != c.norm_topk_prob)))
        abort();
    return 0;
}
