"""The near-zero-bubble schedules reach their targets in the simulator (F = B = W = 1, K = 8, M = 32).

- ``zb-h2`` and ``zb-v``: no idle time inside any worker's span (bubble <= 1%), and a one-step makespan at
  its floor: ``(K - 1)`` forwards before worker ``K - 1`` can start, plus its own work;
- ``zb-v``'s peak activations per worker (a V stage holds half a 1F1B stage) <= 1F1B's;
- the V placement shows in the IR, validates, and prints.
"""

from __future__ import annotations

import dataclasses

import pytest

from fastpipe.schedule import Action, ScheduleError, build, simulate, span_bubble_fraction
from fastpipe.schedule.placement import round_robin, v_shape
from fastpipe.schedule.simulate import peak_memory

K, M = 8, 32


def test_zb_h2_and_zb_v_leave_no_bubble_inside_the_workers_spans() -> None:
    for name in ("zb-h2", "zb-v"):
        timeline = simulate(build(name, K, M))
        assert span_bubble_fraction(timeline) <= 0.01, name
    # The measure has teeth: 1F1B and ZB-H1 leave idle time inside the spans.
    assert span_bubble_fraction(simulate(build("1f1b", K, M))) > 0.15
    assert span_bubble_fraction(simulate(build("zb-h1", K, M))) > 0.05


def test_one_step_makespans_meet_the_floor() -> None:
    # Worker K-1 runs its first forward after K-1 forwards upstream, then its 3 units per
    # (stage, micro-batch) without a gap: no schedule of one isolated step can end earlier.
    assert simulate(build("zb-h2", K, M)).makespan == 3 * M + K - 1
    assert simulate(build("zb-v", K, M)).makespan == 2 * 3 * M + K - 1
    one_f_one_b = simulate(build("1f1b", K, M)).bubble_fraction
    zb_v = simulate(build("zb-v", K, M)).bubble_fraction
    assert zb_v < 0.036 and one_f_one_b > 0.17  # 3.5% against 1F1B's 18%


def test_zb_v_holds_no_more_activations_than_1f1b() -> None:
    baseline = max(peak_memory(build("1f1b", K, M), 1.0))
    v_stage = max(peak_memory(build("zb-v", K, M), 0.5))  # 2K stages: half a 1F1B stage each
    assert v_stage <= baseline
    # ZB-H2 buys its bubble with about twice 1F1B's activations on worker 0.
    assert max(peak_memory(build("zb-h2", K, M), 1.0)) == 2 * K - 1


def test_dualpipev_meets_the_v_floor_with_combined_backwards() -> None:
    s = build("dualpipev", K, M)
    assert {a.kind for _, a in s.actions()} == {"F", "BW", "B", "W"}
    assert simulate(s).makespan == 2 * 3 * M + K - 1
    # Each overlapped pair of DualPipeV is an adjacent F and BW of the worker's two stages.
    pairs = sum(
        1
        for actions in s.workers
        for a, b in zip(actions, actions[1:])
        if a.kind == "F" and b.kind == "BW" and a.stage != b.stage
    )
    assert pairs >= K * (M - 2 * K)


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_placement_is_data_in_the_ir(name: str) -> None:
    s = build(name, 3, 6)
    assert s.placement == v_shape(3) == (0, 1, 2, 2, 1, 0)
    assert [s.stages_of(w) for w in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert not s.crosses(2, 3) and s.crosses(0, 1)
    text = str(s)
    assert "placement (V shape): worker 0: 0+5, worker 1: 1+4, worker 2: 2+3" in text
    lowered = s.with_communication()
    lowered.validate()
    # Stages 2 and 3 share worker 2: no message between them.
    assert Action("SEND_F", 2, 0) not in {a for _, a in lowered.actions()}
    assert "placement" not in str(build("interleaved", 3, 6, virtual_stages=2))


def test_validate_checks_the_placement() -> None:
    s = build("zb-v", 2, 4)
    with pytest.raises(ScheduleError, match="placement maps 3 stages; the schedule has 4"):
        dataclasses.replace(s, placement=(0, 1, 0)).validate()
    with pytest.raises(ScheduleError, match="puts stage 2 on worker 2; workers are 0..1"):
        dataclasses.replace(s, placement=(0, 1, 2, 0)).validate()
    with pytest.raises(ScheduleError, match=r"different numbers of stages \(worker 0: 3, worker 1: 1\)"):
        dataclasses.replace(s, placement=(0, 1, 0, 0)).validate()
    # Actions on the wrong worker for the placement: the V's order under round robin.
    with pytest.raises(ScheduleError, match="3F0 is on worker 0 but stage 3 lives on worker 1"):
        dataclasses.replace(s, placement=round_robin(4, 2)).validate()


def test_the_default_placement_is_round_robin() -> None:
    s = build("interleaved", 2, 4, virtual_stages=2)
    assert s.placement == (0, 1, 0, 1) and [s.worker_of(i) for i in range(4)] == [0, 1, 0, 1]
    assert dataclasses.replace(s, placement=()) == s


@pytest.mark.parametrize("name", ["zb-h2", "zb-v"])
def test_no_bubble_in_span_from_2k_minus_1_microbatches(name: str) -> None:
    for k in range(1, 7):
        for m in range(2 * k - 1, 2 * k + 5):
            assert span_bubble_fraction(simulate(build(name, k, m))) < 1e-9, (name, k, m)
    assert span_bubble_fraction(simulate(build(name, 4, 3))) > 0.05  # a V or a warm-up left unfilled
