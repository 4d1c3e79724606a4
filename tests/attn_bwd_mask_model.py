"""attn_bwd_mask_model.py — an integer model of kernels/attn/attn_bwd_cuda.cu's masked kernels (kMask):
their CTA tile ranges, warp tile and 16x16 chunk skips, "partly masked" tests and per-lane element
masks (fragment positions as in the kernels), written line for line after the kernels. Checks that
the (query, key) pairs whose P the dq and the dkv kernels keep are exactly the pairs the mask shows
(query i sees key j iff first_key(i) <= j <= i), each once, and that first_key and query_end agree,
on test_gpu_attn_bwd.c's masked cases and random windows and document cuts. Written because the
kernels' index arithmetic was first reviewed with no GPU at hand; run it by hand after changing
those decisions (not run by CI; pure Python, about 15 s):
  python3 tests/attn_bwd_mask_model.py [SEED [RANDOM_CASES]]   (default: 1 300)"""
import random, sys

def first_key(i, T, window, doc):
    w = max(0, i - window + 1) if window > 0 else 0
    return max(w, doc[min(i, T - 1)]) if doc is not None else w

def query_end(j, T, window, doc):
    lo, hi = j + 1, (min(T, j + window) if window > 0 else T)
    if doc is None:
        return hi
    while lo < hi:
        mid = lo + (hi - lo) // 2
        if doc[mid] > j: hi = mid
        else: lo = mid + 1
    return lo

def visible(i, j, T, window, doc):
    return j <= i and (window == 0 or i - j < window) and (doc is None or j >= doc[i])

def sim_dq(T, window, doc):
    got = {}
    n_qt = (T + 127) // 128
    for by in range(n_qt):
        q0 = (n_qt - 1 - by) * 128
        last = (min(q0 + 128, T) - 1) // 64
        first = first_key(q0, T, window, doc) // 64
        slo = [first_key(q0 + r, T, window, doc) for r in range(128)]
        for warp in range(8):
            row0 = q0 + 16 * warp
            lo = slo[16 * warp:16 * warp + 16]
            for j in range(last, first - 1, -1):
                k0 = j * 64
                if k0 > row0 + 15: continue
                if k0 + 63 < lo[0]: continue
                for c in range(4):
                    kc = k0 + 16 * c
                    if kc > row0: continue
                    if kc + 15 < lo[0]: continue
                    part = kc == row0 or kc < lo[15]
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        rl = (lo[g], lo[g + 8])
                        for nt in range(2):
                            for e in range(4):
                                key = kc + 8 * nt + 2 * t + (e & 1); row = row0 + g + 8 * (e >> 1)
                                hidden = part and (key > row or key < rl[e >> 1])
                                if hidden or row >= T: continue
                                assert key < T, ("dq: key past T unmasked", row, key)
                                got[(row, key)] = got.get((row, key), 0) + 1
    return got

def sim_dkv(T, window, doc):
    got = {}
    for by in range((T + 127) // 128):
        k0 = by * 128
        sqend = [query_end(min(k0 + i, T - 1), T, window, doc) for i in range(128)]
        qt0 = k0 // 64
        n_q = (sqend[127] + 63) // 64 - qt0
        assert n_q >= 1
        for warp in range(8):
            kw = k0 + 16 * warp
            qend = sqend[16 * warp:16 * warp + 16]
            for n in range(n_q):
                q0 = (qt0 + n) * 64
                for c in range(4):
                    qc = q0 + 16 * c
                    if kw > qc: continue
                    if qc >= qend[15]: continue
                    part = kw == qc or qc + 15 >= qend[0]
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        ke = (qend[g], qend[g + 8])
                        for nt in range(2):
                            for e in range(4):
                                key = kw + g + 8 * (e >> 1); qry = qc + 8 * nt + 2 * t + (e & 1)
                                hidden = part and (key > qry or qry >= ke[e >> 1])
                                if hidden or qry >= T or key >= T: continue
                                got[(qry, key)] = got.get((qry, key), 0) + 1
    return got

def check(T, window, doc):
    want = {(i, j) for i in range(T) for j in range(T) if visible(i, j, T, window, doc)}
    for name, got in (("dq", sim_dq(T, window, doc)), ("dkv", sim_dkv(T, window, doc))):
        assert all(v == 1 for v in got.values()), (name, "a pair twice")
        missing, extra = want - set(got), set(got) - want
        assert not missing and not extra, (name, T, window, sorted(missing)[:5], sorted(extra)[:5])
    # first_key / query_end consistency
    for j in range(T):
        e = query_end(j, T, window, doc)
        for i in range(j, T):
            assert (i < e) == (first_key(i, T, window, doc) <= j), (i, j)

def rand_doc(T, rng):
    starts = sorted(set([0] + [rng.randrange(T) for _ in range(rng.randrange(0, 8))]))
    if rng.random() < 0.3: starts = sorted(set(starts + [T - 1]))
    doc, d = [], 0
    for i in range(T):
        while d + 1 < len(starts) and starts[d + 1] <= i: d += 1
        doc.append(starts[d])
    return doc

rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
fixed = [(300, 0, [0, 1, 2, 60, 61, 127, 128, 129, 200, 299]), (200, 1, None), (333, 37, [0, 5, 140, 141, 270]),
         (333, 37, [0, 64, 192, 256]), (129, 0, [0, 16, 32, 33, 48, 64, 80, 96, 112, 128]), (270, 130, None),
         (257, 80, None), (1, 1, None), (1, 0, [0]), (65, 64, None), (128, 1, [0, 127]), (1000, 200, [0, 300, 301, 700])]
def mkdoc(T, starts):
    if starts is None: return None
    doc, d = [], 0
    for i in range(T):
        while d + 1 < len(starts) and starts[d + 1] <= i: d += 1
        doc.append(starts[d])
    return doc
for T, w, st in fixed:
    check(T, w, mkdoc(T, st))
print("fixed ok")
for it in range(n):
    T = rng.choice([rng.randrange(1, 70), rng.randrange(60, 300), rng.randrange(250, 520)])
    w = rng.choice([0, 1, rng.randrange(1, T + 1), rng.randrange(1, 40)])
    if w >= T: w = 0  # the entry point normalises windows >= T to 0
    doc = rand_doc(T, rng) if rng.random() < 0.7 else None
    if w == 0 and doc is None: doc = rand_doc(T, rng)
    check(T, w, doc)
print("random ok", n)
