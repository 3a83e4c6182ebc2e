"""Near-zero-bubble schedules: ZB-H2, ZB-V (Qi et al. 2023/2024) and DualPipeV (DeepSeek 2024).

Each builder returns per-worker action lists for :func:`fastpipe.schedule.builders.build`, which validates
them. The backward is split into ``B`` (input gradient, on the critical path) and ``W`` (weight gradient,
free to move), and the ``W`` s fill the slots where 1F1B waits.
"""

from __future__ import annotations

from fastpipe.schedule.ir import Action, ScheduleError

__all__ = ["dualpipev", "zb_h2", "zb_v"]


def zb_h2(k: int, m: int) -> list[list[Action]]:
    """ZB-H2: one stage per worker, a parallelogram without bubbles inside it, at about twice 1F1B's memory.

    Worker ``w`` starts with ``2(K-1-w) + 1`` forwards (1F1B: ``K-1-w``), so that its first ``B`` arrives just
    as its warm-up ends. Then, at each slot, it runs the first of: a ``B`` whose gradient has arrived, a
    forward (while fewer than ``2(K-w) - 1`` micro-batches are in flight), a deferred ``W``. With unit costs
    (F = B = W) this gives ``3M`` busy slots on every worker, from slot ``w`` to slot ``w + 3M``: the only
    idle time is the triangle before each worker's first forward and after its last ``W``, which
    consecutive steps would overlap (the zero-bubble paper's count), and no worker waits inside its span.
    The order is derived once for unit costs; other costs keep it (it stays valid), not its optimality.
    ::

        K=2, M=4   w0: 0F0 0F1 0F2 0B0 0F3 0B1 0W0 0B2 0W1 0B3 0W2 0W3
                   w1:     1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1W0 1W1 1W2 1W3

    Constraints: any ``K >= 1`` and ``M >= 1``; the span is bubble-free when ``M >= 2K - 1``.
    """
    limits = [min(2 * (k - w) - 1, m) for w in range(k)]
    return _unit_greedy(k, m, tuple(range(k)), limits)


def _unit_greedy(k: int, m: int, placement: tuple[int, ...], limits: list[int]) -> list[list[Action]]:
    """Orders every worker's F, B and W slot by slot for unit costs: B first, then F under ``limits``, then W.

    A slot's action may use results of earlier slots only (one slot's latency per hop, as in the
    simulator with unit costs and no link delay). This derives a fixed order; it is not a search.
    """
    stages = len(placement)
    held = [[s for s in range(stages) if placement[s] == w] for w in range(k)]
    done: dict[Action, int] = {}  # action -> slot in which it finished
    next_f = [0] * stages
    next_b = [0] * stages
    waiting_w: list[list[Action]] = [[] for _ in range(k)]
    in_flight = [0] * k
    order: list[list[Action]] = [[] for _ in range(k)]
    total = 3 * m * stages
    slot = 0
    while len(done) < total:
        chosen: list[Action | None] = []
        for w in range(k):
            pick: Action | None = None
            # B: the latest stage first (it frees the most downstream work), once its gradient is in.
            for s in sorted(held[w], reverse=True):
                i = next_b[s]
                if i < next_f[s] and _ready(Action("B", s, i), done, slot, stages):
                    pick = Action("B", s, i)
                    break
            if pick is None and in_flight[w] < limits[w]:
                for s in held[w]:
                    i = next_f[s]
                    if i < m and _ready(Action("F", s, i), done, slot, stages):
                        pick = Action("F", s, i)
                        break
            if pick is None and waiting_w[w]:
                pick = waiting_w[w].pop(0)
            chosen.append(pick)
        if all(a is None for a in chosen):
            if slot > 4 * total + 8:
                raise ScheduleError("internal: the unit-cost order stalls")  # pragma: no cover
            slot += 1
            continue
        for w, a in enumerate(chosen):
            if a is None:
                continue
            order[w].append(a)
            done[a] = slot
            if a.kind == "F":
                next_f[a.stage] += 1
                in_flight[w] += 1
            elif a.kind == "B":
                next_b[a.stage] += 1
                in_flight[w] -= 1
                waiting_w[w].append(Action("W", a.stage, a.microbatch))
        slot += 1
    return order


def _ready(a: Action, done: dict[Action, int], slot: int, stages: int) -> bool:
    if a.kind == "F":
        dep = Action("F", a.stage - 1, a.microbatch) if a.stage > 0 else None
        return dep is None or done.get(dep, slot) < slot
    own = done.get(Action("F", a.stage, a.microbatch), slot) < slot
    if a.stage == stages - 1:
        return own
    return own and done.get(Action("B", a.stage + 1, a.microbatch), slot) < slot


def zb_v(k: int, m: int) -> list[list[Action]]:
    """ZB-V: 2K stages in a V (stages ``w`` and ``2K-1-w`` on worker ``w``), zero bubble at 1F1B's memory.

    The zero-bubble paper's V schedule (arXiv 2401.10241, section 6; 2405.15362). Worker ``w`` warms up with
    ``2(K-w) - 1`` forwards of its first stage, then ``w`` pairs of forwards of both stages, then ``K - w``
    rounds of F, B, W on its second stage. In the steady state each round is F, B, W on the first stage and
    F, B, W on the second. The cool-down runs the B's first (W deferred) so the input gradients reach
    worker 0 early, and the deferred W's fill the tail. Each worker then holds at most ``2K`` stage
    activations of half a 1F1B stage each, i.e. 1F1B's memory, and with unit costs no worker waits after
    its first forward.
    ::

        K=2, M=4   w0 (stages 0, 3): 0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 ...
                   w1 (stages 1, 2): 1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 ...

    Constraints: exactly 2 stages per worker (2K stages); any ``K >= 1`` and ``M >= 1``. The order is built
    for ``max(M, 2K - 1)`` micro-batches and those past ``M`` dropped, so with ``M < 2K - 1`` the V is not
    full and bubbles remain; from ``M >= 2K - 1`` no worker waits inside its span (unit costs).
    """
    n = max(2 * k - 1, m)  # build as if for enough micro-batches, then drop those past m
    return [[a for a in _zb_v_worker(k, n, w) if a.microbatch < m] for w in range(k)]


def _zb_v_worker(k: int, n: int, w: int) -> list[Action]:
    first, second = w, 2 * k - 1 - w
    f = {first: 0, second: 0}  # next forward per stage
    b = {first: 0, second: 0}  # next B per stage
    done_w = {first: 0, second: 0}  # next W per stage
    ops: list[Action] = []

    def step(kind: str, stage: int, counter: dict[int, int]) -> None:
        ops.append(Action(kind, stage, counter[stage]))
        counter[stage] += 1

    def fbw(stage: int, forward: bool = True) -> None:
        if forward:
            step("F", stage, f)
        step("B", stage, b)
        step("W", stage, done_w)

    for _ in range(2 * (k - w) - 1):
        step("F", first, f)
    for _ in range(w):
        step("F", second, f)
        step("F", first, f)
    for _ in range(k - w):
        fbw(second)
    while f[second] < f[first] or f[first] < n:
        fbw(first, forward=f[first] < n)
        fbw(second)
    # Cool-down: B's first, so that the input gradients reach worker 0 early; the W's fill the tail.
    for _ in range(w):
        step("B", first, b)
        step("B", second, b)
    for _ in range(k - w):
        step("B", first, b)
        step("W", first, done_w)
    for stage in (second, first):
        while done_w[stage] < b[stage]:
            step("W", stage, done_w)
    return ops


def dualpipev(k: int, m: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek 2024): DualPipe's bidirectional order folded onto K workers in a V.

    Stages ``w`` and ``2K-1-w`` on worker ``w``. After a warm-up of ``2(K-1-w)`` forwards of the first stage
    and ``w + 1`` pairs of forwards of both, the steady state pairs a forward of one stage with a combined
    backward (``BW``) of the other: DualPipe's "overlapped F&B pairs", whose compute and communication
    overlap on GPUs with separate streams. On fastpipe's runtimes a worker runs one action at a time, so a
    pair is two adjacent actions, ``F`` then ``BW``; what remains of DualPipe here is the order. The last
    ``K`` rounds split backwards into ``B`` and ``W`` and run the W's last, as DualPipeV does, to fill the
    tail. The bubble is DualPipeV's ``(K/2 - 1)(F&B + B - 3W)`` on hardware that overlaps the pairs.

    Constraints: exactly 2 stages per worker (2K stages), ``K >= 1`` and ``M >= 2K`` (DualPipeV's: at
    least as many micro-batches as stages; its warm-up alone runs ``2K - 1`` forwards on worker 0).
    """
    if m < 2 * k:
        raise ScheduleError(
            f"dualpipev needs at least as many micro-batches as stages: {2 * k} for {k} workers "
            f"({2 * k} stages in a V), got {m}"
        )
    return [_dualpipev_worker(k, m, w) for w in range(k)]


def _dualpipev_worker(k: int, m: int, w: int) -> list[Action]:
    first, second = w, 2 * k - 1 - w
    f = {first: 0, second: 0}
    b = {first: 0, second: 0}
    deferred: list[Action] = []
    ops: list[Action] = []

    def forward(stage: int) -> None:
        ops.append(Action("F", stage, f[stage]))
        f[stage] += 1

    def backward(stage: int, split: bool) -> None:
        i = b[stage]
        b[stage] += 1
        if split:
            ops.append(Action("B", stage, i))
            deferred.append(Action("W", stage, i))
        else:
            ops.append(Action("BW", stage, i))

    def weight() -> None:
        if deferred:
            ops.append(deferred.pop(0))

    for _ in range(2 * (k - w - 1)):
        forward(first)
    for _ in range(w + 1):
        forward(first)
        forward(second)
    for _ in range(k - w - 1):
        backward(second, split=True)
        weight()
        forward(second)
    for _ in range(m - 2 * k + w + 1):
        forward(first)  # the pair F(first) & BW(second), as adjacent actions
        backward(second, split=False)
        forward(second)  # the pair F(second) & BW(first)
        backward(first, split=False)
    for _ in range(k - w - 1):
        backward(second, split=False)
        forward(second)
        backward(first, split=False)
    # The last w + 1 rounds of backwards: from the middle one on, split B/W and defer the W's.
    split = False
    for i in range(w + 1):
        if i == (w + 1) // 2 and w % 2 == 1:
            split = True
        backward(second, split)
        if i == (w + 1) // 2 and w % 2 == 0:
            split = True
        backward(first, split)
    for _ in range(k - w - 1):
        weight()
        backward(first, split)
    while deferred:
        weight()
    return ops
