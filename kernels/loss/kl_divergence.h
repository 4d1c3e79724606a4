/* kl_divergence.h — the per-bucket maths of kd.divergence (docs/loss.md, "Divergences"), shared by
 * the chunked CPU path (kl_loss_cpu.c) and the CUDA row kernel (kl_loss_cuda_rows.cu), so the two
 * compute the same terms from one text. Header-only, float64, usable from C and from CUDA device
 * code (TKD_HD, as common/half.h). The loops over a row's buckets stay with each caller (serial on
 * the CPU, across a warp's lanes on the GPU); what a bucket contributes is here.
 *
 * A bucket b carries the teacher's mass a and the student's c of the tempered distributions with
 * their logs (la = −inf exactly when a = 0, the same for c). Its term is F(a, c) and cg = c·∂F/∂c;
 * with gbar = Σ_b cg_b, ∂D/∂z_v = (q_v / c_b)·(cg_b − c_b·gbar) for v in bucket b. */
#ifndef TKD_KL_DIVERGENCE_H
#define TKD_KL_DIVERGENCE_H

#include <math.h>
#include <stdint.h>

#include "kernels/loss/kl_loss.h"

#ifndef TKD_HD
#if defined(__CUDACC__)
#define TKD_HD __host__ __device__
#else
#define TKD_HD
#endif
#endif

/* 1 when a row's KD is a divergence other than forward KL: one is chosen and there is a teacher
 * (CE-only calls read none). fkl keeps its own code, bit for bit. */
static inline int tkd_kl_div_on(const tkd_kl_params *p)
{
    return p->divergence != TKD_KL_DIVERGENCE_FKL &&
           (p->k_use > 0 || (p->variant == TKD_KL_VARIANT_SAMPLED && p->s > 0));
}

/* The divergence as computed: jsd at β = 0 and 1 is forward and reverse KL (TRL's endpoints, the
 * limits of JSD_β/β and JSD_β/(1 − β)); the skews at α = 0 are forward and reverse KL. (Over the
 * buckets: jsd at β = 0 is not fkl's `renorm`, whose log q runs over the whole vocabulary.) */
static inline TKD_HD int tkd_kl_div_kind(int divergence, float jsd_beta, float skew_alpha)
{
    switch (divergence) {
    case TKD_KL_DIVERGENCE_JSD:
        return jsd_beta == 0.0f ? TKD_KL_DIVERGENCE_FKL
               : jsd_beta == 1.0f ? TKD_KL_DIVERGENCE_RKL : TKD_KL_DIVERGENCE_JSD;
    case TKD_KL_DIVERGENCE_SKL:
        return skew_alpha == 0.0f ? TKD_KL_DIVERGENCE_FKL : TKD_KL_DIVERGENCE_SKL;
    case TKD_KL_DIVERGENCE_SRKL:
        return skew_alpha == 0.0f ? TKD_KL_DIVERGENCE_RKL : TKD_KL_DIVERGENCE_SRKL;
    default:
        return divergence;
    }
}

/* log(e^a + e^b) in double, exact where one side is −inf. */
static inline TKD_HD double tkd_kl_logaddexp(double a, double b)
{
    if (a == -INFINITY)
        return b;
    if (b == -INFINITY)
        return a;
    return a > b ? a + log1p(exp(b - a)) : b + log1p(exp(a - b));
}

typedef struct tkd_kl_div_bucket {
    double a, la, c, lc;
} tkd_kl_div_bucket;

static inline TKD_HD tkd_kl_div_bucket tkd_kl_div_bucket_of_logs(double la, double lc)
{
    tkd_kl_div_bucket k = {exp(la), la, exp(lc), lc};
    return k;
}

/* w·x with 0·x = 0 (x may be ±inf where w = 0). */
static inline TKD_HD double tkd_kl_div_xmul(double w, double x)
{
    return w == 0.0 ? 0.0 : w * x;
}

/* The bucket's term F(a, c) of divergence `kind` (tkd_kl_div_kind's); *cg = c·∂F/∂c, finite even
 * where c → 0 (so that the gradient needs no division). beta: kd.jsd_beta, skew: kd.skew_alpha. The
 * mixture's log is a logaddexp. */
static inline TKD_HD double tkd_kl_div_term(int kind, double beta, double skew, tkd_kl_div_bucket k, double *cg)
{
    *cg = 0.0;
    if (k.a == 0.0 && k.c == 0.0)
        return 0.0;
    switch (kind) {
    case TKD_KL_DIVERGENCE_FKL: /* a log(a/c) */
        *cg = -k.a;
        return tkd_kl_div_xmul(k.a, k.la - k.lc);
    case TKD_KL_DIVERGENCE_RKL: /* c log(c/a) */
        *cg = tkd_kl_div_xmul(k.c, k.lc - k.la + 1.0);
        return tkd_kl_div_xmul(k.c, k.lc - k.la);
    case TKD_KL_DIVERGENCE_JSD: { /* β a log(a/m) + (1 − β) c log(c/m), m = βa + (1 − β)c */
        const double lm = tkd_kl_logaddexp(log(beta) + k.la, log1p(-beta) + k.lc);
        *cg = (1.0 - beta) * tkd_kl_div_xmul(k.c, k.lc - lm);
        return beta * tkd_kl_div_xmul(k.a, k.la - lm) + (1.0 - beta) * tkd_kl_div_xmul(k.c, k.lc - lm);
    }
    case TKD_KL_DIVERGENCE_SKL: { /* a log(a/m), m = αa + (1 − α)c */
        const double lm = tkd_kl_logaddexp(log(skew) + k.la, log1p(-skew) + k.lc);
        *cg = -k.a * (1.0 - skew) * exp(k.lc - lm);
        return tkd_kl_div_xmul(k.a, k.la - lm);
    }
    case TKD_KL_DIVERGENCE_SRKL: { /* c log(c/m), m = αc + (1 − α)a */
        const double lm = tkd_kl_logaddexp(log(skew) + k.lc, log1p(-skew) + k.la);
        *cg = tkd_kl_div_xmul(k.c, k.lc - lm + 1.0 - skew * exp(k.lc - lm));
        return tkd_kl_div_xmul(k.c, k.lc - lm);
    }
    case TKD_KL_DIVERGENCE_TVD: /* ½|a − c|; the subgradient 0 at a tie */
        *cg = 0.5 * k.c * (k.c > k.a ? 1.0 : k.c < k.a ? -1.0 : 0.0);
        return 0.5 * fabs(k.a - k.c);
    }
    return 0.0;
}

/* `tail`'s tail bucket (every divergence but fkl): the teacher's r clamped at TKD_KL_TAIL_MASS_MIN
 * (kl_loss.h says why), the student's 1 − Q from its exact log. */
static inline TKD_HD tkd_kl_div_bucket tkd_kl_div_tail_bucket(double r, double log_omq)
{
    const double a = r > TKD_KL_TAIL_MASS_MIN ? r : TKD_KL_TAIL_MASS_MIN;
    tkd_kl_div_bucket k = {a, log(a), exp(log_omq), log_omq};
    return k;
}

/* `sampled`'s undrawn tail as one bucket: teacher mass 0, student mass `rest` (clamped at 0). F is
 * linear in c there (F(0, c) = c·F(0, 1)), so its ∂F/∂c is a constant: *rest_g (0 when rest is 0),
 * the dense gradient's weight off the special tokens. Returns F; *cg as tkd_kl_div_term's. */
static inline TKD_HD double tkd_kl_div_rest_term(int kind, double beta, double skew, double rest, double *cg,
                                                 double *rest_g)
{
    rest = rest > 0.0 ? rest : 0.0;
    tkd_kl_div_bucket k = {0.0, -INFINITY, rest, log(rest)};
    const double f = tkd_kl_div_term(kind, beta, skew, k, cg);
    *rest_g = rest > 0.0 ? *cg / rest : 0.0;
    return f;
}

/* Tail draw d of a sampled row (dr: its S draws) as a bucket of its own: *la = log of its teacher
 * mass r·count/S (repeats add up; −inf when r = 0). Returns 0 for a repeat of an earlier draw, whose
 * bucket that one already is (the caller counts it once in the sums; its gradient is the same). */
static inline TKD_HD int tkd_kl_div_draw_log_mass(const int32_t *dr, int s, int d, double r, double *la)
{
    int first = 1, count = 0;
    for (int e = 0; e < s; e++) {
        count += dr[e] == dr[d];
        first &= !(e < d && dr[e] == dr[d]);
    }
    *la = r > 0.0 ? log(r * count / s) : -INFINITY;
    return first;
}

/* The gradient of a special bucket, per unit of the row's KD weight: cg − c·gbar (docs/loss.md,
 * "Gradient": a token bucket's q_v / c_b is 1). */
static inline TKD_HD double tkd_kl_div_bucket_grad(double cg, tkd_kl_div_bucket k, double gbar)
{
    return cg - k.c * gbar;
}

#endif /* TKD_KL_DIVERGENCE_H */
