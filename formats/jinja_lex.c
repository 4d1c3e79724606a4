/* jinja_lex.c — the template's text to tokens, exactly as @huggingface/jinja tokenizes it (its
 * preprocess() then tokenize()), so that whitespace comes out byte for byte the same:
 *   1. one trailing newline of the template is dropped;
 *   2. lstrip_blocks: spaces and tabs before a `{%`, `{#` (or `{-`) that starts a line are dropped;
 *   3. trim_blocks: the newline right after `%}`, `#}` (or `-}`) is dropped;
 *   4. `{%-`, `{{-`, `{#-` strip the whitespace before them, `-%}`, `-}}`, `-#}` the whitespace after.
 * Each preprocessing pass keeps, for every byte it writes, its offset in the original text, so
 * that errors name the line and column the author sees. */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/jinja_internal.h"

tkd_status tkd_jinja_error_at(tkd_status st, const char *name, const char *src, size_t len, size_t pos,
                              const char *fmt, ...)
{
    int line = 1, col = 1;
    for (size_t i = 0; i < pos && i < len; i++) {
        if (src[i] == '\n') {
            line++;
            col = 1;
        } else if (((unsigned char)src[i] & 0xC0) != 0x80) {
            col++;
        }
    }
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return tkd_error_set(st, "%s:%d:%d: %s", name, line, col, msg);
}

/* Text with the original offset of each byte. */
typedef struct tkd_jsrc {
    char *p;
    size_t *at;
    size_t n;
} tkd_jsrc;

static tkd_status tkd_jsrc_alloc(tkd_jsrc *s, size_t cap)
{
    s->p = malloc(cap + 1);
    s->at = malloc((cap + 1) * sizeof *s->at);
    s->n = 0;
    if (!s->p || !s->at) {
        free(s->p);
        free(s->at);
        return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
    }
    return TKD_OK;
}

static void tkd_jsrc_free(tkd_jsrc *s)
{
    free(s->p);
    free(s->at);
}

static void tkd_jsrc_push(tkd_jsrc *d, const tkd_jsrc *s, size_t i)
{
    d->p[d->n] = s->p[i];
    d->at[d->n++] = s->at[i];
}

static int tkd_jlex_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* lstrip_blocks: /^[ \t]*({[#%-])/gm -> "$1" (^ after \n or \r, as JavaScript's multiline ^). */
static void tkd_jlex_lstrip(const tkd_jsrc *s, tkd_jsrc *d)
{
    for (size_t i = 0; i < s->n;) {
        if (i == 0 || s->p[i - 1] == '\n' || s->p[i - 1] == '\r') {
            size_t j = i;
            while (j < s->n && (s->p[j] == ' ' || s->p[j] == '\t'))
                j++;
            if (j + 1 < s->n && s->p[j] == '{' && strchr("#%-", s->p[j + 1]) && s->p[j + 1])
                i = j;
        }
        /* copy up to and including the next line break */
        do {
            tkd_jsrc_push(d, s, i);
        } while (s->p[i] != '\n' && s->p[i] != '\r' && ++i < s->n);
        if (i < s->n && (s->p[i] == '\n' || s->p[i] == '\r'))
            i++;
    }
}

/* trim_blocks: /([#%-]})\n/g -> "$1". */
static void tkd_jlex_trim(const tkd_jsrc *s, tkd_jsrc *d)
{
    for (size_t i = 0; i < s->n; i++) {
        tkd_jsrc_push(d, s, i);
        if (s->p[i] == '}' && i > 0 && strchr("#%-", s->p[i - 1]) && s->p[i - 1] && i + 1 < s->n &&
            s->p[i + 1] == '\n')
            i++;
    }
}

static tkd_status tkd_jlex_preprocess(const char *src, size_t len, tkd_jsrc *out)
{
    tkd_jsrc a, b;
    TKD_TRY(tkd_jsrc_alloc(&a, len));
    if (len > 0 && src[len - 1] == '\n')
        len--;
    memcpy(a.p, src, len);
    for (size_t i = 0; i < len; i++)
        a.at[i] = i;
    a.n = len;
    tkd_status st = tkd_jsrc_alloc(&b, len);
    if (st != TKD_OK) {
        tkd_jsrc_free(&a);
        return st;
    }
    tkd_jlex_lstrip(&a, &b);
    a.n = 0;
    tkd_jlex_trim(&b, &a);
    tkd_jsrc_free(&b);
    a.p[a.n] = 0;
    a.at[a.n] = len;
    *out = a;
    return TKD_OK;
}

/* ---- the tokenizer proper ---- */
typedef struct tkd_jlexer {
    tkd_jsrc s;
    size_t i;
    const char *name, *orig;
    size_t orig_len;
    tkd_jarena *a;
    tkd_jtok *v;
    size_t n, cap;
    int curly; /* depth of { } inside an expression, so that "}}" of a dict literal is two braces */
} tkd_jlexer;

static tkd_status tkd_jlex_err(tkd_jlexer *L, size_t i, const char *what)
{
    size_t pos = i < L->s.n ? L->s.at[i] : L->orig_len;
    return tkd_jinja_error_at(TKD_ERR_FORMAT, L->name, L->orig, L->orig_len, pos, "%s", what);
}

static tkd_status tkd_jlex_push(tkd_jlexer *L, tkd_jtok_type type, const char *s, size_t n, size_t at)
{
    if (L->n == L->cap) {
        size_t cap = L->cap ? 2 * L->cap : 256;
        tkd_jtok *v = realloc(L->v, cap * sizeof *v);
        if (!v)
            return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
        L->v = v;
        L->cap = cap;
    }
    char *copy = tkd_jarena_strndup(L->a, s, n);
    if (!copy)
        return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
    L->v[L->n++] = (tkd_jtok){type, copy, n, at < L->s.n ? L->s.at[at] : L->orig_len};
    return TKD_OK;
}

static tkd_jtok_type tkd_jlex_last(const tkd_jlexer *L)
{
    return L->n ? L->v[L->n - 1].type : TKD_JTOK_EOF;
}

/* `{%-` and friends: the text before loses its trailing whitespace (and goes when empty). */
static void tkd_jlex_strip_before(tkd_jlexer *L)
{
    if (!L->n || L->v[L->n - 1].type != TKD_JTOK_TEXT)
        return;
    tkd_jtok *t = &L->v[L->n - 1];
    size_t start, end;
    tkd_jstr_trim(t->s, t->n, 0, 1, &start, &end);
    t->n = end;
    ((char *)t->s)[end] = 0;
    if (t->n == 0)
        L->n--;
}

static void tkd_jlex_skip_space(tkd_jlexer *L)
{
    while (L->i < L->s.n && tkd_jlex_space(L->s.p[L->i]))
        L->i++;
}

static int tkd_jlex_at(const tkd_jlexer *L, const char *lit)
{
    size_t k = strlen(lit);
    return L->i + k <= L->s.n && !memcmp(L->s.p + L->i, lit, k);
}

static tkd_status tkd_jlex_text(tkd_jlexer *L, int *made)
{
    size_t i = L->i;
    while (i < L->s.n && !(L->s.p[i] == '{' && i + 1 < L->s.n && strchr("%{#", L->s.p[i + 1])))
        i++;
    *made = i > L->i;
    if (!*made)
        return TKD_OK;
    TKD_TRY(tkd_jlex_push(L, TKD_JTOK_TEXT, L->s.p + L->i, i - L->i, L->i));
    L->i = i;
    return TKD_OK;
}

static tkd_status tkd_jlex_comment(tkd_jlexer *L)
{
    size_t start = L->i;
    L->i += 2;
    int strip_before = L->i < L->s.n && L->s.p[L->i] == '-';
    while (L->i + 1 >= L->s.n || L->s.p[L->i] != '#' || L->s.p[L->i + 1] != '}') {
        if (L->i + 2 >= L->s.n)
            return tkd_jlex_err(L, start, "missing end of comment tag '#}'");
        L->i++;
    }
    int strip_after = L->s.p[L->i - 1] == '-' && L->i - 1 > start + 2;
    if (strip_before)
        tkd_jlex_strip_before(L);
    TKD_TRY(tkd_jlex_push(L, TKD_JTOK_COMMENT, "", 0, start));
    L->i += 2;
    if (strip_after)
        tkd_jlex_skip_space(L);
    return TKD_OK;
}

/* A string literal's body with its escapes (the reference's set: \n \t \r \b \f \v \' \" \\ \xHH \uHHHH). */
static tkd_status tkd_jlex_string(tkd_jlexer *L)
{
    char q = L->s.p[L->i];
    size_t start = L->i++;
    tkd_jbuf b = {0};
    tkd_status st = TKD_OK;
    while (st == TKD_OK) {
        if (L->i >= L->s.n) {
            st = tkd_jlex_err(L, start, "unterminated string literal");
            break;
        }
        char c = L->s.p[L->i];
        if (c == q)
            break;
        if (c != '\\') {
            st = tkd_jbuf_putc(&b, c);
            L->i++;
            continue;
        }
        if (++L->i >= L->s.n) {
            st = tkd_jlex_err(L, start, "unterminated string literal");
            break;
        }
        char e = L->s.p[L->i++];
        const char *from = "ntrbfv'\"\\", *to = "\n\t\r\b\f\v'\"\\";
        const char *k = strchr(from, e);
        if (e == 'x' || e == 'u') {
            size_t w = e == 'x' ? 2 : 4;
            unsigned cp = 0;
            for (size_t j = 0; j < w; j++) {
                char h = L->i + j < L->s.n ? L->s.p[L->i + j] : 0;
                if (!isxdigit((unsigned char)h))
                    return free(b.p), tkd_jlex_err(L, L->i - 2, "invalid hexadecimal escape in string literal");
                cp = cp * 16 + (unsigned)(isdigit((unsigned char)h) ? h - '0' : (tolower((unsigned char)h) - 'a' + 10));
            }
            L->i += w;
            char u[4];
            size_t m = cp < 0x80 ? 1 : cp < 0x800 ? 2 : 3;
            if (m == 1)
                u[0] = (char)cp;
            else if (m == 2)
                u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 63));
            else
                u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 63)), u[2] = (char)(0x80 | (cp & 63));
            st = tkd_jbuf_put(&b, u, m);
        } else if (e && k) {
            st = tkd_jbuf_putc(&b, to[k - from]);
        } else {
            st = tkd_jlex_err(L, L->i - 2, "unexpected escaped character in string literal");
        }
    }
    if (st == TKD_OK)
        st = tkd_jlex_push(L, TKD_JTOK_STR, b.p ? b.p : "", b.n, start);
    free(b.p);
    L->i++;
    return st;
}

static int tkd_jlex_word(char c)
{
    return isalnum((unsigned char)c) || c == '_';
}

static tkd_status tkd_jlex_number(tkd_jlexer *L, size_t start)
{
    size_t i = L->i;
    while (i < L->s.n && isdigit((unsigned char)L->s.p[i]))
        i++;
    if (tkd_jlex_last(L) != TKD_JTOK_DOT && i + 1 < L->s.n && L->s.p[i] == '.' &&
        isdigit((unsigned char)L->s.p[i + 1])) {
        i++;
        while (i < L->s.n && isdigit((unsigned char)L->s.p[i]))
            i++;
    }
    L->i = i;
    return tkd_jlex_push(L, TKD_JTOK_NUM, L->s.p + start, i - start, start);
}

/* A + or - where an operand starts is a sign (a negative literal when digits follow). */
static int tkd_jlex_sign_context(tkd_jtok_type last)
{
    return !(last == TKD_JTOK_IDENT || last == TKD_JTOK_NUM || last == TKD_JTOK_STR || last == TKD_JTOK_RPAREN ||
             last == TKD_JTOK_RBRACKET);
}

static const struct {
    const char *lit;
    tkd_jtok_type type;
} tkd_jlex_ops[] = {
    {"{%", TKD_JTOK_OPEN_STMT}, {"%}", TKD_JTOK_CLOSE_STMT}, {"{{", TKD_JTOK_OPEN_EXPR},
    {"}}", TKD_JTOK_CLOSE_EXPR}, {"(", TKD_JTOK_LPAREN},     {")", TKD_JTOK_RPAREN},
    {"{", TKD_JTOK_LBRACE},      {"}", TKD_JTOK_RBRACE},     {"[", TKD_JTOK_LBRACKET},
    {"]", TKD_JTOK_RBRACKET},    {",", TKD_JTOK_COMMA},      {".", TKD_JTOK_DOT},
    {":", TKD_JTOK_COLON},       {"|", TKD_JTOK_PIPE},       {"<=", TKD_JTOK_CMP},
    {">=", TKD_JTOK_CMP},        {"==", TKD_JTOK_CMP},       {"!=", TKD_JTOK_CMP},
    {"<", TKD_JTOK_CMP},         {">", TKD_JTOK_CMP},        {"+", TKD_JTOK_ADD},
    {"-", TKD_JTOK_ADD},         {"~", TKD_JTOK_ADD},        {"**", TKD_JTOK_POW},
    {"*", TKD_JTOK_MUL},         {"//", TKD_JTOK_MUL},       {"/", TKD_JTOK_MUL},
    {"%", TKD_JTOK_MUL},         {"=", TKD_JTOK_EQUALS},
};

static tkd_status tkd_jlex_operator(tkd_jlexer *L, int *made)
{
    for (size_t k = 0; k < sizeof tkd_jlex_ops / sizeof *tkd_jlex_ops; k++) {
        if (tkd_jlex_ops[k].type == TKD_JTOK_CLOSE_EXPR && L->curly > 0)
            continue;
        if (!tkd_jlex_at(L, tkd_jlex_ops[k].lit))
            continue;
        tkd_jtok_type type = tkd_jlex_ops[k].type;
        size_t w = strlen(tkd_jlex_ops[k].lit);
        TKD_TRY(tkd_jlex_push(L, type, tkd_jlex_ops[k].lit, w, L->i));
        if (type == TKD_JTOK_OPEN_EXPR)
            L->curly = 0;
        else if (type == TKD_JTOK_LBRACE)
            L->curly++;
        else if (type == TKD_JTOK_RBRACE)
            L->curly--;
        L->i += w;
        *made = 1;
        return TKD_OK;
    }
    *made = 0;
    return TKD_OK;
}

/* One token inside a tag (or the whitespace-control forms of the tags themselves). */
static tkd_status tkd_jlex_inside(tkd_jlexer *L)
{
    if (tkd_jlex_at(L, "{%-") || tkd_jlex_at(L, "{{-")) {
        int stmt = L->s.p[L->i + 1] == '%';
        tkd_jlex_strip_before(L);
        TKD_TRY(tkd_jlex_push(L, stmt ? TKD_JTOK_OPEN_STMT : TKD_JTOK_OPEN_EXPR, stmt ? "{%" : "{{", 2, L->i));
        L->curly = 0;
        L->i += 3;
        return TKD_OK;
    }
    tkd_jlex_skip_space(L);
    if (L->i >= L->s.n)
        return TKD_OK;
    if (tkd_jlex_at(L, "-%}") || tkd_jlex_at(L, "-}}")) {
        int stmt = L->s.p[L->i + 1] == '%';
        TKD_TRY(tkd_jlex_push(L, stmt ? TKD_JTOK_CLOSE_STMT : TKD_JTOK_CLOSE_EXPR, stmt ? "%}" : "}}", 2, L->i));
        L->i += 3;
        tkd_jlex_skip_space(L);
        return TKD_OK;
    }
    char c = L->s.p[L->i];
    if ((c == '-' || c == '+') && tkd_jlex_sign_context(tkd_jlex_last(L))) {
        if (tkd_jlex_last(L) == TKD_JTOK_TEXT || tkd_jlex_last(L) == TKD_JTOK_EOF)
            return tkd_jlex_err(L, L->i, "unexpected character outside a tag");
        size_t start = L->i++;
        if (L->i < L->s.n && isdigit((unsigned char)L->s.p[L->i]))
            return tkd_jlex_number(L, start);
        return tkd_jlex_push(L, TKD_JTOK_UNARY, L->s.p + start, 1, start);
    }
    int made;
    TKD_TRY(tkd_jlex_operator(L, &made));
    if (made)
        return TKD_OK;
    if (c == '\'' || c == '"')
        return tkd_jlex_string(L);
    if (isdigit((unsigned char)c))
        return tkd_jlex_number(L, L->i);
    if (tkd_jlex_word(c)) {
        size_t start = L->i;
        while (L->i < L->s.n && tkd_jlex_word(L->s.p[L->i]))
            L->i++;
        return tkd_jlex_push(L, TKD_JTOK_IDENT, L->s.p + start, L->i - start, start);
    }
    char what[48];
    snprintf(what, sizeof what, "unexpected character '%c'", c);
    return tkd_jlex_err(L, L->i, what);
}

static tkd_status tkd_jlex_run(tkd_jlexer *L)
{
    while (L->i < L->s.n) {
        tkd_jtok_type last = tkd_jlex_last(L);
        if (last == TKD_JTOK_EOF || last == TKD_JTOK_CLOSE_STMT || last == TKD_JTOK_CLOSE_EXPR ||
            last == TKD_JTOK_COMMENT) {
            int made;
            TKD_TRY(tkd_jlex_text(L, &made));
            if (made)
                continue;
        }
        if (tkd_jlex_at(L, "{#")) {
            TKD_TRY(tkd_jlex_comment(L));
            continue;
        }
        TKD_TRY(tkd_jlex_inside(L));
    }
    return tkd_jlex_push(L, TKD_JTOK_EOF, "", 0, L->s.n);
}

tkd_status tkd_jinja_lex(const char *src, size_t len, const char *name, tkd_jarena *a, tkd_jtok **toks,
                         size_t *ntok)
{
    tkd_jlexer L = {.name = name, .orig = src, .orig_len = len, .a = a};
    TKD_TRY(tkd_jlex_preprocess(src, len, &L.s));
    tkd_status st = tkd_jlex_run(&L);
    tkd_jsrc_free(&L.s);
    if (st != TKD_OK) {
        free(L.v);
        return st;
    }
    *toks = L.v;
    *ntok = L.n;
    return TKD_OK;
}
