"""Plans for order-matched transports (NCCL): safe for every built-in schedule, and the checker has teeth."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from fastpipe.schedule import SCHEDULES, Action, Schedule, ScheduleError, build
from fastpipe.schedule.ordered import Op, Step, check_ordered, inputs, outputs, plan


def _configs():
    for name in SCHEDULES:
        for k in range(1, 7):
            for m in range(1, 10):
                for v in (1, 2, 3) if name == "interleaved" else (None,):
                    if (name == "interleaved" and m % k) or (name == "dualpipev" and m < 2 * k):
                        continue
                    yield name, k, m, v


@pytest.mark.parametrize("name", SCHEDULES)
def test_plans_of_every_builtin_schedule_are_safe_on_nccl(name: str) -> None:
    for _, k, m, v in (c for c in _configs() if c[0] == name):
        s = build(name, k, m, virtual_stages=v)
        check_ordered(s)
        sends: Counter = Counter()
        receives: Counter = Counter()
        for w in range(k):
            steps = plan(s, w)
            assert [st.action for st in steps if st.action is not None] == list(s.workers[w])
            for i, st in enumerate(steps):
                sends.update(op.message for op in st.ops if op.send)
                receives.update(op.message for op in st.ops if not op.send)
                if st.action is not None and outputs(s, st.action):  # sent right after it is produced
                    assert i + 1 < len(steps) and steps[i + 1].action is None
                    assert {msg for msg, _ in outputs(s, st.action)} <= {op.message for op in steps[i + 1].ops}
        expected = Counter(msg for w in range(k) for a in s.workers[w] for msg in inputs(s, a))
        assert sends == expected and receives == expected, (name, k, m, v)


def _per_action_batches(s: Schedule, worker: int) -> list[Step]:
    """The obvious plan: after each action, one batch with its sends and the next action's receives."""
    steps: list[Step] = []
    pending: list[Op] = []
    for a in s.workers[worker]:
        ops = pending + [
            Op(False, msg, s.worker_of(msg.stage + (-1 if msg.kind == "F" else 1)), worker) for msg in inputs(s, a)
        ]
        if ops:
            steps.append(Step(ops=tuple(ops)))
        steps.append(Step(action=a))
        pending = [Op(True, msg, worker, dst) for msg, dst in outputs(s, a)]
    if pending:
        steps.append(Step(ops=tuple(pending)))
    return steps


def test_checker_rejects_the_per_action_plan_that_deadlocks_gpipe() -> None:
    # GPipe, 2 stages, 1 micro-batch: worker 0 posts [send F, receive B] as one batch, but the
    # gradient's header cannot exist before worker 1 had the activation: a real NCCL hang.
    s = build("gpipe", 2, 1)
    with pytest.raises(ScheduleError, match="can deadlock"):
        check_ordered(s, [_per_action_batches(s, w) for w in range(2)])
    check_ordered(s)


def test_checker_rejects_receives_out_of_order() -> None:
    s = build("gpipe", 2, 4)
    programs = [plan(s, w) for w in range(2)]
    recv = [i for i, st in enumerate(programs[1]) if st.action is None and all(not op.send for op in st.ops)]
    a, b = recv[0], recv[1]
    swapped = list(programs[1])  # receive b's value earlier, in one batch, ahead of a's: NCCL would cross them
    swapped[a] = Step(ops=programs[1][b].ops + programs[1][a].ops)
    del swapped[b]
    with pytest.raises(ScheduleError, match="in an order that worker does not receive in"):
        check_ordered(s, [programs[0], swapped])


def test_plan_of_a_deadlocking_schedule_raises() -> None:
    # Worker 1 wants micro-batch 1 first while worker 0 produces micro-batch 0 first and then
    # waits for its gradient: no ordering of transfers can save it.
    w0 = (Action("F", 0, 0), Action("BW", 0, 0), Action("F", 0, 1), Action("BW", 0, 1))
    w1 = (Action("F", 1, 1), Action("BW", 1, 1), Action("F", 1, 0), Action("BW", 1, 0))
    s = Schedule("custom", 2, 2, 2, (w0, w1))
    with pytest.raises(ScheduleError, match="deadlock"):
        plan(s, 0)


def test_nccl_needs_stages_on_the_current_gpu_and_a_known_transport() -> None:
    from fastpipe.distributed.ranks import check_nccl_device, order_matched

    with pytest.raises(ValueError, match="CUDA tensors.*gloo group for CPU stages"):
        check_nccl_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="ignores tags"):
        order_matched("nccl", "tags")
    assert order_matched("gloo", "tags") is False
    with pytest.raises(ValueError, match="'tags', 'ordered' or None"):
        order_matched("gloo", "fifo")
    assert order_matched("nccl", None) is True and order_matched("gloo", None) is False


def test_format_plan_shows_batches_between_actions() -> None:
    from fastpipe.schedule.ordered import format_plan

    text = format_plan(build("1f1b", 2, 2))
    assert text.splitlines()[0].startswith("worker 0: 0F0 [sF1/0] 0F1")
    assert "[rF1/0]" in text.splitlines()[1] and len(text.splitlines()) == 2


def test_even_workers_post_sends_ahead_but_both_sides_doing_it_would_deadlock() -> None:
    from fastpipe.schedule.ordered import _plans, _split

    s = build("1f1b", 2, 4)
    rounds = _plans(s)
    assert any(any(op.send for op in st.ops) and any(not op.send for op in st.ops) for st in rounds[0])
    mine = plan(s, 0)
    assert all(not (any(op.send for op in st.ops) and any(not op.send for op in st.ops)) for st in mine)
    assert plan(s, 1) == list(rounds[1])
    with pytest.raises(ScheduleError, match="can deadlock"):
        check_ordered(s, [_split(steps) for steps in rounds])  # a swap where each side sends first


def test_checker_rejects_a_send_before_its_producer_and_misplaced_ops() -> None:
    s = build("gpipe", 2, 1)
    programs = [plan(s, w) for w in range(2)]
    early = list(programs[0])
    early[0], early[1] = early[1], early[0]  # [sF1/0] before 0F0
    with pytest.raises(ScheduleError, match="before producing it"):
        check_ordered(s, [early, programs[1]])
    late = [st for st in programs[1] if st.action is not None or any(op.send for op in st.ops)]
    with pytest.raises(ScheduleError, match="before receiving"):
        check_ordered(s, [programs[0], late])


@settings(max_examples=60, deadline=None)
@given(data=hs.data())
def test_plans_with_skips_carry_each_skip_once_and_are_safe(data: hs.DataObject) -> None:
    name, k, m, v = data.draw(hs.sampled_from([c for c in _configs() if c[1] <= 4 and c[2] <= 6]))
    s = build(name, k, m, virtual_stages=v)
    pairs = [(p, c) for p in range(s.num_stages) for c in range(p + 1, s.num_stages)]
    edges = data.draw(hs.lists(hs.sampled_from(pairs), max_size=4, unique=True)) if pairs else []
    s = s.with_skips(edges)
    check_ordered(s)
    crossing = [(p, c) for p, c in s.skips if s.crosses(p, c)]
    for w in range(k):
        received: set = set()
        for step in plan(s, w):
            if step.action is None:
                received.update(op.message for op in step.ops if not op.send)
            else:  # every skip (or skip gradient) an action reads has come before it runs
                assert set(inputs(s, step.action)) <= received
    sent = Counter(op.message for w in range(k) for step in plan(s, w) for op in step.ops if op.send)
    skips = Counter(msg for msg in sent if msg.kind in ("S", "SB"))
    assert sum(skips.values()) == 2 * m * len(crossing) and set(skips.values()) <= {1}


def test_a_plan_without_the_skip_messages_is_refused() -> None:
    s = build("1f1b", 3, 4).with_skips([(0, 2)])
    stripped = [
        [
            Step(ops=tuple(op for op in st.ops if op.message.kind in ("F", "B"))) if st.action is None else st
            for st in plan(s, w)
        ]
        for w in range(3)
    ]
    with pytest.raises(ScheduleError, match="before receiving the (gradient of the )?skips from stage 0"):
        check_ordered(s, stripped)


def test_skip_edges_must_go_forward_between_stages() -> None:
    s = build("gpipe", 2, 2)
    for bad in ([(1, 0)], [(0, 2)], [(1, 1)]):
        with pytest.raises(ScheduleError, match="goes from a stage to a later one"):
            s.with_skips(bad)
    assert s.with_skips([(0, 1), (0, 1)]).skips == ((0, 1),)
    assert "skips 0->1" in str(s.with_skips([(0, 1)]))
