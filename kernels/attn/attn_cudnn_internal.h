/* attn_cudnn_internal.h — what attn_cudnn.cu (the plan cache, the forward and backward entry points)
 * and attn_cudnn_graph.cu (cuDNN's operation graphs and the engine pick) share, and nothing else
 * includes: the plan's key and state, the constants they are sized by, and the four calls the
 * cache makes into the graph side. Host C++ only; empty without cuDNN.
 */
#ifndef TKD_ATTN_CUDNN_INTERNAL_H
#define TKD_ATTN_CUDNN_INTERNAL_H

#ifdef TKD_HAVE_CUDNN

#include <stdint.h>

#include "common/status.h"
#include "kernels/cuda/cuda_check.h"

namespace tkd_cudnng {

constexpr int kPlans = 16;   /* cached plans: a teacher pass uses a shape or two (with, without lse) */
constexpr int kDescs = 128;  /* descriptors one graph is built from (backward: 31 tensors, 45 ops, graph, heur) */
constexpr int kOps = 32;     /* operations in the graph (forward 14, backward at most 23) */
constexpr int kCfgs = 16;    /* engine configs taken from one heuristics query */
constexpr int kKnobs = 32;   /* knob choices of one engine config (cuDNN 9 has fewer knob types) */
constexpr int kMsg = TKD_ERROR_MSG_MAX; /* a cached refusal's message */

/* Unique ids of the tensors the variant pack names; the virtual ones count up from kUidVirtual. */
constexpr int64_t kUidQ = 1, kUidK = 2, kUidV = 3, kUidY = 4, kUidStats = 5, kUidScale = 6, kUidNegInf = 7;
constexpr int64_t kUidDO = 8, kUidDQ = 9, kUidDK = 10, kUidDV = 11, kUidSoftmaxSum = 12, kUidOne = 13;
constexpr int64_t kUidDQAccum = 14;
constexpr int64_t kUidVirtual = 100;

struct Key {
    int B, T, H, Hkv, dh, lse; /* compared with memcmp: zero the padding */
    int bwd;                   /* 1: the backward graph (lse then always given) */
    int Hs, Hkvs;              /* heads per token row in memory (H, Hkv unless a group of the backward) */
    int nondet;                /* backward: dQ accumulated in fp32 (atomics), non-deterministic engines allowed */
};

/* Which engine and knob settings an engine config is: a group of the backward prefers its one-call
 * plan's, so that each (batch, head) is computed the same way. */
struct Ident {
    int64_t engine;          /* CUDNN_ATTR_ENGINE_GLOBAL_INDEX; -1: none */
    int nknobs;
    int64_t knob[kKnobs][2]; /* (type, value) in the config's order */
};

struct Plan {
    Key key;
    unsigned long long used;          /* 0: free slot */
    tkd_status refused;               /* not TKD_OK: cuDNN refused this key, why says how */
    char why[kMsg];
    cudnnBackendDescriptor_t desc[kDescs]; /* all the plan was built from, alive as long as it */
    int ndesc;
    cudnnBackendDescriptor_t ops[kOps];    /* the graph's operations, in order (also in desc) */
    int nops;
    int64_t next_uid;
    cudnnBackendDescriptor_t cfgs[kCfgs];  /* the current heuristics query's engine configs */
    int ncfgs;
    cudnnBackendDescriptor_t plan;
    int64_t ws_bytes;                      /* cuDNN's workspace for the plan */
    int64_t ws_off;                        /* backward: our softmax_sum (B, H, T) fp32 before it */
    int64_t accum_off, accum_bytes;        /* non-deterministic backward: its dQ accumulator (B, H, T, dh) fp32 */
    Ident ident;                           /* the engine config the plan was made from */
    bool nondet;                           /* its engine is noted NONDETERMINISTIC */
    int gb, gk;                            /* backward: the call size chosen for this key (0: not yet) */
    float scale, neg_inf, one;             /* by-value scalars: the variant pack points here */
    cudnnBackendDescriptor_t pack;         /* the last call's variant pack and what it holds */
    const void *pack_ptrs[12];
};

/* Every backend call in one place; failures pass through TKD_CUDNN_CHECK with the attribute named
 * in the message (the macro prints the expression). */
#define SET(d, name, type, n, v) TKD_CUDNN_CHECK(cudnnBackendSetAttribute((d), name, type, (n), (v)))

/* Teardown of one descriptor (NULL is a no-op) and of everything a plan holds. */
void destroy(cudnnBackendDescriptor_t d);
void plan_destroy(Plan *p);
/* The finalized operation graph for p->key (attn_cudnn_graph.cu). */
tkd_status graph_build(Plan *p, cudnnHandle_t h, cudnnBackendDescriptor_t *out);
/* The first engine config of graph g that builds a plan, into p->plan (attn_cudnn_graph.cu). */
tkd_status plan_pick(Plan *p, cudnnBackendDescriptor_t g, const Ident *prefer);

} // namespace tkd_cudnng

#endif /* TKD_HAVE_CUDNN */
#endif
