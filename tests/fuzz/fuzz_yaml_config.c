/* fuzz_yaml_config.c — libFuzzer target for the YAML config loader (common/config.c) with the real
 * schemas of both tools. Built and run by scripts/fuzz.sh.
 *
 * The property: any text either loads or is refused with TKD_ERR_CONFIG (TKD_ERR_NOMEM) and a
 * one-line message; a config that loads prints as YAML that loads back to the same printed text;
 * nothing crashes, leaks or takes long (nesting is bounded). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "student_train/train_config.h"
#include "teacher_cache/dump_config.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The effective config of cfg as YAML text (malloc'd). */
static char *print(const tkd_config_schema *schema, const void *cfg)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f || tkd_config_print(schema, cfg, f) != TKD_OK)
        abort();
    fclose(f);
    return text;
}

static void one_schema(const tkd_config_schema *schema, size_t cfg_size, const char *text, size_t size)
{
    static const tkd_status refusals[] = {TKD_ERR_CONFIG, TKD_ERR_NOMEM};
    void *cfg = calloc(1, cfg_size), *again = calloc(1, cfg_size);
    if (!cfg || !again || tkd_config_defaults(schema, cfg) != TKD_OK || tkd_config_defaults(schema, again) != TKD_OK)
        abort();
    tkd_status st = tkd_config_apply_string(schema, cfg, "fuzz.yaml", text, size);
    if (st != TKD_OK) {
        tkd_fuzz_expect_refusal(st, refusals, 2);
    } else {
        char *out = print(schema, cfg);
        if (tkd_config_apply_string(schema, again, "printed.yaml", out, strlen(out)) != TKD_OK) {
            fprintf(stderr, "fuzz: the printed config does not load back: %s\n%s", tkd_error_msg(), out);
            abort();
        }
        char *out2 = print(schema, again);
        if (strcmp(out, out2) != 0)
            abort(); /* printing is not a fixed point */
        free(out);
        free(out2);
    }
    tkd_config_free(schema, cfg);
    tkd_config_free(schema, again);
    free(cfg);
    free(again);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    one_schema(&tkd_train_schema, sizeof(tkd_train_config), (const char *)data, size);
    one_schema(&tkd_dump_schema, sizeof(tkd_dump_config), (const char *)data, size);
    return 0;
}
