"""Install advice points at a fastpipe checkout: the package named fastpipe on the public index is
another project (an ETL library without an ``hf`` extra), so ``pip install "fastpipe[...]"`` would
install the wrong thing."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from fastpipe.train.models import HF_MODELS, check_model

REPO = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
FROM_THE_INDEX = re.compile(r"pip install[^\n]*\bfastpipe\[")


def test_a_missing_transformers_names_the_checkout_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fastpipe.hf", None)  # its import now raises ImportError
    message = check_model(sorted(HF_MODELS)[0])
    assert message is not None
    assert 'pip install ".[hf]" in your fastpipe checkout' in message
    assert "fastpipe[" not in message


def test_no_source_advises_installing_fastpipe_from_the_index() -> None:
    sources = [p for folder in ("fastpipe", "kernels", "bench") for p in (REPO / folder).rglob("*") if p.is_file()]
    advising = [
        str(p.relative_to(REPO))
        for p in sources
        if p.suffix in {".py", ".md", ".sh", ".txt", ".toml"} and FROM_THE_INDEX.search(p.read_text(errors="replace"))
    ]
    assert not advising, f'install from a checkout (pip install ".[hf]"), not the index, in: {advising}'
