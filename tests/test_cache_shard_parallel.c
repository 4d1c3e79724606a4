/* test_cache_shard_parallel.c — the shard writer's parallel path (chunks filtered by us on several
 * threads, written with H5Dwrite_chunk) makes the file its H5Dwrite path makes.
 *
 * The same batches go through both (reference: opts.h5dwrite; parallel: 1 to 4 threads) over every
 * logits dtype, tail draws, chunk sizes the batches do not line up with (a partial chunk carried
 * from one append to the next, an empty append, a partial last chunk), and automatic chunking.
 * Each dataset must have the same creation properties (chunking, filters, zstd level), the same
 * shape, and the same stored chunks byte for byte (H5Dread_chunk, filter mask 0: all filters
 * applied); and the shards must read back the same values through tkd_shard_read. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hdf5.h>

#include "formats/cache_shard.h"
#include "formats/h5zstd.h"
#include "tests/cache_testutil.h"
#include "tests/testutil.h"

static const char *const datasets[] = {"/tokens", "/topk/indices", "/topk/logits", "/lse", "/seq_index",
                                       "/tail/indices"};
enum { NDATASETS = sizeof datasets / sizeof *datasets };

/* Appends batches of sizes[0..n) sequences (global numbers from 0) and publishes the shard. */
static void write_shard(const char *path, const tkd_cache_identity *id, const int64_t *sizes, int n,
                        const tkd_shard_writer_opts *o)
{
    int64_t most = 1;
    for (int i = 0; i < n; i++)
        most = sizes[i] > most ? sizes[i] : most;
    tkd_cache_batch b;
    assert_int_equal(tkd_cache_batch_alloc(&b, most, id->seq_len, id->k, id->tail_samples), TKD_OK);
    tkd_shard_writer *w = NULL;
    if (tkd_shard_writer_open(&w, path, id, 0, o) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    int64_t g = 0;
    for (int i = 0; i < n; g += sizes[i], i++) {
        tkd_test_cache_fill(&b, id, g, sizes[i]);
        if (tkd_shard_writer_append(w, &b) != TKD_OK)
            fail_msg("%s", tkd_error_msg());
    }
    if (tkd_shard_writer_finish(w, NULL) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    tkd_cache_batch_free(&b);
}

/* The filter pipeline of a dataset as (id, first cd_value) pairs, in order. */
static int filters_of(hid_t ds, unsigned ids[8], unsigned cd0[8])
{
    hid_t dcpl = H5Dget_create_plist(ds);
    int n = H5Pget_nfilters(dcpl);
    assert_true(n >= 0 && n <= 8);
    for (int i = 0; i < n; i++) {
        unsigned flags, cd[4] = {0};
        size_t ncd = 4;
        ids[i] = (unsigned)H5Pget_filter2(dcpl, (unsigned)i, &flags, &ncd, cd, 0, NULL, NULL);
        cd0[i] = ncd ? cd[0] : 0;
    }
    H5Pclose(dcpl);
    return n;
}

static hsize_t chunk_rows_of(hid_t ds)
{
    hid_t dcpl = H5Dget_create_plist(ds);
    hsize_t chunk[3] = {0, 0, 0};
    assert_int_equal(H5Pget_layout(dcpl), H5D_CHUNKED);
    assert_true(H5Pget_chunk(dcpl, 3, chunk) >= 1);
    H5Pclose(dcpl);
    return chunk[0];
}

/* The stored bytes of the chunk at row `row` of ds (malloc'd), its size and filter mask. */
static uint8_t *raw_chunk(hid_t ds, hsize_t row, hsize_t *size, uint32_t *mask)
{
    hsize_t off[3] = {row, 0, 0};
    assert_true(H5Dget_chunk_storage_size(ds, off, size) >= 0 && *size > 0);
    uint8_t *buf = malloc(*size);
    assert_non_null(buf);
    assert_true(H5Dread_chunk(ds, H5P_DEFAULT, off, mask, buf) >= 0);
    return buf;
}

/* Dataset `name` of files a (reference) and b: same pipeline, shape, chunking and chunk bytes. */
static void compare_dataset(hid_t fa, hid_t fb, const char *name)
{
    hid_t a = H5Dopen2(fa, name, H5P_DEFAULT), b = H5Dopen2(fb, name, H5P_DEFAULT);
    assert_true(a >= 0 && b >= 0);
    unsigned ida[8], idb[8], cda[8], cdb[8];
    int nf = filters_of(a, ida, cda);
    assert_int_equal(nf, 3); /* shuffle, zstd, fletcher32 */
    assert_int_equal(filters_of(b, idb, cdb), nf);
    for (int i = 0; i < nf; i++) {
        assert_int_equal(ida[i], idb[i]);
        assert_int_equal(cda[i], cdb[i]);
    }
    hsize_t rows = chunk_rows_of(a), dims_a[3] = {0}, dims_b[3] = {0}, na = 0, nb = 0;
    assert_int_equal(chunk_rows_of(b), rows);
    hid_t sa = H5Dget_space(a), sb = H5Dget_space(b);
    assert_int_equal(H5Sget_simple_extent_dims(sa, dims_a, NULL), H5Sget_simple_extent_dims(sb, dims_b, NULL));
    assert_memory_equal(dims_a, dims_b, sizeof dims_a);
    assert_true(H5Dget_num_chunks(a, sa, &na) >= 0 && H5Dget_num_chunks(b, sb, &nb) >= 0);
    assert_int_equal(na, (dims_a[0] + rows - 1) / rows);
    assert_int_equal(nb, na);
    for (hsize_t row = 0; row < dims_a[0]; row += rows) {
        hsize_t size_a, size_b;
        uint32_t mask_a = 9, mask_b = 9;
        uint8_t *ca = raw_chunk(a, row, &size_a, &mask_a), *cb = raw_chunk(b, row, &size_b, &mask_b);
        if (mask_a != 0 || mask_b != 0 || size_a != size_b || memcmp(ca, cb, size_a) != 0)
            fail_msg("%s, chunk at row %llu: H5Dwrite stored %llu bytes (mask %u), the parallel path %llu "
                     "(mask %u), or the bytes differ", name, (unsigned long long)row, (unsigned long long)size_a,
                     mask_a, (unsigned long long)size_b, mask_b);
        free(ca);
        free(cb);
    }
    H5Sclose(sa);
    H5Sclose(sb);
    H5Dclose(a);
    H5Dclose(b);
}

/* Both shards, read whole through tkd_shard_read: every buffer equal. */
static void compare_values(const char *pa, const char *pb, const tkd_cache_identity *id, int64_t num_seq)
{
    tkd_shard *sa = NULL, *sb = NULL;
    tkd_cache_batch ba, bb;
    assert_int_equal(tkd_shard_open(&sa, pa, 0), TKD_OK);
    assert_int_equal(tkd_shard_open(&sb, pb, 0), TKD_OK);
    assert_int_equal(tkd_shard_get_info(sb)->num_seq, num_seq);
    assert_int_equal(tkd_cache_batch_alloc(&ba, num_seq, id->seq_len, id->k, id->tail_samples), TKD_OK);
    assert_int_equal(tkd_cache_batch_alloc(&bb, num_seq, id->seq_len, id->k, id->tail_samples), TKD_OK);
    assert_int_equal(tkd_shard_read(sa, 0, num_seq, &ba, 0), TKD_OK);
    assert_int_equal(tkd_shard_read(sb, 0, num_seq, &bb, 0), TKD_OK);
    size_t n = (size_t)num_seq, T = (size_t)id->seq_len, k = (size_t)id->k, S = (size_t)id->tail_samples;
    assert_memory_equal(ba.tokens, bb.tokens, n * (T + 1) * 4);
    assert_memory_equal(ba.topk_indices, bb.topk_indices, n * T * k * 4);
    assert_memory_equal(ba.topk_logits, bb.topk_logits, n * T * k * 4);
    assert_memory_equal(ba.lse, bb.lse, n * T * 4);
    assert_memory_equal(ba.seq_index, bb.seq_index, n * 8);
    if (S)
        assert_memory_equal(ba.tail_indices, bb.tail_indices, n * T * S * 4);
    tkd_cache_batch_free(&ba);
    tkd_cache_batch_free(&bb);
    tkd_shard_close(sa);
    tkd_shard_close(sb);
}

/* Writes the batches both ways (the parallel path with `threads`) and compares the two files. */
static void both_ways(tkd_cache_dtype dt, int32_t T, int32_t k, int32_t S, int64_t chunk, const int64_t *sizes,
                      int n, int threads)
{
    tkd_cache_identity id = tkd_test_cache_identity(T, k, S, dt);
    const char *ref = tkd_test_path(tkd_test_group_dir, "ref.h5");
    const char *par = tkd_test_path(tkd_test_group_dir, "par.h5");
    tkd_shard_writer_opts o = {.zstd_level = 5, .chunk_seqs = chunk, .tail_seed = 7, .h5dwrite = 1};
    write_shard(ref, &id, sizes, n, &o);
    o.h5dwrite = 0;
    o.threads = threads;
    write_shard(par, &id, sizes, n, &o);
    int64_t num_seq = 0;
    for (int i = 0; i < n; i++)
        num_seq += sizes[i];
    hid_t fa = H5Fopen(ref, H5F_ACC_RDONLY, H5P_DEFAULT), fb = H5Fopen(par, H5F_ACC_RDONLY, H5P_DEFAULT);
    assert_true(fa >= 0 && fb >= 0);
    for (int d = 0; d < NDATASETS; d++)
        if (S > 0 || strcmp(datasets[d], "/tail/indices") != 0)
            compare_dataset(fa, fb, datasets[d]);
    H5Fclose(fa);
    H5Fclose(fb);
    compare_values(ref, par, &id, num_seq);
}

static void test_half_partial_chunks_between_appends(void **state)
{
    (void)state;
    /* chunks of 3: 0-2 (two appends), 3-5, 6-8 (from the held rows 6-7 and the append of 3, whose
     * last two rows are held in turn), 9-11 and 12 alone (the partial last chunk) */
    const int64_t sizes[] = {1, 2, 5, 0, 3, 2};
    both_ways(TKD_CACHE_DTYPE_HALF, 7, 5, 0, 3, sizes, 6, 1);
    both_ways(TKD_CACHE_DTYPE_HALF, 7, 5, 0, 3, sizes, 6, 3);
}

static void test_bfloat16_tail_one_sequence_chunks(void **state)
{
    (void)state;
    const int64_t sizes[] = {2, 3};
    both_ways(TKD_CACHE_DTYPE_BFLOAT16, 6, 4, 3, 1, sizes, 2, 3);
}

static void test_float32_chunk_spans_appends(void **state)
{
    (void)state;
    const int64_t sizes[] = {2, 2, 2, 2, 1}; /* every chunk of 4 is filled by two appends */
    both_ways(TKD_CACHE_DTYPE_FLOAT32, 5, 6, 0, 4, sizes, 5, 2);
}

static void test_automatic_chunking(void **state)
{
    (void)state;
    const int64_t sizes[] = {10, 70}; /* a whole chunk of 64 sequences and a partial one of 16 */
    tkd_cache_identity id = tkd_test_cache_identity(33, 9, 0, TKD_CACHE_DTYPE_HALF);
    assert_int_equal(tkd_shard_default_chunk_seqs(&id), 64);
    both_ways(TKD_CACHE_DTYPE_HALF, 33, 9, 0, 0, sizes, 2, 4);
}

/* Many chunks of some size on 4 threads: chunks really are filtered at the same time (a context
 * shared between threads would garble some of them). */
static void test_many_chunks_many_threads(void **state)
{
    (void)state;
    const int64_t sizes[] = {24, 24, 15};
    both_ways(TKD_CACHE_DTYPE_HALF, 96, 40, 8, 1, sizes, 3, 4);
}

static void test_thread_count(void **state)
{
    (void)state;
    assert_int_equal(tkd_shard_writer_threads(3), 3);
    int cores = omp_get_num_procs(), want = cores - 1 < 8 ? cores - 1 : 8;
    assert_int_equal(tkd_shard_writer_threads(0), want < 1 ? 1 : want);
    tkd_cache_identity id = tkd_test_cache_identity(4, 2, 0, TKD_CACHE_DTYPE_HALF);
    const char *path = tkd_test_path(tkd_test_group_dir, "bad.h5");
    const int bad[] = {-1, TKD_SHARD_WRITER_MAX_THREADS + 1};
    for (int i = 0; i < 2; i++) {
        tkd_shard_writer_opts o = {.threads = bad[i]};
        tkd_shard_writer *w = NULL;
        assert_int_equal(tkd_shard_writer_open(&w, path, &id, 0, &o), TKD_ERR_INVALID_ARG);
        assert_null(w);
        tkd_test_assert_msg_has("threads");
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_half_partial_chunks_between_appends),
        cmocka_unit_test(test_bfloat16_tail_one_sequence_chunks),
        cmocka_unit_test(test_float32_chunk_spans_appends),
        cmocka_unit_test(test_automatic_chunking),
        cmocka_unit_test(test_many_chunks_many_threads),
        cmocka_unit_test(test_thread_count),
    };
    return cmocka_run_group_tests(tests, tkd_test_group_dir_setup, tkd_test_group_dir_teardown);
}
