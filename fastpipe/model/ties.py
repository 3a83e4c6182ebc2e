"""Weights tied across stages: one parameter (or buffer, or module) that layers on several stages use.

A language model's output head often reuses the input embedding's matrix; a U-Net may reuse a
block. In the plain model both uses read one tensor and its gradient is the sum over the
uses. In a pipeline the uses run on different devices and threads, so each stage that is not
the tensor's owner (the first stage that uses it) reads a copy of its own, as in Megatron's
embedding group::

    stage 0 (owner)                stage K-1 (reader)
    wte.weight ──refresh (copy)──▶ lm_head.weight' (the reader's copy, on its device)
        ▲                                │
        └──── grad of the copy, added ◀──┘ after the step's backward

* the owner keeps the one tensor the optimizer, ``parameters()`` and ``state_dict()`` see;
* before each step every reader's copy is refreshed from the owner (skipped while the owner
  has not changed: its version counter says so);
* after the backward, each copy's gradient is added into the owner's, so the owner's
  ``.grad`` is the sum over all uses, as in the plain model.

The reader's layers are shallow clones of the model's layers that differ only in the tied
tensors: their other parameters, their hooks and their buffers are the model's own objects.
A copied buffer must stay constant (rotary tables, say): a reader that writes into one would
diverge from the owner, so the step raises instead.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from fastpipe.model.partition import layers_of

__all__ = ["Tie", "TiedWeights", "split_tied"]

Location = tuple[nn.Module, str, bool]  # (module, key, is_parameter)


def _get(loc: Location) -> Tensor:
    module, key, is_param = loc
    table = module._parameters if is_param else module._buffers
    tensor = table[key]
    assert tensor is not None
    return tensor


@dataclass
class Tie:
    """One tensor of the model that a stage other than its owner reads through a copy.

    Attributes:
        name: the owner's name in the Sequential (``"0.weight"``).
        reader_name: the name of the reader's first use (``"5.weight"``).
        owner_stage: the first stage that uses the tensor; it holds the tensor itself.
        reader_stage: the stage that reads the copy.
        owner: where the tensor lives in the model (module, key, is_parameter).
        readers: where the copy lives in the reader's layers (one entry per use there).
    """

    name: str
    reader_name: str
    owner_stage: int
    reader_stage: int
    owner: Location
    readers: list[Location]
    _seen: tuple[int, int] | None = field(default=None, repr=False)
    _reader_version: int | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        kind = "parameter" if self.is_parameter else "buffer"
        return (
            f"Tie({self.name!r} on stage {self.owner_stage} -> {self.reader_name!r} on stage {self.reader_stage}, "
            f"{kind})"
        )

    @property
    def is_parameter(self) -> bool:
        """A parameter (its gradient is folded into the owner's); else a constant buffer."""
        return self.owner[2]

    def source(self) -> Tensor:
        """The owner's tensor."""
        return _get(self.owner)

    def copy(self) -> Tensor:
        """The reader's copy."""
        return _get(self.readers[0])

    def refresh(self) -> bool:
        """Copy the owner's value into the reader's copy unless it is already current; True if copied."""
        src = self.source()
        state = (src.data_ptr(), src._version)  # both move when the owner's value may have
        dst = self.copy()
        if state == self._seen and dst.dtype == src.dtype:
            return False
        with torch.no_grad():
            if dst.shape == src.shape and dst.dtype == src.dtype:
                dst.copy_(src)
            elif self.is_parameter:
                dst.data = src.detach().to(dst.device, copy=True)
            else:
                fresh = src.detach().to(dst.device, copy=True)
                for module, key, _ in self.readers:
                    module._buffers[key] = fresh
        self._seen = state
        self._reader_version = self.copy()._version
        return True

    def check_constant(self) -> None:
        """Raise if a reader wrote into its copy of a buffer (it would diverge from the owner's)."""
        if not self.is_parameter and self.copy()._version != self._reader_version:
            self._seen = None
            raise RuntimeError(
                f"fastpipe: stage {self.reader_stage} wrote into buffer '{self.reader_name}', which it shares with "
                f"'{self.name}' on stage {self.owner_stage}; a buffer shared across stages is copied to each stage "
                "and must stay constant (e.g. rotary tables, not BatchNorm statistics). Put its uses in one stage "
                "through balance, or give each use its own module"
            )


class TiedWeights:
    """The ties of one pipeline: refreshes the copies and folds their gradients into the owners."""

    def __init__(self, ties: Sequence[Tie], stage_params: Sequence[Sequence[Tensor]]) -> None:
        self.ties = list(ties)
        self._params = stage_params
        self._slots: list[tuple[int, int, int, int]] = []  # (reader stage, index, owner stage, index)
        for tie in self.ties:
            if not tie.is_parameter:
                continue
            reader = _index(stage_params[tie.reader_stage], tie.copy())
            owner = _index(stage_params[tie.owner_stage], tie.source())
            if reader is not None and owner is not None:
                self._slots.append((tie.reader_stage, reader, tie.owner_stage, owner))

    def __bool__(self) -> bool:
        return bool(self.ties)

    def __repr__(self) -> str:
        if not self.ties:
            return "TiedWeights(no tensor is shared across stages)"
        return "TiedWeights(" + ", ".join(repr(t) for t in self.ties) + ")"

    def __iter__(self) -> Iterator[Tie]:
        return iter(self.ties)

    def refresh(self) -> None:
        """Bring every reader's copy up to the owner's value (before a step)."""
        for tie in self.ties:
            tie.refresh()

    def check_constant(self) -> None:
        """Raise if a step wrote into a copied buffer."""
        for tie in self.ties:
            tie.check_constant()

    def fold(self, grads: list[list[Tensor | None]]) -> list[list[Tensor | None]]:
        """Add each copy's gradient into its owner's slot (on the owner's device), leaving None in the copy's.

        Args:
            grads: per stage, one gradient per entry of the stage's parameter list.
        """
        for reader_stage, reader, owner_stage, owner in self._slots:
            g = grads[reader_stage][reader]
            if g is None:
                continue
            grads[reader_stage][reader] = None
            mine = grads[owner_stage][owner]
            g = g.to(self._params[owner_stage][owner].device)
            if mine is None or not mine.is_contiguous():  # an expanded gradient cannot take a sum in place
                grads[owner_stage][owner] = g if mine is None else mine + g
            else:  # the step's own sum: in place, or the step's end would hold a third copy of the tensor
                mine.add_(g)
        return grads


def _index(params: Sequence[Tensor], tensor: Tensor) -> int | None:
    return next((i for i, p in enumerate(params) if p is tensor), None)


def _state(module: nn.Module) -> Iterator[tuple[str, Tensor, Location]]:
    """Every parameter and buffer reached from ``module``, with its name and location, repeats included."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
            for key, tensor in table.items():
                if tensor is not None:
                    yield (f"{prefix}.{key}" if prefix else key), tensor, (sub, key, is_param)


def split_tied(module: nn.Sequential, balance: Sequence[int]) -> tuple[list[nn.Sequential], list[Tie]]:
    """Cut ``module`` into contiguous stages; tensors used on several stages become ties.

    The owner of a tensor is the first stage that reaches it. Each later stage that reaches
    it gets a copy (see the module docstring) through shallow clones of its layers.

    Returns:
        The stages (``nn.Sequential`` s of the model's layers, or of their clones where a
        layer reads a copy) and the ties, in order of the reader stages.
    """
    layers = layers_of(module)
    bounds, start = [], 0
    for count in balance:
        bounds.append((start, start + count))
        start += count
    owner: dict[int, tuple[int, str, Location]] = {}
    for s, (lo, hi) in enumerate(bounds):
        for layer_name, layer in layers[lo:hi]:
            for name, tensor, loc in _state(layer):
                owner.setdefault(id(tensor), (s, f"{layer_name}.{name}", loc))
    stages: list[nn.Sequential] = []
    ties: list[Tie] = []
    for s, (lo, hi) in enumerate(bounds):
        copies: dict[int, Tensor] = {}
        found: dict[int, Tie] = {}
        for layer_name, layer in layers[lo:hi]:
            for name, tensor, _ in _state(layer):
                first = owner[id(tensor)]
                if first[0] != s and id(tensor) not in copies:
                    copies[id(tensor)] = _copy_of(tensor)
                    found[id(tensor)] = Tie(first[1], f"{layer_name}.{name}", first[0], s, first[2], [])
        memo: dict[int, nn.Module] = {}
        stage_layers = [(n, _rebind(layer, copies, memo)) for n, layer in layers[lo:hi]]
        by_copy = {id(copies[k]): tie for k, tie in found.items()}
        for _, layer in stage_layers:  # where the copies ended up
            for _, tensor, loc in _state(layer):
                tie = by_copy.get(id(tensor))
                if tie is not None and all(loc[0] is not m or loc[1] != k for m, k, _ in tie.readers):
                    tie.readers.append(loc)
        stages.append(nn.Sequential(OrderedDict(stage_layers)))
        ties.extend(found.values())
    return stages, ties


def _copy_of(tensor: Tensor) -> Tensor:
    data = tensor.detach().clone()
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(data, requires_grad=tensor.requires_grad)
    return data


def _reaches(module: nn.Module, copies: dict[int, Tensor]) -> bool:
    return any(id(t) in copies for _, t, _ in _state(module))


def _rebind(module: nn.Module, copies: dict[int, Tensor], memo: dict[int, nn.Module]) -> nn.Module:
    """``module``, or a shallow clone of it whose tensors in ``copies`` are replaced by their copies.

    The clone shares everything else with ``module``: its other parameters (by identity),
    its hooks, and its buffer table where no buffer is copied (so moving or converting the
    model's buffers moves the clone's too).
    """
    if id(module) in memo:
        return memo[id(module)]
    if not _reaches(module, copies):
        memo[id(module)] = module
        return module
    clone = copy.copy(module)
    memo[id(module)] = clone
    params = module._parameters
    clone.__dict__["_parameters"] = {k: copies.get(id(v), v) if v is not None else None for k, v in params.items()}
    buffers = module._buffers
    if any(v is not None and id(v) in copies for v in buffers.values()):
        own = [k for k, v in buffers.items() if v is not None and id(v) not in copies]
        if own:
            raise ValueError(
                f"fastpipe: module {type(module).__name__} holds buffers shared with another stage and buffers "
                f"of its own ({', '.join(own)}); fastpipe copies shared buffers to each stage and cannot also keep "
                "the module's own ones in step. Put the module's uses in one stage through balance"
            )
        clone.__dict__["_buffers"] = {k: copies.get(id(v), v) if v is not None else None for k, v in buffers.items()}
    children = module._modules
    rebound = {k: _rebind(c, copies, memo) if c is not None else None for k, c in children.items()}
    if any(rebound[k] is not children[k] for k in children):
        clone.__dict__["_modules"] = rebound
    return clone
