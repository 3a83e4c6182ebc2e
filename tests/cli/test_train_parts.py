"""The pieces of ``fastpipe train``: the text split, the activation meter, the LM loss."""

from __future__ import annotations

import os

import torch
from torch import nn

from fastpipe.kernels.memory import count_saved_bytes
from fastpipe.train.meter import ActivationMeter
from fastpipe.train.model import GPTConfig, LMLoss, build_gpt
from fastpipe.train.textdata import VOCAB, decode, encode, load_corpus


def _write(root: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def test_split_is_by_file_and_fixed(tmp_path: object) -> None:
    root = str(tmp_path)
    texts = {f"pkg/m{i}.py": f"x = {i}\n" * (i + 1) for i in range(60)}
    _write(root, {**texts, "test/test_skip.py": "skipped\n", "site-packages/dep.py": "skipped\n"})
    a, b = load_corpus(root), load_corpus(root)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.files[0] + a.files[1] == 60 and a.files[1] >= 1
    assert len(a.train) + len(a.val) == sum(len(t) for t in texts.values())  # skipped dirs left out
    assert "skipped" not in decode(torch.cat([a.train, a.val]).long())


def test_encode_decode_round_trip() -> None:
    text = "def f(x):\n\treturn x ** 2  # ok\n"
    assert decode(encode(text)) == text
    assert decode(encode("é")) == "??"  # two UTF-8 bytes, both outside the vocabulary
    assert int(encode("é").max()) == VOCAB - 1


def test_meter_counts_what_autograd_saves_and_sees_it_freed() -> None:
    model = build_gpt(GPTConfig(VOCAB, seq_len=16, n_layer=2, dim=32, n_head=2), seed=0)
    stages = [nn.Sequential(*list(model)[:2]), nn.Sequential(*list(model)[2:])]
    x = torch.randint(0, VOCAB, (4, 16))
    meter = ActivationMeter(stages)
    with meter:
        h = stages[0](x)
        out = stages[1](h)
    params = {p.untyped_storage().data_ptr() for p in stages[1].parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stages[1](h.detach().requires_grad_())
    assert meter.peaks[0] > 0
    assert meter.peaks[1] == sum(storages.values())  # the same saves, each storage counted once
    hd = h.detach()
    assert meter.peaks[1] <= count_saved_bytes(lambda: stages[1](hd), stages[1].parameters())[0]
    out.sum().backward()
    del out, h
    meter.reset()
    assert meter.peaks == [0, 0]  # everything was released when the graph went


def test_lm_loss_equals_cross_entropy_of_the_logits() -> None:
    model = build_gpt(GPTConfig(VOCAB, seq_len=8, n_layer=1, dim=16, n_head=2), seed=1)
    x, y = torch.randint(0, VOCAB, (3, 8)), torch.randint(0, VOCAB, (3, 8))
    h = model(x)
    head = model[-1]
    expected = nn.functional.cross_entropy(head.logits(h).reshape(-1, VOCAB), y.reshape(-1))
    torch.testing.assert_close(LMLoss(head)(h, y), expected, rtol=1e-5, atol=1e-5)
