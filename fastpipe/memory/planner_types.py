"""What the planner plans from and what it returns (:mod:`fastpipe.memory.planner`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastpipe.memory.model import DeviceMemory, StageBytes
from fastpipe.memory.offload_bytes import CopyBandwidth
from fastpipe.memory.planner_table import plan_table
from fastpipe.model.skip_memory import SkipSpan
from fastpipe.schedule.ir import Schedule
from fastpipe.step.recompute_policy import Recompute

__all__ = ["Combination", "Plan", "PlanProfile", "RecomputeOption"]


@dataclass(frozen=True)
class RecomputeOption:
    """A per-layer recompute policy as the planner prices it.

    Attributes:
        setting: the policy, as ``checkpoint=`` takes it.
        layers: each layer's bytes with the policy applied (``measure_stages(..., recompute=)``).
        seconds: each layer's recompute time per micro-batch, which its backward then runs too.
    """

    setting: Recompute
    layers: tuple[StageBytes, ...]
    seconds: tuple[float, ...]


@dataclass(frozen=True)
class PlanProfile:
    """What the planner plans from: one micro-batch's per-layer costs, measured or given.

    Attributes:
        forward: each layer's forward seconds (> 0 in sum per stage).
        backward: each layer's backward seconds (input and weight gradients together).
        layers: each layer's bytes without recompute (:func:`~fastpipe.balance.device_need.layer_bytes`).
        policies: the per-layer recompute policies on offer, least recompute first; the whole-stage
            modes (``"never"``, ``"except_last"``, ``"always"``) are always on offer.
        bandwidth: the host copy rates of the stages' device; None: offload does nothing there (a CPU).
        spans: the model's skips, held by the stages they cross.
        weight_share: W's part of each backward (:meth:`~fastpipe.schedule.search.StageCosts.from_measured`).
        comm: seconds per stage boundary.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    layers: tuple[StageBytes, ...]
    policies: tuple[RecomputeOption, ...] = ()
    bandwidth: CopyBandwidth | None = None
    spans: tuple[SkipSpan, ...] = ()
    weight_share: float = 0.5
    comm: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.layers)
        lengths = {"forward": len(self.forward), "backward": len(self.backward)}
        for p in self.policies:
            lengths[f"policy {p.setting} layers"] = len(p.layers)
            lengths[f"policy {p.setting} seconds"] = len(p.seconds)
        wrong = {k: v for k, v in lengths.items() if v != n}
        if n == 0 or wrong:
            raise ValueError(f"fastpipe: a PlanProfile needs one entry per layer ({n} layers); got {wrong}")
        if any(t < 0 for t in (*self.forward, *self.backward)):
            raise ValueError("fastpipe: PlanProfile times are seconds >= 0")


@dataclass(frozen=True)
class Combination:
    """One combination the planner evaluated.

    Attributes:
        balance: layers per stage.
        schedule: the schedule's label (``"zb-v v=2"``); ``name`` and ``virtual_stages`` rebuild it.
        name: the schedule's name.
        virtual_stages: stages per worker.
        checkpoint: what ``checkpoint=`` runs.
        offload: each stage's offloaded fraction of its saved activations.
        time: the simulated step time, in the profile's seconds.
        devices: each device's predicted peak.
        fits: whether every device's prediction plus the margin is within the limit.
        built: the schedule, with its prefetches.
    """

    balance: tuple[int, ...]
    schedule: str
    name: str
    virtual_stages: int
    checkpoint: str | Recompute
    offload: tuple[float, ...]
    time: float
    devices: tuple[DeviceMemory, ...]
    fits: bool
    built: Schedule = field(repr=False, compare=False)

    @property
    def peak(self) -> int:
        """The fullest device's predicted peak, in bytes."""
        return max(d.total for d in self.devices)


@dataclass(frozen=True)
class Plan:
    """What :func:`plan_memory` chose, and what it evaluated.

    Attributes:
        chosen: the fastest combination that fits.
        considered: every combination evaluated, fastest first.
        pruned: combinations not evaluated: no faster than the chosen before any recompute or offload.
        memory_limit: the limit planned under, in bytes per device (None: none).
    """

    chosen: Combination
    considered: tuple[Combination, ...]
    pruned: int
    memory_limit: int | None

    def table(self, top: int = 10, time_scale: float = 1.0, time_unit: str = "s") -> str:
        """The ``top`` fastest combinations and the chosen one as a text table (``*`` marks the choice)."""
        return plan_table(self, top, time_scale, time_unit)
