"""Splitting a mini-batch into micro-batches and joining the results again.

A pipeline value is either one tensor or a tuple whose tensor items carry a batch
dimension (dim 0) and whose other items (ints, strings, ``None``...) ride along to every
micro-batch unchanged. This mirrors what ``nn.Sequential`` accepts: the whole value is
passed as the single positional argument of the first layer. A namedtuple stays one: each
micro-batch of it, and each copy on another device, is of the caller's class, so a layer
or a loss reads its fields by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

__all__ = [
    "Value",
    "check_value",
    "scatter",
    "gather",
    "tensors_of",
    "replace_tensors",
    "to_device",
    "batch_size",
    "is_namedtuple",
    "rebuilt",
]

Value = Tensor | tuple

_warned: set[tuple[int, int, int]] = set()


def check_value(value: Any, what: str = "input") -> None:
    """Raise ``TypeError`` unless ``value`` is a tensor or a tuple holding at least one tensor."""
    if isinstance(value, Tensor):
        return
    if isinstance(value, tuple):
        if not any(isinstance(v, Tensor) for v in value):
            raise TypeError(f"fastpipe: the {what} tuple holds no tensor; at least one item must be a Tensor")
        return
    raise TypeError(
        f"fastpipe: the {what} must be a Tensor or a tuple of tensors (other items pass through); "
        f"got {type(value).__name__}. Wrap several arguments in a tuple."
    )


def batch_size(value: Value, what: str = "input") -> int:
    """The shared dim-0 size of the tensors in ``value``; raises if they disagree or are 0-d."""
    sizes = set()
    for t in tensors_of(value):
        if t.dim() == 0:
            raise ValueError(
                f"fastpipe: a 0-d tensor in the {what} has no batch dimension to split; "
                "give it a leading batch dimension or pass it as a non-tensor item"
            )
        sizes.add(t.size(0))
    if len(sizes) != 1:
        raise ValueError(f"fastpipe: the tensors of the {what} disagree on the batch size (dim 0): {sorted(sizes)}")
    return sizes.pop()


def tensors_of(value: Value) -> list[Tensor]:
    """The tensor items of ``value``, in order."""
    if isinstance(value, Tensor):
        return [value]
    return [v for v in value if isinstance(v, Tensor)]


def replace_tensors(value: Value, tensors: Sequence[Tensor]) -> Value:
    """``value`` with its tensor items replaced, in order, by ``tensors``."""
    if isinstance(value, Tensor):
        (only,) = tensors
        return only
    it = iter(tensors)
    return rebuilt(value, [next(it) if isinstance(v, Tensor) else v for v in value])


def rebuilt(like: tuple, items: Iterable[Any]) -> tuple:
    """``items`` as a tuple of ``like``'s type: a namedtuple of the same class, else a plain tuple.

    ``tuple(items)`` would turn a namedtuple into a plain tuple, and a loss that reads
    ``target.mask`` would then fail only inside the pipeline.
    """
    if is_namedtuple(like):
        return cast(tuple, type(like)._make(items))  # type: ignore[attr-defined]
    return tuple(items)


def is_namedtuple(value: object) -> bool:
    """Whether ``value`` is an instance of a ``collections.namedtuple`` or ``typing.NamedTuple`` class."""
    return isinstance(value, tuple) and hasattr(type(value), "_fields") and hasattr(type(value), "_make")


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor, a tuple holding tensors, or anything else) with its tensors on ``device``."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return rebuilt(value, [v.to(device) if isinstance(v, Tensor) else v for v in value])
    return value


def scatter(value: Value, chunks: int) -> list[Value]:
    """Split ``value`` along dim 0 into at most ``chunks`` micro-batches.

    Micro-batches have ``ceil(batch / chunks)`` samples; the last may be smaller (the same
    rule as ``torch.chunk``). When the batch yields fewer micro-batches than asked for
    (a batch smaller than ``chunks``, or e.g. 5 samples in 4 chunks → sizes 2, 2, 1), the
    pipeline runs with fewer and warns once per (batch, chunks) pair.
    """
    check_value(value)
    n = batch_size(value)
    if n == 0:
        raise ValueError("fastpipe: the input batch is empty (dim 0 has size 0)")
    pieces = [t.chunk(chunks, dim=0) for t in tensors_of(value)]
    count = len(pieces[0])
    if count != chunks:
        key = (n, chunks, count)
        if key not in _warned:
            _warned.add(key)
            sizes = [p.size(0) for p in pieces[0]]
            warnings.warn(
                f"fastpipe: a batch of {n} samples splits into {count} micro-batches {sizes}, not the "
                f"{chunks} asked for; pass a batch of at least `chunks` samples, ideally a multiple of it",
                stacklevel=3,
            )
    return [replace_tensors(value, [p[i] for p in pieces]) for i in range(count)]


def gather(values: Sequence[Value]) -> Value:
    """Concatenate micro-batch results along dim 0; non-tensor items come from the first."""
    first = values[0]
    if isinstance(first, Tensor):
        return _cat([v for v in values])  # type: ignore[misc]
    columns = [tensors_of(v) for v in values]
    joined = [_cat([col[i] for col in columns]) for i in range(len(columns[0]))]
    return replace_tensors(first, joined)


def _cat(parts: list[Tensor]) -> Tensor:
    if parts[0].dim() == 0:
        raise ValueError(
            "fastpipe: the last stage returned a 0-d tensor, which cannot be joined across micro-batches; "
            "return per-sample values (compute a mean loss outside the Pipe)"
        )
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=0)
