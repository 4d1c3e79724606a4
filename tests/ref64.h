/* ref64.h — the GPU tests' float64 references, one copy each: causal GQA attention (the forward row,
 * from which the backward's statistics follow) and RoPE forward and backward with the bound of their
 * fp32 arithmetic. Inputs are the bf16-rounded floats the device read, so a reference differs from
 * the device only by the device's own arithmetic. Built into the test_gpu_* executables only. */
#ifndef TKD_REF64_H
#define TKD_REF64_H

#include <stddef.h>
#include <stdint.h>

/* A causal GQA attention problem, row-major: q and dy (B·T, H·dh), k and v (B·T, Hkv·dh); query head h
 * reads kv head h / (H / Hkv); scores scaled by 1/√dh. window > 0: query t sees keys t − window < j ≤ t;
 * sinks (H) or NULL: a per-head logit in the softmax's denominator (kernels/attn/attn_cuda.h's
 * tkd_attn_mask). */
typedef struct tkd_ref64_attn {
    int B, T, H, Hkv, dh;
    const float *q, *k, *v;
    int window;
    const float *sinks;
} tkd_ref64_attn;

/* Σ a_i·b_i over n in float64 (four chains, so long rows are not latency-bound). */
double tkd_ref64_dot(const float *a, const float *b, int n);

/* Row t of head h in batch b of a (B·T, heads·dh) tensor. */
const float *tkd_ref64_row(const float *x, int T, int heads, int dh, int b, int t, int h);

/* Query row t of head h in batch b: y (dh doubles) = softmax(scores)·V over keys 0..t (those in the
 * window), and returns the row's log-sum-exp (the sink's term included); sc: scratch of t + 1
 * doubles, left holding the scaled scores of the keys seen. */
double tkd_ref64_attn_row(const tkd_ref64_attn *a, int b, int h, int t, double *y, double *sc);

/* The same with a's window replaced by window (≥ 1; 0: full causal): over keys t − window < j ≤ t
 * only (the window counts the query itself), sc holding the scores at [j0, t], j0 = max(0, t − window + 1). */
double tkd_ref64_attn_window_row(const tkd_ref64_attn *a, int window, int b, int h, int t, double *y, double *sc);

/* The first key query t of sequence b sees: t − window + 1 with a window (≥ 1; 0: none), and no
 * earlier than its document's start doc[b·T + t] (doc (B·T) or NULL: tkd_attn_mask's documents). */
int tkd_ref64_first_key(int window, const int32_t *doc, int T, int b, int t);

/* tkd_ref64_attn_row under a's window and packed documents doc (B·T, or NULL: the same row): over
 * the keys tkd_ref64_first_key(...) ≤ j ≤ t, sc holding their scores at [j0, t]. */
double tkd_ref64_attn_doc_row(const tkd_ref64_attn *a, const int32_t *doc, int b, int h, int t, double *y,
                              double *sc);

/* RoPE of one bf16 tensor x (N, nh·dh), position n % T, cos/sin tables c, s (T, dh/2): *ref (the
 * rotation, backward = the inverse one), and *bound, per element bound·(|x_i| + |x_partner|) (the
 * fp32 x·c − y·s error). The caller frees both. */
void tkd_ref64_rope(const uint16_t *x, int N, int T, int nh, int dh, const float *c, const float *s, int backward,
                    double bound, double **ref, double **abs_i);

#endif
