/* rng.c — see rng.h. xoshiro256** and splitmix64 follow Blackman & Vigna's published
 * definitions (public domain algorithms); written here from the description. */
#include "common/rng.h"

#include <math.h>

uint64_t tkd_rng_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void tkd_rng_seed(tkd_rng *r, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        r->s[i] = tkd_rng_splitmix64(&x);
    /* splitmix64 is a bijection of a counter, so four zero outputs in a row cannot happen */
}

void tkd_rng_seed_stream(tkd_rng *r, uint64_t seed, uint64_t stream)
{
    uint64_t k = stream;
    tkd_rng_seed(r, seed ^ tkd_rng_splitmix64(&k));
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t tkd_rng_u64(tkd_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint64_t tkd_rng_below(tkd_rng *r, uint64_t n)
{
    if (n == 0)
        return 0;
    /* values below 2^64 mod n would make small results more likely: reject them */
    uint64_t threshold = (0 - n) % n;
    for (;;) {
        uint64_t x = tkd_rng_u64(r);
        if (x >= threshold)
            return x % n;
    }
}

double tkd_rng_double(tkd_rng *r) { return (double)(tkd_rng_u64(r) >> 11) * 0x1.0p-53; }

float tkd_rng_float(tkd_rng *r) { return (float)(tkd_rng_u64(r) >> 40) * 0x1.0p-24f; }

double tkd_rng_normal(tkd_rng *r)
{
    /* u1 in (0, 1] so log(u1) is finite */
    double u1 = (double)((tkd_rng_u64(r) >> 11) + 1) * 0x1.0p-53;
    double u2 = (double)(tkd_rng_u64(r) >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
}

void tkd_rng_shuffle_i64(tkd_rng *r, int64_t *a, size_t n)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)tkd_rng_below(r, i);
        int64_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

void tkd_rng_save(const tkd_rng *r, tkd_rng_state *out)
{
    for (int i = 0; i < 4; i++)
        out->s[i] = r->s[i];
}

tkd_status tkd_rng_restore(tkd_rng *r, const tkd_rng_state *in)
{
    if (!(in->s[0] | in->s[1] | in->s[2] | in->s[3]))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "rng state is all zeros (a corrupt checkpoint?); cannot restore it");
    for (int i = 0; i < 4; i++)
        r->s[i] = in->s[i];
    return TKD_OK;
}
