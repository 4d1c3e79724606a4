/* comm_none.c — comm_nccl.h in builds without NCCL: a single process never opens a communicator,
 * and asking for one says why there is none. */
#ifndef TKD_HAVE_NCCL
#include "kernels/comm/comm_nccl.h"

static tkd_status no_nccl(void)
{
    return tkd_error_set(TKD_ERR_UNSUPPORTED, "NCCL: this build has no NCCL (it needs the CUDA backend and "
                         "libnccl when it is built) — run one process, or rebuild with CUDA and NCCL");
}

int tkd_comm_built(void) { return 0; }
tkd_status tkd_comm_make_id(tkd_comm_id *id) { (void)id; return no_nccl(); }

tkd_status tkd_comm_init(const tkd_comm_id *id, const tkd_comm_opts *opts, tkd_backend *be, tkd_comm **out)
{
    (void)id, (void)opts, (void)be;
    *out = NULL;
    return no_nccl();
}

void tkd_comm_free(tkd_comm *c) { (void)c; }
tkd_status tkd_comm_allreduce_sum(tkd_comm *c, double *v, int n, const char *w) { (void)c, (void)v, (void)n, (void)w; return no_nccl(); }

tkd_status tkd_comm_reduce_range(tkd_comm *c, float *g, size_t b, size_t e, size_t n, size_t chunk)
{
    (void)c, (void)g, (void)b, (void)e, (void)n, (void)chunk;
    return no_nccl();
}

tkd_status tkd_comm_gather_shards(tkd_comm *c, const void *src, void *buf, size_t es, size_t n, size_t chunk,
                                  const char *w)
{
    (void)c, (void)src, (void)buf, (void)es, (void)n, (void)chunk, (void)w;
    return no_nccl();
}

tkd_status tkd_comm_wait(tkd_comm *c, const char *w) { (void)c, (void)w; return no_nccl(); }
tkd_status tkd_comm_barrier(tkd_comm *c, const char *w) { (void)c, (void)w; return no_nccl(); }
#endif /* !TKD_HAVE_NCCL */
