"""layer_norm_linear / rms_norm_linear / bias_gelu_linear against inline float64 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp_tolerance import assert_close_reordered

from fastpipe.kernels import bias_gelu_linear, layer_norm_linear, rms_norm_linear

SHAPES = [(1, 33, 65), (7, 768, 33), (129, 1000, 17)]


def _pair(*ts):
    lo = [t.float().requires_grad_() if t is not None else None for t in ts]
    hi = [t.clone().requires_grad_() if t is not None else None for t in ts]
    return lo, hi


def _check_grads(lo, hi, k):
    for got, want in zip(lo, hi, strict=True):
        if got is not None:
            assert_close_reordered(got.grad.double(), want.grad, k=k, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(("rows", "hidden", "out"), SHAPES, ids=str)
def test_norm_linear(rows, hidden, out, kind):
    x = torch.randn(rows, hidden, dtype=torch.float64)
    nw, nb = torch.randn(hidden, dtype=torch.float64), torch.randn(hidden, dtype=torch.float64)
    w, b = torch.randn(out, hidden, dtype=torch.float64) / hidden**0.5, torch.randn(out, dtype=torch.float64)
    if kind == "rms":
        nb = None
    lo, hi = _pair(x, nw, nb, w, b)
    if kind == "layer":
        y = layer_norm_linear(*lo, eps=1e-5)
        ref = F.linear(F.layer_norm(hi[0], (hidden,), hi[1], hi[2], 1e-5), hi[3], hi[4])
    else:
        y = rms_norm_linear(lo[0], lo[1], lo[3], lo[4], eps=1e-6)
        xr = hi[0]
        ref = F.linear(xr * torch.rsqrt((xr * xr).mean(-1, keepdim=True) + 1e-6) * hi[1], hi[3], hi[4])
    # fp32 against float64: the rounding of the reductions on the path (norm, GEMM; the
    # gradients also sum over rows and outputs).
    k = 2 * hidden + rows + out
    assert_close_reordered(y.double(), ref, k=k, dtype=torch.float32)
    g = torch.randn(ref.shape, dtype=torch.float64)
    (y * g.float()).sum().backward()
    (ref * g).sum().backward()
    _check_grads(lo, hi, k)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize(("rows", "hidden", "out"), SHAPES, ids=str)
def test_bias_gelu_linear(rows, hidden, out, approximate):
    x = torch.randn(rows, hidden, dtype=torch.float64)
    ab = torch.randn(hidden, dtype=torch.float64)
    w, b = torch.randn(out, hidden, dtype=torch.float64) / hidden**0.5, torch.randn(out, dtype=torch.float64)
    lo, hi = _pair(x, ab, w, b)
    y = bias_gelu_linear(*lo, approximate=approximate)
    ref = F.linear(F.gelu(hi[0] + hi[1], approximate=approximate), hi[2], hi[3])
    # fp32 against float64: the rounding of the reductions on the path (norm, GEMM; the
    # gradients also sum over rows and outputs).
    k = 2 * hidden + rows + out
    assert_close_reordered(y.double(), ref, k=k, dtype=torch.float32)
    g = torch.randn(ref.shape, dtype=torch.float64)
    (y * g.float()).sum().backward()
    (ref * g).sum().backward()
    _check_grads(lo, hi, k)


def test_pairs_save_only_their_input(saved_bytes):
    x = torch.randn(7, 768, requires_grad=True)
    nw, nb = torch.ones(768, requires_grad=True), torch.zeros(768, requires_grad=True)
    w = torch.randn(33, 768, requires_grad=True)
    nbytes, _ = saved_bytes(lambda: layer_norm_linear(x, nw, nb, w), [nw, nb, w])
    assert nbytes == x.numel() * 4
    nbytes, _ = saved_bytes(lambda: bias_gelu_linear(x, nb, w), [nb, w])
    assert nbytes == x.numel() * 4
