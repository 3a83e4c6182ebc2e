"""What offload takes off each device, and what its copies cost: the memory model's and simulator's inputs.

:class:`OffloadBytes` runs each stage's forward once on one micro-batch under the runtime's own
choice (:class:`~fastpipe.runtime.offload.SavedSet`: the saved tensors that only autograd holds
when the forward ends, in the order saved; seen through :class:`~fastpipe.runtime.offload.SizeProbe`,
which holds none of them) and keeps their sizes; a policy's ``fraction`` then
picks the same prefix the runtime picks (:func:`~fastpipe.runtime.offload.chosen_prefix`). The
result is :attr:`StageBytes.offloaded <fastpipe.memory.model.StageBytes.offloaded>`, which the memory
model counts as host bytes (:mod:`fastpipe.memory.model`).

:func:`copy_bandwidth` measures host<->device copies the way offload runs them (``_C``'s copy
streams and pooled host blocks; on a CPU, the host backend's copies into aligned blocks, a
memcpy), and :func:`copy_costs` turns bytes into the ``prefetch``/``offload`` costs of
:func:`fastpipe.schedule.simulate.simulate`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fastpipe.balance._untouched import state_kept
from fastpipe.memory.limit import sample_key
from fastpipe.memory.model import StageBytes
from fastpipe.memory.offload_choice import taken
from fastpipe.runtime.host_copies import CopyPath
from fastpipe.runtime.offload import OffloadPolicy, SizeProbe, saving_hooks
from fastpipe.runtime.stage import Stage
from fastpipe.runtime.wgrad import Deferred, accumulating_linears
from fastpipe.step.microbatch import Value, replace_tensors, tensors_of, to_device

__all__ = ["CopyBandwidth", "OffloadBytes", "copy_bandwidth", "copy_costs"]


class OffloadBytes:
    """The bytes each stage's policy offloads of one micro-batch, measured on the pipe's own stages.

    Args:
        stages: the pipe's stages; their ``offload`` policies are read at each use.
    """

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = list(stages)
        self._sizes: dict[tuple[Any, ...], list[list[int] | None]] = {}

    @property
    def key(self) -> tuple[OffloadPolicy | None, ...]:
        """The stages' policies now: a prediction made under other policies does not apply."""
        return tuple(st.offload for st in self.stages)

    def stage_bytes(
        self,
        stages: Sequence[StageBytes],
        sample: Value,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor] | None,
        policies: Sequence[OffloadPolicy | None] | None = None,
    ) -> list[StageBytes]:
        """``stages`` with ``offloaded`` set as ``policies`` (default: the stages' own) choose.

        A stage whose layers stash or pop skips or take side inputs is not run apart, nor the stages
        after it: their ``fraction`` of the activation stands in for the measured bytes.
        """
        chosen = self.key if policies is None else tuple(policies)
        sizes = self.sizes(sample, target, loss_fn, tuple(p.layers if p else None for p in chosen))
        out = []
        for st, policy, found in zip(stages, chosen, sizes):
            if policy is None:
                out.append(st)
                continue
            out.append(dataclasses.replace(st, offloaded=taken(found, policy.fraction, st.activation)))
        return out

    def sizes(
        self,
        sample: Value,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor] | None,
        scopes: tuple[frozenset[int] | None, ...],
    ) -> list[list[int] | None]:
        """Per stage, the sizes of the tensors its forward can offload (all layers, or the ``scopes``), in order."""
        key = (sample_key(sample), scopes)
        if key in self._sizes:
            return self._sizes[key]
        found: list[list[int] | None] = [None] * len(self.stages)
        value = sample
        with state_kept(nn.ModuleList([st.module for st in self.stages]), None):  # buffers, RNG as they were
            for s, (stage, scope) in enumerate(zip(self.stages, scopes)):
                if stage.skips.layers or stage.side_names:  # it (and so each stage after it) needs more than its input
                    break
                value = to_device(value, stage.device)
                probe = SizeProbe(CopyPath(stage.device, force=True))
                leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors_of(value)]
                value = replace_tensors(value, leaves)
                with torch.enable_grad(), accumulating_linears(stage.linears, Deferred()), probe.outside():
                    with saving_hooks(stage.module, scope, probe):
                        out = stage.module(value)
                        if s == len(self.stages) - 1 and loss_fn is not None:
                            out = loss_fn(out, to_device(target, stage.device))
                found[s] = probe.sizes()
                value = replace_tensors(out, [t.detach() for t in tensors_of(out)])
                del out
        self._sizes[key] = found
        return found


@dataclasses.dataclass(frozen=True)
class CopyBandwidth:
    """Measured copy rates between a device and host memory, in bytes per second.

    Attributes:
        device: the device measured.
        to_host: device to host (an offload).
        to_device: host to device (a prefetch).
        nbytes: the size of each copy timed.
    """

    device: torch.device
    to_host: float
    to_device: float
    nbytes: int

    def __str__(self) -> str:
        gib = float(1 << 30)
        return (
            f"{self.device}: to host {self.to_host / gib:.2f} GiB/s, to device {self.to_device / gib:.2f} GiB/s "
            f"({self.nbytes >> 20} MiB copies)"
        )


def copy_bandwidth(device: torch.device | str, nbytes: int = 64 << 20, repeats: int = 5) -> CopyBandwidth:
    """Time offload's own copies of ``nbytes`` each way on ``device``: the best of ``repeats``.

    On a CPU the copies go through ``_C``'s host backend into aligned pooled blocks (what a pinned
    copy is on a host without a device: a memcpy); elsewhere through the stage's copy path
    (:class:`~fastpipe.runtime.host_copies.CopyPath`).

    Raises:
        ValueError: ``nbytes`` or ``repeats`` below 1.
    """
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"fastpipe: copy_bandwidth needs nbytes >= 1 and repeats >= 1, got {nbytes}, {repeats}")
    where = torch.device(device)
    path = CopyPath(where, force=True)
    src = torch.ones(nbytes, dtype=torch.uint8, device=where)
    out, back = float("inf"), float("inf")
    for _ in range(repeats + 1):  # the first round warms the pool and the streams
        _sync(where)
        started = time.perf_counter()
        host, done = path.to_host(src)
        if done is not None:
            done.synchronize()
        middle = time.perf_counter()
        dst, arrived = path.to_device(host, (src.shape, src.stride(), src.dtype), None)
        path.wait(dst, arrived, None)
        _sync(where)
        ended = time.perf_counter()
        out, back = min(out, middle - started), min(back, ended - middle)
        del host, dst
    return CopyBandwidth(where, nbytes / out, nbytes / back, nbytes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_costs(offloaded: Sequence[int], bandwidth: CopyBandwidth) -> tuple[list[float], list[float]]:
    """Seconds per micro-batch of each stage's prefetch and offload: ``(prefetch, offload)`` for the simulator."""
    return [n / bandwidth.to_device for n in offloaded], [n / bandwidth.to_host for n in offloaded]
