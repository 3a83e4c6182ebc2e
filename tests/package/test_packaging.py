"""fastpipe as a new user meets it: run from the clone's root, from elsewhere, and without triton.

Each test starts a fresh Python the way a user would. "Bare" runs use ``python -S``: sys.path
keeps every folder this process has (torch, numpy, and an installed fastpipe if there is one),
but no ``.pth`` file runs, so an editable install's import hook is absent and a source tree is
imported as a clone with nothing installed would be.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastpipe

REPO = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())

# A demo small enough for a test: two steps of a tiny model, no progress bar.
DEMO_ARGS = (
    "--steps 2 --warmup 1 --eval-batches 1 --sample-chars 8 --max-chars 20000 --batch 4 --seq-len 32 --dim 32 "
    "--heads 2 --no-progress"
).split()

# Makes triton unimportable, as on a host where it is not installed; put before any import.
BLOCK_TRITON = textwrap.dedent("""
    import sys

    class NoTriton:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTriton)
""")


def _env(**extra: str) -> dict[str, str]:
    # PYTHONSAFEPATH would keep the working folder off sys.path, which is what these runs are about.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "TRITON_INTERPRET")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _bare_env(*front: Path) -> dict[str, str]:
    """The environment of a ``python -S`` run: this process's sys.path (after ``front``) as PYTHONPATH."""
    paths = [str(p) for p in front] + [p for p in sys.path if p and os.path.isdir(p) and Path(p) != REPO]
    return _env(PYTHONPATH=os.pathsep.join(paths))


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_the_source_tree_imports_fastpipe_kernels_from_the_top_level_folder() -> None:
    code = textwrap.dedent("""
        import json, sys
        import fastpipe
        from fastpipe import kernels
        import fastpipe.kernels.layer_norm
        from fastpipe.kernels import bias_gelu
        from fastpipe.kernels.memory import count_saved_bytes
        print(json.dumps({
            "fastpipe": fastpipe.__file__,
            "kernels": kernels.__file__,
            "layer_norm": fastpipe.kernels.layer_norm.__file__,
            "same": kernels is sys.modules["fastpipe.kernels"] and kernels.layer_norm is fastpipe.kernels.layer_norm,
            "others": sorted({m.__file__ for n, m in sys.modules.items()
                              if n.startswith("fastpipe") and n != "fastpipe._C" and getattr(m, "__file__", None)
                              and not m.__file__.startswith(str(__import__("pathlib").Path.cwd()))}),
        }))
    """)
    found = _last_json(_run(["-S", "-c", code], cwd=REPO, env=_bare_env()).stdout)
    assert Path(found["fastpipe"]) == REPO / "fastpipe" / "__init__.py"
    assert Path(found["kernels"]) == REPO / "kernels" / "__init__.py"
    assert Path(found["layer_norm"]) == REPO / "kernels" / "layer_norm.py"
    assert found["same"]
    # Nothing of fastpipe's Python came from an installed copy; only the compiled extension may,
    # when the tree has none built (`pip install .` builds it into site-packages).
    assert found["others"] == []


def test_demo_runs_from_the_clone_root(tmp_path: Path) -> None:
    _run(["-S", "-m", "fastpipe.demo", *DEMO_ARGS, "--out", str(tmp_path / "demo")], cwd=REPO, env=_bare_env())
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report  # the run got to its report


def test_demo_runs_elsewhere_without_triton(tmp_path: Path) -> None:
    # The importable fastpipe (installed, or this tree through an editable install), run from another folder,
    # with TRITON_INTERPRET=1 set: without triton the demo's model still runs fastpipe.kernels (LayerNorm,
    # MLPBlock, dropout, linear_cross_entropy) on their PyTorch path. tests/kernels/test_import.py checks
    # the ops one by one.
    code = BLOCK_TRITON + textwrap.dedent(f"""
        import json, runpy
        sys.argv = ["fastpipe.demo", *{DEMO_ARGS!r}, "--out", "demo"]
        try:
            runpy.run_module("fastpipe.demo", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            assert not exit.code, exit.code
        import fastpipe, fastpipe.kernels
        print(json.dumps({{"fastpipe": fastpipe.__file__, "kernels": fastpipe.kernels.__file__,
                          "has_triton": fastpipe.kernels.HAS_TRITON, "triton": "triton" in sys.modules}}))
    """)
    found = _last_json(_run(["-c", code], cwd=tmp_path, env=_env(TRITON_INTERPRET="1")).stdout)
    assert (tmp_path / "demo" / "report.json").is_file()
    assert not found["has_triton"] and not found["triton"]
    package = Path(found["fastpipe"]).parent
    # Installed: fastpipe/kernels/; a source tree: the kernels/ folder beside fastpipe/.
    assert Path(found["kernels"]).parent in (package / "kernels", package.parent / "kernels")
    assert Path(found["fastpipe"]) == Path(fastpipe.__file__)  # the same fastpipe this suite tests


def _extension() -> str:
    """The file of the ``fastpipe._C`` this suite runs with."""
    return str(importlib.import_module("fastpipe._C").__file__)


def _copy_tree(dest: Path, version: str) -> Path:
    """A clone of this source tree without the compiled extension, its version set to ``version``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd")
    for folder in ("fastpipe", "kernels"):
        shutil.copytree(REPO / folder, dest / folder, ignore=ignore)
    shutil.copy(REPO / "setup.py", dest / "setup.py")
    init = dest / "fastpipe" / "_version.py"
    text = init.read_text()
    assert f'__version__ = "{fastpipe.__version__}"' in text
    init.write_text(text.replace(f'__version__ = "{fastpipe.__version__}"', f'__version__ = "{version}"'))
    return dest


def test_a_clone_without_the_extension_says_how_to_build_it_or_uses_an_installed_one(tmp_path: Path) -> None:
    # The version marks the copy, so no fastpipe installed in this environment can match it.
    version = "0.0.0+unbuilt"
    clone = _copy_tree(tmp_path / "clone", version)
    built = _extension()
    # An installed fastpipe of the same version, as `pip install .` leaves it in site-packages.
    site = tmp_path / "site"
    (site / "fastpipe").mkdir(parents=True)
    shutil.copy(built, site / "fastpipe" / Path(built).name)
    info = site / f"fastpipe-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fastpipe\nVersion: {version}\n")
    (info / "RECORD").write_text(f"fastpipe/{Path(built).name},,\n")
    code = textwrap.dedent(f"""
        import json, sys
        error = None
        try:  # the engine imports its extension with the package
            import fastpipe
        except ImportError as e:
            error = str(e)
        for name in [n for n in sys.modules if n == "fastpipe" or n.startswith("fastpipe.")]:
            del sys.modules[name]
        sys.path.append({str(site)!r})  # now pip-install it
        import fastpipe, fastpipe._C
        print(json.dumps({{"fastpipe": fastpipe.__file__, "error": error, "extension": fastpipe._C.__file__}}))
    """)
    found = _last_json(_run(["-S", "-c", code], cwd=clone, env=_bare_env()).stdout)
    assert Path(found["fastpipe"]) == clone / "fastpipe" / "__init__.py"
    assert "not built in the source tree" in found["error"] and "pip install ." in found["error"]
    assert Path(found["extension"]).parent == site / "fastpipe"


def test_an_installed_layout_is_left_to_the_ordinary_import_system(tmp_path: Path) -> None:
    # What pip installs: fastpipe/kernels/ inside the package and no setup.py beside it.
    site = tmp_path / "site"
    shutil.copytree(REPO / "fastpipe", site / "fastpipe", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "kernels", site / "fastpipe" / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    if not (site / "fastpipe" / Path(_extension()).name).exists():  # a tree that was installed, not built in place
        shutil.copy(_extension(), site / "fastpipe")
    code = textwrap.dedent("""
        import json, sys
        import fastpipe, fastpipe.kernels, fastpipe._C
        print(json.dumps({"files": [fastpipe.__file__, fastpipe.kernels.__file__, fastpipe._C.__file__],
                          "finders": [type(f).__name__ for f in sys.meta_path]}))
    """)
    found = _last_json(_run(["-S", "-c", code], cwd=tmp_path, env=_bare_env(site)).stdout)
    assert all(Path(f).is_relative_to(site / "fastpipe") for f in found["files"]), found["files"]
    assert "SourceTreeFinder" not in found["finders"]


def _setup_arguments() -> dict:
    """The keywords setup.py passes to ``setuptools.setup`` (run in a subprocess, which builds nothing)."""
    code = textwrap.dedent("""
        import json, runpy, setuptools
        seen = {}
        setuptools.setup = lambda **kwargs: seen.update(kwargs)
        runpy.run_path("setup.py", run_name="__main__")
        print(json.dumps({k: v for k, v in seen.items() if k not in ("ext_modules", "cmdclass")}))
    """)
    return _last_json(_run(["-c", code], cwd=REPO, env=_env()).stdout)


def test_setup_ships_every_subpackage_py_typed_and_the_metadata() -> None:
    args = _setup_arguments()

    def packages_under(folder: str, prefix: str = "") -> set[str]:
        return {prefix + ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / folder).rglob("__init__.py")}

    on_disk = packages_under("fastpipe") | packages_under("kernels", prefix="fastpipe.")
    assert set(args["packages"]) == on_disk  # found, not listed: a new subpackage ships without an edit
    assert args["package_dir"] == {"fastpipe.kernels": "kernels"}
    assert "py.typed" in args["package_data"]["fastpipe"] and (REPO / "fastpipe" / "py.typed").is_file()
    assert args["license"] == "MIT" and args["author"]
    assert args["long_description"] == (REPO / "README.md").read_text(encoding="utf-8")
    assert args["long_description_content_type"] == "text/markdown"
    assert "Typing :: Typed" in args["classifiers"]


def test_triton_is_an_extra_that_the_test_extra_brings() -> None:
    args = _setup_arguments()
    extras = args["extras_require"]
    assert not [r for r in args["install_requires"] if r.startswith("triton")]
    assert any(r.startswith("triton") for r in extras["triton"])
    assert set(extras["triton"]) <= set(extras["test"])
    # `fastpipe train` (its corpus) and the distributed wire format need numpy without triton.
    assert "numpy" in args["install_requires"]


def _name(requirement: str) -> str:
    """The project name a requirement string names (``"torch>=2.11"`` -> ``"torch"``)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def test_no_extra_repeats_a_required_dependency() -> None:
    args = _setup_arguments()
    required = {_name(r) for r in args["install_requires"]}
    repeated = {extra: sorted(required & {_name(r) for r in reqs}) for extra, reqs in args["extras_require"].items()}
    assert not any(repeated.values()), f"extras that repeat install_requires: {repeated}"


def test_the_test_extra_brings_what_building_without_isolation_needs() -> None:
    # tests/package/test_compiler_requirement.py runs setup.py with --no-build-isolation, so the
    # test environment itself must hold what setup.py imports.
    test_extra = {_name(r) for r in _setup_arguments()["extras_require"]["test"]}
    assert {"pybind11", "setuptools"} <= test_extra


def test_the_classifiers_name_every_python_from_python_requires_through_3_13() -> None:
    args = _setup_arguments()
    floor = re.fullmatch(r">=3\.(\d+)", args["python_requires"])
    assert floor, args["python_requires"]
    named = {
        c.rsplit(" :: ", 1)[1] for c in args["classifiers"] if c.startswith("Programming Language :: Python :: 3.")
    }
    assert named == {f"3.{minor}" for minor in range(int(floor.group(1)), 14)}


def test_py_typed_gives_mypy_the_types_of_an_installed_fastpipe(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    # An installed layout made of links into this tree (fastpipe/, with kernels/ as fastpipe/kernels).
    site = tmp_path / "site" / "fastpipe"
    site.mkdir(parents=True)
    for entry in (REPO / "fastpipe").iterdir():
        (site / entry.name).symlink_to(entry)
    (site / "kernels").symlink_to(REPO / "kernels")
    use = [
        "import fastpipe",
        "import fastpipe.kernels",
        "reveal_type(fastpipe.Pipe)",
        "reveal_type(fastpipe.kernels.LayerNorm)",
    ]
    (tmp_path / "use.py").write_text("\n".join(use) + "\n")
    # torch's own hints are not what this checks; skipping them keeps the run to seconds.
    (tmp_path / "mypy.ini").write_text("[mypy]\n[mypy-torch.*]\nfollow_imports = skip\n")
    mypy = ["-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", os.devnull, "--python-executable", sys.executable]
    env = _env(PYTHONPATH=str(tmp_path / "site"))
    proc = subprocess.run(
        [sys.executable, *mypy, "use.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    revealed = [line for line in proc.stdout.splitlines() if "Revealed type" in line]
    assert len(revealed) == 2, proc.stdout + proc.stderr
    assert "fastpipe.pipe.Pipe" in revealed[0] and "LayerNorm" in revealed[1], revealed
    assert "missing library stubs or py.typed" not in proc.stdout
