/* test_student_loader.c — student-train's loader (student_train/loader.h) over a tiny teacher cache
 * and over a token file: each epoch visits every sequence of its split exactly once, with the
 * contents the cache holds for it; the order is a function of (seed, epoch) only; a seek resumes
 * mid-epoch with the same batches; k' < k hands out exactly the first k' columns, and a shorter
 * seq_len the first positions. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/cache_reader.h"
#include "formats/tokens.h"
#include "student_train/loader.h"
#include "tests/testutil.h"

enum { V = 64, T = 12, K = 6, S = 3, NSEQ = 30 };

typedef struct fixture {
    char *dir;
    tkd_cache_reader *cache;
    tkd_cache_batch full; /* every sequence, all k columns and tail draws, read directly */
    int64_t every[NSEQ];  /* the split of every sequence: 0 .. NSEQ - 1 */
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    f->dir = tkd_test_mkdtemp("loader");
    for (int64_t g = 0; g < NSEQ; g++)
        f->every[g] = g;
    /* 30 sequences in shards of 8 (the last of 6), chunks of 2: batches cross shard boundaries */
    tkd_test_teacher_opts o = {.vocab = V, .hidden = 16, .seq_len = T, .k = K, .tail_samples = S,
                               .temperature = 1.0f, .num_seq = NSEQ, .shard_seqs = 8, .chunk_seqs = 2, .seed = 3};
    if (tkd_test_teacher_cache(f->dir, &o) != TKD_OK || tkd_cache_reader_open(&f->cache, f->dir, NULL) != TKD_OK ||
        tkd_cache_batch_alloc(&f->full, NSEQ, T, K, S) != TKD_OK ||
        tkd_cache_reader_read(f->cache, 0, NSEQ, &f->full, 0) != TKD_OK) {
        fprintf(stderr, "setup: %s\n", tkd_error_msg());
        return -1;
    }
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    tkd_cache_batch_free(&f->full);
    tkd_cache_reader_close(f->cache);
    tkd_test_rmdtemp(f->dir);
    free(f);
    return 0;
}

static tkd_loader_opts opts(int batch, int seq_len, int k, int with_tail, uint64_t seed)
{
    tkd_loader_opts o = {.batch_size = batch, .seq_len = seq_len, .k = k, .with_tail = with_tail, .prefetch = 2,
                         .seed = seed, .shuffle = 1};
    return o;
}

/* Checks slot j of batch b against what the cache holds for sequence g (first t positions and
 * first b->k columns). */
static void check_slot(const fixture *f, const tkd_train_batch *b, int j, int64_t g)
{
    const tkd_cache_batch *c = &f->full;
    for (int p = 0; p < b->t; p++) {
        size_t row = (size_t)j * b->t + p, src = (size_t)g * T + p;
        assert_int_equal(b->inputs[row], c->tokens[g * (T + 1) + p]);
        assert_int_equal(b->labels[row], c->tokens[g * (T + 1) + p + 1]);
        assert_true(b->teacher_lse[row] == c->lse[src]);
        for (int q = 0; q < b->k; q++) {
            assert_int_equal(b->topk_idx[row * b->k + q], (int32_t)c->topk_indices[src * K + q]);
            assert_true(b->topk_logit[row * b->k + q] == c->topk_logits[src * K + q]);
        }
        for (int q = 0; q < b->s; q++)
            assert_int_equal(b->tail_idx[row * b->s + q], (int32_t)c->tail_indices[src * S + q]);
    }
}

/* Reads one whole epoch into seen[] (sequence ids in batch order); returns how many. */
static int64_t read_epoch(const fixture *f, tkd_loader *l, int64_t epoch, int64_t *seen, int batch)
{
    assert_int_equal(tkd_loader_seek(l, epoch, 0), TKD_OK);
    int64_t n = 0;
    const tkd_train_batch *b = NULL;
    for (;;) {
        assert_int_equal(tkd_loader_next(l, &b), TKD_OK);
        if (!b)
            break;
        assert_true(b->b >= 1 && b->b <= batch);
        for (int j = 0; j < b->b; j++) {
            check_slot(f, b, j, b->seq[j]);
            seen[n++] = b->seq[j];
        }
        int64_t e, off;
        tkd_loader_position(l, &e, &off);
        assert_int_equal(e, epoch);
        assert_int_equal(off, n);
    }
    return n;
}

/* A split of 21 sequences (those not a multiple of 3, and 27) from all four shards: each
 * epoch gives each of them once and nothing else, in batches of 4 (the last of 3). */
static void test_each_sequence_once_per_epoch(void **state)
{
    fixture *f = *state;
    int64_t split[NSEQ], n = 0;
    for (int64_t g = 0; g < NSEQ; g++)
        if (g % 3 != 0 || g == 27)
            split[n++] = g;
    assert_int_equal(n, 21);
    tkd_loader *l = NULL;
    tkd_loader_opts o = opts(4, T, 0, 1, 11);
    assert_int_equal(tkd_loader_open(&l, f->cache, NULL, split, n, &o), TKD_OK);
    assert_int_equal(tkd_loader_size(l), n);
    int64_t seen[3][NSEQ];
    for (int e = 0; e < 3; e++) {
        assert_int_equal(read_epoch(f, l, e, seen[e], 4), n);
        int count[NSEQ] = {0};
        for (int64_t i = 0; i < n; i++) {
            assert_true(seen[e][i] >= 0 && seen[e][i] < NSEQ);
            count[seen[e][i]]++;
        }
        for (int64_t i = 0; i < n; i++)
            assert_int_equal(count[split[i]], 1);
        /* the order the loader reports for this epoch is the order it handed out */
        int64_t order[NSEQ];
        tkd_loader_epoch_order(l, e, order);
        assert_memory_equal(order, seen[e], (size_t)n * sizeof(int64_t));
    }
    /* shuffled: not the split's order, and a new order each epoch */
    assert_true(memcmp(seen[0], split, (size_t)n * sizeof(int64_t)) != 0);
    assert_true(memcmp(seen[0], seen[1], (size_t)n * sizeof(int64_t)) != 0);
    assert_true(memcmp(seen[1], seen[2], (size_t)n * sizeof(int64_t)) != 0);
    tkd_loader_close(l);

    /* shuffle = 0 (evaluation) keeps the split's order */
    o.shuffle = 0;
    assert_int_equal(tkd_loader_open(&l, f->cache, NULL, split, n, &o), TKD_OK);
    assert_int_equal(read_epoch(f, l, 5, seen[0], 4), n);
    assert_memory_equal(seen[0], split, (size_t)n * sizeof(int64_t));
    tkd_loader_close(l);
}

/* Orders of the whole cache for (seed, epoch): equal for equal pairs, different otherwise. */
static void test_seeds_and_epochs_select_the_order(void **state)
{
    fixture *f = *state;
    tkd_loader *a = NULL, *b = NULL, *c = NULL;
    tkd_loader_opts oa = opts(5, T, 0, 0, 1234), ob = opts(5, T, 0, 0, 1234), oc = opts(5, T, 0, 0, 1235);
    assert_int_equal(tkd_loader_open(&a, f->cache, NULL, f->every, NSEQ, &oa), TKD_OK);
    assert_int_equal(tkd_loader_open(&b, f->cache, NULL, f->every, NSEQ, &ob), TKD_OK);
    assert_int_equal(tkd_loader_open(&c, f->cache, NULL, f->every, NSEQ, &oc), TKD_OK);
    int64_t sa[NSEQ], sb[NSEQ], sc[NSEQ];
    for (int e = 0; e < 3; e++) {
        assert_int_equal(read_epoch(f, a, e, sa, 5), NSEQ);
        assert_int_equal(read_epoch(f, b, e, sb, 5), NSEQ);
        assert_int_equal(read_epoch(f, c, e, sc, 5), NSEQ);
        assert_memory_equal(sa, sb, sizeof sa);             /* same seed, same epoch: same batches */
        assert_true(memcmp(sa, sc, sizeof sa) != 0);         /* another seed: another order */
    }
    /* many seeds: the first sequence of epoch 0 is not always the same (30 candidates) */
    int firsts[NSEQ] = {0}, distinct = 0;
    for (uint64_t seed = 0; seed < 20; seed++) {
        tkd_loader *d = NULL;
        tkd_loader_opts od = opts(5, T, 0, 0, seed);
        assert_int_equal(tkd_loader_open(&d, f->cache, NULL, f->every, NSEQ, &od), TKD_OK);
        int64_t order[NSEQ];
        tkd_loader_epoch_order(d, 0, order);
        distinct += firsts[order[0]]++ == 0;
        tkd_loader_close(d);
    }
    assert_true(distinct >= 8);
    tkd_loader_close(a);
    tkd_loader_close(b);
    tkd_loader_close(c);
}

/* seek(epoch, offset) mid-epoch continues with exactly the batches an uninterrupted epoch gives
 * from there (how a resumed run picks up its data). */
static void test_seek_resumes_mid_epoch(void **state)
{
    fixture *f = *state;
    tkd_loader *l = NULL;
    tkd_loader_opts o = opts(4, T, 0, 1, 99);
    assert_int_equal(tkd_loader_open(&l, f->cache, NULL, f->every, NSEQ, &o), TKD_OK);
    int64_t all[NSEQ];
    assert_int_equal(read_epoch(f, l, 2, all, 4), NSEQ);
    assert_int_equal(tkd_loader_seek(l, 2, 12), TKD_OK);
    int64_t n = 12;
    const tkd_train_batch *b = NULL;
    for (assert_int_equal(tkd_loader_next(l, &b), TKD_OK); b; assert_int_equal(tkd_loader_next(l, &b), TKD_OK)) {
        for (int j = 0; j < b->b; j++)
            assert_int_equal(b->seq[j], all[n++]);
    }
    assert_int_equal(n, NSEQ);
    /* the end of an epoch is a valid position (a checkpoint taken right at it) */
    assert_int_equal(tkd_loader_seek(l, 2, NSEQ), TKD_OK);
    assert_int_equal(tkd_loader_next(l, &b), TKD_OK);
    assert_null(b);
    assert_int_equal(tkd_loader_seek(l, 2, NSEQ + 1), TKD_ERR_INVALID_ARG);
    tkd_loader_close(l);
}

/* k' = 2 of k = 6 and seq_len 7 of 12: the batch holds k = 2 columns, equal to the first two
 * stored ones, for the first 7 positions; no tail buffer unless asked for. */
static void test_topk_and_seq_len_truncation(void **state)
{
    fixture *f = *state;
    int ks[3] = {2, 1, K};
    for (int i = 0; i < 3; i++) {
        tkd_loader *l = NULL;
        tkd_loader_opts o = opts(8, 7, ks[i], 0, 5);
        assert_int_equal(tkd_loader_open(&l, f->cache, NULL, f->every, NSEQ, &o), TKD_OK);
        assert_int_equal(tkd_loader_seek(l, 0, 0), TKD_OK);
        const tkd_train_batch *b = NULL;
        assert_int_equal(tkd_loader_next(l, &b), TKD_OK);
        assert_non_null(b);
        assert_int_equal(b->k, ks[i]);
        assert_int_equal(b->t, 7);
        assert_int_equal(b->s, 0);
        assert_null(b->tail_idx);
        for (int j = 0; j < b->b; j++)
            check_slot(f, b, j, b->seq[j]); /* compares with the first k' columns of the full rows */
        tkd_loader_close(l);
    }
    /* k = 0 asks for every column; a longer seq_len than the cache's is refused */
    tkd_loader *l = NULL;
    tkd_loader_opts o = opts(8, T, 0, 0, 5);
    assert_int_equal(tkd_loader_open(&l, f->cache, NULL, f->every, NSEQ, &o), TKD_OK);
    assert_int_equal(tkd_loader_seek(l, 0, 0), TKD_OK);
    const tkd_train_batch *b = NULL;
    assert_int_equal(tkd_loader_next(l, &b), TKD_OK);
    assert_int_equal(b->k, K);
    tkd_loader_close(l);
    o.seq_len = T + 1;
    assert_int_equal(tkd_loader_open(&l, f->cache, NULL, f->every, NSEQ, &o), TKD_ERR_MISMATCH);
    assert_null(l);
    assert_non_null(strstr(tkd_error_msg(), "seq_len 13"));
}

/* A token file of 100 tokens (token i = 1000 + i) in windows of 9 + 1: 12 windows (the last
 * padded), each once per epoch with its own tokens, shuffled. */
static void test_token_windows_once_per_epoch(void **state)
{
    fixture *f = *state;
    char path[4200];
    snprintf(path, sizeof path, "%s/tokens.bin", f->dir);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    int32_t header[256] = {20240520, 1, 100};
    fwrite(header, sizeof header, 1, fp);
    for (int i = 0; i < 100; i++) {
        uint16_t t = (uint16_t)(1000 + i);
        fwrite(&t, sizeof t, 1, fp);
    }
    fclose(fp);
    tkd_tokens *tok = NULL;
    assert_int_equal(tkd_tokens_open(path, &tok), TKD_OK);
    int64_t nw = tkd_tokens_num_windows(tok, 9, 9, 1);
    assert_int_equal(nw, 11);
    int64_t split[16];
    for (int64_t i = 0; i < nw; i++)
        split[i] = i;
    tkd_loader *l = NULL;
    tkd_loader_opts o = opts(3, 9, 0, 0, 8);
    assert_int_equal(tkd_loader_open(&l, NULL, tok, split, nw, &o), TKD_OK);
    for (int e = 0; e < 2; e++) {
        assert_int_equal(tkd_loader_seek(l, e, 0), TKD_OK);
        int count[16] = {0}, in_order = 1, n = 0;
        const tkd_train_batch *b = NULL;
        for (assert_int_equal(tkd_loader_next(l, &b), TKD_OK); b; assert_int_equal(tkd_loader_next(l, &b), TKD_OK)) {
            assert_int_equal(b->k, 0);
            assert_null(b->topk_idx);
            for (int j = 0; j < b->b; j++) {
                int64_t w = b->seq[j];
                count[w]++;
                in_order &= w == n++;
                for (int p = 0; p < 9; p++) {
                    int64_t tpos = w * 9 + p;
                    assert_int_equal(b->inputs[j * 9 + p], tpos < 100 ? 1000 + tpos : 0);
                    assert_int_equal(b->labels[j * 9 + p], tpos + 1 < 100 ? 1000 + tpos + 1 : -100);
                }
            }
        }
        for (int64_t w = 0; w < nw; w++)
            assert_int_equal(count[w], 1);
        assert_false(in_order);
    }
    tkd_loader_close(l);
    tkd_tokens_free(tok);
}

/* An llm.c GPT-2 file at path of n tokens 1000, 1001, ... and its flags sidecar path.flags.npy
 * (numpy format 1.0, '|u1', header padded to 128 bytes) holding flags (n). */
static void write_flagged(const char *path, const uint8_t *flags, int n)
{
    char side[4300], h[128];
    snprintf(side, sizeof side, "%s.flags.npy", path);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    int32_t header[256] = {20240520, 1, n};
    fwrite(header, sizeof header, 1, fp);
    for (int i = 0; i < n; i++) {
        uint16_t t = (uint16_t)(1000 + i);
        fwrite(&t, sizeof t, 1, fp);
    }
    fclose(fp);
    fp = fopen(side, "wb");
    assert_non_null(fp);
    memcpy(h, "\x93NUMPY\x01\x00\x76\x00", 10); /* magic, version 1.0, 118 header bytes follow */
    int m = 10 + snprintf(h + 10, sizeof h - 10, "{'descr': '|u1', 'fortran_order': False, 'shape': (%d,), }", n);
    memset(h + m, ' ', sizeof h - (size_t)m);
    h[127] = '\n';
    fwrite(h, sizeof h, 1, fp);
    fwrite(flags, 1, (size_t)n, fp);
    fclose(fp);
}

/* The same token file with a flags sidecar that trains every third token: student-train's batches
 * keep every input, and label only the trained targets (the rest -100, left out of CE and KD). */
static void test_token_windows_with_flags(void **state)
{
    fixture *f = *state;
    char path[4200];
    snprintf(path, sizeof path, "%s/flagged.bin", f->dir);
    uint8_t fl[100];
    for (int i = 0; i < 100; i++)
        fl[i] = i % 3 == 0 ? TKD_TOKENS_FLAG_TRAINED : 0;
    write_flagged(path, fl, 100);
    tkd_tokens *tok = NULL;
    assert_int_equal(tkd_tokens_open(path, &tok), TKD_OK);
    int64_t nw = tkd_tokens_num_windows(tok, 9, 9, 1), split[16];
    for (int64_t i = 0; i < nw; i++)
        split[i] = i;
    tkd_loader *l = NULL;
    tkd_loader_opts o = opts(3, 9, 0, 0, 8);
    assert_int_equal(tkd_loader_open(&l, NULL, tok, split, nw, &o), TKD_OK);
    assert_int_equal(tkd_loader_seek(l, 0, 0), TKD_OK);
    const tkd_train_batch *b = NULL;
    int labelled = 0;
    for (assert_int_equal(tkd_loader_next(l, &b), TKD_OK); b; assert_int_equal(tkd_loader_next(l, &b), TKD_OK))
        for (int j = 0; j < b->b; j++)
            for (int p = 0; p < 9; p++) {
                int64_t tpos = b->seq[j] * 9 + p;
                assert_int_equal(b->inputs[j * 9 + p], tpos < 100 ? 1000 + tpos : 0);
                bool trained = tpos + 1 < 100 && (tpos + 1) % 3 == 0;
                assert_int_equal(b->labels[j * 9 + p], trained ? 1000 + tpos + 1 : -100);
                labelled += trained;
            }
    assert_int_equal(labelled, 33); /* tokens 3, 6, ..., 99 */
    tkd_loader_close(l);
    tkd_tokens_free(tok);
}

/* data.packing: documents over a token file whose flags sidecar records documents of 5, 1, 13 and
 * 11 tokens and leaves token 3 untrained: at seq_len 8 the loader hands out 5 sequences (5+1 | 8 |
 * 5 | 8 | 3), labels never across a document nor on an untrained token, and each position's
 * document start for the forward. */
static void test_packed_documents(void **state)
{
    fixture *f = *state;
    enum { N = 30, T = 8, X = -100 };
    char path[4200];
    snprintf(path, sizeof path, "%s/docs.bin", f->dir);
    uint8_t fl[N];
    for (int i = 0; i < N; i++)
        fl[i] = (i == 3 ? 0 : TKD_TOKENS_FLAG_TRAINED) |
                (i == 0 || i == 5 || i == 6 || i == 19 ? TKD_TOKENS_FLAG_DOC_START : 0);
    write_flagged(path, fl, N);
    tkd_tokens *tok = NULL;
    assert_int_equal(tkd_tokens_open(path, &tok), TKD_OK);
    tkd_doc_pack *pack = NULL;
    assert_int_equal(tkd_doc_pack_build(tok, T, &pack), TKD_OK);
    assert_int_equal(tkd_doc_pack_count(pack), 5);
    int64_t split[5] = {0, 1, 2, 3, 4};
    tkd_loader *l = NULL;
    tkd_loader_opts o = opts(5, T, 0, 0, 8);
    o.shuffle = 0;
    o.pack = pack;
    assert_int_equal(tkd_loader_open(&l, NULL, tok, split, 5, &o), TKD_OK);
    assert_int_equal(tkd_loader_seek(l, 0, 0), TKD_OK);
    const tkd_train_batch *b = NULL;
    assert_int_equal(tkd_loader_next(l, &b), TKD_OK);
    assert_int_equal(b->b, 5);
    static const int32_t in[5][T] = {{1000, 1001, 1002, 1003, 1004, 1005, 0, 0},
                                     {1006, 1007, 1008, 1009, 1010, 1011, 1012, 1013},
                                     {1014, 1015, 1016, 1017, 1018, 0, 0, 0},
                                     {1019, 1020, 1021, 1022, 1023, 1024, 1025, 1026},
                                     {1027, 1028, 1029, 0, 0, 0, 0, 0}};
    static const int32_t lab[5][T] = {{1001, 1002, X, 1004, X, X, X, X},
                                      {1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014},
                                      {1015, 1016, 1017, 1018, X, X, X, X},
                                      {1020, 1021, 1022, 1023, 1024, 1025, 1026, 1027},
                                      {1028, 1029, X, X, X, X, X, X}};
    static const int32_t doc[5][T] = {{0, 0, 0, 0, 0, 5, 6, 6}, {0}, {0, 0, 0, 0, 0, 5, 5, 5}, {0}, {0, 0, 0, 3, 3, 3, 3, 3}};
    assert_non_null(b->doc);
    for (int j = 0; j < 5; j++) {
        assert_memory_equal(b->inputs + j * T, in[j], sizeof in[j]);
        assert_memory_equal(b->labels + j * T, lab[j], sizeof lab[j]);
        assert_memory_equal(b->doc + j * T, doc[j], sizeof doc[j]);
    }
    tkd_loader_close(l);
    tkd_doc_pack_free(pack);
    tkd_tokens_free(tok);
}

/* Tail draws asked of a cache without them: a clear error, nothing leaked. */
static void test_tail_needs_a_cache_with_draws(void **state)
{
    fixture *f = *state;
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/notail", f->dir);
    tkd_test_teacher_opts to = {.vocab = V, .hidden = 16, .seq_len = T, .k = K, .temperature = 1.0f,
                                .num_seq = 4, .shard_seqs = 4, .seed = 3};
    assert_int_equal(tkd_test_teacher_cache(dir, &to), TKD_OK);
    tkd_cache_reader *r = NULL;
    assert_int_equal(tkd_cache_reader_open(&r, dir, NULL), TKD_OK);
    int64_t split[4] = {0, 1, 2, 3};
    tkd_loader *l = NULL;
    tkd_loader_opts o = opts(2, T, 0, 1, 1);
    assert_int_equal(tkd_loader_open(&l, r, NULL, split, 4, &o), TKD_ERR_MISMATCH);
    assert_null(l);
    assert_non_null(strstr(tkd_error_msg(), "no tail draws"));
    tkd_cache_reader_close(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_sequence_once_per_epoch),
        cmocka_unit_test(test_seeds_and_epochs_select_the_order),
        cmocka_unit_test(test_seek_resumes_mid_epoch),
        cmocka_unit_test(test_topk_and_seq_len_truncation),
        cmocka_unit_test(test_token_windows_once_per_epoch),
        cmocka_unit_test(test_token_windows_with_flags),
        cmocka_unit_test(test_packed_documents),
        cmocka_unit_test(test_tail_needs_a_cache_with_draws),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
