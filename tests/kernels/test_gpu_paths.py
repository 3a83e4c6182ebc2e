"""The real CUDA path (compiled Triton kernels) against the CPU path and float64; GPU only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testutils import EagerMLPBlock, count_saved_bytes

import fastpipe.kernels as fk

pytestmark = pytest.mark.gpu

OPS = {
    "layer_norm": (lambda x, r, w, b: fk.add_dropout_layer_norm(x, r, w, b)[0],
                   lambda x, r, w, b: F.layer_norm(x + r, (x.shape[-1],), w, b)),
    "rms_norm": (lambda x, r, w, b: fk.add_dropout_rms_norm(x, r, w)[0],
                 lambda x, r, w, b: (x + r) * torch.rsqrt(((x + r) ** 2).mean(-1, keepdim=True) + 1e-6) * w),
    "bias_gelu": (lambda x, r, w, b: fk.bias_gelu(x, b), lambda x, r, w, b: F.gelu(x + b)),
    "swiglu": (lambda x, r, w, b: fk.swiglu(x, r), lambda x, r, w, b: F.silu(x) * r),
    "layer_norm_linear": (lambda x, r, w, b: fk.layer_norm_linear(x, w, b, r[:17]),
                          lambda x, r, w, b: F.linear(F.layer_norm(x, (x.shape[-1],), w, b), r[:17])),
    "bias_gelu_linear": (lambda x, r, w, b: fk.bias_gelu_linear(x, b, r[:17]),
                         lambda x, r, w, b: F.linear(F.gelu(x + b), r[:17])),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("shape", [(1, 33), (129, 1000), (4096, 4096)], ids=str)
def test_cuda_fwd_bwd_match_float64(op, shape, dtype):
    fused, ref = OPS[op]
    m, n = shape
    base = [torch.randn(m, n), torch.randn(m, n), torch.randn(n), torch.randn(n)]
    lo = [t.to("cuda", dtype).detach().requires_grad_() for t in base]
    hi = [t.to(dtype).to("cuda", torch.float64).detach().requires_grad_() for t in base]
    y, y_ref = fused(*lo), ref(*hi)
    tol = 1e-4 if dtype == torch.float32 else 2**-6
    scale = y_ref.abs().max().item()
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol * scale)
    g = torch.randn(y_ref.shape, device="cuda").to(dtype)
    y.backward(g)
    y_ref.backward(g.double())
    for a, b in zip(lo, hi, strict=True):
        if b.grad is not None:
            s = b.grad.abs().max().item()
            torch.testing.assert_close(a.grad.double(), b.grad, rtol=tol, atol=tol * max(s, 1.0))


def test_cuda_mlp_block_matches_and_saves_half():
    eager = EagerMLPBlock(512, 2048).cuda()
    fused = fk.MLPBlock(512, 2048).cuda()
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(64, 512, device="cuda", requires_grad=True)
    e_bytes, ye = count_saved_bytes(lambda: eager(x), eager.parameters())
    f_bytes, yf = count_saved_bytes(lambda: fused(x), fused.parameters())
    torch.testing.assert_close(yf, ye, rtol=1e-4, atol=1e-3)
    assert f_bytes <= 0.5 * e_bytes


def test_cuda_dropout_in_norm_is_reproducible():
    x, r = torch.randn(129, 1000, device="cuda"), torch.randn(129, 1000, device="cuda")
    a, _ = fk.add_dropout_layer_norm(x, r, None, None, p=0.2, seed=11)
    b, _ = fk.add_dropout_layer_norm(x, r, None, None, p=0.2, seed=11)
    keep = fk.dropout(torch.ones_like(x), 0.2, seed=11) != 0
    ref = F.layer_norm(r + x * keep / 0.8, (1000,))
    assert torch.equal(a, b)
    torch.testing.assert_close(a, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_launches_follow_the_tensors_device():
    """Every op on cuda:1 while cuda:0 is current: the launches are guarded onto the tensor's GPU."""
    dev = torch.device("cuda:1")
    x, r = torch.randn(65, 300, device=dev, requires_grad=True), torch.randn(65, 300, device=dev)
    w, b = torch.randn(300, device=dev, requires_grad=True), torch.randn(300, device=dev, requires_grad=True)
    weight = torch.randn(50, 300, device=dev, requires_grad=True)
    target = torch.randint(0, 50, (65,), device=dev)
    with torch.cuda.device(0):
        out = fk.add_dropout_layer_norm(x, r, w, b, p=0.1, seed=3)[0]
        out = fk.swiglu(fk.bias_gelu(out, b), out) + fk.dropout(out, 0.1, seed=4)
        loss = fk.linear_cross_entropy(out, weight, target)
        loss.backward()
    torch.cuda.synchronize(dev)
    xc, rc = x.detach().cpu().requires_grad_(), r.cpu()
    wc, bc = w.detach().cpu().requires_grad_(), b.detach().cpu().requires_grad_()
    keep = (fk.dropout(torch.ones(65, 300, device=dev), 0.1, seed=3) != 0).cpu()
    ref = F.layer_norm(rc + xc * keep / 0.9, (300,), wc, bc)
    keep2 = (fk.dropout(torch.ones(65, 300, device=dev), 0.1, seed=4) != 0).cpu()
    ref = F.silu(F.gelu(ref + bc)) * ref + ref * keep2 / 0.9
    ref_loss = F.cross_entropy(ref @ weight.detach().cpu().t(), target.cpu())
    ref_loss.backward()
    torch.testing.assert_close(loss.cpu(), ref_loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.cpu(), xc.grad, rtol=1e-3, atol=1e-4)
