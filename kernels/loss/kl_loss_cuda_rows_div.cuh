/* kl_loss_cuda_rows_div.cuh — the row kernel's divergences other than forward KL: row_div_warp
 * forms a row's buckets as the CPU path does (kl_loss_cpu.c) from the logits the row kernel
 * gathered, with kl_divergence.h's per-bucket terms, and reduces them to the same gradient
 * coefficients as fkl's plus exact values at the special positions.
 *
 * A part of kl_loss_cuda_rows.cu, not a header of its own: that file includes it once, inside its
 * anonymous namespace, after RowArgs, RowSmem, RowShared and the warp reductions it uses. It was
 * split out so each file reads in one sitting.
 */
#ifndef TKD_KL_LOSS_CUDA_ROWS_DIV_CUH
#define TKD_KL_LOSS_CUDA_ROWS_DIV_CUH

/* ---- a divergence other than fkl (docs/loss.md, "Divergences"; each bucket's maths is
 * kl_divergence.h's, the CPU path's own text) ---------------------------------------------------- */

/* log Σ_j exp(x_j·scale) over n values, in double, on every lane of the warp. */
__device__ inline double warp_lse(const float *x, int n, double scale)
{
    const int lane = threadIdx.x % 32;
    double mx = -INFINITY;
    for (int j = lane; j < n; j += 32)
        mx = fmax(mx, x[j] * scale);
    mx = warp_max(mx);
    double sum = 0.0;
    for (int j = lane; j < n; j += 32)
        sum += exp(x[j] * scale - mx);
    return mx + log(warp_sum(sum));
}

/* What a row's buckets are formed from, as the CPU path forms them (kl_loss_cpu.c: teacher_of,
 * top_bucket, draw_bucket). */
struct DivRow {
    int kind;                /* tkd_kl_div_kind */
    double beta, skew;       /* kd.jsd_beta, kd.skew_alpha */
    double inv_tau_t;        /* the teacher's 1/τ, in double */
    double inv_tau_s;        /* the student's: fp32's 1/τ, as the row statistics took it */
    double norm;             /* log p_j = t_j/τ − norm: renorm's LSE over t/τ, else the cache's LSE */
    double ls;               /* log c_j = s_j/τ − ls: renorm's LSE over the k' logits, else LSE(z) */
    double lz;               /* LSE(z) */
    double r;                /* the teacher's tail mass (tail, sampled; 0 without a tail) */
};

__device__ inline tkd_kl_div_bucket div_top(const DivRow &d, RowSmem m, int j)
{
    return tkd_kl_div_bucket_of_logs(m.t_i[j] * d.inv_tau_t - d.norm, m.s_i[j] * d.inv_tau_s - d.ls);
}

/* Draw j of a sampled row: its bucket (teacher mass r·count/S); returns 0 for a repeat. */
__device__ inline int div_draw(const DivRow &d, const RowArgs &a, RowSmem m, int j, tkd_kl_div_bucket *k)
{
    double la;
    const int first = tkd_kl_div_draw_log_mass(m.idx_t, a.s, j, d.r, &la);
    *k = tkd_kl_div_bucket_of_logs(la, m.s_t[j] * d.inv_tau_s - d.lz);
    return first;
}

__device__ inline double div_term(const DivRow &d, tkd_kl_div_bucket k, double *cg)
{
    return tkd_kl_div_term(d.kind, d.beta, d.skew, k, cg);
}

__device__ DivRow div_row(const RowArgs &a, RowSmem m, const RowShared &sh)
{
    const int lane = threadIdx.x % 32;
    DivRow d;
    d.kind = a.div_kind;
    d.beta = a.jsd_beta;
    d.skew = a.skew_alpha;
    d.inv_tau_t = 1.0 / (double)a.tau;
    d.inv_tau_s = (double)(1.0f / a.tau);
    d.lz = sh.lse_tau;
    d.ls = d.lz;
    d.r = 0.0;
    if (a.variant == TKD_KL_VARIANT_RENORM) { /* q̃ over the k' tokens, in double: it sums to 1 */
        d.norm = warp_lse(m.t_i, a.k_use, d.inv_tau_t);
        d.ls = warp_lse(m.s_i, a.k_use, d.inv_tau_s);
        return d;
    }
    d.norm = sh.teacher_lse;
    double sp = 0.0;
    for (int j = lane; j < a.k_use; j += 32)
        sp += exp(m.t_i[j] * d.inv_tau_t - d.norm);
    sp = warp_sum(sp);
    d.r = a.k_use < a.v && sp < 1.0 ? 1.0 - sp : 0.0; /* k' = V: no tail; rounding may pass 1 */
    return d;
}

/* The divergence's KD_z (every lane) and gradient (CPU: div_row_sums, row_grad_div). The dense
 * part's KD weight, per unit of the row's KD weight: *c_off on q_v and *c_x on q_v / (1 − Q) (the
 * `tail` form, grad_tail_term), i.e. tail: (cg_tail − (1 − Q)·gbar)·q_v/(1 − Q), sampled:
 * (rest_g − gbar)·q_v, renorm: 0 (q̃ does not depend on the logits off I). Every special token's KD
 * gradient is exact instead: with grad, tgt_i / tgt_t get −(cg − c·gbar) and *c_in is 0, so
 * grad_special's c_in·q − c_tgt·tgt is that value. Out of line: its float64 terms need more than
 * the kernel's 64 registers; inlined, the DIV kernels spilled ~1 KB (ptxas -v), out of line the
 * spills stay in this function (once per row, warp 0) and the kernels spill as fkl's (≤ 48 B). */
__device__ __noinline__ double row_div_warp(const RowArgs &a, RowSmem m, const RowShared &sh, bool grad,
                                            double *c_off, double *c_in, double *c_x)
{
    const int lane = threadIdx.x % 32, kk = a.k_use;
    const DivRow d = div_row(a, m, sh);
    const bool tail = a.variant == TKD_KL_VARIANT_TAIL && kk < a.v;
    const bool sampled = a.variant == TKD_KL_VARIANT_SAMPLED && kk < a.v;
    double kd = 0.0, gbar = 0.0, q_in = 0.0, cg;
    tkd_kl_div_bucket k;
    for (int j = lane; j < kk; j += 32) {
        k = div_top(d, m, j);
        kd += div_term(d, k, &cg);
        gbar += cg;
        q_in += k.c;
    }
    for (int j = lane; j < a.s; j += 32) /* a.s is 0 unless `sampled` */
        if (div_draw(d, a, m, j, &k)) {
            kd += div_term(d, k, &cg);
            gbar += cg;
            q_in += k.c;
        }
    kd = warp_sum(kd);
    gbar = warp_sum(gbar);
    q_in = warp_sum(q_in);
    double omq = 0.0, tail_cg = 0.0, rest_g = 0.0;
    if (tail) {
        omq = exp((double)sh.log_omq);
        kd += div_term(d, tkd_kl_div_tail_bucket(d.r, sh.log_omq), &tail_cg);
        gbar += tail_cg;
    } else if (sampled) {
        /* The undrawn tail 1 − Q − Σ drawn c, by subtraction: the fused statistics hold no sum
         * outside the top-k'. It enters linearly (F(0, c) = c·F(0, 1), rest_g a constant), so its
         * absolute error, the fp32 LSE's (~1e-7·|LSE|), is what reaches the loss. */
        kd += tkd_kl_div_rest_term(d.kind, d.beta, d.skew, 1.0 - q_in, &cg, &rest_g);
        gbar += cg;
    }
    *c_in = 0.0;
    *c_off = tail && omq > 0.0 ? -gbar : sampled ? rest_g - gbar : 0.0;
    *c_x = tail && omq > 0.0 ? -tail_cg : 0.0;
    if (!grad)
        return kd;
    for (int j = lane; j < kk; j += 32) {
        k = div_top(d, m, j);
        div_term(d, k, &cg);
        m.tgt_i[j] = (float)-tkd_kl_div_bucket_grad(cg, k, gbar);
    }
    for (int j = lane; j < a.s; j += 32) { /* repeats of a draw get its value again */
        div_draw(d, a, m, j, &k);
        div_term(d, k, &cg);
        m.tgt_t[j] = (float)-tkd_kl_div_bucket_grad(cg, k, gbar);
    }
    return kd;
}

#endif /* TKD_KL_LOSS_CUDA_ROWS_DIV_CUH */
