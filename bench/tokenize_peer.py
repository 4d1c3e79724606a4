#!/usr/bin/env python3
"""tokenize_peer.py — Hugging Face tokenizers (Rust, from Python) on the text tokenize_bench reads,
for the one-core comparison in docs/PERFORMANCE.md. Needs `tokenizers` (transformers brings it).

    python3 bench/tokenize_peer.py [--reps 5] [--llama3 build/fixtures/llama3] [FILE ...]

Like tokenize_bench: the fixture texts (tests/fixtures/tokenizer/text/*.txt) cut at the first
newline after every 16 KB, decoded as bytes.decode("utf-8", "replace"), encoded with
add_special_tokens=False. One core: each piece through Tokenizer.encode in turn (encode runs on
the calling thread). All cores: encode_batch over all pieces (Rayon threads). Each row
is the fastest of --reps passes, after one warm-up pass.
"""
import argparse
import glob
import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def pieces(files):
    out, total = [], 0
    for f in files:
        data = open(f, "rb").read()
        total += len(data)
        at = 0
        while at < len(data):
            end = min(at + 16384, len(data))
            while end < len(data) and data[end - 1] != 0x0A:
                end += 1
            out.append(data[at:end].decode("utf-8", "replace"))
            at = end
    return out, total


def best(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        n = fn()
        times.append(time.perf_counter() - t0)
    return min(times), n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--llama3", default=os.path.join(ROOT, "build", "fixtures", "llama3"))
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    from tokenizers import Tokenizer
    import tokenizers
    files = args.files or sorted(glob.glob(os.path.join(ROOT, "tests", "fixtures", "tokenizer", "text", "*.txt")))
    texts, total = pieces(files)
    print(f"tokenize_peer: tokenizers {tokenizers.__version__}, {len(files)} texts ({len(texts)} pieces), "
          f"{total} bytes, {args.reps} reps, {os.cpu_count()} CPUs")
    dirs = [os.path.join(ROOT, "tests", "fixtures", "tokenizer", "gpt2"),
            os.path.join(ROOT, "build", "fixtures", "tokenizer", "qwen3")] + [args.llama3]  # qwen3: unpacked by CMake
    for d in dirs:
        path = os.path.join(d, "tokenizer.json")
        if not os.path.exists(path):
            print(f"{path}: missing, skipped")
            continue
        tok = Tokenizer.from_file(path)
        one = lambda: sum(len(tok.encode(t, add_special_tokens=False).ids) for t in texts)
        allc = lambda: sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
        s1, n = best(one, args.reps)
        sa, _ = best(allc, args.reps)
        print(f"{d}: {n} ids")
        print(f"  1 thread (encode)        {total / s1 / 1e6:8.2f} MB/s  {n / s1 / 1e6:7.3f} Mtok/s")
        print(f"  all cores (encode_batch) {total / sa / 1e6:8.2f} MB/s  {n / sa / 1e6:7.3f} Mtok/s")


if __name__ == "__main__":
    main()
