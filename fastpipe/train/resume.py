"""Saving and resuming a ``fastpipe train`` run so that the loss curve continues exactly.

A save folder holds::

    DIR/model-000120.pt   parameters (the Sequential's keys), AdamW state by parameter name,
                          the caller's RNG state (the Pipe's dropout seeds); fastpipe.save's format
    DIR/model-000100.pt   the save before it, to fall back on
    DIR/run.pt            the commit record: for each of the two, its step, history,
                          configuration, model file and that file's size and CRC-32

Both are written atomically (temporary file, fsync, rename) and ``run.pt`` goes last, under
an exclusive lock (``DIR/.run.pt.lock``: a second run saving into DIR raises): a run killed
at any moment leaves ``run.pt`` naming complete model files. Older model files are removed
only after the new record is in place. A resume checks the newest model file against its
size and CRC-32; one that fails is named in a warning and the save before it is loaded
instead; with neither intact it raises :class:`~fastpipe.checkpoint.commit.CheckpointCorruptError`.
A ``run.pt`` without checksums (an earlier fastpipe's) loads with a warning that its model
file cannot be verified. Nothing else needs saving: the data of step ``n`` and the
learning rate are functions of ``n``.

Under torchrun every rank calls :func:`save_run` and :func:`load_run`, and a
:class:`~fastpipe.DistributedPipe` saves sharded instead (:mod:`fastpipe.checkpoint.loop`):
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
import warnings
from typing import Any

import torch
from torch import nn

from fastpipe.checkpoint.commit import CheckpointCorruptError, SaveLock, atomic_write, file_entries, latest, verify
from fastpipe.checkpoint.loop import resume_or_start, save_checkpoint
from fastpipe.checkpoint.serialization import load_file, write_file
from fastpipe.distributed_pipe import DistributedPipe

__all__ = ["RUN_FORMAT", "check_compatible", "has_run", "load_run", "save_run"]

RUN_FORMAT = "fastpipe-train/1"
_RECORD = "run.pt"
_LOCK = ".run.pt.lock"
_KEEP = 2  # saves kept: the newest, and one to fall back on if it is damaged


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
    writes the model file and the record and removes the older model files.

    Raises:
        CheckpointError: another run is saving into ``folder`` (this save wrote nothing).
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
    if not writer:
        return os.path.join(folder, name)
    with SaveLock(os.path.join(folder, _LOCK), folder):
        try:
            earlier = _saves(folder)
        except ValueError:  # unreadable (CheckpointCorruptError), or not a train record: it vouches for nothing
            earlier = []
        write_file(pipe, os.path.join(folder, name), optimizer)
        entry = {**record, "step": step, "model_file": name, "files": file_entries(folder, [name])}
        saves = [entry, *(e for e in earlier if e["model_file"] != name)][:_KEEP]
        atomic_write({"format": RUN_FORMAT, "saves": saves}, os.path.join(folder, _RECORD))
        kept = {e["model_file"] for e in saves}
        for old in glob.glob(os.path.join(folder, "model-*.pt")):
            if os.path.basename(old) not in kept:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old)
    return os.path.join(folder, name)


def _saves(folder: str) -> list[dict[str, Any]]:
    """The saves ``run.pt`` records, newest first; [] where there is no ``run.pt``.

    Raises:
        CheckpointCorruptError: ``run.pt`` cannot be read.
        ValueError: it is not a ``fastpipe train`` record.
    """
    path = os.path.join(folder, _RECORD)
    if not os.path.exists(path):
        return []
    try:
        record = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any failure to read it is damage
        raise CheckpointCorruptError(path, f"unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(record, dict) or record.get("format") != RUN_FORMAT:
        raise ValueError(f"--resume {folder}: {_RECORD} is not a fastpipe train record")
    # A record without "saves" is an earlier fastpipe's: one save, with no checksums.
    return list(record["saves"]) if "saves" in record else [record]


def load_run(folder: str, pipe: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restores model, optimizer and RNG state from ``folder``; returns the commit record.

    For a DistributedPipe every rank takes its own stages' share: of the newest intact
    sharded checkpoint, or else of a one-file save.

    Raises:
        FileNotFoundError: ``folder`` holds no completed save.
        ValueError: the record is not a ``fastpipe train`` save.
        CheckpointCorruptError: no model file that the record lists is intact.
    """
    if isinstance(pipe, DistributedPipe) and latest(folder) is not None:
        resumed = resume_or_start(folder, pipe, optimizer)
        if resumed["folder"] is None:
            raise FileNotFoundError(f"--resume {folder}: no intact checkpoint there (see the warnings above)")
        state = resumed["state"]
        if not isinstance(state, dict) or state.get("format") != RUN_FORMAT:
            raise ValueError(f"--resume {resumed['folder']}: not a fastpipe train checkpoint")
        return {**state, "step": resumed["step"]}
    saves = _saves(folder)
    if not saves:
        raise FileNotFoundError(f"--resume {folder}: no {_RECORD} there (was it written by fastpipe train --save?)")
    failed: list[CheckpointCorruptError] = []
    for save in saves:
        model_file = os.path.join(folder, save["model_file"])
        if "files" not in save:
            warnings.warn(
                f"--resume {folder}: {_RECORD} records no checksums (an earlier fastpipe wrote it), so "
                f"{model_file} cannot be verified; the next save records them",
                stacklevel=2,
            )
        else:
            try:
                verify(folder, save)
            except CheckpointCorruptError as exc:
                failed.append(exc)
                continue
        if failed:
            warnings.warn(
                f"{'; '.join(map(str, failed))}; resuming from the save before it instead, {model_file} "
                f"(step {save['step']})",
                stacklevel=2,
            )
        load_file(model_file, pipe, optimizer, restore_rng=True)
        return save
    first = failed[0]
    others = "; ".join(str(e) for e in failed[1:]) or "no earlier save is kept"
    raise CheckpointCorruptError(first.path, f"{first.reason}, and no earlier save in {folder} is intact ({others})")


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
