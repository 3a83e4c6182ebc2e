"""What storages autograd keeps through saved tensors while it keeps them, and byte sums over storages.

:func:`fastpipe.memory.stage_bytes.measure_stages` packs each tensor a forward saves into a
:class:`Holder` (``saved_tensors_hooks``); the holder dies when autograd lets go of the tensor,
and :class:`Saved` then drops its storage from ``alive``. Storages are keyed by data pointer, so a
tensor several layers save counts once.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any, cast

from torch import Tensor

__all__ = ["Holder", "Saved", "storage_bytes", "storages"]


class Saved:
    """The storages autograd holds through saved tensors, while it holds them."""

    def __init__(self, skip: set[int]) -> None:
        self.skip = skip  # parameter storages
        self.alive: dict[int, list[int]] = {}  # data_ptr -> [nbytes, holders]
        # Weak: a holder autograd let go of must die, so that ``alive`` drops its tensor then.
        self.holders: list[weakref.ref[Holder]] = []

    def pack(self, t: Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip:
            return t
        holder = Holder(t, self)
        self.holders.append(weakref.ref(holder))
        return holder

    def release(self) -> None:
        """Let go of every tensor held, once nothing will unpack them.

        A tensor its own graph node saves (an output kept for the backward) and a holder form a
        cycle through autograd's C++ graph that Python's collector cannot see: a graph part no
        backward consumed (an integer input's path) would keep it, and its saved tensors, alive."""
        for ref in self.holders:
            holder = ref()
            if holder is not None:
                holder.tensor = None
        self.holders.clear()

    @staticmethod
    def unpack(held: Any) -> Tensor:
        if isinstance(held, Holder):
            assert held.tensor is not None, "a measured graph is unpacked after its measure ended"
            return held.tensor
        return cast(Tensor, held)

    def alive_bytes(self) -> dict[int, int]:
        return {ptr: entry[0] for ptr, entry in self.alive.items()}


class Holder:
    __slots__ = ("tensor", "ptr", "owner", "__weakref__")

    def __init__(self, tensor: Tensor, owner: Saved) -> None:
        self.tensor: Tensor | None = tensor
        self.owner = owner
        storage = tensor.untyped_storage()
        self.ptr = storage.data_ptr()
        entry = owner.alive.setdefault(self.ptr, [storage.nbytes(), 0])
        entry[1] += 1

    def __del__(self) -> None:
        entry = self.owner.alive[self.ptr]
        entry[1] -= 1
        if not entry[1]:
            del self.owner.alive[self.ptr]


def storages(tensors: Iterable[Tensor | None]) -> dict[int, int]:
    """Each tensor's storage, ``{data pointer: bytes}``."""
    found = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def storage_bytes(found: Mapping[int, int], *without: Mapping[int, int]) -> int:
    """The bytes of the storages of ``found`` that none of ``without`` has."""
    return sum(n for ptr, n in found.items() if ptr and not any(ptr in w for w in without))
