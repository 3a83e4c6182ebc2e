"""The search of the largest-model benchmark: the largest size whose measured peak fits, by doubling then bisection.

Pure logic over a ``measure(n) -> Point`` callable, so it is tested on a fake measure and run,
in :mod:`fastpipe.bench.largest_ranks`, on real steps. The peak is taken to grow with the size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Point", "Search", "best_of", "search_largest"]


@dataclass(frozen=True)
class Point:
    """One measured size.

    Attributes:
        n: the size (blocks, or width in units).
        peaks: each rank's peak bytes in the step.
        seconds: the step's time; None where it was not timed (the first step already ran over).
        predicted: each rank's peak as the memory model predicts it; None where no model runs.
        refused: why the system refused the size before any step (fastpipe's planner: nothing fits
            its prediction); ``peaks`` is then empty.
    """

    n: int
    peaks: list[int]
    seconds: float | None
    predicted: list[int] | None = None
    refused: str = ""

    def fits(self, budget: int) -> bool:
        """Whether every rank's peak is within ``budget`` bytes (a refused size does not fit)."""
        return not self.refused and max(self.peaks) <= budget

    def to_dict(self, budget: int) -> dict[str, object]:
        """A JSON-serialisable copy, with whether it fits ``budget``."""
        out: dict[str, object] = {"n": self.n, "peaks": list(self.peaks), "seconds": self.seconds}
        return dict(out, predicted=self.predicted, fits=self.fits(budget), refused=self.refused)


@dataclass(frozen=True)
class Search:
    """What :func:`search_largest` found.

    Attributes:
        largest: the largest size that fits, None if none in the range does.
        points: every size measured, in order.
    """

    largest: int | None
    points: list[Point]


def search_largest(
    measure: Callable[[int], Point], budget: int, *, start: int, floor: int = 1, cap: int | None = None
) -> Search:
    """The largest size in ``[floor, cap]`` whose measured peak fits ``budget``: doubling, then bisection.

    From ``start`` the size doubles while it fits (it halves while it does not, down to
    ``floor``), which brackets the answer between a size that fits and one that does not;
    bisection then closes the bracket. About ``2 log2(answer / start)`` sizes are measured.

    Args:
        measure: the peak bytes of a step at a size.
        budget: the bytes each rank may hold.
        start: the first size measured.
        floor: the smallest size worth reporting; the result is None when it does not fit.
        cap: the largest size measured (reported when it fits); None for no cap.

    Raises:
        ValueError: unless ``1 <= floor <= start``, and ``start <= cap`` where capped.
    """
    if floor < 1 or start < floor or (cap is not None and start > cap):
        raise ValueError(
            f"search_largest needs 1 <= floor <= start <= cap; got floor={floor}, start={start}, cap={cap}"
        )
    points: list[Point] = []

    def fits(n: int) -> bool:
        point = measure(n)
        points.append(point)
        return point.fits(budget)

    # Invariant: lo fits (or is floor - 1: none known to), hi does not (or is cap + 1, or None: unbounded).
    lo, hi = floor - 1, (cap + 1 if cap is not None else None)
    if fits(start):
        lo = start
        while hi is None or hi - lo > 1:
            n = 2 * lo if hi is None else min(2 * lo, hi - 1)
            if not fits(n):
                hi = n
                break
            lo = n
    else:
        hi = start
        while hi > floor:
            n = max(floor, hi // 2)
            if fits(n):
                lo = n
                break
            hi = n
    assert hi is not None
    while hi - lo > 1:
        n = (lo + hi) // 2
        if fits(n):
            lo = n
        else:
            hi = n
    return Search(lo if lo >= floor else None, points)


def best_of(
    measures: Sequence[Callable[[int], Point]], budget: int, *, start: int, floor: int = 1, cap: int | None = None
) -> tuple[int | None, int | None]:
    """The configuration that fits the largest size, the faster one at a tie: ``(index, size)``.

    The first configuration is searched over ``[floor, cap]``; each later one only from one size
    above the best so far (all it could add), and where that does not fit, it is timed at the
    best size so that a tie goes to the faster step. ``(None, None)`` when none fits at ``floor``.
    """
    best: tuple[int | None, int | None, float] = (None, None, float("inf"))  # index, size, seconds

    for i, measure in enumerate(measures):
        index, size, seconds = best
        if size is None:
            found = search_largest(measure, budget, start=max(start, floor), floor=floor, cap=cap)
        elif cap is not None and size >= cap:
            found = Search(None, [])
        else:
            found = search_largest(measure, budget, start=size + 1, floor=size + 1, cap=cap)
        if found.largest is not None:
            top = next(p for p in found.points if p.n == found.largest)
            best = (i, found.largest, top.seconds if top.seconds is not None else float("inf"))
        elif size is not None:
            tie = measure(size)
            if tie.fits(budget) and tie.seconds is not None and tie.seconds < seconds:
                best = (i, size, tie.seconds)
    return best[0], best[1]
