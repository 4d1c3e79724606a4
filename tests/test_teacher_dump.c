/* test_teacher_dump.c — teacher-dump in-process: the cache written for the transformers fixtures
 * equals their reference top-k / LSE, an interrupted run resumes to the same cache, a damaged one is
 * repaired, workers merge, worker ranges tile. Bad inputs, conflicting caches and values the cache
 * cannot hold are in test_teacher_dump_errors.c; the child-process cases (SIGKILL, SIGINT, two
 * workers + merge) in test_teacher_dump_cli.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/half.h"
#include "common/fileio.h"
#include "common/signals.h"
#include "kernels/cpu/tail_sample.h"
#include "kernels/backend.h"
#include "kernels/loss/kl_loss.h"
#include "model/model.h"
#include "teacher_cache/dump_merge.h"
#include "tests/gpt_oss_testutil.h"
#include "teacher_cache/dump_dir.h"
#include "student_train/loader.h"
#include "tests/dump_testutil.h"
#include "tests/model_testutil.h"
#include "formats/tokens.h"

/* ---- parity with transformers -------------------------------------------------------------------- */

#define FIX_B 2
#define FIX_T 11

static float *read_f32(const char *path, size_t n)
{
    float *x = malloc(n * sizeof *x);
    FILE *f = fopen(path, "rb");
    assert_non_null(x);
    assert_non_null(f);
    assert_int_equal(fread(x, sizeof *x, n, f), n);
    fclose(f);
    return x;
}

/* The fixture's (B, T+1) tokens as a 2-D .npy: with seq_len T and stride T+1 the windows are
 * exactly its rows. */
static void write_fixture_tokens(const char *path)
{
    int32_t tok[FIX_B * (FIX_T + 1)];
    FILE *f = fopen(tkd_test_src("fixtures/hf/tokens.i32"), "rb");
    assert_non_null(f);
    assert_int_equal(fread(tok, 4, FIX_B * (FIX_T + 1), f), FIX_B * (FIX_T + 1));
    fclose(f);
    tkd_dt_write_npy(path, tok, FIX_B, FIX_T + 1);
}

/* Compares one cached row with the reference logits row (V). */
static void check_row(const float *ref, int V, int k, const uint32_t *idx, const float *val, float lse,
                      double val_tol, int row)
{
    /* Reference LSE in double. The C forward matches transformers to ~1e-6 relative (model tests),
     * so 1e-4 on an LSE of a few units is loose enough for summation order and tight enough to
     * catch a missing or doubled term (each term moves it by > 1e-3 here). */
    double mx = ref[0], s = 0;
    for (int v = 1; v < V; v++)
        mx = ref[v] > mx ? ref[v] : mx;
    for (int v = 0; v < V; v++)
        s += exp(ref[v] - mx);
    assert_true(tkd_test_close(lse, mx + log(s), 1e-4, 0));
    /* The reference top-k: selection by the same total order (larger logit, then smaller id). */
    int ref_idx[128];
    char used[512] = {0};
    for (int c = 0; c < k; c++) {
        int best = -1;
        for (int v = 0; v < V; v++)
            if (!used[v] && (best < 0 || ref[v] > ref[best]))
                best = v;
        used[best] = 1;
        ref_idx[c] = best;
    }
    for (int c = 0; c < k; c++) {
        /* A different id is allowed only where the two logits tie within the forward's error. */
        if ((int)idx[c] != ref_idx[c] && fabsf(ref[idx[c]] - ref[ref_idx[c]]) > 1e-5f)
            fail_msg("row %d col %d: id %u (logit %g), reference id %d (logit %g)", row, c, idx[c], ref[idx[c]],
                     ref_idx[c], ref[ref_idx[c]]);
        if (!tkd_test_close(val[c], ref[idx[c]], val_tol, val_tol == 0 ? 1e-5 : 0x1p-11))
            fail_msg("row %d col %d: logit %.6f, reference %.6f", row, c, val[c], ref[idx[c]]);
        if (c > 0)
            assert_true(val[c] <= val[c - 1]);
    }
}

/* The stored tail draws are those of tkd_tail_sample_cpu on the C teacher's own logits keyed by the
 * GLOBAL sequence index (a per-batch index would repeat draws across batches), and none is in its
 * row's top-k. */
static void check_tail(const char *model_dir, const char *npy, const tkd_cache_batch *b)
{
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_load_hf(model_dir, &m), TKD_OK);
    const int N = FIX_B * FIX_T, V = m->cfg.vocab_size, k = b->k, S = b->tail_samples;
    int32_t in[FIX_B * FIX_T];
    for (int s = 0; s < FIX_B; s++)
        memcpy(in + s * FIX_T, b->tokens + s * (FIX_T + 1), FIX_T * sizeof *in);
    float *logits = malloc((size_t)N * V * sizeof *logits);
    for (int s = 0; s < FIX_B; s++) { /* one sequence per forward, as the dump ran it */
        const void *hidden;
        assert_int_equal(tkd_model_forward(m, in + s * FIX_T, 1, FIX_T, 0, &hidden), TKD_OK);
        tkd_model_logits(m, hidden, FIX_T, logits + (size_t)s * FIX_T * V);
    }
    uint32_t *draws = malloc((size_t)N * S * sizeof *draws);
    int64_t seq[FIX_B * FIX_T];
    int32_t pos[FIX_B * FIX_T];
    for (int r = 0; r < N; r++) {
        seq[r] = r / FIX_T;
        pos[r] = r % FIX_T;
    }
    assert_int_equal(tkd_tail_sample_cpu(logits, N, V, b->topk_indices, k, 1.0f, S, 99, seq, pos, draws), TKD_OK);
    assert_memory_equal(draws, b->tail_indices, (size_t)N * S * sizeof *draws);
    for (int r = 0; r < N; r++)
        for (int j = 0; j < S; j++)
            for (int c = 0; c < k; c++)
                assert_int_not_equal(b->tail_indices[r * S + j], b->topk_indices[r * k + c]);
    (void)npy;
    free(logits);
    free(draws);
    tkd_model_free(m);
}

/* Dumps the fixture's tokens through the teacher at mpath into dir/cache and checks every row
 * against the reference logits at lpath ((B·T, V) f32) and the tail draws against the C teacher. */
static void parity_at(const char *dir, const char *mpath, const char *lpath, int V, const char *dtype)
{
    char npy[4200], out[4200], yaml[16384];
    snprintf(npy, sizeof npy, "%s/tok.npy", dir);
    snprintf(out, sizeof out, "%s/cache", dir);
    write_fixture_tokens(npy);
    snprintf(yaml, sizeof yaml,
             "teacher: {path: '%s'}\n"
             "data: {paths: ['%s'], seq_len: %d, stride: %d}\n"
             "cache: {k: 16, logits_dtype: %s, shard_sequences: 1, tail_samples: 5, seed: 99}\n"
             "run: {batch_size: 1}\n"    /* sequence 1 is the first of its batch */
             "lm_head: {chunk_rows: 5}\n" /* awkward: chunks straddle sequences */
             "output: {dir: '%s'}\n",
             mpath, npy, FIX_T, FIX_T + 1, dtype, out);
    tkd_dump_config cfg;
    tkd_dt_config(&cfg, yaml);
    tkd_status st = tkd_dump_run(&cfg, NULL, NULL);
    if (st != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    tkd_config_free(&tkd_dump_schema, &cfg);

    float *ref = read_f32(lpath, (size_t)FIX_B * FIX_T * (size_t)V);
    tkd_cache_batch b;
    assert_int_equal(tkd_dt_read_all(out, &b, NULL), FIX_B);
    /* half: 1e-3 (the bound) + half's own rounding of the value (2^-11 relative);
     * float32: the forward's own error only. */
    double tol = strcmp(dtype, "half") == 0 ? 1e-3 : 0;
    for (int r = 0; r < FIX_B * FIX_T; r++)
        check_row(ref + (size_t)r * V, V, 16, b.topk_indices + r * 16, b.topk_logits + r * 16, b.lse[r],
                  tol, r);
    assert_int_equal(b.seq_index[1], 1);
    check_tail(mpath, npy, &b);
    tkd_cache_batch_free(&b);
    free(ref);
}

static void parity_case(const char *model, int V, const char *dtype)
{
    char *dir = tkd_test_mkdtemp("dump-parity");
    char mpath[4200], lpath[4200];
    snprintf(mpath, sizeof mpath, "%s/tests/fixtures/hf/%s", TKD_SOURCE_DIR, model);
    snprintf(lpath, sizeof lpath, "%s/tests/fixtures/hf/%s.logits.f32", TKD_SOURCE_DIR, model);
    parity_at(dir, mpath, lpath, V, dtype);
    tkd_test_rmtree(dir);
    free(dir);
}

static void test_parity_llama_half(void **state) { (void)state; parity_case("llama_gqa_f32", 131, "half"); }
static void test_parity_llama_bf16_weights(void **state) { (void)state; parity_case("llama_gqa_bf16", 131, "half"); }
static void test_parity_qwen_float32(void **state) { (void)state; parity_case("qwen2_tied_f32", 173, "float32"); }
static void test_parity_qwen_bf16_weights(void **state) { (void)state; parity_case("qwen2_tied_bf16", 173, "half"); }

/* The dump of the checkpoint at mpath (the model m, saved there) against m's own logits over the
 * fixture tokens, one sequence per forward as the dump runs it: the cache holds their top-k and LSE.
 * Frees m. */
static void dump_matches_model(const char *dir, tkd_model *m, const char *mpath, int V)
{
    char lpath[4200];
    snprintf(lpath, sizeof lpath, "%s/teacher.logits.f32", dir);
    int32_t tok[FIX_B * (FIX_T + 1)];
    FILE *f = fopen(tkd_test_src("fixtures/hf/tokens.i32"), "rb");
    assert_non_null(f);
    assert_int_equal(fread(tok, 4, FIX_B * (FIX_T + 1), f), FIX_B * (FIX_T + 1));
    fclose(f);
    float *logits = malloc(sizeof(float) * FIX_B * FIX_T * (size_t)V);
    assert_non_null(logits);
    for (int s = 0; s < FIX_B; s++) {
        const void *hidden;
        assert_int_equal(tkd_model_forward(m, tok + s * (FIX_T + 1), 1, FIX_T, 0, &hidden), TKD_OK);
        assert_int_equal(tkd_model_logits(m, hidden, FIX_T, logits + (size_t)s * FIX_T * V), TKD_OK);
    }
    f = fopen(lpath, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(logits, sizeof(float) * FIX_B * FIX_T * (size_t)V, 1, f), 1);
    assert_int_equal(fclose(f), 0);
    free(logits);
    tkd_model_free(m);
    parity_at(dir, mpath, lpath, V, "float32");
}

/* A Qwen3-MoE teacher (a dense first layer, then two MoE layers: E 8, top-2) dumps on the CPU: its
 * checkpoint as student-train's writer saves it (per-expert tensors), and the cache holds the top-k
 * and LSE of the C model's own logits (the forward itself is held to transformers by test_hf_parity
 * and to a hand-composed reference by test_model). */
static void test_dump_qwen3_moe_teacher(void **state)
{
    const char *dir = *state;
    enum { V = 149, D = 32, E = 8 };
    tkd_model_config c;
    tkd_model_config_defaults(&c);
    c.arch = TKD_ARCH_QWEN3_MOE, c.vocab_size = V, c.hidden_size = D, c.intermediate_size = 64;
    c.num_hidden_layers = 3, c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 16;
    c.max_position_embeddings = 64, c.tie_word_embeddings = 0, c.initializer_range = 0.1f;
    c.num_experts = E, c.num_experts_per_tok = 2, c.moe_intermediate_size = 24, c.norm_topk_prob = 1;
    c.layer_moe[1] = c.layer_moe[2] = 1;
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&c, 11, &m), TKD_OK);
    for (int l = 1; l <= 2; l++) /* routers wider than the init, so tokens pick different experts */
        tkd_test_randn(m->w.layers[l].router, (size_t)E * D, 30 + l, 1.0f);
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/teacher", dir);
    assert_int_equal(tkd_model_save_hf(m, mpath, TKD_DTYPE_F32), TKD_OK);
    dump_matches_model(dir, m, mpath, V);
}

/* A gpt-oss teacher (sinks, biases, layer 0 sliding with window 4 < T 11, layer 1 full, YaRN, E 4
 * top-2 MoE in both layers) dumps on the CPU from a checkpoint in transformers' layout
 * (tests/gpt_oss_testutil.h); its forward is held to a hand-composed reference by test_model. */
static void test_dump_gpt_oss_teacher(void **state)
{
    const char *dir = *state;
    enum { V = 149, D = 32, E = 4 };
    tkd_model_config c;
    tkd_model_config_defaults(&c);
    c.arch = TKD_ARCH_GPT_OSS, c.vocab_size = V, c.hidden_size = D, c.intermediate_size = 24;
    c.num_hidden_layers = 2, c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 16;
    c.max_position_embeddings = 64, c.tie_word_embeddings = 0, c.initializer_range = 0.1f, c.attention_bias = 1;
    c.num_experts = E, c.num_experts_per_tok = 2, c.moe_intermediate_size = 24, c.swiglu_limit = 7.0f;
    c.layer_moe[0] = c.layer_moe[1] = 1, c.sliding_window = 4, c.layer_sliding[0] = 1;
    c.rope_scaling = TKD_ROPE_SCALING_YARN, c.rope_factor = 4, c.rope_beta_fast = 32, c.rope_beta_slow = 1;
    c.rope_original_max_pos = 8, c.rope_truncate = 0, c.rope_theta = 1e4;
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&c, 13, &m), TKD_OK);
    for (int l = 0; l < 2; l++) { /* routers wide, sinks and router biases away from zero */
        tkd_test_randn(m->w.layers[l].router, (size_t)E * D, 40 + l, 1.0f);
        tkd_test_randn(m->w.layers[l].router_b, E, 50 + l, 0.5f);
        tkd_test_randn(m->w.layers[l].sinks, 4, 60 + l, 1.0f);
    }
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/teacher", dir);
    gpt_oss_save(m, mpath, TKD_DTYPE_F32);
    dump_matches_model(dir, m, mpath, V);
}

/* ---- resume -------------------------------------------------------------------------------------- */

#define run_ok tkd_dt_run_ok

static tkd_status run_status(const char *yaml, const tkd_dump_opts *opts) { return tkd_dt_run(yaml, opts, NULL); }

/* Two caches of the Llama fixture over the same 300 random tokens (seed) in dir: the paths a, b
 * (<dir>/a, <dir>/b; 4200 bytes each) and their configs ya, yb (8192 bytes each) with the extra
 * YAML extra_a, extra_b. Returns the tokens' path (tkd_dt_random_tokens' static buffer). */
static const char *two_caches(const char *dir, uint64_t seed, const char *extra_a, const char *extra_b,
                              char *a, char *b, char *ya, char *yb)
{
    const char *tok = tkd_dt_random_tokens(dir, "tok.npy", 300, 131, seed);
    snprintf(a, 4200, "%s/a", dir);
    snprintf(b, 4200, "%s/b", dir);
    tkd_dt_small_yaml(ya, 8192, TKD_DT_LLAMA, tok, a, extra_a);
    tkd_dt_small_yaml(yb, 8192, TKD_DT_LLAMA, tok, b, extra_b);
    return tok;
}

static void test_resume_after_stop(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char a[4200], b[4200], ya[8192], yb[8192];
    const char *extra = "cache: {k: 8, shard_sequences: 5, tail_samples: 3}\nrun: {batch_size: 2}\n";
    const char *tok = two_caches(dir, 1, extra, extra, a, b, ya, yb); /* 18 windows of 16 + 1 */
    tkd_dump_summary sum;
    run_ok(ya, NULL, &sum);
    assert_int_equal(sum.seqs_run, 18);
    assert_int_equal(sum.shards_run, 4);

    /* Shards of 5 in batches of 2, 2, 1: batch 5 is the middle of shard 1. */
    tkd_dump_opts stop = {.stop_after_batches = 5};
    assert_int_equal(run_status(yb, &stop), TKD_ERR_INTERRUPTED);
    assert_non_null(strstr(tkd_error_msg(), "re-run the same command to resume"));
    assert_int_equal(tkd_dt_count_suffix(b, ".tmp"), 0);
    assert_int_equal(tkd_dt_count_suffix(b, ".h5"), 1);
    run_ok(yb, NULL, &sum);
    assert_int_equal(sum.resumed_at, 5);
    assert_int_equal(sum.seqs_run, 13);
    tkd_dt_assert_same_cache(a, b);

    /* A cache cut short by data.max_sequences (last shard 1 of 5) grows to the same cache. */
    char c[4200], yc[8192], ycs[8300];
    snprintf(c, sizeof c, "%s/c", dir);
    tkd_dt_small_yaml(yc, sizeof yc, TKD_DT_LLAMA, tok, c, extra);
    snprintf(ycs, sizeof ycs, "%s\n---\ndata: {max_sequences: 6}\n", yc);
    run_ok(ycs, NULL, &sum);
    assert_int_equal(sum.seqs_run, 6);
    run_ok(yc, NULL, &sum);
    assert_int_equal(sum.resumed_at, 5);
    tkd_dt_assert_same_cache(a, c);

    /* A finished cache re-run does nothing. */
    run_ok(yb, NULL, &sum);
    assert_int_equal(sum.seqs_run, 0);
    assert_int_equal(sum.resumed_at, 18);

    /* A damaged last shard is caught before resuming, and re-made. */
    char shard[4300];
    snprintf(shard, sizeof shard, "%s/shard-00003.h5", b);
    FILE *f = fopen(shard, "r+b");
    assert_non_null(f);
    fseek(f, -100, SEEK_END);
    fputc(0x5a ^ fgetc(f), f);
    fclose(f);
    run_ok(yb, NULL, &sum);
    assert_int_equal(sum.shards_damaged, 1);
    assert_non_null(strstr(sum.damaged_note, "shard-00003.h5"));
    assert_int_equal(sum.seqs_run, 3);
    tkd_dt_assert_same_cache(a, b);
}

/* ---- repair ------------------------------------------------------------------------------------- */

/* What says a file was not rewritten: the same inode and modification time. */
typedef struct file_id {
    ino_t ino;
    struct timespec mtime;
} file_id;

static file_id file_id_of(const char *dir, const char *name)
{
    struct stat st;
    assert_int_equal(stat(tkd_test_path(dir, name), &st), 0);
    return (file_id){st.st_ino, st.st_mtim};
}

static void assert_same_file(file_id a, file_id b)
{
    assert_int_equal(a.ino, b.ino);
    assert_int_equal(a.mtime.tv_sec, b.mtime.tv_sec);
    assert_int_equal(a.mtime.tv_nsec, b.mtime.tv_nsec);
}

/* What student-train's reader says about the cache in dir: the status of opening it and reading
 * sequence seq (message in tkd_error_msg). */
static tkd_status reader_status(const char *dir, int64_t seq)
{
    tkd_cache_reader *r = NULL;
    tkd_status st = tkd_cache_reader_open(&r, dir, NULL);
    if (st != TKD_OK)
        return st;
    tkd_cache_batch b;
    const tkd_cache_manifest *m = tkd_cache_reader_manifest(r);
    assert_int_equal(tkd_cache_batch_alloc(&b, 1, m->id.seq_len, m->id.k, 0), TKD_OK);
    st = tkd_cache_reader_read(r, seq, 1, &b, 0);
    tkd_cache_batch_free(&b);
    tkd_cache_reader_close(r);
    return st;
}

/* A finished cache (18 sequences in shards 0..4 of 4) with shard 1 damaged (a byte of its compressed
 * logits flipped, same size) and shard 3 deleted. The reader's messages name the repair command;
 * running it (the same teacher-dump, no --overwrite) re-makes exactly those two shards, leaves the
 * others untouched (inode and mtime) and gives the cache of one uninterrupted run. A repair stopped
 * half way leaves a manifest with a gap, which the reader reports with the same command, and the
 * command completes it. */
static void test_repair_missing_and_damaged(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char a[4200], b[4200], ya[8192], yb[8192];
    const char *extra = "cache: {tail_samples: 2}\n";
    two_caches(dir, 12, extra, extra, a, b, ya, yb);
    run_ok(ya, NULL, NULL);
    run_ok(yb, NULL, NULL);

    tkd_test_flip_chunk_byte(tkd_test_path(b, "shard-00001.h5"), "/topk/logits", 0);
    assert_int_equal(reader_status(b, 5), TKD_ERR_CHECKSUM);
    tkd_test_assert_msg_has("shard-00001.h5: reading /topk/logits");
    tkd_test_assert_msg_has(TKD_CACHE_REPAIR_HINT);
    assert_int_equal(unlink(tkd_test_path(b, "shard-00003.h5")), 0);
    assert_int_equal(reader_status(b, 5), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("shard-00003.h5: listed in the manifest but missing — " TKD_CACHE_REPAIR_HINT);

    file_id keep[3] = {file_id_of(b, "shard-00000.h5"), file_id_of(b, "shard-00002.h5"),
                       file_id_of(b, "shard-00004.h5")};
    tkd_dump_summary sum;
    run_ok(yb, NULL, &sum); /* the action the messages name */
    assert_int_equal(sum.shards_damaged, 2);
    assert_non_null(strstr(sum.damaged_note, "shard-00001.h5"));
    assert_int_equal(sum.shards_run, 2);
    assert_int_equal(sum.seqs_run, 8);
    assert_same_file(keep[0], file_id_of(b, "shard-00000.h5"));
    assert_same_file(keep[1], file_id_of(b, "shard-00002.h5"));
    assert_same_file(keep[2], file_id_of(b, "shard-00004.h5"));
    tkd_dt_assert_same_cache(a, b);
    tkd_cache_reader *r = NULL; /* the manifest lists the new files' digests */
    tkd_cache_reader_opts verify = {.verify_sha256 = 1};
    assert_int_equal(tkd_cache_reader_open(&r, b, &verify), TKD_OK);
    tkd_cache_reader_close(r);
    run_ok(yb, NULL, &sum);
    assert_int_equal(sum.seqs_run, 0);
    assert_int_equal(sum.shards_damaged, 0);

    /* Stopped after one batch of the repair: shard 0 is unlisted (being re-made), shard 4 too. */
    tkd_test_flip_chunk_byte(tkd_test_path(b, "shard-00004.h5"), "/lse", 0);
    assert_int_equal(unlink(tkd_test_path(b, "shard-00000.h5")), 0);
    tkd_dump_opts stop = {.stop_after_batches = 1};
    assert_int_equal(run_status(yb, &stop), TKD_ERR_INTERRUPTED);
    tkd_test_assert_msg_has("with 12 of 18 sequences in whole shards");
    tkd_test_assert_msg_has("re-run the same command");
    assert_int_equal(reader_status(b, 5), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("shard-00001.h5 starts at sequence 4, expected 0 — sequences are missing");
    tkd_test_assert_msg_has("re-run the teacher-dump command that made this cache (without --overwrite)");
    run_ok(yb, NULL, &sum);
    assert_int_equal(sum.seqs_run, 6);
    assert_int_equal(sum.shards_run, 2); /* 0 and 4; 1..3 were kept */
    tkd_dt_assert_same_cache(a, b);
}

/* cache.writer_threads changes how many threads compress, never what the cache holds (not a byte); it is
 * 0 (automatic) .. TKD_SHARD_WRITER_MAX_THREADS. */
static void test_writer_threads_same_cache(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char a[4200], b[4200], ya[8192], yb[8192];
    const char *one = "cache: {k: 8, shard_sequences: 7, tail_samples: 2, writer_threads: 1}\nrun: {batch_size: 3}\n";
    const char *three = "cache: {k: 8, shard_sequences: 7, tail_samples: 2, writer_threads: 3}\nrun: {batch_size: 3}\n";
    two_caches(dir, 5, one, three, a, b, ya, yb);
    tkd_dump_summary sum;
    run_ok(ya, NULL, &sum);
    run_ok(yb, NULL, &sum);
    assert_int_equal(sum.shards_run, 3);
    tkd_dt_assert_same_cache(a, b);
    tkd_dt_assert_same_bytes(a, b);
    tkd_dump_config cfg;
    memset(&cfg, 0, sizeof cfg);
    assert_int_equal(tkd_config_defaults(&tkd_dump_schema, &cfg), TKD_OK);
    assert_int_equal(cfg.writer_threads, 0);
    const char *bad = "cache: {writer_threads: 257}\n";
    assert_int_equal(tkd_config_apply_string(&tkd_dump_schema, &cfg, "t", bad, strlen(bad)), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("cache.writer_threads");
    tkd_config_free(&tkd_dump_schema, &cfg);
}

/* Two dumps of the same data with the same settings, a second apart, write the same shard files
 * byte for byte (no HDF5 modification times), so their manifests' sha256 are equal (issue 26). */
static void test_two_dumps_same_bytes(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("dump-bytes");
    char a[4200], b[4200], ya[8192], yb[8192];
    const char *extra = "cache: {k: 8, shard_sequences: 7, tail_samples: 2}\n";
    two_caches(dir, 9, extra, extra, a, b, ya, yb);
    tkd_dump_summary sum;
    run_ok(ya, NULL, &sum);
    tkd_dt_next_second();
    run_ok(yb, NULL, &sum);
    assert_int_equal(sum.shards_run, 3);
    tkd_dt_assert_same_bytes(a, b);
    tkd_test_rmtree(dir);
    free(dir);
}

/* The padded last window keeps its real tokens; its padding labels are -100 in /tokens. */
static void test_last_window_pad(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    int32_t t[40];
    for (int i = 0; i < 40; i++)
        t[i] = (i * 7) % 131;
    char npy[4200], out[4200], y[8192];
    snprintf(npy, sizeof npy, "%s/t.npy", dir);
    snprintf(out, sizeof out, "%s/cache", dir);
    tkd_dt_write_npy(npy, t, 0, 40);
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, npy, out, "data: {last_window: pad}\n");
    tkd_dump_config cfg;
    tkd_dt_config(&cfg, y);
    assert_int_equal(tkd_dump_run(&cfg, NULL, NULL), TKD_OK);
    tkd_config_free(&tkd_dump_schema, &cfg);
    tkd_cache_batch b;
    /* 40 tokens, windows of 17 every 16: starts 0, 16, 32; the last has 8 real tokens (7 labels) */
    assert_int_equal(tkd_dt_read_all(out, &b, NULL), 3);
    const int32_t *last = b.tokens + 2 * 17;
    for (int j = 0; j < 17; j++)
        assert_int_equal(last[j], j < 8 ? t[32 + j] : -100);
    tkd_cache_batch_free(&b);
}

/* ---- merge ---------------------------------------------------------------------------------------- */

/* The yaml of worker i of 3 over out (18 sequences, shards of 4: shards {0}, {1, 2}, {3, 4}). */
static const char *worker_yaml(const char *tok, const char *out, int i)
{
    static char y[8192];
    char extra[64];
    snprintf(extra, sizeof extra, "workers: {index: %d, count: 3}\n", i);
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tok, out, extra);
    return y;
}

/* merge names the worker that is missing or incomplete and the command that completes it; each
 * command, taken, lets merge succeed, and the merged cache equals one worker's. */
static void test_merge_names_the_missing_worker(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    const char *tok = tkd_dt_random_tokens(dir, "tok.npy", 300, 131, 13);
    char ref[4200], out[4200], y[8192];
    snprintf(ref, sizeof ref, "%s/ref", dir);
    snprintf(out, sizeof out, "%s/out", dir);
    tkd_dt_small_yaml(y, sizeof y, TKD_DT_LLAMA, tok, ref, "");
    run_ok(y, NULL, NULL);

    assert_int_equal(tkd_dump_merge(out, NULL, NULL), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("nothing to merge — run teacher-dump with workers.count > 1");
    run_ok(worker_yaml(tok, out, 1), NULL, NULL);
    run_ok(worker_yaml(tok, out, 2), NULL, NULL);
    /* worker 0 never ran */
    assert_int_equal(tkd_dump_merge(out, NULL, NULL), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("manifest.worker-0.yaml: missing: worker 0 of 3 has not started — run it with workers.index=0");
    /* worker 0 stopped in its first shard */
    tkd_dump_opts stop = {.stop_after_batches = 1};
    assert_int_equal(run_status(worker_yaml(tok, out, 0), &stop), TKD_ERR_INTERRUPTED);
    assert_int_equal(tkd_dump_merge(out, NULL, NULL), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("worker-0.done: missing: worker 0 of 3 has not finished its range — run (or resume) it with workers.index=0");
    run_ok(worker_yaml(tok, out, 0), NULL, NULL);
    int64_t nseq = 0, nshards = 0;
    assert_int_equal(tkd_dump_merge(out, &nseq, &nshards), TKD_OK);
    assert_int_equal(nseq, 18);
    assert_int_equal(nshards, 5);

    /* a shard of worker 1 deleted after it finished */
    assert_int_equal(unlink(tkd_test_path(out, "shard-00002.h5")), 0);
    assert_int_equal(tkd_dump_merge(out, NULL, NULL), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("shard-00002.h5: listed by worker 1 of 3");
    tkd_test_assert_msg_has("re-run that worker with workers.index=1, without --overwrite");
    /* ... and its repair stopped half way: the worker's list no longer covers its marked range */
    assert_int_equal(run_status(worker_yaml(tok, out, 1), &stop), TKD_ERR_INTERRUPTED);
    assert_int_equal(tkd_dump_merge(out, NULL, NULL), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("manifest.worker-1.yaml: lists 4 of the 8 sequences [4, 12) of worker 1 of 3 — run (or resume) it with workers.index=1");
    run_ok(worker_yaml(tok, out, 1), NULL, NULL);
    assert_int_equal(tkd_dump_merge(out, NULL, NULL), TKD_OK);
    tkd_dt_assert_same_cache(ref, out);
}

/* ---- config and worker split ----------------------------------------------------------------------- */

static tkd_status finalize_with(const char *const *env, const char *extra, tkd_dump_config *cfg)
{
    const char *y = "teacher: {path: t}\ndata: {paths: [d]}\noutput: {dir: o}\n";
    memset(cfg, 0, sizeof *cfg);
    assert_int_equal(tkd_config_defaults(&tkd_dump_schema, cfg), TKD_OK);
    assert_int_equal(tkd_config_apply_string(&tkd_dump_schema, cfg, "t", y, strlen(y)), TKD_OK);
    assert_int_equal(tkd_config_apply_string(&tkd_dump_schema, cfg, "t", extra, strlen(extra)), TKD_OK);
    tkd_test_env = env;
    return tkd_dump_config_finalize(cfg, tkd_test_getenv);
}

static void test_config_workers_from_env(void **state)
{
    (void)state;
    tkd_dump_config cfg;
    static const char *const torch[] = {"RANK", "2", "WORLD_SIZE", "4", "SLURM_PROCID", "0", "SLURM_NTASKS", "9", NULL};
    assert_int_equal(finalize_with(torch, "", &cfg), TKD_OK);
    assert_int_equal(cfg.worker_index, 2);
    assert_int_equal(cfg.worker_count, 4);
    assert_int_equal(cfg.stride, cfg.seq_len); /* stride 0 means seq_len */
    tkd_config_free(&tkd_dump_schema, &cfg);
    static const char *const slurm[] = {"SLURM_PROCID", "1", "SLURM_NTASKS", "3", NULL};
    assert_int_equal(finalize_with(slurm, "", &cfg), TKD_OK);
    assert_int_equal(cfg.worker_index, 1);
    assert_int_equal(cfg.worker_count, 3);
    tkd_config_free(&tkd_dump_schema, &cfg);
    /* the config wins over the environment */
    assert_int_equal(finalize_with(slurm, "workers: {index: 1, count: 2}\n", &cfg), TKD_OK);
    assert_int_equal(cfg.worker_count, 2);
    tkd_config_free(&tkd_dump_schema, &cfg);
    static const char *const bad[] = {"RANK", "x1", "WORLD_SIZE", "4", NULL};
    assert_int_equal(finalize_with(bad, "", &cfg), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "RANK=x1"));
    tkd_config_free(&tkd_dump_schema, &cfg);
    /* read by common/dist.h as student-train reads it: half a pair is an error, not one worker,
     * and srun's per-node task list is understood */
    static const char *const half[] = {"SLURM_PROCID", "1", "SLURM_NTASKS", "3", "RANK", "1", NULL};
    assert_int_equal(finalize_with(half, "", &cfg), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "RANK is set without WORLD_SIZE"));
    assert_non_null(strstr(tkd_error_msg(), "unset it or set workers.* in the config"));
    tkd_config_free(&tkd_dump_schema, &cfg);
    static const char *const srun[] = {"SLURM_PROCID", "5", "SLURM_NTASKS", "6", "SLURM_LOCALID", "1",
                                       "SLURM_NODEID", "2", "SLURM_STEP_TASKS_PER_NODE", "2(x3)", NULL};
    assert_int_equal(finalize_with(srun, "", &cfg), TKD_OK);
    assert_int_equal(cfg.worker_index, 5);
    assert_int_equal(cfg.worker_count, 6);
    assert_int_equal(cfg.dist.local_rank, 1); /* its GPU on its node (tkd_backend_open_local) */
    tkd_config_free(&tkd_dump_schema, &cfg);
    /* workers set in the config replace the environment: one process of its own, on GPU 0 */
    assert_int_equal(finalize_with(srun, "workers: {index: 0, count: 2}\n", &cfg), TKD_OK);
    assert_int_equal(cfg.worker_count, 2);
    assert_int_equal(cfg.dist.local_rank, 0);
    assert_int_equal(cfg.dist.world, 1);
    tkd_config_free(&tkd_dump_schema, &cfg);
    /* junk in the local rank is refused by the one parse, not read as GPU 0 */
    static const char *const junk[] = {"RANK", "1", "WORLD_SIZE", "2", "LOCAL_RANK", "1x", NULL};
    assert_int_equal(finalize_with(junk, "", &cfg), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("environment LOCAL_RANK=1x: not a number");
    tkd_config_free(&tkd_dump_schema, &cfg);
    static const char *const none[] = {NULL};
    assert_int_equal(finalize_with(none, "workers: {index: 3, count: 3}\n", &cfg), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "workers.index"));
    tkd_config_free(&tkd_dump_schema, &cfg);
    assert_int_equal(finalize_with(none, "teacher: {path: ''}\n", &cfg), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "teacher.path"));
    tkd_config_free(&tkd_dump_schema, &cfg);
}

/* cache.shard_tokens sizes shards in positions; with shard_sequences too it is an error naming
 * both; neither gives 1024 sequences; the resolved config prints and loads back the same. */
static void test_config_shard_tokens(void **state)
{
    (void)state;
    static const char *const none[] = {NULL};
    tkd_dump_config cfg;
    assert_int_equal(finalize_with(none, "data: {seq_len: 1024}\ncache: {shard_tokens: 65536}\n", &cfg), TKD_OK);
    assert_int_equal(cfg.shard_sequences, 64);
    assert_int_equal(cfg.shard_tokens, 0);
    char *text = NULL;
    assert_int_equal(tkd_config_to_text(&tkd_dump_schema, &cfg, &text), TKD_OK);
    tkd_dump_config again;
    assert_int_equal(finalize_with(none, text, &again), TKD_OK);
    assert_true(tkd_config_equal(&tkd_dump_schema, &cfg, &again));
    free(text);
    tkd_config_free(&tkd_dump_schema, &again);
    tkd_config_free(&tkd_dump_schema, &cfg);
    /* fewer positions than one sequence: still one sequence per shard */
    assert_int_equal(finalize_with(none, "data: {seq_len: 1024}\ncache: {shard_tokens: 1000}\n", &cfg), TKD_OK);
    assert_int_equal(cfg.shard_sequences, 1);
    tkd_config_free(&tkd_dump_schema, &cfg);
    /* 700 / 256 (the default seq_len) rounds down */
    assert_int_equal(finalize_with(none, "cache: {shard_tokens: 700}\n", &cfg), TKD_OK);
    assert_int_equal(cfg.shard_sequences, 2);
    tkd_config_free(&tkd_dump_schema, &cfg);
    assert_int_equal(finalize_with(none, "", &cfg), TKD_OK);
    assert_int_equal(cfg.shard_sequences, 1024);
    tkd_config_free(&tkd_dump_schema, &cfg);
    /* an explicit shard_sequences, even the default's value, is not silently overridden */
    assert_int_equal(finalize_with(none, "cache: {shard_tokens: 65536, shard_sequences: 1024}\n", &cfg),
                     TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "cache.shard_tokens (65536) and cache.shard_sequences (1024)"));
    assert_non_null(strstr(tkd_error_msg(), " — keep one"));
    tkd_config_free(&tkd_dump_schema, &cfg);
}

static void test_worker_ranges_tile(void **state)
{
    (void)state;
    for (int64_t total = 0; total < 40; total++)
        for (int64_t ss = 1; ss < 7; ss++)
            for (int n = 1; n < 6; n++) {
                int64_t expect = 0;
                for (int i = 0; i < n; i++) {
                    int64_t a, b;
                    tkd_dump_worker_range(total, ss, i, n, &a, &b);
                    assert_int_equal(a, expect);   /* contiguous, in order */
                    assert_true(b >= a);
                    assert_true(a % ss == 0 || a == total); /* whole shards */
                    expect = b;
                }
                assert_int_equal(expect, total);
            }
    /* 18 windows in shards of 5 over 2 workers: shards {0, 1} and {2, 3} */
    int64_t a, b;
    tkd_dump_worker_range(18, 5, 1, 2, &a, &b);
    assert_int_equal(a, 10);
    assert_int_equal(b, 18);
}

/* data.packing: documents (issue 23): a dataset whose flags sidecar records documents of 7, 1, 12
 * and 20 tokens, at seq_len 16, packs into 4 sequences (7+1 | 12 | 16 | 4), and every cached row
 * holds the top-k and LSE of its document run alone through the teacher (float32 cache: the
 * forward's own rounding only); /doc_start and the manifest say how they were packed, and a file
 * without documents is refused naming data.packing. */
static void test_packed_documents(void **state)
{
    const char *dir = *state;
    enum { N = 40, T = 16, K = 8 };
    static const int starts[] = {0, 7, 8, 20, N};
    tkd_model_config c = small_cfg(0, 1);
    c.vocab_size = 53, c.max_position_embeddings = 32;
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&c, 3, &m), TKD_OK);
    int32_t tok[N];
    uint8_t fl[N];
    for (int i = 0; i < N; i++)
        tok[i] = (i * 17 + 5) % c.vocab_size, fl[i] = TKD_TOKENS_FLAG_TRAINED;
    for (int d = 0; d < 4; d++)
        fl[starts[d]] |= TKD_TOKENS_FLAG_DOC_START;
    char npy[4200], flags[4200], out[4200], yaml[16384];
    snprintf(npy, sizeof npy, "%s/docs.npy", dir);
    snprintf(flags, sizeof flags, "%s/docs.npy.flags.npy", dir);
    snprintf(out, sizeof out, "%s/cache", dir);
    tkd_dt_write_npy(npy, tok, 0, N);
    tkd_dt_write_npy_as(flags, "|u1", fl, 1, 0, N);
    snprintf(yaml, sizeof yaml,
             "teacher: {path: 'random:small'}\ndata: {paths: ['%s'], seq_len: %d, packing: documents}\n"
             "cache: {k: %d, logits_dtype: float32, shard_sequences: 2}\nrun: {batch_size: 3}\n"
             "lm_head: {chunk_rows: 7}\noutput: {dir: '%s'}\n", npy, T, K, out);
    tkd_dump_opts o = {.teacher = m, .teacher_seed = 3};
    tkd_dt_run_ok(yaml, &o, NULL);
    tkd_cache_batch b;
    tkd_cache_manifest man;
    assert_int_equal(tkd_dt_read_all(out, &b, &man), 4);
    assert_int_equal(man.id.packed, 1);
    assert_int_equal(man.id.trained_only, 1);
    assert_int_equal(man.version, 2); /* a version-1 reader would misread it: it must refuse it */
    assert_non_null(b.doc_start);
    assert_non_null(b.labels);
    /* the pieces: (sequence, position, dataset start, length) */
    static const int pieces[5][4] = {{0, 0, 0, 7}, {0, 7, 7, 1}, {1, 0, 8, 12}, {2, 0, 20, 16}, {3, 0, 36, 4}};
    float *lg = malloc(sizeof(float) * T * (size_t)c.vocab_size);
    assert_non_null(lg);
    for (int p = 0; p < 5; p++) {
        const int sq = pieces[p][0], at = pieces[p][1], n = pieces[p][3];
        const void *h = NULL;
        assert_int_equal(tkd_model_forward(m, tok + pieces[p][2], 1, n, 0, &h), TKD_OK);
        assert_int_equal(tkd_model_logits(m, h, n, lg), TKD_OK);
        for (int j = 0; j < n; j++) {
            size_t r = (size_t)sq * T + at + j;
            /* the flags make the cache trained_only: a document's last position has no target and keeps
             * no teacher data; the others hold their document's own */
            int last = j + 1 == n && !(p == 3);
            assert_int_equal(b.labels[r], last ? TKD_TOKENS_IGNORE_LABEL : tok[pieces[p][2] + j + 1]);
            if (last)
                assert_true(b.lse[r] == 0.0f && b.topk_logits[r * K] == 0.0f && b.topk_indices[r * K] == 0);
            else
                check_row(lg + (size_t)j * c.vocab_size, c.vocab_size, K, b.topk_indices + r * K,
                          b.topk_logits + r * K, b.lse[r], 0, (int)r);
            assert_int_equal(b.doc_start[r], at);
            assert_int_equal(b.tokens[(size_t)sq * (T + 1) + at + j], tok[pieces[p][2] + j]);
        }
    }
    /* padding after the last piece: −100 in /tokens, one more document */
    for (int t = 4; t < T; t++) {
        assert_int_equal(b.tokens[3 * (T + 1) + t], TKD_TOKENS_IGNORE_LABEL);
        assert_int_equal(b.doc_start[3 * T + t], 4);
    }
    assert_int_equal(b.tokens[2 * (T + 1) + T], tok[36]); /* the cut document's next token */
    /* student-train's loader over this cache: no label across a document start, the starts kept */
    tkd_cache_reader *r = NULL;
    assert_int_equal(tkd_cache_reader_open(&r, out, NULL), TKD_OK);
    int64_t split[4] = {0, 1, 2, 3};
    tkd_loader_opts lo = {.batch_size = 4, .seq_len = T, .k = K, .prefetch = 2};
    tkd_loader *l = NULL;
    assert_int_equal(tkd_loader_open(&l, r, NULL, split, 4, &lo), TKD_OK);
    assert_int_equal(tkd_loader_seek(l, 0, 0), TKD_OK);
    const tkd_train_batch *tb = NULL;
    assert_int_equal(tkd_loader_next(l, &tb), TKD_OK);
    assert_int_equal(tb->b, 4);
    assert_non_null(tb->doc);
    assert_memory_equal(tb->doc, b.doc_start, sizeof(int32_t) * 4 * T);
    assert_int_equal(tb->labels[6], TKD_TOKENS_IGNORE_LABEL);    /* the 7-token document's last */
    assert_int_equal(tb->labels[7], TKD_TOKENS_IGNORE_LABEL);    /* the 1-token document's */
    assert_int_equal(tb->labels[5], tok[6]);
    assert_int_equal(tb->labels[2 * T + T - 1], tok[36]);        /* the cut document goes on */
    assert_int_equal(tb->labels[3 * T + 3], TKD_TOKENS_IGNORE_LABEL);
    assert_int_equal(tb->inputs[3 * T + 5], 0);                  /* padding reads as token 0 */
    tkd_loader_close(l);
    tkd_cache_reader_close(r);
    free(lg);
    tkd_cache_batch_free(&b);
    tkd_cache_manifest_free(&man);
    /* a token file that records no documents */
    char bare[4200];
    snprintf(bare, sizeof bare, "%s/bare.npy", dir);
    tkd_dt_write_npy(bare, tok, 0, N);
    snprintf(yaml, sizeof yaml,
             "teacher: {path: 'random:small'}\ndata: {paths: ['%s'], seq_len: %d, packing: documents}\n"
             "cache: {k: %d}\noutput: {dir: '%s/c2'}\n", bare, T, K, dir);
    assert_int_equal(tkd_dt_run(yaml, &o, NULL), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("data.packing: documents: ");
    tkd_test_assert_msg_has("bare.npy records no document boundaries");
    tkd_model_free(m);
}

/* Bytes of the shards shard-00000.h5 .. of a cache directory. */
static long long shard_bytes(const char *dir, int n)
{
    long long total = 0;
    for (int i = 0; i < n; i++) {
        char path[4300];
        struct stat sb;
        snprintf(path, sizeof path, "%s/shard-%05d.h5", dir, i);
        assert_int_equal(stat(path, &sb), 0);
        total += (long long)sb.st_size;
    }
    return total;
}

/* A dataset whose flags sidecar trains 40 % of the targets (runs of 10: a prompt of 15 tokens, an
 * answer of 10) makes a trained_only cache: /labels −100 on the other positions, which keep no
 * teacher data, and the trained positions' data equal to the cache without flags; its shards take
 * well under half the bytes (issue 23: ~40 % of today's). */
static void test_trained_only_cache(void **state)
{
    const char *dir = *state;
    enum { N = 8193, T = 64, K = 32 };
    tkd_model_config c = small_cfg(0, 0);
    c.vocab_size = 97, c.max_position_embeddings = 64;
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&c, 5, &m), TKD_OK);
    int32_t tok[N];
    uint8_t fl[N];
    for (int i = 0; i < N; i++)
        tok[i] = (i * 31 + 7) % c.vocab_size, fl[i] = i % 25 >= 15 ? TKD_TOKENS_FLAG_TRAINED : 0;
    char all[4200], part[4200], flags[4300], out_a[4200], out_b[4200], yaml[16384];
    snprintf(all, sizeof all, "%s/all.npy", dir);
    snprintf(part, sizeof part, "%s/part.npy", dir);
    snprintf(flags, sizeof flags, "%s.flags.npy", part);
    snprintf(out_a, sizeof out_a, "%s/cache-all", dir);
    snprintf(out_b, sizeof out_b, "%s/cache-part", dir);
    tkd_dt_write_npy(all, tok, 0, N);
    tkd_dt_write_npy(part, tok, 0, N);
    tkd_dt_write_npy_as(flags, "|u1", fl, 1, 0, N);
    tkd_dump_opts o = {.teacher = m, .teacher_seed = 5};
    const char *fmt = "teacher: {path: 'random:small'}\ndata: {paths: ['%s'], seq_len: %d}\n"
                      "cache: {k: %d, shard_sequences: 64}\nrun: {batch_size: 16}\noutput: {dir: '%s'}\n";
    snprintf(yaml, sizeof yaml, fmt, all, T, K, out_a);
    tkd_dt_run_ok(yaml, &o, NULL);
    snprintf(yaml, sizeof yaml, fmt, part, T, K, out_b);
    tkd_dt_run_ok(yaml, &o, NULL);
    tkd_cache_batch a, b;
    tkd_cache_manifest ma, mb;
    const int64_t n = tkd_dt_read_all(out_a, &a, &ma);
    assert_int_equal(tkd_dt_read_all(out_b, &b, &mb), n);
    assert_int_equal(ma.id.trained_only, 0);
    assert_int_equal(mb.id.trained_only, 1);
    assert_int_equal(ma.version, 1);
    assert_int_equal(mb.version, 2);
    assert_null(a.labels);
    assert_non_null(b.labels);
    assert_string_not_equal(ma.id.dataset_sha256, mb.id.dataset_sha256); /* the flags are data */
    int64_t trained = 0;
    for (int64_t r = 0; r < n * T; r++) {
        const int64_t g = r / T * T + r % T + 1; /* the label's token in the stream (stride = T) */
        if (fl[g] & TKD_TOKENS_FLAG_TRAINED) {
            trained++;
            assert_int_equal(b.labels[r], tok[g]);
            assert_memory_equal(b.topk_indices + r * K, a.topk_indices + r * K, K * sizeof *a.topk_indices);
            assert_memory_equal(b.topk_logits + r * K, a.topk_logits + r * K, K * sizeof *a.topk_logits);
            assert_true(b.lse[r] == a.lse[r]);
        } else {
            assert_int_equal(b.labels[r], TKD_TOKENS_IGNORE_LABEL);
            assert_true(b.lse[r] == 0.0f && b.topk_indices[r * K] == 0 && b.topk_logits[r * K] == 0.0f);
        }
    }
    const long long ba = shard_bytes(out_a, (int)ma.num_shards), bb = shard_bytes(out_b, (int)mb.num_shards);
    print_message("trained_only: %lld of %lld positions trained; shards %lld bytes vs %lld without flags (%.2f)\n",
                  (long long)trained, (long long)(n * T), bb, ba, (double)bb / (double)ba);
    assert_true((double)bb < 0.5 * (double)ba);
    tkd_cache_batch_free(&a), tkd_cache_batch_free(&b);
    tkd_cache_manifest_free(&ma), tkd_cache_manifest_free(&mb);
    tkd_model_free(m);
}

static void test_raw_bytes_per_token(void **state)
{
    (void)state;
    tkd_dump_config cfg;
    static const char *const none[] = {NULL};
    assert_int_equal(finalize_with(none, "cache: {k: 100}\n", &cfg), TKD_OK);
    assert_true(tkd_dump_raw_bytes_per_token(&cfg) == 604.0); /* (4 + 2)·100 + 4 */
    cfg.logits_dtype = 2;                                      /* float32 */
    cfg.tail_samples = 10;
    assert_true(tkd_dump_raw_bytes_per_token(&cfg) == 844.0); /* (4 + 4)·100 + 4 + 4·10 */
    tkd_config_free(&tkd_dump_schema, &cfg);
}

TKD_TEST_MAIN_EACH_DIR(test_packed_documents, test_trained_only_cache, test_parity_llama_half, test_parity_llama_bf16_weights, test_parity_qwen_float32,
    test_parity_qwen_bf16_weights, test_dump_qwen3_moe_teacher, test_dump_gpt_oss_teacher, test_resume_after_stop, test_repair_missing_and_damaged,
    test_writer_threads_same_cache, test_two_dumps_same_bytes, test_last_window_pad,
    test_merge_names_the_missing_worker, test_config_workers_from_env, test_config_shard_tokens,
    test_worker_ranges_tile, test_raw_bytes_per_token)
