#!/usr/bin/env python3
"""GPU-machine checks that need PyTorch, transformers and h5py (none of which CI has):
  1. h5py reads a topkd shard through the zstd plugin; /topk/logits comes back as float16 and
     equals what the tool's own reader sees (h5dump's numbers);
  2. transformers' AutoModelForCausalLM.from_pretrained loads a checkpoint written by student-train,
     and its validation CE equals the one student-train measured on the same windows.
Usage: HDF5_PLUGIN_PATH=<build>/plugins python3 scripts/gpu_check.py SHARD.h5 CHECKPOINT_DIR VAL.bin NWIN SEQ_LEN VAL_CE
(VAL_CE: what student-train printed for that checkpoint over the first NWIN windows of VAL.bin.)"""
import re
import subprocess
import sys

import h5py
import numpy as np
import torch
import transformers


def check_shard(path):
    with h5py.File(path, "r") as f:
        logits = f["/topk/logits"][...]
        idx = f["/topk/indices"][...]
        lse = f["/lse"][...]
        attrs = dict(f.attrs)
    assert logits.dtype == np.float16, logits.dtype
    assert idx.dtype == np.uint32, idx.dtype
    assert np.all(np.diff(logits.astype(np.float32), axis=-1) <= 0), "top-k not sorted descending"
    dump = subprocess.run(["h5dump", "-y", "-w", "0", "-d", "/topk/logits", path], capture_output=True,
                          text=True, check=True).stdout
    nums = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?", dump[dump.index("DATA {") + 6:])]
    assert len(nums) == logits.size, (len(nums), logits.size)
    assert np.allclose(np.array(nums, dtype=np.float32), logits.reshape(-1).astype(np.float32), atol=1e-3, rtol=1e-3)
    print(f"h5py: {path}: logits {logits.shape} float16, indices {idx.shape} uint32, lse {lse.shape}; "
          f"k={attrs['k']}, vocab={attrs['vocab_size']}: OK")


def check_checkpoint(ckpt, val_bin, n_windows, seq_len, expected_ce):
    """transformers loads the checkpoint, and its mean next-token CE over the first n_windows
    windows of val_bin (llm.c .bin, uint16) equals the val CE student-train printed."""
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.eval()
    header = np.fromfile(val_bin, dtype=np.int32, count=256)
    toks = np.fromfile(val_bin, dtype=np.uint16, offset=1024, count=int(header[2])).astype(np.int64)
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(n_windows):
            x = torch.tensor(toks[w * seq_len: w * seq_len + seq_len + 1][None, :])
            out = model(x[:, :-1]).logits[0]
            total += torch.nn.functional.cross_entropy(out, x[0, 1:], reduction="sum").item()
            count += seq_len
    ce = total / count
    print(f"transformers {transformers.__version__}: {ckpt} loads; val CE {ce:.6f} vs student-train {expected_ce:.6f}")
    assert abs(ce - expected_ce) < 1e-4 * max(1.0, abs(ce)), (ce, expected_ce)


if __name__ == "__main__":
    check_shard(sys.argv[1])
    check_checkpoint(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
    print("gpu_check: all OK")
