/* config.c — see config.h. YAML is read with libyaml's document API (yaml_parser_load), so node
 * marks give line:column for every error; values from defaults and --set go through the same
 * parser, so one set of type rules applies everywhere. Here: reading (files, --set, defaults), the
 * schema check, comparing and freeing; writing a config back out is config_print.c. */
#include "common/config.h"

#include "common/fileio.h"
#include "common/yaml_check.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

#include "common/config_internal.h"

/* Where values come from, for messages: a file (name:line:col) or one --set / default text. */
typedef struct src_ctx {
    const char *name;  /* file name, or "--set k=v", or "default of 'k'" */
    bool is_file;
    int *first_line;   /* per field: line (1-based) where this file first set it; NULL for --set */
} src_ctx;

/* ---- small helpers -------------------------------------------------------------------------- */

static void *field_ptr(const tkd_config_field *f, void *cfg) { return (char *)cfg + f->offset; }

static const char *loc(const src_ctx *ctx, const yaml_node_t *node, char *buf, size_t cap)
{
    if (!ctx->is_file || !node)
        return ctx->name;
    snprintf(buf, cap, "%s:%zu:%zu", ctx->name, node->start_mark.line + 1,
             node->start_mark.column + 1);
    return buf;
}

static const char *scalar_text(const yaml_node_t *n) { return (const char *)n->data.scalar.value; }

static bool is_plain(const yaml_node_t *n)
{
    return n->type == YAML_SCALAR_NODE && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
}

bool tkd_config_is_null_word(const char *s)
{
    return !*s || !strcmp(s, "~") || !strcmp(s, "null") || !strcmp(s, "Null") || !strcmp(s, "NULL");
}

/* A YAML null: an empty value, ~ or null written without quotes. */
bool is_null(const yaml_node_t *n) { return is_plain(n) && tkd_config_is_null_word(scalar_text(n)); }

static const char *node_kind(const yaml_node_t *n)
{
    if (n->type == YAML_MAPPING_NODE)
        return "a mapping";
    if (n->type == YAML_SEQUENCE_NODE)
        return "a sequence";
    return NULL;
}

static char *dup_n(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = '\0';
    }
    return d;
}

static void strlist_clear(tkd_strlist *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->items[i]);
    free(l->items);
    l->items = NULL;
    l->n = 0;
}

/* Numbers in messages: integers without a fraction, others shortest-ish. */
void tkd_config_fmt_num(char *buf, size_t cap, double v, bool integer)
{
    if (integer)
        snprintf(buf, cap, "%.0f", v);
    else
        snprintf(buf, cap, "%g", v);
}


const char *tkd_config_type_name(tkd_config_type type)
{
    switch (type) {
    case TKD_CONFIG_INT: return "int";
    case TKD_CONFIG_INT64: return "int64";
    case TKD_CONFIG_FLOAT: return "float";
    case TKD_CONFIG_BOOL: return "bool";
    case TKD_CONFIG_STRING: return "string";
    case TKD_CONFIG_ENUM: return "enum";
    case TKD_CONFIG_STRING_LIST: return "string list";
    }
    return "?";
}

/* ---- "did you mean" ------------------------------------------------------------------------- */

static size_t edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    if (la > 64 || lb > 64)
        return (size_t)-1;
    size_t row[65];
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

const char *tkd_config_suggest(const char *word, const char *const *cands, size_t ncands)
{
    size_t limit = strlen(word) / 3;
    if (limit < 1)
        limit = 1;
    const char *best = NULL;
    size_t best_d = limit + 1;
    for (size_t i = 0; i < ncands; i++) {
        size_t d = edit_distance(word, cands[i]);
        if (d == 0)
            continue; /* the word itself: "did you mean" what was typed helps nobody */
        if (d < best_d) {
            best_d = d;
            best = cands[i];
        }
    }
    return best;
}

/* ---- schema lookup -------------------------------------------------------------------------- */

const tkd_config_field *tkd_config_find(const tkd_config_schema *schema, const char *key)
{
    for (size_t i = 0; i < schema->nfields; i++)
        if (!strcmp(schema->fields[i].key, key))
            return &schema->fields[i];
    return NULL;
}

static bool has_prefix(const char *key, const char *prefix, size_t n)
{
    return strncmp(key, prefix, n) == 0 && key[n] == '.';
}

/* True when some key lives under "section." */
static bool is_section(const tkd_config_schema *schema, const char *section)
{
    size_t n = strlen(section);
    for (size_t i = 0; i < schema->nfields; i++)
        if (has_prefix(schema->fields[i].key, section, n))
            return true;
    return false;
}

/* Distinct first segments of the keys under prefix ("" = top level), in schema order. Returns the
 * count; names[] point into a caller buffer. */
static size_t children(const tkd_config_schema *schema, const char *prefix, char *buf, size_t cap,
                       const char **names, size_t max_names)
{
    size_t plen = strlen(prefix), used = 0, n = 0;
    for (size_t i = 0; i < schema->nfields && n < max_names; i++) {
        const char *k = schema->fields[i].key;
        if (plen) {
            if (!has_prefix(k, prefix, plen))
                continue;
            k += plen + 1;
        }
        size_t seg = strcspn(k, ".");
        bool seen = false;
        for (size_t j = 0; j < n && !seen; j++)
            seen = strlen(names[j]) == seg && !strncmp(names[j], k, seg);
        if (seen || used + seg + 1 > cap)
            continue;
        memcpy(buf + used, k, seg);
        buf[used + seg] = '\0';
        names[n++] = buf + used;
        used += seg + 1;
    }
    return n;
}

void tkd_config_join_names(char *out, size_t cap, const char *const *names, size_t n)
{
    size_t used = 0;
    out[0] = '\0';
    for (size_t i = 0; i < n && used < cap; i++)
        used += (size_t)snprintf(out + used, cap - used, "%s%s", i ? ", " : "", names[i]);
}

/* Builds "unknown key" for full key `key` whose last segment is `name` under `prefix`. */
static tkd_status unknown_key(const tkd_config_schema *schema, const char *where,
                              const char *prefix, const char *name, const char *key)
{
    char buf[2048], list[768], hint[KEY_MAX + 32] = "";
    const char *names[128];
    size_t n = children(schema, prefix, buf, sizeof buf, names, 128);
    const char *close = tkd_config_suggest(name, names, n);
    if (close) {
        snprintf(hint, sizeof hint, " (did you mean '%s%s%s'?)", prefix, *prefix ? "." : "", close);
    } else {
        /* the right name at the wrong level: "temperature" for "kd.temperature" */
        for (size_t i = 0; i < schema->nfields; i++) {
            const char *k = schema->fields[i].key;
            size_t lk = strlen(k), ln = strlen(name);
            if (lk > ln && k[lk - ln - 1] == '.' && !strcmp(k + lk - ln, name)) {
                snprintf(hint, sizeof hint, " (did you mean '%s'?)", k);
                break;
            }
        }
    }
    tkd_config_join_names(list, sizeof list, names, n);
    if (*prefix)
        return tkd_error_set(TKD_ERR_CONFIG, "%s: unknown key '%s'%s; keys allowed under '%s': %s",
                             where, key, hint, prefix, list);
    return tkd_error_set(TKD_ERR_CONFIG, "%s: unknown key '%s'%s; keys allowed at the top level: %s",
                         where, key, hint, list);
}

/* ---- value conversion ----------------------------------------------------------------------- */

static tkd_status type_error(const char *where, const tkd_config_field *f, const char *want,
                             const yaml_node_t *n)
{
    const char *kind = node_kind(n);
    if (kind)
        return tkd_error_set(TKD_ERR_CONFIG, "%s: %s: expected %s, got %s", where, f->key, want, kind);
    return tkd_error_set(TKD_ERR_CONFIG, "%s: %s: expected %s, got '%s'", where, f->key, want,
                         scalar_text(n));
}

static tkd_status range_check(const char *where, const tkd_config_field *f, double v,
                              const char *text)
{
    if (!f->ranged || (v >= f->min && v <= f->max))
        return TKD_OK;
    char lo[64], hi[64];
    tkd_config_fmt_num(lo, sizeof lo, f->min, tkd_config_is_int_type(f->type));
    tkd_config_fmt_num(hi, sizeof hi, f->max, tkd_config_is_int_type(f->type));
    return tkd_error_set(TKD_ERR_CONFIG, "%s: %s = %s is out of range; it must be in [%s, %s]",
                         where, f->key, text, lo, hi);
}

/* Integers: decimal, or a decimal float spelling of an exact integer ("1e6") up to 2^53. A value
 * strtoll cannot hold is refused, never saturated; so are strtod's hex floats ("0x1p3"). */
static bool parse_int64(const char *s, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (*s && !*end && !errno && !isspace((unsigned char)*s)) {
        *out = v;
        return true;
    }
    if (s[strspn(s, "0123456789+-.eE")] != '\0')
        return false;
    double d = strtod(s, &end);
    if (!*s || *end || isspace((unsigned char)*s) || !isfinite(d) || d != floor(d) ||
        fabs(d) > 9007199254740992.0)
        return false;
    *out = (int64_t)d;
    return true;
}

static bool parse_double(const char *s, double *out)
{
    char *end;
    errno = 0;
    double d = strtod(s, &end);
    if (!*s || *end || isspace((unsigned char)*s) || errno == ERANGE || !isfinite(d))
        return false;
    *out = d;
    return true;
}

static bool parse_bool(const char *s, bool *out)
{
    static const char *const yes[] = {"true", "yes", "on"}, *const no[] = {"false", "no", "off"};
    for (int i = 0; i < 3; i++) {
        if (!strcasecmp(s, yes[i]))
            return *out = true, true;
        if (!strcasecmp(s, no[i]))
            return *out = false, true;
    }
    return false;
}

static tkd_status set_number(const tkd_config_field *f, void *cfg, const yaml_node_t *n,
                             const char *where)
{
    if (!is_plain(n) || is_null(n)) {
        const char *want = f->type == TKD_CONFIG_FLOAT ? "a number" : "an integer";
        if (n->type == YAML_SCALAR_NODE && !is_null(n) && !is_plain(n))
            return tkd_error_set(TKD_ERR_CONFIG, "%s: %s: expected %s, got the quoted string '%s'",
                                 where, f->key, want, scalar_text(n));
        return type_error(where, f, want, n);
    }
    const char *s = scalar_text(n);
    if (f->type == TKD_CONFIG_FLOAT) {
        double d;
        if (!parse_double(s, &d))
            return type_error(where, f, "a finite number", n);
        TKD_TRY(range_check(where, f, d, s));
        *(double *)field_ptr(f, cfg) = d;
        return TKD_OK;
    }
    int64_t v;
    if (!parse_int64(s, &v))
        return type_error(where, f, "an integer", n);
    if (f->type == TKD_CONFIG_INT && (v < -2147483647 - 1 || v > 2147483647))
        return tkd_error_set(TKD_ERR_CONFIG, "%s: %s = %s does not fit a 32-bit int", where, f->key, s);
    TKD_TRY(range_check(where, f, (double)v, s));
    if (f->type == TKD_CONFIG_INT)
        *(int *)field_ptr(f, cfg) = (int)v;
    else
        *(int64_t *)field_ptr(f, cfg) = v;
    return TKD_OK;
}

static tkd_status set_enum(const tkd_config_field *f, void *cfg, const yaml_node_t *n,
                           const char *where)
{
    char list[512];
    size_t na = 0;
    while (f->allowed[na])
        na++;
    tkd_config_join_names(list, sizeof list, f->allowed, na);
    if (n->type != YAML_SCALAR_NODE)
        return tkd_error_set(TKD_ERR_CONFIG, "%s: %s: expected one of: %s; got %s", where, f->key,
                             list, node_kind(n));
    for (size_t i = 0; i < na; i++) {
        if (!strcmp(scalar_text(n), f->allowed[i])) {
            *(int *)field_ptr(f, cfg) = (int)i;
            return TKD_OK;
        }
    }
    return tkd_error_set(TKD_ERR_CONFIG, "%s: %s: '%s' is not one of: %s", where, f->key,
                         scalar_text(n), list);
}

static tkd_status set_string(const tkd_config_field *f, void *cfg, const yaml_node_t *n,
                             const char *where)
{
    if (n->type != YAML_SCALAR_NODE)
        return type_error(where, f, "a string", n);
    const char *s = is_null(n) ? "" : scalar_text(n);
    char *d = dup_n(s, is_null(n) ? 0 : n->data.scalar.length);
    if (!d)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: %s: out of memory", where, f->key);
    char **slot = field_ptr(f, cfg);
    free(*slot);
    *slot = d;
    return TKD_OK;
}

static tkd_status set_list(const tkd_config_field *f, void *cfg, yaml_document_t *doc,
                           const yaml_node_t *n, const src_ctx *ctx)
{
    char lbuf[1100];
    const char *where = loc(ctx, n, lbuf, sizeof lbuf);
    tkd_strlist l = {0};
    if (n->type == YAML_MAPPING_NODE)
        return type_error(where, f, "a string or a list of strings", n);
    if (n->type == YAML_SCALAR_NODE && !is_null(n)) {
        l.items = malloc(sizeof *l.items);
        if (!l.items || !(l.items[0] = dup_n(scalar_text(n), n->data.scalar.length))) {
            free(l.items);
            return tkd_error_set(TKD_ERR_NOMEM, "%s: %s: out of memory", where, f->key);
        }
        l.n = 1;
    } else if (n->type == YAML_SEQUENCE_NODE) {
        size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
        l.items = cnt ? calloc(cnt, sizeof *l.items) : NULL;
        if (cnt && !l.items)
            return tkd_error_set(TKD_ERR_NOMEM, "%s: %s: out of memory", where, f->key);
        for (size_t i = 0; i < cnt; i++) {
            yaml_node_t *it = yaml_document_get_node(doc, n->data.sequence.items.start[i]);
            if (it->type != YAML_SCALAR_NODE) {
                strlist_clear(&l);
                return type_error(loc(ctx, it, lbuf, sizeof lbuf), f, "a list of strings", it);
            }
            bool nul = is_null(it);
            if (!(l.items[l.n] = dup_n(nul ? "" : scalar_text(it), nul ? 0 : it->data.scalar.length))) {
                strlist_clear(&l);
                return tkd_error_set(TKD_ERR_NOMEM, "%s: %s: out of memory", where, f->key);
            }
            l.n++;
        }
    }
    tkd_strlist *slot = field_ptr(f, cfg);
    strlist_clear(slot);
    *slot = l;
    return TKD_OK;
}

/* Converts node into field f of cfg with f's type rules. at: the node whose position messages
 * give (the key for an empty value, whose own mark points past any following comment). */
static tkd_status set_field(const tkd_config_field *f, void *cfg, yaml_document_t *doc,
                            const yaml_node_t *n, const yaml_node_t *at, const src_ctx *ctx)
{
    char lbuf[1100];
    const char *where = loc(ctx, at, lbuf, sizeof lbuf);
    switch (f->type) {
    case TKD_CONFIG_INT:
    case TKD_CONFIG_INT64:
    case TKD_CONFIG_FLOAT:
        return set_number(f, cfg, n, where);
    case TKD_CONFIG_BOOL: {
        bool b;
        if (!is_plain(n) || !parse_bool(scalar_text(n), &b))
            return type_error(where, f, "true or false", n);
        *(bool *)field_ptr(f, cfg) = b;
        return TKD_OK;
    }
    case TKD_CONFIG_STRING:
        return set_string(f, cfg, n, where);
    case TKD_CONFIG_ENUM:
        return set_enum(f, cfg, n, where);
    case TKD_CONFIG_STRING_LIST:
        return set_list(f, cfg, doc, n, ctx);
    }
    return tkd_error_set(TKD_ERR_INTERNAL, "%s: %s: unknown field type", where, f->key);
}

/* ---- YAML documents ------------------------------------------------------------------------- */

static tkd_status syntax_error(const yaml_parser_t *p, const src_ctx *ctx)
{
    const char *what = p->problem ? p->problem : "malformed YAML";
    const char *context = p->context ? p->context : NULL;
    if (ctx->is_file)
        return tkd_error_set(TKD_ERR_CONFIG, "%s:%zu:%zu: YAML syntax error: %s%s%s%s", ctx->name,
                             p->problem_mark.line + 1, p->problem_mark.column + 1, what,
                             context ? " (" : "", context ? context : "", context ? ")" : "");
    return tkd_error_set(TKD_ERR_CONFIG, "%s: YAML syntax error at column %zu: %s", ctx->name,
                         p->problem_mark.column + 1, what);
}

static tkd_status too_deep(const yaml_mark_t *m, const src_ctx *ctx)
{
    if (ctx->is_file)
        return tkd_error_set(TKD_ERR_CONFIG, "%s:%zu:%zu: YAML nested deeper than %d levels — no setting needs that",
                             ctx->name, m->line + 1, m->column + 1, TKD_YAML_MAX_DEPTH);
    return tkd_error_set(TKD_ERR_CONFIG, "%s: YAML nested deeper than %d levels at column %zu", ctx->name,
                         TKD_YAML_MAX_DEPTH, m->column + 1);
}

/* Loads the single document of text (len bytes) into doc. On success the caller deletes doc. */
static tkd_status load_document(const char *text, size_t len, yaml_document_t *doc, const src_ctx *ctx)
{
    yaml_mark_t deep;
    if (tkd_yaml_too_deep(text, len, TKD_YAML_MAX_DEPTH, &deep))
        return too_deep(&deep, ctx);
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: cannot initialise the YAML parser", ctx->name);
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    tkd_status st = TKD_OK;
    yaml_document_t extra;
    if (!yaml_parser_load(&p, doc)) {
        st = syntax_error(&p, ctx);
    } else if (!yaml_parser_load(&p, &extra)) {
        yaml_document_delete(doc);
        st = syntax_error(&p, ctx);
    } else {
        yaml_node_t *root2 = yaml_document_get_root_node(&extra);
        if (root2) {
            char lbuf[1100];
            st = tkd_error_set(TKD_ERR_CONFIG, "%s: a second YAML document starts here; put all keys in one",
                               loc(ctx, root2, lbuf, sizeof lbuf));
            yaml_document_delete(doc);
        }
        yaml_document_delete(&extra);
    }
    yaml_parser_delete(&p);
    return st;
}

static tkd_status apply_mapping(const tkd_config_schema *schema, void *cfg, yaml_document_t *doc,
                                yaml_node_t *map, const char *prefix, const src_ctx *ctx);

/* One "key: value" pair of a mapping under prefix. */
static tkd_status apply_pair(const tkd_config_schema *schema, void *cfg, yaml_document_t *doc,
                             yaml_node_t *kn, yaml_node_t *vn, const char *prefix,
                             const src_ctx *ctx)
{
    char lbuf[1100], key[KEY_MAX];
    const char *where = loc(ctx, kn, lbuf, sizeof lbuf);
    if (kn->type != YAML_SCALAR_NODE)
        return tkd_error_set(TKD_ERR_CONFIG, "%s: a key must be a plain name, got %s", where,
                             node_kind(kn));
    const char *name = scalar_text(kn);
    if ((size_t)snprintf(key, sizeof key, "%s%s%s", prefix, *prefix ? "." : "", name) >= sizeof key)
        return tkd_error_set(TKD_ERR_CONFIG, "%s: key '%.40s...' is too long", where, name);
    const tkd_config_field *f = tkd_config_find(schema, key);
    if (f) {
        int *first = &ctx->first_line[f - schema->fields];
        if (*first)
            return tkd_error_set(TKD_ERR_CONFIG, "%s: duplicate key '%s' (first set at line %d)",
                                 where, key, *first);
        *first = (int)kn->start_mark.line + 1;
        bool empty = is_null(vn) && vn->data.scalar.length == 0;
        return set_field(f, cfg, doc, vn, empty ? kn : vn, ctx);
    }
    if (!is_section(schema, key))
        return unknown_key(schema, where, prefix, name, key);
    if (is_null(vn))
        return TKD_OK; /* "kd:" with nothing under it */
    if (vn->type != YAML_MAPPING_NODE) {
        char buf[1024], list[768];
        const char *names[128];
        size_t n = children(schema, key, buf, sizeof buf, names, 128);
        tkd_config_join_names(list, sizeof list, names, n);
        return tkd_error_set(TKD_ERR_CONFIG, "%s: '%s' is a section; expected a mapping of: %s",
                             loc(ctx, vn, lbuf, sizeof lbuf), key, list);
    }
    return apply_mapping(schema, cfg, doc, vn, key, ctx);
}

static tkd_status apply_mapping(const tkd_config_schema *schema, void *cfg, yaml_document_t *doc,
                                yaml_node_t *map, const char *prefix, const src_ctx *ctx)
{
    yaml_node_pair_t *start = map->data.mapping.pairs.start, *top = map->data.mapping.pairs.top;
    for (yaml_node_pair_t *p = start; p < top; p++) {
        yaml_node_t *kn = yaml_document_get_node(doc, p->key);
        yaml_node_t *vn = yaml_document_get_node(doc, p->value);
        /* a repeated section ("kd:" twice) is a duplicate even when its keys differ */
        for (yaml_node_pair_t *q = start; q < p && kn->type == YAML_SCALAR_NODE; q++) {
            yaml_node_t *qk = yaml_document_get_node(doc, q->key);
            if (qk->type == YAML_SCALAR_NODE && !strcmp(scalar_text(qk), scalar_text(kn))) {
                char lbuf[1100];
                return tkd_error_set(TKD_ERR_CONFIG, "%s: duplicate key '%s%s%s' (first at line %zu)",
                                     loc(ctx, kn, lbuf, sizeof lbuf), prefix, *prefix ? "." : "",
                                     scalar_text(kn), qk->start_mark.line + 1);
            }
        }
        TKD_TRY(apply_pair(schema, cfg, doc, kn, vn, prefix, ctx));
    }
    return TKD_OK;
}

tkd_status tkd_config_apply_string(const tkd_config_schema *schema, void *cfg, const char *name,
                                   const char *text, size_t len)
{
    int *first = calloc(schema->nfields ? schema->nfields : 1, sizeof *first);
    if (!first)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", name);
    src_ctx ctx = {name, true, first};
    yaml_document_t doc;
    tkd_status st = load_document(text, len, &doc, &ctx);
    if (st == TKD_OK) {
        yaml_node_t *root = yaml_document_get_root_node(&doc);
        if (root && !is_null(root)) {
            if (root->type != YAML_MAPPING_NODE) {
                char lbuf[1100];
                st = tkd_error_set(TKD_ERR_CONFIG, "%s: expected a mapping of keys at the top level",
                                   loc(&ctx, root, lbuf, sizeof lbuf));
            } else {
                st = apply_mapping(schema, cfg, &doc, root, "", &ctx);
            }
        }
        yaml_document_delete(&doc);
    }
    free(first);
    return st;
}

tkd_status tkd_config_apply_file(const tkd_config_schema *schema, void *cfg, const char *path)
{
    void *text = NULL;
    size_t len = 0;
    TKD_TRY(tkd_read_input(path, "config file", &text, &len));
    tkd_status st = tkd_config_apply_string(schema, cfg, path, text, len);
    free(text);
    return st;
}

/* Parses text as one YAML value and stores it in f (defaults and --set values). */
static tkd_status set_from_text(const tkd_config_field *f, void *cfg, const char *text,
                                const char *name)
{
    src_ctx ctx = {name, false, NULL};
    yaml_document_t doc;
    tkd_status st = load_document(text, strlen(text), &doc, &ctx);
    if (st == TKD_OK) {
        yaml_node_t *root = yaml_document_get_root_node(&doc);
        if (root) {
            st = set_field(f, cfg, &doc, root, root, &ctx);
        } else {
            /* empty text: an empty plain scalar, i.e. null */
            yaml_node_t empty = {0};
            empty.type = YAML_SCALAR_NODE;
            empty.data.scalar.value = (yaml_char_t *)"";
            empty.data.scalar.style = YAML_PLAIN_SCALAR_STYLE;
            st = set_field(f, cfg, &doc, &empty, &empty, &ctx);
        }
        yaml_document_delete(&doc);
    }
    return st;
}

tkd_status tkd_config_apply_set(const tkd_config_schema *schema, void *cfg, const char *assignment)
{
    const char *eq = strchr(assignment, '=');
    if (!eq || eq == assignment)
        return tkd_error_set(TKD_ERR_CONFIG, "--set %s: expected key=value, e.g. --set kd.temperature=2",
                             assignment);
    char key[KEY_MAX], name[KEY_MAX + 64];
    size_t klen = (size_t)(eq - assignment);
    if (klen >= sizeof key)
        return tkd_error_set(TKD_ERR_CONFIG, "--set %.40s...: key too long", assignment);
    memcpy(key, assignment, klen);
    key[klen] = '\0';
    const tkd_config_field *f = tkd_config_find(schema, key);
    if (!f && is_section(schema, key)) {
        char buf[1024], list[768];
        const char *names[128];
        tkd_config_join_names(list, sizeof list, names, children(schema, key, buf, sizeof buf, names, 128));
        return tkd_error_set(TKD_ERR_CONFIG, "--set %s: '%s' is a section, not a key; set one of its keys: %s",
                             key, key, list);
    }
    if (!f) {
        snprintf(name, sizeof name, "--set %s", key);
        const char *dot = strrchr(key, '.');
        char prefix[KEY_MAX] = "";
        if (dot) {
            memcpy(prefix, key, (size_t)(dot - key));
            prefix[dot - key] = '\0';
            if (is_section(schema, prefix))
                return unknown_key(schema, name, prefix, dot + 1, key);
        }
        /* no such section: suggest among all full keys */
        const char **all = malloc((schema->nfields ? schema->nfields : 1) * sizeof *all);
        if (!all)
            return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", name);
        for (size_t i = 0; i < schema->nfields; i++)
            all[i] = schema->fields[i].key;
        const char *close = tkd_config_suggest(key, all, schema->nfields);
        free(all);
        if (close)
            return tkd_error_set(TKD_ERR_CONFIG, "%s: unknown key '%s' (did you mean '%s'?); --help lists all keys",
                                 name, key, close);
        return unknown_key(schema, name, "", key, key);
    }
    snprintf(name, sizeof name, "--set %s", assignment);
    return set_from_text(f, cfg, eq + 1, name);
}

/* ---- schema check, defaults, free ----------------------------------------------------------- */

static bool key_chars_ok(const char *k)
{
    if (!*k || *k == '.' || k[strlen(k) - 1] == '.' || strstr(k, ".."))
        return false;
    for (; *k; k++)
        if (!isalnum((unsigned char)*k) && *k != '_' && *k != '-' && *k != '.')
            return false;
    return true;
}

tkd_status tkd_config_check_schema(const tkd_config_schema *schema)
{
    const tkd_config_field *F = schema->fields;
    for (size_t i = 0; i < schema->nfields; i++) {
        const char *k = F[i].key;
        if (!k || !key_chars_ok(k) || strlen(k) >= KEY_MAX)
            return tkd_error_set(TKD_ERR_INTERNAL, "config schema field %zu: bad key '%s'", i,
                                 k ? k : "(null)");
        if (F[i].type == TKD_CONFIG_ENUM && (!F[i].allowed || !F[i].allowed[0]))
            return tkd_error_set(TKD_ERR_INTERNAL, "config schema: %s: enum without allowed values", k);
        bool needs_def = F[i].type != TKD_CONFIG_STRING && F[i].type != TKD_CONFIG_STRING_LIST;
        if (needs_def && !F[i].def)
            return tkd_error_set(TKD_ERR_INTERNAL, "config schema: %s: needs a default", k);
        if (F[i].ranged && F[i].min > F[i].max)
            return tkd_error_set(TKD_ERR_INTERNAL, "config schema: %s: min > max", k);
        for (size_t j = 0; j < i; j++) {
            const char *o = F[j].key;
            if (!strcmp(o, k))
                return tkd_error_set(TKD_ERR_INTERNAL, "config schema: key '%s' appears twice", k);
            if (has_prefix(k, o, strlen(o)) || has_prefix(o, k, strlen(k)))
                return tkd_error_set(TKD_ERR_INTERNAL,
                                     "config schema: '%s' is both a key and a section ('%s')",
                                     strlen(o) < strlen(k) ? o : k, strlen(o) < strlen(k) ? k : o);
        }
        /* every section of k must be contiguous, so printing never repeats a mapping */
        for (const char *dot = strchr(k, '.'); dot && i > 0; dot = strchr(dot + 1, '.')) {
            size_t plen = (size_t)(dot - k);
            if (has_prefix(F[i - 1].key, k, plen))
                continue;
            for (size_t j = 0; j + 1 < i; j++)
                if (has_prefix(F[j].key, k, plen))
                    return tkd_error_set(TKD_ERR_INTERNAL,
                                         "config schema: keys under '%.*s' are not adjacent ('%s')",
                                         (int)plen, k, k);
        }
    }
    return TKD_OK;
}

tkd_status tkd_config_defaults(const tkd_config_schema *schema, void *cfg)
{
    TKD_TRY(tkd_config_check_schema(schema));
    for (size_t i = 0; i < schema->nfields; i++) {
        const tkd_config_field *f = &schema->fields[i];
        char name[KEY_MAX + 32];
        snprintf(name, sizeof name, "default of '%s'", f->key);
        tkd_status st = set_from_text(f, cfg, f->def ? f->def : "", name);
        if (st != TKD_OK)
            return tkd_error_prefix(st == TKD_ERR_NOMEM ? st : TKD_ERR_INTERNAL, "config schema");
    }
    return TKD_OK;
}

tkd_status tkd_config_load(const tkd_config_schema *schema, void *cfg, const char *path,
                           const char *const *sets, size_t nsets)
{
    TKD_TRY(tkd_config_defaults(schema, cfg));
    if (path)
        TKD_TRY(tkd_config_apply_file(schema, cfg, path));
    for (size_t i = 0; i < nsets; i++)
        TKD_TRY(tkd_config_apply_set(schema, cfg, sets[i]));
    return TKD_OK;
}

void tkd_config_free(const tkd_config_schema *schema, void *cfg)
{
    for (size_t i = 0; i < schema->nfields; i++) {
        const tkd_config_field *f = &schema->fields[i];
        if (f->type == TKD_CONFIG_STRING) {
            char **s = field_ptr(f, cfg);
            free(*s);
            *s = NULL;
        } else if (f->type == TKD_CONFIG_STRING_LIST) {
            strlist_clear(field_ptr(f, cfg));
        }
    }
}

bool tkd_config_equal(const tkd_config_schema *schema, const void *a, const void *b)
{
    for (size_t i = 0; i < schema->nfields; i++) {
        const tkd_config_field *f = &schema->fields[i];
        const void *pa = tkd_config_field_cptr(f, a), *pb = tkd_config_field_cptr(f, b);
        switch (f->type) {
        case TKD_CONFIG_INT:
        case TKD_CONFIG_ENUM:
            if (*(const int *)pa != *(const int *)pb)
                return false;
            break;
        case TKD_CONFIG_INT64:
            if (*(const int64_t *)pa != *(const int64_t *)pb)
                return false;
            break;
        case TKD_CONFIG_FLOAT:
            if (*(const double *)pa != *(const double *)pb)
                return false;
            break;
        case TKD_CONFIG_BOOL:
            if (*(const bool *)pa != *(const bool *)pb)
                return false;
            break;
        case TKD_CONFIG_STRING: {
            const char *sa = *(char *const *)pa, *sb = *(char *const *)pb;
            if (strcmp(sa ? sa : "", sb ? sb : ""))
                return false;
            break;
        }
        case TKD_CONFIG_STRING_LIST: {
            const tkd_strlist *la = pa, *lb = pb;
            if (la->n != lb->n)
                return false;
            for (size_t j = 0; j < la->n; j++)
                if (strcmp(la->items[j], lb->items[j]))
                    return false;
            break;
        }
        }
    }
    return true;
}

