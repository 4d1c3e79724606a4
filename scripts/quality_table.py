#!/usr/bin/env python3
"""Prints issue 24's quality table from a sweep.csv written by scripts/quality_table.sh: each KD
row's validation CE and its gain over CE only as a fraction of dense distillation's gain at the
same alpha (rows named <divergence or variant>-...-a<alpha>, ce-only, dense-a<alpha>). Standard
library only."""
import csv
import re
import sys


def main(path):
    rows = {r["name"]: r for r in csv.DictReader(open(path))}
    ce = float(rows["ce-only"]["val_ce"]) if rows.get("ce-only", {}).get("val_ce") else None
    print("| run | alpha | val CE | gain over CE only | fraction of dense's gain | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        m = re.search(r"-a([0-9.]+)$", name)
        alpha = m.group(1) if m else "0"
        if r["status"] != "ok" or not r["val_ce"]:
            print(f"| {name} | {alpha} | {r['status']}: {r.get('error', '')} | | | |")
            continue
        v = float(r["val_ce"])
        dense = rows.get(f"dense-a{alpha}")
        gain = ce - v if ce is not None else None
        frac = ""
        if gain is not None and dense and dense["status"] == "ok" and dense["val_ce"]:
            dg = ce - float(dense["val_ce"])
            frac = f"{gain / dg:.2f}" if dg > 0 else "dense gained nothing"
        g = f"{gain:+.4f}" if gain is not None and name != "ce-only" else "-"
        tps = f"{float(r['tokens_per_s']):,.0f}" if r["tokens_per_s"] else "-"
        print(f"| {name} | {alpha} | {v:.4f} | {g} | {frac if name != 'ce-only' else '-'} | {tps} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: quality_table.py SWEEP.csv")
    main(sys.argv[1])
