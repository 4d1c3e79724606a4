/* json_check.c — see json_check.h. */
#include "formats/json_check.h"

#include <stdlib.h>
#include <string.h>

/* One key of an object: its name and its rank among all keys of the document, in text order. */
typedef struct key_ref {
    const char *name;
    size_t rank;
} key_ref;

typedef struct dup_found {
    const char *name;
    size_t first, second; /* ranks */
} dup_found;

static int cmp_ref(const void *a, const void *b)
{
    const key_ref *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : x->rank < y->rank ? -1 : x->rank > y->rank;
}

/* Walks the tree in text order (a key, then everything inside its value, then the next key), so
 * *next counts keys as they appear in the text. Sorting each object's keys keeps an object of n keys
 * at n log n. Returns 0, 1 (dup set) or -1 (out of memory). */
static int walk(const cJSON *node, size_t *next, dup_found *dup)
{
    size_t n = 0;
    for (const cJSON *c = node->child; c; c = c->next)
        n++;
    key_ref *refs = cJSON_IsObject(node) && n > 1 ? malloc(n * sizeof *refs) : NULL;
    if (cJSON_IsObject(node) && n > 1 && !refs)
        return -1;
    size_t i = 0;
    int r = 0;
    for (const cJSON *c = node->child; c && r == 0; c = c->next, i++) {
        if (cJSON_IsObject(node) && refs)
            refs[i] = (key_ref){c->string ? c->string : "", *next};
        if (cJSON_IsObject(node))
            ++*next;
        if (cJSON_IsObject(c) || cJSON_IsArray(c))
            r = walk(c, next, dup);
    }
    if (r == 0 && refs) {
        qsort(refs, n, sizeof *refs, cmp_ref);
        for (size_t j = 1; j < n && r == 0; j++)
            if (strcmp(refs[j - 1].name, refs[j].name) == 0) {
                *dup = (dup_found){refs[j].name, refs[j - 1].rank, refs[j].rank};
                r = 1;
            }
    }
    free(refs);
    return r;
}

/* Byte offset of the key of rank `rank` in text: a string followed by ':' is a key, in valid JSON. */
static size_t key_offset(const char *text, size_t len, size_t rank)
{
    size_t k = 0;
    for (size_t i = 0; i < len; i++) {
        if (text[i] != '"')
            continue;
        size_t start = i;
        for (i++; i < len && text[i] != '"'; i++)
            if (text[i] == '\\')
                i++;
        size_t j = i + 1;
        while (j < len && (text[j] == ' ' || text[j] == '\t' || text[j] == '\n' || text[j] == '\r'))
            j++;
        if (j < len && text[j] == ':' && k++ == rank)
            return start;
    }
    return len;
}

void tkd_json_line_col(const char *text, size_t len, size_t off, int *line, int *col)
{
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < off && i < len; i++) {
        if (text[i] == '\n') {
            ++*line;
            *col = 1;
        } else {
            ++*col;
        }
    }
}

tkd_status tkd_json_unique_keys(const cJSON *root, const char *text, size_t len, const char *path)
{
    size_t next = 0;
    dup_found d;
    int r = root ? walk(root, &next, &d) : 0;
    if (r < 0)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory checking JSON keys", path);
    if (r == 0)
        return TKD_OK;
    int l1, c1, l2, c2;
    tkd_json_line_col(text, len, key_offset(text, len, d.first), &l1, &c1);
    tkd_json_line_col(text, len, key_offset(text, len, d.second), &l2, &c2);
    return tkd_error_set(TKD_ERR_FORMAT, "%s:%d:%d: duplicate key \"%.80s\" (first at line %d, column %d)", path,
                         l2, c2, d.name, l1, c1);
}
