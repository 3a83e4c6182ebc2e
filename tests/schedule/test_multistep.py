"""Multi-step schedules are schedules too: U actions print, parse, validate, simulate and draw."""

from __future__ import annotations

import dataclasses

import pytest

from fastpipe.schedule import Action, Schedule, ScheduleError, simulate
from fastpipe.schedule.multistep import build_multistep, steady_state_time, update_lag, weight_versions


def test_update_action_text_round_trip() -> None:
    assert str(Action("U", 0, 1)) == "0U1"
    assert Action.parse("3U12") == Action("U", 3, 12)


@pytest.mark.parametrize("flush", [False, True])
def test_streams_validate_print_and_simulate(flush: bool) -> None:
    for k in (1, 2, 3, 4):
        for m in (1, 2, 4):
            for n in (1, 3):
                s = build_multistep(k, m, n, flush)  # validates
                assert s.num_minibatches == n and s.num_microbatches == m * n
                assert sum(a.kind == "U" for _, a in s.actions()) == k * n
                s.with_communication().validate()
    s = build_multistep(2, 2, 3, flush)
    text = str(s)
    assert "0U0" in text and "1U2" in text and ("flushed" if flush else "no flush") in text
    timeline = simulate(s, forward=1.0, backward=2.0, weight=0.0, update=0.5)
    assert {e.kind for e in timeline.events} == {"F", "BW", "U"}


def test_validate_catches_broken_streams() -> None:
    good = build_multistep(2, 2, 2, flush=False)
    w0 = list(good.workers[0])
    # An update before its mini-batch's last backward on that stage can never run.
    early = [a for a in w0 if a != Action("U", 0, 0)]
    early.insert(early.index(Action("BW", 0, 1)), Action("U", 0, 0))
    with pytest.raises(ScheduleError, match="deadlock"):
        dataclasses.replace(good, workers=(tuple(early), good.workers[1])).validate()
    with pytest.raises(ScheduleError, match="missing update 0U1"):
        dataclasses.replace(good, workers=(tuple(a for a in w0 if a != Action("U", 0, 1)), good.workers[1])).validate()
    with pytest.raises(ScheduleError, match="mini-batch out of range"):
        dataclasses.replace(good, workers=(tuple(w0) + (Action("U", 0, 2),), good.workers[1])).validate()
    with pytest.raises(ScheduleError, match="need a multi-step schedule"):
        Schedule("x", 1, 1, 1, ((Action("F", 0, 0), Action("BW", 0, 0), Action("U", 0, 0)),)).validate()
    with pytest.raises(ScheduleError, match="must divide"):
        dataclasses.replace(good, minibatch_size=3).validate()
    # The asynchronous order read as a flushed stream: forwards of mini-batch 1 run before the update of 0.
    with pytest.raises(ScheduleError, match="deadlock"):
        dataclasses.replace(good, flush=True).validate()


def test_update_lag_hand_count() -> None:
    # K=2, M=1:  w0: F0 F1 BW0 U0 F2 BW1 U1 F3 BW2 U2 BW3 U3   w1: F0 BW0 U0 F1 BW1 U1 ...
    # Stage 0: F1 runs before U0 and its gradient is applied by U1: one update in between.
    lag = update_lag(build_multistep(2, 1, 4))
    assert [lag[(0, m)] for m in range(4)] == [0, 1, 1, 1]
    assert [lag[(1, m)] for m in range(4)] == [0, 0, 0, 0]
    # K=2, M=2:  w0: F0 F1 BW0 F2 BW1 U0 F3 BW2 F4 BW3 U1 F5 BW4 BW5 U2
    # F2 sees 0 updates, U1 is the 2nd: lag 1; F3 runs after U0: lag 0; F4 before U1, applied by U2: 1.
    lag = update_lag(build_multistep(2, 2, 3))
    assert [lag[(0, m)] for m in range(6)] == [0, 0, 1, 0, 1, 0]
    assert all(lag[(1, m)] == 0 for m in range(6))
    # K=4, M=1, stage s: K-1-s updates land between a forward and its update, once the stream is full.
    lag = update_lag(build_multistep(4, 1, 8))
    assert [lag[(s, 7)] for s in range(4)] == [3, 2, 1, 0]
    assert all(v == 0 for v in update_lag(build_multistep(4, 2, 3, flush=True)).values())
    with pytest.raises(ScheduleError, match="not a multi-step schedule"):
        update_lag(build_multistep(2, 1, 1).without_communication().__class__("1f1b", 1, 1, 1, ((),)))


def test_weight_versions() -> None:
    # Stash holds the versions in flight that an update superseded: K-1-s at M=1 (K with the live one).
    versions = weight_versions(build_multistep(4, 1, 8))
    assert versions["stash"] == [3, 2, 1, 0]
    assert versions["predict"] == [4, 3, 2, 0]  # one prediction per micro-batch in flight with a lag
    assert versions["sync"] == versions["stale"] == [0, 0, 0, 0]
    flushed = weight_versions(build_multistep(4, 2, 3, flush=True))
    assert flushed["stash"] == flushed["predict"] == [0, 0, 0, 0]


def test_steady_state_gain_is_the_bubble() -> None:
    f, b = 1.0, 2.0
    for k in (2, 4):
        for m in (1, 4):
            assert steady_state_time(k, m, flush=False, forward=f, backward=b) == pytest.approx(m * (f + b))
            assert steady_state_time(k, m, flush=True, forward=f, backward=b) == pytest.approx((m + k - 1) * (f + b))


def test_virtual_stage_stream_lags_by_hand() -> None:
    # 4 stages on 2 workers, M=2, N=3 (interleaved 1F1B over 6 micro-batches). Worker 0 runs
    # 0F0 0F1 2F0 2F1 0F2 2BW0 0F3 2BW1 2U0 2F2 0BW0 2F3 0BW1 0U0 0F4 ...: stage 0's micro-batches 2 and 3
    # run before U0 and are applied by U1 (lag 1), 4 and 5 after U0 by U2 (lag 1); stage 2 updates before
    # each of its next forwards (lag 0). Worker 1 likewise for stages 1 and 3.
    s = build_multistep(4, 2, 3, workers=2)
    assert (s.name, s.num_stages, s.num_workers) == ("interleaved-async", 4, 2)
    lag = update_lag(s)
    assert [lag[(0, m)] for m in range(6)] == [lag[(1, m)] for m in range(6)] == [0, 0, 1, 1, 1, 1]
    assert [lag[(2, m)] for m in range(6)] == [lag[(3, m)] for m in range(6)] == [0] * 6
    assert [a.kind for a in s.workers[0]].count("U") == 6  # one per (stage, mini-batch) it holds
    flushed = build_multistep(4, 2, 3, flush=True, workers=2)
    assert flushed.name == "interleaved-flush" and set(update_lag(flushed).values()) == {0}


def test_virtual_stage_stream_needs_a_multiple_of_the_workers() -> None:
    with pytest.raises(ScheduleError, match="multiple of 2 micro-batches.*N·M = 3·1"):
        build_multistep(4, 1, 3, workers=2)
    with pytest.raises(ScheduleError, match="M = 3"):
        build_multistep(4, 3, 2, flush=True, workers=2)
    with pytest.raises(ScheduleError, match="spread evenly"):
        build_multistep(3, 2, 2, workers=2)
