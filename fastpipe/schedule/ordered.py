"""Message order for transports that match by order (NCCL), and a check that it cannot deadlock.

NCCL ignores tags: the k-th payload one rank sends to another lands in the k-th receive the
other posted from it, and a send may not complete before its receive is posted. Posting
each send after its producer and each receive before its consumer deadlocks as soon as two
ranks swap values (each waits in a send for a receive queued behind the other's send).

:func:`plan` therefore cuts a step into **rounds**, from one simulated run of the schedule:
in each round every worker runs its next action if it already has the inputs, then posts
one batch (``batch_isend_irecv``) that sends what that action produced and receives what
was produced for it in the round (1F1B, 2 stages, :func:`format_plan`; ``s``/``r`` send or
receive the activation ``F`` or gradient ``B`` entering a stage, for a micro-batch; skips of
:mod:`fastpipe.model.skips` add ``S`` and ``SB`` messages, see :class:`Message`)::

    worker 0: 0F0 [sF1/0] 0F1 [sF1/1] [rB0/0] 0BW0 0F2 [sF1/2] [rB0/1] 0BW1 ...
    worker 1: [rF1/0] 1F0 [rF1/1] 1BW0 [sB0/0] 1F1 1BW1 [sB0/1,rF1/2] 1F2 1BW2 ...

(Worker 0 posts a round's send ahead of its receive, as its own batch: see :func:`plan`.)

Every batch of round r only pairs with batches of round r, and an action runs after the
rounds that brought its inputs, so the plan cannot deadlock, whatever the timing. Each
value's header (its shapes) travels ahead over a side channel matched by tag, so a receive
is sized before its batch is posted.

:func:`check_ordered` verifies a plan independently of how it was made:

- **Order:** between every pair of workers the sender's payloads come in the order in which
  the receiver posts for them; otherwise values would land in the wrong buffers.
- **Progress** under the strictest reading of NCCL: each worker's batches run one after
  another on one stream, a send completes only while its receive's batch runs too (no
  buffering), a batch is posted once the headers of its receives were sent, and an action
  waits for the batches with its inputs. Buffering and more streams only remove waits.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from fastpipe.schedule.ir import Action, Schedule, ScheduleError

__all__ = ["Message", "Op", "Step", "batches", "check_ordered", "format_plan", "plan"]


@dataclass(frozen=True)
class Message:
    """One value crossing workers, into ``stage``.

    ``kind`` is "F" (the activation into ``stage``), "B" (the gradient into ``stage``),
    "S" (the tensors stage ``peer`` stashed for ``stage``, a skip's consumer) or "SB" (the
    gradients of what ``stage`` stashed, from the consumer ``peer``); ``peer`` is -1 for
    "F" and "B".
    """

    kind: str
    stage: int
    microbatch: int
    peer: int = -1


@dataclass(frozen=True)
class Op:
    """A send or receive of one message from worker ``src`` to worker ``dst``."""

    send: bool
    message: Message
    src: int
    dst: int


@dataclass(frozen=True)
class Step:
    """One step of a worker's plan: post ``ops`` as one batch, or (``action`` set) run a compute action."""

    ops: tuple[Op, ...] = ()
    action: Action | None = None


def inputs(schedule: Schedule, action: Action) -> list[Message]:
    """The values ``action`` receives from another worker (its skips' first, as they are sent)."""
    s, m, last = action.stage, action.microbatch, schedule.num_stages - 1
    if action.kind == "F":
        skips = [Message("S", s, m, p) for p, c in schedule.skips if c == s and schedule.crosses(p, s)]
        return skips + ([Message("F", s, m)] if s > 0 and schedule.crosses(s - 1, s) else [])
    if action.kind in ("B", "BW"):
        grads = [Message("SB", s, m, c) for p, c in schedule.skips if p == s and schedule.crosses(s, c)]
        return grads + ([Message("B", s, m)] if s < last and schedule.crosses(s, s + 1) else [])
    return []


def outputs(schedule: Schedule, action: Action) -> list[tuple[Message, int]]:
    """The values ``action`` sends to another worker, with that worker.

    A stage sends its skips before its activation, and the gradients of the skips it
    received before its input gradient (the order :mod:`fastpipe.runtime.skip_flow` sends in).
    """
    s, m, last = action.stage, action.microbatch, schedule.num_stages - 1
    out: list[tuple[Message, int]] = []
    if action.kind == "F":
        out += [
            (Message("S", c, m, s), schedule.worker_of(c))
            for p, c in schedule.skips
            if p == s and schedule.crosses(s, c)
        ]
        if s < last and schedule.crosses(s, s + 1):
            out.append((Message("F", s + 1, m), schedule.worker_of(s + 1)))
    elif action.kind in ("B", "BW"):
        out += [
            (Message("SB", p, m, s), schedule.worker_of(p))
            for p, c in schedule.skips
            if c == s and schedule.crosses(p, s)
        ]
        if s > 0 and schedule.crosses(s - 1, s):
            out.append((Message("B", s - 1, m), schedule.worker_of(s - 1)))
    return out


def plan(schedule: Schedule, worker: int) -> list[Step]:
    """What an ordered transport does on ``worker`` in one step, in order (see the module doc)."""
    return list(_safe_plans(schedule.without_communication())[worker])


@lru_cache(maxsize=16)
def _safe_plans(schedule: Schedule) -> tuple[tuple[Step, ...], ...]:
    """The round plans, with the sends of even workers posted ahead of their receives when that is safe.

    In a round where two workers swap values, each would post its send only once the
    header of the value it receives has come, so the one that finished first waits for the
    other's action before its own value leaves. Posting one side's sends on their own lets
    that value go as soon as it exists. Both sides doing it would deadlock (each send queued
    ahead of the receive the other's send needs), so only even workers do, and the result is
    kept only if :func:`check_ordered` accepts it.
    """
    rounds = _plans(schedule)
    split = tuple(tuple(_split(steps)) if w % 2 == 0 else steps for w, steps in enumerate(rounds))
    try:
        check_ordered(schedule, [list(steps) for steps in split])
    except ScheduleError:
        return rounds
    return split


def _split(steps: tuple[Step, ...]) -> list[Step]:
    out: list[Step] = []
    for step in steps:
        sends = tuple(op for op in step.ops if op.send)
        recvs = tuple(op for op in step.ops if not op.send)
        out += [Step(ops=sends), Step(ops=recvs)] if sends and recvs else [step]
    return out


def format_plan(schedule: Schedule) -> str:
    """Every worker's plan on one line, batches in brackets (``s``/``r``: send/receive)::

    worker 0: 0F0 [sF1/0] 0F1 [sF1/1] [rB0/0] 0BW0 ...
    """

    def op(o: Op) -> str:
        return f"{'s' if o.send else 'r'}{_text(o.message)}"

    return "\n".join(
        f"worker {w}: "
        + " ".join(
            str(st.action) if st.action is not None else f"[{','.join(op(o) for o in st.ops)}]"
            for st in plan(schedule, w)
        )
        for w in range(schedule.num_workers)
    )


def batches(schedule: Schedule, worker: int) -> list[tuple[Op, ...]]:
    """The batches an ordered transport posts on ``worker``, in order."""
    return [step.ops for step in plan(schedule, worker) if step.action is None]


@lru_cache(maxsize=16)
def _plans(schedule: Schedule) -> tuple[tuple[Step, ...], ...]:
    workers = range(schedule.num_workers)
    steps: list[list[Step]] = [[] for _ in workers]
    pc = [0] * schedule.num_workers
    have: list[set[Message]] = [set() for _ in workers]
    while any(pc[w] < len(schedule.workers[w]) for w in workers):
        produced: list[list[tuple[Message, int]]] = [[] for _ in workers]
        before = list(pc)
        for w in workers:
            actions = schedule.workers[w]
            if pc[w] < len(actions) and all(msg in have[w] for msg in inputs(schedule, actions[pc[w]])):
                steps[w].append(Step(action=actions[pc[w]]))
                produced[w] += outputs(schedule, actions[pc[w]])
                pc[w] += 1
        if not any(produced) and pc == before:
            stuck = [str(schedule.workers[w][pc[w]]) for w in workers if pc[w] < len(schedule.workers[w])]
            raise ScheduleError(
                f"schedule {schedule.name!r} deadlocks: {', '.join(stuck)} wait for inputs "
                "that no action produces first"
            )
        ops: list[list[Op]] = [[] for _ in workers]
        for w in workers:  # sends first, in the order produced; receives in each sender's order
            ops[w] += [Op(True, msg, w, dst) for msg, dst in produced[w]]
        for w in workers:
            for msg, dst in produced[w]:
                ops[dst].append(Op(False, msg, w, dst))
                have[dst].add(msg)
        for w in workers:
            if ops[w]:
                steps[w].append(Step(ops=tuple(ops[w])))
    return tuple(tuple(s) for s in steps)


def check_ordered(schedule: Schedule, programs: list[list[Step]] | None = None) -> None:
    """Raise :class:`ScheduleError` unless the plans (default: :func:`plan`'s) are safe on NCCL."""
    schedule = schedule.without_communication()
    if programs is None:
        programs = [plan(schedule, w) for w in range(schedule.num_workers)]
    _check_placement(schedule, programs)
    _check_order(programs)
    _check_progress(schedule, programs)


def _check_placement(schedule: Schedule, programs: list[list[Step]]) -> None:
    """Each worker runs exactly its actions, sends only what it already produced, and receives
    what it consumes before the consumer runs."""
    if len(programs) != schedule.num_workers:
        raise ScheduleError(f"{len(programs)} plans for {schedule.num_workers} workers")
    for w, program in enumerate(programs):
        ran = [step.action for step in program if step.action is not None]
        if ran != list(schedule.workers[w]):
            raise ScheduleError(f"worker {w}'s plan does not run its schedule's actions in order")
        produced: set[Message] = set()
        received: set[Message] = set()
        for step in program:
            if step.action is not None:
                missing = [m for m in inputs(schedule, step.action) if m not in received]
                if missing:
                    raise ScheduleError(f"worker {w} runs {step.action} before receiving {_name(missing, 0)}")
                produced.update(m for m, _ in outputs(schedule, step.action))
                continue
            for op in step.ops:
                if op.send and (op.src != w or op.message not in produced):
                    raise ScheduleError(
                        f"worker {w} sends {_name([op.message], 0)} before producing it (or it is not its to send)"
                    )
                if not op.send:
                    if op.dst != w:
                        raise ScheduleError(f"worker {w} posts a receive addressed to worker {op.dst}")
                    received.add(op.message)


def _check_order(programs: list[list[Step]]) -> None:
    sent: dict[tuple[int, int], list[Message]] = defaultdict(list)
    received: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for program in programs:
        for step in program:
            for op in step.ops:
                (sent if op.send else received)[(op.src, op.dst)].append(op.message)
    for pair in sorted(set(sent) | set(received)):
        a, b = sent[pair], received[pair]
        if a != b:
            first = next(i for i in range(len(a) + 1) if i >= len(a) or i >= len(b) or a[i] != b[i])
            raise ScheduleError(
                f"worker {pair[0]} sends to worker {pair[1]} in an order that worker does not receive in "
                f"(message #{first}: sent {_name(a, first)}, expected {_name(b, first)}); NCCL matches messages "
                "by order"
            )


def _name(messages: list[Message], i: int) -> str:
    if i >= len(messages):
        return "nothing"
    msg = messages[i]
    if msg.kind == "S":
        return f"the skips from stage {msg.peer} for stage {msg.stage}, micro-batch {msg.microbatch}"
    if msg.kind == "SB":
        return f"the gradient of the skips from stage {msg.stage} to stage {msg.peer}, micro-batch {msg.microbatch}"
    return f"the {'activation' if msg.kind == 'F' else 'gradient'} of stage {msg.stage}, micro-batch {msg.microbatch}"


def _text(msg: Message) -> str:
    """``F1/0``, ``B0/2``; a skip from stage 0 into stage 2 ``S0>2/1``, its gradient back ``SB2>0/1``."""
    if msg.kind in ("S", "SB"):
        return f"{msg.kind}{msg.peer}>{msg.stage}/{msg.microbatch}"
    return f"{msg.kind}{msg.stage}/{msg.microbatch}"


def _check_progress(schedule: Schedule, programs: list[list[Step]]) -> None:
    """Run every worker's plan under rendezvous semantics on one stream; raise on a deadlock."""
    # Where each message's send and receive sit: (worker, index of the batch on its stream).
    where: dict[tuple[Message, bool], tuple[int, int]] = {}
    for w, program in enumerate(programs):
        for i, ops in enumerate(step.ops for step in program if step.action is None):
            for op in ops:
                where[(op.message, op.send)] = (w, i)
    produced: set[Message] = set()  # their header was sent: their producer ran
    moved: set[Message] = set()
    pc = [0] * len(programs)
    stream: list[list[tuple[Op, ...]]] = [[] for _ in programs]  # batches posted, in order
    finished = [0] * len(programs)  # batches completed; stream[w][finished[w]] is the running one
    progress = True
    while progress:
        progress = False
        for w, program in enumerate(programs):
            while pc[w] < len(program):
                step = program[pc[w]]
                if step.action is None:
                    if any(not op.send and op.message not in produced for op in step.ops):
                        break  # a receive cannot be sized before its header came
                    stream[w].append(step.ops)
                else:
                    needed = inputs(schedule, step.action)
                    if any(msg not in moved or where.get((msg, False), (w, -1))[1] >= finished[w] for msg in needed):
                        break  # its input has not arrived
                    produced.update(msg for msg, _ in outputs(schedule, step.action))
                pc[w] += 1
                progress = True
        for w in range(len(programs)):
            while finished[w] < len(stream[w]):
                ops = stream[w][finished[w]]
                for op in ops:
                    peer, index = where[(op.message, not op.send)]
                    if finished[peer] == index < len(stream[peer]):  # both batches run: the pair moves
                        moved.add(op.message)
                if not all(op.message in moved for op in ops):
                    break
                finished[w] += 1
                progress = True
    stuck = [
        _stuck(w, programs[w], pc[w], stream[w], finished[w])
        for w in range(len(programs))
        if pc[w] < len(programs[w]) or finished[w] < len(stream[w])
    ]
    if stuck:
        raise ScheduleError(
            f"schedule {schedule.name!r} can deadlock on a transport that matches messages by "
            f"order (NCCL): {'; '.join(stuck)}"
        )


def _stuck(w: int, program: list[Step], pc: int, stream: list[tuple[Op, ...]], finished: int) -> str:
    if finished < len(stream):
        return f"worker {w} waits in a batch of {', '.join(_op_text(op) for op in stream[finished][:4])}"
    step = program[pc]
    if step.action is None:
        return f"worker {w} waits for the headers of a batch of {', '.join(_op_text(op) for op in step.ops[:4])}"
    return f"worker {w} waits for the input of {step.action}"


def _op_text(op: Op) -> str:
    what = _text(op.message)
    return f"send {what} to worker {op.dst}" if op.send else f"receive {what} from worker {op.src}"
