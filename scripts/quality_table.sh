#!/usr/bin/env bash
# scripts/quality_table.sh — issue 24's quality table: how much of dense distillation's gain each
# divergence keeps on a top-100 cache, the sampled cache keeps, at alpha 0.5 and 1, with the whole
# pipeline on one device:
#   1. the teacher: data/demo-teacher (a Llama trained from scratch on the Brown Corpus by
#      student-train, CE only: scripts/make_demo_teacher.sh; the corpus tokenized by teacher-dump
#      tokenize with data/tokenizer-4096.json, data/README.md);
#   2. teacher-dump: a top-100 cache and a top-20 + 80 tail draws cache of the training windows,
#      and the same two of the validation windows;
#   3. student-train sweep: CE only; fkl, rkl, jsd (beta 0.5), skl, srkl (alpha 0.1) and tvd on the
#      top-100 cache (kd.variant tail: the stored LSE makes the tail bucket exact); fkl with the
#      unbiased sampled variant on the top-20 + 80 cache; dense online distillation from the
#      teacher itself (kd.teacher); each KD row at kd.alpha 0.5 and 1. The demo's student shape
#      (configs/student-demo.yaml), one seed and data order for all.
#   4. the table (scripts/quality_table.py): validation CE, and the gain over CE only as a fraction
#      of dense distillation's gain at the same alpha.
#   scripts/quality_table.sh [--device cpu|cuda] [--steps N] [--windows N] [--out DIR] [--dense-device D]
# --dense-device runs the dense rows on another device (the CPU where CUDA cannot run them).
set -euo pipefail
cd "$(dirname "$0")/.."
device=cpu dense_device= steps=512 windows=8192 out=demo-out/quality bin=${TOPKD_BIN:-build/bin}
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift ;;
    --dense-device) dense_device=$2; shift ;;
    --steps) steps=$2; shift ;;
    --windows) windows=$2; shift ;;
    --out) out=$2; shift ;;
    *) echo "usage: scripts/quality_table.sh [--device cpu|cuda] [--steps N] [--windows N] [--out DIR] [--dense-device D]" >&2
       exit 2 ;;
  esac
  shift
done
dense_device=${dense_device:-$device}
mkdir -p "$out/ablations"
val_windows=512

echo "== caches ($windows training windows of 64 tokens, $val_windows validation windows) =="
dump() { # name k tail_samples data max_sequences
  [ -f "$out/$1/manifest.yaml" ] && return 0
  "$bin/teacher-dump" --config configs/teacher-demo.yaml --set output.dir="$out/$1" --set device="$device" \
    --set cache.k="$2" --set cache.tail_samples="$3" --set "data.paths=[$4]" --set data.max_sequences="$5" -q
}
dump cache-top100 100 0 data/brown-train.bin "$windows"
dump val-top100 100 0 data/brown-val.bin "$val_windows"
dump cache-top20-tail80 20 80 data/brown-train.bin "$windows"
dump val-top20-tail80 20 80 data/brown-val.bin "$val_windows"

# One ablation file per row; every key a dotted "key: value" line (docs/student-train.md).
abl() { # name lines...
  local name=$1; shift
  printf '%s\n' "$@" > "$out/ablations/$name.yaml"
}
top100=("data.cache: $out/cache-top100" "data.val_cache: $out/val-top100")
abl ce-only "kd.alpha: 0" "data.cache: ''" "data.val_cache: ''" "data.seq_len: 64" \
  "data.tokens: [data/brown-train.bin]" "data.val_tokens: [data/brown-val.bin]" "data.max_sequences: $windows"
files=("$out/ablations/ce-only.yaml")
for a in 0.5 1; do
  for d in fkl rkl jsd skl srkl tvd; do
    abl "$d-top100-a$a" "${top100[@]}" "kd.variant: tail" "kd.divergence: $d" "kd.alpha: $a"
    files+=("$out/ablations/$d-top100-a$a.yaml")
  done
  abl "sampled-top20-tail80-a$a" "data.cache: $out/cache-top20-tail80" "data.val_cache: $out/val-top20-tail80" \
    "kd.variant: sampled" "kd.alpha: $a"
  abl "dense-a$a" "kd.teacher: data/demo-teacher" "kd.alpha: $a" "data.cache: ''" "data.val_cache: ''" \
    "data.seq_len: 64" "data.tokens: [data/brown-train.bin]" "data.val_tokens: [data/brown-val.bin]" \
    "data.max_sequences: $windows" "device: $dense_device"
  files+=("$out/ablations/sampled-top20-tail80-a$a.yaml" "$out/ablations/dense-a$a.yaml")
done

echo "== sweep: ${#files[@]} students of $steps steps =="
status=0
"$bin/student-train" sweep --config configs/student-demo.yaml "${files[@]}" --dir "$out/sweep" \
  --set device="$device" --set train.max_steps="$steps" --set train.eval_batches=32 \
  --set train.eval_interval=$((steps / 4)) || status=$?
python3 scripts/quality_table.py "$out/sweep/sweep.csv" | tee "$out/quality.md"
exit $status
