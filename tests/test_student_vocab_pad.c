/* test_student_vocab_pad.c — a cache whose vocabulary is padded past the student's (the teacher's
 * embedding larger than its tokenizer, e.g. Qwen2.5-7B's 152064 rows against Qwen2.5-0.5B's
 * 151936): the loader maps every teacher entry beyond the student's V before the loss sees it
 * (tkd_loader_fit_vocab), the loss of a mapped row equals the loss of the row without those entries
 * (renorm: renormalised over the rest; sampled: their mass in the tail), data that uses an extra id
 * is refused, and student-train runs end to end, reporting the count in metrics.jsonl. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/cache_reader.h"
#include "kernels/loss/kl_loss.h"
#include "student_train/loader.h"
#include "student_train/train.h"
#include "tests/testutil.h"

/* The cache's V = 64 (a random teacher: about a quarter of its top-k lies in [48, 64)); the data's
 * tokens are folded below VS = 48, the student's vocabulary. */
enum { V = 64, VS = 56, T = 12, K = 6, S = 3, NSEQ = 24, D = 8 };
_Static_assert(S == 3, "fold_tokens checks three draws");

static int has_u(const uint32_t *ids, int n, uint32_t id)
{
    for (int e = 0; e < n; e++)
        if (ids[e] == id)
            return 1;
    return 0;
}

/* Folds the tokens below VS and gives each row a draw within VS (the smallest id the row does not
 * use), except in sequence ALL_BEYOND, whose first row keeps only draws beyond VS. */
enum { ALL_BEYOND = NSEQ - 1 };
static void fold_tokens(tkd_cache_batch *b, int64_t g0, void *ctx)
{
    (void)ctx;
    for (int64_t i = 0; i < b->num_seq * (b->seq_len + 1); i++)
        b->tokens[i] %= VS;
    for (int64_t r = 0; r < b->num_seq * b->seq_len; r++) {
        uint32_t *dr = b->tail_indices + r * S, *idx = b->topk_indices + r * K;
        if (g0 + r / T == ALL_BEYOND && r % T == 0) {
            for (int d = 0; d < S; d++)
                for (dr[d] = V - 1; has_u(idx, K, dr[d]) || has_u(dr, d, dr[d]);)
                    dr[d]--;
            continue;
        }
        if (dr[0] >= VS && dr[1] >= VS && dr[2] >= VS)
            for (dr[0] = 0; has_u(idx, K, dr[0]) || has_u(dr + 1, S - 1, dr[0]);)
                dr[0]++;
    }
}

static const tkd_test_teacher_opts teacher = {.vocab = V, .hidden = 16, .seq_len = T, .k = K, .tail_samples = S,
                                              .temperature = 1.0f, .num_seq = NSEQ, .shard_seqs = 8,
                                              .seed = 5, .edit = fold_tokens};

static int setup(void **state) { return tkd_test_student_setup(state, "vocabpad", &teacher); }

typedef struct opened {
    tkd_cache_reader *cache;
    tkd_loader *l;
    tkd_cache_batch full; /* every sequence as stored */
} opened;

static void open_all(const tkd_test_student_dir *f, opened *o, int vocab, int renorm)
{
    memset(o, 0, sizeof *o);
    int64_t split[NSEQ];
    for (int i = 0; i < NSEQ; i++)
        split[i] = i;
    tkd_loader_opts lo = {.batch_size = NSEQ - 1, .seq_len = T, .k = K, .with_tail = 1, .prefetch = 2, .shuffle = 0};
    assert_int_equal(tkd_cache_reader_open(&o->cache, f->cache, NULL), TKD_OK);
    assert_int_equal(tkd_cache_batch_alloc(&o->full, NSEQ, T, K, S), TKD_OK);
    assert_int_equal(tkd_cache_reader_read(o->cache, 0, NSEQ, &o->full, 0), TKD_OK);
    assert_int_equal(tkd_loader_open(&o->l, o->cache, NULL, split, NSEQ, &lo), TKD_OK);
    assert_int_equal(tkd_loader_fit_vocab(o->l, vocab, renorm), TKD_OK);
    assert_int_equal(tkd_loader_seek(o->l, 0, 0), TKD_OK);
}

static void close_all(opened *o)
{
    tkd_loader_close(o->l);
    tkd_cache_batch_free(&o->full);
    tkd_cache_reader_close(o->cache);
}

static int has(const int32_t *ids, int n, int32_t id)
{
    for (int e = 0; e < n; e++)
        if (ids[e] == id)
            return 1;
    return 0;
}

/* Entries within VS stay as stored; each beyond gets a free id < VS and the dropped logit; draws
 * beyond VS become the row's first draw within; the batch counts them all. */
static void test_loader_maps_entries_beyond(void **state)
{
    opened o;
    open_all(*state, &o, VS, 0);
    const tkd_train_batch *b = NULL;
    tkd_status st = tkd_loader_next(o.l, &b);
    if (st != TKD_OK)
        print_error("%s\n", tkd_error_msg());
    assert_int_equal(st, TKD_OK);
    assert_non_null(b);
    int64_t beyond = 0;
    for (int64_t r = 0; r < (int64_t)(NSEQ - 1) * T; r++) {
        const uint32_t *ci = o.full.topk_indices + r * K, *cd = o.full.tail_indices + r * S;
        const int32_t *bi = b->topk_idx + r * K, *bd = b->tail_idx + r * S;
        for (int j = 0; j < K; j++) {
            assert_true(bi[j] >= 0 && bi[j] < VS);
            assert_false(has(bi, j, bi[j]) || has(bd, S, bi[j])); /* distinct, never a draw */
            if (ci[j] < VS) {
                assert_int_equal(bi[j], (int32_t)ci[j]);
                assert_true(b->topk_logit[r * K + j] == o.full.topk_logits[r * K + j]);
            } else {
                assert_true(b->topk_logit[r * K + j] == TKD_LOADER_DROPPED_LOGIT);
                beyond++;
            }
        }
        for (int d = 0; d < S; d++) {
            assert_true(bd[d] >= 0 && bd[d] < VS);
            if (cd[d] < VS)
                assert_int_equal(bd[d], (int32_t)cd[d]);
            beyond += cd[d] >= VS;
        }
    }
    assert_true(beyond > 0); /* the fixture does exercise the mapping */
    assert_int_equal(b->beyond_vocab, beyond);
    close_all(&o);
}

/* A row whose tail draws all lie beyond: nothing in the student's vocabulary stands for the tail
 * there, refused naming the sequence (the second batch holds sequence ALL_BEYOND alone). */
static void test_loader_refuses_row_without_draws(void **state)
{
    opened o;
    open_all(*state, &o, VS, 0);
    const tkd_train_batch *b = NULL;
    assert_int_equal(tkd_loader_next(o.l, &b), TKD_OK);
    assert_int_equal(tkd_loader_next(o.l, &b), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("sequence 23 position 0: every teacher tail draw lies beyond");
    close_all(&o);
}

/* Data using an id >= the student's vocabulary: the extra ids are not unused, refused by name. */
static void test_loader_refuses_tokens_beyond(void **state)
{
    opened o;
    open_all(*state, &o, VS - 8, 0);
    const tkd_train_batch *b = NULL;
    assert_int_equal(tkd_loader_next(o.l, &b), TKD_ERR_MISMATCH);
    tkd_test_assert_msg_has("beyond the student's vocabulary of 48");
    close_all(&o);
}

/* The loss of row r as mapped equals the loss of the same row with its entries beyond VS left out
 * (the compacted row, k'' = the entries kept): loss and both gradients, by the float64 reference. */
static void check_row_equals_compacted(const opened *o, const tkd_train_batch *b, int64_t r, tkd_kl_variant var)
{
    float h[D], w[VS * D];
    tkd_test_randn(h, D, 100 + (uint64_t)r, 1.0f);
    tkd_test_randn(w, VS * D, 200, 1.0f);
    int32_t cidx[K], label = b->labels[r];
    float clog[K];
    int kept = 0;
    for (int j = 0; j < K; j++)
        if (o->full.topk_indices[r * K + j] < VS) {
            cidx[kept] = (int32_t)o->full.topk_indices[r * K + j];
            clog[kept++] = o->full.topk_logits[r * K + j];
        }
    const int s = var == TKD_KL_VARIANT_SAMPLED ? S : 0;
    tkd_kl_params pm = tkd_test_kl_params(var, 1.0, 1.0, K, K, s), pc = tkd_test_kl_params(var, 1.0, 1.0, kept, kept, s);
    tkd_kl_batch bm = {.n = 1, .d = D, .v = VS, .h = h, .w = w, .topk_idx = b->topk_idx + r * K,
                       .topk_logit = b->topk_logit + r * K, .teacher_lse = b->teacher_lse + r,
                       .tail_idx = s ? b->tail_idx + r * S : NULL, .labels = &label};
    tkd_kl_batch bc = bm;
    bc.topk_idx = cidx;
    bc.topk_logit = clog;
    tkd_kl_result rm, rc;
    double dhm[D], dhc[D], dwm[VS * D], dwc[VS * D];
    assert_int_equal(tkd_kl_validate(&pm, &bm), TKD_OK);
    assert_int_equal(tkd_kl_ref_f64(&pm, &bm, &rm, dhm, dwm), TKD_OK);
    assert_int_equal(tkd_kl_ref_f64(&pc, &bc, &rc, dhc, dwc), TKD_OK);
    assert_true(tkd_test_close(rm.kd, rc.kd, 1e-12, 1e-12)); /* the same sums in double */
    for (int i = 0; i < D; i++)
        assert_true(tkd_test_close(dhm[i], dhc[i], 1e-12, 1e-12));
    for (int i = 0; i < VS * D; i++)
        assert_true(tkd_test_close(dwm[i], dwc[i], 1e-12, 1e-12));
}

static void check_variant_exact(void **state, tkd_kl_variant var)
{
    opened o;
    open_all(*state, &o, VS, var == TKD_KL_VARIANT_RENORM);
    const tkd_train_batch *b = NULL;
    tkd_status st = tkd_loader_next(o.l, &b);
    if (st != TKD_OK)
        print_error("%s\n", tkd_error_msg());
    assert_int_equal(st, TKD_OK);
    int checked = 0;
    for (int64_t r = 0; r < (int64_t)(NSEQ - 1) * T; r++) {
        int n_beyond = 0, draws_beyond = 0;
        for (int j = 0; j < K; j++)
            n_beyond += o.full.topk_indices[r * K + j] >= VS;
        for (int d = 0; d < S; d++)
            draws_beyond += o.full.tail_indices[r * S + d] >= VS;
        if (n_beyond == 0 || n_beyond == K || (var == TKD_KL_VARIANT_SAMPLED && draws_beyond))
            continue; /* rows whose only change is the columns (a replaced draw changes the target) */
        check_row_equals_compacted(&o, b, r, var);
        checked++;
    }
    assert_true(checked >= 10);
    close_all(&o);
}

static void test_renorm_drops_and_renormalises(void **state) { check_variant_exact(state, TKD_KL_VARIANT_RENORM); }
static void test_sampled_mass_joins_tail(void **state) { check_variant_exact(state, TKD_KL_VARIANT_SAMPLED); }

/* End to end: a random student of 48 ids on the cache of 64 trains, counting the mapped entries. */
static void test_train_end_to_end(void **state)
{
    const tkd_test_student_dir *f = *state;
    char cache_set[4300], metrics[4400];
    snprintf(cache_set, sizeof cache_set, "data.cache=%s", f->cache);
    const char *sets[] = {"model.hidden_size=16", "model.intermediate_size=32", "model.num_layers=1",
                          "model.num_heads=2", "model.num_kv_heads=2", "model.max_position_embeddings=16",
                          "model.vocab_size=56", "train.batch_size=4", "train.max_steps=3", "train.log_interval=1",
                          "kd.variant=tail", "device=cpu", cache_set};
    tkd_train_result res;
    tkd_status st = tkd_test_student_train(f->runs, "pad", sets, sizeof sets / sizeof *sets, 0, &res);
    if (st != TKD_OK)
        print_error("%s\n", tkd_error_msg());
    assert_int_equal(st, TKD_OK);
    assert_true(isfinite(res.val_loss));
    snprintf(metrics, sizeof metrics, "%s/pad/metrics.jsonl", f->runs);
    double n[8];
    assert_int_equal(tkd_test_metrics(metrics, "train", "beyond_vocab", n, 8), 3);
    assert_true(n[0] > 0 && n[1] > 0 && n[2] > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_loader_maps_entries_beyond),
        cmocka_unit_test(test_loader_refuses_tokens_beyond),
        cmocka_unit_test(test_loader_refuses_row_without_draws),
        cmocka_unit_test(test_renorm_drops_and_renormalises),
        cmocka_unit_test(test_sampled_mass_joins_tail),
        cmocka_unit_test(test_train_end_to_end),
    };
    return cmocka_run_group_tests(tests, setup, tkd_test_student_teardown);
}
