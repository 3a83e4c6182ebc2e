"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank writes its own share.

``save(pipe, folder, optimizer, step=...)`` on every rank of a :class:`~fastpipe.DistributedPipe`
writes that rank's parameters, buffers and optimizer state, keyed by the Sequential's names, into
``folder``; no rank gathers another's share. ``load(folder, into, optimizer)`` reads the keys
``into`` holds, so the folder loads into any balance, any number of ranks, a local
:class:`~fastpipe.Pipe` or the plain ``nn.Sequential`` (in one process, without a process group).
The keys inside DCP are :mod:`fastpipe.checkpoint.shards`'s; a tensor that several layers share
(a tied embedding) is saved once, by its owner.

Stages sharded over their replicas (``dp_shard="fsdp"``) hold ``DTensor`` shards of their
parameters and of the optimizer state (Adam's moments). Each rank writes its own rows, which
DCP's index places in the global tensor, so nothing is gathered; an entry the replicas hold
alike (a whole tensor of ``dp_shard="replicate"``, Adam's ``step``) is written by one of them.
A load reads into the layout of ``into``: shards read only their rows, whole tensors the whole,
so a checkpoint loads into any number of pipeline ranks and replicas, sharded or not.

After the shards, rank 0 writes the commit record (:mod:`fastpipe.checkpoint.commit`) once every
rank has checksummed its files: the step, the settings, the caller's ``state`` and every rank's
RNG state. ``async_save`` costs the caller only the copy of its tensors to host memory; writing,
checksums and the record follow in a background thread, on a gloo group of the checkpoint's own,
so they never interleave with the training's collectives. Rank 0 holds the folder's
:class:`~fastpipe.checkpoint.commit.SaveLock` until the record is written, so a racing second
save raises and writes nothing. DCP's failures raise as
:class:`~fastpipe.checkpoint.commit.CheckpointError`, each rank's cause first.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from fastpipe.checkpoint.commit import (
    LOCK,
    CheckpointCorruptError,
    CheckpointError,
    SaveLock,
    file_entries,
    read_record,
    remove_record,
    verify,
    write_record,
)
from fastpipe.checkpoint.dcp_io import quiet_warnings as _quiet
from fastpipe.checkpoint.dcp_io import torch_dcp as _dcp
from fastpipe.checkpoint.dcp_io import wrapped_errors as _wrapped
from fastpipe.checkpoint.dcp_io import writer as _writer
from fastpipe.checkpoint.serialization import _load_optimizer
from fastpipe.checkpoint.shards import (
    aliases,
    check_keys,
    optimizer_slots,
    owned_params,
    rng_state,
    set_rng_state,
    share,
    unflatten,
)
from fastpipe.distributed.settle import settle_at_exit
from fastpipe.distributed_pipe import DistributedPipe

__all__ = [
    "save",
    "async_save",
    "load",
    "PendingSave",
    "checkpoint_group",
    "wait_pending",
    "DEFAULT_TIMEOUT",
]

DEFAULT_TIMEOUT = 600.0
_METADATA = ".metadata"
_GROUPS: dict[tuple[tuple[int, ...], float], Any] = {}
_PENDING: dict[tuple[int, ...], PendingSave] = {}


def checkpoint_group(module: nn.Module, process_group: Any, timeout: float) -> Any:
    """The checkpoint's own gloo group over the ranks that save ``module``; None in one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if process_group is not None:
        ranks = tuple(dist.get_process_group_ranks(process_group))
    elif isinstance(module, DistributedPipe):
        # With data parallelism every replica takes part: DCP writes an entry the replicas hold
        # alike once, and each shard of dp_shard="fsdp" by its rank.
        group = module.group if module.dp_group is None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group))
    else:
        return None  # a whole module in this process: it writes alone
    if (ranks, timeout) not in _GROUPS:
        settle_at_exit()
        _GROUPS[ranks, timeout] = dist.new_group(
            list(ranks), backend="gloo", timeout=datetime.timedelta(seconds=timeout), use_local_synchronization=True
        )
    return _GROUPS[ranks, timeout]


def _settings(module: nn.Module, group: Any, settings: dict[str, Any] | None) -> dict[str, Any]:
    base = {"ranks": 1 if group is None else dist.get_world_size(group), "kind": type(module).__name__}
    balance = getattr(module, "balance", None)
    if balance:
        base["balance"] = list(balance)
    return {**base, **(settings or {})}


def _commit(folder: str, group: Any, record: dict[str, Any], rng: dict[str, Any]) -> None:
    """Checksums this rank's files, then rank 0 writes the record once every rank has; raises on every rank."""
    rank = 0 if group is None else dist.get_rank(group)
    mine = sorted(n for n in os.listdir(folder) if n.startswith(f"__{rank}_"))
    if rank == 0:
        mine.append(_METADATA)
    share = {"files": file_entries(folder, mine), "rng": rng, "rank": dist.get_rank() if group is not None else 0}
    shares: list[Any] = [share]
    if group is not None:
        shares = [None] * dist.get_world_size(group) if rank == 0 else []
        dist.gather_object(share, shares if rank == 0 else None, dst=dist.get_global_rank(group, 0), group=group)
    status: list[Any] = [None]
    if rank == 0:
        try:
            files = {name: entry for s in shares for name, entry in s["files"].items()}
            write_record(folder, {**record, "files": files, "rng": {s["rank"]: s["rng"] for s in shares}})
        except Exception as exc:  # noqa: BLE001 - every rank must learn it
            status[0] = f"{type(exc).__name__}: {exc}"
    if group is not None:
        dist.broadcast_object_list(status, src=dist.get_global_rank(group, 0), group=group)
    if status[0] is not None:
        raise CheckpointError(f"fastpipe.checkpoint.dcp: could not write the commit record of {folder}: {status[0]}")


def _lock(folder: str, group: Any) -> contextlib.ExitStack:
    """Rank 0 takes the folder's lock (closing the stack lets it go) and removes its record; all raise if it failed."""
    lock = contextlib.ExitStack()
    status: list[Any] = [None]
    os.makedirs(folder, exist_ok=True)
    if group is None or dist.get_rank(group) == 0:
        try:
            lock.enter_context(SaveLock(os.path.join(folder, LOCK), folder))
            remove_record(folder)  # a folder that is written again stops counting first
        except Exception as exc:  # noqa: BLE001 - every rank must learn it
            lock.close()
            status[0] = (
                exc
                if isinstance(exc, CheckpointError)
                else CheckpointError(f"fastpipe.checkpoint.dcp: {folder}: {exc}")
            )
    if group is not None:  # no rank writes before this: the second of two racing saves writes nothing
        dist.broadcast_object_list(status, src=dist.get_global_rank(group, 0), group=group)
    if status[0] is not None:
        raise status[0]
    return lock


def _start(
    module: nn.Module,
    folder: str,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    state: dict[str, Any] | None,
    settings: dict[str, Any] | None,
    process_group: Any,
    timeout: float,
    asynchronous: bool,
) -> tuple[Any, contextlib.ExitStack, Any, dict[str, Any], dict[str, Any]]:
    """Writes (or stages) this rank's share; returns the group, the lock (:func:`_lock`; the caller
    lets it go after the record), DCP's result, the record and the RNG state."""
    group = checkpoint_group(module, process_group, timeout)
    wait_pending(group)
    lock = _lock(folder, group)
    try:
        rng = rng_state()
        write = _dcp().async_save if asynchronous else _dcp().save
        with _quiet(group), _wrapped(f"could not save {folder}"):
            result = write(
                share(module, optimizer), storage_writer=_writer(folder), process_group=group, no_dist=group is None
            )
        # A copy: the loop goes on appending to its loss history while an asynchronous save is written.
        record = copy.deepcopy({"step": step, "state": state or {}, "settings": _settings(module, group, settings)})
        record["time"] = time.time()
    except BaseException:
        lock.close()
        raise
    return group, lock, result, record, rng


def save(
    module: nn.Module,
    folder: str,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    state: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> None:
    """Write ``module``'s share (and ``optimizer``'s) into ``folder``, then its commit record.

    Call it on every rank of a ``DistributedPipe`` (with data parallelism, every rank of
    the default group); a ``Pipe`` or any other module is saved by this process alone.
    ``state`` (picklable: step counters, loss history, data position) and ``settings`` go
    into the record; pass the same on every rank (rank 0's are kept). ``timeout`` bounds
    every wait on another rank: a rank that dies mid-save makes the others raise within it,
    and the folder stays without a record. Returns when the record is in place.

    Raises:
        CheckpointError: another save is writing ``folder`` (this one wrote nothing), or writing failed.
    """
    group, lock, _, record, rng = _start(
        module, folder, optimizer, step, state, settings, process_group, timeout, False
    )
    with lock:
        _commit(folder, group, record, rng)


class PendingSave:
    """An :func:`async_save` under way: its shards, checksums and record are written in the background."""

    def __init__(
        self, folder: str, future: Future[None], key: tuple[int, ...] = (), thread: threading.Thread | None = None
    ) -> None:
        self.folder = folder
        self._future = future
        self._key = key
        self._thread = thread

    def done(self) -> bool:
        """The save finished (or failed)."""
        return self._future.done()

    def wait(self) -> str:
        """Blocks until the record is in place; returns the folder, or raises the save's error (no later save does)."""
        try:
            self._future.result()
            if self._thread is not None:
                # The thread still frees the save's tensors after it set the result: a process
                # that ended meanwhile would kill it inside a destructor (std::terminate).
                self._thread.join()
        finally:
            if _PENDING.get(self._key) is self:
                del _PENDING[self._key]
        return self.folder


def wait_pending(group: Any) -> None:
    """Waits for the :func:`async_save` on ``group`` that is still writing, if any."""
    pending = _PENDING.pop(_key(group), None)
    if pending is not None:
        pending.wait()


def _key(group: Any) -> tuple[int, ...]:
    return () if group is None else tuple(dist.get_process_group_ranks(group))


def async_save(
    module: nn.Module,
    folder: str,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    state: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    after_commit: Callable[[], None] | None = None,
) -> PendingSave:
    """:func:`save` that returns once this rank's tensors are copied to host memory.

    DCP writes the copies from a background thread; then the checksums and the record follow
    in the same order as in :func:`save`, and ``after_commit`` runs on every rank (pruning,
    say). The training may change its tensors at once. The next save or load on these ranks
    waits for this one first, so at most one is in flight.
    """
    group, lock, upload, record, rng = _start(
        module, folder, optimizer, step, state, settings, process_group, timeout, True
    )
    done: Future[None] = Future()

    def finish() -> None:
        try:
            with lock, _wrapped(f"could not save {folder}"):
                cast(Future, upload).result()
                _commit(folder, group, record, rng)
            if after_commit is not None:
                after_commit()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            done.set_exception(exc)
        else:
            done.set_result(None)

    thread = threading.Thread(target=finish, name="fastpipe-dcp-commit", daemon=True)
    thread.start()
    pending = PendingSave(folder, done, _key(group), thread)
    _PENDING[_key(group)] = pending
    return pending


def _verify_shared(folder: str, record: dict[str, Any], group: Any) -> None:
    """Every rank checks a share of the files; all raise the same error, naming the file."""
    names = sorted(record["files"])
    if group is None:
        verify(folder, record)
        return
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    error: tuple[str, str] | None = None
    try:
        verify(folder, record, names[rank::size])
    except CheckpointCorruptError as exc:
        error = (exc.path, exc.reason)
    errors: list[Any] = [None] * size
    dist.all_gather_object(errors, error, group=group)
    bad = [e for e in errors if e is not None]
    if bad:
        raise CheckpointCorruptError(*bad[0])


def load(
    folder: str,
    into: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    check: bool = True,
    strict: bool = True,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> dict[str, Any]:
    """Load a committed checkpoint folder into ``into`` (and ``optimizer``); returns its record.

    ``into`` is a ``DistributedPipe`` with any balance and number of ranks (call it on every
    rank), a local ``Pipe`` or the plain module. With ``check``, the files are first
    compared with the record's sizes and CRC-32s (split among the ranks). ``strict``: the
    checkpoint's model keys must be the whole model's (all ranks' together), neither more
    nor fewer; ``strict=False`` loads the keys both hold. ``restore_rng`` sets this rank's
    generators (torch, CUDA, Python, NumPy) to those the same rank saved, or rank 0's
    where the checkpoint had fewer ranks.

    Raises:
        FileNotFoundError: ``folder`` has no commit record (the save did not finish).
        CheckpointCorruptError: a file is missing, truncated or corrupt (with ``check``).
        CheckpointKeyError: with ``strict``, the checkpoint's keys are not the model's.
        CheckpointError: DCP could not read it (a shape that differs, say), leading with the cause.
    """
    group = checkpoint_group(into, process_group, timeout)
    wait_pending(group)
    record = read_record(folder)
    if record is None:
        raise FileNotFoundError(
            f"fastpipe.checkpoint.dcp: {folder} holds no commit record (an unfinished save, or none)"
        )
    if check:
        _verify_shared(folder, record, group)
    metadata = _dcp().FileSystemReader(folder).read_metadata().state_dict_metadata
    tied = aliases(into)
    model = into.state_dict()
    if strict:  # over the whole model: every rank's keys together, so all ranks raise alike
        saved = [k.removeprefix("model.") for k in metadata if k.startswith("model.")]
        check_keys({tied.get(k, k) for k in model}, saved, f"fastpipe.checkpoint.dcp: {folder}", group)
    else:
        model = {k: v for k, v in model.items() if f"model.{tied.get(k, k)}" in metadata}
    wanted: dict[str, Any] = {f"model.{tied.get(k, k)}": v for k, v in model.items()}
    optim_keys = {} if optimizer is None else optimizer_slots(into, optimizer, metadata)
    wanted.update({key: slot for key, (_, slot) in optim_keys.items()})
    with _quiet(group), _wrapped(f"could not load {folder}"):
        _dcp().load(wanted, checkpoint_id=folder, process_group=group, no_dist=group is None)
    into.load_state_dict({k: wanted[f"model.{tied.get(k, k)}"] for k in model}, strict=False)
    if optimizer is not None:
        names = {key: name for key, (name, _) in optim_keys.items()}
        _load_optimizer(into, optimizer, unflatten(wanted, names, owned_params(into, optimizer)))
    if restore_rng:
        rngs = record["rng"]
        me = 0 if group is None else dist.get_rank()
        if me not in rngs:
            warnings.warn(
                f"fastpipe.checkpoint.dcp: {folder} holds no RNG state of rank {me}; using rank 0's", stacklevel=2
            )
        set_rng_state(rngs.get(me, rngs[min(rngs)]))
    return record
