/* json_check.h — the check on parsed JSON that cJSON does not make: duplicate keys.
 *
 * cJSON keeps every pair of an object that repeats a key, and its lookups return the first, so a
 * config.json with "vocab_size" twice was read with the first value while Python's json (and so
 * transformers) takes the last. Every JSON file we read (config.json, safetensors headers and
 * indexes, checkpoint state) is checked with tkd_json_unique_keys right after parsing.
 */
#ifndef TKD_JSON_CHECK_H
#define TKD_JSON_CHECK_H

#include <cjson/cJSON.h>
#include <stddef.h>

#include "common/status.h"

/* TKD_OK when no object in root repeats a key; else TKD_ERR_FORMAT
 * "path:line:col: duplicate key "k" (first at line L)", positions found in text (len bytes), the
 * JSON root was parsed from. */
tkd_status tkd_json_unique_keys(const cJSON *root, const char *text, size_t len, const char *path);

/* 1-based line and column of byte offset off in text (len bytes), for parse errors. */
void tkd_json_line_col(const char *text, size_t len, size_t off, int *line, int *col);

#endif /* TKD_JSON_CHECK_H */
