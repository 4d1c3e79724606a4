/* model.h — the Llama-family decoder: load / random init / save, forward, backward, written once
 * over the backend seam (kernels/backend.h): every op runs on the model's backend, CPU or CUDA.
 *
 * Architecture (docs/model.md): token embedding; L blocks of
 *   x += o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))   n1 = rmsnorm(x)
 *   x += down_proj(silu(gate_proj(n2)) · up_proj(n2))                    n2 = rmsnorm(x)
 * then a final RMSNorm. gpt-oss (forward only: a teacher) adds biases to q/k/v/o, one attention
 * sink logit per head (self_attn.sinks), YaRN tables, and an MoE MLP in every block (a biased
 * router, top-k then softmax, clamped-SwiGLU experts with biases; the checkpoint's interleaved
 * gate_up_proj (E, D, 2I), bf16 or MXFP4, converted at load into the op's layout, stored under the
 * internal names mlp.experts.{w_gate,w_up,w_down,b_gate,b_up}). Qwen3-MoE (forward only: a teacher) replaces the MLP of its sparse layers
 * (tkd_model_config_moe) by the backend's mixture-of-experts op (kernels/moe.h: softmax router,
 * top-k experts, each a SwiGLU of moe_intermediate_size); its other layers keep the dense MLP. A
 * model with MoE layers refuses training (tkd_model_reserve). Qwen3 normalises each head of q and
 * k (RMSNorm over head_dim with weights q_norm, k_norm (Dh)) between the projection and RoPE: the
 * backend's row RMSNorm over (N·H, Dh) rows. A layer with a sliding window
 * (tkd_model_config_window) attends i − W < j ≤ i. The model stops at the final hidden states
 * (N, D), N = B·T: the LM head (V, D) is applied by the caller, chunked (the fused KL loss, teacher-dump's top-K), which is why
 * backward takes dHidden and the loss adds its LM-head gradient straight into
 * tkd_model_lm_head_grad(). Tied models share one (V, D) matrix for embedding and head, so the
 * embedding's and the head's gradients add in one buffer.
 *
 * Backends: tkd_model_load_hf / tkd_model_init_random make a model on a CPU backend of its own;
 * the _on and _for_training variants put it on a backend the caller opened (and keeps open while
 * the model lives). On the CPU the compute weights ARE the fp32 parameters (m->params ==
 * m->dparams, no copy). On CUDA the compute weights are a bf16 copy in device memory (m->dparams)
 * and m->params is NULL: an inference model (_on) has nothing else; a trainable one
 * (_for_training) also keeps an int16 residual per weight (m->master_lo), and bf16 + residual is
 * the exact fp32 master weight (common/half.h's tkd_f32_split_bf16: the bf16 half is the fp32
 * value rounded to nearest with ties away from zero, so it differs from round-to-nearest-even only
 * at exact ties). The master costs 2 bytes beyond the compute copy instead of 4; the AdamW kernel
 * updates both halves. Host copies of the weights exist only while loading, saving
 * (tkd_model_save_hf) or through tkd_model_get_params / _set_params, always as plain fp32.
 *
 * Memory: all parameters live in ONE allocation (m->dparams) with views; gradients (m->grads) are a
 * second allocation of the same layout in backend memory (host on the CPU, device on CUDA), made on
 * the first training forward; activations are one allocation sized for the largest (B, T) seen
 * and reused. tkd_model_params() lists every tensor (HF name, shape, offset into the flat arrays,
 * weight decay yes / no) for the optimizer and checkpoints. Not thread-safe: one model, one caller
 * at a time (the ops use OpenMP inside).
 */
#ifndef TKD_MODEL_H
#define TKD_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "formats/hf_config.h"
#include "kernels/backend.h"
#include "formats/safetensors.h"

#define TKD_PARAM_NAME_MAX 80

/* One parameter tensor: its Hugging Face name, shape and place in the flat arrays. */
typedef struct tkd_param_info {
    char name[TKD_PARAM_NAME_MAX]; /* e.g. "model.layers.3.self_attn.q_proj.weight" */
    int ndim;                      /* 1 or 2 */
    int64_t shape[2];
    size_t offset;                 /* in floats, into params / grads / AdamW m and v */
    size_t numel;
    int decay;                     /* 1: AdamW weight decay applies (not norms, not biases) */
} tkd_param_info;

/* Views of one block's tensors (into params or into grads). Biases are NULL without attention_bias,
 * q_norm and k_norm without tkd_arch_qk_norm. */
typedef struct tkd_layer_weights {
    float *attn_norm; // (D)
    float *wq;        // (H·Dh, D)
    float *bq;        // (H·Dh)
    float *wk;        // (Hkv·Dh, D)
    float *bk;        // (Hkv·Dh)
    float *wv;        // (Hkv·Dh, D)
    float *bv;        // (Hkv·Dh)
    float *wo;        // (D, H·Dh)
    float *q_norm;    // (Dh) Qwen3 only, else NULL
    float *k_norm;    // (Dh) Qwen3 only, else NULL
    float *mlp_norm;  // (D)
    float *wg;        // (F, D)
    float *wu;        // (F, D)
    float *wd;        // (D, F)
    /* Qwen3-MoE's sparse layers (tkd_model_config_moe) instead of wg/wu/wd (NULL there): the router
     * and the experts stacked in kernels/cpu/cpu_moe.h's layout — the per-expert tensors
     * mlp.experts.<e>.{gate,up,down}_proj.weight lie one after another, so each stack is a view. */
    float *router;    // (E, D) mlp.gate.weight
    float *eg;        // (E, I, D)
    float *eu;        // (E, I, D)
    float *ed;        // (E, D, I)
    /* The optional tensors stored after a block's others (NULL where absent) */
    float *bo;        // (D) o_proj.bias: attention_bias on llama and gpt-oss (tkd_model_config_o_bias)
    float *sinks;     // (H) self_attn.sinks: gpt-oss's attention sinks (tkd_arch_sinks)
    float *router_b;  // (E) gpt-oss: mlp.router.bias
    float *ebg;       // (E, I) gpt-oss: the experts' gate bias (gate_up_proj_bias's even columns)
    float *ebu;       // (E, I) gpt-oss: the experts' up bias (its odd columns)
    float *ebd;       // (E, D) gpt-oss: mlp.experts.down_proj_bias
} tkd_layer_weights;

typedef struct tkd_model_weights {
    float *embed;              // (V, D)
    tkd_layer_weights *layers; // (L)
    float *final_norm;         // (D)
    float *lm_head;            // (V, D): == embed when tied
} tkd_model_weights;

/* The same tensors as the backend sees them: views into m->dparams (act elements, backend memory). */
typedef struct tkd_layer_dweights {
    const void *attn_norm, *wq, *bq, *wk, *bk, *wv, *bv, *wo, *q_norm, *k_norm, *mlp_norm, *wg, *wu, *wd;
    const void *router, *eg, *eu, *ed; /* MoE layers, as in tkd_layer_weights */
    const void *bo, *sinks, *router_b, *ebg, *ebu, *ebd; /* as in tkd_layer_weights */
} tkd_layer_dweights;

typedef struct tkd_model_dweights {
    const void *embed;
    tkd_layer_dweights *layers; /* (L) */
    const void *final_norm;
    const void *lm_head;
} tkd_model_dweights;

/* Activation recomputation (train.recompute). Values are the config's indices. */
typedef enum tkd_recompute {
    TKD_RECOMPUTE_NONE = 0,      /* every block keeps all its activations */
    TKD_RECOMPUTE_FULL = 1,      /* only each block's input is kept */
    TKD_RECOMPUTE_ATTENTION = 2, /* the input and the MLP's activations are kept */
    TKD_RECOMPUTE_FULL_KEEP_ATTENTION = 3, /* the input, the attention's output and its saved
                                            * statistics are kept: full recompute without the
                                            * attention itself (long context, where it dominates) */
    TKD_RECOMPUTE_AUTO = 4, /* a caller's choice, never a model's mode: pick one of the above with
                             * tkd_model_pick_recompute (student-train does); a model given it keeps
                             * what full keeps */
} tkd_recompute;

/* tkd_recompute's names, indexed by value (the config's train.recompute, student_bench's
 * --recompute). A macro so that the config schema builds without the model library (the config
 * fuzzer compiles the schema alone). */
#define TKD_RECOMPUTE_NAMES {"none", "full", "attention", "full_keep_attention", "auto", NULL}

typedef struct tkd_model_acts tkd_model_acts; /* private: activation buffers */

typedef struct tkd_model {
    tkd_model_config cfg;
    size_t n_params;        /* floats in params (and grads) */
    float *params;          /* host fp32 weights, one allocation, owned (CPU; NULL on CUDA) */
    void *master_lo;        /* the master weights' residuals in backend memory (n_params elements of
                             * be->master_lo_size bytes: int16 on CUDA) beside the compute copy
                             * dparams; NULL on the CPU (params are the master) and for an
                             * inference model on CUDA */
    float *grads;           /* backend memory; NULL until the first training forward; same layout */
    tkd_model_weights w;    /* views into params (NULL on CUDA) */
    tkd_model_weights g;    /* views into grads (all NULL while grads is NULL); backend memory */
    tkd_param_info *info;   /* n_info entries, in storage order */
    int n_info;
    int info_per_layer;     /* entries of one block (they follow the embedding's, block by block) when
                             * every block is alike; a model mixing dense and MoE blocks: 0 */
    int *info_layer;        /* (L + 1) index in info of block l's first entry; [L]: the final norm's */
    float *rope_cos;        // (max_position_embeddings, Dh/2) host
    float *rope_sin;        // (max_position_embeddings, Dh/2) host
    tkd_model_acts *acts;
    tkd_backend *be;        /* where the ops run; owned when be_owned */
    int be_owned;
    void *dparams;          /* compute weights in backend memory (== params on the CPU) */
    tkd_model_dweights d;   /* views into dparams */
    float *d_rope_cos;      /* the RoPE tables in backend memory (== rope_cos on the CPU) */
    float *d_rope_sin;
    tkd_recompute recompute; /* what training keeps of each block (tkd_model_set_recompute) */
    int recompute_whole;     /* the last blocks that keep everything whatever recompute says
                              * (tkd_model_set_recompute_whole) */
    int lend_grads;         /* the gradient buffer holds activations until each block's backward
                             * (tkd_model_set_lend_grads) */
    tkd_backend_moe *moe;   /* the MoE layers' workspace on be (one shape for all), sized by reserve */
    void *qexp;             /* cfg.experts_mxfp4: every MoE layer's MXFP4 experts, backend memory */
    tkd_moe_mxfp4 *qlayer;  /* (L) views into qexp (model/model_mxfp4.c) */
    int moe_rows;           /* rows one moe_fwd call takes: the forward calls it in chunks of these */
    tkd_status (*grad_hook)(void *ctx, struct tkd_model *m, int layer); /* tkd_model_set_grad_hook */
    void *grad_hook_ctx;
} tkd_model;

/* A model with weights drawn from normal(0, cfg->initializer_range) by a seeded generator (same seed,
 * same weights, on every machine), norm weights 1, biases 0 — transformers' own init for these models
 * (no scaled output projections). On success *out is owned by the caller (tkd_model_free). */
tkd_status tkd_model_init_random(const tkd_model_config *cfg, uint64_t seed, tkd_model **out);

/* The same weights on a caller's backend (be borrowed: it must outlive the model). The draws are a
 * counter-based stream (splitmix64 steps), made in parallel and bit-identical to the CPU's. */
tkd_status tkd_model_init_random_on(const tkd_model_config *cfg, uint64_t seed, tkd_backend *be,
                                    tkd_model **out);

/* The same weights on a caller's backend, made for training: on CUDA the fp32 draws are kept as
 * device master weights (bit-identical to the CPU's params), the bf16 compute copy being their high
 * half. On the CPU the same as tkd_model_init_random_on. */
tkd_status tkd_model_init_random_for_training(const tkd_model_config *cfg, uint64_t seed, tkd_backend *be,
                                              tkd_model **out);

/* An inference model of cfg on a caller's backend (borrowed) whose weights are left as allocated
 * (unset): for benchmarks that fill m->dparams themselves (teacher_bench draws a 30B MoE's weights on
 * the device in a second, where the seeded host draws above take minutes). */
tkd_status tkd_model_create_unset(const tkd_model_config *cfg, tkd_backend *be, tkd_model **out);

/* Loads <dir>/config.json and the safetensors weights (F32/F16/BF16, converted to fp32). A missing
 * tensor is TKD_ERR_NOT_FOUND and a wrong shape TKD_ERR_FORMAT, each naming the tensor and the file.
 * lm_head.weight is required unless tie_word_embeddings. *out owned by the caller. */
tkd_status tkd_model_load_hf(const char *dir, tkd_model **out);

/* The same onto a caller's backend (borrowed): on CUDA each tensor is converted on the way into
 * bf16 device memory, and no host fp32 copy of the model is kept. */
tkd_status tkd_model_load_hf_on(const char *dir, tkd_backend *be, tkd_model **out);

/* The same for training: fp32 master weights in backend memory (CUDA) beside the compute copy. */
tkd_status tkd_model_load_hf_for_training(const char *dir, tkd_backend *be, tkd_model **out);

/* All weights as host fp32 (n_params floats, the layout of tkd_model_params) from the master
 * weights, and back (set refreshes the compute copy). TKD_ERR_UNSUPPORTED for an inference model on
 * CUDA (no fp32 weights). */
tkd_status tkd_model_get_params(const tkd_model *m, float *host);
tkd_status tkd_model_set_params(tkd_model *m, const float *host);

/* Writes <dir>/config.json and <dir>/model.safetensors (dtype TKD_DTYPE_F32 or TKD_DTYPE_BF16;
 * creates <dir> if absent), loadable by transformers' AutoModelForCausalLM.from_pretrained.
 * lm_head.weight is omitted when tied. On CUDA the master weights are downloaded to a host buffer
 * for the writer (an inference model there has none: TKD_ERR_UNSUPPORTED). */
tkd_status tkd_model_save_hf(const tkd_model *m, const char *dir, tkd_dtype dtype);

void tkd_model_free(tkd_model *m); /* NULL is a no-op */

/* The parameter list (n entries), in storage order. */
const tkd_param_info *tkd_model_params(const tkd_model *m, int *n);

/* Sizes the activation buffers for up to (B, T) once (forward does it on demand; calling it up front
 * keeps allocation out of the training loop). training = 1 keeps every layer's activations for
 * backward and allocates the gradients. T must not exceed max_position_embeddings. */
tkd_status tkd_model_reserve(tkd_model *m, int B, int T, int training);

/* Sets the recomputation mode. Per token and layer a training forward keeps (A = act bytes, Q and
 * KV the q and k/v widths, F the MLP's): none 8·D + A·(2Q + 2·KV) + 2A·F bytes (the input, q, k, v,
 * the attention's output and statistics, the residual after attention, gate and up); attention
 * 8·D + 2A·F (the input, the residual after attention, gate, up), backward recomputing the
 * attention side — input norm, q/k/v projections, RoPE, the attention forward — (by FLOPs about a
 * third of the blocks' forward at the 1B and 3B shapes at T 8192, more at longer T); full 4·D (the
 * input), backward recomputing the whole block (about one more forward); full_keep_attention
 * 4·D + A·Q. Every mode remakes the two norms' outputs and the SwiGLU product before a block's
 * backward (a norm and an elementwise pass), and all share one set of what they do not keep. The
 * ops run again in the same order on the same inputs, so the gradients are bit-identical in every
 * mode; the last block is never recomputed (the shared set still holds its activations). Drops
 * the activation buffers; the next forward sizes them for the new layout. */
void tkd_model_set_recompute(tkd_model *m, tkd_recompute mode);

/* Keeps everything (as none) in the last `whole` blocks (clamped to [0, L]) and recomputes the
 * others as tkd_model_set_recompute says: train.recompute: auto's partial step between two modes,
 * one block's activations at a time. The gradients stay the same bits. Drops the activation
 * buffers when it changes, as tkd_model_set_recompute does. */
void tkd_model_set_recompute_whole(tkd_model *m, int whole);

/* *bytes = the activation buffer a training reserve of batch (B, T) would allocate in recompute
 * mode `mode` (not AUTO) with the last `whole` blocks whole, with the gradient loans of the current
 * lend setting (which needs the gradient buffer: allocated here if it is not yet). Allocates
 * nothing else. */
tkd_status tkd_model_recompute_bytes(tkd_model *m, tkd_recompute mode, int whole, int B, int T, size_t *bytes);

/* train.recompute: auto's answer. */
typedef struct tkd_recompute_fit {
    tkd_recompute mode; /* of every block but the last `whole` */
    int whole;          /* blocks that keep everything (0 with mode none) */
    size_t need;        /* the activation bytes of that plan */
    size_t budget;      /* the bytes there were for them */
} tkd_recompute_fit;

/* The plan that recomputes the fewest FLOPs in backward among those whose activations
 * (tkd_model_recompute_bytes) fit in budget bytes: none when it fits; else, for each of attention,
 * full_keep_attention and full, the most blocks kept whole that fit, ranked by (blocks recomputed) ×
 * (the mode's FLOPs per block: attention's are the q/k/v GEMMs and the causal attention forward,
 * the others' every GEMM of the block, full's both), so attention wins at short T and
 * full_keep_attention at long T. When nothing fits: full, with need > budget for the caller to
 * report. */
tkd_status tkd_model_pick_recompute(tkd_model *m, int B, int T, size_t budget, tkd_recompute_fit *out);

/* train.recompute: auto, once everything else a run holds is allocated. The budget is the
 * backend's free memory (its mem_info) plus the activations reserved now, less a margin for what
 * the first step allocates on demand (512 MiB, 1/32 of the device, the attention backward's fp32 dQ
 * accumulators); budget_override > 0 replaces it (tests, student_bench --act-budget). Picks with
 * tkd_model_pick_recompute, sets the plan and reserves a training batch (B, T); the reserve may
 * fail when nothing fits. */
tkd_status tkd_model_fit_recompute(tkd_model *m, int B, int T, size_t budget_override, tkd_recompute_fit *out);

/* Lends the gradient buffer to the activations (on: 1): block l's kept activations go first into
 * the gradients of block l − 1 (block 0's into the embedding's when the head is untied), which
 * its backward does not write until after block l's, and the rest into the activations' own
 * buffer. The backward zeroes each lent range just before writing it, so the gradients of one
 * forward/backward are bit-identical to lending off, but a backward no longer adds to what the
 * lent ranges held: only for one forward and backward per zeroing (gradient accumulation over
 * micro-batches needs it off), and an inference forward between a backward and the optimizer step
 * may overwrite the embedding's gradient. Saves min(activations, gradients) of each block: ~10 GiB
 * for a ~3B student at T 8192. Drops the activation buffers, as tkd_model_set_recompute does. */
void tkd_model_set_lend_grads(tkd_model *m, int on);

/* Bytes of the activation buffers sized now (0 before the first forward or reserve). */
size_t tkd_model_activation_bytes(const tkd_model *m);

/* Bytes of kept activations placed in the gradient buffer (tkd_model_set_lend_grads; 0 without):
 * with the activation bytes, what the activations would take without the loan. */
size_t tkd_model_activation_lent_bytes(const tkd_model *m);

/* Forward over host tokens (B, T) int32 (each in [0, V), else TKD_ERR_INVALID_ARG naming the
 * position). *hidden (optional) receives a view of the final hidden states (B·T, D) after the final
 * RMSNorm, in backend memory as act elements (a const float * on the CPU backend), owned by the
 * model and valid until the next forward; on CUDA the work is enqueued, not finished. training = 0 keeps no activations (teacher);
 * training = 1 keeps them for tkd_model_backward. */
tkd_status tkd_model_forward(tkd_model *m, const int32_t *tokens, int B, int T, int training,
                             const void **hidden);

/* The same over sequences of packed documents (data.packing: documents): doc (host (B, T) int32;
 * NULL: one document per sequence, tkd_model_forward) gives for each position where its document
 * starts in its sequence (0 ≤ doc[b·T + i] ≤ i, non-decreasing in i, doc[b·T + i] = i at a start).
 * Each document is computed as if alone: attention never reaches an earlier document, and RoPE
 * positions restart at 0 at each start. The backward of a training forward keeps the documents.
 * A backend without be->attn_docs (training: attn_docs_bwd) is TKD_ERR_UNSUPPORTED naming it. */
tkd_status tkd_model_forward_docs(tkd_model *m, const int32_t *tokens, const int32_t *doc, int B, int T,
                                  int training, const void **hidden);

/* Backward of the last training forward, given dHidden = ∂loss/∂hidden (B·T, D) fp32 in backend
 * memory (what the backend's loss writes). ADDS into m->grads (so gradient accumulation over
 * micro-batches is just several forward/backward pairs), including the embedding; the LM head's own
 * gradient comes from the loss via tkd_model_lm_head_grad. On CUDA the work is enqueued. */
tkd_status tkd_model_backward(tkd_model *m, const float *dhidden);

/* The LM-head weight (V, D) (the embedding when tied) as host fp32 (NULL on CUDA) and its fp32
 * gradient buffer in backend memory (NULL before the first training forward); the loss adds dW
 * into the latter. */
const float *tkd_model_lm_head(const tkd_model *m);
/* The LM-head weight as the backend sees it (V, D) act elements: what LM-head consumers take. */
const void *tkd_model_lm_head_dev(const tkd_model *m);
float *tkd_model_lm_head_grad(tkd_model *m);

/* A hook tkd_model_backward calls as soon as gradients are final for this backward (data-parallel
 * training starts reducing them while the earlier layers' backward runs): after block l's backward
 * with layer = l (the tensors of tkd_model_layer_range(l)), and once at the end with layer = -1
 * (everything else: the embedding, the final norm, the LM head). On CUDA the gradient work is
 * enqueued, not finished: the hook orders its own work after the backend's stream. An error from the
 * hook ends the backward with it. fn NULL: no hook. */
void tkd_model_set_grad_hook(tkd_model *m, tkd_status (*fn)(void *ctx, tkd_model *m, int layer), void *ctx);

/* The elements [begin, end) of the flat arrays that hold block l's tensors (contiguous: storage order). */
void tkd_model_layer_range(const tkd_model *m, int l, size_t *begin, size_t *end);

/* Zeroes all gradients (no-op when none are allocated); enqueued on CUDA. */
tkd_status tkd_model_zero_grad(tkd_model *m);

/* Full-vocabulary logits (N, V) = hidden (N, D) · lm_headᵀ through the backend's linear: hidden
 * (N, D) act and logits (N, V) act in backend memory (host fp32 where tkd_backend_host_f32, the CPU)
 * — for tests and small vocabularies. */
tkd_status tkd_model_logits(const tkd_model *m, const void *hidden, int64_t N, void *logits); // (N, D), (N, V)

#endif /* TKD_MODEL_H */
