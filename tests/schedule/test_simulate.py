"""The simulator reproduces the known bubble formulas and orders the schedules as the papers do."""

from __future__ import annotations

import pytest

from fastpipe.schedule import ScheduleError, build, simulate


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 32])
def test_unit_cost_makespan_and_bubble(k: int, m: int) -> None:
    t = simulate(build("1f1b", k, m), forward=1.0, backward=1.0, weight=1.0)  # F = 1, BW = 2
    assert t.makespan == pytest.approx(3 * (m + k - 1))
    assert t.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize(("f", "b", "w"), [(1.0, 1.0, 1.0), (1.0, 0.8, 1.2), (2.0, 1.0, 1.0), (1.0, 1.0, 0.2)])
def test_gpipe_drain_reaches_the_zero_bubble_bound(k: int, m: int, f: float, b: float, w: float) -> None:
    """Splitting worker w's first w backwards leaves a bubble of (K-1)(F+B), not (K-1)(F+B+W)."""
    from fastpipe.schedule.builders import _gpipe
    from fastpipe.schedule.ir import Schedule

    split = simulate(build("gpipe", k, m), forward=f, backward=b, weight=w)
    assert split.makespan == pytest.approx((k - 1) * (f + b) + m * (f + b + w))
    fused = Schedule("gpipe", k, m, k, tuple(tuple(a) for a in _gpipe(k, m, split_drain=False)))
    fused.validate()
    assert simulate(fused, forward=f, backward=b, weight=w).makespan == pytest.approx((m + k - 1) * (f + b + w))
    assert split.peak_activations == [m] * k  # the deferred W's keep nothing alive past the drain's start


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("m", [8, 16, 32])
def test_zb_h1_cuts_the_1f1b_bubble_to_about_a_third(k: int, m: int) -> None:
    zb = simulate(build("zb-h1", k, m))
    one = simulate(build("1f1b", k, m))
    assert zb.bubble_fraction < one.bubble_fraction
    assert zb.makespan == pytest.approx(3 * m + k - 1)  # bubble (K-1)(F+B-W) against 1F1B's (K-1)(F+B+W)
    assert zb.peak_activations == one.peak_activations


@pytest.mark.parametrize("k", [2, 4])
def test_interleaved_has_a_smaller_bubble_than_1f1b(k: int) -> None:
    m = 4 * k
    inter = simulate(build("interleaved", k, m, virtual_stages=2), forward=0.5, backward=0.5, weight=0.5)
    one = simulate(build("1f1b", k, m))
    assert inter.bubble_fraction < one.bubble_fraction


def test_peak_activations() -> None:
    k, m = 4, 16
    assert simulate(build("gpipe", k, m)).peak_activations == [m] * k
    peaks = simulate(build("1f1b", k, m)).peak_activations
    assert peaks[0] <= k and peaks == [4, 3, 2, 1]


def test_per_stage_costs_and_comm() -> None:
    s = build("gpipe", 2, 1)
    t = simulate(s, forward=[1.0, 2.0], backward=[1.0, 1.0], weight=[0.0, 1.0], comm=0.5)
    # 0F0 [0,1] -> +0.5 -> 1F0 [1.5,3.5] -> 1B0 [3.5,4.5] -> +0.5 -> 0BW0 [5,6]; 1W0 [4.5,5.5]
    assert t.makespan == pytest.approx(6.0)
    events = {e.action: (e.start, e.end) for e in t.events}
    assert events["1F0"] == pytest.approx((1.5, 3.5))
    assert events["1W0"] == pytest.approx((4.5, 5.5))
    assert events["0BW0"] == pytest.approx((5.0, 6.0))
    with pytest.raises(ScheduleError, match="forward has 3 entries; expected 2"):
        simulate(s, forward=[1.0, 1.0, 1.0])


def test_combined_backward_can_cost_other_than_b_plus_w() -> None:
    s = build("1f1b", 2, 4)
    default = simulate(s, forward=1.0, backward=1.0, weight=1.0)
    assert simulate(s, forward=1.0, backward=1.0, weight=1.0, combined=2.0).makespan == default.makespan
    cheaper = simulate(s, forward=1.0, backward=5.0, weight=5.0, combined=[1.5, 1.5])
    assert cheaper.makespan == pytest.approx(2.5 * (4 + 1))
    with pytest.raises(ScheduleError, match="combined has 3 entries"):
        simulate(s, combined=[1.0, 1.0, 1.0])


def test_split_backward_costs() -> None:
    t = simulate(build("zb-h1", 1, 2), forward=1.0, backward=2.0, weight=3.0)
    assert t.makespan == pytest.approx(2 * (1 + 2 + 3))
    assert t.bubble_fraction == pytest.approx(0.0)


def test_comm_events_do_not_count_as_busy() -> None:
    s = build("1f1b", 2, 4).with_communication()
    t = simulate(s, comm=1.0)
    assert any("SEND" in e.action for e in t.events)
    busy = sum(e.end - e.start for e in t.events if "SEND" not in e.action and "RECV" not in e.action)
    assert t.bubble_fraction == pytest.approx(1 - busy / (2 * t.makespan))


@pytest.mark.parametrize(("name", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_compiled_simulation_matches_simulate(name: str, v: int) -> None:
    from fastpipe.schedule.simulate import CompiledSimulation

    s = build(name, 3, 6, virtual_stages=v)
    n = s.num_stages
    fwd = [1.0 + 0.3 * i for i in range(n)]
    bwd = [2.0 - 0.1 * i for i in range(n)]
    wgt = [0.5 + 0.2 * i for i in range(n)]
    comm = [0.1 * (i + 1) for i in range(n - 1)]
    for sched in (s, s.with_communication()):
        expected = simulate(sched, forward=fwd, backward=bwd, weight=wgt, comm=comm).makespan
        assert CompiledSimulation(sched, comm)(fwd, bwd, wgt) == pytest.approx(expected)
