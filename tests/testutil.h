/* testutil.h — small helpers shared by the cmocka tests. */
#ifndef TKD_TESTUTIL_H
#define TKD_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/status.h"
#include "kernels/loss/kl_loss.h"

/* Makes a fresh empty directory under $TMPDIR (or /tmp) named topkd-<tag>-XXXXXX; returns a
 * malloc'd path the caller frees (after tkd_test_rmtree). Aborts the test on failure. */
char *tkd_test_mkdtemp(const char *tag);

/* Removes a directory tree (rm -rf). Returns 0 on success. */
int tkd_test_rmtree(const char *path);

/* The end of a tkd_test_mkdtemp dir: removes the tree and frees the path. */
void tkd_test_rmdtemp(char *dir);

/* Path of a file under the source tree's tests/ folder (static buffer, overwritten per call). */
const char *tkd_test_src(const char *rel);

/* "<dir>/<name>" in one of 8 static buffers used in turn (so a call's result outlives the next 7
 * calls). Fails the test when the path does not fit. */
const char *tkd_test_path(const char *dir, const char *name);

/* A temp dir shared by a whole cmocka group: pass tkd_test_group_dir_setup / _teardown to
 * cmocka_run_group_tests. Setup makes tkd_test_group_dir (tkd_test_mkdtemp tagged with the test
 * program's name) and points *state at it; teardown removes and frees it. */
extern char *tkd_test_group_dir;
int tkd_test_group_dir_setup(void **state);
int tkd_test_group_dir_teardown(void **state);

/* The main of a test program: TKD_TEST_MAIN(test_a, test_b, ...) runs the named tests (each a
 * `static void test_x(void **state)`) as one cmocka group "tests". TKD_TEST_MAIN_WITH also takes the
 * group's setup and teardown (NULL for none) and `each`: TKD_TEST_EACH_DIR gives every test a fresh
 * temp dir of its own as *state (a char *, tagged with the test's name, removed after the test
 * whatever its outcome), TKD_TEST_EACH_NONE nothing; TKD_TEST_MAIN_EACH_DIR(...) is the first
 * with no group fixture. TKD_TEST_RUN_WITH is the run alone (an int expression: cmocka's count of
 * failed tests), for a main that does more. cmocka.h must be included before the use. */
typedef void (*tkd_test_fn)(void **state);
typedef int (*tkd_test_fixture_fn)(void **state);
enum { TKD_TEST_EACH_NONE = 0, TKD_TEST_EACH_DIR = 1 };
#define TKD_TEST_RUN_WITH(group_setup, group_teardown, each, ...)                                            \
    tkd_test_main(#__VA_ARGS__, (const tkd_test_fn[]){__VA_ARGS__},                                          \
                  sizeof((const tkd_test_fn[]){__VA_ARGS__}) / sizeof(tkd_test_fn), group_setup, group_teardown, \
                  each)
#define TKD_TEST_MAIN_WITH(group_setup, group_teardown, each, ...)                                           \
    int main(void) { return TKD_TEST_RUN_WITH(group_setup, group_teardown, each, __VA_ARGS__); }
#define TKD_TEST_MAIN(...) TKD_TEST_MAIN_WITH(NULL, NULL, TKD_TEST_EACH_NONE, __VA_ARGS__)
#define TKD_TEST_MAIN_EACH_DIR(...) TKD_TEST_MAIN_WITH(NULL, NULL, TKD_TEST_EACH_DIR, __VA_ARGS__)

/* Exits with 77 (ctest "skipped"), saying so, unless the programs bins (NULL-terminated) are all
 * built: a test of the tools runs only where the build made them. */
void tkd_test_require_built(const char *const *bins);

/* What TKD_TEST_RUN_WITH runs: names is the comma-separated list of the n functions' names (the
 * macro's arguments as written), for cmocka's report. Returns cmocka's count of failed tests. */
int tkd_test_main(const char *names, const tkd_test_fn *fns, size_t n, tkd_test_fixture_fn group_setup,
                  tkd_test_fixture_fn group_teardown, int each);

/* The per-test fixture of TKD_TEST_EACH_DIR, for a hand-written cmocka test list: setup turns
 * *state (a tag, or NULL) into a fresh tkd_test_mkdtemp dir; teardown removes and frees it. */
int tkd_test_dir_setup(void **state);
int tkd_test_dir_teardown(void **state);

/* A fake environment for code that takes a getenv-like lookup: tkd_test_getenv(name) is the value
 * after name in tkd_test_env ({"NAME", "value", ..., NULL}), or NULL. */
extern const char *const *tkd_test_env;
const char *tkd_test_getenv(const char *name);

/* Fails the test unless the calling thread's error message contains needle. */
void tkd_test_assert_msg_has(const char *needle);

/* Fails the test unless got is want and the calling thread's error message holds every fragment of
 * frags (NULL-terminated: TKD_TEST_FRAGS("a", "b")); prints the message ("expected error: ...") so
 * that the log shows what a user would read. */
void tkd_test_expect_error(tkd_status got, tkd_status want, const char *const *frags);
#define TKD_TEST_FRAGS(...) ((const char *const[]){__VA_ARGS__, NULL})

/* Opens one broken file: returns its status and asserts nothing was handed out on failure. */
typedef tkd_status (*tkd_test_open_fn)(const char *path);

/* Defines such an opener, `static tkd_status name(const char *path)`, for a module whose open is
 * open_fn(path, type **out): the status, after asserting that nothing was handed out. */
#define TKD_TEST_OPENER(name, type, open_fn)                                                                     \
    static tkd_status name(const char *path)                                                                   \
    {                                                                                                          \
        type *handle = NULL;                                                                                   \
        tkd_status st = open_fn(path, &handle);                                                                \
        assert_null(handle);                                                                                   \
        return st;                                                                                             \
    }

/* For every row of tests/data/broken/EXPECTED.tsv ("file<TAB>status<TAB>message substring") whose
 * file name starts with prefix: open_file() must give that status, with a message containing the
 * substring and naming the file. Returns the number of rows checked. */
int tkd_test_broken_files(const char *prefix, tkd_test_open_fn open_file);

/* Flips one byte in the middle of the stored (compressed) chunk of HDF5 dataset `dataset` in file
 * path that holds element (row, 0, ...), found with H5Dget_chunk_info_by_coord; the file size does
 * not change. The chunk must be larger than 16 bytes. */
void tkd_test_flip_chunk_byte(const char *path, const char *dataset, int64_t row);

/* Exits the process with 77 (ctest "skipped") when no CUDA device answers; GPU tests call it first. */
void tkd_test_require_gpu(void);

/* Relative-or-absolute closeness: |a - b| <= atol + rtol·|b|. */
int tkd_test_close(double a, double b, double atol, double rtol);

/* Fills x[0..n) with a deterministic pseudo-random normal(0, std) sequence from seed. */
void tkd_test_randn(float *x, size_t n, uint64_t seed, float std);

/* Packed documents' starts (tkd_model_forward_docs' doc, tkd_attn_mask.doc) of B sequences of T
 * positions from each sequence's list of document starts (starts[b*stride ..], 0 first, ended by
 * -1 or T): doc[b·T + i] = the last start ≤ i. */
void tkd_test_doc_starts(const int *starts, int stride, int B, int T, int32_t *doc);

/* One teacher row's cache columns cut from its full logits t (v): the k largest, largest first
 * (ties to the lower id) into idx and tl (k), *lse = log Σ exp(t / tau_cache), and s draws outside
 * the top-k from rand_below(ctx, v) into draws (s), draw `repeat` (≥ 1; beyond s: none) a copy of
 * draw 0 (a repeated draw). The loss tests' batches are made of such rows. */
void tkd_test_cut_row(const float *t, int v, int k, double tau_cache, int s, int repeat,
                      int (*rand_below)(void *ctx, int n), void *ctx, int32_t *idx, float *tl, float *lse,
                      int32_t *draws);

/* Logit contents that stress a top-k's order, for the CPU and CUDA top-k tests. */
typedef enum tkd_test_fill {
    TKD_TEST_FILL_RANDN,        /* normal(0, 3) */
    TKD_TEST_FILL_TIES,         /* the same, floored: about 20 distinct values, heavy ties */
    TKD_TEST_FILL_EXTREME,      /* +-1e4 next to small values */
    TKD_TEST_FILL_CONST,        /* all 0.25 */
    TKD_TEST_FILL_ZEROS_SIGNED, /* -0, +0 and -1 in turn */
} tkd_test_fill;

/* Fills x[0..n) with the contents f from seed. */
void tkd_test_fill_logits(float *x, size_t n, tkd_test_fill f, uint64_t seed);

/* KL loss parameters: the defaults for k stored columns, then the variant, τ, α, k_use and s. */
tkd_kl_params tkd_test_kl_params(tkd_kl_variant var, double tau, double alpha, int k, int k_use, int s);

/* ---- child processes ------------------------------------------------------------------------- */

/* fork() for a test: stdio flushed first (else the child would write our buffered output again)
 * and, when fds is not NULL, a pipe made into fds[2] before; fails the test when either fails.
 * Returns fork's pid (0 in the child). */
pid_t tkd_test_fork(int *fds);

/* Starts the program bin with arguments args (NULL-terminated, argv[0] excluded: bin is used) and,
 * when env is not NULL, one extra environment assignment "NAME=value"; its stdout and stderr go to
 * the file out_path. Returns the child's pid; fails the test when fork fails. */
pid_t tkd_test_spawn(const char *bin, const char *const *args, const char *env, const char *out_path);

/* Waits for a child of tkd_test_spawn; returns its exit code, or 1000 + the signal that killed it. */
int tkd_test_wait(pid_t pid);

/* tkd_test_spawn then tkd_test_wait. */
int tkd_test_run(const char *bin, const char *const *args, const char *env, const char *out_path);

/* Waits until path exists (a file the child makes once its signal handlers are in place), sends
 * the child sig, then waits for it as tkd_test_wait does. A child that exits first gives its own
 * status (so the test fails on it); path still missing after two minutes: the signal goes anyway. */
int tkd_test_signal_when(pid_t pid, const char *path, int sig);

/* A child process (fork) that takes the lock <dir>/<name> (common/dir_lock.h: exclusive, or shared
 * plus <name>.<part> when part is not NULL) and holds it until killed. Returns its pid once it holds
 * the lock; fails the test when it could not take it. */
pid_t tkd_test_lock_holder(const char *dir, const char *name, const char *part);

/* SIGKILLs a child of tkd_test_lock_holder and reaps it. */
void tkd_test_kill_holder(pid_t pid);

/* tkd_test_wait for at most timeout_s seconds: a child still running then is killed (SIGKILL),
 * reaped, and -1 returned, so a test of "does not hang" fails instead of hanging. */
int tkd_test_wait_timeout(pid_t pid, double timeout_s);

/* A one-layer Llama of 2 attention heads for the model tests: the defaults of
 * tkd_model_config_defaults (tied embeddings included), then vocab, hidden (even) and an MLP of
 * 2 x hidden, head_dim hidden / 2, kv_heads (1 or 2) and max_pos positions. */
struct tkd_model_config;
void tkd_test_tiny_llama(struct tkd_model_config *mc, int vocab, int hidden, int kv_heads, int max_pos);

/* ---- a tiny teacher cache for student-train tests ------------------------------------------- */

struct tkd_cache_batch;

/* What tkd_test_teacher_cache writes. The teacher is a fixed random Llama (tkd_model_init_random
 * with init_std large enough that its next-token distributions are peaked, and its block outputs
 * scaled by 0.1 so that it is mostly a bigram model a tiny student learns quickly); the sequences are
 * seeded random tokens; top-k, LSE and tail draws are computed from the teacher's full logits by
 * kernels/cpu/topk.h and kernels/cpu/tail_sample.h exactly as teacher-dump does. */
typedef struct tkd_test_teacher_opts {
    int vocab;          /* V (> k) */
    int hidden;         /* the teacher's D; one layer, 2 heads */
    int seq_len;        /* T */
    int k;              /* stored top-k columns */
    int tail_samples;   /* S; 0 = no /tail/indices */
    float temperature;  /* the cache's temperature */
    float init_std;     /* the teacher's init std (0 = 0.5) */
    int num_seq;        /* sequences in the cache */
    int shard_seqs;     /* sequences per shard (the last shard may be shorter) */
    int chunk_seqs;     /* HDF5 chunk in sequences (0 = automatic) */
    uint64_t seed;      /* teacher weights, tokens and tail draws */
    const char *teacher_sha256; /* 64 hex digits; NULL = "ab" x 32 */
    /* optional: called on every batch (sequences g0 .. g0 + b->num_seq - 1) before it is written,
     * to plant bad values (an inf logit, a bogus LSE) in chosen sequences */
    void (*edit)(struct tkd_cache_batch *b, int64_t g0, void *ctx);
    void *edit_ctx;
} tkd_test_teacher_opts;

/* Writes the cache (shard-NNNNN.h5 + manifest.yaml) into the directory dir, made when missing.
 * Returns the first failing status (message set). */
tkd_status tkd_test_teacher_cache(const char *dir, const tkd_test_teacher_opts *o);

/* The fixture of the student-train tests: a temp dir holding a teacher cache and a folder for runs. */
typedef struct tkd_test_student_dir {
    char *dir;        /* tkd_test_mkdtemp(tag) */
    char cache[4200]; /* <dir>/cache: the tkd_test_teacher_cache of the options given */
    char runs[4200];  /* <dir>/runs: run.dir for tkd_test_student_train */
} tkd_test_student_dir;

/* Makes s (the cache written with o). On failure prints the message to stderr and returns the
 * status with nothing left to free (a group setup then returns -1). */
tkd_status tkd_test_student_dir_make(tkd_test_student_dir *s, const char *tag, const tkd_test_teacher_opts *o);

/* Removes the temp dir and frees s->dir. */
void tkd_test_student_dir_free(tkd_test_student_dir *s);

/* For a cmocka group setup / teardown: *state gets a malloc'd tkd_test_student_dir made with
 * tkd_test_student_dir_make (setup returns -1 when that fails); teardown removes and frees it. */
int tkd_test_student_setup(void **state, const char *tag, const tkd_test_teacher_opts *o);
int tkd_test_student_teardown(void **state);

/* The tiny fixture of the run-directory tests: tkd_test_student_setup with a cache of V 64, D 16,
 * T 8, k 4, 32 sequences in 2 shards (seed 5). */
int tkd_test_tiny_student_setup(void **state);

/* A tiny student on that cache (D 16, one layer, 4 steps of batch 4 on the CPU, logged every step,
 * evaluated at the end), run `name` under run_dir (NULL: s->runs) in mode resume as in
 * tkd_test_student_train, then one more "key=value" setting extra (NULL: none). */
struct tkd_train_result;
tkd_status tkd_test_tiny_student(const tkd_test_student_dir *s, const char *run_dir, const char *name, int resume,
                                 const char *extra, struct tkd_train_result *res);

/* "<s->runs>/<name>/<file>" in one of 4 static buffers used in turn (a result outlives the next 3). */
const char *tkd_test_in_run(const tkd_test_student_dir *s, const char *name, const char *file);

/* Reads a whole file into a malloc'd buffer (*len bytes, NUL-terminated); NULL when it cannot. */
char *tkd_test_read_file(const char *path, size_t *len);

/* A whole file that must exist (the test fails otherwise), malloc'd and NUL-terminated; *len its
 * size in bytes when len is not NULL. */
char *tkd_test_slurp(const char *path, size_t *len);

/* Writes text to path (replacing it); fails the test when it cannot. */
void tkd_test_write_text(const char *path, const char *text);

/* Writes a byte-level BPE tokenizer into the directory dir (made when missing): tokenizer.json with
 * printable ASCII at ids 0-93 (but 'Z' at z_id when z_id >= 0), space 94, newline 95, then the vocab
 * entries extra_vocab ("\"he\": 96" or ""), the merges (JSON strings, or ""), and <|eos|> 99 as an
 * added special token; tokenizer_config.json names it the eos_token. Fails the test when it cannot. */
void tkd_test_ascii_tokenizer(const char *dir, int z_id, const char *extra_vocab, const char *merges);

/* Calls each(path, name, ctx) for every entry of dir but "." and ".." (path "<dir>/<name>") and
 * returns the sum of what the calls returned; fails the test when dir cannot be listed. */
typedef long long (*tkd_test_entry_fn)(const char *path, const char *name, void *ctx);
long long tkd_test_dir_sum(const char *dir, tkd_test_entry_fn each, void *ctx);

/* One tensor of a safetensors file written byte for byte (tkd_st_writer writes floats only; tests
 * need U8 MXFP4 pairs, wrong dtypes, mixed files). */
typedef struct tkd_test_st_entry {
    const char *name, *dtype; /* dtype as safetensors spells it: "U8", "F32", ... */
    int ndim;
    int64_t shape[4];
    const void *data;
    size_t nbytes;
} tkd_test_st_entry;

/* Writes the n entries to path as one safetensors file (metadata format "pt"); fails the test when
 * it cannot. */
void tkd_test_write_st(const char *path, const tkd_test_st_entry *e, int n);

/* The entries of dir whose name does not begin with '.'. */
int tkd_test_count_visible(const char *dir);

/* 1 when the two files exist and have the same bytes. */
int tkd_test_files_equal(const char *a, const char *b);

/* Runs student-train in-process (tkd_train_run) on a config made of the schema's defaults and then
 * sets[0..n) ("key=value", as --set), as run `name` under run_dir (run.dir and run.name are set
 * here). resume = 1 continues that run from its checkpoint (--resume), 2 starts it over
 * (--overwrite). res may be NULL. Info logs are off. */
struct tkd_train_result;
tkd_status tkd_test_student_train(const char *run_dir, const char *name, const char *const *sets, size_t n,
                                  int resume, struct tkd_train_result *res);

/* The values of `key` in the metrics.jsonl records of type `type` ("train" / "eval"), in file
 * order, into out (up to cap); returns how many records had the key (null values count as NaN). */
int tkd_test_metrics(const char *metrics_path, const char *type, const char *key, double *out, int cap);

/* A metrics.jsonl file's text with every record's wall-clock field ("elapsed_s", the only thing two
 * identical runs write differently) cut out; the caller frees it. Fails the test if unreadable. */
char *tkd_test_metrics_without_time(const char *path);

/* The `key` values of exactly `want` training records of run `run` under s's runs directory (its
 * metrics.jsonl) into out; fails the test naming the file when there are not `want` of them. */
void tkd_test_train_metrics(const tkd_test_student_dir *s, const char *run, const char *key, double *out, int want);

#endif /* TKD_TESTUTIL_H */
