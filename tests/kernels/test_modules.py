"""Drop-in modules and patch(): same state_dict keys, same numbers, checkpoints unchanged."""

from __future__ import annotations

import logging

import torch
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe.kernels as fk


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(33, 64),
        nn.LayerNorm(64),
        nn.GELU(approximate="tanh"),
        nn.Dropout(0.1),
        nn.Sequential(nn.RMSNorm(64, eps=1e-6), nn.Linear(64, 7)),
        nn.LayerNorm(7, elementwise_affine=False),
    )


def test_constructor_args_and_state_dict_keys():
    pairs = [
        (nn.LayerNorm(33, eps=1e-6, bias=False), fk.LayerNorm(33, eps=1e-6, bias=False)),
        (nn.RMSNorm(33), fk.RMSNorm(33)),
        (nn.Dropout(0.3), fk.Dropout(0.3)),
        (nn.GELU("tanh"), fk.GELU("tanh")),
    ]
    for ref, mod in pairs:
        assert ref.state_dict().keys() == mod.state_dict().keys()
        assert ref.extra_repr() == mod.extra_repr()
        assert isinstance(mod, type(ref))


def test_patch_swaps_in_place_and_changes_no_numbers(caplog):
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    x = torch.randn(7, 33, requires_grad=True)
    ref = model(x)
    # A random weighting: the plain sum of a LayerNorm's outputs is constant, so its
    # gradients would be pure rounding noise and test nothing.
    g = torch.randn_like(ref)
    (ref * g).sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None

    with caplog.at_level(logging.INFO, logger="fastpipe.kernels.patch"):
        swapped = fk.patch(model)
    assert [name for name, _, _ in swapped] == ["1", "2", "3", "4.0", "5"]
    assert "swapped 5 modules" in caplog.text
    assert type(model[1]) is fk.LayerNorm and type(model[4][0]) is fk.RMSNorm
    assert type(model[2]) is fk.GELU and type(model[3]) is fk.Dropout
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    out = model(x)
    (out * g).sum().backward()
    # Fused kernels against eager ops: the same math in another reduction order. The path
    # reduces over 33 + 64 + 64 + 64 + 7 values, and weight gradients over the 7 rows.
    k = 33 + 3 * 64 + 7 + 7
    assert_close_reordered(out, ref, k=k)
    for got, want in zip([p.grad for p in model.parameters()] + [x.grad], ref_grads, strict=True):
        assert_close_reordered(got, want, k=k)
    assert fk.patch(model) == []  # already patched


def test_rms_norm_default_eps_follows_torch():
    ref, mod = nn.RMSNorm(33), fk.RMSNorm(33)
    x = torch.randn(7, 33) * 1e-3
    torch.testing.assert_close(mod(x), ref(x), rtol=1e-5, atol=1e-6)
