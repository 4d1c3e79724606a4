#!/usr/bin/env bash
# scripts/test.sh — install what is missing (Debian), build, run every test.
# Two builds: build/ (Release, CUDA backend when nvcc is found) and build-asan/ (Debug with
# AddressSanitizer + UndefinedBehaviorSanitizer, CPU only). GPU tests skip where no GPU answers.
# Then the parsers' libFuzzer targets run a fixed number of times each (scripts/fuzz.sh, about a
# minute).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

jobs=$(nproc 2>/dev/null || echo 2)
# Llama 3's tokenizer.json is fetched, not committed (tests/fixtures/tokenizer/README.md); without
# npm or the registry the script says so and test_tokenizer skips Llama 3.
tests/fixtures/tokenizer/fetch_llama3.sh build/fixtures/llama3
export TKD_LLAMA3_TOKENIZER=$PWD/build/fixtures/llama3
echo "== build (Release) =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs"
echo "== tests (Release) =="
ctest --test-dir build --output-on-failure -j "$jobs"

if [ "${TOPKD_SKIP_ASAN:-0}" != 1 ]; then
  echo "== build (Debug, ASan + UBSan) =="
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DTOPKD_SANITIZE=ON -DTOPKD_CUDA=OFF >/dev/null
  cmake --build build-asan -j "$jobs"
  echo "== tests (ASan + UBSan) =="
  # detect_leaks stays on: a leak fails the run. OpenBLAS/HDF5 keep a few global caches; those
  # are listed in scripts/lsan.supp with the reason.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  LSAN_OPTIONS=suppressions=$PWD/scripts/lsan.supp:print_suppressions=0 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j "$jobs" -LE slow
fi

if [ "${TOPKD_SKIP_FUZZ:-0}" != 1 ]; then
  echo "== fuzz (libFuzzer + ASan + UBSan, fixed runs) =="
  ./scripts/fuzz.sh
fi
