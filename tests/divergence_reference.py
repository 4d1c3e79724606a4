#!/usr/bin/env python3
"""divergence_reference.py — the distillation loss of every kd.divergence written in PyTorch (float64,
autograd for the gradients), as fixtures for test_kl_divergences's `fixtures` group (ctest
test_kl_divergences_torch, registered once tests/fixtures/divergences/ exists; docs/loss.md,
"Divergences").

Needs torch only (CPU is enough, no network; written against 2.x, runs on 1.13 too):

    python3 tests/divergence_reference.py                 # writes tests/fixtures/divergences/
    python3 tests/divergence_reference.py --out DIR

Independent of the C code: per row it builds the two distributions each variant forms, as tensors —
renorm: p~ = softmax(t/tau) over the k' stored tokens against q restricted to them and renormalised
(forward KL: log q over the whole vocabulary); tail: the k' exact probabilities exp(t/tau - lse) plus
the tail bucket r = 1 - sum p (at least 1e-6 for every divergence but fkl) against q on the k' tokens
plus 1 - Q = exp(logsumexp(z outside I) - logsumexp(z)); sampled: the target over all V tokens (p on
the top-k', r/S per tail draw, repeats adding up) against q — then the divergence from its
definition (jsd as TRL's generalized_jsd_loss, beta = 0 / 1 being forward / reverse KL; skew KL and
skew reverse KL as DistiLLM's), KD = tau^2 * D, CE on the label, loss = alpha*mean KD + (1-alpha)*mean
CE over rows whose label is not -100, and dH, dW by backward().

Two input sets, tau1/ and tau2/ (the cache temperature, and the tau of every case in it), each:

  meta.txt        first line "N D V k S tau_cache"; then '#' lines: seed and torch version
  h.f32 (N, D), w.f32 (V, D), idx.i32 (N, k) top-k largest first, tl.f32 (N, k) their logits,
  lse.f32 (N) logsumexp(t / tau_cache), draws.i32 (N, S) from the teacher outside its top-k (draw 2
  repeats draw 0), labels.i32 (N) (every fifth row, i % 5 == 3, is -100)
  cases.txt       "name variant divergence jsd_beta skew_alpha tau alpha k_use" per line
  NAME.loss.f64   loss, KD, CE;   NAME.dh.f64 (N, D), NAME.dw.f64 (V, D): gradients of the mean loss

All raw little-endian, no header. Inputs are drawn in float32 and used as float64 from there, as the
C code reads them; beta, skew alpha and alpha are rounded to float32 as the C parameters hold them.
"""
import argparse
import array
import os
import struct

import torch

N, D, V, K, S = 13, 6, 37, 5, 4  # none a multiple of anything the kernels tile by
SETS = {"tau1": (1.0, 11), "tau2": (2.0, 12)}
TAIL_MASS_MIN = 1e-6  # TKD_KL_TAIL_MASS_MIN (kernels/loss/kl_loss.h)
DIVERGENCES = [("fkl", 0.5, 0.1), ("rkl", 0.5, 0.1), ("jsd", 0.5, 0.1), ("jsd", 0.9, 0.1),
               ("skl", 0.5, 0.1), ("srkl", 0.5, 0.1), ("tvd", 0.5, 0.1)]
VARIANTS = [("renorm", K - 1), ("tail", K - 1), ("sampled", K)]  # k' < k except sampled (docs/loss.md)
ALPHAS = [0.5, 1.0]


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def refused(variant, div, beta, skew):
    """sampled's target is 0 on the undrawn tail, where reverse KL is infinite (tkd_kl_params_check)."""
    return variant == "sampled" and (div == "rkl" or (div == "jsd" and beta == 1.0) or
                                     (div == "srkl" and skew == 0.0))


def make_inputs(tau, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=torch.float32)
    w = 0.7 * torch.randn(V, D, generator=g, dtype=torch.float32)
    t = 2.0 * torch.randn(N, V, generator=g, dtype=torch.float32)
    tl, idx = torch.topk(t, K, dim=1)  # sorted, largest first
    lse = torch.logsumexp(t.double() / tau, dim=1).float()
    draws = torch.empty(N, S, dtype=torch.int32)
    for i in range(N):
        p = torch.softmax(t[i].double() / tau, 0)
        p[idx[i]] = 0.0
        draws[i] = torch.multinomial(p, S, replacement=True, generator=g).int()
        draws[i, 2] = draws[i, 0]
    labels = torch.randint(0, V, (N,), generator=g, dtype=torch.int32)
    labels[torch.arange(N) % 5 == 3] = -100
    return dict(h=h, w=w, idx=idx.int(), tl=tl, lse=lse, draws=draws, labels=labels)


def divergence(div, beta, skew, P, logP, logC):
    """D(P || C) over buckets: P the teacher's (constant, logP its log, -inf where 0), C = exp(logC)."""
    if div == "jsd" and beta in (0.0, 1.0):  # TRL's endpoints
        div = "fkl" if beta == 0.0 else "rkl"
    if div in ("skl", "srkl") and skew == 0.0:
        div = "fkl" if div == "skl" else "rkl"
    C = logC.exp()
    if div == "fkl":
        return (torch.special.xlogy(P, P) - P * logC).sum()
    if div == "rkl":
        return (C * (logC - logP)).sum()
    if div == "jsd":
        logM = torch.logsumexp(torch.stack([logP + torch.log(torch.tensor(beta, dtype=torch.float64)),
                                            logC + torch.log1p(torch.tensor(-beta, dtype=torch.float64))]), 0)
        return (beta * (torch.special.xlogy(P, P) - P * logM) + (1 - beta) * C * (logC - logM)).sum()
    la, l1a = torch.log(torch.tensor(skew, dtype=torch.float64)), torch.log1p(torch.tensor(-skew, dtype=torch.float64))
    if div == "skl":  # KL(p || a p + (1 - a) q)
        logM = torch.logsumexp(torch.stack([logP + la, logC + l1a]), 0)
        return (torch.special.xlogy(P, P) - P * logM).sum()
    if div == "srkl":  # KL(q || a q + (1 - a) p)
        logM = torch.logsumexp(torch.stack([logC + la, logP + l1a]), 0)
        return (C * (logC - logM)).sum()
    if div == "tvd":
        return 0.5 * (P - C).abs().sum()
    raise ValueError(div)


def row_kd(x, i, z, variant, div, beta, skew, tau, k_use):
    """tau^2 * D for row i: the buckets of the variant, built token by token."""
    I = x["idx"][i, :k_use].long()
    t = x["tl"][i, :k_use].double()
    lse_z = torch.logsumexp(z[i], 0)
    if variant == "renorm":
        logP = torch.log_softmax(t / tau, 0)
        logC = z[i, I] - lse_z if div == "fkl" else torch.log_softmax(z[i, I], 0)
        P = logP.exp()
    else:
        logp = t / tau - x["lse"][i].double()
        p = logp.exp()
        r = torch.clamp(1.0 - p.sum(), min=0.0)
        if variant == "tail":
            P, logP, logC = p, logp, z[i, I] - lse_z
            if k_use < V:
                out = torch.ones(V, dtype=torch.bool)
                out[I] = False
                rt = r if div == "fkl" else torch.clamp(r, min=TAIL_MASS_MIN)
                P = torch.cat([p, rt.view(1)])
                logP = torch.cat([logp, torch.log(rt).view(1)])
                logC = torch.cat([logC, (torch.logsumexp(z[i, out], 0) - lse_z).view(1)])
        else:
            P = torch.zeros(V, dtype=torch.float64)
            P[I] = p
            P.index_add_(0, x["draws"][i].long(), torch.full((S,), float(r) / S, dtype=torch.float64))
            logP = torch.log(P)
            logC = z[i] - lse_z
    return tau * tau * divergence(div, beta, skew, P, logP, logC)


def loss_and_grads(x, variant, div, beta, skew, tau, alpha, k_use):
    h = x["h"].double().requires_grad_(True)
    w = x["w"].double().requires_grad_(True)
    s = h @ w.T
    z = s / tau
    kept = [i for i in range(N) if int(x["labels"][i]) != -100]
    kd = torch.stack([row_kd(x, i, z, variant, div, beta, skew, tau, k_use) for i in kept]).mean()
    ls = torch.log_softmax(s, 1)
    ce = torch.stack([-ls[i, int(x["labels"][i])] for i in kept]).mean()
    loss = alpha * kd + (1 - alpha) * ce
    loss.backward()
    return [float(loss), float(kd), float(ce)], h.grad, w.grad


def write(path, typecode, values):
    with open(path, "wb") as f:
        array.array(typecode, values).tofile(f)  # native order: little-endian on the machines we use


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                                                   "divergences"))
    args = ap.parse_args()
    assert array.array("i").itemsize == 4 and struct.pack("=i", 1) == b"\x01\0\0\0"
    torch.set_grad_enabled(True)
    total = 0
    for name, (tau, seed) in SETS.items():
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        x = make_inputs(tau, seed)
        with open(os.path.join(d, "meta.txt"), "w") as f:
            f.write(f"{N} {D} {V} {K} {S} {tau}\n# seed {seed}\n# torch {torch.__version__}\n")
        for key, tc in (("h", "f"), ("w", "f"), ("idx", "i"), ("tl", "f"), ("lse", "f"), ("draws", "i"),
                        ("labels", "i")):
            write(os.path.join(d, f"{key}.{'f32' if tc == 'f' else 'i32'}"), tc, x[key].reshape(-1).tolist())
        lines = []
        for variant, k_use in VARIANTS:
            for div, beta, skew in DIVERGENCES:
                if refused(variant, div, beta, skew):
                    continue
                for alpha in ALPHAS:
                    b, sk, a = f32(beta), f32(skew), f32(alpha)
                    case = f"{variant}_{div}_b{beta}_s{skew}_a{alpha}"
                    vals, dh, dw = loss_and_grads(x, variant, div, b, sk, tau, a, k_use)
                    assert all(map(lambda v: v == v and abs(v) < 1e30, vals)), (case, vals)
                    write(os.path.join(d, f"{case}.loss.f64"), "d", vals)
                    write(os.path.join(d, f"{case}.dh.f64"), "d", dh.reshape(-1).tolist())
                    write(os.path.join(d, f"{case}.dw.f64"), "d", dw.reshape(-1).tolist())
                    lines.append(f"{case} {variant} {div} {beta} {skew} {tau} {alpha} {k_use}\n")
        with open(os.path.join(d, "cases.txt"), "w") as f:
            f.writelines(lines)
        total += len(lines)
        print(f"{d}: {len(lines)} cases")
    print(f"{total} cases in {args.out}")


if __name__ == "__main__":
    main()
