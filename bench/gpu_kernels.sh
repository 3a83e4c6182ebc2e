#!/usr/bin/env bash
# GPU checks for fastpipe.kernels alone (bench/gpu_check.sh runs these tests among all gpu tests).
# Usage: bench/gpu_kernels.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out"
unset TRITON_INTERPRET
python -m pytest -m gpu tests/kernels -q
python -m fastpipe.bench.kernels --json "$out/kernels.json"
