/* jinja_value.c — formats/jinja's memory (arena, byte buffer) and runtime values: construction,
 * truthiness, equality, the context read from JSON, and the two ways a value becomes text —
 * str() and tojson — written the way @huggingface/jinja writes them (JavaScript's String() and its
 * toJSON), since the output must match it byte for byte. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/jinja_internal.h"

/* ---- arena ---- */
struct tkd_jarena_block {
    tkd_jarena_block *next;
    size_t used, cap;
    max_align_t data[];
};

void *tkd_jarena_alloc(tkd_jarena *a, size_t n)
{
    n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    tkd_jarena_block *b = a->head;
    if (!b || b->cap - b->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        b = malloc(sizeof *b + cap);
        if (!b)
            return NULL;
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
    }
    void *p = (char *)b->data + b->used;
    b->used += n;
    memset(p, 0, n);
    return p;
}

char *tkd_jarena_strndup(tkd_jarena *a, const char *s, size_t n)
{
    char *p = tkd_jarena_alloc(a, n + 1);
    if (p && n)
        memcpy(p, s, n);
    return p;
}

void tkd_jarena_free(tkd_jarena *a)
{
    while (a->head) {
        tkd_jarena_block *next = a->head->next;
        free(a->head);
        a->head = next;
    }
}

tkd_status tkd_jbuf_put(tkd_jbuf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p)
            return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return TKD_OK;
}

tkd_status tkd_jbuf_putc(tkd_jbuf *b, char c)
{
    return tkd_jbuf_put(b, &c, 1);
}

/* ---- strings ---- */
/* The code point at s[i] and its length in bytes (invalid bytes are taken one at a time). */
static unsigned tkd_jutf8_at(const char *s, size_t n, size_t i, size_t *len)
{
    const unsigned char *u = (const unsigned char *)s + i;
    size_t m = u[0] < 0x80 ? 1 : u[0] >= 0xF0 ? 4 : u[0] >= 0xE0 ? 3 : u[0] >= 0xC0 ? 2 : 1;
    if (i + m > n)
        m = 1;
    unsigned cp = m == 1 ? u[0] : m == 2 ? u[0] & 0x1Fu : m == 3 ? u[0] & 0x0Fu : u[0] & 0x07u;
    for (size_t k = 1; k < m; k++)
        cp = cp << 6 | (u[k] & 0x3Fu);
    *len = m;
    return cp;
}

/* JavaScript's WhiteSpace and LineTerminator, which trim() removes. */
static int tkd_jis_space(unsigned c)
{
    return (c >= 9 && c <= 13) || c == 32 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
           c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000 || c == 0xFEFF;
}

void tkd_jstr_trim(const char *s, size_t n, int left, int right, size_t *start, size_t *end)
{
    size_t i = 0, first = n, last = 0, len;
    while (i < n) {
        unsigned cp = tkd_jutf8_at(s, n, i, &len);
        if (!tkd_jis_space(cp)) {
            if (first == n)
                first = i;
            last = i + len;
        }
        i += len;
    }
    if (first == n) { /* all whitespace */
        *start = left ? n : 0;
        *end = right ? *start : n;
        return;
    }
    *start = left ? first : 0;
    *end = right ? last : n;
}

size_t tkd_jstr_utf16_len(const char *s, size_t n)
{
    size_t units = 0, len;
    for (size_t i = 0; i < n; i += len)
        units += tkd_jutf8_at(s, n, i, &len) >= 0x10000 ? 2 : 1;
    return units;
}

/* ---- values ---- */
tkd_jv *tkd_jv_new(tkd_jarena *a, tkd_jv_type t)
{
    tkd_jv *v = tkd_jarena_alloc(a, sizeof *v);
    if (v)
        v->t = t;
    return v;
}

tkd_jv *tkd_jv_str(tkd_jarena *a, const char *s, size_t n)
{
    tkd_jv *v = tkd_jv_new(a, TKD_JV_STR);
    char *p = v ? tkd_jarena_strndup(a, s, n) : NULL;
    if (!p)
        return NULL;
    v->u.s.p = p;
    v->u.s.n = n;
    return v;
}

tkd_jv *tkd_jv_int(tkd_jarena *a, long long i)
{
    tkd_jv *v = tkd_jv_new(a, TKD_JV_INT);
    if (v)
        v->u.i = i;
    return v;
}

tkd_jv *tkd_jv_bool(tkd_jarena *a, int b)
{
    tkd_jv *v = tkd_jv_new(a, TKD_JV_BOOL);
    if (v)
        v->u.b = !!b;
    return v;
}

static tkd_status tkd_jv_grow(tkd_jarena *a, tkd_jv ***v, size_t n, size_t *cap)
{
    if (n < *cap)
        return TKD_OK;
    size_t c = *cap ? 2 * *cap : 8;
    tkd_jv **p = tkd_jarena_alloc(a, c * sizeof *p);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
    if (n)
        memcpy(p, *v, n * sizeof *p);
    *v = p;
    *cap = c;
    return TKD_OK;
}

tkd_status tkd_jv_list_push(tkd_jarena *a, tkd_jv *l, tkd_jv *v)
{
    TKD_TRY(tkd_jv_grow(a, &l->u.l.v, l->u.l.n, &l->u.l.cap));
    l->u.l.v[l->u.l.n++] = v;
    return TKD_OK;
}

tkd_jv *tkd_jv_dict_get(const tkd_jv *d, const char *k, size_t n)
{
    for (size_t i = 0; i < d->u.d.n; i++) {
        const tkd_jv *key = d->u.d.k[i];
        if (key->u.s.n == n && !memcmp(key->u.s.p, k, n))
            return d->u.d.v[i];
    }
    return NULL;
}

tkd_status tkd_jv_dict_set(tkd_jarena *a, tkd_jv *d, tkd_jv *k, tkd_jv *v)
{
    for (size_t i = 0; i < d->u.d.n; i++) {
        const tkd_jv *key = d->u.d.k[i];
        if (key->u.s.n == k->u.s.n && !memcmp(key->u.s.p, k->u.s.p, k->u.s.n)) {
            d->u.d.v[i] = v;
            return TKD_OK;
        }
    }
    size_t kcap = d->u.d.cap;
    TKD_TRY(tkd_jv_grow(a, &d->u.d.k, d->u.d.n, &kcap));
    TKD_TRY(tkd_jv_grow(a, &d->u.d.v, d->u.d.n, &d->u.d.cap));
    d->u.d.k[d->u.d.n] = k;
    d->u.d.v[d->u.d.n++] = v;
    return TKD_OK;
}

int tkd_jv_truthy(const tkd_jv *v)
{
    switch (v->t) {
    case TKD_JV_BOOL: return v->u.b;
    case TKD_JV_INT: return v->u.i != 0;
    case TKD_JV_FLOAT: return v->u.f != 0 && !isnan(v->u.f);
    case TKD_JV_STR: return v->u.s.n > 0;
    case TKD_JV_LIST: return v->u.l.n > 0;
    case TKD_JV_DICT: return v->u.d.n > 0;
    case TKD_JV_NS:
    case TKD_JV_FUNC: return 1;
    default: return 0;
    }
}

const char *tkd_jv_type_name(const tkd_jv *v)
{
    static const char *names[] = {"undefined", "none", "boolean", "integer", "float",
                                  "string",    "list", "dict",    "namespace", "function"};
    return names[v->t];
}

static int tkd_jv_is_num(const tkd_jv *v)
{
    return v->t == TKD_JV_INT || v->t == TKD_JV_FLOAT || v->t == TKD_JV_BOOL;
}

static double tkd_jv_num(const tkd_jv *v)
{
    return v->t == TKD_JV_INT ? (double)v->u.i : v->t == TKD_JV_FLOAT ? v->u.f : (double)v->u.b;
}

int tkd_jv_strict_eq(const tkd_jv *x, const tkd_jv *y)
{
    int xn = x->t == TKD_JV_INT || x->t == TKD_JV_FLOAT, yn = y->t == TKD_JV_INT || y->t == TKD_JV_FLOAT;
    if (xn && yn)
        return tkd_jv_num(x) == tkd_jv_num(y);
    if (x->t != y->t)
        return 0;
    switch (x->t) {
    case TKD_JV_UNDEF:
    case TKD_JV_NULL: return 1;
    case TKD_JV_BOOL: return x->u.b == y->u.b;
    case TKD_JV_STR: return x->u.s.n == y->u.s.n && !memcmp(x->u.s.p, y->u.s.p, x->u.s.n);
    default: return x == y; /* containers compare by identity, as JavaScript objects do */
    }
}

int tkd_jv_loose_eq(const tkd_jv *x, const tkd_jv *y)
{
    int xnil = x->t == TKD_JV_UNDEF || x->t == TKD_JV_NULL, ynil = y->t == TKD_JV_UNDEF || y->t == TKD_JV_NULL;
    if (xnil || ynil)
        return xnil && ynil;
    if (tkd_jv_is_num(x) && tkd_jv_is_num(y))
        return tkd_jv_num(x) == tkd_jv_num(y);
    if (x->t == TKD_JV_STR && y->t == TKD_JV_STR)
        return tkd_jv_strict_eq(x, y);
    if ((x->t == TKD_JV_STR && tkd_jv_is_num(y)) || (y->t == TKD_JV_STR && tkd_jv_is_num(x))) {
        const tkd_jv *s = x->t == TKD_JV_STR ? x : y, *num = x->t == TKD_JV_STR ? y : x;
        char tmp[64];
        size_t start, end;
        tkd_jstr_trim(s->u.s.p, s->u.s.n, 1, 1, &start, &end);
        if (end - start >= sizeof tmp)
            return 0;
        memcpy(tmp, s->u.s.p + start, end - start);
        tmp[end - start] = 0;
        char *stop;
        double d = end == start ? 0 : strtod(tmp, &stop);
        return (end == start || *stop == 0) && d == tkd_jv_num(num);
    }
    return x == y;
}

/* ---- JSON in ---- */
static tkd_status tkd_jv_from_cjson(tkd_jarena *a, const cJSON *j, tkd_jv **out)
{
    tkd_jv *v = NULL;
    if (cJSON_IsNull(j)) {
        v = tkd_jv_new(a, TKD_JV_NULL);
    } else if (cJSON_IsBool(j)) {
        v = tkd_jv_bool(a, cJSON_IsTrue(j));
    } else if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        /* JavaScript has one number type; the reference makes integers of the integral ones. */
        if (d == floor(d) && fabs(d) < 9007199254740992.0) {
            v = tkd_jv_int(a, (long long)d);
        } else if ((v = tkd_jv_new(a, TKD_JV_FLOAT))) {
            v->u.f = d;
        }
    } else if (cJSON_IsString(j)) {
        v = tkd_jv_str(a, j->valuestring, strlen(j->valuestring));
    } else if (cJSON_IsArray(j) || cJSON_IsObject(j)) {
        v = tkd_jv_new(a, cJSON_IsArray(j) ? TKD_JV_LIST : TKD_JV_DICT);
        for (const cJSON *c = j->child; v && c; c = c->next) {
            tkd_jv *item = NULL;
            TKD_TRY(tkd_jv_from_cjson(a, c, &item));
            if (v->t == TKD_JV_LIST) {
                TKD_TRY(tkd_jv_list_push(a, v, item));
            } else {
                tkd_jv *k = tkd_jv_str(a, c->string, strlen(c->string));
                if (!k)
                    return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
                TKD_TRY(tkd_jv_dict_set(a, v, k, item));
            }
        }
    } else {
        return tkd_error_set(TKD_ERR_FORMAT, "jinja context: unsupported JSON value");
    }
    if (!v)
        return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
    *out = v;
    return TKD_OK;
}

tkd_status tkd_jv_from_json(tkd_jarena *a, const char *json, size_t len, tkd_jv **out)
{
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!root) {
        size_t off = end ? (size_t)(end - json) : 0;
        return tkd_error_set(TKD_ERR_FORMAT, "jinja context: invalid JSON near byte %zu", off);
    }
    tkd_status st = tkd_jv_from_cjson(a, root, out);
    cJSON_Delete(root);
    return st;
}

/* ---- text out ---- */
/* JavaScript's Number.prototype.toString for finite doubles: the shortest digits that read back. */
static void tkd_jnum_js(double d, char *buf, size_t cap)
{
    if (isnan(d)) {
        snprintf(buf, cap, "NaN");
        return;
    }
    if (isinf(d)) {
        snprintf(buf, cap, d < 0 ? "-Infinity" : "Infinity");
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, d);
        if (strtod(buf, NULL) == d)
            break;
    }
    char *e = strchr(buf, 'e');
    if (!e)
        return;
    /* %g switches to exponent form earlier than JavaScript (which uses it from 1e21 and below
     * 1e-6): rewrite in plain digits inside that range. */
    int exp10 = atoi(e + 1);
    if (exp10 >= 21 || exp10 < -6) {
        char mant[32];
        snprintf(mant, sizeof mant, "%.*s", (int)(e - buf), buf);
        snprintf(buf, cap, "%se%s%d", mant, exp10 > 0 ? "+" : "", exp10);
        return;
    }
    snprintf(buf, cap, "%.*f", exp10 < 0 ? -exp10 + 16 : 0, d);
    if (strchr(buf, '.')) {
        size_t n = strlen(buf);
        while (buf[n - 1] == '0')
            buf[--n] = 0;
        if (buf[n - 1] == '.')
            buf[n - 1] = 0;
    }
}

static tkd_status tkd_jjson_str(tkd_jbuf *b, const char *s, size_t n, int ensure_ascii)
{
    TKD_TRY(tkd_jbuf_putc(b, '"'));
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        char esc[16];
        const char *rep = NULL;
        size_t len = 1;
        switch (c) {
        case '"': rep = "\\\""; break;
        case '\\': rep = "\\\\"; break;
        case '\b': rep = "\\b"; break;
        case '\f': rep = "\\f"; break;
        case '\n': rep = "\\n"; break;
        case '\r': rep = "\\r"; break;
        case '\t': rep = "\\t"; break;
        default:
            if (c < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", c);
                rep = esc;
            } else if (ensure_ascii && c >= 0x7F) {
                unsigned cp = tkd_jutf8_at(s, n, i, &len);
                if (cp >= 0x10000) /* JavaScript escapes both UTF-16 halves */
                    snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xD800 + ((cp - 0x10000) >> 10),
                             0xDC00 + ((cp - 0x10000) & 0x3FF));
                else
                    snprintf(esc, sizeof esc, "\\u%04x", cp);
                rep = esc;
            }
        }
        if (rep)
            TKD_TRY(tkd_jbuf_put(b, rep, strlen(rep)));
        else
            TKD_TRY(tkd_jbuf_putc(b, (char)c));
        i += len;
    }
    return tkd_jbuf_putc(b, '"');
}

static tkd_status tkd_jjson_pad(tkd_jbuf *b, int indent, int depth)
{
    TKD_TRY(tkd_jbuf_putc(b, '\n'));
    for (int i = 0; i < indent * depth; i++)
        TKD_TRY(tkd_jbuf_putc(b, ' '));
    return TKD_OK;
}

static int tkd_jjson_key_cmp(const void *x, const void *y)
{
    const tkd_jv *const *a = x, *const *b = y;
    size_t n = (*a)->u.s.n < (*b)->u.s.n ? (*a)->u.s.n : (*b)->u.s.n;
    int c = memcmp((*a)->u.s.p, (*b)->u.s.p, n);
    return c ? c : ((*a)->u.s.n > (*b)->u.s.n) - ((*a)->u.s.n < (*b)->u.s.n);
}

static tkd_status tkd_jjson_container(tkd_jbuf *b, const tkd_jv *v, const tkd_jjson_opts *o, int depth)
{
    int list = v->t == TKD_JV_LIST;
    size_t n = list ? v->u.l.n : v->u.d.n;
    const char *isep = o->item_sep ? o->item_sep : o->indent > 0 ? "," : ", ";
    const char *ksep = o->key_sep ? o->key_sep : ": ";
    size_t *order = NULL;
    if (!list && o->sort_keys && n > 1) {
        /* sort the keys by pointer pairs: (key, index) */
        const tkd_jv **keys = malloc(n * sizeof *keys);
        order = malloc(n * sizeof *order);
        if (!keys || !order)
            return free(keys), free(order), tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
        memcpy(keys, v->u.d.k, n * sizeof *keys);
        qsort(keys, n, sizeof *keys, tkd_jjson_key_cmp);
        for (size_t i = 0; i < n; i++)
            for (size_t j = 0; j < n; j++)
                if (v->u.d.k[j] == keys[i])
                    order[i] = j;
        free(keys);
    }
    tkd_status st = tkd_jbuf_putc(b, list ? '[' : '{');
    for (size_t i = 0; st == TKD_OK && i < n; i++) {
        size_t k = order ? order[i] : i;
        if (i)
            st = tkd_jbuf_put(b, isep, strlen(isep));
        if (st == TKD_OK && o->indent > 0)
            st = tkd_jjson_pad(b, o->indent, depth + 1);
        if (st == TKD_OK && !list) {
            st = tkd_jjson_str(b, v->u.d.k[k]->u.s.p, v->u.d.k[k]->u.s.n, o->ensure_ascii);
            if (st == TKD_OK)
                st = tkd_jbuf_put(b, ksep, strlen(ksep));
        }
        if (st == TKD_OK)
            st = tkd_jv_to_json(b, list ? v->u.l.v[k] : v->u.d.v[k], o, depth + 1);
    }
    free(order);
    if (st == TKD_OK && o->indent > 0 && n > 0)
        st = tkd_jjson_pad(b, o->indent, depth);
    return st != TKD_OK ? st : tkd_jbuf_putc(b, list ? ']' : '}');
}

tkd_status tkd_jv_to_json(tkd_jbuf *b, const tkd_jv *v, const tkd_jjson_opts *o, int depth)
{
    char num[64];
    switch (v->t) {
    case TKD_JV_UNDEF: return tkd_jbuf_put(b, o->undefined_as_null ? "null" : "undefined",
                                           o->undefined_as_null ? 4 : 9);
    case TKD_JV_NULL: return tkd_jbuf_put(b, "null", 4);
    case TKD_JV_BOOL: return tkd_jbuf_put(b, v->u.b ? "true" : "false", v->u.b ? 4 : 5);
    case TKD_JV_INT: snprintf(num, sizeof num, "%lld", v->u.i); return tkd_jbuf_put(b, num, strlen(num));
    case TKD_JV_FLOAT:
        if (!isfinite(v->u.f))
            return tkd_jbuf_put(b, "null", 4);
        tkd_jnum_js(v->u.f, num, sizeof num);
        return tkd_jbuf_put(b, num, strlen(num));
    case TKD_JV_STR: return tkd_jjson_str(b, v->u.s.p, v->u.s.n, o->ensure_ascii);
    case TKD_JV_LIST:
    case TKD_JV_DICT:
    case TKD_JV_NS: return tkd_jjson_container(b, v, o, depth);
    default: return tkd_error_set(TKD_ERR_FORMAT, "cannot convert a %s to JSON", tkd_jv_type_name(v));
    }
}

tkd_status tkd_jv_to_string(tkd_jbuf *b, const tkd_jv *v)
{
    char num[64];
    switch (v->t) {
    case TKD_JV_UNDEF: return tkd_jbuf_put(b, "undefined", 9);
    case TKD_JV_NULL: return tkd_jbuf_put(b, "null", 4);
    case TKD_JV_STR: return tkd_jbuf_put(b, v->u.s.p, v->u.s.n);
    case TKD_JV_FLOAT:
        /* the reference writes integral floats with one decimal (Python's 1.0), others as JavaScript */
        if (isfinite(v->u.f) && v->u.f == floor(v->u.f))
            snprintf(num, sizeof num, "%.1f", v->u.f);
        else
            tkd_jnum_js(v->u.f, num, sizeof num);
        return tkd_jbuf_put(b, num, strlen(num));
    case TKD_JV_FUNC: return tkd_jbuf_put(b, "[object Object]", 15);
    case TKD_JV_LIST:
    case TKD_JV_DICT:
    case TKD_JV_NS: {
        tkd_jjson_opts o = {.indent = -1};
        return tkd_jv_to_json(b, v, &o, 0);
    }
    default: {
        tkd_jjson_opts o = {.indent = -1};
        return tkd_jv_to_json(b, v, &o, 0);
    }
    }
}

tkd_status tkd_jv_to_raw_string(tkd_jbuf *b, const tkd_jv *v)
{
    char num[64];
    switch (v->t) {
    case TKD_JV_FLOAT: tkd_jnum_js(v->u.f, num, sizeof num); return tkd_jbuf_put(b, num, strlen(num));
    case TKD_JV_LIST:
        for (size_t i = 0; i < v->u.l.n; i++)
            TKD_TRY(tkd_jbuf_put(b, i ? ",[object Object]" : "[object Object]", i ? 16 : 15));
        return TKD_OK;
    case TKD_JV_DICT: return tkd_jbuf_put(b, "[object Map]", 12);
    case TKD_JV_NS: return tkd_jbuf_put(b, "[object Object]", 15);
    default: return tkd_jv_to_string(b, v);
    }
}
