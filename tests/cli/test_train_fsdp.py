"""``fastpipe train --data-parallel 2 --dp-shard fsdp`` on 4 gloo ranks (2 stages x 2 shards).

At D = 2 a sharded stage runs the replicated stage's arithmetic: the step trains on the
gathered parameters, a reduce-scatter sums the same two gradients an all-reduce sums, and
AdamW steps each element alike. So the losses and the saved state equal the replicated run's
bit for bit, while each rank holds half of its parameters, gradients and AdamW state; and a
run whose rank is SIGKILLed continues, after torchrun's restart, as the uninterrupted run did.
One uninterrupted sharded run (a module fixture) serves both torchrun tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_torchrun import _assert_bitwise, _sharded_weights, _torchrun

from fastpipe.cli import main

TINY_ONE = ["--layers", "2", "--dim", "32", "--heads", "2", "--seq-len", "32", "--batch", "8", "--chunks", "2"]
TINY_ONE += ["--warmup", "1", "--eval-batches", "1", "--sample-chars", "8", "--max-chars", "100000", "--no-progress"]
# Dropout on, so that a resumed run must continue the dropout seeds' stream as well.
FLAGS = ["--steps", "6", "--dropout", "0.1", "--save-every", "2", "--resume", "auto", "--schedule", "gpipe"]
SHARDED = ["--data-parallel", "2", "--dp-shard", "fsdp"]


@pytest.fixture(autouse=True)
def _threads() -> Any:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # fastpipe train sets one thread per stage worker


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The uninterrupted sharded run: its --out, its --save folder and rank 0's printed report."""
    root = tmp_path_factory.mktemp("fsdp")
    out, ckpt = root / "out", root / "ckpt"
    proc = _torchrun(out, *FLAGS, *SHARDED, "--save", str(ckpt), ranks=4)
    return out, ckpt, proc.stdout


def _report(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "report.json").read_text()))


def test_dp_shard_takes_only_replicate_or_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["train", "--dp-shard", "zero3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err  # Python 3.12 quotes the choices, 3.11 does not
    assert re.search(r"--dp-shard: invalid choice: 'zero3' \(choose from '?replicate'?, '?fsdp'?\)", err), err


def test_one_process_dp_shard_fsdp_is_a_no_op_and_reports_its_state(tmp_path: Path) -> None:
    # One process has one replica: nothing to shard, so --dp-shard fsdp runs the replicated arithmetic.
    runs = {}
    for shard in ("replicate", "fsdp"):
        out = tmp_path / shard
        assert main(["train", *TINY_ONE, "--steps", "2", "--dp-shard", shard, "--out", str(out)]) == 0
        runs[shard] = _report(out)
    assert runs["fsdp"]["history"] == runs["replicate"]["history"]
    for report in runs.values():
        assert "dp_shard" not in report["settings"]
        state = report["state"]
        assert state["dp_shard"] == "replicate" and state["collectives_per"] == "step"
        (row,) = state["ranks"]  # one process: one row, holding every stage
        assert row["stages"] == [0, 1] and row["collectives"] == {}
        assert row["parameters"] == 4 * report["parameters"]  # fp32 weights, each counted once
        assert row["gradients"] == row["parameters"]  # the last step's gradients are still held
        assert row["optimizer"] > 2 * row["parameters"]  # AdamW's two moments, and its step counters


def test_fsdp_holds_half_the_replicated_state_and_trains_it_bit_for_bit(
    tmp_path: Path, sharded: tuple[Path, Path, str]
) -> None:
    out, ckpt, printed = sharded
    replicated_ckpt = tmp_path / "ckpt"
    _torchrun(tmp_path / "out", *FLAGS, "--data-parallel", "2", "--save", str(replicated_ckpt), ranks=4)
    fsdp, replicated = _report(out), _report(tmp_path / "out")
    assert fsdp["settings"]["dp_shard"] == "fsdp" and "dp_shard" not in replicated["settings"]
    assert fsdp["history"] == replicated["history"]  # bitwise: the same sums, see the module's doc
    _assert_bitwise(_sharded_weights(ckpt, 6), _sharded_weights(replicated_ckpt, 6))

    assert fsdp["state"]["dp_shard"] == "fsdp" and replicated["state"]["dp_shard"] == "replicate"
    shards, whole = fsdp["state"]["ranks"], replicated["state"]["ranks"]
    assert [(r["rank"], r["stages"], r["replica"]) for r in shards] == [
        (0, [0], 0),
        (1, [1], 0),
        (2, [0], 1),
        (3, [1], 1),
    ]
    for mine, theirs in zip(shards, whole):
        for kind in ("parameters", "gradients", "optimizer"):
            assert 0 < mine[kind] <= 0.55 * theirs[kind], (mine, theirs)
        # Once per step and unit: never once per micro-batch (--chunks 2).
        assert set(mine["collectives"]) == {"all_gather", "reduce_scatter"}
        assert mine["collectives"]["all_gather"] == mine["collectives"]["reduce_scatter"] >= 1
        assert theirs["collectives"] == {"all_reduce": 1}  # one bucket per stage of this small model
    assert "model state        fsdp: MiB held by each rank, collectives over the replicas per step" in printed
    assert "all-gather  reduce-scatter" in printed


def test_fsdp_restart_resumes_bit_for_bit(tmp_path: Path, sharded: tuple[Path, Path, str]) -> None:
    # Rank 3 (stage 1 of replica 1) is SIGKILLed before step 4, after the save at step 2;
    # torchrun restarts the 4 ranks and --resume auto loads each rank's shards of that save.
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    _torchrun(out, *FLAGS, *SHARDED, "--save", str(ckpt), ranks=4, restarts=2, kill=(3, 3))
    assert (out / ".killed-at-step-3").read_text() == "rank 3\n"
    resumed, (whole_out, whole_ckpt, _) = _report(out), sharded
    assert resumed["start_step"] == 2 and resumed["torchrun"] == {"world": 4, "data_parallel": 2, "restart": 1}
    assert resumed["history"] == _report(whole_out)["history"]
    _assert_bitwise(_sharded_weights(ckpt, 6), _sharded_weights(whole_ckpt, 6))


def test_fsdp_async_streams_on_shards_and_counts_per_window(tmp_path: Path) -> None:
    # fit on sharded stages: each update reduce-scatters into the shards; the report counts a window's collectives.
    out = tmp_path / "out"
    _torchrun(out, "--steps", "2", "--schedule", "async", "--window", "2", *SHARDED, ranks=4)
    report = _report(out)
    assert report["settings"]["dp_shard"] == "fsdp" and len(report["history"]) == 2
    state = report["state"]
    assert state["collectives_per"] == "window"
    rows = state["ranks"]
    # The two replicas of a stage hold one copy of it between them (a shard's padding aside).
    held = sum(r["parameters"] for r in rows)
    assert 4 * report["parameters"] <= held <= 1.05 * 4 * report["parameters"]
    for row in rows:
        assert row["collectives"]["reduce_scatter"] >= 1 and row["collectives"]["all_gather"] >= 1
