/* ctr_rng.h — counter-based random numbers (Philox4x32-10), identical on the CPU and in CUDA code.
 *
 * A counter-based generator has no state to carry: the random word for (seed, a, b, c) is a pure
 * function of those numbers. That is what lets a resumed run, or one worker of a split, reproduce
 * exactly the draws an uninterrupted single run would have made, in any order, on CPU or GPU.
 * Philox4x32-10 (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3") is the
 * well-studied choice: 10 rounds of 32x32->64-bit multiplies, passes BigCrush, and it is checked
 * here against the published known-answer vectors (tests/test_tail_sample.c).
 *
 * Header-only; every function is TKD_HD so CUDA kernels call the very same code.
 * Callers that use one seed for several purposes should fold a purpose constant into `a`, `b` or
 * `c` (or the seed) so the streams do not overlap.
 */
#ifndef TKD_CTR_RNG_H
#define TKD_CTR_RNG_H

#include <stdint.h>

#include "common/half.h" /* TKD_HD */

#ifdef __cplusplus
extern "C" {
#endif

/* One Philox4x32 round on the counter, with the round key. */
static inline TKD_HD void tkd_philox_round(uint32_t ctr[4], const uint32_t key[2])
{
    const uint64_t p0 = (uint64_t)0xD2511F53u * ctr[0];
    const uint64_t p1 = (uint64_t)0xCD9E8D57u * ctr[2];
    const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    const uint32_t c1 = ctr[1], c3 = ctr[3];
    ctr[0] = hi1 ^ c1 ^ key[0];
    ctr[1] = lo1;
    ctr[2] = hi0 ^ c3 ^ key[1];
    ctr[3] = lo0;
}

/* Philox4x32-10: out = bijection of ctr under key. out may alias ctr. */
static inline TKD_HD void tkd_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2],
                                            uint32_t out[4])
{
    uint32_t c[4] = {ctr[0], ctr[1], ctr[2], ctr[3]};
    uint32_t k[2] = {key[0], key[1]};
    for (int r = 0; r < 10; r++) {
        if (r > 0) { /* Weyl key schedule: golden ratio and sqrt(3) - 1 */
            k[0] += 0x9E3779B9u;
            k[1] += 0xBB67AE85u;
        }
        tkd_philox_round(c, k);
    }
    out[0] = c[0];
    out[1] = c[1];
    out[2] = c[2];
    out[3] = c[3];
}

/* 64 random bits for (seed, a, b, c): counter = (c, b, low a, high a), key = seed. Distinct
 * (a, b, c) under one seed never repeat a counter, so the words are independent. */
static inline TKD_HD uint64_t tkd_ctr_rng_u64(uint64_t seed, uint64_t a, uint32_t b, uint32_t c)
{
    const uint32_t ctr[4] = {c, b, (uint32_t)a, (uint32_t)(a >> 32)};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t out[4];
    tkd_philox4x32_10(ctr, key, out);
    return (uint64_t)out[0] | ((uint64_t)out[1] << 32);
}

/* A double uniform in [0, 1) with 53 random bits, from the same stream as tkd_ctr_rng_u64. */
static inline TKD_HD double tkd_ctr_rng_uniform(uint64_t seed, uint64_t a, uint32_t b, uint32_t c)
{
    return (double)(tkd_ctr_rng_u64(seed, a, b, c) >> 11) * (1.0 / 9007199254740992.0);
}

#ifdef __cplusplus
}
#endif

#endif /* TKD_CTR_RNG_H */
