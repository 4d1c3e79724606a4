/* jinja_eval.c — rendering: statements write into the render's output buffer, expressions give
 * values, with @huggingface/jinja's semantics (scoping included: a `for` body and a macro call
 * get their own scope, `set` inside them does not leak out, `if` makes none). Also the module's
 * entry points (parse, render, free). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#include "formats/jinja_internal.h"

/* Bounds that turn a runaway template into an error instead of a crash or a hang: nested macro
 * calls, statements run (a chat template runs thousands), bytes of output. */
enum { TKD_JINJA_MAX_DEPTH = 64 };
#define TKD_JINJA_MAX_STEPS 20000000LL
#define TKD_JINJA_MAX_OUTPUT ((size_t)1 << 28)

tkd_status tkd_jinja_fail(tkd_jrender *r, tkd_status st, const tkd_jnode *n, const char *fmt, ...)
{
    char msg[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return tkd_jinja_error_at(st, r->t->name, r->t->src, r->t->len, n ? n->pos : 0, "%s", msg);
}

static tkd_status tkd_jnomem(void)
{
    return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
}

static tkd_status tkd_jscope_new(tkd_jrender *r, tkd_jscope *parent, tkd_jscope **out)
{
    tkd_jscope *s = tkd_jarena_alloc(r->a, sizeof *s);
    if (!s || !(s->vars = tkd_jv_new(r->a, TKD_JV_DICT)))
        return tkd_jnomem();
    s->parent = parent;
    *out = s;
    return TKD_OK;
}

static tkd_status tkd_jscope_set(tkd_jrender *r, tkd_jscope *sc, const char *name, tkd_jv *v)
{
    tkd_jv *k = tkd_jv_str(r->a, name, strlen(name));
    if (!k)
        return tkd_jnomem();
    return tkd_jv_dict_set(r->a, sc->vars, k, v);
}

static tkd_status tkd_jlookup(tkd_jrender *r, tkd_jscope *sc, const char *name, tkd_jv **out)
{
    for (tkd_jscope *s = sc; s; s = s->parent) {
        tkd_jv *v = tkd_jv_dict_get(s->vars, name, strlen(name));
        if (v) {
            *out = v;
            return TKD_OK;
        }
    }
    *out = tkd_jinja_global(r->a, name);
    if (!*out && !(*out = tkd_jv_new(r->a, TKD_JV_UNDEF)))
        return tkd_jnomem();
    return TKD_OK;
}

tkd_jv *tkd_jargs_kw(const tkd_jargs *a, const char *name)
{
    for (size_t i = 0; i < a->nkw; i++)
        if (!strcmp(a->kwn[i], name))
            return a->kwv[i];
    return NULL;
}

tkd_status tkd_jinja_eval_args(tkd_jrender *r, tkd_jscope *sc, const tkd_jnodes *args, tkd_jargs *out)
{
    memset(out, 0, sizeof *out);
    size_t n = args->n ? args->n : 1;
    out->pos = tkd_jarena_alloc(r->a, n * sizeof *out->pos);
    out->kwv = tkd_jarena_alloc(r->a, n * sizeof *out->kwv);
    out->kwn = tkd_jarena_alloc(r->a, n * sizeof *out->kwn);
    if (!out->pos || !out->kwv || !out->kwn)
        return tkd_jnomem();
    for (size_t i = 0; i < args->n; i++) {
        const tkd_jnode *a = args->v[i];
        if (a->kind == TKD_JN_KWARG) {
            out->kwn[out->nkw] = a->s;
            TKD_TRY(tkd_jinja_eval(r, sc, a->a, &out->kwv[out->nkw++]));
        } else {
            if (out->nkw)
                return tkd_jinja_fail(r, TKD_ERR_FORMAT, a, "positional argument after a keyword argument");
            TKD_TRY(tkd_jinja_eval(r, sc, a, &out->pos[out->npos++]));
        }
    }
    return TKD_OK;
}

/* ---- expressions ---- */
static tkd_status tkd_jeval_concat(tkd_jrender *r, const tkd_jv *x, const tkd_jv *y, tkd_jv **out)
{
    tkd_jbuf b = {0};
    tkd_status st = tkd_jv_to_raw_string(&b, x);
    if (st == TKD_OK)
        st = tkd_jv_to_raw_string(&b, y);
    if (st == TKD_OK && !(*out = tkd_jv_str(r->a, b.p ? b.p : "", b.n)))
        st = tkd_jnomem();
    free(b.p);
    return st;
}

static int tkd_jv_contains(const tkd_jv *hay, const tkd_jv *needle, int *ok)
{
    *ok = 1;
    if (hay->t == TKD_JV_LIST) {
        for (size_t i = 0; i < hay->u.l.n; i++)
            if (tkd_jv_strict_eq(hay->u.l.v[i], needle))
                return 1;
        return 0;
    }
    if (needle->t == TKD_JV_STR && hay->t == TKD_JV_STR) {
        size_t n = needle->u.s.n, m = hay->u.s.n;
        for (size_t i = 0; n <= m && i <= m - n; i++)
            if (!memcmp(hay->u.s.p + i, needle->u.s.p, n))
                return 1;
        return 0;
    }
    if (needle->t == TKD_JV_STR && hay->t == TKD_JV_DICT)
        return tkd_jv_dict_get(hay, needle->u.s.p, needle->u.s.n) != NULL;
    *ok = 0;
    return 0;
}

static tkd_status tkd_jeval_arith(tkd_jrender *r, const tkd_jnode *n, const tkd_jv *x, const tkd_jv *y, tkd_jv **out)
{
    int fl = x->t == TKD_JV_FLOAT || y->t == TKD_JV_FLOAT;
    double a = x->t == TKD_JV_INT ? (double)x->u.i : x->u.f, b = y->t == TKD_JV_INT ? (double)y->u.i : y->u.f;
    long long ia = x->u.i, ib = y->u.i;
    int op = n->op, cmp = -1;
    double f = 0;
    long long i = 0;
    switch (op) {
    case TKD_JOP_ADD: f = a + b, i = ia + ib; break;
    case TKD_JOP_SUB: f = a - b, i = ia - ib; break;
    case TKD_JOP_MUL: f = a * b, i = ia * ib; break;
    case TKD_JOP_DIV: fl = 1, f = a / b; break;
    case TKD_JOP_FLOORDIV:
    case TKD_JOP_MOD:
        if (!fl && ib == 0)
            return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "division by zero");
        f = op == TKD_JOP_MOD ? a - b * (double)(long long)(a / b) : __builtin_floor(a / b);
        i = op == TKD_JOP_MOD ? ia % ib : (ia / ib - ((ia % ib != 0) && ((ia < 0) != (ib < 0))));
        break;
    case TKD_JOP_LT: cmp = a < b; break;
    case TKD_JOP_GT: cmp = a > b; break;
    case TKD_JOP_LE: cmp = a <= b; break;
    case TKD_JOP_GE: cmp = a >= b; break;
    case TKD_JOP_POW:
        if (a == 0 && b < 0)
            return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "0.0 cannot be raised to a negative power");
        f = pow(a, b);
        if (!isfinite(f))
            return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "a power that is not a finite number");
        fl = fl || b < 0;
        i = (long long)f;
        break;
    default: return tkd_jinja_fail(r, TKD_ERR_INTERNAL, n, "unknown arithmetic operator %d", op);
    }
    if (cmp >= 0)
        *out = tkd_jv_bool(r->a, cmp);
    else if (fl && (*out = tkd_jv_new(r->a, TKD_JV_FLOAT)))
        (*out)->u.f = f;
    else if (!fl)
        *out = tkd_jv_int(r->a, i);
    return *out ? TKD_OK : tkd_jnomem();
}

static tkd_status tkd_jeval_binop(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n, tkd_jv **out)
{
    tkd_jv *x = NULL, *y = NULL;
    TKD_TRY(tkd_jinja_eval(r, sc, n->a, &x));
    if (n->op == TKD_JOP_AND || n->op == TKD_JOP_OR) {
        if (tkd_jv_truthy(x) == (n->op == TKD_JOP_OR)) {
            *out = x;
            return TKD_OK;
        }
        return tkd_jinja_eval(r, sc, n->b, out);
    }
    TKD_TRY(tkd_jinja_eval(r, sc, n->b, &y));
    if (n->op == TKD_JOP_EQ || n->op == TKD_JOP_NE) {
        int eq = tkd_jv_loose_eq(x, y);
        return (*out = tkd_jv_bool(r->a, n->op == TKD_JOP_EQ ? eq : !eq)) ? TKD_OK : tkd_jnomem();
    }
    int in = n->op == TKD_JOP_IN || n->op == TKD_JOP_NOT_IN;
    if (y->t == TKD_JV_UNDEF && in)
        return (*out = tkd_jv_bool(r->a, n->op == TKD_JOP_NOT_IN)) ? TKD_OK : tkd_jnomem();
    if (x->t == TKD_JV_UNDEF || y->t == TKD_JV_UNDEF || x->t == TKD_JV_NULL || y->t == TKD_JV_NULL)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "cannot apply an operator to %s and %s", tkd_jv_type_name(x),
                              tkd_jv_type_name(y));
    if (n->op == TKD_JOP_CONCAT)
        return tkd_jeval_concat(r, x, y, out);
    int xn = x->t == TKD_JV_INT || x->t == TKD_JV_FLOAT, yn = y->t == TKD_JV_INT || y->t == TKD_JV_FLOAT;
    if (xn && yn)
        return tkd_jeval_arith(r, n, x, y, out);
    if (n->op == TKD_JOP_ADD && x->t == TKD_JV_LIST && y->t == TKD_JV_LIST) {
        if (!(*out = tkd_jv_new(r->a, TKD_JV_LIST)))
            return tkd_jnomem();
        for (size_t i = 0; i < x->u.l.n; i++)
            TKD_TRY(tkd_jv_list_push(r->a, *out, x->u.l.v[i]));
        for (size_t i = 0; i < y->u.l.n; i++)
            TKD_TRY(tkd_jv_list_push(r->a, *out, y->u.l.v[i]));
        return TKD_OK;
    }
    if (in) {
        int ok, has = tkd_jv_contains(y, x, &ok);
        if (ok)
            return (*out = tkd_jv_bool(r->a, n->op == TKD_JOP_IN ? has : !has)) ? TKD_OK : tkd_jnomem();
    }
    if (n->op == TKD_JOP_ADD && (x->t == TKD_JV_STR || y->t == TKD_JV_STR))
        return tkd_jeval_concat(r, x, y, out);
    return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "unsupported operand types for this operator: %s and %s",
                          tkd_jv_type_name(x), tkd_jv_type_name(y));
}

/* Python's slice of n items: the indices start, start+step, ... (count in *cnt). */
static tkd_status tkd_jslice_bounds(tkd_jrender *r, const tkd_jnode *n, const tkd_jv *const p[3], long long len,
                                    long long *start, long long *step, long long *cnt)
{
    for (int k = 0; k < 3; k++)
        if (p[k] && p[k]->t != TKD_JV_INT && p[k]->t != TKD_JV_UNDEF)
            return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "slice bounds must be integers, got %s", tkd_jv_type_name(p[k]));
    int has[3];
    for (int k = 0; k < 3; k++)
        has[k] = p[k] && p[k]->t == TKD_JV_INT;
    *step = has[2] ? p[2]->u.i : 1;
    if (*step == 0)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "slice step cannot be zero");
    long long lo = *step > 0 ? 0 : -1, hi = *step > 0 ? len : len - 1;
    long long s = has[0] ? p[0]->u.i : (*step > 0 ? 0 : len - 1);
    long long e = has[1] ? p[1]->u.i : (*step > 0 ? len : -1);
    if (has[0] && s < 0)
        s += len;
    if (has[1] && e < 0)
        e += len;
    s = s < lo ? lo : s > hi ? hi : s;
    e = e < lo ? lo : e > hi ? hi : e;
    *start = s;
    *cnt = *step > 0 ? (e > s ? (e - s + *step - 1) / *step : 0) : (s > e ? (s - e - *step - 1) / -*step : 0);
    return TKD_OK;
}

/* Byte offsets of the code points of a string (JavaScript's Array.from(str) slices by code point). */
static tkd_status tkd_jcodepoints(tkd_jrender *r, const tkd_jv *s, size_t **offs, long long *count)
{
    size_t n = 0;
    for (size_t i = 0; i < s->u.s.n; i++)
        n += ((unsigned char)s->u.s.p[i] & 0xC0) != 0x80;
    size_t *o = tkd_jarena_alloc(r->a, (n + 1) * sizeof *o);
    if (!o)
        return tkd_jnomem();
    size_t k = 0;
    for (size_t i = 0; i < s->u.s.n; i++)
        if (((unsigned char)s->u.s.p[i] & 0xC0) != 0x80)
            o[k++] = i;
    o[n] = s->u.s.n;
    *offs = o;
    *count = (long long)n;
    return TKD_OK;
}

static tkd_status tkd_jeval_slice(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n, tkd_jv *obj, tkd_jv **out)
{
    if (obj->t != TKD_JV_LIST && obj->t != TKD_JV_STR)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "cannot slice a %s", tkd_jv_type_name(obj));
    tkd_jv *p[3] = {0};
    const tkd_jnode *parts[3] = {n->a, n->b, n->c};
    for (int k = 0; k < 3; k++)
        if (parts[k])
            TKD_TRY(tkd_jinja_eval(r, sc, parts[k], &p[k]));
    size_t *offs = NULL;
    long long len = (long long)obj->u.l.n, start = 0, step = 1, cnt = 0;
    if (obj->t == TKD_JV_STR)
        TKD_TRY(tkd_jcodepoints(r, obj, &offs, &len));
    TKD_TRY(tkd_jslice_bounds(r, n, (const tkd_jv *const *)p, len, &start, &step, &cnt));
    if (obj->t == TKD_JV_LIST) {
        if (!(*out = tkd_jv_new(r->a, TKD_JV_LIST)))
            return tkd_jnomem();
        for (long long k = 0; k < cnt; k++)
            TKD_TRY(tkd_jv_list_push(r->a, *out, obj->u.l.v[start + k * step]));
        return TKD_OK;
    }
    tkd_jbuf b = {0};
    tkd_status st = TKD_OK;
    for (long long k = 0; st == TKD_OK && k < cnt; k++) {
        long long c = start + k * step;
        st = tkd_jbuf_put(&b, obj->u.s.p + offs[c], offs[c + 1] - offs[c]);
    }
    if (st == TKD_OK && !(*out = tkd_jv_str(r->a, b.p ? b.p : "", b.n)))
        st = tkd_jnomem();
    free(b.p);
    return st;
}

static tkd_status tkd_jeval_index(tkd_jrender *r, const tkd_jnode *n, tkd_jv *obj, const tkd_jv *key, tkd_jv **out)
{
    tkd_jv *v = NULL;
    if (obj->t == TKD_JV_DICT || obj->t == TKD_JV_NS) {
        if (key->t != TKD_JV_STR)
            return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "a dict key must be a string, got %s", tkd_jv_type_name(key));
        v = tkd_jv_dict_get(obj, key->u.s.p, key->u.s.n);
        if (!v && obj->t == TKD_JV_DICT)
            v = tkd_jinja_method(r->a, obj, key->u.s.p);
    } else if ((obj->t == TKD_JV_LIST || obj->t == TKD_JV_STR) && key->t == TKD_JV_INT) {
        long long len = (long long)obj->u.l.n, i = key->u.i;
        size_t *offs = NULL;
        if (obj->t == TKD_JV_STR)
            TKD_TRY(tkd_jcodepoints(r, obj, &offs, &len));
        if (i < 0)
            i += len;
        if (i >= 0 && i < len)
            v = obj->t == TKD_JV_LIST ? obj->u.l.v[i] : tkd_jv_str(r->a, obj->u.s.p + offs[i], offs[i + 1] - offs[i]);
    } else if (key->t == TKD_JV_STR) {
        v = tkd_jinja_method(r->a, obj, key->u.s.p);
    } else if (obj->t == TKD_JV_LIST || obj->t == TKD_JV_STR) {
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "cannot index a %s with a %s", tkd_jv_type_name(obj),
                              tkd_jv_type_name(key));
    }
    if (!v && !(v = tkd_jv_new(r->a, TKD_JV_UNDEF)))
        return tkd_jnomem();
    *out = v;
    return TKD_OK;
}

static tkd_status tkd_jeval_member(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n, tkd_jv **out)
{
    tkd_jv *obj = NULL, *key = NULL;
    TKD_TRY(tkd_jinja_eval(r, sc, n->a, &obj));
    if (n->op && n->b->kind == TKD_JN_SLICE)
        return tkd_jeval_slice(r, sc, n->b, obj, out);
    if (n->op) {
        TKD_TRY(tkd_jinja_eval(r, sc, n->b, &key));
    } else if (n->b->kind == TKD_JN_INT) {
        key = tkd_jv_int(r->a, n->b->i);
    } else {
        key = tkd_jv_str(r->a, n->b->s, strlen(n->b->s));
    }
    if (!key)
        return tkd_jnomem();
    return tkd_jeval_index(r, n, obj, key, out);
}

static tkd_status tkd_jcall_macro(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *at, const tkd_jv *fn,
                                  const tkd_jargs *args, tkd_jv **out)
{
    const tkd_jnode *m = fn->u.fn.macro;
    if (args->npos > m->args.n)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "macro '%s' takes at most %zu argument(s)", m->s, m->args.n);
    if (r->depth >= TKD_JINJA_MAX_DEPTH)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "macro calls nested deeper than %d", TKD_JINJA_MAX_DEPTH);
    tkd_jscope *ms = NULL;
    TKD_TRY(tkd_jscope_new(r, sc, &ms)); /* the caller's scope is the parent, as in the reference */
    size_t used_kw = 0;
    for (size_t i = 0; i < m->args.n; i++) { /* bind every name first, then evaluate defaults */
        const tkd_jnode *p = m->args.v[i];
        const char *name = p->kind == TKD_JN_KWARG ? p->s : p->s;
        tkd_jv *v = i < args->npos ? args->pos[i] : tkd_jargs_kw(args, name);
        used_kw += i >= args->npos && v;
        if (!v && !(v = tkd_jv_new(r->a, TKD_JV_UNDEF)))
            return tkd_jnomem();
        TKD_TRY(tkd_jscope_set(r, ms, name, v));
    }
    if (used_kw < args->nkw)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "macro '%s' got an unknown keyword argument", m->s);
    for (size_t i = 0; i < m->args.n; i++) {
        const tkd_jnode *p = m->args.v[i];
        if (p->kind == TKD_JN_KWARG && i >= args->npos && !tkd_jargs_kw(args, p->s)) {
            tkd_jv *v = NULL;
            TKD_TRY(tkd_jinja_eval(r, ms, p->a, &v));
            TKD_TRY(tkd_jscope_set(r, ms, p->s, v));
        }
    }
    tkd_jbuf buf = {0}, *saved = r->out;
    r->out = &buf;
    r->depth++;
    tkd_status st = tkd_jinja_exec_block(r, ms, &m->body);
    r->depth--;
    r->out = saved;
    r->ctl = TKD_JCTL_NONE;
    if (st == TKD_OK && !(*out = tkd_jv_str(r->a, buf.p ? buf.p : "", buf.n)))
        st = tkd_jnomem();
    free(buf.p);
    return st;
}

static tkd_status tkd_jeval_call(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n, tkd_jv **out)
{
    tkd_jargs args;
    TKD_TRY(tkd_jinja_eval_args(r, sc, &n->args, &args));
    tkd_jv *fn = NULL;
    TKD_TRY(tkd_jinja_eval(r, sc, n->a, &fn));
    if (fn->t != TKD_JV_FUNC) {
        const char *what = n->a->kind == TKD_JN_IDENT ? n->a->s
                           : n->a->kind == TKD_JN_MEMBER && !n->a->op && n->a->b->kind == TKD_JN_IDENT ? n->a->b->s
                                                                                                         : "(expression)";
        if (fn->t == TKD_JV_UNDEF)
            return tkd_jinja_fail(r, TKD_ERR_UNSUPPORTED, n, "unsupported function or method '%s'", what);
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "'%s' is a %s, not a function", what, tkd_jv_type_name(fn));
    }
    if (fn->u.fn.macro)
        return tkd_jcall_macro(r, sc, n, fn, &args, out);
    return tkd_jinja_call_builtin(r, n, fn, &args, out);
}

static tkd_status tkd_jeval_literal(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n, tkd_jv **out)
{
    if (!(*out = tkd_jv_new(r->a, n->kind == TKD_JN_DICT ? TKD_JV_DICT : TKD_JV_LIST)))
        return tkd_jnomem();
    for (size_t i = 0; i < n->args.n; i++) {
        tkd_jv *v = NULL;
        TKD_TRY(tkd_jinja_eval(r, sc, n->args.v[i], &v));
        if (n->kind != TKD_JN_DICT) {
            TKD_TRY(tkd_jv_list_push(r->a, *out, v));
            continue;
        }
        tkd_jv *val = NULL;
        TKD_TRY(tkd_jinja_eval(r, sc, n->args.v[++i], &val));
        if (v->t != TKD_JV_STR)
            return tkd_jinja_fail(r, TKD_ERR_UNSUPPORTED, n->args.v[i - 1], "unsupported dict key of type %s",
                                  tkd_jv_type_name(v));
        TKD_TRY(tkd_jv_dict_set(r->a, *out, v, val));
    }
    return TKD_OK;
}

static tkd_status tkd_jeval_unary(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n, tkd_jv **out)
{
    tkd_jv *v = NULL;
    TKD_TRY(tkd_jinja_eval(r, sc, n->a, &v));
    if (n->op == TKD_JOP_NOT)
        return (*out = tkd_jv_bool(r->a, !tkd_jv_truthy(v))) ? TKD_OK : tkd_jnomem();
    int sign = n->op == TKD_JOP_NEG ? -1 : 1;
    if (v->t == TKD_JV_FLOAT) {
        if ((*out = tkd_jv_new(r->a, TKD_JV_FLOAT)))
            (*out)->u.f = sign * v->u.f;
    } else if (v->t == TKD_JV_INT || v->t == TKD_JV_BOOL) {
        *out = tkd_jv_int(r->a, sign * (v->t == TKD_JV_INT ? v->u.i : v->u.b));
    } else {
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "bad operand type for unary sign: %s", tkd_jv_type_name(v));
    }
    return *out ? TKD_OK : tkd_jnomem();
}

tkd_status tkd_jinja_eval(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n, tkd_jv **out)
{
    switch (n->kind) {
    case TKD_JN_STR: return (*out = tkd_jv_str(r->a, n->s, n->n)) ? TKD_OK : tkd_jnomem();
    case TKD_JN_INT: return (*out = tkd_jv_int(r->a, n->i)) ? TKD_OK : tkd_jnomem();
    case TKD_JN_FLOAT:
        if (!(*out = tkd_jv_new(r->a, TKD_JV_FLOAT)))
            return tkd_jnomem();
        (*out)->u.f = n->f;
        return TKD_OK;
    case TKD_JN_IDENT: return tkd_jlookup(r, sc, n->s, out);
    case TKD_JN_LIST:
    case TKD_JN_TUPLE:
    case TKD_JN_DICT: return tkd_jeval_literal(r, sc, n, out);
    case TKD_JN_MEMBER: return tkd_jeval_member(r, sc, n, out);
    case TKD_JN_CALL: return tkd_jeval_call(r, sc, n, out);
    case TKD_JN_FILTER: {
        tkd_jv *operand = NULL;
        TKD_TRY(tkd_jinja_eval(r, sc, n->a, &operand));
        return tkd_jinja_apply_filter(r, sc, n, operand, out);
    }
    case TKD_JN_TEST: {
        tkd_jv *operand = NULL;
        int yes;
        TKD_TRY(tkd_jinja_eval(r, sc, n->a, &operand));
        TKD_TRY(tkd_jinja_apply_test(r, n, operand, &yes));
        return (*out = tkd_jv_bool(r->a, n->op ? !yes : yes)) ? TKD_OK : tkd_jnomem();
    }
    case TKD_JN_BINOP: return tkd_jeval_binop(r, sc, n, out);
    case TKD_JN_UNARY: return tkd_jeval_unary(r, sc, n, out);
    case TKD_JN_TERNARY: {
        tkd_jv *test = NULL;
        TKD_TRY(tkd_jinja_eval(r, sc, n->a, &test));
        return tkd_jinja_eval(r, sc, tkd_jv_truthy(test) ? n->b : n->c, out);
    }
    case TKD_JN_SELECT: {
        tkd_jv *test = NULL;
        TKD_TRY(tkd_jinja_eval(r, sc, n->b, &test));
        if (tkd_jv_truthy(test))
            return tkd_jinja_eval(r, sc, n->a, out);
        return (*out = tkd_jv_new(r->a, TKD_JV_UNDEF)) ? TKD_OK : tkd_jnomem();
    }
    case TKD_JN_SLICE: return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "a slice outside [ ]");
    case TKD_JN_KWARG: return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "a keyword argument outside a call");
    default: return tkd_jinja_fail(r, TKD_ERR_INTERNAL, n, "a statement where an expression was expected");
    }
}

/* ---- statements ---- */
/* Binds a for / set target (a name or a tuple of names) to v in sc. */
static tkd_status tkd_jbind(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *target, tkd_jv *v)
{
    if (target->kind == TKD_JN_IDENT)
        return tkd_jscope_set(r, sc, target->s, v);
    if (target->kind != TKD_JN_TUPLE)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, target, "cannot assign to this target");
    if (v->t != TKD_JV_LIST)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, target, "cannot unpack a %s", tkd_jv_type_name(v));
    if (v->u.l.n != target->args.n)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, target, "too %s values to unpack (expected %zu, got %zu)",
                              v->u.l.n < target->args.n ? "few" : "many", target->args.n, v->u.l.n);
    for (size_t i = 0; i < target->args.n; i++) {
        if (target->args.v[i]->kind != TKD_JN_IDENT)
            return tkd_jinja_fail(r, TKD_ERR_FORMAT, target->args.v[i], "cannot unpack into this target");
        TKD_TRY(tkd_jscope_set(r, sc, target->args.v[i]->s, v->u.l.v[i]));
    }
    return TKD_OK;
}

static tkd_status tkd_jexec_set(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n)
{
    tkd_jv *v = NULL;
    if (n->b) {
        TKD_TRY(tkd_jinja_eval(r, sc, n->b, &v));
    } else { /* {% set x %}...{% endset %} */
        tkd_jbuf buf = {0}, *saved = r->out;
        r->out = &buf;
        tkd_status st = tkd_jinja_exec_block(r, sc, &n->body);
        r->out = saved;
        if (st == TKD_OK && !(v = tkd_jv_str(r->a, buf.p ? buf.p : "", buf.n)))
            st = tkd_jnomem();
        free(buf.p);
        TKD_TRY(st);
    }
    if (n->a->kind != TKD_JN_MEMBER)
        return tkd_jbind(r, sc, n->a, v);
    tkd_jv *obj = NULL;
    TKD_TRY(tkd_jinja_eval(r, sc, n->a->a, &obj));
    if (obj->t != TKD_JV_NS)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "cannot set an attribute of a %s (only of a namespace)",
                              tkd_jv_type_name(obj));
    if (n->a->b->kind != TKD_JN_IDENT)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, n, "a namespace attribute must be a name");
    tkd_jv *k = tkd_jv_str(r->a, n->a->b->s, strlen(n->a->b->s));
    return k ? tkd_jv_dict_set(r->a, obj, k, v) : tkd_jnomem();
}

/* The loop object of item i of n (index, index0, revindex, revindex0, first, last, length, previtem, nextitem). */
static tkd_status tkd_jloop_obj(tkd_jrender *r, tkd_jv *const *items, size_t i, size_t n, tkd_jv **out)
{
    static const char *const names[] = {"index", "index0", "revindex", "revindex0", "first", "last", "length",
                                        "previtem", "nextitem"};
    tkd_jv *vals[9] = {
        tkd_jv_int(r->a, (long long)i + 1), tkd_jv_int(r->a, (long long)i), tkd_jv_int(r->a, (long long)(n - i)),
        tkd_jv_int(r->a, (long long)(n - i - 1)), tkd_jv_bool(r->a, i == 0), tkd_jv_bool(r->a, i == n - 1),
        tkd_jv_int(r->a, (long long)n), i > 0 ? items[i - 1] : tkd_jv_new(r->a, TKD_JV_UNDEF),
        i + 1 < n ? items[i + 1] : tkd_jv_new(r->a, TKD_JV_UNDEF)};
    if (!(*out = tkd_jv_new(r->a, TKD_JV_DICT)))
        return tkd_jnomem();
    for (size_t k = 0; k < 9; k++) {
        tkd_jv *key = tkd_jv_str(r->a, names[k], strlen(names[k]));
        if (!key || !vals[k])
            return tkd_jnomem();
        TKD_TRY(tkd_jv_dict_set(r->a, *out, key, vals[k]));
    }
    return TKD_OK;
}

static tkd_status tkd_jexec_for(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n)
{
    tkd_jscope *ls = NULL;
    TKD_TRY(tkd_jscope_new(r, sc, &ls));
    tkd_jv *it = NULL;
    TKD_TRY(tkd_jinja_eval(r, ls, n->b, &it));
    if (it->t == TKD_JV_DICT) { /* iterating a dict gives its keys */
        tkd_jv *keys = tkd_jv_new(r->a, TKD_JV_LIST);
        if (!keys)
            return tkd_jnomem();
        for (size_t i = 0; i < it->u.d.n; i++)
            TKD_TRY(tkd_jv_list_push(r->a, keys, it->u.d.k[i]));
        it = keys;
    }
    if (it->t != TKD_JV_LIST)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, n->b, "cannot iterate over a %s", tkd_jv_type_name(it));
    tkd_jv **items = tkd_jarena_alloc(r->a, (it->u.l.n + 1) * sizeof *items);
    if (!items)
        return tkd_jnomem();
    size_t count = 0;
    for (size_t i = 0; i < it->u.l.n; i++) { /* the `if` of `for x in xs if c` filters first */
        if (n->c) {
            tkd_jscope *ts = NULL;
            tkd_jv *keep = NULL;
            TKD_TRY(tkd_jscope_new(r, ls, &ts));
            TKD_TRY(tkd_jbind(r, ts, n->a, it->u.l.v[i]));
            TKD_TRY(tkd_jinja_eval(r, ts, n->c, &keep));
            if (!tkd_jv_truthy(keep))
                continue;
        }
        items[count++] = it->u.l.v[i];
    }
    int ran = 0;
    for (size_t i = 0; i < count; i++) {
        tkd_jv *loop = NULL;
        TKD_TRY(tkd_jloop_obj(r, items, i, count, &loop));
        TKD_TRY(tkd_jscope_set(r, ls, "loop", loop));
        TKD_TRY(tkd_jbind(r, ls, n->a, items[i]));
        TKD_TRY(tkd_jinja_exec_block(r, ls, &n->body));
        int ctl = r->ctl;
        r->ctl = TKD_JCTL_NONE;
        if (ctl == TKD_JCTL_BREAK)
            break;
        ran = ran || ctl == TKD_JCTL_NONE;
    }
    return ran ? TKD_OK : tkd_jinja_exec_block(r, ls, &n->alt);
}

/* The block's body, and where its text landed in the render's output: transformers' AssistantTracker
 * records (start, end) of what a generation block writes at the top level of the output. */
static tkd_status tkd_jexec_generation(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n)
{
    size_t start = r->out->n;
    TKD_TRY(tkd_jinja_exec_block(r, sc, &n->body));
    tkd_jinja_spans *g = r->generation;
    if (!g || r->out != r->root)
        return TKD_OK;
    if (g->n == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 8;
        tkd_jinja_span *v = realloc(g->v, cap * sizeof *v);
        if (!v)
            return tkd_jnomem();
        g->v = v, g->cap = cap;
    }
    g->v[g->n++] = (tkd_jinja_span){start, r->out->n};
    return TKD_OK;
}

static tkd_status tkd_jexec(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n)
{
    if (++r->steps > TKD_JINJA_MAX_STEPS || r->out->n > TKD_JINJA_MAX_OUTPUT)
        return tkd_jinja_fail(r, TKD_ERR_UNSUPPORTED, n, "unsupported: the template runs past %lld statements or %zu "
                              "bytes of output", TKD_JINJA_MAX_STEPS, TKD_JINJA_MAX_OUTPUT);
    switch (n->kind) {
    case TKD_JN_TEXT: return tkd_jbuf_put(r->out, n->s, n->n);
    case TKD_JN_OUTPUT: {
        tkd_jv *v = NULL;
        TKD_TRY(tkd_jinja_eval(r, sc, n->a, &v));
        if (v->t == TKD_JV_UNDEF || v->t == TKD_JV_NULL) /* the reference prints nothing for both */
            return TKD_OK;
        return tkd_jv_to_string(r->out, v);
    }
    case TKD_JN_IF: {
        tkd_jv *test = NULL;
        TKD_TRY(tkd_jinja_eval(r, sc, n->a, &test));
        return tkd_jinja_exec_block(r, sc, tkd_jv_truthy(test) ? &n->body : &n->alt);
    }
    case TKD_JN_FOR: return tkd_jexec_for(r, sc, n);
    case TKD_JN_SET: return tkd_jexec_set(r, sc, n);
    case TKD_JN_GENERATION: return tkd_jexec_generation(r, sc, n);
    case TKD_JN_MACRO: {
        tkd_jv *fn = tkd_jv_new(r->a, TKD_JV_FUNC);
        if (!fn)
            return tkd_jnomem();
        fn->u.fn.macro = n;
        fn->u.fn.name = n->s;
        return tkd_jscope_set(r, sc, n->s, fn);
    }
    case TKD_JN_BREAK: r->ctl = TKD_JCTL_BREAK; return TKD_OK;
    case TKD_JN_CONTINUE: r->ctl = TKD_JCTL_CONTINUE; return TKD_OK;
    default: return tkd_jinja_fail(r, TKD_ERR_INTERNAL, n, "an expression where a statement was expected");
    }
}

tkd_status tkd_jinja_exec_block(tkd_jrender *r, tkd_jscope *sc, const tkd_jnodes *body)
{
    for (size_t i = 0; i < body->n && r->ctl == TKD_JCTL_NONE; i++)
        TKD_TRY(tkd_jexec(r, sc, body->v[i]));
    return TKD_OK;
}

/* ---- entry points ---- */
tkd_status tkd_jinja_parse(const char *src, size_t len, const char *name, tkd_jinja_template **out)
{
    *out = NULL;
    tkd_jinja_template *t = calloc(1, sizeof *t);
    if (!t)
        return tkd_jnomem();
    t->name = tkd_jarena_strndup(&t->arena, name ? name : "template", strlen(name ? name : "template"));
    t->src = tkd_jarena_strndup(&t->arena, src, len);
    t->len = len;
    if (!t->name || !t->src) {
        tkd_jinja_free(t);
        return tkd_jnomem();
    }
    tkd_jtok *toks = NULL;
    size_t ntok = 0;
    tkd_status st = tkd_jinja_lex(t->src, len, t->name, &t->arena, &toks, &ntok);
    if (st == TKD_OK)
        st = tkd_jinja_parse_tokens(t, toks, ntok);
    free(toks);
    if (st != TKD_OK) {
        tkd_jinja_free(t);
        return st;
    }
    *out = t;
    return TKD_OK;
}

int tkd_jinja_has_generation(const tkd_jinja_template *t) { return t->has_generation; }

void tkd_jinja_spans_free(tkd_jinja_spans *s)
{
    free(s->v);
    *s = (tkd_jinja_spans){0};
}

void tkd_jinja_free(tkd_jinja_template *t)
{
    if (!t)
        return;
    tkd_jarena_free(&t->arena);
    free(t);
}

tkd_status tkd_jinja_render(const tkd_jinja_template *t, const char *ctx_json, size_t ctx_len,
                            const tkd_jinja_render_opts *opts, char **out, size_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    tkd_jarena arena = {0};
    tkd_jbuf buf = {0};
    tkd_jrender r = {.t = t, .a = &arena, .out = &buf, .root = &buf, .generation = opts ? opts->generation : NULL,
                     .now = opts && opts->now >= 0 ? opts->now : (long long)time(NULL)};
    if (r.generation)
        r.generation->n = 0;
    tkd_jscope *root = NULL;
    tkd_jv *ctx = NULL;
    tkd_status st = tkd_jv_from_json(&arena, ctx_json, ctx_len, &ctx);
    if (st == TKD_OK && ctx->t != TKD_JV_DICT)
        st = tkd_error_set(TKD_ERR_FORMAT, "%s: the render context must be a JSON object, got %s", t->name,
                           tkd_jv_type_name(ctx));
    if (st == TKD_OK)
        st = tkd_jscope_new(&r, NULL, &root);
    if (st == TKD_OK) {
        root->vars = ctx;
        st = tkd_jinja_exec_block(&r, root, &t->body);
    }
    if (st == TKD_OK && !buf.p)
        st = tkd_jbuf_put(&buf, "", 0);
    tkd_jarena_free(&arena);
    if (st != TKD_OK) {
        free(buf.p);
        return st;
    }
    *out = buf.p;
    *out_len = buf.n;
    return TKD_OK;
}
