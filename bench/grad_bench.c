/* grad_bench.c — the LM head's gradient GEMMs of the fused KL loss (issue 13): our Hopper kernels
 * (kernels/gemm_sm90/lmhead_grad_sm90.h: dH = sigma ⊙ (E·W) with the scaling in the epilogue, dW += Eᵀ·X
 * with the fp32 accumulation in the epilogue) against cuBLAS doing the same work (fp32 out, a
 * scaling pass for dH, beta = 1 for dW) and against cuBLAS's plain GEMMs of the same sizes with
 * bf16 out (what PyTorch's linear backward runs). Device time per call, median of --reps,
 * the kinds alternating rep by rep; TFLOP/s = 2·rows·D·V / time.
 *
 *   grad_bench [--shapes ROWSxDxV,...] [--reps N] [--sched pp|coop]
 * --sched forces our kernels' schedule for both GEMMs (default: cooperative).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

#ifdef TKD_HAVE_CUDA
#include "bench/grad_bench_cuda.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"

int main(int argc, char **argv)
{
    const char *shapes = "4096x4096x128256,2816x2048x151552,8192x2880x201088";
    int reps = 5, sched = -1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--shapes") == 0 && i + 1 < argc)
            shapes = argv[++i];
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--sched") == 0 && i + 1 < argc && !strcmp(argv[i + 1], "pp"))
            sched = TKD_LMHEAD_SM90_SCHED_PINGPONG, i++;
        else if (strcmp(argv[i], "--sched") == 0 && i + 1 < argc && !strcmp(argv[i + 1], "coop"))
            sched = TKD_LMHEAD_SM90_SCHED_COOP, i++;
        else {
            fprintf(stderr, "usage: grad_bench [--shapes ROWSxDxV,...] [--reps N] [--sched pp|coop]\n");
            return 2;
        }
    }
    if (reps < 1 || reps > 100) {
        fprintf(stderr, "grad_bench: --reps must be 1..100\n");
        return 2;
    }
    static const char *const names[GB_N] = {"ours dH", "cuBLAS dH+scale", "ours dW +=", "cuBLAS dW +=",
                                             "plain dH bf16", "plain dW bf16", "ours dW ="};
    printf("| rows x D x V | kind | ms | TFLOP/s |\n|---|---|---:|---:|\n");
    char *list = strdup(shapes);
    int rc = 0;
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        long long rows = 0;
        int d = 0, v = 0;
        if (sscanf(tok, "%lldx%dx%d", &rows, &d, &v) != 3 || rows < 1 || d < 8 || v < 1) {
            fprintf(stderr, "grad_bench: bad shape '%s' (want ROWSxDxV)\n", tok);
            rc = 2;
            break;
        }
        double ms[GB_N], rel = 0;
        tkd_status st = tkd_grad_bench_run(rows, d, v, reps, sched, ms, &rel);
        if (st != TKD_OK) {
            fprintf(stderr, "grad_bench: %s: %s\n", tok, tkd_error_msg());
            rc = 1;
            break;
        }
        const double flop = 2.0 * rows * d * v;
        for (int k = 0; k < GB_N; k++)
            printf("| %s | %s | %.3f | %.1f |\n", tok, names[k], ms[k], flop / (ms[k] * 1e-3) / 1e12);
        printf("| %s | ours vs cuBLAS, max relative norm difference | %.2e | |\n", tok, rel);
    }
    free(list);
    return rc;
}
#else
int main(void)
{
    fprintf(stderr, "grad_bench: built without CUDA\n");
    return 77;
}
#endif
