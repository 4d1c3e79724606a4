/* jinja_filters.c — formats/jinja's filters (`x | name(args)`) and tests (`x is name`), with
 * @huggingface/jinja's behaviour: tojson as transformers configures it (no ASCII escaping unless
 * asked, `indent`, `separators`, `sort_keys`), selectattr/rejectattr with a test, map(attribute=),
 * join, trim, length, items, ... A filter or test outside this set is refused by name. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "formats/jinja_internal.h"

static tkd_status tkd_jnomem(void)
{
    return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
}

/* ---- tests ---- */
static const char *const tkd_jtest_names[] = {"boolean", "callable", "odd",      "even",     "false",   "true",
                                              "none",    "string",   "number",   "integer",  "iterable", "mapping",
                                              "sequence", "lower",   "upper",    "defined",  "undefined", "equalto",
                                              "eq",      NULL};

static int tkd_jstr_is_case(const tkd_jv *v, int upper)
{
    for (size_t i = 0; i < v->u.s.n; i++) {
        char c = v->u.s.p[i];
        if (upper ? (c >= 'a' && c <= 'z') : (c >= 'A' && c <= 'Z'))
            return 0;
    }
    return 1;
}

/* Test number k of tkd_jtest_names on v (arg: the value equalto compares with). */
static tkd_status tkd_jtest_run(tkd_jrender *r, const tkd_jnode *at, int k, const tkd_jv *v, const tkd_jv *arg, int *out)
{
    tkd_jv_type t = v->t;
    switch (k) {
    case 0: *out = t == TKD_JV_BOOL; break;
    case 1: *out = t == TKD_JV_FUNC; break;
    case 2:
    case 3:
        if (t != TKD_JV_INT)
            return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "test '%s' needs an integer, got %s", tkd_jtest_names[k],
                                  tkd_jv_type_name(v));
        *out = (v->u.i % 2 != 0) == (k == 2);
        break;
    case 4: *out = t == TKD_JV_BOOL && !v->u.b; break;
    case 5: *out = t == TKD_JV_BOOL && v->u.b; break;
    case 6: *out = t == TKD_JV_NULL; break;
    case 7: *out = t == TKD_JV_STR; break;
    case 8: *out = t == TKD_JV_INT || t == TKD_JV_FLOAT; break;
    case 9: *out = t == TKD_JV_INT; break;
    case 10: *out = t == TKD_JV_LIST || t == TKD_JV_STR; break; /* not dicts, as in the reference */
    case 11: *out = t == TKD_JV_DICT; break;
    case 12: *out = t == TKD_JV_LIST || t == TKD_JV_DICT || t == TKD_JV_STR; break;
    case 13:
    case 14: *out = t == TKD_JV_STR && tkd_jstr_is_case(v, k == 14); break;
    case 15: *out = t != TKD_JV_UNDEF; break;
    case 16: *out = t == TKD_JV_UNDEF; break;
    default:
        if (!arg)
            return tkd_jinja_fail(r, TKD_ERR_UNSUPPORTED, at, "unsupported construct 'is %s' without a value",
                                  tkd_jtest_names[k]);
        *out = tkd_jv_strict_eq(v, arg);
    }
    return TKD_OK;
}

static int tkd_jtest_find(const char *name)
{
    for (int k = 0; tkd_jtest_names[k]; k++)
        if (!strcmp(tkd_jtest_names[k], name))
            return k;
    return -1;
}

tkd_status tkd_jinja_apply_test(tkd_jrender *r, const tkd_jnode *n, const tkd_jv *operand, int *out)
{
    int k = tkd_jtest_find(n->s);
    if (k < 0)
        return tkd_jinja_fail(r, TKD_ERR_UNSUPPORTED, n, "unsupported test '%s'", n->s);
    return tkd_jtest_run(r, n, k, operand, NULL, out);
}

/* ---- filters ---- */
typedef struct tkd_jfilter_call {
    tkd_jrender *r;
    tkd_jscope *sc;
    const tkd_jnode *n;
    tkd_jv *v;
    tkd_jargs a;
} tkd_jfilter_call;

static tkd_status tkd_jfilter_type(tkd_jfilter_call *c)
{
    return tkd_jinja_fail(c->r, TKD_ERR_FORMAT, c->n, "filter '%s' cannot apply to a %s", c->n->s,
                          tkd_jv_type_name(c->v));
}

static tkd_jv *tkd_jarg(const tkd_jfilter_call *c, size_t i, const char *kw)
{
    return i < c->a.npos ? c->a.pos[i] : tkd_jargs_kw(&c->a, kw);
}

static tkd_status tkd_jfilter_tojson(tkd_jfilter_call *c, tkd_jv **out)
{
    tkd_jjson_opts o = {.indent = -1, .undefined_as_null = 1};
    const tkd_jv *indent = tkd_jargs_kw(&c->a, "indent"), *ascii = tkd_jargs_kw(&c->a, "ensure_ascii");
    const tkd_jv *sort = tkd_jargs_kw(&c->a, "sort_keys"), *seps = tkd_jargs_kw(&c->a, "separators");
    if (c->a.npos)
        return tkd_jinja_fail(c->r, TKD_ERR_UNSUPPORTED, c->n, "unsupported construct 'tojson' with positional arguments");
    if (indent && indent->t != TKD_JV_NULL && indent->t != TKD_JV_INT)
        return tkd_jinja_fail(c->r, TKD_ERR_FORMAT, c->n, "tojson: indent must be an integer");
    if (indent && indent->t == TKD_JV_INT)
        o.indent = (int)indent->u.i;
    if ((ascii && ascii->t != TKD_JV_BOOL) || (sort && sort->t != TKD_JV_BOOL))
        return tkd_jinja_fail(c->r, TKD_ERR_FORMAT, c->n, "tojson: ensure_ascii and sort_keys must be booleans");
    o.ensure_ascii = ascii && ascii->u.b;
    o.sort_keys = sort && sort->u.b;
    if (seps && seps->t != TKD_JV_NULL) {
        if (seps->t != TKD_JV_LIST || seps->u.l.n != 2 || seps->u.l.v[0]->t != TKD_JV_STR ||
            seps->u.l.v[1]->t != TKD_JV_STR)
            return tkd_jinja_fail(c->r, TKD_ERR_FORMAT, c->n, "tojson: separators must be two strings");
        o.item_sep = seps->u.l.v[0]->u.s.p;
        o.key_sep = seps->u.l.v[1]->u.s.p;
    }
    tkd_jbuf b = {0};
    tkd_status st = tkd_jv_to_json(&b, c->v, &o, 0);
    if (st == TKD_OK && !(*out = tkd_jv_str(c->r->a, b.p ? b.p : "", b.n)))
        st = tkd_jnomem();
    free(b.p);
    return st == TKD_ERR_FORMAT ? tkd_jinja_fail(c->r, st, c->n, "tojson: %s", tkd_error_msg()) : st;
}

static tkd_status tkd_jfilter_join(tkd_jfilter_call *c, tkd_jv **out)
{
    const tkd_jv *sep = tkd_jarg(c, 0, "separator");
    if (sep && sep->t != TKD_JV_STR)
        return tkd_jinja_fail(c->r, TKD_ERR_FORMAT, c->n, "join: the separator must be a string");
    if (c->v->t == TKD_JV_STR && !sep) {
        *out = c->v;
        return TKD_OK;
    }
    if (c->v->t == TKD_JV_STR)
        return tkd_jinja_fail(c->r, TKD_ERR_UNSUPPORTED, c->n, "unsupported construct 'join' of a string's characters");
    if (c->v->t != TKD_JV_LIST)
        return tkd_jfilter_type(c);
    tkd_jbuf b = {0};
    tkd_status st = tkd_jbuf_put(&b, "", 0);
    for (size_t i = 0; st == TKD_OK && i < c->v->u.l.n; i++) {
        if (i && sep)
            st = tkd_jbuf_put(&b, sep->u.s.p, sep->u.s.n);
        const tkd_jv *x = c->v->u.l.v[i];
        if (st == TKD_OK && x->t != TKD_JV_NULL && x->t != TKD_JV_UNDEF) /* JavaScript's join writes "" for both */
            st = tkd_jv_to_raw_string(&b, x);
    }
    if (st == TKD_OK && !(*out = tkd_jv_str(c->r->a, b.p, b.n)))
        st = tkd_jnomem();
    free(b.p);
    return st;
}

/* item.attr for a dotted path ("function.name"), undefined when absent. */
static const tkd_jv *tkd_jattr_path(const tkd_jv *item, const char *path)
{
    const tkd_jv *v = item;
    while (v && *path) {
        const char *dot = strchr(path, '.');
        size_t n = dot ? (size_t)(dot - path) : strlen(path);
        if (v->t == TKD_JV_DICT || v->t == TKD_JV_NS)
            v = tkd_jv_dict_get(v, path, n);
        else if (v->t == TKD_JV_LIST && n > 0 && path[0] >= '0' && path[0] <= '9') {
            size_t i = (size_t)strtoul(path, NULL, 10);
            v = i < v->u.l.n ? v->u.l.v[i] : NULL;
        } else
            v = NULL;
        path += n + (dot != NULL);
    }
    return v;
}

static tkd_status tkd_jfilter_selectattr(tkd_jfilter_call *c, int select, tkd_jv **out)
{
    if (c->v->t != TKD_JV_LIST)
        return tkd_jfilter_type(c);
    for (size_t i = 0; i < c->n->args.n; i++)
        if (c->n->args.v[i]->kind != TKD_JN_STR)
            return tkd_jinja_fail(c->r, TKD_ERR_FORMAT, c->n, "%s: the arguments must be string literals", c->n->s);
    if (c->a.npos < 1 || c->a.npos > 3)
        return tkd_jinja_fail(c->r, TKD_ERR_FORMAT, c->n, "%s takes an attribute, a test and a value", c->n->s);
    int test = c->a.npos > 1 ? tkd_jtest_find(c->a.pos[1]->u.s.p) : -1;
    if (c->a.npos > 1 && test < 0)
        return tkd_jinja_fail(c->r, TKD_ERR_UNSUPPORTED, c->n, "unsupported test '%s'", c->a.pos[1]->u.s.p);
    if (!(*out = tkd_jv_new(c->r->a, TKD_JV_LIST)))
        return tkd_jnomem();
    for (size_t i = 0; i < c->v->u.l.n; i++) {
        const tkd_jv *item = c->v->u.l.v[i];
        if (item->t != TKD_JV_DICT && item->t != TKD_JV_NS)
            return tkd_jinja_fail(c->r, TKD_ERR_FORMAT, c->n, "%s applies to a list of dicts, got a %s", c->n->s,
                                  tkd_jv_type_name(item));
        const tkd_jv *a = tkd_jv_dict_get(item, c->a.pos[0]->u.s.p, c->a.pos[0]->u.s.n);
        int yes = 0;
        if (a && test >= 0)
            TKD_TRY(tkd_jtest_run(c->r, c->n, test, a, c->a.npos > 2 ? c->a.pos[2] : NULL, &yes));
        else if (a)
            yes = tkd_jv_truthy(a);
        if (yes == select)
            TKD_TRY(tkd_jv_list_push(c->r->a, *out, c->v->u.l.v[i]));
    }
    return TKD_OK;
}

static tkd_status tkd_jfilter_map(tkd_jfilter_call *c, tkd_jv **out)
{
    const tkd_jv *attr = tkd_jargs_kw(&c->a, "attribute"), *dflt = tkd_jargs_kw(&c->a, "default");
    if (c->v->t != TKD_JV_LIST)
        return tkd_jfilter_type(c);
    if (!attr || attr->t != TKD_JV_STR)
        return tkd_jinja_fail(c->r, TKD_ERR_UNSUPPORTED, c->n, "unsupported construct 'map' without attribute=");
    if (!(*out = tkd_jv_new(c->r->a, TKD_JV_LIST)))
        return tkd_jnomem();
    for (size_t i = 0; i < c->v->u.l.n; i++) {
        const tkd_jv *item = c->v->u.l.v[i];
        if (item->t != TKD_JV_DICT && item->t != TKD_JV_NS)
            return tkd_jinja_fail(c->r, TKD_ERR_FORMAT, c->n, "map applies to a list of dicts, got a %s",
                                  tkd_jv_type_name(item));
        tkd_jv *v = (tkd_jv *)tkd_jattr_path(item, attr->u.s.p);
        if (!v && !(v = dflt ? (tkd_jv *)dflt : tkd_jv_new(c->r->a, TKD_JV_UNDEF)))
            return tkd_jnomem();
        TKD_TRY(tkd_jv_list_push(c->r->a, *out, v));
    }
    return TKD_OK;
}

static tkd_status tkd_jfilter_indent(tkd_jfilter_call *c, tkd_jv **out)
{
    const tkd_jv *w = tkd_jarg(c, 0, "width"), *first = tkd_jarg(c, 1, "first"), *blank = tkd_jarg(c, 2, "blank");
    if (c->v->t != TKD_JV_STR)
        return tkd_jfilter_type(c);
    if (w && w->t != TKD_JV_INT)
        return tkd_jinja_fail(c->r, TKD_ERR_FORMAT, c->n, "indent: the width must be an integer");
    long long width = w ? w->u.i : 4;
    tkd_jbuf b = {0};
    tkd_status st = tkd_jbuf_put(&b, "", 0);
    const char *p = c->v->u.s.p, *end = p + c->v->u.s.n;
    for (int line = 0; st == TKD_OK; line++) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
        int pad = (line > 0 || (first && tkd_jv_truthy(first))) && (len > 0 || (blank && tkd_jv_truthy(blank)));
        for (long long k = 0; pad && st == TKD_OK && k < width; k++)
            st = tkd_jbuf_putc(&b, ' ');
        if (st == TKD_OK)
            st = tkd_jbuf_put(&b, p, len);
        if (!nl)
            break;
        if (st == TKD_OK)
            st = tkd_jbuf_putc(&b, '\n');
        p = nl + 1;
    }
    if (st == TKD_OK && !(*out = tkd_jv_str(c->r->a, b.p, b.n)))
        st = tkd_jnomem();
    free(b.p);
    return st;
}

static tkd_status tkd_jfilter_string(tkd_jfilter_call *c, tkd_jv **out)
{
    if (c->v->t == TKD_JV_STR) {
        *out = c->v;
        return TKD_OK;
    }
    if (c->v->t == TKD_JV_UNDEF || c->v->t == TKD_JV_NULL || c->v->t == TKD_JV_FUNC)
        return tkd_jfilter_type(c);
    tkd_jbuf b = {0};
    tkd_status st = tkd_jv_to_string(&b, c->v);
    if (st == TKD_OK && !(*out = tkd_jv_str(c->r->a, b.p, b.n)))
        st = tkd_jnomem();
    free(b.p);
    return st;
}

static tkd_status tkd_jfilter_str_method(tkd_jfilter_call *c, const char *method, tkd_jv **out)
{
    if (c->v->t != TKD_JV_STR)
        return tkd_jfilter_type(c);
    tkd_jv *fn = tkd_jinja_method(c->r->a, c->v, method);
    if (!fn)
        return tkd_jnomem();
    return tkd_jinja_call_builtin(c->r, c->n, fn, &c->a, out);
}

static tkd_status tkd_jfilter_list(tkd_jfilter_call *c, tkd_jv **out)
{
    const char *f = c->n->s;
    const tkd_jv *v = c->v;
    if (v->t != TKD_JV_LIST)
        return tkd_jfilter_type(c);
    if (!strcmp(f, "list")) {
        *out = c->v;
        return TKD_OK;
    }
    if (!strcmp(f, "first") || !strcmp(f, "last")) {
        *out = v->u.l.n ? v->u.l.v[f[0] == 'f' ? 0 : v->u.l.n - 1] : tkd_jv_new(c->r->a, TKD_JV_UNDEF);
        return *out ? TKD_OK : tkd_jnomem();
    }
    /* reverse */
    if (!(*out = tkd_jv_new(c->r->a, TKD_JV_LIST)))
        return tkd_jnomem();
    for (size_t i = v->u.l.n; i-- > 0;)
        TKD_TRY(tkd_jv_list_push(c->r->a, *out, v->u.l.v[i]));
    return TKD_OK;
}

static tkd_status tkd_jfilter_length(tkd_jfilter_call *c, tkd_jv **out)
{
    const tkd_jv *v = c->v;
    long long n;
    if (v->t == TKD_JV_STR)
        n = (long long)tkd_jstr_utf16_len(v->u.s.p, v->u.s.n);
    else if (v->t == TKD_JV_LIST)
        n = (long long)v->u.l.n;
    else if (v->t == TKD_JV_DICT)
        n = (long long)v->u.d.n;
    else
        return tkd_jfilter_type(c);
    return (*out = tkd_jv_int(c->r->a, n)) ? TKD_OK : tkd_jnomem();
}

static tkd_status tkd_jfilter_default(tkd_jfilter_call *c, tkd_jv **out)
{
    tkd_jv *dflt = c->a.npos ? c->a.pos[0] : NULL;
    const tkd_jv *boolean = tkd_jarg(c, 1, "boolean");
    if (!dflt && !(dflt = tkd_jv_str(c->r->a, "", 0)))
        return tkd_jnomem();
    int use = c->v->t == TKD_JV_UNDEF || (boolean && tkd_jv_truthy(boolean) && !tkd_jv_truthy(c->v));
    *out = use ? dflt : c->v;
    return TKD_OK;
}

static tkd_status tkd_jfilter_dict(tkd_jfilter_call *c, const char *method, tkd_jv **out)
{
    if (c->v->t != TKD_JV_DICT)
        return tkd_jfilter_type(c);
    tkd_jv *fn = tkd_jinja_method(c->r->a, c->v, method);
    if (!fn)
        return tkd_jnomem();
    return tkd_jinja_call_builtin(c->r, c->n, fn, &c->a, out);
}

/* int, float, abs: numbers from numbers, booleans and numeric strings (the default when not). */
static tkd_status tkd_jfilter_number(tkd_jfilter_call *c, tkd_jv **out)
{
    const char *f = c->n->s;
    const tkd_jv *v = c->v;
    int want_float = f[0] == 'f';
    if (!strcmp(f, "abs")) {
        if (v->t != TKD_JV_INT && v->t != TKD_JV_FLOAT)
            return tkd_jfilter_type(c);
        if (!(*out = tkd_jv_new(c->r->a, v->t)))
            return tkd_jnomem();
        if (v->t == TKD_JV_INT)
            (*out)->u.i = v->u.i < 0 ? -v->u.i : v->u.i;
        else
            (*out)->u.f = fabs(v->u.f);
        return TKD_OK;
    }
    double d;
    if (v->t == TKD_JV_INT || v->t == TKD_JV_FLOAT || v->t == TKD_JV_BOOL) {
        d = v->t == TKD_JV_INT ? (double)v->u.i : v->t == TKD_JV_FLOAT ? v->u.f : v->u.b;
        if (c->n->op && v->t != TKD_JV_BOOL) { /* called form: numbers pass through unchanged */
            *out = c->v;
            return TKD_OK;
        }
    } else if (v->t == TKD_JV_STR) {
        char *end;
        char *tmp = strndup(v->u.s.p, v->u.s.n);
        if (!tmp)
            return tkd_jnomem();
        d = want_float ? strtod(tmp, &end) : (double)strtoll(tmp, &end, 10);
        int none = end == tmp;
        free(tmp);
        if (none) {
            tkd_jv *dflt = tkd_jarg(c, 0, "default");
            if (dflt) {
                *out = dflt;
                return TKD_OK;
            }
            d = 0;
        }
    } else {
        return tkd_jfilter_type(c);
    }
    if (want_float) {
        if (!(*out = tkd_jv_new(c->r->a, TKD_JV_FLOAT)))
            return tkd_jnomem();
        (*out)->u.f = d;
        return TKD_OK;
    }
    return (*out = tkd_jv_int(c->r->a, (long long)floor(d))) ? TKD_OK : tkd_jnomem();
}

tkd_status tkd_jinja_apply_filter(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n, tkd_jv *operand, tkd_jv **out)
{
    tkd_jfilter_call c = {.r = r, .sc = sc, .n = n, .v = operand};
    TKD_TRY(tkd_jinja_eval_args(r, sc, &n->args, &c.a));
    const char *f = n->s;
    if (!strcmp(f, "safe")) {
        *out = operand;
        return TKD_OK;
    }
    if (!strcmp(f, "tojson"))
        return tkd_jfilter_tojson(&c, out);
    if (!strcmp(f, "default") || !strcmp(f, "d"))
        return tkd_jfilter_default(&c, out);
    if (!strcmp(f, "string"))
        return tkd_jfilter_string(&c, out);
    if (!strcmp(f, "length") || !strcmp(f, "count"))
        return tkd_jfilter_length(&c, out);
    if (!strcmp(f, "join"))
        return tkd_jfilter_join(&c, out);
    if (!strcmp(f, "selectattr") || !strcmp(f, "rejectattr"))
        return tkd_jfilter_selectattr(&c, f[0] == 's', out);
    if (!strcmp(f, "map"))
        return tkd_jfilter_map(&c, out);
    if (!strcmp(f, "indent"))
        return tkd_jfilter_indent(&c, out);
    if (!strcmp(f, "list") || !strcmp(f, "first") || !strcmp(f, "last") || !strcmp(f, "reverse"))
        return tkd_jfilter_list(&c, out);
    if (!strcmp(f, "trim"))
        return tkd_jfilter_str_method(&c, "strip", out);
    if (!strcmp(f, "upper") || !strcmp(f, "lower") || !strcmp(f, "title") || !strcmp(f, "capitalize") ||
        !strcmp(f, "replace"))
        return tkd_jfilter_str_method(&c, f, out);
    if (!strcmp(f, "items"))
        return tkd_jfilter_dict(&c, "items", out);
    if (!strcmp(f, "int") || !strcmp(f, "float") || !strcmp(f, "abs"))
        return tkd_jfilter_number(&c, out);
    return tkd_jinja_fail(r, TKD_ERR_UNSUPPORTED, n, "unsupported filter '%s'", f);
}
