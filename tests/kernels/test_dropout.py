"""Seed-based dropout: reproducible masks, right drop rate, identical values in a recompute."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from kernel_testutils import INTERPRET
from torch.utils.checkpoint import checkpoint

from fastpipe.kernels import Dropout, dropout


def test_same_seed_same_mask_other_seed_other_mask():
    x = torch.randn(129, 1000)
    a, b, c = dropout(x, 0.5, seed=7), dropout(x, 0.5, seed=7), dropout(x, 0.5, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a != 0, c != 0)


def test_seed_drawn_from_torch_default_generator():
    x = torch.randn(33, 1000)
    torch.manual_seed(123)
    a = dropout(x, 0.3)
    torch.manual_seed(123)
    b = dropout(x, 0.3)
    assert torch.equal(a, b)
    state = torch.get_rng_state()
    c = dropout(x, 0.3)
    torch.set_rng_state(state)
    assert torch.equal(dropout(x, 0.3), c)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_rate_matches_p(p):
    n = 129 * 1000
    y = dropout(torch.ones(n), p, seed=42)
    rate = (y == 0).float().mean().item()
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n)
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / (1 - p)))


def test_backward_reuses_the_mask():
    x = torch.randn(7, 1000, requires_grad=True)
    y = dropout(x, 0.4, seed=3)
    g = torch.randn_like(y)
    y.backward(g)
    keep = y.detach() != 0
    torch.testing.assert_close(x.grad, torch.where(keep, g / 0.6, 0.0))


def test_recompute_gives_identical_values(saved_bytes):
    w = torch.randn(33, 33, requires_grad=True)
    x = torch.randn(7, 33, requires_grad=True)

    def block(inp: torch.Tensor) -> torch.Tensor:
        return dropout(inp @ w, 0.5) @ w

    torch.manual_seed(5)
    block(x).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch.manual_seed(5)
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert torch.equal(x.grad, gx) and torch.equal(w.grad, gw)


def test_only_the_seed_is_saved(saved_bytes):
    x = torch.randn(129, 1000, requires_grad=True)
    nbytes, _ = saved_bytes(lambda: dropout(x, 0.5), [])
    assert nbytes == 8


def test_edge_cases():
    x = torch.randn(7, 33)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.count_nonzero(dropout(x, 1.0)) == 0
    with pytest.raises(ValueError):
        dropout(x, 1.5)


def test_module_is_a_drop_in():
    ref, mod = torch.nn.Dropout(0.2), Dropout(0.2)
    assert mod.state_dict().keys() == ref.state_dict().keys() and repr(mod) == repr(ref)
    mod.eval()
    x = torch.randn(3, 5)
    assert torch.equal(mod(x), x)


@pytest.mark.gpu
def test_cuda_same_seed_same_mask():
    x = torch.randn(129, 1000, device="cuda")
    torch.cuda.manual_seed(1)
    a = dropout(x, 0.5)
    torch.cuda.manual_seed(1)
    assert torch.equal(a, dropout(x, 0.5))
    rate = (a == 0).float().mean().item()
    assert abs(rate - 0.5) < 0.01


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernel under TRITON_INTERPRET=1")
@pytest.mark.parametrize("numel", [2**31 - 1, 2**31 - 1000])
def test_last_block_below_2_31_elements_stays_in_bounds(numel, monkeypatch):
    """The last program of a launch over just under 2**31 elements touches only [0, numel).

    Its int32 offsets peak at ``cdiv(numel, BLOCK) * BLOCK - 1 <= 2**31 - 1`` as BLOCK (a
    ``tl.arange`` length) is a power of two, so they cannot wrap negative and slip through the
    ``offs < numel`` mask. The tensors are stride-0 expansions (no real memory); the
    interpreter's loads and stores of them are recorded, not performed, and only the last
    program runs.
    """
    import numpy as np
    from triton.runtime import interpreter

    from fastpipe.kernels.configs import launch_config

    # The module, not the function that ``fastpipe.kernels`` exports under the same name.
    dropout_module = importlib.import_module("fastpipe.kernels.dropout")

    x, y = torch.zeros(1).expand(numel), torch.zeros(1).expand(numel)
    seed = torch.tensor([7], dtype=torch.int64)
    block = launch_config("elementwise", x.device)["block"]
    last = -(-numel // block) - 1
    builder = interpreter.interpreter_builder
    real_load = builder.create_masked_load
    touched: dict[str, list[np.ndarray]] = {"load": [], "store": []}

    def offsets(ptrs, mask, base: int) -> np.ndarray:
        addr = ptrs.data[mask.data].astype(np.int64)
        return (addr - base) // 4  # fp32 elements

    def load(ptrs, mask, other, *rest):
        if ptrs.data.size == 1:  # the seed: a real one-element tensor
            return real_load(ptrs, mask, other, *rest)
        touched["load"].append(offsets(ptrs, mask, x.data_ptr()))
        return interpreter.TensorHandle(np.zeros(ptrs.data.shape, np.float32), ptrs.get_element_ty())

    def store(ptrs, value, mask, *rest):
        touched["store"].append(offsets(ptrs, mask, y.data_ptr()))

    pid = interpreter.TensorHandle(np.array([last], dtype=np.int32), interpreter.tl.int32)
    monkeypatch.setattr(builder, "create_get_program_id", lambda axis: pid)
    monkeypatch.setattr(builder, "create_masked_load", load)
    monkeypatch.setattr(builder, "create_masked_store", store)
    dropout_module._dropout_kernel[(1,)](x, y, seed, numel, 0.5, 2.0, BLOCK=block, num_warps=1)

    want = np.arange(last * block, numel, dtype=np.int64)
    for kind in ("load", "store"):
        (got,) = touched[kind]
        assert got.min() >= 0 and got.max() < numel, kind
        assert np.array_equal(np.sort(got), want), kind
