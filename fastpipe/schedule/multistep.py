"""Multi-step schedules: several mini-batches in one schedule, with weight updates inside it.

A one-step schedule (``gpipe``, ``1f1b``, ...) ends with a flush: every stage waits for the
last backward before the caller's ``optimizer.step()``. A *multi-step* schedule runs N mini-batches of M
micro-batches each and gives every (stage, mini-batch) an update action ``U``; micro-batch
``m`` belongs to mini-batch ``m // M``. Its text form is ``0U1`` (stage 0 applies the update
of mini-batch 1). Two orders of the same actions:

* ``flush=True`` (synchronous): N one-step 1F1B schedules back to back, ``U(s, n)`` right
  after the stage's last backward of mini-batch n, and every forward of mini-batch n + 1
  waiting for it. Each mini-batch pays the fill-and-drain bubble (K - 1)(F + B).
* ``flush=False`` (asynchronous, PipeDream / XPipe): one 1F1B over all N·M micro-batches,
  with ``U(s, n)`` still right after the stage's last backward of mini-batch n. Forwards of
  mini-batch n + 1 run while mini-batch n drains, on weights that miss the updates still
  to come; the bubble is paid once per schedule, so the steady-state gain is (M + K - 1)/M.

::

    K=2, M=2, no flush   w0: F0 F1 BW0 F2 BW1 U0 F3 BW2 F4 BW3 U1 ...
                         w1: F0 BW0 F1 BW1 U0 F2 BW2 F3 BW3 U1 ...

(Asynchronous training, :mod:`fastpipe.asynchronous`, runs these.) :func:`update_lag` reads
from such a schedule how many updates land between a micro-batch's
forward and the update that consumes its gradient (the ``s`` of weight prediction), and
:func:`weight_versions` how many old or predicted weight copies a stage holds at most.
"""

from __future__ import annotations

import functools

from fastpipe.schedule.builders import build_for
from fastpipe.schedule.ir import Action, Schedule, ScheduleError
from fastpipe.schedule.simulate import simulate_times

__all__ = ["build_multistep", "update_lag", "weight_versions", "steady_state_time"]


@functools.lru_cache(maxsize=64)
def build_multistep(
    stages: int, microbatches: int, minibatches: int, flush: bool = False, workers: int | None = None
) -> Schedule:
    """A 1F1B multi-step schedule of ``minibatches`` mini-batches of ``microbatches`` micro-batches each.

    Args:
        stages: pipeline stages.
        microbatches: micro-batches per mini-batch M (per weight update).
        minibatches: mini-batches N in the schedule.
        flush: synchronous (True) or asynchronous (False); see the module docstring.
        workers: workers K (default one per stage). Fewer workers than stages means virtual
            stages, stage s on worker s % K, ordered by Megatron's interleaved 1F1B; its
            constraint applies to the micro-batches it orders: M (flushed) or N·M (not)
            must be a multiple of K.

    Returns:
        A validated schedule named ``"1f1b-async"`` or ``"1f1b-flush"`` (``"interleaved-…"``
        with virtual stages). ``U(s, n)`` follows stage s's last backward of mini-batch n on
        its worker.

    Raises:
        ScheduleError: an argument is not a positive integer, the stages do not spread
            evenly over the workers, or the interleaved constraint fails.
    """
    for name, value in (
        ("stages", stages),
        ("microbatches", microbatches),
        ("minibatches", minibatches),
        ("workers", stages if workers is None else workers),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be an integer >= 1, got {value!r}")
    k = stages if workers is None else workers
    kind = "1f1b" if k == stages else "interleaved"
    m = microbatches
    ordered = m if flush else m * minibatches
    if kind == "interleaved" and stages % k == 0 and ordered % k:
        count = f"M = {m}" if flush else f"N·M = {minibatches}·{m}"
        raise ScheduleError(
            f"{stages} stages on {k} workers (virtual stages) are ordered by the interleaved 1F1B, which needs "
            f"a multiple of {k} micro-batches; this schedule has {count}. Use chunks that are a multiple of {k}, "
            "and mini-batches of at least chunks rows (e.g. drop_last=True in the DataLoader)"
        )
    one = build_for(kind, stages, k, ordered).workers
    out_workers = []
    for w in range(k):
        actions = (
            [Action(x.kind, x.stage, x.microbatch + n * m) for n in range(minibatches) for x in one[w]]
            if flush
            else one[w]
        )
        out: list[Action] = []
        done: dict[tuple[int, int], int] = {}  # (stage, mini-batch) -> its backwards run so far
        for a in actions:
            out.append(a)
            if a.kind == "BW":
                key = (a.stage, a.microbatch // m)
                done[key] = done.get(key, 0) + 1
                if done[key] == m:
                    out.append(Action("U", a.stage, a.microbatch // m))
        out_workers.append(out)
    label = "1f1b" if kind == "1f1b" else "interleaved"
    schedule = Schedule(
        f"{label}-flush" if flush else f"{label}-async",
        stages,
        m * minibatches,
        k,
        tuple(tuple(w) for w in out_workers),
        minibatch_size=m,
        flush=flush,
    )
    schedule.validate()
    return schedule


def update_lag(schedule: Schedule) -> dict[tuple[int, int], int]:
    """Per ``(stage, micro-batch)``, the updates its stage applies between the micro-batch's
    forward and the update that consumes its gradient (that update excluded).

    This is the ``s`` of XPipe's weight prediction (Guan et al. 2019, arXiv 1911.04610):
    the gradient of micro-batch m is applied to the weights W_{t+s}, where W_t are the
    weights its forward would see, so the forward should run on a prediction of W_{t+s}.
    It is read from the stage's action list, not from a formula per rank, so any multi-step
    order gets its own lags. A flushed schedule has lag 0 everywhere.

    Raises:
        ScheduleError: ``schedule`` is not a multi-step schedule (no ``U`` actions).
    """
    if not schedule.minibatch_size:
        raise ScheduleError(f"{schedule.name!r} is not a multi-step schedule; it has no update actions")
    size = schedule.minibatch_size
    lag: dict[tuple[int, int], int] = {}
    for actions in schedule.workers:
        applied: dict[int, int] = {}  # per stage: updates applied so far along this worker's list
        seen_at: dict[tuple[int, int], int] = {}
        for a in actions:
            if a.kind == "F":
                seen_at[(a.stage, a.microbatch)] = applied.get(a.stage, 0)
            elif a.kind == "U":
                # U(s, n) is the (applied)-th update of stage s; it consumes mini-batch n.
                done = applied.get(a.stage, 0)
                for m in range(a.microbatch * size, (a.microbatch + 1) * size):
                    lag[(a.stage, m)] = done - seen_at[(a.stage, m)]
                applied[a.stage] = done + 1
    return lag


def weight_versions(schedule: Schedule) -> dict[str, list[int]]:
    """Per policy, per stage: the most weight copies held at once besides the live weights.

    * ``"stash"``: one copy per version that an update superseded while a micro-batch that
      ran its forward on it still awaits its backward (PipeDream's weight stashing; with the
      live weights at most K versions);
    * ``"predict"``: one prediction per (version seen, mini-batch) among the micro-batches in
      flight with a lag > 0 (:func:`update_lag`; with lag 0 no update lands between a
      forward and its backward, so the live weights serve);
    * ``"sync"`` and ``"stale"``: none.

    A copy lives until the last backward that reads it.
    """
    lags = update_lag(schedule)
    size = schedule.minibatch_size
    peaks = {"stash": [0] * schedule.num_stages, "predict": [0] * schedule.num_stages}
    for actions in schedule.workers:
        version: dict[int, int] = {}
        alive: dict[str, dict[tuple[int, ...], set[int]]] = {"stash": {}, "predict": {}}
        for a in actions:
            s, m = a.stage, a.microbatch
            t = version.get(s, 0)
            if a.kind == "F":
                alive["stash"].setdefault((s, t), set()).add(m)
                if lags[(s, m)]:
                    alive["predict"].setdefault((s, t, m // size), set()).add(m)
            elif a.kind in ("BW", "W"):
                for table in alive.values():
                    for key in [k for k, users in table.items() if k[0] == s and m in users]:
                        table[key].discard(m)
                        if not table[key]:
                            del table[key]
            elif a.kind == "U":
                version[s] = version.get(s, 0) + 1
            now = version.get(s, 0)
            peaks["stash"][s] = max(peaks["stash"][s], sum(1 for k in alive["stash"] if k[0] == s and k[1] < now))
            peaks["predict"][s] = max(peaks["predict"][s], sum(1 for k in alive["predict"] if k[0] == s))
    zeros = [0] * schedule.num_stages
    return {"sync": zeros, "stale": list(zeros), **peaks}


def steady_state_time(
    stages: int, microbatches: int, flush: bool, forward: float = 1.0, backward: float = 2.0, minibatches: int = 16
) -> float:
    """Simulated time per mini-batch in steady state (the fill and drain of the schedule excluded).

    It is the slope of the makespan over the number of mini-batches: (T(2N) - T(N)) / N.
    """

    def makespan(n: int) -> float:
        times = simulate_times(
            build_multistep(stages, microbatches, n, flush), forward=forward, backward=backward, weight=0.0
        )
        return max(end for _, _, end in times.values())

    return (makespan(2 * minibatches) - makespan(minibatches)) / minibatches
