"""A split backward's deferred Linear work: B computes no weight GEMM, W adds it in the GEMM,
and B + W equal one plain backward, GEMM for GEMM."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fastpipe.runtime.split_backward import backward_inputs, backward_weights
from fastpipe.runtime.step import Stage
from fastpipe.runtime.wgrad import Deferred, DeferringLinear, accumulating_linears, fusable_linears

GEMMS = {"mm", "addmm", "bmm", "matmul", "linear"}


class _Gemms(TorchDispatchMode):
    """Counts the matrix products that run, and the shapes they produce."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__.rstrip("_") in GEMMS:
            self.shapes.append(tuple(out.shape))
        return out


class _Block(nn.Module):
    def __init__(self, norm: bool = True, bias: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6) if norm else nn.Identity()
        self.fc1, self.fc2 = nn.Linear(6, 10, bias=bias), nn.Linear(10, 6, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class _Twice(nn.Module):
    """One Linear called twice: two records for one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


class _Tied(nn.Module):
    """A Linear whose weight a non-Linear op also uses in the same stage."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6, bias=False)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)) + x @ self.fc.weight


MODELS: dict[str, Callable[[], nn.Module]] = {
    "block": lambda: nn.Sequential(_Block(), _Block()),
    "no-norm": lambda: nn.Sequential(_Block(norm=False), _Block(norm=False)),
    "no-bias": lambda: _Block(bias=False),
    "twice": _Twice,
    "tied": _Tied,
}


def _plain(
    model: nn.Module, x: torch.Tensor, dy: torch.Tensor, gemms: _Gemms | None = None
) -> list[torch.Tensor | None]:
    xs = x.detach().requires_grad_(x.requires_grad)
    out = model(xs)
    params = list(model.parameters())
    with gemms if gemms is not None else _Gemms():
        got = torch.autograd.grad(out, [*params, *([xs] if x.requires_grad else [])], dy, allow_unused=True)
    return list(got)


def _split(
    model: nn.Module, x: torch.Tensor, dy: torch.Tensor, gemms: dict[str, _Gemms] | None = None
) -> list[torch.Tensor | None]:
    stage = Stage(model, torch.device("cpu"))  # the step runner's choices of linears and early params
    params = stage.params
    records = Deferred()
    xs = x.detach().requires_grad_(x.requires_grad)  # a leaf, as a stage's input is
    with accumulating_linears(stage.linears, records):
        out = model(xs)
    assert records.records == []  # the forward defers nothing yet
    leaves = [xs] if x.requires_grad else []
    gemms = gemms if gemms is not None else {"B": _Gemms(), "W": _Gemms()}
    with gemms["B"]:
        leaf_grads, work = backward_inputs([out], [dy], leaves, params, early=stage.early, records=records)
    sums: list[torch.Tensor | None] = [None] * len(params)
    with gemms["W"]:
        backward_weights(work, sums)
    assert records.records == []  # consumed by W
    return [*sums, *leaf_grads]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("input_grad", [True, False])
def test_b_then_w_equals_one_backward(name: str, input_grad: bool) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=input_grad)
    dy = torch.randn(4, 6, dtype=torch.float64)
    ref = _plain(model, x, dy)
    got = _split(model, x, dy)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("input_grad", [True, False])
def test_b_computes_no_weight_gemm_and_no_gemm_is_wasted(input_grad: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    weights = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)]
    x = torch.randn(5, 6, requires_grad=input_grad)
    dy = torch.randn(5, 6)
    gemms = {"B": _Gemms(), "W": _Gemms()}
    _split(model, x, dy, gemms)
    assert not set(weights) & set(gemms["B"].shapes)  # no dW in B
    assert sorted(s for s in gemms["W"].shapes if s in weights) == sorted(weights)  # each dW once, in W
    plain = _Gemms()
    _plain(model, x, dy, plain)
    # Without an input gradient, the first Linear's dx feeds only the LayerNorm's parameters:
    # B skips it and W computes it once, as the plain backward does.
    assert len(gemms["B"].shapes) + len(gemms["W"].shapes) == len(plain.shapes)


def test_b_frees_the_graph_when_only_linears_hold_parameters() -> None:
    model = nn.Sequential(_Block(norm=False))
    x = torch.randn(3, 6, requires_grad=True)
    params = list(model.parameters())
    records = Deferred()
    with accumulating_linears(fusable_linears(model, params), records):
        out = model(x)
    _, work = backward_inputs([out], [torch.ones_like(out)], [x], params, records=records)
    assert work.groups == [] and len(records.records) == 2
    with pytest.raises(RuntimeError, match="second time"):
        out.backward(torch.ones_like(out))


@pytest.mark.parametrize("input_grad", [True, False])
def test_the_step_runner_defers_every_split_pairs_linears(monkeypatch: pytest.MonkeyPatch, input_grad: bool) -> None:
    """And runs a first-stage pair combined where no input gradient is wanted and W follows B at once."""
    from fastpipe import Pipe
    from fastpipe.runtime import split_backward
    from fastpipe.schedule import build
    from fastpipe.schedule.fuse import adjacent_pairs

    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), _Block(), _Block())
    ref = nn.Sequential(_Block(), _Block(), _Block(), _Block())
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 6, requires_grad=input_grad), torch.randn(8, 6)
    applied: list[int] = []
    plain_apply = split_backward.apply_deferred

    def counting(store: Deferred, params: list[torch.Tensor], sums: list[torch.Tensor | None]) -> None:
        applied.append(len(store.records))
        plain_apply(store, params, sums)

    monkeypatch.setattr(split_backward, "apply_deferred", counting)
    # wgrad_batch=1: each W runs its own pair's work (batches: test_weight_batches)
    pipe = Pipe(model, balance=[1, 1, 1, 1], chunks=4, checkpoint="never", wgrad_batch=1)
    pipe.train_step(x, y, nn.functional.mse_loss, schedule="zb-h1", trace=True)
    schedule = build("zb-h1", 4, 4)
    combined = set() if input_grad else {p for p in adjacent_pairs(schedule) if p[0] == 0}
    assert input_grad or combined  # the case is exercised
    splits = len(schedule.split_pairs - combined)
    assert splits > 0 and applied == [2] * splits  # each split pair's two Linears, deferred to its W
    ws = {e.action: e.end - e.start for e in pipe.last_timeline.events if "W" in e.action}
    assert all(ws[f"0W{m}"] < 1e-3 for _, m in combined)  # their W had nothing left to do
    x_ref = x.detach().requires_grad_(input_grad)
    nn.functional.mse_loss(ref(x_ref), y).backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):  # summed over micro-batches in another order
        assert_close_reordered(p.grad, q.grad, k=8 + 4 * (6 + 10))


def test_under_cpu_bf16_autocast_the_weight_gemms_still_wait_for_w() -> None:
    """Autocast casts operands around each Linear: the weight GEMMs must still run in W alone."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    weights = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)]
    x, dy = torch.randn(5, 6, requires_grad=True), torch.randn(5, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _plain(model, x, dy)
        gemms = {"B": _Gemms(), "W": _Gemms()}
        got = _split(model, x, dy, gemms)
    assert not set(weights) & set(gemms["B"].shapes)
    assert sorted(s for s in gemms["W"].shapes if s in weights) == sorted(weights)
    for a, b in zip(got, ref):
        assert a is not None and b is not None
        assert_close_reordered(a, b, k=2 * (6 + 10) + 5, dtype=torch.bfloat16)  # bf16 GEMMs, other calls


@pytest.mark.gpu
@pytest.mark.parametrize("input_grad", [True, False])
def test_b_then_w_on_gpu_equals_one_backward(input_grad: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block()).double().cuda()
    x = torch.randn(4, 6, dtype=torch.float64, device="cuda", requires_grad=input_grad)
    dy = torch.randn(4, 6, dtype=torch.float64, device="cuda")
    for a, b in zip(_split(model, x, dy), _plain(model, x, dy)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("width", [1, 2])
def test_a_split_step_leaves_plain_gradients_and_frees_its_records(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """W runs outside the engine: its GEMMs must build no graph into .grad, nor keep a record alive."""
    import gc
    import weakref

    from fastpipe import Pipe

    seen: list[weakref.ref] = []
    plain_backward = DeferringLinear.backward

    def watching(ctx: Any, grad: torch.Tensor) -> Any:
        seen.append(weakref.ref(grad))
        return plain_backward(ctx, grad)

    monkeypatch.setattr(DeferringLinear, "backward", staticmethod(watching))
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), _Block())
    pipe = Pipe(model, balance=[1, 1, 1], chunks=4, checkpoint="never", wgrad_batch=width)
    x, y = torch.randn(8, 6, requires_grad=True), torch.randn(8, 6)
    pipe.train_step(x, y, nn.functional.mse_loss, schedule="zb-h1")
    gc.collect()
    assert seen and not [r for r in seen if r() is not None]
    for name, p in pipe.named_parameters():
        assert p.grad is not None and p.grad.grad_fn is None and not p.grad.requires_grad, name
