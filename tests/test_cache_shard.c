/* test_cache_shard.c — shard writer/reader round trips: every logits dtype, shape edges (k = 1,
 * one sequence, a partial last chunk, batches not aligned to chunks), tail indices present and
 * absent, reading only the first k' columns, atomic publication, and h5dump through the plugin. */
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

#include <hdf5.h>
#include <zstd.h>

#include "common/half.h"
#include "common/fileio.h"
#include "common/sha256.h"
#include "formats/h5zstd.h"
#include "formats/cache_shard.h"
#include "tests/cache_testutil.h"
#include "tests/testutil.h"

/* What a stored logit reads back as: the float rounded to the shard dtype and widened again. */
static float stored(float x, tkd_cache_dtype dt)
{
    switch (dt) {
    case TKD_CACHE_DTYPE_HALF: return tkd_f16_to_f32(tkd_f32_to_f16(x));
    case TKD_CACHE_DTYPE_BFLOAT16: return tkd_bf16_to_f32(tkd_f32_to_bf16(x));
    default: return x;
    }
}

/* Reads every sequence of the shard at `path` with k' columns (one read per `run` sequences) and
 * checks each value against the generator. */
static void check_shard(const char *path, const tkd_cache_identity *id, int64_t first_seq,
                        int64_t num_seq, int32_t kp, int64_t run, int with_tail)
{
    tkd_shard *s = NULL;
    assert_int_equal(tkd_shard_open(&s, path, 0), TKD_OK);
    const tkd_shard_info *in = tkd_shard_get_info(s);
    assert_int_equal(in->num_seq, num_seq);
    assert_int_equal(in->first_seq, first_seq);
    assert_int_equal(tkd_cache_identity_compare(&in->id, "shard", id, "writer"), TKD_OK);
    tkd_cache_batch got, want;
    int32_t S = with_tail ? id->tail_samples : 0;
    assert_int_equal(tkd_cache_batch_alloc(&got, run, id->seq_len, kp, S), TKD_OK);
    assert_int_equal(tkd_cache_batch_alloc(&want, 1, id->seq_len, id->k, id->tail_samples), TKD_OK);
    size_t T = (size_t)id->seq_len;
    for (int64_t i0 = 0; i0 < num_seq; i0 += run) {
        int64_t n = num_seq - i0 < run ? num_seq - i0 : run;
        assert_int_equal(tkd_shard_read(s, i0, n, &got, 0), TKD_OK);
        for (int64_t j = 0; j < n; j++) {
            int64_t g = first_seq + i0 + j;
            tkd_test_cache_fill(&want, id, g, 1);
            assert_int_equal(got.cache_seq[j], g);
            assert_int_equal(got.seq_index[j], want.seq_index[0]);
            assert_memory_equal(got.tokens + j * (T + 1), want.tokens, (T + 1) * 4);
            assert_memory_equal(got.lse + j * T, want.lse, T * 4);
            for (size_t t = 0; t < T; t++)
                for (int32_t c = 0; c < kp; c++) {
                    size_t gi = ((size_t)j * T + t) * (size_t)kp + (size_t)c;
                    size_t wi = t * (size_t)id->k + (size_t)c;
                    assert_int_equal(got.topk_indices[gi], want.topk_indices[wi]);
                    /* exact: the reader widens the same 16 bits the writer rounded to */
                    float w = stored(want.topk_logits[wi], id->logits_dtype);
                    assert_memory_equal(&got.topk_logits[gi], &w, 4);
                }
            if (S > 0)
                assert_memory_equal(got.tail_indices + j * T * (size_t)S, want.tail_indices,
                                    T * (size_t)S * 4);
        }
    }
    tkd_cache_batch_free(&got);
    tkd_cache_batch_free(&want);
    tkd_shard_close(s);
}

static void roundtrip(tkd_cache_dtype dt, int32_t T, int32_t k, int32_t S, int64_t num_seq,
                      int64_t batch, int64_t chunk)
{
    char *dir = tkd_test_mkdtemp("shard");
    char path[4200];
    snprintf(path, sizeof path, "%s/shard-00000.h5", dir);
    tkd_cache_identity id = tkd_test_cache_identity(T, k, S, dt);
    tkd_cache_shard_entry e;
    assert_int_equal(tkd_test_cache_write_shard(path, &id, 40, num_seq, batch, chunk, &e), TKD_OK);
    assert_int_equal(e.num_seq, num_seq);
    assert_int_equal(e.first_seq, 40);
    assert_string_equal(e.file, "shard-00000.h5");
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(e.bytes, (uint64_t)st.st_size);
    check_shard(path, &id, 40, num_seq, k, 1, 1);       /* one sequence at a time */
    check_shard(path, &id, 40, num_seq, k, 3, 0);       /* runs crossing chunk edges, no tail */
    if (k > 1)
        check_shard(path, &id, 40, num_seq, k - 1, 2, S > 0); /* first k' columns only */
    tkd_test_rmdtemp(dir);
}

static void test_roundtrip_half(void **state)
{
    (void)state;
    roundtrip(TKD_CACHE_DTYPE_HALF, 7, 5, 0, 11, 3, 4); /* 11 = 2 full chunks of 4 + 3 */
}

static void test_roundtrip_bfloat16(void **state)
{
    (void)state;
    roundtrip(TKD_CACHE_DTYPE_BFLOAT16, 7, 5, 0, 11, 4, 3);
}

static void test_roundtrip_float32(void **state)
{
    (void)state;
    roundtrip(TKD_CACHE_DTYPE_FLOAT32, 5, 6, 0, 9, 9, 2);
}

static void test_edges_k1_one_sequence(void **state)
{
    (void)state;
    roundtrip(TKD_CACHE_DTYPE_HALF, 3, 1, 0, 1, 1, 4);     /* k = 1, one sequence, partial chunk */
    roundtrip(TKD_CACHE_DTYPE_BFLOAT16, 1, 1, 0, 5, 2, 0); /* seq_len 1, automatic chunking */
}

static void test_tail_indices(void **state)
{
    (void)state;
    roundtrip(TKD_CACHE_DTYPE_HALF, 6, 4, 3, 7, 2, 3);
    roundtrip(TKD_CACHE_DTYPE_FLOAT32, 2, 1, 1, 2, 2, 1);
}

/* A shard of 3 sequences (T 4, k columns of dt, no tail draws; chunks of 2) written to
 * <dir>/shard-00000.h5, whose path goes to path; its identity. */
static tkd_cache_identity three_sequences(char *path, size_t cap, const char *dir, int32_t k, tkd_cache_dtype dt)
{
    snprintf(path, cap, "%s/shard-00000.h5", dir);
    tkd_cache_identity id = tkd_test_cache_identity(4, k, 0, dt);
    assert_int_equal(tkd_test_cache_write_shard(path, &id, 0, 3, 3, 2, NULL), TKD_OK);
    return id;
}

static void test_kprime_is_first_columns(void **state)
{
    char path[4200];
    three_sequences(path, sizeof path, *state, 8, TKD_CACHE_DTYPE_FLOAT32);
    tkd_shard *s = NULL;
    assert_int_equal(tkd_shard_open(&s, path, 0), TKD_OK);
    tkd_cache_batch full, part;
    assert_int_equal(tkd_cache_batch_alloc(&full, 3, 4, 8, 0), TKD_OK);
    assert_int_equal(tkd_cache_batch_alloc(&part, 3, 4, 3, 0), TKD_OK);
    assert_int_equal(tkd_shard_read(s, 0, 3, &full, 0), TKD_OK);
    assert_int_equal(tkd_shard_read(s, 0, 3, &part, 0), TKD_OK);
    for (int r = 0; r < 3 * 4; r++) {
        assert_memory_equal(part.topk_indices + r * 3, full.topk_indices + r * 8, 3 * 4);
        assert_memory_equal(part.topk_logits + r * 3, full.topk_logits + r * 8, 3 * 4);
        /* sorted largest first, so the first k' are the k' largest */
        assert_true(part.topk_logits[r * 3] >= part.topk_logits[r * 3 + 2]);
    }
    /* k' > k is refused, not silently clamped */
    tkd_cache_batch wide;
    assert_int_equal(tkd_cache_batch_alloc(&wide, 1, 4, 9, 0), TKD_OK);
    assert_int_equal(tkd_shard_read(s, 0, 1, &wide, 0), TKD_ERR_INVALID_ARG);
    tkd_cache_batch_free(&wide);
    tkd_cache_batch_free(&full);
    tkd_cache_batch_free(&part);
    tkd_shard_close(s);
}

static void test_publish_is_atomic(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char path[4200], tmp[4300];
    snprintf(path, sizeof path, "%s/shard-00003.h5", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    tkd_cache_identity id = tkd_test_cache_identity(4, 2, 0, TKD_CACHE_DTYPE_HALF);
    tkd_cache_batch b;
    assert_int_equal(tkd_cache_batch_alloc(&b, 2, 4, 2, 0), TKD_OK);
    tkd_test_cache_fill(&b, &id, 0, 2);
    tkd_shard_writer *w = NULL;
    assert_int_equal(tkd_shard_writer_open(&w, path, &id, 0, NULL), TKD_OK);
    assert_int_equal(tkd_shard_writer_append(w, &b), TKD_OK);
    assert_int_equal(access(path, F_OK), -1); /* only the .tmp exists while writing */
    assert_int_equal(access(tmp, F_OK), 0);
    tkd_shard_writer_abort(w);
    assert_int_equal(access(tmp, F_OK), -1);
    assert_int_equal(access(path, F_OK), -1);

    assert_int_equal(tkd_shard_writer_open(&w, path, &id, 0, NULL), TKD_OK);
    assert_int_equal(tkd_shard_writer_append(w, &b), TKD_OK);
    assert_int_equal(tkd_shard_writer_num_seq(w), 2);
    tkd_cache_shard_entry e;
    assert_int_equal(tkd_shard_writer_finish(w, &e), TKD_OK);
    assert_int_equal(access(tmp, F_OK), -1);
    char hex[TKD_SHA256_HEX_LEN];
    uint64_t bytes = 0;
    assert_int_equal(tkd_sha256_file_hex(path, hex), TKD_OK);
    assert_int_equal(tkd_file_size(path, &bytes), TKD_OK);
    assert_string_equal(hex, e.sha256);
    assert_int_equal(bytes, e.bytes);
    /* a mismatched batch is an argument error, not a crash */
    assert_int_equal(tkd_shard_writer_open(&w, path, &id, 0, NULL), TKD_OK);
    b.k = 3;
    assert_int_equal(tkd_shard_writer_append(w, &b), TKD_ERR_INVALID_ARG);
    b.k = 2;
    tkd_shard_writer_abort(w);
    assert_int_equal(access(path, F_OK), 0); /* the published shard is untouched */
    tkd_cache_batch_free(&b);
}

static void test_dtype_names(void **state)
{
    (void)state;
    tkd_cache_dtype dt;
    assert_int_equal(tkd_cache_dtype_parse("float16", &dt), TKD_OK);
    assert_int_equal(dt, TKD_CACHE_DTYPE_HALF);
    assert_int_equal(tkd_cache_dtype_parse("bf16", &dt), TKD_OK);
    assert_int_equal(dt, TKD_CACHE_DTYPE_BFLOAT16);
    assert_int_equal(tkd_cache_dtype_parse("int8", &dt), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "half, bfloat16, float32"));
    assert_string_equal(tkd_cache_dtype_name(TKD_CACHE_DTYPE_FLOAT32), "float32");
}

/* h5dump (a stock HDF5 tool) reads the shard through build/plugins/libh5zstd.so and prints the
 * logits we wrote: the plugin and the HDF5 half type are readable outside our code. */
static void test_h5dump_reads_through_plugin(void **state)
{
    (void)state;
    if (system("command -v h5dump >/dev/null 2>&1") != 0) {
        printf("skipped: h5dump is not installed (scripts/setup.sh installs hdf5-tools)\n");
        skip();
    }
    char *dir = tkd_test_mkdtemp("h5dump");
    char path[4200], cmd[8800];
    snprintf(path, sizeof path, "%s/shard-00000.h5", dir);
    tkd_cache_identity id = tkd_test_cache_identity(3, 2, 0, TKD_CACHE_DTYPE_HALF);
    assert_int_equal(tkd_test_cache_write_shard(path, &id, 0, 2, 2, 1, NULL), TKD_OK);
    snprintf(cmd, sizeof cmd,
             "HDF5_PLUGIN_PATH='%s/plugins' h5dump -w 0 -m '%%.6f' -d /topk/logits '%s' 2>&1",
             TKD_BINARY_DIR, path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    static char out[1 << 16];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int rc = pclose(p);
    if (rc != 0)
        fprintf(stderr, "h5dump output:\n%s\n", out);
    assert_int_equal(rc, 0);
    /* values follow "DATA {" as "(i,j,k): v, v," lines; parse every number after a colon */
    char *data = strstr(out, "DATA {");
    assert_non_null(data);
    tkd_cache_batch want;
    assert_int_equal(tkd_cache_batch_alloc(&want, 2, 3, 2, 0), TKD_OK);
    tkd_test_cache_fill(&want, &id, 0, 2);
    size_t count = 0;
    for (char *line = strtok(data, "\n"); line; line = strtok(NULL, "\n")) {
        char *q = strstr(line, "):");
        if (!q)
            continue;
        q += 2;
        for (;;) {
            char *end;
            double v = strtod(q, &end);
            if (end == q)
                break;
            assert_true(count < 12);
            float w = stored(want.topk_logits[count], TKD_CACHE_DTYPE_HALF);
            /* h5dump prints 6 decimals of the widened half: equal within that rounding */
            assert_true(tkd_test_close(v, w, 1e-6, 0));
            count++;
            q = end;
            while (*q == ',' || *q == ' ')
                q++;
        }
    }
    assert_int_equal(count, 12); /* 2 sequences x 3 positions x 2 columns */
    tkd_cache_batch_free(&want);
    tkd_test_rmdtemp(dir);
}

/* Runs the filter function the way HDF5 does, on a buffer from HDF5's allocator. */
static size_t run_filter(unsigned flags, const void *in, size_t n, void **out)
{
    void *buf = H5allocate_memory(n ? n : 1, 0);
    memcpy(buf, in, n);
    size_t size = n, level = 3;
    unsigned cd = (unsigned)level;
    size_t got = tkd_h5zstd_class.filter(flags, 1, &cd, n, &size, &buf);
    *out = buf;
    return got;
}

static void test_zstd_filter_direct(void **state)
{
    (void)state;
    enum { N = 10000 };
    static uint8_t data[N];
    for (int i = 0; i < N; i++)
        data[i] = (uint8_t)((i * 7) % 13);
    void *c = NULL, *d = NULL;
    size_t cn = run_filter(0, data, N, &c);
    assert_true(cn > 0 && cn < N / 10); /* periodic data compresses well */
    assert_int_equal(ZSTD_getFrameContentSize(c, cn), N);
    assert_int_equal(run_filter(H5Z_FLAG_REVERSE, c, cn, &d), N);
    assert_memory_equal(d, data, N);
    H5free_memory(d);
    /* a frame without a content size (as streaming compressors write) still decodes */
    ZSTD_CCtx *cctx = ZSTD_createCCtx();
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 0);
    static uint8_t frame[N + 1024];
    ZSTD_outBuffer o = {frame, sizeof frame, 0};
    ZSTD_inBuffer i = {data, N, 0};
    assert_int_equal(ZSTD_compressStream2(cctx, &o, &i, ZSTD_e_end), 0);
    ZSTD_freeCCtx(cctx);
    assert_int_equal(ZSTD_getFrameContentSize(frame, o.pos), ZSTD_CONTENTSIZE_UNKNOWN);
    assert_int_equal(run_filter(H5Z_FLAG_REVERSE, frame, o.pos, &d), N);
    assert_memory_equal(d, data, N);
    H5free_memory(d);
    /* truncated or garbage input is a failure (0), never a crash */
    assert_int_equal(run_filter(H5Z_FLAG_REVERSE, c, cn / 2, &d), 0);
    H5free_memory(d);
    assert_int_equal(run_filter(H5Z_FLAG_REVERSE, frame, o.pos - 3, &d), 0);
    H5free_memory(d);
    assert_int_equal(run_filter(H5Z_FLAG_REVERSE, "garbage!", 8, &d), 0);
    H5free_memory(d);
    H5free_memory(c);
    assert_int_equal(tkd_h5zstd_register(), TKD_OK); /* idempotent */
    assert_int_equal(tkd_h5zstd_register(), TKD_OK);
    assert_true(H5Zfilter_avail(TKD_H5ZSTD_FILTER_ID) > 0);
}

static void test_bytes_per_token(void **state)
{
    (void)state;
    tkd_cache_identity id = tkd_test_cache_identity(64, 100, 0, TKD_CACHE_DTYPE_HALF);
    assert_true(tkd_cache_raw_bytes_per_token(&id) == 604.0); /* (4 + 2)·100 + 4 */
    id.logits_dtype = TKD_CACHE_DTYPE_FLOAT32;
    id.tail_samples = 80;
    assert_true(tkd_cache_raw_bytes_per_token(&id) == 804.0 + 320.0);
    assert_true(tkd_cache_bytes_per_token(6400, 10, 64) == 10.0);
    assert_true(tkd_cache_bytes_per_token(6400, 0, 64) == 0.0);
    /* a real shard compresses: the generator's indices are regular, logits are not */
    char *dir = tkd_test_mkdtemp("bpt");
    char path[4200];
    snprintf(path, sizeof path, "%s/shard-00000.h5", dir);
    id = tkd_test_cache_identity(64, 32, 0, TKD_CACHE_DTYPE_HALF);
    tkd_cache_shard_entry e;
    assert_int_equal(tkd_test_cache_write_shard(path, &id, 0, 16, 8, 0, &e), TKD_OK);
    double bpt = tkd_cache_bytes_per_token(e.bytes, e.num_seq, id.seq_len);
    printf("  shard of 16 x 64 tokens, k = 32 half: %.1f bytes/token stored, %.0f raw\n", bpt,
           tkd_cache_raw_bytes_per_token(&id));
    /* observed 65 of 196 raw; a shard whose datasets went uncompressed would store the raw bytes plus
     * HDF5's overhead (>= 196), so 0.6 of raw leaves a margin and still catches a missing filter */
    assert_true(bpt > 0 && bpt < tkd_cache_raw_bytes_per_token(&id) * 0.6);
    tkd_test_rmdtemp(dir);
}

/* A shard from before the tail draws (no tail_samples attribute, no /tail group) reads with S = 0. */
static void test_shard_without_tail_attribute(void **state)
{
    char path[4200];
    tkd_cache_identity id = three_sequences(path, sizeof path, *state, 2, TKD_CACHE_DTYPE_HALF);
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    assert_true(H5Adelete(f, "tail_samples") >= 0);
    H5Fclose(f);
    check_shard(path, &id, 0, 3, 2, 3, 0);
}

/* tkd_cache_dtype_exact_below: every float below it is stored within tol (checked on a dense sweep of
 * each binade and on the last float below it), and it is tight: the binade above holds a value
 * rounded by more than tol (a bound one binade too low would make teacher-dump round-trip every
 * logit of a real teacher for nothing). */
static void test_exact_below(void **state)
{
    (void)state;
    assert_true(tkd_cache_dtype_exact_below(TKD_CACHE_DTYPE_HALF, 0.125) == 512.0f);
    assert_true(tkd_cache_dtype_exact_below(TKD_CACHE_DTYPE_BFLOAT16, 0.125) == 64.0f);
    assert_true(isinf(tkd_cache_dtype_exact_below(TKD_CACHE_DTYPE_FLOAT32, 0.125)));
    assert_true(tkd_cache_dtype_exact_below(TKD_CACHE_DTYPE_HALF, 1e6) == 65504.0f); /* capped at the range */
    const tkd_cache_dtype dts[] = {TKD_CACHE_DTYPE_HALF, TKD_CACHE_DTYPE_BFLOAT16};
    const double tols[] = {0.125, 0.0875, 0.3, 2.0, 1e-3};
    for (int d = 0; d < 2; d++)
        for (size_t t = 0; t < sizeof tols / sizeof tols[0]; t++) {
            const float lim = tkd_cache_dtype_exact_below(dts[d], tols[t]);
            double worst_below = 0.0, worst_above = 0.0;
            for (float lo = lim / 4096.0f; lo < lim; lo *= 2.0f) /* 12 binades below, 1024 steps each */
                for (int i = 0; i < 1024; i++) {
                    const float x = lo * (1.0f + (float)i / 1024.0f) * (i % 2 ? -1.0f : 1.0f);
                    if (fabsf(x) < lim)
                        worst_below = fmax(worst_below, fabs(tkd_cache_dtype_round(dts[d], x) - (double)x));
                }
            const float last = nextafterf(lim, 0.0f);
            worst_below = fmax(worst_below, fabs(tkd_cache_dtype_round(dts[d], last) - (double)last));
            for (int i = 0; i < 4096; i++) {
                const float x = lim * (1.0f + (float)i / 4096.0f);
                if (fabsf(x) <= tkd_cache_dtype_max(dts[d]))
                    worst_above = fmax(worst_above, fabs(tkd_cache_dtype_round(dts[d], x) - (double)x));
            }
            if (!(worst_below <= tols[t]))
                fail_msg("%s, tol %g: below %g a value is rounded by %g", tkd_cache_dtype_name(dts[d]), tols[t],
                         (double)lim, worst_below);
            if (lim < tkd_cache_dtype_max(dts[d]) && !(worst_above > tols[t]))
                fail_msg("%s, tol %g: %g is not tight (the next binade rounds by at most %g)",
                         tkd_cache_dtype_name(dts[d]), tols[t], (double)lim, worst_above);
        }
}

TKD_TEST_MAIN_EACH_DIR(test_roundtrip_half, test_roundtrip_bfloat16, test_roundtrip_float32,
    test_edges_k1_one_sequence, test_tail_indices, test_kprime_is_first_columns, test_publish_is_atomic,
    test_dtype_names, test_h5dump_reads_through_plugin, test_zstd_filter_direct, test_bytes_per_token,
    test_shard_without_tail_attribute, test_exact_below)
