#!/usr/bin/env python3
"""moe_reference.py — transformers' own MoE layers on fixed random weights, written as fixtures for
test_moe's `fixtures` group (ctest test_moe_transformers, kernels/cpu/cpu_moe.h).

Needs torch + transformers 5.x (CPU torch is enough; no network):

    python3 tests/moe_reference.py                 # writes tests/fixtures/moe/
    python3 tests/moe_reference.py --out DIR

Builds tiny Qwen3MoeSparseMoeBlock and GptOssMLP modules from transformers, fills every parameter
from a seeded generator (router biases and expert biases away from zero; gpt-oss's gate/up weights
large enough that many gates and ups pass ±swiglu_limit), runs them in fp32 on the CPU on a fixed
random input, and writes, per family, under --out/<family>/ (raw little-endian, no header):

  meta.txt               "key value" lines: N D I E k, norm_topk_prob (Qwen3) or limit / alpha
                         (gpt-oss), seed, versions, torch.topk's answer on tied rows (for the record)
  x.f32                  (N, D) input
  router_w.f32           (E, D) router weight; router_b.f32 (E) for gpt-oss
  Qwen3:   w_gate.f32, w_up.f32 (E, I, D), w_down.f32 (E, D, I) — the op's layout, cut out of
           transformers 5's fused gate_up_proj (E, 2I, D) = [gate; up] and down_proj (E, D, I)
  gpt-oss: gate_up_proj.f32 (E, D, 2I) INTERLEAVED, gate_up_proj_bias.f32 (E, 2I),
           down_proj.f32 (E, I, D), down_proj_bias.f32 (E, D) — transformers' own layout, so the
           test also checks tkd_moe_from_gpt_oss against it
  y.f32                  (N, D) the module's output
  experts.i32, weights.f32  (N, k) the router's choice (torch.topk order) and its weights

A seed is skipped when some token's k-th and (k+1)-th router scores lie within 1e-4 of each other,
so fp32 rounding cannot change the choice between transformers and the C paths.
"""
import argparse
import os
import sys

import torch

B, T = 2, 23  # N = 46 tokens: not a multiple of anything the kernels tile by
FAMILIES = {
    "qwen3":        dict(D=64, I=40, E=8, k=3, norm_topk_prob=True),
    "qwen3_nonorm": dict(D=33, I=21, E=6, k=2, norm_topk_prob=False),
    "gpt_oss":      dict(D=64, I=48, E=8, k=4, swiglu_limit=7.0),
}
MARGIN = 1e-4


def make_module(family, p):
    if family.startswith("qwen3"):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        cfg = Qwen3MoeConfig(hidden_size=p["D"], moe_intermediate_size=p["I"], num_experts=p["E"],
                             num_experts_per_tok=p["k"], norm_topk_prob=p["norm_topk_prob"],
                             hidden_act="silu", intermediate_size=96, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64)
        cls = Qwen3MoeSparseMoeBlock
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
        cfg = GptOssConfig(hidden_size=p["D"], intermediate_size=p["I"], num_local_experts=p["E"],
                           num_experts_per_tok=p["k"], swiglu_limit=p["swiglu_limit"],
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, vocab_size=64)
        cls = GptOssMLP
    try:  # the plain per-expert loop, not a grouped-GEMM kernel: same maths, fewer surprises
        cfg._experts_implementation = "eager"
    except Exception:
        pass
    return cls(cfg).float().eval()


def weight_std(family, name, p):
    """Standard deviation of each parameter, by the end of its name."""
    D, I = p["D"], p["I"]
    if name.endswith("router.bias"):
        return 1.0
    if name.endswith("_bias"):
        return 0.5
    if name.endswith("gate.weight") or name.endswith("router.weight"):
        return 2.0 / D ** 0.5
    if "down" in name:
        return 1.0 / I ** 0.5
    # gate/up: gpt-oss's large enough that |gate|, |up| often pass the limit (std ~ 8 for x ~ N(0,1))
    return 1.0 if family == "gpt_oss" else 1.0 / D ** 0.5


def routing_margin_ok(family, x, rw, rb, k):
    """Every token's k-th and (k+1)-th scores (what torch.topk ranks) differ by > MARGIN."""
    lg = x.double() @ rw.double().T + (rb.double() if rb is not None else 0)
    sc = torch.softmax(lg, dim=-1) if family.startswith("qwen3") else lg
    if k == sc.shape[1]:
        return True
    top = torch.topk(sc, k + 1, dim=-1).values
    return bool((top[:, k - 1] - top[:, k]).min() > MARGIN)


def router_of(family, mod):
    return mod.gate if family.startswith("qwen3") else mod.router


def expert_tensors(family, mod, p):
    """The expert tensors to write, name -> tensor."""
    ex, E, I = mod.experts, p["E"], p["I"]
    if family == "gpt_oss":
        assert tuple(ex.gate_up_proj.shape) == (E, p["D"], 2 * I), ex.gate_up_proj.shape
        return {"gate_up_proj": ex.gate_up_proj, "gate_up_proj_bias": ex.gate_up_proj_bias,
                "down_proj": ex.down_proj, "down_proj_bias": ex.down_proj_bias}
    if hasattr(ex, "gate_up_proj"):  # transformers 5: fused (E, 2I, D) = [gate; up], chunk(2, -1)
        gu = ex.gate_up_proj
        assert tuple(gu.shape) == (E, 2 * I, p["D"]), gu.shape
        return {"w_gate": gu[:, :I], "w_up": gu[:, I:], "w_down": ex.down_proj}
    return {"w_gate": torch.stack([m.gate_proj.weight for m in ex]),  # 4.x: one module per expert
            "w_up": torch.stack([m.up_proj.weight for m in ex]),
            "w_down": torch.stack([m.down_proj.weight for m in ex])}


def tie_record():
    """torch.topk's order on tied rows (the C side puts the lower index first)."""
    rows = [torch.zeros(8), torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])]
    out = []
    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        got = [torch.topk(r.to(dev), 3).indices.tolist() for r in rows]
        out.append((dev, "|".join(",".join(str(i) for i in g) for g in got)))
    return out


def write(path, t, dtype):
    t.detach().contiguous().to(dtype).cpu().numpy().tofile(path)


def make_family(family, p, out):
    import transformers
    D, E, k = p["D"], p["E"], p["k"]
    N = B * T
    for attempt in range(100):
        seed = 1000 + attempt
        g = torch.Generator().manual_seed(seed)
        mod = make_module(family, p)
        with torch.no_grad():
            for name, prm in mod.named_parameters():
                prm.copy_(torch.randn(prm.shape, generator=g) * weight_std(family, name, p))
        x = torch.randn(B, T, D, generator=g)
        rt = router_of(family, mod)
        if routing_margin_ok(family, x.reshape(N, D), rt.weight, getattr(rt, "bias", None), k):
            break
    else:
        sys.exit(f"{family}: no seed in 100 gives a routing margin > {MARGIN}")
    with torch.no_grad():
        y = mod(x)
        y = y[0] if isinstance(y, tuple) else y
        r = rt(x.reshape(N, D))
    if not (isinstance(r, tuple) and len(r) == 3):
        sys.exit(f"{family}: the router returned {type(r)}; this script reads transformers 5's "
                 "(logits, scores (N, k), indices (N, k))")
    _, scores, idx = r
    assert tuple(idx.shape) == (N, k) and tuple(scores.shape) == (N, k), (idx.shape, scores.shape)
    d = os.path.join(out, family)
    os.makedirs(d, exist_ok=True)
    write(os.path.join(d, "x.f32"), x.reshape(N, D), torch.float32)
    write(os.path.join(d, "router_w.f32"), rt.weight, torch.float32)
    if family == "gpt_oss":
        write(os.path.join(d, "router_b.f32"), rt.bias, torch.float32)
    for name, t in expert_tensors(family, mod, p).items():
        write(os.path.join(d, name + ".f32"), t, torch.float32)
    write(os.path.join(d, "y.f32"), y.reshape(N, D), torch.float32)
    write(os.path.join(d, "experts.i32"), idx, torch.int32)
    write(os.path.join(d, "weights.f32"), scores, torch.float32)
    meta = {"N": N, "D": D, "I": p["I"], "E": E, "k": k, "seed": seed,
            "transformers": transformers.__version__, "torch": torch.__version__}
    if family == "gpt_oss":
        ex = mod.experts
        meta["limit"] = float(getattr(ex, "limit", p["swiglu_limit"]))
        meta["alpha"] = float(ex.alpha)
        pre = torch.einsum("nd,edc->nec", x.reshape(N, D), ex.gate_up_proj) + ex.gate_up_proj_bias
        meta["frac_gate_clamped"] = float((pre[..., ::2] > meta["limit"]).float().mean())
        meta["frac_up_clamped"] = float((pre[..., 1::2].abs() > meta["limit"]).float().mean())
    else:
        meta["norm_topk_prob"] = int(p["norm_topk_prob"])
    for dev, rec in tie_record():
        meta["torch_topk_tie_" + dev] = rec
    with open(os.path.join(d, "meta.txt"), "w") as f:
        for key, v in meta.items():
            f.write(f"{key} {v}\n")
    print(f"{family}: N {N} D {D} I {p['I']} E {E} k {k} seed {seed} -> {d}; "
          + " ".join(f"{key}={meta[key]}" for key in meta if key.startswith(("frac", "torch_topk"))))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "fixtures", "moe"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # one fixed summation order on any machine
    for family, p in FAMILIES.items():
        make_family(family, p, args.out)


if __name__ == "__main__":
    main()
