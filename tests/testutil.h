/* testutil.h — small helpers shared by the cmocka tests. */
#ifndef TKD_TESTUTIL_H
#define TKD_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* Makes a fresh empty directory under $TMPDIR (or /tmp) named topkd-<tag>-XXXXXX; returns a
 * malloc'd path the caller frees (after tkd_test_rmtree). Aborts the test on failure. */
char *tkd_test_mkdtemp(const char *tag);

/* Removes a directory tree (rm -rf). Returns 0 on success. */
int tkd_test_rmtree(const char *path);

/* Path of a file under the source tree's tests/ folder (static buffer, overwritten per call). */
const char *tkd_test_src(const char *rel);

/* Exits the process with 77 (ctest "skipped") when no CUDA device answers; GPU tests call it first. */
void tkd_test_require_gpu(void);

/* Relative-or-absolute closeness: |a - b| <= atol + rtol·|b|. */
int tkd_test_close(double a, double b, double atol, double rtol);

/* Fills x[0..n) with a deterministic pseudo-random normal(0, std) sequence from seed. */
void tkd_test_randn(float *x, size_t n, uint64_t seed, float std);

/* ---- a tiny teacher cache for student-train tests ------------------------------------------- */

struct tkd_cache_batch;

/* What tkd_test_teacher_cache writes. The teacher is a fixed random Llama (tkd_model_init_random
 * with init_std large enough that its next-token distributions are peaked, and its block outputs
 * scaled by 0.1 so that it is mostly a bigram model a tiny student learns quickly); the sequences are
 * seeded random tokens; top-k, LSE and tail draws are computed from the teacher's full logits by
 * kernels/topk.h and kernels/tail_sample.h exactly as teacher-dump does. */
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

/* Writes the cache (shard-NNNNN.h5 + manifest.yaml) into the existing directory dir. Returns the
 * first failing status (message set). */
tkd_status tkd_test_teacher_cache(const char *dir, const tkd_test_teacher_opts *o);

/* Reads a whole file into a malloc'd buffer (*len bytes, NUL-terminated); NULL when it cannot. */
char *tkd_test_read_file(const char *path, size_t *len);

/* 1 when the two files exist and have the same bytes. */
int tkd_test_files_equal(const char *a, const char *b);

/* Runs student-train in-process (tkd_train_run) on a config made of the schema's defaults and then
 * sets[0..n) ("key=value", as --set), as run `name` under run_dir (run.dir and run.name are set
 * here). resume = 1 continues that run from its checkpoint. res may be NULL. Info logs are off. */
struct tkd_train_result;
tkd_status tkd_test_student_train(const char *run_dir, const char *name, const char *const *sets, size_t n,
                                  int resume, struct tkd_train_result *res);

/* The values of `key` in the metrics.jsonl records of type `type` ("train" / "eval"), in file
 * order, into out (up to cap); returns how many records had the key (null values count as NaN). */
int tkd_test_metrics(const char *metrics_path, const char *type, const char *key, double *out, int cap);

#endif /* TKD_TESTUTIL_H */
