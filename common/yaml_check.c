/* yaml_check.c — see yaml_check.h. */
#include "common/yaml_check.h"

#include <stdlib.h>
#include <string.h>

bool tkd_yaml_too_deep(const char *text, size_t len, int max_depth, yaml_mark_t *mark)
{
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p))
        return false; /* out of memory: the loader will say so */
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    int depth = 0;
    bool deep = false, done = false;
    while (!done && !deep) {
        yaml_event_t ev;
        if (!yaml_parser_parse(&p, &ev))
            break;
        if (ev.type == YAML_SEQUENCE_START_EVENT || ev.type == YAML_MAPPING_START_EVENT) {
            deep = ++depth > max_depth;
            *mark = ev.start_mark;
        } else if (ev.type == YAML_SEQUENCE_END_EVENT || ev.type == YAML_MAPPING_END_EVENT) {
            depth--;
        }
        done = ev.type == YAML_STREAM_END_EVENT;
        yaml_event_delete(&ev);
    }
    yaml_parser_delete(&p);
    return deep;
}

/* A scalar key node, compared by its bytes (which may hold NULs) and then by position. */
static int cmp_key(const void *a, const void *b)
{
    const yaml_node_t *x = *(const yaml_node_t *const *)a, *y = *(const yaml_node_t *const *)b;
    size_t lx = x->data.scalar.length, ly = y->data.scalar.length;
    int c = memcmp(x->data.scalar.value, y->data.scalar.value, lx < ly ? lx : ly);
    if (c || lx != ly)
        return c ? c : lx < ly ? -1 : 1;
    return x->start_mark.index < y->start_mark.index ? -1 : x->start_mark.index > y->start_mark.index;
}

static bool same_key(const yaml_node_t *x, const yaml_node_t *y)
{
    return x->data.scalar.length == y->data.scalar.length &&
           memcmp(x->data.scalar.value, y->data.scalar.value, x->data.scalar.length) == 0;
}

/* Sorting the keys makes a mapping of n keys cost n log n, not n² (a hostile file may hold many). */
static bool map_duplicate(yaml_document_t *doc, const yaml_node_t *map, const yaml_node_t **keys,
                          const yaml_node_t **first, const yaml_node_t **second)
{
    size_t n = 0;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        const yaml_node_t *k = yaml_document_get_node(doc, p->key);
        if (k && k->type == YAML_SCALAR_NODE)
            keys[n++] = k;
    }
    qsort(keys, n, sizeof *keys, cmp_key);
    for (size_t i = 1; i < n; i++) {
        if (same_key(keys[i - 1], keys[i])) {
            *first = keys[i - 1];
            *second = keys[i];
            return true;
        }
    }
    return false;
}

bool tkd_yaml_duplicate_key(yaml_document_t *doc, const yaml_node_t **first, const yaml_node_t **second)
{
    size_t most = 0;
    for (yaml_node_t *n = doc->nodes.start; n < doc->nodes.top; n++)
        if (n->type == YAML_MAPPING_NODE && (size_t)(n->data.mapping.pairs.top - n->data.mapping.pairs.start) > most)
            most = (size_t)(n->data.mapping.pairs.top - n->data.mapping.pairs.start);
    if (most < 2)
        return false;
    const yaml_node_t **keys = malloc(most * sizeof *keys);
    bool dup = false;
    for (yaml_node_t *n = doc->nodes.start; keys && !dup && n < doc->nodes.top; n++)
        if (n->type == YAML_MAPPING_NODE)
            dup = map_duplicate(doc, n, keys, first, second);
    free(keys);
    return dup;
}
