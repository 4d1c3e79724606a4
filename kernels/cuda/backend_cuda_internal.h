/* backend_cuda_internal.h — what the CUDA backend's two files share, and nothing else includes:
 * backend_cuda.cu (the op table, memory, the decoder ops, the optimizer, the fused loss, timing
 * marks, opening and closing) and backend_cuda_lmhead.cu (the LM head's top-k / tail-draw consumer,
 * beside topk_cuda.cu). The backend's state (CudaImpl), its grow-to-fit scratch and the LM head's two
 * ops. C++ (CUDA) only; internal to kernels/cuda/.
 */
#ifndef TKD_BACKEND_CUDA_INTERNAL_H
#define TKD_BACKEND_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <stdint.h>

#include "kernels/attn/attn_bwd_cuda_internal.h"
#include "kernels/attn/attn_cudnn.h"
#include "kernels/backend.h"
#include "kernels/cuda/ops_bwd_cuda.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/topk_cuda.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"

namespace tkd_cub {

/* A device buffer that grows to the largest size asked and is then reused. */
struct Grow {
    void *p = nullptr;
    size_t bytes = 0;
};

/* A pinned host buffer that grows to the largest size asked and is then reused. */
struct GrowHost {
    void *p = nullptr;
    size_t bytes = 0;
};

struct CudaImpl {
    int gpu = 0;
    tkd_cuda_policy pol;           /* every kernel choice (cuda_policy.h), fixed when the backend opens */
    cudaStream_t stream = nullptr;
    cudaStream_t copy = nullptr;   /* device-to-host copies of the LM head's results, beside compute */
    cudaEvent_t chunk_done = nullptr;
    tkd_cuda_linear *lin = nullptr;
    cublasHandle_t blas = nullptr; /* the LM head's bf16 x bf16 -> fp32 logits GEMM */
    void *blas_ws = nullptr;
    tkd_topk_cuda_ws *topk = nullptr;
    tkd_cudnn_attn *cudnn = nullptr;  /* cuDNN's fused attention; NULL where cuDNN is absent */
    tkd_cuda_attn_bwd_ws *attn_bwd_ws = nullptr; /* the flash backward's, sized for attn_bwd_rows */
    int64_t attn_bwd_rows = 0;
    int attn_bwd_dh = 0;
    float *stage = nullptr;        // (kStageFloats) fp32 staging of upload_f32 / download_f32
    Grow logits, idx, val, lse, tail, seq, pos;
    tkd_lmhead_sm90_ws *lm = nullptr; /* our sm90 GEMM for the LM head's top-k, made at first use */
    int lm_tried = 0;
    Grow lm_scratch, lm_flags;        /* its candidates and statistics; its failure flags */
    GrowHost h_idx, h_val, h_lse, h_tail; /* pinned staging the copy stream writes into */
    tkd_cuda_bwd_ws *bwd = nullptr; /* backward workspace for up to bwd_rows rows of width bwd_d */
    int bwd_rows = 0, bwd_d = 0;
    Grow attn_delta;               // (B, H, T) f32: attention backward's δ
    Grow sinks32;                  // (H) f32: attn_fwd's bf16 sinks converted for the masked kernels
    double *norm2 = nullptr;       // (1) device: the gradient norm's sum of squares
    double *h_norm2 = nullptr;     // (1) pinned: its copy
    unsigned *h_wait_err = nullptr; // (1) pinned: the wgmma attention backward's wait flag, read with the norm
    cudaEvent_t *marks = nullptr;  // (marks_n) timing marks (backend.h's mark), made at first use
    int64_t marks_n = 0;
};

inline CudaImpl *impl(tkd_backend *be) { return static_cast<CudaImpl *>(be->impl); }
inline cudaStream_t stream_of(tkd_backend *be) { return impl(be)->stream; }

/* Grow g (or the pinned h) to at least bytes, keeping what it holds when it is large enough. */
tkd_status grow(Grow *g, size_t bytes, const char *what, const char *hint);
tkd_status grow_host(GrowHost *g, size_t bytes, const char *what);

/* The LM head's ops (backend_cuda_lmhead.cu): chunk rows for a vocabulary of v, and the top-k /
 * tail-draw consumer. */
int cu_lmhead_chunk_rows(const tkd_backend *be, int64_t v);
tkd_status cu_lmhead_topk(tkd_backend *be, tkd_lmhead_topk_args *a);

} // namespace tkd_cub

#endif
