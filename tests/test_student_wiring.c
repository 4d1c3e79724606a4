/* test_student_wiring.c — what student-train reports equals the loss computed independently:
 * the same random student built here, the cache read here, the float64 reference loss. A wrong
 * label shift, a teacher row paired with the wrong position, a column stride or a tail draw read
 * from the wrong place changes the number, even where training would still go down. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "formats/cache_reader.h"
#include "kernels/loss/kl_loss.h"
#include "model/model.h"
#include "student_train/train.h"
#include "tests/testutil.h"

enum { V = 96, T = 16, K = 8, S = 4, NSEQ = 12, D = 32, SEED = 99 };

/* The student student-train builds from the sets below (train_setup.c's student_config, written out
 * again here on purpose). */
static void student_config(tkd_model_config *mc)
{
    tkd_model_config_defaults(mc);
    mc->arch = TKD_ARCH_LLAMA;
    mc->vocab_size = V;
    mc->hidden_size = D;
    mc->intermediate_size = 64;
    mc->num_hidden_layers = 1;
    mc->num_attention_heads = 2;
    mc->num_key_value_heads = 1;
    mc->head_dim = D / 2;
    mc->max_position_embeddings = T;
    mc->rope_theta = 10000.0;
    mc->rms_norm_eps = 1e-5f;
    mc->tie_word_embeddings = 0;
    mc->attention_bias = 0;
    mc->initializer_range = 0.3f; /* large, so the student is far from uniform and rows differ */
}

/* The reference: every cached sequence through the model built here and tkd_kl_ref_f64. */
static void reference(const char *cache, const tkd_kl_params *p, tkd_kl_result *r)
{
    tkd_cache_reader *rd = NULL;
    assert_int_equal(tkd_cache_reader_open(&rd, cache, NULL), TKD_OK);
    assert_int_equal(tkd_cache_reader_num_seq(rd), NSEQ);
    tkd_cache_batch cb;
    assert_int_equal(tkd_cache_batch_alloc(&cb, NSEQ, T, K, S), TKD_OK);
    assert_int_equal(tkd_cache_reader_read(rd, 0, NSEQ, &cb, 0), TKD_OK);
    int32_t *in = malloc(sizeof(int32_t) * NSEQ * T), *lab = malloc(sizeof(int32_t) * NSEQ * T);
    for (int i = 0; i < NSEQ; i++)
        for (int t = 0; t < T; t++) {
            in[i * T + t] = cb.tokens[i * (T + 1) + t];
            lab[i * T + t] = cb.tokens[i * (T + 1) + t + 1];
        }
    tkd_model_config mc;
    student_config(&mc);
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&mc, SEED, &m), TKD_OK);
    const void *hidden = NULL;
    assert_int_equal(tkd_model_forward(m, in, NSEQ, T, 0, &hidden), TKD_OK);
    tkd_kl_batch b = {.n = NSEQ * T, .d = D, .v = V, .h = hidden, .w = tkd_model_lm_head(m),
                      .topk_idx = (const int32_t *)cb.topk_indices, .topk_logit = cb.topk_logits,
                      .teacher_lse = cb.lse, .tail_idx = (const int32_t *)cb.tail_indices, .labels = lab};
    assert_int_equal(tkd_kl_ref_f64(p, &b, r, NULL, NULL), TKD_OK);
    tkd_model_free(m);
    free(in);
    free(lab);
    tkd_cache_batch_free(&cb);
    tkd_cache_reader_close(rd);
}

static void check_variant(tkd_test_student_dir *sd, const char *variant, tkd_kl_variant v)
{
    char cache_set[4300], val_set[4300], name[64], variant_set[64];
    snprintf(cache_set, sizeof cache_set, "data.cache=%s", sd->cache);
    snprintf(val_set, sizeof val_set, "data.val_cache=%s", sd->cache);
    snprintf(variant_set, sizeof variant_set, "kd.variant=%s", variant);
    snprintf(name, sizeof name, "wiring-%s", variant);
    const char *sets[] = {cache_set, val_set, variant_set, "kd.alpha=0.6", "kd.temperature=1",
                          "train.eval_only=true", "train.batch_size=5", /* 12 = 5 + 5 + 2: a short last batch */
                          "train.seed=99", "model.hidden_size=32", "model.intermediate_size=64",
                          "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
                          "model.max_position_embeddings=16", "model.init_std=0.3", "device=cpu"};
    tkd_train_result res;
    assert_int_equal(tkd_test_student_train(sd->runs, name, sets, sizeof sets / sizeof sets[0], 0, &res), TKD_OK);

    tkd_kl_params p;
    tkd_kl_params_defaults(&p, K);
    p.variant = v;
    p.alpha = 0.6f;
    p.s = v == TKD_KL_VARIANT_SAMPLED ? S : 0;
    tkd_kl_result r;
    reference(sd->cache, &p, &r);
    assert_int_equal(r.n_kept, NSEQ * T);
    /* fp32 forward and fp32 logits in the trainer against double from the same fp32 hidden states:
     * the loss agrees to ~1e-7; 1e-5 relative leaves room and still catches any misplaced row */
    assert_true(tkd_test_close(res.val_loss, r.loss, 0, 1e-5));
    assert_true(tkd_test_close(res.val_kd, r.kd, 0, 1e-5));
    assert_true(tkd_test_close(res.val_ce, r.ce, 0, 1e-5));
    assert_true(fabs(r.kd - r.ce) > 0.1); /* both halves matter: swapping them would fail */
}

static void test_reported_loss_is_the_reference_loss(void **state)
{
    (void)state;
    tkd_test_teacher_opts o = {.vocab = V, .hidden = 32, .seq_len = T, .k = K, .tail_samples = S,
                               .temperature = 1.0f, .num_seq = NSEQ, .shard_seqs = 5, .seed = 5};
    tkd_test_student_dir sd;
    assert_int_equal(tkd_test_student_dir_make(&sd, "wiring", &o), TKD_OK);
    check_variant(&sd, "renorm", TKD_KL_VARIANT_RENORM);
    check_variant(&sd, "tail", TKD_KL_VARIANT_TAIL);
    check_variant(&sd, "sampled", TKD_KL_VARIANT_SAMPLED);
    tkd_test_student_dir_free(&sd);
}

/* kd.variant's allowed values are the loss's own list of names (one declaration, in kl_loss.h),
 * in the enum's order. */
static void test_variant_names_declared_once(void **state)
{
    (void)state;
    const tkd_config_field *f = tkd_config_find(&tkd_train_schema, "kd.variant");
    assert_non_null(f);
    assert_ptr_equal(f->allowed, tkd_kl_variant_names);
    for (int i = 0; tkd_kl_variant_names[i]; i++)
        assert_int_equal(tkd_kl_variant_parse(tkd_kl_variant_names[i]), i);
    assert_string_equal(tkd_kl_variant_names[TKD_KL_VARIANT_SAMPLED], "sampled");
    assert_null(tkd_kl_variant_names[TKD_KL_VARIANT_SAMPLED + 1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_variant_names_declared_once),
                                       cmocka_unit_test(test_reported_loss_is_the_reference_loss)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
