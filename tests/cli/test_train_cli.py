"""``fastpipe train``: it learns, writes its report, refuses bad flags, and resumes exactly."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
import torch

from fastpipe.cli import main

# Toy sizes: seconds on one CPU core. 200k characters of the stdlib are plenty for 6 steps.
TINY = [
    "--layers",
    "2",
    "--dim",
    "32",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch",
    "8",
    "--chunks",
    "2",
    "--lr",
    "1e-2",
    "--warmup",
    "1",
    "--eval-batches",
    "1",
    "--sample-chars",
    "16",
    "--max-chars",
    "200000",
    "--no-progress",
]


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # fastpipe train sets one thread per stage worker


def _train(tmp_path: object, name: str, *extra: str) -> dict:
    out = os.path.join(str(tmp_path), name)
    assert main(["train", *TINY, "--out", out, *extra]) == 0
    with open(os.path.join(out, "report.json")) as f:
        return dict(json.load(f))


def test_steps_5_writes_the_report_and_learns(tmp_path: object) -> None:
    report = _train(tmp_path, "run", "--steps", "5")
    for key in (
        "settings",
        "history",
        "val_loss",
        "unigram_entropy",
        "tokens_per_s",
        "bubble",
        "memory",
        "sample",
        "files",
    ):
        assert key in report
    for name in ("report.json", "loss.png", "timeline.png", "trace.json"):
        assert os.path.getsize(report["files"][name]) > 0
    history = report["history"]
    assert len(history) == 5 and history[-1] < history[0] - 0.1
    assert 0.0 <= report["bubble"]["measured"] < 1.0 and 0.0 <= report["bubble"]["simulated"] < 1.0
    assert len(report["memory"]["activation_bytes_per_stage"]) == 2
    assert all(b > 0 for b in report["memory"]["activation_bytes_per_stage"])
    assert report["sample"].startswith("def ") and len(report["sample"]) == 4 + 16
    with open(report["files"]["trace.json"]) as f:
        assert any(e.get("ph") == "X" for e in json.load(f)["traceEvents"])


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_resume_continues_the_loss_curve_exactly(tmp_path: object, schedule: str) -> None:
    # Dropout on, so the restored RNG state matters too.
    flags = ["--dropout", "0.1", "--schedule", schedule]
    whole = _train(tmp_path, "whole", "--steps", "6", *flags)["history"]
    ckpt = os.path.join(str(tmp_path), "ckpt")
    first = _train(tmp_path, "first", "--steps", "3", "--save", ckpt, *flags)["history"]
    # A later save that died before its commit record: its model file is ignored, then removed.
    with open(os.path.join(ckpt, "model-000005.pt"), "wb") as f:
        f.write(b"truncated")
    resumed = _train(tmp_path, "resumed", "--steps", "6", "--resume", ckpt, "--save", ckpt, *flags)["history"]
    assert first == whole[:3]
    assert resumed == whole  # bitwise: steps 4..6 equal the uninterrupted run's
    # the newest save and the one before it, to fall back on; the unrecorded file is gone
    visible = sorted(n for n in os.listdir(ckpt) if not n.startswith("."))
    assert visible == ["model-000003.pt", "model-000006.pt", "run.pt"]


def test_async_learns_and_reports_its_window(tmp_path: object) -> None:
    report = _train(tmp_path, "async", "--steps", "6", "--schedule", "async", "--window", "3")
    assert report["settings"]["consistency"] == "predict" and report["settings"]["window"] == 3
    history = report["history"]
    assert len(history) == 6 and history[-1] < history[0] - 0.1
    assert "async/predict" in report["bubble"]["timeline"]
    assert 0.0 <= report["bubble"]["measured"] < 1.0 and 0.0 <= report["bubble"]["simulated"] < 1.0
    memory = report["memory"]
    assert all(b > 0 for b in memory["activation_bytes_per_stage"])
    # predict keeps one predicted copy where an update lands between F and B (stage 0 of 2);
    # the last stage updates right after its last backward.
    assert memory["weight_copy_bytes_per_stage"][0] > 0
    assert memory["weight_copy_bytes_per_stage"] <= memory["weight_copy_bound_per_stage"]
    with open(report["files"]["trace.json"]) as f:
        names = {e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"}
    assert {"0U0", "1U2"} <= names  # the traced window's weight updates


def test_async_sync_equals_1f1b_bit_for_bit(tmp_path: object) -> None:
    # fit owns the step here; same learning rate per step, same arithmetic as train_step + step.
    flags = ["--steps", "4", "--warmup", "3"]
    sync = _train(tmp_path, "sync", *flags, "--schedule", "async", "--consistency", "sync", "--window", "3")
    assert sync["history"] == _train(tmp_path, "1f1b", *flags, "--schedule", "1f1b")["history"]


def test_async_resume_continues_the_loss_curve_exactly(tmp_path: object) -> None:
    flags = ["--dropout", "0.1", "--schedule", "async", "--window", "2", "--consistency", "stash"]
    whole = _train(tmp_path, "whole", "--steps", "6", *flags)["history"]
    ckpt = os.path.join(str(tmp_path), "ckpt")
    first = _train(tmp_path, "first", "--steps", "4", "--save", ckpt, "--save-every", "2", *flags)["history"]
    resumed = _train(tmp_path, "resumed", "--steps", "6", "--resume", ckpt, *flags)["history"]
    assert first == whole[:4]
    assert resumed == whole  # bitwise: the weights, AdamW state, RNG and lr continue at the window boundary
    code = main(["train", *TINY, "--steps", "6", "--resume", ckpt, "--out", str(tmp_path), *flags[:-2]])
    assert code == 2  # another consistency policy would change the curve


def test_resume_auto_starts_afresh_then_continues(tmp_path: object) -> None:
    ckpt = os.path.join(str(tmp_path), "ckpt")  # not there yet: the first run starts from scratch
    first = _train(tmp_path, "first", "--steps", "2", "--save", ckpt, "--resume", "auto")
    again = _train(tmp_path, "again", "--steps", "3", "--save", ckpt, "--resume", "auto")
    assert (first["start_step"], again["start_step"]) == (0, 2)
    assert again["history"][:2] == first["history"] and len(again["history"]) == 3


def test_resume_refuses_other_settings(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = os.path.join(str(tmp_path), "ckpt")
    _train(tmp_path, "first", "--steps", "1", "--save", ckpt)
    code = main(["train", *TINY, "--steps", "2", "--resume", ckpt, "--chunks", "4", "--out", str(tmp_path)])
    assert code == 2
    assert "chunks: saved 2, now 4" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--chunks", "16"], "--chunks 16 is more than --batch 8"),
        (["--stages", "3"], "raise --layers to at least 3"),
        (["--schedule", "interleaved"], "raise --layers to at least 4"),
        (["--heads", "3"], "--dim 32 must be a multiple of --heads 3"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--save-every", "2"], "--save-every needs --save DIR"),
        (["--resume", "auto"], "--resume auto resumes from --save DIR: pass --save DIR too"),
        (["--data-parallel", "2"], "--data-parallel 2 needs a process per replica: launch with torchrun"),
        (["--resume", "/nonexistent/fastpipe-ckpt"], "no run.pt there"),
        (["--consistency", "stash"], "--consistency applies to --schedule async only"),
        (["--window", "4"], "--window applies to --schedule async only"),
        (["--schedule", "async", "--window", "0"], "--window must be >= 1"),
        (
            [
                "--schedule",
                "async",
                "--window",
                "4",
                "--steps",
                "8",
                "--save",
                "/nonexistent/ckpt",
                "--save-every",
                "2",
            ],
            "--save-every 2 is not a multiple of --window 4",
        ),
        (
            ["--schedule", "async", "--window", "4", "--steps", "6", "--save", "/nonexistent/ckpt"],
            "needs --steps to be a multiple of --window 4",
        ),
    ],
)
def test_bad_flags_are_refused_with_what_to_change(
    tmp_path: object, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["train", *TINY, "--out", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err
