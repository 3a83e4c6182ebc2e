"""``fastpipe plan``: a balance table and predictions from given costs or a profiled model; clear refusals.

``--model _cli_model:build`` imports ``tests/_cli_model.py``, which pytest's ``pythonpath`` puts on ``sys.path``.
"""

from __future__ import annotations

import inspect
import re

import pytest

from fastpipe import cli
from fastpipe.pipe import Pipe


def test_cli_plan_prints_balance_table_and_predictions(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["plan", "--costs", "1,2,3,4", "--stages", "2", "--chunks", "8", "--schedule", "1f1b"])
    out = capsys.readouterr().out
    assert status == 0
    assert "balance: [3, 1]" in out
    assert "worker 1" in out and "1BW7" in out
    assert "predicted bubble" in out and "peak activations" in out
    status = cli.main(
        ["plan", "--costs", "1,1", "--stages", "2", "--chunks", "2", "--memory", "5,5", "--memory-limit", "1"]
    )
    assert status == 2
    assert "memory_limit" in capsys.readouterr().err


def test_cli_plan_profiles_a_model_and_prints_memory(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(
        [
            "plan",
            "--model",
            "_cli_model:build",
            "--sample-shape",
            "32,16",
            "--stages",
            "2",
            "--chunks",
            "4",
            "--schedule",
            "1f1b",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "balance: [" in out and "peak memory per device" in out and "predicted bubble" in out
    assert re.search(r"device 1 \(stages 1\): [0-9.]+ KiB \(parameters .*, optimizer .*, activations", out), out


def test_cli_plan_balances_under_a_device_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "_cli_model:build", "--sample-shape", "32,16", "--stages", "2", "--chunks", "4"]
    # The 64x64 layer's parameters, gradients and Adam's moments take 65 KiB wherever it goes.
    assert cli.main([*argv, "--memory-limit", "120KiB"]) == 0
    out = capsys.readouterr().out
    assert "memory_limit: 120.00 KiB per device, 5% of each prediction kept" in out
    peaks = [float(m) for m in re.findall(r"device \d \(stages \d\): (\d+\.\d\d) KiB \(parameters", out)]
    assert len(peaks) == 2 and max(peaks) * 1.05 <= 120 and max(peaks) > 65
    assert cli.main([*argv, "--memory-limit", "20KiB"]) == 2
    err = capsys.readouterr().err
    assert "no balance into 2 stages fits memory_limit=20.00 KiB per device: stage 0 needs at least" in err
    assert "(layer 0 alone)" in err and "parameters" in err and "optimizer" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "_cli_model:build"], "needs --sample-shape"),
        (["--model", "_cli_model:not_sequential", "--sample-shape", "8,2"], "not an nn.Sequential"),
        (["--model", "_cli_model:missing", "--sample-shape", "8,2"], "has no attribute"),
        (["--model", "no_colon", "--sample-shape", "8,2"], "module:callable"),
    ],
)
def test_cli_plan_model_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["plan", *argv, "--stages", "2", "--chunks", "2"])
    assert status == 2
    assert message in capsys.readouterr().err


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_plan_speaks_the_vocabulary_of_train_and_pipe(capsys: pytest.CaptureFixture[str]) -> None:
    plan, train = (cli.build_parser().parse_args([command]) for command in ("plan", "train"))
    assert plan.schedule == train.schedule == inspect.signature(Pipe).parameters["schedule"].default == "1f1b"
    out = _plan(capsys, "--costs", "1,2,3,4", "--stages", "2", "--chunks", "8")
    assert "1f1b: 2 workers, 2 stages, 8 micro-batches" in out
    # torchgpipe's spellings stay: the same plan.
    assert _plan(capsys, "--costs", "1,2,3,4", "--partitions", "2", "--microbatches", "8") == out
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    shown = capsys.readouterr().out
    assert "--stages" in shown and "--chunks" in shown and "--virtual-stages" in shown
    assert "--partitions" not in shown and "--microbatches" not in shown


def test_plan_gives_times_with_their_unit(capsys: pytest.CaptureFixture[str]) -> None:
    out = _plan(capsys, "--costs", "1,2,3,4", "--stages", "2", "--chunks", "8")
    assert "predicted step: 150 cost units (sequential 240 cost units, speed-up 1.6x)" in out
    out = _plan(capsys, "--model", "_cli_model:build", "--sample-shape", "32,16", "--stages", "2", "--chunks", "4")
    assert re.search(r"predicted step: [0-9.]+ (s|ms|µs) \(sequential [0-9.]+ (s|ms|µs), speed-up", out), out
    assert re.search(r"stage 0 \(worker 0\): layers 0\.\.\d+, fwd [0-9.]+ (s|ms|µs), bwd [0-9.]+ (s|ms|µs)", out), out


def test_plan_v_schedules_take_their_own_virtual_stages(capsys: pytest.CaptureFixture[str]) -> None:
    for schedule in ("zb-v", "dualpipev"):
        out = _plan(capsys, "--costs", "1,2,3,4", "--stages", "2", "--chunks", "4", "--schedule", schedule)
        assert f"{schedule}: 2 workers, 4 stages" in out and "worker 0: 0+3, worker 1: 1+2" in out
    out = _plan(capsys, "--costs", "1,1,1,1,1,1", "--stages", "2", "--chunks", "4", "--schedule", "interleaved")
    assert "interleaved: 2 workers, 4 stages" in out  # 2 per worker, as fastpipe train runs it


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedule", "zb-v", "--virtual-stages", "3"], "zb-v places 2 stages on each worker in a V"),
        (["--schedule", "1f1b", "--virtual-stages", "2"], "--schedule 1f1b runs one stage per worker"),
        (["--schedule", "dualpipev", "--chunks", "2"], "dualpipev needs at least as many micro-batches as stages"),
    ],
)
def test_plan_refuses_what_the_schedule_cannot_take(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", "--costs", "1,2,3,4", "--stages", "2", "--chunks", "4", *argv]) == 2
    assert message in capsys.readouterr().err
