"""Every script in examples/ runs as its docstring says, from another folder, and does what it claims."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
EXAMPLES = REPO / "examples"


def _run(args: list[str], cwd: Path, timeout: float = 120) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _losses(stdout: str, pattern: str = r"step \d+: (?:pipe )?loss ([0-9.]+)") -> list[float]:
    return [float(m) for m in re.findall(pattern, stdout)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_example_is_tested_and_says_how_to_run_it() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == ["one_host.py", "own_model.py", "torchrun_pipeline.py", "unet_skips.py"]
    for name in scripts:
        assert f"examples/{name}" in (EXAMPLES / name).read_text().split('"""')[1], f"{name}: no run command"


def test_one_host_trains_like_the_plain_model(tmp_path: Path) -> None:
    out = _run([str(EXAMPLES / "one_host.py")], cwd=tmp_path)
    pipe = _losses(out, r"pipe loss ([0-9.]+)")
    plain = _losses(out, r"plain loss ([0-9.]+)")
    assert len(pipe) == 5 and pipe == pytest.approx(plain, rel=1e-5)
    assert pipe[-1] < pipe[0]
    assert "the pipeline trained the same weights as the plain model" in out


def test_torchrun_pipeline_trains_over_two_processes(tmp_path: Path) -> None:
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port())]
    out = _run([*torchrun, str(EXAMPLES / "torchrun_pipeline.py")], cwd=tmp_path)
    losses = _losses(out)
    assert len(losses) == 5  # printed by rank 0 only
    assert losses[-1] < losses[0]


def test_own_model_trains_and_round_trips_through_save_and_load(tmp_path: Path) -> None:
    out = _run([str(EXAMPLES / "own_model.py")], cwd=tmp_path)
    balance = re.search(r"balance \(layers per stage\): \[(\d+), (\d+)\]", out)
    assert balance and sum(map(int, balance.groups())) == 6  # embed, 4 blocks, head over two stages
    losses = _losses(out)
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "the saved weights give the plain model the pipeline's outputs" in out
    assert list(tmp_path.iterdir()) == []  # the checkpoint went to a temporary folder


def test_unet_skips_trains_like_the_plain_model_with_the_skips_across_stages(tmp_path: Path) -> None:
    out = _run([str(EXAMPLES / "unet_skips.py")], cwd=tmp_path)
    assert "skips e1: stage 0 -> stage 2" in out and "skips e2: stage 1 -> stage 2" in out
    pipe = _losses(out, r"pipe loss ([0-9.]+)")
    plain = _losses(out, r"plain loss ([0-9.]+)")
    assert len(pipe) == 5 and pipe == pytest.approx(plain, rel=1e-4)
    assert pipe[-1] < pipe[0]
    assert "the pipeline and the plain model predict the same masks" in out
