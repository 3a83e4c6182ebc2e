"""``fastpipe bench``: the suite runs from the package and writes JSON, charts and a markdown table."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
import torch

from fastpipe.bench.scaling import limit_of
from fastpipe.bench.zero_bubble import v_peers_refused_on_gloo
from fastpipe.cli import main


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_quick_e2e_and_schedules(
    tmp_path: object, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(str(tmp_path))  # the suite needs no checkout: it runs from any directory
    out = "bench"
    assert main(["bench", "--quick", "--tiny", "--only", "e2e,schedules", "--out", out, "--no-progress"]) == 0
    for name in ("bench.json", "results.md", "e2e.png", "schedules.png"):
        assert os.path.getsize(os.path.join(str(tmp_path), out, name)) > 0
    with open(os.path.join(out, "bench.json")) as f:
        report = json.load(f)
    assert set(report) >= {"host", "quick", "parts"} and list(report["parts"]) == ["e2e", "schedules"]
    e2e = report["parts"]["e2e"]
    assert e2e["status"] == "ok" and e2e["seconds"] <= e2e["budget_s"] * 2
    res = e2e["result"]
    assert res["k"] == 2 and res["limit_s"] == pytest.approx(limit_of(res["t_mb_s"], 2, res["m"]))
    methods = {r["method"]: r for r in res["rows"]}
    assert {
        "plain, 1 device, full batch",
        "gradient accumulation, 1 device (T_mb)",
        "fastpipe GPipe, pipe(x) + backward",
        "fastpipe train_step 1f1b",
    } <= set(methods)
    for r in methods.values():
        assert r["median_s"] > 0 and r["speedup_over_1_device"] == pytest.approx(res["t_mb_s"] / r["median_s"])
    # Peers that are missing or skipped say so instead of vanishing.
    if "torchgpipe" not in methods:
        assert any(n.startswith("torchgpipe") for n in res["notes"])
    sched = report["parts"]["schedules"]["result"]["rows"]
    assert {r["schedule"] for r in sched} >= {"gpipe", "1f1b", "zb-h1"}
    text = capsys.readouterr().out
    assert "| method | median ms | speed-up over 1 device | fraction of limit |" in text
    assert text.strip().splitlines()[-1].startswith("JSON ")


def test_unknown_part_is_refused(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--only", "e2e,warp", "--out", str(tmp_path)]) == 2
    assert "unknown part(s) warp" in capsys.readouterr().err


def test_bench_says_where_it_wrote(
    tmp_path: object, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(str(tmp_path))
    assert main(["bench", "--tiny", "--only", "schedules", "--out", "out", "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    wrote = [line for line in lines if line.startswith("fastpipe bench: wrote ")]
    assert len(wrote) == 1 and wrote[0].endswith(f" in {os.path.join(str(tmp_path), 'out')}")
    for name in ("bench.json", "results.md"):
        assert name in wrote[0] and os.path.exists(os.path.join("out", name))
    assert lines[-1].startswith("JSON ")  # still the last line, for bench/gpu_check.sh


def test_bench_prints_the_kernel_tables_once(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    out = os.path.join(str(tmp_path), "out")
    assert main(["bench", "--quick", "--tiny", "--only", "kernels", "--out", out, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert text.count("MLP block 512/2048 (p=0.0)") == 1  # the markdown table only, not the raw one before it
    assert [line for line in text.splitlines() if line.startswith("JSON ")] == [text.strip().splitlines()[-1]]
    with open(os.path.join(out, "kernels.json")) as f:
        assert {"correctness", "saved_bytes"} <= set(json.load(f))


@pytest.mark.skipif(
    v_peers_refused_on_gloo() is not None, reason=f"the peers cannot start here: {v_peers_refused_on_gloo()}"
)
def test_zero_bubble_part_pairs_the_v_schedules_with_torchs(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(str(tmp_path))
    assert main(["bench", "--tiny", "--only", "zero-bubble", "--out", "out", "--no-progress"]) == 0
    with open(os.path.join("out", "bench.json")) as f:
        part = json.load(f)["parts"]["zero-bubble"]
    assert part["status"] == "ok", part
    res = part["result"]
    assert set(res["median_s"]) == {
        "fastpipe zb-v",
        "pipelining ZBVZeroBubble",
        "fastpipe dualpipev",
        "pipelining DualPipeV",
        "fastpipe 1f1b",
    }
    assert set(res["paired_ratio"]) == {
        "fastpipe zb-v / pipelining ZBVZeroBubble",
        "fastpipe dualpipev / pipelining DualPipeV",
        "fastpipe zb-v / fastpipe 1f1b",
        "fastpipe dualpipev / fastpipe 1f1b",
    }
    assert all(r > 0 for r in res["paired_ratio"].values())
    assert all(0 <= b["measured"] < 1 and 0 <= b["simulated"] < 1 for b in res["bubble"].values())
    with open(os.path.join("out", "results.md")) as f:
        text = f.read()
    assert "fastpipe zb-v / pipelining ZBVZeroBubble" in text and "bubble, traced" in text


def test_v_peers_are_refused_only_where_they_start_with_a_send_to_their_own_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.pipelining import stage

    class SendsToNeighbours:  # the start-up of torch 2.11's stages
        def _get_init_p2p_neighbors_ops(self) -> list[object]:
            return []

    class Votes(SendsToNeighbours):  # torch 2.13's
        def _warmup_forward_vote(self) -> None:
            return None

    monkeypatch.setattr(stage, "PipelineStage", SendsToNeighbours)
    why = v_peers_refused_on_gloo()
    assert why is not None and torch.__version__ in why and "gloo refuses" in why and ">= 2.13" in why
    monkeypatch.setattr(stage, "PipelineStage", Votes)
    assert v_peers_refused_on_gloo() is None
    # A release with neither start-up is run rather than skipped: its failure would say what changed.
    monkeypatch.setattr(stage, "PipelineStage", object)
    assert v_peers_refused_on_gloo() is None


def test_zero_bubble_ranks_that_cannot_start_the_peers_report_why_and_join_no_group(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    from fastpipe.bench import zero_bubble

    monkeypatch.setattr(zero_bubble, "v_peers_refused_on_gloo", lambda: "no start-up here")
    out = os.path.join(str(tmp_path), "times.json")
    for rank in (1, 0):  # neither rank waits for the other: a lone rank returns at once
        zero_bubble._worker(rank, 1, zero_bubble._TINY, 0, 0, out)
    assert not dist.is_initialized()
    with open(out) as f:
        assert json.load(f) == {"skipped": "no start-up here"}


def test_distributed_part_times_its_four_runs_in_one_set_of_forked_ranks(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.multiprocessing as mp

    started: list[object] = []
    start = mp.start_processes

    def spy(*args: object, **kwargs: object) -> object:
        started.append(kwargs.get("start_method"))
        return start(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mp, "start_processes", spy)
    monkeypatch.chdir(str(tmp_path))
    assert main(["bench", "--tiny", "--only", "distributed", "--out", "out", "--no-progress"]) == 0
    with open(os.path.join("out", "bench.json")) as f:
        part = json.load(f)["parts"]["distributed"]
    assert part["status"] == "ok", part
    methods = {r["method"] for r in part["result"]["rows"]}
    assert {
        f"{who} {schedule} (2 gloo ranks)"
        for who in ("fastpipe DistributedPipe", "torch.distributed.pipelining")
        for schedule in ("1f1b", "gpipe")
    } <= methods
    # A rank forked from a server that imported torch starts in milliseconds; a spawned one imports it again.
    assert started == ["forkserver"]


def test_ranks_keep_the_runs_finished_before_a_failure_and_name_it() -> None:
    from fastpipe.bench.ranks import spawn_runs
    from fastpipe.bench.scaling import host_workload

    runs = [("fastpipe", "1f1b"), ("fastpipe", "no-such-schedule"), ("pipelining", "1f1b")]
    result = spawn_runs(runs, host_workload(tiny=True), warmup=0, steps=2, timeout=300)
    assert list(result.times) == [("fastpipe", "1f1b")]
    steps, t_mb = result.times[("fastpipe", "1f1b")]
    assert len(steps) == len(t_mb) == 2 and all(t > 0 for t in steps + t_mb)
    assert "no-such-schedule" in result.missing[("fastpipe", "no-such-schedule")]
    assert set(result.missing) == {("fastpipe", "no-such-schedule"), ("pipelining", "1f1b")}


def test_ranks_start_no_run_past_the_budget() -> None:
    from fastpipe.bench.ranks import spawn_runs
    from fastpipe.bench.scaling import host_workload

    runs = [("fastpipe", "1f1b"), ("pipelining", "gpipe")]
    result = spawn_runs(runs, host_workload(tiny=True), warmup=0, steps=1, timeout=300, reserve=300)
    assert result.times == {}
    assert result.missing == {r: "skipped, time budget spent" for r in runs}
