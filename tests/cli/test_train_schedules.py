"""``fastpipe train --schedule``: every schedule ``Pipe`` takes trains, placed as the schedule says; bad
combinations of ``--schedule``, ``--virtual-stages``, ``--stages`` and ``--chunks`` are refused with what to change."""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fp_tolerance import assert_close_reordered
from test_train_cli import TINY

from fastpipe.cli import build_parser, main
from fastpipe.pipe import Pipe
from fastpipe.schedule import SCHEDULES
from fastpipe.schedule.builders import placement_for
from fastpipe.train.job import _placement, build_job
from fastpipe.train.options import TrainError
from fastpipe.train.ranks import Ranks

# The module: fastpipe.train's name ``run`` is its function.
train_run = importlib.import_module("fastpipe.train.run")
# Four blocks: room for 2 workers x 2 stages (interleaved, zb-v, dualpipev); 4 micro-batches, as
# many as dualpipev needs for 4 stages.
FOUR = [*TINY, "--layers", "4", "--chunks", "4", "--steps", "3"]
# The loss's longest reduction: the head's rows times the tokens of a micro-batch (dim x 2 x seq-len).
K = 32 * 2 * 32


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # fastpipe train sets one thread per stage worker


def _train(tmp_path: object, name: str, *extra: str) -> dict:
    out = os.path.join(str(tmp_path), name)
    assert main(["train", *FOUR, "--out", out, *extra]) == 0
    with open(os.path.join(out, "report.json")) as f:
        report = dict(json.load(f))
    with open(report["files"]["trace.json"]) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    # Which worker ran each stage's actions ("3F0": stage 3), as the trace recorded it.
    report["ran_on"] = {(int(re.match(r"\d+", e["name"]).group()), e["tid"]) for e in events}  # type: ignore[union-attr]
    return report


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return list(_train(tmp_path_factory.mktemp("ref"), "1f1b", "--schedule", "1f1b")["history"])


def test_train_offers_every_schedule_that_pipe_takes() -> None:
    parser = build_parser()
    for schedule in (*SCHEDULES, "auto", "async"):
        assert parser.parse_args(["train", "--schedule", schedule]).schedule == schedule


@pytest.mark.parametrize("schedule", [*SCHEDULES, "auto"])
def test_every_schedule_trains_like_1f1b(tmp_path: object, schedule: str, one_f_one_b: list[float]) -> None:
    report = _train(tmp_path, schedule, "--schedule", schedule)
    history = report["history"]
    assert len(history) == 3 and history[-1] < history[0] - 0.1
    # The same micro-batches and updates: only the order of the gradient sums may differ.
    assert_close_reordered(torch.tensor(history), torch.tensor(one_f_one_b), k=K)
    assert report["settings"]["schedule"] == schedule
    assert report["bubble"]["timeline"].startswith(f"one step of {schedule}")
    assert 0.0 <= report["bubble"]["simulated"] < 1.0
    if schedule == "auto":
        assert "(chosen: " in report["bubble"]["timeline"]  # the simulator priced the search's choice
        return
    virtual = 2 if schedule in ("interleaved", "zb-v", "dualpipev") else 1
    placed = placement_for(schedule, 2 * virtual, 2)
    assert report["ran_on"] == {(stage, worker) for stage, worker in enumerate(placed)}
    assert len(report["devices"]) == len(report["memory"]["activation_bytes_per_stage"]) == 2 * virtual


def test_interleaved_takes_any_virtual_stages(tmp_path: object) -> None:
    report = _train(tmp_path, "v3", "--schedule", "interleaved", "--virtual-stages", "3", "--layers", "6")
    assert report["settings"]["virtual_stages"] == 3
    assert report["ran_on"] == {(stage, stage % 2) for stage in range(6)}  # round robin over 2 workers
    assert report["history"][-1] < report["history"][0] - 0.1


def test_gpu_stages_follow_the_schedules_placement() -> None:
    # Built as torch.device values only: no GPU is touched.
    cuda = [torch.device("cuda", i) for i in range(2)]
    assert _placement(2, "zb-v", 2, 2)[0] == [cuda[0], cuda[1], cuda[1], cuda[0]]  # the V: 0 and 3 on worker 0
    assert _placement(2, "interleaved", 2, 2)[0] == [cuda[0], cuda[1], cuda[0], cuda[1]]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--schedule", "zb-v", "--layers", "2"], "--schedule zb-v (2 stages per worker) needs 4 pipeline stages"),
        (["--schedule", "zb-v", "--virtual-stages", "3"], "zb-v places 2 stages on each worker in a V"),
        (["--schedule", "dualpipev", "--virtual-stages", "1"], "drop --virtual-stages 1 or pass 2"),
        (["--schedule", "1f1b", "--virtual-stages", "2"], "--schedule 1f1b runs one stage per worker"),
        (["--schedule", "auto", "--virtual-stages", "2"], "--schedule auto picks the stages per worker itself"),
        (["--schedule", "async", "--virtual-stages", "2"], "--schedule async streams a 1F1B order"),
        (["--schedule", "interleaved", "--virtual-stages", "0"], "--virtual-stages must be >= 1"),
        (
            ["--schedule", "dualpipev", "--chunks", "2"],
            "--schedule dualpipev cannot run --stages 2 workers with --chunks 2 micro-batches",
        ),
    ],
)
def test_schedule_combinations_that_cannot_run_are_refused(
    tmp_path: object, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["train", *FOUR, "--out", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err


def test_auto_under_torchrun_is_refused_with_what_to_pick() -> None:
    # The refusal comes before any process group is used.
    ranks = Ranks(0, 2, 2, 1, torch.device("cpu"), pipeline=None, replicas_group=None)
    args = build_parser().parse_args(["train", *FOUR, "--schedule", "auto"])
    with pytest.raises(TrainError, match="pick a named --schedule there"):
        build_job(args, ranks)


@pytest.mark.parametrize("flag", ["--recompute", "--checkpoint"])
def test_recompute_reaches_the_pipe_under_either_spelling(flag: str) -> None:
    args = build_parser().parse_args(["train", *FOUR, flag, "always"])
    job = build_job(args)
    assert isinstance(job.pipe, Pipe) and job.pipe.checkpoint == "always"
    assert job.settings["recompute"] == "always"
    assert build_parser().parse_args(["train"]).recompute == "never"


def test_help_names_recompute_and_hides_the_other_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--recompute" in text and "--virtual-stages" in text
    assert "--checkpoint" not in text  # --save/--resume are the checkpoint files


def test_resume_reads_a_save_that_calls_recompute_checkpoint(
    tmp_path: object, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = os.path.join(str(tmp_path), "ckpt")
    _train(tmp_path, "first", "--steps", "1", "--save", ckpt, "--recompute", "always")
    load_run = train_run.load_run

    def as_pipe_names_it(*args: Any) -> dict[str, Any]:
        record = load_run(*args)
        settings = dict(record["settings"])
        settings["checkpoint"] = settings.pop("recompute")  # Pipe's name for it
        return {**record, "settings": settings}

    monkeypatch.setattr(train_run, "load_run", as_pipe_names_it)
    resumed = _train(tmp_path, "resumed", "--steps", "2", "--resume", ckpt, "--recompute", "always")
    assert resumed["start_step"] == 1 and len(resumed["history"]) == 2
    assert main(["train", *FOUR, "--steps", "2", "--resume", ckpt, "--out", str(tmp_path)]) == 2
    assert "recompute: saved 'always', now 'never'" in capsys.readouterr().err
