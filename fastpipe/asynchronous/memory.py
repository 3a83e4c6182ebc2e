"""Bytes of weight copies each consistency policy holds per stage, read from the schedule."""

from __future__ import annotations

from typing import Any

from fastpipe.asynchronous.weights import POLICIES
from fastpipe.schedule.multistep import build_multistep, weight_versions

__all__ = ["weight_copy_bytes"]


def weight_copy_bytes(pipe: Any, chunks: int | None = None) -> dict[str, dict[int, int]]:
    """Per policy, per stage: the most bytes of weight copies ``fit`` holds at once in steady state.

    ``stash`` keeps the versions that updates superseded while micro-batches that ran on
    them are in flight (at most K versions with the live one), ``predict`` one predicted copy
    per (mini-batch, version seen) in flight with a lag, ``sync`` and ``stale`` none (see
    :func:`fastpipe.schedule.multistep.weight_versions`). Counted for this process's stages
    (all of them for a :class:`fastpipe.Pipe`); optimizer state is never copied.

    Args:
        pipe: a :class:`fastpipe.Pipe` or :class:`fastpipe.DistributedPipe`.
        chunks: micro-batches per mini-batch; default the pipe's ``chunks``.
    """
    stages: Any = pipe.runtime.stages  # a list (threads) or a dict of this rank's (distributed)
    owned = dict(enumerate(stages)) if isinstance(stages, list) else dict(stages)
    k = len(pipe.balance)
    m = pipe.chunks if chunks is None else chunks
    workers: int = pipe.num_workers
    n = k + 2  # K + 2 mini-batches reach steady state
    while (n * m) % workers:  # the interleaved order needs a multiple of the workers
        n += 1
    versions = weight_versions(build_multistep(k, m, n, flush=False, workers=workers))
    sizes = {s: sum(p.numel() * p.element_size() for p in st.params) for s, st in owned.items()}
    return {policy: {s: versions[policy][s] * sizes[s] for s in owned} for policy in POLICIES}
