"""The schedule IR: per-worker ordered lists of actions.

A :class:`Schedule` is plain data. It can be printed, validated, simulated
(:mod:`fastpipe.schedule.simulate`) and executed by a runtime. Nothing here
imports a runtime.

Text form of an action (as in ``torch.distributed.pipelining``)::

    1F3        stage 1, forward, micro-batch 3
    0BW2       stage 0, combined backward (input and weight grads), micro-batch 2
    0B2 / 0W2  stage 0, input-grad only / weight-grad only, micro-batch 2
    1SEND_F3   stage 1 sends the output of 1F3 to stage 2
    2RECV_F3   stage 2 receives the input of 2F3 from stage 1
    2SEND_B3   stage 2 sends the input grad of its backward to stage 1
    1RECV_B3   stage 1 receives the output grad of its backward from stage 2
    1P3        stage 1 brings back what 1F3 offloaded to host memory, ahead of 1B3 (schedule.prefetch)
    0U1        stage 0 applies its weight update for mini-batch 1 (asynchronous streams only:
               there the number is a mini-batch, not a micro-batch; see schedule.multistep)

Dependencies (``->`` reads "needs")::

    F(s, m)      -> F(s-1, m)                       (s > 0)
    B/BW(s, m)   -> F(s, m), B/BW(s+1, m)           (s < last)
    W(s, m)      -> B(s, m)
    P(s, m)      -> F(s, m);  and B/BW(s, m) -> P(s, m) where the schedule has that P
    U(s, n)      -> the backward (BW or W) of every micro-batch of mini-batch n on stage s, U(s, n-1)
    F(s, m)      -> U(s, n-1)                       (flushed streams only; m in mini-batch n)

Each (stage, micro-batch) has its backward either combined (``BW``) or split into ``B`` and
``W``; a schedule may mix the two, e.g. split only where an upstream stage waits for the input
gradient.

With communication actions, a cross-worker edge ``F(s-1,m) -> F(s,m)`` becomes
``F(s-1,m) -> SEND_F(s-1,m) -> RECV_F(s,m) -> F(s,m)`` (and mirrored for the
backward). Sends never block; a receive waits for its matching send.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from fastpipe.schedule.placement import placement_problem, round_robin
from fastpipe.schedule.text import schedule_text

__all__ = ["Action", "ActionKind", "COMPUTE_KINDS", "COMM_KINDS", "COPY_KINDS", "Schedule", "ScheduleError"]

ActionKind = Literal["F", "B", "W", "BW", "U", "P", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
COMPUTE_KINDS = ("F", "B", "W", "BW", "U")
COPY_KINDS = ("P",)  # a copy on a device's copy stream: its worker only issues it
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_KINDS = frozenset(COMPUTE_KINDS + COPY_KINDS + COMM_KINDS)
_ACTION_RE = re.compile(r"^\s*(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BW|F|B|W|U|P)(\d+)\s*$")


class ScheduleError(ValueError):
    """A schedule is invalid, or a schedule cannot be built from the given arguments."""


@dataclass(frozen=True)
class Action:
    """One step of a schedule: ``kind`` applied to ``stage`` for ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; valid: {COMPUTE_KINDS + COPY_KINDS + COMM_KINDS}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def is_comm(self) -> bool:
        """True for SEND/RECV actions."""
        return self.kind in COMM_KINDS

    @staticmethod
    def parse(text: str) -> Action:
        """Parses the compact text form, e.g. ``"1F3"`` or ``"0SEND_B2"``.

        Raises:
            ScheduleError: if ``text`` is not an action.
        """
        match = _ACTION_RE.match(text)
        if match is None:
            raise ScheduleError(f"cannot parse action {text!r}; expected e.g. '1F3', '0BW2', '1SEND_F3'")
        return Action(match.group(2), int(match.group(1)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """Per-worker ordered actions of one training step.

    Attributes:
        name: schedule name, e.g. ``"1f1b"``.
        num_stages: total (virtual) stages; stage ``s`` lives on worker ``placement[s]``.
        num_microbatches: micro-batches per step.
        num_workers: physical pipeline ranks/devices.
        workers: per worker, its actions in execution order.
        minibatch_size: micro-batches per weight update in a stream of mini-batches (the
            schedule then holds ``U`` actions; micro-batch ``m`` belongs to mini-batch
            ``m // minibatch_size``); 0 for a one-step schedule without updates.
        flush: in a stream, whether each stage's forwards of mini-batch ``n + 1`` wait for its
            update of mini-batch ``n`` (synchronous training); False lets them run on older
            weights (asynchronous).
        skips: the ``(producer, consumer)`` stage pairs of the model's skips
            (:mod:`fastpipe.model.skips`), sorted: ``F(c, m)`` also reads what ``F(p, m)`` stashed,
            and ``B(p, m)`` also reads the gradient ``B(c, m)`` computed for it. Both already
            follow from the stage-to-stage edges, so only the messages they add change: a
            transport that matches messages by order plans them (:mod:`fastpipe.schedule.ordered`).
        placement: per stage, the worker that holds it (:mod:`fastpipe.schedule.placement`);
            empty means round robin, stage ``s`` on worker ``s % num_workers`` (interleaved).
            A V shape (``zb-v``, ``dualpipev``) puts stages ``s`` and ``2K - 1 - s`` on worker ``s``.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_workers: int
    workers: tuple[tuple[Action, ...], ...]
    minibatch_size: int = 0
    flush: bool = True
    skips: tuple[tuple[int, int], ...] = ()
    placement: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.placement and self.num_workers >= 1:
            # Frozen: the default map is filled in once, so equal schedules compare (and hash) equal.
            object.__setattr__(self, "placement", round_robin(self.num_stages, self.num_workers))
        elif not isinstance(self.placement, tuple):
            object.__setattr__(self, "placement", tuple(self.placement))

    @property
    def num_minibatches(self) -> int:
        """Mini-batches (weight updates per stage) of a stream; 0 for a one-step schedule."""
        return self.num_microbatches // self.minibatch_size if self.minibatch_size else 0

    def worker_of(self, stage: int) -> int:
        """The worker that holds ``stage``: ``placement[stage]`` (round robin: worker w holds w, w+K, ...)."""
        return self.placement[stage]

    def stages_of(self, worker: int) -> tuple[int, ...]:
        """The stages that ``worker`` holds, in increasing order."""
        return tuple(s for s, w in enumerate(self.placement) if w == worker)

    @cached_property
    def split_backward(self) -> bool:
        """True when the schedule splits at least one backward into B and W."""
        return bool(self.split_pairs)

    @cached_property
    def split_pairs(self) -> frozenset[tuple[int, int]]:
        """The ``(stage, micro-batch)`` pairs whose backward is split into B and W (the rest use BW)."""
        return frozenset((a.stage, a.microbatch) for actions in self.workers for a in actions if a.kind == "B")

    @cached_property
    def prefetched(self) -> frozenset[tuple[int, int]]:
        """The ``(stage, micro-batch)`` pairs whose offloaded activations a ``P`` brings back before their backward."""
        return frozenset((a.stage, a.microbatch) for actions in self.workers for a in actions if a.kind == "P")

    def backward_of(self, stage: int, microbatch: int) -> Action:
        """The action that produces the input gradient of ``(stage, microbatch)``: its B or its BW."""
        kind = "B" if (stage, microbatch) in self.split_pairs else "BW"
        return Action(kind, stage, microbatch)

    @cached_property
    def has_communication(self) -> bool:
        """True when the schedule carries explicit SEND/RECV actions."""
        return any(a.is_comm for actions in self.workers for a in actions)

    def actions(self) -> Iterable[tuple[int, Action]]:
        """Yields ``(worker, action)`` for every action."""
        for worker, actions in enumerate(self.workers):
            for action in actions:
                yield worker, action

    def crosses(self, stage_a: int, stage_b: int) -> bool:
        """True when two stages live on different workers (an edge needs communication)."""
        return self.worker_of(stage_a) != self.worker_of(stage_b)

    def dependencies(self, action: Action) -> list[Action]:
        """The actions that must finish before ``action`` may start."""
        s, m, kind = action.stage, action.microbatch, action.kind
        comm = self.has_communication
        last = self.num_stages - 1
        if kind == "U":
            size = self.minibatch_size
            done = [Action("W" if (s, i) in self.split_pairs else "BW", s, i) for i in range(m * size, (m + 1) * size)]
            return done + ([Action("U", s, m - 1)] if m > 0 else [])
        if kind == "F":
            flushed = (
                [Action("U", s, m // self.minibatch_size - 1)]
                if self.minibatch_size and self.flush and m >= self.minibatch_size
                else []
            )
            if s == 0:
                return flushed
            if comm and self.crosses(s - 1, s):
                return [Action("RECV_F", s, m), *flushed]
            return [Action("F", s - 1, m), *flushed]
        if kind == "P":
            return [Action("F", s, m)]
        if kind in ("B", "BW"):
            deps = [Action("F", s, m), *([Action("P", s, m)] if (s, m) in self.prefetched else [])]
            if s < last:
                if comm and self.crosses(s, s + 1):
                    deps.append(Action("RECV_B", s, m))
                else:
                    deps.append(self.backward_of(s + 1, m))
            return deps
        if kind == "W":
            return [Action("B", s, m)]
        if kind == "SEND_F":
            return [Action("F", s, m)]
        if kind == "RECV_F":
            return [Action("SEND_F", s - 1, m)]
        if kind == "SEND_B":
            return [self.backward_of(s, m)]
        return [Action("SEND_B", s + 1, m)]  # RECV_B

    def validate(self) -> None:
        """Checks placement, completeness, dependencies and freedom from deadlock.

        Raises:
            ScheduleError: naming the offending action and the unmet constraint.
        """
        if self.num_workers < 1 or self.num_stages < 1 or self.num_microbatches < 1:
            raise ScheduleError("num_workers, num_stages and num_microbatches must be >= 1")
        if self.num_stages % self.num_workers != 0:
            raise ScheduleError(
                f"num_stages ({self.num_stages}) must be a multiple of num_workers ({self.num_workers})"
            )
        if self.minibatch_size < 0 or (self.minibatch_size and self.num_microbatches % self.minibatch_size):
            raise ScheduleError(
                f"minibatch_size ({self.minibatch_size}) must divide num_microbatches ({self.num_microbatches})"
            )
        if len(self.workers) != self.num_workers:
            raise ScheduleError(f"{len(self.workers)} worker lists for num_workers={self.num_workers}")
        problem = placement_problem(self.placement, self.num_stages, self.num_workers)
        if problem is not None:
            raise ScheduleError(problem)
        self._check_placement()
        self._check_skips()
        self._check_completeness()
        self._check_deadlock()

    def _check_placement(self) -> None:
        for worker, action in self.actions():
            if not 0 <= action.stage < self.num_stages:
                raise ScheduleError(f"{action} on worker {worker}: stage out of range 0..{self.num_stages - 1}")
            if action.kind == "U":
                if not self.minibatch_size:
                    raise ScheduleError(
                        f"{action} on worker {worker}: update actions need a multi-step schedule (minibatch_size > 0)"
                    )
                if not 0 <= action.microbatch < self.num_minibatches:
                    raise ScheduleError(
                        f"{action} on worker {worker}: mini-batch out of range 0..{self.num_minibatches - 1}"
                    )
            elif not 0 <= action.microbatch < self.num_microbatches:
                raise ScheduleError(
                    f"{action} on worker {worker}: micro-batch out of range 0..{self.num_microbatches - 1}"
                )
            if self.worker_of(action.stage) != worker:
                raise ScheduleError(
                    f"{action} is on worker {worker} but stage {action.stage} lives on worker "
                    f"{self.worker_of(action.stage)}"
                )

    def _check_skips(self) -> None:
        for p, c in self.skips:
            if not 0 <= p < c < self.num_stages:
                raise ScheduleError(
                    f"skip edge ({p}, {c}): a skip goes from a stage to a later one, within 0..{self.num_stages - 1}"
                )
        if list(self.skips) != sorted(set(self.skips)):
            raise ScheduleError(f"skip edges {self.skips} must be sorted and unique (use Schedule.with_skips)")

    def with_skips(self, edges: Iterable[tuple[int, int]]) -> Schedule:
        """The same schedule whose dataflow also holds the skip ``edges`` (``(producer, consumer)`` pairs).

        Raises:
            ScheduleError: an edge that does not go forward between the schedule's stages.
        """
        out = dataclasses.replace(self, skips=tuple(sorted({(int(p), int(c)) for p, c in edges})))
        out._check_skips()
        return out

    def _check_completeness(self) -> None:
        counts = Counter(action for _, action in self.actions())
        for action, n in counts.items():
            if n > 1:
                raise ScheduleError(f"{action} appears {n} times; every action must run exactly once")
        for s in range(self.num_stages):
            for m in range(self.num_microbatches):
                split = Action("B", s, m) in counts or Action("W", s, m) in counts
                if split and Action("BW", s, m) in counts:
                    raise ScheduleError(
                        f"stage {s}, micro-batch {m} has both {Action('BW', s, m)} and a split B/W; "
                        "a backward is either combined or split"
                    )
                for kind in ("F", "B", "W") if split else ("F", "BW"):
                    if Action(kind, s, m) not in counts:
                        raise ScheduleError(f"missing action {Action(kind, s, m)} (stage {s}, micro-batch {m})")
            for n in range(self.num_minibatches):
                if Action("U", s, n) not in counts:
                    raise ScheduleError(f"missing update {Action('U', s, n)} (stage {s}, mini-batch {n})")
        # Every dependency must exist (this covers RECV without its matching SEND and vice versa).
        for _, action in self.actions():
            for dep in self.dependencies(action):
                if dep not in counts:
                    raise ScheduleError(f"{action} needs {dep}, which is not in the schedule")
        if self.has_communication:
            for _, action in self.actions():
                if action.kind == "SEND_F" and Action("RECV_F", action.stage + 1, action.microbatch) not in counts:
                    raise ScheduleError(f"{action} has no matching {action.stage + 1}RECV_F{action.microbatch}")
                if action.kind == "SEND_B" and Action("RECV_B", action.stage - 1, action.microbatch) not in counts:
                    raise ScheduleError(f"{action} has no matching {action.stage - 1}RECV_B{action.microbatch}")

    def _check_deadlock(self) -> None:
        # Run every worker in order; a worker blocked on a missing dependency is woken when it completes.
        done: set[Action] = set()
        pos = [0] * self.num_workers
        waiting: dict[Action, list[int]] = {}
        ready = list(range(self.num_workers))
        while ready:
            w = ready.pop()
            actions = self.workers[w]
            while pos[w] < len(actions):
                action = actions[pos[w]]
                missing = next((d for d in self.dependencies(action) if d not in done), None)
                if missing is not None:
                    waiting.setdefault(missing, []).append(w)
                    break
                done.add(action)
                pos[w] += 1
                ready.extend(waiting.pop(action, []))
        stuck = []
        for w, actions in enumerate(self.workers):
            if pos[w] < len(actions):
                action = actions[pos[w]]
                waits = [str(d) for d in self.dependencies(action) if d not in done]
                stuck.append(f"worker {w} stuck at {action} waiting for {', '.join(waits)}")
        if stuck:
            raise ScheduleError("deadlock: " + "; ".join(stuck))

    def without_communication(self) -> Schedule:
        """The same schedule with every SEND/RECV action removed."""
        workers = tuple(tuple(a for a in actions if not a.is_comm) for actions in self.workers)
        return dataclasses.replace(self, workers=workers)

    def with_communication(self) -> Schedule:
        """Lowers cross-worker edges to SEND/RECV actions.

        A send goes right after its producer, a receive right before its consumer. Sends never block, so
        the lowered schedule is deadlock-free whenever the original is. Idempotent.
        """
        base = self.without_communication()
        last = self.num_stages - 1
        workers = []
        for actions in base.workers:
            out: list[Action] = []
            for a in actions:
                s, m = a.stage, a.microbatch
                if a.kind == "F" and s > 0 and base.crosses(s - 1, s):
                    out.append(Action("RECV_F", s, m))
                if a.kind in ("B", "BW") and s < last and base.crosses(s, s + 1):
                    out.append(Action("RECV_B", s, m))
                out.append(a)
                if a.kind == "F" and s < last and base.crosses(s, s + 1):
                    out.append(Action("SEND_F", s, m))
                if a.kind in ("B", "BW") and s > 0 and base.crosses(s - 1, s):
                    out.append(Action("SEND_B", s, m))
            workers.append(tuple(out))
        return dataclasses.replace(self, workers=tuple(workers))

    def __str__(self) -> str:
        return schedule_text(self)
