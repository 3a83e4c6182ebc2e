"""``Pipe(offload=...)``: which saved activations go to host memory, for which stages and micro-batches.

The setting takes one of these forms:

* a fraction in ``[0, 1]``: that share of each stage's saved activation bytes (``0.5``), the
  earliest saved first (:mod:`fastpipe.runtime.offload`);
* a layer predicate ``fn(index, layer) -> bool`` (``index`` in the whole model): the saved
  tensors of the layers it picks;
* a list with one of those per stage (a fraction, a predicate, or None);
* ``"auto"``: with ``memory_limit=`` (the pipe's, or ``fit``'s), per device the least fraction,
  in eighths, whose predicted peak fits (:mod:`fastpipe.memory.offload_choice`); without a
  limit, nothing.

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

from fastpipe.memory.limit import MemoryGuard, sample_key
from fastpipe.memory.model import DeviceMemory
from fastpipe.memory.offload_bytes import OffloadBytes
from fastpipe.memory.offload_choice import StageOffload, choose_fractions, prefetching
from fastpipe.memory.sizes import format_bytes
from fastpipe.runtime.host_copies import check_host_memory
from fastpipe.runtime.offload import OffloadPolicy
from fastpipe.runtime.stage import Stage
from fastpipe.schedule.ir import Schedule

__all__ = ["FORMS", "OffloadSpec", "PipeOffload", "resolve_offload", "stage_policy"]

LayerPredicate = Callable[[int, nn.Module], bool]
OffloadSpec = float | str | LayerPredicate | Sequence[float | LayerPredicate | None] | None

#: What ``offload=`` accepts, for error messages.
FORMS = (
    "a fraction in [0, 1] of each stage's saved activations (e.g. 0.5), a layer predicate fn(index, layer) -> bool, "
    "a list with one fraction, predicate or None per stage, 'auto' (the least offload that fits memory_limit), "
    "or 0 / None for none"
)
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
        #: Whether ``offload="auto"`` was asked: a guard (the pipe's, or ``fit``'s) then chooses the shares.
        self.auto = _is_auto(spec)
        #: Per stage, whether ``"auto"`` may offload it: those off the CPU.
        self.movable = [st.device.type != "cpu" for st in self.stages]
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
            found = prefetching(schedule, offloading, self.lookahead)
            self._prefetched[key] = found
        return found

    def for_step(
        self,
        schedule: Schedule,
        sample: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor] | None,
        checkpoint: Any,
    ) -> Schedule:
        """A ``train_step``'s schedule with its prefetches; ``"auto"`` first chooses what to offload.

        Args:
            schedule: the step's schedule.
            sample: one micro-batch of input.
            target: its target.
            loss_fn: the step's loss (None: the output's gradient is ones, as for ``forward``).
            checkpoint: what the step recomputes, as the memory guard takes it.
        """
        if self.auto and self.guard is not None:
            if isinstance(checkpoint, str) and checkpoint == "auto":  # the pipe chooses both together; alone: none
                checkpoint = "never"
            self._choose(self.guard, schedule, (checkpoint, self.stages[-1].wgrad_batch, sample, target, loss_fn))
        return self.prefetch(schedule)

    def _choose(self, guard: MemoryGuard, schedule: Schedule, rest: tuple[Any, ...]) -> None:
        """Per device, the least fraction (in eighths) whose predicted peak fits the guard's limit."""
        checkpoint, _, sample, _, loss_fn = rest
        # A Recompute is hashed by value: its ids are reused.
        key = (schedule, checkpoint, sample_key(sample), loss_fn is None)
        chosen = self._chosen.get(key)
        if chosen is None:
            modules = [st.module for st in self.stages]
            layers = [layer for m in modules for layer in m.children()]
            balance = [len(list(m.children())) for m in modules]

            def predict(fractions: Sequence[float]) -> list[DeviceMemory]:
                self._set(self._policies(fractions))
                return guard.predict(layers, balance, self.prefetch(schedule), *rest)

            told = [StageOffload(0.0, None, m) for m in self.movable]  # the guard measures the sizes itself
            chosen = self._policies(choose_fractions(predict, schedule, told, guard.limit))
            self._chosen[key] = chosen
            shown = ", ".join(f"stage {s}: {p.fraction:g}" for s, p in enumerate(chosen) if p is not None)
            _log.info("fastpipe: offload='auto' under %s: %s", format_bytes(guard.limit), shown or "nothing")
        self._set(chosen)

    def _policies(self, fractions: Sequence[float]) -> tuple[OffloadPolicy | None, ...]:
        # A CPU stage is movable only where a test made it so: it then takes _C's host path.
        return tuple(
            OffloadPolicy(f, force=st.device.type == "cpu") if f > 0 else None for f, st in zip(fractions, self.stages)
        )

    def told(self, sample: Any, target: Any, loss_fn: Callable[[Any, Any], Tensor] | None) -> list[StageOffload | None]:
        """Per stage, what it can offload of one micro-batch (None: nothing), as :func:`offloaded` takes it.

        Under ``"auto"`` every movable stage reports all its layers' saved tensors at share 0 (the
        share is the chooser's); otherwise each stage with a policy reports its policy's.
        """
        policies: list[OffloadPolicy | None] = [None] * len(self.stages) if self.auto else list(self.bytes.key)
        if not any(self.movable if self.auto else policies):  # nothing to measure: no forward
            return [None] * len(self.stages)
        scopes = tuple(None if p is None else p.layers for p in policies)
        sizes = self.bytes.sizes(sample, target, loss_fn, scopes)
        if self.auto:
            return [StageOffload(0.0, found, True) if m else None for found, m in zip(sizes, self.movable)]
        return [None if p is None else StageOffload(p.fraction, found, False) for p, found in zip(policies, sizes)]

    def apply(self, fractions: Sequence[float]) -> None:
        """Set ``"auto"``'s choice, one share per stage, on the stages (nothing unless ``"auto"``).

        Raises:
            fastpipe.runtime.host_copies.HostMemoryError: a share for a device whose host cannot
                give page-locked memory (checked when the pipe is built where it has a limit).
        """
        if not self.auto:
            return
        for f, st in zip(fractions, self.stages):
            if f > 0 and st.device.type != "cpu":
                check_host_memory(st.device)
        self._set(self._policies(fractions))
