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
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastpipe.checkpoint.commit import CheckpointKeyError
from fastpipe.distributed_pipe import DistributedPipe

__all__ = [
    "aliases",
    "check_keys",
    "optimizer_slots",
    "owned_params",
    "share",
    "unflatten",
    "rng_state",
    "set_rng_state",
]

_SHOWN = 5  # keys named per kind in a mismatch's message


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


def check_keys(expected: Iterable[str], saved: Iterable[str], where: str, group: Any = None) -> None:
    """A strict load's check: the checkpoint holds exactly the model's keys.

    Args:
        expected: the model's keys; with ``group``, this rank's share of them (a collective:
            call it on every rank of ``group``, which checks against all ranks' keys together).
        saved: the checkpoint's keys.
        where: what the message names first.
        group: the ranks that hold the model together, or None.

    Raises:
        CheckpointKeyError: naming the first few keys missing from the checkpoint and the
            first few it holds that the model lacks, and how many of each.
    """
    expected, saved = set(expected), set(saved)
    if group is not None:
        ranks: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, sorted(expected), group=group)
        expected = {k for keys in ranks for k in keys}
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if not missing and not unexpected:
        return

    def some(keys: list[str]) -> str:
        more = f", and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
        return ", ".join(keys[:_SHOWN]) + more

    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's keys are missing from it ({some(missing)})")
    if unexpected:
        parts.append(f"it holds {len(unexpected)} keys the model lacks ({some(unexpected)})")
    raise CheckpointKeyError(
        f"{where} does not fit the model: {'; '.join(parts)}. Build the model the checkpoint was saved "
        "from, or pass strict=False to load only the keys both hold"
    )


def owned_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """{this module's parameter name: the name it is saved under} for the optimizer's parameters."""
    names = {id(p): n for n, p in module.named_parameters()}
    tied = aliases(module)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("fastpipe.checkpoint.dcp: the optimizer holds a parameter that is not in the module")
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


def optimizer_slots(module: nn.Module, optimizer: torch.optim.Optimizer, metadata: dict[str, Any]) -> dict[str, Any]:
    """{DCP key: (this module's parameter name, an empty tensor to read it into, or None)} of the optimizer's state.

    ``metadata`` is DCP's index of the checkpoint (``state_dict_metadata``); only the keys it
    holds are listed (a parameter that has not stepped yet has no state).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    params = dict(module.named_parameters())
    slots: dict[str, Any] = {}
    for name, saved_as in owned_params(module, optimizer).items():
        for prefix in (f"optim.state.{saved_as}.", f"optim.param_groups.{saved_as}."):
            for key in (k for k in metadata if k.startswith(prefix)):
                entry = metadata[key]
                tensor = isinstance(entry, TensorStorageMetadata)
                slots[key] = (name, _slot(params[name], entry.size, entry.properties.dtype) if tensor else None)
    return slots


def _slot(param: Tensor, size: torch.Size, dtype: torch.dtype) -> Tensor:
    """An empty tensor that DCP reads a state entry of ``param`` into.

    The entry of a sharded parameter (a DTensor of the global shape, such as Adam's moments) is
    read as a DTensor laid out as the parameter: DCP then reads only this rank's rows, whatever
    layout saved them, and the optimizer gets state that matches its parameter. Any other entry
    (``step``, a replicated parameter's) is read whole.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and tuple(size) == tuple(param.shape):
        return torch.empty_like(param, dtype=dtype)
    return torch.empty(size, dtype=dtype)


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
    """The name-keyed optimizer state that :func:`fastpipe.checkpoint.serialization._load_optimizer` takes.

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
