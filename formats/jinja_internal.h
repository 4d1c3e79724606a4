/* jinja_internal.h — the pieces of formats/jinja shared by its files: the arena every parse and
 * render allocates from, tokens (jinja_lex.c), the syntax tree (jinja_parse.c), runtime values
 * (jinja_value.c), and the evaluator's state (jinja_eval.c, jinja_builtins.c). */
#ifndef TKD_JINJA_INTERNAL_H
#define TKD_JINJA_INTERNAL_H

#include <stddef.h>

#include "common/status.h"
#include "formats/jinja.h"

/* ---- arena: everything of one parse (or one render) lives until the arena is freed ---- */
typedef struct tkd_jarena_block tkd_jarena_block;
typedef struct tkd_jarena {
    tkd_jarena_block *head;
} tkd_jarena;

/* Zeroed memory of n bytes, or NULL (out of memory). */
void *tkd_jarena_alloc(tkd_jarena *a, size_t n);
char *tkd_jarena_strndup(tkd_jarena *a, const char *s, size_t n);
void tkd_jarena_free(tkd_jarena *a);

/* A growable byte buffer (malloc'd). */
typedef struct tkd_jbuf {
    char *p;
    size_t n, cap;
} tkd_jbuf;
tkd_status tkd_jbuf_put(tkd_jbuf *b, const char *s, size_t n);
tkd_status tkd_jbuf_putc(tkd_jbuf *b, char c);

/* ---- tokens ---- */
typedef enum tkd_jtok_type {
    TKD_JTOK_TEXT,
    TKD_JTOK_NUM,
    TKD_JTOK_STR,
    TKD_JTOK_IDENT,
    TKD_JTOK_EQUALS,
    TKD_JTOK_LPAREN,
    TKD_JTOK_RPAREN,
    TKD_JTOK_OPEN_STMT,
    TKD_JTOK_CLOSE_STMT,
    TKD_JTOK_OPEN_EXPR,
    TKD_JTOK_CLOSE_EXPR,
    TKD_JTOK_LBRACKET,
    TKD_JTOK_RBRACKET,
    TKD_JTOK_LBRACE,
    TKD_JTOK_RBRACE,
    TKD_JTOK_COMMA,
    TKD_JTOK_DOT,
    TKD_JTOK_COLON,
    TKD_JTOK_PIPE,
    TKD_JTOK_ADD,   /* + - ~ */
    TKD_JTOK_MUL,   /* * / // % */
    TKD_JTOK_POW,   /* ** */
    TKD_JTOK_CMP,   /* < > <= >= == != */
    TKD_JTOK_UNARY, /* a sign that starts an operand */
    TKD_JTOK_COMMENT,
    TKD_JTOK_EOF,
} tkd_jtok_type;

typedef struct tkd_jtok {
    tkd_jtok_type type;
    const char *s; /* value (unescaped for strings), NUL-terminated, in the parse arena */
    size_t n;
    size_t pos; /* byte offset in the original source (for line:col) */
} tkd_jtok;

/* The token list of src, after transformers' preprocessing (trim_blocks, lstrip_blocks) and
 * whitespace control; the last token is TKD_JTOK_EOF. */
tkd_status tkd_jinja_lex(const char *src, size_t len, const char *name, tkd_jarena *a, tkd_jtok **toks,
                         size_t *ntok);

/* "name:line:col: " prefix for an error at byte offset pos of src. */
tkd_status tkd_jinja_error_at(tkd_status st, const char *name, const char *src, size_t len, size_t pos,
                              const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* ---- syntax tree ---- */
typedef enum tkd_jnode_kind {
    /* statements */
    TKD_JN_TEXT,     /* s */
    TKD_JN_OUTPUT,   /* a */
    TKD_JN_IF,       /* a: test, body, alt */
    TKD_JN_FOR,      /* a: target (ident or tuple), b: iterable, c: filter or NULL, body, alt: else */
    TKD_JN_SET,      /* a: target, b: value or NULL (block: body) */
    TKD_JN_MACRO,    /* s: name, args: params (ident or kwarg with default), body */
    TKD_JN_BREAK,
    TKD_JN_CONTINUE,
    TKD_JN_GENERATION, /* body: a {% generation %} block (transformers' assistant-mask marker) */
    /* expressions */
    TKD_JN_STR,     /* s, n */
    TKD_JN_INT,     /* i */
    TKD_JN_FLOAT,   /* f */
    TKD_JN_IDENT,   /* s */
    TKD_JN_LIST,    /* args */
    TKD_JN_TUPLE,   /* args */
    TKD_JN_DICT,    /* args: key0, value0, key1, value1, ... */
    TKD_JN_MEMBER,  /* a: object, b: property, op: 1 when computed ([...]) */
    TKD_JN_SLICE,   /* a, b, c: start, stop, step (each may be NULL) */
    TKD_JN_CALL,    /* a: callee, args (kwargs are TKD_JN_KWARG) */
    TKD_JN_KWARG,   /* s: name, a: value */
    TKD_JN_FILTER,  /* a: operand, s: filter name, args */
    TKD_JN_TEST,    /* a: operand, s: test name, op: 1 when negated */
    TKD_JN_BINOP,   /* a, b, op: tkd_jop */
    TKD_JN_UNARY,   /* a, op: TKD_JOP_NOT / _NEG / _POS */
    TKD_JN_TERNARY, /* a: test, b: true, c: false */
    TKD_JN_SELECT,  /* a: value, b: test (value if test, else undefined) */
} tkd_jnode_kind;

typedef enum tkd_jop {
    TKD_JOP_ADD, TKD_JOP_SUB, TKD_JOP_CONCAT, TKD_JOP_MUL, TKD_JOP_DIV, TKD_JOP_FLOORDIV, TKD_JOP_MOD,
    TKD_JOP_POW, TKD_JOP_EQ, TKD_JOP_NE, TKD_JOP_LT, TKD_JOP_GT, TKD_JOP_LE, TKD_JOP_GE, TKD_JOP_IN,
    TKD_JOP_NOT_IN, TKD_JOP_AND, TKD_JOP_OR, TKD_JOP_NOT, TKD_JOP_NEG, TKD_JOP_POS,
} tkd_jop;

typedef struct tkd_jnode tkd_jnode;
typedef struct tkd_jnodes {
    tkd_jnode **v;
    size_t n, cap;
} tkd_jnodes;
struct tkd_jnode {
    tkd_jnode_kind kind;
    int op;
    size_t pos; /* byte offset in the source */
    const char *s;
    size_t n;
    long long i;
    double f;
    tkd_jnode *a, *b, *c;
    tkd_jnodes args, body, alt;
};

struct tkd_jinja_template {
    tkd_jarena arena;
    char *name;
    char *src; /* the original text, for line:col */
    size_t len;
    tkd_jnodes body;
    int has_generation; /* the template holds a {% generation %} block */
};

tkd_status tkd_jinja_parse_tokens(tkd_jinja_template *t, const tkd_jtok *toks, size_t ntok);

/* ---- runtime values (allocated in the render arena, never freed one by one) ---- */
typedef enum tkd_jv_type {
    TKD_JV_UNDEF, TKD_JV_NULL, TKD_JV_BOOL, TKD_JV_INT, TKD_JV_FLOAT, TKD_JV_STR, TKD_JV_LIST,
    TKD_JV_DICT, TKD_JV_NS, TKD_JV_FUNC,
} tkd_jv_type;

typedef struct tkd_jv tkd_jv;
struct tkd_jv {
    tkd_jv_type t;
    union {
        int b;
        long long i;
        double f;
        struct { const char *p; size_t n; } s;
        struct { tkd_jv **v; size_t n, cap; } l;
        struct { tkd_jv **k, **v; size_t n, cap; } d; /* TKD_JV_DICT and _NS; keys are strings */
        struct { int builtin; const tkd_jnode *macro; tkd_jv *self; const char *name; } fn;
    } u;
};

tkd_jv *tkd_jv_new(tkd_jarena *a, tkd_jv_type t);
tkd_jv *tkd_jv_str(tkd_jarena *a, const char *s, size_t n); /* copies s */
tkd_jv *tkd_jv_int(tkd_jarena *a, long long i);
tkd_jv *tkd_jv_bool(tkd_jarena *a, int b);
tkd_status tkd_jv_list_push(tkd_jarena *a, tkd_jv *l, tkd_jv *v);
tkd_jv *tkd_jv_dict_get(const tkd_jv *d, const char *k, size_t n); /* NULL when absent */
tkd_status tkd_jv_dict_set(tkd_jarena *a, tkd_jv *d, tkd_jv *k, tkd_jv *v);
int tkd_jv_truthy(const tkd_jv *v);
const char *tkd_jv_type_name(const tkd_jv *v);
/* The value of a JSON document's root (cJSON underneath); TKD_ERR_FORMAT on bad JSON. */
tkd_status tkd_jv_from_json(tkd_jarena *a, const char *json, size_t len, tkd_jv **out);

typedef struct tkd_jjson_opts {
    int indent; /* < 0: none */
    int ensure_ascii, sort_keys;
    const char *item_sep, *key_sep; /* NULL: the defaults for indent */
    int undefined_as_null;          /* tojson: 1; str() of a container: 0 ("undefined") */
} tkd_jjson_opts;
/* Appends v as JSON the way @huggingface/jinja's toJSON writes it. TKD_ERR_FORMAT for a function. */
tkd_status tkd_jv_to_json(tkd_jbuf *b, const tkd_jv *v, const tkd_jjson_opts *o, int depth);
/* Appends str(v) (JavaScript's String() as the reference prints values). */
tkd_status tkd_jv_to_string(tkd_jbuf *b, const tkd_jv *v);
/* Appends String() of the JavaScript value underneath v, which `~`, `+` on strings and `join` use:
 * 2.0 is "2" there (but "2.0" printed), a list "[object Object],...", a dict "[object Map]". */
tkd_status tkd_jv_to_raw_string(tkd_jbuf *b, const tkd_jv *v);
/* JavaScript's loose == between two values (the reference compares .value with ==). */
int tkd_jv_loose_eq(const tkd_jv *x, const tkd_jv *y);
/* JavaScript's === on the values (equalto test, `in` over a list). */
int tkd_jv_strict_eq(const tkd_jv *x, const tkd_jv *y);

/* JavaScript's whitespace (String.prototype.trim) around s[0, n): sets *start and *end. */
void tkd_jstr_trim(const char *s, size_t n, int left, int right, size_t *start, size_t *end);
/* Length in UTF-16 code units (JavaScript's .length). */
size_t tkd_jstr_utf16_len(const char *s, size_t n);

/* ---- evaluator state ---- */
typedef struct tkd_jscope tkd_jscope;
struct tkd_jscope {
    tkd_jscope *parent;
    tkd_jv *vars; /* a dict */
};

enum { TKD_JCTL_NONE = 0, TKD_JCTL_BREAK, TKD_JCTL_CONTINUE };

typedef struct tkd_jrender {
    const tkd_jinja_template *t;
    tkd_jarena *a;
    tkd_jbuf *out;
    long long now;
    int ctl;   /* a pending break / continue */
    int depth; /* macro call depth, bounded against runaway recursion */
    long long steps; /* statements run, bounded so that a runaway template stops with an error */
    tkd_jbuf *root;  /* the render's output; a {% set %} block or macro call writes elsewhere */
    tkd_jinja_spans *generation; /* where {% generation %} spans go, or NULL */
} tkd_jrender;

/* An error at node n of the template being rendered. */
tkd_status tkd_jinja_fail(tkd_jrender *r, tkd_status st, const tkd_jnode *n, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

tkd_status tkd_jinja_eval(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n, tkd_jv **out);
tkd_status tkd_jinja_exec_block(tkd_jrender *r, tkd_jscope *sc, const tkd_jnodes *body);

/* Evaluated call arguments: positional, then keyword (names in kwn). */
typedef struct tkd_jargs {
    tkd_jv **pos;
    size_t npos;
    const char **kwn;
    tkd_jv **kwv;
    size_t nkw;
} tkd_jargs;
tkd_status tkd_jinja_eval_args(tkd_jrender *r, tkd_jscope *sc, const tkd_jnodes *args, tkd_jargs *out);
tkd_jv *tkd_jargs_kw(const tkd_jargs *a, const char *name); /* NULL when absent */

/* builtins (jinja_builtins.c) */
/* The value of a global name (true, none, raise_exception, ...), or NULL. */
tkd_jv *tkd_jinja_global(tkd_jarena *a, const char *name);
tkd_status tkd_jinja_call_builtin(tkd_jrender *r, const tkd_jnode *at, const tkd_jv *fn, const tkd_jargs *args,
                                  tkd_jv **out);
/* obj.name as a method: *out is a function value bound to obj, or NULL when obj has none. */
tkd_jv *tkd_jinja_method(tkd_jarena *a, tkd_jv *obj, const char *name);
tkd_status tkd_jinja_apply_filter(tkd_jrender *r, tkd_jscope *sc, const tkd_jnode *n, tkd_jv *operand, tkd_jv **out);
tkd_status tkd_jinja_apply_test(tkd_jrender *r, const tkd_jnode *n, const tkd_jv *operand, int *out);

#endif /* TKD_JINJA_INTERNAL_H */
