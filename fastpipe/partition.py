"""Checking a Pipe's arguments and cutting a Sequential into stages."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["Device", "check_module", "check_balance", "resolve_devices", "split", "first_layer_in_place"]

Device = str | int | torch.device


def check_module(module: object) -> nn.Sequential:
    """Return ``module`` if it is an ``nn.Sequential``; raise ``TypeError`` otherwise."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"fastpipe.Pipe takes an nn.Sequential, got {type(module).__name__}. Express the model as "
            "nn.Sequential(layer1, layer2, ...) so it can be cut into stages."
        )
    if len(module) == 0:
        raise ValueError("fastpipe.Pipe got an empty nn.Sequential; it needs at least one layer")
    return module


def check_balance(balance: object, num_layers: int) -> list[int]:
    """Validate ``balance`` (layers per stage) against a model of ``num_layers`` layers."""
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"fastpipe: balance must be a list of layer counts per stage, e.g. [2, 2]; got {balance!r}")
    out = list(balance)
    if not out:
        raise ValueError("fastpipe: balance is empty; give at least one stage, e.g. balance=[len(model)]")
    for i, n in enumerate(out):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"fastpipe: balance[{i}] = {n!r} is not an int; balance lists layer counts per stage")
        if n <= 0:
            raise ValueError(f"fastpipe: balance[{i}] = {n}; every stage needs at least one layer")
    if sum(out) != num_layers:
        raise ValueError(
            f"fastpipe: balance {out} sums to {sum(out)} but the Sequential has {num_layers} layers; "
            "the entries must add up to len(module)"
        )
    return out


def resolve_devices(devices: Sequence[Device] | None, num_stages: int) -> list[torch.device]:
    """One device per stage. ``None`` means one visible GPU per stage, else CPU for all."""
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return [torch.device("cpu")] * num_stages
        if count < num_stages:
            raise ValueError(
                f"fastpipe: {num_stages} stages but only {count} visible GPUs; pass devices= explicitly "
                "(entries may repeat, e.g. ['cuda:0', 'cuda:0', ...]) or use fewer stages"
            )
        return [torch.device("cuda", i) for i in range(num_stages)]
    if isinstance(devices, (str, int, torch.device)):
        raise TypeError(f"fastpipe: devices must be a list with one device per stage, got {devices!r}")
    out = []
    for d in devices:
        dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        out.append(dev)
    if len(out) != num_stages:
        raise ValueError(
            f"fastpipe: {len(out)} devices for {num_stages} stages (len(balance)); give exactly one device "
            "per stage (repeat a device to put several stages on it)"
        )
    return out


def split(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``module`` into contiguous stages, refusing parameters shared across stages.

    A parameter, buffer or module used by two stages would be updated from two devices
    and two threads at once, so it is rejected with the names of both uses.
    """
    layers = list(module.named_children())
    stages: list[nn.Sequential] = []
    owner: dict[int, tuple[int, str]] = {}
    start = 0
    for s, count in enumerate(balance):
        chunk = layers[start:start + count]
        start += count
        for layer_name, layer in chunk:
            for kind, items in (
                ("module", layer.named_modules(remove_duplicate=False)),
                ("parameter", layer.named_parameters(remove_duplicate=False)),
                ("buffer", layer.named_buffers(remove_duplicate=False)),
            ):
                for name, obj in items:
                    if obj is None:
                        continue
                    full = f"{layer_name}.{name}" if name else layer_name
                    seen = owner.setdefault(id(obj), (s, full))
                    if seen[0] != s:
                        raise ValueError(
                            f"fastpipe: {kind} '{full}' (stage {s}) is the same object as '{seen[1]}' "
                            f"(stage {seen[0]}); shared {kind}s must sit in one stage: change balance so "
                            "both uses fall in the same stage, or untie them"
                        )
        stages.append(nn.Sequential(OrderedDict(chunk)))
    return stages


def first_layer_in_place(stage: nn.Sequential) -> bool:
    """Whether the stage's first leaf layer writes into its input (e.g. ``ReLU(inplace=True)``).

    Leading layers that return a view of their input (``Flatten``, ``Unflatten``,
    ``Identity``) are looked through: a write into their output lands in the input.
    """
    for layer in _leaves(stage):
        if type(layer) not in (nn.Flatten, nn.Unflatten, nn.Identity):
            return bool(getattr(layer, "inplace", False))
    return False


def _leaves(module: nn.Module) -> Iterator[nn.Module]:
    if isinstance(module, nn.Sequential):
        for child in module:
            yield from _leaves(child)
    else:
        yield module
