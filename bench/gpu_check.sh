#!/usr/bin/env bash
# GPU check: build in place, run the gpu-marked tests, run GPU benchmarks, print a table.
# Budget: must finish in 8 minutes on the GPU host (one H200, offline).
#
# To add a benchmark, append one line to CHECKS below: "name|timeout_s|command".
# Each command's last line starting with "JSON " is kept for the summary table.
set -euo pipefail
cd "$(dirname "$0")/.."

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
OUT_DIR="${OUT:-/tmp}/gpu_check"
mkdir -p "$OUT_DIR"
START=$(date +%s)

CHECKS=(
  "build|180|pip install --no-build-isolation --no-deps -e . -q"
  "gpu-tests|240|python -m pytest -m gpu -q -p no:cacheprovider"
  "copy_overlap|60|python bench/copy_overlap.py --runs 5"
  "kernels|150|python bench/kernels.py --json $OUT_DIR/kernels.json"
  "nccl|100|python bench/nccl_smoke.py --limit 30"
  # "my_bench|60|python bench/my_bench.py"   <- append new checks here
)

declare -a SUMMARY=()
FAILED=0
for entry in "${CHECKS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$entry"
  log="$OUT_DIR/$name.log"
  t0=$(date +%s)
  echo "=== $name: $cmd (limit ${limit}s)"
  if timeout "$limit" bash -c "$cmd" >"$log" 2>&1; then status=ok; else status="FAIL($?)"; FAILED=1; fi
  t1=$(date +%s)
  tail -n 15 "$log"
  json=$(grep '^JSON ' "$log" | tail -n 1 | cut -c6- || true)
  SUMMARY+=("$(printf '%-16s %-9s %5ss  %s' "$name" "$status" "$((t1 - t0))" "${json:0:150}")")
done

echo
echo "=== gpu_check summary ($(( $(date +%s) - START ))s total; logs in $OUT_DIR)"
printf '%-16s %-9s %6s  %s\n' check status time result
for line in "${SUMMARY[@]}"; do echo "$line"; done
exit "$FAILED"
