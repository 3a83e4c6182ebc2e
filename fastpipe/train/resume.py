"""Saving and resuming a ``fastpipe train`` run so that the loss curve continues exactly.

A save folder holds::

    DIR/model-000120.pt   fastpipe.save: parameters (the Sequential's keys), AdamW state by
                          parameter name, the caller's RNG state (the Pipe's dropout seeds)
    DIR/run.pt            the commit record: step, history, configuration, which model file

Both are written atomically (temporary file, fsync, rename) and ``run.pt`` goes last: a run
killed at any moment leaves ``run.pt`` naming a complete model file, the previous one or the
new one. Older model files are removed only after the new record is in place. Nothing else
needs saving: the data of step ``n`` and the learning rate are functions of ``n``.

Under torchrun every rank calls :func:`save_run` and :func:`load_run`: ``fastpipe.save``
gathers the stages to rank 0, which writes both files, and every rank reads them back, so
the folder must be one that every host sees. The run reads and writes its saves through
:func:`has_run`, :func:`save_run` and :func:`load_run` alone.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any

import torch
from torch import nn

import fastpipe
from fastpipe.serialization import atomic_write

__all__ = ["RUN_FORMAT", "check_compatible", "has_run", "load_run", "save_run"]

RUN_FORMAT = "fastpipe-train/1"
_RECORD = "run.pt"


def has_run(folder: str) -> bool:
    """Whether ``folder`` holds a completed save (its commit record)."""
    return os.path.exists(os.path.join(folder, _RECORD))


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
    DistributedPipe call it on every rank: the model file is gathered to the pipeline's rank 0,
    and only the ``writer`` (that rank) writes the record and removes the older model files.
    """
    os.makedirs(folder, exist_ok=True)
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

    For a DistributedPipe every rank reads the files and takes its own stages' share.

    Raises:
        FileNotFoundError: ``folder`` holds no completed save.
        ValueError: the record is not a ``fastpipe train`` save.
    """
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
