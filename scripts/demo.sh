#!/usr/bin/env bash
# scripts/demo.sh — set up, build, then run the whole pipeline on the embedded default:
#   1. the teacher: a small Llama trained on the Brown Corpus by student-train in CE-only mode
#      (committed in data/demo-teacher/; --train-teacher trains it again, about 20 minutes);
#   2. teacher-dump: two caches of the same training windows, top-100 and top-20 + 80 tail draws,
#      plus the same two for the validation windows;
#   3. three students of one size, one init and one data order: CE only, KD on the top-100
#      cache (renorm), KD with the unbiased `sampled` variant on the top-20 + tail cache;
#   4. a table: validation CE / perplexity of the teacher and each student, bytes/token per cache.
# Everything lands in demo-out/ (removed first). CPU is enough; --device cuda runs the dumps on the
# GPU (auto: the GPU when one answers; the students stay on the CPU until GPU training lands).
set -euo pipefail
cd "$(dirname "$0")/.."
train_teacher=0
device=cpu
while [ $# -gt 0 ]; do
  case "$1" in
    --train-teacher) train_teacher=1 ;;
    --device) device=${2:-}; shift ;;
    --device=*) device=${1#--device=} ;;
    *) echo "usage: scripts/demo.sh [--train-teacher] [--device cpu|cuda|auto]" >&2; exit 2 ;;
  esac
  shift
done
case "$device" in cpu|cuda|auto) ;; *) echo "demo: --device takes cpu, cuda or auto" >&2; exit 2 ;; esac

./scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)"
bin=build/bin
rm -rf demo-out
mkdir -p demo-out
start=$(date +%s)

if [ "$train_teacher" = 1 ] || [ ! -f data/demo-teacher/model.safetensors ]; then
  echo "== 1. training the teacher (CE only) =="
  TOPKD_BIN=$bin ./scripts/make_demo_teacher.sh -q
fi

train_seqs=2048   # training windows of 64 tokens each the students see (one epoch of 128 steps)
val_seqs=256      # validation windows every model is scored on
echo "== 2. teacher-dump: caches of $train_seqs training and $val_seqs validation windows =="
dump() { # name k tail_samples data max_sequences
  "$bin/teacher-dump" --config configs/teacher-demo.yaml --set output.dir=demo-out/$1 --set device=$device \
    --set cache.k=$2 --set cache.tail_samples=$3 --set "data.paths=[$4]" --set data.max_sequences=$5 \
    | tee demo-out/$1.log
}
dump cache-top100 100 0 data/brown-train.bin $train_seqs
dump val-top100 100 0 data/brown-val.bin $val_seqs
dump cache-top20-tail80 20 80 data/brown-train.bin $train_seqs
dump val-top20-tail80 20 80 data/brown-val.bin $val_seqs

echo "== 3. students =="
eval_batches=$((val_seqs / 16))
student() { # name extra --set arguments...
  local name=$1; shift
  "$bin/student-train" --config configs/student-demo.yaml -q --set run.name=$name \
    --set train.eval_batches=$eval_batches "$@" | tee demo-out/$name.log
}
student teacher-eval --set model.init=hf --set model.path=data/demo-teacher --set train.eval_only=true \
  --set data.cache= --set data.val_cache= --set kd.alpha=0 --set data.seq_len=64 \
  --set "data.tokens=[data/brown-train.bin]" --set "data.val_tokens=[data/brown-val.bin]"
student ce-only --set data.cache= --set data.val_cache= --set kd.alpha=0 --set data.seq_len=64 \
  --set "data.tokens=[data/brown-train.bin]" --set "data.val_tokens=[data/brown-val.bin]" \
  --set data.max_sequences=$train_seqs
student kd-top100-renorm --set data.cache=demo-out/cache-top100 --set data.val_cache=demo-out/val-top100 \
  --set kd.variant=renorm
student kd-top20-tail80-sampled --set data.cache=demo-out/cache-top20-tail80 \
  --set data.val_cache=demo-out/val-top20-tail80 --set kd.variant=sampled

echo "== 4. results (validation: $val_seqs windows of 64 tokens of data/brown-val.bin) =="
python3 scripts/demo_table.py demo-out
echo "demo: done in $(( $(date +%s) - start )) s after the build; outputs in demo-out/"
