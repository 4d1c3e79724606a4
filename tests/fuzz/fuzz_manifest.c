/* fuzz_manifest.c — libFuzzer target for the cache manifest reader (formats/cache_manifest.c,
 * libyaml underneath). Built and run by scripts/fuzz.sh.
 *
 * The property: any text either reads as a manifest or is refused with TKD_ERR_FORMAT or
 * TKD_ERR_UNSUPPORTED (TKD_ERR_NOMEM) and a one-line message; a manifest that reads writes back as
 * one that reads to the same identity and shard list. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "formats/cache_manifest.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const tkd_status refusals[] = {TKD_ERR_FORMAT, TKD_ERR_UNSUPPORTED, TKD_ERR_NOMEM};
    tkd_cache_manifest m, back;
    tkd_status st = tkd_cache_manifest_parse(&m, "manifest.yaml", (const char *)data, size);
    if (st != TKD_OK) {
        tkd_fuzz_expect_refusal(st, refusals, 3);
        return 0;
    }
    const char *path = tkd_fuzz_write_file(".yaml", (const uint8_t *)"", 0);
    if (tkd_cache_manifest_write(&m, path) != TKD_OK || tkd_cache_manifest_read(&back, path) != TKD_OK) {
        fprintf(stderr, "fuzz: a manifest that read does not round-trip: %s\n", tkd_error_msg());
        abort();
    }
    if (tkd_cache_manifest_check_same(&m, "read", &back, "written") != TKD_OK || back.num_shards != m.num_shards ||
        (m.num_shards && memcmp(back.shards, m.shards, (size_t)m.num_shards * sizeof *m.shards) != 0))
        abort();
    tkd_cache_manifest_free(&m);
    tkd_cache_manifest_free(&back);
    return 0;
}
