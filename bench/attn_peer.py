"""attn_peer.py — torch's causal GQA attention forward on the same GPU and shapes as bench/attn_bench,
run in the same device call so the ratio is fair. Prints one markdown row per (shape, backend):
median ms of 10 launches and TFLOP/s with the same count as attn_bench (4·B·H·T²·dh/2, causal).
  python3 bench/attn_peer.py [BxTxHxHkvxDH ...]   (default: attn_bench's four shapes)"""
import sys
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

shapes = sys.argv[1:] or ["1x8192x32x8x128", "1x32768x32x8x128", "1x8192x14x2x64", "1x32768x14x2x64"]
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


print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
print("| shape B x T x H x Hkv x dh | torch backend | ms | TFLOP/s |\n|---|---|---|---|")
for sh in shapes:
    B, T, H, Hkv, dh = map(int, sh.split("x"))
    q = torch.randn(B, H, T, dh, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, T, dh, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, T, dh, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * B * H * T * T * dh / 2
    for name, be in backends:
        def run():
            if be is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        try:
            ms = timed(run)
            print(f"| {sh} | {name} | {ms:.3f} | {flops / ms / 1e9:.1f} |", flush=True)
        except Exception as ex:  # a backend that refuses the shape
            print(f"| {sh} | {name} | refused: {str(ex).splitlines()[0][:60]} | |", flush=True)
