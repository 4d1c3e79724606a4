/* lmhead_sm90.cu — see lmhead_sm90.h. Built for sm_90a only (kernels/CMakeLists.txt). The GEMM
 * runs on gemm_sm90/'s one driver (gemm_sm90_pipe.cuh) as the problem of lmhead_sm90_logits.cuh;
 * this file holds the launchers of its epilogue combinations, the partials' combine and the
 * teacher's top-k selection. The bench-only main loop and the tuning setters are in
 * lmhead_sm90_tuning.cu (library tkd_kernels_tuning).
 *
 * The GEMM. Tiles of Z are BN = 256 columns wide, K in steps of 64 (BK: one 128-byte swizzle span
 * of bf16). A persistent grid (one CTA per SM) walks the tiles; each CTA has three warpgroups:
 *   warpgroup 0, the producer: one thread issues the TMA loads (cp.async.bulk.tensor) of the H tile
 *     (rows x 64) and the W tile (256 x 64) of each K step into a ring of shared-memory stages,
 *     each completing on that stage's `full` mbarrier (expect_tx of the stage's bytes);
 *   warpgroups 1 and 2, the consumers: each waits on `full`, issues four wgmma.m64n256k16 per K
 *     step (both operands from shared memory, 128-byte swizzle), keeps one K step of wgmma in
 *     flight, and releases a stage on its `empty` mbarrier (one arrival per consuming warp) once
 *     the wgmma that read it is done; after the last K step it runs the epilogue straight from the
 *     128 fp32 accumulators per thread.
 * Two schedules (tkd_lmhead_sm90_sched):
 *   cooperative: 128 x 256 tiles, 4 stages of 48 KB; both consumers work on every tile (64 rows
 *     each) and run its epilogue together, while the tensor cores wait.
 *   ping-pong: 64 x 256 tiles, 5 stages of 40 KB; the consumers own whole tiles in alternation
 *     (consumer 0 the CTA's tiles 0, 2, 4.., consumer 1 tiles 1, 3, 5..), so one runs its epilogue
 *     while the other's wgmma run. A pair of `turn` mbarriers orders their main loops: consumer c
 *     starts the main loop of its tile only after the other finished waiting on every stage of
 *     the tile before it. That keeps the tensor cores with one warpgroup at a time and, more
 *     importantly, keeps the ring's parity waits exact: a consumer that skips the other's K steps
 *     must never wait on a stage whose previous fill has not even landed (an mbarrier's parity
 *     tells only its last two phases apart).
 *     The price: each W tile is loaded per 64 rows instead of per 128 (320 instead of 192 loaded
 *     rows per 64 x 256 of output, from L2), so whether it wins is a measurement (kl_bench --lmhead
 *     times both).
 * setmaxnreg moves registers from the producer (40) to the consumers (232). Stage q of the ring
 * (q = the CTA's tile sequence number · K steps + K step) sits in slot q mod stages with phase
 * parity (q / stages) mod 2; producer and consumers derive it from the same tile sequence. Tiles are
 * visited in groups of 2048 rows of H swept along V, so a wave of CTAs shares its H rows and W rows
 * in L2.
 *
 * Shared memory per stage: A (rows x 128 B) then B (256 rows x 128 B), each 1024-byte aligned
 * as the 128-byte swizzle wants (the TMA writes the swizzled layout; the wgmma descriptors say
 * "128-byte swizzle, 8-row groups 1024 bytes apart"; the K step inside the span moves the start
 * address by 32 bytes). Out-of-range rows and K columns of a box are zero-filled by the TMA.
 *
 * Accumulator fragment of wgmma m64nNk16 (fp32): in warp w of a warpgroup, lane l holds rows
 * 16w + l/4 (+8) and columns 8j + 2(l%4) + e of the warpgroup's 64 x 256 block, register
 * 4j + 2h + e for row 16w + l/4 + 8h. So a row lives in the 4 lanes of a quad: quad shuffles
 * reduce it.
 */
#include "kernels/gemm_sm90/lmhead_sm90.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mem.h"
#include "kernels/gemm_sm90/lmhead_sm90_logits.cuh"

namespace {

/* lse1, lset (n) from part (3, n, T): per row M = max m_t, lse1 = M + log Σ s1_t e^(m_t − M),
 * lset = M/τ + log Σ st_t e^((m_t − M)/τ). One warp per row. */
__global__ void lse_combine_kernel(const float *part, long long n, int T, float inv_tau,
                                   float *lse1, float *lset)
{
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= n)
        return;
    const int lane = threadIdx.x & 31;
    const size_t plane = (size_t)n * T;
    const float *pm = part + (size_t)row * T, *p1 = pm + plane, *pt = pm + 2 * plane;
    float m = -INFINITY;
    for (int t = lane; t < T; t += 32)
        m = fmaxf(m, pm[t]);
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s1 = 0.0f, st = 0.0f;
    for (int t = lane; t < T; t += 32) {
        const float dm = pm[t] - m;
        s1 += p1[t] * expf(dm);
        st += pt[t] * expf(dm * inv_tau);
    }
    for (int o = 16; o > 0; o >>= 1) {
        s1 += __shfl_xor_sync(0xffffffffu, s1, o);
        st += __shfl_xor_sync(0xffffffffu, st, o);
    }
    if (lane == 0) {
        lse1[row] = m + logf(s1);
        lset[row] = m * inv_tau + logf(st);
    }
}

/* The k-th largest tile maximum of each row (plane m of part (3, n, T)): at least k logits of the
 * row are at or above it, so its top k are. -inf when T < k. One warp per row. */
__global__ void topk_thr_kernel(const float *part, long long n, int T, int k, float *thr)
{
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= n)
        return;
    const int lane = threadIdx.x & 31;
    const float *m = part + (size_t)row * T;
    float best = -INFINITY;
    for (int i = lane; i < T && T >= k; i += 32) {
        const float x = m[i];
        int c = 0;
        for (int j = 0; j < T; j++)
            c += m[j] >= x;
        if (c >= k)
            best = fmaxf(best, x);
    }
    for (int o = 16; o > 0; o >>= 1)
        best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, o));
    if (lane == 0)
        thr[row] = best;
}

/* Ascending order of (logit descending, column ascending) as one 64-bit key. */
__device__ inline unsigned long long cand_key(int2 c)
{
    const unsigned u = (unsigned)c.x, ord = u ^ ((u >> 31) ? 0xffffffffu : 0x80000000u);
    return ((unsigned long long)(~ord) << 32) | (unsigned)c.y;
}

__device__ inline float key_logit(unsigned long long key)
{
    const unsigned ord = ~(unsigned)(key >> 32);
    return __uint_as_float(ord ^ ((ord >> 31) ? 0x80000000u : 0xffffffffu));
}

/* One block per row: the row's candidates sorted (bitonic, in shared memory: a power of two ≥
 * their count, at most cap) and the first k written out as (id, logit), ties by the smaller id
 * (kernels/cpu/topk.h's order). A row with more than cap candidates counts in flags[0] and writes
 * nothing (the caller runs the logits path instead). */
__global__ void topk_select_kernel(const int2 *cand, const unsigned *cnt, int cap, long long n, int k,
                                   uint32_t *idx, float *val, unsigned *flags)
{
    extern __shared__ unsigned long long keys[];
    const long long row = blockIdx.x;
    const unsigned c = cnt[row];
    if (c > (unsigned)cap || c < (unsigned)k) { /* too many to sort here; too few: NaN maxima */
        if (threadIdx.x == 0)
            atomicAdd(&flags[0], 1u);
        return;
    }
    int m = 1;
    while (m < (int)c)
        m <<= 1;
    for (int i = threadIdx.x; i < m; i += blockDim.x)
        keys[i] = i < (int)c ? cand_key(cand[row * cap + i]) : ~0ull;
    __syncthreads();
    for (int size = 2; size <= m; size <<= 1)
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < m; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool up = (i & size) == 0;
                    const unsigned long long a = keys[i], b = keys[j];
                    if ((a > b) == up) {
                        keys[i] = b;
                        keys[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        const unsigned long long key = i < (int)c ? keys[i] : ~0ull;
        idx[row * k + i] = (uint32_t)(key & 0xffffffffu);
        val[row * k + i] = i < (int)c ? key_logit(key) : -INFINITY;
    }
}

/* ---- host side ----------------------------------------------------------------------------------- */

tkd_status check_z(const float *z, int v, int64_t ldz)
{
    if (!z || ldz < v || ldz % 2 != 0 || (uintptr_t)z % 8 != 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: z needs ldz >= V (%d), ldz even "
                             "(got %lld) and 8-byte alignment", v, (long long)ldz);
    return TKD_OK;
}

/* The statistics epilogue's part of p: partials (3, n, tiles) and τ. */
tkd_status set_stats(Params &p, float *part, float tau)
{
    if (!part || !(tau > 0.0f) || !isfinite(tau))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: stats need part and a finite "
                             "τ > 0 (got %g)", (double)tau);
    p.part = part;
    p.l2e_tau = kLog2e / tau;
    p.tau_mode = tau == 1.0f ? 1 : tau == 2.0f ? 2 : 0;
    return TKD_OK;
}

/* The fused epilogues' arguments into p; which parts run follows from what is set. */
tkd_status set_fused(Params &p, Fx &x, const tkd_lmhead_sm90_fused *f, int &epi)
{
    epi = 0;
    if (f->part) {
        TKD_TRY(set_stats(p, f->part, f->tau));
        epi |= kEpiStats;
    }
    if (f->e) {
        if (f->lde < p.v || f->lde % 2 != 0 || (uintptr_t)f->e % 4 != 0 || !f->ref ||
            !(f->tau > 0.0f) || !isfinite(f->tau))
            return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: exp epilogue needs lde >= V "
                                 "(%d) and even (got %lld), e 4-byte aligned, ref and τ > 0", p.v,
                                 (long long)f->lde);
        x.e = reinterpret_cast<__nv_bfloat16 *>(f->e);
        x.lde = f->lde;
        x.ref = f->ref;
        x.ref_scale = f->ref_scale;
        x.l2e_k = f->k_one ? kLog2e : kLog2e / f->tau;
        epi |= kEpiExp;
    }
    if (f->sp_off) {
        if (!f->sp_list || !f->g || f->sp_l < 1)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: gather needs sp_list, g and "
                                 "sp_l >= 1 (got %d)", f->sp_l);
        x.sp_off = f->sp_off;
        x.sp_list = reinterpret_cast<const int2 *>(f->sp_list);
        x.sp_l = f->sp_l;
        x.g = f->g;
        epi |= kEpiGather;
    }
    return TKD_OK;
}

} // namespace

extern "C" tkd_status tkd_lmhead_sm90_supported(void)
{
    tkd_status st = check_cc90("lmhead_sm90");
    return st == TKD_ERR_UNSUPPORTED ? tkd_error_hint(st, "use the cuBLAS path") : st;
}

extern "C" tkd_status tkd_lmhead_sm90_ws_create(tkd_lmhead_sm90_ws **out, int sched)
{
    *out = NULL;
    TKD_TRY(tkd_lmhead_sm90_supported());
    tkd_lmhead_sm90_ws *ws = (tkd_lmhead_sm90_ws *)calloc(1, sizeof *ws);
    if (!ws)
        return tkd_error_set(TKD_ERR_NOMEM, "lmhead_sm90: workspace");
    ws->sched = sched == TKD_LMHEAD_SM90_SCHED_COOP ? TKD_LMHEAD_SM90_SCHED_COOP : TKD_LMHEAD_SM90_SCHED_PINGPONG;
    tkd_status st = tkd_cuda_malloc((void **)&ws->err, sizeof *ws->err, "lmhead_sm90: error flag", NULL);
    if (st == TKD_OK)
        st = tkd_cuda_memzero(ws->err, sizeof *ws->err);
    if (st != TKD_OK) {
        tkd_lmhead_sm90_ws_free(ws);
        return st;
    }
    *out = ws;
    return TKD_OK;
}

extern "C" void tkd_lmhead_sm90_ws_free(tkd_lmhead_sm90_ws *ws)
{
    if (!ws)
        return;
    tkd_cuda_free(ws->err);
    free(ws);
}

extern "C" int tkd_lmhead_sm90_vtiles(int v) { return (v + kBN - 1) / kBN; }

extern "C" size_t tkd_lmhead_sm90_part_floats(int64_t n, int v)
{
    return 3 * (size_t)n * (size_t)tkd_lmhead_sm90_vtiles(v);
}

extern "C" tkd_status tkd_lmhead_sm90_logits(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                             const uint16_t *w, int64_t n, int d, int v, float *z,
                                             int64_t ldz)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    TKD_TRY(check_z(z, v, ldz));
    Params p = params_of(ws, n, d, v);
    p.z = z;
    p.ldz = ldz;
    return launch<kEpiLogits>(ws, h, w, d, p);
}

extern "C" tkd_status tkd_lmhead_sm90_stats(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                            const uint16_t *w, int64_t n, int d, int v, float tau,
                                            float *part)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    Params p = params_of(ws, n, d, v);
    TKD_TRY(set_stats(p, part, tau));
    return launch<kEpiStats>(ws, h, w, d, p);
}

extern "C" tkd_status tkd_lmhead_sm90_logits_stats(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                                   const uint16_t *w, int64_t n, int d, int v,
                                                   float tau, float *z, int64_t ldz, float *part)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    TKD_TRY(check_z(z, v, ldz));
    Params p = params_of(ws, n, d, v);
    TKD_TRY(set_stats(p, part, tau));
    p.z = z;
    p.ldz = ldz;
    return launch<kEpiLogitsStats>(ws, h, w, d, p);
}

extern "C" float tkd_lmhead_sm90_exp_scale(float tau, int k_one)
{
    return k_one ? kLog2e : kLog2e / tau;
}

extern "C" tkd_status tkd_lmhead_sm90_fused_run(tkd_lmhead_sm90_ws *ws, const uint16_t *h,
                                                const uint16_t *w, int64_t n, int d, int v,
                                                const tkd_lmhead_sm90_fused *f)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    Params p = params_of(ws, n, d, v);
    Fx x = {};
    int epi = 0;
    TKD_TRY(set_fused(p, x, f, epi));
    switch (epi) { /* the combinations the loss runs, each one kernel */
    case kEpiStats | kEpiGather: return launch<kEpiStats | kEpiGather>(ws, h, w, d, p, x);
    case kEpiExp | kEpiGather: return launch<kEpiExp | kEpiGather>(ws, h, w, d, p, x);
    case kEpiStats | kEpiExp | kEpiGather:
        return launch<kEpiStats | kEpiExp | kEpiGather>(ws, h, w, d, p, x);
    default:
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "lmhead_sm90: fused epilogue 0x%x: only "
                             "statistics + gather, exp + gather, and all three are built", epi);
    }
}

static tkd_status launch_lse(const float *part, int64_t n, int v, float tau, float *lse1, float *lset,
                             cudaStream_t stream)
{
    if (!part || !lse1 || !lset || n < 1 || v < 1 || !(tau > 0.0f) || !isfinite(tau))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: lse: bad arguments (N %lld, V %d, "
                             "τ %g)", (long long)n, v, (double)tau);
    constexpr int kRowsPerBlock = 8; /* one warp per row */
    const long long blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
    lse_combine_kernel<<<(unsigned)blocks, 32 * kRowsPerBlock, 0, stream>>>(
        part, n, tkd_lmhead_sm90_vtiles(v), 1.0f / tau, lse1, lset);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

extern "C" tkd_status tkd_lmhead_sm90_lse(const float *part, int64_t n, int v, float tau,
                                          float *lse1, float *lset)
{
    return launch_lse(part, n, v, tau, lse1, lset, 0);
}

extern "C" void tkd_lmhead_sm90_ws_set_stream(tkd_lmhead_sm90_ws *ws, void *stream)
{
    ws->stream = static_cast<cudaStream_t>(stream);
}

extern "C" const unsigned *tkd_lmhead_sm90_ws_error_flag(const tkd_lmhead_sm90_ws *ws) { return ws->err; }

extern "C" size_t tkd_lmhead_sm90_topk_bytes(int64_t n, int v, int cap)
{
    return tkd_lmhead_sm90_part_floats(n, v) * 4 + (size_t)n * (3 * 4 + (size_t)cap * 8) + 2 * 4 + 64;
}

extern "C" tkd_status tkd_lmhead_sm90_topk(tkd_lmhead_sm90_ws *ws, const uint16_t *h, const uint16_t *w,
                                           int64_t n, int d, int v, int k, float tau, int cap,
                                           void *scratch, unsigned *flags, uint32_t *idx,
                                           float *val, float *lse)
{
    TKD_TRY(check_shape(h, w, n, d, v));
    if (k < 1 || k > v || cap < k || cap > TKD_LMHEAD_SM90_TOPK_MAX_CAP || !scratch || !flags ||
        !idx || !val || !lse)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lmhead_sm90: topk: k %d (V %d), cap %d (k..%d) "
                             "or a NULL buffer", k, v, cap, TKD_LMHEAD_SM90_TOPK_MAX_CAP);
    /* scratch: part (3, n, T), then thr, lse1, cnt (n each), then cand (n, cap) 8-byte aligned */
    float *part = static_cast<float *>(scratch);
    float *thr = part + tkd_lmhead_sm90_part_floats(n, v), *lse1 = thr + n;
    unsigned *cnt = reinterpret_cast<unsigned *>(lse1 + n);
    int2 *cand = reinterpret_cast<int2 *>(((uintptr_t)(cnt + n) + 7) & ~(uintptr_t)7);
    const cudaStream_t st = ws->stream;
    TKD_CUDA_CHECK(cudaMemsetAsync(cnt, 0, (size_t)n * 4, st));
    Params p = params_of(ws, n, d, v);
    TKD_TRY(set_stats(p, part, tau));
    TKD_TRY(launch<kEpiStats>(ws, h, w, d, p));
    TKD_TRY(launch_lse(part, n, v, tau, lse1, lse, st));
    const long long blocks = (n + 7) / 8;
    topk_thr_kernel<<<(unsigned)blocks, 256, 0, st>>>(part, n, tkd_lmhead_sm90_vtiles(v), k, thr);
    TKD_CUDA_CHECK(cudaGetLastError());
    Fx x = {};
    x.thr = thr, x.cnt = cnt, x.cand = cand, x.cap = cap, x.flags = flags;
    TKD_TRY(launch<kEpiCand>(ws, h, w, d, params_of(ws, n, d, v), x));
    int m = 1;
    while (m < cap)
        m <<= 1;
    const size_t smem = (size_t)m * 8;
    if (smem > 48 * 1024)
        TKD_CUDA_CHECK(cudaFuncSetAttribute(topk_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem));
    topk_select_kernel<<<(unsigned)n, 256, smem, st>>>(cand, cnt, cap, n, k, idx, val, flags);
    TKD_CUDA_CHECK(cudaGetLastError());
    return TKD_OK;
}

extern "C" tkd_status tkd_lmhead_sm90_sync(tkd_lmhead_sm90_ws *ws)
{
    return check_wait_flag(ws->err, "lmhead_sm90");
}
