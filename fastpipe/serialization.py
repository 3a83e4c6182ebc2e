"""Checkpoints that outlive the topology: one file keyed like the original ``nn.Sequential``.

``save(pipe, path, optimizer)`` writes the model's ``state_dict`` (the Sequential's keys),
the optimizer's state keyed by parameter *name* instead of position, and the caller's
RNG state. A distributed pipe gathers every stage's share to the pipeline group's rank 0,
which writes the file. ``load(path, into, optimizer)`` fills a :class:`fastpipe.Pipe`
with any balance, a :class:`~fastpipe.distributed_pipe.DistributedPipe` (each rank takes
its own keys) or the plain Sequential.

The file is written atomically: a temporary file in the same directory, flushed and
fsync'ed, then renamed over ``path``. A crash or kill mid-write leaves the previous file
(or none) at ``path``, never a truncated one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastpipe.distributed_pipe import DistributedPipe
from fastpipe.runtime.watchdog import bounded_barrier

__all__ = ["save", "load", "atomic_write", "FORMAT"]

FORMAT = "fastpipe-checkpoint/1"


def _is_distributed(module: nn.Module) -> bool:
    return isinstance(module, DistributedPipe)


def _cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _named_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state with parameter names (the Sequential's) in place of positions."""
    names = {id(p): n for n, p in module.named_parameters()}
    sd = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(f"fastpipe.save: optimizer parameters {missing} do not belong to the saved module")
    state = {names[id(params[i])]: _cpu(s) for i, s in sd["state"].items()}
    groups = []
    for group, saved in zip(optimizer.param_groups, sd["param_groups"]):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
    return {"state": state, "param_groups": groups}


def _merge(shares: Iterable[dict[str, Any]]) -> dict[str, Any]:
    model: dict[str, Tensor] = {}
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    has_optimizer = False
    for share in shares:
        model.update(share["model"])
        if share["optimizer"] is not None:
            has_optimizer = True
            state.update(share["optimizer"]["state"])
            groups += share["optimizer"]["param_groups"]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups} if has_optimizer else None}


def atomic_write(obj: Any, path: str) -> None:
    """``torch.save(obj)`` to ``path`` atomically: a crash leaves the old file (or none), never a torn one."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable; some filesystems cannot fsync a directory
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def save(pipe: nn.Module, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``pipe``'s parameters and buffers (and ``optimizer``'s state) to ``path``.

    ``pipe`` is a :class:`fastpipe.Pipe`, a ``DistributedPipe`` or any module (e.g. the
    plain Sequential). For a ``DistributedPipe`` call it on every rank: shares are
    gathered to the pipeline group's rank 0 (of data-parallel replica 0), which writes the
    file; the call returns on every pipeline rank once the file is in place.
    """
    _check_arguments("save", pipe, "pipe", path, optimizer, "save(pipe, path, optimizer=None)")
    share = {
        "model": _cpu(pipe.state_dict()),
        "optimizer": None if optimizer is None else _named_optimizer_state(pipe, optimizer),
    }
    extra = {"format": FORMAT, "rng": torch.get_rng_state(), "balance": list(getattr(pipe, "balance", []) or [])}
    if not _is_distributed(pipe):
        atomic_write({**extra, **_merge([share])}, path)
        return
    # The pipeline's gloo group (the pipeline group itself on gloo, its gloo twin on NCCL):
    # over NCCL the shares would be staged in GPU memory, the root would allocate world x
    # the largest share there, and the bounded barrier could not bound anything.
    group: Any = cast(Any, pipe).runtime.control_group
    dp_group: Any = pipe.dp_group
    root = dist.get_global_rank(group, 0)
    is_root = dist.get_rank(group) == 0
    shares: list[Any] | None = [None] * dist.get_world_size(group) if is_root else None
    bounded_barrier(group, cast(float, pipe.timeout), f"fastpipe.save({path!r})")
    dist.gather_object(share, shares, dst=root, group=group)
    status: list[Any] = [None]
    if is_root and (dp_group is None or dist.get_rank(dp_group) == 0):
        try:
            assert shares is not None
            atomic_write({**extra, **_merge(shares)}, path)
        except BaseException as exc:
            status[0] = f"{type(exc).__name__}: {exc}"
            dist.broadcast_object_list(status, src=root, group=group)
            raise
    dist.broadcast_object_list(status, src=root, group=group)
    if status[0] is not None:
        raise RuntimeError(f"fastpipe.save: rank {root} could not write {path}: {status[0]}")


def _check_arguments(fn: str, module: object, module_arg: str, path: object, optimizer: object, signature: str) -> None:
    """Name the arguments when they are swapped or mistyped, instead of torch's error deep inside."""
    if isinstance(module, (str, os.PathLike)) and isinstance(path, nn.Module):
        raise TypeError(
            f"fastpipe.{fn}: the arguments are swapped: it is fastpipe.{signature}, with the "
            f"module as {module_arg!r} and the file as 'path'"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fastpipe.{fn}: {module_arg} must be the Pipe (or nn.Module) to {fn}, got "
            f"{type(module).__name__}; the call is fastpipe.{signature}"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"fastpipe.{fn}: path must be a file path (str or os.PathLike), got "
            f"{type(path).__name__}; the call is fastpipe.{signature}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"fastpipe.{fn}: optimizer must be a torch.optim.Optimizer (or None), got "
            f"{type(optimizer).__name__}; the call is fastpipe.{signature}"
        )


def _load_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    names = {id(p): n for n, p in module.named_parameters()}
    group_of = {n: g for g in saved["param_groups"] for n in g["params"]}
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group in optimizer.param_groups:
        ids = []
        hyper: dict[str, Any] | None = None
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise ValueError("fastpipe.load: the optimizer holds a parameter that is not in the module")
            if name in saved["state"]:
                state[index] = saved["state"][name]
            if hyper is None and name in group_of:
                hyper = group_of[name]
            ids.append(index)
            index += 1
        source = hyper if hyper is not None else optimizer.state_dict()["param_groups"][len(groups)]
        groups.append({**{k: v for k, v in source.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load(
    path: str, into: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, restore_rng: bool = False
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``into`` (and ``optimizer``).

    ``into`` may have another balance than the saved pipe, be a ``DistributedPipe`` (every
    rank reads the file and takes its own stages' keys) or the plain ``nn.Sequential``.
    ``restore_rng`` sets the caller's CPU generator to the saved one, so a resumed run draws
    the same dropout masks as the original. Returns the checkpoint dict.
    """
    _check_arguments("load", into, "into", path, optimizer, "load(path, into, optimizer=None)")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"fastpipe.load: {path} is not a fastpipe checkpoint")
    model: dict[str, Tensor] = ckpt["model"]
    if _is_distributed(into):
        wanted = into.state_dict().keys()
        missing = [k for k in wanted if k not in model]
        if missing:
            raise KeyError(f"fastpipe.load: the checkpoint lacks {missing}")
        into.load_state_dict({k: model[k] for k in wanted})
    else:
        into.load_state_dict(model)
    if optimizer is not None:
        if ckpt["optimizer"] is None:
            raise ValueError(f"fastpipe.load: {path} holds no optimizer state")
        _load_optimizer(into, optimizer, ckpt["optimizer"])
    if restore_rng:
        torch.set_rng_state(ckpt["rng"])
    return ckpt
