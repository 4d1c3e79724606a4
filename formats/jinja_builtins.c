/* jinja_builtins.c — formats/jinja's globals (raise_exception, strftime_now, namespace, range,
 * true/false/none), the methods of strings and dicts (.strip(), .split(), .items(), ...), the
 * filters and the tests, each with @huggingface/jinja's behaviour. A filter, test or method it
 * does not have is refused as TKD_ERR_UNSUPPORTED naming it; a known one applied to a value it
 * does not take is TKD_ERR_FORMAT, as the reference throws there too. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <utf8proc.h>

#include "formats/jinja_internal.h"

enum tkd_jfn {
    TKD_JFN_RAISE = 1, TKD_JFN_STRFTIME, TKD_JFN_NAMESPACE, TKD_JFN_RANGE,
    /* string methods */
    TKD_JFN_UPPER, TKD_JFN_LOWER, TKD_JFN_STRIP, TKD_JFN_LSTRIP, TKD_JFN_RSTRIP, TKD_JFN_TITLE, TKD_JFN_CAPITALIZE,
    TKD_JFN_STARTSWITH, TKD_JFN_ENDSWITH, TKD_JFN_SPLIT, TKD_JFN_REPLACE,
    /* dict methods */
    TKD_JFN_GET, TKD_JFN_ITEMS, TKD_JFN_KEYS, TKD_JFN_VALUES,
};

static tkd_status tkd_jnomem(void)
{
    return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
}

static tkd_jv *tkd_jfn(tkd_jarena *a, int id, tkd_jv *self, const char *name)
{
    tkd_jv *f = tkd_jv_new(a, TKD_JV_FUNC);
    if (f) {
        f->u.fn.builtin = id;
        f->u.fn.self = self;
        f->u.fn.name = name;
    }
    return f;
}

tkd_jv *tkd_jinja_global(tkd_jarena *a, const char *name)
{
    static const struct { const char *name; int id; } fns[] = {
        {"raise_exception", TKD_JFN_RAISE}, {"strftime_now", TKD_JFN_STRFTIME},
        {"namespace", TKD_JFN_NAMESPACE},   {"range", TKD_JFN_RANGE}};
    for (size_t i = 0; i < sizeof fns / sizeof *fns; i++)
        if (!strcmp(name, fns[i].name))
            return tkd_jfn(a, fns[i].id, NULL, fns[i].name);
    if (!strcmp(name, "true") || !strcmp(name, "True"))
        return tkd_jv_bool(a, 1);
    if (!strcmp(name, "false") || !strcmp(name, "False"))
        return tkd_jv_bool(a, 0);
    if (!strcmp(name, "none") || !strcmp(name, "None"))
        return tkd_jv_new(a, TKD_JV_NULL);
    return NULL;
}

tkd_jv *tkd_jinja_method(tkd_jarena *a, tkd_jv *obj, const char *name)
{
    static const struct { const char *name; int id; tkd_jv_type on; } methods[] = {
        {"upper", TKD_JFN_UPPER, TKD_JV_STR},           {"lower", TKD_JFN_LOWER, TKD_JV_STR},
        {"strip", TKD_JFN_STRIP, TKD_JV_STR},           {"lstrip", TKD_JFN_LSTRIP, TKD_JV_STR},
        {"rstrip", TKD_JFN_RSTRIP, TKD_JV_STR},         {"title", TKD_JFN_TITLE, TKD_JV_STR},
        {"capitalize", TKD_JFN_CAPITALIZE, TKD_JV_STR}, {"startswith", TKD_JFN_STARTSWITH, TKD_JV_STR},
        {"endswith", TKD_JFN_ENDSWITH, TKD_JV_STR},     {"split", TKD_JFN_SPLIT, TKD_JV_STR},
        {"replace", TKD_JFN_REPLACE, TKD_JV_STR},       {"get", TKD_JFN_GET, TKD_JV_DICT},
        {"items", TKD_JFN_ITEMS, TKD_JV_DICT},          {"keys", TKD_JFN_KEYS, TKD_JV_DICT},
        {"values", TKD_JFN_VALUES, TKD_JV_DICT}};
    if (!strcmp(name, "length") && (obj->t == TKD_JV_STR || obj->t == TKD_JV_LIST))
        return tkd_jv_int(a, obj->t == TKD_JV_STR ? (long long)tkd_jstr_utf16_len(obj->u.s.p, obj->u.s.n)
                                                  : (long long)obj->u.l.n);
    for (size_t i = 0; i < sizeof methods / sizeof *methods; i++)
        if (obj->t == methods[i].on && !strcmp(name, methods[i].name))
            return tkd_jfn(a, methods[i].id, obj, methods[i].name);
    return NULL;
}

static tkd_status tkd_jret_str(tkd_jrender *r, const char *s, size_t n, tkd_jv **out)
{
    return (*out = tkd_jv_str(r->a, s, n)) ? TKD_OK : tkd_jnomem();
}

static tkd_status tkd_jret_buf(tkd_jrender *r, tkd_jbuf *b, tkd_status st, tkd_jv **out)
{
    if (st == TKD_OK)
        st = tkd_jret_str(r, b->p ? b->p : "", b->n, out);
    free(b->p);
    return st;
}

/* upper / lower map every code point (utf8proc's simple case mapping: JavaScript also expands a few,
 * like ß to SS); title upper-cases an ASCII letter after a non-word character, as the reference's
 * /\b\w/ does; capitalize upper-cases the first code point only. */
static tkd_status tkd_jcase(tkd_jrender *r, const tkd_jv *s, int mode, tkd_jv **out)
{
    tkd_jbuf b = {0};
    tkd_status st = tkd_jbuf_put(&b, "", 0);
    const utf8proc_uint8_t *p = (const utf8proc_uint8_t *)s->u.s.p;
    utf8proc_ssize_t n = (utf8proc_ssize_t)s->u.s.n, i = 0;
    int prev_word = 0;
    while (st == TKD_OK && i < n) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t len = utf8proc_iterate(p + i, n - i, &cp);
        if (len <= 0) { /* not UTF-8: the byte is copied */
            st = tkd_jbuf_putc(&b, (char)p[i++]);
            prev_word = 0;
            continue;
        }
        int word = cp < 128 && (isalnum(cp) || cp == '_');
        if (mode == 'U' || (mode == 'C' && i == 0))
            cp = utf8proc_toupper(cp);
        else if (mode == 'L')
            cp = utf8proc_tolower(cp);
        else if (mode == 'T' && word && !prev_word)
            cp = toupper(cp);
        utf8proc_uint8_t enc[4];
        st = tkd_jbuf_put(&b, (const char *)enc, (size_t)utf8proc_encode_char(cp, enc));
        prev_word = word;
        i += len;
    }
    return tkd_jret_buf(r, &b, st, out);
}

static tkd_status tkd_jtrim(tkd_jrender *r, const tkd_jv *s, int left, int right, tkd_jv **out)
{
    size_t a, b;
    tkd_jstr_trim(s->u.s.p, s->u.s.n, left, right, &a, &b);
    return tkd_jret_str(r, s->u.s.p + a, b - a, out);
}

static int tkd_jaffix(const tkd_jv *s, const tkd_jv *x, int end)
{
    if (x->u.s.n > s->u.s.n)
        return 0;
    return !memcmp(s->u.s.p + (end ? s->u.s.n - x->u.s.n : 0), x->u.s.p, x->u.s.n);
}

static tkd_status tkd_jstartsends(tkd_jrender *r, const tkd_jnode *at, const tkd_jv *s, const tkd_jargs *a, int end,
                                  tkd_jv **out)
{
    const tkd_jv *x = a->npos ? a->pos[0] : NULL;
    int yes = 0;
    if (x && x->t == TKD_JV_STR) {
        yes = tkd_jaffix(s, x, end);
    } else if (x && x->t == TKD_JV_LIST) {
        for (size_t i = 0; i < x->u.l.n && !yes; i++) {
            if (x->u.l.v[i]->t != TKD_JV_STR)
                return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "%s(): tuple elements must be strings",
                                      end ? "endswith" : "startswith");
            yes = tkd_jaffix(s, x->u.l.v[i], end);
        }
    } else {
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "%s() takes a string or a tuple of strings",
                              end ? "endswith" : "startswith");
    }
    return (*out = tkd_jv_bool(r->a, yes)) ? TKD_OK : tkd_jnomem();
}

static int tkd_jascii_space(char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r');
}

/* Python's str.split(sep=None, maxsplit=-1). */
static tkd_status tkd_jsplit(tkd_jrender *r, const tkd_jnode *at, const tkd_jv *s, const tkd_jargs *a, tkd_jv **out)
{
    const tkd_jv *sep = a->npos > 0 ? a->pos[0] : NULL;
    long long maxsplit = a->npos > 1 && a->pos[1]->t == TKD_JV_INT ? a->pos[1]->u.i : -1;
    if (sep && sep->t != TKD_JV_STR && sep->t != TKD_JV_NULL)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "split(): the separator must be a string or none");
    if (!(*out = tkd_jv_new(r->a, TKD_JV_LIST)))
        return tkd_jnomem();
    const char *p = s->u.s.p;
    size_t n = s->u.s.n, i = 0;
    tkd_jv *piece;
    if (!sep || sep->t == TKD_JV_NULL) {
        for (;;) {
            while (i < n && tkd_jascii_space(p[i]))
                i++;
            if (i >= n)
                return TKD_OK;
            size_t j = i;
            if (maxsplit >= 0 && (long long)(*out)->u.l.n >= maxsplit)
                j = n;
            while (j < n && !tkd_jascii_space(p[j]))
                j++;
            if (!(piece = tkd_jv_str(r->a, p + i, j - i)))
                return tkd_jnomem();
            TKD_TRY(tkd_jv_list_push(r->a, *out, piece));
            i = j;
        }
    }
    if (sep->u.s.n == 0)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "split(): empty separator");
    for (;;) {
        size_t j = i;
        int found = 0;
        if (maxsplit < 0 || (long long)(*out)->u.l.n < maxsplit)
            for (; j + sep->u.s.n <= n; j++)
                if (!memcmp(p + j, sep->u.s.p, sep->u.s.n)) {
                    found = 1;
                    break;
                }
        if (!found)
            j = n;
        if (!(piece = tkd_jv_str(r->a, p + i, j - i)))
            return tkd_jnomem();
        TKD_TRY(tkd_jv_list_push(r->a, *out, piece));
        if (!found)
            return TKD_OK;
        i = j + sep->u.s.n;
    }
}

static tkd_status tkd_jreplace(tkd_jrender *r, const tkd_jnode *at, const tkd_jv *s, const tkd_jargs *a, tkd_jv **out)
{
    if (a->npos < 2 || a->pos[0]->t != TKD_JV_STR || a->pos[1]->t != TKD_JV_STR)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "replace() takes two strings");
    const tkd_jv *old = a->pos[0], *new = a->pos[1];
    const tkd_jv *cnt = a->npos > 2 ? a->pos[2] : tkd_jargs_kw(a, "count");
    long long left = cnt && cnt->t == TKD_JV_INT && cnt->u.i >= 0 ? cnt->u.i : -1;
    if (old->u.s.n == 0)
        return tkd_jinja_fail(r, TKD_ERR_UNSUPPORTED, at, "unsupported construct 'replace' with an empty pattern");
    tkd_jbuf b = {0};
    tkd_status st = TKD_OK;
    size_t i = 0;
    while (st == TKD_OK && i < s->u.s.n) {
        if (left != 0 && i + old->u.s.n <= s->u.s.n && !memcmp(s->u.s.p + i, old->u.s.p, old->u.s.n)) {
            st = tkd_jbuf_put(&b, new->u.s.p, new->u.s.n);
            i += old->u.s.n;
            left -= left > 0;
        } else {
            st = tkd_jbuf_putc(&b, s->u.s.p[i++]);
        }
    }
    return tkd_jret_buf(r, &b, st, out);
}

/* [key, value] pairs (items), keys or values of a dict. */
static tkd_status tkd_jdict_view(tkd_jrender *r, const tkd_jv *d, int which, tkd_jv **out)
{
    if (!(*out = tkd_jv_new(r->a, TKD_JV_LIST)))
        return tkd_jnomem();
    for (size_t i = 0; i < d->u.d.n; i++) {
        tkd_jv *item = which == TKD_JFN_KEYS ? d->u.d.k[i] : d->u.d.v[i];
        if (which == TKD_JFN_ITEMS) {
            if (!(item = tkd_jv_new(r->a, TKD_JV_LIST)))
                return tkd_jnomem();
            TKD_TRY(tkd_jv_list_push(r->a, item, d->u.d.k[i]));
            TKD_TRY(tkd_jv_list_push(r->a, item, d->u.d.v[i]));
        }
        TKD_TRY(tkd_jv_list_push(r->a, *out, item));
    }
    return TKD_OK;
}

/* strftime_now: the reference's subset of formats (%Y %m %d %b %B %H %M %%), in UTC. */
static tkd_status tkd_jstrftime(tkd_jrender *r, const tkd_jnode *at, const tkd_jargs *a, tkd_jv **out)
{
    if (a->npos < 1 || a->pos[0]->t != TKD_JV_STR)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "strftime_now() takes a format string");
    static const char *const months[] = {"January", "February", "March",     "April",   "May",      "June",
                                         "July",    "August",   "September", "October", "November", "December"};
    time_t now = (time_t)r->now;
    struct tm tm;
    gmtime_r(&now, &tm);
    const tkd_jv *f = a->pos[0];
    tkd_jbuf b = {0};
    tkd_status st = TKD_OK;
    for (size_t i = 0; st == TKD_OK && i < f->u.s.n; i++) {
        char tmp[16] = {0};
        char c = i + 1 < f->u.s.n && f->u.s.p[i] == '%' ? f->u.s.p[i + 1] : 0;
        switch (c) {
        case 'Y': snprintf(tmp, sizeof tmp, "%d", tm.tm_year + 1900); break;
        case 'm': snprintf(tmp, sizeof tmp, "%02d", tm.tm_mon + 1); break;
        case 'd': snprintf(tmp, sizeof tmp, "%02d", tm.tm_mday); break;
        case 'b': snprintf(tmp, sizeof tmp, "%.3s", months[tm.tm_mon]); break;
        case 'B': snprintf(tmp, sizeof tmp, "%s", months[tm.tm_mon]); break;
        case 'H': snprintf(tmp, sizeof tmp, "%02d", tm.tm_hour); break;
        case 'M': snprintf(tmp, sizeof tmp, "%02d", tm.tm_min); break;
        case '%': tmp[0] = '%'; break;
        default: break;
        }
        if (tmp[0]) {
            st = tkd_jbuf_put(&b, tmp, strlen(tmp));
            i++;
        } else {
            st = tkd_jbuf_putc(&b, f->u.s.p[i]);
        }
    }
    return tkd_jret_buf(r, &b, st, out);
}

static tkd_status tkd_jnamespace(tkd_jrender *r, const tkd_jnode *at, const tkd_jargs *a, tkd_jv **out)
{
    if (!(*out = tkd_jv_new(r->a, TKD_JV_NS)))
        return tkd_jnomem();
    if (a->npos > 1 || (a->npos == 1 && a->pos[0]->t != TKD_JV_DICT))
        return tkd_jinja_fail(r, TKD_ERR_UNSUPPORTED, at, "unsupported construct 'namespace' with positional arguments "
                                                          "other than one dict");
    for (size_t i = 0; a->npos && i < a->pos[0]->u.d.n; i++)
        TKD_TRY(tkd_jv_dict_set(r->a, *out, a->pos[0]->u.d.k[i], a->pos[0]->u.d.v[i]));
    for (size_t i = 0; i < a->nkw; i++) {
        tkd_jv *k = tkd_jv_str(r->a, a->kwn[i], strlen(a->kwn[i]));
        if (!k)
            return tkd_jnomem();
        TKD_TRY(tkd_jv_dict_set(r->a, *out, k, a->kwv[i]));
    }
    return TKD_OK;
}

static tkd_status tkd_jrange(tkd_jrender *r, const tkd_jnode *at, const tkd_jargs *a, tkd_jv **out)
{
    long long v[3] = {0, 0, 1};
    if (a->npos < 1 || a->npos > 3)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "range() takes 1 to 3 integers");
    for (size_t i = 0; i < a->npos; i++) {
        if (a->pos[i]->t != TKD_JV_INT)
            return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "range() takes integers, got %s", tkd_jv_type_name(a->pos[i]));
        v[a->npos == 1 ? 1 : i] = a->pos[i]->u.i;
    }
    if (v[2] == 0)
        return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "range() step must not be zero");
    if (!(*out = tkd_jv_new(r->a, TKD_JV_LIST)))
        return tkd_jnomem();
    long long count = v[2] > 0 ? (v[1] - v[0] + v[2] - 1) / v[2] : (v[0] - v[1] - v[2] - 1) / -v[2];
    if (count > (1 << 20)) /* a chat template counts messages, not millions */
        return tkd_jinja_fail(r, TKD_ERR_UNSUPPORTED, at, "unsupported: range() of %lld items", count);
    for (long long i = v[0]; v[2] > 0 ? i < v[1] : i > v[1]; i += v[2]) {
        tkd_jv *x = tkd_jv_int(r->a, i);
        if (!x)
            return tkd_jnomem();
        TKD_TRY(tkd_jv_list_push(r->a, *out, x));
    }
    return TKD_OK;
}

static tkd_status tkd_jraise(tkd_jrender *r, const tkd_jnode *at, const tkd_jargs *a)
{
    tkd_jbuf b = {0};
    tkd_status st = a->npos ? tkd_jv_to_string(&b, a->pos[0]) : TKD_OK;
    if (st == TKD_OK)
        st = tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "raise_exception: %s", b.p ? b.p : "");
    free(b.p);
    return st;
}

tkd_status tkd_jinja_call_builtin(tkd_jrender *r, const tkd_jnode *at, const tkd_jv *fn, const tkd_jargs *a,
                                  tkd_jv **out)
{
    tkd_jv *self = fn->u.fn.self;
    switch (fn->u.fn.builtin) {
    case TKD_JFN_RAISE: return tkd_jraise(r, at, a);
    case TKD_JFN_STRFTIME: return tkd_jstrftime(r, at, a, out);
    case TKD_JFN_NAMESPACE: return tkd_jnamespace(r, at, a, out);
    case TKD_JFN_RANGE: return tkd_jrange(r, at, a, out);
    case TKD_JFN_UPPER: return tkd_jcase(r, self, 'U', out);
    case TKD_JFN_LOWER: return tkd_jcase(r, self, 'L', out);
    case TKD_JFN_TITLE: return tkd_jcase(r, self, 'T', out);
    case TKD_JFN_CAPITALIZE: return tkd_jcase(r, self, 'C', out);
    case TKD_JFN_STRIP:
    case TKD_JFN_LSTRIP:
    case TKD_JFN_RSTRIP:
        /* The reference ignores a chars argument and trims whitespace (Python would strip only
         * chars): followed here, since its output is the one to match. */
        return tkd_jtrim(r, self, fn->u.fn.builtin != TKD_JFN_RSTRIP, fn->u.fn.builtin != TKD_JFN_LSTRIP, out);
    case TKD_JFN_STARTSWITH: return tkd_jstartsends(r, at, self, a, 0, out);
    case TKD_JFN_ENDSWITH: return tkd_jstartsends(r, at, self, a, 1, out);
    case TKD_JFN_SPLIT: return tkd_jsplit(r, at, self, a, out);
    case TKD_JFN_REPLACE: return tkd_jreplace(r, at, self, a, out);
    case TKD_JFN_GET:
        if (a->npos < 1 || a->pos[0]->t != TKD_JV_STR)
            return tkd_jinja_fail(r, TKD_ERR_FORMAT, at, "get() takes a string key");
        *out = tkd_jv_dict_get(self, a->pos[0]->u.s.p, a->pos[0]->u.s.n);
        if (!*out)
            *out = a->npos > 1 ? a->pos[1] : tkd_jv_new(r->a, TKD_JV_NULL);
        return *out ? TKD_OK : tkd_jnomem();
    case TKD_JFN_ITEMS:
    case TKD_JFN_KEYS:
    case TKD_JFN_VALUES: return tkd_jdict_view(r, self, fn->u.fn.builtin, out);
    default: return tkd_jinja_fail(r, TKD_ERR_INTERNAL, at, "unknown builtin %d", fn->u.fn.builtin);
    }
}
