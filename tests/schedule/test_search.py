"""``schedule="auto"``'s search: never slower than a named schedule, within the memory limit, clear refusals;
the greedy zero-bubble scheduler yields valid schedules that keep to their limit."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpipe.schedule import SCHEDULES, ScheduleError, build, simulate
from fastpipe.schedule.builders import build_for
from fastpipe.schedule.greedy import greedy_schedule
from fastpipe.schedule.search import StageCosts, search
from fastpipe.schedule.simulate import peak_memory, simulate_times

# The uneven costs of the target: F = 1, B = 1.2, W = 0.8 and a link of 0.1.
UNEVEN = {"forward": 1.0, "backward": 1.2, "weight": 0.8, "comm": 0.1}


def _named_times(costs: StageCosts, microbatches: int) -> dict[str, float]:
    """Each named schedule's simulated time at every stage count per worker it builds for, found apart."""
    n = costs.num_stages
    times = {}
    for name in SCHEDULES:
        for v in (v for v in range(1, n + 1) if n % v == 0):
            try:
                schedule = build_for(name, n, n // v, microbatches)
            except ScheduleError:
                continue
            times[f"{name}/{v}"] = simulate(schedule, costs.forward, costs.backward, costs.weight, costs.comm).makespan
    return times


def test_uneven_costs_auto_beats_every_named_schedule() -> None:
    costs = StageCosts.uniform(8, **UNEVEN)
    choice = search(costs, stages=8, microbatches=32)
    best = min(_named_times(costs, 32).values())
    assert choice.chosen.time <= best
    # The least any schedule can take: the last worker's first F waits for 7 F's and links, then it
    # runs its 32 F, B and W one after another. zb-h2 and the greedy schedule both reach it.
    lower_bound = 7 * (1.0 + 0.1) + 32 * 3.0
    assert choice.chosen.time == pytest.approx(lower_bound)
    without_h2 = search(costs, stages=8, microbatches=32, schedules=[n for n in SCHEDULES if n != "zb-h2"])
    assert without_h2.chosen.name == "greedy" and without_h2.chosen.time == pytest.approx(lower_bound)
    assert without_h2.chosen.time < min(t for key, t in _named_times(costs, 32).items() if not key.startswith("zb-h2/"))


def test_the_search_lists_every_candidate_with_time_bubble_and_memory() -> None:
    choice = search(StageCosts.uniform(4, **UNEVEN), stages=4, microbatches=8)
    table = choice.table()
    for name in ("gpipe", "1f1b", "zb-h1", "interleaved v=2", "greedy"):
        assert name in table
    assert "bubble" in table and "peak memory" in table and f"chosen: {choice.chosen.label}" in table
    times = [c.time for c in choice.candidates if not c.skipped]
    assert times == sorted(times)
    assert choice.schedule is choice.chosen.schedule
    for c in choice.candidates:
        assert c.schedule is not None
        assert len(c.peak_memory) == c.schedule.num_workers


_COST = st.floats(0.1, 3.0, allow_nan=False)


@st.composite
def _problems(draw: st.DrawFn) -> tuple[StageCosts, int]:
    k = draw(st.integers(1, 6))
    m = draw(st.integers(1, 12))
    costs = StageCosts.uniform(
        k,
        forward=draw(st.lists(_COST, min_size=k, max_size=k)),
        backward=draw(st.lists(_COST, min_size=k, max_size=k)),
        weight=draw(st.lists(st.floats(0.0, 3.0), min_size=k, max_size=k)),
        comm=draw(st.lists(st.floats(0.0, 1.0), min_size=k - 1, max_size=k - 1)),
        activation=draw(st.lists(st.floats(0.5, 2.0), min_size=k, max_size=k)),
    )
    return costs, m


@settings(max_examples=40, deadline=None)
@given(_problems())
def test_auto_is_never_slower_than_the_best_named_schedule(problem: tuple[StageCosts, int]) -> None:
    costs, m = problem
    choice = search(costs, costs.num_stages, m)
    assert choice.chosen.time <= min(_named_times(costs, m).values()) * (1 + 1e-9)
    # The time the table reports is the simulator's for that schedule.
    again = simulate(choice.schedule, costs.forward, costs.backward, costs.weight, costs.comm)
    assert again.makespan == pytest.approx(choice.chosen.time)


@settings(max_examples=40, deadline=None)
@given(_problems(), st.floats(1.0, 4.0))
def test_the_chosen_schedule_fits_the_memory_limit(problem: tuple[StageCosts, int], scale: float) -> None:
    costs, m = problem
    limit = max(costs.activation) * scale
    try:
        choice = search(costs, costs.num_stages, m, memory_limit=limit)
    except ScheduleError as exc:
        assert "no schedule fits" in str(exc)
        return
    times = simulate_times(choice.schedule, costs.forward, costs.backward, costs.weight, costs.comm)
    assert max(peak_memory(choice.schedule, costs.activation, times=times)) <= limit * (1 + 1e-9)
    assert max(choice.chosen.peak_memory) <= limit * (1 + 1e-9)
    # Nothing that fits is faster than the one chosen.
    assert all(c.time >= choice.chosen.time * (1 - 1e-9) for c in choice.candidates if c.fits)


def test_a_limit_nothing_fits_is_refused_with_the_least_peak() -> None:
    costs = StageCosts.uniform(4, **UNEVEN, activation=2.0)
    with pytest.raises(ScheduleError, match=r"no schedule fits memory_limit=1.*least peak.*; greedy: .*below one"):
        search(costs, 4, 8, memory_limit=1.0)


def test_a_tighter_limit_picks_a_leaner_schedule() -> None:
    costs = StageCosts.uniform(8, **UNEVEN)
    free = search(costs, 8, 32)
    lean = search(costs, 8, 32, memory_limit=8)  # 1F1B's peak on its first worker
    assert max(free.chosen.peak_memory) > 8 >= max(lean.chosen.peak_memory)
    assert lean.chosen.time >= free.chosen.time
    assert any(not c.fits for c in lean.candidates)
    assert "over memory_limit" in lean.table()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: search([1.0, 1.0], 2, 4), "costs must be a StageCosts"),  # type: ignore[arg-type]
        (lambda: search(StageCosts.uniform(2), 3, 4), "does not match the costs"),
        (lambda: search(StageCosts.uniform(2), 2, 0), "microbatches must be an integer >= 1"),
        (lambda: search(StageCosts.uniform(2), 2, 4, memory_limit=0), "memory_limit must be a number > 0"),
        (lambda: search(StageCosts.uniform(2), 2, 4, memory_limit="1"), "memory_limit must be"),  # type: ignore[arg-type]
        (lambda: search(StageCosts.uniform(2), 2, 4, schedules=["2f2b"]), "unknown schedules"),
        (lambda: StageCosts.uniform(0), "stages must be an integer >= 1"),
        (lambda: StageCosts.uniform(2, forward=[1.0]), "forward has 1 entries; expected 2"),
        (lambda: StageCosts.uniform(2, backward=0.0), "backward cost must be finite and > 0"),
        (lambda: StageCosts.uniform(2, weight=-1.0), "weight cost must be finite and >= 0"),
        (lambda: StageCosts.uniform(2, comm=math.nan), "comm"),
        (lambda: StageCosts.uniform(3, comm=[0.1]), "comm .* has 1 entries; expected 2"),
        (lambda: StageCosts.from_measured([1.0], [1.0], [1.0], weight_share=1.0), "weight_share must be in"),
        (lambda: greedy_schedule(0, 4), "stages must be an integer >= 1"),
        (lambda: greedy_schedule(2, 4, forward=0.0), "forward cost must be finite and > 0"),
        (lambda: greedy_schedule(2, 4, memory_limit=0.5), "below one micro-batch's activation on stage 0"),
        (lambda: greedy_schedule(2, 4, backlog=0), "backlog must be an integer >= 1"),
        (lambda: greedy_schedule(2, 4, backlog=[1]), "backlog must be an integer >= 1, one per stage"),
    ],
)
def test_bad_arguments_are_refused(call: object, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        call()  # type: ignore[operator]


def test_measured_costs_split_the_backward_by_the_weight_share() -> None:
    costs = StageCosts.from_measured([1.0, 2.0], [2.0, 4.0], [10.0, 20.0], weight_share=0.25, comm=0.5)
    assert costs.backward == (1.5, 3.0) and costs.weight == (0.5, 1.0)
    assert costs.comm == (0.5,) and costs.activation == (10.0, 20.0)


# -- the greedy scheduler -------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(_problems(), st.one_of(st.none(), st.floats(1.0, 6.0)))
def test_greedy_validates_simulates_and_keeps_to_its_limit(
    problem: tuple[StageCosts, int], scale: float | None
) -> None:
    costs, m = problem
    k = costs.num_stages
    limit = None if scale is None else max(costs.activation) * scale
    schedule = greedy_schedule(
        k, m, costs.forward, costs.backward, costs.weight, costs.comm, costs.activation, limit
    )  # validated inside; validate again to be sure the checks ran on this object
    schedule.validate()
    assert schedule.split_pairs == {(s, i) for s in range(k) for i in range(m)}
    times = simulate_times(schedule, costs.forward, costs.backward, costs.weight, costs.comm)
    assert len(times) == 3 * k * m
    if limit is not None:
        assert max(peak_memory(schedule, costs.activation, times=times)) <= limit * (1 + 1e-9)


@pytest.mark.parametrize(("k", "m"), [(4, 8), (8, 32), (3, 6), (8, 16), (1, 3)])
def test_greedy_without_a_limit_reaches_the_lower_bound_for_unit_costs(k: int, m: int) -> None:
    """The last worker cannot start before K - 1 forwards and then runs 3M units: with M >= 2K greedy takes no more."""
    t = simulate(greedy_schedule(k, m))
    assert t.makespan == pytest.approx(3 * m + k - 1)
    assert t.makespan <= simulate(build("zb-h1", k, m)).makespan


def test_greedy_with_1f1b_memory_matches_zb_h1() -> None:
    greedy = greedy_schedule(8, 32, memory_limit=8)
    zb = build("zb-h1", 8, 32)
    assert simulate(greedy).makespan == pytest.approx(simulate(zb).makespan)
    assert max(peak_memory(greedy, 1.0)) <= max(peak_memory(zb, 1.0))


@pytest.mark.parametrize("backlog", [1, 2, [3, 1, 2]])
def test_greedy_defers_no_more_w_than_its_backlog(backlog: int | list[int]) -> None:
    schedule = greedy_schedule(3, 9, forward=[1.0, 2.0, 1.0], backward=1.5, weight=[2.0, 0.5, 1.0], backlog=backlog)
    bounds = [backlog] * 3 if isinstance(backlog, int) else backlog
    for w, actions in enumerate(schedule.workers):
        due = 0
        for a in actions:
            assert a.kind != "F" or due < bounds[w], (w, a)  # with the backlog full, a W runs before any F
            due += {"B": 1, "W": -1}.get(a.kind, 0)


def test_the_search_keeps_the_fastest_greedy_variant() -> None:
    costs = StageCosts.uniform(5, [0.6, 2.0, 1.2, 1.9, 1.7], [1.9, 1.0, 1.8, 0.8, 0.7], [0.3, 0.2, 1.6, 2.0, 1.1], 0.2)
    args = (5, 11, costs.forward, costs.backward, costs.weight, costs.comm, costs.activation, 5.0)
    times = {b: simulate(greedy_schedule(*args, backlog=b), *args[2:6]).makespan for b in (None, 1, 2, 3, 4, 5)}
    chosen = next(c for c in search(costs, 5, 11, memory_limit=5.0).candidates if c.name == "greedy")
    assert chosen.time == pytest.approx(min(times.values())) and chosen.time < times[None]
    assert chosen.label.startswith("greedy backlog=")


def test_greedy_with_room_for_one_activation_runs_one_micro_batch_at_a_time() -> None:
    schedule = greedy_schedule(3, 4, memory_limit=1.0)
    assert max(peak_memory(schedule, 1.0)) == 1.0
    assert [str(a) for a in schedule.workers[0][:3]] == ["0F0", "0B0", "0F1"]
