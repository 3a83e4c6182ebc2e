"""Checkpoints that outlive the topology: one file keyed like the original ``nn.Sequential``.

``save(pipe, path, optimizer)`` writes the model's ``state_dict`` (the Sequential's keys),
the optimizer's state keyed by parameter *name* instead of position, and the caller's
RNG state. A distributed pipe gathers every stage's share to the pipeline group's rank 0,
which writes the file. ``load(path, into, optimizer)`` fills a :class:`fastpipe.Pipe`
with any balance, a :class:`~fastpipe.distributed_pipe.DistributedPipe` (each rank takes
its own keys) or the plain Sequential; by default every key must match.

A save writes three names beside each other::

    ckpt.pt          the newest checkpoint (a ``torch.save`` dict)
    ckpt.pt.prev     the one before it, to fall back on (``keep=2``, the default)
    ckpt.pt.commit   the commit record: the size and CRC-32 of both, written last

Each file is written atomically (a temporary file, fsync'ed, renamed into place), under
an exclusive lock (``.ckpt.pt.lock``), so a racing second save raises instead of mixing
its files with the first one's. ``load`` checks the file against the record and, where
it fails (damaged, or a save that died before its record), loads ``ckpt.pt.prev`` with a
warning naming the bad file; with neither intact it raises
:class:`~fastpipe.checkpoint.commit.CheckpointCorruptError`. A file without a record (written by an
earlier fastpipe, or copied alone) loads with a warning that it cannot be verified.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastpipe.checkpoint.commit import CheckpointCorruptError, CheckpointError, SaveLock, atomic_write, checksum
from fastpipe.checkpoint.shards import check_keys
from fastpipe.distributed.ranks import gather_objects
from fastpipe.distributed.watchdog import bounded_barrier
from fastpipe.distributed_pipe import DistributedPipe

__all__ = ["save", "load", "write_file", "load_file", "atomic_write", "FORMAT", "PREVIOUS", "FILE_RECORD"]

FORMAT = "fastpipe-checkpoint/1"
PREVIOUS = ".prev"  # suffix of the kept previous checkpoint
FILE_RECORD = ".commit"  # suffix of the commit record
_RECORD_FORMAT = "fastpipe-file-commit/1"


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


def _share(pipe: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    return {
        "model": _cpu(pipe.state_dict()),
        "optimizer": None if optimizer is None else _named_optimizer_state(pipe, optimizer),
    }


def _extra(pipe: nn.Module) -> dict[str, Any]:
    return {"format": FORMAT, "rng": torch.get_rng_state(), "balance": list(getattr(pipe, "balance", []) or [])}


def _fingerprint(path: str) -> tuple[int, int, int]:
    """Which file this is (a rename keeps it): inode, size and modification time."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _read_file_record(path: str) -> list[dict[str, Any]] | None:
    """The entries of ``path``'s commit record, newest first; None where it has none."""
    record = path + FILE_RECORD
    if not os.path.exists(record):
        return None
    try:
        saved = torch.load(record, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - an unreadable record vouches for nothing
        raise CheckpointCorruptError(record, f"unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(saved, dict) or saved.get("format") != _RECORD_FORMAT:
        raise CheckpointCorruptError(record, "not a fastpipe commit record")
    return list(saved["files"])


def _committed(path: str, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The record's entry of the file now at ``path``, if the record vouches for that very file."""
    if entries is None or not os.path.exists(path):
        return None
    here = _fingerprint(path)
    return next((e for e in entries if tuple(e["stat"]) == here), None)


def _commit_file(payload: dict[str, Any], path: str, keep: int) -> None:
    """Writes ``payload`` to ``path`` with its record, keeping the previous checkpoint; under the lock.

    The record is written last and names the files by content, so a kill at any point leaves
    a file that matches the record: the previous one, or (once the record is in place) the new.
    """
    path = os.path.abspath(path)
    previous = path + PREVIOUS
    lock = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")
    with SaveLock(lock, path):
        try:
            entries = _read_file_record(path)
        except CheckpointCorruptError:
            entries = None  # a damaged record vouches for nothing: no file is kept as the previous
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.writing")
        kept: list[dict[str, Any]] = []
        try:
            atomic_write(payload, tmp)
            size, crc = checksum(tmp)
            new = {"name": os.path.basename(path), "size": size, "crc": crc, "stat": _fingerprint(tmp)}
            if keep > 1 and (entry := _committed(path, entries)) is not None:
                os.replace(path, previous)
                kept = [{**entry, "name": os.path.basename(previous)}]
            elif keep > 1 and (entry := _committed(previous, entries)) is not None:
                kept = [entry]  # the file at path never got its record: it is replaced, the previous stays
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        atomic_write({"format": _RECORD_FORMAT, "files": [new, *kept]}, path + FILE_RECORD)
        if not kept:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(previous)  # not vouched for by the record: never a fallback


def write_file(pipe: nn.Module, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Writes a whole module's checkpoint to ``path`` atomically, with no record: for callers that keep their own.

    ``fastpipe train`` records its model files' sizes and CRC-32s in its own ``run.pt``.
    """
    if _is_distributed(pipe):
        raise TypeError(
            "fastpipe: write_file takes a module that this process holds whole; save a DistributedPipe "
            "with fastpipe.save"
        )
    atomic_write({**_extra(pipe), **_merge([_share(pipe, optimizer)])}, path)


def save(pipe: nn.Module, path: str, optimizer: torch.optim.Optimizer | None = None, *, keep: int = 2) -> None:
    """Write ``pipe``'s parameters and buffers (and ``optimizer``'s state) to ``path``, with its commit record.

    ``pipe`` is a :class:`fastpipe.Pipe`, a ``DistributedPipe`` or any module (e.g. the
    plain Sequential). For a ``DistributedPipe`` call it on every rank: shares are
    gathered to the pipeline group's rank 0 (of data-parallel replica 0), which writes the
    file; the call returns on every pipeline rank once the file is in place. ``keep=2``
    keeps the checkpoint that was at ``path`` as ``path + ".prev"`` to fall back on;
    ``keep=1`` keeps none.

    Raises:
        CheckpointError: another save is writing ``path`` (nothing is written), or the
            writing rank failed (on the other ranks).
    """
    _check_arguments("save", pipe, "pipe", path, optimizer, "save(pipe, path, optimizer=None)")
    if keep not in (1, 2):
        raise ValueError(
            f"fastpipe.save: keep must be 1 (no previous checkpoint) or 2 (one to fall back on), got {keep}"
        )
    share = _share(pipe, optimizer)
    extra = _extra(pipe)
    if not _is_distributed(pipe):
        _commit_file({**extra, **_merge([share])}, str(path), keep)
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
            _commit_file({**extra, **_merge(shares)}, str(path), keep)
        except BaseException as exc:
            status[0] = f"{type(exc).__name__}: {exc}"
            dist.broadcast_object_list(status, src=root, group=group)
            raise
    dist.broadcast_object_list(status, src=root, group=group)
    if status[0] is not None:
        raise CheckpointError(f"fastpipe.save: rank {root} could not write {path}: {status[0]}")


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


def _verified(path: str) -> str:
    """The newest of ``path`` and its previous checkpoint that matches the commit record; warns on a fallback."""
    entries = _read_file_record(path)
    if entries is None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"fastpipe.load: there is no checkpoint at {path}")
        warnings.warn(
            f"fastpipe.load: {path} has no commit record ({os.path.basename(path)}{FILE_RECORD}: written by an "
            "earlier fastpipe, or copied without it), so its bytes cannot be verified; save it again to record them",
            stacklevel=3,
        )
        return path
    vouched = {(e["size"], e["crc"]) for e in entries}
    problems: list[tuple[str, str]] = []
    for candidate in (path, path + PREVIOUS):
        if not os.path.exists(candidate):
            problems.append((candidate, "missing"))
        elif checksum(candidate) not in vouched:
            problems.append((candidate, "corrupt: its size or CRC-32 differs from the commit record's"))
        else:
            if problems:
                bad = "; ".join(f"checkpoint file {p} is {why}" for p, why in problems)
                warnings.warn(
                    f"fastpipe.load: {bad}; loading the previous checkpoint {candidate} instead", stacklevel=3
                )
            return candidate
    (first, why), (_, why_previous) = problems
    raise CheckpointCorruptError(first, f"{why}, and the previous checkpoint {first}{PREVIOUS} is {why_previous}")


def load_file(
    path: str,
    into: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = False,
    strict: bool = True,
) -> dict[str, Any]:
    """:func:`load` of the file ``path`` itself, without the commit record's check (the caller made its own)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"fastpipe.load: {path} is not a fastpipe checkpoint")
    model: dict[str, Tensor] = ckpt["model"]
    mine = into.state_dict().keys()
    if strict:
        expected = set(mine)
        if _is_distributed(into):  # the checkpoint must fit the whole model, held by every rank together
            pipe = cast(Any, into)
            ranks = gather_objects(sorted(mine), pipe.runtime.control_group, f"fastpipe.load({path!r})", pipe.timeout)
            expected = {k for keys in ranks for k in keys}
        check_keys(expected, model.keys(), f"fastpipe.load: {path}")
    into.load_state_dict({k: model[k] for k in mine if k in model}, strict=False)
    if optimizer is not None:
        if ckpt["optimizer"] is None:
            raise ValueError(f"fastpipe.load: {path} holds no optimizer state")
        _load_optimizer(into, optimizer, ckpt["optimizer"])
    if restore_rng:
        torch.set_rng_state(ckpt["rng"])
    return ckpt


def load(
    path: str,
    into: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = False,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``into`` (and ``optimizer``).

    ``into`` may have another balance than the saved pipe, be a ``DistributedPipe`` (call
    it on every rank: each reads the file and takes its own stages' keys) or the plain
    ``nn.Sequential``. The file is first checked against its commit record; where it fails,
    the previous checkpoint (``path + ".prev"``) is loaded with a warning. ``strict``: the
    checkpoint's keys must be the model's, neither more nor fewer; ``strict=False`` loads
    the keys both hold and leaves the others as they are. ``restore_rng`` sets the caller's
    CPU generator to the saved one, so a resumed run draws the same dropout masks as the
    original. Returns the checkpoint dict.

    Raises:
        CheckpointCorruptError: neither the file nor the previous one matches the record.
        CheckpointKeyError: with ``strict``, keys missing from the checkpoint or not in the model.
    """
    _check_arguments("load", into, "into", path, optimizer, "load(path, into, optimizer=None)")
    return load_file(_verified(str(path)), into, optimizer, restore_rng=restore_rng, strict=strict)
