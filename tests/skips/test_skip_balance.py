"""``balance="auto"`` profiles a model with skips: each pop layer runs with the tensor its stash recorded."""

from __future__ import annotations

import torch
from _unet import unet
from fp_tolerance import assert_close_reordered

import fastpipe
from fastpipe.balance import profile_layers


def test_the_profiler_hands_pop_layers_their_skips():
    model = unet()
    x = torch.randn(4, 6)
    profile = profile_layers(model, x)
    assert len(profile.forward) == len(model) and all(t > 0 for t in profile.forward)


def test_auto_balance_plans_a_model_with_skips():
    model = unet()
    ref = unet()
    x = torch.randn(8, 6)
    pipe = fastpipe.Pipe(model, balance="auto", devices=["cpu"] * 3, sample=x, chunks=2)
    assert len(pipe.balance) == 3 and sum(pipe.balance) == len(ref)
    assert_close_reordered(pipe(x), ref(x), k=64)


def test_a_memory_limit_counts_the_skips_on_their_stash_and_pop_layers(monkeypatch):
    import fastpipe.balance.auto as auto
    from fastpipe.model.skip_memory import measure_skips

    seen: list[list[float]] = []
    real = auto.plan
    monkeypatch.setattr(auto, "plan", lambda *a, **k: seen.append(list(k["memory"])) or real(*a, **k))
    model = unet()
    x = torch.randn(8, 6)
    auto.auto_balance(model, ["cpu"] * 3, x, chunks=2, memory_limit=1e12)
    with monkeypatch.context() as m:
        m.setattr(auto, "has_skips", lambda module: False)
        auto.auto_balance(model, ["cpu"] * 3, x, chunks=2, memory_limit=1e12)
    with_skips, without = seen
    spans = measure_skips(model, x[:4])
    grown = {i for i, (a, b) in enumerate(zip(with_skips, without)) if a > b}
    assert grown == {i for s in spans for i in (s.producer, s.consumer)}
