"""Linear weight gradients accumulated in the GEMM equal autograd's, and fall back where they would not."""

from __future__ import annotations

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime.wgrad import AccumulatingLinear, accumulating_linears, fusable_linears


def _accumulate(lin: nn.Linear, xs: list[torch.Tensor], fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Backward of each micro-batch in turn with ``lin.weight.grad`` as the running sum."""
    lin.zero_grad(set_to_none=True)
    input_grads = []
    for x in xs:
        x = x.clone().requires_grad_()
        with accumulating_linears([lin]) if fused else torch.enable_grad():
            out = lin(x)
        assert (type(out.grad_fn).__name__ == "AccumulatingLinearBackward") == fused
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
        input_grads.append(x.grad)
    assert lin.weight.grad is not None
    return lin.weight.grad.clone(), input_grads


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7), (7,)])
@pytest.mark.parametrize("bias", [True, False])
def test_accumulating_linear_matches_autograd_in_float64(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(7, 4, bias=bias).double()
    xs = [torch.randn(*shape, dtype=torch.float64) for _ in range(3)]
    ref_w, ref_x = _accumulate(lin, xs, fused=False)
    ref_b = lin.bias.grad.clone() if bias else None
    got_w, got_x = _accumulate(lin, xs, fused=True)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_x, ref_x):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if bias:
        torch.testing.assert_close(lin.bias.grad, ref_b, rtol=1e-12, atol=1e-12)


def test_falls_back_to_autograd_where_it_would_differ() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    with accumulating_linears([lin]):
        with torch.no_grad():
            assert lin(x).grad_fn is None
        lin.weight.requires_grad_(False)
        assert type(lin(x).grad_fn).__name__ != "AccumulatingLinearBackward"
        lin.weight.requires_grad_(True)
        with pytest.raises(RuntimeError):  # the error plain F.linear gives, not a new one
            lin(x.double())


def test_modules_are_restored_even_on_error() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    linears = fusable_linears(model, list(model.parameters()))
    assert linears == [model[0], model[2]]
    with pytest.raises(ValueError, match="boom"), accumulating_linears(linears):
        assert "forward" in model[0].__dict__
        raise ValueError("boom")
    assert all("forward" not in lin.__dict__ for lin in linears)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    assert fusable_linears(nn.Sequential(frozen), []) == []


class _Sub(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_linear_subclasses_are_left_alone() -> None:
    model = nn.Sequential(_Sub(3, 3), nn.Linear(3, 3))
    assert fusable_linears(model, list(model.parameters())) == [model[1]]


# Reductions from input to loss through _mlp, plus the rows a weight gradient sums over.
MLP_K = 6 + 16 + 16 + 16 + 16


def _mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_pipe_gradients_equal_with_and_without_fusion(path: str, checkpoint: str) -> None:
    x, y = torch.randn(10, 6), torch.randn(10, 3)
    grads = []
    for fused in (False, True):
        pipe = Pipe(_mlp(), balance=[2, 3, 2], chunks=4, checkpoint=checkpoint, fused_wgrad=fused)
        assert bool(pipe._stages[0].linears) == fused
        for _ in range(2):  # the second step adds to .grad left by the first
            if path == "forward":
                nn.functional.mse_loss(pipe(x), y).backward()
            else:
                pipe.train_step(x, y, nn.functional.mse_loss, schedule=path)
        grads.append([p.grad.clone() for p in pipe.parameters()])
        assert all("forward" not in m.__dict__ for m in pipe.modules())
    for a, b in zip(*grads):  # the GEMM's accumulation against autograd's add: another rounding
        assert_close_reordered(a, b, k=MLP_K)


def test_function_is_usable_directly() -> None:
    w = nn.Parameter(torch.randn(3, 2, dtype=torch.float64))
    x = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    AccumulatingLinear.apply(x, w, None).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(4, 3, dtype=torch.float64).t().mm(x.detach()))


class _CheckpointedBlock(nn.Module):
    """torch.utils.checkpoint inside a stage: its recompute must save what the forward saved."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda t: self.b(torch.tanh(self.a(t))), x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_inside_a_stage(path: str, reentrant: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_CheckpointedBlock(reentrant) for _ in range(3)])
    ref = nn.Sequential(*[_CheckpointedBlock(reentrant) for _ in range(3)])
    ref.load_state_dict(model.state_dict())
    # Reentrant checkpointing gives no parameter gradients unless an input requires grad.
    x, y = torch.randn(8, 6, requires_grad=True), torch.randn(8, 6)
    nn.functional.mse_loss(ref(x), y).backward()
    pipe = Pipe(model, balance=[1, 2], chunks=4, checkpoint="never")
    assert pipe._stages[0].linears

    def step() -> None:
        if path == "forward":
            nn.functional.mse_loss(pipe(x), y).backward()
        else:
            pipe.train_step(x, y, nn.functional.mse_loss, schedule=path)

    if reentrant:  # stage backwards pass inputs=, which torch refuses for reentrant checkpoints
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            step()
        return
    step()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        assert_close_reordered(p.grad, q.grad, k=MLP_K)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7)])
def test_accumulating_linear_on_gpu_matches_autograd(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(7, 4).double().cuda()
    xs = [torch.randn(*shape, dtype=torch.float64, device="cuda") for _ in range(3)]
    ref_w, ref_x = _accumulate(lin, xs, fused=False)
    got_w, got_x = _accumulate(lin, xs, fused=True)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_x, ref_x):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_pipe_on_gpu_fused_equals_unfused_with_and_without_autocast() -> None:
    x, y = torch.randn(16, 6, device="cuda"), torch.randn(16, 3, device="cuda")
    for autocast in (False, True):
        grads = []
        for fused in (False, True):
            devices = ["cuda:0", "cuda:0"]
            pipe = Pipe(_mlp(), balance=[3, 4], devices=devices, chunks=4, checkpoint="never", fused_wgrad=fused)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                out = pipe(x)
            nn.functional.mse_loss(out.float(), y).backward()
            grads.append([p.grad.clone() for p in pipe.parameters()])
        for a, b in zip(*grads):
            if autocast:  # every GEMM output rounds to bf16 (eps 2**-7), a few roundings deep
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
            else:
                assert_close_reordered(a, b, k=MLP_K)
