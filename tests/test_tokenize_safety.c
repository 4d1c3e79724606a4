/* test_tokenize_safety.c — `teacher-dump tokenize` keeps the user's files safe and says what
 * happened (issue 20, items 2, 3, 7 and 12):
 * - an output that is one of the files being read (the same name, ./name, a symlink, a hard link, the
 *   tokenizer.json, an input that is an existing shard name) is refused before anything is written,
 *   naming both, and the input is left as it was;
 * - one writer per output: the lock .<output name>.topkd-lock beside it; a second run is refused at
 *   once naming the first one's pid;
 * - numeric flags refuse junk and overflow (one parser, common/cli.h), and --shard-tokens above what
 *   an llm.c .bin file counts (int32) is refused where a .npy takes it;
 * - a sharded run stopped by SIGINT leaves no output name behind (its shards were temporaries), so
 *   the advice "re-run the command" is true, and an earlier complete output stays as it was;
 * - a write that fails (EFBIG under RLIMIT_FSIZE) says why (strerror), and leaves nothing;
 * - a single document longer than a batch is read in place, not copied into the batch: the run's
 *   peak memory grows by well under twice that document's size. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/launch.h"
#include "common/signals.h"
#include "formats/tokenizer.h"
#include "teacher_cache/tokenize.h"
#include "tests/testutil.h"

#define BIN TKD_BINARY_DIR "/bin/teacher-dump"
#define QWEN3 TKD_BINARY_DIR "/fixtures/tokenizer/qwen3" /* unpacked by CMake */

static const char *tmp(const char *name)
{
    return tkd_test_path(tkd_test_group_dir, name);
}

/* A fresh directory <group>/name for one test (so that directory listings are the test's own). */
static char *fresh_dir(const char *name)
{
    char *d = strdup(tmp(name));
    tkd_test_rmtree(d);
    assert_int_equal(mkdir(d, 0755), 0);
    return d;
}

static char *join(const char *dir, const char *name)
{
    char *p = malloc(strlen(dir) + strlen(name) + 2);
    sprintf(p, "%s/%s", dir, name);
    return p;
}

static tkd_status run_opts(tkd_tokenize_opts *o, const char *out, const char **inputs, int n)
{
    tkd_tokenize_summary sum;
    o->tokenizer = o->tokenizer ? o->tokenizer : QWEN3;
    o->output = out;
    o->inputs = inputs;
    o->ninputs = n;
    o->field = "text";
    return tkd_tokenize_run(o, &sum);
}

/* How many entries of dir start with prefix (hidden lock files are not outputs: skipped). */
static long long named(const char *path, const char *name, void *prefix)
{
    (void)path;
    return name[0] != '.' && strncmp(name, prefix, strlen(prefix)) == 0;
}

static int count_named(const char *dir, const char *prefix)
{
    return (int)tkd_test_dir_sum(dir, named, (void *)prefix);
}

/* ---- item 2: an output that is an input ------------------------------------------------------- */

static void expect_same_file(const char *out, const char *input, const char *out_in_msg, const char *read_in_msg,
                             int64_t shard_tokens)
{
    const char *inputs[] = {input};
    tkd_tokenize_opts o = {.overwrite = true, .shard_tokens = shard_tokens};
    assert_int_equal(run_opts(&o, out, inputs, 1), TKD_ERR_INVALID_ARG);
    char want[16384];
    snprintf(want, sizeof want, "tokenize: the output %s is the %s (the same file)", out_in_msg, read_in_msg);
    tkd_test_assert_msg_has(want);
    tkd_test_assert_msg_has("choose another --output");
}

static void test_output_is_input(void **state)
{
    (void)state;
    char *dir = fresh_dir("same");
    char *doc = join(dir, "doc.txt"), *slink = join(dir, "link.txt"), *hard = join(dir, "hard.txt");
    char *dotted = join(dir, "./doc.txt");
    const char *text = "A document the user keeps.\n";
    tkd_test_write_text(doc, text);
    assert_int_equal(symlink("doc.txt", slink), 0);
    assert_int_equal(link(doc, hard), 0);
    char in_doc[4200], in_slink[4200], in_tok[4300], in_shard[4200];
    snprintf(in_doc, sizeof in_doc, "input %s", doc);
    snprintf(in_slink, sizeof in_slink, "input %s", slink);
    expect_same_file(doc, doc, doc, in_doc, 0);
    expect_same_file(dotted, doc, dotted, in_doc, 0);
    expect_same_file(slink, doc, slink, in_doc, 0);
    expect_same_file(hard, doc, hard, in_doc, 0);
    expect_same_file(doc, slink, doc, in_slink, 0); /* the input through the symlink */
    /* the tokenizer's own file is read too */
    char tok_json[4200];
    snprintf(tok_json, sizeof tok_json, "%s/tokenizer.json", QWEN3);
    char *tok_before = tkd_test_slurp(tok_json, NULL);
    snprintf(in_tok, sizeof in_tok, "tokenizer file %s", tok_json);
    expect_same_file(tok_json, doc, tok_json, in_tok, 0);
    char *tok_after = tkd_test_slurp(tok_json, NULL);
    assert_string_equal(tok_after, tok_before);
    free(tok_before);
    free(tok_after);
    /* sharded: an input that is an existing shard name is refused before any shard is written,
     * whatever its number (shard 7 of a run that would write one shard) */
    char *shard7 = join(dir, "out_000007.bin"), *out = join(dir, "out.bin");
    tkd_test_write_text(shard7, text);
    snprintf(in_shard, sizeof in_shard, "input %s", shard7);
    expect_same_file(out, shard7, shard7, in_shard, 1000);
    assert_int_equal(count_named(dir, "out_"), 1);
    char *kept = tkd_test_slurp(doc, NULL);
    assert_string_equal(kept, text); /* never replaced */
    free(kept);
    kept = tkd_test_slurp(shard7, NULL);
    assert_string_equal(kept, text);
    free(kept);
    /* the binary: exit 2, one line naming both */
    char *log = join(dir, "cli.out");
    const char *args[] = {"tokenize", "--tokenizer", QWEN3, "--output", slink, "--overwrite", doc, NULL};
    assert_int_equal(tkd_test_run(BIN, args, NULL, log), 2);
    char *msg = tkd_test_slurp(log, NULL);
    char want[9000];
    snprintf(want, sizeof want, "teacher-dump: tokenize: the output %s is the input %s (the same file)", slink, doc);
    if (!strstr(msg, want))
        fail_msg("'%s' lacks '%s'", msg, want);
    free(msg);
    kept = tkd_test_slurp(doc, NULL);
    assert_string_equal(kept, text);
    free(kept);
    free(log), free(shard7), free(out), free(doc), free(slink), free(hard), free(dotted);
    tkd_test_rmdtemp(dir);
}

/* ---- item 3: one writer per output ------------------------------------------------------------ */

static void test_second_writer_refused(void **state)
{
    (void)state;
    char *dir = fresh_dir("lock");
    char *doc = join(dir, "doc.txt"), *out = join(dir, "out.bin");
    tkd_test_write_text(doc, "some text");
    /* another writer of out.bin holds its lock (what a running tokenize holds) */
    pid_t holder = tkd_test_lock_holder(dir, ".out.bin.topkd-lock", NULL);
    const char *inputs[] = {doc};
    tkd_tokenize_opts o = {.overwrite = true, .shard_tokens = 2};
    assert_int_equal(run_opts(&o, out, inputs, 1), TKD_ERR_BUSY);
    char want[128];
    snprintf(want, sizeof want, "another teacher-dump tokenize (pid %ld) is writing there", (long)holder);
    tkd_test_assert_msg_has(want);
    tkd_test_assert_msg_has("--output ");
    assert_int_equal(count_named(dir, "out"), 0); /* nothing written, nothing staged */
    /* the binary: exit 1 naming the pid */
    char *log = join(dir, "cli.out");
    const char *args[] = {"tokenize", "--tokenizer", QWEN3, "--output", out, "--overwrite", doc, NULL};
    assert_int_equal(tkd_test_run(BIN, args, NULL, log), 1);
    char *msg = tkd_test_slurp(log, NULL);
    assert_non_null(strstr(msg, want));
    free(msg);
    tkd_test_kill_holder(holder);
    /* once the other writer is gone, the run goes through (and a different output is never blocked) */
    assert_int_equal(run_opts(&o, out, inputs, 1), TKD_OK);
    assert_true(count_named(dir, "out_") >= 2);
    free(log), free(doc), free(out);
    tkd_test_rmdtemp(dir);
}

/* ---- item 7: numeric flags -------------------------------------------------------------------- */

static tkd_status parse(const char *flag, const char *value, const char *output, tkd_tokenize_opts *o)
{
    char *argv[] = {"tokenize", "--tokenizer", "t", "--output", (char *)output, (char *)flag, (char *)value, "in.txt",
                    NULL};
    bool help;
    int verbosity;
    tkd_status st = tkd_tokenize_parse_args(8, argv, o, &help, &verbosity);
    return st;
}

static void expect_flag_error(const char *flag, const char *value, const char *output, const char *frag)
{
    tkd_tokenize_opts o;
    assert_int_equal(parse(flag, value, output, &o), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(frag);
    tkd_tokenize_opts_free(&o);
}

static void test_numeric_flags(void **state)
{
    (void)state;
    /* what one llm.c file can count (int32 header) */
    expect_flag_error("--shard-tokens", "2147483648", "o.bin",
                      "tokenize: --shard-tokens 2147483648 is more than one llm.c .bin file holds (2147483647 tokens");
    expect_flag_error("--shard-tokens", "3000000000", "o", "give at most 2147483647, or an --output named .npy");
    tkd_tokenize_opts o;
    assert_int_equal(parse("--shard-tokens", "2147483647", "o.bin", &o), TKD_OK);
    assert_int_equal(o.shard_tokens, 2147483647);
    tkd_tokenize_opts_free(&o);
    assert_int_equal(parse("--shard-tokens", "3000000000", "o.npy", &o), TKD_OK); /* .npy: 64-bit shape */
    assert_int_equal(o.shard_tokens, 3000000000LL);
    tkd_tokenize_opts_free(&o);
    /* overflow is refused, never saturated */
    expect_flag_error("--shard-tokens", "99999999999999999999", "o.npy",
                      "tokenize: --shard-tokens: 99999999999999999999 is out of range; it must be in [1, "
                      "9223372036854775807]");
    expect_flag_error("--threads", "99999999999999999999", "o.bin", "--threads: 99999999999999999999 is out of range");
    expect_flag_error("--threads", "5000", "o.bin", "tokenize: --threads: 5000 is out of range; it must be in [1, 4096]");
    /* junk */
    const char *junk[] = {"", "12abc", " 5", "1e6", "0x10", "+", "--", "5 "};
    for (size_t i = 0; i < sizeof junk / sizeof *junk; i++) {
        char want[64];
        snprintf(want, sizeof want, "--threads: '%s' is not an integer", junk[i]);
        expect_flag_error("--threads", junk[i], "o.bin", junk[i][0] ? want : "--threads needs an integer value");
    }
    expect_flag_error("--shard-tokens", "0", "o.bin", "--shard-tokens: 0 is out of range; it must be in [1, ");
    expect_flag_error("--shard-tokens", "-3", "o.bin", "--shard-tokens: -3 is out of range");
    /* the library refuses what the parser would, for callers that fill the options themselves */
    tkd_test_write_text(tmp("n.txt"), "x");
    const char *inputs[] = {tmp("n.txt")};
    tkd_tokenize_opts big = {.overwrite = true, .shard_tokens = 1LL << 31};
    assert_int_equal(run_opts(&big, tmp("n.bin"), inputs, 1), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("--shard-tokens 2147483648 is more than one llm.c .bin file holds");
    assert_null(tkd_test_read_file(tmp("n_000000.bin"), NULL));
}

/* The shared parser itself, and --nproc-per-node through it. */
static void test_cli_parse_int(void **state)
{
    (void)state;
    int64_t x = 0;
    assert_int_equal(tkd_cli_parse_int("--n", "42", 1, 100, &x), TKD_OK);
    assert_int_equal(x, 42);
    assert_int_equal(tkd_cli_parse_int("--n", "-9223372036854775808", INT64_MIN, 0, &x), TKD_OK);
    assert_true(x == INT64_MIN);
    assert_int_equal(tkd_cli_parse_int("--n", "9223372036854775808", 1, INT64_MAX, &x), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("--n: 9223372036854775808 is out of range; it must be in [1, 9223372036854775807]");
    assert_int_equal(tkd_cli_parse_int("--n", "7x", 1, 100, &x), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("--n: '7x' is not an integer");
    assert_int_equal(tkd_cli_parse_int("--n", NULL, 1, 100, &x), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("--n needs an integer value");
    char a0[] = "tool", a1[] = "--nproc-per-node", a2[] = " 2", a3[] = "--nproc-per-node=99999999999999999999";
    char *argv[] = {a0, a1, a2, NULL};
    int argc = 3, nproc = -1;
    assert_int_equal(tkd_launch_take_nproc(&argc, argv, &nproc), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("--nproc-per-node: ' 2' is not an integer — give one process per GPU, 1 to 1024");
    char *argv2[] = {a0, a3, NULL};
    argc = 2;
    assert_int_equal(tkd_launch_take_nproc(&argc, argv2, &nproc), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("--nproc-per-node: 99999999999999999999 is out of range; it must be in [1, 1024]");
}

/* ---- item 12: an interrupted sharded run ----------------------------------------------------- */

/* 10,000 short documents: three batches of 4096 records, about 60,000 tokens. */
static void write_many(const char *path)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < 10000; i++)
        fprintf(f, "%sdocument number %d of the many", i ? "\n\n" : "", i);
    fclose(f);
}

static void sigint_after_first_batch(const tkd_tokenize_progress *p, void *user)
{
    (void)p;
    int *calls = user;
    if (++*calls == 1)
        raise(SIGINT);
}

static void test_interrupted_shards(void **state)
{
    (void)state;
    char *dir = fresh_dir("sigint");
    char *in = join(dir, "many.txt"), *out = join(dir, "out.bin"), *shard0 = join(dir, "out_000000.bin");
    write_many(in);
    const char *inputs[] = {in};
    /* stopped after the first batch, which filled several shards */
    int calls = 0;
    tkd_tokenize_opts o = {.separator = "\n\n", .shard_tokens = 4000, .threads = 2,
                           .progress = sigint_after_first_batch, .progress_user = &calls};
    assert_int_equal(tkd_signals_install(), TKD_OK);
    tkd_status st = run_opts(&o, out, inputs, 1);
    tkd_signals_uninstall();
    assert_int_equal(st, TKD_ERR_INTERRUPTED);
    tkd_test_assert_msg_has("tokenize: stopped by a signal after 4096 documents; nothing written");
    tkd_test_assert_msg_has("re-run the command to start again");
    assert_int_equal(count_named(dir, "out"), 0); /* no shard, no temporary: nothing that looks like a dataset */
    /* the advice is true: the same command (no --overwrite) now runs through */
    o = (tkd_tokenize_opts){.separator = "\n\n", .shard_tokens = 4000, .threads = 2};
    assert_int_equal(run_opts(&o, out, inputs, 1), TKD_OK);
    int nshards = count_named(dir, "out_");
    assert_true(nshards > 3);
    char *before = tkd_test_slurp(shard0, NULL);
    /* an interrupted --overwrite run leaves the complete earlier output exactly as it was */
    calls = 0;
    o = (tkd_tokenize_opts){.separator = "\n\n", .shard_tokens = 3000, .threads = 2, .overwrite = true,
                            .progress = sigint_after_first_batch, .progress_user = &calls};
    assert_int_equal(tkd_signals_install(), TKD_OK);
    st = run_opts(&o, out, inputs, 1);
    tkd_signals_uninstall();
    assert_int_equal(st, TKD_ERR_INTERRUPTED);
    assert_int_equal(count_named(dir, "out_"), nshards);
    char *after = tkd_test_slurp(shard0, NULL);
    assert_memory_equal(before, after, 1024 + 4 * 4000);
    free(before), free(after);
    /* without --overwrite an existing shard stops the run before anything is done */
    o = (tkd_tokenize_opts){.separator = "\n\n", .shard_tokens = 4000};
    assert_int_equal(run_opts(&o, out, inputs, 1), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(".bin exists — pass --overwrite");
    tkd_test_assert_msg_has("/out_0000");
    free(in), free(out), free(shard0);
    tkd_test_rmdtemp(dir);
}

/* ---- item 12: a failed write says why --------------------------------------------------------- */

/* In a child: writes larger than 64 KiB fail with EFBIG (SIGXFSZ ignored), as a full disk would
 * fail them; the child sends back its status and message. */
static tkd_status run_with_fsize_limit(const char *out, const char *in, int64_t shard_tokens, char *msg, size_t cap)
{
    int fds[2];
    pid_t pid = tkd_test_fork(fds);
    if (pid == 0) {
        close(fds[0]);
        signal(SIGXFSZ, SIG_IGN);
        struct rlimit rl = {64 << 10, 64 << 10};
        if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
            _exit(90);
        const char *inputs[] = {in};
        tkd_tokenize_opts o = {.overwrite = true, .separator = "\n\n", .shard_tokens = shard_tokens, .threads = 1};
        int st = run_opts(&o, out, inputs, 1);
        if (write(fds[1], &st, sizeof st) != sizeof st || write(fds[1], tkd_error_msg(), strlen(tkd_error_msg())) < 0)
            _exit(91);
        _exit(0);
    }
    close(fds[1]);
    int st = 0;
    assert_int_equal(read(fds[0], &st, sizeof st), sizeof st);
    ssize_t n = read(fds[0], msg, cap - 1);
    msg[n > 0 ? n : 0] = '\0';
    close(fds[0]);
    assert_int_equal(tkd_test_wait(pid), 0);
    return (tkd_status)st;
}

static void test_write_error_reason(void **state)
{
    (void)state;
    char *dir = fresh_dir("efbig");
    char *in = join(dir, "many.txt"), *out = join(dir, "out.bin");
    write_many(in); /* about 240 KB of ids: over the limit */
    char msg[1024];
    /* one file, and shards (the failure then comes at a shard's flush or its header) */
    int64_t shards[] = {0, 20000, 16200}; /* 16200: a shard of 65,824 bytes, over the limit only at its last flush */
    for (int i = 0; i < 3; i++) {
        tkd_status st = run_with_fsize_limit(out, in, shards[i], msg, sizeof msg);
        if (st != TKD_ERR_IO)
            fail_msg("shard_tokens %lld: status %d, '%s'", (long long)shards[i], st, msg);
        if (!strstr(msg, "failed: File too large") || !strstr(msg, "out"))
            fail_msg("shard_tokens %lld: '%s' does not say why", (long long)shards[i], msg);
        assert_int_equal(count_named(dir, "out"), 0); /* nothing half-written left */
    }
    free(in), free(out);
    tkd_test_rmdtemp(dir);
}

/* ---- batches around long documents ---------------------------------------------------------- */

/* Documents of 10, 10 and 17 MB among short ones: the second 10 MB one waits for the next batch,
 * the 17 MB one is read in place as a batch of its own; the ids are those of each document on its
 * own, in order, each followed by the EOS. */
static void test_long_documents_in_order(void **state)
{
    (void)state;
    size_t sizes[] = {5, 10u << 20, 10u << 20, 17u << 20, 7, 3u << 20};
    enum { N = sizeof sizes / sizeof *sizes };
    char *docs[N];
    char *dir = fresh_dir("order"), *in = join(dir, "docs.txt"), *out = join(dir, "out.bin");
    FILE *f = fopen(in, "w");
    assert_non_null(f);
    for (int i = 0; i < N; i++) {
        docs[i] = malloc(sizes[i] + 1);
        for (size_t j = 0; j < sizes[i]; j++) /* words of varying length, no separator inside */
            docs[i][j] = j % (5 + (size_t)i) == 4 ? ' ' : (char)('a' + (j * 7 + (size_t)i) % 26);
        docs[i][sizes[i]] = '\0';
        fprintf(f, "%s%s", i ? "<DOC>" : "", docs[i]);
    }
    fclose(f);
    const char *inputs[] = {in};
    tkd_tokenize_opts o = {.separator = "<DOC>", .threads = 2};
    assert_int_equal(run_opts(&o, out, inputs, 1), TKD_OK);
    tkd_tokenizer *tok = NULL;
    tkd_tokenizer_ctx *ctx = NULL;
    assert_int_equal(tkd_tokenizer_load(QWEN3, &tok), TKD_OK);
    assert_int_equal(tkd_tokenizer_ctx_create(tok, &ctx), TKD_OK);
    tkd_token_ids want = {0};
    uint32_t eos = (uint32_t)tkd_tokenizer_eos_id(tok);
    for (int i = 0; i < N; i++) {
        assert_int_equal(tkd_tokenizer_encode(ctx, docs[i], sizes[i], &want), TKD_OK);
        assert_int_equal(tkd_token_ids_push(&want, &eos, 1), TKD_OK);
        free(docs[i]);
    }
    size_t len;
    char *got = tkd_test_slurp(out, &len);
    assert_int_equal(len, 1024 + 4 * want.n);
    assert_memory_equal(got + 1024, want.ids, 4 * want.n);
    free(got);
    tkd_token_ids_free(&want);
    tkd_tokenizer_ctx_free(ctx);
    tkd_tokenizer_free(tok);
    free(in), free(out);
    tkd_test_rmdtemp(dir);
}

/* ---- item 12: a document longer than a batch ------------------------------------------------- */

#if !defined(__SANITIZE_ADDRESS__) /* ASan's shadow and quarantine make resident memory say nothing about ours */
/* The binary's peak resident memory (KiB) tokenizing path as one document. */
static long peak_kib(const char *path, const char *out, const char *log)
{
    const char *args[] = {"tokenize", "--tokenizer", QWEN3, "--output", out, "--overwrite", "--threads", "1", path,
                          NULL};
    pid_t pid = tkd_test_spawn(BIN, args, NULL, log);
    int status = 0;
    struct rusage ru;
    assert_int_equal(wait4(pid, &status, 0, &ru), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    return ru.ru_maxrss;
}

/* One line of about mb MB: "international organization " repeated (about one token per 13 bytes,
 * so its ids are small beside its text and a copy of the text shows). */
static void write_long_line(const char *path, size_t mb)
{
    const char *unit = "international organization ";
    size_t ulen = strlen(unit);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (size_t at = 0; at + ulen <= (mb << 20); at += ulen)
        fputs(unit, f);
    fclose(f);
}

static void test_long_document_memory(void **state)
{
    (void)state;
    char *dir = fresh_dir("longdoc");
    char *doc = join(dir, "doc.txt"), *out = join(dir, "out.bin"), *log = join(dir, "log");
    /* two sizes, both well over a 16 MB batch and the tokenizer's load: the difference of the peaks
     * is what the extra 80 MB of one document costs */
    write_long_line(doc, 40);
    long p40 = peak_kib(doc, out, log);
    write_long_line(doc, 120);
    long p120 = peak_kib(doc, out, log);
    double growth = (double)(p120 - p40) / (80.0 * 1024.0);
    print_message("peak %ld KiB (40 MB document), %ld KiB (120 MB): %.2f bytes per byte of document\n", p40, p120,
                  growth);
    /* the text in the reader's buffer (1x) + its ids (4 bytes per 13: 0.3x); a copy into the batch
     * (as before) made it 2.3x */
    assert_true(growth < 1.8);
    free(doc), free(out), free(log);
    tkd_test_rmdtemp(dir);
}
#else
static void test_long_document_memory(void **state)
{
    (void)state;
    skip();
}
#endif

TKD_TEST_MAIN_WITH(tkd_test_group_dir_setup, tkd_test_group_dir_teardown, TKD_TEST_EACH_NONE, test_output_is_input,
    test_second_writer_refused, test_numeric_flags, test_cli_parse_int, test_interrupted_shards,
    test_write_error_reason, test_long_documents_in_order, test_long_document_memory)
