#!/usr/bin/env bash
# scripts/setup.sh — installs the Debian packages topkd builds against, when any is missing.
# Works as root; uses sudo otherwise. Safe to run again: it does nothing when all are there.
set -euo pipefail
# clang + libclang-rt-dev (libFuzzer and the sanitizer runtimes) build scripts/fuzz.sh's targets.
# libjansson-dev reads JSON Lines records: cJSON (our other JSON files) cannot hold a NUL in a string.
pkgs=(build-essential cmake pkg-config libhdf5-dev hdf5-tools libzstd-dev libyaml-dev
      libcmocka-dev libopenblas-openmp-dev libcjson-dev libjansson-dev libpcre2-dev libutf8proc-dev python3 clang
      libclang-rt-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
