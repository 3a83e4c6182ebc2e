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
    assert _chunk_size(8192, 128256, 4096, None) == 256  # Liger-Kernel's chunk at the shape
    assert _chunk_size(4096, 128256, 512, None) == 64  # floor: keep the chunk GEMMs wide enough
    assert _chunk_size(16384, 32000, 4096, None, ratio=2.0) == 4096
    assert _chunk_size(40, 32000, 4096, None) == 40  # never more than the tokens
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


STRATEGIES = ["recompute", "accumulate"]


def _problem(tokens, hidden, vocab, dtype, with_bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.2
    b = torch.randn(vocab, generator=gen, dtype=torch.float64) if with_bias else None
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    target[::4] = -100
    return x, w, b, target


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_match_float64(strategy, reduction):
    """Both strategies, several chunks and vocab blocks, ignore_index, bias: fp32 vs float64."""
    from fastpipe.kernels.configs import override

    x64, w64, b64, target = _problem(45, 24, 700, torch.float64, True)
    x, w, b = (t.float().requires_grad_() for t in (x64, w64, b64))
    refs = [t.clone().requires_grad_() for t in (x64, w64, b64)]
    with override("lce", dict(strategy=strategy)):
        loss = linear_cross_entropy(x, w, target, b, reduction=reduction, chunk_size=16)
        g = torch.randn(loss.shape, dtype=torch.float64)
        (loss * g.float()).sum().backward()
    ref = F.cross_entropy(F.linear(*refs), target, reduction=reduction)
    (ref * g).sum().backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip((x, w, b), refs, strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_inputs_near_float64(dtype, strategy):
    """16-bit inputs: GEMMs in that dtype with fp32 accumulation. Error budget: the logits and the
    logits' gradient are rounded to the 16-bit dtype once each (rel. 2**-8 for bf16, 2**-11 for
    fp16, and the interpreter truncates: up to 2x that), so gradients land within a few times that."""
    from fastpipe.kernels.configs import override

    if dtype == torch.float16 and not INTERPRET:
        pytest.skip("CPU fp16 matmul is too slow/unsupported on some builds; covered by the interpreter and GPU")
    x64, w64, b64, target = _problem(40, 32, 300, dtype, False)
    x, w = (t.to(dtype).requires_grad_() for t in (x64, w64))
    xr, wr = (t.to(dtype).double().requires_grad_() for t in (x64, w64))
    with override("lce", dict(strategy=strategy)):
        loss = linear_cross_entropy(x, w, target, chunk_size=16)
        loss.backward()
    ref = F.cross_entropy(F.linear(xr, wr), target)
    ref.backward()
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-11
    assert loss.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == dtype
    assert abs(loss.double().item() - ref.item()) <= 4 * ulp * abs(ref.item())
    assert _rel(x.grad, xr.grad) <= 8 * ulp
    assert _rel(w.grad, wr.grad) <= 8 * ulp


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_backward_again_with_the_same_or_another_upstream_gradient(reduction):
    """A pipeline's split backward runs the loss node twice (input pass, weight pass): the
    gradients computed in forward must serve both, also for another upstream gradient."""
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 30, (5,))
    loss = linear_cross_entropy(x, w, target, reduction=reduction)
    # The reference is the kernel's own single backward: only the repeat is under test.
    want = torch.autograd.grad(linear_cross_entropy(x, w, target, reduction=reduction), [x, w])
    for scale in (0.5, 0.5, 3.0):
        got = torch.autograd.grad(loss * scale, [x, w], retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, scale * b)


def test_backward_again_after_its_gradients_were_written_is_refused():
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    loss = linear_cross_entropy(x, w, torch.randint(0, 30, (5,)))
    (gx,) = torch.autograd.grad(loss, [x], retain_graph=True)
    gx.add_(1.0)  # the caller owns what backward returned
    with pytest.raises(RuntimeError, match="modified after its first backward"):
        torch.autograd.grad(loss, [x])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_autocast_bf16_all_reductions_with_ignore_and_bias(reduction):
    """Under CPU autocast the GEMMs run in bf16 like eager's F.linear; losses and gradients come
    back in the inputs' dtype (fp32)."""
    x64, w64, b64, target = _problem(37, 33, 500, torch.float64, True, seed=3)
    x, w, b = (t.float().requires_grad_() for t in (x64, w64, b64))
    xr, wr, br = (t.float().clone().requires_grad_() for t in (x64, w64, b64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, w, target, b, reduction=reduction, chunk_size=8)
        ref = F.cross_entropy(F.linear(xr, wr, br).float(), target, reduction=reduction)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    g = torch.rand(ref.shape)
    (loss * g).sum().backward()
    (ref * g).sum().backward()
    for got, want in [(x, xr), (w, wr), (b, br)]:
        assert got.grad.dtype == torch.float32
        assert _rel(got.grad, want.grad.double()) <= 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_bf16_triton_path(strategy):
    """The compiled kernels and bf16 GEMMs against float64; "recompute" peaks at the gradients plus
    one logits chunk (Liger-Kernel's memory), "accumulate" adds one fp32 weight-sized buffer."""
    from fastpipe.kernels.configs import override

    tokens, hidden, vocab = 2048, 512, 32000
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 0.05).bfloat16().requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    t[::7] = -100
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with override("lce", dict(strategy=strategy)):
        linear_cross_entropy(x, w, t).backward()
    peak = torch.cuda.max_memory_allocated() - base
    chunk = 256 * vocab * 2  # _chunk_size(2048, 32000, 512) tokens of bf16 logits
    grads = x.numel() * 2 + w.numel() * 2
    extra = w.numel() * 4 if strategy == "accumulate" else 0
    assert peak <= grads + extra + chunk + 8 * 2**20, (peak, grads, extra, chunk)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(xr @ wr.t(), t)
    ref.backward()
    assert _rel(x.grad, xr.grad) <= 2e-2 and _rel(w.grad, wr.grad) <= 2e-2


def test_fp16_gradients_with_a_loss_scale_are_as_good_as_eager():
    """fp16 with a GradScaler: the upstream gradient (the scaler's factor) must reach each row's
    scale before (softmax - onehot) / n_valid is rounded to fp16, as in eager, where the logits'
    gradient is formed in fp32. Folding 1 / n_valid in first flushed the small off-target
    gradients to zero (here 0.45% of dW and twice eager's error on dx)."""
    torch.manual_seed(0)
    tokens, hidden, vocab = 1024, 16, 8192
    x64 = torch.randn(tokens, hidden, dtype=torch.float64)
    w64 = torch.randn(vocab, hidden, dtype=torch.float64)
    target = torch.randint(0, vocab, (tokens,))
    target[::7] = -100
    scale = torch.tensor([2.0**15])  # what GradScaler multiplies by (fp32, so the product is fp32)
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    F.cross_entropy(F.linear(xr, wr), target).backward()
    x, w = (t.half().requires_grad_() for t in (x64, w64))
    (linear_cross_entropy(x, w, target) * scale).sum().backward()
    xe, we = (t.half().requires_grad_() for t in (x64, w64))
    (F.cross_entropy(F.linear(xe, we).float(), target) * scale).sum().backward()  # eager, as autocast runs it

    def error(got, want):
        return float((got.double() / scale.double() - want).norm() / want.norm())

    assert error(x.grad, xr.grad) <= 1.1 * error(xe.grad, xr.grad)
    assert error(w.grad, wr.grad) <= 1.1 * error(we.grad, wr.grad)
    assert (w.grad == 0).sum() <= (we.grad == 0).sum()


class LiveWeightSized(TorchDispatchMode):
    """Weak references to every tensor at least as large as the weight that an aten op produces."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.refs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.weight.numel():
                self.refs.append(weakref.ref(t))
        return out

    def alive(self) -> int:
        import gc

        gc.collect()
        ptr = self.weight.untyped_storage().data_ptr()
        live = [r() for r in self.refs]
        return len({t.untyped_storage().data_ptr() for t in live if t is not None} - {ptr})


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_micro_batches_in_flight_hold_no_weight_sized_gradient(reduction):
    # A pipeline's forward phase (GPipe, checkpoint="never") runs M forwards before any
    # backward: one dW per micro-batch kept from forward held M x |W|.
    torch.manual_seed(0)
    w = torch.randn(300, 16, requires_grad=True)
    xs = [torch.randn(8, 16, requires_grad=True) for _ in range(4)]
    ts = [torch.randint(0, 300, (8,)) for _ in range(4)]
    mode = LiveWeightSized(w)
    with mode:
        losses = [linear_cross_entropy(x, w, t, reduction=reduction) for x, t in zip(xs, ts)]
    assert mode.alive() == 0
    sum(losses).backward()
    wr = w.detach().clone().requires_grad_()
    sum(F.cross_entropy(x.detach() @ wr.t(), t, reduction=reduction) for x, t in zip(xs, ts)).backward()
    assert_close_reordered(w.grad, wr.grad, k=8 * 4 + 16)


@pytest.mark.gpu
def test_cuda_forwards_in_flight_hold_no_weight_sized_gradient():
    """Four forwards before any backward (a pipeline's forward phase) on the compiled path:
    what they keep is far below one weight (it was one weight per forward)."""
    tokens, hidden, vocab = 1024, 512, 32000
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 0.05).bfloat16().requires_grad_()
    xs = [torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(4)]
    ts = [torch.randint(0, vocab, (tokens,), device="cuda", generator=gen) for _ in range(4)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    losses = [linear_cross_entropy(x, w, t) for x, t in zip(xs, ts)]
    held = torch.cuda.memory_allocated() - base
    assert held < w.numel() * w.element_size() // 2, held
    sum(losses).backward()
    wr = w.detach().double().requires_grad_()
    sum(F.cross_entropy(x.detach().double() @ wr.t(), t) for x, t in zip(xs, ts)).backward()
    assert _rel(w.grad, wr.grad) <= 2e-2


class _Head(torch.nn.Module):
    """Holds the projection ``linear_cross_entropy`` applies in the loss (as an LM head does)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_pipeline_gets_each_micro_batch_s_weight_gradient_once(schedule, monkeypatch):
    # zb-h1 runs the loss node twice per micro-batch (input pass, then weight pass): dW is
    # computed once, not twice or never.
    import fastpipe.kernels.cross_entropy as ce
    from fastpipe import Pipe

    calls = []
    real = ce._weight_grad
    monkeypatch.setattr(ce, "_weight_grad", lambda *a: calls.append(1) or real(*a))

    def build() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), _Head(40, 16))

    x, y = torch.randn(8, 16), torch.randint(0, 40, (8,))
    plain = build()
    linear_cross_entropy(plain(x), plain[-1].weight, y).backward()
    calls.clear()
    model = build()
    loss_fn = lambda h, t: linear_cross_entropy(h, model[-1].weight, t)  # noqa: E731
    loss_fn.reduction = "mean"
    Pipe(model, [2, 2], chunks=4).train_step(x, y, loss_fn, schedule=schedule)
    assert len(calls) == 4
    for (name, got), want in zip(model.named_parameters(), plain.parameters()):
        assert_close_reordered(got.grad, want.grad, k=64), name
