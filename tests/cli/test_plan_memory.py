"""``fastpipe plan --checkpoint auto --offload auto``: the planner's combinations as a table, the choice marked.

``--model _cli_model:build`` imports ``tests/_cli_model.py``, which pytest's ``pythonpath`` puts on ``sys.path``.
"""

from __future__ import annotations

import re

import pytest

from fastpipe import cli

# 8 layers of cost 1 and 4000 bytes on 4 stages of 8 micro-batches: without offload no schedule fits 20000 bytes.
GIVEN = ["plan", "--costs", ",".join(["1"] * 8), "--memory", ",".join(["4000"] * 8), "--stages", "4", "--chunks", "8"]


def rows(out: str) -> list[dict[str, str]]:
    """The table's rows by column: mark, balance, schedule, checkpoint, offload, time, peaks, fits."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["balance", "schedule"])
    names = ("balance", "schedule", "checkpoint", "offload", "time", "peaks", "fits")
    body = []
    for line in lines[head + 1 :]:
        if "combinations evaluated" in line:
            break
        body.append({"mark": line[0].strip(), **dict(zip(names, re.split(r"\s{2,}", line[1:].strip())))})
    return body


def test_the_table_lists_the_combinations_with_time_peaks_and_fit_and_marks_the_fastest_that_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*GIVEN, "--memory-limit", "20000", "--checkpoint", "auto", "--offload", "auto", "--copy-bandwidth", "2000"]
    assert cli.main([*argv, "--schedule", "auto"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint  offload" in out and "peak per device" in out and "fits" in out
    table = rows(out)
    (chosen,) = [r for r in table if r["mark"] == "*"]
    assert chosen["fits"] == "yes" and chosen["offload"] != "0"  # it fits by offloading
    assert float(chosen["time"]) == min(float(r["time"]) for r in table if r["fits"] == "yes")
    assert "chosen: balance [2, 2, 2, 2]" in out and "pruned" in out
    assert "device 3 (stages 3)" in out  # each device's prediction for the chosen one


def test_a_fixed_checkpoint_is_held_and_too_small_a_limit_is_refused_naming_the_device(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main([*GIVEN, "--memory-limit", "100000", "--checkpoint", "never", "--offload", "auto"]) == 0
    table = rows(capsys.readouterr().out)
    assert table and all(r["checkpoint"] == "never" and r["schedule"] == "1f1b" for r in table)
    assert cli.main([*GIVEN, "--memory-limit", "20000", "--checkpoint", "auto"]) == 0  # no offload: recompute
    table = rows(capsys.readouterr().out)
    assert [(r["checkpoint"], r["fits"]) for r in table if r["mark"] != "*"] == [("never", "no")]
    (chosen,) = [r for r in table if r["mark"] == "*"]
    assert chosen["checkpoint"] != "never" and chosen["fits"] == "yes" and chosen["offload"] == "0"
    assert cli.main([*GIVEN, "--memory-limit", "5000", "--checkpoint", "auto"]) == 2
    assert "needs" in capsys.readouterr().err


def test_memory_with_a_unit_is_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "_cli_model:build", "--sample-shape", "32,16", "--stages", "2", "--chunks", "4"]
    assert cli.main([*argv, "--memory", "1GiB", "--checkpoint", "auto"]) == 0
    out = capsys.readouterr().out
    assert "memory_limit: 1.00 GiB per device" in out and "never" in out
    assert cli.main([*argv, "--memory", "1GiB", "--memory-limit", "2GiB", "--checkpoint", "auto"]) == 2
    assert "another spelling of --memory-limit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([*argv, "--memory", "lots", "--checkpoint", "auto"])
    assert "a device size with a unit" in capsys.readouterr().err
