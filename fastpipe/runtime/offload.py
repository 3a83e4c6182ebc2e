"""Activation offload: saved tensors of a forward go to host memory and come back before their backward.

A forward ``F(s, m)`` whose pair the schedule prefetches (a ``P(s, m)``, :mod:`fastpipe.schedule.prefetch`)
and whose stage has an :class:`OffloadPolicy` runs under ``saved_tensors_hooks``, around its whole
stage or around the chosen layers. Its saved tensors are only held during the forward; when it
ends, those that nothing else holds (not a parameter, the stage's input or output, a view, nor a
tensor autograd or the model also keeps) are the candidates, in the order they were saved. A
prefix of them, the ``fraction`` of their bytes, starts copying to the host; each device copy is
dropped once its copy has landed (:mod:`fastpipe.runtime.host_copies`)::

    F(s, m) ── saves ──▶ held ──(forward ends)──▶ host copy ──P(s, m)──▶ device copy ──▶ B(s, m) reads it
                                  └─ the rest stays on the device, as without offload

The earliest saved are chosen first: the backward reads them last, so their prefetch has the
most time. ``P(s, m)`` starts the copies back; a backward that reads one before it arrived waits
for it, or starts it when no ``P`` ran. The device copies are the same bytes, shapes and strides,
so the gradients are bitwise those without offload.

A saved tensor changed in place before the backward reads it is refused, as autograd refuses its
own (the version counter): with these hooks autograd no longer checks, so the record does, when
the forward ends and, for a tensor kept on the device, when the backward reads it; a tensor that
went to the host has no other holder left that could change it.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from fastpipe.runtime.host_copies import CopyPath, copy_path, pending_copies
from fastpipe.schedule.ir import Action, Schedule

if TYPE_CHECKING:
    from fastpipe.runtime.stage import Stage

__all__ = ["OffloadPolicy", "SavedSet", "StepOffload", "chosen_prefix", "saving_hooks"]


@dataclass(frozen=True)
class OffloadPolicy:
    """What one stage offloads of each micro-batch it prefetches.

    Attributes:
        fraction: the share of the candidates' bytes to offload, in ``[0, 1]``, earliest saved
            first; at least this share (the last tensor taken may pass it).
        layers: indices of the stage's layers whose saved tensors are candidates; None: all of them
            (and the loss on the last stage).
        force: copy a CPU stage's tensors through ``fastpipe._C``'s host backend (tests of the
            asynchronous path; offloading a CPU stage otherwise does nothing).
    """

    fraction: float = 1.0
    layers: frozenset[int] | None = None
    force: bool = False


def chosen_prefix(sizes: Sequence[int], fraction: float) -> int:
    """How many of ``sizes`` (in order) to offload: the fewest whose sum reaches ``fraction`` of the total."""
    goal, total, n = fraction * sum(sizes), 0, 0
    while n < len(sizes) and total < goal:
        total, n = total + sizes[n], n + 1
    return n


class _Saved:
    """One saved tensor: held on the device, or offloaded to host memory and brought back."""

    __slots__ = (
        "tensor",
        "version",
        "like",
        "path",
        "host",
        "out",
        "back",
        "into",
        "stream",
        "error",
        "lock",
        "__weakref__",
    )

    def __init__(self, tensor: Tensor, path: CopyPath) -> None:
        self.tensor: Tensor | None = tensor  # the device copy, while kept on the device
        self.version = tensor._version
        self.like = (tensor.shape, tensor.stride(), tensor.dtype)
        self.path = path
        self.host: Any = None  # the host copy once offloaded
        self.out: Any = None  # the copy to the host, while in flight
        self.back: Tensor | None = None  # the device copy brought back
        self.into: Any = None  # the copy back, until the backward has waited for it
        self.stream: int | None = None
        self.error: str | None = None
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        shape, _, dtype = self.like
        return shape.numel() * dtype.itemsize

    def alone(self) -> bool:
        """Whether nothing but this record holds the tensor or its storage (a private torch count, pinned by tests)."""
        t = self.tensor
        assert t is not None
        # Three references: the attribute, the local name, the argument.
        if sys.getrefcount(t) > 3 or t._use_count() != 1 or t._is_view():  # type: ignore[attr-defined]
            return False
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2  # its tensor and the temporary

    def changed(self) -> bool:
        return self.tensor is not None and self.tensor._version != self.version

    def offload(self) -> None:
        """Start the copy to the host; the device copy goes once that has landed (the copy keeps it until then)."""
        assert self.tensor is not None
        self.host, self.out = self.path.to_host(self.tensor)
        self.tensor = None

    def fetch(self) -> None:
        """Start bringing the tensor back (once)."""
        with self.lock:
            if self.host is not None and self.back is None:
                self.stream = self.path.allocating_stream()
                self.back, self.into = self.path.to_device(self.host, self.like, self.out)

    def get(self) -> Tensor:
        """The saved tensor, as the backward reads it (the unpack hook)."""
        if self.error is None and self.host is None and self.changed():
            assert self.tensor is not None
            self.error = f"is at version {self.tensor._version}; expected version {self.version} instead"
        if self.error is not None:
            shape, _, dtype = self.like
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a saved tensor of shape {list(shape)} and dtype {dtype} under fastpipe's offload {self.error}. "
                "Change the model so that it does not write into a tensor its forward saved for backward "
                "(clone it first), as autograd requires without offload too"
            )
        if self.host is None:
            kept = self.tensor if self.back is None else self.back
            assert kept is not None
            return kept
        self.fetch()
        with self.lock:
            assert self.back is not None
            if self.host is not None:  # the first read waits; the host copy is released once the copy is done
                self.path.wait(self.back, self.into, self.stream)
                self.into, self.host, self.tensor = None, None, None
            return self.back


class SavedSet:
    """The saved tensors of one forward, held until it ends (pack and unpack hooks).

    Args:
        path: the stage's copies; tensors it cannot copy are not held.
    """

    def __init__(self, path: CopyPath) -> None:
        self.path = path
        self.held: dict[int, _Saved] = {}  # by id: the held tensor keeps its id unique

    def pack(self, t: Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.numel() == 0 or t.device != self.path.device or not self.path.fits(t):
            return t.detach()  # detached: a tensor the node outputs would hold its own node
        record = self.held.get(id(t))
        if record is None:
            record = self.held[id(t)] = _Saved(t, self.path)
        return record

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        return packed.get() if isinstance(packed, _Saved) else packed

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def candidates(self) -> list[_Saved]:
        """When the forward has ended: the records that only this set holds, in the order saved.

        A record changed in place is marked (its backward refuses it) and stays on the device.
        """
        found = []
        for record in self.held.values():
            if record.changed():
                record.error = f"was changed in place during the forward (version {record.version} when saved)"
            elif record.alone():
                found.append(record)
        return found

    def release(self) -> None:
        """Stop holding: what stays on the device is kept detached, as autograd keeps a saved tensor.

        The held tensor's ``grad_fn`` would hold the graph, whose nodes hold the record: a cycle
        through C++ that no collection frees. The detached tensor shares its version counter.
        """
        for record in self.held.values():
            if record.tensor is not None:
                record.tensor = record.tensor.detach()
        self.held.clear()


class SizeProbe:
    """The sizes :meth:`SavedSet.candidates` would return for one forward, without holding a tensor.

    A forward run to learn what offload would take need not keep its activations: holding every
    saved tensor until its end is the whole stage's activation at once, recompute or not, on the
    device that offload is there to relieve. Each saved tensor is seen through weak references
    instead. One that :class:`SavedSet` would hold alone is one whose storage nothing else holds
    when the forward ends (no output, module, Python name or other saved tensor) and that is no view;
    a tensor saved where :class:`SavedSet` does not hold it (outside the chosen layers, a parameter,
    another device) is held there by autograd, so it takes its storage out of the count.

    Args:
        path: the stage's copies, as for :class:`SavedSet`.
    """

    def __init__(self, path: CopyPath) -> None:
        self.path = path
        self.seen: list[tuple[weakref.ref[Tensor], int, bool, StorageWeakRef]] = []
        self.by_id: dict[int, int] = {}
        self.held: list[StorageWeakRef] = []  # weak references keep a storage's address unique

    def pack(self, t: Tensor) -> None:
        if isinstance(t, nn.Parameter) or t.numel() == 0 or t.device != self.path.device or not self.path.fits(t):
            self.elsewhere(t)
            return None
        index = self.by_id.get(id(t))
        if index is None or self.seen[index][0]() is not t:  # an id can be reused once its tensor is gone
            self.by_id[id(t)] = len(self.seen)
            storage = StorageWeakRef(t.untyped_storage())
            self.seen.append((weakref.ref(t), t.numel() * t.element_size(), t._is_view(), storage))
        return None

    def elsewhere(self, t: Tensor) -> None:
        """A tensor saved outside :class:`SavedSet`'s hold: autograd keeps it, and so its storage."""
        try:
            self.held.append(StorageWeakRef(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):  # no storage (a subclass): nothing to share
            pass

    @staticmethod
    def _unpacked(_: None) -> Tensor:
        raise RuntimeError("fastpipe's offload measure keeps no saved tensor: its forward has no backward")

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self._unpacked)

    def outside(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Around the whole forward, under :meth:`hooks`: the saves of the layers not chosen."""

        def pack(t: Tensor) -> None:
            self.elsewhere(t)

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpacked)

    def sizes(self) -> list[int]:
        """When the forward has ended (its output still held): the bytes of each candidate, in order saved."""
        shared = collections.Counter(storage.cdata for *_, storage in self.seen)
        shared.update({ref.cdata: 2 for ref in self.held})
        return [
            nbytes
            for tensor, nbytes, view, storage in self.seen
            if tensor() is None and not view and storage.expired() and shared[storage.cdata] == 1
        ]


@contextlib.contextmanager
def saving_hooks(module: nn.Module, layers: frozenset[int] | None, saved: SavedSet | SizeProbe) -> Iterator[None]:
    """``saved``'s hooks around the whole forward, or around each chosen layer of ``module``."""
    if layers is None:
        with saved.hooks():
            yield
        return
    handles, entered = [], []

    def enter(*_: Any) -> None:
        ctx = saved.hooks()
        ctx.__enter__()
        entered.append(ctx)

    def leave(*_: Any) -> None:
        entered.pop().__exit__(None, None, None)

    for i, layer in enumerate(module.children()):
        if i in layers:
            handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class StepOffload:
    """The offload of one step: which micro-batches offload, and their records until prefetched."""

    def __init__(self) -> None:
        self.records: dict[tuple[int, int], list[weakref.ref[_Saved]]] = {}
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def saving(self, stage: Stage, action: Action, keep_graph: bool, schedule: Schedule) -> Iterator[None]:
        """Around the forward ``action``: offload what the stage's policy chooses when it ends.

        Args:
            stage: its stage (the ``offload`` policy, the device).
            action: the ``F``.
            keep_graph: whether the forward keeps its graph (a recomputed one saves nothing).
            schedule: the step's schedule: only the pairs it prefetches offload.
        """
        s, m, policy = action.stage, action.microbatch, stage.offload
        path = None if policy is None else copy_path(stage.device, force=policy.force)
        if path is not None:
            pending_copies()  # the device copies whose host copies have landed go before this forward allocates
        if not keep_graph or policy is None or path is None or (s, m) not in schedule.prefetched:
            yield
            return
        saved = SavedSet(path)
        try:
            with saving_hooks(stage.module, policy.layers, saved):
                yield
            found = saved.candidates()
            chosen = found[: chosen_prefix([r.nbytes for r in found], policy.fraction)]
            for record in chosen:
                record.offload()
        finally:
            saved.release()  # the rest is held by the graph alone, as without offload
        with self.lock:
            self.records[(s, m)] = [weakref.ref(r) for r in chosen]

    def prefetch(self, action: Action) -> float:
        """``P(s, m)``: start bringing back what ``F(s, m)`` offloaded; returns when it started."""
        started = time.perf_counter()
        with self.lock:
            refs = self.records.pop((action.stage, action.microbatch), [])
        for ref in refs:
            record = ref()
            if record is not None:
                record.fetch()
        return started
