"""matplotlib for the charts fastpipe writes (timelines, loss curves, bench figures): files only.

The Agg backend draws into files without a display, so charts work on headless training hosts
and under CI; a missing matplotlib gets an error that says how to install it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("fastpipe draws its charts with matplotlib: pip install matplotlib") from exc
    return plt
