"""What a checkpointed forward leaves behind so that its recompute replays it exactly.

A recompute must see what the forward saw and must not apply the forward's side effects a
second time. Randomness is the task RNG's job (fastpipe.rng.streams); this module covers the rest:

* **Inputs written in place.** A stage that writes into its input (``bar.add_(1)``) under
  checkpointing would see the written values in the recompute and write them again. The
  version counters of the inputs are recorded around the forward and checked before the
  recompute; a change is refused with an error that says what to change. (A stage whose
  first layer works in place gets a copy of its input instead: see ``Stage.clone_input``.)
* **Buffers written by the forward** (BatchNorm's running statistics): the recompute runs
  on copies of them, which its graph may keep, so the module's own buffers are updated once,
  by the forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn

from fastpipe.step.microbatch import Value, tensors_of

__all__ = ["Snapshot", "check_untouched"]

Slot = tuple[nn.Module, str]


class Snapshot:
    """Taken before a checkpointed forward; :meth:`seal` after it, :meth:`replaying` around
    its recompute."""

    def __init__(self, module: nn.Module, inputs: Value) -> None:
        self.inputs = inputs
        self.versions = _versions(inputs)
        self._slots = [
            (mod, name, b._version) for mod in module.modules() for name, b in mod._buffers.items() if b is not None
        ]
        self.written: list[Slot] = []

    def seal(self, stage: int, microbatch: int) -> None:
        """After the forward: refuse writes into its inputs, note the buffers it wrote."""
        check_untouched(self.versions, self.inputs, stage, microbatch, "during its checkpointed forward")
        self.versions = _versions(self.inputs)
        # Norm layers' running statistics are written inside the kernel, which leaves no trace
        # in the version counter: count them as written.
        self.written = [
            (mod, name)
            for mod, name, version in self._slots
            if isinstance(mod, nn.modules.batchnorm._NormBase) or _version_of(mod, name) != version
        ]
        self._slots = []

    @contextlib.contextmanager
    def replaying(self, stage: int, microbatch: int) -> Iterator[None]:
        """Around the recompute: inputs as the forward left them, buffers written into copies."""
        check_untouched(
            self.versions, self.inputs, stage, microbatch, "between its checkpointed forward and the recompute"
        )
        originals = [mod._buffers[name] for mod, name in self.written]
        try:
            for (mod, name), b in zip(self.written, originals):
                mod._buffers[name] = None if b is None else b.clone()
            yield
        finally:
            for (mod, name), b in zip(self.written, originals):
                mod._buffers[name] = b


def check_untouched(before: list[int], inputs: Value, stage: int, microbatch: int, when: str) -> None:
    """Refuse to replay a forward whose inputs were written in place since ``before``."""
    after = _versions(inputs)
    if before == after:
        return
    i = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    what = "the input" if isinstance(inputs, Tensor) else f"tensor {i} of the input tuple"
    raise RuntimeError(
        f"fastpipe: {what} of stage {stage} (micro-batch {microbatch}) was written in place {when}, so "
        "recomputing that forward for the backward would not see the values the forward saw (and would apply "
        "the write twice). Write into a copy in the stage (e.g. `x = x.clone()` before `x.add_(...)`, or an "
        "out-of-place op), or pass checkpoint='never'."
    )


def _versions(value: Value) -> list[int]:
    return [t._version for t in tensors_of(value)]


def _version_of(module: nn.Module, name: str) -> int:
    b = module._buffers[name]
    return -1 if b is None else b._version
