"""A schedule's digest, the same in every process for the same schedule, for ranks to compare theirs."""

from __future__ import annotations

import hashlib

from fastpipe.schedule.ir import Schedule

__all__ = ["schedule_digest"]


def schedule_digest(schedule: Schedule | None) -> int:
    """A 56-bit digest of everything in ``schedule`` (0 for None).

    Built from the dataclass's ``repr``, which lists every field and action; Python's own
    ``hash`` of strings differs between processes.
    """
    if schedule is None:
        return 0
    return int.from_bytes(hashlib.blake2b(repr(schedule).encode(), digest_size=7).digest(), "big") or 1
