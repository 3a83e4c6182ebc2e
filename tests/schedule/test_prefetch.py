"""The prefetch action ``P`` in the schedule IR: parsed, validated, placed by the pass, simulated, drawn."""

import pytest

from fastpipe.schedule import Action, Schedule, ScheduleError, build, simulate, simulate_times
from fastpipe.schedule.fuse import adjacent_pairs
from fastpipe.schedule.prefetch import with_prefetch, worth_prefetching
from fastpipe.schedule.simulate import span_bubble_fraction
from fastpipe.trace.timeline import Timeline

NAMES = [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb-h1", None), ("zb-h2", None), ("zb-v", None)]


def every_pair(s: Schedule) -> list[tuple[int, int]]:
    return [(st, m) for st in range(s.num_stages) for m in range(s.num_microbatches)]


def test_prefetch_action_parses_and_prints_in_the_compact_form():
    action = Action.parse("1P3")
    assert (action.kind, action.stage, action.microbatch) == ("P", 1, 3)
    assert str(action) == "1P3" and not action.is_comm


def test_a_backward_waits_for_its_prefetch_and_the_prefetch_for_its_forward():
    s = with_prefetch(build("1f1b", 2, 4), [(0, 1)])
    assert Action("P", 0, 1) in s.dependencies(Action("BW", 0, 1))
    assert s.dependencies(Action("P", 0, 1)) == [Action("F", 0, 1)]
    assert Action("P", 0, 2) not in s.dependencies(Action("BW", 0, 2))


def test_a_prefetch_after_its_backward_is_refused_as_a_deadlock():
    base = build("1f1b", 1, 2)
    late = Schedule(
        "late", 1, 2, 1, ((Action("F", 0, 0), Action("BW", 0, 0), Action("P", 0, 0), *base.workers[0][2:]),)
    )
    with pytest.raises(ScheduleError, match="deadlock"):
        late.validate()


def test_a_prefetch_before_its_forward_is_refused():
    base = build("1f1b", 1, 2)
    early = Schedule("early", 1, 2, 1, ((Action("P", 0, 0), *base.workers[0]),))
    with pytest.raises(ScheduleError, match="deadlock"):
        early.validate()


def test_a_prefetch_twice_is_refused():
    s = with_prefetch(build("gpipe", 1, 3), [(0, 0)])
    twice = Schedule("twice", 1, 3, 1, ((Action("P", 0, 0), *s.workers[0]),))
    with pytest.raises(ScheduleError, match="appears 2 times"):
        twice.validate()


@pytest.mark.parametrize("name, virtual", NAMES)
def test_the_pass_places_each_prefetch_between_its_forward_and_backward_without_splitting_a_fused_pair(name, virtual):
    base = build(name, 2, 6, virtual)
    out = with_prefetch(base, every_pair(base))
    out.validate()
    assert out.prefetched == frozenset(every_pair(base))
    assert adjacent_pairs(out) == adjacent_pairs(base)
    for actions in out.workers:
        where = {a: i for i, a in enumerate(actions)}
        for a in actions:
            if a.kind == "P":
                assert (
                    where[Action("F", a.stage, a.microbatch)] < where[a] < where[out.backward_of(a.stage, a.microbatch)]
                )
    assert tuple(tuple(a for a in w if a.kind != "P") for w in out.workers) == base.workers


def test_the_pass_leaves_lookahead_compute_actions_between_prefetch_and_backward():
    base = build("gpipe", 1, 6)
    for lookahead in (0, 1, 2):
        out = with_prefetch(base, [(0, 2)], lookahead)
        actions = [a for a in out.workers[0]]
        gap = actions.index(Action("BW", 0, 2)) - actions.index(Action("P", 0, 2)) - 1
        assert gap == lookahead


def test_the_pass_is_idempotent_and_keeps_a_given_prefetch_where_it_is():
    base = build("zb-h1", 2, 4)
    once = with_prefetch(base, every_pair(base))
    assert with_prefetch(once, every_pair(base)) is once
    assert with_prefetch(base, []) is base


def test_the_pass_also_lowers_to_communication_actions():
    out = with_prefetch(build("zb-v", 2, 4), every_pair(build("zb-v", 2, 4))).with_communication()
    out.validate()
    assert out.prefetched


def test_the_pass_refuses_a_pair_outside_the_schedule_and_a_negative_lookahead():
    with pytest.raises(ScheduleError, match="stage 5, micro-batch 0"):
        with_prefetch(build("1f1b", 2, 4), [(5, 0)])
    with pytest.raises(ScheduleError, match="lookahead"):
        with_prefetch(build("1f1b", 2, 4), [(0, 0)], -1)


def test_only_micro_batches_with_work_between_forward_and_backward_are_worth_prefetching():
    s = build("1f1b", 2, 4)
    worth = worth_prefetching(s, every_pair(s))
    assert (1, 0) not in worth  # the last stage runs each backward right after its forward
    assert worth == {(0, 1), (0, 2)}
    assert worth_prefetching(s, every_pair(s), lookahead=0) >= worth


def test_a_free_copy_costs_no_time_and_a_slow_one_delays_its_backward():
    base = build("1f1b", 4, 8)
    out = with_prefetch(base, worth_prefetching(base, every_pair(base)))
    plain = simulate(base, 1.0, 1.0, 1.0).makespan
    assert simulate(out, 1.0, 1.0, 1.0).makespan == plain
    assert simulate(out, 1.0, 1.0, 1.0, prefetch=0.5, offload=0.5).makespan == plain  # hidden by the compute between
    times = simulate_times(out, 1.0, 1.0, 1.0, prefetch=5.0)
    assert max(end for _, _, end in times.values()) > plain
    for action, (_, start, _) in times.items():
        if action.kind == "BW" and (action.stage, action.microbatch) in out.prefetched:
            assert start >= times[Action("P", action.stage, action.microbatch)][2]


def test_the_worker_goes_on_while_its_prefetch_copies_and_copies_queue_on_their_lane():
    base = build("gpipe", 1, 4)
    out = with_prefetch(base, [(0, 0), (0, 1), (0, 2)])
    times = simulate_times(out, 1.0, 1.0, 0.0, prefetch=3.0)
    order = out.workers[0]
    for a, b in zip(order, order[1:]):
        if a.kind == "P" and a not in out.dependencies(b):
            assert times[b][1] < times[a][2]  # the next action did not wait for the copy
    ends = sorted(times[a][2] for a in order if a.kind == "P")
    assert all(later - earlier >= 3.0 - 1e-9 for earlier, later in zip(ends, ends[1:]))


def test_a_prefetch_waits_for_the_offload_it_brings_back():
    base = build("gpipe", 1, 2)
    out = with_prefetch(base, [(0, 0)], lookahead=0)
    times = simulate_times(out, 1.0, 1.0, 0.0, prefetch=1.0, offload=10.0)
    f_end = times[Action("F", 0, 0)][2]
    assert times[Action("P", 0, 0)][2] == pytest.approx(f_end + 10.0 + 1.0)


def test_copies_are_not_busy_time_nor_part_of_a_span_and_are_drawn(tmp_path):
    base = build("1f1b", 4, 8)
    out = with_prefetch(base, worth_prefetching(base, every_pair(base)))
    timeline = simulate(out, 1.0, 1.0, 1.0, prefetch=0.5, offload=0.5)
    plain = simulate(base, 1.0, 1.0, 1.0)
    assert timeline.busy == plain.busy
    assert timeline.makespan == plain.makespan
    assert span_bubble_fraction(timeline) == pytest.approx(span_bubble_fraction(plain))
    assert any(e.kind == "P" for e in timeline.events)
    pytest.importorskip("matplotlib")
    path = tmp_path / "gantt.png"
    timeline.plot(path)
    assert path.stat().st_size > 0


def test_a_timeline_event_of_a_prefetch_reads_its_kind():
    t = Timeline(1)
    t.record(0, "2P7", 0.0, 1.0)
    assert t.events[0].kind == "P" and t.busy == [0.0]
