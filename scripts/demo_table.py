#!/usr/bin/env python3
"""Prints the demo's results table from demo-out/: each model's validation CE / perplexity
(the RESULT line student-train prints) and each cache's stored bytes per token (shard file
sizes over the positions the manifest lists). Standard library only."""
import glob
import math
import os
import re
import sys


def result(out, name):
    """The key=value pairs of the RESULT line in demo-out/<name>.log."""
    with open(os.path.join(out, name + ".log")) as f:
        for line in f:
            if line.startswith("RESULT "):
                return {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
    sys.exit(f"demo_table: no RESULT line in {out}/{name}.log")


def bytes_per_token(cache):
    """Bytes of shard files per stored position (num_seq x seq_len from the manifest)."""
    text = open(os.path.join(cache, "manifest.yaml")).read()
    seq_len = int(re.search(r"^\s*seq_len:\s*(\d+)", text, re.M).group(1))
    nseq = sum(int(n) for n in re.findall(r"^\s*num_seq:\s*(\d+)", text, re.M))
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(cache, "shard-*.h5")))
    return size / (nseq * seq_len)


def main(out):
    teacher = result(out, "teacher-eval")
    rows = [
        ("teacher (4 layers, D=128)", teacher, None),
        ("student: CE only", result(out, "ce-only"), None),
        ("student: KD top-100 renorm", result(out, "kd-top100-renorm"), "cache-top100"),
        ("student: KD top-20 + 80 tail draws, sampled", result(out, "kd-top20-tail80-sampled"), "cache-top20-tail80"),
    ]
    print(f"{'model':46s} {'val CE':>8s} {'val ppl':>9s} {'top-1 agr':>9s} {'cache B/token':>14s}")
    for name, r, cache in rows:
        agree = f"{r['top1']:.3f}" if "top1" in r else ""  # left out when not measured
        bpt = f"{bytes_per_token(os.path.join(out, cache)):.1f}" if cache else ""
        print(f"{name:46s} {r['val_ce']:8.4f} {r['val_ppl']:9.2f} {agree:>9s} {bpt:>14s}")
    ce = rows[1][1]["val_ce"]
    for name, r, _ in rows[2:]:
        verdict = "beats" if r["val_ce"] < ce else "does NOT beat"
        print(f"{name.split(': ')[1]} {verdict} CE only by {ce - r['val_ce']:+.4f} nats/token")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "demo-out")
