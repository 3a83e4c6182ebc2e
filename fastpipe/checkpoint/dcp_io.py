"""DCP's entry points as fastpipe uses them: imported on first use, one writer, errors and warnings translated."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from fastpipe.checkpoint.commit import CheckpointError

__all__ = ["torch_dcp", "writer", "wrapped_errors", "quiet_warnings"]


def torch_dcp() -> Any:
    """``torch.distributed.checkpoint``, imported on first use: it takes seconds, and ``import fastpipe`` should not."""
    import torch.distributed.checkpoint as dcp

    return dcp


def writer(path: str) -> Any:
    """DCP's file writer, one file per rank, fsync'ed."""
    dcp = torch_dcp()
    return dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)


@contextlib.contextmanager
def wrapped_errors(what: str) -> Iterator[None]:
    """DCP's ``CheckpointException`` as a :class:`CheckpointError` that leads with each rank's cause."""
    try:
        yield
    except torch_dcp().api.CheckpointException as exc:
        causes = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items()))
        raise CheckpointError(f"fastpipe.checkpoint.dcp: {what}: {causes or exc}") from exc


@contextlib.contextmanager
def quiet_warnings(group: Any) -> Iterator[None]:
    """DCP's warnings about what is intended here: one process without a group, a folder written again."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint", category=UserWarning)
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
