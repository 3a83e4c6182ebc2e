#!/usr/bin/env bash
# The whole GPU check in one call, from the repository root of a fresh GPU host:
#
#     bash bench/gpu_session.sh          # allow it 540 s; results land in $OUT/gpu_check
#
# Prints the host's facts, then runs bench/gpu_check.sh: the library probe, the build, the core
# runtime and Pipe tests, stream stress and gradient equality, NCCL on one rank, the kernel tests,
# the Pipe-on-GPU bench, the CLI tests, under one deadline of GPU_CHECK_DEADLINE seconds (default
# 460), so that with about 60 s of set-up the call ends inside 540 s even if a step hangs.
# Everything a step finished is in $OUT/gpu_check/steps.jsonl at once (see gpu_check.sh).
set -u
cd "$(dirname "$0")/.."
echo "=== host"
timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 4
exec bash bench/gpu_check.sh
