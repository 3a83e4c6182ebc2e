"""Peak activation bytes per pipeline stage, counted with saved-tensor hooks inside each worker.

``torch.autograd.graph.saved_tensors_hooks`` is thread-local, and every stage runs in its own
worker thread, so the hooks are entered around each layer's forward (a forward pre-hook and a
forward hook on every layer) in whichever thread runs it, recomputations included. Each saved
storage is counted once while any autograd node holds it; parameters are left out (those
the stage holds at that forward: gathered ones where FSDP2 shards it). The count
drops when autograd frees the node, so ``peak`` is the most activation memory one stage kept
alive at once under the schedule in use: 1F1B's fewer micro-batches in flight and
recomputation's smaller saves both show in it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["ActivationMeter"]


class _Saved:
    """What the pack hook returns: the tensor plus a release when autograd drops it."""

    __slots__ = ("tensor", "release")

    def __init__(self, tensor: Tensor, release: Any) -> None:
        self.tensor = tensor
        self.release = release

    def __del__(self) -> None:
        self.release()


def _storages(stage: nn.Module) -> set[int]:
    """Where ``stage``'s parameters live now (a DTensor shard's local storage)."""
    out = set()
    for p in stage.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        out.add(local.untyped_storage().data_ptr())
    return out


class _StageCounter:
    def __init__(self, stage: nn.Module) -> None:
        self.stage = stage
        self.params: set[int] = set()
        self.refs: dict[int, tuple[int, int]] = {}  # storage pointer -> (references, bytes)
        self.live = 0
        self.peak = 0
        self.lock = threading.Lock()

    def pack(self, t: Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params or storage.nbytes() == 0:
            return t
        with self.lock:
            count, nbytes = self.refs.get(ptr, (0, storage.nbytes()))
            self.refs[ptr] = (count + 1, nbytes)
            if count == 0:
                self.live += nbytes
                self.peak = max(self.peak, self.live)

        def release() -> None:
            with self.lock:
                n, size = self.refs[ptr]
                if n == 1:
                    del self.refs[ptr]
                    self.live -= size
                else:
                    self.refs[ptr] = (n - 1, size)

        return _Saved(t, release)

    @staticmethod
    def unpack(obj: Any) -> Tensor:
        return obj.tensor if isinstance(obj, _Saved) else obj


class ActivationMeter:
    """Counts the activation bytes each stage keeps for backward, while attached.

    Args:
        stages: the pipeline's stages in order (``Pipe.partitions``).

    Use as a context manager around the steps to measure; ``peaks`` holds each stage's most
    bytes alive at once (reset with :meth:`reset`).
    """

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        self._stages = list(stages)
        self._counters = [_StageCounter(s) for s in self._stages]
        self._handles: list[Any] = []
        self._active = threading.local()

    @property
    def peaks(self) -> list[int]:
        """Per stage, the most saved bytes alive at once."""
        return [c.peak for c in self._counters]

    def reset(self) -> None:
        """Start a new peak from what is alive now."""
        for c in self._counters:
            with c.lock:
                c.peak = c.live

    def __enter__(self) -> ActivationMeter:
        for stage, counter in zip(self._stages, self._counters):
            for layer in stage.children():
                self._handles.append(layer.register_forward_pre_hook(self._enter_hook(counter)))
                self._handles.append(layer.register_forward_hook(self._exit_hook, always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _enter_hook(self, counter: _StageCounter) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            # Read at each forward: a stage sharded over its replicas trains on parameters
            # gathered for the step, which exist only then.
            counter.params = _storages(counter.stage)
            ctx = torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack)
            ctx.__enter__()
            stack = getattr(self._active, "stack", None)
            if stack is None:
                stack = self._active.stack = []
            stack.append(ctx)

        return hook

    def _exit_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = getattr(self._active, "stack", None)
        if stack:
            stack.pop().__exit__(None, None, None)
