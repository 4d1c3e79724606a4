#!/usr/bin/env bash
# scripts/fuzz.sh — builds the libFuzzer targets of tests/fuzz/ with clang
# (-fsanitize=fuzzer,address,undefined) into build-fuzz/ and runs each one: first on its
# regression inputs (tests/fuzz/regress/<target>/, each must pass), then for a fixed number of
# runs from a fixed seed over its seed corpus. A crash, a leak, a timeout or a broken property
# fails the script; the input is left in build-fuzz/artifacts/ — copy it to
# tests/fuzz/regress/<target>/ with the fix.
#
#   scripts/fuzz.sh                      # every target, TOPKD_FUZZ_RUNS runs each (CI)
#   scripts/fuzz.sh shard -max_total_time=600    # one target, longer, extra libFuzzer flags
#
# OpenMP (the shard writer compresses chunks in parallel) through GCC's libgomp: clang -fopenmp=libgomp
# needs no libomp package.
#
# Runs per target are fixed (below; TOPKD_FUZZ_RUNS overrides them all): about ten seconds each on
# one core of the CI machine, two to four minutes for the ten (a loaded machine is slower). The targets differ a thousandfold in speed (a
# shard is written and fsynced per run, a safetensors header is parsed in memory).
set -euo pipefail
cd "$(dirname "$0")/.."

cc=${CC_FUZZ:-clang}
out=build-fuzz
jobs=$(nproc 2>/dev/null || echo 2)
targets=(safetensors yaml_config hf_config tokens flags megatron manifest shard jsonl tokenizer_json tokenizer_config jinja)
if [ $# -gt 0 ]; then
  targets=("$1")
  shift
fi

san="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
cflags="-g -O1 -std=c11 -fopenmp=libgomp -I. -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -DTKD_VERSION=\"fuzz\"
        $(pkg-config --cflags hdf5 libzstd yaml-0.1 libcjson jansson libpcre2-8 libutf8proc)"
libs="$(pkg-config --libs hdf5 libzstd yaml-0.1 libcjson jansson libpcre2-8 libutf8proc) -fopenmp=libgomp -lm -lpthread"

# The library sources the targets reach, instrumented for coverage (fuzzer-no-link) and ASan.
# (train_config.c takes the loss-variant names from kernels/loss/kl_loss.c.)
srcs=(common/*.c $(ls formats/*.c | grep -v h5zstd_plugin) student_train/train_config.c
      teacher_cache/dump_config.c kernels/loss/kl_loss.c)
rm -rf "$out/obj" && mkdir -p "$out/obj" "$out/artifacts"
echo "== fuzz: building ${#srcs[@]} sources with $cc"
objs=()
for src in "${srcs[@]}"; do
  objs+=("$out/obj/${src//\//_}.o")
  $cc -c $cflags $san -fsanitize=fuzzer-no-link "$src" -o "${objs[-1]}" &
  while [ "$(jobs -pr | wc -l)" -ge "$jobs" ]; do wait -n; done
done
while [ "$(jobs -pr | wc -l)" -gt 0 ]; do wait -n; done

runs_of() {
  case $1 in
    safetensors) echo 300000 ;; hf_config) echo 60000 ;; manifest) echo 100000 ;;
    tokens) echo 30000 ;; flags) echo 30000 ;; megatron) echo 100000 ;; yaml_config) echo 1500 ;; shard) echo 1000 ;;
    jsonl) echo 400000 ;;
    tokenizer_json) echo 3000 ;; tokenizer_config) echo 3000 ;; jinja) echo 10000 ;;
  esac
}

# Seeds: the small valid files and every broken file for that parser.
seeds() {
  case $1 in
    safetensors) ls tests/fuzz/corpus/*.safetensors tests/data/broken/st_* ;;
    yaml_config) ls configs/*.yaml configs/ablations/*.yaml tests/data/broken/cfg_* ;;
    hf_config) ls tests/data/hf/*.json tests/fixtures/hf/*/config.json tests/data/broken/hf_* ;;
    tokens) ls tests/fuzz/corpus/valid_tokens.* tests/data/broken/tok_* ;;
    flags) ls tests/fuzz/corpus/valid_flags.npy tests/data/broken/tok_flags_*.flags.npy ;;
    megatron) ls tests/data/broken/tok_mm_*.idx ;;
    manifest) ls tests/fuzz/corpus/manifest.yaml tests/data/broken/man_* ;;
    shard) ls tests/fuzz/corpus/*.recipe ;;
    jsonl) ls tests/fuzz/corpus/jsonl/* ;;
    tokenizer_json) ls tests/fuzz/corpus/tokenizer/*.json ;;
    tokenizer_config) ls tests/fuzz/corpus/tokenizer_config/*.json ;;
    jinja) ls tests/data/chat_templates/*.jinja tests/data/chat/*.jinja ;;
  esac
}

# The suppressions of the ctest ASan run (scripts/lsan.supp); UBSan stops at the first report.
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export LSAN_OPTIONS=suppressions=$PWD/scripts/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for t in "${targets[@]}"; do
  bin=$out/fuzz_$t
  $cc $cflags $san -fsanitize=fuzzer "tests/fuzz/fuzz_$t.c" "${objs[@]}" $libs -o "$bin"
  if [ -d "tests/fuzz/regress/$t" ] && [ -n "$(ls -A "tests/fuzz/regress/$t")" ]; then
    echo "== fuzz $t: regression inputs"
    "$bin" -runs=1 "tests/fuzz/regress/$t"/* >"$out/$t.regress.log" 2>&1 || { tail -40 "$out/$t.regress.log"; exit 1; }
  fi
  corpus=$out/corpus/$t
  rm -rf "$corpus" && mkdir -p "$corpus"
  for f in $(seeds "$t"); do cp "$f" "$corpus/${f//\//_}"; done
  runs=${TOPKD_FUZZ_RUNS:-$(runs_of "$t")}
  echo "== fuzz $t: $runs runs from $(ls "$corpus" | wc -l) seeds"
  if ! "$bin" -seed=1 -runs="$runs" -timeout=20 -rss_limit_mb=4096 -artifact_prefix="$out/artifacts/$t-" \
       "$@" "$corpus" >"$out/$t.log" 2>&1; then
    tail -60 "$out/$t.log"
    echo "fuzz: $t failed; the input is in $out/artifacts/ (add it to tests/fuzz/regress/$t/ with the fix)"
    exit 1
  fi
  grep -E "^Done|cov:" "$out/$t.log" | tail -1
done
