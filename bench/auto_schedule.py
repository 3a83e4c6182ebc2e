"""The schedule search on random per-stage costs: how often, and by how much, it beats the named schedules.

Computed, no machine dependence. For each of ``--cases`` seeded draws (K workers in 2..8, M in K..4K,
F and B per stage uniform in 0.5..2, W in 0..2, links in 0..0.5) it prints the search's time over
the best named schedule's with one stage per worker, and the greedy scheduler's alone over
ZB-H1's, with no limit and under 1F1B's memory (K activations per worker)::

    python bench/auto_schedule.py --cases 200 --seed 0
"""

from __future__ import annotations

import argparse
import random
import statistics

from fastpipe.schedule import SCHEDULES, ScheduleError, build, simulate
from fastpipe.schedule.search import StageCosts, search


def _draw(rng: random.Random) -> tuple[StageCosts, int]:
    k = rng.randint(2, 8)
    m = rng.randint(k, 4 * k)
    costs = StageCosts.uniform(
        k,
        [rng.uniform(0.5, 2.0) for _ in range(k)],
        [rng.uniform(0.5, 2.0) for _ in range(k)],
        [rng.uniform(0.0, 2.0) for _ in range(k)],
        [rng.uniform(0.0, 0.5) for _ in range(k - 1)],
    )
    return costs, m


def _named_best(costs: StageCosts, m: int, limit: float | None) -> tuple[float, float]:
    """The best named schedule's time (one stage per worker, within the limit) and ZB-H1's."""
    times = {}
    for name in SCHEDULES:
        try:
            schedule = build(name, costs.num_stages, m)
        except ScheduleError:
            continue
        if schedule.num_stages != costs.num_stages:  # the V schedules: 2 stages per worker
            continue
        timeline = simulate(schedule, costs.forward, costs.backward, costs.weight, costs.comm)
        if limit is None or max(timeline.peak_activations) <= limit:
            times[name] = timeline.makespan
    return min(times.values()), times["zb-h1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    problems = [_draw(rng) for _ in range(args.cases)]
    print("| limit | auto / best named: median | min | max | cases faster | greedy / zb-h1: median | max |")
    print("|---|---|---|---|---|---|---|")
    for label in ("none", "1F1B's (K)"):
        auto, greedy = [], []
        for costs, m in problems:
            limit = None if label == "none" else float(costs.num_stages)
            choice = search(costs, costs.num_stages, m, memory_limit=limit)
            best, zb = _named_best(costs, m, limit)
            auto.append(choice.chosen.time / best)
            greedy.append(next(c.time for c in choice.candidates if c.name == "greedy") / zb)
        faster = sum(a < 1 - 1e-9 for a in auto) / len(auto)
        print(
            f"| {label} | {statistics.median(auto):.3f} | {min(auto):.3f} | {max(auto):.3f} | {faster:.0%} | "
            f"{statistics.median(greedy):.3f} | {max(greedy):.3f} |"
        )


if __name__ == "__main__":
    main()
