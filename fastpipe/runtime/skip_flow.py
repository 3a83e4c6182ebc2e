"""Skips in a step: a stashed tensor goes straight to the stage that pops it, its gradient straight back.

A skip (:mod:`fastpipe.model.skips`) is one more edge of the step's dataflow, from the stage
that stashes it (the producer, p) to the stage that pops it (the consumer, c), beside the
stage-to-stage activations::

    F(p, m) ──act──▶ F(p+1, m) ──act──▶ … ──act──▶ F(c, m)
       └──────────────────── skip ──────────────────▲
    B(p, m) ◀─grad── B(p+1, m) ◀─grad── … ◀─grad── B(c, m)
       ▲────────────────── skip grad ──────────────┘

The consumer receives the stashed tensors as leaves that require grad, and its backward
sends their gradients back with its input gradient. The producer's backward treats each
stashed tensor as one more output of the stage, with that gradient. Every schedule runs
B(c, m) before B(p, m), since B(p, m) waits for B(p+1, m) and so on up to c.

Values leave in a fixed order: a stage sends its skips before its activation, and the
gradients of its received skips before its input gradient. Whoever holds a stage's
activation (or gradient) then finds that micro-batch's skips (or skip gradients) already
delivered: the inline backward of :mod:`fastpipe.runtime.inline` waits only for the first
value an action reads.

Under checkpointing the producer's recompute stashes again (graph-attached, sent nowhere)
and the consumer's recompute pops the leaves it received in the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor

from fastpipe.model.skips import SkipEvent, SkipStore, StageSkips, plan_skips, skip_events
from fastpipe.runtime.transport import Transport
from fastpipe.step.microbatch import Value, tensors_of

if TYPE_CHECKING:
    from fastpipe.runtime.step import Stage

__all__ = ["SkipFlow", "route_skips", "share_skip_routes"]


def route_skips(stages: Sequence[Stage]) -> None:
    """Check the skips of a whole pipeline (its stages in order) and tell each stage where its own go.

    Raises:
        ValueError: as :func:`fastpipe.model.skips.plan_skips`.
    """
    for stage, skips in zip(stages, plan_skips([skip_events(st.module) for st in stages])):
        stage.skips = skips


def share_skip_routes(stages: Mapping[int, Stage], num_stages: int, group: Any) -> list[StageSkips]:
    """:func:`route_skips` over ranks: every rank of ``group`` gives its stages' stashes and pops.

    Returns every stage's skips (the same on every rank; a bad declaration raises the same
    error on every rank, so none is left waiting).
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, {s: skip_events(st.module) for s, st in stages.items()}, group=group)
    events: dict[int, list[SkipEvent]] = {s: e for part in gathered for s, e in part.items()}
    routes = plan_skips([events.get(s, []) for s in range(num_stages)])
    for s, stage in stages.items():
        stage.skips = routes[s]
    return routes


class SkipFlow:
    """The skip traffic of one step's tasks, over the step's transport.

    Args:
        skips: per stage this process runs, where its skips go and come from.
        transport: the step's transport.
    """

    def __init__(self, skips: dict[int, StageSkips], transport: Transport) -> None:
        self.skips = skips
        self.transport = transport
        self.stores: dict[tuple[int, int], SkipStore] = {}  # per (stage, mb) running now

    def run(self, s: int, m: int, received: dict[str, Tensor], body: Callable[[], Value]) -> tuple[Value, list[Tensor]]:
        """``body()``, the run of stage ``s``, with the skips it received; returns its output and
        the tensors it stashed for other stages (in the order of ``skips.sends``)."""
        skips = self.skips[s]
        if not skips.layers:
            return body(), []
        store = self.stores[(s, m)] = SkipStore(received)
        try:
            out = body()
        finally:
            del self.stores[(s, m)]
        return out, store.left([n for _, names in skips.sends for n in names])

    def receive(self, s: int, m: int) -> dict[str, Tensor]:
        """The tensors other stages stashed for stage ``s``'s pops of micro-batch ``m``, by name."""
        received: dict[str, Tensor] = {}
        for p, names in self.skips[s].receives:
            received.update(zip(names, tensors_of(self.transport.recv_skip(p, s, m))))
        return received

    def send(self, s: int, m: int, stashed: Sequence[Tensor], grad: bool, keep_graph: bool) -> None:
        """Send what stage ``s`` stashed (``run``'s result) to the stages that pop it.

        Args:
            grad: the step has a backward.
            keep_graph: the forward kept its graph (False: checkpointed, the recompute will
                attach one, so the consumer must still ask for the gradient).
        """
        it = iter(stashed)
        for c, names in self.skips[s].sends:
            bundle = tuple(next(it) for _ in names)
            flags = [
                grad and (t.is_floating_point() or t.is_complex()) and (t.requires_grad or not keep_graph)
                for t in bundle
            ]
            self.transport.send_skip(s, c, m, bundle, flags)

    def receive_grads(self, s: int, m: int) -> list[Tensor | None]:
        """The gradients of what stage ``s`` stashed, in the order of :meth:`run`'s result."""
        return [g for c, _ in self.skips[s].sends for g in self.transport.recv_skip_grad(s, c, m)]

    @staticmethod
    def pairs(stashed: Sequence[Tensor] | None, grads: Sequence[Tensor | None]) -> list[tuple[Tensor, Tensor]]:
        """(output, gradient) pairs of a producer's backward: each stashed tensor is one more output."""
        if not grads:
            return []
        assert stashed is not None, "a producer's backward without its stashed tensors"
        return [(o, g) for o, g in zip(stashed, grads) if g is not None and o.requires_grad]

    def send_grads(self, s: int, m: int, received: dict[str, Tensor], grads: Iterator[Tensor | None]) -> None:
        """Send the gradients of the skip leaves stage ``s`` received (``grads``: one per leaf that requires grad)."""
        if not received:
            return
        got = {n: next(grads) if t.requires_grad else None for n, t in received.items()}
        for p, names in self.skips[s].receives:
            self.transport.send_skip_grad(p, s, m, [got[n] for n in names])
