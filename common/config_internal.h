/* config_internal.h — what the config reader (config.c: YAML, --set, the schema) and the config
 * printer (config_print.c: --print-config, --help) share. Only those two files include it.
 */
#ifndef TKD_CONFIG_INTERNAL_H
#define TKD_CONFIG_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>

#include "common/config.h"

#define KEY_MAX 256

static inline const void *tkd_config_field_cptr(const tkd_config_field *f, const void *cfg)
{
    return (const char *)cfg + f->offset;
}

static inline bool tkd_config_is_int_type(tkd_config_type t) { return t == TKD_CONFIG_INT || t == TKD_CONFIG_INT64; }

/* A word YAML reads as null when it is written without quotes: "", ~, null, Null, NULL. */
bool tkd_config_is_null_word(const char *s);
/* Numbers in messages: integers without a fraction, others shortest-ish. */
void tkd_config_fmt_num(char *buf, size_t cap, double v, bool integer);
/* names[0, n) joined with ", " into out (capacity cap, truncated). */
void tkd_config_join_names(char *out, size_t cap, const char *const *names, size_t n);

#endif
