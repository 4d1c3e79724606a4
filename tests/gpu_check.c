/* gpu_check.c — see gpu_check.h. */
#include "tests/gpu_check.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>

#include "common/half.h"

void tkd_test_check_begin(tkd_test_check *k, const char *what, tkd_test_tol tol, tkd_test_where_fn where,
                          const void *ctx)
{
    *k = (tkd_test_check){.what = what, .tol = tol, .where = where ? where : tkd_test_where_index, .ctx = ctx,
                          .worst = -1.0, .worst_i = -1};
}

double tkd_test_check_add(tkd_test_check *k, int64_t i, double got, double ref, double extra)
{
    const double d = fabs(got - ref), allowed = k->tol.abs + k->tol.rel * fabs(ref) + extra;
    /* a zero allowance (bit-exact outputs) gives 0 when equal, infinity when not */
    const double ratio = allowed > 0 ? d / allowed : (d == 0 ? 0.0 : (isnan(d) ? NAN : INFINITY));
    k->n++;
    if (!(d <= allowed)) /* NaN and ±inf outputs fail here */
        k->bad++;
    if (isfinite(d))
        k->num += d * d, k->den += ref * ref;
    if (!isnan(k->worst) && !(ratio <= k->worst)) { /* the first NaN stays the worst */
        k->worst = ratio, k->worst_i = i;
        k->worst_got = got, k->worst_ref = ref, k->worst_allowed = allowed;
    }
    return ratio;
}

double tkd_test_check_norm(const tkd_test_check *k)
{
    if (k->num == 0)
        return 0.0;
    return sqrt(k->num / (k->den > 0 ? k->den : 1.0));
}

void tkd_test_check_describe(const tkd_test_check *k, char *buf, size_t cap)
{
    char where[160] = "-";
    if (k->worst_i >= 0)
        k->where(where, sizeof where, k->worst_i, k->ctx);
    snprintf(buf, cap,
             "%s: %lld of %lld elements off (tolerance %g + %g·|ref|: %s); worst %s: got %.9g ref %.9g |d| %.3g "
             "allowed %.3g (%.3f of it)",
             k->what, (long long)k->bad, (long long)k->n, k->tol.abs, k->tol.rel, k->tol.why ? k->tol.why : "-",
             where, k->worst_got, k->worst_ref, fabs(k->worst_got - k->worst_ref), k->worst_allowed, k->worst);
}

void tkd_test_check_end(const tkd_test_check *k)
{
    char msg[1024];
    if (k->n == 0)
        fail_msg("%s: no element was checked", k->what);
    if (k->bad == 0)
        return;
    tkd_test_check_describe(k, msg, sizeof msg);
    fail_msg("%s", msg);
}

/* Element i of an output array of one element type, as a double. */
typedef double (*elem_fn)(const void *got, size_t i);

static double elem_bf16(const void *got, size_t i) { return tkd_bf16_to_f32(((const uint16_t *)got)[i]); }
static double elem_f32(const void *got, size_t i) { return ((const float *)got)[i]; }
static double elem_f64(const void *got, size_t i) { return ((const double *)got)[i]; }

static void check_array(const char *what, const void *got, elem_fn elem, const double *ref, size_t n,
                        tkd_test_tol tol, const double *extra, tkd_test_where_fn where, const void *ctx)
{
    tkd_test_check k;
    tkd_test_check_begin(&k, what, tol, where, ctx);
    for (size_t i = 0; i < n; i++)
        tkd_test_check_add(&k, (int64_t)i, elem(got, i), ref[i], extra ? extra[i] : 0.0);
    tkd_test_check_end(&k);
}

void tkd_test_check_bf16(const char *what, const uint16_t *got, const double *ref, size_t n, tkd_test_tol tol,
                         const double *extra, tkd_test_where_fn where, const void *ctx)
{
    check_array(what, got, elem_bf16, ref, n, tol, extra, where, ctx);
}

void tkd_test_check_f32(const char *what, const float *got, const double *ref, size_t n, tkd_test_tol tol,
                        const double *extra, tkd_test_where_fn where, const void *ctx)
{
    check_array(what, got, elem_f32, ref, n, tol, extra, where, ctx);
}

void tkd_test_check_f64(const char *what, const double *got, const double *ref, size_t n, tkd_test_tol tol,
                        const double *extra, tkd_test_where_fn where, const void *ctx)
{
    check_array(what, got, elem_f64, ref, n, tol, extra, where, ctx);
}

void tkd_test_check_bf16_mat(const char *what, const uint16_t *got, const double *ref, size_t n, size_t cols,
                             tkd_test_tol tol, const double *extra)
{
    check_array(what, got, elem_bf16, ref, n, tol, extra, tkd_test_where_rowcol, &cols);
}

void tkd_test_check_f32_mat(const char *what, const float *got, const double *ref, size_t n, size_t cols,
                            tkd_test_tol tol, const double *extra)
{
    check_array(what, got, elem_f32, ref, n, tol, extra, tkd_test_where_rowcol, &cols);
}

void tkd_test_where_rowcol(char *buf, size_t cap, int64_t i, const void *cols)
{
    const int64_t c = (int64_t)*(const size_t *)cols;
    snprintf(buf, cap, "[row %lld, col %lld]", (long long)(i / c), (long long)(i % c));
}

void tkd_test_where_index(char *buf, size_t cap, int64_t i, const void *unused)
{
    (void)unused;
    snprintf(buf, cap, "[%lld]", (long long)i);
}

void tkd_test_where_step(char *buf, size_t cap, int64_t i, const void *unused)
{
    (void)unused;
    snprintf(buf, cap, "step %lld", (long long)i + 1);
}
