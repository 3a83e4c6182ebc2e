"""Of the partitions simulated within the tolerance of the fastest, plan returns the most even, then the fastest."""

from __future__ import annotations

import itertools
import random

import pytest

from fastpipe.balance import BalanceError, plan, predict


def _all(fwd, bwd, k, m, schedule):  # type: ignore[no-untyped-def]
    """(time, sum of squared layer counts, balance) of every partition."""
    n = len(fwd)
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        balance = [b - a for a, b in zip(bounds, bounds[1:])]
        t = predict(balance, fwd, bwd, microbatches=m, schedule=schedule).makespan
        out.append((t, sum(c * c for c in balance), balance))
    return out


@pytest.mark.parametrize("seed", range(24))
def test_plan_within_tolerance_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n, k = rng.randint(5, 10), rng.randint(2, 4)
    m = rng.choice([2, 4, 8])
    schedule = ["gpipe", "1f1b", "zb-h1"][seed % 3]
    tolerance = [0.0, 0.05, 0.1, 0.2][seed % 4]
    # Costs in a few levels with noise, so that near-ties exist.
    fwd = [rng.choice([0.5, 1.0, 2.0]) * rng.uniform(1.0, 1.05) for _ in range(n)]
    bwd = [2 * f * rng.uniform(1.0, 1.05) for f in fwd]
    every = _all(fwd, bwd, k, m, schedule)
    fastest = min(t for t, _, _ in every)
    qualified = [(sq, t) for t, sq, _ in every if t <= fastest * (1 + tolerance) * (1 + 1e-9)]
    got = plan(fwd, bwd, k, microbatches=m, schedule=schedule, tolerance=tolerance)
    t = predict(got, fwd, bwd, microbatches=m, schedule=schedule).makespan
    squares = sum(c * c for c in got)
    assert t <= fastest * (1 + tolerance) * (1 + 1e-9)
    least = min(sq for sq, _ in qualified)
    assert squares == least
    assert t == pytest.approx(min(tq for sq, tq in qualified if sq == least), rel=1e-9)


def test_identical_layers_split_evenly_and_the_extra_layer_goes_where_it_is_fastest() -> None:
    assert plan([1.0] * 16, [2.0] * 16, 4, microbatches=8, schedule="1f1b") == [4, 4, 4, 4]
    # 17 layers: every [5, 4, 4, 4] arrangement is as even; 1F1B runs the extra layer best on stage 0.
    assert plan([1.0] * 17, [2.0] * 17, 4, microbatches=8, schedule="1f1b", tolerance=0.05) == [5, 4, 4, 4]


def test_a_bad_tolerance_is_refused() -> None:
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(BalanceError, match="tolerance must be a finite relative margin >= 0"):
            plan([1.0, 1.0], [1.0, 1.0], 2, microbatches=2, tolerance=bad)


def test_planner_messages_say_what_to_do() -> None:
    fwd = [1.0] * 4
    with pytest.raises(BalanceError, match="layer 2 alone needs 9. Raise memory_limit, or make the layer need less"):
        plan(fwd, fwd, 2, microbatches=2, memory=[1.0, 1.0, 9.0, 1.0], memory_limit=5.0)
    with pytest.raises(BalanceError, match="no contiguous cut keeps every stage within the limit. Raise memory_limit"):
        plan(fwd, fwd, 2, microbatches=2, memory=[3.0, 3.0, 3.0, 3.0], memory_limit=5.0)
    with pytest.raises(BalanceError, match="4 layers cannot fill 5 stages.*plan at most 4 stages"):
        plan(fwd, fwd, 5, microbatches=2)
    with pytest.raises(BalanceError, match=r"costs_bwd\[1\] is -1.0"):
        plan(fwd, [1.0, -1.0, 1.0, 1.0], 2, microbatches=2)
    with pytest.raises(BalanceError, match=r"pass memory=\[bytes of each layer\]"):
        plan(fwd, fwd, 2, microbatches=2, memory_limit=5.0)
