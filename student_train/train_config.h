/* train_config.h — student-train's settings: the typed struct and its schema (the one place every
 * key, default, range and help text is declared; --help and --print-config come from it).
 * docs/student-train.md explains the keys and the loss variants. */
#ifndef TKD_TRAIN_CONFIG_H
#define TKD_TRAIN_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "common/config.h"

/* Enum indices of the schema's ENUM fields (the order of the allowed-name lists). */
enum { TKD_TRAIN_INIT_RANDOM = 0, TKD_TRAIN_INIT_HF = 1 };
enum { TKD_TRAIN_ARCH_LLAMA = 0, TKD_TRAIN_ARCH_QWEN2 = 1, TKD_TRAIN_ARCH_QWEN3 = 2 };
enum { TKD_TRAIN_RDZV_AUTO = 0, TKD_TRAIN_RDZV_FILE = 1, TKD_TRAIN_RDZV_TCP = 2 };
enum { TKD_TRAIN_BEST_VAL_CE = 0, TKD_TRAIN_BEST_VAL_KD = 1 }; /* train.best_metric */

/* dist.rendezvous as the kind argument of tkd_rdzv_config_from_env (common/dist.h): -1 auto, else
 * TKD_RDZV_FILE / TKD_RDZV_TCP. */
static inline int tkd_train_rdzv_kind(int rendezvous) { return rendezvous - 1; }

typedef struct tkd_train_config {
    /* run */
    char *run_name;        /* "" = derived from the config file name and the --set overrides */
    char *run_dir;         /* parent of runs/<name>/ */
    /* model */
    int model_init;        /* random | hf */
    char *model_path;      /* HF checkpoint dir when init = hf */
    char *kd_teacher;      /* kd.teacher: an HF checkpoint distilled from online, densely ("" = a cache) */
    int model_arch;        /* llama | qwen2 | qwen3 (random init) */
    int vocab_size;        /* 0 = the cache's vocabulary */
    int hidden_size;
    int intermediate_size;
    int num_layers;
    int num_heads;
    int num_kv_heads;
    int head_dim;          /* 0 = hidden_size / num_heads */
    int max_position_embeddings;
    double rope_theta;
    double rms_norm_eps;
    bool tie_word_embeddings;
    double init_std;
    /* data */
    char *cache;           /* teacher cache dir; "" = no teacher (CE only, from data.tokens) */
    tkd_strlist tokens;    /* token files for CE-only runs (llm.c .bin / .npy) */
    char *val_cache;       /* separate validation cache; "" = hold out val_fraction of data.cache */
    tkd_strlist val_tokens;/* separate validation token files for CE-only runs */
    double val_fraction;
    int seq_len;           /* 0 = the cache's seq_len; may be shorter (first positions are used) */
    int packing;           /* data.packing (tkd_packing) for data.tokens; a cache says its own */
    int prefetch;          /* batches read ahead by the loader thread */
    char *expect_teacher_sha256; /* "" = any; else the cache's teacher identity must equal it */
    int64_t max_sequences; /* 0 = all; limits the training split (quick runs) */
    /* kd */
    int kd_variant;        /* renorm | tail | sampled (tkd_kl_variant) */
    int kd_divergence;     /* fkl | rkl | jsd | skl | srkl | tvd (tkd_kl_divergence) */
    double kd_jsd_beta;    /* jsd's β in [0, 1] */
    double kd_skew_alpha;  /* skl / srkl's α in [0, 1) */
    double kd_temperature;
    double kd_alpha;       /* KD weight; CE weight is 1 - alpha */
    int kd_topk;           /* k' <= cache k; 0 = all stored columns */
    int kd_chunk_size;     /* rows per chunk of the fused loss; 0 = automatic */
    bool kd_grad_in_forward;
    /* optim */
    double lr;
    double min_lr;
    int warmup_steps;
    double weight_decay;
    double beta1;
    double beta2;
    double eps;
    double grad_clip;      /* 0 = no clipping */
    int grad_accum;
    int state_dtype;       /* optim.state_dtype: a tkd_adamw_dtype (kernels/cpu/adamw.h): 0 f32, 1 bf16 */
    int recompute;         /* train.recompute: a tkd_recompute (model/model.h), AUTO resolved by tkd_train_fit_recompute */
    /* train */
    int batch_size;        /* sequences per micro-batch */
    int64_t max_steps;     /* 0 = until max_tokens / epochs */
    int64_t stop_after;    /* 0 = off; else stop (with a checkpoint) once this step is done, schedule unchanged */
    int64_t max_tokens;    /* 0 = no limit */
    int epochs;
    int64_t seed;
    int eval_interval;     /* steps; 0 = only at the end */
    int eval_batches;      /* 0 = the whole validation split */
    int checkpoint_interval; /* steps; 0 = only at the end */
    int log_interval;
    bool eval_only;        /* evaluate the initial student and stop (e.g. a teacher's val CE) */
    bool keep_best;        /* keep checkpoint-best/: the checkpoint of the best evaluation so far */
    int best_metric;       /* val_ce | val_kd (TKD_TRAIN_BEST_*): what "best" means, lower is better */
    int early_stop_patience; /* stop after this many evaluations without improvement; 0 = off */
    int device;            /* auto | cpu | cuda */
    /* dist: only read when the world (common/dist.h) is larger than 1 */
    int dist_rendezvous;   /* auto | file | tcp (TKD_TRAIN_RDZV_*) */
    char *dist_dir;        /* file rendezvous and heartbeats; "" = the run's directory */
    double dist_timeout_s; /* how long a rank waits for the others (rendezvous, a collective, a checkpoint) */
} tkd_train_config;

extern const tkd_config_schema tkd_train_schema;

#endif /* TKD_TRAIN_CONFIG_H */
