"""What a pipeline's ranks must agree on before the first step, checked where a mistake is cheap.

A rank with other settings, another transport or a misplaced GPU would expect other messages
and fail only at the deadline, far from the cause; these checks name the cause at set-up.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastpipe.distributed.watchdog import bounded_barrier
from fastpipe.errors import PipelineError
from fastpipe.schedule.placement import placement_problem, round_robin

__all__ = [
    "check_nccl_device",
    "check_rank_stages",
    "check_same_settings",
    "check_same_transport",
    "gather_objects",
    "order_matched",
    "pipeline_groups",
]


def check_rank_stages(
    placement: Sequence[int] | None, num_stages: int, size: int, rank: int, stages: Iterable[int]
) -> tuple[int, ...]:
    """The pipeline's placement (default round robin), checked, and checked to put ``stages`` on ``rank``.

    Raises:
        ValueError: the placement does not fit ``size`` ranks, or puts one of ``stages`` elsewhere.
    """
    placed = tuple(placement) if placement is not None else round_robin(num_stages, size)
    problem = placement_problem(placed, num_stages, size)
    if problem is not None:
        raise ValueError(f"fastpipe: {problem} (a group of {size} ranks)")
    wrong = [s for s in stages if not 0 <= s < num_stages or placed[s] != rank]
    if wrong:
        here = [s for s, r in enumerate(placed) if r == rank]
        raise ValueError(f"fastpipe: rank {rank} of {size} cannot hold stages {wrong}; the placement puts {here} here")
    return placed


def gather_objects(value: Any, group: Any, what: str, timeout: float) -> list[Any]:
    """Every rank's ``value``, in ``group``'s order; a rank missing for ``timeout`` s raises PipelineError."""
    bounded_barrier(group, timeout, what)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def check_same_settings(settings: dict[str, Any], group: Any, what: str, timeout: float) -> None:
    """Every rank of ``group`` must build the same pipeline: a rank with other settings would
    expect other messages and fail only at the deadline, far from the cause."""
    everyone = gather_objects(settings, group, f"checking the {what} ranks' settings", timeout)
    for key in settings:
        values = [s[key] for s in everyone]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {dist.get_global_rank(group, r)}: {v!r}" for r, v in enumerate(values))
            raise ValueError(
                f"fastpipe: the {what} ranks disagree on {key} ({per_rank}); build the "
                "DistributedPipe with the same arguments on every rank"
            )


def pipeline_groups(process_group: Any, mesh: Any, dp_group: Any) -> tuple[Any, Any]:
    """The pipeline group and the data-parallel group (or None), from groups or a 2-D ``DeviceMesh``.

    Raises:
        PipelineError: no process group is initialised; the message says how to launch the ranks.
    """
    if not (dist.is_available() and dist.is_initialized()):
        by_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # torchrun sets both on every rank
        launch = (
            "torchrun started this process, but"
            if by_torchrun
            else (
                "start every rank with `torchrun --nproc-per-node K script.py` (K pipeline ranks; on several nodes "
                "add --nnodes and --rdzv-endpoint), and"
            )
        )
        raise PipelineError(
            "fastpipe: DistributedPipe runs one pipeline stage per process and needs torch.distributed set up "
            f'first: {launch} call torch.distributed.init_process_group("gloo") for CPU stages, or ("nccl") for '
            "GPUs, before building it. To run every stage in this one process, use fastpipe.Pipe instead"
        )
    if mesh is not None:
        if process_group is not None or dp_group is not None:
            raise ValueError("fastpipe: give either mesh= or process_group=/dp_group=, not both")
        names = tuple(mesh.mesh_dim_names or ())
        if "pp" not in names:
            raise ValueError(f"fastpipe: the DeviceMesh needs a dimension named 'pp' (has {names})")
        return mesh.get_group("pp"), mesh.get_group("dp") if "dp" in names else None
    return (process_group if process_group is not None else dist.group.WORLD), dp_group


def order_matched(backend: str, p2p: str | None) -> bool:
    """Whether payloads must be matched by order: always on NCCL; on request (``p2p="ordered"``) elsewhere.

    The request exists to run the NCCL code path on gloo (tests, dry runs on CPU hosts).
    ``p2p=None`` takes the backend's own way: ordered on NCCL, tags elsewhere.

    Raises:
        ValueError: ``p2p`` is not ``"tags"``, ``"ordered"`` or None, or asks for tags on NCCL.
    """
    if p2p not in (None, "tags", "ordered"):
        raise ValueError(f"fastpipe: p2p must be 'tags', 'ordered' or None (the backend's), got {p2p!r}")
    if backend == "nccl" and p2p == "tags":
        raise ValueError(
            "fastpipe: p2p='tags' cannot work on NCCL, which ignores tags; pass p2p='ordered' or None "
            "(and leave FASTPIPE_P2P unset)"
        )
    return backend == "nccl" or p2p == "ordered"


def check_nccl_device(device: torch.device) -> None:
    """NCCL moves CUDA tensors of the current device only; anything else hangs or fails late."""
    if device.type != "cuda":
        raise ValueError(
            f"fastpipe: an NCCL pipeline group moves CUDA tensors, but this rank's stages are on "
            f"{device}; place them on this rank's GPU, or use a gloo group for CPU stages"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index != torch.cuda.current_device():
        raise ValueError(
            f"fastpipe: this rank's stages are on cuda:{index} but the current CUDA device is "
            f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device({index}) before "
            "building the pipeline (NCCL's batched send/receive hangs otherwise)"
        )


def check_same_transport(ordered: bool, group: Any) -> None:
    """All ranks of ``group`` must match messages the same way (each rank resolves its own ``p2p``).

    Raises:
        ValueError: on every rank, naming each rank's transport.
    """
    modes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(modes, "ordered" if ordered else "tags", group=group)
    if len(set(modes)) > 1:
        per_rank = ", ".join(f"rank {dist.get_global_rank(group, r)}: {m}" for r, m in enumerate(modes))
        raise ValueError(
            f"fastpipe: the pipeline's ranks disagree on the transport ({per_rank}); pass the same "
            "p2p= on every rank (where it is None, FASTPIPE_P2P is read: set it the same, or unset it)"
        )
