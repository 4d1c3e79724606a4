/* testutil.c — see testutil.h. */
#include "tests/testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"

char *tkd_test_mkdtemp(const char *tag)
{
    const char *base = getenv("TMPDIR");
    char *path = malloc(4096);
    if (!path)
        abort();
    snprintf(path, 4096, "%s/topkd-%s-XXXXXX", base && *base ? base : "/tmp", tag);
    if (!mkdtemp(path)) {
        perror(path);
        abort();
    }
    return path;
}

int tkd_test_rmtree(const char *path)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    return system(cmd);
}

const char *tkd_test_src(const char *rel)
{
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/tests/%s", TKD_SOURCE_DIR, rel);
    return buf;
}

void tkd_test_require_gpu(void)
{
    if (tkd_backend_cuda_devices() == 0) {
        printf("skipped: no CUDA device answers on this machine\n");
        exit(77);
    }
}

int tkd_test_close(double a, double b, double atol, double rtol)
{
    return fabs(a - b) <= atol + rtol * fabs(b);
}

void tkd_test_randn(float *x, size_t n, uint64_t seed, float std)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        double u[2];
        for (int j = 0; j < 2; j++) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17; /* xorshift64 */
            u[j] = ((s >> 11) + 0.5) * (1.0 / 9007199254740992.0);
        }
        x[i] = (float)(std * sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]));
    }
}
