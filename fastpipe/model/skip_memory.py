"""What skip connections cost in memory, for the planner: which stages hold a skip, and how many bytes.

A skip (:mod:`fastpipe.model.skips`) is held by the stage that stashes it, until that stage's
backward of the micro-batch, and by the stage that pops it, until its own backward; the
stages between never see it. Carried hop by hop as a tuple item it would be held by every
stage between as well. :func:`measure_skips` measures each skip on a sample;
:func:`skip_bytes` is what a candidate stage of layers ``first:end`` holds per micro-batch
in flight, which a planner adds to the stage's activation bytes (see also
:func:`fastpipe.schedule.simulate.peak_memory`, which counts them over a simulated step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastpipe.model.side_inputs import run_layers
from fastpipe.model.skips import SkipStore, plan_skips, skip_events

__all__ = ["SkipSpan", "measure_skips", "skip_bytes", "stage_skip_edges"]


@dataclass(frozen=True)
class SkipSpan:
    """A skip as the memory plan sees it: stashed by layer ``producer``, popped by layer ``consumer``.

    Attributes:
        name: the stash's name.
        producer: index in the top-level Sequential of the layer that stashes it (or holds the stash).
        consumer: index of the layer that pops it (or holds the pop).
        nbytes: its size for one micro-batch of the measured sample.
    """

    name: str
    producer: int
    consumer: int
    nbytes: int


class _Measuring(SkipStore):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[str, int] = {}

    def put(self, name: str, value: Any) -> None:
        super().put(name, value)
        self.sizes[name] = value.numel() * value.element_size()


def measure_skips(module: nn.Sequential, sample: Any, **side: Any) -> list[SkipSpan]:
    """Each skip of ``module`` with its bytes, from one forward of the plain model on ``sample`` (no graph).

    Args:
        module: the model.
        sample: one micro-batch (as the planner profiles one).
        side: side inputs, as for the model's call.
    """
    top = {name: i for i, name in enumerate(module._modules)}
    events = skip_events(module)
    plan_skips([events])
    where = {(e.kind, e.name): top[e.layer.split(".")[0]] for e in events}
    store = _Measuring()
    with torch.no_grad():
        run_layers(module, sample, side, store)
    return [SkipSpan(n, where[("stash", n)], where[("pop", n)], size) for n, size in store.sizes.items()]


def skip_bytes(spans: Sequence[SkipSpan], first: int, end: int) -> int:
    """Bytes of skips that a stage of layers ``first:end`` holds per micro-batch in flight.

    A skip counts on the stage that stashes it and on the stage that pops it, once when
    both are this stage, and not on the stages between.
    """
    return sum(s.nbytes for s in spans if first <= s.producer < end or first <= s.consumer < end)


def stage_skip_edges(spans: Sequence[SkipSpan], balance: Sequence[int]) -> list[tuple[int, int, int]]:
    """The skips that cross stages under ``balance``, as ``(producer stage, consumer stage, bytes)``."""
    stage_of: list[int] = [s for s, count in enumerate(balance) for _ in range(count)]
    edges = [(stage_of[s.producer], stage_of[s.consumer], s.nbytes) for s in spans]
    return [e for e in edges if e[0] != e[1]]
