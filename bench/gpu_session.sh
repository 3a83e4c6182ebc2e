#!/usr/bin/env bash
# The whole GPU check in one call, from the repository root of a fresh GPU host:
#
#     bash bench/gpu_session.sh          # allow it 540 s; results land in $OUT/gpu_check
#
# Prints the host's facts, then runs bench/gpu_check.sh (build; the device-thread and placement
# tests; the Pipe-on-GPU bench; the kernel tests; a kernel timing table; NCCL smoke;
# `fastpipe bench --quick`), most valuable first, under one global deadline of
# GPU_CHECK_DEADLINE seconds (default 420), so it ends inside 7 minutes even if a step hangs.
# Files land flat in $OUT/gpu_check (see gpu_check.sh).
set -u
cd "$(dirname "$0")/.."
echo "=== host"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 4
python -c "import sys, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
exec bash bench/gpu_check.sh
