"""Fault injection for the checkpoint tests: this process SIGKILLs itself at a chosen point of its next save.

Call one of these in a spawned rank before the save that should die; it patches the code
that the save runs through (DCP's file writer, or the checksums before the commit record),
so the product code carries no kill switch.
"""

from __future__ import annotations

import os
import signal
from typing import Any

__all__ = ["die_after_writing_the_shard", "die_before_the_record"]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_after_writing_the_shard() -> None:
    """The next DCP save dies once this rank's shard is written: before DCP's index and the commit record exist."""
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
        real(self, plan, planner)
        _die()

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


def die_before_the_record() -> None:
    """The next DCP save dies once DCP has finished (shards and index written), before this rank's checksums."""
    from fastpipe.checkpoint import dcp

    def die(*args: Any, **kwargs: Any) -> Any:
        _die()

    dcp.file_entries = die  # type: ignore[assignment]
