/* attn_cudnn_graph.cu — the graph side of attn_cudnn.cu: cuDNN backend-API operation graphs for the
 * attention forward (scores, causal mask, softmax, P·V) and backward (softmax sum, dP, dS, dQ, dK,
 * dV, grouped-query reductions), the heuristics query and the pick of the first engine config that
 * builds a plan. attn_cudnn.cu keeps the plan cache and the entry points; what both use is in
 * attn_cudnn_internal.h. Host code only. The pattern follows the one cudnn-frontend lowers its SDPA
 * node to for cuDNN < 9.21 (its "composite" node: causal mask by GEN_INDEX + CMP_GE + BINARY_SELECT,
 * softmax from reductions and pointwise ops, P in the io type before the second matmul); the code is
 * ours. */
#include "kernels/attn/attn_cudnn_internal.h"

#include "kernels/attn/attn_cudnn.h"

#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"

#include <initializer_list>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef TKD_HAVE_CUDNN

namespace tkd_cudnng {

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

namespace {

/* A new descriptor of type t, owned by p. */
tkd_status keep(Plan *p, cudnnBackendDescriptorType_t t, cudnnBackendDescriptor_t *out)
{
    if (p->ndesc == kDescs)
        return tkd_error_set(TKD_ERR_INTERNAL, "cudnn attention: more than %d descriptors", kDescs);
    TKD_CUDNN_CHECK(cudnnBackendCreateDescriptor(t, &p->desc[p->ndesc]));
    *out = p->desc[p->ndesc++];
    return TKD_OK;
}

/* One attribute of a descriptor to set: its name (spelt out for the error message), value type,
 * count and values; left unset when !on (an optional operand). */
struct Attr {
    bool on;
    cudnnBackendAttributeName_t name;
    const char *what;
    cudnnBackendAttributeType_t type;
    int64_t n;
    const void *val;
};

#define ATTR_IF(on, name, type, n, val) (Attr{(on), name, "cudnnBackendSetAttribute " #name, type, (n), (val)})
#define ATTR(name, type, n, val) ATTR_IF(true, name, type, n, val)
#define DESC_IF(on, name, d) ATTR_IF(on, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &(d))
#define DESC(name, d) DESC_IF(true, name, d)

/* *out = a new descriptor of type t owned by p, attrs set in their order, finalized: how every
 * descriptor of the graph is made. */
tkd_status described(Plan *p, cudnnBackendDescriptorType_t t, std::initializer_list<Attr> attrs,
                     cudnnBackendDescriptor_t *out)
{
    cudnnBackendDescriptor_t d;
    TKD_TRY(keep(p, t, &d));
    for (const Attr &a : attrs) {
        if (!a.on)
            continue;
        const cudnnStatus_t e = cudnnBackendSetAttribute(d, a.name, a.type, a.n, a.val);
        if (e != CUDNN_STATUS_SUCCESS)
            return tkd_cudnn_fail(e, a.what, __func__, __FILE__, __LINE__);
    }
    TKD_CUDNN_CHECK(cudnnBackendFinalize(d));
    *out = d;
    return TKD_OK;
}

/* A 4-d tensor. uid 0: virtual (an intermediate cuDNN never writes out), numbered by p. */
tkd_status tensor(Plan *p, int64_t uid, cudnnDataType_t dt, const int64_t dim[4], const int64_t str[4],
                  bool by_value, cudnnBackendDescriptor_t *out)
{
    const bool is_virtual = uid == 0, yes = true;
    const int64_t id = is_virtual ? p->next_uid++ : uid, align = 16;
    return described(p, CUDNN_BACKEND_TENSOR_DESCRIPTOR,
                     {ATTR(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt),
                      ATTR(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim),
                      ATTR(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str),
                      ATTR(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &id),
                      ATTR(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align),
                      ATTR_IF(is_virtual, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes),
                      ATTR_IF(by_value, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes)},
                     out);
}

/* An operation of type t (its attributes attrs) appended to the graph's operations. */
tkd_status operation(Plan *p, cudnnBackendDescriptorType_t t, std::initializer_list<Attr> attrs)
{
    cudnnBackendDescriptor_t op;
    TKD_TRY(described(p, t, attrs, &op));
    if (p->nops == kOps)
        return tkd_error_set(TKD_ERR_INTERNAL, "cudnn attention: more than %d operations", kOps);
    p->ops[p->nops++] = op;
    return TKD_OK;
}

/* y = mode(x[, b[, t]]) computed in prec; axis only for GEN_INDEX. */
tkd_status pointwise(Plan *p, cudnnPointwiseMode_t mode, cudnnDataType_t prec, cudnnBackendDescriptor_t x,
                     cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                     int64_t axis = -1)
{
    cudnnBackendDescriptor_t pw;
    const float one = 1.0f;
    TKD_TRY(described(p, CUDNN_BACKEND_POINTWISE_DESCRIPTOR,
                      {ATTR(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode),
                       ATTR(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec),
                       ATTR_IF(mode == CUDNN_POINTWISE_GEN_INDEX, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1,
                               &axis)},
                      &pw));
    return operation(p, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
                     {DESC(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw),
                      DESC(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x),
                      DESC_IF(b != NULL, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b),
                      DESC_IF(t != NULL, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t),
                      DESC(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y),
                      ATTR(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one),
                      ATTR(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one)});
}

/* y = reduce(x) over the axes where y's dimension is 1, in fp32. */
tkd_status reduction(Plan *p, cudnnReduceTensorOp_t red, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y)
{
    cudnnBackendDescriptor_t rd;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    TKD_TRY(described(p, CUDNN_BACKEND_REDUCTION_DESCRIPTOR,
                      {ATTR(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red),
                       ATTR(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32)},
                      &rd));
    return operation(p, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
                     {DESC(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x), DESC(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y),
                      DESC(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd)});
}

/* c = a·b batched over the two leading dims (b's head dim may divide a's: GQA), fp32 accumulation. */
tkd_status matmul(Plan *p, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c)
{
    cudnnBackendDescriptor_t md;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    TKD_TRY(described(p, CUDNN_BACKEND_MATMUL_DESCRIPTOR,
                      {ATTR(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32)}, &md));
    return operation(p, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
                     {DESC(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a), DESC(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b),
                      DESC(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c), DESC(CUDNN_ATTR_OPERATION_MATMUL_DESC, md)});
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

/* Virtual fp32 tensors of the scores' shape (B, H, T, T), made in the order given: the
 * intermediates of the softmax and of dS. what: the step's name, for the message. */
struct Named {
    const char *what;
    cudnnBackendDescriptor_t *out;
};

tkd_status score_tensors(Plan *p, const Shapes &s, std::initializer_list<Named> ts)
{
    for (const Named &t : ts)
        STEP(t.what, tensor(p, 0, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, false, t.out));
    return TKD_OK;
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
    TKD_TRY(score_tensors(p, s, {{"tensor S", &sc}, {"tensor S·scale", &ss}}));
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
    TKD_TRY(score_tensors(p, s, {{"tensor S - max", &sub}, {"tensor exp", &ex}}));
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
    return operation(p, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR,
                     {DESC(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x), DESC(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y)});
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

/* out (uid kUidDV or kUidDK: (B, Hkv, T, dh) bf16) = Σgroup xᵀ·b, x (B, H, T, T) fp32 seen
 * transposed in bf16 through a reshape: the dV and dK steps. names: the four steps' names, for the
 * messages. */
tkd_status graph_grad_kv(Plan *p, const Shapes &s, const BwdShapes &bs, cudnnBackendDescriptor_t x,
                         cudnnBackendDescriptor_t b, int64_t uid, const char *const names[4])
{
    cudnnBackendDescriptor_t xt, out;
    STEP(names[0], tensor(p, 0, CUDNN_DATA_BFLOAT16, bs.st_dim, bs.st_str, false, &xt));
    STEP(names[1], tensor(p, uid, CUDNN_DATA_BFLOAT16, s.v_dim, s.v_str, false, &out));
    STEP(names[2], reshape(p, x, xt));
    return matmul_gqa(p, bs, xt, b, out, names[3]);
}

/* The backward graph (cudnn-frontend's composite sdpa_backward with its deterministic choice on
 * Hopper: dQ straight from dS·K, no fp32 atomic accumulator):
 *   E = exp(masked S − stats) (P, fp32);  dV = Σgroup Pᵀ·dO;  dP = dO·Vᵀ;
 *   dS = (dP − softmax_sum) ⊙ E · scale;  dK = Σgroup dSᵀ·Q;  dQ = dS·K. */
tkd_status graph_backward(Plan *p, const Shapes &s)
{
    const BwdShapes bs = bwd_shapes_for(p->key);
    const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
    static const char *const dv_steps[4] = {"tensor Pᵀ", "tensor dv", "reshape Pᵀ", "matmul Pᵀ·dO"};
    static const char *const dk_steps[4] = {"tensor dSᵀ", "tensor dk", "reshape dSᵀ", "matmul dSᵀ·Q"};
    cudnnBackendDescriptor_t dy, ssum, masked, q, kt, scale, stats, sub, ex, vt, dp, dps, dpe, ds, kk, dq;
    TKD_TRY(graph_softmax_sum(p, s, &dy, &ssum));
    TKD_TRY(graph_scores(p, s, &masked, &q, &kt, &scale));
    STEP("tensor stats", tensor(p, kUidStats, f32, s.r_dim, s.st_str, false, &stats));
    TKD_TRY(score_tensors(p, s, {{"tensor S - stats", &sub}, {"tensor exp", &ex}}));
    STEP("pointwise S - stats", pointwise(p, CUDNN_POINTWISE_SUB, f32, masked, stats, NULL, sub));
    STEP("pointwise exp", pointwise(p, CUDNN_POINTWISE_EXP, f32, sub, NULL, NULL, ex));
    /* dV */
    TKD_TRY(graph_grad_kv(p, s, bs, ex, dy, kUidDV, dv_steps));
    /* dP, dS */
    int64_t vt_dim[4] = {s.v_dim[0], s.v_dim[1], s.v_dim[3], s.v_dim[2]};
    int64_t vt_str[4] = {s.v_str[0], s.v_str[1], s.v_str[3], s.v_str[2]};
    STEP("tensor vᵀ", tensor(p, kUidV, bf16, vt_dim, vt_str, false, &vt));
    TKD_TRY(score_tensors(p, s, {{"tensor dP", &dp}, {"tensor dP - softmax_sum", &dps},
                                 {"tensor (dP - softmax_sum)·E", &dpe}, {"tensor dS", &ds}}));
    STEP("matmul dO·Vᵀ", matmul(p, dy, vt, dp));
    STEP("pointwise dP - softmax_sum", pointwise(p, CUDNN_POINTWISE_SUB, f32, dp, ssum, NULL, dps));
    STEP("pointwise ·E", pointwise(p, CUDNN_POINTWISE_MUL, f32, dps, ex, NULL, dpe));
    STEP("pointwise dS·scale", pointwise(p, CUDNN_POINTWISE_MUL, f32, dpe, scale, NULL, ds));
    /* dK */
    TKD_TRY(graph_grad_kv(p, s, bs, ds, q, kUidDK, dk_steps));
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

} // namespace

/* The finalized operation graph for p->key. */
tkd_status graph_build(Plan *p, cudnnHandle_t h, cudnnBackendDescriptor_t *out)
{
    const Shapes s = shapes_for(p->key);
    cudnnBackendDescriptor_t masked;
    p->next_uid = kUidVirtual;
    if (p->key.bwd) {
        TKD_TRY(graph_backward(p, s));
    } else {
        TKD_TRY(graph_scores(p, s, &masked));
        TKD_TRY(graph_softmax_pv(p, s, masked));
    }
    /* The handle: deprecated since cuDNN 9.8 (the device comes from the current context), still
     * accepted, and what cudnn-frontend sets when given a handle: the path PyTorch's cuDNN attention
     * takes. */
    return described(p, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR,
                     {ATTR(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, p->nops, p->ops),
                      ATTR(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h)},
                     out);
}

namespace {

/* Asks the heuristics (mode) for engine configs of graph g into p->cfgs (replacing the last ones). */
tkd_status heuristics(Plan *p, cudnnBackendDescriptor_t g, cudnnBackendHeurMode_t mode)
{
    cudnnBackendDescriptor_t heur;
    for (int i = 0; i < p->ncfgs; i++)
        destroy(p->cfgs[i]);
    p->ncfgs = 0;
    TKD_TRY(described(p, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR,
                      {DESC(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, g),
                       ATTR(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode)},
                      &heur));
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

} // namespace

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

} // namespace tkd_cudnng

#endif /* TKD_HAVE_CUDNN */
