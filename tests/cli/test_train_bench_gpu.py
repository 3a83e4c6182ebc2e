"""``fastpipe train`` and ``fastpipe bench`` on GPUs: one stage per visible GPU, memory from the allocator."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fastpipe.cli import main

pytestmark = pytest.mark.gpu


def test_train_puts_one_stage_on_each_gpu(tmp_path: object) -> None:
    out = os.path.join(str(tmp_path), "run")
    gpus = torch.cuda.device_count()
    assert (
        main(
            [
                "train",
                "--steps",
                "8",
                "--layers",
                str(max(2, gpus)),
                "--dim",
                "64",
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
                "8",
                "--max-chars",
                "200000",
                "--no-progress",
                "--out",
                out,
            ]
        )
        == 0
    )
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    assert report["devices"] == [f"cuda:{i}" for i in range(gpus)]
    allocated = report["memory"]["max_memory_allocated_per_device"]
    assert sorted(allocated) == [f"cuda:{i}" for i in range(gpus)] and all(b > 0 for b in allocated.values())
    assert report["history"][-1] < report["history"][0]
    assert report["val_loss"] < report["unigram_entropy"] + 0.5  # sane, not NaN, after 8 steps


def test_train_async_on_gpus(tmp_path: object) -> None:
    # fit under bf16 autocast, one stage per GPU (the worker threads carry the caller's autocast).
    out = os.path.join(str(tmp_path), "async")
    gpus = torch.cuda.device_count()
    assert (
        main(
            [
                "train",
                "--steps",
                "8",
                "--layers",
                str(max(2, gpus)),
                "--dim",
                "64",
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
                "8",
                "--max-chars",
                "200000",
                "--no-progress",
                "--schedule",
                "async",
                "--window",
                "4",
                "--out",
                out,
            ]
        )
        == 0
    )
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    assert report["devices"] == [f"cuda:{i}" for i in range(gpus)]
    assert len(report["memory"]["weight_copy_bytes_per_stage"]) == gpus
    assert report["history"][-1] < report["history"][0]
    assert report["val_loss"] < report["unigram_entropy"] + 0.5


def test_bench_e2e_and_memory_scale_with_the_host(tmp_path: object) -> None:
    out = os.path.join(str(tmp_path), "bench")
    assert main(["bench", "--quick", "--only", "e2e,memory", "--out", out, "--no-progress"]) == 0
    with open(os.path.join(out, "bench.json")) as f:
        parts = json.load(f)["parts"]
    e2e = parts["e2e"]["result"]
    assert e2e["k"] == torch.cuda.device_count()
    assert all(d.startswith("cuda") for d in e2e["workload"]["devices"])
    rows = parts["memory"]["result"]["rows"]
    assert [r["mode"] for r in rows[:4]] == ["plain", "fused", "recompute", "recompute + fused"]
    assert rows[0]["largest_blocks"] <= rows[1]["largest_blocks"] <= rows[2]["largest_blocks"]
    for r in rows:  # the prediction from per-block bytes bounds the real allocator's peak, and not loosely
        assert 0.6 * r["predicted_peak_bytes"] <= r["measured_peak_bytes"] <= 1.1 * r["predicted_peak_bytes"]
