"""Which weights each micro-batch of a stage runs on, under a consistency policy.

A stage's forward and backward run on *version tensors*, not on the ``nn.Parameter`` s
themselves (:func:`torch.func.functional_call`), so the optimizer may update the
parameters in place while micro-batches that ran their forward earlier still await their
backward. Per policy:

==========  =================================================================================
``sync``    the live weights (the stream is flushed: no update lands between F and B)
``stale``   the live weights at each moment: the forward sees those of its time, the
            backward those of its own time (an alias of the parameter's storage, so the
            optimizer's in-place update shows through; activations saved in the forward
            stay). The naive asynchronous baseline.
``stash``   PipeDream's weight stashing: the backward sees exactly the forward's weights.
            Micro-batches run on an alias of the live weights; an update that would
            overwrite a version still in use moves the parameter to fresh storage first
            (copy on write), so the old storage stays with the micro-batches that saw it.
            At most K versions: the live one and those of micro-batches in flight.
``predict`` XPipe / PipeOptim: forward and backward on Ŵ = W - Σ lr · Δ over the ``lag``
            updates still to come before this micro-batch's gradient is applied (= lr·s·Δ
            at a constant lr; see :mod:`fastpipe.asynchronous.direction`). One prediction is
            shared by the micro-batches of a mini-batch that saw the same live version.
==========  =================================================================================

Copies are counted (:attr:`StageWeights.peak_copy_bytes`) from creation (stash: from the
update that supersedes the version) until the last backward that reads them.

A copy no longer read goes back to a pool of buffers (one tensor per parameter) that the
next copy is written into. Predictions and stashes come once per mini-batch per stage, each
the size of the stage's weights; fresh allocations of that size cost page faults on a CPU
(glibc serves them with mmap) and show up as a few percent of the step. The pool never holds
more buffers than the peak number of copies alive at once, so the memory it keeps is within
``peak_copy_bytes``; it lives as long as the caller keeps it (``Pipe.fit`` keeps one per stage
for the run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["POLICIES", "StageWeights"]

POLICIES = ("sync", "stale", "stash", "predict")

# (version seen, lag, buffers to write into or None) -> the predicted weights, one tensor per parameter
Predictor = Callable[[int, int, Sequence[Tensor] | None], Sequence[Tensor]]


@dataclass
class _Version:
    tensors: list[Tensor]
    nbytes: int  # 0 for an alias of the live parameters
    users: set[int] = field(default_factory=set)


class StageWeights:
    """The version tensors of one stage's micro-batches, within one window of a stream.

    Only the stage's worker thread touches it.

    Args:
        params: the stage's trainable parameters (updated in place by the optimizer), or
            whole-size buffers of them that ``refresh`` fills.
        policy: one of :data:`POLICIES`.
        lags: per micro-batch of the stream, its update lag on this stage.
        minibatch_size: micro-batches per update.
        predictor: ``predictor(version, lag, out)``: the predicted weights, written into the
            buffers ``out`` when given (``predict`` only).
        pool: free buffers (each a list with one tensor per parameter, like ``params``) to
            write copies into; released copies are put back. A new list when None.
        refresh: for a stage sharded over its replicas, where ``params`` are whole-size buffers,
            not the parameters: writes the parameters' current values into them (an all-gather).
            Called before a forward reads the live weights after an update (under ``stale``, at
            the update itself while micro-batches are in flight: their backwards read the live
            weights of their time), so an update that nothing reads after gathers nothing.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        policy: str,
        lags: Mapping[int, int],
        minibatch_size: int,
        predictor: Predictor | None = None,
        pool: list[list[Tensor]] | None = None,
        refresh: Callable[[], None] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"fastpipe: consistency must be one of {POLICIES}, got {policy!r}")
        self.params = list(params)
        self.policy = policy
        self.lags = lags
        self.minibatch_size = minibatch_size
        self.predictor = predictor
        self.pool: list[list[Tensor]] = [] if pool is None else pool
        self.refresh = refresh
        self._outdated = refresh is not None  # the buffers hold no values yet
        self.version = 0  # updates applied by this stage in this window
        self.copy_bytes = 0
        self.peak_copy_bytes = 0
        self._versions: dict[tuple[object, ...], _Version] = {}
        self._key_of: dict[int, tuple[object, ...]] = {}

    def acquire(self, m: int) -> list[Tensor]:
        """At micro-batch ``m``'s forward: choose (and make, if new) its weights."""
        lag = self.lags[m]
        copy = lag > 0 and self.policy == "predict"
        key = ("predict", self.version, m // self.minibatch_size) if copy else ("live", self.version)
        entry = self._versions.get(key)
        if entry is None:
            if not copy and self._outdated:
                self._refresh()
            entry = self._make(copy, lag)
            self._versions[key] = entry
            self.copy_bytes += entry.nbytes
            self.peak_copy_bytes = max(self.peak_copy_bytes, self.copy_bytes)
        entry.users.add(m)
        self._key_of[m] = key
        return entry.tensors

    def tensors(self, m: int) -> list[Tensor]:
        """The weights micro-batch ``m`` ran its forward on (for its backward or recompute)."""
        return self._versions[self._key_of[m]].tensors

    def release(self, m: int) -> None:
        """After micro-batch ``m``'s backward: drop its weights when no one else needs them."""
        key = self._key_of.pop(m)
        entry = self._versions[key]
        entry.users.discard(m)
        if not entry.users:
            del self._versions[key]
            self.copy_bytes -= entry.nbytes
            if entry.nbytes:  # a copy, not the live storage: its buffers serve the next copy
                self.pool.append(entry.tensors)

    def before_update(self) -> None:
        """Just before the optimizer steps this stage: under ``stash``, keep the live version
        for the micro-batches still using it by moving the parameters to new storage."""
        entry = self._versions.get(("live", self.version))
        if self.policy != "stash" or entry is None:
            return
        spare = self.pool.pop() if self.pool else None
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if self.refresh is not None:  # gathered anew before the next read: no values to keep
                    p.data = torch.empty_like(p.data) if spare is None else spare[i]
                else:
                    p.data = p.data.clone() if spare is None else spare[i].copy_(p.data)
        entry.nbytes = sum(t.numel() * t.element_size() for t in entry.tensors)
        self.copy_bytes += entry.nbytes
        self.peak_copy_bytes = max(self.peak_copy_bytes, self.copy_bytes)

    def after_update(self) -> None:
        """Just after the optimizer stepped this stage."""
        self.version += 1
        self._outdated = self.refresh is not None
        if self.policy == "stale" and self._outdated and self._versions:  # in-flight backwards read them
            self._refresh()

    def _refresh(self) -> None:
        assert self.refresh is not None
        self.refresh()
        self._outdated = False

    def _make(self, copy: bool, lag: int) -> _Version:
        with torch.no_grad():
            if not copy:
                # .data: shares the storage but not the version counter, so the optimizer's
                # in-place step does not invalidate graphs that saved it (stale reads through).
                tensors = [p.data for p in self.params]
            else:
                assert self.predictor is not None
                tensors = list(self.predictor(self.version, lag, self.pool.pop() if self.pool else None))
        for t in tensors:
            t.requires_grad_(True)
        nbytes = sum(t.numel() * t.element_size() for t in tensors) if copy else 0
        return _Version(tensors, nbytes)
