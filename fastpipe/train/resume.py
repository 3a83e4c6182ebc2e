"""Saving and resuming a ``fastpipe train`` run so that the loss curve continues exactly.

A save folder holds::

    DIR/model-000120.pt   fastpipe.save: parameters (the Sequential's keys), AdamW state by
                          parameter name, the caller's RNG state (the Pipe's dropout seeds)
    DIR/run.pt            the commit record: step, history, configuration, which model file

Both are written atomically (temporary file, fsync, rename) and ``run.pt`` goes last: a run
killed at any moment leaves ``run.pt`` naming a complete model file, the previous one or the
new one. Older model files are removed only after the new record is in place. Nothing else
needs saving: the data of step ``n`` and the learning rate are functions of ``n``.

Under torchrun every rank calls :func:`save_run` and :func:`load_run`, and a
:class:`~fastpipe.DistributedPipe` saves sharded instead (:mod:`fastpipe.checkpoints`):
``DIR/step-000120/`` holds each rank's shard and, written last, the commit record with
the files' sizes and checksums; the two newest complete ones are kept, and a resume skips
one whose files fail their record (with a warning naming the file) for the one before.
No rank gathers another's share. The folder must be one that every host sees. The run
reads and writes its saves through :func:`has_run`, :func:`save_run` and :func:`load_run`
alone.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any

import torch
from torch import nn

import fastpipe
from fastpipe.checkpoints import resume_or_start, save_checkpoint
from fastpipe.commit import latest
from fastpipe.distributed_pipe import DistributedPipe
from fastpipe.serialization import atomic_write

__all__ = ["RUN_FORMAT", "check_compatible", "has_run", "load_run", "save_run"]

RUN_FORMAT = "fastpipe-train/1"
_RECORD = "run.pt"
_KEEP = 2  # sharded checkpoints kept: the newest, and one to fall back on if it is damaged


def has_run(folder: str) -> bool:
    """Whether ``folder`` holds a completed save (its commit record, one-file or sharded)."""
    return os.path.exists(os.path.join(folder, _RECORD)) or latest(folder) is not None


def save_run(
    folder: str,
    pipe: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    record: dict[str, Any],
    *,
    writer: bool = True,
) -> str:
    """Writes the state after ``step`` optimizer steps; returns the model file's path.

    ``record`` (history, configuration) is stored beside ``step`` in the commit record. For a
    DistributedPipe call it on every rank: each writes its shard of ``DIR/step-NNNNNN`` and
    the folder's path is returned (``writer`` is then unused); otherwise only the ``writer``
    writes the record and removes the older model files.
    """
    os.makedirs(folder, exist_ok=True)
    if isinstance(pipe, DistributedPipe):
        saved = save_checkpoint(
            folder,
            pipe,
            optimizer,
            step,
            state={**record, "format": RUN_FORMAT},
            settings=record.get("settings"),
            keep=_KEEP,
        )
        assert isinstance(saved, str)
        return saved
    name = f"model-{step:06d}.pt"
    fastpipe.save(pipe, os.path.join(folder, name), optimizer=optimizer)
    if not writer:
        return os.path.join(folder, name)
    atomic_write({**record, "format": RUN_FORMAT, "step": step, "model_file": name}, os.path.join(folder, _RECORD))
    for old in glob.glob(os.path.join(folder, "model-*.pt")):
        if os.path.basename(old) != name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)
    return os.path.join(folder, name)


def load_run(folder: str, pipe: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restores model, optimizer and RNG state from ``folder``; returns the commit record.

    For a DistributedPipe every rank takes its own stages' share: of the newest intact
    sharded checkpoint, or else of a one-file save.

    Raises:
        FileNotFoundError: ``folder`` holds no completed save.
        ValueError: the record is not a ``fastpipe train`` save.
    """
    if isinstance(pipe, DistributedPipe) and latest(folder) is not None:
        resumed = resume_or_start(folder, pipe, optimizer)
        if resumed["folder"] is None:
            raise FileNotFoundError(f"--resume {folder}: no intact checkpoint there (see the warnings above)")
        state = resumed["state"]
        if not isinstance(state, dict) or state.get("format") != RUN_FORMAT:
            raise ValueError(f"--resume {resumed['folder']}: not a fastpipe train checkpoint")
        return {**state, "step": resumed["step"]}
    path = os.path.join(folder, _RECORD)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume {folder}: no {_RECORD} there (was it written by fastpipe train --save?)")
    record = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(record, dict) or record.get("format") != RUN_FORMAT:
        raise ValueError(f"--resume {folder}: {_RECORD} is not a fastpipe train record")
    fastpipe.load(os.path.join(folder, record["model_file"]), pipe, optimizer=optimizer, restore_rng=True)
    return record


def check_compatible(saved: dict[str, Any], now: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Refuses to resume with settings that would change the loss curve.

    Raises:
        ValueError: naming each differing setting with both values.
    """
    diffs = [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]
    if diffs:
        raise ValueError(
            "--resume: the run was saved with other settings, which would change its loss curve ("
            + "; ".join(diffs)
            + "); pass the saved values"
        )
