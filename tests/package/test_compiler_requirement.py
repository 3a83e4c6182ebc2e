"""``pip install .`` on a host without a working C++17 compiler stops with one line that says what to install.

Each test builds a wheel from a copy of the source tree with ``pip wheel --no-build-isolation
--no-deps --no-index``, as ``pip install .`` would, but with nothing fetched and nothing installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
ADVICE = "fastpipe needs a C++17 compiler (g++ >= 7 or clang >= 5) to build fastpipe._C"


def _source_copy(dest: Path) -> Path:
    """What ``pip install .`` reads from the tree, without any extension already built."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd")
    for folder in ("fastpipe", "kernels", "csrc"):
        shutil.copytree(REPO / folder, dest / folder, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, dest / name)
    return dest


def _pip_wheel(tree: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # With build isolation off, what setup.py imports must be in this environment (the test extra brings it).
    pytest.importorskip("pybind11", reason="building without isolation needs pybind11")
    pytest.importorskip("setuptools", minversion="70.1", reason="building without isolation needs bdist_wheel")
    args = ["-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", "dist", "."]
    run_env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env}
    return subprocess.run([sys.executable, *args], cwd=tree, env=run_env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("compiler", ["/bin/false", "missing"])
def test_a_build_without_a_cxx17_compiler_stops_with_one_line_that_says_what_to_install(
    tmp_path: Path, compiler: str
) -> None:
    # /bin/false: a compiler that fails on everything; "missing": a path with nothing there.
    cc = compiler if compiler != "missing" else str(tmp_path / "no-such-compiler")
    proc = _pip_wheel(_source_copy(tmp_path / "tree"), CC=cc, CXX=cc)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    advice = [line.strip() for line in output.splitlines() if ADVICE in line]
    assert len(advice) == 1, output[-3000:]
    # The whole explanation sits on that one line: the compiler it tried, what to install, what to do next.
    assert repr(cc) in advice[0], advice[0]
    assert "build-essential" in advice[0] and "gcc-c++" in advice[0] and advice[0].endswith("and retry")
    assert not list((tmp_path / "tree" / "dist").glob("*.whl"))


def test_a_working_compiler_that_fails_on_the_sources_shows_its_own_error(tmp_path: Path) -> None:
    compiler = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"needs the C++ compiler this Python was built with ({compiler}), which is not installed")
    tree = _source_copy(tmp_path / "tree")
    # Every translation unit fails at once, so no real compile runs; the compiler itself works.
    for source in (tree / "csrc").glob("*.cpp"):
        source.write_text("#error csrc is broken on purpose\n")
    proc = _pip_wheel(tree)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "csrc is broken on purpose" in output
    assert ADVICE not in output  # the fault is in the sources, not the host: no advice to install a compiler
