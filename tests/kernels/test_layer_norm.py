"""add_dropout_layer_norm / add_dropout_rms_norm against an inline float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp_tolerance import assert_close_reordered
from kernel_testutils import INTERPRET

from fastpipe.kernels import add_dropout_layer_norm, add_dropout_rms_norm, dropout

SHAPES = [(1, 33), (7, 768), (129, 1000)] if INTERPRET else [(1, 33), (7, 768), (129, 1000), (129, 33)]


def _ref_norm(x: torch.Tensor, w, b, eps: float, rms: bool) -> torch.Tensor:
    if rms:
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
        return y * w if w is not None else y
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in ts]


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["res", "nores"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_matches_float64(shape, with_residual, rms):
    m, n = shape
    x64 = torch.randn(m, n, dtype=torch.float64)
    r64 = torch.randn(m, n, dtype=torch.float64) if with_residual else None
    w64 = torch.randn(n, dtype=torch.float64)
    b64 = None if rms else torch.randn(n, dtype=torch.float64)
    x, r, w, b = _leaves(*(t.float() if t is not None else None for t in (x64, r64, w64, b64)))
    xr, rr, wr, br = _leaves(x64, r64, w64, b64)

    if rms:
        out, new_res = add_dropout_rms_norm(x, r, w, eps=1e-6)
    else:
        out, new_res = add_dropout_layer_norm(x, r, w, b, eps=1e-5)
    res_ref = xr + rr if rr is not None else xr
    out_ref = _ref_norm(res_ref, wr, br, 1e-6 if rms else 1e-5, rms)
    # fp32 against float64: the rounding of the row reductions (the weight gradients also
    # sum over the rows).
    k = n + m
    assert_close_reordered(out.double(), out_ref, k=k, dtype=torch.float32)
    assert_close_reordered(new_res.double(), res_ref, k=1, dtype=torch.float32)

    g_out, g_res = torch.randn(m, n, dtype=torch.float64), torch.randn(m, n, dtype=torch.float64)
    if with_residual:
        (out * g_out.float()).sum().add((new_res * g_res.float()).sum()).backward()
        (out_ref * g_out).sum().add((res_ref * g_res).sum()).backward()
    else:
        (out * g_out.float()).sum().backward()
        (out_ref * g_out).sum().backward()
    pairs = [(x, xr), (w, wr)] + ([(r, rr)] if with_residual else []) + ([] if rms else [(b, br)])
    for got, ref in pairs:
        assert_close_reordered(got.grad.double(), ref.grad, k=k, dtype=torch.float32)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_dropout_inside_norm(rms):
    m, n, p, seed = 7, 1000, 0.3, 1234
    x64, r64 = torch.randn(m, n, dtype=torch.float64), torch.randn(m, n, dtype=torch.float64)
    w64, b64 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    x, r, w, b = _leaves(x64.float(), r64.float(), w64.float(), b64.float())
    if rms:
        out, new_res = add_dropout_rms_norm(x, r, w, p=p, seed=seed)
    else:
        out, new_res = add_dropout_layer_norm(x, r, w, b, p=p, seed=seed)
    # The fused kernel drops exactly what dropout() drops with the same seed.
    keep = dropout(torch.ones(m, n), p, seed=seed) != 0
    xr, rr, wr, br = _leaves(x64, r64, w64, b64)
    res_ref = rr + xr * keep / (1 - p)
    out_ref = _ref_norm(res_ref, wr, None if rms else br, 1e-6 if rms else 1e-5, rms)
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_res.double(), res_ref, rtol=1e-6, atol=1e-6)
    g = torch.randn(m, n, dtype=torch.float64)
    (out * g.float()).sum().backward()
    (out_ref * g).sum().backward()
    for got, ref in [(x, xr), (r, rr), (w, wr)]:
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-4)
    assert torch.all(x.grad[~keep] == 0)


def test_no_residual_no_dropout_returns_input_as_residual():
    x = torch.randn(3, 33)
    out, new_res = add_dropout_layer_norm(x, None, None, None)
    assert new_res is x
    torch.testing.assert_close(out, F.layer_norm(x, (33,)), rtol=1e-5, atol=1e-5)


def test_eval_mode_disables_dropout():
    x, r = torch.randn(3, 33), torch.randn(3, 33)
    out, new_res = add_dropout_layer_norm(x, r, None, None, p=0.9, training=False)
    torch.testing.assert_close(new_res, x + r)


def test_saves_only_residual_and_stats(saved_bytes):
    m, n = 7, 768
    x, r = torch.randn(m, n, requires_grad=True), torch.randn(m, n, requires_grad=True)
    w, b = torch.ones(n, requires_grad=True), torch.zeros(n, requires_grad=True)
    nbytes, _ = saved_bytes(lambda: add_dropout_layer_norm(x, r, w, b, p=0.1)[0], [w, b])
    # new_residual + fp32 mean and rstd + an int64 seed.
    assert nbytes == m * n * 4 + 2 * m * 4 + 8


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_bf16_forward_within_one_ulp(rms):
    m, n = 7, 768
    x, r, w = torch.randn(m, n).bfloat16(), torch.randn(m, n).bfloat16(), torch.randn(n).bfloat16()
    if rms:
        out, new_res = add_dropout_rms_norm(x, r, w)
    else:
        out, new_res = add_dropout_layer_norm(x, r, w, None)
    # bf16 has 8 significant bits; the interpreter truncates instead of rounding: allow 1 ulp
    # (relative 2**-7) on each rounded result, and normalise the residual the kernel stored.
    torch.testing.assert_close(new_res.double(), x.double() + r.double(), rtol=2**-7, atol=1e-6)
    ref = _ref_norm(new_res.double(), w.double(), None, 1e-6 if rms else 1e-5, rms)
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu_reference(dtype):
    m, n = 129, 1000
    x, r, w, b = torch.randn(m, n), torch.randn(m, n), torch.randn(n), torch.randn(n)
    ref, _ = add_dropout_layer_norm(x.to(dtype), r.to(dtype), w.to(dtype), b.to(dtype))
    out, _ = add_dropout_layer_norm(*(t.to(dtype).cuda() for t in (x, r, w, b)))
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.cpu().double(), ref.double(), rtol=tol, atol=tol)


def test_bf16_backward_close_to_float64():
    m, n = 7, 768
    x, r, w, b = (torch.randn(m, n).bfloat16(), torch.randn(m, n).bfloat16(), torch.randn(n).bfloat16(),
                  torch.randn(n).bfloat16())  # fmt: skip
    lo = _leaves(x, r, w, b)
    out, new_res = add_dropout_layer_norm(*lo)
    hi = _leaves(*(t.double() for t in (x, r, w, b)))
    ref = F.layer_norm(hi[0] + hi[1], (n,), hi[2], hi[3], 1e-5)
    g = torch.randn(m, n).bfloat16()
    out.backward(g)
    ref.backward(g.double())
    for got, want in zip(lo, hi, strict=True):
        scale = want.grad.abs().max().item()
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=2**-6, atol=2**-6 * scale)


def test_wide_rows_fall_back_to_pytorch():
    from fastpipe.kernels.layer_norm import MAX_TRITON_COLS

    n = MAX_TRITON_COLS + 3
    x = torch.randn(2, n, requires_grad=True)
    out, _ = add_dropout_layer_norm(x, None, None, None)
    out.sum().backward()
    torch.testing.assert_close(out, F.layer_norm(x, (n,)), rtol=1e-5, atol=1e-5)
