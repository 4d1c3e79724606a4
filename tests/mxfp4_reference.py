#!/usr/bin/env python3
"""mxfp4_reference.py — transformers' own MXFP4 dequantisation of a tiny gpt-oss checkpoint, written as
the fixture of `test_mxfp4 fixtures` (ctest test_mxfp4_transformers, formats/mxfp4.h).

Needs torch + transformers 5.x + safetensors (CPU torch is enough; no network):

    python3 tests/mxfp4_reference.py          # writes tests/fixtures/mxfp4/ (dequantising on the CPU)
    python3 tests/mxfp4_reference.py --out DIR [--device cuda] [--skip-load]

Writes under --out:
  model.safetensors     a 2-layer gpt-oss checkpoint (hidden 64, intermediate 64, 3 experts) whose
                        experts are MXFP4 pairs, U8: model.layers.L.mlp.experts.{gate_up_proj,down_proj}
                        _blocks (E, R, G, 16) / _scales (E, R, G); every other tensor F32. Layer 0 has
                        random codes (every byte value occurs) and scales 110..140; layer 1 the edges:
                        scales 0, 1, 2 (fp32 subnormal results), 126..128, 252, and 253 / 254 on blocks
                        whose codes stay finite there.
  config.json           its config, with quantization_config {"quant_method": "mxfp4", ...}
  expected.safetensors  per pair stem S (e.g. model.layers.0.mlp.experts.gate_up_proj):
                          S.f32    convert_moe_packed_tensors(blocks, scales, dtype=float32)   (E, K, R)
                          S.bf16   convert_moe_packed_tensors(blocks, scales) (its default, bf16)
                          S.loaded the parameter GptOssForCausalLM.from_pretrained(...,
                                   quantization_config=Mxfp4Config(dequantize=True)) holds, as F32
                                   (left out with --skip-load, or when that load fails: reported)
  meta.txt              versions, device, and whether transformers' result equals the exact value
                        E2M1 · 2^(s − 127) everywhere (the C reader is exact; a difference is printed
                        with the scales where it occurs)

transformers 5 gives gpt-oss's experts in (E, in, out) layout ("is_transposed"): convert_moe_packed_tensors
turns blocks (E, R, G, 16) into (E, R, G·32) and transposes dims 1 and 2, so gate_up_proj is (E, D, 2I)
and down_proj (E, I, D). The script asserts those shapes.
"""
import argparse
import json
import os

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
E, D, I, L = 3, 64, 64, 2
SEED = 22


def make_pair(torch, g, R, G, edges):
    """Blocks (E, R, G, 16) and scales (E, R, G), uint8."""
    blocks = torch.randint(0, 256, (E, R, G, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    flat = blocks.view(-1)
    flat[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # every byte value occurs
    if not edges:
        scales = torch.randint(110, 141, (E, R, G), generator=g, dtype=torch.int32).to(torch.uint8)
        return blocks, scales
    pool = torch.tensor([0, 1, 2, 126, 127, 128, 252, 253, 254], dtype=torch.int32)
    scales = pool[torch.randint(0, len(pool), (E, R, G), generator=g)].to(torch.uint8)
    # at 2^126 codes up to |3| stay finite, at 2^127 up to |1.5|: nibbles 0..5 / 0..3, either sign
    for s, top in ((253, 6), (254, 4)):
        m = (scales == s)
        lo = torch.randint(0, top, blocks.shape, generator=g) | (torch.randint(0, 2, blocks.shape, generator=g) << 3)
        hi = torch.randint(0, top, blocks.shape, generator=g) | (torch.randint(0, 2, blocks.shape, generator=g) << 3)
        safe = (lo | (hi << 4)).to(torch.uint8)
        blocks = torch.where(m[..., None], safe, blocks)
    return blocks, scales


def exact(torch, blocks, scales):
    """E2M1 · 2^(s − 127) in float64 (exact), laid out as transformers does: (E, G·32, R)."""
    lut = torch.tensor(FP4, dtype=torch.float64)
    b = blocks.to(torch.int64)
    vals = torch.stack([lut[b & 15], lut[b >> 4]], dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * torch.pow(2.0, scales.to(torch.float64) - 127)[..., None]
    Ee, R, G = scales.shape
    return vals.reshape(Ee, R, G * 32).transpose(1, 2).contiguous()


def check_exact(torch, name, got, want, scales):
    same = got.double() == want
    same |= torch.isnan(got.double()) & torch.isnan(want)
    if bool(same.all()):
        return "exact"
    bad = (~same).nonzero()
    s = sorted({int(scales[e, r, k // 32]) for e, k, r in bad[:1000].tolist()})
    print(f"  {name}: {int((~same).sum())} elements differ from E2M1*2^(s-127); scales involved: {s}")
    return f"differs(scales {','.join(map(str, s))})"


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "fixtures", "mxfp4"))
    ap.add_argument("--device", default="cpu", help="where convert_moe_packed_tensors runs (cpu, cuda)")
    ap.add_argument("--skip-load", action="store_true", help="leave out the from_pretrained check")
    args = ap.parse_args()
    if args.device == "cpu":  # the older convert_moe_packed_tensors moves its inputs to CUDA when it can
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    cfg = GptOssConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                       num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=64, sliding_window=8)
    model = GptOssForCausalLM(cfg).float().eval()
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}

    shapes = {"gate_up_proj": (2 * I, D // 32, (E, D, 2 * I)), "down_proj": (D, I // 32, (E, I, D))}
    pairs, meta = {}, {"transformers": transformers.__version__, "torch": torch.__version__,
                       "device": args.device, "seed": SEED}
    for layer in range(L):
        for proj, (R, G, _) in shapes.items():
            stem = f"model.layers.{layer}.mlp.experts.{proj}"
            assert stem in sd, f"{stem} is not a parameter of this transformers' GptOssForCausalLM"
            del sd[stem]
            pairs[stem] = make_pair(torch, g, R, G, edges=(layer == 1))
            sd[stem + "_blocks"], sd[stem + "_scales"] = pairs[stem]

    os.makedirs(args.out, exist_ok=True)
    save_file(sd, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    cj = json.loads(cfg.to_json_string(use_diff=False))  # JSON-safe (dtype as a string)
    cj["architectures"] = ["GptOssForCausalLM"]
    cj["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cj, f, indent=2)

    expected = {}
    for stem, (blocks, scales) in pairs.items():
        proj = stem.rsplit(".", 1)[1]
        want_shape = shapes[proj][2]
        b, s = blocks.to(args.device), scales.to(args.device)
        f32 = convert_moe_packed_tensors(b, s, dtype=torch.float32).cpu()
        bf16 = convert_moe_packed_tensors(b, s).cpu()
        assert tuple(f32.shape) == want_shape, (stem, tuple(f32.shape), want_shape)
        assert bf16.dtype == torch.bfloat16 and tuple(bf16.shape) == want_shape, (stem, bf16.dtype, bf16.shape)
        ref = exact(torch, blocks, scales)
        meta[stem + ".f32"] = check_exact(torch, stem + ".f32", f32, ref, scales)
        meta[stem + ".bf16"] = check_exact(torch, stem + ".bf16", bf16, ref, scales)
        expected[stem + ".f32"] = f32.contiguous()
        expected[stem + ".bf16"] = bf16.contiguous()

    if not args.skip_load:
        try:
            from transformers import Mxfp4Config
            loaded = GptOssForCausalLM.from_pretrained(args.out, quantization_config=Mxfp4Config(dequantize=True),
                                                       dtype=torch.float32)
            for stem in pairs:
                layer, proj = int(stem.split(".")[2]), stem.rsplit(".", 1)[1]
                p = getattr(loaded.model.layers[layer].mlp.experts, proj)
                assert tuple(p.shape) == shapes[proj][2], (stem, tuple(p.shape))
                expected[stem + ".loaded"] = p.detach().float().cpu().contiguous()
                meta[stem + ".loaded"] = f"{p.dtype}:" + check_exact(torch, stem + ".loaded", p.detach().cpu(),
                                                                     exact(torch, *pairs[stem]), pairs[stem][1])
        except Exception as e:  # reported, not fatal: the .f32/.bf16 comparisons still stand
            print(f"from_pretrained with Mxfp4Config(dequantize=True) failed: {type(e).__name__}: {e}")
            meta["loaded"] = f"failed: {type(e).__name__}"
    save_file(expected, os.path.join(args.out, "expected.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "meta.txt"), "w") as f:
        for k, v in meta.items():
            f.write(f"{k} {v}\n")
    for k, v in meta.items():
        print(f"{k}: {v}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
