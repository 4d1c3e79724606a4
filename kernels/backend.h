/* backend.h — the one seam between the model and the hardware.
 *
 * model/ writes the architecture once and reaches every op through a tkd_backend: a table of op
 * entry points plus device memory and copies, implemented twice in kernels/ — the CPU (fp32, the
 * reference that every test holds the others to: backend_cpu.c over cpu_ops.h, kl_loss.h and
 * adamw.h) and CUDA (bf16 compute with fp32 accumulation: backend_cuda.cu over ops_cuda.h,
 * ops_bwd_cuda.h, attn_cuda.h, attn_cudnn.h, attn_bwd_simple_cuda.h, kl_loss_cuda.h, topk_cuda.h).
 * Besides the layer ops it carries what a training step needs: the fused KL loss, AdamW over a
 * segment table, the gradient norm and scale; and two timing marks, through which
 * kernels/backend_profile.h's wrapper times every op of another backend. The tools resolve the
 * device once (tkd_backend_resolve, the one place `device: auto` is decided), open a backend once
 * (tkd_backend_open_local: the GPU of a launcher's process is picked here, for both tools) and
 * name no backend's functions.
 *
 * Capabilities: code above kernels/ never asks which device a backend is (be->device is for
 * kernels/ and for printing); it asks what it needs to know, as fields and ops of struct
 * tkd_backend below:
 *   host_addressable — backend memory is host memory (tkd_backend_host_f32: and act is fp32, so a
 *                      host float array is an act tensor as it is);
 *   act_size         — bytes of one act element;
 *   master_lo_size   — the fp32 master weights are the act compute copy plus a residual of this
 *                      many bytes (0: the act copy is the fp32 master itself);
 *   data_parallel    — kernels/comm/comm_nccl.h's collectives run on this backend (several processes;
 *                      before any backend opens, tkd_backend_device_data_parallel);
 *   attn_window      — attn_fwd applies a sliding window shorter than the sequence (the model
 *                      refuses such a layer, naming it, on a backend without);
 *   attn_window_bwd  — attn_bwd does too (a training model with such a layer needs it);
 *   attn_docs        — attn_fwd confines each query to its document (packed documents, doc != NULL);
 *   attn_docs_bwd    — attn_bwd does too (training on packed documents needs it);
 *   moe_mxfp4        — moe_fwd takes gpt-oss's experts as MXFP4 (kernels/moe.h's tkd_moe_mxfp4);
 *   op->lmhead_chunk_rows — the LM head's chunk when the config leaves it automatic.
 *
 * Memory: every pointer an op takes is backend memory (host memory on the CPU, device memory on
 * CUDA) unless its comment says host. Three element types appear in the signatures:
 *   act  — activations and weights: be->act_size bytes (4 = fp32 on the CPU, 2 = bf16 on CUDA);
 *   f32  — the residual stream, RMSNorm's rstd, RoPE tables, attention's saved statistics;
 *   i32  — token ids.
 * Ops are asynchronous on the backend's compute stream (CPU: synchronous); copies to the host
 * and tkd_backend_sync order with it. Errors: TKD_ERR_DEVICE for a failed launch, TKD_ERR_DEVICE_OOM
 * from alloc with a message saying how much was asked and what to lower.
 *
 * Layouts as kernels/cpu/cpu_ops.h: rows are N = B·T tokens, row n = (b = n / T, t = n % T); heads
 * packed along the row, q (N, H·dh), k and v (N, Hkv·dh), query head h reads kv head h / (H / Hkv).
 * Linear weights in the Hugging Face layout W (M out, K in). Backward ops ADD into gradients.
 */
#ifndef TKD_BACKEND_H
#define TKD_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "common/device.h"
#include "common/dist.h"
#include "common/status.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cuda/cuda_policy.h"
#include "kernels/loss/kl_loss.h"
#include "kernels/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tkd_backend tkd_backend;

/* The fused KL loss's state on a backend (kl_create): the loss workspace and the batch's teacher
 * side in backend memory. Opaque; one per training run. */
typedef struct tkd_backend_kl tkd_backend_kl;

/* A backend's AdamW segment table (adamw_create). Opaque. */
typedef struct tkd_backend_adamw tkd_backend_adamw;

/* A mixture-of-experts layer's workspace on a backend (moe_create), for layers of one shape. Opaque. */
typedef struct tkd_backend_moe tkd_backend_moe;

/* One MoE layer's weights in backend memory, act dtype (fp32 on the CPU, bf16 on CUDA), in
 * kernels/cpu/cpu_moe.h's layout (per expert W_gate (I, D), W_up (I, D), W_down (D, I), stacked
 * over the E experts). A NULL bias is a zero bias. */
typedef struct tkd_moe_act_weights {
    const void *router_w; /* (E, D) */
    const void *router_b; /* (E) or NULL */
    const void *w_gate;   /* (E, I, D) */
    const void *w_up;     /* (E, I, D) */
    const void *w_down;   /* (E, D, I) */
    const void *b_gate;   /* (E, I) or NULL */
    const void *b_up;     /* (E, I) or NULL */
    const void *b_down;   /* (E, D) or NULL */
    tkd_moe_mxfp4 q;      /* be->moe_mxfp4 and params.mxfp4: the experts as MXFP4 (w_gate/w_up/w_down NULL) */
} tkd_moe_act_weights;

/* The LM head + top-k consumer's arguments (teacher-dump): per row the top-k ids and raw logits
 * of hidden · Wᵀ, the log-sum-exp at tau over the full vocabulary, and S tail draws (when S > 0)
 * keyed by (seed, row_seq[r], row_pos[r]) as kernels/cpu/tail_sample.h defines them. Outputs are HOST
 * memory, complete when the call returns (on CUDA each chunk's results travel to pinned staging on
 * a copy stream while the next chunk computes). A non-finite logit is TKD_ERR_NUMERIC naming the
 * first bad row of its chunk. */
typedef struct tkd_lmhead_topk_args {
    const void *hidden;      // (rows, D) act, backend memory
    const void *w;           // (V, D) act, backend memory
    int64_t rows;
    int d;
    int64_t v;
    int k;
    float tau;
    int chunk_rows;          /* rows of logits that exist at once (the backend keeps one chunk) */
    int s;                   /* tail draws per row; 0 = none */
    uint64_t seed;
    const int64_t *row_seq;  // (rows) host: each row's sequence index (tail draws' key)
    const int32_t *row_pos;  // (rows) host: each row's position
    uint32_t *idx;           // (rows, k) host out
    float *val;              // (rows, k) host out
    float *lse;              // (rows) host out
    uint32_t *tail;          // (rows, s) host out, or NULL when s == 0
    /* out, with TKD_ERR_NUMERIC: the first non-finite logit (row of hidden, token, value) */
    int64_t bad_row, bad_col;
    float bad_value;
} tkd_lmhead_topk_args;

typedef struct tkd_backend_ops {
    void (*close)(tkd_backend *be); /* frees the backend itself (tkd_backend_close) */

    /* ---- memory ---- */
    tkd_status (*alloc)(tkd_backend *be, size_t bytes, const char *what, void **out); /* zeroed */
    void (*free)(tkd_backend *be, void *p);                                            /* NULL ok */
    tkd_status (*host_alloc)(tkd_backend *be, size_t bytes, void **out); /* pinned on CUDA */
    void (*host_free)(tkd_backend *be, void *p);
    tkd_status (*upload)(tkd_backend *be, void *dst, const void *src_host, size_t bytes);
    tkd_status (*download)(tkd_backend *be, void *dst_host, const void *src, size_t bytes);
    tkd_status (*upload_f32)(tkd_backend *be, void *dst_act, const float *src_host, size_t n);
    tkd_status (*download_f32)(tkd_backend *be, float *dst_host, const void *src_act, size_t n);
    tkd_status (*memset0)(tkd_backend *be, void *p, size_t bytes);
    tkd_status (*sync)(tkd_backend *be); /* waits for all enqueued work; reports its errors */

    /* ---- forward ---- */
    /* x[n] = emb[tok[n]] */
    tkd_status (*embedding_fwd)(tkd_backend *be, const int32_t *tok, int N, // (N) i32
                                const void *emb, int D,                      // (V, D) act
                                float *x);                                   // (N, D) f32
    /* y = w · x · rstd, rstd = 1/sqrt(mean(x²) + eps); rstd may be NULL */
    tkd_status (*rmsnorm_fwd)(tkd_backend *be, const float *x, // (N, D) f32
                              const void *w, int N, int D, float eps, // (D) act
                              void *y, float *rstd);                  // (N, D) act, (N) f32
    /* x_out = x_in + branch, then y = rmsnorm(x_out) (x_out may equal x_in) */
    tkd_status (*add_rmsnorm_fwd)(tkd_backend *be, const float *x_in, // (N, D) f32
                                  const void *branch,                 // (N, D) act
                                  float *x_out,                       // (N, D) f32
                                  const void *w, int N, int D, float eps, // (D) act
                                  void *y, float *rstd);                  // (N, D) act, (N) f32
    /* rmsnorm_fwd of an act input (its values as f32, exactly), the bits of act_to_f32 then
     * rmsnorm_fwd without the f32 copy: Qwen3's q/k norm when no backward needs that copy; y may
     * equal x */
    tkd_status (*rmsnorm_act_fwd)(tkd_backend *be, const void *x, // (N, D) act
                                  const void *w, int N, int D, float eps, // (D) act
                                  void *y, float *rstd);                  // (N, D) act, (N) f32 or NULL
    /* y = x Wᵀ + b; b may be NULL */
    tkd_status (*linear_fwd)(tkd_backend *be, const void *x, // (N, K) act
                             const void *w, const void *b,    // (M, K) act, (M) act
                             int N, int K, int M, void *y);   // (N, M) act
    /* RoPE (rotate-half) on q and k in place, position t = n % T, tables (T, dh/2) f32 */
    tkd_status (*rope_fwd)(tkd_backend *be, void *q, void *k, // (N, H·dh), (N, Hkv·dh) act
                           int N, int T, int H, int Hkv, int dh, const float *cos_t,
                           const float *sin_t);
    /* causal GQA attention, scale 1/sqrt(dh); saved (attn_saved_bytes) keeps what backward needs
     * (CPU: probabilities (B, H, T, T); CUDA: log-sum-exps (B, H, T)). window > 0: query i attends
     * only keys i − window < j ≤ i (the window counts the query itself, as transformers'
     * sliding_window); 0, or ≥ T, masks nothing beyond causality. A window shorter than T is
     * TKD_ERR_UNSUPPORTED unless be->attn_window
     * (attn_bwd: be->attn_window_bwd). sinks (gpt-oss; NULL: none): one logit per query head,
     * in the units of the scaled scores, joining each row's softmax (its max and denominator) and
     * then dropped, as transformers' eager_attention_forward for gpt-oss; no attn_bwd takes them
     * (the model refuses training a model with sinks). doc (NULL: one document per sequence;
     * be->attn_docs, attn_bwd: be->attn_docs_bwd): doc[b·T + i] is the position in sequence b
     * where query i's document starts; the query attends no key before it (packed documents: a
     * block-diagonal causal mask). */
    tkd_status (*attn_fwd)(tkd_backend *be, const void *q, const void *k, const void *v, int B, int T,
                           int H, int Hkv, int dh, int window,
                           const int32_t *doc, // (B·T) or NULL
                           const void *sinks,  // (H) act or NULL
                           void *y,           // (B·T, H·dh) act
                           void *saved);
    size_t (*attn_saved_bytes)(const tkd_backend *be, int B, int T, int H);
    /* h = silu(g) · u */
    tkd_status (*swiglu_fwd)(tkd_backend *be, const void *g, const void *u, int64_t n, void *h);

    /* ---- backward: gradient outputs ADD unless said otherwise (the first contribution to an
     * activation gradient overwrites, so no zeroing pass runs before it); activation gradients
     * are act, the residual stream's dx, rstd and every weight gradient f32 (NULL entries: the
     * model refuses training) */
    tkd_status (*embedding_bwd)(tkd_backend *be, const int32_t *tok, int N, const float *dx, int D,
                                float *demb); // (V, D) f32 +=
    tkd_status (*rmsnorm_bwd)(tkd_backend *be, const void *dy, const float *x, const void *w,
                              const float *rstd, int N, int D, float *dx, float *dw, // +=
                              void *dx_act); // (N, D) act or NULL: the new dx as act (may be dy)
    tkd_status (*linear_bwd)(tkd_backend *be, const void *dy, const void *x, const void *w, int N,
                             int K, int M, void *dx, float *dw, float *db, // dw, db +=
                             int dx_acc); // 1: dx += dy·W; 0: dx = dy·W (its old contents unread)
    tkd_status (*rope_bwd)(tkd_backend *be, void *dq, void *dk, int N, int T, int H, int Hkv, int dh,
                           const float *cos_t, const float *sin_t);
    tkd_status (*attn_bwd)(tkd_backend *be, const void *dy, const void *q, const void *k,
                           const void *v, const void *y, const void *saved, int B, int T, int H,
                           int Hkv, int dh, int window, const int32_t *doc, // the forward's
                           void *dq, void *dk, void *dv); // overwritten
    tkd_status (*swiglu_bwd)(tkd_backend *be, const void *dh, const void *g, const void *u, int64_t n,
                             void *dg, void *du, int acc); // acc 1: +=; 0: overwritten

    /* ---- LM-head consumers ---- */
    tkd_status (*lmhead_topk)(tkd_backend *be, tkd_lmhead_topk_args *a);
    /* The chunk_rows lmhead_topk works well with for vocabulary v when the caller has no value of
     * its own (lm_head.chunk_rows: 0): the CPU 256 rows (a few hundred MB of fp32 logits at real
     * vocabularies); CUDA about 2 GiB of fp32 logits (large GEMMs, few top-k launches), a multiple
     * of 256 in [256, 65536]. */
    int (*lmhead_chunk_rows)(const tkd_backend *be, int64_t v);

    /* ---- training: optimizer and gradient helpers (kernels/cpu/adamw.h's maths) ---- */
    /* f32 -> act, element by element (CUDA: round to nearest even bf16; CPU: a copy) */
    tkd_status (*f32_to_act)(tkd_backend *be, const float *src, void *dst, size_t n); // (n) f32 -> act
    /* act -> f32, exact (an act row that an f32-input op such as rmsnorm_fwd reads: Qwen3's q/k norm) */
    tkd_status (*act_to_f32)(tkd_backend *be, const void *src, float *dst, size_t n); // (n) act -> f32
    /* The segments of a flat parameter array (host table, copied), built once per optimizer. */
    tkd_status (*adamw_create)(tkd_backend *be, const tkd_adamw_seg *segs, int n_segs,
                               tkd_backend_adamw **out);
    void (*adamw_free)(tkd_backend *be, tkd_backend_adamw *a); /* NULL ok */
    /* tkd_adamw_update over the table's segments with g scaled by grad_scale first (the clip
     * coefficient, 1: none), bit-identical on both backends. The fp32 master weights are w (the
     * act compute copy) with lo (be->master_lo_size bytes per element; NULL on the CPU, where w is
     * fp32 and IS the master): both are read and rewritten. The moments m, v are kept as mdt
     * (bf16: loaded to fp32, stored rounded to nearest even; the same bits on both backends). A
     * sub-range [b, e) of the flat arrays: a table of the segments cut to it and shifted by −b,
     * every pointer advanced by b. */
    tkd_status (*adamw_step)(tkd_backend *be, const tkd_backend_adamw *a, void *w, void *lo, // (n) act, lo
                             const float *grads, void *m, void *v, tkd_adamw_dtype mdt, // (n) f32; (n) mdt each
                             const tkd_adamw_hparams *h, int64_t step, float grad_scale);
    /* Master weights from host fp32 (n) into (w, lo), and back, exactly (the CPU: a copy into w;
     * CUDA: tkd_f32_split_bf16 / tkd_bf16_join_f32 through the staging buffer). Upload is ordered
     * on the compute stream, download returns when the data is on the host. */
    tkd_status (*master_upload)(tkd_backend *be, void *w, void *lo, const float *src_host, size_t n);
    tkd_status (*master_download)(tkd_backend *be, float *dst_host, const void *w, const void *lo, size_t n);
    /* *norm2 (host) = Σ g², accumulated in double; waits for the work before it */
    tkd_status (*grad_norm2)(tkd_backend *be, const float *g, size_t n, double *norm2);
    tkd_status (*grad_scale)(tkd_backend *be, float *g, size_t n, float s); /* g *= s */

    /* ---- the fused KL loss (kernels/loss/kl_loss.h; CPU: tkd_kl_cpu_*, CUDA: tkd_kl_cuda_*) ---- */
    /* State for batches of up to n_max rows of (D, V) with p's teacher columns (p->k) and tail
     * draws (p->s); p->chunk_rows is fixed here, the rest of p is read per call. */
    tkd_status (*kl_create)(tkd_backend *be, const tkd_kl_params *p, int64_t n_max, int d, int v,
                            tkd_backend_kl **out);
    void (*kl_free)(tkd_backend *be, tkd_backend_kl *kl); /* NULL ok */
    /* Takes the teacher side of a host batch (top-k, LSE, tail draws, labels; hb->h and hb->w are
     * ignored; with p->dense, labels and hb->teacher_h (N, Dt) / teacher_w (V, Dt), which are act
     * tensors in this backend's memory, the teacher model's, passed through) for the next kl_forward: the CPU keeps the pointers (the caller keeps the batch alive
     * until kl_backward); CUDA copies it to pinned memory (after waiting for the last batch's
     * copy out of it) and sends it to the device on a copy stream. Call it after the model's
     * forward is enqueued and before kl_forward: on CUDA the host copy and the transfer then run
     * while the forward computes. */
    tkd_status (*kl_stage)(tkd_backend *be, tkd_backend_kl *kl, const tkd_kl_params *p,
                           const tkd_kl_batch *hb);
    /* Validates the staged batch (tkd_kl_validate's checks and messages), then the loss of hidden h
     * under head w; with p->grad_in_forward also dh (N, D) f32 overwritten and dw (V, D) f32 +=.
     * Returns when res is known. */
    tkd_status (*kl_forward)(tkd_backend *be, tkd_backend_kl *kl, const tkd_kl_params *p,
                             const void *h, const void *w, // (N, D) act, (V, D) act
                             tkd_kl_result *res, float *dh, float *dw);
    /* After kl_forward on the same batch (recompute mode): dh overwritten with ∂(scale·loss)/∂h,
     * dw += ∂(scale·loss)/∂w. */
    tkd_status (*kl_backward)(tkd_backend *be, tkd_backend_kl *kl, const tkd_kl_params *p,
                              const void *h, const void *w, float scale, float *dh, float *dw);

    /* ---- mixture of experts (forward only: teachers; kernels/moe.h, cpu/cpu_moe.h's maths) ---- */
    /* A workspace for layers of shape p over at most max_tokens rows per call. */
    tkd_status (*moe_create)(tkd_backend *be, const tkd_moe_params *p, int max_tokens, tkd_backend_moe **out);
    void (*moe_free)(tkd_backend *be, tkd_backend_moe *m); /* NULL ok */
    /* y = MoE(x) for N ≤ max_tokens rows: the router's k experts per token (ties to the lower
     * index), each a gated MLP, their outputs summed with the routing weights in increasing
     * expert order. */
    tkd_status (*moe_fwd)(tkd_backend *be, tkd_backend_moe *m, const tkd_moe_act_weights *w,
                          const void *x, int N, // (N, D) act
                          void *y);             // (N, D) act

    /* ---- timing marks (for kernels/backend_profile.h; never a sync per mark) ---- */
    /* Records mark i ≥ 0 after the work enqueued so far: CUDA an event recorded on the compute
     * stream, CPU the monotonic clock. The backend keeps the marks (made at the first use of an
     * index, freed with the backend); recording an index again replaces it. */
    tkd_status (*mark)(tkd_backend *be, int64_t i);
    /* *ms (host) = time from mark a to mark b, both recorded; waits for mark b. */
    tkd_status (*mark_ms)(tkd_backend *be, int64_t a, int64_t b, double *ms);

    /* ---- memory, asked ---- */
    /* *free_bytes: what the backend could still allocate (CUDA: the device's free memory; the CPU:
     * the kernel's MemAvailable), *total_bytes: its size (the device's; the host's RAM). */
    tkd_status (*mem_info)(tkd_backend *be, size_t *free_bytes, size_t *total_bytes);
} tkd_backend_ops;

struct tkd_backend {
    tkd_device device;          /* TKD_DEVICE_CPU or TKD_DEVICE_CUDA, never AUTO: for kernels/ and
                                 * messages; callers above kernels/ ask the capabilities below */
    const char *name;           /* "cpu" | "cuda" */
    const tkd_cuda_policy *policy; /* CUDA: the kernel choices it runs with (cuda_policy.h); NULL on the CPU */
    size_t act_size;            /* bytes of one act element: 4 (fp32) or 2 (bf16) */
    size_t master_lo_size;      /* bytes per element the master weights keep beside the act compute
                                 * copy: 0 (CPU: fp32 act is the master) or 2 (CUDA: an int16
                                 * residual, so bf16 + residual is the exact fp32) */
    int host_addressable;       /* 1: backend memory is host memory (CPU): the host reads and writes
                                 * it in place, upload/download are plain copies; 0: reached only
                                 * through upload/download (CUDA: device memory) */
    int data_parallel;          /* 1: kernels/comm/comm_nccl.h's collectives run on this backend's stream
                                 * (CUDA: data-parallel training, ZeRO-1); 0: one process only (the
                                 * CPU; a profiling wrapper, which has no stream of its own) */
    int attn_window;            /* 1: attn_fwd masks a sliding window shorter than T (the CPU, CUDA);
                                 * 0: it does not, and the model refuses such a layer */
    int attn_window_bwd;        /* 1: attn_bwd does too (the CPU, CUDA); 0: it does not, and a
                                 * model reserved for training refuses such a layer */
    int attn_docs;              /* 1: attn_fwd takes doc (packed documents; the CPU, CUDA) */
    int attn_docs_bwd;          /* 1: attn_bwd does too (the CPU, CUDA) */
    int moe_mxfp4;              /* 1: moe_fwd takes MXFP4 experts (the CPU, CUDA); 0: the model gives
                                 * it act stacks, decoding MXFP4 checkpoints at load */
    const tkd_backend_ops *op;
    void *impl;                 /* the implementation's own state */
};

/* 1 when a host fp32 array is an act tensor of be as it is (host-addressable memory, fp32 act: the
 * CPU): the model then keeps one host copy of its weights that is also the compute copy and the
 * master, and act results (hidden states, logits) are read in place. */
static inline int tkd_backend_host_f32(const tkd_backend *be)
{
    return be->host_addressable && be->act_size == sizeof(float);
}

/* 1 when this binary was built with the CUDA backend. */
int tkd_backend_cuda_built(void);

/* Number of CUDA devices that answer (0 without the backend, a driver or a GPU). */
int tkd_backend_cuda_devices(void);

/* The LM head + top-k op's argument rules, the same on every backend (lmhead_topk checks them
 * again): chunk rows C ≥ 0, 1 ≤ k ≤ 128, k ≤ V ≤ INT32_MAX, τ finite > 0, and with S > 0 tail
 * draws the tail's rules (V within its limit, S in range). TKD_ERR_INVALID_ARG with a message. A
 * tool checks its config with it before anything is computed. */
tkd_status tkd_backend_lmhead_topk_check(int64_t chunk_rows, int64_t v, int k, float tau, int s);

/* Resolves AUTO to CPU or CUDA, the one place it is decided: CUDA when this build has it and a GPU
 * answers, else the CPU; asking for CUDA where none answers is TKD_ERR_UNSUPPORTED. */
tkd_status tkd_backend_resolve(tkd_device want, tkd_device *got);

/* Opens the backend for a resolved device (CPU or CUDA; AUTO is TKD_ERR_INVALID_ARG: resolve it
 * first): the CPU one always exists; CUDA takes device `gpu` among those that answer and makes its
 * streams and handles. *out is owned by the caller (tkd_backend_close). */
tkd_status tkd_backend_open(tkd_device dev, int gpu, tkd_backend **out);

/* The same for a process of a job (both tools): CUDA on the GPU tkd_dist_local_gpu picks for d
 * among those that answer. */
tkd_status tkd_backend_open_local(tkd_device dev, const tkd_dist_info *d, tkd_backend **out);

/* 1 when a backend of the device a config names could train data-parallel (data_parallel once
 * open; auto: it may resolve to CUDA): what a launcher checks before any backend opens. */
int tkd_backend_device_data_parallel(tkd_device dev);

void tkd_backend_close(tkd_backend *be); /* NULL is a no-op */

/* The implementations (kernels/cpu/backend_cpu.c, kernels/cuda/backend_cuda.cu); use tkd_backend_open. */
tkd_status tkd_backend_cpu_open(tkd_backend **out);
tkd_status tkd_backend_cuda_open(int gpu, const tkd_cuda_policy *pol, tkd_backend **out); /* pol NULL: from the environment */

/* The compute stream (a cudaStream_t) of a CUDA backend, NULL for any other: what code beside the
 * seam (kernels/comm/comm_nccl.h's collectives) orders its own stream against. */
void *tkd_backend_cuda_stream(tkd_backend *be);

#ifdef __cplusplus
}
#endif

#endif /* TKD_BACKEND_H */
