"""Commit records: a sharded checkpoint folder counts only once its record is in place.

A run's checkpoints live in one root folder, one sub-folder per step::

    ROOT/step-000120/__0_0.distcp   rank 0's shard (torch.distributed.checkpoint)
    ROOT/step-000120/__1_0.distcp   rank 1's shard
    ROOT/step-000120/.metadata      DCP's index of the shards
    ROOT/step-000120/commit.pt      the commit record, written last

The record holds the step, the settings, the caller's state (data position, loss history),
every rank's RNG state, and the size and CRC-32 of every file of the folder. It is written
by one rank after all ranks finished writing their shards, atomically (temporary file,
fsync, rename), so a folder without a readable record is a save that did not finish and is
never loaded. :func:`verify` compares the files with the record before a load: a truncated
shard or one whose bytes changed is refused with :class:`CheckpointCorruptError`, naming
the file.

A save holds :class:`SaveLock` on what it writes (a step folder, a one-file checkpoint)
from its first byte to its record, so that two saves racing into one place cannot mix
their files: the second one raises instead of writing.

This module only reads and writes files; the ranks' coordination is :mod:`fastpipe.checkpoint.dcp`'s.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import tempfile
import warnings
import zlib
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

__all__ = [
    "RECORD",
    "RECORD_FORMAT",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointKeyError",
    "SaveLock",
    "LOCK",
    "atomic_write",
    "step_dir",
    "checksum",
    "file_entries",
    "write_record",
    "read_record",
    "complete_checkpoints",
    "latest",
    "verify",
    "remove_record",
    "prune",
]

RECORD = "commit.pt"
RECORD_FORMAT = "fastpipe-commit/1"
LOCK = ".lock"  # a step folder's SaveLock
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}  # flock where the file system has none
_STEP = re.compile(r"^step-(\d+)$")
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message leads with the cause.

    An ``Exception`` (``torch.distributed.checkpoint``'s own ``CheckpointException`` is a
    ``BaseException``, which ``except Exception`` misses); the original is its ``__cause__``.
    """


class CheckpointCorruptError(CheckpointError, ValueError):
    """A file of a committed checkpoint is missing, truncated, or its checksum fails.

    Attributes:
        path: the file.
        reason: what is wrong with it.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"fastpipe: checkpoint file {path} is {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.path, self.reason)


class CheckpointKeyError(CheckpointError, KeyError):
    """A checkpoint's keys and the module's differ: some are missing from it, or it holds others."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else ""


class SaveLock:
    """An exclusive lock on ``path`` (created if need be), taken at once or not at all.

    ``flock`` on an open file: the operating system drops it when the holder dies, so a save
    killed mid-write never leaves a stale lock behind for the restarted job.

    A file system without locks (Lustre mounted ``noflock``, say) gets a warning that the
    save goes unprotected, rather than no saves at all.

    Raises:
        CheckpointError: another save (another process, or another thread) holds it.
    """

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        self._fd: int | None = None
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(
                f"fastpipe: another save is writing {what} right now (it holds the lock {path}), so this "
                "save wrote nothing; save to another step or path, or wait for that save to finish"
            ) from None
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            warnings.warn(
                f"fastpipe: the file system of {path} cannot lock files ({exc}), so nothing stops a second "
                f"save racing into {what} from mixing its files with this one's",
                stacklevel=3,
            )
            os.close(fd)
            return
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Lets the next save in; a second call does nothing."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> SaveLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _fsync_directory(directory: str) -> None:
    """Makes a rename in ``directory`` durable; some file systems cannot fsync a directory."""
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


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
    _fsync_directory(directory)


def step_dir(root: str, step: int) -> str:
    """The folder of ``step``'s checkpoint under ``root``: ``ROOT/step-000120``."""
    return os.path.join(root, f"step-{step:06d}")


def checksum(path: str) -> tuple[int, int]:
    """``(size in bytes, CRC-32)`` of a file, read in 8 MiB pieces."""
    crc = 0
    size = 0
    with open(path, "rb") as f:
        while piece := f.read(_CHUNK):
            crc = zlib.crc32(piece, crc)
            size += len(piece)
    return size, crc


def file_entries(folder: str, names: Iterable[str]) -> dict[str, tuple[int, int]]:
    """The size and CRC-32 of each named file of ``folder``."""
    return {name: checksum(os.path.join(folder, name)) for name in names}


def write_record(folder: str, record: dict[str, Any]) -> None:
    """Writes ``folder``'s commit record atomically; from then on the checkpoint counts."""
    atomic_write({**record, "format": RECORD_FORMAT}, os.path.join(folder, RECORD))


def read_record(folder: str) -> dict[str, Any] | None:
    """The commit record of ``folder``, or None where there is none (an unfinished save).

    A record that cannot be read (the record is written atomically, so only damage to the
    disk does this) counts as none, with a warning naming it.
    """
    path = os.path.join(folder, RECORD)
    if not os.path.exists(path):
        return None
    try:
        record = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any failure to read makes the folder incomplete
        warnings.warn(f"fastpipe: cannot read the commit record {path} ({exc}); skipping that checkpoint", stacklevel=2)
        return None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        warnings.warn(f"fastpipe: {path} is not a fastpipe commit record; skipping that checkpoint", stacklevel=2)
        return None
    return record


def _step_folders(root: str) -> list[tuple[int, str]]:
    """Every ``step-N`` folder of ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) if (m := _STEP.match(n))]
    return sorted((f for f in found if os.path.isdir(f[1])), reverse=True)


def complete_checkpoints(root: str) -> list[str]:
    """The folders of ``root`` that hold a commit record, newest step first."""
    return [folder for _, folder in _step_folders(root) if read_record(folder) is not None]


def latest(root: str) -> str | None:
    """The newest complete checkpoint folder under ``root``, or None."""
    done = complete_checkpoints(root)
    return done[0] if done else None


def verify(folder: str, record: dict[str, Any], names: Iterable[str] | None = None) -> None:
    """Checks ``folder``'s files (or the ``names`` among them) against the record's sizes and CRC-32s.

    Raises:
        CheckpointCorruptError: naming the first file that is missing, has another size,
            or whose checksum differs.
    """
    files: dict[str, tuple[int, int]] = record["files"]
    for name in sorted(files) if names is None else names:
        path = os.path.join(folder, name)
        size, crc = files[name]
        if not os.path.exists(path):
            raise CheckpointCorruptError(path, "missing")
        actual = os.path.getsize(path)
        if actual != size:
            raise CheckpointCorruptError(path, f"truncated or resized: {actual} bytes, the commit record says {size}")
        if checksum(path)[1] != crc:
            raise CheckpointCorruptError(path, "corrupt: its CRC-32 differs from the commit record's")


def remove_record(folder: str) -> None:
    """Makes ``folder`` incomplete before its files are rewritten or removed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(folder, RECORD))


def prune(root: str, keep: int) -> list[str]:
    """Removes all but the ``keep`` newest complete checkpoints, and unfinished saves older than those.

    Folders newer than the newest complete checkpoint are left alone. Each folder loses its
    record first, so that one whose removal is cut short reads as unfinished, never as a
    complete checkpoint with files missing. Returns the removed folders.
    """
    if keep < 1:
        raise ValueError(f"fastpipe: keep must be at least 1, got {keep}")
    folders = _step_folders(root)
    complete = [(step, f) for step, f in folders if read_record(f) is not None]
    if len(complete) <= keep:
        oldest_kept = complete[-1][0] if complete else None
    else:
        oldest_kept = complete[keep - 1][0]
    if oldest_kept is None:
        return []
    removed = []
    for step, folder in folders:
        if step < oldest_kept:
            remove_record(folder)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
