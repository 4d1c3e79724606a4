/* cuda_mem.cu — see cuda_mem.h. */
#include "kernels/cuda/cuda_mem.h"

#include <algorithm>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace {

/* tkd_cuda_mem_ledger's state: per name its use, per live pointer its size and name. Allocation
 * happens when workspaces are made, never in a hot loop, so a mutex and maps are cheap enough. */
struct Ledger {
    std::mutex mu;
    std::deque<std::string> names; /* a deque: push_back never moves the strings (c_str stays valid) */
    std::vector<tkd_cuda_mem_use> use;
    std::unordered_map<std::string, int> index;
    std::unordered_map<void *, std::pair<size_t, int>> live;
};

Ledger &ledger()
{
    static Ledger *l = new Ledger; /* never destroyed: frees may come from static teardown */
    return *l;
}

void ledger_add(void *p, size_t bytes, const char *what)
{
    Ledger &l = ledger();
    std::lock_guard<std::mutex> g(l.mu);
    const std::string name = what ? what : "(unnamed)";
    auto it = l.index.find(name);
    int i;
    if (it == l.index.end()) {
        i = (int)l.use.size();
        l.index.emplace(name, i);
        l.names.push_back(name);
        l.use.push_back(tkd_cuda_mem_use{nullptr, 0, 0, 0});
    } else {
        i = it->second;
    }
    tkd_cuda_mem_use &u = l.use[(size_t)i];
    u.live += bytes;
    u.peak = std::max(u.peak, u.live);
    u.count++;
    l.live[p] = {bytes, i};
}

void ledger_remove(void *p)
{
    Ledger &l = ledger();
    std::lock_guard<std::mutex> g(l.mu);
    auto it = l.live.find(p);
    if (it == l.live.end())
        return;
    tkd_cuda_mem_use &u = l.use[(size_t)it->second.second];
    u.live -= it->second.first;
    u.count--;
    l.live.erase(it);
}

} // namespace

extern "C" tkd_status tkd_cuda_malloc(void **out, size_t bytes, const char *what, const char *hint)
{
    *out = NULL;
    cudaError_t e = cudaMalloc(out, bytes ? bytes : 1);
    if (e == cudaSuccess) {
        ledger_add(*out, bytes, what);
        return TKD_OK;
    }
    *out = NULL;
    (void)cudaGetLastError();
    if (e != cudaErrorMemoryAllocation)
        return tkd_error_set(TKD_ERR_DEVICE, "%s: cudaMalloc of %.1f MiB failed: %s", what,
                             bytes / 1048576.0, cudaGetErrorString(e));
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    tkd_error_set(TKD_ERR_DEVICE_OOM, "%s: out of device memory asking for %.1f MiB (%.1f of %.1f GiB free)",
                  what, bytes / 1048576.0, free_b / 1073741824.0, total_b / 1073741824.0);
    return hint ? tkd_error_hint(TKD_ERR_DEVICE_OOM, "%s", hint) : TKD_ERR_DEVICE_OOM;
}

extern "C" tkd_status tkd_cuda_malloc_host(void **out, size_t bytes, const char *what)
{
    *out = NULL;
    cudaError_t e = cudaMallocHost(out, bytes ? bytes : 1);
    if (e == cudaSuccess)
        return TKD_OK;
    *out = NULL;
    (void)cudaGetLastError();
    return tkd_error_set(e == cudaErrorMemoryAllocation ? TKD_ERR_NOMEM : TKD_ERR_DEVICE,
                         "%s: pinned host allocation of %.1f MiB failed: %s", what, bytes / 1048576.0,
                         cudaGetErrorString(e));
}

extern "C" void tkd_cuda_free(void *p)
{
    if (!p)
        return;
    ledger_remove(p);
    (void)cudaFree(p);
}

extern "C" void tkd_cuda_free_host(void *p)
{
    if (p)
        (void)cudaFreeHost(p);
}

extern "C" tkd_status tkd_cuda_to_device(void *dst, const void *src, size_t bytes)
{
    TKD_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_to_host(void *dst, const void *src, size_t bytes)
{
    TKD_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_memzero(void *p, size_t bytes)
{
    TKD_CUDA_CHECK(cudaMemset(p, 0, bytes));
    return TKD_OK;
}

extern "C" tkd_status tkd_cuda_mem_info(size_t *free_bytes, size_t *total_bytes)
{
    TKD_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
    return TKD_OK;
}

extern "C" int tkd_cuda_mem_ledger(tkd_cuda_mem_use *out, int cap)
{
    Ledger &l = ledger();
    std::lock_guard<std::mutex> g(l.mu);
    std::vector<tkd_cuda_mem_use> v = l.use;
    for (size_t i = 0; i < v.size(); i++)
        v[i].what = l.names[i].c_str();
    std::stable_sort(v.begin(), v.end(), [](const tkd_cuda_mem_use &a, const tkd_cuda_mem_use &b) {
        return a.live > b.live;
    });
    for (int i = 0; i < cap && i < (int)v.size(); i++)
        out[i] = v[(size_t)i];
    return (int)v.size();
}

extern "C" size_t tkd_cuda_mem_live(void)
{
    Ledger &l = ledger();
    std::lock_guard<std::mutex> g(l.mu);
    size_t n = 0;
    for (const tkd_cuda_mem_use &u : l.use)
        n += u.live;
    return n;
}
