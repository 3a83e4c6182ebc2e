"""Where one process of ``fastpipe train`` sits when ``torchrun`` started it.

``torchrun`` tells each process its place through the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``). :func:`join` starts the process group and cuts the
world into pipelines of ``world / D`` ranks, one stage each (two under ``--schedule
interleaved``), and ``D`` data-parallel replicas of them::

    rank = replica * stages + stage        # a pipeline's ranks are neighbours (one host, usually)

A host with a GPU for each of its processes runs every rank on ``cuda:LOCAL_RANK`` over NCCL
(and gloo for the CPU objects the pipeline exchanges); any other host runs gloo on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Ranks", "join", "leave", "launched_by_torchrun"]

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launched_by_torchrun() -> bool:
    """Whether ``torchrun`` (or another launcher that sets its variables) started this process."""
    return all(name in os.environ for name in _ENV)


@dataclass(frozen=True)
class Ranks:
    """This process's place in the world of ``torchrun`` processes.

    Attributes:
        rank: the global rank.
        world: all processes.
        stages: the ranks of one pipeline (pipeline workers).
        replicas: data-parallel copies of the pipeline.
        device: where this rank's stages live.
        pipeline: the process group of this rank's pipeline.
        replicas_group: the group of this rank's stage in every replica (None without data parallelism).
    """

    rank: int
    world: int
    stages: int
    replicas: int
    device: torch.device
    pipeline: Any
    replicas_group: Any

    @property
    def stage(self) -> int:
        """This rank's place in its pipeline."""
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        """Which data-parallel copy of the pipeline this rank belongs to."""
        return self.rank // self.stages

    @property
    def is_main(self) -> bool:
        """Rank 0: it alone prints, plots and writes files."""
        return self.rank == 0

    def mean_over_replicas(self, loss: Tensor) -> Tensor:
        """The mini-batch loss over every replica's share of the batch (the replicas' mean)."""
        if self.replicas_group is None:
            return loss
        total = loss.detach().to(self.device, torch.float64).clone()
        dist.all_reduce(total, group=self.replicas_group)
        return (total / self.replicas).to(loss.dtype)

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0, in rank order (None elsewhere)."""
        everyone: list[Any] | None = [None] * self.world if self.is_main else None
        dist.gather_object(value, everyone, dst=0)
        return everyone


def _device(local_rank: int) -> torch.device:
    """This rank's GPU when the host has one for each of its processes, else the CPU."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def join(data_parallel: int, stages: int | None) -> Ranks:
    """Starts the process group from torchrun's environment and cuts it into pipelines.

    Args:
        data_parallel: replicas of the pipeline (``--data-parallel``); must divide the world.
        stages: ``--stages`` if given: it must be ``world / data_parallel``.

    Raises:
        ValueError: the world does not cut into ``data_parallel`` pipelines of ``stages`` ranks.
    """
    rank, world, local_rank = (int(os.environ[name]) for name in _ENV)
    if data_parallel < 1 or world % data_parallel:
        raise ValueError(
            f"--data-parallel {data_parallel} does not divide the {world} torchrun processes; "
            "pass a divisor of --nproc-per-node x --nnodes"
        )
    per_pipeline = world // data_parallel
    if stages is not None and stages != per_pipeline:
        raise ValueError(
            f"--stages {stages} with {world} torchrun processes and --data-parallel {data_parallel}: "
            f"each pipeline has {per_pipeline} ranks, one stage each; drop --stages or pass {per_pipeline}"
        )
    device = _device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any NCCL call: NCCL moves the current device's tensors
        # init_process_group() without a backend configures only cuda:nccl on a CUDA host,
        # and the pipeline also exchanges CPU objects (settings, sizes, checkpoints).
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
        torch.set_num_threads(1)  # the host's processes share its cores
    if not dist.is_initialized():
        store, _, _ = next(dist.rendezvous("env://"))
        # torchrun's restarts reuse its agent's store, where the last attempt's keys remain: a
        # rank that read a dead peer's gloo address from them would fail to connect. Each
        # attempt keeps its keys apart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"fastpipe-train/attempt-{attempt}", store), rank=rank, world_size=world
        )
    pipeline: Any = dist.group.WORLD
    replicas_group: Any = None
    if data_parallel > 1:
        # Every rank creates every group, in the same order, as new_group requires.
        pipelines = [
            dist.new_group(list(range(r * per_pipeline, (r + 1) * per_pipeline))) for r in range(data_parallel)
        ]
        columns = [dist.new_group(list(range(s, world, per_pipeline))) for s in range(per_pipeline)]
        pipeline, replicas_group = pipelines[rank // per_pipeline], columns[rank % per_pipeline]
    return Ranks(rank, world, per_pipeline, data_parallel, device, pipeline, replicas_group)


def leave() -> None:
    """Ends the process group (every rank, after its last collective)."""
    if dist.is_initialized():
        dist.destroy_process_group()
