"""bias_gelu and swiglu against inline float64 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testutils import INTERPRET

from fastpipe.kernels import GELU, bias_gelu, swiglu

SHAPES = [(1, 33), (7, 768), (129, 1000)]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bias_gelu_fp32(shape, with_bias, approximate):
    x64 = torch.randn(shape, dtype=torch.float64) * 3
    b64 = torch.randn(shape[-1], dtype=torch.float64) if with_bias else None
    x = x64.float().requires_grad_()
    b = b64.float().requires_grad_() if with_bias else None
    xr = x64.clone().requires_grad_()
    br = b64.clone().requires_grad_() if with_bias else None
    y = bias_gelu(x, b, approximate)
    yr = F.gelu(xr + br if with_bias else xr, approximate=approximate)
    torch.testing.assert_close(y.double(), yr, rtol=1e-5, atol=1e-5)
    g = torch.randn(shape, dtype=torch.float64)
    (y * g.float()).sum().backward()
    (yr * g).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)
    if with_bias:
        torch.testing.assert_close(b.grad.double(), br.grad, rtol=1e-4, atol=1e-4)


def test_bias_gelu_saves_inputs_only(saved_bytes):
    x = torch.randn(7, 768, requires_grad=True)
    b = torch.randn(768, requires_grad=True)
    nbytes, _ = saved_bytes(lambda: bias_gelu(x, b), [b])
    assert nbytes == x.numel() * 4


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_fp32(shape):
    a64, b64 = torch.randn(shape, dtype=torch.float64) * 3, torch.randn(shape, dtype=torch.float64)
    a, b = a64.float().requires_grad_(), b64.float().requires_grad_()
    ar, br = a64.clone().requires_grad_(), b64.clone().requires_grad_()
    y, yr = swiglu(a, b), F.silu(ar) * br
    torch.testing.assert_close(y.double(), yr, rtol=1e-5, atol=1e-5)
    g = torch.randn(shape, dtype=torch.float64)
    (y * g.float()).sum().backward()
    (yr * g).sum().backward()
    torch.testing.assert_close(a.grad.double(), ar.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad.double(), br.grad, rtol=1e-5, atol=1e-5)


def test_swiglu_saves_inputs_only(saved_bytes):
    a, b = torch.randn(7, 768, requires_grad=True), torch.randn(7, 768, requires_grad=True)
    nbytes, _ = saved_bytes(lambda: swiglu(a, b), [])
    assert nbytes == 2 * a.numel() * 4


@pytest.mark.parametrize("op", ["gelu", "swiglu"])
def test_bf16_within_one_ulp(op):
    a, b = (torch.randn(7, 768) * 3).bfloat16(), torch.randn(7, 768).bfloat16()
    if op == "gelu":
        y, ref = bias_gelu(a, b[0]), F.gelu(a.double() + b[0].double())
        # x + bias is rounded to fp32 in the kernel, not to bf16: compare against the exact sum.
    else:
        y, ref = swiglu(a, b), F.silu(a.double()) * b.double()
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=1e-3 if not INTERPRET else 2e-3)


def test_gelu_module_is_a_drop_in():
    for approximate in ("none", "tanh"):
        ref, mod = torch.nn.GELU(approximate), GELU(approximate)
        assert repr(ref) == repr(mod)
        x = torch.randn(7, 33)
        torch.testing.assert_close(mod(x), ref(x), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_torch(dtype):
    x, b = torch.randn(129, 1000, device="cuda", dtype=dtype), torch.randn(1000, device="cuda", dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    ref = F.gelu(x.double() + b.double(), approximate="tanh")
    torch.testing.assert_close(bias_gelu(x, b, "tanh").double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(swiglu(x, x).double(), F.silu(x.double()) * x.double(), rtol=tol, atol=tol)


# CUDA's grid axes 1 and 2 stop at 65,535 programs; axis 0 goes to 2**31 - 1.
_GRID_AXIS_LIMIT = 65_535


@pytest.mark.parametrize("rows", [1, 262_141, 64 * 4096, 1 << 24])
def test_tall_inputs_launch_within_the_grid_limits(rows):
    from fastpipe.kernels.bias_gelu import forward_grid

    block_r, block_c = 4, 512  # the CUDA fallback config
    row_blocks, col_blocks = forward_grid(rows, 4096, block_r, block_c)
    assert row_blocks * block_r >= rows and col_blocks * block_c >= 4096  # every element is covered
    assert col_blocks <= _GRID_AXIS_LIMIT  # the rows went to axis 0, the only one without that limit


@pytest.mark.parametrize("width, tile", [(7, (256, 8)), (100, (16, 128)), (4096, (4, 512)), (20_000, (4, 512))])
def test_narrow_rows_get_a_narrow_tile(width, tile):
    from fastpipe.kernels import configs
    from fastpipe.kernels.bias_gelu import _tiles

    # The CUDA config, forced so that the CPU computes the tile a GPU would launch.
    with configs.override("bias_gelu", dict(block_r=4, block_c=512, num_warps=8, progs_per_sm=4)):
        block_r, block_c, _, _ = _tiles(torch.empty(0), width)
    assert (block_r, block_c) == tile
    assert block_r * block_c == 4 * 512  # the same elements per tile as the config
