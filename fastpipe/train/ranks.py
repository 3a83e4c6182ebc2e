"""Where one process of ``fastpipe train`` sits when ``torchrun`` started it.

``torchrun`` tells each process its place through the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``). :func:`join` starts the process group and cuts the
world into pipelines of ``world / D`` ranks, one stage each (two under ``--schedule
interleaved``), and ``D`` data-parallel replicas of them::

    rank = replica * stages + stage        # a pipeline's ranks are neighbours (one host, usually)

With ``--dp-shard fsdp`` the same ranks also form the 2-D ``DeviceMesh`` ``("pp", "dp")`` that
FSDP2 shards each stage over: ``mesh[stage][replica]`` is ``replica * stages + stage``, so the
mesh's ``"pp"`` groups are the pipelines above and its ``"dp"`` groups a stage's replicas.

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
from torch.distributed.device_mesh import DeviceMesh

from fastpipe.distributed.fsdp import MESH_DIMS
from fastpipe.distributed.launch import init_distributed, launched_by_torchrun

__all__ = ["Ranks", "join", "leave", "launched_by_torchrun"]


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
        mesh: the ``("pp", "dp")`` DeviceMesh of these groups where the replicas shard their stages
            (``--dp-shard fsdp`` with ``--data-parallel`` above 1), else None.
    """

    rank: int
    world: int
    stages: int
    replicas: int
    device: torch.device
    pipeline: Any
    replicas_group: Any
    mesh: DeviceMesh | None = None

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


def join(data_parallel: int, stages: int | None, *, sharded: bool = False) -> Ranks:
    """Starts the process group from torchrun's environment and cuts it into pipelines.

    Args:
        data_parallel: replicas of the pipeline (``--data-parallel``); must divide the world.
        stages: ``--stages`` if given: it must be ``world / data_parallel``.
        sharded: the replicas shard their stages (``--dp-shard fsdp``): the groups come from a
            ``("pp", "dp")`` DeviceMesh of the same layout, which FSDP2 needs.

    Raises:
        ValueError: the world does not cut into ``data_parallel`` pipelines of ``stages`` ranks.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
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
    device = init_distributed()  # per-attempt keys: see fastpipe.distributed.launch
    if device.type == "cpu":
        torch.set_num_threads(1)  # the host's processes share its cores
    pipeline: Any = dist.group.WORLD
    replicas_group: Any = None
    if data_parallel > 1 and sharded:
        # Row s of the mesh is stage s of every replica; its groups replace the ones below.
        layout = torch.arange(world).reshape(data_parallel, per_pipeline).T
        mesh = DeviceMesh(device.type, layout, mesh_dim_names=MESH_DIMS)
        pipeline, replicas_group = mesh.get_group("pp"), mesh.get_group("dp")
        return Ranks(rank, world, per_pipeline, data_parallel, device, pipeline, replicas_group, mesh)
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
