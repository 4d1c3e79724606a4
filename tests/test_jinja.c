/* test_jinja.c — formats/jinja: the language construct by construct (expected outputs are what
 * @huggingface/jinja renders), whitespace control and transformers' trim/lstrip_blocks, errors with
 * line:col and refusals naming the construct, then the real chat templates of
 * tests/data/chat_templates byte for byte against the outputs @huggingface/jinja wrote
 * (tests/chat_template_reference.mjs). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "formats/jinja.h"
#include "tests/testutil.h"

/* 2024-07-26T12:00:00Z, the clock conversations.json pins for strftime_now. */
static const long long tkd_test_now = 1721995200;

/* Renders src with ctx (JSON); returns the output (malloc'd) or NULL with the status in *st. */
static char *tkd_test_render(const char *src, const char *ctx, tkd_status *st)
{
    tkd_jinja_template *t = NULL;
    char *out = NULL;
    size_t n = 0;
    tkd_jinja_render_opts o = {.now = tkd_test_now};
    *st = tkd_jinja_parse(src, strlen(src), "t.jinja", &t);
    if (*st == TKD_OK)
        *st = tkd_jinja_render(t, ctx, strlen(ctx), &o, &out, &n);
    if (*st == TKD_OK)
        assert_int_equal(strlen(out), n);
    tkd_jinja_free(t);
    return out;
}

static void tkd_test_renders(const char *src, const char *ctx, const char *want)
{
    tkd_status st;
    char *got = tkd_test_render(src, ctx, &st);
    if (st != TKD_OK)
        fail_msg("render of %s failed: %s", src, tkd_error_msg());
    if (strcmp(got, want))
        fail_msg("template %s\n  got  [%s]\n  want [%s]", src, got, want);
    free(got);
}

static void tkd_test_refuses(const char *src, const char *ctx, tkd_status want, const char *msg)
{
    tkd_status st;
    char *got = tkd_test_render(src, ctx, &st);
    if (st == TKD_OK)
        fail_msg("template %s rendered [%s], expected an error with '%s'", src, got, msg);
    assert_int_equal(st, want);
    tkd_test_assert_msg_has(msg);
    assert_null(strchr(tkd_error_msg(), '\n'));
}

static void test_text_and_output(void **state)
{
    (void)state;
    tkd_test_renders("hello", "{}", "hello");
    tkd_test_renders("a{{ x }}b", "{\"x\": \"X\"}", "aXb");
    tkd_test_renders("{{ 1 }} {{ 2.5 }} {{ 3.0 }} {{ -4 }}", "{}", "1 2.5 3.0 -4");
    tkd_test_renders("{{ true }} {{ none }}|{{ undefined_name }}|", "{}", "true ||");
    tkd_test_renders("{{ 'it''s' }} {{ \"q\\\"\\n\" }}", "{}", "its q\"\n");
    tkd_test_renders("{{ [1, 'a', none] }} {{ {'k': [true]} }}", "{}", "[1, \"a\", null] {\"k\": [true]}");
    tkd_test_renders("{# comment #}x", "{}", "x");
    tkd_test_renders("trailing newline dropped\n", "{}", "trailing newline dropped");
}

static void test_whitespace_control(void **state)
{
    (void)state;
    tkd_test_renders("a  {{- 'b' -}}  c", "{}", "abc");
    tkd_test_renders("a \n {%- if true -%} \n b {%- endif %}", "{}", "ab");
    tkd_test_renders("x  {#- c -#}  y", "{}", "xy");
    /* trim_blocks: the newline after a block tag goes; lstrip_blocks: indentation before it goes */
    tkd_test_renders("{% if true %}\n    yes\n    {% endif %}\nafter", "{}", "    yes\nafter");
    /* ... but not around {{ }} */
    tkd_test_renders("  {{ 'v' }}\nz", "{}", "  v\nz");
    tkd_test_renders("{% generation %}gen{% endgeneration %}", "{}", "gen");
}

/* The spans {% generation %} blocks write, as transformers' AssistantTracker records them: byte
 * offsets of the top-level output, whitespace control applied; blocks in a set capture not recorded. */
static void test_generation_spans(void **state)
{
    (void)state;
    const char *src = "{% for m in ms %}<{{ m.r }}>{%- generation -%}  {{ m.c }}|{% endgeneration %}\n{% endfor %}"
                      "{% set x %}{% generation %}no{% endgeneration %}{% endset %}{{ x }}";
    const char *ctx = "{\"ms\": [{\"r\": \"u\", \"c\": \"hi\"}, {\"r\": \"a\", \"c\": \"\u00e9t\u00e9\"}]}";
    tkd_jinja_template *t = NULL;
    assert_int_equal(tkd_jinja_parse(src, strlen(src), "gen.jinja", &t), TKD_OK);
    assert_true(tkd_jinja_has_generation(t));
    tkd_jinja_spans g = {0};
    tkd_jinja_render_opts o = {.now = 0, .generation = &g};
    char *out = NULL;
    size_t n = 0;
    assert_int_equal(tkd_jinja_render(t, ctx, strlen(ctx), &o, &out, &n), TKD_OK);
    assert_string_equal(out, "<u>hi|<a>\xc3\xa9t\xc3\xa9|no"); /* trim_blocks took the newlines */
    assert_int_equal(g.n, 2);
    assert_int_equal(g.v[0].start, 3);
    assert_int_equal(g.v[0].end, 6);
    assert_int_equal(g.v[1].start, 9);
    assert_int_equal(g.v[1].end, 15);
    free(out);
    tkd_jinja_spans_free(&g);
    tkd_jinja_free(t);
    assert_int_equal(tkd_jinja_parse("a", 1, "plain", &t), TKD_OK);
    assert_false(tkd_jinja_has_generation(t));
    tkd_jinja_free(t);
    tkd_test_refuses("{% generation %}x", "{}", TKD_ERR_FORMAT, "'generation' is never closed");
    tkd_test_refuses("x{% endgeneration %}", "{}", TKD_ERR_FORMAT, "unexpected 'endgeneration'");
}

static void test_if_for_loop(void **state)
{
    (void)state;
    const char *ctx = "{\"xs\": [\"a\", \"b\", \"c\"], \"d\": {\"k1\": 1, \"k2\": 2}}";
    tkd_test_renders("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ x }}{% if loop.first %}F{% endif %}"
                     "{% if loop.last %}L{{ loop.length }}{% endif %},{% endfor %}",
                     ctx, "10aF,21b,32cL3,");
    tkd_test_renders("{% for x in xs if x != 'b' %}{{ x }}{{ loop.index }}{% endfor %}", ctx, "a1c2");
    tkd_test_renders("{% for x in [] %}x{% else %}empty{% endfor %}", ctx, "empty");
    tkd_test_renders("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", ctx, "k1=1;k2=2;");
    tkd_test_renders("{% for k in d %}{{ k }}{% endfor %}", ctx, "k1k2");
    tkd_test_renders("{% for x in xs %}{% if x == 'b' %}{% continue %}{% endif %}{{ x }}{% endfor %}", ctx, "ac");
    tkd_test_renders("{% for x in xs %}{% if x == 'b' %}{% break %}{% endif %}{{ x }}{% endfor %}", ctx, "a");
    tkd_test_renders("{% if 0 %}a{% elif xs %}b{% else %}c{% endif %}", ctx, "b");
    tkd_test_renders("{{ 'y' if xs else 'n' }}{{ 'y' if [] else 'n' }}|{{ 'only' if false }}|", ctx, "yn||");
}

static void test_set_namespace_macro(void **state)
{
    (void)state;
    tkd_test_renders("{% set x = 1 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}{{ x }}", "{}", "1");
    tkd_test_renders("{% set ns = namespace(n=0, s='') %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}{% endfor %}"
                     "{{ ns.n }}",
                     "{}", "6");
    tkd_test_renders("{% set b %}in {{ 'block' }}{% endset %}[{{ b }}]", "{}", "[in block]");
    tkd_test_renders("{% set a, b = [1, 2] %}{{ b }}{{ a }}", "{}", "21");
    tkd_test_renders("{% macro m(x, y='d') %}<{{ x }}{{ y }}>{% endmacro %}{{ m(1) }}{{ m(2, 'e') }}{{ m(3, y='f') }}",
                     "{}", "<1d><2e><3f>");
    tkd_test_renders("{% set messages = messages[1:] %}{{ messages | length }}", "{\"messages\": [1, 2, 3]}", "2");
}

static void test_expressions(void **state)
{
    (void)state;
    const char *ctx = "{\"s\": \"hello\", \"xs\": [0, 1, 2, 3, 4], \"m\": {\"role\": \"user\"}}";
    tkd_test_renders("{{ xs[1:3] }}{{ xs[::-1] }}{{ xs[-2:] }}{{ xs[:-3] }}{{ xs[::2] }}", ctx,
                     "[1, 2][4, 3, 2, 1, 0][3, 4][0, 1][0, 2, 4]");
    tkd_test_renders("{{ s[1:3] }}{{ s[-1] }}{{ s[::-1] }}", ctx, "eloolleh");
    tkd_test_renders("{{ 'ell' in s }}{{ 3 in xs }}{{ 'role' in m }}{{ 'x' not in m }}{{ 'a' in undefined_name }}", ctx,
                     "truetruetruetruefalse");
    tkd_test_renders("{{ m.role }}{{ m['role'] }}{{ m.missing is defined }}{{ m.get('missing', 'dflt') }}", ctx,
                     "useruserfalsedflt");
    tkd_test_renders("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 7 / 2 }} {{ -7 // 2 }} {{ 1 - 2.5 }}", ctx,
                     "7 3 1 3.5 -4 -1.5");
    tkd_test_renders("{{ 'a' ~ 1 ~ true }}{{ 'b' + 'c' }}{{ [1] + [2] }}", ctx, "a1truebc[1, 2]");
    tkd_test_renders("{{ 1 < 2 and 2 >= 2 }}{{ not 1 == 1 or 0 }}{{ 1 != 1.0 }}{{ none == undefined_name }}", ctx,
                     "true0falsetrue");
    tkd_test_renders("{{ s is string }}{{ m is mapping }}{{ m is iterable }}{{ xs is iterable }}{{ s is not none }}"
                     "{{ 3 is number }}{{ none is none }}{{ false is false }}{{ xs is sequence }}",
                     ctx, "truetruefalsetruetruetruetruetruetrue");
    tkd_test_renders("{{ {'a': 1, 'b': [1, 2]}['b'][1] }}{{ ('x', 'y')[1] }}", ctx, "2y");
}

static void test_strings_and_filters(void **state)
{
    (void)state;
    const char *ctx = "{\"s\": \"  Hi There  \", \"tools\": [{\"name\": \"a\", \"on\": true}, {\"name\": \"b\"}],"
                      " \"u\": \"Grüße 世界\", \"d\": {\"x\": 1, \"é\": [1.5, null]}}";
    tkd_test_renders("[{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}][{{ s | trim }}]", ctx,
                     "[Hi There][Hi There  ][  Hi There][Hi There]");
    tkd_test_renders("{{ s.upper() }}{{ s.lower() }}{{ 'ab cd'.title() }}", ctx, "  HI THERE    hi there  Ab Cd");
    tkd_test_renders("{{ 'a,b,,c'.split(',') }}{{ ' a  b '.split() }}{{ 'a,b,c'.split(',', 1) }}", ctx,
                     "[\"a\", \"b\", \"\", \"c\"][\"a\", \"b\"][\"a\", \"b,c\"]");
    tkd_test_renders("{{ s.startswith('  H') }}{{ s.endswith(('x', '  ')) }}{{ 'aXbX'.replace('X', '-') }}", ctx,
                     "truetruea-b-");
    tkd_test_renders("{{ u | length }}{{ u[0:2] }}{{ s | length }}{{ tools | length }}{{ d | length }}", ctx, "8Gr1222");
    tkd_test_renders("{{ tools | map(attribute='name') | join(', ') }}|{{ tools | selectattr('on') | list | length }}"
                     "|{{ tools | rejectattr('name', 'equalto', 'a') | map(attribute='name') | first }}",
                     ctx, "a, b|1|b");
    tkd_test_renders("{{ d | tojson }}|{{ u | tojson }}|{{ u | tojson(ensure_ascii=true) }}", ctx,
                     "{\"x\": 1, \"é\": [1.5, null]}|\"Grüße 世界\"|\"Gr\\u00fc\\u00dfe \\u4e16\\u754c\"");
    tkd_test_renders("{{ d | tojson(indent=2) }}", ctx, "{\n  \"x\": 1,\n  \"é\": [\n    1.5,\n    null\n  ]\n}");
    tkd_test_renders("{{ d | tojson(separators=(',', ':')) }}{{ [] | tojson(indent=2) }}", ctx,
                     "{\"x\":1,\"é\":[1.5,null]}[]");
    tkd_test_renders("{{ d | items | first }}{{ xs | default('D') }}{{ 1 | string }}{{ ['a', 'b'] | last }}", ctx,
                     "[\"x\", 1]D1b");
    tkd_test_renders("{{ 'a\nb\n\nc' | indent(2) }}", ctx, "a\n  b\n\n  c");
    tkd_test_renders("{{ strftime_now('%Y-%m-%d %d %b %Y') }}", ctx, "2024-07-26 26 Jul 2024");
}

/* Where the reference's JavaScript shows through: ~ and join write a float's raw JavaScript value. */
static void test_numbers_and_case(void **state)
{
    (void)state;
    const char *ctx = "{\"f\": 2.5, \"n\": 5, \"u\": \"héllo 👋\"}";
    tkd_test_renders("{{ 'abc'[1:] ~ 5 ~ 2.0 ~ true }}|{{ [1.0, 'a', none] | join(',') }}|{{ 2.0 }}", ctx, "bc52true|1,a,|2.0");
    tkd_test_renders("{{ f | int }}{{ '42' | int }}{{ n | float }}{{ (7 / 2) | int }}{{ -3 | abs }}", ctx, "2425.033");
    tkd_test_renders("{{ n ** 2 }} {{ 2 ** -1 }} {{ 0.1 + 0.2 }} {{ 10 / 4 }}", ctx, "25 0.5 0.30000000000000004 2.5");
    tkd_test_renders("{{ u | upper }}{{ u | length }}{{ u[::-1] }}{{ 'éa b'.title() }}", ctx, "HÉLLO 👋8👋 olléhéA B");
}

static void test_errors_name_place(void **state)
{
    (void)state;
    tkd_test_refuses("line one\n{% include 'x' %}", "{}", TKD_ERR_UNSUPPORTED, "t.jinja:2:4: unsupported statement 'include'");
    tkd_test_refuses("{% raw %}x{% endraw %}", "{}", TKD_ERR_UNSUPPORTED, "t.jinja:1:4: unsupported statement 'raw'");
    tkd_test_refuses("ab\n  {{ x | wordcount }}", "{\"x\": \"a\"}", TKD_ERR_UNSUPPORTED,
                     "t.jinja:2:10: unsupported filter 'wordcount'");
    tkd_test_refuses("{{ x is divisibleby }}", "{\"x\": 3}", TKD_ERR_UNSUPPORTED, "t.jinja:1:6: unsupported test 'divisibleby'");
    tkd_test_refuses("{{ x.zfill(3) }}", "{\"x\": \"3\"}", TKD_ERR_UNSUPPORTED, "unsupported function or method 'zfill'");
    tkd_test_refuses("{{ f(*xs) }}", "{}", TKD_ERR_UNSUPPORTED, "unsupported construct '*'");
    tkd_test_refuses("{% for x in xs %}", "{}", TKD_ERR_FORMAT, "t.jinja:1:4: 'for' is never closed");
    tkd_test_refuses("{{ 'abc }}", "{}", TKD_ERR_FORMAT, "t.jinja:1:4: unterminated string literal");
    tkd_test_refuses("{% endif %}", "{}", TKD_ERR_FORMAT, "unexpected 'endif'");
    tkd_test_refuses("{{ (1 }}", "{}", TKD_ERR_FORMAT, "t.jinja:1:");
    tkd_test_refuses("x\n{{ raise_exception('Roles must alternate') }}", "{}", TKD_ERR_FORMAT,
                     "t.jinja:2:4: raise_exception: Roles must alternate");
    tkd_test_refuses("{{ 1 + none }}", "{}", TKD_ERR_FORMAT, "cannot apply an operator to integer and none");
    tkd_test_refuses("{{ x | trim }}", "{\"x\": [1]}", TKD_ERR_FORMAT, "filter 'trim' cannot apply to a list");
    tkd_test_refuses("{{ x }}", "[1]", TKD_ERR_FORMAT, "must be a JSON object");
    tkd_test_refuses("{{ x }}", "{bad", TKD_ERR_FORMAT, "invalid JSON");
    tkd_test_refuses("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "{}", TKD_ERR_FORMAT, "nested deeper");
    tkd_test_refuses("{% for i in range(10000000) %}{% endfor %}", "{}", TKD_ERR_UNSUPPORTED, "range() of 10000000 items");
    char deep[1200] = "{{ ";
    for (int i = 0; i < 300; i++)
        strcat(deep, "(");
    tkd_test_refuses(deep, "{}", TKD_ERR_UNSUPPORTED, "nesting deeper than 200 levels");
}

/* ---- the real templates ---- */
/* A file under tests/ (the test fails when it is missing). */
static char *tkd_test_data(const char *rel, size_t *n)
{
    return tkd_test_slurp(tkd_test_src(rel), n);
}

/* The context of one conversation for one template: its bos/eos tokens added (none when null). */
static char *tkd_test_context(const cJSON *conv, const cJSON *tmpl)
{
    cJSON *ctx = cJSON_Duplicate(cJSON_GetObjectItem(conv, "context"), 1);
    const char *keys[] = {"bos_token", "eos_token"};
    for (int k = 0; k < 2; k++) {
        const cJSON *tok = cJSON_GetObjectItem(tmpl, keys[k]);
        if (cJSON_IsString(tok))
            cJSON_AddStringToObject(ctx, keys[k], tok->valuestring);
    }
    char *s = cJSON_PrintUnformatted(ctx);
    cJSON_Delete(ctx);
    return s;
}

static int tkd_test_one_template(const cJSON *tmpl, const cJSON *convs)
{
    const char *file = cJSON_GetObjectItem(tmpl, "file")->valuestring;
    char rel[256], base[200];
    size_t n;
    snprintf(rel, sizeof rel, "data/chat_templates/%s", file);
    snprintf(base, sizeof base, "%.*s", (int)(strlen(file) - strlen(".jinja")), file);
    char *src = tkd_test_data(rel, &n);
    tkd_jinja_template *t = NULL;
    if (tkd_jinja_parse(src, n, file, &t) != TKD_OK)
        fail_msg("%s does not parse: %s", file, tkd_error_msg());
    free(src);
    int rendered = 0, raised = 0;
    const cJSON *conv;
    cJSON_ArrayForEach(conv, convs)
    {
        const char *name = cJSON_GetObjectItem(conv, "name")->valuestring;
        char *ctx = tkd_test_context(conv, tmpl), *out = NULL;
        size_t out_n = 0, want_n = 0;
        tkd_jinja_render_opts o = {.now = tkd_test_now};
        tkd_status st = tkd_jinja_render(t, ctx, strlen(ctx), &o, &out, &out_n);
        snprintf(rel, sizeof rel, "data/chat_templates/expected/%s__%s.txt", base, name);
        FILE *fp = fopen(tkd_test_src(rel), "rb");
        if (!fp) { /* the reference raised: so must we */
            snprintf(rel, sizeof rel, "data/chat_templates/expected/%s__%s.err", base, name);
            char *want = tkd_test_data(rel, &want_n);
            if (st == TKD_OK)
                fail_msg("%s x %s rendered, the reference raised: %s", file, name, want);
            want[strcspn(want, "\n")] = 0; /* the reference's message, which ours must carry */
            if (!strstr(tkd_error_msg(), want))
                fail_msg("%s x %s: error \"%s\" lacks the reference's \"%s\"", file, name, tkd_error_msg(), want);
            raised++;
            free(want);
        } else {
            fclose(fp);
            char *want = tkd_test_data(rel, &want_n);
            if (st != TKD_OK)
                fail_msg("%s x %s: %s", file, name, tkd_error_msg());
            if (out_n != want_n || memcmp(out, want, want_n)) {
                size_t i = 0;
                while (i < out_n && i < want_n && out[i] == want[i])
                    i++;
                fail_msg("%s x %s differs from the reference at byte %zu:\n  got  [%.80s]\n  want [%.80s]", file, name,
                         i, out + i, want + i);
            }
            free(want);
            rendered++;
        }
        free(out);
        cJSON_free(ctx);
    }
    tkd_jinja_free(t);
    print_message("%s: %d conversations byte-identical, %d raising as the reference does\n", file, rendered, raised);
    return rendered;
}

static void test_real_templates_match_reference(void **state)
{
    (void)state;
    size_t n;
    char *text = tkd_test_data("data/chat_templates/conversations.json", &n);
    cJSON *corpus = cJSON_ParseWithLength(text, n);
    assert_non_null(corpus);
    const cJSON *tmpls = cJSON_GetObjectItem(corpus, "templates"), *convs = cJSON_GetObjectItem(corpus, "conversations");
    assert_int_equal(cJSON_GetArraySize(tmpls), 8);
    const cJSON *tmpl;
    cJSON_ArrayForEach(tmpl, tmpls)
    {
        assert_true(tkd_test_one_template(tmpl, convs) > 0);
    }
    cJSON_Delete(corpus);
    free(text);
}

/* A real template's branch the interpreter lacks is refused by name and place, never skipped:
 * Llama 3.1 with builtin_tools reaches `reject` (which @huggingface/jinja lacks too). */
static void test_real_template_refusal_names_construct(void **state)
{
    (void)state;
    size_t n;
    char *src = tkd_test_data("data/chat_templates/meta-llama-Llama-3.1-8B-Instruct.jinja", &n);
    tkd_jinja_template *t = NULL;
    assert_int_equal(tkd_jinja_parse(src, n, "llama31.jinja", &t), TKD_OK);
    const char *ctx = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [],"
                      " \"builtin_tools\": [\"brave_search\", \"code_interpreter\"]}";
    char *out = NULL;
    size_t out_n;
    tkd_jinja_render_opts o = {.now = tkd_test_now};
    assert_int_equal(tkd_jinja_render(t, ctx, strlen(ctx), &o, &out, &out_n), TKD_ERR_UNSUPPORTED);
    assert_null(out);
    tkd_test_assert_msg_has("llama31.jinja:29:");
    tkd_test_assert_msg_has("unsupported filter 'reject'");
    tkd_jinja_free(t);
    free(src);
}

TKD_TEST_MAIN(test_text_and_output, test_whitespace_control, test_generation_spans, test_if_for_loop, test_set_namespace_macro,
              test_expressions, test_strings_and_filters, test_numbers_and_case, test_errors_name_place, test_real_templates_match_reference,
              test_real_template_refusal_names_construct)
