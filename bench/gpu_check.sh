#!/usr/bin/env bash
# GPU check: build in place, then the checks in the order of what their figures are worth, each
# under its own limit, all under one deadline; prints a table.
#
# One global deadline (GPU_CHECK_DEADLINE seconds, default 420): a lent GPU host gives 15 minutes
# in all, its start included, so one call of at most 540 s must return what matters most and
# leave time for a rerun. The step limits below sum to 420 s. Each step gets min(its own limit,
# time left) and is killed at the end of it, so a hanging step costs its limit, never the run.
# A step that fails says why: timed out, or its exit code and the last lines of its output.
#
# The order, most valuable first:
#   1. build;
#   2. the device-thread and placement tests (every gpu test outside tests/kernels), before Triton
#      compiles anything cold;
#   3. pipe_gpu: Pipe(x)+backward on cuda:0 x2 against gradient accumulation, memory per mode;
#   4. the kernel tests (gpu-marked tests/kernels);
#   5. one kernel timing table against eager (python -m fastpipe.bench.kernels);
#   6. the NCCL smoke test;
#   7. `fastpipe bench --quick`, with what is left.
#
# Output, flat and small, in $OUT/gpu_check (default /tmp/gpu_check), at most 8 files:
#   check.log        every step's output, one after the other (pytest's --durations included)
#   summary.json     one record per step: name, status, seconds, reason, JSON result
#   hang_dump.txt    stacks of all threads of a gpu test that ran past its limit (if any)
#   junit_pipe.xml, junit_kernels.xml   the two test steps, test by test
#   pipe_gpu.json    the Pipe-on-GPU bench
#   bench.json, bench_results.md   `fastpipe bench --quick` (its PNG charts stay on the host)
#
# To add a benchmark, add one line to CHECKS below: "name|limit_s|command", and take its
# seconds from another step's limit. A command's last line starting with "JSON " is its result
# for the summary.
set -uo pipefail
cd "$(dirname "$0")/.."

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
OUT_DIR="${OUT:-/tmp}/gpu_check"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/check.log"
SUMMARY_JSON="$OUT_DIR/summary.json"
: >"$LOG"
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_DEADLINE:-420}))
# gpu tests: a per-test limit with all threads' stacks (tests/conftest.py).
export FASTPIPE_GPU_TEST_TIMEOUT="${FASTPIPE_GPU_TEST_TIMEOUT:-60}"
export FASTPIPE_HANG_DUMP="$OUT_DIR/hang_dump.txt"

PYTEST="python -m pytest -m gpu -q -p no:cacheprovider -p no:timeout -rfE --durations=15"
CHECKS=(
  "build|60|pip install --no-build-isolation --no-deps -e . -q"
  "gpu-pipe-tests|80|$PYTEST --ignore=tests/kernels --junitxml=$OUT_DIR/junit_pipe.xml"
  "pipe_gpu|45|python bench/pipe_gpu.py --json $OUT_DIR/pipe_gpu.json"
  "gpu-kernel-tests|80|$PYTEST tests/kernels --junitxml=$OUT_DIR/junit_kernels.xml"
  "kernel-table|35|python -m fastpipe.bench.kernels --no-compile"
  "nccl|30|python bench/nccl_smoke.py --limit 9"
  # The suite users run: e2e, schedules, distributed, copy, kernels, memory, quick sizes, in what is left.
  # Its PNGs stay on the host (the output stays at most 8 files); the JSON and the markdown table are copied.
  "bench|90|fastpipe bench --quick --no-progress --out /tmp/fastpipe_bench; rc=\$?; cp /tmp/fastpipe_bench/bench.json $OUT_DIR/bench.json; cp /tmp/fastpipe_bench/results.md $OUT_DIR/bench_results.md; exit \$rc"
)
# Kernel tuning needs ~4 more minutes and the Liger-Kernel wheel, so it runs as a command of
# its own (docs/gpu.md): `python bench/kernel_tune.py --budget 200 --json $OUT/kernel_tune.json`.

declare -a ROWS=()
RECORDS=""
FAILED=0
for entry in "${CHECKS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$entry"
  left=$((DEADLINE - $(date +%s)))
  if ((left < 5)); then
    status="SKIPPED" reason="global deadline reached" secs=0 json=""
    FAILED=1
  else
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit}s): $cmd" | tee -a "$LOG"
    step_log=$(mktemp)
    t0=$(date +%s)
    # SIGTERM at the limit, SIGKILL 5 s later: a hang cannot outlive its slot.
    timeout -k 5 "$limit" bash -c "$cmd" >"$step_log" 2>&1
    rc=$?
    secs=$(($(date +%s) - t0))
    cat "$step_log" >>"$LOG"
    tail -n 12 "$step_log"
    json=$(grep '^JSON ' "$step_log" | tail -n 1 | cut -c6-)
    if ((rc == 0)); then
      status="ok" reason=""
    else
      FAILED=1
      if ((rc == 124 || rc == 137)); then
        status="TIMEOUT" reason="killed after ${limit}s (see hang_dump.txt / check.log for stacks)"
      else
        why=$(grep -E 'Error|error:|FAILED|Timeout|Killed' "$step_log" | tail -n 1)
        [[ -z "$why" ]] && why=$(grep -v '^\s*$' "$step_log" | tail -n 1)
        status="FAIL" reason="exit $rc: ${why:0:200}"
      fi
    fi
    rm -f "$step_log"
  fi
  ROWS+=("$(printf '%-16s %-8s %4ss  %s' "$name" "$status" "$secs" "${reason:-${json:0:150}}")")
  rec=$(python3 -c 'import json,sys; a=sys.argv; print(json.dumps({"name": a[1], "status": a[2], "seconds": int(a[3]),
      "reason": a[4], "result": json.loads(a[5]) if a[5] else None}))' "$name" "$status" "$secs" "${reason:-}" "${json:-}" \
      2>/dev/null || echo "{\"name\": \"$name\", \"status\": \"$status\"}")
  RECORDS="${RECORDS:+$RECORDS,}$rec"
done

echo "[$RECORDS]" >"$SUMMARY_JSON"
echo
echo "=== gpu_check summary ($(($(date +%s) - START))s total; files in $OUT_DIR)"
printf '%-16s %-8s %5s  %s\n' check status time "result / why it failed"
for row in "${ROWS[@]}"; do echo "$row"; done
[[ -s "$FASTPIPE_HANG_DUMP" ]] && { echo "--- hang dump (head)"; head -n 60 "$FASTPIPE_HANG_DUMP"; }
exit "$FAILED"
