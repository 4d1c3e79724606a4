"""attn_peer.py — torch's causal GQA attention forward and backward on the same GPU and shapes as
bench/attn_bench, run in the same device call so the ratio is fair. Prints one markdown row per
(shape, backend): median ms of 10 launches and TFLOP/s with the same counts as attn_bench (forward
4·B·H·T²·dh/2, causal; backward 2.5 × that; fwd+bwd 3.5 × that over the sum). The backward is
torch.autograd.grad of the SDPA output for dq, dk, dv (the forward outside the timed region).
  python3 bench/attn_peer.py [BxTxHxHkvxDH ...]   (default: attn_bench's seven shapes)"""
import sys
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

shapes = sys.argv[1:] or ["1x8192x32x8x128", "1x32768x32x8x128", "1x8192x14x2x64", "1x32768x14x2x64",
                          "1x8192x32x8x64", "1x8192x24x8x128", "4x4096x14x2x64"]
backends = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]


def timed(fn, reps=10):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def sdpa(be, q, k, v):
    if be is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(be):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
print("| shape B x T x H x Hkv x dh | torch backend | fwd ms | TFLOP/s | bwd ms | TFLOP/s | fwd+bwd TFLOP/s |\n"
      "|---|---|---|---|---|---|---|")
for sh in shapes:
    B, T, H, Hkv, dh = map(int, sh.split("x"))
    q = torch.randn(B, H, T, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, T, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, T, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, H, T, dh, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * B * H * T * T * dh / 2
    for name, be in backends:
        try:
            with torch.no_grad():
                ms = timed(lambda: sdpa(be, q, k, v))
            out = sdpa(be, q, k, v)
            ms_b = timed(lambda: torch.autograd.grad(out, (q, k, v), dy, retain_graph=True))
            del out
            print(f"| {sh} | {name} | {ms:.3f} | {flops / ms / 1e9:.1f} | {ms_b:.3f} | {2.5 * flops / ms_b / 1e9:.1f} "
                  f"| {3.5 * flops / (ms + ms_b) / 1e9:.1f} |", flush=True)
        except Exception as ex:  # a backend that refuses the shape
            print(f"| {sh} | {name} | refused: {str(ex).splitlines()[0][:60]} | | | | |", flush=True)
