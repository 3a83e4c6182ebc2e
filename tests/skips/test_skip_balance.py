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


def test_a_memory_limit_counts_each_skip_on_the_stages_it_leaves_and_enters(monkeypatch):
    import fastpipe.balance.auto as auto
    from fastpipe.balance.device_need import compose, layer_bytes
    from fastpipe.model.skip_memory import measure_skips

    needs = []
    real = auto.plan
    monkeypatch.setattr(auto, "plan", lambda *a, **k: needs.append(k["stage_memory"]) or real(*a, **k))
    model = unet()
    x = torch.randn(8, 6)
    auto.auto_balance(model, ["cpu"] * 3, x, chunks=2, memory_limit=1e12)
    spans = measure_skips(model, x[:4])
    (need,) = needs
    assert need.spans == spans and spans
    layers = layer_bytes(model, x[:4], {})
    crossed = 0
    for a in range(len(model)):
        for b in range(a + 1, len(model) + 1):
            extra = compose(layers, a, b, spans).input - compose(layers, a, b).input
            crossing = [s for s in spans if (a <= s.producer < b) != (a <= s.consumer < b)]
            assert extra == sum(s.nbytes for s in crossing), (a, b)
            crossed += bool(crossing)
    assert crossed
