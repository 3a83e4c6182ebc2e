"""The wire format of values crossing ranks: a fixed-size header, then raw payload bytes.

The header (pickled, :data:`HEADER` bytes) says what the value is: a lone tensor, a tuple,
or a namedtuple (its class, pickled by reference: every rank runs the same code and finds it
by module and name), then per item its shape, dtype and ``requires_grad`` flag, or a
non-tensor item itself. The tensor items travel as flat byte buffers of the sizes :func:`payload_sizes`
gives and come back as views of those buffers (:func:`tensors_from`). Keys name values:
``(kind, stage, micro-batch)``: ``ACT`` or ``GRAD`` into ``stage``, or a skip's tensors
(:mod:`fastpipe.model.skips`) into ``stage`` from their producer (:func:`skip_kind`) and their
gradients into ``stage`` from their consumer (:func:`skip_grad_kind`).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, cast

import torch
from torch import Tensor

from fastpipe.step.microbatch import Value, is_namedtuple

__all__ = [
    "ACT",
    "GRAD",
    "HEADER",
    "assemble",
    "describe",
    "kinds",
    "payload_sizes",
    "pack",
    "skip_grad_kind",
    "skip_kind",
    "tensors_from",
    "unpack",
    "value_kind",
]

HEADER = 512  # bytes of the fixed-size header (pickled shapes, dtypes, flags, non-tensor items)
ACT, GRAD = 0, 1


def skip_kind(producer: int) -> int:
    """The kind of the tensors ``producer`` stashed, sent to the stage that pops them."""
    return 2 + 2 * producer


def skip_grad_kind(consumer: int) -> int:
    """The kind of the gradients of tensors that ``consumer`` popped, sent back to their producer."""
    return 3 + 2 * consumer


def kinds(num_stages: int) -> int:
    """How many kinds of values a pipeline of ``num_stages`` stages sends."""
    return 2 + 2 * num_stages


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype


def _nbytes(item: Any) -> int:
    return int(torch.Size(item[1]).numel()) * _dtype(item[2]).itemsize


def value_kind(value: Value) -> bool | type:
    """The header's first field for ``value``: True for a lone tensor, False for a plain tuple,
    else the namedtuple's class, so that the receiver rebuilds the same type (:func:`assemble`).

    Raises:
        TypeError: the namedtuple's class is not where its module and name say (made inside a
            function), so no other rank can find it.
    """
    if isinstance(value, Tensor):
        return True
    if not is_namedtuple(value):
        return False
    cls = type(value)
    found: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is not cls:
        raise TypeError(
            f"fastpipe: a stage output is a namedtuple of class {cls.__qualname__!r}, which the next rank cannot "
            f"find by its name in module {cls.__module__!r} (a class made inside a function); define the class "
            "at module level"
        )
    return cls


def assemble(kind: bool | type, items: list[Any]) -> Value:
    """The received value of header kind ``kind`` (:func:`value_kind`) from its ``items``."""
    if kind is True:
        return cast(Tensor, items[0])
    if kind is False:
        return tuple(items)
    return cast(tuple, kind._make(items))  # type: ignore[attr-defined]


def pack(meta: list[Any]) -> Tensor:
    """The fixed-size header tensor (uint8, CPU) for ``meta``."""
    blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    if len(blob) > HEADER - 4:
        raise ValueError(
            f"fastpipe: the non-tensor items of a stage output pickle to {len(blob)} bytes; "
            f"at most {HEADER - 4} fit in a header (pass big objects as tensors)"
        )
    head = bytearray(HEADER)
    head[:4] = len(blob).to_bytes(4, "little")
    head[4 : 4 + len(blob)] = blob
    return torch.frombuffer(head, dtype=torch.uint8)


def unpack(header: Tensor) -> list[Any]:
    raw = header.cpu().numpy().tobytes()
    meta: list[Any] = pickle.loads(raw[4 : 4 + int.from_bytes(raw[:4], "little")])
    return meta


def payload_sizes(meta: list[Any]) -> tuple[int, ...]:
    """Payload bytes per item of a header (0 for non-tensor items)."""
    return tuple(_nbytes(item) if item[0] == "t" else 0 for item in meta[2:])


def tensors_from(meta: list[Any], buffers: dict[int, Tensor], device: torch.device) -> dict[int, Tensor]:
    """The tensor items of a received value, as views of their byte buffers."""
    tensors: dict[int, Tensor] = {}
    for i, item in enumerate(meta[2:]):
        if item[0] == "t":
            buf = buffers.get(i)
            dtype = _dtype(item[2])
            if buf is None:  # an empty tensor travels in the header only
                tensors[i] = torch.empty(item[1], dtype=dtype, device=device)
            else:
                tensors[i] = buf.view(dtype).view(item[1]).detach()
    return tensors


def describe(kind: int, stage: int, microbatch: int) -> str:
    if kind in (ACT, GRAD):
        return f"the {'activation' if kind == ACT else 'gradient'} for stage {stage}, micro-batch {microbatch}"
    peer = (kind - 2) // 2
    if kind % 2 == 0:
        return f"the skips from stage {peer} for stage {stage}, micro-batch {microbatch}"
    return f"the gradient of the skips from stage {stage} to stage {peer}, micro-batch {microbatch}"
