#!/usr/bin/env bash
# scripts/gpu_checks.sh BIN_DIR [LIB_DIR] — everything that needs the GPU machine, in one go:
# the GPU tests (CUDA vs CPU), h5py reading a shard through the zstd plugin, and transformers
# loading a checkpoint written by student-train on the GPU (CONTRIBUTING.md, "Running on a GPU").
# BIN_DIR holds test_gpu_*, teacher-dump, student-train, h5dump and plugins/libh5zstd.so;
# LIB_DIR the non-CUDA libraries they need (../shared/tools/gpu-libs.sh), if any.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(cd "$1" && pwd)
libs=${2:+$(cd "$2" && pwd)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { LD_LIBRARY_PATH=${libs:+$libs:}/usr/local/cuda/lib64 "$@"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
failed=0
export TKD_SOURCE_DIR=$PWD # the GPU tests read fixtures and the demo data from this tree
for t in "$bin"/test_gpu_*; do
  echo "== $(basename "$t")"
  if run "$t" > "$tmp/test.log" 2>&1; then
    tail -n 3 "$tmp/test.log"
  else
    echo "FAILED (exit $?)"; failed=1
    # what failed and why, not only the summary: every cmocka error line and its context
    grep -n -B2 -A4 -E "^\[  (ERROR|FAILED) +\]|error: |Failure" "$tmp/test.log" | head -n 80
  fi
done

# test_gpu_kl_loss and test_gpu_kl_loss_paths run their groups over the loss's policies themselves (our GEMM off, gradients on
# cuBLAS, both ours), so no variable loop here

echo "== teacher-dump --set device=cuda (the CLI end to end on the GPU)"
run "$bin/teacher-dump" --config configs/teacher-demo.yaml -q --set device=cuda \
  --set output.dir="$tmp/gpu-cache" --set data.max_sequences=64 --set cache.shard_sequences=32 || failed=1
ls "$tmp/gpu-cache"

echo "== h5py and transformers"
run "$bin/teacher-dump" --config configs/teacher-demo.yaml -q --set teacher.path=data/demo-teacher \
  --set output.dir="$tmp/cache" --set data.max_sequences=8 --set cache.shard_sequences=8 --set cache.k=8
# a checkpoint trained on the GPU (16 CE steps from the demo teacher), measured on the CPU (fp32, as
# transformers computes) and by transformers
run "$bin/student-train" --config configs/student-demo.yaml -q --set run.dir="$tmp/runs" --set run.name=gpu \
  --set device=cuda --set model.init=hf --set model.path=data/demo-teacher --set data.cache= --set data.val_cache= \
  --set kd.alpha=0 --set "data.tokens=[data/brown-train.bin]" --set "data.val_tokens=[data/brown-val.bin]" \
  --set data.seq_len=64 --set train.max_steps=16 --set train.eval_batches=1 > /dev/null
ckpt="$tmp/runs/gpu/checkpoint"
ce=$(run "$bin/student-train" --config configs/student-demo.yaml -q --set run.dir="$tmp/runs" --set run.name=t \
  --set device=cpu --set model.init=hf --set model.path="$ckpt" --set train.eval_only=true --set data.cache= \
  --set data.val_cache= --set kd.alpha=0 --set "data.tokens=[data/brown-val.bin]" \
  --set "data.val_tokens=[data/brown-val.bin]" --set data.seq_len=64 --set train.batch_size=4 --set train.eval_batches=1 |
  sed -n 's/^RESULT val_ce=\([^ ]*\).*/\1/p')
# a Qwen3 student (q/k norms, head_dim 32 ≠ D/H 16) made by student-train on the GPU: transformers must
# load it as Qwen3ForCausalLM and measure the same validation CE
run "$bin/student-train" --config configs/student-demo.yaml -q --set run.dir="$tmp/runs" --set run.name=q3 \
  --set device=cuda --set model.arch=qwen3 --set model.head_dim=32 --set model.vocab_size=4096 --set data.cache= \
  --set data.val_cache= --set kd.alpha=0 --set "data.tokens=[data/brown-train.bin]" \
  --set "data.val_tokens=[data/brown-val.bin]" --set data.seq_len=64 --set train.max_steps=16 \
  --set train.eval_batches=1 > /dev/null
q3ce=$(run "$bin/student-train" --config configs/student-demo.yaml -q --set run.dir="$tmp/runs" --set run.name=q3e \
  --set device=cpu --set model.init=hf --set model.path="$tmp/runs/q3/checkpoint" --set train.eval_only=true \
  --set data.cache= --set data.val_cache= --set kd.alpha=0 --set "data.tokens=[data/brown-val.bin]" \
  --set "data.val_tokens=[data/brown-val.bin]" --set data.seq_len=64 --set train.batch_size=4 --set train.eval_batches=1 |
  sed -n 's/^RESULT val_ce=\([^ ]*\).*/\1/p')
# h5dump needs our libraries, python must not see them (torch brings its own)
mkdir -p "$tmp/path"
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$libs" "$bin/h5dump" > "$tmp/path/h5dump"
chmod +x "$tmp/path/h5dump"
PATH="$tmp/path:$PATH" HDF5_PLUGIN_PATH="$bin/plugins" \
  python3 scripts/gpu_check.py "$tmp/cache/shard-00000.h5" "$ckpt" data/brown-val.bin 4 64 "$ce" || failed=1
PATH="$tmp/path:$PATH" HDF5_PLUGIN_PATH="$bin/plugins" \
  python3 scripts/gpu_check.py "$tmp/cache/shard-00000.h5" "$tmp/runs/q3/checkpoint" data/brown-val.bin 4 64 "$q3ce"
exit $failed
