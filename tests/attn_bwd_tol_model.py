"""attn_bwd_tol_model.py — the rounding model behind tests/test_gpu_attn_bwd.c's tolerances.

Exact float64 arithmetic except for the roundings the CUDA backward (kernels/attn/attn_bwd_cuda.cu)
does: P rounded to bf16 before dV += Pᵀ dY, dS before dK += dSᵀ Q and dQ += dS K, D = Σ dy·y from
the forward's bf16 y (itself from bf16 P), and each output rounded to bf16 once. For the test's
shapes and input scales (test_masked's under their windows and documents too) it prints, per
gradient, the worst |Δ| / (ATOL·scale + RTOL·|ref|) with the test's per-row error scale, and
‖Δ‖ / ‖ref‖. Not run by CI (numpy; about 30 s):
  python3 tests/attn_bwd_tol_model.py [ATOL RTOL]   (default: the test's 2e-2 1e-2)"""
import sys

import numpy as np


def bf16(x):
    """Round to the nearest bf16 (ties to even), returned as float64."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def visible(T, window, starts):
    """(T, T) bool: query i sees key j (causal; i − j < window when window > 0; j at or after the start
    of i's document, starts: the sequence's document starts, 0 first, or None)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    vis = j <= i
    if window > 0:
        vis &= i - j < window
    if starts:
        doc = np.array(starts)[np.searchsorted(starts, np.arange(T), side="right") - 1]
        vis &= j >= doc[:, None]
    return vis


def case(B, T, H, Hkv, dh, std, seed, atol, rtol, window=0, starts=None):
    """starts: None, or one list of document starts per sequence (test_masked's cases)."""
    rng = np.random.default_rng(seed)
    grp, c = H // Hkv, 1 / np.sqrt(dh)
    q = bf16(rng.normal(0, std, (B, H, T, dh)))
    k = bf16(rng.normal(0, std, (B, Hkv, T, dh)))
    v = bf16(rng.normal(0, 1, (B, Hkv, T, dh)))
    dy = bf16(rng.normal(0, 1, (B, H, T, dh)))
    masks = [visible(T, window, starts[b] if starts else None) for b in range(B)]
    ref = {n: np.zeros_like(x) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    gpu = {n: np.zeros_like(x) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    sc2 = {"dq": np.zeros(q.shape[:3]), "dk": np.zeros(k.shape[:3]), "dv": np.zeros(v.shape[:3])}
    for b in range(B):
        for h in range(H):
            g = h // grp
            S = q[b, h] @ k[b, g].T * c
            S[~masks[b]] = -np.inf
            E = np.exp(S - S.max(1, keepdims=True))
            l = E.sum(1, keepdims=True)
            P = E / l
            y_gpu = bf16((bf16(E) @ v[b, g]) / l)
            dP = dy[b, h] @ v[b, g].T
            D = (P * dP).sum(1, keepdims=True)
            D_gpu = (dy[b, h] * y_gpu).sum(1, keepdims=True)
            dS, dS_gpu = P * (dP - D), bf16(P * (dP - D_gpu))
            ref["dq"][b, h] = c * dS @ k[b, g]
            gpu["dq"][b, h] = c * dS_gpu @ k[b, g]
            ref["dk"][b, g] += c * dS.T @ q[b, h]
            gpu["dk"][b, g] += c * dS_gpu.T @ q[b, h]
            ref["dv"][b, g] += P.T @ dy[b, h]
            gpu["dv"][b, g] += bf16(P).T @ dy[b, h]
            # the test's error scales (its file comment): root-sum-square of the terms' sizes
            Dn = np.sqrt(((dy[b, h] * y_gpu) ** 2).sum(1, keepdims=True))
            W = (P * (np.abs(dP) + np.abs(D) + Dn)) ** 2
            sc2["dq"][b, h] = c * c * (W @ (k[b, g] ** 2).mean(1))
            sc2["dk"][b, g] += c * c * (W.T @ (q[b, h] ** 2).mean(1))
            sc2["dv"][b, g] += (P ** 2).T @ (dy[b, h] ** 2).mean(1)
    out = []
    for n in ("dq", "dk", "dv"):
        got, r = bf16(gpu[n]), ref[n]
        excess = np.abs(got - r) / (atol * np.sqrt(sc2[n])[..., None] + rtol * np.abs(r))
        norm = np.linalg.norm(got - r) / max(np.linalg.norm(r), 1e-300)
        out.append(f"{n} err/tol {excess.max():.3f} norm {norm:.1e}")
    print(f"B={B} T={T} H={H} Hkv={Hkv} dh={dh} std={std} window={window} docs={bool(starts)}: " + ", ".join(out),
          flush=True)


if __name__ == "__main__":
    atol, rtol = (float(sys.argv[1]), float(sys.argv[2])) if len(sys.argv) == 3 else (2e-2, 1e-2)
    for args in [(1, 1, 2, 1, 64, 1.0, 1), (2, 17, 4, 2, 64, 1.5, 2), (1, 65, 2, 2, 128, 1.5, 3),
                 (1, 1000, 7, 1, 128, 1.5, 4), (2, 1000, 2, 2, 64, 1.0, 5), (1, 333, 6, 2, 80, 1.5, 6),
                 (2, 200, 4, 2, 48, 1.5, 7), (1, 129, 3, 3, 96, 1.5, 8), (1, 128, 2, 1, 64, 1.5, 13),
                 (1, 300, 2, 1, 64, 3.0, 9), (1, 4097, 4, 2, 128, 1.5, 11), (2, 4097, 2, 1, 64, 1.0, 12)]:
        case(*args, atol, rtol)
    for args, window, starts in [
            ((2, 300, 8, 2, 64, 1.5, 21), 0, [[0, 1, 2, 60, 61, 127, 128, 129, 200, 299], [0, 150, 151]]),
            ((1, 200, 4, 1, 128, 1.5, 22), 1, None),
            ((2, 333, 8, 2, 128, 1.5, 23), 37, [[0, 5, 140, 141, 270], [0, 64, 192, 256]]),
            ((1, 129, 4, 1, 96, 1.5, 24), 0, [[0, 16, 32, 33, 48, 64, 80, 96, 112, 128]]),
            ((2, 270, 8, 2, 48, 1.5, 25), 130, None),
            ((1, 257, 4, 2, 80, 1.5, 27), 80, None),
            ((1, 1000, 4, 1, 64, 1.0, 26), 200, [[0, 300, 301, 700]])]:
        case(*args, atol, rtol, window, starts)
