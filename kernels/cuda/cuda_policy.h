/* cuda_policy.h — every choice between CUDA kernel paths, made in one place.
 *
 * Where two kernels compute the same op (ours or cuBLAS's GEMM, our attention backward or cuDNN's,
 * the fused loss or its split form), one path is the default and the others stay reachable for A/B
 * measurements and as a way round a problem on some machine. Those choices are this struct: read
 * once from the environment when the CUDA backend opens (tkd_cuda_policy_from_env), one rule for
 * every variable — it names one of the values listed in the knob table (switches also take 1 / 0),
 * an unset or empty variable is the default, and anything else is an error naming the variable and
 * its values — then handed explicitly to the workspaces that use it. Nothing below kernels/ reads
 * the environment for a kernel choice; tests build a policy through this API instead of setenv.
 * Plain C with no CUDA types: the CPU-only build parses, prints and tests it too.
 */
#ifndef TKD_CUDA_POLICY_H
#define TKD_CUDA_POLICY_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The attention backward (TKD_ATTN_BWD). */
typedef enum tkd_policy_attn_bwd {
    TKD_POLICY_ATTN_BWD_WGMMA = 0, /* our Hopper wgmma kernel, then cuDNN, then flash (default) */
    TKD_POLICY_ATTN_BWD_CUDNN = 1, /* cuDNN's fused backward first */
    TKD_POLICY_ATTN_BWD_FLASH = 2, /* only our mma.sync flash backward */
} tkd_policy_attn_bwd;

/* Which of the fused loss's gradient GEMMs run on our Hopper kernels (TKD_KL_GRAD_SM90). */
typedef enum tkd_policy_kl_grad {
    TKD_POLICY_KL_GRAD_AUTO = 0,   /* dH ours where D % 256 == 0, dW cuBLAS (default; docs/PERFORMANCE.md) */
    TKD_POLICY_KL_GRAD_CUBLAS = 1, /* both on cuBLAS */
    TKD_POLICY_KL_GRAD_DH = 2,     /* dH ours, dW cuBLAS */
    TKD_POLICY_KL_GRAD_DW = 3,     /* dW ours, dH cuBLAS */
    TKD_POLICY_KL_GRAD_BOTH = 4,   /* both ours */
} tkd_policy_kl_grad;

/* The persistent schedule of our Hopper LM-head GEMM (TKD_LMHEAD_SM90_SCHED). */
typedef enum tkd_policy_lmhead_sched {
    TKD_POLICY_LMHEAD_SCHED_PINGPONG = 0, /* two consumer groups on alternate tiles (default) */
    TKD_POLICY_LMHEAD_SCHED_COOP = 1,     /* both groups on one 128-row tile */
} tkd_policy_lmhead_sched;

/* How the MoE op runs its experts' GEMMs (TKD_MOE_GEMM). */
typedef enum tkd_policy_moe_gemm {
    TKD_POLICY_MOE_GEMM_AUTO = 0,    /* per call from the routing (kernels/cuda/moe_cuda.h; default) */
    TKD_POLICY_MOE_GEMM_GROUPED = 1, /* two grouped cuBLAS calls per layer */
    TKD_POLICY_MOE_GEMM_LOOP = 2,    /* one cuBLAS GEMM per expert and projection */
    TKD_POLICY_MOE_GEMM_OURS = 3,    /* our grouped GEMM, two launches a layer */
} tkd_policy_moe_gemm;

/* Where the MoE op decodes MXFP4 experts (TKD_MOE_MXFP4). */
typedef enum tkd_policy_moe_mxfp4 {
    TKD_POLICY_MOE_MXFP4_GEMM = 0,  /* inside our Hopper GEMM where it runs (default), else a layer at a time */
    TKD_POLICY_MOE_MXFP4_LAYER = 1, /* always a layer at a time into a bf16 copy */
} tkd_policy_moe_mxfp4;

typedef struct tkd_cuda_policy {
    int attn_bwd;          /* tkd_policy_attn_bwd */
    int cudnn;             /* 1: cuDNN's attention where it takes the shape (default); 0: never */
    int cudnn_bwd_nondet;  /* 1: cuDNN's backward may take non-deterministic engines (default 0) */
    int kl_sm90;           /* 1: the loss's logits on our Hopper GEMM where it runs (default); 0: cuBLAS */
    int kl_fused;          /* 1: the fused loss path (bf16 dS straight from the GEMM, default); 0: split */
    int kl_grad;           /* tkd_policy_kl_grad */
    int topk_fused;        /* 1: the teacher's top-k in our GEMM's epilogue (slower today); 0 (default) */
    int lmhead_sched;      /* tkd_policy_lmhead_sched */
    int moe_gemm;          /* tkd_policy_moe_gemm */
    int moe_mxfp4;         /* tkd_policy_moe_mxfp4 */
} tkd_cuda_policy;

/* The defaults: what runs when no variable is set. */
tkd_cuda_policy tkd_cuda_policy_default(void);

/* Reads every knob through get (getenv's signature; NULL = getenv) into *out. TKD_ERR_CONFIG
 * "TKD_X=value: expected a, b or c (what it chooses)" on a value the knob does not list, and on
 * the retired spellings TKD_NO_CUDNN and TKD_CUDNN_BWD (naming the variable that replaced them). */
tkd_status tkd_cuda_policy_from_env(tkd_cuda_policy *out, const char *(*get)(const char *name));

/* "TKD_ATTN_BWD=wgmma TKD_CUDNN=on ..." — every knob with its value, in the table's order; what
 * `-v` prints and what a run's config.yaml and a cache's manifest record. Returns the length
 * snprintf would write (truncated at cap). */
int tkd_cuda_policy_format(const tkd_cuda_policy *p, char *buf, size_t cap);

/* Appends "# CUDA kernel choices (docs/config.md): TKD_ATTN_BWD=... ...\n" to *text (malloc'd,
 * replaced by a longer malloc'd copy): a YAML comment, so a run's config.yaml and a cache manifest's
 * config record the choices without changing what either means to a reader. TKD_ERR_NOMEM. */
tkd_status tkd_cuda_policy_append_note(const tkd_cuda_policy *p, char **text);

/* Whether results are bit-identical run to run (and so across a resume): false when a knob that
 * trades determinism for speed is on (TKD_CUDNN_BWD_NONDET). *why (may be NULL) names it. */
bool tkd_cuda_policy_deterministic(const tkd_cuda_policy *p, const char **why);

/* The knob table, for docs and --help: name, values (the first is the default), and what it picks.
 * Returns NULL past the last index. */
typedef struct tkd_cuda_knob_info {
    const char *name;
    const char *values;  /* "wgmma|cudnn|flash" */
    const char *help;
    bool nondeterministic; /* its non-default value breaks bit-identical runs */
} tkd_cuda_knob_info;
const tkd_cuda_knob_info *tkd_cuda_policy_knob(int i);

#ifdef __cplusplus
}
#endif

#endif /* TKD_CUDA_POLICY_H */
