/* test_hooks.h — fault injection for the child-process tests, compiled only into test builds.
 *
 * CMake builds each tool twice from the same sources (tkd_tool in CMakeLists.txt): the shipped
 * binary (teacher-dump) and a test build (teacher-dump-testhooks, and the tool libraries the unit
 * tests link) with TKD_TEST_HOOKS defined. Code that injects a fault (a SIGKILL at a chosen point, a
 * signal after N batches) sits inside `#ifdef TKD_TEST_HOOKS`, so the shipped binaries hold neither
 * that code nor the names of its environment variables (tests/test_shipped_binaries.c checks).
 */
#ifndef TKD_TEST_HOOKS_H
#define TKD_TEST_HOOKS_H

#ifdef TKD_TEST_HOOKS
#include <stdlib.h>

/* The environment variable `name` as a number; 0 (the hook is off) when it is unset. */
static inline long tkd_test_hook_env(const char *name)
{
    const char *v = getenv(name);
    return v ? strtol(v, NULL, 10) : 0;
}
#endif

#endif /* TKD_TEST_HOOKS_H */
