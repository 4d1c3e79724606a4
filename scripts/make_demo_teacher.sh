#!/usr/bin/env bash
# scripts/make_demo_teacher.sh — trains the demo's teacher from scratch with student-train in
# CE-only mode (configs/student-demo-teacher.yaml) and copies its weights to data/demo-teacher/
# (config.json + model.safetensors, a Hugging Face checkpoint directory).
# About 20 minutes on two cores (OMP_NUM_THREADS=1 when the machine is shared); scripts/demo.sh
# uses the committed result.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TOPKD_BIN:-build/bin}
"$bin/student-train" --config configs/student-demo-teacher.yaml --overwrite "$@"
ckpt=demo-out/runs/demo-teacher/checkpoint
mkdir -p data/demo-teacher
cp "$ckpt/config.json" "$ckpt/model.safetensors" data/demo-teacher/
echo "teacher weights: data/demo-teacher/ ($(du -sh data/demo-teacher | cut -f1))"
