/* fuzz_tokenizer.h — shared by the tokenizer targets (fuzz_tokenizer_json.c, fuzz_tokenizer_config.c;
 * header-only): a directory holding the fuzz input as tokenizer.json or tokenizer_config.json, and
 * the property both check.
 *
 * The property: the directory's tokenizer either loads or is refused with TKD_ERR_FORMAT,
 * TKD_ERR_UNSUPPORTED or TKD_ERR_NOMEM and a one-line message naming the file (its directory); one
 * that loads encodes a fixed text and the input itself (as text) without failing, every id below
 * tkd_tokenizer_vocab_size and with a token's bytes. */
#ifndef TKD_FUZZ_TOKENIZER_H
#define TKD_FUZZ_TOKENIZER_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "formats/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

static char tkd_fuzz_tok_dir_[4096];

static inline void tkd_fuzz_tok_path_(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", tkd_fuzz_tok_dir_, name);
}

static inline void tkd_fuzz_tok_cleanup_(void)
{
    char p[4200];
    tkd_fuzz_tok_path_(p, sizeof p, "tokenizer.json");
    unlink(p);
    tkd_fuzz_tok_path_(p, sizeof p, "tokenizer_config.json");
    unlink(p);
    rmdir(tkd_fuzz_tok_dir_);
}

/* Writes data as dir/name, the directory made on the first call (removed at exit). */
static inline void tkd_fuzz_tok_write(const char *name, const uint8_t *data, size_t size)
{
    if (!tkd_fuzz_tok_dir_[0]) {
        const char *tmp = getenv("TMPDIR");
        snprintf(tkd_fuzz_tok_dir_, sizeof tkd_fuzz_tok_dir_, "%s/topkd-fuzz-tok-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(tkd_fuzz_tok_dir_))
            abort();
        atexit(tkd_fuzz_tok_cleanup_);
    }
    char p[4200];
    tkd_fuzz_tok_path_(p, sizeof p, name);
    FILE *f = fopen(p, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0)
        abort();
}

static inline void tkd_fuzz_tok_encode_(tkd_tokenizer *tok, tkd_tokenizer_ctx *ctx, const char *text, size_t len)
{
    tkd_token_ids ids = {0};
    if (tkd_tokenizer_encode(ctx, text, len, &ids) != TKD_OK) {
        fprintf(stderr, "fuzz: a tokenizer that loaded cannot encode: %s\n", tkd_error_msg());
        abort();
    }
    for (size_t i = 0; i < ids.n; i++) {
        size_t n;
        if (ids.ids[i] >= (uint32_t)tkd_tokenizer_vocab_size(tok) || !tkd_tokenizer_token_bytes(tok, ids.ids[i], &n)) {
            fprintf(stderr, "fuzz: id %u has no token (vocab size %d)\n", ids.ids[i], tkd_tokenizer_vocab_size(tok));
            abort();
        }
    }
    tkd_token_ids_free(&ids);
}

/* Loads the directory and checks the property (top of this file); data is also encoded as text. */
static inline void tkd_fuzz_tok_check(const uint8_t *data, size_t size)
{
    static const tkd_status refusals[] = {TKD_ERR_FORMAT, TKD_ERR_UNSUPPORTED, TKD_ERR_NOMEM};
    static const char text[] = "Hello world! 123  \t\n caf\xC3\xA9 \xFF\xFE ab<|eos|>abab <|endoftext|>\xE2\x80\x8B x";
    tkd_tokenizer *tok = NULL;
    tkd_status st = tkd_tokenizer_load(tkd_fuzz_tok_dir_, &tok);
    if (st != TKD_OK) {
        tkd_fuzz_expect_refusal(st, refusals, 3);
        if (!strstr(tkd_error_msg(), tkd_fuzz_tok_dir_) || tok) {
            fprintf(stderr, "fuzz: a refusal that does not name the file: '%s'\n", tkd_error_msg());
            abort();
        }
        return;
    }
    tkd_tokenizer_ctx *ctx = NULL;
    if (tkd_tokenizer_ctx_create(tok, &ctx) != TKD_OK)
        abort();
    tkd_fuzz_tok_encode_(tok, ctx, text, sizeof text - 1);
    tkd_fuzz_tok_encode_(tok, ctx, (const char *)data, size < 4096 ? size : 4096);
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
}

#endif /* TKD_FUZZ_TOKENIZER_H */
