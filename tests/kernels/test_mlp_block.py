"""MLPBlock: drop-in for the eager pre-norm block, and at most half its saved activation bytes."""

from __future__ import annotations

import pytest
import torch
from fp_tolerance import assert_close_reordered
from kernel_testutils import INTERPRET, EagerMLPBlock
from torch.utils.checkpoint import checkpoint

from fastpipe.kernels import MLPBlock

ROWS = 3 if INTERPRET else 16


def test_state_dict_matches_eager():
    eager, fused = EagerMLPBlock(64, 256), MLPBlock(64, 256)
    assert list(eager.state_dict().keys()) == list(fused.state_dict().keys())
    assert all(eager.state_dict()[k].shape == v.shape for k, v in fused.state_dict().items())


@pytest.mark.parametrize(("hidden", "ffn"), [(33, 65), (512, 2048)], ids=str)
def test_numbers_match_eager(hidden, ffn):
    eager = EagerMLPBlock(hidden, ffn)
    with torch.no_grad():
        for p in eager.parameters():
            p.normal_()
    fused = MLPBlock(hidden, ffn)
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(2, ROWS, hidden)
    xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye, yf = eager(xe), fused(xf)
    # Same math, other reduction orders (fused kernels vs eager, and the BLAS kernel the CPU
    # picks): the tolerance follows the reductions on the path, LayerNorm + fc1 + fc2, plus
    # the rows a weight gradient sums over.
    k = 2 * hidden + ffn + x.shape[0] * x.shape[1]
    assert_close_reordered(yf, ye, k=k)
    g = torch.randn_like(ye)
    ye.backward(g)
    yf.backward(g)
    assert_close_reordered(xf.grad, xe.grad, k=k)
    for (name, pe), pf in zip(eager.named_parameters(), fused.parameters(), strict=True):
        assert_close_reordered(pf.grad, pe.grad, k=k, msg=name)


def test_saves_at_most_half_of_eager(saved_bytes):
    hidden, ffn = 512, 2048
    eager, fused = EagerMLPBlock(hidden, ffn), MLPBlock(hidden, ffn, dropout=0.1)
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(ROWS, hidden, requires_grad=True)
    eager_bytes, _ = saved_bytes(lambda: eager(x), eager.parameters())
    fused_bytes, _ = saved_bytes(lambda: fused(x), fused.parameters())
    assert eager_bytes == ROWS * 5122 * 4  # LN: x, mean, rstd; fc1: ln(x); gelu: h; fc2: gelu(h)
    assert fused_bytes == ROWS * (hidden + ffn) * 4 + 8  # x, h and one dropout seed
    assert fused_bytes <= 0.5 * eager_bytes


def test_dropout_recompute_matches():
    fused = MLPBlock(33, 65, dropout=0.5)
    x = torch.randn(ROWS, 33, requires_grad=True)
    torch.manual_seed(3)
    fused(x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    torch.manual_seed(3)
    checkpoint(fused, x, use_reentrant=False).sum().backward()
    assert torch.equal(g, x.grad)


def test_autocast_bf16_matches_eager():
    eager, fused = EagerMLPBlock(33, 65), MLPBlock(33, 65)
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(ROWS, 33)
    xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ye, yf = eager(xe), fused(xf)
    assert yf.dtype == ye.dtype
    torch.testing.assert_close(yf, ye, rtol=2e-2, atol=2e-2)
    ye.sum().backward()
    yf.sum().backward()
    torch.testing.assert_close(xf.grad, xe.grad, rtol=5e-2, atol=5e-2)
    for (name, pe), pf in zip(eager.named_parameters(), fused.parameters(), strict=True):
        assert pf.grad.dtype == pe.grad.dtype, name
        scale = pe.grad.abs().max().item()
        torch.testing.assert_close(pf.grad, pe.grad, rtol=5e-2, atol=5e-2 * scale, msg=name)
