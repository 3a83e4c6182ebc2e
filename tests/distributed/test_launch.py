"""``fastpipe.init_distributed``: torchrun restarts that meet again, and processes that exit cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastpipe

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}

# Rank 1 dies in the first attempt after a collective; torchrun restarts both ranks, which must
# find each other again (torch 2.13's launcher hands them the first attempt's store).
RESTARTED = """
import os
import torch
import torch.distributed as dist
import fastpipe

fastpipe.init_distributed()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.ones(1)
dist.all_reduce(t)
group = dist.new_group([0, 1], backend="gloo", use_local_synchronization=True)
dist.all_reduce(t, group=group)
if attempt == 0 and dist.get_rank() == 1:
    os._exit(1)
dist.barrier()
with open(f"attempt-{attempt}-rank-{dist.get_rank()}", "w") as out:  # the ranks share stdout
    out.write(f"{t.item():g}")
dist.destroy_process_group()
"""

# A daemon thread that needs the GIL once the script ended, as gloo's worker threads do after
# a collective: a later exit hook (hooks run last-registered first) releases it.
AT_EXIT = """
import atexit, sys, threading, time
from fastpipe.distributed.settle import settle_at_exit

before = atexit._ncallbacks()
settle_at_exit()
settle_at_exit()
assert atexit._ncallbacks() == before + 1, "registered once per process"
go = threading.Event()

def late():
    go.wait()
    start = time.perf_counter()
    while time.perf_counter() - start < 0.02:  # 20 ms holding the GIL; the interpreter ends first without the hook
        pass
    open(sys.argv[1], "w").write("ran")

threading.Thread(target=late, daemon=True).start()
atexit.register(go.set)
"""


def torchrun(script: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args, str(script)],
        cwd=script.parent,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a launcher past its time is killed with its ranks
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun over {timeout:g} s\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_restarted_group_meets_again(tmp_path: Path) -> None:
    script = tmp_path / "restarted.py"
    script.write_text(textwrap.dedent(RESTARTED))
    done = torchrun(script, "--max-restarts", "1")
    assert done.returncode == 0, done.stderr[-4000:]
    finished = {path.name: path.read_text() for path in tmp_path.glob("attempt-*")}
    assert finished == {"attempt-1-rank-0": "4", "attempt-1-rank-1": "4"}


def test_outside_torchrun_it_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK is not set: launch the script with `torchrun"):
        fastpipe.init_distributed()


def test_the_exit_hook_lets_a_thread_that_needs_the_gil_finish(tmp_path: Path) -> None:
    script, mark = tmp_path / "at_exit.py", tmp_path / "mark"
    script.write_text(textwrap.dedent(AT_EXIT))
    done = subprocess.run([sys.executable, str(script), str(mark)], env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert mark.read_text() == "ran"
