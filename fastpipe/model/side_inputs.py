"""Side inputs: per-step keyword values (masks, positions, rotary tables) handed to the layers that declare them.

A pipeline value flows from layer to layer as the single positional argument. Some values
are not like that: an ``attention_mask`` or a rotary ``(cos, sin)`` pair is the same for every
layer of a step. Instead of threading them through every layer as tuple items, give them once
to the call, by keyword::

    pipe(ids, attention_mask=mask)
    pipe.train_step(ids, labels, loss_fn, attention_mask=mask)

and let the layers that need them say so::

    block = fastpipe.takes(block, "attention_mask")   # block(x, attention_mask=...) from now on

or, for a class of your own, with a class attribute::

    class Block(nn.Module):
        fastpipe_side_inputs = ("attention_mask",)
        def forward(self, x, attention_mask=None): ...

A layer receives only the side inputs it declares, and only those the call passed (a missing
one is left to the layer's default). :class:`Sequential` runs such a model without a pipeline
(``Sequential(...)(ids, attention_mask=mask)``), so the plain model and the pipe take the same
call.

How a side input is split into micro-batches, once, when the mini-batch is:

* a tensor whose dim 0 is the batch is split like the input;
* a tensor whose dim 0 is 1, a 0-d tensor, and anything that is not a tensor reach every
  micro-batch whole (broadcast);
* :func:`broadcast` marks a value to reach every micro-batch whole whatever its shape (a
  ``[T, d]`` table whose ``T`` happens to equal the batch size);
* tuples, lists and dicts are split item by item (an item may be marked with :func:`broadcast`).

Side inputs carry no gradient: a value that needs one is an activation, so pass it through
the layers (or stash it as a skip). Each stage receives them on its own device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fastpipe.model.skips import SkipStore, Stash, has_skips, open_skips, popped

__all__ = [
    "SIDE_INPUTS_ATTRIBUTE",
    "Broadcast",
    "Sequential",
    "broadcast",
    "takes",
    "declared",
    "check_side_inputs",
    "split_side_inputs",
    "side_inputs_on",
    "run_layers",
]

SIDE_INPUTS_ATTRIBUTE = "fastpipe_side_inputs"

M = TypeVar("M", bound=nn.Module)

SideInputs = Mapping[str, Any]


@dataclass(frozen=True)
class Broadcast:
    """A side input that reaches every micro-batch whole, whatever its shape (see :func:`broadcast`)."""

    value: Any


def broadcast(value: Any) -> Broadcast:
    """Mark a side input to reach every micro-batch whole instead of being split along dim 0."""
    return Broadcast(value)


def takes(layer: M, *names: str) -> M:
    """Declare that ``layer`` takes the side inputs ``names`` as keyword arguments; returns ``layer``.

    The names add to those the layer (or its class) already declares.

    Raises:
        TypeError: ``layer`` is not a module, or a name is not an identifier.
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(f"fastpipe.takes: expected an nn.Module, got {type(layer).__name__}")
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"fastpipe.takes: side input names are keyword names, got {name!r}")
    own = tuple(getattr(layer, SIDE_INPUTS_ATTRIBUTE, ()))
    setattr(layer, SIDE_INPUTS_ATTRIBUTE, own + tuple(n for n in names if n not in own))
    return layer


def declared(module: nn.Module) -> tuple[str, ...]:
    """The side inputs ``module`` takes: its own declaration, or, for an ``nn.Sequential``, its layers'."""
    own = getattr(module, SIDE_INPUTS_ATTRIBUTE, None)
    if own is not None:
        return tuple(own)
    if isinstance(module, nn.Sequential):
        names: dict[str, None] = {}
        for layer in module._modules.values():
            if layer is not None:
                names.update(dict.fromkeys(declared(layer)))
        return tuple(names)
    return ()


def call_layer(layer: nn.Module, value: Any, side: SideInputs, skips: SkipStore | None = None) -> Any:
    """``layer(value)``, with the side inputs it declares (and the skips it pops) as keywords.

    A nested ``nn.Sequential`` without a declaration of its own hands them on to its layers.
    ``skips`` holds the run's stashed tensors (:mod:`fastpipe.model.skips`); None when it has none.
    """
    names = declared(layer) if side else ()
    taken = popped(layer) if skips is not None else ()
    if skips is not None and isinstance(layer, Stash):
        skips.put(layer.name, value)
        return value
    if not names and not taken and not (skips is not None and isinstance(layer, nn.Sequential) and has_skips(layer)):
        return layer(value)
    if getattr(layer, SIDE_INPUTS_ATTRIBUTE, None) is None and not taken and isinstance(layer, nn.Sequential):
        return run_layers(layer, value, side, skips)
    kwargs = {n: side[n] for n in names if n in side}
    if taken:
        assert skips is not None
        if set(kwargs) & set(taken):
            raise TypeError(
                f"fastpipe: {type(layer).__name__} takes {sorted(set(kwargs) & set(taken))} both as a "
                "side input and as a skip it pops; rename one"
            )
        kwargs.update((n, skips.take(n, layer)) for n in taken)
    return layer(value, **kwargs)


def run_layers(module: nn.Module, value: Any, side: SideInputs, skips: SkipStore | None = None) -> Any:
    """Run ``module``'s layers in order on ``value``, handing each the side inputs it declares (and its skips)."""
    for layer in module._modules.values():
        if layer is not None:
            value = call_layer(layer, value, side, skips)
    return value


class Sequential(nn.Sequential):
    """An ``nn.Sequential`` whose forward takes side inputs by keyword: ``model(x, attention_mask=mask)``.

    Each layer receives the side inputs it declares (see :func:`takes`) and the skips it pops
    (see :mod:`fastpipe.model.skips`), so this runs the same model a :class:`fastpipe.Pipe`
    pipelines, in one piece.
    """

    def forward(self, input: Any, **side: Any) -> Any:  # noqa: D102 - the class says it
        check_side_inputs(self, side)
        return run_layers(self, input, {k: _unwrap(v) for k, v in side.items()}, open_skips(self))


def _unwrap(value: Any) -> Any:
    return tree_map(lambda leaf: leaf.value if isinstance(leaf, Broadcast) else leaf, value)


def check_side_inputs(module: nn.Module | Sequence[str], side: SideInputs, *, grad: bool | None = None) -> None:
    """Raise a clear error for side inputs no layer of ``module`` takes, or that need a gradient.

    Args:
        module: the whole model (or a stage), or the names its layers take.
        side: the keyword values of the call.
        grad: whether autograd records this call (default: ``torch.is_grad_enabled()``).
    """
    if not side:
        return
    known = declared(module) if isinstance(module, nn.Module) else tuple(module)
    unknown = [n for n in side if n not in known]
    if unknown:
        takes_now = ", ".join(repr(n) for n in known) if known else "none"
        raise TypeError(
            f"fastpipe: no layer of the model takes the side input(s) {', '.join(map(repr, unknown))} "
            f"(the layers take: {takes_now}). Declare it on the layers that use it with "
            f"fastpipe.takes(layer, {unknown[0]!r}), or a class attribute fastpipe_side_inputs = ({unknown[0]!r},)"
        )
    if grad if grad is not None else torch.is_grad_enabled():
        for name, value in side.items():
            leaves, _ = tree_flatten(_unwrap(value))
            if any(isinstance(t, Tensor) and t.requires_grad for t in leaves):
                raise ValueError(
                    f"fastpipe: side input {name!r} requires grad, but side inputs carry no gradient back; "
                    "pass a value that needs a gradient through the layers (part of the input), or detach it"
                )


def split_side_inputs(side: SideInputs, batch: int, chunks: int, count: int) -> list[dict[str, Any]]:
    """Each micro-batch's side inputs: split along dim 0 like the input, or whole (see the module doc).

    Args:
        side: the call's keyword values.
        batch: the mini-batch's size (the input's dim 0).
        chunks: the micro-batches asked for (the input was split with ``torch.chunk(chunks)``).
        count: the micro-batches the input split into.

    Raises:
        ValueError: a tensor's dim 0 is neither the batch size nor 1.
    """
    out: list[dict[str, Any]] = [{} for _ in range(count)]
    for name, value in side.items():
        if isinstance(value, Broadcast):
            for mb in out:
                mb[name] = value.value
            continue
        leaves, spec = tree_flatten(value)
        columns = [_split_leaf(name, leaf, batch, chunks, count) for leaf in leaves]
        for m, mb in enumerate(out):
            mb[name] = tree_unflatten([col[m] for col in columns], spec)
    return out


def _split_leaf(name: str, leaf: Any, batch: int, chunks: int, count: int) -> Sequence[Any]:
    if isinstance(leaf, Broadcast):
        return [leaf.value] * count
    if not isinstance(leaf, Tensor) or leaf.dim() == 0 or (leaf.size(0) == 1 and batch != 1):
        return [leaf] * count
    if leaf.size(0) != batch:
        raise ValueError(
            f"fastpipe: side input {name!r} has shape {tuple(leaf.shape)}: its dim 0 ({leaf.size(0)}) is neither "
            f"the batch size ({batch}, split into micro-batches) nor 1 (the same for every sample). Give it a "
            "batch dimension, or wrap it in fastpipe.broadcast(...) to hand it whole to every micro-batch"
        )
    pieces = leaf.chunk(chunks, dim=0)
    assert len(pieces) == count, "side input split unlike the input"
    return pieces


def side_inputs_on(
    side: SideInputs, names: Sequence[str], device: torch.device, cache: dict[tuple[int, torch.device], Tensor]
) -> dict[str, Any]:
    """The side inputs ``names`` of one micro-batch, their tensors on ``device``.

    ``cache`` keeps the copy of each tensor per device, so a broadcast tensor moves to a
    device once per step, not once per micro-batch.
    """
    out: dict[str, Any] = {}
    for name in names:
        if name not in side:
            continue
        leaves, spec = tree_flatten(side[name])
        moved = []
        for leaf in leaves:
            if isinstance(leaf, Tensor) and leaf.device != device:
                key = (id(leaf), device)
                if key not in cache:
                    cache[key] = leaf.to(device)
                leaf = cache[key]
            moved.append(leaf)
        out[name] = tree_unflatten(moved, spec)
    return out
