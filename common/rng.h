/* rng.h — a small seeded random generator: xoshiro256** seeded through splitmix64.
 *
 * Good enough for weight init, dropout-free shuffling and sampling; not for cryptography. Every
 * result is a pure function of the seed and the number of draws, computed with integer arithmetic
 * (the normal draw also uses log/sqrt/cos from libm, which IEEE platforms round alike in practice),
 * so the same seed gives the same numbers on every machine. The whole state is four u64 words, so
 * a checkpoint stores it as tkd_rng_state and resume continues the exact sequence.
 * A tkd_rng is not thread-safe: give each thread its own (tkd_rng_seed_stream).
 */
#ifndef TKD_RNG_H
#define TKD_RNG_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct tkd_rng {
    uint64_t s[4];
} tkd_rng;

/* The state as a checkpoint stores it (plain words, no padding). */
typedef struct tkd_rng_state {
    uint64_t s[4];
} tkd_rng_state;

/* splitmix64: advances *x by the golden-ratio increment and returns the mixed value. */
uint64_t tkd_rng_splitmix64(uint64_t *x);

/* s[i] = successive splitmix64 outputs starting from seed. */
void tkd_rng_seed(tkd_rng *r, uint64_t seed);

/* An independent stream for (seed, stream), e.g. one per worker thread or per epoch:
 * seeds with seed ^ splitmix64-mix(stream), so different streams never share a state. */
void tkd_rng_seed_stream(tkd_rng *r, uint64_t seed, uint64_t stream);

/* Next 64 random bits. */
uint64_t tkd_rng_u64(tkd_rng *r);

/* Uniform integer in [0, n), n > 0, without modulo bias (rejection). Returns 0 for n == 0. */
uint64_t tkd_rng_below(tkd_rng *r, uint64_t n);

/* Uniform in [0, 1): 53 (double) or 24 (float) random bits. */
double tkd_rng_double(tkd_rng *r);
float tkd_rng_float(tkd_rng *r);

/* Standard normal N(0, 1) by Box-Muller; uses two u64 draws per value (the sine half is
 * discarded so that the state stays four words). */
double tkd_rng_normal(tkd_rng *r);

/* Fisher-Yates shuffle of a[0..n) in place. */
void tkd_rng_shuffle_i64(tkd_rng *r, int64_t *a, size_t n);

void tkd_rng_save(const tkd_rng *r, tkd_rng_state *out);

/* Restores a saved state; TKD_ERR_INVALID_ARG for the all-zero state (xoshiro's fixed point,
 * which only a corrupt checkpoint can hold). */
tkd_status tkd_rng_restore(tkd_rng *r, const tkd_rng_state *in);

#endif /* TKD_RNG_H */
