"""The repository stays small to clone: no tracked file over 500 kB except the committed result charts.

Sizes are read from the git index (the blobs a commit would hold), so a large file that is
staged counts even before it is committed, and one already removed with ``git rm`` does not.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
MAX_BYTES = 500_000
# bench/RESULTS.md shows these charts; each is a measured result, not something a build makes.
ALLOWED = "bench/results/*.png"


def _git(*args: str) -> str:
    proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _tracked_sizes() -> dict[str, int]:
    """``{path: bytes}`` of every blob in the index of the checkout that holds this tree."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed, so the tracked files cannot be listed")
    probe = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0 or Path(probe.stdout.strip()).resolve() != REPO.resolve():
        pytest.skip(f"{REPO} is not the root of a git checkout (an unpacked sdist?), so nothing is tracked")
    # "<mode> <blob> <stage>\t<path>" per file; submodules (mode 160000) hold no blob of ours.
    entries = [line.split("\t", 1) for line in _git("ls-files", "-s", "-z").split("\0") if line]
    blobs = {path: meta.split()[1] for meta, path in entries if not meta.startswith("160000")}
    sizes = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "--batch-check=%(objectsize)"],
        input="\n".join(blobs.values()) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sizes.returncode == 0, sizes.stderr
    return dict(zip(blobs, map(int, sizes.stdout.split()), strict=True))


def test_no_tracked_file_but_the_result_charts_exceeds_500_kb() -> None:
    sizes = _tracked_sizes()
    assert "setup.py" in sizes  # the listing is of this tree
    too_big = {p: n for p, n in sizes.items() if n > MAX_BYTES and not PurePosixPath(p).match(ALLOWED)}
    assert not too_big, (
        f"tracked files over {MAX_BYTES // 1000} kB: {too_big}. Keep build outputs, wheels and data out of git "
        f"(git rm --cached <file>, and add it to .gitignore); only {ALLOWED} may be larger."
    )
