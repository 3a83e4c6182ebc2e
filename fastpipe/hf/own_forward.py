"""The HF model's own ``forward``, run in pieces: what each pipeline layer needs, computed as the model computes it.

A HF base model does work between its modules: it scales or sums embeddings, builds one
attention mask per attention kind (with options of its own, such as ``allow_is_causal_skip``),
computes the rotary ``(cos, sin)`` per layer type, and hands each decoder layer whatever
keyword arguments it wants. Copying that work into the adapter would copy one family's way.
Instead each pipeline layer runs the base model's own ``forward`` on a stand-in whose decoder
layers are stubs::

    base.forward(stand_in, inputs_embeds=hidden, attention_mask=mask, position_ids=pos)
        embeddings, masks, rotary ... (the model's code, the stand-in's modules)
        for layer in stand_in.layers:      stub 0 .. i-1: pass the hidden states through
            hidden = layer(hidden, **kw)   stub i: raise Reached(args, kwargs)  ─▶ layer i's inputs

The stand-in answers every attribute from the base model, except:

* the decoder layers, which are stubs;
* the modules the pipeline layer owns (its own, or its copies of the rotary embedding);
* any other module that holds tensors, which answers with zeros of the right shape computed on
  the meta device. Such a module belongs to another stage: its parameters may be on another
  device, and what it computes before layer ``i`` only feeds hidden states that the stub drops;
* ``training``, which is the pipeline layer's.

The base model itself is never changed, so stages on other threads can run it at the same time.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["Reached", "StandIn", "Stub", "Absent", "LastHidden", "own_forward", "hidden_of", "has_state"]


class Reached(BaseException):  # noqa: N818 - a signal, not an error: a BaseException passes `except Exception`
    """Raised by the stub of the target layer: the positional and keyword arguments the model gave it."""

    def __init__(self, positional: tuple[Any, ...], keywords: dict[str, Any]) -> None:
        super().__init__()
        self.positional = positional
        self.keywords = keywords


def hidden_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The hidden states in a decoder layer call: the first positional argument, or ``hidden_states=``."""
    return args[0] if args else kwargs["hidden_states"]


class Stub:
    """Decoder layer ``index`` in a stand-in: passes the hidden states on, or stops the forward.

    Attribute reads go to the real layer (some base models read ``layer.attention_type``).

    Args:
        layer: the real decoder layer.
        index: its position in the stack.
        target: the layer whose call raises :class:`Reached` (None: none does).
        last: hidden states that the last layer returns in place of its input (None: its input).
        seen: where each call's ``(index, args, kwargs)`` is recorded (None: not recorded).
    """

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        target: int | None,
        last: tuple[int, Tensor] | None = None,
        seen: list[tuple[int, tuple[Any, ...], dict[str, Any]]] | None = None,
    ) -> None:
        # Underscored: any other attribute read is the real layer's.
        self.__dict__.update(_layer=layer, _index=index, _target=target, _last=last, _seen=seen)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_layer"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        index, last = self._index, self._last
        if self._seen is not None:
            self._seen.append((index, args, kwargs))
        if index == self._target:
            raise Reached(args, kwargs)
        if last is not None and index == last[0]:
            return last[1]
        return hidden_of(args, kwargs)


def has_state(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) holds a parameter or a buffer."""
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _on_meta(module: nn.Module) -> nn.Module:
    """A shallow clone of ``module`` whose parameters and buffers are meta tensors (no data, no device)."""
    clone = copy.copy(module)
    clone.__dict__["_parameters"] = {k: None if v is None else v.to("meta") for k, v in module._parameters.items()}
    clone.__dict__["_buffers"] = {k: None if v is None else v.to("meta") for k, v in module._buffers.items()}
    clone.__dict__["_modules"] = {k: None if c is None else _on_meta(c) for k, c in module._modules.items()}
    return clone


class Absent:
    """Stands in for a module of another pipeline layer: returns zeros shaped like its output.

    The shape and dtype come from running a meta-device clone of the module, so nothing is
    read from (or written to) the module's own tensors. Attribute reads go to the module.

    Args:
        module: the module.
        shapes: remembers the output's structure per input signature (shared between calls).
    """

    def __init__(self, module: nn.Module, shapes: dict[Any, Any]) -> None:
        self.__dict__.update(_module=module, _shapes=shapes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        module, shapes = self._module, self._shapes
        key = (
            id(module),
            len(args),
            tuple(kwargs),
            tuple((t.shape, t.dtype) for t in tensors),
            tuple(p.dtype for p in module.parameters()),
        )
        if key not in shapes:
            meta = tree_map(lambda t: t.to("meta") if isinstance(t, Tensor) else t, (args, kwargs))
            out_leaves, spec = tree_flatten(_on_meta(module)(*meta[0], **meta[1]))
            shapes[key] = ([(t.shape, t.dtype) if isinstance(t, Tensor) else t for t in out_leaves], spec)
        out, spec = shapes[key]
        made = [torch.zeros(o[0], dtype=o[1], device=device) if isinstance(o, tuple) else o for o in out]
        return tree_unflatten(made, spec)


class StandIn:
    """The base model (or the causal LM) with some attributes replaced (see the module docstring)."""

    def __init__(self, model: nn.Module, replaced: Mapping[str, Any]) -> None:
        self.__dict__.update(replaced)
        self.__dict__["_model"] = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_model"], name)


class LastHidden:
    """What a stand-in base model returns to the causal LM's forward: the given hidden states.

    Other output fields (cache, attentions, router logits) read as None.
    """

    def __init__(self, hidden: Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state

    def __getattr__(self, name: str) -> None:
        return None


_UNWRAPPED: dict[type, Callable[..., Any]] = {}


def own_forward(module: nn.Module) -> Callable[..., Any]:
    """``type(module).forward`` without its decorators (they keep state keyed by the real module)."""
    cls = type(module)
    if cls not in _UNWRAPPED:
        _UNWRAPPED[cls] = inspect.unwrap(cls.forward)
    return _UNWRAPPED[cls]
