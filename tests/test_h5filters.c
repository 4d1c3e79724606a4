/* test_h5filters.c — our shuffle, fletcher32 and whole shard pipeline make the bytes HDF5 makes.
 *
 * Each case lets HDF5 write a chunked dataset through its own filters (H5Dwrite), reads the stored
 * chunks back raw (H5Dread_chunk) and compares them with what formats/h5filters.c makes from the same
 * data: shuffle alone over element sizes 1, 2, 3, 4, 8; fletcher32 alone over odd and even lengths
 * around its 360-word folding blocks, with bytes that drive the sums to their limits; and the shard
 * pipeline (shuffle → zstd → fletcher32) at several levels, including a partial edge chunk, which
 * HDF5 pads with zeros before filtering. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include <hdf5.h>

#include "formats/h5filters.h"
#include "formats/h5zstd.h"
#include "tests/testutil.h"

enum { FILTER_SHUFFLE = 1, FILTER_ZSTD = 2, FILTER_FLETCHER = 4 };

static uint8_t pattern_byte(int pattern, size_t i, uint64_t *x)
{
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    switch (pattern) {
    case 0: return 0xff;                        /* drives both sums as high as they go */
    case 1: return (uint8_t)(*x >> 56);         /* random */
    default: return (uint8_t)(i % 7 == 0 ? i : 0); /* mostly zeros: compressible */
    }
}

static uint8_t *make_bytes(size_t n, int pattern, uint64_t seed)
{
    uint8_t *p = malloc(n ? n : 1);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = pattern_byte(pattern, i, &seed);
    return p;
}

/* Writes `total` elements of type `type` (data: total · its size bytes) as dataset "d" of
 * `chunk`-element chunks with the given filters through H5Dwrite, into a file returned by path. */
static const char *hdf5_write(hid_t type, const void *data, hsize_t total, hsize_t chunk, int filters, int level)
{
    const char *path = tkd_test_path(tkd_test_group_dir, "filters.h5");
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t sp = H5Screate_simple(1, &total, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    unsigned cd = (unsigned)level;
    assert_true(f >= 0 && sp >= 0 && dcpl >= 0 && H5Pset_chunk(dcpl, 1, &chunk) >= 0);
    if (filters & FILTER_SHUFFLE)
        assert_true(H5Pset_shuffle(dcpl) >= 0);
    if (filters & FILTER_ZSTD)
        assert_true(H5Pset_filter(dcpl, TKD_H5ZSTD_FILTER_ID, H5Z_FLAG_MANDATORY, 1, &cd) >= 0);
    if (filters & FILTER_FLETCHER)
        assert_true(H5Pset_fletcher32(dcpl) >= 0);
    hid_t ds = H5Dcreate2(f, "d", type, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    assert_true(ds >= 0 && H5Dwrite(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0);
    H5Dclose(ds);
    H5Pclose(dcpl);
    H5Sclose(sp);
    assert_true(H5Fclose(f) >= 0);
    return path;
}

/* The stored bytes of the chunk of path's dataset "d" that starts at element `at` (malloc'd, *size
 * set); its filter mask must be 0 (every filter applied). */
static uint8_t *hdf5_read_chunk(const char *path, hsize_t at, size_t *size)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t ds = H5Dopen2(f, "d", H5P_DEFAULT);
    hsize_t stored = 0;
    assert_true(ds >= 0 && H5Dget_chunk_storage_size(ds, &at, &stored) >= 0 && stored > 0);
    uint8_t *buf = malloc(stored);
    uint32_t mask = 99;
    assert_non_null(buf);
    assert_true(H5Dread_chunk(ds, H5P_DEFAULT, &at, &mask, buf) >= 0);
    assert_int_equal(mask, 0);
    H5Dclose(ds);
    H5Fclose(f);
    *size = (size_t)stored;
    return buf;
}

static uint8_t *hdf5_chunk(hid_t type, const void *data, hsize_t total, hsize_t chunk, int filters, int level,
                           hsize_t at, size_t *size)
{
    return hdf5_read_chunk(hdf5_write(type, data, total, chunk, filters, level), at, size);
}

/* An HDF5 type of `size` bytes: the native integers, or an opaque type for other sizes. */
static hid_t type_of_size(size_t size)
{
    switch (size) {
    case 1: return H5Tcopy(H5T_NATIVE_UINT8);
    case 2: return H5Tcopy(H5T_NATIVE_UINT16);
    case 4: return H5Tcopy(H5T_NATIVE_UINT32);
    case 8: return H5Tcopy(H5T_NATIVE_UINT64);
    default: {
        hid_t t = H5Tcreate(H5T_OPAQUE, size);
        H5Tset_tag(t, "bytes");
        return t;
    }
    }
}

static void test_shuffle_matches_hdf5(void **state)
{
    (void)state;
    const size_t elems[] = {1, 2, 3, 4, 8};
    const hsize_t counts[] = {1, 2, 7, 1000};
    for (size_t e = 0; e < sizeof elems / sizeof *elems; e++) {
        for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
            size_t nbytes = elems[e] * (size_t)counts[c];
            uint8_t *data = make_bytes(nbytes, 1, 11 + e * 7 + c), *ours = malloc(nbytes), *want;
            hid_t t = type_of_size(elems[e]);
            size_t got = 0;
            want = hdf5_chunk(t, data, counts[c], counts[c], FILTER_SHUFFLE, 0, 0, &got);
            H5Tclose(t);
            tkd_h5_shuffle(ours, data, nbytes, elems[e]);
            if (got != nbytes || memcmp(ours, want, nbytes) != 0)
                fail_msg("shuffle of %llu elements of %zu bytes differs from HDF5's", (unsigned long long)counts[c],
                         elems[e]);
            free(data);
            free(ours);
            free(want);
        }
    }
}

/* Bytes after the last whole element stay at the end, unshuffled (HDF5 never stores such chunks,
 * so this is checked against the definition). */
static void test_shuffle_leftover_bytes(void **state)
{
    (void)state;
    const uint8_t src[11] = {0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22};
    const uint8_t want[11] = {0, 10, 1, 11, 2, 12, 3, 13, 20, 21, 22};
    uint8_t dst[11];
    tkd_h5_shuffle(dst, src, sizeof src, 4);
    assert_memory_equal(dst, want, sizeof want);
}

static void check_fletcher(const uint8_t *data, size_t len, const uint8_t *stored, size_t stored_len)
{
    assert_int_equal(stored_len, len + 4);
    assert_memory_equal(stored, data, len);
    uint32_t sum = tkd_h5_fletcher32(data, len);
    uint8_t le[4] = {(uint8_t)sum, (uint8_t)(sum >> 8), (uint8_t)(sum >> 16), (uint8_t)(sum >> 24)};
    if (memcmp(le, stored + len, 4) != 0)
        fail_msg("fletcher32 of %zu bytes %02x %02x...: ours %08x, HDF5 stored %02x%02x%02x%02x", len, data[0],
                 len > 1 ? data[1] : 0, sum, stored[len + 3], stored[len + 2], stored[len + 1], stored[len]);
}

/* Short runs of bytes near 0 and 0xff: sums that land next to multiples of 0xffff, where the last
 * folds (and the representation of a zero sum) decide the stored bits. */
static void test_fletcher32_extreme_sums(void **state)
{
    (void)state;
    static const uint8_t values[] = {0x00, 0x01, 0x02, 0xfd, 0xfe, 0xff};
    enum { CHUNKS = 128 };
    uint64_t x = 99;
    for (size_t len = 1; len <= 24; len++) {
        uint8_t *data = malloc(CHUNKS * len);
        assert_non_null(data);
        for (size_t i = 0; i < CHUNKS * len; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            data[i] = values[(x >> 33) % sizeof values];
        }
        const char *path = hdf5_write(H5T_NATIVE_UINT8, data, CHUNKS * len, len, FILTER_FLETCHER, 0);
        for (size_t c = 0; c < CHUNKS; c++) {
            size_t got = 0;
            uint8_t *stored = hdf5_read_chunk(path, c * len, &got);
            check_fletcher(data + c * len, len, stored, got);
            free(stored);
        }
        free(data);
    }
}

static void test_fletcher32_matches_hdf5(void **state)
{
    (void)state;
    /* around the 360-word (720-byte) folding blocks, odd and even, and one byte */
    const size_t lens[] = {1, 2, 3, 718, 719, 720, 721, 722, 1439, 1440, 1441, 65537, 262144};
    for (int pattern = 0; pattern < 3; pattern++) {
        for (size_t i = 0; i < sizeof lens / sizeof *lens; i++) {
            uint8_t *data = make_bytes(lens[i], pattern, 5 + i);
            size_t got = 0;
            uint8_t *want = hdf5_chunk(H5T_NATIVE_UINT8, data, lens[i], lens[i], FILTER_FLETCHER, 0, 0, &got);
            check_fletcher(data, lens[i], want, got);
            free(data);
            free(want);
        }
    }
    /* a value worked by hand: words 0x6162, 0x6364 and the odd byte 0x65 as 0x6500 */
    assert_int_equal(tkd_h5_fletcher32("abcde", 5), 0x4ff029c7u);
}

/* Our pipeline over `nbytes` of data (zero-padded to a whole chunk of chunk · elem bytes). */
static uint8_t *our_chunk(const uint8_t *data, size_t nbytes, size_t chunk_bytes, size_t elem, int level,
                          size_t *size)
{
    uint8_t *padded = calloc(1, chunk_bytes);
    size_t cap = tkd_h5_filter_bound(chunk_bytes);
    uint8_t *out = malloc(cap);
    assert_true(padded && out);
    memcpy(padded, data, nbytes);
    tkd_h5_filter_ctx *c = NULL;
    assert_int_equal(tkd_h5_filter_ctx_create(&c, chunk_bytes), TKD_OK);
    *size = tkd_h5_filter_chunk(c, padded, chunk_bytes, elem, level, out, cap);
    assert_true(*size > 4);
    tkd_h5_filter_ctx_free(c);
    free(padded);
    return out;
}

static void test_pipeline_matches_hdf5(void **state)
{
    (void)state;
    assert_int_equal(tkd_h5zstd_register(), TKD_OK);
    const size_t elems[] = {2, 4, 8};
    const int levels[] = {1, 3, 9};
    enum { CHUNK = 5000, TOTAL = 2 * CHUNK + 1234 }; /* two whole chunks and a partial edge one */
    for (size_t e = 0; e < sizeof elems / sizeof *elems; e++) {
        for (size_t l = 0; l < sizeof levels / sizeof *levels; l++) {
            uint8_t *data = make_bytes(TOTAL * elems[e], 2, 3 + e);
            hid_t t = type_of_size(elems[e]);
            for (hsize_t at = 0; at < TOTAL; at += CHUNK) {
                size_t got = 0, mine = 0;
                uint8_t *want = hdf5_chunk(t, data, TOTAL, CHUNK, FILTER_SHUFFLE | FILTER_ZSTD | FILTER_FLETCHER,
                                           levels[l], at, &got);
                size_t n = (size_t)(at + CHUNK <= TOTAL ? CHUNK : TOTAL - at) * elems[e];
                uint8_t *ours = our_chunk(data + at * elems[e], n, CHUNK * elems[e], elems[e], levels[l], &mine);
                if (mine != got || memcmp(ours, want, got) != 0)
                    fail_msg("chunk at %llu (elem %zu, level %d): ours %zu bytes, HDF5 %zu, or the bytes differ",
                             (unsigned long long)at, elems[e], levels[l], mine, got);
                free(want);
                free(ours);
            }
            H5Tclose(t);
            free(data);
        }
    }
}

static void test_filter_chunk_refuses_what_does_not_fit(void **state)
{
    (void)state;
    tkd_h5_filter_ctx *c = NULL;
    assert_int_equal(tkd_h5_filter_ctx_create(&c, 64), TKD_OK);
    uint8_t src[128] = {0}, out[512];
    assert_true(tkd_h5_filter_chunk(c, src, 64, 4, 3, out, sizeof out) > 4);
    assert_int_equal(tkd_h5_filter_chunk(c, src, 128, 4, 3, out, sizeof out), 0);          /* > max_bytes */
    assert_int_equal(tkd_h5_filter_chunk(c, src, 64, 4, 3, out, tkd_h5_filter_bound(64) - 1), 0); /* cap */
    tkd_h5_filter_ctx_free(c);
    tkd_h5_filter_ctx_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shuffle_matches_hdf5),
        cmocka_unit_test(test_shuffle_leftover_bytes),
        cmocka_unit_test(test_fletcher32_matches_hdf5),
        cmocka_unit_test(test_fletcher32_extreme_sums),
        cmocka_unit_test(test_pipeline_matches_hdf5),
        cmocka_unit_test(test_filter_chunk_refuses_what_does_not_fit),
    };
    return cmocka_run_group_tests(tests, tkd_test_group_dir_setup, tkd_test_group_dir_teardown);
}
