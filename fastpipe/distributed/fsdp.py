"""Stages sharded over their data-parallel replicas with FSDP2 (``DistributedPipe(dp_shard="fsdp")``).

On a 2-D mesh ``("pp", "dp")`` each rank's stages are wrapped with
:func:`torch.distributed.fsdp.fully_shard` over the ``"dp"`` sub-mesh: one unit per layer of
the stage's Sequential, then the stage itself as the root unit, which takes the parameters no
layer holds alone (one that two of its layers share). Between steps a rank holds 1/D of its
stages' parameters (``DTensor`` shards), of their gradients and, for an optimizer built over
``pipe.parameters()``, of the optimizer state.

The pipeline, not FSDP2's hooks, says when a unit gathers and reduces: once per step each
(:mod:`fastpipe.distributed.fsdp_step`). A tied weight's shards are then summed over its tie
group as a whole tensor would be: each replica's tie group pairs ranks of one ``dp``
coordinate, which hold the same rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from fastpipe.distributed.fsdp_step import StageShards, Unit, Wait
from fastpipe.distributed.runtime import DistributedRuntime
from fastpipe.runtime.stage import Stage

__all__ = [
    "DP_SHARDS",
    "MESH_DIMS",
    "check_dp_shard",
    "point_at_shards",
    "shard_pipe",
    "shard_stages",
    "state_bytes",
]

DP_SHARDS = ("replicate", "fsdp")
MESH_DIMS = ("pp", "dp")


def check_dp_shard(dp_shard: str, mesh: Any) -> None:
    """Refuse a ``dp_shard`` that is not one of :data:`DP_SHARDS`, and ``"fsdp"`` without a ``("pp", "dp")`` mesh.

    Raises:
        ValueError: naming the choices, or the mesh's dimension names expected.
    """
    if dp_shard not in DP_SHARDS:
        raise ValueError(
            f"fastpipe: dp_shard must be one of {DP_SHARDS} ('replicate': each replica holds its whole stages; "
            f"'fsdp': the replicas shard them with FSDP2), got {dp_shard!r}"
        )
    if dp_shard != "fsdp":
        return
    recipe = "init_device_mesh(device_type, (pp, dp), mesh_dim_names=('pp', 'dp'))"
    if mesh is None:
        raise ValueError(
            f"fastpipe: dp_shard='fsdp' shards each stage over the 'dp' dimension of a DeviceMesh: pass mesh={recipe} "
            "instead of process_group=/dp_group="
        )
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if names != MESH_DIMS:
        raise ValueError(
            f"fastpipe: dp_shard='fsdp' needs a 2-D DeviceMesh with dimensions named {MESH_DIMS}, in that order "
            f"(pipeline ranks outer, replicas inner), got {names}; build it with {recipe}"
        )


def shard_pipe(root: nn.Module, stages: Mapping[int, Stage], mesh: DeviceMesh, runtime: DistributedRuntime) -> None:
    """Shard ``stages`` over ``mesh["dp"]`` and give ``runtime`` their step (one replica: nothing to shard).

    ``root`` (the pipe) is pointed at the shards wherever it still holds a replaced parameter.
    """
    dp = mesh["dp"]
    if dp.size() == 1:
        return
    shards, replaced = shard_stages(stages, dp, runtime.wait_collective)
    point_at_shards(root, replaced)
    runtime.replicas = shards


def shard_stages(
    stages: Mapping[int, Stage], mesh: DeviceMesh, wait: Wait
) -> tuple[StageShards, dict[int, tuple[Tensor, Tensor]]]:
    """Wrap each stage with ``fully_shard`` over ``mesh`` (the ``"dp"`` sub-mesh), each layer a unit.

    Returns:
        The shards, and each replaced parameter with its shard, by the original's ``id``: a module
        outside the stages that holds the original (the layer a tied copy's stage cloned) must be
        pointed at the shard.

    Raises:
        ValueError: a stage is already sharded, or lives on another device type than ``mesh``.
    """
    units: dict[int, list[Unit]] = {}
    replaced: dict[int, tuple[Tensor, Tensor]] = {}
    for s, st in stages.items():
        if st.device.type != mesh.device_type:
            raise ValueError(
                f"fastpipe: stage {s} lives on {st.device} but the mesh's device type is {mesh.device_type!r}; "
                "build the DeviceMesh for the stages' device type"
            )
        if any(isinstance(m, FSDPModule) for m in st.module.modules()):
            raise ValueError(
                f"fastpipe: stage {s} holds modules already sharded with fully_shard; pass the plain model, "
                "dp_shard='fsdp' shards it"
            )
        before = list(st.module.parameters())
        units[s] = _wrap(st.module, mesh)
        after = list(st.module.parameters())
        replaced.update((id(old), (old, new)) for old, new in zip(before, after) if old is not new)
        st.params[:] = [p for p in after if p.requires_grad]
        *layers, root = units[s]
        in_layers = {id(p) for unit in layers for p in unit.module.parameters()}
        for unit in layers:
            ids = {id(p) for p in unit.module.parameters()}
            unit.index = [i for i, p in enumerate(st.params) if id(p) in ids]
        root.index = [i for i, p in enumerate(st.params) if id(p) not in in_layers]
    return StageShards(stages, units, mesh, wait), replaced


def _wrap(stage: nn.Module, mesh: DeviceMesh) -> list[Unit]:
    """``fully_shard`` each layer that holds parameters no other layer holds, then ``stage`` (which takes
    the rest); the units, in forward order, ``stage`` last."""
    layers = list(stage.children())
    owners: dict[int, int] = {}
    for layer in layers:
        for p in layer.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    units = []
    for layer in layers:
        params = list(layer.parameters())
        if params and all(owners[id(p)] == 1 for p in params):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
            units.append(Unit(layer, []))
    fully_shard(stage, mesh=mesh, reshard_after_forward=False)
    return [*units, Unit(stage, [])]


def point_at_shards(root: nn.Module, replaced: Mapping[int, tuple[Tensor, Tensor]]) -> None:
    """Make every module under ``root`` that still holds a replaced parameter hold its shard instead."""
    for module in root.modules():
        for key, p in list(module._parameters.items()):
            old, new = replaced.get(id(p), (None, None))
            if p is not None and p is old:
                module._parameters[key] = cast(nn.Parameter, new)


def state_bytes(tensors: Iterable[Tensor], optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of ``tensors`` (parameters), of their ``.grad`` and of ``optimizer``'s state.

    A DTensor counts its local shard, the memory this rank holds.
    """
    params = {id(p): p for p in tensors}.values()
    out = {"parameters": 0, "gradients": 0, "optimizer": 0}
    for p in params:
        out["parameters"] += _local_bytes(p)
        if p.grad is not None:
            out["gradients"] += _local_bytes(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(_local_bytes(v) for v in state.values() if isinstance(v, Tensor))
    return out


def _local_bytes(t: Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
