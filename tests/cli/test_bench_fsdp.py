"""``fastpipe bench --only fsdp``: replicated stages, sharded stages and pipelining over FSDP2 on 4 gloo ranks.

One tiny run (toy sizes, seconds) of the part through the CLI checks what its table claims: a
sharded rank holds about half a replicated rank's parameter, gradient and Adam bytes, and every
method's losses are one process's on the whole batch. The run is given no time for rounds past
the first few, as a loaded host's run would be, so it also shows that they stop there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fp_tolerance import close_reordered

import fastpipe.bench.fsdp
from fastpipe.bench.fsdp import run_fsdp
from fastpipe.bench.fsdp_ranks import METHODS, MIN_ROUNDS, SIZES
from fastpipe.cli import main


@pytest.fixture(scope="module")
def part(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], str]]:
    threads = torch.get_num_threads()
    out = str(tmp_path_factory.mktemp("bench"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastpipe.bench.fsdp, "ROUNDS_SHARE", 0.0)
        code = main(["bench", "--quick", "--tiny", "--only", "fsdp", "--out", out, "--no-progress"])
    torch.set_num_threads(threads)
    assert code == 0
    with open(os.path.join(out, "bench.json")) as f:
        entry = json.load(f)["parts"]["fsdp"]
    with open(os.path.join(out, "results.md")) as f:
        yield entry, f.read()


def _rows(entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    assert entry["status"] == "ok", entry.get("error")
    return {r["method"]: r for r in entry["result"]["rows"]}


def test_every_method_ran_within_the_quick_budget(part: tuple[dict[str, Any], str]) -> None:
    entry, _ = part
    rows = _rows(entry)
    assert list(rows) == list(METHODS)
    for name, row in rows.items():
        assert "error" not in row, f"{name}: {row.get('error')}"
        assert row["median_s"] > 0 and row["state_bytes"] > 0
    assert entry["seconds"] <= entry["budget_s"]


def test_no_round_starts_past_the_rounds_time_once_the_fewest_were_timed(part: tuple[dict[str, Any], str]) -> None:
    entry, markdown = part
    res = entry["result"]
    assert MIN_ROUNDS < SIZES["tiny"]["rounds"] and res["rounds"] == MIN_ROUNDS
    for row in _rows(entry).values():
        assert len(row["times_s"]) == MIN_ROUNDS and len(row["losses"]) == SIZES["tiny"]["warmup"] + MIN_ROUNDS
    assert f"medians of {MIN_ROUNDS} rounds" in markdown


def test_a_sharded_rank_holds_at_most_055x_the_replicated_bytes(part: tuple[dict[str, Any], str]) -> None:
    entry, _ = part
    rows = _rows(entry)
    ratio = rows["fastpipe fsdp"]["state_bytes"] / rows["fastpipe replicate"]["state_bytes"]
    assert 0.45 <= ratio <= 0.55
    for kind in ("parameters", "gradients", "optimizer"):  # each of the three is sharded, not only their sum
        assert rows["fastpipe fsdp"][kind] <= 0.55 * rows["fastpipe replicate"][kind], kind
    assert rows["pipelining fsdp"]["state_bytes"] <= 0.55 * rows["fastpipe replicate"]["state_bytes"]
    reported = {r["ratio"]: r for r in entry["result"]["ratios"]}["bytes fsdp / replicate"]
    assert reported["value"] == pytest.approx(ratio) and reported["met"] == "yes"


def test_every_methods_losses_are_one_process_losses(part: tuple[dict[str, Any], str]) -> None:
    entry, _ = part
    res = entry["result"]
    w = res["workload"]
    steps = SIZES["tiny"]["warmup"] + res["rounds"]
    reference = torch.tensor(res["one_process_losses"])
    assert len(reference) == steps and bool(reference[-1] < reference[0])  # Adam trained it
    # Reductions to the loss: each block's LayerNorm and two GEMMs, the loss over the batch, and per
    # step since the first, the rows each weight gradient summed over.
    k = w["blocks"] * (2 * w["hidden"] + w["ffn"]) + w["batch"] * w["hidden"] + (steps - 1) * w["batch"]
    for name, row in _rows(entry).items():
        losses = torch.tensor(row["losses"])
        assert close_reordered(losses, reference, k=k), f"{name}: {row['losses']} vs {res['one_process_losses']}"
        assert row["losses_within_tolerance"]


def test_both_sharded_pipelines_gather_and_reduce_each_unit_once_per_step(part: tuple[dict[str, Any], str]) -> None:
    entry, _ = part
    rows = _rows(entry)
    units = entry["result"]["workload"]["blocks"] // 2  # rank 0's stage: one unit per block (its root holds none)
    assert entry["result"]["workload"]["chunks"] > 1  # so that a gather per micro-batch would show
    for name in ("fastpipe fsdp", "pipelining fsdp"):
        assert rows[name]["collectives"] == {"all_gather": units, "reduce_scatter": units}, name
    assert rows["fastpipe replicate"]["collectives"]["all_reduce"] >= 1
    assert "all_gather" not in rows["fastpipe replicate"]["collectives"]


def test_the_replica_phases_lie_within_the_schedule_and_only_fsdp_gathers(part: tuple[dict[str, Any], str]) -> None:
    entry, _ = part
    phases = {(r["method"], r["stage"]): r for r in entry["result"]["phases"]}
    assert set(phases) == {(m, s) for m in METHODS for s in (0, 1)}
    for (name, stage), r in phases.items():
        assert r["schedule"] > 0 and r["optimizer"] > 0, (name, stage)
        if name.startswith("fastpipe"):
            assert r["gather"] + r["reduce launch"] + r["reduce wait"] < r["schedule"], (name, stage)
        else:  # pipelining's collectives run inside its schedule, where the bench does not look
            assert "gather" not in r
    for stage in (0, 1):
        # Replicated stages start the step without collectives; sharded ones all-gather theirs.
        assert phases[("fastpipe replicate", stage)]["gather"] < 0.2 * phases[("fastpipe fsdp", stage)]["gather"]


def test_the_results_table_names_every_method_and_target(part: tuple[dict[str, Any], str]) -> None:
    _, markdown = part
    assert "### fsdp" in markdown and "(no table" not in markdown
    assert "| method | per-rank params + grads + Adam MiB | median step ms |" in markdown
    for name in METHODS:
        assert f"| {name} |" in markdown
    assert "| where a step's time goes, ms (median) | stage (replica 0) | schedule | gather |" in markdown
    for ratio in ("bytes fsdp / replicate", "step fsdp / replicate", "step fsdp / pipelining fsdp"):
        assert f"| {ratio} |" in markdown


def test_an_unknown_size_is_refused() -> None:
    with pytest.raises(ValueError, match="size must be one of tiny, quick, full"):
        run_fsdp(10.0, "huge")
