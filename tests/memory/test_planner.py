"""The planner chooses balance, schedule, recompute and offload together: the fastest that fits.

Costs and bytes are given, so every figure can be checked by hand. Two stages of two layers
(forward 1 and backward 2 per layer, so per stage F = 2, B = 2, W = 2), 4 micro-batches, each
layer saving 100 bytes and taking a 10-byte input. Simulated, and predicted per device:

=========  ===========  ====  ==========
schedule   checkpoint   time  peaks
=========  ===========  ====  ==========
gpipe      never        28    810, 840
1f1b       never        30    410, 210
gpipe      except_last  35.5  210, 240
gpipe      always       38    210, 240
1f1b       always       40    210, 210
=========  ===========  ====  ==========

(``except_last`` recomputes 3 of 4 micro-batches: 3/4 of the forward joins each backward.) A
combination fits when its fullest device plus 5% is within the limit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastpipe.balance import BalanceError
from fastpipe.memory.limit import MARGIN
from fastpipe.memory.model import StageBytes
from fastpipe.memory.offload_bytes import CopyBandwidth
from fastpipe.memory.planner import Plan, PlanProfile, RecomputeOption, plan_memory
from fastpipe.step.recompute_policy import Recompute

LAYER = StageBytes(parameters=0, activation=100, input=10)


def profile(layers: tuple[StageBytes, ...] = (LAYER,) * 4, **kw: object) -> PlanProfile:
    return PlanProfile(forward=(1.0,) * 4, backward=(2.0,) * 4, layers=layers, **kw)  # type: ignore[arg-type]


def planned(limit: int | None, given: PlanProfile | None = None, **kw: object) -> Plan:
    options: dict[str, object] = {"balances": [(2, 2)], "schedules": ("gpipe", "1f1b"), "greedy": False, **kw}
    return plan_memory(given or profile(), 2, 4, limit, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("limit", "schedule", "checkpoint", "time"),
    [
        (900, "gpipe", "never", 28.0),  # 840 * 1.05 = 882 fits: the fastest of all
        (500, "1f1b", "never", 30.0),  # gpipe's 840 no longer fits, 1f1b's 410 does
        (300, "gpipe", "except_last", 35.5),  # only recompute fits; gpipe's recomputes least time
        (230, "1f1b", "always", 40.0),  # gpipe's 240 * 1.05 = 252 is over: only 1f1b's 210 fits
    ],
)
def test_the_chosen_combination_fits_and_is_the_fastest_that_fits(
    limit: int, schedule: str, checkpoint: str, time: float
) -> None:
    plan = planned(limit)
    chosen = plan.chosen
    assert (chosen.schedule, chosen.checkpoint, chosen.balance) == (schedule, checkpoint, (2, 2))
    assert chosen.time == pytest.approx(time)
    assert chosen.fits and chosen.peak * (1 + MARGIN) <= limit
    assert not any(c.fits and c.time < chosen.time for c in plan.considered)
    assert chosen.offload == (0.0, 0.0)


def test_a_limit_no_combination_fits_is_refused_naming_the_device_and_what_it_holds() -> None:
    with pytest.raises(ValueError, match=r"device \d \(stages \d\) needs .* over memory_limit=200 B: activations"):
        planned(200)


def test_a_stage_that_cannot_fit_even_alone_is_refused_naming_the_stage_and_the_least_it_needs() -> None:
    heavy = dataclasses.replace(LAYER, parameters=1000)
    with pytest.raises(BalanceError, match=r"stage \d needs at least .* \(layer \d alone\).*parameters 1000 B"):
        plan_memory(profile(layers=(heavy,) * 4), 2, 4, 3000, greedy=False)


def test_a_per_layer_policy_that_alone_fits_is_chosen_over_whole_stage_recompute() -> None:
    # Recomputing half of each layer keeps 40 of its 100 bytes and costs 0.25 per layer.
    lean = Recompute(layers=lambda i, layer: True, name="half")
    option = RecomputeOption(lean, (dataclasses.replace(LAYER, activation=40),) * 4, (0.25,) * 4)
    plan = planned(500, profile(policies=(option,)), schedules=("gpipe",))
    # gpipe never: 840 (over); "half" keeps 4 micro-batches of 2 * 50 bytes: fits, slower than never, faster
    # than except_last.
    assert plan.chosen.checkpoint is lean
    assert plan.chosen.fits and 28.0 < plan.chosen.time < 35.5


def test_a_limit_that_fits_only_with_offload_offloads() -> None:
    # 1F1B's first stage of four holds four micro-batches at once: room for copies between F and B.
    fast = CopyBandwidth(torch.device("cuda"), 1e6, 1e6, 1)
    given = profile(bandwidth=fast)
    fixed = {"balances": [(1, 1, 1, 1)], "schedules": ("1f1b",), "checkpoints": ["never"], "greedy": False}
    bare = plan_memory(given, 4, 8, None, **fixed).chosen  # type: ignore[arg-type]
    limit = int(bare.peak * (1 + MARGIN) * 0.8)
    chosen = plan_memory(given, 4, 8, limit, **fixed).chosen  # type: ignore[arg-type]
    assert chosen.checkpoint == "never" and chosen.fits and chosen.peak < bare.peak
    assert chosen.offload[0] > 0
    assert any(a.kind == "P" for actions in chosen.built.workers for a in actions)  # its prefetches are scheduled
    assert chosen.time >= bare.time  # copies never make a step faster
    with pytest.raises(ValueError, match="needs"):  # the same limit without a copy bandwidth: nothing fits
        plan_memory(profile(), 4, 8, limit, **fixed)  # type: ignore[arg-type]


def test_with_ample_memory_nothing_is_recomputed_or_offloaded() -> None:
    free = Recompute(layers=lambda i, layer: True, name="free")  # as fast as none, and leaner
    option = RecomputeOption(free, (dataclasses.replace(LAYER, activation=10),) * 4, (0.0,) * 4)
    fast = CopyBandwidth(torch.device("cuda"), 1e12, 1e12, 1)
    for limit in (1 << 30, None):
        chosen = planned(limit, profile(policies=(option,), bandwidth=fast)).chosen
        assert chosen.checkpoint == "never" and chosen.offload == (0.0, 0.0)
        assert chosen.time == pytest.approx(28.0)


def test_the_default_balances_and_schedules_plan_8_stages_of_32_chunks() -> None:
    layer = StageBytes(parameters=1000, activation=4000, input=500, w_records=1000, w_kept=200)
    rich = PlanProfile(tuple(1.0 + 0.1 * i for i in range(32)), (2.0,) * 32, (layer,) * 32)
    plan = plan_memory(rich, 8, 32, 60_000, greedy=False)
    assert plan.chosen.fits and len(plan.chosen.balance) == 8
    assert plan.pruned > 0  # combinations no faster than the chosen are never evaluated
    assert not any(c.fits and c.time < plan.chosen.time for c in plan.considered)


def test_a_profile_with_a_length_that_is_not_one_per_layer_is_refused() -> None:
    with pytest.raises(ValueError, match="one entry per layer"):
        PlanProfile(forward=(1.0,) * 3, backward=(2.0,) * 4, layers=(LAYER,) * 4)


def test_a_distributed_transport_s_receive_buffers_count_toward_the_limit() -> None:
    from fastpipe.distributed.wire import HEADER

    local, tags = planned(None), planned(None, transport="tags")
    assert (local.chosen.schedule, tags.chosen.schedule) == ("gpipe", "gpipe")
    for a, b in zip(local.chosen.devices, tags.chosen.devices):
        assert a.receive_buffers == 0 and b.receive_buffers >= 4 * HEADER and b.total > a.total
    lean = planned(None, transport="tags", schedules=("1f1b",)).chosen
    limit = int(max(d.total for d in lean.devices) * (1 + MARGIN)) + 1  # 1f1b fits with its buffers, gpipe not
    assert planned(limit).chosen.schedule == "gpipe"  # which fits without them
    chosen = planned(limit, transport="tags").chosen
    assert chosen.schedule == "1f1b" and all(d.total * (1 + MARGIN) <= limit for d in chosen.devices)


def test_a_per_layer_policy_gets_its_own_memory_cut_where_the_time_cut_does_not_fit() -> None:
    # Eight layers on 2 stages under 1f1b. Recomputing half of each layer keeps 40 of its 100 bytes;
    # on the time-planned cut (4, 4) the first stage holds two micro-batches of 4 layers: 320 bytes,
    # over 300 with the margin, and nothing else fits there. Moving a layer off it, (3, 5) holds
    # 240 and 210.
    lean = Recompute(layers=lambda i, layer: True, name="half")
    option = RecomputeOption(lean, (dataclasses.replace(LAYER, activation=40),) * 8, (0.25,) * 8)
    given = PlanProfile(forward=(1.0,) * 8, backward=(2.0,) * 8, layers=(LAYER,) * 8, policies=(option,))
    fixed = {"schedules": ("1f1b",), "virtual_stages": 1, "greedy": False}
    with pytest.raises(ValueError, match="needs"):
        plan_memory(given, 2, 4, 300, balances=[(4, 4)], **fixed)  # type: ignore[arg-type]
    chosen = plan_memory(given, 2, 4, 300, **fixed).chosen  # type: ignore[arg-type]
    assert chosen.checkpoint is lean and chosen.balance == (3, 5)
    assert [d.total for d in chosen.devices] == [240, 210] and chosen.fits


def test_regions_inside_stage_recompute_are_chosen_only_where_always_does_not_fit() -> None:
    # Each layer its own region keeps 10 of its 100 bytes; inside stage recompute a micro-batch in
    # flight keeps its stage's input alone, and the replay rebuilds one layer at a time.
    nested = Recompute(layers=lambda i, layer: True, name="nested", stage="always")
    option = RecomputeOption(nested, (dataclasses.replace(LAYER, activation=10),) * 4, (1.0,) * 4)
    given = profile(policies=(option,))
    roomy = planned(230, given)
    assert roomy.chosen.checkpoint == "always"  # fits, and the nested form runs the forward once more
    tight = planned(150, given)
    assert tight.chosen.checkpoint is nested and tight.chosen.fits and tight.chosen.peak * (1 + MARGIN) <= 150
    assert tight.chosen.time > roomy.chosen.time
    with pytest.raises(ValueError, match="over memory_limit"):
        planned(150, profile())  # without it nothing fits
