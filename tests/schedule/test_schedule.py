"""Schedules are data: every built-in schedule validates, and validate() catches broken ones."""

from __future__ import annotations

import pytest

from fastpipe.schedule import SCHEDULES, Action, Schedule, ScheduleError, build, simulate


def _legal(name: str, k: int, m: int, v: int = 1) -> bool:
    if name == "dualpipev":
        return m >= 2 * k
    return name != "interleaved" or m % k == 0


def _virtual(name: str) -> tuple[int, ...]:
    return {"interleaved": (1, 2, 3), "zb-v": (2,), "dualpipev": (2,)}.get(name, (1,))


@pytest.mark.parametrize("name", SCHEDULES)
def test_all_builtin_schedules_validate(name: str) -> None:
    for k in range(1, 9):
        for m in range(1, 33):
            for v in _virtual(name):
                if not _legal(name, k, m, v):
                    continue
                s = build(name, k, m, virtual_stages=v)  # build() validates
                assert s.num_workers == k and s.num_stages == k * v and s.num_microbatches == m
                # GPipe splits the first w backwards of worker w (see builders._gpipe).
                zero_bubble = name in ("zb-h1", "zb-h2", "zb-v", "dualpipev")
                assert s.split_backward == (zero_bubble or (name == "gpipe" and k > 1 and m > 0))
                if k in (2, 4) and m in (4, 8):
                    s.with_communication().validate()


def test_action_text_round_trip() -> None:
    for kind in ("F", "B", "W", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B"):
        for stage, mb in ((0, 0), (3, 12), (15, 7)):
            action = Action(kind, stage, mb)
            assert Action.parse(str(action)) == action
    assert str(Action("F", 1, 3)) == "1F3"
    assert str(Action("BW", 0, 2)) == "0BW2"
    with pytest.raises(ScheduleError, match="cannot parse"):
        Action.parse("F13")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "pipedream", "stages": 2, "microbatches": 4}, "valid schedules: gpipe, 1f1b, interleaved, zb-h1"),
        ({"name": "gpipe", "stages": 0, "microbatches": 4}, "stages must be an integer >= 1"),
        ({"name": "1f1b", "stages": 2, "microbatches": 0}, "microbatches must be an integer >= 1"),
        ({"name": "interleaved", "stages": 4, "microbatches": 6, "virtual_stages": 2}, "microbatches % stages == 0"),
        ({"name": "interleaved", "stages": 2, "microbatches": 1, "virtual_stages": 2}, "microbatches % stages == 0"),
        ({"name": "1f1b", "stages": 2, "microbatches": 4, "virtual_stages": 2}, "needs the 'interleaved'"),
        ({"name": "interleaved", "stages": 2, "microbatches": 4, "virtual_stages": 0}, "virtual_stages must be"),
        ({"name": "zb-h2", "stages": 2, "microbatches": 4, "virtual_stages": 2}, "needs the 'interleaved'"),
        ({"name": "zb-v", "stages": 2, "microbatches": 4, "virtual_stages": 1}, "zb-v places 2 stages on each worker"),
        ({"name": "dualpipev", "stages": 2, "microbatches": 4, "virtual_stages": 3}, "dualpipev places 2 stages"),
        ({"name": "dualpipev", "stages": 3, "microbatches": 5}, "at least as many micro-batches as stages: 6"),
    ],
)
def test_invalid_arguments_are_rejected_with_the_constraint(kwargs: dict, message: str) -> None:
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build(**kwargs)


def _edit(s: Schedule, worker: int, actions: list[str]) -> Schedule:
    workers = list(s.workers)
    workers[worker] = tuple(Action.parse(a) for a in actions)
    return Schedule(s.name, s.num_stages, s.num_microbatches, s.num_workers, tuple(workers))


def test_validate_catches_missing_action() -> None:
    s = build("gpipe", 2, 2)
    with pytest.raises(ScheduleError, match="missing action 1BW0"):
        _edit(s, 1, ["1F0", "1F1", "1BW1"]).validate()


def test_validate_catches_duplicate_action() -> None:
    s = build("gpipe", 2, 2)
    with pytest.raises(ScheduleError, match="1F1 appears 2 times"):
        _edit(s, 1, ["1F0", "1F1", "1F1", "1BW1", "1BW0"]).validate()


def test_validate_catches_wrong_worker() -> None:
    s = build("gpipe", 2, 2)
    bad = Schedule(s.name, 2, 2, 2, (s.workers[0] + (Action("F", 1, 0),), s.workers[1]))
    with pytest.raises(ScheduleError, match="1F0 is on worker 0 but stage 1 lives on worker 1"):
        bad.validate()


def test_validate_catches_deadlock_from_wrong_order() -> None:
    s = build("1f1b", 2, 2)
    # Worker 0 wants 0BW0 before 0F0 has run: it waits on itself.
    with pytest.raises(ScheduleError, match=r"deadlock: worker 0 stuck at 0BW0 waiting for 0F0"):
        _edit(s, 0, ["0BW0", "0F0", "0F1", "0BW1"]).validate()
    # A cycle across workers: worker 1 runs 1BW1 before 1F0, which needs 0F0... that worker 0 runs late.
    with pytest.raises(ScheduleError, match="deadlock"):
        _edit(s, 0, ["0F1", "0BW1", "0F0", "0BW0"]).validate()


def test_validate_catches_doubled_backward_and_bad_ranges() -> None:
    s = build("gpipe", 1, 1)
    with pytest.raises(ScheduleError, match="has both 0BW0 and a split B/W"):
        _edit(s, 0, ["0F0", "0BW0", "0B0"]).validate()
    with pytest.raises(ScheduleError, match="missing action 0W0"):
        _edit(s, 0, ["0F0", "0B0"]).validate()
    with pytest.raises(ScheduleError, match="micro-batch out of range"):
        _edit(s, 0, ["0F0", "0BW0", "0F5"]).validate()


def test_communication_lowering_matches_sends_and_receives() -> None:
    s = build("1f1b", 3, 4)
    lowered = s.with_communication()
    lowered.validate()
    text = [str(a) for a in lowered.workers[1]]
    assert text[:3] == ["1RECV_F0", "1F0", "1SEND_F0"]
    assert lowered.with_communication() == lowered
    assert lowered.without_communication() == s
    # Dropping a SEND leaves its RECV unmatched.
    broken = _edit(lowered, 0, [str(a) for a in lowered.workers[0] if str(a) != "0SEND_F2"])
    with pytest.raises(ScheduleError, match="1RECV_F2 needs 0SEND_F2"):
        broken.validate()
    # Same timing with and without explicit communication.
    for comm in (0.0, 0.5):
        assert simulate(lowered, comm=comm).makespan == pytest.approx(simulate(s, comm=comm).makespan)


def test_gpipe_and_1f1b_shapes() -> None:
    gpipe = build("gpipe", 2, 3)
    assert [str(a) for a in gpipe.workers[0]] == ["0F0", "0F1", "0F2", "0BW2", "0BW1", "0BW0"]
    assert [str(a) for a in gpipe.workers[1]] == ["1F0", "1F1", "1F2", "1B2", "1BW1", "1BW0", "1W2"]
    deep = build("gpipe", 3, 4)
    assert [str(a) for a in deep.workers[2]][4:] == ["2B3", "2B2", "2BW1", "2BW0", "2W3", "2W2"]
    one = build("1f1b", 3, 4)
    assert [str(a) for a in one.workers[0]][:4] == ["0F0", "0F1", "0F2", "0BW0"]
    assert [str(a) for a in one.workers[2]][:2] == ["2F0", "2BW0"]


def test_interleaved_places_chunks_round_robin() -> None:
    s = build("interleaved", 2, 4, virtual_stages=2)
    assert {a.stage for a in s.workers[0]} == {0, 2}
    assert {a.stage for a in s.workers[1]} == {1, 3}
    assert s.worker_of(3) == 1


def test_table_lists_every_worker() -> None:
    text = str(build("zb-h1", 3, 4))
    lines = text.splitlines()
    assert lines[0].startswith("zb-h1: 3 workers")
    assert sum(line.startswith("worker") for line in lines) == 3
    assert "2W0" in text
