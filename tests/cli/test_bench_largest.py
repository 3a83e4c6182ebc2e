"""The largest-model benchmark: an exact search, a real run on 2 ranks at the budget's edge, its wiring.

The search is checked on fake measures against brute force; one tiny run on 2 gloo ranks checks
that what it reports is the edge of the budget on real, counted steps.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpipe.bench.largest import PRESETS, Config, System, run_largest
from fastpipe.bench.largest_ranks import stage_layers
from fastpipe.bench.largest_report import largest_markdown, plot_largest
from fastpipe.bench.largest_search import Point, best_of, search_largest
from fastpipe.cli import main


def _linear(base: int, slope: int, seconds: float = 1.0, log: list[int] | None = None) -> Any:
    def measure(n: int) -> Point:
        if log is not None:
            log.append(n)
        return Point(n, [base + slope * n, base], seconds)

    return measure


@settings(max_examples=300, deadline=None)
@given(
    base=st.integers(0, 1000),
    slope=st.integers(1, 100),
    budget=st.integers(1, 20000),
    floor=st.integers(1, 20),
    above=st.integers(0, 50),
    cap=st.one_of(st.none(), st.integers(1, 400)),
)
def test_search_finds_the_largest_size_that_fits(
    base: int, slope: int, budget: int, floor: int, above: int, cap: int | None
) -> None:
    start = floor + above
    if cap is not None and cap < start:
        cap = start
    sizes: list[int] = []
    found = search_largest(_linear(base, slope, log=sizes), budget, start=start, floor=floor, cap=cap)
    edge = (budget - base) // slope if budget >= base else 0  # the largest n with base + slope * n <= budget
    if cap is not None:
        edge = min(edge, cap)
    assert found.largest == (edge if edge >= floor else None)
    assert [p.n for p in found.points] == sizes and len(set(sizes)) == len(sizes)  # no size measured twice
    # Doubling (or halving) then bisection: logarithmic in the sizes, where a scan would be linear.
    top = max(start, found.largest or floor)
    assert len(sizes) <= 2 * math.ceil(math.log2(top + 1)) + 3
    if found.largest is not None and found.largest != cap:
        assert found.largest + 1 in sizes  # the edge is proven: the next size was measured over


def test_search_refuses_a_start_outside_its_range() -> None:
    for kwargs in ({"start": 0}, {"start": 3, "floor": 4}, {"start": 9, "cap": 8}):
        with pytest.raises(ValueError, match="1 <= floor <= start <= cap"):
            search_largest(_linear(0, 1), 10, **kwargs)  # type: ignore[arg-type]


def test_best_of_takes_the_largest_then_the_faster_and_searches_later_ones_only_above() -> None:
    later: list[int] = []
    # Fits 10, then one that fits 14, then one that fits 14 faster, then a slower one that fits 14 too.
    measures = [_linear(0, 10), _linear(0, 7, 2.0), _linear(0, 7, 1.0, later), _linear(0, 7, 3.0)]
    assert best_of(measures, 100, start=4, floor=2) == (2, 14)
    assert later == [15, 14]  # above the best so far, then timed at it for the tie
    assert best_of([_linear(50, 10)], 40, start=4) == (None, None)


def test_stages_need_a_layer_each() -> None:
    assert stage_layers(6, 4) == [2, 2, 2, 2] and stage_layers(3, 4) == [2, 1, 1, 1]
    with pytest.raises(ValueError, match="use at least 2 blocks"):
        stage_layers(1, 4)


def test_bad_presets_are_refused_with_the_accepted_forms() -> None:
    with pytest.raises(ValueError, match="choose from tiny, quick, full"):
        run_largest("huge")
    with pytest.raises(ValueError, match="positive int"):
        run_largest(dict(PRESETS["tiny"], budget=-1))
    with pytest.raises(ValueError, match="'layers' and/or 'width'"):
        run_largest("tiny", dims=("depth",))


def test_tiny_run_on_two_ranks_reports_the_edge_of_the_budget(tmp_path: Path) -> None:
    asked: list[Config] = []

    def predict(config: Config) -> list[int] | None:
        asked.append(config)
        return [config.budget // 2] * config.ranks if config.system.kind == "pipelining" else None

    result = run_largest("tiny", predict=predict)
    budget = result["budget_bytes"]
    rows = {r["system"].split(" (")[0]: r for r in result["dims"]["layers"]}
    host = "fastpipe 1f1b + host optimizer"
    assert set(rows) == {"plain PyTorch, 1 device", "pipelining 1F1B", "fastpipe 1f1b", host}
    for name, row in rows.items():
        assert row["stopped"] is None, row
        n = row["largest"]
        by_size = {q["n"]: q for q in row["points"]}
        assert by_size[n]["fits"] and max(by_size[n]["peaks"]) <= budget and row["step_s"] > 0
        assert not by_size[n + 1]["fits"] and max(by_size[n + 1]["peaks"]) > budget, name  # the edge, measured
        assert len(row["peaks"]) == (1 if name.startswith("plain") else 2)
    # Two devices hold a larger model than one.
    assert rows["pipelining 1F1B"]["largest"] > rows["plain PyTorch, 1 device"]["largest"]
    ours = rows["fastpipe 1f1b"]
    assert ours["system"].startswith("fastpipe 1f1b (best of 2: ")
    # fastpipe's ranks predict their own peaks with memory_limit's model; the hook is not asked for them.
    assert not [c for c in asked if c.system.kind == "fastpipe"]
    assert len(ours["predicted"]) == 2
    for row in (ours, rows[host]):
        for predicted, measured in zip(row["predicted"], row["peaks"]):
            assert abs(predicted - measured) <= 0.05 * measured, (row["predicted"], row["peaks"])
    # Adam's moments on the host leave the devices more room.
    assert rows[host]["largest"] > ours["largest"], (rows[host]["largest"], ours["largest"])
    assert rows["pipelining 1F1B"]["predicted"] == [budget // 2] * 2
    config = next(c for c in asked if c.system.kind == "pipelining")
    assert sum(config.balance) == config.shape["layers"] + 2  # the embedding and the head are layers
    assert len(config.balance) == config.ranks * config.system.stages_per_rank
    text = largest_markdown(result)
    assert "| plain PyTorch, 1 device |" in text and "| n/a |" in text  # the hook's None
    assert f"{budget // 2 / 2**20:.1f} / {budget // 2 / 2**20:.1f}" in text  # the hook's figures
    assert "At PL's largest N" in text
    plot_largest(result, str(tmp_path / "largest.png"))
    assert (tmp_path / "largest.png").stat().st_size > 0


def test_bench_memory_runs_the_largest_model_search_beside_the_kernels_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fastpipe.bench.largest as largest

    budget = 2**20
    fake = {
        "budget_bytes": budget,
        "shape": PRESETS["tiny"]["shape"],
        "ranks": 2,
        "width_layers": 4,
        "width_unit": 16,
        "fastpipe": {},
        "notes": [],
        "dims": {
            "layers": [
                {
                    "system": System("plain").name,
                    "largest": 3,
                    "step_s": 0.01,
                    "peaks": [budget - 1],
                    "predicted": None,
                    "ratio_to_pl": None,
                    "points": [{"n": 3, "peaks": [budget - 1], "seconds": 0.01, "fits": True}],
                }
            ]
        },
    }
    presets: list[object] = []

    def run(preset: object, **kwargs: object) -> dict[str, Any]:
        presets.append(preset)
        return json.loads(json.dumps(fake))

    monkeypatch.setattr(largest, "run_largest", run)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--tiny", "--only", "memory", "--out", "out", "--no-progress"]) == 0
    assert presets == ["tiny"]
    with open(os.path.join("out", "bench.json")) as f:
        part = json.load(f)["parts"]["memory"]
    assert part["status"] == "ok" and part["result"]["largest"]["dims"]["layers"][0]["largest"] == 3
    assert part["result"]["rows"]  # the fused kernels' one-device section is still there
    with open(os.path.join("out", "results.md")) as f:
        text = f.read()
    assert "Largest blocks N at width 32" in text and "One device, the fused kernels" in text
    assert os.path.getsize(os.path.join("out", "largest.png")) > 0


def test_quick_bench_on_a_gpu_host_leaves_the_cpu_ranks_search_to_a_cpu_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import fastpipe.bench.largest as largest
    import fastpipe.bench.memory as memory

    def refuse(*args: object, **kwargs: object) -> dict[str, Any]:
        raise AssertionError("the largest-model search ran under --quick on a GPU host")

    kernels = {"device": "cuda:0", "budget": "90%", "hidden": 8, "ffn": 16, "reference": "-", "rows": []}
    monkeypatch.setattr(largest, "run_largest", refuse)
    monkeypatch.setattr(memory, "run_memory", lambda *args, **kwargs: dict(kernels))
    monkeypatch.setattr(memory, "plot_memory", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--quick", "--only", "memory", "--out", "out", "--no-progress"]) == 0
    with open(os.path.join("out", "bench.json")) as f:
        result = json.load(f)["parts"]["memory"]["result"]
    assert "largest" not in result and any("fastpipe bench --only memory" in n for n in result["notes"])


def test_a_system_that_fails_is_reported_with_its_error_and_the_others_still_run() -> None:
    result = run_largest("tiny", systems=[System("bogus"), System("plain")], fastpipe=[])
    failed, plain = result["dims"]["layers"]
    assert failed["largest"] is None and "unknown system kind 'bogus'" in failed["stopped"]
    assert any("unknown system kind 'bogus'" in note for note in result["notes"])
    assert plain["largest"] is not None and plain["stopped"] is None
    text = largest_markdown(result)
    assert "| bogus | none (stopped: see the notes) |" in text and "- bogus (layers): stopped" in text


def test_the_planner_s_largest_size_fits_as_predicted_and_the_next_is_refused_or_over(tmp_path: Path) -> None:
    planner = System("fastpipe", "1f1b", "auto", "host")
    result = run_largest("tiny", systems=[], fastpipe=[planner])
    budget = result["budget_bytes"]
    (row,) = result["dims"]["layers"]
    assert row["stopped"] is None and row["system"].startswith(planner.name), row
    n = row["largest"]
    by_size = {q["n"]: q for q in row["points"]}
    assert by_size[n]["fits"] and max(by_size[n]["peaks"]) <= budget and not by_size[n]["refused"]
    for predicted, measured in zip(row["predicted"], row["peaks"]):
        assert abs(predicted - measured) <= 0.05 * measured, (row["predicted"], row["peaks"])
    after = by_size[n + 1]
    assert not after["fits"] and (after["refused"] or max(after["peaks"]) > budget), after
    refused = [q for q in row["points"] if q["refused"]]
    assert all(not q["peaks"] and "memory_limit" in q["refused"] for q in refused), refused
    plot_largest(result, str(tmp_path / "planner.png"))  # refused sizes ran no step: not drawn
    assert (tmp_path / "planner.png").stat().st_size > 0
