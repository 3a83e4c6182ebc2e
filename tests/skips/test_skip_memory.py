"""A skip's memory is counted on the stages that hold it: its producer's and its consumer's, not those between."""

from __future__ import annotations

import pytest
import torch
from _unet import unet

from fastpipe.model.skip_memory import SkipSpan, measure_skips, skip_bytes, stage_skip_edges
from fastpipe.schedule import build
from fastpipe.schedule.simulate import peak_memory, simulate

D1, D2 = 4 * 8 * 4, 4 * 6 * 4  # bytes of d1 ([4, 8] float32) and d2 ([4, 6]) for a micro-batch of 4


def test_measure_skips_finds_each_skip_its_layers_and_bytes():
    spans = measure_skips(unet(), torch.randn(4, 6))
    assert spans == [SkipSpan("d1", 2, 9, D1), SkipSpan("d2", 5, 8, D2)]


def test_a_stage_holds_the_skips_it_stashes_or_pops_and_none_that_pass_over_it():
    spans = measure_skips(unet(), torch.randn(4, 6))
    assert [skip_bytes(spans, a, b) for a, b in [(0, 3), (3, 8), (8, 11)]] == [D1, D2, D1 + D2]
    assert skip_bytes(spans, 3, 5) == 0  # d1 passes over layers 3..4; d2 is stashed at 5
    assert skip_bytes(spans, 0, 11) == D1 + D2  # one stage: each skip once
    assert stage_skip_edges(spans, [3, 5, 3]) == [(0, 2, D1), (1, 2, D2)]
    assert stage_skip_edges(spans, [3, 8]) == [(0, 1, D1)]  # d2 stays inside stage 1


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_the_simulated_peak_counts_each_skip_until_the_backward_of_each_stage_that_holds_it(name):
    schedule = build(name, 3, 4)
    in_flight = simulate(schedule).peak_activations  # micro-batches alive per worker
    edges = [(0, 2, D1), (1, 2, D2)]
    assert peak_memory(schedule, 0.0, edges) == [in_flight[0] * D1, in_flight[1] * D2, in_flight[2] * (D1 + D2)]
    act = [100.0, 200.0, 300.0]
    assert peak_memory(schedule, act) == [n * a for n, a in zip(in_flight, act)]
    assert peak_memory(schedule, 0.0, [(0, 2, D1)])[1] == 0.0  # d1 passes over stage 1
