"""``fastpipe plan``: a balance table and predictions from given costs or a profiled model; clear refusals.

``--model _cli_model:build`` imports ``tests/_cli_model.py``, which pytest's ``pythonpath`` puts on ``sys.path``.
"""

from __future__ import annotations

import pytest

from fastpipe import cli


def test_cli_plan_prints_balance_table_and_predictions(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["plan", "--costs", "1,2,3,4", "--partitions", "2", "--microbatches", "8", "--schedule", "1f1b"])
    out = capsys.readouterr().out
    assert status == 0
    assert "balance: [3, 1]" in out
    assert "worker 1" in out and "1BW7" in out
    assert "predicted bubble" in out and "peak activations" in out
    status = cli.main(
        ["plan", "--costs", "1,1", "--partitions", "2", "--microbatches", "2", "--memory", "5,5", "--memory-limit", "1"]
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
            "--partitions",
            "2",
            "--microbatches",
            "4",
            "--schedule",
            "1f1b",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "balance: [" in out and "peak memory" in out and "MiB" in out and "predicted bubble" in out


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
    status = cli.main(["plan", *argv, "--partitions", "2", "--microbatches", "2"])
    assert status == 2
    assert message in capsys.readouterr().err
