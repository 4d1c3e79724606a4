/* cuda_policy.c — see cuda_policy.h. One table row per knob: its variable, the words of its values
 * (indexed by the field's value), its default and the field it sets. */
#include "kernels/cuda/cuda_policy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const kSwitch[] = {"off", "on", NULL};
static const char *const kAttnBwd[] = {"wgmma", "cudnn", "flash", NULL};
static const char *const kKlGrad[] = {"auto", "cublas", "dh", "dw", "both", NULL};
static const char *const kSched[] = {"pingpong", "coop", NULL};
static const char *const kMoeGemm[] = {"auto", "grouped", "loop", "ours", NULL};
static const char *const kMoeMx[] = {"gemm", "layer", NULL};

typedef struct knob {
    tkd_cuda_knob_info info;
    const char *const *words; /* words[v] names value v */
    int def;
    size_t off;               /* of the int field in tkd_cuda_policy */
} knob;

#define FIELD(f) offsetof(tkd_cuda_policy, f)
static const knob kKnobs[] = {
    {{"TKD_ATTN_BWD", "wgmma|cudnn|flash",
      "the attention backward tried first: our Hopper wgmma kernel, cuDNN's, or only our flash kernel", false},
     kAttnBwd, TKD_POLICY_ATTN_BWD_WGMMA, FIELD(attn_bwd)},
    {{"TKD_CUDNN", "on|off", "cuDNN's fused attention where it takes the shape; off: our kernels alone", false},
     kSwitch, 1, FIELD(cudnn)},
    {{"TKD_CUDNN_BWD_NONDET", "off|on",
      "let cuDNN's attention backward take non-deterministic engines (to measure what determinism costs); "
      "on: runs are no longer bit-identical, resume included", true},
     kSwitch, 0, FIELD(cudnn_bwd_nondet)},
    {{"TKD_KL_SM90", "on|off", "the loss's logits GEMM on our Hopper kernel where it runs; off: cuBLAS", false},
     kSwitch, 1, FIELD(kl_sm90)},
    {{"TKD_KL_FUSED", "on|off", "the fused loss path (bf16 dS from the logits GEMM's epilogue); off: the split path",
      false},
     kSwitch, 1, FIELD(kl_fused)},
    {{"TKD_KL_GRAD_SM90", "auto|cublas|dh|dw|both",
      "which loss gradient GEMMs run on our Hopper kernels; auto: dH where D % 256 == 0, dW on cuBLAS", false},
     kKlGrad, TKD_POLICY_KL_GRAD_AUTO, FIELD(kl_grad)},
    {{"TKD_TOPK_FUSED", "off|on",
      "the teacher's top-k in our Hopper GEMM's epilogue (no fp32 logits; slower today, no tail draws)", false},
     kSwitch, 0, FIELD(topk_fused)},
    {{"TKD_LMHEAD_SM90_SCHED", "pingpong|coop", "the persistent schedule of our Hopper LM-head GEMM", false},
     kSched, TKD_POLICY_LMHEAD_SCHED_PINGPONG, FIELD(lmhead_sched)},
    {{"TKD_MOE_GEMM", "auto|grouped|loop|ours",
      "the MoE experts' GEMMs: ours (our grouped GEMM), two grouped cuBLAS calls a layer, or one GEMM per expert "
      "and projection; auto: ours on Hopper, else grouped where the experts' products are small", false},
     kMoeGemm, TKD_POLICY_MOE_GEMM_AUTO, FIELD(moe_gemm)},
    {{"TKD_MOE_MXFP4", "gemm|layer",
      "MXFP4 experts: decoded inside our Hopper GEMM where it runs, or a layer at a time into a bf16 copy "
      "(layer: every other way's, 6 bytes a weight of one layer more memory)", false},
     kMoeMx, TKD_POLICY_MOE_MXFP4_GEMM, FIELD(moe_mxfp4)},
};
#undef FIELD
enum { kNumKnobs = (int)(sizeof kKnobs / sizeof kKnobs[0]) };

/* Retired spellings: refused, naming what replaced them, so an old script does not silently lose
 * its choice. */
static const struct {
    const char *name, *instead;
} kRetired[] = {
    {"TKD_NO_CUDNN", "TKD_CUDNN=off"},
    {"TKD_CUDNN_BWD", "TKD_ATTN_BWD=flash (for TKD_CUDNN_BWD=0) or TKD_ATTN_BWD=cudnn"},
};

static int nwords(const knob *k)
{
    int n = 0;
    while (k->words[n])
        n++;
    return n;
}

static int *field(tkd_cuda_policy *p, const knob *k) { return (int *)((char *)p + k->off); }
static int cfield(const tkd_cuda_policy *p, const knob *k) { return *(const int *)((const char *)p + k->off); }

tkd_cuda_policy tkd_cuda_policy_default(void)
{
    tkd_cuda_policy p;
    memset(&p, 0, sizeof p);
    for (int i = 0; i < kNumKnobs; i++)
        *field(&p, &kKnobs[i]) = kKnobs[i].def;
    return p;
}

/* The value index of word for knob k, or -1. Switches also take 1 and 0. */
static int parse_word(const knob *k, const char *word)
{
    for (int v = 0; k->words[v]; v++)
        if (strcmp(word, k->words[v]) == 0)
            return v;
    if (k->words == kSwitch && (!strcmp(word, "1") || !strcmp(word, "0")))
        return word[0] == '1';
    return -1;
}

static const char *plain_getenv(const char *name) { return getenv(name); }

tkd_status tkd_cuda_policy_from_env(tkd_cuda_policy *out, const char *(*get)(const char *name))
{
    if (!get)
        get = plain_getenv;
    *out = tkd_cuda_policy_default();
    for (size_t i = 0; i < sizeof kRetired / sizeof kRetired[0]; i++)
        if (get(kRetired[i].name))
            return tkd_error_set(TKD_ERR_CONFIG, "%s is no longer read: use %s", kRetired[i].name,
                                 kRetired[i].instead);
    for (int i = 0; i < kNumKnobs; i++) {
        const knob *k = &kKnobs[i];
        const char *v = get(k->info.name);
        if (!v || !*v)
            continue;
        int x = parse_word(k, v);
        if (x < 0)
            return tkd_error_set(TKD_ERR_CONFIG, "%s=%s: expected one of %s%s (%s)", k->info.name, v, k->info.values,
                                 k->words == kSwitch ? " (or 1|0)" : "", k->info.help);
        *field(out, k) = x;
    }
    return TKD_OK;
}

int tkd_cuda_policy_format(const tkd_cuda_policy *p, char *buf, size_t cap)
{
    size_t n = 0;
    if (cap)
        buf[0] = '\0';
    for (int i = 0; i < kNumKnobs; i++) {
        const knob *k = &kKnobs[i];
        int v = cfield(p, k);
        int w = snprintf(n < cap ? buf + n : NULL, n < cap ? cap - n : 0, "%s%s=%s", i ? " " : "", k->info.name,
                         v >= 0 && v < nwords(k) ? k->words[v] : "?");
        n += w > 0 ? (size_t)w : 0;
    }
    return (int)n;
}

tkd_status tkd_cuda_policy_append_note(const tkd_cuda_policy *p, char **text)
{
    static const char head[] = "# CUDA kernel choices (docs/config.md): ";
    const size_t had = *text ? strlen(*text) : 0, n = (size_t)tkd_cuda_policy_format(p, NULL, 0);
    const bool nl = had > 0 && (*text)[had - 1] != '\n';
    char *s = malloc(had + nl + sizeof head + n + 1);
    if (!s)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for the CUDA policy's note");
    memcpy(s, *text ? *text : "", had);
    size_t at = had;
    if (nl)
        s[at++] = '\n';
    memcpy(s + at, head, sizeof head - 1);
    at += sizeof head - 1;
    tkd_cuda_policy_format(p, s + at, n + 1);
    memcpy(s + at + n, "\n", 2);
    free(*text);
    *text = s;
    return TKD_OK;
}

bool tkd_cuda_policy_deterministic(const tkd_cuda_policy *p, const char **why)
{
    for (int i = 0; i < kNumKnobs; i++)
        if (kKnobs[i].info.nondeterministic && cfield(p, &kKnobs[i]) != kKnobs[i].def) {
            if (why)
                *why = kKnobs[i].info.name;
            return false;
        }
    return true;
}

const tkd_cuda_knob_info *tkd_cuda_policy_knob(int i)
{
    return i >= 0 && i < kNumKnobs ? &kKnobs[i].info : NULL;
}
