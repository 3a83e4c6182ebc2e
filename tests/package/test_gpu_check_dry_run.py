"""bench/gpu_check.sh, dry-run on CPU: its order, its budget, and what a kill leaves behind.

A lent GPU host gives one 540 s call with about 60 s of set-up, and may be taken back mid-run,
so the check must put what matters first, fit its deadline, and have written every finished
step's record before the next one starts.
"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
ORDER = ["probe", "build", "core", "streams", "nccl", "kernels", "pipe_gpu", "cli"]
CALL_S, SETUP_S = 540, 60

pytestmark = pytest.mark.time_limit(60)


def run(tmp_path, **env):
    full = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_DRY_RUN": "1", **env}
    return subprocess.Popen(["bash", str(SCRIPT)], env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def records(tmp_path):
    lines = (tmp_path / "gpu_check" / "steps.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_steps_run_in_order_within_the_budget(tmp_path):
    proc = run(tmp_path)
    out = proc.communicate(timeout=50)[0].decode()
    assert proc.returncode == 0, out
    steps = records(tmp_path)
    assert [s["name"] for s in steps] == ORDER
    assert all(s["status"] == "dry-run" for s in steps)
    # The limits sum to no more than the deadline, and deadline + set-up fit one call.
    assert sum(s["limit_s"] for s in steps) + SETUP_S <= CALL_S
    # Every test file a step names exists (a renamed file would silently test nothing).
    log = (tmp_path / "gpu_check" / "check.log").read_text()
    named = set(re.findall(r"tests/[\w/]+\.py", log))
    assert "tests/runtime/test_gpu_stream_stress.py" in named and "tests/pipe/test_gpu_gradients.py" in named
    assert [p for p in named if not (ROOT / p).exists()] == []
    # Per step, pytest is verbose (-v names each test as it ends), and no 2-ranks-on-one-GPU case is run.
    assert " -q " not in log and "-v" in log
    assert len(list((tmp_path / "gpu_check").iterdir())) <= 8


def test_a_kill_mid_run_keeps_the_finished_steps(tmp_path):
    proc = run(tmp_path, GPU_CHECK_DRY_RUN_STEP_S="1")
    path = tmp_path / "gpu_check" / "steps.jsonl"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not path.exists() or len(path.read_text().splitlines()) < 2):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # as a host taken back: nothing can be flushed at the end
    proc.wait(timeout=10)
    steps = records(tmp_path)
    assert 2 <= len(steps) < len(ORDER)
    assert [s["name"] for s in steps] == ORDER[: len(steps)]


def test_the_deadline_skips_what_is_left_and_says_so(tmp_path):
    proc = run(tmp_path, GPU_CHECK_DRY_RUN_STEP_S="1", GPU_CHECK_DEADLINE="7")
    proc.communicate(timeout=50)
    steps = records(tmp_path)
    assert [s["name"] for s in steps] == ORDER
    assert steps[-1]["status"] == "SKIPPED" and steps[0]["status"] == "dry-run"
    assert proc.returncode != 0


def test_probe_reports_versions_and_every_at_risk_call():
    # The probe is the first step on the GPU host: it must run (and say what is missing) anywhere.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["python", str(ROOT / "bench" / "gpu_probe.py")], env=env, capture_output=True, text=True,
                          timeout=50)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("JSON ")][-1][5:])
    assert {"torch", "triton", "transformers", "python"} <= set(result["versions"])
    assert set(result["probes"]) == {
        "Backend.abort",
        "addmm(out_dtype=)",
        "dcp save/async_save/load(no_dist=)",
        "FileSystemWriter(overwrite=)",
        "transformers create_causal_mask",
    }
