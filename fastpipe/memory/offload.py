"""``Pipe(offload=...)``: which saved activations go to host memory, for which stages and micro-batches.

The setting takes one of these forms:

* a fraction in ``[0, 1]``: that share of each stage's saved activation bytes (``0.5``), the
  earliest saved first (:mod:`fastpipe.runtime.offload`);
* a layer predicate ``fn(index, layer) -> bool`` (``index`` in the whole model): the saved
  tensors of the layers it picks;
* a list with one of those per stage (a fraction, a predicate, or None);
* ``"auto"``: with ``memory_limit=``, per device the least fraction, in eighths, whose predicted
  peak fits (:mod:`fastpipe.memory.limit`); without a limit, nothing.

Offloading a CPU stage does nothing (its memory is host memory already): the pipe warns once, when
it is built, and runs it without. A CUDA stage on a host that cannot give page-locked memory is
refused when the pipe is built (:func:`~fastpipe.runtime.host_copies.check_host_memory`).

Each step's schedule gets a ``P`` ahead of the backward of each micro-batch that gains from
offload (:func:`~fastpipe.schedule.prefetch.worth_prefetching`); only those micro-batches offload,
so a step is what its schedule says, and the memory model and simulator see the same ``P``.
"""

from __future__ import annotations

import logging
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from fastpipe.memory.limit import MARGIN, MemoryGuard, sample_key
from fastpipe.memory.offload_bytes import OffloadBytes
from fastpipe.memory.sizes import format_bytes
from fastpipe.runtime.host_copies import check_host_memory
from fastpipe.runtime.offload import OffloadPolicy
from fastpipe.runtime.stage import Stage
from fastpipe.schedule.ir import Schedule
from fastpipe.schedule.prefetch import with_prefetch, worth_prefetching

__all__ = ["FORMS", "OffloadSpec", "PipeOffload", "resolve_offload", "stage_policy"]

LayerPredicate = Callable[[int, nn.Module], bool]
OffloadSpec = float | str | LayerPredicate | Sequence[float | LayerPredicate | None] | None

#: What ``offload=`` accepts, for error messages.
FORMS = (
    "a fraction in [0, 1] of each stage's saved activations (e.g. 0.5), a layer predicate fn(index, layer) -> bool, "
    "a list with one fraction, predicate or None per stage, 'auto' (the least offload that fits memory_limit), "
    "or 0 / None for none"
)
_AUTO_STEPS = 8  # "auto" tries fractions in eighths
_log = logging.getLogger("fastpipe")


def resolve_offload(spec: OffloadSpec, stages: Sequence[Sequence[nn.Module]]) -> list[OffloadPolicy | None]:
    """Each stage's :class:`~fastpipe.runtime.offload.OffloadPolicy` under ``spec`` (None: it offloads nothing).

    Args:
        spec: the pipe's ``offload`` (any form but ``"auto"``).
        stages: each stage's layers, in order.

    Raises:
        ValueError: a form not among :data:`FORMS`, a fraction outside ``[0, 1]``, a list of the wrong
            length, or a predicate that returns something other than a bool.
    """
    if isinstance(spec, (list, tuple)):
        if len(spec) != len(stages):
            raise ValueError(
                f"fastpipe: offload= got a list of {len(spec)} for {len(stages)} stages; give one per stage"
            )
        entries = list(spec)
    else:
        entries = [spec] * len(stages)
    out: list[OffloadPolicy | None] = []
    start = 0
    for entry, layers in zip(entries, stages):
        out.append(stage_policy(entry, layers, start, spec))
        start += len(layers)
    return out


def stage_policy(entry: Any, layers: Sequence[nn.Module], start: int, spec: Any) -> OffloadPolicy | None:
    """One stage's policy: ``entry`` (a fraction, a layer predicate or None) over ``layers``, the first
    of which is layer ``start`` of the model; ``spec`` is the whole setting, for messages.

    Raises:
        ValueError: a fraction outside ``[0, 1]``, another form, or a predicate that returns a non-bool.
    """
    if entry is None:
        return None
    if callable(entry) and not isinstance(entry, nn.Module):
        chosen = set()
        for i, layer in enumerate(layers):
            picked = entry(start + i, layer)
            if not isinstance(picked, bool):
                raise ValueError(
                    f"fastpipe: an offload= predicate must return a bool for (index, layer), got {picked!r} for "
                    f"layer {start + i}; accepted forms: {FORMS}"
                )
            if picked:
                chosen.add(i)
        return OffloadPolicy(1.0, frozenset(chosen)) if chosen else None
    if isinstance(entry, bool) or not isinstance(entry, numbers.Real) or not 0 <= float(entry) <= 1:
        raise ValueError(f"fastpipe: offload={spec!r} is not valid; accepted forms: {FORMS}")
    return OffloadPolicy(float(entry)) if float(entry) > 0 else None


def _is_auto(spec: Any) -> bool:
    return isinstance(spec, str) and spec == "auto"


class PipeOffload:
    """What a :class:`~fastpipe.Pipe` offloads: its ``offload=`` set on its stages, each step's prefetches.

    Args:
        spec: the pipe's ``offload``.
        stages: the pipe's stages (their ``offload`` is set here, and by ``"auto"`` at each step).
        guard: the pipe's memory guard, whose predictions then count offload; None without ``memory_limit``.
        lookahead: compute actions between a prefetch and its backward
            (:func:`~fastpipe.schedule.prefetch.with_prefetch`).

    Raises:
        ValueError: ``spec`` is not one of :data:`FORMS`.
        fastpipe.runtime.host_copies.HostMemoryError: a stage to offload from a device whose host
            cannot give page-locked memory.
    """

    def __init__(
        self, spec: OffloadSpec, stages: Sequence[Stage], guard: MemoryGuard | None = None, lookahead: int = 1
    ) -> None:
        if isinstance(spec, str) and not _is_auto(spec):
            raise ValueError(f"fastpipe: offload={spec!r} is not valid; accepted forms: {FORMS}")
        self.stages = list(stages)
        self.auto = _is_auto(spec)
        self.guard = guard
        self.lookahead = lookahead
        self.bytes = OffloadBytes(self.stages)
        self._chosen: dict[tuple[Any, ...], tuple[OffloadPolicy | None, ...]] = {}
        self._prefetched: dict[tuple[Any, ...], Schedule] = {}
        layers = [list(st.module.children()) for st in self.stages]
        policies = [None] * len(layers) if self.auto else resolve_offload(spec, layers)
        on_cpu = [
            s for s, (st, p) in enumerate(zip(self.stages, policies)) if p is not None and st.device.type == "cpu"
        ]
        if on_cpu:
            warnings.warn(
                f"fastpipe: offload= does nothing on CPU stages ({', '.join(map(str, on_cpu))}): their activations "
                "are in host memory already; those stages run without offload",
                stacklevel=3,
            )
        for s, st in enumerate(self.stages):
            if st.device.type != "cpu" and (policies[s] is not None or (self.auto and guard is not None)):
                check_host_memory(st.device)
        self._set([None if s in on_cpu else p for s, p in enumerate(policies)])
        if guard is not None:
            guard.offload = self.bytes

    def _set(self, policies: Sequence[OffloadPolicy | None]) -> None:
        for stage, policy in zip(self.stages, policies):
            stage.offload = policy

    def prefetch(self, schedule: Schedule) -> Schedule:
        """``schedule`` with a ``P`` ahead of each backward whose micro-batch gains from the stages' offload."""
        key = (schedule, self.bytes.key)
        found = self._prefetched.get(key)
        if found is None:
            offloading = [s for s, st in enumerate(self.stages) if st.offload is not None and st.offload.fraction > 0]
            pairs = [(s, m) for s in offloading for m in range(schedule.num_microbatches)]
            found = with_prefetch(schedule, worth_prefetching(schedule, pairs, self.lookahead), self.lookahead)
            self._prefetched[key] = found
        return found

    def for_step(
        self, schedule: Schedule, sample: Any, target: Any, loss_fn: Callable[[Any, Any], Tensor], checkpoint: Any
    ) -> Schedule:
        """A ``train_step``'s schedule with its prefetches; ``"auto"`` first chooses what to offload.

        Args:
            schedule: the step's schedule.
            sample: one micro-batch of input.
            target: its target.
            loss_fn: the step's loss.
            checkpoint: what the step recomputes, as the memory guard takes it.
        """
        if self.auto and self.guard is not None:
            if isinstance(checkpoint, str) and checkpoint == "auto":  # chosen after this, under the offload chosen here
                checkpoint = "never"
            self._choose(self.guard, schedule, (checkpoint, self.stages[-1].wgrad_batch, sample, target, loss_fn))
        return self.prefetch(schedule)

    def _choose(self, guard: MemoryGuard, schedule: Schedule, rest: tuple[Any, ...]) -> None:
        """Per device, the least fraction (in eighths) whose predicted peak fits the guard's limit."""
        checkpoint, _, sample, _, _ = rest
        key = (schedule, checkpoint if isinstance(checkpoint, str) else id(checkpoint), sample_key(sample))
        chosen = self._chosen.get(key)
        if chosen is None:
            modules = [st.module for st in self.stages]
            layers = [layer for m in modules for layer in m.children()]
            balance = [len(list(m.children())) for m in modules]
            devices = [st.device for st in self.stages]
            best: dict[int, float] = {}
            for step in range(_AUTO_STEPS + 1):
                fraction = step / _AUTO_STEPS
                self._set([OffloadPolicy(fraction) if d.type != "cpu" and fraction else None for d in devices])
                for d in guard.predict(layers, balance, self.prefetch(schedule), *rest):
                    if d.worker not in best and d.total * (1 + MARGIN) <= guard.limit:
                        best[d.worker] = fraction
                if len(best) == schedule.num_workers:
                    break
            share = [best.get(schedule.worker_of(s), 1.0) for s in range(len(self.stages))]
            chosen = tuple(OffloadPolicy(f) if f and d.type != "cpu" else None for f, d in zip(share, devices))
            self._chosen[key] = chosen
            shown = ", ".join(f"stage {s}: {p.fraction:g}" for s, p in enumerate(chosen) if p is not None)
            _log.info("fastpipe: offload='auto' under %s: %s", format_bytes(guard.limit), shown or "nothing")
        self._set(chosen)
