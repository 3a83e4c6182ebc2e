"""Before anything runs: check that each decoder layer's inputs are the hidden states plus values a stage can rebuild.

A pipeline stage receives the hidden states and the side inputs, and rebuilds everything
else a decoder layer takes by running the base model's forward (:mod:`fastpipe.hf.layers`).
That is exact when the rest depends only on the side inputs and on the shapes: the masks, the
rotary tables, the position ids. :func:`check_layer_inputs` runs the base model's forward on
a small batch of random hidden states, with every decoder layer replaced by a stub that
records its arguments, and refuses the model when:

* a layer argument is a container or object that layers could share state through (Gemma 4's
  ``shared_kv_states``), rather than tensors and plain values;
* a layer argument changes with the hidden states fed in, or differs when the modules of the
  other stages really run (per-layer inputs computed from the embeddings);
* the forward changes the hidden states between two layers, or calls the layers out of order;
* what the forward does after the last layer depends on anything before the layers but the
  side inputs (the final norm's stage sees only the last layer's output).

It costs a few runs of the base model's own work between its modules (masks, rotary tables) on
a 2 x 4 batch: on a tiny Llama (2026-12-01), 6 rotary calls, 2 embedding lookups and 2 final
norms; no decoder layer or head runs. A model on the
meta device is not probed (HF's mask functions read tensor values); the checks of
``to_sequential`` that read only the model's structure still apply to it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from fastpipe.hf.errors import UnsupportedModelError
from fastpipe.hf.layers import Calls, DecoderBlock, Embeddings, FinalNorm, ModelPart
from fastpipe.hf.own_forward import hidden_of

__all__ = ["check_layer_inputs"]

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_ROWS, _STEPS = 2, 4  # the probe batch: 2 sequences of 4 tokens, the second one left-padded


def _plain_types() -> tuple[type, ...]:
    try:  # a flex-attention mask is built per call like a tensor mask
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention
        return (Tensor, *_PLAIN)
    return (Tensor, BlockMask, *_PLAIN)


def _leaves(value: Any, name: str) -> Iterator[tuple[str, Any]]:
    """``(name, leaf)`` for each leaf of a layer argument; tuples are walked into, nothing else."""
    if type(value) is tuple:
        for i, item in enumerate(value):
            yield from _leaves(item, f"{name}[{i}]")
    else:
        yield name, value


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A layer call's arguments other than the hidden states, by name (``positional argument i`` for the others)."""
    named = {f"positional argument {i}": a for i, a in enumerate(args[1:], start=1)}
    named.update((k, v) for k, v in kwargs.items() if not (k == "hidden_states" and not args))
    return {leaf: value for name, arg in named.items() for leaf, value in _leaves(arg, name)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b.to(a.device)))
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    return type(a) is type(b) and (a is b or a == b)


def check_layer_inputs(seq: nn.Sequential, name: str) -> None:
    """Refuse the model of ``seq`` (the adapter's layers) if its layers take state a stage cannot rebuild.

    Args:
        seq: the adapter's layers: :class:`Embeddings`, the :class:`DecoderBlock` s, and two more.
        name: the model's class name, for the messages.

    Raises:
        UnsupportedModelError: see the module docstring; the message names the layer and the argument.
    """
    blocks = [layer for layer in seq if isinstance(layer, DecoderBlock)]
    assert isinstance(seq[0], Embeddings) and blocks and isinstance(seq[-2], FinalNorm)
    embeddings, last, final = _scratch(seq[0]), _scratch(blocks[-1]), _scratch(seq[-2])
    param = next(iter([*last.layer.parameters(), *embeddings.parameters()]))
    if param.is_meta:
        return  # HF's mask functions read values (packed sequences), which meta tensors do not have
    mask = torch.ones(_ROWS, _STEPS, dtype=torch.long, device=param.device)
    mask[1, 0] = 0  # padding, so that every attention implementation materialises its mask
    ids = torch.zeros(_ROWS, _STEPS, dtype=torch.long, device=param.device)
    with torch.no_grad():
        embedded = embeddings.inputs_of_layer(0, {"input_ids": ids, "attention_mask": mask}, training=False)
    hidden = hidden_of(*embedded)
    generator = torch.Generator().manual_seed(0)
    runs: list[Calls] = []
    for absent in (True, True, False):
        given = torch.randn(hidden.shape, generator=generator).to(hidden.device, hidden.dtype)
        calls: Calls = []
        with torch.enable_grad():
            given.requires_grad_(hidden.is_floating_point())
            inputs = {"inputs_embeds": given, "attention_mask": mask}
            last.inputs_of_layer(last.index, inputs, training=False, absent=absent, seen=calls)
        _check_calls(calls, len(blocks), name)
        runs.append(calls)
    _check_after_layers(final, ids, mask, runs[0], name)
    for calls in runs[1:]:
        for (index, args, kwargs), (_, args0, kwargs0) in zip(calls, runs[0]):
            here, first = _arguments(args, kwargs), _arguments(args0, kwargs0)
            for arg, value in here.items():
                if arg not in first or not _same(value, first[arg]):
                    raise UnsupportedModelError(
                        f"fastpipe.hf.to_sequential: {name}'s forward gives decoder layer {index} an argument "
                        f"({arg}) that changes with the hidden states or comes from modules the layer's stage "
                        "does not hold; a stage receives only the hidden states and the side inputs "
                        "(attention_mask, position_ids)"
                    )


P = TypeVar("P", bound=ModelPart)


def _scratch(part: P) -> P:
    """A clone of ``part`` with copies of its helpers: a dynamic rotary's ``inv_freq`` must not remember the probe."""
    clone = copy.copy(part)
    config = getattr(part._layout.base, "config", None)
    helpers = part._layout.helpers
    modules = {k: copy.deepcopy(m, memo={id(config): config}) if k in helpers else m for k, m in part._modules.items()}
    clone.__dict__["_modules"] = modules
    return clone


def _check_calls(calls: Calls, blocks: int, name: str) -> None:
    """The stubs' record of one run: each layer once, in order, on the same hidden states, with plain arguments."""
    if [index for index, _, _ in calls] != list(range(blocks)):
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {name}'s forward called its decoder layers in the order "
            f"{[index for index, _, _ in calls]}; the adapter needs each of layers 0..{blocks - 1} once, in order"
        )
    plain = _plain_types()
    first = hidden_of(calls[0][1], calls[0][2])
    for index, args, kwargs in calls:
        if index and hidden_of(args, kwargs) is not first:
            raise UnsupportedModelError(
                f"fastpipe.hf.to_sequential: {name}'s forward changes the hidden states between decoder layers "
                f"{index - 1} and {index}, outside any module a pipeline stage holds"
            )
        for arg, value in _arguments(args, kwargs).items():
            if not isinstance(value, plain):
                raise UnsupportedModelError(
                    f"fastpipe.hf.to_sequential: {name}'s forward gives decoder layer {index} the argument {arg}, "
                    f"a {type(value).__name__}: layers can pass state to each other through it, outside the "
                    "hidden states that flow between pipeline stages"
                )
            if isinstance(value, Tensor) and value.requires_grad:
                raise UnsupportedModelError(
                    f"fastpipe.hf.to_sequential: {name}'s forward gives decoder layer {index} the argument {arg}, "
                    "computed from the hidden states or from parameters; a stage receives only the hidden "
                    "states and the side inputs (attention_mask, position_ids)"
                )


def _check_after_layers(final: FinalNorm, ids: Tensor, mask: Tensor, calls: Calls, name: str) -> None:
    """The final norm's stage, given only the last layer's output, computes what the whole forward does."""
    last = hidden_of(calls[-1][1], calls[-1][2])
    hidden = torch.randn(last.shape, generator=torch.Generator().manual_seed(1)).to(last.device, last.dtype)
    with torch.no_grad():
        expected = final.after_layers(hidden, {"input_ids": ids, "attention_mask": mask}, training=False, absent=False)
        got = final.after_layers(hidden, {"inputs_embeds": hidden}, training=False)
    if not (isinstance(got, Tensor) and isinstance(expected, Tensor) and torch.equal(got, expected)):
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {name}'s forward combines the last decoder layer's output with values "
            "from before the layers (the embeddings, say); the stage of the final norm receives only that output"
        )
