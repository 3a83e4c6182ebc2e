"""The ``fastpipe`` command as a first run meets it: its version, help with defaults, plain error messages."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastpipe
from fastpipe.cli import build_parser, main

# A console script's sys.path[0] is its own folder, never the current directory: drop '' (which
# `python -c` puts first) so the subprocess sees sys.path as `fastpipe` from a shell does.
_AS_CONSOLE_SCRIPT = (
    "import sys; sys.path = [p for p in sys.path if p not in ('', '.')]; "
    "from fastpipe.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    # argparse keeps subparsers in a private action; there is no public way to list them.
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out.strip()
    assert shown == f"fastpipe {fastpipe.__version__}" == f"fastpipe {importlib.metadata.version('fastpipe')}"


@pytest.mark.parametrize(
    "command, shown",
    [
        ("plan", ["as fastpipe train and Pipe take it (default: 1f1b)", "(default: float32)"]),
        ("train", ["(default: 1f1b)", "(default: fastpipe-train)", "(default: 300)", "(default: 0.0)"]),
        ("bench", ["(default: fastpipe-bench)"]),
    ],
)
def test_help_shows_the_defaults(command: str, shown: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal width
    for fragment in shown:
        assert fragment in text
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("command", ["plan", "train", "bench"])
def test_every_option_has_a_help_text(command: str) -> None:
    parser = _subcommands()[command]
    assert parser.formatter_class is not argparse.HelpFormatter
    undocumented = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert undocumented == []


def test_no_command_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "plan" in err and "train" in err and "bench" in err and "--version" in err


@pytest.mark.parametrize(
    "argv, missing",
    [
        ([], ["the layers' costs (--costs", "--stages K", "--chunks M"]),
        (["--costs", "1,2,3,4", "--chunks", "8"], ["--stages K (the pipeline workers to balance the layers"]),
        (["--costs", "1,2,3,4", "--stages", "2"], ["--chunks M"]),
    ],
)
def test_plan_says_what_the_balance_needs(
    argv: list[str], missing: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    for fragment in missing:
        assert fragment in err
    assert "Example: fastpipe plan --costs 1,2,3,4 --stages 2 --chunks 8" in err
    assert "the following arguments are required" not in err


def test_plan_imports_a_model_module_from_the_current_directory(tmp_path: Path) -> None:
    (tmp_path / "fastpipe_cwd_models.py").write_text(
        textwrap.dedent("""
        from torch import nn


        def build():
            return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    """)
    )
    argv = [
        "plan",
        "--model",
        "fastpipe_cwd_models:build",
        "--sample-shape",
        "16,8",
        "--stages",
        "2",
        "--chunks",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _AS_CONSOLE_SCRIPT, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "balance: [" in done.stdout and "peak memory" in done.stdout
