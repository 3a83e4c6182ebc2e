"""``torchrun -m fastpipe train`` on 2 gloo ranks: the one-process run's losses and weights, bit for bit.

Each rank holds one stage of a DistributedPipe; the arithmetic per stage is the one-process
Pipe's (same micro-batches, same dropout seeds, same AdamW on the same parameters), so the
losses and the final weights match exactly, also across a rank killed mid-run and the
group's restart by ``torchrun --max-restarts``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fp_tolerance import assert_close_reordered
from test_train_cli import TINY

from fastpipe.cli import main
from fastpipe.train.ranks import join, launched_by_torchrun

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # fastpipe train sets one thread per stage worker


def _torchrun(
    out: Path, *flags: str, ranks: int = 2, restarts: int = 0, kill: tuple[int, int] | None = None
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone -m fastpipe train`` with this tree's fastpipe, under a hard timeout.

    ``kill=(step, rank)``: rank ``rank`` SIGKILLs itself once, before step index ``step``
    (``tests/_kill_in_train.py``).
    """
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    if restarts:
        launcher += ["--max-restarts", str(restarts)]
    entry = ["-m", "fastpipe"] if kill is None else [str(ROOT / "tests" / "_kill_in_train.py"), *map(str, kill)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    full_env.pop("FASTPIPE_P2P", None)
    proc = subprocess.run(
        [*launcher, *entry, "train", *TINY, "--out", str(out), *flags],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _one_process(out: Path, *flags: str) -> dict:
    assert main(["train", *TINY, "--out", str(out), *flags]) == 0
    return dict(json.loads((out / "report.json").read_text()))


def _weights(folder: Path, step: int) -> dict[str, torch.Tensor]:
    """A one-file save's parameters, AdamW state and RNG state (the stream of the dropout seeds)."""
    saved = torch.load(folder / f"model-{step:06d}.pt", weights_only=False)
    return {
        "rng": saved["rng"],
        **{f"model.{k}": v for k, v in saved["model"].items()},
        **{
            f"optimizer.{name}.{key}": value
            for name, state in saved["optimizer"]["state"].items()
            for key, value in state.items()
        },
    }


def _sharded_weights(folder: Path, step: int) -> dict[str, torch.Tensor]:
    """The same of a sharded checkpoint (every rank's share; rank 0's RNG, which draws the seeds)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from fastpipe.checkpoint.commit import read_record, step_dir

    path = step_dir(str(folder), step)
    record = read_record(path)
    assert record is not None, f"{path} has no commit record"
    flat = _load_state_dict_from_keys(checkpoint_id=path)
    out: dict[str, torch.Tensor] = {"rng": record["rng"][0]["torch"]}
    for key, value in flat.items():
        if key.startswith("model."):
            out[key] = value
        elif key.startswith("optim.state."):
            name, _, what = key.removeprefix("optim.state.").rpartition(".")
            out[f"optimizer.{name}.{what}"] = value
    return out


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"not bitwise equal: {differ}"


@pytest.mark.parametrize(
    "world, data_parallel, stages, message",
    [
        ("3", 2, None, "--data-parallel 2 does not divide the 3 torchrun processes"),
        ("4", 2, 4, "--stages 4 with 4 torchrun processes and --data-parallel 2: each pipeline has 2 ranks"),
    ],
)
def test_torchrun_world_that_does_not_cut_is_refused(
    monkeypatch: pytest.MonkeyPatch, world: str, data_parallel: int, stages: int | None, message: str
) -> None:
    for name, value in (("RANK", "0"), ("WORLD_SIZE", world), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    assert launched_by_torchrun()
    with pytest.raises(ValueError, match=message):
        join(data_parallel, stages)  # refused before any process group starts


def test_torchrun_1f1b_equals_one_process(tmp_path: Path) -> None:
    flags = ["--steps", "3", "--dropout", "0.1", "--schedule", "1f1b"]
    two = tmp_path / "two"
    proc = _torchrun(two, *flags)
    ranks = json.loads((two / "report.json").read_text())
    one = _one_process(tmp_path / "one", *flags)
    assert ranks["history"] == one["history"]  # bitwise: the same arithmetic on each stage
    assert ranks["val_loss"] == one["val_loss"]
    assert ranks["devices"] == ["cpu", "cpu"] and ranks["parameters"] == one["parameters"]
    assert ranks["torchrun"] == {"world": 2, "data_parallel": 1, "restart": 0} and one["torchrun"] is None
    assert len(ranks["memory"]["activation_bytes_per_stage"]) == 2
    assert {e["tid"] for e in json.loads((two / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"} == {
        0,
        1,
    }  # both ranks' rows in rank 0's trace
    assert proc.stdout.count("fastpipe train:") == 1  # only rank 0 reports


def test_torchrun_zb_v_holds_the_v_and_equals_one_process(tmp_path: Path) -> None:
    # 4 stages on 2 ranks: rank 0 holds the first and the last (the V), so it reads both x and y.
    flags = ["--steps", "2", "--layers", "4", "--chunks", "4", "--schedule", "zb-v"]
    two = tmp_path / "two"
    _torchrun(two, *flags)
    ranks = json.loads((two / "report.json").read_text())
    one = _one_process(tmp_path / "one", *flags)
    assert ranks["history"] == one["history"]  # bitwise: the same arithmetic on each stage
    assert ranks["devices"] == ["cpu"] * 4 and ranks["bubble"]["timeline"] == "one step of zb-v"
    events = json.loads((two / "trace.json").read_text())["traceEvents"]
    held = {(int(re.match(r"\d+", e["name"]).group()), e["tid"]) for e in events if e.get("ph") == "X"}  # type: ignore[union-attr]
    assert held == {(0, 0), (3, 0), (1, 1), (2, 1)}


@pytest.mark.parametrize(
    "schedule, kill_rank",
    [
        (["--schedule", "gpipe"], "1"),
        (["--schedule", "async", "--consistency", "stash", "--window", "2"], "0"),
    ],
    ids=["gpipe", "async"],
)
def test_torchrun_restart_resumes_bit_for_bit(tmp_path: Path, schedule: list[str], kill_rank: str) -> None:
    # A rank SIGKILLed before step 4 (after the save at step 2): torchrun restarts both, and
    # --resume auto continues from step 2. Dropout on, so the RNG streams must continue too.
    flags = ["--steps", "6", "--dropout", "0.1", "--save-every", "2", "--resume", "auto", *schedule]
    ckpt, out = tmp_path / "ckpt", tmp_path / "two"
    _torchrun(out, *flags, "--save", str(ckpt), restarts=2, kill=(3, int(kill_rank)))
    assert (out / ".killed-at-step-3").read_text() == f"rank {kill_rank}\n"  # it died once
    resumed = json.loads((out / "report.json").read_text())
    assert resumed["start_step"] == 2  # the restarted group continued from the newest save
    assert resumed["torchrun"] == {"world": 2, "data_parallel": 1, "restart": 1}  # one restart: the kill's
    ref = tmp_path / "ref"
    whole = _one_process(tmp_path / "one", *flags, "--save", str(ref))
    assert whole["start_step"] == 0  # an empty --save folder: --resume auto starts afresh
    assert resumed["history"] == whole["history"]
    assert not list(ckpt.glob("model-*.pt"))  # sharded: no rank gathered the others' shares
    _assert_bitwise(_sharded_weights(ckpt, 6), _weights(ref, 6))


def test_torchrun_data_parallel_matches_the_whole_batch(tmp_path: Path) -> None:
    # 2 stages x 2 replicas: each replica trains on half of every batch and the stages average
    # their gradients over the replicas. The one-process run on the whole batch with twice the
    # micro-batches has micro-batches of the same rows; the gradient sums group differently.
    flags = ["--steps", "3", "--schedule", "1f1b"]
    four = tmp_path / "four"
    _torchrun(four, *flags, "--data-parallel", "2", ranks=4)
    replicated = json.loads((four / "report.json").read_text())
    one = _one_process(tmp_path / "one", *flags, "--chunks", "4")
    assert replicated["settings"]["data_parallel"] == 2 and replicated["devices"] == ["cpu", "cpu"]
    # The loss's longest reduction: the last Linear's rows times the tokens of a micro-batch.
    k = 32 * 2 * 32
    assert_close_reordered(torch.tensor(replicated["history"]), torch.tensor(one["history"]), k=k)
