/* test_student_errors.c — student-train's bad inputs, each one clear one-line error with the right
 * status, and the last checkpoint left valid when training stops midway: a cache from another
 * teacher than data.expect_teacher_sha256, a vocabulary mismatch (random student and HF init),
 * kd.variant = sampled on a cache without tail draws, kd.topk > k, data.seq_len longer than the
 * cache's, a temperature the cache was not written at, a corrupt chunk in the 2nd shard met in the
 * middle of training, an infinite teacher logit (refused by validation) and a bogus LSE that makes
 * the loss infinite; an optim.state_dtype that is neither f32 nor bf16. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "formats/cache_reader.h"
#include "model/model.h"
#include "model/optim.h"
#include "student_train/checkpoint.h"
#include "student_train/loader.h"
#include "student_train/train.h"
#include "student_train/train_config.h"
#include "tests/testutil.h"

/* Caches: V = 80, T = 8, k = 6, 40 sequences in shards of 16 (chunks of 4); 5 held out (val 0.125),
 * 35 train, batches of 4. "good" has S = 2 tail draws, "notail" none. */
enum { V = 80, T = 8, K = 6, NSEQ = 40, NTRAIN = 35, BATCH = 4 };
#define SEED 1234 /* train.seed: the shuffle of the runs below */
#define TEACHER_SHA "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

/* s.cache is the "good" cache. */
typedef struct fixture {
    tkd_test_student_dir s;
    char notail[4200];
} fixture;

static tkd_test_teacher_opts cache_opts(int tail)
{
    tkd_test_teacher_opts o = {.vocab = V, .hidden = 16, .seq_len = T, .k = K, .tail_samples = tail,
                               .temperature = 1.0f, .num_seq = NSEQ, .shard_seqs = 16, .chunk_seqs = 4, .seed = 5,
                               .teacher_sha256 = TEACHER_SHA};
    return o;
}

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    tkd_test_teacher_opts a = cache_opts(2), b = cache_opts(0);
    if (!f || tkd_test_student_dir_make(&f->s, "st-errors", &a) != TKD_OK) {
        free(f);
        return -1;
    }
    snprintf(f->notail, sizeof f->notail, "%s/notail", f->s.dir);
    if (tkd_test_teacher_cache(f->notail, &b) != TKD_OK) {
        fprintf(stderr, "setup: %s\n", tkd_error_msg());
        tkd_test_student_dir_free(&f->s);
        free(f);
        return -1;
    }
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    if (f)
        tkd_test_student_dir_free(&f->s);
    free(f);
    return 0;
}

/* Runs `name` on cache with a tiny student, then extra settings. */
static tkd_status run(const fixture *f, const char *cache, const char *name, const char *const *extra, size_t n)
{
    const char *sets[32] = {"model.hidden_size=16", "model.intermediate_size=32", "model.num_layers=1",
                            "model.num_heads=2", "model.num_kv_heads=2", "model.max_position_embeddings=8",
                            "data.val_fraction=0.125", "train.batch_size=4", "train.log_interval=1",
                            "train.eval_interval=0", "device=cpu", "train.max_steps=8"};
    size_t nb = 12;
    char cache_set[4300];
    snprintf(cache_set, sizeof cache_set, "data.cache=%s", cache);
    sets[nb++] = cache_set;
    for (size_t i = 0; i < n; i++)
        sets[nb++] = extra[i];
    tkd_status st = tkd_test_student_train(f->s.runs, name, sets, nb, 0, NULL);
    if (getenv("TKD_SHOW_ERRORS"))
        printf("  %s -> %s\n", name, st == TKD_OK ? "ok" : tkd_error_msg());
    return st;
}

/* The status and the message: one line, containing every given fragment. */
static void expect_error(tkd_status got, tkd_status want, const char *const *fragments, int n)
{
    const char *msg = tkd_error_msg();
    if (got != want)
        fail_msg("got %s '%s', want %s", tkd_status_name(got), msg, tkd_status_name(want));
    assert_null(strchr(msg, '\n'));
    for (int i = 0; i < n; i++)
        if (!strstr(msg, fragments[i]))
            fail_msg("'%s' does not mention '%s'", msg, fragments[i]);
}

static void test_other_teacher(void **state)
{
    fixture *f = *state;
    const char *wrong[] = {"data.expect_teacher_sha256=fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"};
    const char *frag[] = {f->s.cache, "0123456789ab", "fedcba987654", "data.expect_teacher_sha256"};
    expect_error(run(f, f->s.cache, "other-teacher", wrong, 1), TKD_ERR_MISMATCH, frag, 4);
    const char *right[] = {"data.expect_teacher_sha256=" TEACHER_SHA, "train.max_steps=1"};
    assert_int_equal(run(f, f->s.cache, "right-teacher", right, 2), TKD_OK);
}

static int exists(const char *path) { return access(path, F_OK) == 0; }

/* A run refused before it writes anything (a cache that is not there, another teacher) leaves no
 * run directory behind, nor the runs folder it made; a run directory the user already had stays. */
static void test_refused_run_leaves_no_directory(void **state)
{
    fixture *f = *state;
    char missing[4300], runs[4300], made[4400], set_dir[4400];
    snprintf(missing, sizeof missing, "%s/no-such-cache", f->s.dir);
    const char *frag[] = {"no-such-cache"};
    expect_error(run(f, missing, "refused", NULL, 0), TKD_ERR_NOT_FOUND, frag, 1);
    assert_false(exists(tkd_test_path(f->s.runs, "refused")));
    /* under a runs folder the run itself made: both go */
    snprintf(runs, sizeof runs, "%s/new-runs/deeper", f->s.dir);
    snprintf(set_dir, sizeof set_dir, "run.dir=%s", runs);
    const char *wrong[] = {set_dir, "data.expect_teacher_sha256=fedcba9876543210fedcba9876543210fedcba9876543210"
                                    "fedcba9876543210"};
    assert_int_equal(run(f, f->s.cache, "refused2", wrong, 2), TKD_ERR_MISMATCH);
    snprintf(made, sizeof made, "%s/new-runs", f->s.dir);
    assert_false(exists(made));
    /* a run directory the user made stays (its own marker and lock aside, empty as it was) */
    snprintf(made, sizeof made, "%s/mine", f->s.runs);
    assert_int_equal(mkdir(made, 0755), 0);
    assert_int_equal(run(f, missing, "mine", NULL, 0), TKD_ERR_NOT_FOUND);
    assert_true(exists(made));
    assert_int_equal(tkd_test_count_visible(made), 0);
}

static void test_vocabulary_mismatch(void **state)
{
    fixture *f = *state;
    const char *random_student[] = {"model.vocab_size=100"};
    const char *frag[] = {"100", "80", f->s.cache};
    expect_error(run(f, f->s.cache, "vocab-random", random_student, 1), TKD_ERR_MISMATCH, frag, 3);

    /* a Hugging Face student of 72 tokens */
    char hf[4300];
    snprintf(hf, sizeof hf, "%s/hf72", f->s.dir);
    tkd_model_config mc;
    tkd_test_tiny_llama(&mc, 72, 16, 2, 8);
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&mc, 1, &m), TKD_OK);
    assert_int_equal(tkd_model_save_hf(m, hf, TKD_DTYPE_F32), TKD_OK);
    tkd_model_free(m);
    char path_set[4400];
    snprintf(path_set, sizeof path_set, "model.path=%s", hf);
    const char *hf_student[] = {"model.init=hf", path_set};
    /* a smaller student is taken (a teacher's padded vocabulary) only while the data stays below its
     * size: these random tokens do not */
    const char *frag_hf[] = {"token 7", "beyond the student's vocabulary of 72 (the cache's has 80)", "not unused"};
    expect_error(run(f, f->s.cache, "vocab-hf", hf_student, 2), TKD_ERR_MISMATCH, frag_hf, 3);
    /* --help says what these runs show (it used to say the sizes must be equal) */
    char *help = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&help, &len);
    tkd_config_print_help(&tkd_train_schema, mem);
    fclose(mem);
    const char *vocab = strstr(help, "model.vocab_size");
    assert_non_null(vocab);
    char *next = strstr(vocab, "\n  model."); /* the key's text ends where the next key starts */
    assert_non_null(next);
    *next = '\0';
    assert_non_null(strstr(vocab, "Smaller than the cache's only when the teacher's extra ids are padding"));
    assert_null(strstr(vocab, "must equal"));
    free(help);
}

static void test_sampled_needs_tail_draws(void **state)
{
    fixture *f = *state;
    const char *extra[] = {"kd.variant=sampled"};
    const char *frag[] = {"sampled", "tail draws", f->notail};
    expect_error(run(f, f->notail, "sampled-notail", extra, 1), TKD_ERR_CONFIG, frag, 3);
    const char *tail[] = {"kd.variant=tail", "train.max_steps=1"}; /* tail needs only the LSE */
    assert_int_equal(run(f, f->notail, "tail-notail", tail, 2), TKD_OK);
}

static void test_topk_beyond_the_cache(void **state)
{
    fixture *f = *state;
    const char *extra[] = {"kd.topk=7"};
    const char *frag[] = {"kd.topk = 7", "k = 6", f->s.cache};
    expect_error(run(f, f->s.cache, "topk7", extra, 1), TKD_ERR_CONFIG, frag, 3);
    const char *ok[] = {"kd.topk=6", "train.max_steps=1"};
    assert_int_equal(run(f, f->s.cache, "topk6", ok, 2), TKD_OK);
}

/* optim.state_dtype takes f32 or bf16: anything else is a config error naming the key, the value
 * and the accepted values, before any training; bf16 trains. */
static void test_state_dtype_values(void **state)
{
    fixture *f = *state;
    const char *bad[] = {"optim.state_dtype=fp16"};
    const char *frag[] = {"optim.state_dtype", "'fp16'", "is not one of: f32, bf16"};
    expect_error(run(f, f->s.cache, "state-fp16", bad, 1), TKD_ERR_CONFIG, frag, 3);
    assert_false(exists(tkd_test_path(f->s.runs, "state-fp16")));
    const char *ok[] = {"optim.state_dtype=bf16", "train.max_steps=1"};
    assert_int_equal(run(f, f->s.cache, "state-bf16", ok, 2), TKD_OK);
}

/* kd.divergence beside kd.variant: a combination that is not defined is a config error naming both
 * keys, found once the cache says whether it has tail draws; the others train, and the KD they report
 * (val_kd, metrics.jsonl's kd) is the divergence's value: on the same initial student (eval_only) the
 * CE is the same and the KD differs, TVD's staying within τ² = 1. */
static void test_divergence_with_variant(void **state)
{
    fixture *f = *state;
    const char *rkl[] = {"kd.variant=sampled", "kd.divergence=rkl"};
    const char *frag[] = {"kd.divergence = rkl", "kd.variant = sampled", "kd.variant = tail"};
    expect_error(run(f, f->s.cache, "sampled-rkl", rkl, 2), TKD_ERR_CONFIG, frag, 3);
    const char *skew1[] = {"kd.divergence=skl", "kd.skew_alpha=1"};
    const char *frag1[] = {"kd.skew_alpha = 1", "[0, 1)"};
    expect_error(run(f, f->s.cache, "skl-alpha1", skew1, 2), TKD_ERR_CONFIG, frag1, 2);
    const char *beta[] = {"kd.divergence=jsd", "kd.jsd_beta=1.5"}; /* the schema's range */
    const char *frag2[] = {"kd.jsd_beta"};
    expect_error(run(f, f->s.cache, "jsd-beta", beta, 2), TKD_ERR_CONFIG, frag2, 1);
    const char *ok[] = {"kd.variant=sampled", "kd.divergence=jsd", "kd.jsd_beta=0.3", "train.max_steps=2"};
    assert_int_equal(run(f, f->s.cache, "sampled-jsd", ok, 4), TKD_OK);
    double kd[3], ce[3];
    const char *divs[] = {"kd.divergence=fkl", "kd.divergence=rkl", "kd.divergence=tvd"};
    for (int i = 0; i < 3; i++) {
        const char *sets[] = {"model.hidden_size=16", "model.intermediate_size=32", "model.num_layers=1",
                              "model.num_heads=2", "model.num_kv_heads=2", "model.max_position_embeddings=8",
                              "data.val_fraction=0.125", "train.batch_size=4", "device=cpu", "train.eval_only=true",
                              "kd.variant=tail", divs[i], NULL};
        char cache_set[4300], name[32];
        snprintf(cache_set, sizeof cache_set, "data.cache=%s", f->s.cache);
        sets[12] = cache_set;
        snprintf(name, sizeof name, "eval-div%d", i);
        tkd_train_result res;
        if (tkd_test_student_train(f->s.runs, name, sets, 13, 0, &res) != TKD_OK)
            fail_msg("%s: %s", divs[i], tkd_error_msg());
        kd[i] = res.val_kd, ce[i] = res.val_ce;
    }
    assert_true(ce[1] == ce[0] && ce[2] == ce[0]);
    assert_true(kd[0] > 0 && kd[1] > 0 && kd[2] > 0 && kd[2] <= 1.0);
    assert_true(fabs(kd[1] - kd[0]) > 1e-3 * kd[0] && fabs(kd[2] - kd[0]) > 1e-3 * kd[0]);
}

/* A config error found once the cache is open is still a config error (exit 2), not a mismatch. */
static void test_seq_len_beyond_the_cache(void **state)
{
    fixture *f = *state;
    const char *extra[] = {"data.seq_len=9"};
    const char *frag[] = {"data.seq_len = 9", "sequences of 8", f->s.cache};
    expect_error(run(f, f->s.cache, "seq9", extra, 1), TKD_ERR_CONFIG, frag, 3);
    /* the cache's 8 positions (data.seq_len 0) on a student of 4: the message names the key to raise */
    const char *short_student[] = {"model.max_position_embeddings=4"};
    const char *frag_pos[] = {"max_position_embeddings 4", "raise model.max_position_embeddings"};
    expect_error(run(f, f->s.cache, "pos4", short_student, 1), TKD_ERR_CONFIG, frag_pos, 2);
}

static void test_temperature_of_the_cache(void **state)
{
    fixture *f = *state;
    const char *extra[] = {"kd.variant=tail", "kd.temperature=2"};
    const char *frag[] = {"kd.temperature", "1", "2"};
    expect_error(run(f, f->s.cache, "tail-t2", extra, 2), TKD_ERR_CONFIG, frag, 3);
    const char *renorm[] = {"kd.variant=renorm", "kd.temperature=2", "train.max_steps=1"}; /* any τ */
    assert_int_equal(run(f, f->s.cache, "renorm-t2", renorm, 3), TKD_OK);
}

/* data.val_cache: a cache of the same teacher is used whole for evaluation; one that lacks what
 * the training cache's variant needs (tail draws for sampled) is refused naming both. */
static void test_validation_cache(void **state)
{
    fixture *f = *state;
    char val_set[4300];
    snprintf(val_set, sizeof val_set, "data.val_cache=%s", f->notail);
    const char *ok[] = {val_set, "kd.variant=tail", "train.max_steps=2"};
    assert_int_equal(run(f, f->s.cache, "val-cache", ok, 3), TKD_OK);
    const char *sampled[] = {val_set, "kd.variant=sampled"};
    const char *frag[] = {f->notail, f->s.cache, "validation cache"};
    expect_error(run(f, f->s.cache, "val-cache-sampled", sampled, 2), TKD_ERR_MISMATCH, frag, 3);
}

/* ---- failures in the middle of training --------------------------------------------------------- */

/* Position of the first of the sequences [g0, g0 + n) in epoch 0's training order (seed SEED). */
static int64_t first_position(const fixture *f, int64_t g0, int64_t n)
{
    tkd_cache_reader *r = NULL;
    assert_int_equal(tkd_cache_reader_open(&r, f->s.cache, NULL), TKD_OK);
    int64_t split[NTRAIN], order[NTRAIN];
    for (int64_t i = 0; i < NTRAIN; i++)
        split[i] = i;
    tkd_loader_opts o = {.batch_size = BATCH, .seq_len = T, .prefetch = 2, .seed = SEED, .shuffle = 1};
    tkd_loader *l = NULL;
    assert_int_equal(tkd_loader_open(&l, r, NULL, split, NTRAIN, &o), TKD_OK);
    tkd_loader_epoch_order(l, 0, order);
    tkd_loader_close(l);
    tkd_cache_reader_close(r);
    int64_t best = NTRAIN;
    for (int64_t p = 0; p < NTRAIN; p++)
        if (order[p] >= g0 && order[p] < g0 + n && p < best)
            best = p;
    return best;
}

/* A run with a checkpoint every step that must stop with `want` at step fail_step: the message says
 * so, the checkpoint holds step fail_step - 1 and loads back into a student of the run's shape. */
static void expect_stop(const fixture *f, const char *cache, const char *name, const char *const *extra, size_t n,
                        tkd_status want, int64_t fail_step, const char *fragment, const char *fragment2)
{
    const char *sets[16] = {"train.checkpoint_interval=1"};
    memcpy(sets + 1, extra, n * sizeof *sets);
    tkd_status st = run(f, cache, name, sets, n + 1);
    char ckpt[4400];
    snprintf(ckpt, sizeof ckpt, "%s/%s/checkpoint", f->s.runs, name);
    char step_text[64];
    snprintf(step_text, sizeof step_text, "step %lld", (long long)fail_step);
    const char *frag[] = {"training stopped (last good checkpoint: ", ckpt, step_text, fragment, fragment2};
    expect_error(st, want, frag, 5);
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_load_hf(ckpt, &m), TKD_OK);
    tkd_optim_config oc;
    tkd_optim_config_defaults(&oc);
    tkd_adamw *opt = NULL;
    assert_int_equal(tkd_adamw_init(&oc, m->n_params, &opt), TKD_OK);
    tkd_train_state ts;
    assert_int_equal(tkd_checkpoint_load(ckpt, m, opt, &ts), TKD_OK);
    assert_int_equal(ts.step, fail_step - 1);
    assert_int_equal(opt->step, fail_step - 1);
    for (size_t i = 0; i < m->n_params; i++)
        assert_true(isfinite(m->params[i]));
    tkd_adamw_free(opt);
    tkd_model_free(m);
    /* nothing half-written is left beside it */
    char cmd[4600];
    snprintf(cmd, sizeof cmd, "ls -a '%s/%s' | grep -q tmp", f->s.runs, name);
    assert_int_not_equal(system(cmd), 0);
}

/* A copy of the good cache with one compressed chunk of shard-00001.h5 (sequences 16..31) broken:
 * the chunk chosen is one whose sequences come up only after a few steps, so checkpoints exist. */
static void test_corrupt_shard_mid_training(void **state)
{
    fixture *f = *state;
    char dir[4300], cmd[13000], shard[4400];
    snprintf(dir, sizeof dir, "%s/corrupt", f->s.dir);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", dir, f->s.cache, dir);
    assert_int_equal(system(cmd), 0);
    int64_t chunk = -1, pos = 0;
    for (int64_t c = 0; c < 4 && chunk < 0; c++) {
        pos = first_position(f, 16 + 4 * c, 4);
        if (pos >= 2 * BATCH)
            chunk = c;
    }
    assert_true(chunk >= 0);
    snprintf(shard, sizeof shard, "%s/shard-00001.h5", dir);
    tkd_test_flip_chunk_byte(shard, "/topk/logits", 4 * chunk);
    int64_t fail_step = pos / BATCH + 1;
    const char *extra[] = {"train.max_steps=20"};
    expect_stop(f, dir, "corrupt", extra, 1, TKD_ERR_CHECKSUM, fail_step, "shard-00001.h5", "/topk/logits");
}

typedef struct bad_value {
    int64_t seq;   /* global sequence */
    int pos;       /* position in it */
    int what;      /* 0: top-1 logit = +inf, 1: LSE = -1e30 */
} bad_value;

static void plant(tkd_cache_batch *b, int64_t g0, void *ctx)
{
    const bad_value *bv = ctx;
    if (bv->seq < g0 || bv->seq >= g0 + b->num_seq)
        return;
    size_t row = (size_t)(bv->seq - g0) * (size_t)b->seq_len + (size_t)bv->pos;
    if (bv->what == 0)
        b->topk_logits[row * (size_t)b->k] = INFINITY;
    else /* the stored top-1 probability exp(t − lse) becomes e: the mass of a too coarsely rounded cache */
        b->lse[row] = b->topk_logits[row * (size_t)b->k] - 1.0f;
}

typedef struct bad_cache {
    char dir[4300]; /* <fixture dir>/<name> */
    char seq[32];   /* the bad sequence as the message lists it in its batch: ", g," */
    int64_t step;   /* the step that meets it */
} bad_cache;

/* A cache like the good one with one bad value planted in the sequence at training position 9
 * (epoch 0, step 3), in <fixture dir>/<name>. */
static bad_cache make_bad_cache(const fixture *f, const char *name, int what)
{
    bad_cache bc;
    snprintf(bc.dir, sizeof bc.dir, "%s/%s", f->s.dir, name);
    int64_t split_pos = 9, seq = -1;
    for (int64_t g = 0; g < NTRAIN && seq < 0; g++)
        if (first_position(f, g, 1) == split_pos)
            seq = g;
    assert_true(seq >= 0);
    bad_value bv = {.seq = seq, .pos = 3, .what = what};
    tkd_test_teacher_opts o = cache_opts(2);
    o.edit = plant;
    o.edit_ctx = &bv;
    assert_int_equal(tkd_test_teacher_cache(bc.dir, &o), TKD_OK);
    snprintf(bc.seq, sizeof bc.seq, ", %lld,", (long long)seq); /* 2nd of its batch of 4 */
    bc.step = split_pos / BATCH + 1;
    return bc;
}

/* An infinite teacher logit is refused by the loss's validation before the step is taken. */
static void test_infinite_teacher_logit(void **state)
{
    fixture *f = *state;
    bad_cache bc = make_bad_cache(f, "inf-logit", 0);
    const char *extra[] = {"kd.variant=renorm"};
    expect_stop(f, bc.dir, "inf-logit", extra, 1, TKD_ERR_FORMAT, bc.step, bc.seq, "not finite (inf)");
    /* without checkpoints the message does not point at one */
    const char *no_ckpt[] = {"kd.variant=renorm", "train.checkpoint_interval=0"};
    const char *frag[] = {"training stopped (no checkpoint written yet)", "step 3", "not finite (inf)"};
    expect_error(run(f, bc.dir, "inf-logit-nockpt", no_ckpt, 2), TKD_ERR_FORMAT, frag, 3);
}

/* A row whose stored probabilities exp(t − lse) sum above 1 (a half cache of logits near 45,000
 * stored them ±16 off, issue 20) would give tail a negative tail mass and sampled a broken target:
 * the loss's validation refuses it before the step is taken, naming the step and the sum, and the
 * last checkpoint is kept. (Before this check the run trained on it without a word.) */
static void test_teacher_mass_above_one(void **state)
{
    fixture *f = *state;
    bad_cache bc = make_bad_cache(f, "bad-lse", 1);
    const char *tail[] = {"kd.variant=tail"};
    expect_stop(f, bc.dir, "bad-lse-tail", tail, 1, TKD_ERR_FORMAT, bc.step, bc.seq, "stored probabilities sum to");
    const char *renorm[] = {"kd.variant=renorm"}; /* reads no LSE: p̃ is renormalised over the top-k' */
    assert_int_equal(run(f, bc.dir, "bad-lse-renorm", renorm, 1), TKD_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_other_teacher),
        cmocka_unit_test(test_refused_run_leaves_no_directory),
        cmocka_unit_test(test_vocabulary_mismatch),
        cmocka_unit_test(test_sampled_needs_tail_draws),
        cmocka_unit_test(test_topk_beyond_the_cache),
        cmocka_unit_test(test_state_dtype_values),
        cmocka_unit_test(test_divergence_with_variant),
        cmocka_unit_test(test_seq_len_beyond_the_cache),
        cmocka_unit_test(test_temperature_of_the_cache),
        cmocka_unit_test(test_validation_cache),
        cmocka_unit_test(test_corrupt_shard_mid_training),
        cmocka_unit_test(test_infinite_teacher_logit),
        cmocka_unit_test(test_teacher_mass_above_one),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
