"""A training loop's checkpoints: save every few steps, resume from the newest complete one.

::

    resumed = fastpipe.resume_or_start(ROOT, pipe, opt, state={"losses": []})
    for step in range(resumed["step"], total):
        ...                                            # one optimizer step
        if (step + 1) % every == 0:
            fastpipe.save_checkpoint(ROOT, pipe, opt, step + 1, state={"losses": losses})

``save_checkpoint`` writes ``ROOT/step-000120`` through :mod:`fastpipe.checkpoint.dcp` (each rank its
shard, then the commit record) and then removes all but the ``keep`` newest complete
checkpoints. ``resume_or_start`` loads the newest complete checkpoint whose files match
their record. One that does not is skipped with a warning naming the file, and the one
before it is tried. With no checkpoint it returns step 0 and the given state. Call both on
every rank of a ``DistributedPipe``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpipe.checkpoint import dcp
from fastpipe.checkpoint.commit import CheckpointCorruptError, complete_checkpoints, prune, step_dir

__all__ = ["save_checkpoint", "resume_or_start"]


def _is_root(group: Any) -> bool:
    return group is None or dist.get_rank(group) == 0


def save_checkpoint(
    root: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    *,
    state: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    keep: int = 3,
    asynchronous: bool = False,
    timeout: float = dcp.DEFAULT_TIMEOUT,
) -> str | dcp.PendingSave:
    """Write the checkpoint of ``step`` under ``root``, then keep only the ``keep`` newest complete ones.

    Older checkpoints are removed (by rank 0) only after the new record is in place, so a
    kill at any moment leaves the previous checkpoint loadable. With ``asynchronous`` the
    call returns once the tensors are copied (a :class:`~fastpipe.checkpoint.dcp.PendingSave`; the
    pruning follows the record in the background); otherwise it returns the folder.
    """
    if keep < 1:
        raise ValueError(f"fastpipe.save_checkpoint: keep must be at least 1, got {keep}")
    folder = step_dir(root, step)
    group = dcp.checkpoint_group(module, None, timeout)

    def after_commit() -> None:
        if _is_root(group):
            prune(root, keep)

    kwargs: dict[str, Any] = {"step": step, "state": state, "settings": settings, "timeout": timeout}
    if asynchronous:
        return dcp.async_save(module, folder, optimizer, after_commit=after_commit, **kwargs)
    dcp.save(module, folder, optimizer, **kwargs)
    after_commit()
    return folder


def resume_or_start(
    root: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    state: dict[str, Any] | None = None,
    restore_rng: bool = True,
    strict: bool = True,
    timeout: float = dcp.DEFAULT_TIMEOUT,
) -> dict[str, Any]:
    """Load the newest complete, intact checkpoint under ``root``; or start fresh.

    Returns ``{"step", "state", "settings", "folder"}``: the saved step and caller's state,
    or ``0``, ``state`` (default ``{}``) and None when ``root`` holds no usable checkpoint.
    A checkpoint whose files fail their sizes or checksums is skipped with a warning that
    names the file, and the previous complete one is loaded instead. ``strict`` (see
    :func:`fastpipe.checkpoint.dcp.load`): a checkpoint of another model raises instead of loading
    the keys both hold.

    Raises:
        CheckpointKeyError: with ``strict``, the newest intact checkpoint's keys are not the model's.
        CheckpointError: DCP could not read it (a tensor of another shape, say).
    """
    group = dcp.checkpoint_group(module, None, timeout)
    dcp.wait_pending(group)  # its collectives would interleave with the listing's broadcast
    folders = complete_checkpoints(root) if _is_root(group) else []
    if group is not None:  # one listing for all ranks, so they try the same folders in order
        box: list[Any] = [folders]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        folders = box[0]
    for folder in folders:
        try:
            record = dcp.load(folder, module, optimizer, restore_rng=restore_rng, strict=strict, timeout=timeout)
        except CheckpointCorruptError as exc:
            warnings.warn(f"{exc}; resuming from the previous complete checkpoint instead", stacklevel=2)
            continue
        return {"step": record["step"], "state": record["state"], "settings": record["settings"], "folder": folder}
    return {"step": 0, "state": {} if state is None else state, "settings": None, "folder": None}
