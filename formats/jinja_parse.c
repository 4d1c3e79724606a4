/* jinja_parse.c — tokens to the syntax tree, a recursive descent with @huggingface/jinja's grammar
 * and precedence (loosest first): `a if b else c` / `a if b`, or, and, not, comparisons and `in`,
 * + - ~, * / // %, **, `is` tests, | filters, unary signs, calls / members / slices, literals.
 * A statement outside the supported set is refused here, naming it and its line:col. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/jinja_internal.h"

typedef struct tkd_jparser {
    tkd_jinja_template *t;
    const tkd_jtok *tok;
    size_t n, i;
    int depth; /* nesting of expressions and blocks, bounded so that no input overflows the stack */
} tkd_jparser;

enum { TKD_JINJA_MAX_NESTING = 200 };

static const tkd_jtok *tkd_jp_peek(const tkd_jparser *P)
{
    return &P->tok[P->i < P->n ? P->i : P->n - 1];
}

static int tkd_jp_is(const tkd_jparser *P, tkd_jtok_type type)
{
    return tkd_jp_peek(P)->type == type;
}

static int tkd_jp_ident(const tkd_jparser *P, const char *word)
{
    const tkd_jtok *k = tkd_jp_peek(P);
    return k->type == TKD_JTOK_IDENT && !strcmp(k->s, word);
}

/* `{% word` at the cursor. */
static int tkd_jp_stmt(const tkd_jparser *P, const char *word)
{
    return P->i + 1 < P->n && P->tok[P->i].type == TKD_JTOK_OPEN_STMT && P->tok[P->i + 1].type == TKD_JTOK_IDENT &&
           !strcmp(P->tok[P->i + 1].s, word);
}

static tkd_status tkd_jp_err(const tkd_jparser *P, tkd_status st, const tkd_jtok *at, const char *fmt, const char *arg)
{
    return tkd_jinja_error_at(st, P->t->name, P->t->src, P->t->len, at->pos, fmt, arg);
}

static const char *tkd_jp_tok_text(const tkd_jtok *k)
{
    return k->type == TKD_JTOK_EOF ? "end of template" : k->type == TKD_JTOK_TEXT ? "text" : k->s;
}

static tkd_status tkd_jp_expect(tkd_jparser *P, tkd_jtok_type type, const char *what)
{
    if (!tkd_jp_is(P, type)) {
        char msg[160];
        snprintf(msg, sizeof msg, "expected %s, got '%%s'", what);
        return tkd_jp_err(P, TKD_ERR_FORMAT, tkd_jp_peek(P), msg, tkd_jp_tok_text(tkd_jp_peek(P)));
    }
    P->i++;
    return TKD_OK;
}

static tkd_status tkd_jp_expect_word(tkd_jparser *P, const char *word)
{
    if (!tkd_jp_ident(P, word))
        return tkd_jp_err(P, TKD_ERR_FORMAT, tkd_jp_peek(P), "expected '%s'", word);
    P->i++;
    return TKD_OK;
}

static tkd_status tkd_jp_node(tkd_jparser *P, tkd_jnode_kind kind, const tkd_jtok *at, tkd_jnode **out)
{
    tkd_jnode *n = tkd_jarena_alloc(&P->t->arena, sizeof *n);
    if (!n)
        return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
    n->kind = kind;
    n->pos = at->pos;
    *out = n;
    return TKD_OK;
}

static tkd_status tkd_jp_push(tkd_jparser *P, tkd_jnodes *l, tkd_jnode *n)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 4;
        tkd_jnode **v = tkd_jarena_alloc(&P->t->arena, cap * sizeof *v);
        if (!v)
            return tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
        if (l->n)
            memcpy(v, l->v, l->n * sizeof *v);
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = n;
    return TKD_OK;
}

static tkd_status tkd_jp_expr(tkd_jparser *P, tkd_jnode **out);
static tkd_status tkd_jp_or(tkd_jparser *P, tkd_jnode **out);
static tkd_status tkd_jp_any(tkd_jparser *P, tkd_jnodes *into);
static tkd_status tkd_jp_not(tkd_jparser *P, tkd_jnode **out);
static tkd_status tkd_jp_unary_sign(tkd_jparser *P, tkd_jnode **out);

/* a, b, c: one expression, or a tuple when commas follow (primary: plain names, for targets). */
static tkd_status tkd_jp_sequence(tkd_jparser *P, int primary, tkd_jnode **out);

static tkd_status tkd_jp_binop(tkd_jparser *P, const tkd_jtok *at, int op, tkd_jnode *l, tkd_jnode *r, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_node(P, TKD_JN_BINOP, at, out));
    (*out)->op = op;
    (*out)->a = l;
    (*out)->b = r;
    return TKD_OK;
}

/* Call arguments up to ')': expressions, `name=value` as TKD_JN_KWARG. */
static tkd_status tkd_jp_args(tkd_jparser *P, tkd_jnodes *args)
{
    TKD_TRY(tkd_jp_expect(P, TKD_JTOK_LPAREN, "'('"));
    while (!tkd_jp_is(P, TKD_JTOK_RPAREN)) {
        const tkd_jtok *at = tkd_jp_peek(P);
        if (at->type == TKD_JTOK_EOF)
            return tkd_jp_err(P, TKD_ERR_FORMAT, at, "expected ')', got '%s'", tkd_jp_tok_text(at));
        if (at->type == TKD_JTOK_POW || (at->type == TKD_JTOK_MUL && !strcmp(at->s, "*")))
            return tkd_jp_err(P, TKD_ERR_UNSUPPORTED, at, "unsupported construct '%s' (argument unpacking)", at->s);
        tkd_jnode *arg = NULL;
        TKD_TRY(tkd_jp_expr(P, &arg));
        if (tkd_jp_is(P, TKD_JTOK_EQUALS)) {
            P->i++;
            if (arg->kind != TKD_JN_IDENT)
                return tkd_jp_err(P, TKD_ERR_FORMAT, at, "expected a name before '=', got '%s'", at->s);
            tkd_jnode *kw = NULL;
            TKD_TRY(tkd_jp_node(P, TKD_JN_KWARG, at, &kw));
            kw->s = arg->s;
            TKD_TRY(tkd_jp_expr(P, &kw->a));
            arg = kw;
        }
        TKD_TRY(tkd_jp_push(P, args, arg));
        if (tkd_jp_is(P, TKD_JTOK_COMMA))
            P->i++;
        else if (!tkd_jp_is(P, TKD_JTOK_RPAREN))
            return tkd_jp_err(P, TKD_ERR_FORMAT, tkd_jp_peek(P), "expected ',' or ')', got '%s'",
                              tkd_jp_tok_text(tkd_jp_peek(P)));
    }
    P->i++;
    return TKD_OK;
}

static tkd_status tkd_jp_literal_list(tkd_jparser *P, const tkd_jtok *at, tkd_jtok_type close, int dict,
                                      tkd_jnode **out)
{
    TKD_TRY(tkd_jp_node(P, dict ? TKD_JN_DICT : TKD_JN_LIST, at, out));
    while (!tkd_jp_is(P, close)) {
        if (tkd_jp_is(P, TKD_JTOK_EOF))
            return tkd_jp_err(P, TKD_ERR_FORMAT, at, "unclosed '%s'", at->s);
        tkd_jnode *e = NULL;
        TKD_TRY(tkd_jp_expr(P, &e));
        TKD_TRY(tkd_jp_push(P, &(*out)->args, e));
        if (dict) {
            TKD_TRY(tkd_jp_expect(P, TKD_JTOK_COLON, "':' in a dict literal"));
            TKD_TRY(tkd_jp_expr(P, &e));
            TKD_TRY(tkd_jp_push(P, &(*out)->args, e));
        }
        if (tkd_jp_is(P, TKD_JTOK_COMMA))
            P->i++;
    }
    P->i++;
    return TKD_OK;
}

static tkd_status tkd_jp_primary(tkd_jparser *P, tkd_jnode **out)
{
    const tkd_jtok *at = tkd_jp_peek(P);
    P->i++;
    switch (at->type) {
    case TKD_JTOK_NUM:
        if (strchr(at->s, '.')) {
            TKD_TRY(tkd_jp_node(P, TKD_JN_FLOAT, at, out));
            (*out)->f = strtod(at->s, NULL);
        } else {
            TKD_TRY(tkd_jp_node(P, TKD_JN_INT, at, out));
            (*out)->i = strtoll(at->s, NULL, 10);
        }
        return TKD_OK;
    case TKD_JTOK_STR: { /* adjacent literals concatenate */
        tkd_jbuf b = {0};
        tkd_status st = tkd_jbuf_put(&b, at->s, at->n);
        while (st == TKD_OK && tkd_jp_is(P, TKD_JTOK_STR)) {
            st = tkd_jbuf_put(&b, tkd_jp_peek(P)->s, tkd_jp_peek(P)->n);
            P->i++;
        }
        if (st == TKD_OK)
            st = tkd_jp_node(P, TKD_JN_STR, at, out);
        if (st == TKD_OK) {
            (*out)->s = tkd_jarena_strndup(&P->t->arena, b.p ? b.p : "", b.n);
            (*out)->n = b.n;
            if (!(*out)->s)
                st = tkd_error_set(TKD_ERR_NOMEM, "jinja: out of memory");
        }
        free(b.p);
        return st;
    }
    case TKD_JTOK_IDENT:
        TKD_TRY(tkd_jp_node(P, TKD_JN_IDENT, at, out));
        (*out)->s = at->s;
        return TKD_OK;
    case TKD_JTOK_LPAREN:
        TKD_TRY(tkd_jp_sequence(P, 0, out));
        return tkd_jp_expect(P, TKD_JTOK_RPAREN, "')'");
    case TKD_JTOK_LBRACKET: return tkd_jp_literal_list(P, at, TKD_JTOK_RBRACKET, 0, out);
    case TKD_JTOK_LBRACE: return tkd_jp_literal_list(P, at, TKD_JTOK_RBRACE, 1, out);
    default: return tkd_jp_err(P, TKD_ERR_FORMAT, at, "unexpected '%s' in an expression", tkd_jp_tok_text(at));
    }
}

/* The inside of [...]: an index, or a slice a:b:c with any part left out. */
static tkd_status tkd_jp_subscript(tkd_jparser *P, const tkd_jtok *at, tkd_jnode **out)
{
    tkd_jnode *part[3] = {0};
    int nparts = 0, slice = 0;
    while (!tkd_jp_is(P, TKD_JTOK_RBRACKET)) {
        if (nparts == 3 || tkd_jp_is(P, TKD_JTOK_EOF))
            return tkd_jp_err(P, TKD_ERR_FORMAT, at, "bad subscript after '%s'", at->s);
        if (tkd_jp_is(P, TKD_JTOK_COLON)) {
            nparts++;
            slice = 1;
            P->i++;
            continue;
        }
        TKD_TRY(tkd_jp_expr(P, &part[nparts++]));
        if (tkd_jp_is(P, TKD_JTOK_COLON)) {
            slice = 1;
            P->i++;
        }
    }
    P->i++;
    if (nparts == 0)
        return tkd_jp_err(P, TKD_ERR_FORMAT, at, "empty subscript '%s]'", at->s);
    if (!slice) {
        *out = part[0];
        return TKD_OK;
    }
    TKD_TRY(tkd_jp_node(P, TKD_JN_SLICE, at, out));
    (*out)->a = part[0];
    (*out)->b = part[1];
    (*out)->c = part[2];
    return TKD_OK;
}

static tkd_status tkd_jp_members(tkd_jparser *P, tkd_jnode **obj)
{
    while (tkd_jp_is(P, TKD_JTOK_DOT) || tkd_jp_is(P, TKD_JTOK_LBRACKET)) {
        const tkd_jtok *at = tkd_jp_peek(P);
        P->i++;
        tkd_jnode *m = NULL;
        TKD_TRY(tkd_jp_node(P, TKD_JN_MEMBER, at, &m));
        m->a = *obj;
        m->op = at->type == TKD_JTOK_LBRACKET;
        if (m->op) {
            TKD_TRY(tkd_jp_subscript(P, at, &m->b));
        } else {
            TKD_TRY(tkd_jp_primary(P, &m->b));
            if (m->b->kind != TKD_JN_IDENT && m->b->kind != TKD_JN_INT)
                return tkd_jp_err(P, TKD_ERR_FORMAT, at, "expected a name after '%s'", ".");
        }
        *obj = m;
    }
    return TKD_OK;
}

static tkd_status tkd_jp_call_member(tkd_jparser *P, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_primary(P, out));
    TKD_TRY(tkd_jp_members(P, out));
    while (tkd_jp_is(P, TKD_JTOK_LPAREN)) {
        tkd_jnode *call = NULL;
        TKD_TRY(tkd_jp_node(P, TKD_JN_CALL, tkd_jp_peek(P), &call));
        call->pos = (*out)->pos; /* errors of a call point at its callee */
        call->a = *out;
        TKD_TRY(tkd_jp_args(P, &call->args));
        *out = call;
        TKD_TRY(tkd_jp_members(P, out));
    }
    return TKD_OK;
}

static tkd_status tkd_jp_unary_sign_in(tkd_jparser *P, tkd_jnode **out)
{
    const tkd_jtok *at = tkd_jp_peek(P);
    if ((at->type == TKD_JTOK_UNARY || at->type == TKD_JTOK_ADD) && (!strcmp(at->s, "-") || !strcmp(at->s, "+"))) {
        P->i++;
        TKD_TRY(tkd_jp_node(P, TKD_JN_UNARY, at, out));
        (*out)->op = at->s[0] == '-' ? TKD_JOP_NEG : TKD_JOP_POS;
        return tkd_jp_unary_sign(P, &(*out)->a);
    }
    return tkd_jp_call_member(P, out);
}

static tkd_status tkd_jp_unary_sign(tkd_jparser *P, tkd_jnode **out)
{
    if (P->depth >= TKD_JINJA_MAX_NESTING)
        return tkd_jp_err(P, TKD_ERR_UNSUPPORTED, tkd_jp_peek(P), "unsupported construct: nesting deeper than %s levels",
                          "200");
    P->depth++;
    tkd_status st = tkd_jp_unary_sign_in(P, out);
    P->depth--;
    return st;
}

static tkd_status tkd_jp_filter(tkd_jparser *P, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_unary_sign(P, out));
    while (tkd_jp_is(P, TKD_JTOK_PIPE)) {
        P->i++;
        const tkd_jtok *at = tkd_jp_peek(P);
        if (at->type != TKD_JTOK_IDENT)
            return tkd_jp_err(P, TKD_ERR_FORMAT, at, "expected a filter name after '|', got '%s'", tkd_jp_tok_text(at));
        P->i++;
        tkd_jnode *f = NULL;
        TKD_TRY(tkd_jp_node(P, TKD_JN_FILTER, at, &f));
        f->a = *out;
        f->s = at->s;
        f->op = tkd_jp_is(P, TKD_JTOK_LPAREN); /* called: tojson(indent=4) */
        if (f->op)
            TKD_TRY(tkd_jp_args(P, &f->args));
        *out = f;
    }
    return TKD_OK;
}

static tkd_status tkd_jp_test(tkd_jparser *P, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_filter(P, out));
    while (tkd_jp_ident(P, "is")) {
        const tkd_jtok *at = tkd_jp_peek(P);
        P->i++;
        int negate = tkd_jp_ident(P, "not");
        P->i += (size_t)negate;
        const tkd_jtok *name = tkd_jp_peek(P);
        if (name->type != TKD_JTOK_IDENT)
            return tkd_jp_err(P, TKD_ERR_FORMAT, name, "expected a test name after 'is', got '%s'", tkd_jp_tok_text(name));
        P->i++;
        tkd_jnode *t = NULL;
        TKD_TRY(tkd_jp_node(P, TKD_JN_TEST, at, &t));
        t->a = *out;
        t->s = name->s;
        t->op = negate;
        if (tkd_jp_is(P, TKD_JTOK_LPAREN))
            return tkd_jp_err(P, TKD_ERR_UNSUPPORTED, name, "unsupported construct 'is %s(...)' (test with arguments)",
                              name->s);
        *out = t;
    }
    return TKD_OK;
}

/* Left-associative levels built on next: tokens of type `type` (and for CMP also in / not in). */
static tkd_status tkd_jp_power(tkd_jparser *P, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_test(P, out));
    while (tkd_jp_is(P, TKD_JTOK_POW)) {
        const tkd_jtok *at = &P->tok[P->i++];
        tkd_jnode *r = NULL;
        TKD_TRY(tkd_jp_test(P, &r));
        TKD_TRY(tkd_jp_binop(P, at, TKD_JOP_POW, *out, r, out));
    }
    return TKD_OK;
}

static int tkd_jp_arith_op(const char *s)
{
    static const struct { const char *s; int op; } ops[] = {
        {"+", TKD_JOP_ADD}, {"-", TKD_JOP_SUB}, {"~", TKD_JOP_CONCAT}, {"*", TKD_JOP_MUL}, {"/", TKD_JOP_DIV},
        {"//", TKD_JOP_FLOORDIV}, {"%", TKD_JOP_MOD}, {"==", TKD_JOP_EQ}, {"!=", TKD_JOP_NE}, {"<", TKD_JOP_LT},
        {">", TKD_JOP_GT}, {"<=", TKD_JOP_LE}, {">=", TKD_JOP_GE}};
    for (size_t i = 0; i < sizeof ops / sizeof *ops; i++)
        if (!strcmp(ops[i].s, s))
            return ops[i].op;
    return -1;
}

static tkd_status tkd_jp_mul(tkd_jparser *P, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_power(P, out));
    while (tkd_jp_is(P, TKD_JTOK_MUL)) {
        const tkd_jtok *at = &P->tok[P->i++];
        tkd_jnode *r = NULL;
        TKD_TRY(tkd_jp_power(P, &r));
        TKD_TRY(tkd_jp_binop(P, at, tkd_jp_arith_op(at->s), *out, r, out));
    }
    return TKD_OK;
}

static tkd_status tkd_jp_add(tkd_jparser *P, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_mul(P, out));
    while (tkd_jp_is(P, TKD_JTOK_ADD)) {
        const tkd_jtok *at = &P->tok[P->i++];
        tkd_jnode *r = NULL;
        TKD_TRY(tkd_jp_mul(P, &r));
        TKD_TRY(tkd_jp_binop(P, at, tkd_jp_arith_op(at->s), *out, r, out));
    }
    return TKD_OK;
}

static tkd_status tkd_jp_compare(tkd_jparser *P, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_add(P, out));
    for (;;) {
        const tkd_jtok *at = tkd_jp_peek(P);
        int op;
        if (tkd_jp_ident(P, "not") && P->i + 1 < P->n && P->tok[P->i + 1].type == TKD_JTOK_IDENT &&
            !strcmp(P->tok[P->i + 1].s, "in")) {
            op = TKD_JOP_NOT_IN;
            P->i += 2;
        } else if (tkd_jp_ident(P, "in")) {
            op = TKD_JOP_IN;
            P->i++;
        } else if (at->type == TKD_JTOK_CMP) {
            op = tkd_jp_arith_op(at->s);
            P->i++;
        } else {
            return TKD_OK;
        }
        tkd_jnode *r = NULL;
        TKD_TRY(tkd_jp_add(P, &r));
        TKD_TRY(tkd_jp_binop(P, at, op, *out, r, out));
    }
}

static tkd_status tkd_jp_not_in(tkd_jparser *P, tkd_jnode **out)
{
    if (!tkd_jp_ident(P, "not"))
        return tkd_jp_compare(P, out);
    TKD_TRY(tkd_jp_node(P, TKD_JN_UNARY, &P->tok[P->i++], out));
    (*out)->op = TKD_JOP_NOT;
    return tkd_jp_not(P, &(*out)->a);
}

static tkd_status tkd_jp_not(tkd_jparser *P, tkd_jnode **out)
{
    if (P->depth >= TKD_JINJA_MAX_NESTING)
        return tkd_jp_err(P, TKD_ERR_UNSUPPORTED, tkd_jp_peek(P), "unsupported construct: nesting deeper than %s levels",
                          "200");
    P->depth++;
    tkd_status st = tkd_jp_not_in(P, out);
    P->depth--;
    return st;
}

static tkd_status tkd_jp_and(tkd_jparser *P, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_not(P, out));
    while (tkd_jp_ident(P, "and")) {
        const tkd_jtok *at = &P->tok[P->i++];
        tkd_jnode *r = NULL;
        TKD_TRY(tkd_jp_not(P, &r));
        TKD_TRY(tkd_jp_binop(P, at, TKD_JOP_AND, *out, r, out));
    }
    return TKD_OK;
}

static tkd_status tkd_jp_or(tkd_jparser *P, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_and(P, out));
    while (tkd_jp_ident(P, "or")) {
        const tkd_jtok *at = &P->tok[P->i++];
        tkd_jnode *r = NULL;
        TKD_TRY(tkd_jp_and(P, &r));
        TKD_TRY(tkd_jp_binop(P, at, TKD_JOP_OR, *out, r, out));
    }
    return TKD_OK;
}

static tkd_status tkd_jp_expr_in(tkd_jparser *P, tkd_jnode **out)
{
    TKD_TRY(tkd_jp_or(P, out));
    if (!tkd_jp_ident(P, "if"))
        return TKD_OK;
    tkd_jnode *n = NULL;
    TKD_TRY(tkd_jp_node(P, TKD_JN_SELECT, &P->tok[P->i++], &n));
    n->b = *out;
    TKD_TRY(tkd_jp_or(P, &n->a));
    if (tkd_jp_ident(P, "else")) {
        P->i++;
        n->kind = TKD_JN_TERNARY;
        TKD_TRY(tkd_jp_expr(P, &n->c));
    } else {
        /* a if b: b is the test, a the value */
        tkd_jnode *value = n->b;
        n->b = n->a;
        n->a = value;
    }
    *out = n;
    return TKD_OK;
}

static tkd_status tkd_jp_expr(tkd_jparser *P, tkd_jnode **out)
{
    if (P->depth >= TKD_JINJA_MAX_NESTING)
        return tkd_jp_err(P, TKD_ERR_UNSUPPORTED, tkd_jp_peek(P), "unsupported construct: nesting deeper than %s levels",
                          "200");
    P->depth++;
    tkd_status st = tkd_jp_expr_in(P, out);
    P->depth--;
    return st;
}

static tkd_status tkd_jp_sequence(tkd_jparser *P, int primary, tkd_jnode **out)
{
    const tkd_jtok *at = tkd_jp_peek(P);
    TKD_TRY(primary ? tkd_jp_primary(P, out) : tkd_jp_expr(P, out));
    if (!tkd_jp_is(P, TKD_JTOK_COMMA))
        return TKD_OK;
    tkd_jnode *tuple = NULL;
    TKD_TRY(tkd_jp_node(P, TKD_JN_TUPLE, at, &tuple));
    TKD_TRY(tkd_jp_push(P, &tuple->args, *out));
    while (tkd_jp_is(P, TKD_JTOK_COMMA)) {
        P->i++;
        tkd_jnode *e = NULL;
        TKD_TRY(primary ? tkd_jp_primary(P, &e) : tkd_jp_expr(P, &e));
        TKD_TRY(tkd_jp_push(P, &tuple->args, e));
    }
    *out = tuple;
    return TKD_OK;
}

/* Statements' bodies: nodes until `{% word` for one of the words in stops (NULL-terminated). */
static tkd_status tkd_jp_body(tkd_jparser *P, const tkd_jtok *opener, const char *const *stops, tkd_jnodes *into)
{
    for (;;) {
        for (const char *const *w = stops; *w; w++)
            if (tkd_jp_stmt(P, *w))
                return TKD_OK;
        if (tkd_jp_is(P, TKD_JTOK_EOF))
            return tkd_jp_err(P, TKD_ERR_FORMAT, opener, "'%s' is never closed", opener->s);
        TKD_TRY(tkd_jp_any(P, into));
    }
}

/* `{% word %}` closing a block. */
static tkd_status tkd_jp_close(tkd_jparser *P, const char *word)
{
    TKD_TRY(tkd_jp_expect(P, TKD_JTOK_OPEN_STMT, "'{%'"));
    TKD_TRY(tkd_jp_expect_word(P, word));
    return tkd_jp_expect(P, TKD_JTOK_CLOSE_STMT, "'%}'");
}

static tkd_status tkd_jp_if(tkd_jparser *P, const tkd_jtok *kw, tkd_jnode **out)
{
    static const char *const stops[] = {"elif", "else", "endif", NULL};
    TKD_TRY(tkd_jp_node(P, TKD_JN_IF, kw, out));
    TKD_TRY(tkd_jp_expr(P, &(*out)->a));
    TKD_TRY(tkd_jp_expect(P, TKD_JTOK_CLOSE_STMT, "'%}'"));
    TKD_TRY(tkd_jp_body(P, kw, stops, &(*out)->body));
    const tkd_jtok *next = &P->tok[P->i + 1];
    if (tkd_jp_stmt(P, "elif")) { /* elif is an if inside the else branch */
        P->i += 2;
        tkd_jnode *inner = NULL;
        TKD_TRY(tkd_jp_if(P, next, &inner));
        return tkd_jp_push(P, &(*out)->alt, inner);
    }
    if (tkd_jp_stmt(P, "else")) {
        static const char *const end[] = {"endif", NULL};
        P->i += 2;
        TKD_TRY(tkd_jp_expect(P, TKD_JTOK_CLOSE_STMT, "'%}'"));
        TKD_TRY(tkd_jp_body(P, kw, end, &(*out)->alt));
    }
    return tkd_jp_close(P, "endif");
}

static tkd_status tkd_jp_for(tkd_jparser *P, const tkd_jtok *kw, tkd_jnode **out)
{
    static const char *const stops[] = {"else", "endfor", NULL}, *const end[] = {"endfor", NULL};
    TKD_TRY(tkd_jp_node(P, TKD_JN_FOR, kw, out));
    TKD_TRY(tkd_jp_sequence(P, 1, &(*out)->a));
    if ((*out)->a->kind != TKD_JN_IDENT && (*out)->a->kind != TKD_JN_TUPLE)
        return tkd_jp_err(P, TKD_ERR_FORMAT, kw, "expected a name after '%s'", "for");
    TKD_TRY(tkd_jp_expect_word(P, "in"));
    tkd_jnode *iter = NULL;
    TKD_TRY(tkd_jp_expr(P, &iter));
    if (iter->kind == TKD_JN_SELECT) { /* for x in xs if cond */
        (*out)->b = iter->a;
        (*out)->c = iter->b;
    } else {
        (*out)->b = iter;
    }
    if (tkd_jp_ident(P, "recursive"))
        return tkd_jp_err(P, TKD_ERR_UNSUPPORTED, tkd_jp_peek(P), "unsupported construct '%s'", "for ... recursive");
    TKD_TRY(tkd_jp_expect(P, TKD_JTOK_CLOSE_STMT, "'%}'"));
    TKD_TRY(tkd_jp_body(P, kw, stops, &(*out)->body));
    if (tkd_jp_stmt(P, "else")) {
        P->i += 2;
        TKD_TRY(tkd_jp_expect(P, TKD_JTOK_CLOSE_STMT, "'%}'"));
        TKD_TRY(tkd_jp_body(P, kw, end, &(*out)->alt));
    }
    return tkd_jp_close(P, "endfor");
}

static tkd_status tkd_jp_set(tkd_jparser *P, const tkd_jtok *kw, tkd_jnode **out)
{
    static const char *const end[] = {"endset", NULL};
    TKD_TRY(tkd_jp_node(P, TKD_JN_SET, kw, out));
    TKD_TRY(tkd_jp_sequence(P, 0, &(*out)->a));
    tkd_jnode_kind k = (*out)->a->kind;
    if (k != TKD_JN_IDENT && k != TKD_JN_TUPLE && !(k == TKD_JN_MEMBER && !(*out)->a->op))
        return tkd_jp_err(P, TKD_ERR_FORMAT, kw, "cannot assign to this target of '%s'", "set");
    if (tkd_jp_is(P, TKD_JTOK_EQUALS)) {
        P->i++;
        TKD_TRY(tkd_jp_sequence(P, 0, &(*out)->b));
        return tkd_jp_expect(P, TKD_JTOK_CLOSE_STMT, "'%}'");
    }
    TKD_TRY(tkd_jp_expect(P, TKD_JTOK_CLOSE_STMT, "'=' or '%}'"));
    TKD_TRY(tkd_jp_body(P, kw, end, &(*out)->body));
    return tkd_jp_close(P, "endset");
}

static tkd_status tkd_jp_macro(tkd_jparser *P, const tkd_jtok *kw, tkd_jnode **out)
{
    static const char *const end[] = {"endmacro", NULL};
    TKD_TRY(tkd_jp_node(P, TKD_JN_MACRO, kw, out));
    const tkd_jtok *name = tkd_jp_peek(P);
    if (name->type != TKD_JTOK_IDENT)
        return tkd_jp_err(P, TKD_ERR_FORMAT, name, "expected a macro name, got '%s'", tkd_jp_tok_text(name));
    P->i++;
    (*out)->s = name->s;
    TKD_TRY(tkd_jp_args(P, &(*out)->args));
    for (size_t i = 0; i < (*out)->args.n; i++) {
        tkd_jnode *p = (*out)->args.v[i];
        if (p->kind != TKD_JN_IDENT && p->kind != TKD_JN_KWARG)
            return tkd_jp_err(P, TKD_ERR_FORMAT, name, "macro '%s': parameters must be names", name->s);
    }
    TKD_TRY(tkd_jp_expect(P, TKD_JTOK_CLOSE_STMT, "'%}'"));
    TKD_TRY(tkd_jp_body(P, kw, end, &(*out)->body));
    return tkd_jp_close(P, "endmacro");
}

/* {% generation %}...{% endgeneration %}: transformers' block marking what the assistant writes. */
static tkd_status tkd_jp_generation(tkd_jparser *P, const tkd_jtok *kw, tkd_jnode **out)
{
    static const char *const end[] = {"endgeneration", NULL};
    TKD_TRY(tkd_jp_node(P, TKD_JN_GENERATION, kw, out));
    TKD_TRY(tkd_jp_expect(P, TKD_JTOK_CLOSE_STMT, "'%}'"));
    TKD_TRY(tkd_jp_body(P, kw, end, &(*out)->body));
    P->t->has_generation = 1;
    return tkd_jp_close(P, "endgeneration");
}

static tkd_status tkd_jp_statement(tkd_jparser *P, tkd_jnode **out)
{
    P->i++; /* {% */
    const tkd_jtok *kw = tkd_jp_peek(P);
    if (kw->type != TKD_JTOK_IDENT)
        return tkd_jp_err(P, TKD_ERR_FORMAT, kw, "expected a statement name, got '%s'", tkd_jp_tok_text(kw));
    P->i++;
    if (!strcmp(kw->s, "if"))
        return tkd_jp_if(P, kw, out);
    if (!strcmp(kw->s, "for"))
        return tkd_jp_for(P, kw, out);
    if (!strcmp(kw->s, "set"))
        return tkd_jp_set(P, kw, out);
    if (!strcmp(kw->s, "macro"))
        return tkd_jp_macro(P, kw, out);
    if (!strcmp(kw->s, "generation"))
        return tkd_jp_generation(P, kw, out);
    if (!strcmp(kw->s, "break") || !strcmp(kw->s, "continue")) {
        TKD_TRY(tkd_jp_node(P, kw->s[0] == 'b' ? TKD_JN_BREAK : TKD_JN_CONTINUE, kw, out));
        return tkd_jp_expect(P, TKD_JTOK_CLOSE_STMT, "'%}'");
    }
    static const char *const closers[] = {"endif",  "endfor", "endset",        "endmacro",
                                          "elif",   "else",   "endgeneration", NULL};
    for (const char *const *c = closers; *c; c++)
        if (!strcmp(kw->s, *c))
            return tkd_jp_err(P, TKD_ERR_FORMAT, kw, "unexpected '%s' (nothing open to close)", kw->s);
    return tkd_jp_err(P, TKD_ERR_UNSUPPORTED, kw, "unsupported statement '%s'", kw->s);
}

static tkd_status tkd_jp_any_in(tkd_jparser *P, tkd_jnodes *into)
{
    const tkd_jtok *k = tkd_jp_peek(P);
    tkd_jnode *n = NULL;
    switch (k->type) {
    case TKD_JTOK_COMMENT: P->i++; return TKD_OK;
    case TKD_JTOK_TEXT:
        P->i++;
        TKD_TRY(tkd_jp_node(P, TKD_JN_TEXT, k, &n));
        n->s = k->s;
        n->n = k->n;
        break;
    case TKD_JTOK_OPEN_EXPR:
        P->i++;
        TKD_TRY(tkd_jp_node(P, TKD_JN_OUTPUT, k, &n));
        TKD_TRY(tkd_jp_expr(P, &n->a));
        TKD_TRY(tkd_jp_expect(P, TKD_JTOK_CLOSE_EXPR, "'}}'"));
        break;
    case TKD_JTOK_OPEN_STMT: TKD_TRY(tkd_jp_statement(P, &n)); break;
    default: return tkd_jp_err(P, TKD_ERR_FORMAT, k, "unexpected '%s' outside a tag", tkd_jp_tok_text(k));
    }
    return tkd_jp_push(P, into, n);
}

static tkd_status tkd_jp_any(tkd_jparser *P, tkd_jnodes *into)
{
    if (P->depth >= TKD_JINJA_MAX_NESTING)
        return tkd_jp_err(P, TKD_ERR_UNSUPPORTED, tkd_jp_peek(P), "unsupported construct: nesting deeper than %s levels",
                          "200");
    P->depth++;
    tkd_status st = tkd_jp_any_in(P, into);
    P->depth--;
    return st;
}

tkd_status tkd_jinja_parse_tokens(tkd_jinja_template *t, const tkd_jtok *toks, size_t ntok)
{
    tkd_jparser P = {.t = t, .tok = toks, .n = ntok};
    while (!tkd_jp_is(&P, TKD_JTOK_EOF))
        TKD_TRY(tkd_jp_any(&P, &t->body));
    return TKD_OK;
}
