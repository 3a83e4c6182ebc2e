"""Writing a benchmark's result file (shared by the scripts in bench/)."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(result: Any, path: str | None) -> None:
    """Write ``result`` to ``path`` as indented JSON, creating its folder; nothing when ``path`` is None."""
    if path is None:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
