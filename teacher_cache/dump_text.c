/* dump_text.c — see dump_text.h. */
#include "teacher_cache/dump_text.h"

#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/fileio.h"
#include "common/log.h"
#include "teacher_cache/tokenize.h"

/* data.paths with each glob pattern replaced by its matches (sorted); a pattern that matches
 * nothing is an error naming it. *files is malloc'd, its strings are in *g (globfree). */
static tkd_status expand(const tkd_strlist *paths, glob_t *g, const char ***files, int *n)
{
    memset(g, 0, sizeof *g);
    for (size_t i = 0; i < paths->n; i++) {
        int rc = glob(paths->items[i], (i ? GLOB_APPEND : 0) | GLOB_NOCHECK, NULL, g);
        if (rc != 0)
            return tkd_error_set(TKD_ERR_IO, "data.paths: cannot expand '%s'", paths->items[i]);
        const char *last = g->gl_pathv[g->gl_pathc - 1];
        if (strcmp(last, paths->items[i]) == 0 && !tkd_file_exists(last))
            return tkd_error_set(TKD_ERR_NOT_FOUND, "data.paths: '%s' matches no file", paths->items[i]);
    }
    *files = malloc((g->gl_pathc + 1) * sizeof **files);
    if (!*files)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < g->gl_pathc; i++)
        (*files)[i] = g->gl_pathv[i];
    *n = (int)g->gl_pathc;
    return TKD_OK;
}

static tkd_status tokenize_to(const tkd_dump_config *cfg, int64_t vocab, const char *out_path)
{
    glob_t g;
    tkd_tokenize_opts o = {
        .tokenizer = cfg->data_tokenizer,
        .output = out_path,
        .vocab_limit = vocab,
        .no_lock = true, /* a directory of its own (mkdtemp), removed after: no lock file to leave there */
        .field = cfg->data_text_field && *cfg->data_text_field ? cfg->data_text_field : "text",
        .chat = cfg->data_format == TKD_DUMP_DATA_FORMAT_CHAT,
        .chat_template = cfg->data_chat_template && *cfg->data_chat_template ? cfg->data_chat_template : NULL,
        .chat_kwargs = cfg->data_chat_kwargs && *cfg->data_chat_kwargs ? cfg->data_chat_kwargs : NULL,
    };
    static const tkd_text_kind kinds[] = {[TKD_DUMP_DATA_FORMAT_AUTO] = TKD_TEXT_AUTO,
                                          [TKD_DUMP_DATA_FORMAT_TEXT] = TKD_TEXT_PLAIN,
                                          [TKD_DUMP_DATA_FORMAT_JSONL] = TKD_TEXT_JSONL,
                                          [TKD_DUMP_DATA_FORMAT_CHAT] = TKD_TEXT_JSONL};
    o.kind = kinds[cfg->data_format];
    TKD_TRY(tkd_dump_doc_separator(cfg, &o.separator)); /* its escapes read as --doc-separator's */
    tkd_status st = expand(&cfg->data_paths, &g, &o.inputs, &o.ninputs);
    tkd_tokenize_summary sum;
    if (st == TKD_OK)
        st = tkd_tokenize_run(&o, &sum);
    if (st == TKD_OK)
        tkd_log_info("teacher-dump: data.tokenizer: %lld documents, %.1f MB of text -> %lld tokens in %.1f s",
                     (long long)sum.docs, (double)sum.bytes / 1e6, (long long)sum.tokens, sum.seconds);
    if (st == TKD_OK && o.chat)
        tkd_log_info("teacher-dump: data.format chat: template %s", sum.chat_source);
    free(o.inputs);
    free(o.separator);
    globfree(&g);
    return st == TKD_OK ? st : tkd_error_prefix(st, "data.tokenizer");
}

tkd_status tkd_dump_open_dataset(const tkd_dump_config *cfg, int64_t vocab, tkd_tokens **out)
{
    *out = NULL;
    if (!cfg->data_tokenizer || !*cfg->data_tokenizer) {
        tkd_status st = tkd_tokens_open_list((const char *const *)cfg->data_paths.items, (int)cfg->data_paths.n, out);
        return st == TKD_OK ? st : tkd_error_prefix(st, "data.paths");
    }
    const char *base = getenv("TMPDIR");
    char dir[4096], path[4200];
    snprintf(dir, sizeof dir, "%s/topkd-tokens-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(dir))
        return tkd_error_set(TKD_ERR_IO, "%s: cannot make a temporary directory for the tokens", dir);
    snprintf(path, sizeof path, "%s/tokens.npy", dir);
    tkd_status st = tokenize_to(cfg, vocab, path);
    if (st == TKD_OK)
        st = tkd_tokens_open(path, out); /* with data.format chat, its flags sidecar too */
    tkd_error_saved saved;
    tkd_error_save(&saved, st);
    unlink(path);
    snprintf(path, sizeof path, "%s/tokens.npy.flags.npy", dir);
    unlink(path);
    rmdir(dir);
    return tkd_error_restore(&saved);
}
