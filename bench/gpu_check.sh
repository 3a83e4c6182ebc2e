#!/usr/bin/env bash
# GPU check: the library probe, the build, then the tests in the order of what their results are
# worth, each under its own limit, all under one deadline.
#
# The budget: a lent GPU host gives 15 minutes in all, its start included, and one call of at most
# 540 s, of which about 60 s go to setting up. So the steps run under one deadline
# (GPU_CHECK_DEADLINE, default 460 s) and their limits sum to it (tests/package/test_gpu_check_dry_run.py
# holds them to that). Each step gets min(its own limit, time left) and is killed at the end of it,
# so a hanging step costs its limit, never the run.
#
# The order, most valuable first (docs/gpu.md says what each result means):
#   probe    library versions and which at-risk calls exist (bench/gpu_probe.py)
#   build    pip install --no-build-isolation --no-deps -e .
#   core     the runtime and Pipe tests on CUDA: fastpipe._C's streams, the deferred and batched
#            weight gradients, Pipe on cuda:0 x2 and cpu+cuda:0, replay, RNG state
#   streams  stream stress on start_transfer, gradient equality per schedule, the sync audit
#   nccl     DistributedPipe on one NCCL rank (two ranks on one GPU are refused by NCCL)
#   kernels  the gpu-marked Triton kernel tests
#   pipe_gpu the Pipe-on-GPU bench: speed and memory per mode
#   cli      `fastpipe train`/`bench` on the GPU and fit (they compile Triton cold, so last)
#
# What survives a kill at any second, in $OUT/gpu_check (at most 8 files, flat):
#   check.log      every step's output, written live (pytest -v names each test as it ends)
#   steps.jsonl    one record per finished step, appended as the step ends: name, status,
#                  seconds, limit_s, reason, result (a command's last "JSON " line)
#   hang_dump.txt  stacks of all threads of a gpu test that ran past its limit (if any)
#   sync_audit.txt the host syncs one bf16 zb-h1 step makes, by file:line
#   pipe_gpu.json  the Pipe-on-GPU bench
#   step.log       the output of the step running now (or last)
#
# GPU_CHECK_DRY_RUN=1: no build, no CUDA; every step runs `sleep $GPU_CHECK_DRY_RUN_STEP_S`
# (default 0) instead of its command, and records status "dry-run". CI uses it to check the
# order, the budget and what a kill leaves.
set -uo pipefail
cd "$(dirname "$0")/.."

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
# Python buffers a pipe's output in blocks: unbuffered, a killed step has written what it printed.
export PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-/tmp}/gpu_check"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/check.log"
STEPS="$OUT_DIR/steps.jsonl"
STEP_LOG="$OUT_DIR/step.log"
: >"$LOG"
: >"$STEPS"
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_DEADLINE:-460}))
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
# gpu tests: a per-test limit with all threads' stacks (tests/conftest.py).
export FASTPIPE_GPU_TEST_TIMEOUT="${FASTPIPE_GPU_TEST_TIMEOUT:-60}"
export FASTPIPE_HANG_DUMP="$OUT_DIR/hang_dump.txt"
export FASTPIPE_SYNC_AUDIT="$OUT_DIR/sync_audit.txt"

# -v: a run cut short still names every test that finished; -x is left out so one failure does
# not hide the others (a hang stops the session by itself, tests/conftest.py).
PYTEST="python -m pytest -m gpu -v -p no:cacheprovider -p no:timeout -rfE --durations=10"
CORE="tests/runtime/test_c_runtime_gpu.py tests/runtime/test_deferred_wgrad.py tests/runtime/test_wgrad.py
  tests/pipe/test_gpu.py tests/runtime/test_replay.py tests/pipe/test_misuse.py tests/rng/test_rng_state.py"
STREAMS="tests/runtime/test_gpu_stream_stress.py tests/pipe/test_gpu_gradients.py tests/memory/test_model_gpu.py
  tests/distributed/test_host_syncs_gpu.py tests/runtime/test_offload_gpu.py tests/memory/test_accounting.py
  tests/memory/test_default_checkpoint.py"
CLI="tests/cli/test_train_bench_gpu.py tests/asynchronous/test_fit.py tests/asynchronous/test_fit_deferred_batch_norm.py"
# "name|limit_s|command", in the order they run. The limits sum to the default deadline.
CHECKS=(
  "probe|20|python bench/gpu_probe.py"
  "build|60|pip install --no-build-isolation --no-deps -e . -q"
  "core|90|$PYTEST ${CORE//$'\n'/ }"
  "streams|80|$PYTEST ${STREAMS//$'\n'/ }"
  # One NCCL rank: CUDA + NCCL start-up and a spawn take 7-10 s on a cold host, so 25 s a case.
  "nccl|40|python bench/nccl_smoke.py --limit 25"
  "kernels|75|$PYTEST tests/kernels"
  "pipe_gpu|45|python bench/pipe_gpu.py --json $OUT_DIR/pipe_gpu.json"
  "cli|50|$PYTEST $CLI"
)
# Not in the 540 s call (run them on their own when time is left, docs/gpu.md):
#   python -m fastpipe.bench.kernels --no-compile; fastpipe bench --quick; bench/kernel_tune.py.

CURRENT=""
record() {  # name status seconds limit reason json: one JSONL line, appended at once
  python -c 'import json,sys; a=sys.argv; print(json.dumps({"name": a[1], "status": a[2], "seconds": int(a[3]),
      "limit_s": int(a[4]), "reason": a[5], "result": json.loads(a[6]) if a[6] else None}))' "$@" >>"$STEPS" 2>/dev/null ||
    echo "{\"name\": \"$1\", \"status\": \"$2\", \"seconds\": $3, \"limit_s\": $4}" >>"$STEPS"
}
# Stopped from outside (SIGTERM/SIGINT; SIGKILL cannot be caught): the step cut short says so.
on_stop() {
  [[ -n "$CURRENT" ]] && record "$CURRENT" "KILLED" "$(($(date +%s) - t0))" 0 "the whole check was stopped" ""
  exit 143
}
trap on_stop TERM INT

declare -a ROWS=()
FAILED=0
for entry in "${CHECKS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$entry"
  shown=$cmd
  ((DRY_RUN)) && cmd="sleep ${GPU_CHECK_DRY_RUN_STEP_S:-0}" shown="(dry run) sleep instead of: $shown"
  left=$((DEADLINE - $(date +%s)))
  if ((left < 5)); then
    status="SKIPPED" reason="global deadline reached" secs=0 json=""
    FAILED=1
  else
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit}s): $shown" | tee -a "$LOG"
    CURRENT=$name
    t0=$(date +%s)
    # SIGTERM at the limit, SIGKILL 5 s later, to the step's whole process group: a hang cannot
    # outlive its slot. Its output goes live into check.log and step.log.
    timeout -k 5 "$limit" bash -c "$cmd" 2>&1 | tee "$STEP_LOG" >>"$LOG"
    rc=${PIPESTATUS[0]}
    CURRENT=""
    secs=$(($(date +%s) - t0))
    tail -n 12 "$STEP_LOG"
    json=$(grep '^JSON ' "$STEP_LOG" | tail -n 1 | cut -c6-)
    if ((rc == 0)); then
      status="ok" reason=""
      ((DRY_RUN)) && status="dry-run" reason="not run: GPU_CHECK_DRY_RUN"
    else
      FAILED=1
      if ((rc == 124 || rc == 137)); then
        status="TIMEOUT" reason="killed after ${limit}s (see hang_dump.txt / check.log for stacks)"
      else
        why=$(grep -E 'Error|error:|FAILED|Timeout|Killed' "$STEP_LOG" | tail -n 1)
        [[ -z "$why" ]] && why=$(grep -v '^\s*$' "$STEP_LOG" | tail -n 1)
        status="FAIL" reason="exit $rc: ${why:0:200}"
      fi
    fi
  fi
  record "$name" "$status" "$secs" "$limit" "${reason:-}" "${json:-}"
  ROWS+=("$(printf '%-10s %-8s %4ss  %s' "$name" "$status" "$secs" "${reason:-${json:0:150}}")")
done

echo
echo "=== gpu_check summary ($(($(date +%s) - START))s total; files in $OUT_DIR)"
printf '%-10s %-8s %5s  %s\n' check status time "result / why it failed"
for row in "${ROWS[@]}"; do echo "$row"; done
[[ -s "$FASTPIPE_SYNC_AUDIT" ]] && { echo "--- sync audit (head)"; head -n 30 "$FASTPIPE_SYNC_AUDIT"; }
[[ -s "$FASTPIPE_HANG_DUMP" ]] && { echo "--- hang dump (head)"; head -n 60 "$FASTPIPE_HANG_DUMP"; }
exit "$FAILED"
