/* config.h — typed configuration structs loaded from YAML through a static schema.
 *
 * A tool declares its settings once, as a struct plus a static array of field descriptors (the
 * schema). From that schema this module fills defaults, applies a YAML file (libyaml), applies
 * `--set a.b=value` overrides, prints the effective config as YAML (which loads back to the same
 * struct) and prints --help. Nested YAML mappings map to dotted keys: `kd: {temperature: 2}` sets
 * "kd.temperature".
 *
 * Storage per type (the member named in the descriptor must have exactly this C type; the
 * TKD_CFG_* macros check it at compile time):
 *   TKD_CONFIG_INT          int
 *   TKD_CONFIG_INT64        int64_t
 *   TKD_CONFIG_FLOAT        double
 *   TKD_CONFIG_BOOL         bool
 *   TKD_CONFIG_STRING       char *      owned (malloc'd), never NULL after tkd_config_defaults
 *   TKD_CONFIG_ENUM         int         index into the field's `allowed` list (YAML holds the name)
 *   TKD_CONFIG_STRING_LIST  tkd_strlist owned; YAML: a sequence of scalars or a single scalar
 *
 * Errors are TKD_ERR_CONFIG with a one-line message starting with "file:line:column: " (1-based),
 * or "--set key=value: " for overrides. The struct stays valid (every owned string is owned) after
 * an error but may be partly updated: free it with tkd_config_free.
 *
 * Library code: nothing here prints except to the FILE* the caller passes.
 */
#ifndef TKD_CONFIG_H
#define TKD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/status.h"

typedef enum tkd_config_type {
    TKD_CONFIG_INT,
    TKD_CONFIG_INT64,
    TKD_CONFIG_FLOAT,
    TKD_CONFIG_BOOL,
    TKD_CONFIG_STRING,
    TKD_CONFIG_ENUM,
    TKD_CONFIG_STRING_LIST,
} tkd_config_type;

/* A list of owned strings (items[0..n), each malloc'd; items malloc'd; NULL when n == 0). */
typedef struct tkd_strlist {
    char **items;
    size_t n;
} tkd_strlist;

typedef struct tkd_config_field {
    const char *key;             /* dotted path, e.g. "kd.temperature" */
    tkd_config_type type;
    size_t offset;               /* offsetof(struct, member) */
    const char *def;             /* default, written as YAML would be ("2.0", "[a, b]", "renorm");
                                  * NULL = "" / empty list; required for numbers, bools, enums */
    bool ranged;                 /* numbers: check min <= value <= max (inclusive) */
    double min, max;
    const char *const *allowed;  /* ENUM: NULL-terminated list of names */
    const char *help;            /* one sentence for --help */
} tkd_config_field;

typedef struct tkd_config_schema {
    const char *tool;               /* e.g. "student-train"; used in --help and --print-config */
    const tkd_config_field *fields; /* fields sharing a dotted prefix must be adjacent */
    size_t nfields;
} tkd_config_schema;

/* Compile-time check that member m of T has C type CT (no code is generated). */
#define TKD_CFG_OFFSET_(T, m, CT) (offsetof(T, m) + 0 * sizeof(&((T *)0)->m == (CT *)0))

#define TKD_CFG_INT(T, m, key, def, lo, hi, help) \
    { key, TKD_CONFIG_INT, TKD_CFG_OFFSET_(T, m, int), def, true, lo, hi, NULL, help }
#define TKD_CFG_INT64(T, m, key, def, lo, hi, help) \
    { key, TKD_CONFIG_INT64, TKD_CFG_OFFSET_(T, m, int64_t), def, true, lo, hi, NULL, help }
#define TKD_CFG_FLOAT(T, m, key, def, lo, hi, help) \
    { key, TKD_CONFIG_FLOAT, TKD_CFG_OFFSET_(T, m, double), def, true, lo, hi, NULL, help }
#define TKD_CFG_BOOL(T, m, key, def, help) \
    { key, TKD_CONFIG_BOOL, TKD_CFG_OFFSET_(T, m, bool), def, false, 0, 0, NULL, help }
#define TKD_CFG_STRING(T, m, key, def, help) \
    { key, TKD_CONFIG_STRING, TKD_CFG_OFFSET_(T, m, char *), def, false, 0, 0, NULL, help }
/* allowed: a `static const char *const names[] = {"a", "b", NULL};` */
#define TKD_CFG_ENUM(T, m, key, def, allowed, help) \
    { key, TKD_CONFIG_ENUM, TKD_CFG_OFFSET_(T, m, int), def, false, 0, 0, allowed, help }
#define TKD_CFG_STRING_LIST(T, m, key, def, help) \
    { key, TKD_CONFIG_STRING_LIST, TKD_CFG_OFFSET_(T, m, tkd_strlist), def, false, 0, 0, NULL, help }

#define TKD_CONFIG_SCHEMA(tool, fields) { tool, fields, sizeof(fields) / sizeof((fields)[0]) }

/* Checks the schema itself (unique keys, no key that is also a prefix of another, prefixes
 * adjacent, defaults that parse and lie in range). Returns TKD_ERR_INTERNAL naming the bad field.
 * tkd_config_defaults calls it; tests call it directly. */
tkd_status tkd_config_check_schema(const tkd_config_schema *schema);

/* Sets every field of cfg to its default. cfg must be zero-initialised (`= {0}`) or freed with
 * tkd_config_free: owned strings already there are freed and replaced. */
tkd_status tkd_config_defaults(const tkd_config_schema *schema, void *cfg);

/* Applies a YAML file on top of cfg (keys not in the file keep their value). An empty file is fine. */
tkd_status tkd_config_apply_file(const tkd_config_schema *schema, void *cfg, const char *path);

/* Applies YAML text (name is used in messages in place of a file name). */
tkd_status tkd_config_apply_string(const tkd_config_schema *schema, void *cfg, const char *name,
                                   const char *yaml, size_t len);

/* Applies one override "a.b=value"; value is read as a YAML value with the same type rules as the
 * file ("[x, y]" is a list, quotes make strings). An unknown key is an error naming "--set a.b". */
tkd_status tkd_config_apply_set(const tkd_config_schema *schema, void *cfg, const char *assignment);

/* Defaults, then the file (when path != NULL), then each override in order. */
tkd_status tkd_config_load(const tkd_config_schema *schema, void *cfg, const char *path,
                           const char *const *sets, size_t nsets);

/* Writes cfg as a YAML document that tkd_config_apply_file reads back to an equal struct. */
tkd_status tkd_config_print(const tkd_config_schema *schema, const void *cfg, FILE *out);

/* The same YAML document as a malloc'd string in *out (the caller frees it; NULL on error), e.g. to
 * save the effective config inside another file. */
tkd_status tkd_config_to_text(const tkd_config_schema *schema, const void *cfg, char **out);

/* Writes the key reference: every key with its type, default, range or allowed values, help. */
void tkd_config_print_help(const tkd_config_schema *schema, FILE *out);

/* True when every field of a and b is equal (floats compared exactly; NaN never occurs). */
bool tkd_config_equal(const tkd_config_schema *schema, const void *a, const void *b);

/* The descriptor for a dotted key, or NULL. */
const tkd_config_field *tkd_config_find(const tkd_config_schema *schema, const char *key);

/* Frees owned strings and lists of cfg and sets them to NULL/empty. Safe on a zeroed struct and
 * when called twice. */
void tkd_config_free(const tkd_config_schema *schema, void *cfg);

/* The candidate closest to word by edit distance, when close enough to be a likely typo (distance
 * <= max(1, strlen/3)); NULL otherwise. A candidate equal to word is never the answer. Used for
 * "did you mean" hints (also by cli.c). */
const char *tkd_config_suggest(const char *word, const char *const *cands, size_t ncands);

/* Name of a type for messages and help ("int", "float", "string list", ...). */
const char *tkd_config_type_name(tkd_config_type type);

#endif /* TKD_CONFIG_H */
