/* tail_sample.h — tail draws: S tokens per row from the teacher's distribution outside its top-k.
 *
 * For each row (one position of one sequence) the teacher distribution softmax(t / τ) is restricted
 * to the tokens NOT in the row's top-k and renormalised; S tokens are drawn from it i.i.d. The
 * student's `sampled` loss gives each draw weight r/S of the tail mass r (docs in DESIGN.md).
 *
 * Reproducibility. Draw j of a row is keyed by (seed, global sequence index, position, j) through
 * the counter-based RNG of common/ctr_rng.h, so a resumed run or one worker of a split makes the
 * very same draws, and the CPU path (here) and the CUDA path (kernels/cuda/tail_sample_cuda.h) agree
 * bit for bit. Output order is draw order: out[r, j] is draw j, so the first S' < S columns are
 * themselves a valid sample.
 *
 * Why this algorithm (inverse CDF over integer weights). A floating-point prefix sum depends on the
 * summation order, which differs between a sequential CPU loop and a GPU block scan, and a draw
 * landing near a boundary would flip. The Gumbel-max trick is order-free but needs S·V hashes per
 * row (80 draws x 152k tokens = 12M Philox calls per position: far too slow on the CPU). Instead
 * each tail token gets an integer weight
 *     w_v = floor(2^43 · exp((t_v − m) / τ)),   m = the largest tail logit,
 * computed by tkd_tail_weight() below from IEEE-exact operations only (subtract, divide, floor and
 * explicit fma — never a library exp, whose last bit may differ between glibc and CUDA), so w_v is
 * the same integer everywhere. Integer sums are associative, so the prefix sums, and hence the
 * draws, are identical whatever the order. Draw j takes u_j (64 random bits), target
 * T_j = floor(u_j · W / 2^64) in [0, W) with W = Σ w_v, and returns the token whose integer
 * prefix interval [P_v − w_v, P_v) holds T_j. Cost: two passes of V exps + one sort of S targets.
 * Precision: tokens with exp((t_v − m)/τ) < 2^-43 are never drawn; their share of the tail is at
 * most V·2^-43 (3e-8 for V = 262144), far below what S draws can resolve. W < 2^64 needs
 * V ≤ 2^20 (TKD_TAIL_MAX_V).
 */
#ifndef TKD_TAIL_SAMPLE_H
#define TKD_TAIL_SAMPLE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/half.h" /* TKD_HD */
#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TKD_TAIL_MAX_S 1024        /* draws per row */
#define TKD_TAIL_MAX_V (1 << 20)   /* keeps Σ w_v below 2^64 */
#define TKD_TAIL_WEIGHT_BITS 43    /* fixed-point scale of the weights */

/* Checks the shared preconditions: C ≥ 0, 1 ≤ k ≤ TKD_TOPK_MAX_K, k < V ≤ TKD_TAIL_MAX_V (so the
 * tail is never empty), 0 ≤ S ≤ TKD_TAIL_MAX_S, τ finite > 0. TKD_ERR_INVALID_ARG otherwise. */
tkd_status tkd_tail_sample_check_args(int64_t C, int64_t V, int k, float tau, int S);

/* Draws S tail tokens per row. logits (C, V) fp32 (raw, not divided by τ); topk_idx (C, k) the
 * row's top-k ids (any order; ids must be < V); seq_index (C) the global sequence index of each
 * row; pos (C) each row's position in its sequence; out (C, S) caller-owned, draw order.
 * Errors: TKD_ERR_INVALID_ARG (bad sizes, a top-k id ≥ V, naming the row), TKD_ERR_NUMERIC (a
 * non-finite logit, naming the row). No allocation; OpenMP over rows. */
tkd_status tkd_tail_sample_cpu(const float *logits, int64_t C, int64_t V, const uint32_t *topk_idx,
                               int k, float tau, int S, uint64_t seed, const int64_t *seq_index,
                               const int32_t *pos, uint32_t *out);

/* ---- shared by the CPU and CUDA paths (bit-identical results) ---------------------------- */

#if defined(__CUDA_ARCH__)
#define TKD_TAIL_DSUB(a, b) __dsub_rn(a, b)
#define TKD_TAIL_DDIV(a, b) __ddiv_rn(a, b)
#define TKD_TAIL_DMUL(a, b) __dmul_rn(a, b)
#else
#define TKD_TAIL_DSUB(a, b) ((a) - (b))
#define TKD_TAIL_DDIV(a, b) ((a) / (b))
#define TKD_TAIL_DMUL(a, b) ((a) * (b))
#endif

/* floor(2^43 · exp((t − m) / τ)) for t ≤ m, from correctly rounded operations only: 2^y with
 * y = x·log2(e) split as n = floor(y) plus f in [0, 1), 2^f by a degree-13 Taylor polynomial
 * (relative error < 2e-13) in Horner form with explicit fma, times 2^(43+n) built from bits.
 * The __*_rn intrinsics on the device forbid nvcc from fusing a multiply into an add. */
static inline TKD_HD uint64_t tkd_tail_weight(float t, float m, double tau)
{
    const double L2E = 1.4426950408889634; /* log2(e) */
    const double x = TKD_TAIL_DDIV(TKD_TAIL_DSUB((double)t, (double)m), tau);
    const double y = TKD_TAIL_DMUL(x, L2E);
    if (!(y >= -(double)TKD_TAIL_WEIGHT_BITS))
        return 0;
    const double n = floor(y);
    const double f = fma(x, L2E, -n);
    double p = 1.3691488853904124e-12;
    p = fma(p, f, 2.5678435993488196e-11);
    p = fma(p, f, 4.44553827187081e-10);
    p = fma(p, f, 7.054911620801121e-09);
    p = fma(p, f, 1.0178086009239696e-07);
    p = fma(p, f, 1.3215486790144305e-06);
    p = fma(p, f, 1.5252733804059838e-05);
    p = fma(p, f, 0.00015403530393381606);
    p = fma(p, f, 0.0013333558146428441);
    p = fma(p, f, 0.009618129107628477);
    p = fma(p, f, 0.055504108664821576);
    p = fma(p, f, 0.2402265069591007);
    p = fma(p, f, 0.6931471805599453);
    p = fma(p, f, 1.0);
    const uint64_t sbits = (uint64_t)(1023 + TKD_TAIL_WEIGHT_BITS + (int)n) << 52;
    double scale;
    memcpy(&scale, &sbits, sizeof scale);
    return (uint64_t)TKD_TAIL_DMUL(p, scale); /* power-of-two scaling is exact */
}

/* floor(u · W / 2^64): the target of one draw, uniform over [0, W). */
static inline TKD_HD uint64_t tkd_tail_target(uint64_t u, uint64_t W)
{
#if defined(__CUDA_ARCH__)
    return __umul64hi(u, W);
#else
    return (uint64_t)(((unsigned __int128)u * W) >> 64);
#endif
}

#ifdef __cplusplus
}
#endif

#endif /* TKD_TAIL_SAMPLE_H */
