"""linear_cross_entropy: values and grads against float64, and no full-size logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp_tolerance import assert_close_reordered
from kernel_testutils import INTERPRET
from torch.utils._python_dispatch import TorchDispatchMode

from fastpipe.kernels import linear_cross_entropy


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in bytes) any aten op produces, a CPU stand-in for peak memory.

    Tensors as large as the weight (its views and its gradient) are left out.
    """

    def __init__(self, weight_nbytes: int) -> None:
        super().__init__()
        self.weight_nbytes = weight_nbytes
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                nbytes = t.numel() * t.element_size()
                if nbytes != self.weight_nbytes:
                    self.nbytes = max(self.nbytes, nbytes)
        return out


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    ("tokens", "hidden", "vocab", "chunk"), [(1, 33, 1000, None), (37, 33, 1000, 8), (129, 64, 257, None)]
)
def test_matches_float64(tokens, hidden, vocab, chunk, with_bias, reduction):
    x64 = torch.randn(tokens, hidden, dtype=torch.float64)
    w64 = torch.randn(vocab, hidden, dtype=torch.float64) * 0.2
    b64 = torch.randn(vocab, dtype=torch.float64) if with_bias else None
    target = torch.randint(0, vocab, (tokens,))
    if tokens > 1:
        target[::5] = -100
    x, w = x64.float().requires_grad_(), w64.float().requires_grad_()
    b = b64.float().requires_grad_() if with_bias else None
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    br = b64.clone().requires_grad_() if with_bias else None

    loss = linear_cross_entropy(x, w, target, b, reduction=reduction, chunk_size=chunk)
    ref = F.cross_entropy(F.linear(xr, wr, br), target, reduction=reduction)
    # fp32 against float64: the logits' GEMM, the log-sum-exp over the vocabulary and the
    # reduction over tokens (the weight gradient sums over tokens too).
    k = hidden + vocab + tokens
    assert_close_reordered(loss.double(), ref, k=k, dtype=torch.float32)
    g = torch.randn(ref.shape, dtype=torch.float64)
    (loss * g.float()).sum().backward()
    (ref * g).sum().backward()
    for got, want in [(x, xr), (w, wr)] + ([(b, br)] if with_bias else []):
        assert_close_reordered(got.grad.double(), want.grad, k=k, dtype=torch.float32)


def test_3d_input_and_all_ignored():
    x = torch.randn(2, 3, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (2, 3))
    ref = F.cross_entropy((x @ w.t()).flatten(0, 1), t.flatten())
    torch.testing.assert_close(linear_cross_entropy(x, w, t), ref)
    t.fill_(-100)
    loss = linear_cross_entropy(x, w, t, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and torch.count_nonzero(x.grad) == 0


def test_default_chunk_rule():
    from fastpipe.kernels.cross_entropy import _chunk_size

    assert _chunk_size(16384, 32000, 4096, None) == 2048  # logits chunk ~ size of x
    assert _chunk_size(4096, 128256, 512, None) == 256  # floor: amortise the dW update
    assert _chunk_size(100, 32000, 4096, None) == 100  # never more than the tokens
    assert _chunk_size(100, 32000, 4096, 7) == 7


def test_32k_vocab_never_materialises_logits():
    tokens, hidden, vocab = (96, 64, 32000) if INTERPRET else (256, 128, 32000)
    x = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.05).requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    assert tokens != hidden  # else logits would be as large as the weight
    with LargestTensor(w.numel() * 4) as fused:
        loss = linear_cross_entropy(x, w, target, chunk_size=8)
        loss.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    with LargestTensor(w.numel() * 4) as eager:
        ref = F.cross_entropy(x @ w.t(), target)
        ref.backward()
    full_logits = tokens * vocab * 4
    assert eager.nbytes >= full_logits
    # Besides the weight and its gradient, the largest buffer is one logits chunk.
    assert fused.nbytes <= full_logits // 8
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, gx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, gw, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_cuda_peak_memory_far_below_logits():
    tokens, hidden, vocab = 8192, 1024, 32000
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    linear_cross_entropy(x, w, t).backward()
    fused_peak = torch.cuda.max_memory_allocated() - base
    gx, gw = x.grad.float(), w.grad.float()
    x.grad = w.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ref = F.cross_entropy((x @ w.t()).float(), t)
    ref.backward()
    eager_peak = torch.cuda.max_memory_allocated() - base
    assert fused_peak < 0.5 * eager_peak
    torch.testing.assert_close(gx, x.grad.float(), rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(gw, w.grad.float(), rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_autocast_bf16(reduction):
    x = torch.randn(37, 33, requires_grad=True)
    w = (torch.randn(1000, 33) * 0.2).requires_grad_()
    t = torch.randint(0, 1000, (37,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, w, t, reduction=reduction, chunk_size=8)
        ref = F.cross_entropy(F.linear(x, w).float(), t, reduction=reduction)
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-2)
    (gx,) = torch.autograd.grad(loss.sum(), [x])
    (gx_ref,) = torch.autograd.grad(ref.sum(), [x])
    torch.testing.assert_close(gx, gx_ref, rtol=5e-2, atol=5e-2 * gx_ref.abs().max().item())
