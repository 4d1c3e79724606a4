/* test_student_train.c — student-train end to end on a tiny synthetic teacher cache (a fixed random
 * teacher's top-k, LSE and tail draws over random tokens, tests/testutil.c): the KD loss falls for
 * every variant, KD with alpha = 1 raises the student's top-1 agreement with the teacher, a run
 * stopped and resumed equals an uninterrupted one bit for bit (with fp32 and with bf16 AdamW
 * moments), and the checkpoint is a loadable Hugging Face directory with the optimizer state beside it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "model/optim.h"
#include "formats/safetensors.h"
#include "student_train/checkpoint.h"
#include "student_train/train.h"
#include "tests/testutil.h"

/* The cache: V = 96, T = 16, k = 8 stored columns, S = 4 tail draws, 48 sequences in 3 shards of
 * 16 (chunks of 4 sequences). 6 sequences (val_fraction 0.125) are held out, 42 train. */
typedef tkd_test_student_dir fixture;

#define STUDENT_SETS                                                                                          \
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",           \
        "model.num_kv_heads=2", "model.max_position_embeddings=16", "data.val_fraction=0.125",               \
        "train.batch_size=4", "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.warmup_steps=2",                   \
        "optim.weight_decay=0", "train.log_interval=1", "train.eval_interval=0", "device=cpu"

static int setup(void **state)
{
    tkd_test_teacher_opts o = {.vocab = 96, .hidden = 32, .seq_len = 16, .k = 8, .tail_samples = 4,
                               .temperature = 1.0f, .num_seq = 48, .shard_seqs = 16, .chunk_seqs = 4, .seed = 7};
    return tkd_test_student_setup(state, "student", &o);
}

/* Runs `name` with the student settings, data.cache = the fixture's cache, then extra. */
static tkd_status run(const fixture *f, const char *name, const char *const *extra, size_t n, int resume,
                      tkd_train_result *res)
{
    const char *base[] = {STUDENT_SETS};
    size_t nb = sizeof base / sizeof base[0];
    const char *sets[64];
    char cache_set[4300];
    snprintf(cache_set, sizeof cache_set, "data.cache=%s", f->cache);
    memcpy(sets, base, nb * sizeof *sets);
    sets[nb] = cache_set;
    memcpy(sets + nb + 1, extra, n * sizeof *sets);
    tkd_status st = tkd_test_student_train(f->runs, name, sets, nb + 1 + n, resume, res);
    if (st != TKD_OK)
        print_error("run %s: %s\n", name, tkd_error_msg());
    return st;
}

static void run_path(char *out, size_t cap, const fixture *f, const char *name, const char *file)
{
    snprintf(out, cap, "%s/%s/%s", f->runs, name, file);
}

/* The KD term of the first logged steps against the last: a 40-step run must at least halve it for
 * each variant (observed ratios 0.34 renorm, 0.27 tail, 0.37 sampled; val KD / first 0.41, 0.34,
 * 0.44). A student that learns nothing stays near 1: random tokens give it nothing else to fit. */
static void check_kd_falls(const fixture *f, const char *variant)
{
    char name[64], vset[64], metrics[4400];
    snprintf(name, sizeof name, "falls-%s", variant);
    snprintf(vset, sizeof vset, "kd.variant=%s", variant);
    const char *extra[] = {vset, "kd.alpha=1", "train.max_steps=40"};
    tkd_train_result res;
    assert_int_equal(run(f, name, extra, 3, 0, &res), TKD_OK);
    run_path(metrics, sizeof metrics, f, name, "metrics.jsonl");
    double kd[64];
    int n = tkd_test_metrics(metrics, "train", "kd", kd, 64);
    assert_int_equal(n, 40);
    double first = (kd[0] + kd[1]) / 2, last = (kd[n - 2] + kd[n - 1]) / 2; /* two steps: batches differ */
    printf("  %-8s train KD %.4f -> %.4f, val KD %.4f, top-1 %.3f\n", variant, first, last, res.val_kd,
           res.top1_agree);
    assert_true(isfinite(first) && isfinite(last));
    assert_true(last < 0.5 * first);
    assert_true(res.val_kd < 0.6 * first);
    assert_int_equal(res.steps, 40);
    /* 42 training sequences = 11 batches an epoch, the 11th of 2: steps 11, 22 and 33 are short */
    assert_int_equal(res.tokens, (40 * 4 - 3 * 2) * 16);
}

static void test_kd_falls_renorm(void **state) { check_kd_falls(*state, "renorm"); }
static void test_kd_falls_tail(void **state) { check_kd_falls(*state, "tail"); }
static void test_kd_falls_sampled(void **state) { check_kd_falls(*state, "sampled"); }

/* train.eval_only measures the initial student's top-1 agreement; the same seed trained 60 steps with alpha = 1 must gain at least 0.3 (observed:
 * 0.010 -> 0.604 on the 96 validation positions; chance is about 1/96). */
static void test_top1_agreement_rises(void **state)
{
    fixture *f = *state;
    const char *frozen[] = {"kd.alpha=1", "train.eval_only=true"};
    const char *trained[] = {"kd.alpha=1", "train.max_steps=60"};
    tkd_train_result r0, r1;
    assert_int_equal(run(f, "top1-init", frozen, 2, 0, &r0), TKD_OK);
    assert_int_equal(run(f, "top1-trained", trained, 2, 0, &r1), TKD_OK);
    printf("  top-1 agreement %.3f at init -> %.3f after 60 steps (val KD %.4f -> %.4f)\n", r0.top1_agree,
           r1.top1_agree, r0.val_kd, r1.val_kd);
    assert_true(r0.top1_agree >= 0 && r0.top1_agree <= 1);
    /* The untrained student (init std 0.02, D = 32: logits of std ~0.1) is nearly uniform, so its
     * validation CE is ln 96 = 4.564 nats plus ~var/2 = 0.006; 0.05 catches a CE summed over tokens,
     * taken in bits (6.58) or on the wrong distribution, and perplexity must be its exp. */
    assert_true(fabs(r0.val_ce - log(96.0)) < 0.05);
    assert_true(tkd_test_close(r0.val_ppl, exp(r0.val_ce), 0, 1e-12));
    assert_true(r0.val_loss == r0.val_kd); /* alpha = 1: the loss is the KD alone */
    assert_true(r1.top1_agree >= r0.top1_agree + 0.3);
    assert_true(r1.val_kd < r0.val_kd);
}

/* Runs x and y ended with the same checkpoint (weights, moments, state) byte for byte and the same
 * metrics records but for their times. */
static void assert_same_run(const fixture *f, const char *x, const char *y)
{
    char a[4400], b[4400];
    const char *files[] = {"checkpoint/model.safetensors", "checkpoint/optimizer.safetensors",
                           "checkpoint/state.json"};
    for (int i = 0; i < 3; i++) {
        run_path(a, sizeof a, f, x, files[i]);
        run_path(b, sizeof b, f, y, files[i]);
        if (!tkd_test_files_equal(a, b))
            fail_msg("%s differs between runs %s and %s", files[i], x, y);
    }
    run_path(a, sizeof a, f, x, "metrics.jsonl");
    run_path(b, sizeof b, f, y, "metrics.jsonl");
    char *ma = tkd_test_metrics_without_time(a), *mb = tkd_test_metrics_without_time(b);
    assert_string_equal(ma, mb);
    free(ma);
    free(mb);
}

/* optim.grad_accum = 2 of 2 sequences is one batch of 4 (the same sequences per step, each
 * micro-batch's mean scaled by 1/2): the gradient norms and losses of 4 steps agree to float
 * rounding. Guards that accumulation keeps the gradients of every micro-batch: the gradient buffer
 * is lent to the activations only without it (a loan would leave the last micro-batch's alone,
 * 0.545 against 0.663 at step 1 here). */
static void test_grad_accum_equals_one_batch(void **state)
{
    fixture *f = *state;
    const char *one[] = {"kd.alpha=0.5", "train.max_steps=4"};
    const char *two[] = {"kd.alpha=0.5", "train.max_steps=4", "train.batch_size=2", "optim.grad_accum=2"};
    tkd_train_result ra, rb;
    assert_int_equal(run(f, "accum-1x4", one, 2, 0, &ra), TKD_OK);
    assert_int_equal(run(f, "accum-2x2", two, 4, 0, &rb), TKD_OK);
    char a[4400], b[4400];
    run_path(a, sizeof a, f, "accum-1x4", "metrics.jsonl");
    run_path(b, sizeof b, f, "accum-2x2", "metrics.jsonl");
    const char *keys[] = {"grad_norm", "loss"};
    for (int k = 0; k < 2; k++) {
        double x[8], y[8];
        assert_int_equal(tkd_test_metrics(a, "train", keys[k], x, 8), 4);
        assert_int_equal(tkd_test_metrics(b, "train", keys[k], y, 8), 4);
        for (int i = 0; i < 4; i++) {
            printf("  step %d %-9s one batch %.9g, two micro-batches %.9g\n", i + 1, keys[k], x[i], y[i]);
            assert_true(tkd_test_close(x[i], y[i], 0, 1e-5));
        }
    }
}

/* 12 steps straight vs 5 steps (train.stop_after) + --resume: with grad_accum = 2 and 11 batches
 * per epoch, the epoch boundary falls inside step 6, just after the stop. The weights, the AdamW
 * moments and every metrics record (to the printed digit) must be equal. */
static void test_resume_is_bit_exact(void **state)
{
    fixture *f = *state;
    const char *common[] = {"kd.variant=sampled", "kd.alpha=0.7", "optim.grad_accum=2", "train.max_steps=12",
                            "train.eval_interval=4", "train.eval_batches=1"};
    char b[4400];
    tkd_train_result ra, rb;
    assert_int_equal(run(f, "straight", common, 6, 0, &ra), TKD_OK);

    const char *first_half[8];
    memcpy(first_half, common, sizeof common);
    first_half[6] = "train.stop_after=5";
    assert_int_equal(run(f, "split", first_half, 7, 0, &rb), TKD_OK);
    assert_int_equal(rb.steps, 5);
    assert_true(isnan(rb.val_ce)); /* no final evaluation at a stop */
    run_path(b, sizeof b, f, "split", "checkpoint/state.json");
    char *state_json = tkd_test_read_file(b, NULL);
    assert_non_null(state_json);
    assert_non_null(strstr(state_json, "\"step\":\t\"5\""));
    free(state_json);
    /* resumed with the same overrides: past stop_after, the run goes on to max_steps */
    assert_int_equal(run(f, "split", first_half, 7, 1, &rb), TKD_OK);
    assert_int_equal(rb.steps, 12);

    assert_same_run(f, "straight", "split");
    run_path(b, sizeof b, f, "split", "metrics.jsonl");
    assert_true(ra.train_loss == rb.train_loss); /* the doubles themselves, not their print */
    assert_true(ra.val_loss == rb.val_loss);
    double losses[16], kds[16], ces[16], ppl[16];
    assert_int_equal(tkd_test_metrics(b, "train", "loss", losses, 16), 12);
    assert_int_equal(tkd_test_metrics(b, "train", "kd", kds, 16), 12);
    assert_int_equal(tkd_test_metrics(b, "train", "ce", ces, 16), 12);
    /* every logged loss is alpha·KD + (1 − alpha)·CE of its own KD and CE: 1e-7 relative covers the
     * %.9g print (5e-9 each) and alpha held as fp32 0.7 (1.2e-8 of |KD − CE|); a swapped or missing
     * weight is off by ~10% */
    for (int i = 0; i < 12; i++) {
        assert_true(kds[i] > 0 && ces[i] > 0 && fabs(kds[i] - ces[i]) > 0.05 * ces[i]);
        assert_true(tkd_test_close(losses[i], 0.7 * kds[i] + 0.3 * ces[i], 0, 1e-7));
    }
    assert_int_equal(tkd_test_metrics(b, "eval", "val_loss", losses, 16), 3); /* steps 4, 8 and the end */
    assert_int_equal(tkd_test_metrics(b, "eval", "val_kd", kds, 16), 3);
    assert_int_equal(tkd_test_metrics(b, "eval", "val_ce", ces, 16), 3);
    assert_int_equal(tkd_test_metrics(b, "eval", "val_ppl", ppl, 16), 3);
    for (int i = 0; i < 3; i++) {
        assert_true(tkd_test_close(losses[i], 0.7 * kds[i] + 0.3 * ces[i], 0, 1e-7));
        assert_true(tkd_test_close(ppl[i], exp(ces[i]), 0, 1e-7));
    }
}

/* optim.state_dtype bf16: 9 steps straight vs 4 (train.stop_after) + --resume give the same
 * weights, BF16 moments, state and metrics bit for bit; the checkpoint records the dtype and keeps
 * the moments as BF16 tensors; the run is not the f32 one (the rounding shows in the weights); and
 * resuming it with the default f32 state is refused, naming the checkpoint and both dtypes. */
static void test_resume_bf16_state_is_bit_exact(void **state)
{
    fixture *f = *state;
    const char *common[] = {"optim.state_dtype=bf16", "kd.alpha=0.5", "train.max_steps=9", "train.eval_interval=4",
                            "train.eval_batches=1", "train.stop_after=0"};
    char a[4400], b[4400];
    tkd_train_result ra, rb, rf;
    assert_int_equal(run(f, "bf16-straight", common, 6, 0, &ra), TKD_OK);
    const char *first_half[6];
    memcpy(first_half, common, sizeof common);
    first_half[5] = "train.stop_after=4";
    assert_int_equal(run(f, "bf16-split", first_half, 6, 0, &rb), TKD_OK);
    assert_int_equal(rb.steps, 4);
    assert_int_equal(run(f, "bf16-split", first_half, 6, 1, &rb), TKD_OK);
    assert_int_equal(rb.steps, 9);
    assert_same_run(f, "bf16-straight", "bf16-split");
    assert_true(ra.train_loss == rb.train_loss && ra.val_loss == rb.val_loss);

    run_path(b, sizeof b, f, "bf16-split", "checkpoint/state.json");
    char *state_json = tkd_test_read_file(b, NULL);
    assert_non_null(strstr(state_json, "\"optimizer_state_dtype\":\t\"bf16\""));
    free(state_json);
    run_path(b, sizeof b, f, "bf16-split", "checkpoint/optimizer.safetensors");
    tkd_st_dir *d = NULL;
    assert_int_equal(tkd_st_open(b, &d), TKD_OK);
    const tkd_st_tensor *t = tkd_st_find(d, "adamw.m");
    assert_true(t && t->dtype == TKD_DTYPE_BF16);
    tkd_st_close(d);

    const char *as_f32[] = {"kd.alpha=0.5", "train.max_steps=9", "train.eval_interval=4", "train.eval_batches=1"};
    assert_int_equal(run(f, "f32-straight", as_f32, 4, 0, &rf), TKD_OK);
    run_path(a, sizeof a, f, "f32-straight", "checkpoint/model.safetensors");
    run_path(b, sizeof b, f, "bf16-straight", "checkpoint/model.safetensors");
    assert_false(tkd_test_files_equal(a, b));
    /* close, though: 9 steps of rounded moments move the validation CE by far less than training does */
    printf("  val CE after 9 steps: f32 state %.6f, bf16 state %.6f\n", rf.val_ce, ra.val_ce);
    assert_true(fabs(rf.val_ce - ra.val_ce) < 0.02);

    const char *more[] = {"kd.alpha=0.5", "train.max_steps=12", "train.eval_interval=4", "train.eval_batches=1"};
    assert_int_equal(run(f, "bf16-split", more, 4, 1, &rb), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("bf16-split/checkpoint keeps the AdamW moments as bf16, but optim.state_dtype is f32");
}

/* The checkpoint: an HF directory tkd_model_load_hf reads, the optimizer moments and the state,
 * and tkd_checkpoint_load puts exactly those values into a freshly built student. */
static void test_checkpoint_loads_back(void **state)
{
    fixture *f = *state;
    const char *extra[] = {"kd.variant=tail", "train.max_steps=6", "train.checkpoint_interval=4",
                           "model.tie_word_embeddings=true"};
    assert_int_equal(run(f, "ckpt", extra, 4, 0, NULL), TKD_OK);
    char dir[4400], path[4500];
    run_path(dir, sizeof dir, f, "ckpt", "checkpoint");
    const char *must[] = {"config.json", "model.safetensors", "optimizer.safetensors", "state.json", "config.yaml"};
    for (int i = 0; i < 5; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, must[i]);
        char *text = tkd_test_read_file(path, NULL);
        if (!text)
            fail_msg("%s missing", path);
        free(text);
    }
    tkd_model *hf = NULL, *fresh = NULL;
    assert_int_equal(tkd_model_load_hf(dir, &hf), TKD_OK);
    assert_int_equal(hf->cfg.vocab_size, 96);
    assert_int_equal(hf->cfg.hidden_size, 32);
    assert_int_equal(hf->cfg.num_hidden_layers, 1);
    assert_int_equal(hf->cfg.tie_word_embeddings, 1);

    /* a student of the same shape with other weights, and an optimizer of its size */
    tkd_model_config mc = hf->cfg;
    assert_int_equal(tkd_model_init_random(&mc, 999, &fresh), TKD_OK);
    assert_int_equal(fresh->n_params, hf->n_params);
    assert_true(memcmp(fresh->params, hf->params, hf->n_params * sizeof(float)) != 0);
    tkd_optim_config oc;
    tkd_optim_config_defaults(&oc);
    tkd_adamw *opt = NULL;
    assert_int_equal(tkd_adamw_init(&oc, fresh->n_params, &opt), TKD_OK);
    tkd_train_state st;
    memset(&st, 0, sizeof st);
    assert_int_equal(tkd_checkpoint_load(dir, fresh, opt, &st), TKD_OK);
    assert_memory_equal(fresh->params, hf->params, hf->n_params * sizeof(float));
    assert_int_equal(st.step, 6);
    assert_int_equal(opt->step, 6);
    assert_int_equal(st.tokens_seen, 6 * 4 * 16);
    assert_int_equal(st.epoch, 0);
    assert_int_equal(st.offset, 24);
    double msum = 0, vsum = 0;
    for (size_t i = 0; i < opt->n; i++) {
        msum += fabs(opt->m[i]);
        vsum += opt->v[i];
        assert_true(opt->v[i] >= 0);
    }
    assert_true(msum > 0 && vsum > 0); /* moments were restored, not left at zero */

    /* state.json with a key given twice is refused (cJSON would take the first "step") */
    snprintf(path, sizeof path, "%s/state.json", dir);
    char *state_json = tkd_test_slurp(path, NULL), dup[8192];
    assert_true(state_json[0] == '{');
    snprintf(dup, sizeof dup, "{\n\t\"step\":\t\"2\",%s", state_json + 1);
    tkd_test_write_text(path, dup);
    free(state_json);
    assert_int_equal(tkd_checkpoint_load(dir, fresh, opt, &st), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("state.json:3:2: duplicate key \"step\" (first at line 2, column 2)");

    /* an architecture that differs is refused as a config error (exit 2), naming the directory */
    tkd_model *other = NULL;
    mc.hidden_size = 16;
    mc.head_dim = 8;
    assert_int_equal(tkd_model_init_random(&mc, 1, &other), TKD_OK);
    tkd_adamw *opt2 = NULL;
    assert_int_equal(tkd_adamw_init(&oc, other->n_params, &opt2), TKD_OK);
    assert_int_equal(tkd_checkpoint_load(dir, other, opt2, &st), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "architecture"));
    tkd_adamw_free(opt2);
    tkd_model_free(other);
    tkd_adamw_free(opt);
    tkd_model_free(fresh);
    tkd_model_free(hf);

    /* the run directory: the effective config, one record per step and the final evaluation */
    run_path(path, sizeof path, f, "ckpt", "config.yaml");
    char *yaml = tkd_test_read_file(path, NULL);
    assert_non_null(yaml);
    assert_non_null(strstr(yaml, "tail"));
    free(yaml);
    double v[8];
    run_path(path, sizeof path, f, "ckpt", "metrics.jsonl");
    assert_int_equal(tkd_test_metrics(path, "train", "loss", v, 8), 6);
    assert_int_equal(tkd_test_metrics(path, "eval", "top1_agree", v, 8), 1);
    assert_true(v[0] >= 0 && v[0] <= 1);
}

/* model.arch: qwen3 builds, trains, checkpoints and exports a Qwen3 student (head_dim 24 != D/H = 16):
 * the checkpoint reads back as Qwen3ForCausalLM with its q/k norms, which training moved off their
 * initial 1 (their gradients reach AdamW), and a resume from it continues. */
static void test_qwen3_student(void **state)
{
    fixture *f = *state;
    const char *extra[] = {"model.arch=qwen3", "model.head_dim=24", "kd.variant=tail", "train.max_steps=6",
                           "train.checkpoint_interval=4"};
    assert_int_equal(run(f, "qwen3", extra, 5, 0, NULL), TKD_OK);
    char dir[4400], path[4500];
    run_path(dir, sizeof dir, f, "qwen3", "checkpoint");
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *cfg = tkd_test_read_file(path, NULL);
    assert_non_null(cfg);
    assert_non_null(strstr(cfg, "\"Qwen3ForCausalLM\""));
    assert_non_null(strstr(cfg, "\"attention_bias\":\tfalse"));
    free(cfg);
    tkd_model *hf = NULL;
    if (tkd_model_load_hf(dir, &hf) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    assert_int_equal(hf->cfg.arch, TKD_ARCH_QWEN3);
    assert_int_equal(hf->cfg.head_dim, 24);
    for (int n = 0; n < 2; n++) {
        const float *w = n ? hf->w.layers[0].k_norm : hf->w.layers[0].q_norm;
        assert_non_null(w);
        int moved = 0;
        for (int i = 0; i < 24; i++)
            moved += w[i] != 1.0f;
        if (moved < 12)
            fail_msg("%s_norm: only %d of 24 weights moved in 6 steps", n ? "k" : "q", moved);
    }
    tkd_model_free(hf);
    const char *more[] = {"model.arch=qwen3", "model.head_dim=24", "kd.variant=tail", "train.max_steps=8",
                          "train.checkpoint_interval=4"};
    tkd_train_result res;
    assert_int_equal(run(f, "qwen3", more, 5, 1, &res), TKD_OK);
    assert_true(isfinite(res.val_kd));
}

/* A finished run is not silently overwritten; --resume of a finished run takes no step. */
static void test_existing_run_is_kept(void **state)
{
    fixture *f = *state;
    const char *extra[] = {"train.max_steps=2"};
    assert_int_equal(run(f, "twice", extra, 1, 0, NULL), TKD_OK);
    assert_int_equal(run(f, "twice", extra, 1, 0, NULL), TKD_ERR_INVALID_ARG);
    assert_non_null(strstr(tkd_error_msg(), "--resume"));
    tkd_train_result res;
    assert_int_equal(run(f, "twice", extra, 1, 1, &res), TKD_OK);
    assert_int_equal(res.steps, 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kd_falls_renorm),
        cmocka_unit_test(test_kd_falls_tail),
        cmocka_unit_test(test_kd_falls_sampled),
        cmocka_unit_test(test_top1_agreement_rises),
        cmocka_unit_test(test_grad_accum_equals_one_batch),
        cmocka_unit_test(test_resume_is_bit_exact),
        cmocka_unit_test(test_resume_bf16_state_is_bit_exact),
        cmocka_unit_test(test_checkpoint_loads_back),
        cmocka_unit_test(test_qwen3_student),
        cmocka_unit_test(test_existing_run_is_kept),
    };
    return cmocka_run_group_tests(tests, setup, tkd_test_student_teardown);
}
