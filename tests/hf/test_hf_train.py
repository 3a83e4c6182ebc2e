"""``fastpipe train --model hf-gpt2 / hf-llama``: a HF model from scratch, tied across the first and last stage."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from fastpipe.cli import main  # noqa: E402
from fastpipe.train.model import LMHead  # noqa: E402
from fastpipe.train.models import build_model  # noqa: E402
from fastpipe.train.options import add_arguments  # noqa: E402
from fastpipe.train.textdata import VOCAB  # noqa: E402

TINY = (
    "--layers 2 --dim 32 --heads 2 --seq-len 32 --batch 8 --chunks 2 --lr 1e-2 --warmup 1 --eval-batches 1 "
    "--sample-chars 16 --max-chars 200000 --no-progress --steps 4 --stages 2"
).split()
EMBEDDING = {"hf-gpt2": "wte", "hf-llama": "embed_tokens"}


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # fastpipe train sets one thread per stage worker


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize("family", sorted(EMBEDDING))
def test_a_hf_model_trains_on_two_stages_with_its_tied_embedding(tmp_path: object, family: str) -> None:
    out = os.path.join(str(tmp_path), family)
    assert main(["train", *TINY, "--model", family, "--out", out]) == 0
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    history = report["history"]
    assert len(history) == 4 and history[-1] < history[0] - 0.1
    assert abs(history[0] - math.log(VOCAB)) < 0.5  # a fresh model: about uniform over the characters
    assert math.isfinite(report["val_loss"]) and report["sample"].startswith("def ")
    assert report["settings"]["model"]["family"] == family and report["settings"]["model"]["tied"]
    assert len(report["memory"]["activation_bytes_per_stage"]) == 2  # the embedding on one, the head on the other

    layers = build_model(_args(*TINY, "--model", family)).layers
    assert layers[-1].head.weight is getattr(layers[0], EMBEDDING[family]).weight  # one weight, two stages
    assert report["parameters"] == sum(p.numel() for p in layers.parameters())  # counted once


def test_the_asynchronous_schedule_is_refused_for_the_tie(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model", "hf-llama", "--schedule", "async", "--window", "2"]
    assert main(["train", *TINY, *flags, "--out", str(tmp_path)]) == 2
    assert "ties its embedding across the first and the last stage" in capsys.readouterr().err


def test_the_default_model_is_fastpipes_own_gpt() -> None:
    args = _args("--layers", "2", "--dim", "32", "--heads", "2")
    assert args.model == "gpt"
    assert isinstance(build_model(args).layers[-1], LMHead)
