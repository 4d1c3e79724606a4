/* fuzz_flags.c — libFuzzer target for the flags sidecar of a token file (formats/tokens_flags.c):
 * the fuzz input is F.flags.npy beside a fixed llm.c token file F of 64 tokens. Built and run by
 * scripts/fuzz.sh.
 *
 * The property: the pair either opens — then it has flags, at most 64 trained tokens, documents
 * starting in increasing order inside the stream, and every window label is its token or -100,
 * -100 exactly where the flags say untrained — or is refused with TKD_ERR_FORMAT,
 * TKD_ERR_UNSUPPORTED or TKD_ERR_MISMATCH (TKD_ERR_NOMEM) and a one-line message naming the sidecar. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "formats/tokens.h"
#include "tests/fuzz/fuzz_util.h"

#define NTOK 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char tok_file_[4096];
static void remove_tokens_(void) { unlink(tok_file_); }

/* F: an llm.c GPT-2 file of tokens 100..163, written once beside where the sidecar goes (removed
 * at exit, as fuzz_util.h removes the sidecar). */
static void write_tokens(const char *flags_path, char *tok_path, size_t cap)
{
    size_t n = strlen(flags_path) - strlen(".flags.npy");
    if (n >= cap)
        abort();
    memcpy(tok_path, flags_path, n);
    tok_path[n] = '\0';
    static int done;
    if (done)
        return;
    int32_t h[256] = {20240520, 1, NTOK};
    uint16_t t[NTOK];
    for (int i = 0; i < NTOK; i++)
        t[i] = (uint16_t)(100 + i);
    FILE *f = fopen(tok_path, "wb");
    if (!f || fwrite(h, sizeof h, 1, f) != 1 || fwrite(t, sizeof t, 1, f) != 1 || fclose(f) != 0)
        abort();
    snprintf(tok_file_, sizeof tok_file_, "%s", tok_path);
    atexit(remove_tokens_);
    done = 1;
}

static void check_opened(const tkd_tokens *ds)
{
    uint8_t fl[NTOK];
    if (!tkd_tokens_has_flags(ds) || tkd_tokens_read_flags(ds, 0, NTOK, fl) != TKD_OK)
        abort();
    int64_t trained = tkd_tokens_num_trained(ds), prev = -1;
    if (trained < 0 || trained > NTOK)
        abort();
    for (int64_t d = 0; d < tkd_tokens_num_docs(ds); d++) {
        int64_t s = tkd_tokens_doc_start(ds, d);
        if (s <= prev || s >= NTOK || !(fl[s] & TKD_TOKENS_FLAG_DOC_START))
            abort();
        prev = s;
    }
    int32_t win[8], lab[7];
    for (int64_t i = 0; i < tkd_tokens_num_windows(ds, 7, 5, 1); i++) {
        if (tkd_tokens_window(ds, 7, 5, 1, i, win, lab, NULL) != TKD_OK)
            abort();
        for (int j = 0; j < 7; j++) {
            int64_t g = i * 5 + j + 1;
            int32_t want = g < NTOK && (fl[g] & TKD_TOKENS_FLAG_TRAINED) ? (int32_t)(100 + g) : -100;
            if (lab[j] != want)
                abort();
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const tkd_status refusals[] = {TKD_ERR_FORMAT, TKD_ERR_UNSUPPORTED, TKD_ERR_MISMATCH, TKD_ERR_NOMEM};
    char tok_path[4096];
    const char *flags_path = tkd_fuzz_write_file(".bin.flags.npy", data, size);
    write_tokens(flags_path, tok_path, sizeof tok_path);
    tkd_tokens *ds = NULL;
    tkd_status st = tkd_tokens_open(tok_path, &ds);
    if (st != TKD_OK) {
        tkd_fuzz_expect_refusal(st, refusals, 4);
        if (ds || !strstr(tkd_error_msg(), flags_path))
            abort();
        return 0;
    }
    check_opened(ds);
    tkd_tokens_free(ds);
    return 0;
}
