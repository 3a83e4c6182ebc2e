"""The systems of the largest-model benchmark (:mod:`fastpipe.bench.largest`): who trains the GPT, and how.

Plain PyTorch, ``torch.distributed.pipelining`` (PL) and fastpipe, each with its recompute and
its optimizer's place, named as the tables print them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Config", "System", "fastpipe_configs", "peer_systems", "predict", "shipped_pl"]


@dataclass(frozen=True)
class System:
    """One way to train the model.

    Attributes:
        kind: ``"plain"``, ``"pipelining"`` or ``"fastpipe"``.
        schedule: PL's (``"1F1B"``, ``"ZBVZeroBubble"``) or fastpipe's; ``""`` for plain.
        checkpoint: ``"never"``, ``"blocks"`` (each block under ``torch.utils.checkpoint``),
            fastpipe's ``"except_last"`` and ``"always"``, ``"always+blocks"`` (fastpipe's stage
            recompute over blocks each under ``torch.utils.checkpoint``: a micro-batch in flight
            keeps its stage input only, and its backward replays the stage keeping block inputs),
            or fastpipe's ``"auto"``: the planner (``balance="auto"``, ``checkpoint="auto"``,
            ``memory_limit`` the budget, and ``schedule`` as given, ``"auto"`` included).
        optimizer: ``"device"`` (Adam on the device) or ``"host"`` (Adam under
            :class:`~fastpipe.memory.host_optimizer.HostOptimizer`: its state and update on the host,
            whose bytes a CPU rank books apart).
    """

    kind: str
    schedule: str = ""
    checkpoint: str = "never"
    optimizer: str = "device"

    @property
    def name(self) -> str:
        """How the tables name it."""
        if self.checkpoint == "auto":
            host = ", host optimizer" if self.optimizer == "host" else ""
            return f"fastpipe planner (balance, checkpoint auto; schedule {self.schedule}{host})"
        recompute = {"never": "", "blocks": " + checkpoint per block"}.get(self.checkpoint, f", {self.recompute}")
        recompute += " + host optimizer" if self.optimizer == "host" else ""
        who = {
            "plain": "plain PyTorch, 1 device",
            "pipelining": f"pipelining {self.schedule}",
            "fastpipe": f"fastpipe {self.schedule}",
        }
        return who.get(self.kind, f"{self.kind} {self.schedule}".strip()) + recompute

    @property
    def recompute(self) -> str:
        """What it recomputes, in words."""
        mode, _, blocks = self.checkpoint.partition("+")
        if blocks:  # fastpipe's stage recompute over blocks each under torch.utils.checkpoint
            return f"checkpoint={mode} over checkpoint per block"
        named = {"never": "no recomputation", "blocks": "checkpoint per block", "auto": "the planner's choice"}
        return named.get(mode, f"checkpoint={mode}")

    @property
    def stages_per_rank(self) -> int:
        """Stages per rank: 2 for the V schedules, else 1."""
        return 2 if self.schedule in ("ZBVZeroBubble", "zb-v") else 1


@dataclass(frozen=True)
class Config:
    """What :func:`predict` is asked about.

    Attributes:
        system: the system.
        shape: ``vocab``, ``seq``, ``heads``, ``width``, ``batch``, ``chunks`` (micro-batches), ``layers`` (blocks).
        ranks: devices (1 for plain PyTorch).
        balance: layers per stage (embedding and head count as layers), stage 0 first.
        budget: bytes per device.
    """

    system: System
    shape: dict[str, int] = field(hash=False)
    ranks: int
    balance: list[int] = field(hash=False)
    budget: int


def predict(config: Config) -> list[int] | None:
    """Each rank's predicted peak bytes of ``config``'s step, or None where no memory model is wired."""
    return None


def peer_systems() -> list[System]:
    """Plain PyTorch and ``torch.distributed.pipelining``, each with and without checkpointing per block.

    Then PL's best, 1F1B with checkpointing per block, with Adam under fastpipe's
    :class:`~fastpipe.memory.host_optimizer.HostOptimizer`: what the host optimizer alone gives.
    """
    out = [System("plain", "", c) for c in ("never", "blocks")]
    out += [System("pipelining", s, c) for s in ("1F1B", "ZBVZeroBubble") for c in ("never", "blocks")]
    return out + [System("pipelining", "1F1B", "blocks", "host")]


def fastpipe_configs() -> list[System]:
    """fastpipe's configurations, the one expected to fit the most first (later ones start above its size).

    Per schedule with Adam on the device, then 1f1b with Adam on the host, then the planner
    (``schedule="auto"``) with Adam on the device and on the host.
    """
    modes = ("blocks", "always", "except_last", "never")
    out = [System("fastpipe", s, c) for c in modes for s in ("1f1b", "zb-h1", "zb-v")]
    out += [System("fastpipe", "1f1b", c, "host") for c in ("always+blocks", "blocks")]
    return out + [System("fastpipe", "auto", "auto", o) for o in ("device", "host")]


def shipped_pl(row: dict[str, Any]) -> bool:
    """Whether a row is ``torch.distributed.pipelining`` as it ships (Adam on the device): the ratios' base."""
    config = row.get("config") or {"kind": row["system"].split(" ")[0]}  # a row without its config: by name
    return config["kind"] == "pipelining" and config.get("optimizer", "device") == "device"
