#!/usr/bin/env bash
# scripts/gpu_pack.sh [BUILD_DIR [NAME...]] — packs what the GPU machine needs into build-gpu-pack/bundle.tgz
# (ignored by git; carry build-gpu-pack with the device tool): the GPU tests, both tools, the
# benchmarks, h5dump and the zstd plugin under build-gpu-bin/, and the non-CUDA shared libraries they
# need under .gpulibs/ (../shared/tools/gpu-libs.sh). One compressed file keeps the transfer small.
# NAMEs limit the programs packed (each carries the kernels' device code, ~7 MB; the device tool takes
# 64 MB a call): e.g. scripts/gpu_pack.sh build test_gpu_train student-train.
# There: tar xzf build-gpu-pack/bundle.tgz && bash scripts/gpu_checks.sh build-gpu-bin .gpulibs
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true
out=build-gpu-bin
rm -rf "$out" .gpulibs build-gpu-pack
mkdir -p "$out/plugins" build-gpu-pack
if [ $# -gt 0 ]; then
  for b in "$@"; do cp "$build/bin/$b" "$out/"; done
else
  cp "$build"/bin/test_gpu_* "$build"/bin/teacher-dump "$build"/bin/student-train "$out/"
  for b in kl_bench grad_bench teacher_bench attn_bench topk_bench shard_bench student_bench moe_bench; do [ -x "$build/bin/$b" ] && cp "$build/bin/$b" "$out/"; done
fi
cp "$build/plugins/libh5zstd.so" "$out/plugins/"
cp /usr/bin/h5dump "$out/"
strip --strip-debug "$out"/* 2>/dev/null || true
../shared/tools/gpu-libs.sh .gpulibs $(find "$out" -type f) >/dev/null
tar czf build-gpu-pack/bundle.tgz "$out" .gpulibs
rm -rf .gpulibs
du -sh build-gpu-pack/bundle.tgz
