/* kl_loss_cuda_internal.h — the CUDA KL loss's workspace and its per-chunk stages, for bench/ and
 * tests/ only. The product API is kernels/loss/kl_loss_cuda.h; nothing in teacher_cache/, student_train/
 * or model/ includes this header.
 *
 * tkd_kl_cuda_forward and tkd_kl_cuda_backward are loops over chunks of the stages below; the
 * benchmark (bench/kl_bench_cuda.cu) runs the same stages one at a time to time each (profile) and
 * to run the GEMMs alone (the floor), and sweeps the row kernels' launch shape on its own
 * workspace with tkd_kl_cuda_ws_set_rows (kl_loss_cuda_tuning.h); tests/test_gpu_kl_loss.c checks every such shape.
 * Usable from C with the CUDA include path (it names cuBLAS's handle type); CUDA builds only.
 */
#ifndef TKD_KL_LOSS_CUDA_INTERNAL_H
#define TKD_KL_LOSS_CUDA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <cublas_v2.h>

#include "common/status.h"
#include "kernels/loss/kl_loss.h"
#include "kernels/loss/kl_loss_cuda.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The row kernels' launch shape, the one the product runs: 512 threads per block (one row per
 * block, 2 blocks per SM) with 4 float4 loads in flight per thread. Measured best on an H200
 * (docs/PERFORMANCE.md, 2026-11-30): 256 x 8 and 128 x 8 were no better. */
#define TKD_KL_CUDA_ROW_THREADS 512
#define TKD_KL_CUDA_ROW_VEC 4

/* The device-side loss sums, kept-row count and first-bad-row state (defined in the .cu). */
typedef struct tkd_kl_cuda_dev_out tkd_kl_cuda_dev_out;

/* Which of the fused path's gradient GEMMs are ours (tkd_kl_cuda_ws.grad_sm90 bits). */
enum { TKD_KL_GRAD_DH = 1, TKD_KL_GRAD_DW = 2 };

/* Sized once by tkd_kl_cuda_ws_create. */
struct tkd_kl_cuda_ws {
    int64_t n_max;
    int d, v, chunk;
    long long ldl;             /* fp32 logits leading dimension: V rounded up to 16 floats */
    int row_threads, row_vec;  /* TKD_KL_CUDA_ROW_THREADS / _VEC unless tkd_kl_cuda_ws_set_rows */
    cublasHandle_t blas;
    void *blas_ws;             /* the cuBLAS workspace we hand it, so that it allocates none */
    tkd_lmhead_sm90_ws *lm;    /* our Hopper logits GEMM, NULL where it does not run (not sm_90,
                                * D not a multiple of 8, TKD_KL_SM90=0) */
    float *lm_part;            /* (3, chunk, ceil(V / 256)) its statistics partials, with lm */
    int use_sm90;              /* 1: forward/backward use lm (set when lm is; the bench toggles) */
    float *chunk_buf;          /* (chunk, ldl) fp32 logits; in place bf16 dS (chunk, 2·ldl); on
                                * the fused path bf16 E (chunk_e, ldl): twice the rows, same bytes */
    /* The fused path (with lm, unless TKD_KL_FUSED=0): the sm90 GEMM's epilogue gathers the special
     * columns and writes the gradient tile as bf16; chunks of chunk_e rows. */
    int fused;                 /* 1: calls that qualify take it (tkd_kl_cuda_fused_on) */
    int grad_sm90;             /* TKD_KL_GRAD_DH, TKD_KL_GRAD_DW bits: that GEMM is ours
                                * (lmhead_grad_sm90.h: sigma resp. dW's accumulation in the
                                * epilogue), else cuBLAS (dH then scaled in a pass). Default: dH
                                * where D is a multiple of 256; TKD_KL_GRAD_SM90 = 0, dh, dw, both
                                * picks (sm90_setup) */
    int sms;                   /* the device's multiprocessors (dH's waves, tkd_kl_cuda_chunk_for) */
    int chunk_e;               /* rows per fused chunk: 2·chunk, at most n_max */
    int sp_l;                  /* special slots per row: k + s + 1 of the params it was made with */
    int32_t *sp_list;          /* (chunk_e, sp_l) (column, slot) pairs sorted by column */
    int *sp_off;               /* (chunk_e, tiles + 1) each row-tile's first entry in sp_list */
    float *sp_g;               /* (chunk_e, sp_l) the logits at the special columns, by slot */
    float *ref, *sigma;        /* (chunk_e) E's reference logit; dS = sigma · E off the specials */
    uint16_t *hs;              /* (chunk_e, D) bf16 sigma_i · h_i, dW's operand */
    unsigned long long slow_rows; /* rows the last forward (+ backward) made E again: the student's
                                   * logit at the row's first special column was far below its max */
    /* Dense mode (made for tkd_kl_params.dense, else NULL): the teacher's logits chunk beside
     * chunk_buf, and the row statistics recompute's backward reads (kl_loss_cuda_dense.cu). */
    float *tchunk_buf;         /* (chunk, ldl) fp32 teacher logits */
    double *dense_stats;       /* (4, n_max): LSE(zt/τ), LSE(zs/τ), LSE(zs), gbar per row */
    float *lse_tau, *lse_one, *log_omq; /* (n_max) per-row statistics */
    double *row_stats;         /* (3, n_max): loss, kd, ce per row */
    tkd_kl_cuda_dev_out *out;
};

/* What the row kernel does with one chunk: the statistics pass of recompute forward, the gradient
 * pass of backward (dS in place), or both in one pass (grad_in_forward). */
typedef enum tkd_kl_cuda_rows_mode {
    TKD_KL_CUDA_ROWS_STATS = 0,
    TKD_KL_CUDA_ROWS_GRAD = 1,
    TKD_KL_CUDA_ROWS_STATS_GRAD = 2,
    /* flag, with the stats modes: the chunk's LSEs at 1 and 1/τ are already in ws (the sm90
     * GEMM's fused statistics), so the row kernel reads them instead of its own pass over the
     * row; not for `tail` (its 1 − Q needs the sum outside the top-k'). */
    TKD_KL_CUDA_ROWS_LSE_GIVEN = 4,
} tkd_kl_cuda_rows_mode;

/* The checks tkd_kl_cuda_forward/backward make on entry: the batch fits ws, p is valid for the
 * CUDA path, and dh, dw are set when need_grads. */
tkd_status tkd_kl_cuda_check_call(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                  const tkd_kl_cuda_batch *b, int need_grads, const float *dh,
                                  const float *dw);

/* Counts the kept rows of b into ws and clears the error state; forward's first stage. */
tkd_status tkd_kl_cuda_count_kept(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                  const tkd_kl_cuda_batch *b);

/* Chunk [row0, row0 + rows): logits (rows, ldl) fp32 into ws->chunk_buf = H_c Wᵀ (cuBLAS: the
 * fallback, the reference and the floor's GEMM). */
tkd_status tkd_kl_cuda_chunk_logits(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int64_t row0,
                                    int rows);

/* Dense mode: the teacher's logits (rows, ldl) fp32 into ws->tchunk_buf = Ht_c Wtᵀ (cuBLAS; bf16
 * b->teacher_h (N, Dt), b->teacher_w (V, Dt)). */
tkd_status tkd_kl_cuda_chunk_teacher_logits(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int64_t row0,
                                            int rows);

/* 1 when calls with p on ws run the sm90 path: ws->use_sm90 and a variant other than `tail`. */
int tkd_kl_cuda_sm90_on(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p);

/* The chunk's logits as forward (stats = 1) and backward (stats = 0) make them: with
 * tkd_kl_cuda_sm90_on, our GEMM writes the logits and, with stats, its per-tile statistics, then
 * combines them into ws->lse_one / lse_tau (rows row0..); *rows_flag is then
 * TKD_KL_CUDA_ROWS_LSE_GIVEN for the stats modes. Otherwise cuBLAS and *rows_flag = 0. */
tkd_status tkd_kl_cuda_chunk_logits_auto(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                         const tkd_kl_cuda_batch *b, int64_t row0, int rows,
                                         int stats, int *rows_flag);

/* After a pass that used the sm90 GEMM: waits, then reports a pipeline timeout of its kernels
 * (TKD_ERR_INTERNAL) instead of letting garbage through; TKD_OK without it. */
tkd_status tkd_kl_cuda_sm90_check(tkd_kl_cuda_ws *ws);

/* 1 when calls with p on ws take the fused path (forward statistics and gather from the GEMM's
 * epilogue, nothing written but the statistics); tkd_kl_cuda_fused_grad_on: its gradient too,
 * the bf16 tile from the epilogue, which needs one softmax in the dense gradient: τ = 1, α = 1 or
 * α = 0 (else the sm90 fp32-logits path makes the gradient). */
int tkd_kl_cuda_fused_on(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p);
int tkd_kl_cuda_fused_grad_on(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p);
/* Stage marks of one chunk, for the benchmark's profile: called before each stage (0 logits GEMM
 * with its preparation and combine, 1 row kernel, 2 dH, 3 dW) when not NULL. */
typedef tkd_status (*tkd_kl_cuda_mark_fn)(void *ctx, int stage);
/* One chunk [row0, row0 + rows) of forward (mode STATS or STATS_GRAD) or backward (GRAD), on the
 * path the product takes for p; dh, dw only in the gradient modes. The product's loops call it. */
tkd_status tkd_kl_cuda_run_chunk(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                 const tkd_kl_cuda_batch *b, tkd_kl_cuda_rows_mode mode,
                                 int64_t row0, int rows, float grad_scale, float *dh, float *dw,
                                 tkd_kl_cuda_mark_fn mark, void *mark_ctx);
/* Rows per chunk of a call with p over n rows: on the fused path for that mode as many chunks as
 * chunk_e rows need, balanced (128-row multiples) — in gradient modes where our dH GEMM runs, up to
 * three chunks more where that fills its waves better (tkd_kl_cuda_dh_chunk_rows); else chunk. */
int tkd_kl_cuda_chunk_for(const tkd_kl_cuda_ws *ws, const tkd_kl_params *p, int grad, int64_t n);

/* The rows per chunk tkd_kl_cuda_chunk_for takes when our dH GEMM runs: n rows, at most chunk_e
 * per chunk, at least c0 ≥ 1 chunks, D columns, sms multiprocessors. Host arithmetic only (exposed for
 * its test). The chunk count depends on sms, so dW's fp32 bits do too (chunks sum in order). */
int tkd_kl_cuda_dh_chunk_rows(int64_t n, int chunk_e, int64_t c0, int d, int sms);
/* The row kernel over the chunk in ws->chunk_buf; gradient modes make ∂(grad_scale·loss)/∂s.
 * mode may carry TKD_KL_CUDA_ROWS_LSE_GIVEN (stats modes, not `tail`). */
tkd_status tkd_kl_cuda_chunk_rows(tkd_kl_cuda_ws *ws, const tkd_kl_params *p,
                                  const tkd_kl_cuda_batch *b, tkd_kl_cuda_rows_mode mode,
                                  int64_t row0, int rows, float grad_scale);

/* dH_c (rows, D) fp32 = dS · W (overwrites rows row0.. of dh); dW (V, D) fp32 += dSᵀ · H_c
 * (= when !accumulate).
 * ds (rows, 2·ldl) bf16: ws->chunk_buf after a gradient mode, or any stand-in of that shape. */
tkd_status tkd_kl_cuda_chunk_dh(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int64_t row0,
                                int rows, const void *ds, float *dh);
tkd_status tkd_kl_cuda_chunk_dw(tkd_kl_cuda_ws *ws, const tkd_kl_cuda_batch *b, int64_t row0,
                                int rows, const void *ds, float *dw, int accumulate);

#ifdef __cplusplus
}
#endif

#endif /* TKD_KL_LOSS_CUDA_INTERNAL_H */
