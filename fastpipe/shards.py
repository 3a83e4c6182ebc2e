"""This rank's share of a sharded checkpoint, as the flat dict that ``torch.distributed.checkpoint`` writes.

Keys are the Sequential's names, so that any layout of the same model reads them back::

    model.<name>                        a parameter or buffer ("model.3.0.weight")
    optim.state.<name>.<key>            its optimizer state ("optim.state.3.0.weight.exp_avg")
    optim.param_groups.<name>.<key>     its group's hyper-parameters ("...3.0.weight.lr")

A tensor that several layers share is saved once, under the name of its first use (its
owner's): the plain model's later keys of one tensor, and a ``DistributedPipe`` rank's copy
of a tensor that an earlier stage owns, are aliases of that name.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch
from torch import Tensor, nn

from fastpipe.distributed_pipe import DistributedPipe

__all__ = ["aliases", "owned_params", "share", "unflatten", "rng_state", "set_rng_state"]


def aliases(module: nn.Module) -> dict[str, str]:
    """Keys of ``module``'s state dict that are saved under another (tied) key: {key: owner's key}."""
    saved_as: dict[str, str] = {}
    first: dict[int, str] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, Tensor):
            saved_as[key] = first.setdefault(id(tensor), key)
    if isinstance(module, DistributedPipe):
        for tie in module.ties:  # this rank's copy of a tensor that an earlier stage owns
            if tie.reader_name in saved_as and tie.name not in saved_as:
                saved_as[tie.reader_name] = tie.name
    return {k: v for k, v in saved_as.items() if k != v}


def owned_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """{this module's parameter name: the name it is saved under} for the optimizer's parameters."""
    names = {id(p): n for n, p in module.named_parameters()}
    tied = aliases(module)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("fastpipe.dcp: the optimizer holds a parameter that is not in the module")
            out[names[id(p)]] = tied.get(names[id(p)], names[id(p)])
    return out


def share(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's share, flat, under the Sequential's names; each tied tensor only at its owner."""
    tied = aliases(module)
    out: dict[str, Any] = {f"model.{k}": v for k, v in module.state_dict().items() if k not in tied}
    if optimizer is None:
        return out
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    saved = optimizer.state_dict()
    params = dict(module.named_parameters())
    for name, key in owned_params(module, optimizer).items():
        if key != name:
            continue  # the owner's rank saves it
        i = index[id(params[name])]
        for k, v in saved["state"].get(i, {}).items():
            out[f"optim.state.{name}.{k}"] = v
        group = next(g for g in saved["param_groups"] if i in g["params"])
        for k, v in group.items():
            if k != "params":
                out[f"optim.param_groups.{name}.{k}"] = v
    return out


def rng_state() -> dict[str, Any]:
    """This process's generators: torch's CPU one, CUDA's (once initialised), Python's and NumPy's (once imported)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Sets the generators that :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])


def unflatten(loaded: dict[str, Any], keys: dict[str, str], owned: dict[str, str]) -> dict[str, Any]:
    """The name-keyed optimizer state that :func:`fastpipe.serialization._load_optimizer` takes.

    Args:
        loaded: the DCP keys read back.
        keys: {DCP key: the parameter of this module it belongs to}.
        owned: {parameter name: the name it was saved under} (:func:`owned_params`).
    """
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, name in keys.items():
        saved_as = owned[name]
        if key.startswith(f"optim.state.{saved_as}."):
            state.setdefault(name, {})[key[len(f"optim.state.{saved_as}.") :]] = loaded[key]
        else:
            hyper.setdefault(name, {})[key[len(f"optim.param_groups.{saved_as}.") :]] = loaded[key]
    return {"state": state, "param_groups": [{**h, "params": [n]} for n, h in hyper.items()]}
