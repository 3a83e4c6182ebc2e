"""transformers is an optional extra, ``.[hf]``, that the test extra brings so CI runs tests/hf."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())


def _extras() -> tuple[list[str], dict[str, list[str]]]:
    code = textwrap.dedent("""
        import json, runpy, setuptools
        seen = {}
        setuptools.setup = lambda **kwargs: seen.update(kwargs)
        runpy.run_path("setup.py", run_name="__main__")
        print(json.dumps([seen["install_requires"], seen["extras_require"]]))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    requires, extras = json.loads(out.strip().splitlines()[-1])
    return requires, extras


def test_transformers_is_the_hf_extra_and_part_of_the_test_extra() -> None:
    requires, extras = _extras()
    assert extras["hf"] == ["transformers>=5.17,<6"]
    assert set(extras["hf"]) <= set(extras["test"])
    assert not [r for r in requires if r.startswith("transformers")]  # plain installs stay without it
    # transformers imports torchvision when present, and the CPU hosts get only CUDA wheels of it.
    assert not [r for group in (requires, *extras.values()) for r in group if r.startswith("torchvision")]


def test_the_install_hint_names_the_checkout_not_the_unrelated_fastpipe_on_the_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fastpipe`` on the public index is another project, without an ``hf`` extra."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r'pip install "\.\[hf\]" in your fastpipe checkout'):
        runpy.run_path(str(REPO / "fastpipe" / "hf" / "__init__.py"))
