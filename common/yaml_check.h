/* yaml_check.h — checks on YAML input that libyaml does not make, shared by the config loader
 * (common/config.c) and the cache manifest reader (formats/cache_manifest.c).
 *
 * Depth: libyaml's scanner does work proportional to the nesting depth for every token, so N nested
 * flow collections ("[[[[...") take time quadratic in N (100,000 levels: over a minute). Our
 * documents nest a few levels; deeper ones are refused after reading only a little past the first
 * level too many.
 * Duplicate keys: libyaml keeps both pairs of a mapping that repeats a key, and a lookup that stops
 * at the first match would silently ignore the second value; such a mapping is refused instead.
 */
#ifndef TKD_YAML_CHECK_H
#define TKD_YAML_CHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <yaml.h>

/* Deepest nesting of mappings and sequences our YAML readers accept. */
#define TKD_YAML_MAX_DEPTH 64

/* True when text (len bytes) nests collections deeper than max_depth; *mark is then where the
 * first collection one level too deep starts (0-based line and column, as libyaml's marks). False
 * otherwise, also on a syntax error: loading the document reports that one. */
bool tkd_yaml_too_deep(const char *text, size_t len, int max_depth, yaml_mark_t *mark);

/* True when some mapping of doc has two equal scalar keys; *first and *second are then the key
 * nodes, first before second in the text. (Out of memory for the key list counts as none found.) */
bool tkd_yaml_duplicate_key(yaml_document_t *doc, const yaml_node_t **first, const yaml_node_t **second);

#endif /* TKD_YAML_CHECK_H */
