"""``fastpipe plan --schedule auto``: the candidates with time, bubble and peak memory, the one chosen; refusals."""

from __future__ import annotations

import re

import pytest

from fastpipe import cli
from fastpipe.schedule.search import StageCosts, search


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(["plan", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_plan_auto_prints_every_candidate_and_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _plan(
        capsys,
        "--costs",
        "1,2,3,4,1,1,2,2",
        "--stages",
        "4",
        "--chunks",
        "8",
        "--schedule",
        "auto",
        "--comm",
        "0.1",
    )
    assert status == 0
    assert "balance: [2, 1, 2, 3] (planned for zb-h1)" in out
    table = out[out.index("schedules considered") :]
    for name in ("gpipe", "1f1b", "zb-h1", "interleaved v=2", "greedy"):
        assert f" {name} " in table
    assert "bubble" in table and "peak memory" in table
    chosen = next(line for line in table.splitlines() if line.startswith("*"))
    # zb-h2 and the greedy schedule tie at the least time; a tie goes to the named schedule.
    assert chosen.split()[:3] == ["*", "zb-h2", "131.3"] and "chosen: zb-h2 (memory_limit: none)" in table
    assert next(line for line in table.splitlines() if " greedy " in line).split()[1:4] == [
        "backlog=none",
        "131.3",
        "26.9%",
    ]
    assert "zb-h2: 4 workers, 4 stages, 8 micro-batches" in out and "0W7" in out
    assert "predicted step: 131.3 cost units, bubble 26.9%" in out


def test_plan_auto_judges_every_candidate_by_its_devices_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--costs", "1,2,3,4", "--stages", "2", "--chunks", "8", "--schedule", "auto", "--checkpoint", "never")
    given = ("--memory", "1024,1024,1024,1024")  # each layer's activation bytes per micro-batch
    status, out, _ = _plan(capsys, *argv, *given, "--memory-limit", "8KiB")
    assert status == 0
    assert "chosen: zb-h1 (memory_limit: 8.00 KiB per device)" in out
    # zb-h2 keeps three of stage 0's micro-batches (3 KiB each) alive at once, 9 KiB: over 8 KiB.
    fastest = next(line for line in out.splitlines() if " zb-h2 " in line)
    assert "9.00 KiB, 1.00 KiB" in fastest and fastest.endswith("over memory_limit (+5% margin)")
    status, _, err = _plan(capsys, *argv, *given, "--memory-limit", "100")
    assert status == 2
    assert "no schedule fits memory_limit=100 B on every device; the leanest, zb-h1" in err
    assert "device 0 (stages 0) needs 6.00 KiB" in err
    status, _, err = _plan(capsys, *argv, "--memory-limit", "8KiB")  # no bytes known without --memory or --model
    assert status == 2 and "--memory-limit is in device bytes" in err


def test_plan_auto_prints_a_profiled_models_peak_per_device(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--model", "_cli_model:build", "--sample-shape", "32,16", "--stages", "2", "--chunks", "4")
    status, out, _ = _plan(capsys, *argv, "--schedule", "auto", "--memory-limit", "1MiB")
    assert status == 0
    assert "chosen: " in out and "(memory_limit: 1.00 MiB per device)" in out
    one_f_one_b = next(line for line in out.splitlines() if " 1f1b " in line)
    peaks = re.findall(r"(\d+\.\d\d) KiB", one_f_one_b)
    assert len(peaks) == 2, one_f_one_b  # one per device
    # The parameters, their gradients and Adam's two moments of the 64x64 layer alone: 4 x 16.25 KiB.
    assert max(float(p) for p in peaks) > 4 * 16.25
    status, _, err = _plan(capsys, *argv, "--schedule", "auto", "--memory-limit", "40KiB")
    assert status == 2 and "no schedule fits memory_limit=40.00 KiB" in err and "optimizer" in err


def test_plan_auto_profiles_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _plan(
        capsys,
        "--model",
        "_cli_model:build",
        "--sample-shape",
        "32,16",
        "--stages",
        "2",
        "--chunks",
        "4",
        "--schedule",
        "auto",
    )
    assert status == 0
    assert "activation" in out and "MiB" in out
    # Seconds, shown in the unit of the chosen step (the table's header names it).
    unit = re.search(r"predicted step: [0-9.]+ (s|ms|µs), bubble", out)
    assert unit is not None, out
    assert f"(time in {unit.group(1)} and bubble simulated" in out
    assert re.search(r"stage 0: F [0-9.]+ (s|ms|µs), B [0-9.]+ (s|ms|µs), W [0-9.]+ (s|ms|µs)", out), out
    assert "chosen: " in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--virtual-stages", "2"), "picks the stages per worker itself"),
        (("--weight-share", "1.5"), "weight_share must be in"),
        (("--memory-limit", "-1"), "'-1' is not a size (not above 0); a size is"),
        (("--memory-limit", "24 parsecs"), "unknown unit 'parsecs'"),
    ],
)
def test_plan_auto_refuses_bad_arguments(
    extra: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _plan(capsys, "--costs", "1,1,1,1", "--stages", "2", "--chunks", "4", "--schedule", "auto", *extra)
    assert status == 2
    assert message in err


def test_plan_auto_bubble_counts_the_workers_that_virtual_stages_leave_idle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 2 stages: a V (or interleaved v=2) puts both on one worker, as slow as running them in
    # sequence; the other worker idles the whole step.
    status, out, _ = _plan(capsys, "--costs", "1,2,3,4", "--stages", "2", "--chunks", "8", "--schedule", "auto")
    assert status == 0
    sequential = 8 * (1 + 2 + 3 + 4) * 3
    for name in ("interleaved v=2", "zb-v v=2", "dualpipev v=2"):
        row = next(line for line in out.splitlines() if f" {name} " in line)
        assert row.split()[2:4] == [f"{sequential}", "50.0%"], row
    choice = search(StageCosts.uniform(4, forward=1.0, backward=1.0, weight=1.0), 4, 8)
    for c in choice.candidates:
        if c.schedule is not None:  # busy time over one worker per stage and the whole step
            assert c.bubble == pytest.approx(1 - 4 * 8 * 3 / (4 * c.time))
