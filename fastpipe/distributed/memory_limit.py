"""``DistributedPipe(memory_limit=...)``: every rank refuses, before any action, a step one device could not hold.

A rank holds only its own stages' layers (the others are released to the meta device, or never
built), so no single rank can measure the whole pipeline. Each stage is therefore measured by
the rank that holds it, on one micro-batch, and the figures travel down the pipeline the way
the activations do::

    owner of stage 0 ── StageBytes 0, output, skips ──▶ every rank
    owner of stage 1 ── StageBytes 1, output, skips ──▶ every rank    (measured on stage 0's output)
    ...

After the last stage every rank holds every stage's figures
(:func:`~fastpipe.memory.stage_bytes.measure_stages`) and the skips that cross stages, and
predicts every device's peak (:func:`~fastpipe.memory.model.predict_memory`) from the same
numbers. So all ranks reach the same verdict and raise the same error, naming the device,
with no further message to agree on. An error while measuring travels in the owner's broadcast
in place of its figures, and every rank raises. Data-parallel replicas then take the
worst verdict of all (a max over every rank), so one replica's refusal stops the others too.

Stages sharded over their replicas (``dp_shard="fsdp"``) are measured whole, on full-size
stand-ins for their shards, and their owner sends their shards' bytes too
(:class:`~fastpipe.memory.sharded.ShardBytes`), so that the model counts what a rank keeps as
1/D and what a step gathers and reduces at its time.

The check runs at the first step of each schedule, checkpoint mode and micro-batch shape; stage
0's rank shares a digest of the shape every step (one broadcast of 8 bytes). Every wait is bounded
by the pipeline's first-step timeout, as a cold first step is.
"""

from __future__ import annotations

import contextlib
import io
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from fastpipe.balance._untouched import state_kept
from fastpipe.distributed.fsdp_step import StageShards
from fastpipe.distributed.rank_recompute import stage_policy
from fastpipe.errors import PipelineError
from fastpipe.memory.limit import limit_source, over_limit, refusal
from fastpipe.memory.model import DeviceMemory, OptimizerSpec, StageBytes, predict_memory
from fastpipe.memory.offload_choice import StageOffload, choose_fractions, offloaded
from fastpipe.memory.receive_buffers import buffered_stages, receive_buffer_bytes
from fastpipe.memory.sharded import ShardBytes, shard_bytes
from fastpipe.memory.sizes import parse_bytes
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.model.side_inputs import run_layers
from fastpipe.model.skips import SkipStore, has_skips
from fastpipe.step.microbatch import Value, replace_tensors, tensors_of
from fastpipe.step.recompute_policy import Recompute, stage_mode

if TYPE_CHECKING:
    from fastpipe.distributed.rank_step import RankStep
    from fastpipe.distributed.runtime import DistributedRuntime
    from fastpipe.distributed_pipe import DistributedPipe

__all__ = ["RankMemoryGuard", "capacity_guard", "check_rank_memory"]

_LEAST_FIRST = ("never", "except_last", "always")  # checkpoint="auto" tries them in this order


class RankMemoryGuard:
    """A :class:`~fastpipe.DistributedPipe`'s budget of ``limit`` bytes per device (per rank).

    Args:
        limit: an int, or a size such as ``"24GiB"`` (:func:`~fastpipe.memory.sizes.parse_bytes`).
        optimizer: the optimizer whose state to count (Adam's two moments by default, see
            :func:`~fastpipe.memory.model.optimizer_factor`).
        source: what the limit is where no ``memory_limit`` was given (:func:`~fastpipe.memory.limit.limit_source`).
        dp_shard: the pipe's ``dp_shard``: with ``"fsdp"`` each device's parameters, gradient
            shards and optimizer state count as its 1/D shards, besides the step's gathered working
            set (:mod:`fastpipe.memory.sharded`).

    Attributes:
        limit: the budget in bytes.
        predicted: every device's prediction, by step key (schedule, checkpoint, shape).
        chosen: the recompute each step key runs with (under ``checkpoint="auto"``, the least that fits).
        offload: each stage's offloaded share, by step key (under ``offload="auto"``, the least that fits).
        last: every device's prediction for the last step checked.

    Raises:
        ValueError: a limit that is not a size.
    """

    def __init__(
        self,
        limit: int | float | str,
        optimizer: OptimizerSpec = "adam",
        *,
        dp_shard: str = "replicate",
        source: str | None = None,
    ) -> None:
        self.limit = parse_bytes(limit)
        self.source = source
        self.dp_shard = dp_shard
        self.optimizer = optimizer
        self.predicted: dict[tuple[Any, ...], list[DeviceMemory]] = {}
        self.chosen: dict[tuple[Any, ...], str] = {}
        self.offload: dict[tuple[Any, ...], list[float]] = {}  # each stage's share offloaded, by step key
        self.last: list[DeviceMemory] = []


def capacity_guard(capacities: Sequence[int | None], optimizer: OptimizerSpec, dp_shard: str) -> RankMemoryGuard | None:
    """The guard of a pipe without ``memory_limit`` under ``checkpoint="auto"``: the least of the
    pipeline ranks' device capacities (:func:`~fastpipe.memory.capacity.device_capacity`, gathered
    from every rank), or None where a rank's device reports none (host memory)."""
    if not capacities or any(c is None for c in capacities):
        return None
    least = min(c for c in capacities if c is not None)
    return RankMemoryGuard(least, optimizer, dp_shard=dp_shard, source=limit_source(["the pipeline's devices"]))


def check_rank_memory(pipe: DistributedPipe, step: RankStep, loss_fn: Callable[[Any, Any], Tensor]) -> str | None:
    """Raise the same ``ValueError`` on every rank if a device's predicted peak exceeds the pipe's limit.

    Call it on every rank after the step's inputs are shared and before any action runs; a pipe
    without ``memory_limit`` returns at once, without a message.

    Returns:
        Under ``checkpoint="auto"``, the recompute the step runs with: the least of ``"never"``,
        ``"except_last"``, ``"always"`` whose prediction fits (the same on every rank, and the
        most any data-parallel replica needs); otherwise None.

    Raises:
        ValueError: naming the device, its stages and what it holds, by part.
        PipelineError: another rank failed to measure its stage, or a rank is missing.
    """
    guard: RankMemoryGuard | None = getattr(pipe, "memory_guard", None)
    if guard is None:
        return None
    runtime = pipe.runtime
    wgrad_batch = max(st.wgrad_batch for st in pipe._stages.values())
    shape = torch.tensor([_shape_digest(step.microbatches[0]) if step.microbatches else 0], dtype=torch.int64)
    shared = int(runtime.broadcast(shape, runtime.first_rank, "the micro-batch shape for memory_limit").item())
    # Another recompute policy than the three whole-stage ones counts as none: the most it can hold.
    auto = pipe.checkpoint == "auto"
    mode: str = stage_mode(pipe.checkpoint)
    modes = _LEAST_FIRST if auto else (mode,)
    key = (step.schedule, "auto" if auto else mode, wgrad_batch, tuple(step.sizes), shared)
    measured = key not in guard.predicted
    if measured:
        stages, skips, input_grad, sharded, told = _relay(pipe, step, loss_fn)
        transport = "ordered" if runtime.ordered else "tags"

        def predict(mode: str, fractions: Sequence[float]) -> list[DeviceMemory]:
            schedule, held = offloaded(step.schedule, stages, told, fractions, pipe._offload.lookahead)
            return predict_memory(schedule, buffered_stages(schedule, held, transport), checkpoint=mode,
                                  receive_buffers=receive_buffer_bytes(schedule, held, transport, skips),
                                  skip_buffers=transport == "tags",
                                  optimizer=guard.optimizer, skips=skips, wgrad_batch=wgrad_batch,
                                  input_grad=input_grad, sharded=sharded)  # fmt: skip

        tried, given = {}, [0.0 if t is None else t.fraction for t in told]
        for mode in modes:  # the least recompute first: the fastest step that fits
            fractions = given
            if pipe._offload.auto:
                fractions = choose_fractions(partial(predict, mode), step.schedule, told, guard.limit)
            tried[mode] = (predict(mode, fractions), fractions)
            if over_limit(tried[mode][0], guard.limit) is None:
                break
        if auto and runtime.dp_group is not None:  # every replica runs the most any of them needs
            most = runtime.agree_max(torch.tensor([float(modes.index(mode))]), "the recompute of checkpoint='auto'")
            mode = modes[int(most.item())]
        guard.chosen[key] = mode
        guard.predicted[key], guard.offload[key] = tried[mode]
    mode, devices = guard.chosen[key], guard.predicted[key]
    pipe._offload.apply(guard.offload[key])
    guard.last = devices
    over = over_limit(devices, guard.limit)
    if measured and runtime.dp_group is not None:  # the replicas measured this step together
        flag = torch.tensor([0.0 if over is None else 1.0])
        if runtime.agree_max(flag, "the memory_limit verdicts of the replicas").item() and over is None:
            raise ValueError(
                f"fastpipe: a data-parallel replica's device exceeds memory_limit={guard.limit} bytes (its ranks "
                "raised the details); the step did not run here either"
            )
    if over is not None:
        tried_note = f" (checkpoint='auto' tried {', '.join(modes)})" if auto else ""
        raise ValueError(refusal(over, guard.limit, guard.source) + tried_note + _sharded_note(runtime))
    return mode if auto else None


def _sharded_note(runtime: DistributedRuntime) -> str:
    """What the parts of a refusal mean where the stages are sharded over their replicas."""
    if not isinstance(runtime.replicas, StageShards):
        return ""
    return (
        f" (dp_shard='fsdp' over {runtime.replicas.size} replicas: parameters and optimizer are this rank's "
        "shards; gathered is the step's all-gathered parameters, gradients its full-size sums, reduce_scatter "
        "their reduction's buffers)"
    )


@dataclass
class _Measured:
    """What the owner of a stage broadcasts: its bytes, its output and the skips that go on past it."""

    stage_bytes: StageBytes | None
    output: Any = None
    left: dict[str, Tensor] = field(default_factory=dict)
    input_grad: bool = False
    error: str = ""
    sharded: ShardBytes | None = None
    offload: StageOffload | None = None


def _relay(
    pipe: DistributedPipe, step: RankStep, loss_fn: Callable[[Any, Any], Tensor]
) -> tuple[list[StageBytes], list[tuple[int, int, float]], bool, list[ShardBytes] | None, list[StageOffload | None]]:
    """Every stage's bytes, the skips between stages ``(producer, consumer, bytes)``, whether
    stage 0's input needs a gradient, each stage's shards where the stages are sharded, and what
    each stage can offload; the same on every rank (see the module docstring)."""
    runtime = pipe.runtime
    value: Any = None
    pending: dict[str, Tensor] = {}
    stashed: dict[str, tuple[int, int]] = {}  # name -> (producer stage, bytes)
    found: list[StageBytes] = []
    told: list[StageOffload | None] = []
    shards: list[ShardBytes] = []
    edges: list[tuple[int, int, float]] = []
    input_grad = False
    bound = runtime.watchdog.timeout
    runtime.watchdog.timeout = max(bound, runtime.first_step_timeout)
    try:
        for s in range(len(pipe.balance)):
            owner = runtime.placement[s]
            mine = _measure(pipe, s, value, pending, step, loss_fn) if owner == runtime.rank else None
            got: _Measured = _broadcast_object(runtime, mine, owner, f"stage {s}'s measured bytes for memory_limit")
            if got.error:
                if mine is not None:
                    raise ValueError(got.error)
                raise PipelineError(f"fastpipe: rank {runtime.global_rank_of(owner)} (stage {s}): {got.error}")
            assert got.stage_bytes is not None
            found.append(got.stage_bytes)
            told.append(got.offload)
            if got.sharded is not None:
                shards.append(got.sharded)
            input_grad = input_grad or (s == 0 and got.input_grad)
            for name in pending.keys() - got.left.keys():
                producer, nbytes = stashed.pop(name)
                edges.append((producer, s, float(nbytes)))
            for name in got.left.keys() - pending.keys():
                t = got.left[name]
                stashed[name] = (s, t.untyped_storage().nbytes())
            value, pending = got.output, got.left
    finally:
        runtime.watchdog.timeout = bound
    return found, edges, input_grad, shards if len(shards) == len(found) else None, told


def _measure(
    pipe: DistributedPipe,
    s: int,
    received: Any,
    skips: Mapping[str, Tensor],
    step: RankStep,
    loss_fn: Callable[[Any, Any], Tensor],
) -> _Measured:
    """Stage ``s`` (held here) on one micro-batch: its bytes, output and skips left, or the error."""
    stage = pipe._stages[s]
    module = stage.module
    assert isinstance(module, nn.Sequential)
    try:
        if s == 0:
            assert step.microbatches is not None, "stage 0's rank splits the input"
            sample: Value = step.microbatches[0]
        else:
            sample = _arrived(received, stage.device)
        pending = {n: t.to(stage.device) for n, t in skips.items()}
        side = step.side[0] if step.side else {}
        last = s == len(pipe.balance) - 1
        replicas = pipe.runtime.replicas
        sharded = None
        if isinstance(replicas, StageShards):  # gloo's reduce-scatter copies its input
            copies = 2 if dist.get_backend(replicas.group) == "gloo" else 1
            sharded = shard_bytes(module, replicas.size, scatter_copies=copies)
        policy = pipe.checkpoint  # a per-layer policy: measured with its regions recomputed
        with state_kept(module, None), _whole(module):  # not moving the step's generators or statistics
            (stage_bytes,) = measure_stages(
                module,
                [len(module)],
                sample,
                side_inputs=side,
                skips=pending,
                loss_fn=loss_fn if last else None,
                target=step.targets[0] if last else None,
                fused_wgrad=stage.options.fused_wgrad,
                wgrad_fuse_min=stage.options.wgrad_fuse_min,
                split=getattr(getattr(step, "schedule", None), "split_backward", True),  # fit's windows: any
                recompute=stage_policy(policy, pipe.balance, s) if isinstance(policy, Recompute) else None,
            )
            target = step.targets[0] if last else None
            offload = pipe._offload.measure(s, sample, target, loss_fn if last else None)
            store = SkipStore(pending) if has_skips(module) else None
            # As the step runs it (a layer may branch on grad mode), but saving nothing: only the output
            # and the skips are wanted, and a graph kept until the return would hold every layer's saved
            # tensors at once, the whole stage's activation without its recompute, during the first
            # step (under a per-layer policy, more than the step itself holds on the last ranks).
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_unsaved, _unpacked):
                out = run_layers(module, sample, side, store)  # the last stage too: which skips it pops
        left = store.values if store is not None else pending
        return _Measured(
            stage_bytes,
            None if last else replace_tensors(out, [t.detach().cpu() for t in tensors_of(out)]),
            {n: t.detach().cpu() for n, t in left.items()},
            any(t.requires_grad for t in tensors_of(sample)),
            sharded=sharded,
            offload=offload,
        )
    except Exception as exc:  # noqa: BLE001 - sent to every rank, which all raise
        return _Measured(None, error=f"measuring stage {s} for memory_limit raised {type(exc).__name__}: {exc}")


def _unsaved(_: Any) -> None:
    """A saved-tensor hook of a forward that no backward will run: keep nothing."""
    return None


def _unpacked(_: None) -> Tensor:
    raise RuntimeError("the measuring forward's graph has no saved tensors to run a backward with")


@contextlib.contextmanager
def _whole(module: nn.Module) -> Iterator[None]:
    """``module`` with plain full-size parameters in place of its FSDP2 shards, FSDP2's forward hooks aside.

    What a stage holds depends on its parameters' shapes, not their values, so zeros stand in
    for the gathered values: measuring runs no collective, and a replica that fails to measure
    leaves no other waiting. Nothing changes for a stage that is not sharded.
    """
    made: dict[int, nn.Parameter] = {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    hooks: list[tuple[dict[int, Any], dict[int, Any]]] = []
    try:
        for m in module.modules():
            for key, p in list(m._parameters.items()):
                if isinstance(p, DTensor):
                    local = p.to_local()
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(
                            torch.zeros(p.shape, dtype=p.dtype, device=local.device), p.requires_grad
                        )
                    swapped.append((m, key, p))
                    m._parameters[key] = made[id(p)]
            if isinstance(m, FSDPModule):
                state = fully_shard.state(m)  # type: ignore[attr-defined]
                for table in (m._forward_pre_hooks, m._forward_hooks):
                    saved = dict(table)
                    hooks.append((table, saved))
                    for k, hook in saved.items():
                        if getattr(hook, "__self__", None) is state:
                            del table[k]
        yield
    finally:
        for m, key, p in swapped:
            m._parameters[key] = p
        for table, saved in hooks:
            table.clear()
            table.update(saved)


def _arrived(value: Any, device: torch.device) -> Value:
    """A stage's input as the transport hands it over: on the stage's device, floats requiring grad."""
    return replace_tensors(
        value, [t.to(device).requires_grad_(t.is_floating_point() or t.is_complex()) for t in tensors_of(value)]
    )


def _shape_digest(value: Any) -> int:
    """A number that changes with the shapes and dtypes of a micro-batch's tensors."""
    return zlib.crc32(repr([(tuple(t.shape), str(t.dtype)) for t in tensors_of(value)]).encode())


def _broadcast_object(runtime: DistributedRuntime, value: Any, src: int, what: str) -> Any:
    """``value`` of the pipeline's rank ``src`` on every rank, over the control group, each wait bounded."""
    if runtime.rank == src:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    size = runtime.broadcast(size, src, what)
    if runtime.rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    payload = runtime.broadcast(payload, src, what)
    if runtime.rank == src:
        return value
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
