"""The counted schedule peaks behind the README's table: the runner agrees with the memory model."""

from __future__ import annotations

import pytest
from _memory_utils import install_counter_or_skip

from fastpipe.bench.schedule_peaks import SchedulePeak, count_peaks, predict_peaks, table


def test_counted_schedule_peaks_match_the_model_and_print_against_1f1b() -> None:
    install_counter_or_skip()
    schedules = ["1f1b", "zb-v"]
    counted = count_peaks(2, 4, schedules, timeout=180)
    peaks = [SchedulePeak(s, counted[s], predict_peaks(2, 4, s)) for s in schedules]
    for p in peaks:
        assert len(p.counted) == 2 and min(p.counted) > 0
        for got, want in zip(p.counted, p.predicted):
            assert want == pytest.approx(got, rel=0.05), (p.schedule, got, want)
    # zb-v's W records stay until W: its fullest rank holds more than 1F1B's.
    assert max(counted["zb-v"]) > max(counted["1f1b"])
    text = table(peaks)
    assert "| `1f1b` | 0 |" in text and "1.00x" in text


def test_unknown_schedules_are_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match="unknown schedules"):
        count_peaks(2, 4, ["1f1b", "zigzag"])
