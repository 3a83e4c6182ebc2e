"""Checking a Pipe's arguments and cutting a Sequential into stages."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fastpipe.runtime.device import normalize
from fastpipe.schedule.builders import STAGES_PER_WORKER
from fastpipe.schedule.placement import round_robin, v_shape
from fastpipe.step.microbatch import Value, check_value, tensors_of

__all__ = [
    "Device",
    "stage_devices",
    "MOVE_REFUSED",
    "layers_of",
    "tied_blocks",
    "check_module",
    "check_materialised",
    "check_balance",
    "resolve_devices",
    "split",
    "first_layer_in_place",
    "check_input",
    "refuse_device_move",
    "refuse_move",
    "refuse_process_group",
    "warn_unpipelined",
]

Device = str | int | torch.device

MOVE_REFUSED = (
    "fastpipe.Pipe places each stage on its own device (devices=...), so it cannot be moved as a whole. "
    "Move the nn.Sequential before wrapping it, or build a new Pipe with other devices; dtype changes "
    "(.to(torch.float64), .double(), .half()) are allowed."
)


def layers_of(module: nn.Sequential) -> list[tuple[str, nn.Module]]:
    """Every layer of ``module`` with its name, in order, a layer used twice included twice.

    ``named_children()``/``children()`` (like ``parameters()``) skip an object already seen,
    so in ``nn.Sequential(shared, act, shared)`` the second ``shared`` would vanish and the
    layer count would no longer match ``len(module)``. ``Sequential.forward`` and
    ``state_dict()`` see every entry; so must anything that cuts or registers layers.
    """
    return list(module._modules.items())


def tied_blocks(module: nn.Sequential) -> list[int]:
    """Sizes of the runs of layers that must share a stage, in order (summing to ``len(module)``).

    Layers ``i < j`` that reach one parameter or buffer (a layer used twice, a shared weight or
    submodule) tie every layer from ``i`` to ``j`` into one run, since stages are contiguous.
    Untied layers are runs of one. A planner that cuts only between runs never splits a tie.
    """
    last: dict[int, int] = {}
    first: dict[int, int] = {}
    for index, (_, layer) in enumerate(layers_of(module)):
        for obj in [*layer.parameters(), *layer.buffers()]:  # state ties; a shared stateless module does not
            first.setdefault(id(obj), index)
            last[id(obj)] = index
    reach = list(range(len(module)))  # reach[i]: the furthest layer tied to one at or before i
    for key, i in first.items():
        reach[i] = max(reach[i], last[key])
    sizes, start, end = [], 0, -1
    for i in range(len(module)):
        end = max(end, reach[i])
        if i == end:
            sizes.append(i + 1 - start)
            start = i + 1
    return sizes


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


def check_materialised(module: nn.Module, prefix: str = "") -> None:
    """Raise ``ValueError`` if a parameter or buffer of ``module`` is on the meta device."""
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in items:
            if tensor.is_meta:
                raise ValueError(
                    f"fastpipe: the model's {kind} '{prefix}{name}' is on the meta device (a shape without data), "
                    "so its stage cannot be placed. Materialise the model first: model.to_empty(device='cpu'), "
                    "then initialise it (reset_parameters() or load_state_dict); under torchrun, "
                    "DistributedPipe.from_stage_builder builds each rank's stages on meta and materialises them"
                )


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
    """One device per stage. ``None`` means one visible GPU per stage, else CPU for all.

    A longer list is accepted and its first ``num_stages`` entries used (torchgpipe does the
    same, so code that passes every visible GPU keeps working). CUDA devices are checked
    against ``torch.cuda`` here, so a missing GPU is named now rather than by torch's error
    at the first copy.
    """
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
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Iterable):
        raise TypeError(f"fastpipe: devices must be a list with one device per stage, got {devices!r}")
    devices = list(devices)
    if len(devices) < num_stages:
        raise ValueError(
            f"fastpipe: {len(devices)} devices for {num_stages} stages (len(balance)); give at least one device "
            "per stage (repeat a device to put several stages on it)"
        )
    out = [_device(d, i) for i, d in enumerate(devices[:num_stages])]
    for kind in sorted({d.type for d in out} - {"cpu", "meta"}):
        _check_accelerator(kind, out, list(devices[:num_stages]))
    return out


def _device(d: object, i: int) -> torch.device:
    if isinstance(d, bool) or not isinstance(d, (str, int, torch.device)):
        raise TypeError(f"fastpipe: devices[{i}] = {d!r} is not a device; give e.g. 'cuda:0', 'cpu' or 0")
    try:
        dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    except RuntimeError as exc:
        raise ValueError(
            f"fastpipe: devices[{i}] = {d!r} is not a device name ({exc}); give e.g. 'cuda:0' or 'cpu'"
        ) from None
    if dev.index is None and dev.type not in ("cpu", "meta") and not _seen(dev.type)[0]:
        return torch.device(dev.type, 0)  # named as missing by _check_accelerator
    # An explicit index everywhere: autograd's engine asserts on a bare accelerator type.
    return normalize(dev)


def _seen(kind: str) -> tuple[bool, int]:
    """``torch.<kind>.is_available()`` and its device count (0 when unavailable).

    A device type without such a module (a custom one) counts as available, its
    indices unchecked: torch raises its own errors there.
    """
    module: Any = getattr(torch, kind, None)
    is_available = getattr(module, "is_available", None)
    device_count = getattr(module, "device_count", None)
    if not callable(is_available) or not callable(device_count):
        return True, 1 << 30
    available = bool(is_available())
    return available, int(device_count()) if available else 0


def _check_accelerator(kind: str, devices: list[torch.device], asked: list[object]) -> None:
    """Name the devices of type ``kind`` that ``torch.<kind>`` does not see."""
    available, count = _seen(kind)
    missing = sorted({d.index for d in devices if d.type == kind and (d.index is None or d.index >= count)})
    if not missing:
        return
    seen = f"torch.{kind}.is_available() is {available} and torch.{kind}.device_count() is {count}" + (
        " (this torch is a CPU-only build)" if kind == "cuda" and not torch.version.cuda else ""
    )
    raise ValueError(
        f"fastpipe: devices={asked!r} asks for {', '.join(f'{kind}:{i}' for i in missing)}, but {seen}. "
        + (
            "Use devices=['cpu'] * len(balance) (or devices=None) on this host, or run where the GPUs are visible"
            if count == 0
            else f"Use indices 0..{count - 1} (entries may repeat)"
            + (" or check CUDA_VISIBLE_DEVICES" if kind == "cuda" else "")
        )
    )


def split(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``module`` into contiguous stages, refusing objects shared across stages.

    A layer used twice (or any parameter, buffer or submodule reached from two layers) is a
    tied weight; a reused module without parameters or buffers (an activation) is not.
    Within one stage a tied weight works as in the Sequential: both uses run, and the shared
    parameter's gradient is the sum of both. Across stages it would be updated from two
    devices and two threads at once, so it is refused, naming both uses and a balance that
    puts them in one stage.
    """
    layers = layers_of(module)
    stages: list[nn.Sequential] = []
    owner: dict[int, tuple[int, int, str]] = {}  # id -> (stage, layer index, name)
    start = 0
    for s, count in enumerate(balance):
        for index in range(start, start + count):
            layer_name, layer = layers[index]
            for kind, items in (
                ("module", layer.named_modules(remove_duplicate=False)),
                ("parameter", layer.named_parameters(remove_duplicate=False)),
                ("buffer", layer.named_buffers(remove_duplicate=False)),
            ):
                for name, obj in items:
                    if obj is None or (isinstance(obj, nn.Module) and not _has_state(obj)):
                        continue  # a stateless module (an activation reused) runs anywhere
                    full = f"{layer_name}.{name}" if name else layer_name
                    seen = owner.setdefault(id(obj), (s, index, full))
                    if seen[0] != s:
                        raise ValueError(_tied_across_stages(kind, (s, index, full), seen, list(balance)))
        stages.append(nn.Sequential(OrderedDict(layers[start : start + count])))
        start += count
    return stages


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _tied_across_stages(kind: str, use: tuple[int, int, str], first: tuple[int, int, str], balance: list[int]) -> str:
    (stage, index, name), (first_stage, first_index, first_name) = use, first
    merged = balance[:first_stage] + [sum(balance[first_stage : stage + 1])] + balance[stage + 1 :]
    return (
        f"fastpipe: {kind} '{name}' (layer {index}, stage {stage}) is the same object as '{first_name}' "
        f"(layer {first_index}, stage {first_stage}). A {kind} used in two places is a tied weight, and a tied "
        f"weight cannot span stages: each stage runs on its own device and thread. Put both uses in one stage "
        f"through balance (e.g. balance={merged}), or untie them (give each use its own copy)"
    )


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


def check_input(input: Value) -> None:
    """A tensor or tuple with data; tensors on another device than stage 0's are copied there."""
    check_value(input, "input")
    for i, t in enumerate(tensors_of(input)):
        if t.is_meta:
            raise ValueError(
                f"fastpipe: input tensor {i} is on the meta device (a shape without data); pass a "
                "tensor with data (any device: it is copied to the first stage's)"
            )


def refuse_device_move(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` if ``module.to(*args, **kwargs)`` would move a module to a device."""
    # The obvious spellings are caught before torch's parser (which raises its own error for
    # an index on a host without that accelerator); the parser then sees every other form
    # nn.Module.to accepts (device and dtype together, non_blocking, ...).
    moves = (
        kwargs.get("device") is not None
        or "tensor" in kwargs
        or any(isinstance(a, (str, int, torch.device, torch.Tensor)) and not isinstance(a, bool) for a in args)
    )
    if moves or torch._C._nn._parse_to(*args, **kwargs)[0] is not None:

        def show(v: Any) -> str:
            return f"<tensor on {v.device}>" if isinstance(v, torch.Tensor) else repr(v)

        call = ", ".join([*map(show, args), *(f"{k}={show(v)}" for k, v in kwargs.items())])
        raise TypeError(f"{MOVE_REFUSED} (got .to({call}))")


def refuse_move(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A Pipe's ``.cuda()``, ``.cpu()`` and other whole-module moves: always ``TypeError``."""
    raise TypeError(MOVE_REFUSED)


def refuse_process_group(process_group: Any, mesh: Any) -> None:
    """Raise ``TypeError`` when a Pipe (one process) is given a process group or a mesh."""
    if process_group is not None or mesh is not None:
        raise TypeError(
            "fastpipe: Pipe runs every stage in this process; for one stage per process over torch.distributed "
            "(torchrun), build fastpipe.DistributedPipe(model, balance, chunks=..., process_group=...) "
            "(or mesh=...) on every rank instead"
        )


def stage_devices(devices: Sequence[Any] | None, stages: int, schedule: object, virtual_stages: int) -> Any:
    """``devices`` as one entry per stage, for :func:`fastpipe.model.partition.resolve_devices`.

    With several stages per worker (``virtual_stages > 1``) a list of one device per worker
    (``stages // virtual_stages`` entries) is spread by the schedule's placement: a V puts stages
    ``w`` and ``2K-1-w`` on device ``w``, round robin stage ``s`` on device ``s % K``. ``None``
    then means one visible GPU per worker (CPU without GPUs). Any other list is per stage.
    """
    if virtual_stages < 1 or stages % virtual_stages:
        return devices  # refused with its own message by pipe_schedule
    workers = stages // virtual_stages
    if virtual_stages == 1:
        return devices
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or count >= stages:
            return devices
        devices = [torch.device("cuda", i) for i in range(workers)]
    if isinstance(devices, (str, int, torch.device)) or len(list(devices)) != workers:
        return devices
    key = schedule.lower().replace("_", "-") if isinstance(schedule, str) else schedule
    placement = v_shape(workers) if key in STAGES_PER_WORKER else round_robin(stages, workers)
    per_worker = list(devices)
    return [per_worker[w] for w in placement]


def warn_unpipelined(chunks: int, stages: int, workers: int) -> None:
    """Warn that ``chunks=1`` on several workers runs the stages one after another, never at once."""
    if chunks == 1 and workers > 1:
        warnings.warn(
            f"fastpipe: chunks=1 sends the whole mini-batch through the {stages} stages one after another, so "
            f"one stage works at a time; pass chunks=M micro-batches to overlap them, e.g. chunks={4 * stages} "
            "(4 per stage: the bubble is (K-1)/(M+K-1) of a step for K stages)",
            stacklevel=3,
        )
