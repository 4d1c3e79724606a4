/* train_config.c — the student-train schema (see train_config.h). */
#include "student_train/train_config.h"

#include "common/device.h"
#include "formats/doc_pack.h"
#include "kernels/cpu/adamw.h"
#include "kernels/loss/kl_loss.h"
#include "model/model.h"

#include <stddef.h>

#define T tkd_train_config

static const char *const init_names[] = {"random", "hf", NULL};
static const char *const recompute_names[] = TKD_RECOMPUTE_NAMES; /* tkd_recompute's values */
static const char *const arch_names[] = {"llama", "qwen2", "qwen3", NULL}; /* TKD_TRAIN_ARCH_* */
static const char *const rdzv_names[] = {"auto", "file", "tcp", NULL};
static const char *const best_names[] = {"val_ce", "val_kd", NULL}; /* TKD_TRAIN_BEST_* */
static const char *const state_dtype_names[] = TKD_ADAMW_DTYPE_NAMES; /* tkd_adamw_dtype's values */

static const tkd_config_field fields[] = {
    TKD_CFG_STRING(T, run_name, "run.name", "", "Run name: outputs go to <run.dir>/<name>/; empty = derived from the config file and --set overrides"),
    TKD_CFG_STRING(T, run_dir, "run.dir", "runs", "Directory holding one folder per run"),

    TKD_CFG_ENUM(T, model_init, "model.init", "random", init_names, "Student weights: random (from model.* and train.seed) or hf (a Hugging Face checkpoint dir in model.path)"),
    TKD_CFG_STRING(T, model_path, "model.path", "", "Hugging Face checkpoint directory when model.init = hf"),
    TKD_CFG_ENUM(T, model_arch, "model.arch", "llama", arch_names, "Architecture family of a random student (qwen2 adds q/k/v biases; qwen3 an RMSNorm on each q and k head)"),
    TKD_CFG_INT(T, vocab_size, "model.vocab_size", "0", 0, 1 << 24, "Vocabulary size; 0 = the cache's. Smaller than the cache's only when the teacher's extra ids are padding the data never uses; never larger"),
    TKD_CFG_INT(T, hidden_size, "model.hidden_size", "128", 8, 65536, "Hidden size D"),
    TKD_CFG_INT(T, intermediate_size, "model.intermediate_size", "384", 1, 262144, "SwiGLU inner size"),
    TKD_CFG_INT(T, num_layers, "model.num_layers", "2", 1, 1024, "Decoder blocks"),
    TKD_CFG_INT(T, num_heads, "model.num_heads", "4", 1, 1024, "Attention heads"),
    TKD_CFG_INT(T, num_kv_heads, "model.num_kv_heads", "4", 1, 1024, "Key/value heads (grouped-query attention); divides num_heads"),
    TKD_CFG_INT(T, head_dim, "model.head_dim", "0", 0, 1024, "Head size; 0 = hidden_size / num_heads"),
    TKD_CFG_INT(T, max_position_embeddings, "model.max_position_embeddings", "1024", 1, 1 << 20, "Longest sequence the model accepts"),
    TKD_CFG_FLOAT(T, rope_theta, "model.rope_theta", "10000", 1, 1e9, "RoPE base"),
    TKD_CFG_FLOAT(T, rms_norm_eps, "model.rms_norm_eps", "1e-5", 0, 1, "RMSNorm epsilon"),
    TKD_CFG_BOOL(T, tie_word_embeddings, "model.tie_word_embeddings", "false", "Share the embedding and the LM head"),
    TKD_CFG_FLOAT(T, init_std, "model.init_std", "0.02", 0, 10, "Std of the normal init of a random student"),

    TKD_CFG_STRING(T, cache, "data.cache", "", "Teacher cache directory (made by teacher-dump); empty = CE-only training on data.tokens"),
    TKD_CFG_STRING_LIST(T, tokens, "data.tokens", NULL, "Token files (llm.c .bin, .npy, Megatron prefix; globs allowed) for CE-only training without a cache"),
    TKD_CFG_STRING(T, val_cache, "data.val_cache", "", "Separate validation cache; empty = hold out data.val_fraction of data.cache"),
    TKD_CFG_STRING_LIST(T, val_tokens, "data.val_tokens", NULL, "Validation token files for CE-only runs; empty = hold out data.val_fraction"),
    TKD_CFG_FLOAT(T, val_fraction, "data.val_fraction", "0.05", 0, 0.9, "Fraction of sequences held out for evaluation when no separate validation set is given"),
    TKD_CFG_INT(T, seq_len, "data.seq_len", "0", 0, 1 << 20, "Positions per sequence; 0 = the cache's seq_len (a shorter value uses each sequence's first positions)"),
    TKD_CFG_INT(T, prefetch, "data.prefetch", "4", 1, 64, "Batches the loader thread reads ahead"),
    TKD_CFG_STRING(T, expect_teacher_sha256, "data.expect_teacher_sha256", "", "When set, the cache's teacher sha256 must equal it (guards against a cache from another teacher)"),
    TKD_CFG_ENUM(T, packing, "data.packing", "stream", tkd_packing_names, "With data.tokens (CE only): stream = windows of the token stream, across documents; documents = whole documents, packed with attention kept inside each (needs recorded documents). A cache was packed by teacher-dump and says so itself"),
    TKD_CFG_INT64(T, max_sequences, "data.max_sequences", "0", 0, 1e15, "Use at most this many training sequences; 0 = all"),

    TKD_CFG_ENUM(T, kd_variant, "kd.variant", "renorm", tkd_kl_variant_names, "Loss variant: renorm (softmax over the top-k'), tail (exact top-k' + tail mass), sampled (top-k' + tail draws, unbiased; needs a cache with tail draws)"),
    TKD_CFG_ENUM(T, kd_divergence, "kd.divergence", "fkl", tkd_kl_divergence_names, "Divergence between the teacher's and the student's distributions over the variant's buckets: fkl (forward KL), rkl (reverse KL; not with sampled), jsd (generalised JSD, kd.jsd_beta), skl / srkl (skew forward / reverse KL, kd.skew_alpha), tvd (total variation)"),
    TKD_CFG_FLOAT(T, kd_jsd_beta, "kd.jsd_beta", "0.5", 0, 1, "jsd's beta: beta*KL(p||m) + (1-beta)*KL(q||m), m = beta*p + (1-beta)*q (TRL's GKD); 0 is forward KL, 1 reverse KL"),
    TKD_CFG_FLOAT(T, kd_skew_alpha, "kd.skew_alpha", "0.1", 0, 1, "skl / srkl's alpha, below 1: KL(p || alpha*p + (1-alpha)*q) and KL(q || alpha*q + (1-alpha)*p) (DistiLLM); 0 is forward / reverse KL"),
    TKD_CFG_FLOAT(T, kd_temperature, "kd.temperature", "1", 0.01, 100, "Distillation temperature; tail and sampled need the cache's temperature"),
    TKD_CFG_FLOAT(T, kd_alpha, "kd.alpha", "0.5", 0, 1, "KD weight: loss = alpha*KD + (1-alpha)*CE; 0 = CE only"),
    TKD_CFG_STRING(T, kd_teacher, "kd.teacher", "", "A Hugging Face checkpoint: distil from it online, from its full distribution made chunk by chunk beside the student's (the dense reference a cache is judged against; data.tokens, kd.variant renorm; on the CPU and the GPU)"),
    TKD_CFG_INT(T, kd_topk, "kd.topk", "0", 0, 65535, "Use the first k' stored teacher tokens; 0 = all k"),
    TKD_CFG_INT(T, kd_chunk_size, "kd.chunk_size", "0", 0, 1 << 24, "Rows per chunk of the fused LM-head + loss; 0 = automatic"),
    TKD_CFG_BOOL(T, kd_grad_in_forward, "kd.grad_in_forward", "true", "Make the LM-head gradients in the loss's forward pass (3 GEMMs per chunk); false makes the logits again in backward (4)"),

    TKD_CFG_FLOAT(T, lr, "optim.lr", "3e-3", 0, 10, "Peak learning rate"),
    TKD_CFG_FLOAT(T, min_lr, "optim.min_lr", "3e-4", 0, 10, "Learning rate at the end of the cosine decay"),
    TKD_CFG_INT(T, warmup_steps, "optim.warmup_steps", "20", 0, 1 << 30, "Linear warmup steps"),
    TKD_CFG_FLOAT(T, weight_decay, "optim.weight_decay", "0.1", 0, 10, "AdamW decoupled weight decay (not applied to norms and biases)"),
    TKD_CFG_FLOAT(T, beta1, "optim.beta1", "0.9", 0, 0.999999, "AdamW beta1"),
    TKD_CFG_FLOAT(T, beta2, "optim.beta2", "0.95", 0, 0.999999, "AdamW beta2"),
    TKD_CFG_FLOAT(T, eps, "optim.eps", "1e-8", 0, 1, "AdamW epsilon"),
    TKD_CFG_FLOAT(T, grad_clip, "optim.grad_clip", "1.0", 0, 1e9, "Global gradient-norm clip; 0 = off"),
    TKD_CFG_INT(T, grad_accum, "optim.grad_accum", "1", 1, 1 << 20, "Micro-batches per optimizer step"),
    TKD_CFG_ENUM(T, state_dtype, "optim.state_dtype", "f32", state_dtype_names, "How the AdamW moments m and v are kept: f32 (8 bytes a parameter; the update is torch's fp32 AdamW bit for bit) or bf16 (4 bytes a parameter: each update runs in fp32 and stores m and v rounded to nearest-even bf16, so it is no longer fp32-exact). A checkpoint resumes only with the dtype it was written with"),
    TKD_CFG_ENUM(T, recompute, "train.recompute", "auto", recompute_names,
                 "auto | none | attention | full | full_keep_attention: auto picks, once everything else is allocated, what recomputes least among the plans whose activations fit in the memory left: none when it fits, else attention or full_keep_attention with as many of the last layers kept whole as fit; attention keeps each layer's input and MLP activations and recomputes the attention side (norm, q/k/v, RoPE, attention) in backward; full keeps only each layer's input and recomputes the rest (least memory, ~1/3 more compute); full_keep_attention is full that also keeps each layer's attention output and its statistics, so the attention itself is not run again (long context); gradients identical in every mode"),

    TKD_CFG_INT(T, batch_size, "train.batch_size", "8", 1, 1 << 20, "Sequences per micro-batch"),
    TKD_CFG_INT64(T, max_steps, "train.max_steps", "200", 0, 1e15, "Optimizer steps; 0 = until train.max_tokens or train.epochs"),
    TKD_CFG_INT64(T, stop_after, "train.stop_after", "0", 0, 1e15, "Stop once this step is done, writing a checkpoint, without changing the LR schedule (continue later with --resume); 0 = off"),
    TKD_CFG_INT64(T, max_tokens, "train.max_tokens", "0", 0, 1e18, "Stop after this many training tokens; 0 = no limit"),
    TKD_CFG_INT(T, epochs, "train.epochs", "1000", 1, 1 << 30, "Stop after this many passes over the training split"),
    TKD_CFG_INT64(T, seed, "train.seed", "1234", 0, 9e18, "Seed of the init and of the per-epoch shuffle"),
    TKD_CFG_INT(T, eval_interval, "train.eval_interval", "50", 0, 1 << 30, "Evaluate every N steps (and at the end); 0 = only at the end"),
    TKD_CFG_INT(T, eval_batches, "train.eval_batches", "0", 0, 1 << 30, "Validation batches per evaluation; 0 = the whole split"),
    TKD_CFG_INT(T, checkpoint_interval, "train.checkpoint_interval", "0", 0, 1 << 30, "Checkpoint every N steps (and at the end); 0 = only at the end"),
    TKD_CFG_INT(T, log_interval, "train.log_interval", "10", 1, 1 << 30, "Steps between metrics.jsonl training records"),
    TKD_CFG_BOOL(T, eval_only, "train.eval_only", "false", "Only evaluate the initial student on the validation split (e.g. a teacher loaded with model.init = hf)"),
    TKD_CFG_BOOL(T, keep_best, "train.keep_best", "false", "Also keep checkpoint-best/: the checkpoint of the evaluation with the lowest train.best_metric so far, beside the last one in checkpoint/"),
    TKD_CFG_ENUM(T, best_metric, "train.best_metric", "val_ce", best_names, "What the best evaluation is (lower is better): val_ce (validation cross-entropy) or val_kd (validation KD; needs kd.alpha > 0); for train.keep_best, train.early_stop_patience and the best step reported"),
    TKD_CFG_INT(T, early_stop_patience, "train.early_stop_patience", "0", 0, 1 << 30, "Stop (with a checkpoint, as a finished run) after this many evaluations in a row without a new best train.best_metric; 0 = off"),
    TKD_CFG_ENUM(T, device, "device", "auto", tkd_device_names, "auto | cpu | cuda: where the student trains (cuda: bf16 compute, fp32 master weights and optimizer state on GPU 0); auto takes the GPU when this build has CUDA and one answers, else the CPU"),

    TKD_CFG_ENUM(T, dist_rendezvous, "dist.rendezvous", "auto", rdzv_names, "With several processes (--nproc-per-node, srun): how rank 0 hands the NCCL id to the others. file: through dist.dir; tcp: a connection to MASTER_ADDR:MASTER_PORT; auto: tcp when both are set in the environment (--nproc-per-node sets them), else file. Unused with one process"),
    TKD_CFG_STRING(T, dist_dir, "dist.dir", "", "Directory every rank sees, for the file rendezvous and the per-rank heartbeats; empty = <run.dir>/.<run.name>.dist"),
    TKD_CFG_FLOAT(T, dist_timeout_s, "dist.timeout_s", "600", 1, 86400, "Seconds a rank waits for the others (rendezvous, a step's collectives, a checkpoint's shards) before the run ends with an error naming the late rank"),
};

const tkd_config_schema tkd_train_schema = TKD_CONFIG_SCHEMA("student-train", fields);
