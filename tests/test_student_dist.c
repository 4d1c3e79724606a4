/* test_student_dist.c — student-train's CPU side of data-parallel training: the dist.* config keys,
 * and checkpoints whose AdamW moments are sharded over ranks (student_train/checkpoint.h): saved by
 * 3 or 20 ranks and loaded back by 1, 2, 3, 5 or 64, bit for bit; a one-process checkpoint read by
 * several ranks; a missing shard keeps the previous checkpoint and is named when loading; bf16
 * moments (optim.state_dtype) stored as BF16 and re-sharded the same way, a dtype mismatch refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/dist.h"
#include "common/fileio.h"
#include "common/half.h"
#include "formats/safetensors.h"
#include "model/model.h"
#include "model/optim.h"
#include "student_train/checkpoint.h"
#include "student_train/train_config.h"
#include "tests/testutil.h"

/* ---- config ----------------------------------------------------------------------------------- */

static void test_dist_config_keys(void **state)
{
    (void)state;
    tkd_train_config c = {0};
    assert_int_equal(tkd_config_load(&tkd_train_schema, &c, NULL, NULL, 0), TKD_OK);
    assert_int_equal(c.dist_rendezvous, TKD_TRAIN_RDZV_AUTO);
    assert_int_equal(tkd_train_rdzv_kind(c.dist_rendezvous), -1);
    assert_string_equal(c.dist_dir, "");
    assert_true(c.dist_timeout_s == 600.0);
    tkd_config_free(&tkd_train_schema, &c);
    const char *sets[] = {"dist.rendezvous=tcp", "dist.timeout_s=30", "dist.dir=/shared/rdzv"};
    assert_int_equal(tkd_config_load(&tkd_train_schema, &c, NULL, sets, 3), TKD_OK);
    assert_int_equal(tkd_train_rdzv_kind(c.dist_rendezvous), TKD_RDZV_TCP);
    assert_true(c.dist_timeout_s == 30.0);
    assert_string_equal(c.dist_dir, "/shared/rdzv");
    tkd_config_free(&tkd_train_schema, &c);
    const char *file[] = {"dist.rendezvous=file"};
    assert_int_equal(tkd_config_load(&tkd_train_schema, &c, NULL, file, 1), TKD_OK);
    assert_int_equal(tkd_train_rdzv_kind(c.dist_rendezvous), TKD_RDZV_FILE);
    tkd_config_free(&tkd_train_schema, &c);
    const char *bad[] = {"dist.rendezvous=nfs"};
    assert_int_equal(tkd_config_load(&tkd_train_schema, &c, NULL, bad, 1), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("auto");
    tkd_config_free(&tkd_train_schema, &c);
    const char *zero[] = {"dist.timeout_s=0"};
    assert_int_equal(tkd_config_load(&tkd_train_schema, &c, NULL, zero, 1), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("dist.timeout_s");
    tkd_config_free(&tkd_train_schema, &c);
}

/* ---- sharded checkpoints ---------------------------------------------------------------------- */

typedef struct ckpt_fixture {
    char *dir;          /* temp dir; the checkpoint is <dir>/checkpoint */
    char ckpt[4200];
    tkd_model *m;       /* a tiny student (n not a multiple of 64) */
    size_t n;
    float *M, *V;       /* (n) the moments every save starts from */
    tkd_adamw_dtype dt; /* how they are kept (f32 unless a test says bf16) */
    tkd_train_state st;
} ckpt_fixture;

static int fixture_setup(void **state)
{
    ckpt_fixture *f = calloc(1, sizeof *f);
    f->dir = tkd_test_mkdtemp("student-dist");
    snprintf(f->ckpt, sizeof f->ckpt, "%s/checkpoint", f->dir);
    tkd_model_config mc;
    tkd_test_tiny_llama(&mc, 40, 8, 2, 16);
    if (tkd_model_init_random(&mc, 3, &f->m) != TKD_OK)
        return -1;
    f->n = f->m->n_params;
    f->M = malloc(f->n * sizeof(float));
    f->V = malloc(f->n * sizeof(float));
    tkd_test_randn(f->M, f->n, 11, 0.01f);
    tkd_test_randn(f->V, f->n, 12, 1e-4f);
    for (size_t i = 0; i < f->n; i++)
        f->V[i] = fabsf(f->V[i]);
    f->st = (tkd_train_state){.step = 10, .epoch = 1, .offset = 24, .tokens_seen = 4096, .rng = {{1, 2, 3, 4}}};
    *state = f;
    return 0;
}

static int fixture_teardown(void **state)
{
    ckpt_fixture *f = *state;
    tkd_model_free(f->m);
    free(f->M);
    free(f->V);
    tkd_test_rmdtemp(f->dir);
    free(f);
    return 0;
}

/* Every rank of world saves its shard of M, V at step; rank 0 commits with the given timeout. */
static tkd_status save_world(ckpt_fixture *f, const char *job, int64_t step, int world, int skip_rank, double timeout)
{
    for (int r = 0; r < world; r++) {
        size_t b, e, chunk;
        tkd_zero_range(f->n, world, r, &b, &e, &chunk);
        if (r != skip_rank)
            assert_int_equal(tkd_checkpoint_save_shard(f->ckpt, job, step, r, world, f->dt, f->n, f->M + b, f->V + b),
                             TKD_OK);
    }
    tkd_train_state st = f->st;
    st.step = step;
    return tkd_checkpoint_commit(f->ckpt, job, step, f->m, step - 3, world, f->dt, &st, "train: {}\n", timeout);
}

/* Every rank of world loads its range: the moments equal M, V there exactly, the state is step's. */
static void assert_loads_as(ckpt_fixture *f, int world, int64_t step)
{
    float *m = malloc(f->n * sizeof(float) + 4), *v = malloc(f->n * sizeof(float) + 4);
    for (int r = 0; r < world; r++) {
        size_t b, e, chunk;
        tkd_zero_range(f->n, world, r, &b, &e, &chunk);
        memset(m, 0xff, f->n * sizeof(float)); /* NaN: a moment the load does not write fails */
        memset(v, 0xff, f->n * sizeof(float));
        int64_t adamw_step = -1;
        tkd_train_state st;
        tkd_status s = tkd_checkpoint_load_shard(f->ckpt, f->m, r, world, f->dt, m, v, &adamw_step, &st);
        if (s != TKD_OK)
            fail_msg("world %d rank %d: %s", world, r, tkd_error_msg());
        assert_memory_equal(m, f->M + b, (e - b) * sizeof(float));
        assert_memory_equal(v, f->V + b, (e - b) * sizeof(float));
        assert_int_equal(st.step, step);
        assert_int_equal(adamw_step, step - 3);
        assert_int_equal(st.tokens_seen, 4096);
        assert_int_equal(st.rng.s[3], 4);
    }
    free(m);
    free(v);
}

/* Saved by 3 ranks (and by 20, some of them with an empty range): loaded by 1, 2, 3, 5 and 64
 * ranks, and by one process through tkd_checkpoint_load. */
static void test_reshard_any_world(void **state)
{
    ckpt_fixture *f = *state;
    assert_true(f->n % 64 != 0 && f->n < 64 * 20);
    assert_int_equal(save_world(f, "jobA", 10, 3, -1, 5.0), TKD_OK);
    assert_true(tkd_file_exists(tkd_test_path(f->ckpt, "optimizer-rank2-of3.safetensors")));
    assert_false(tkd_file_exists(tkd_test_path(f->ckpt, "optimizer.safetensors")));
    int worlds[] = {1, 2, 3, 5, 64};
    for (int i = 0; i < 5; i++)
        assert_loads_as(f, worlds[i], 10);

    tkd_optim_config oc;
    tkd_optim_config_defaults(&oc);
    tkd_adamw *opt = NULL;
    assert_int_equal(tkd_adamw_init(&oc, f->n, &opt), TKD_OK);
    tkd_train_state st;
    assert_int_equal(tkd_checkpoint_load(f->ckpt, f->m, opt, &st), TKD_OK);
    assert_memory_equal(opt->m, f->M, f->n * sizeof(float));
    assert_memory_equal(opt->v, f->V, f->n * sizeof(float));
    assert_int_equal(opt->step, 7);

    assert_int_equal(save_world(f, "jobA", 20, 20, -1, 5.0), TKD_OK);
    for (int i = 0; i < 5; i++)
        assert_loads_as(f, worlds[i], 20);

    /* a one-process checkpoint (optimizer.safetensors) is world 1 to any number of ranks */
    memcpy(opt->m, f->M, f->n * sizeof(float));
    memcpy(opt->v, f->V, f->n * sizeof(float));
    opt->step = 27;
    tkd_train_state one = f->st;
    one.step = 30;
    assert_int_equal(tkd_checkpoint_save(f->ckpt, f->m, opt, &one, NULL), TKD_OK);
    for (int i = 0; i < 5; i++)
        assert_loads_as(f, worlds[i], 30);
    tkd_adamw_free(opt);
}

/* Rank 1 never writes its shard: the commit times out naming it, the step-10 checkpoint stays the
 * valid one and no staging directory is left; a checkpoint that lost a shard names it on load. */
static void test_missing_shard(void **state)
{
    ckpt_fixture *f = *state;
    assert_int_equal(save_world(f, "jobB", 10, 3, -1, 5.0), TKD_OK);
    /* a crashed job's staging directory (its marker in it), removed by the next good commit; a
     * user's directory of such a name (no marker) is not */
    char stale[4400], mine[4400];
    snprintf(stale, sizeof stale, "%s.building-jobOld-10", f->ckpt);
    snprintf(mine, sizeof mine, "%s.building-mine", f->ckpt);
    assert_int_equal(tkd_built_dir_make(&tkd_checkpoint_kind, stale), TKD_OK);
    assert_int_equal(tkd_mkdir_p(mine), TKD_OK);
    assert_int_equal(save_world(f, "jobB", 12, 3, -1, 5.0), TKD_OK);
    assert_false(tkd_file_exists(stale));
    assert_true(tkd_file_exists(mine));
    assert_int_equal(rmdir(mine), 0);

    assert_int_equal(save_world(f, "jobB", 14, 3, 1, 0.3), TKD_ERR_IO);
    tkd_test_assert_msg_has("(the previous checkpoint is kept)");
    tkd_test_assert_msg_has("2 of 3 optimizer shards written after 0 s; missing: optimizer-rank1-of3.safetensors");
    snprintf(stale, sizeof stale, "%s.building-jobB-14", f->ckpt);
    assert_false(tkd_file_exists(stale));
    assert_loads_as(f, 2, 12);

    /* the shard of another job's staging is never taken: jobC waits for its own */
    size_t b, e, chunk;
    tkd_zero_range(f->n, 2, 1, &b, &e, &chunk);
    assert_int_equal(tkd_checkpoint_save_shard(f->ckpt, "jobD", 16, 1, 2, f->dt, f->n, f->M + b, f->V + b), TKD_OK);
    assert_int_equal(save_world(f, "jobC", 16, 2, 1, 0.3), TKD_ERR_IO);
    tkd_test_assert_msg_has("missing: optimizer-rank1-of2.safetensors");

    assert_int_equal(unlink(tkd_test_path(f->ckpt, "optimizer-rank1-of3.safetensors")), 0);
    float *m = malloc(f->n * sizeof(float)), *v = malloc(f->n * sizeof(float));
    int64_t as;
    tkd_train_state st;
    assert_int_equal(tkd_checkpoint_load_shard(f->ckpt, f->m, 0, 1, f->dt, m, v, &as, &st), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("optimizer-rank1-of3.safetensors: missing");
    /* a rank whose new range lies within the shards still there loads fine */
    assert_int_equal(tkd_checkpoint_load_shard(f->ckpt, f->m, 0, 3, f->dt, m, v, &as, &st), TKD_OK);
    free(m);
    free(v);
}

/* optim.state_dtype bf16: the shards are BF16 safetensors (half the bytes) and re-shard bit for
 * bit like F32 ones (M, V made bf16 values first: the moments of a bf16 run are); a one-process
 * bf16 checkpoint loads into a bf16 optimizer exactly; an f32 run refuses a bf16 checkpoint, naming
 * it and both dtypes, and a bf16 run an f32 one. */
static void test_reshard_bf16(void **state)
{
    ckpt_fixture *f = *state;
    f->dt = TKD_ADAMW_DTYPE_BF16;
    for (size_t i = 0; i < f->n; i++) {
        f->M[i] = tkd_bf16_to_f32(tkd_f32_to_bf16(f->M[i]));
        f->V[i] = tkd_bf16_to_f32(tkd_f32_to_bf16(f->V[i]));
    }
    assert_int_equal(save_world(f, "jobE", 10, 3, -1, 5.0), TKD_OK);
    tkd_st_dir *d = NULL;
    assert_int_equal(tkd_st_open(tkd_test_path(f->ckpt, "optimizer-rank1-of3.safetensors"), &d), TKD_OK);
    const tkd_st_tensor *t = tkd_st_find(d, "adamw.v");
    assert_non_null(t);
    assert_int_equal(t->dtype, TKD_DTYPE_BF16);
    tkd_st_close(d);
    int worlds[] = {1, 2, 5};
    for (int i = 0; i < 3; i++)
        assert_loads_as(f, worlds[i], 10);

    tkd_optim_config oc;
    tkd_optim_config_defaults(&oc);
    oc.state_dtype = TKD_ADAMW_DTYPE_BF16;
    tkd_adamw *opt = NULL;
    assert_int_equal(tkd_adamw_init(&oc, f->n, &opt), TKD_OK);
    assert_null(opt->m);
    tkd_train_state st;
    assert_int_equal(tkd_checkpoint_load(f->ckpt, f->m, opt, &st), TKD_OK);
    float *m = malloc(f->n * sizeof(float)), *v = malloc(f->n * sizeof(float));
    assert_int_equal(tkd_adamw_moments_get(opt, m, v), TKD_OK);
    assert_memory_equal(m, f->M, f->n * sizeof(float));
    assert_memory_equal(v, f->V, f->n * sizeof(float));
    tkd_train_state one = f->st;
    one.step = 30;
    opt->step = 27;
    assert_int_equal(tkd_checkpoint_save(f->ckpt, f->m, opt, &one, NULL), TKD_OK);
    for (int i = 0; i < 3; i++)
        assert_loads_as(f, worlds[i], 30);

    int64_t as;
    assert_int_equal(tkd_checkpoint_load_shard(f->ckpt, f->m, 0, 2, TKD_ADAMW_DTYPE_F32, m, v, &as, &st),
                     TKD_ERR_CONFIG);
    tkd_test_assert_msg_has(f->ckpt);
    tkd_test_assert_msg_has("keeps the AdamW moments as bf16, but optim.state_dtype is f32");
    tkd_adamw_free(opt);
    oc.state_dtype = TKD_ADAMW_DTYPE_F32;
    assert_int_equal(tkd_adamw_init(&oc, f->n, &opt), TKD_OK);
    assert_int_equal(tkd_checkpoint_load(f->ckpt, f->m, opt, &st), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("resume with optim.state_dtype: bf16");
    assert_int_equal(tkd_checkpoint_save(f->ckpt, f->m, opt, &one, NULL), TKD_OK); /* an f32 checkpoint */
    assert_int_equal(tkd_checkpoint_load_shard(f->ckpt, f->m, 0, 2, TKD_ADAMW_DTYPE_BF16, m, v, &as, &st),
                     TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("keeps the AdamW moments as f32, but optim.state_dtype is bf16");
    tkd_adamw_free(opt);
    free(m);
    free(v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dist_config_keys),
        cmocka_unit_test_setup_teardown(test_reshard_any_world, fixture_setup, fixture_teardown),
        cmocka_unit_test_setup_teardown(test_missing_shard, fixture_setup, fixture_teardown),
        cmocka_unit_test_setup_teardown(test_reshard_bf16, fixture_setup, fixture_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
