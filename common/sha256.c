/* sha256.c — see sha256.h. Straight from the FIPS 180-4 description: 64 rounds over 512-bit
 * blocks, big-endian words, length-in-bits padding. */
#include "common/sha256.h"

#include "common/fileio.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static inline uint32_t ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void compress_scalar(uint32_t h[8], const uint8_t *p)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = hh + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
        uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        hh = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>

/* The same block function on x86's SHA extensions (about 5x the scalar code: the writer hashes
 * every finished shard, hundreds of MB). The state lives as ABEF / CDGH halves, as the rounds
 * instruction wants; each step does 4 rounds, two per sha256rnds2, with the message schedule for
 * words 16..63 made by sha256msg1/msg2 from the four previous 4-word groups. */
__attribute__((target("sha,sse4.1"))) static void compress_shani(uint32_t h[8], const uint8_t *p)
{
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i t = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[0]), 0xB1); /* CDAB */
    __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[4]), 0x1B); /* EFGH */
    __m128i s0 = _mm_alignr_epi8(t, s1, 8);                                         /* ABEF */
    s1 = _mm_blend_epi16(s1, t, 0xF0);                                              /* CDGH */
    const __m128i abef = s0, cdgh = s1;
    __m128i m[4];
    for (int g = 0; g < 16; g++) {
        if (g < 4)
            m[g] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * g)), bswap);
        else
            m[g & 3] = _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32(m[g & 3], m[(g + 1) & 3]),
                                                          _mm_alignr_epi8(m[(g + 3) & 3], m[(g + 2) & 3], 4)),
                                            m[(g + 3) & 3]);
        __m128i wk = _mm_add_epi32(m[g & 3], _mm_loadu_si128((const __m128i *)&K[4 * g]));
        s1 = _mm_sha256rnds2_epu32(s1, s0, wk);
        s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(wk, 0x0E));
    }
    s0 = _mm_add_epi32(s0, abef);
    s1 = _mm_add_epi32(s1, cdgh);
    t = _mm_shuffle_epi32(s0, 0x1B);                                    /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);                                   /* DCHG */
    _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(t, s1, 0xF0));   /* DCBA */
    _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(s1, t, 8));      /* HGFE */
}

/* CPUID leaf 7 EBX bit 29: SHA extensions; leaf 1 ECX bit 19: SSE4.1 (cpuid.h rather than
 * __builtin_cpu_supports, which older clang does not know for "sha"). */
static int have_shani(void)
{
    static int known = -1;
    if (known < 0) {
        unsigned a, b, c, d;
        int sse41 = __get_cpuid(1, &a, &b, &c, &d) && (c >> 19 & 1);
        known = sse41 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 29 & 1);
    }
    return known;
}
#else
static void compress_shani(uint32_t h[8], const uint8_t *p) { compress_scalar(h, p); }
static int have_shani(void) { return 0; }
#endif

/* TKD_SHA256_SCALAR=1 forces the scalar code (the reference the tests compare the fast path with). */
static void compress(uint32_t h[8], const uint8_t *p)
{
    static int use_ni = -1;
    if (use_ni < 0)
        use_ni = have_shani() && !getenv("TKD_SHA256_SCALAR");
    if (use_ni)
        compress_shani(h, p);
    else
        compress_scalar(h, p);
}

void tkd_sha256_init(tkd_sha256 *c)
{
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, h0, sizeof h0);
    c->nbytes = 0;
    c->fill = 0;
}

void tkd_sha256_update(tkd_sha256 *c, const void *data, size_t len)
{
    const uint8_t *p = data;
    c->nbytes += len;
    if (c->fill) {
        size_t take = 64 - c->fill < len ? 64 - c->fill : len;
        memcpy(c->block + c->fill, p, take);
        c->fill += take;
        p += take;
        len -= take;
        if (c->fill < 64)
            return;
        compress(c->h, c->block);
        c->fill = 0;
    }
    for (; len >= 64; p += 64, len -= 64)
        compress(c->h, p);
    memcpy(c->block, p, len);
    c->fill = len;
}

void tkd_sha256_final(tkd_sha256 *c, uint8_t out[TKD_SHA256_BYTES])
{
    uint64_t bits = c->nbytes * 8;
    c->block[c->fill++] = 0x80;
    if (c->fill > 56) {
        memset(c->block + c->fill, 0, 64 - c->fill);
        compress(c->h, c->block);
        c->fill = 0;
    }
    memset(c->block + c->fill, 0, 56 - c->fill);
    for (int i = 0; i < 8; i++)
        c->block[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    compress(c->h, c->block);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++)
            out[4 * i + j] = (uint8_t)(c->h[i] >> (24 - 8 * j));
}

void tkd_sha256_buffer(const void *data, size_t len, uint8_t out[TKD_SHA256_BYTES])
{
    tkd_sha256 c;
    tkd_sha256_init(&c);
    tkd_sha256_update(&c, data, len);
    tkd_sha256_final(&c, out);
}

void tkd_sha256_hex(const uint8_t digest[TKD_SHA256_BYTES], char hex[TKD_SHA256_HEX_LEN])
{
    static const char d[] = "0123456789abcdef";
    for (int i = 0; i < TKD_SHA256_BYTES; i++) {
        hex[2 * i] = d[digest[i] >> 4];
        hex[2 * i + 1] = d[digest[i] & 15];
    }
    hex[64] = '\0';
}

tkd_status tkd_sha256_file(const char *path, uint8_t out[TKD_SHA256_BYTES])
{
    enum { BLOCK = 1 << 20 };
    FILE *fp;
    TKD_TRY(tkd_fopen_input(path, "file to checksum", &fp));
    uint8_t *buf = malloc(BLOCK);
    if (!buf) {
        fclose(fp);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory for sha256", path);
    }
    tkd_sha256 c;
    tkd_sha256_init(&c);
    size_t n = BLOCK;
    tkd_status st = TKD_OK;
    while (st == TKD_OK && n == BLOCK && (st = tkd_fread_input(fp, buf, BLOCK, &n, path)) == TKD_OK)
        tkd_sha256_update(&c, buf, n);
    free(buf);
    fclose(fp);
    if (st == TKD_OK)
        tkd_sha256_final(&c, out);
    return st;
}

tkd_status tkd_sha256_file_hex(const char *path, char hex[TKD_SHA256_HEX_LEN])
{
    uint8_t d[TKD_SHA256_BYTES];
    TKD_TRY(tkd_sha256_file(path, d));
    tkd_sha256_hex(d, hex);
    return TKD_OK;
}
