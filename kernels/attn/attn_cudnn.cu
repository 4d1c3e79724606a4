/* attn_cudnn.cu — see attn_cudnn.h. Host code only: the plan cache, the variant packs and the
 * forward / backward entry points of cuDNN's backend API; the operation graphs and the engine pick
 * are in attn_cudnn_graph.cu. */
#include "kernels/attn/attn_cudnn.h"

#include "common/status.h"
#include "kernels/attn/attn_cudnn_internal.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef TKD_HAVE_CUDNN

using namespace tkd_cudnng;

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
    tkd_cuda_ws_free(a, [](tkd_cudnn_attn *w) {
        for (int i = 0; i < kPlans; i++)
            if (w->plans[i].used)
                plan_destroy(&w->plans[i]);
        if (w->h)
            (void)cudnnDestroy(w->h); /* teardown: not actionable */
        tkd_cuda_free(w->ws);
    });
}

static tkd_status attn_init(tkd_cudnn_attn *a)
{
    const size_t ver = cudnnGetVersion();
    if (ver < 90000)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "cuDNN attention: the cuDNN loaded is %zu, 9.x needed", ver);
    a->bwd_budget = TKD_CUDNN_ATTN_BWD_BUDGET;
    TKD_CUDNN_CHECK(cudnnCreate(&a->h));
    return TKD_OK;
}

extern "C" tkd_status tkd_cudnn_attn_create(tkd_cudnn_attn **out)
{
    return tkd_cuda_ws_create(out, tkd_cudnn_attn_free, "cuDNN attention: out of host memory", attn_init);
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
