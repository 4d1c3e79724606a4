/* attn_cudnn.cu — see attn_cudnn.h. Host code only: the graph, heuristics, plans and variant packs
 * of cuDNN's backend API. The pattern follows the one cudnn-frontend lowers its SDPA node to for
 * cuDNN < 9.21 (its "composite" node: causal mask by GEN_INDEX + CMP_GE + BINARY_SELECT, softmax
 * from reductions and pointwise ops, P in the io type before the second matmul); the code is ours. */
#include "kernels/attn/attn_cudnn.h"

#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef TKD_HAVE_CUDNN

namespace {

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

/* Runs expr; on failure prefixes the message with what the graph step was. */
#define STEP(what, expr)                                   \
    do {                                                   \
        tkd_status step_st_ = (expr);                      \
        if (step_st_ != TKD_OK)                            \
            return tkd_error_prefix(step_st_, "%s", what); \
    } while (0)

/* Teardown: a failure to destroy is not actionable (as cudaFree in tkd_cuda_free). */
void destroy(cudnnBackendDescriptor_t d)
{
    if (d)
        (void)cudnnBackendDestroyDescriptor(d);
}

void plan_destroy(Plan *p)
{
    destroy(p->pack);
    destroy(p->plan);
    for (int i = 0; i < p->ncfgs; i++)
        destroy(p->cfgs[i]);
    for (int i = p->ndesc - 1; i >= 0; i--)
        destroy(p->desc[i]);
    memset(p, 0, sizeof *p);
}

/* A new descriptor of type t, owned by p. */
tkd_status keep(Plan *p, cudnnBackendDescriptorType_t t, cudnnBackendDescriptor_t *out)
{
    if (p->ndesc == kDescs)
        return tkd_error_set(TKD_ERR_INTERNAL, "cudnn attention: more than %d descriptors", kDescs);
    TKD_CUDNN_CHECK(cudnnBackendCreateDescriptor(t, &p->desc[p->ndesc]));
    *out = p->desc[p->ndesc++];
    return TKD_OK;
}

/* A 4-d tensor. uid 0: virtual (an intermediate cuDNN never writes out), numbered by p. */
tkd_status tensor(Plan *p, int64_t uid, cudnnDataType_t dt, const int64_t dim[4], const int64_t str[4],
                  bool by_value, cudnnBackendDescriptor_t *out)
{
    cudnnBackendDescriptor_t t;
    TKD_TRY(keep(p, CUDNN_BACKEND_TENSOR_DESCRIPTOR, &t));
    const bool is_virtual = uid == 0, yes = true;
    const int64_t id = is_virtual ? p->next_uid++ : uid, align = 16;
    SET(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    SET(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim);
    SET(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str);
    SET(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &id);
    SET(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    if (is_virtual)
        SET(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes);
    if (by_value)
        SET(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
    TKD_CUDNN_CHECK(cudnnBackendFinalize(t));
    *out = t;
    return TKD_OK;
}

tkd_status add_op(Plan *p, cudnnBackendDescriptor_t op)
{
    if (p->nops == kOps)
        return tkd_error_set(TKD_ERR_INTERNAL, "cudnn attention: more than %d operations", kOps);
    TKD_CUDNN_CHECK(cudnnBackendFinalize(op));
    p->ops[p->nops++] = op;
    return TKD_OK;
}

/* y = mode(x[, b[, t]]) computed in prec; axis only for GEN_INDEX. */
tkd_status pointwise(Plan *p, cudnnPointwiseMode_t mode, cudnnDataType_t prec, cudnnBackendDescriptor_t x,
                     cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                     int64_t axis = -1)
{
    cudnnBackendDescriptor_t pw, op;
    TKD_TRY(keep(p, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, &pw));
    SET(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    SET(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (mode == CUDNN_POINTWISE_GEN_INDEX)
        SET(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    TKD_CUDNN_CHECK(cudnnBackendFinalize(pw));
    TKD_TRY(keep(p, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, &op));
    const float one = 1.0f;
    SET(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
    SET(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    if (b)
        SET(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t)
        SET(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    SET(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    return add_op(p, op);
}

/* y = reduce(x) over the axes where y's dimension is 1, in fp32. */
tkd_status reduction(Plan *p, cudnnReduceTensorOp_t red, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y)
{
    cudnnBackendDescriptor_t rd, op;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    TKD_TRY(keep(p, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, &rd));
    SET(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red);
    SET(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    TKD_CUDNN_CHECK(cudnnBackendFinalize(rd));
    TKD_TRY(keep(p, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, &op));
    SET(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SET(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    SET(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd);
    return add_op(p, op);
}

/* c = a·b batched over the two leading dims (b's head dim may divide a's: GQA), fp32 accumulation. */
tkd_status matmul(Plan *p, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c)
{
    cudnnBackendDescriptor_t md, op;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    TKD_TRY(keep(p, CUDNN_BACKEND_MATMUL_DESCRIPTOR, &md));
    SET(md, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    TKD_CUDNN_CHECK(cudnnBackendFinalize(md));
    TKD_TRY(keep(p, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, &op));
    SET(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    SET(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    SET(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    SET(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &md);
    return add_op(p, op);
}

/* The graph's non-virtual tensors and the shapes of the virtual ones, for key. Dimensions are
 * (b, h, s, d) as cuDNN's attention pattern wants them, strides our row-major token layout:
 * q, y (B, H, T, dh) element (b, h, t, d) at ((b·T + t)·H + h)·dh + d; K enters transposed,
 * (B, Hkv, dh, T); the score matrix S (B, H, T, T) and row statistics (B, H, T, 1) are virtual,
 * with packed strides (lse (B, H, T) is exactly that row-statistics layout). */
struct Shapes {
    int64_t q_dim[4], q_str[4], kt_dim[4], kt_str[4], v_dim[4], v_str[4];
    int64_t s_dim[4], s_str[4], r_dim[4], r_str[4], one[4];
    int64_t qv_str[4]; /* q's shape packed: virtual tensors of it (a group's rows are Hs heads wide) */
    int64_t st_str[4]; /* lse (B, Hs, T) in memory: a group's stats are a slice of the whole */
};

/* Memory strides use the heads per row (Hs, Hkvs), so a group of the backward addresses its heads
 * inside the whole tensors; virtual tensors stay packed. */
Shapes shapes_for(const Key &k)
{
    const int64_t B = k.B, T = k.T, H = k.H, G = k.Hkv, D = k.dh, HS = k.Hs, GS = k.Hkvs;
    Shapes s = {
        {B, H, T, D}, {T * HS * D, D, HS * D, 1},
        {B, G, D, T}, {T * GS * D, D, 1, GS * D},
        {B, G, T, D}, {T * GS * D, D, GS * D, 1},
        {B, H, T, T}, {H * T * T, T * T, T, 1},
        {B, H, T, 1}, {H * T, T, 1, 1},
        {1, 1, 1, 1},
        {T * H * D, D, H * D, 1},
        {HS * T, T, 1, 1},
    };
    return s;
}

/* S = scale·Q·Kᵀ with entries above the diagonal set to −inf: the masked scores *out (fp32); the
 * tensors q, kᵀ and scale made for it in *q_out, *kt_out, *scale_out when not NULL (the backward
 * reuses them). */
tkd_status graph_scores(Plan *p, const Shapes &s, cudnnBackendDescriptor_t *out,
                        cudnnBackendDescriptor_t *q_out = NULL, cudnnBackendDescriptor_t *kt_out = NULL,
                        cudnnBackendDescriptor_t *scale_out = NULL)
{
    cudnnBackendDescriptor_t q, kt, scale, neg_inf, sc, ss, row, col, keep_mask, masked;
    const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
    STEP("tensor q", tensor(p, kUidQ, bf16, s.q_dim, s.q_str, false, &q));
    STEP("tensor k", tensor(p, kUidK, bf16, s.kt_dim, s.kt_str, false, &kt));
    STEP("tensor scale", tensor(p, kUidScale, f32, s.one, s.one, true, &scale));
    STEP("tensor -inf", tensor(p, kUidNegInf, f32, s.one, s.one, true, &neg_inf));
    STEP("tensor S", tensor(p, 0, f32, s.s_dim, s.s_str, false, &sc));
    STEP("tensor S·scale", tensor(p, 0, f32, s.s_dim, s.s_str, false, &ss));
    STEP("tensor row index", tensor(p, 0, CUDNN_DATA_INT32, s.s_dim, s.s_str, false, &row));
    STEP("tensor column index", tensor(p, 0, CUDNN_DATA_INT32, s.s_dim, s.s_str, false, &col));
    STEP("tensor causal mask", tensor(p, 0, CUDNN_DATA_BOOLEAN, s.s_dim, s.s_str, false, &keep_mask));
    STEP("tensor masked S", tensor(p, 0, f32, s.s_dim, s.s_str, false, &masked));
    STEP("matmul Q·Kᵀ", matmul(p, q, kt, sc));
    STEP("pointwise S·scale", pointwise(p, CUDNN_POINTWISE_MUL, f32, sc, scale, NULL, ss));
    STEP("gen index rows", pointwise(p, CUDNN_POINTWISE_GEN_INDEX, f32, ss, NULL, NULL, row, 2));
    STEP("gen index columns", pointwise(p, CUDNN_POINTWISE_GEN_INDEX, f32, ss, NULL, NULL, col, 3));
    STEP("row >= column", pointwise(p, CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, NULL, keep_mask));
    /* BINARY_SELECT: y = t ? x : b, so the scores stay where row ≥ column */
    STEP("causal select", pointwise(p, CUDNN_POINTWISE_BINARY_SELECT, f32, ss, neg_inf, keep_mask, masked));
    *out = masked;
    if (q_out)
        *q_out = q, *kt_out = kt, *scale_out = scale;
    return TKD_OK;
}

/* P = softmax(masked) over the key axis (bf16, the io type, as the second matmul wants), stats =
 * max + log Σ exp(masked − max), then Y = P·V. stats non-virtual when the key asks for lse. */
tkd_status graph_softmax_pv(Plan *p, const Shapes &s, cudnnBackendDescriptor_t masked)
{
    cudnnBackendDescriptor_t mx, sub, ex, sum, lg, stats, prob, v, y;
    const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
    STEP("tensor max", tensor(p, 0, f32, s.r_dim, s.r_str, false, &mx));
    STEP("tensor S - max", tensor(p, 0, f32, s.s_dim, s.s_str, false, &sub));
    STEP("tensor exp", tensor(p, 0, f32, s.s_dim, s.s_str, false, &ex));
    STEP("tensor sum", tensor(p, 0, f32, s.r_dim, s.r_str, false, &sum));
    STEP("tensor log sum", tensor(p, 0, f32, s.r_dim, s.r_str, false, &lg));
    STEP("tensor stats", tensor(p, p->key.lse ? kUidStats : 0, f32, s.r_dim, p->key.lse ? s.st_str : s.r_str,
                                false, &stats));
    STEP("tensor P", tensor(p, 0, bf16, s.s_dim, s.s_str, false, &prob));
    STEP("tensor v", tensor(p, kUidV, bf16, s.v_dim, s.v_str, false, &v));
    STEP("tensor y", tensor(p, kUidY, bf16, s.q_dim, s.q_str, false, &y));
    STEP("reduce max", reduction(p, CUDNN_REDUCE_TENSOR_MAX, masked, mx));
    STEP("pointwise S - max", pointwise(p, CUDNN_POINTWISE_SUB, f32, masked, mx, NULL, sub));
    STEP("pointwise exp", pointwise(p, CUDNN_POINTWISE_EXP, f32, sub, NULL, NULL, ex));
    STEP("reduce sum", reduction(p, CUDNN_REDUCE_TENSOR_ADD, ex, sum));
    STEP("pointwise log", pointwise(p, CUDNN_POINTWISE_LOG, f32, sum, NULL, NULL, lg));
    STEP("pointwise stats", pointwise(p, CUDNN_POINTWISE_ADD, f32, mx, lg, NULL, stats));
    STEP("pointwise P", pointwise(p, CUDNN_POINTWISE_DIV, f32, ex, sum, NULL, prob));
    STEP("matmul P·V", matmul(p, prob, v, y));
    return TKD_OK;
}

/* y = x with another view (dims, strides, data type) of the same elements: cuDNN's reshape. */
tkd_status reshape(Plan *p, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y)
{
    cudnnBackendDescriptor_t op;
    TKD_TRY(keep(p, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, &op));
    SET(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SET(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    return add_op(p, op);
}

/* The shapes the backward adds to Shapes: (B, H, T, T) transposed views of P and dS (keys as rows),
 * K untransposed (B, Hkv, T, dh), the per-query-head dK/dV before the GQA sum (B, H, T, dh, packed). */
struct BwdShapes {
    int64_t st_dim[4], st_str[4], k_dim[4], k_str[4], full_dim[4], full_str[4];
};

BwdShapes bwd_shapes_for(const Key &k)
{
    const int64_t H = k.H, T = k.T, B = k.B, G = k.Hkv, D = k.dh, GS = k.Hkvs;
    BwdShapes s = {
        {B, H, T, T}, {H * T * T, T * T, 1, T},
        {B, G, T, D}, {T * GS * D, D, GS * D, 1}, /* K as it lies in memory (a view of kᵀ) */
        {B, H, T, D}, {H * T * D, T * D, D, 1},
    };
    return s;
}

/* softmax_sum (B, H, T, 1) fp32, non-virtual (in our workspace) = rowsum(dO ⊙ O)·1, the frontend's
 * "dO * O => softmax_sum" chain (the ·1 is its dropout-scale multiply, kept for the pattern). */
tkd_status graph_softmax_sum(Plan *p, const Shapes &s, cudnnBackendDescriptor_t *dout, cudnnBackendDescriptor_t *out)
{
    cudnnBackendDescriptor_t dy, y, one, prod, sum, ssum;
    const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
    STEP("tensor dO", tensor(p, kUidDO, bf16, s.q_dim, s.q_str, false, &dy));
    STEP("tensor O", tensor(p, kUidY, bf16, s.q_dim, s.q_str, false, &y));
    STEP("tensor one", tensor(p, kUidOne, f32, s.one, s.one, true, &one));
    STEP("tensor dO*O", tensor(p, 0, f32, s.q_dim, s.qv_str, false, &prod));
    STEP("tensor rowsum dO*O", tensor(p, 0, f32, s.r_dim, s.r_str, false, &sum));
    STEP("tensor softmax_sum", tensor(p, kUidSoftmaxSum, f32, s.r_dim, s.r_str, false, &ssum));
    STEP("pointwise dO*O", pointwise(p, CUDNN_POINTWISE_MUL, f32, dy, y, NULL, prod));
    STEP("reduce dO*O", reduction(p, CUDNN_REDUCE_TENSOR_ADD, prod, sum));
    STEP("pointwise softmax_sum", pointwise(p, CUDNN_POINTWISE_MUL, f32, sum, one, NULL, ssum));
    *dout = dy, *out = ssum;
    return TKD_OK;
}

/* out = a·b for a GQA-summed output (B, Hkv, T, dh): straight into out when H = Hkv, else into a
 * virtual per-query-head (B, H, T, dh) bf16 tensor and a head-axis sum (the frontend's way). */
tkd_status matmul_gqa(Plan *p, const BwdShapes &bs, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                      cudnnBackendDescriptor_t out, const char *what)
{
    if (p->key.H == p->key.Hkv) {
        STEP(what, matmul(p, a, b, out));
        return TKD_OK;
    }
    cudnnBackendDescriptor_t full;
    STEP("tensor per-head gradient", tensor(p, 0, CUDNN_DATA_BFLOAT16, bs.full_dim, bs.full_str, false, &full));
    STEP(what, matmul(p, a, b, full));
    STEP("reduce over the group", reduction(p, CUDNN_REDUCE_TENSOR_ADD, full, out));
    return TKD_OK;
}

/* The backward graph (cudnn-frontend's composite sdpa_backward with its deterministic choice on
 * Hopper: dQ straight from dS·K, no fp32 atomic accumulator):
 *   E = exp(masked S − stats) (P, fp32);  dV = Σgroup Pᵀ·dO;  dP = dO·Vᵀ;
 *   dS = (dP − softmax_sum) ⊙ E · scale;  dK = Σgroup dSᵀ·Q;  dQ = dS·K. */
tkd_status graph_backward(Plan *p, const Shapes &s)
{
    const BwdShapes bs = bwd_shapes_for(p->key);
    const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t dy, ssum, masked, q, kt, scale, stats, sub, ex, pt, dv, vt, dp, dps, dpe, ds, dst, dk;
    cudnnBackendDescriptor_t kk, dq;
    TKD_TRY(graph_softmax_sum(p, s, &dy, &ssum));
    TKD_TRY(graph_scores(p, s, &masked, &q, &kt, &scale));
    STEP("tensor stats", tensor(p, kUidStats, f32, s.r_dim, s.st_str, false, &stats));
    STEP("tensor S - stats", tensor(p, 0, f32, s.s_dim, s.s_str, false, &sub));
    STEP("tensor exp", tensor(p, 0, f32, s.s_dim, s.s_str, false, &ex));
    STEP("pointwise S - stats", pointwise(p, CUDNN_POINTWISE_SUB, f32, masked, stats, NULL, sub));
    STEP("pointwise exp", pointwise(p, CUDNN_POINTWISE_EXP, f32, sub, NULL, NULL, ex));
    /* dV */
    STEP("tensor Pᵀ", tensor(p, 0, bf16, bs.st_dim, bs.st_str, false, &pt));
    STEP("tensor dv", tensor(p, kUidDV, bf16, s.v_dim, s.v_str, false, &dv));
    STEP("reshape Pᵀ", reshape(p, ex, pt));
    TKD_TRY(matmul_gqa(p, bs, pt, dy, dv, "matmul Pᵀ·dO"));
    /* dP, dS */
    int64_t vt_dim[4] = {s.v_dim[0], s.v_dim[1], s.v_dim[3], s.v_dim[2]};
    int64_t vt_str[4] = {s.v_str[0], s.v_str[1], s.v_str[3], s.v_str[2]};
    STEP("tensor vᵀ", tensor(p, kUidV, bf16, vt_dim, vt_str, false, &vt));
    STEP("tensor dP", tensor(p, 0, f32, s.s_dim, s.s_str, false, &dp));
    STEP("tensor dP - softmax_sum", tensor(p, 0, f32, s.s_dim, s.s_str, false, &dps));
    STEP("tensor (dP - softmax_sum)·E", tensor(p, 0, f32, s.s_dim, s.s_str, false, &dpe));
    STEP("tensor dS", tensor(p, 0, f32, s.s_dim, s.s_str, false, &ds));
    STEP("matmul dO·Vᵀ", matmul(p, dy, vt, dp));
    STEP("pointwise dP - softmax_sum", pointwise(p, CUDNN_POINTWISE_SUB, f32, dp, ssum, NULL, dps));
    STEP("pointwise ·E", pointwise(p, CUDNN_POINTWISE_MUL, f32, dps, ex, NULL, dpe));
    STEP("pointwise dS·scale", pointwise(p, CUDNN_POINTWISE_MUL, f32, dpe, scale, NULL, ds));
    /* dK */
    STEP("tensor dSᵀ", tensor(p, 0, bf16, bs.st_dim, bs.st_str, false, &dst));
    STEP("tensor dk", tensor(p, kUidDK, bf16, s.v_dim, s.v_str, false, &dk));
    STEP("reshape dSᵀ", reshape(p, ds, dst));
    TKD_TRY(matmul_gqa(p, bs, dst, q, dk, "matmul dSᵀ·Q"));
    /* dQ */
    STEP("tensor K", tensor(p, 0, bf16, bs.k_dim, bs.k_str, false, &kk));
    STEP("tensor dq", tensor(p, kUidDQ, bf16, s.q_dim, s.q_str, false, &dq));
    STEP("reshape K", reshape(p, kt, kk));
    if (!p->key.nondet) {
        STEP("matmul dS·K", matmul(p, ds, kk, dq));
        return TKD_OK;
    }
    /* the frontend's non-deterministic choice: dQ summed over key tiles into an fp32 accumulator
     * (zeroed before each call, in our workspace), then converted */
    cudnnBackendDescriptor_t acc;
    STEP("tensor dQ accumulator", tensor(p, kUidDQAccum, f32, bs.full_dim, bs.full_str, false, &acc));
    STEP("matmul dS·K", matmul(p, ds, kk, acc));
    STEP("pointwise dQ", pointwise(p, CUDNN_POINTWISE_IDENTITY, f32, acc, NULL, NULL, dq));
    return TKD_OK;
}

/* The finalized operation graph for p->key. */
tkd_status graph_build(Plan *p, cudnnHandle_t h, cudnnBackendDescriptor_t *out)
{
    const Shapes s = shapes_for(p->key);
    cudnnBackendDescriptor_t masked, g;
    p->next_uid = kUidVirtual;
    if (p->key.bwd) {
        TKD_TRY(graph_backward(p, s));
    } else {
        TKD_TRY(graph_scores(p, s, &masked));
        TKD_TRY(graph_softmax_pv(p, s, masked));
    }
    TKD_TRY(keep(p, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &g));
    SET(g, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, p->nops, p->ops);
    /* Deprecated since cuDNN 9.8 (the device comes from the current context), still accepted, and
     * what cudnn-frontend sets when given a handle: the path PyTorch's cuDNN attention takes. */
    SET(g, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
    TKD_CUDNN_CHECK(cudnnBackendFinalize(g));
    *out = g;
    return TKD_OK;
}

/* Asks the heuristics (mode) for engine configs of graph g into p->cfgs (replacing the last ones). */
tkd_status heuristics(Plan *p, cudnnBackendDescriptor_t g, cudnnBackendHeurMode_t mode)
{
    cudnnBackendDescriptor_t heur;
    for (int i = 0; i < p->ncfgs; i++)
        destroy(p->cfgs[i]);
    p->ncfgs = 0;
    TKD_TRY(keep(p, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, &heur));
    SET(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g);
    SET(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    TKD_CUDNN_CHECK(cudnnBackendFinalize(heur));
    int64_t avail = 0, got = 0;
    TKD_CUDNN_CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                             0, &avail, NULL));
    const int64_t want = avail < kCfgs ? avail : kCfgs;
    for (; p->ncfgs < want; p->ncfgs++)
        TKD_CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &p->cfgs[p->ncfgs]));
    if (want > 0)
        TKD_CUDNN_CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, want, &got, p->cfgs));
    for (int64_t i = got; i < want; i++) /* fewer than announced: drop the unfilled ones */
        destroy(p->cfgs[i]), p->cfgs[i] = NULL;
    p->ncfgs = (int)got;
    return TKD_OK;
}

/* An execution plan of engine config cfg: finalizing it is where an engine accepts or refuses. */
tkd_status plan_try(cudnnBackendDescriptor_t cfg, cudnnBackendDescriptor_t *out, int64_t *ws_bytes)
{
    cudnnBackendDescriptor_t plan;
    TKD_CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan));
    *out = plan; /* the caller destroys it on failure */
    SET(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg);
    TKD_CUDNN_CHECK(cudnnBackendFinalize(plan));
    int64_t n = 0;
    TKD_CUDNN_CHECK(cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64,
                                             1, &n, ws_bytes));
    return TKD_OK;
}

/* cfg's engine: whether it carries CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC, and its global index. */
tkd_status cfg_engine(cudnnBackendDescriptor_t cfg, bool *nondet, int64_t *index)
{
    cudnnBackendDescriptor_t eng = NULL;
    cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
    int64_t n = 0, m = 0;
    *nondet = false, *index = -1;
    TKD_CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &eng));
    cudnnStatus_t e = cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                               &n, &eng);
    if (e == CUDNN_STATUS_SUCCESS)
        e = cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                     CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, notes);
    if (e == CUDNN_STATUS_SUCCESS)
        e = cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &m, index);
    destroy(eng);
    TKD_CUDNN_CHECK(e);
    for (int64_t i = 0; i < n; i++)
        if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC)
            *nondet = true;
    return TKD_OK;
}

/* id's knob choices: cfg's (type, value) pairs in its order. */
tkd_status cfg_knobs(cudnnBackendDescriptor_t cfg, Ident *id)
{
    cudnnBackendDescriptor_t kc[kKnobs] = {};
    int64_t n = 0, m = 0;
    cudnnStatus_t e = CUDNN_STATUS_SUCCESS;
    for (int i = 0; i < kKnobs && e == CUDNN_STATUS_SUCCESS; i++)
        e = cudnnBackendCreateDescriptor(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, &kc[i]);
    if (e == CUDNN_STATUS_SUCCESS)
        e = cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, kKnobs,
                                     &n, kc);
    id->nknobs = e == CUDNN_STATUS_SUCCESS ? (int)(n < kKnobs ? n : kKnobs) : 0;
    for (int i = 0; i < id->nknobs && e == CUDNN_STATUS_SUCCESS; i++) {
        cudnnBackendKnobType_t type;
        e = cudnnBackendGetAttribute(kc[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &m, &type);
        id->knob[i][0] = (int64_t)type;
        if (e == CUDNN_STATUS_SUCCESS)
            e = cudnnBackendGetAttribute(kc[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &m,
                                         &id->knob[i][1]);
    }
    for (int i = 0; i < kKnobs; i++)
        destroy(kc[i]);
    TKD_CUDNN_CHECK(e);
    return TKD_OK;
}

bool ident_same(const Ident &a, const Ident &b)
{
    return a.engine == b.engine && a.nknobs == b.nknobs &&
           memcmp(a.knob, b.knob, sizeof a.knob[0] * (size_t)a.nknobs) == 0;
}

/* Whether config i may be tried in pass `pass` of plan_pick (0: only configs like prefer, 1: the
 * others), with its engine's description in *nondet and *id. The forward takes the heuristics'
 * order undescribed; the backward leaves out engines noted non-deterministic and those it cannot
 * describe, with the reason in why (when why is still empty). Knobs that cannot be read only make
 * the config match prefer by its engine alone. */
bool cfg_admit(Plan *p, int i, int pass, const Ident *prefer, bool *nondet, Ident *id, char *why, const char *mode)
{
    memset(id, 0, sizeof *id);
    id->engine = -1, *nondet = false;
    if (!p->key.bwd)
        return pass == 1;
    if (cfg_engine(p->cfgs[i], nondet, &id->engine) != TKD_OK) {
        if (pass == 1 && !why[0])
            snprintf(why, kMsg, "mode %s config %d: %s", mode, i, tkd_error_msg());
        return false;
    }
    if (cfg_knobs(p->cfgs[i], id) != TKD_OK)
        id->nknobs = 0, tkd_error_clear();
    if ((pass == 0) != (prefer && ident_same(*prefer, *id)))
        return false;
    if (*nondet && !p->key.nondet) { /* training resumes bit-exactly: no engine that says it is not */
        if (!why[0])
            snprintf(why, kMsg, "mode %s config %d: engine is non-deterministic (skipped)", mode, i);
        return false;
    }
    return true;
}

/* p->plan: the first engine config (heuristics mode A, then FALLBACK) whose plan finalizes, those
 * like prefer (when not NULL) first in each mode. When none does, TKD_ERR_UNSUPPORTED with how many
 * each mode offered and the first refusal's message (that of the heuristics' top choice, the engine
 * we wanted). */
tkd_status plan_pick(Plan *p, cudnnBackendDescriptor_t g, const Ident *prefer)
{
    static const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
    static const char *const names[2] = {"A", "FALLBACK"};
    char first[kMsg] = "";
    int offered[2] = {0, 0};
    for (int m = 0; m < 2; m++) {
        tkd_status st = heuristics(p, g, modes[m]);
        if (st == TKD_ERR_DEVICE_OOM)
            return st;
        if (st != TKD_OK && !first[0])
            snprintf(first, sizeof first, "heuristics mode %s: %s", names[m], tkd_error_msg());
        offered[m] = st == TKD_OK ? p->ncfgs : 0;
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; i < offered[m]; i++) {
                bool nondet = false;
                Ident id;
                if (!cfg_admit(p, i, pass, prefer, &nondet, &id, first, names[m]))
                    continue;
                cudnnBackendDescriptor_t plan = NULL;
                tkd_status pst = plan_try(p->cfgs[i], &plan, &p->ws_bytes);
                if (pst == TKD_OK) {
                    p->plan = plan, p->ident = id, p->nondet = nondet;
                    return TKD_OK;
                }
                destroy(plan);
                if (pst == TKD_ERR_DEVICE_OOM)
                    return pst;
                if (!first[0])
                    snprintf(first, sizeof first, "mode %s config %d: %s", names[m], i, tkd_error_msg());
            }
    }
    return tkd_error_set(TKD_ERR_UNSUPPORTED,
                         "no engine built a plan (heuristics offered %d configs in mode A, %d in FALLBACK)%s%s",
                         offered[0], offered[1], first[0] ? "; first refusal: " : "", first);
}

} // namespace

struct tkd_cudnn_attn {
    cudnnHandle_t h;
    void *ws; /* (ws_bytes): shared by every plan, one call at a time */
    size_t ws_bytes;
    size_t bwd_budget; /* cuDNN's workspace of one backward call at most (0: no bound) */
    int bwd_nondet;    /* the backward may take non-deterministic engines (fp32 dQ accumulation) */
    Plan plans[kPlans];
    unsigned long long clock;
};

/* Builds p's plan for p->key (the workspace grows when it first runs: a backward whose one-call
 * plan is too big never allocates its workspace). Any failure but out-of-memory becomes
 * TKD_ERR_UNSUPPORTED: the caller falls back, the message says why. */
static tkd_status plan_init(tkd_cudnn_attn *a, Plan *p, const Ident *prefer)
{
    cudnnBackendDescriptor_t g = NULL;
    tkd_status st = graph_build(p, a->h, &g);
    if (st == TKD_OK)
        st = plan_pick(p, g, prefer);
    /* the backward's softmax_sum (B, H, T) fp32 goes first, then (non-deterministic) the dQ
     * accumulator (B, H, T, dh) fp32, cuDNN's workspace after them, each 256-aligned */
    const Key &k = p->key;
    p->accum_off = k.bwd ? ((int64_t)k.B * k.H * k.T * 4 + 255) / 256 * 256 : 0;
    p->accum_bytes = k.nondet ? (int64_t)k.B * k.H * k.T * k.dh * 4 : 0;
    p->ws_off = p->accum_off + (p->accum_bytes + 255) / 256 * 256;
    if (st != TKD_OK && st != TKD_ERR_DEVICE_OOM)
        st = TKD_ERR_UNSUPPORTED;
    return st == TKD_OK ? st
                        : tkd_error_prefix(st, "cuDNN attention %s B=%d T=%d H=%d Hkv=%d dh=%d%s",
                                           k.bwd ? "backward" : "forward", k.B, k.T, k.H, k.Hkv, k.dh,
                                           !k.bwd && k.lse ? " with lse" : "");
}

/* The cached plan for key, built (replacing the least recently used slot, never the one used last)
 * when missing, preferring the engine config prefer (NULL: none). A refusal is cached as well and
 * returned again with its message. */
static tkd_status plan_get(tkd_cudnn_attn *a, const Key &key, Plan **out, const Ident *prefer = NULL)
{
    Plan *victim = &a->plans[0];
    for (int i = 0; i < kPlans; i++) {
        Plan *p = &a->plans[i];
        if (p->used && memcmp(&p->key, &key, sizeof key) == 0) {
            p->used = ++a->clock;
            *out = p;
            return p->refused == TKD_OK ? TKD_OK : tkd_error_set(p->refused, "%s", p->why);
        }
        if (p->used < victim->used)
            victim = p;
    }
    if (victim->used)
        plan_destroy(victim);
    victim->key = key;
    tkd_status st = plan_init(a, victim, prefer);
    if (st != TKD_OK) {
        plan_destroy(victim);
        if (st == TKD_ERR_DEVICE_OOM) /* may pass: not cached */
            return st;
        victim->key = key, victim->refused = st;
        snprintf(victim->why, sizeof victim->why, "%s", tkd_error_msg());
    }
    victim->used = ++a->clock;
    *out = victim;
    return st;
}

/* p->pack for these pointers (ptrs[12]: q, k, v, y, lse, workspace, then the backward's dy, dq,
 * dk, dv, unused ones NULL): the last call's when they are the same (a model's layers reuse their
 * buffers), else a new one. The by-value scalars point into p. */
static tkd_status pack_get(tkd_cudnn_attn *a, Plan *p, const void *const ptrs[12])
{
    if (p->pack && memcmp(p->pack_ptrs, ptrs, sizeof p->pack_ptrs) == 0)
        return TKD_OK;
    destroy(p->pack);
    p->pack = NULL;
    p->scale = (float)(1.0 / sqrt((double)p->key.dh));
    p->neg_inf = -INFINITY;
    p->one = 1.0f;
    int64_t uids[14] = {kUidQ, kUidK, kUidV, kUidY, kUidScale, kUidNegInf, kUidStats};
    void *data[14] = {(void *)ptrs[0], (void *)ptrs[1], (void *)ptrs[2], (void *)ptrs[3], &p->scale,
                      &p->neg_inf, (void *)ptrs[4]};
    int64_t n = p->key.lse ? 7 : 6;
    if (p->key.bwd) {
        const int64_t more[6] = {kUidDO, kUidDQ, kUidDK, kUidDV, kUidSoftmaxSum, kUidOne};
        void *const mdata[6] = {(void *)ptrs[6], (void *)ptrs[7], (void *)ptrs[8], (void *)ptrs[9], a->ws, &p->one};
        for (int i = 0; i < 6; i++)
            uids[n + i] = more[i], data[n + i] = mdata[i];
        n += 6;
    }
    if (p->key.nondet)
        uids[n] = kUidDQAccum, data[n++] = (char *)a->ws + p->accum_off;
    void *ws = (char *)a->ws + p->ws_off;
    cudnnBackendDescriptor_t vp;
    TKD_CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp));
    p->pack = vp; /* destroyed with p, or by the next pack_get, also after a failure below */
    SET(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    SET(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, data);
    SET(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    memset(p->pack_ptrs, 0, sizeof p->pack_ptrs); /* unusable until finalized */
    TKD_CUDNN_CHECK(cudnnBackendFinalize(vp));
    memcpy(p->pack_ptrs, ptrs, sizeof p->pack_ptrs);
    return TKD_OK;
}

/* Runs p on stream with ptrs (pack_get's layout; [5] is set here to the workspace, grown first to
 * p's need: cudaFree waits for the kernels that may still use the old one). */
static tkd_status plan_run(tkd_cudnn_attn *a, Plan *p, const void *const ptrs_in[12], void *stream)
{
    const size_t need = (size_t)(p->ws_off + p->ws_bytes);
    if (need > a->ws_bytes) {
        tkd_cuda_free(a->ws);
        a->ws = NULL, a->ws_bytes = 0;
        TKD_TRY(tkd_cuda_malloc(&a->ws, need, "cuDNN attention workspace",
                                "lower data.seq_len or train.batch_size, or set TKD_ATTN_BWD=wgmma"));
        a->ws_bytes = need;
    }
    const void *ptrs[12];
    memcpy(ptrs, ptrs_in, sizeof ptrs);
    ptrs[5] = a->ws;
    TKD_TRY(pack_get(a, p, ptrs));
    if (p->accum_bytes) /* the accumulator starts at zero (cudnn-frontend leaves it to cuDNN from 9.6: kept) */
        TKD_CUDA_CHECK(cudaMemsetAsync((char *)a->ws + p->accum_off, 0, (size_t)p->accum_bytes,
                                       (cudaStream_t)stream));
    TKD_CUDNN_CHECK(cudnnSetStream(a->h, (cudaStream_t)stream));
    TKD_CUDNN_CHECK(cudnnBackendExecute(a->h, p->plan, p->pack));
    return TKD_OK;
}

extern "C" void tkd_cudnn_attn_free(tkd_cudnn_attn *a)
{
    if (!a)
        return;
    for (int i = 0; i < kPlans; i++)
        if (a->plans[i].used)
            plan_destroy(&a->plans[i]);
    if (a->h)
        (void)cudnnDestroy(a->h); /* teardown: not actionable */
    tkd_cuda_free(a->ws);
    free(a);
}

static tkd_status attn_init(tkd_cudnn_attn *a)
{
    const size_t ver = cudnnGetVersion();
    if (ver < 90000)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "cuDNN attention: the cuDNN loaded is %zu, 9.x needed", ver);
    TKD_CUDNN_CHECK(cudnnCreate(&a->h));
    return TKD_OK;
}

extern "C" tkd_status tkd_cudnn_attn_create(tkd_cudnn_attn **out)
{
    *out = NULL;
    tkd_cudnn_attn *a = (tkd_cudnn_attn *)calloc(1, sizeof *a);
    if (!a)
        return tkd_error_set(TKD_ERR_NOMEM, "cuDNN attention: out of host memory");
    a->bwd_budget = TKD_CUDNN_ATTN_BWD_BUDGET;
    tkd_status st = attn_init(a);
    if (st != TKD_OK) {
        tkd_cudnn_attn_free(a);
        return st;
    }
    *out = a;
    return TKD_OK;
}

static int aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

extern "C" tkd_status tkd_cudnn_attn_fwd(tkd_cudnn_attn *a, const uint16_t *q, const uint16_t *k,
                                         const uint16_t *v, int B, int T, int H, int Hkv, int dh,
                                         uint16_t *y, float *lse, void *stream)
{
    if (!a || B < 0 || T < 0 || H < 1 || Hkv < 1 || H % Hkv != 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "tkd_cudnn_attn_fwd: bad shape B=%d T=%d H=%d Hkv=%d (H must be a multiple of "
                             "Hkv) or no state", B, T, H, Hkv);
    if (dh < 8 || dh > 256 || dh % 8 != 0)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "tkd_cudnn_attn_fwd: head dim %d is not supported (cuDNN: a multiple of 8, at "
                             "most 256)", dh);
    if (B == 0 || T == 0)
        return TKD_OK;
    if (!q || !k || !v || !y || !aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(y) ||
        !aligned16(lse))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "tkd_cudnn_attn_fwd: q, k, v, y (and lse) must be 16-byte aligned device pointers");
    Key key;
    memset(&key, 0, sizeof key);
    key.B = B, key.T = T, key.H = H, key.Hkv = Hkv, key.dh = dh, key.lse = lse != NULL;
    key.Hs = H, key.Hkvs = Hkv;
    Plan *p = NULL;
    TKD_TRY(plan_get(a, key, &p));
    const void *const ptrs[12] = {q, k, v, y, lse};
    return plan_run(a, p, ptrs, stream);
}

/* The shape checks of the backward's entry points (fn names the one called). */
static tkd_status bwd_shape_check(const tkd_cudnn_attn *a, int B, int T, int H, int Hkv, int dh, const char *fn)
{
    if (!a || B < 0 || T < 0 || H < 1 || Hkv < 1 || H % Hkv != 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: bad shape B=%d T=%d H=%d Hkv=%d (H must be a multiple of Hkv) or no state", fn, B,
                             T, H, Hkv);
    if (dh < 8 || dh > 256 || dh % 8 != 0)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "%s: head dim %d is not supported (cuDNN: a multiple of 8, at most 256)", fn, dh);
    return TKD_OK;
}

static Key bwd_key(const tkd_cudnn_attn *a, int B, int T, int H, int Hkv, int dh)
{
    Key key;
    memset(&key, 0, sizeof key);
    key.B = B, key.T = T, key.H = H, key.Hkv = Hkv, key.dh = dh, key.lse = 1, key.bwd = 1;
    key.Hs = H, key.Hkvs = Hkv, key.nondet = a->bwd_nondet;
    return key;
}

/* The key of one call over gb batches and gk kv heads (with their query heads) of k's tensors. */
static Key group_key(const Key &k, int gb, int gk)
{
    Key g = k;
    g.B = gb, g.Hkv = gk, g.H = gk * (k.H / k.Hkv);
    return g;
}

/* The largest call gb·gk < limit (gb | B, gk | Hkv, more kv heads first on a tie) whose workspace,
 * per bytes for each (batch, kv head), fits budget; (1, 1) when none does. */
static void group_pick(int B, int Hkv, int64_t per, size_t budget, int limit, int *gb, int *gk)
{
    *gb = *gk = 1;
    for (int kk = 1; kk <= Hkv; kk++)
        for (int bb = 1; bb <= B; bb++) {
            const int n = kk * bb;
            if (Hkv % kk || B % bb || n >= limit || (size_t)((int64_t)n * per) > budget)
                continue;
            if (n > *gb * *gk || (n == *gb * *gk && kk > *gk))
                *gb = bb, *gk = kk;
        }
}

/* p (a one-call backward plan over budget): p->gb, p->gk the call size whose plan's workspace
 * fits, estimated from the workspace per (batch, kv head) and checked on the group's own plan
 * (smaller again until it fits or is one batch and one kv head). A group shape cuDNN refuses
 * leaves the last size that worked (at first: one call). */
static tkd_status bwd_split(tkd_cudnn_attn *a, Plan *p)
{
    const Key k = p->key;
    int limit = k.B * k.Hkv;
    int64_t per = (p->ws_bytes + limit - 1) / limit;
    for (;;) {
        int gb, gk;
        group_pick(k.B, k.Hkv, per, a->bwd_budget, limit, &gb, &gk);
        Plan *gp = NULL;
        tkd_status st = plan_get(a, group_key(k, gb, gk), &gp, &p->ident);
        if (st == TKD_ERR_UNSUPPORTED) {
            tkd_error_clear();
            return TKD_OK;
        }
        TKD_TRY(st);
        p->gb = gb, p->gk = gk;
        if ((size_t)gp->ws_bytes <= a->bwd_budget || gb * gk == 1)
            return TKD_OK;
        limit = gb * gk;
        per = (gp->ws_bytes + limit - 1) / limit;
    }
}

/* The one-call plan of key (*full, with the call size chosen in gb, gk) and the plan each call
 * runs (*run: *full itself when one call fits the budget). */
static tkd_status bwd_plans(tkd_cudnn_attn *a, const Key &key, Plan **full, Plan **run)
{
    Plan *p = NULL;
    TKD_TRY(plan_get(a, key, &p));
    *full = p;
    if (!p->gb) {
        p->gb = key.B, p->gk = key.Hkv;
        if (a->bwd_budget && (size_t)p->ws_bytes > a->bwd_budget && key.T % 4 == 0) {
            tkd_status st = bwd_split(a, p);
            if (st != TKD_OK) {
                p->gb = 0; /* decide again at the next call (out of memory may pass) */
                return st;
            }
        }
    }
    if (p->gb == key.B && p->gk == key.Hkv) {
        *run = p;
        return TKD_OK;
    }
    return plan_get(a, group_key(key, p->gb, p->gk), run, &p->ident);
}

extern "C" void tkd_cudnn_attn_set_bwd_budget(tkd_cudnn_attn *a, size_t bytes)
{
    if (a->bwd_budget == bytes) /* attn_bench sets it before every timed call */
        return;
    a->bwd_budget = bytes;
    for (int i = 0; i < kPlans; i++)
        a->plans[i].gb = a->plans[i].gk = 0; /* choose the call sizes again */
}

extern "C" void tkd_cudnn_attn_set_bwd_nondet(tkd_cudnn_attn *a, int allow)
{
    a->bwd_nondet = allow != 0;
}

extern "C" tkd_status tkd_cudnn_attn_bwd_plan(tkd_cudnn_attn *a, int B, int T, int H, int Hkv, int dh,
                                              tkd_cudnn_attn_bwd_info *info)
{
    memset(info, 0, sizeof *info);
    TKD_TRY(bwd_shape_check(a, B, T, H, Hkv, dh, "tkd_cudnn_attn_bwd_plan"));
    if (B == 0 || T == 0)
        return TKD_OK;
    Plan *p = NULL, *run = NULL;
    TKD_TRY(bwd_plans(a, bwd_key(a, B, T, H, Hkv, dh), &p, &run));
    info->ws_one_call = p->ws_bytes, info->ws_call = run->ws_bytes;
    info->batches = p->gb, info->kv_heads = p->gk, info->calls = (B / p->gb) * (Hkv / p->gk);
    info->nondet = run->nondet, info->engine = run->ident.engine, info->one_call_engine = p->ident.engine;
    return TKD_OK;
}

extern "C" tkd_status tkd_cudnn_attn_bwd(tkd_cudnn_attn *a, const uint16_t *dy, const uint16_t *q,
                                         const uint16_t *k, const uint16_t *v, const uint16_t *y,
                                         const float *lse, int B, int T, int H, int Hkv, int dh, uint16_t *dq,
                                         uint16_t *dk, uint16_t *dv, void *stream)
{
    TKD_TRY(bwd_shape_check(a, B, T, H, Hkv, dh, "tkd_cudnn_attn_bwd"));
    if (B == 0 || T == 0)
        return TKD_OK;
    const void *const all[10] = {dy, q, k, v, y, lse, dq, dk, dv, a};
    for (int i = 0; i < 10; i++)
        if (!all[i] || !aligned16(all[i]))
            return tkd_error_set(TKD_ERR_INVALID_ARG, "tkd_cudnn_attn_bwd: dy, q, k, v, y, lse, dq, dk, dv must "
                                 "all be 16-byte aligned device pointers (argument %d is not)", i);
    Plan *p = NULL, *run = NULL;
    TKD_TRY(bwd_plans(a, bwd_key(a, B, T, H, Hkv, dh), &p, &run));
    const int grp = H / Hkv;
    for (int b0 = 0; b0 < B; b0 += p->gb) /* one pass when one call fits */
        for (int k0 = 0; k0 < Hkv; k0 += p->gk) {
            /* the group's first element: row b0·T, query head k0·grp, kv head k0; lse (B, H, T) */
            const int64_t oq = ((int64_t)b0 * T * H + (int64_t)k0 * grp) * dh;
            const int64_t okv = ((int64_t)b0 * T * Hkv + k0) * dh, ol = ((int64_t)b0 * H + (int64_t)k0 * grp) * T;
            const void *const ptrs[12] = {q + oq, k + okv, v + okv, y + oq, lse + ol, NULL,
                                          dy + oq, dq + oq, dk + okv, dv + okv};
            TKD_TRY(plan_run(a, run, ptrs, stream));
        }
    return TKD_OK;
}

#else /* built without cuDNN: the same entry points, refusing */

struct tkd_cudnn_attn {
    int unused;
};

extern "C" tkd_status tkd_cudnn_attn_create(tkd_cudnn_attn **out)
{
    *out = NULL;
    return tkd_error_set(TKD_ERR_UNSUPPORTED,
                         "cuDNN attention: this build has no cuDNN (CMake found no cudnn_graph.h and libcudnn)");
}

extern "C" void tkd_cudnn_attn_free(tkd_cudnn_attn *a)
{
    (void)a;
}

extern "C" tkd_status tkd_cudnn_attn_fwd(tkd_cudnn_attn *a, const uint16_t *q, const uint16_t *k,
                                         const uint16_t *v, int B, int T, int H, int Hkv, int dh,
                                         uint16_t *y, float *lse, void *stream)
{
    (void)a, (void)q, (void)k, (void)v, (void)B, (void)T, (void)H, (void)Hkv, (void)dh, (void)y, (void)lse;
    (void)stream;
    return tkd_error_set(TKD_ERR_UNSUPPORTED, "cuDNN attention: this build has no cuDNN");
}

extern "C" void tkd_cudnn_attn_set_bwd_budget(tkd_cudnn_attn *a, size_t bytes)
{
    (void)a, (void)bytes;
}

extern "C" void tkd_cudnn_attn_set_bwd_nondet(tkd_cudnn_attn *a, int allow)
{
    (void)a, (void)allow;
}

extern "C" tkd_status tkd_cudnn_attn_bwd_plan(tkd_cudnn_attn *a, int B, int T, int H, int Hkv, int dh,
                                              tkd_cudnn_attn_bwd_info *info)
{
    (void)a, (void)B, (void)T, (void)H, (void)Hkv, (void)dh;
    memset(info, 0, sizeof *info);
    return tkd_error_set(TKD_ERR_UNSUPPORTED, "cuDNN attention: this build has no cuDNN");
}

extern "C" tkd_status tkd_cudnn_attn_bwd(tkd_cudnn_attn *a, const uint16_t *dy, const uint16_t *q,
                                         const uint16_t *k, const uint16_t *v, const uint16_t *y,
                                         const float *lse, int B, int T, int H, int Hkv, int dh, uint16_t *dq,
                                         uint16_t *dk, uint16_t *dv, void *stream)
{
    (void)a, (void)dy, (void)q, (void)k, (void)v, (void)y, (void)lse, (void)B, (void)T, (void)H, (void)Hkv;
    (void)dh, (void)dq, (void)dk, (void)dv, (void)stream;
    return tkd_error_set(TKD_ERR_UNSUPPORTED, "cuDNN attention: this build has no cuDNN");
}

#endif /* TKD_HAVE_CUDNN */
