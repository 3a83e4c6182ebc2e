"""Skips on the memory model's timeline.

Within one device a skip shares its storage with the next stage's input or the input's gradient:
:func:`fastpipe.memory.local_skips.local_skips` counts such a storage once, and keeps a stash alive
until the producer's ``W`` (a split ``B`` leaves its outputs to it); :func:`measure_stages` finds
the sharing. Across devices its gradient waits on the producer's, or in gloo's receive buffers.
Counted end to end in ``test_skip_peaks.py`` (one device) and ``test_skip_ranks.py`` (gloo ranks).
"""

from __future__ import annotations

import torch
from torch import nn

import fastpipe
from fastpipe.distributed.wire import HEADER
from fastpipe.memory.local_skips import local_skips
from fastpipe.memory.model import StageBytes, predict_memory
from fastpipe.memory.receive_buffers import receive_buffer_bytes
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.schedule import build
from fastpipe.schedule.ir import Action
from fastpipe.schedule.simulate import simulate_times, weight_release

SKIP = 100


class _Add(nn.Module):
    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return x + a


def _peak(stages: list[StageBytes], checkpoint: str) -> int:
    (device,) = predict_memory(build("zb-v", 1, 2), stages, skips=[(0, 1, SKIP)], checkpoint=checkpoint)
    return device.total


def test_a_recomputed_input_that_the_stage_before_stashed_counts_once() -> None:
    plain = [StageBytes(parameters=0, activation=50, input=SKIP), StageBytes(parameters=0, activation=50, input=SKIP)]
    stashed = [StageBytes(parameters=0, activation=50, input=SKIP, output_stashed=SKIP), plain[1]]
    # Under recompute stage 1 keeps only its input, which is the skip's tensor: at the peak, while
    # micro-batch 1's forwards run, micro-batch 0's input is not a copy of its own.
    assert _peak(plain, "always") - _peak(stashed, "always") == SKIP
    # Kept whole, the input is the output stage 0 keeps, which its activation leaves to the skip.
    assert _peak(plain, "never") == _peak(stashed, "never")


def test_a_gradient_that_a_split_B_gives_a_skip_and_its_input_counts_once() -> None:
    first = StageBytes(parameters=0, activation=50, input=SKIP)
    apart, shared = (
        StageBytes(parameters=0, activation=50, input=SKIP),
        StageBytes(parameters=0, activation=50, input=SKIP, skip_grads_shared=SKIP),
    )
    assert _peak([first, apart], "never") - _peak([first, shared], "never") == SKIP


def test_a_split_B_leaves_its_stash_to_its_W() -> None:
    schedule = build("zb-v", 1, 1)  # F0 F1 B1 W1 B0 W0: stage 0's W ends last
    times = simulate_times(schedule)
    release = weight_release(schedule, 1, frozenset())
    stages = [StageBytes(parameters=0, activation=0)] * 2
    _, points = local_skips(schedule, times, stages, [(0, 1, SKIP)], release, [False])
    freed = max(t for _, t, n in points if n == -SKIP)
    assert freed == times[Action("W", 0, 0)][2] > times[Action("B", 0, 0)][2]


def test_measure_finds_a_stashed_output_and_a_shared_skip_gradient() -> None:
    torch.manual_seed(0)
    model = fastpipe.Sequential(nn.Linear(8, 8), fastpipe.stash("a"), fastpipe.pops(_Add(), "a"), nn.Tanh())
    first, second = measure_stages(model, [2, 2], torch.randn(4, 8), transients=False)
    assert first.output_stashed == 4 * 8 * 4  # its output is the stash
    assert second.skip_grads_shared == 4 * 8 * 4  # the add's one gradient for both inputs
    assert first.skip_grads_shared == second.output_stashed == 0


def test_across_devices_a_split_producer_holds_its_stash_until_its_W() -> None:
    # zb-v on 2 workers, stage 0 on worker 0, stage 1 on worker 1: the input gradient B(0) ends
    # with comes while W(0) still keeps the stash.
    stages = [StageBytes(parameters=0, activation=0, input=50)] + [StageBytes(parameters=0, activation=0)] * 3
    first, _ = predict_memory(build("zb-v", 2, 1), stages, skips=[(0, 1, SKIP)], input_grad=True, skip_buffers=True)
    assert (first.skips, first.input_grads) == (SKIP, 50)


def test_across_devices_a_skips_gradient_waits_on_the_producers_device() -> None:
    # gpipe on 2 workers, 1 micro-batch: B(1) ends before B(0), and the gradient waits between.
    stages = [StageBytes(parameters=0, activation=0)] * 2
    producer, consumer = predict_memory(build("gpipe", 2, 1), stages, skips=[(0, 1, SKIP)])
    assert (producer.skips, consumer.skips) == (2 * SKIP, SKIP)  # the stash and its gradient; the copy
    # Over gloo both arrive in receive buffers kept between steps, counted there.
    producer, consumer = predict_memory(build("gpipe", 2, 1), stages, skips=[(0, 1, SKIP)], skip_buffers=True)
    assert (producer.skips, consumer.skips) == (SKIP, 0)


def test_tags_keeps_a_buffer_per_micro_batch_for_a_skip_and_its_gradient() -> None:
    schedule = build("1f1b", 2, 4)
    stages = [StageBytes(parameters=0, activation=0, input=64)] * 2
    plain = receive_buffer_bytes(schedule, stages, "tags")
    skipped = receive_buffer_bytes(schedule, stages, "tags", [(0, 1, SKIP)])
    assert [b - a for a, b in zip(plain, skipped)] == [4 * (HEADER + SKIP)] * 2
    assert receive_buffer_bytes(schedule, stages, "local", [(0, 1, SKIP)]) == [0, 0]


def test_a_recomputed_producer_keeps_no_stash_between_its_forward_and_its_backward() -> None:
    stages = [StageBytes(parameters=0, activation=0)] * 2
    kept, redone = (
        predict_memory(build("gpipe", 2, 4), stages, skips=[(0, 1, SKIP)], checkpoint=mode, skip_buffers=True)[0]
        for mode in ("never", "always")
    )
    assert (kept.skips, redone.skips) == (4 * SKIP, SKIP)  # every micro-batch's; the one replayed
