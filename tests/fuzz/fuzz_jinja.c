/* fuzz_jinja.c — libFuzzer target for chat templates (formats/jinja: lexer, parser, evaluator).
 * Built and run by scripts/fuzz.sh.
 *
 * The property: any text either parses or is refused with TKD_ERR_FORMAT / TKD_ERR_UNSUPPORTED
 * (TKD_ERR_NOMEM) and a one-line message; a template that parses renders a fixed conversation
 * (messages with a tool call, tools, bos/eos) to a NUL-terminated output of the length it reports,
 * or is refused the same way. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "formats/jinja.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char tkd_fuzz_ctx[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"sys\"}, {\"role\": \"user\", \"content\": \"Hi ü\"},"
    " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"abc123XYZ\", \"type\": \"function\","
    " \"function\": {\"name\": \"f\", \"arguments\": {\"a\": 1}}}]}, {\"role\": \"tool\", \"content\": \"ok\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}],"
    " \"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"enable_thinking\": false}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const tkd_status refusals[] = {TKD_ERR_FORMAT, TKD_ERR_UNSUPPORTED, TKD_ERR_NOMEM};
    tkd_jinja_template *t = NULL;
    tkd_status st = tkd_jinja_parse((const char *)data, size, "fuzz.jinja", &t);
    if (st != TKD_OK) {
        tkd_fuzz_expect_refusal(st, refusals, 3);
        if (t)
            abort();
        return 0;
    }
    char *out = NULL;
    size_t n = 0;
    tkd_jinja_render_opts o = {.now = 1721995200};
    st = tkd_jinja_render(t, tkd_fuzz_ctx, sizeof tkd_fuzz_ctx - 1, &o, &out, &n);
    if (st != TKD_OK) {
        tkd_fuzz_expect_refusal(st, refusals, 3);
        if (out)
            abort();
    } else if (!out || out[n] != 0) {
        fprintf(stderr, "fuzz: a render's output is not NUL-terminated at its length\n");
        abort();
    }
    free(out);
    tkd_jinja_free(t);
    return 0;
}
