"""Pipe(deferred_batch_norm=True) gives the running statistics of one full-batch pass.

Each micro-batch is normalised with its own statistics, as BatchNorm does for a batch of that
size; the statistics are summed over the micro-batches and committed once per step, exactly (no
fp32 cancellation on inputs far from zero) and cheaply (no fp64 activation copies, no host syncs).
``Pipe.fit`` with deferred BatchNorm is in ``asynchronous/test_fit_deferred_batch_norm.py``.
"""

import copy

import pytest
import torch
import torch.utils.checkpoint
from fp_tolerance import assert_close_reordered
from torch import nn
from torch.overrides import TorchFunctionMode

from fastpipe import DeferredBatchNorm, Pipe


def bn_model():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 6),
        nn.BatchNorm1d(6, momentum=None),
    )


def stats_model(momentum):
    # Only one BatchNorm: later ones would see inputs normalised per micro-batch, which
    # legitimately differ from a full-batch pass.
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.BatchNorm2d(4, momentum=momentum),
        nn.Flatten(),
        nn.Linear(100, 6),
        nn.Tanh(),
    )


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_running_stats_equal_one_full_batch_pass(checkpoint, momentum):
    model = stats_model(momentum)
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[3, 3], chunks=4, checkpoint=checkpoint, deferred_batch_norm=True)
    for step in range(3):
        x = torch.randn(16, 3, 5, 5) * (step + 1) + step
        pipe(x).sum().backward()
        ref(x)
    for key, value in ref.state_dict().items():
        if "running" in key or "num_batches" in key:
            # Per-channel sums over 16 x 5 x 5 values, per micro-batch then added, against one pass.
            assert_close_reordered(pipe.state_dict()[key], value, k=16 * 25 + 27, msg=key)


def test_keys_match_and_layers_converted():
    model = bn_model()
    keys = list(model.state_dict())
    pipe = Pipe(model, balance=[3, 3], chunks=2, deferred_batch_norm=True)
    assert list(pipe.state_dict()) == keys
    assert isinstance(pipe[1], DeferredBatchNorm)


def test_eval_uses_running_stats():
    model = bn_model()
    pipe = Pipe(model, balance=[3, 3], chunks=2, deferred_batch_norm=True)
    pipe(torch.randn(8, 3, 5, 5))
    pipe.eval()
    ref = copy.deepcopy(nn.Sequential(*[pipe[i] for i in range(6)]))
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(pipe(x), ref(x))


def test_normalises_each_micro_batch_like_torch():
    # In training, each micro-batch is normalised with its own statistics, as BatchNorm
    # does for a batch of that size.
    bn = nn.BatchNorm1d(5)
    dbn = DeferredBatchNorm.convert(copy.deepcopy(bn))
    x = torch.randn(7, 5)
    torch.testing.assert_close(dbn(x), bn(x))


def test_slots_accumulate_and_commit_apart():
    # Pipe.fit gives each mini-batch its own slot: committing one leaves the others (and the default) pending.
    from fastpipe.model.batchnorm import accumulating_into

    torch.manual_seed(0)
    a, b, c = torch.randn(6, 3), torch.randn(6, 3) + 5, torch.randn(6, 3) - 5
    dbn = DeferredBatchNorm.convert(nn.BatchNorm1d(3))
    ref = copy.deepcopy(dbn)
    with accumulating_into("one"):
        dbn(a)
        with accumulating_into("two"):
            dbn(b)
        dbn(a)
    dbn(c)  # the default slot
    dbn.commit("one")
    ref(torch.cat([a, a]))
    ref.commit()
    torch.testing.assert_close(dbn.running_mean, ref.running_mean)
    torch.testing.assert_close(dbn.running_var, ref.running_var)
    assert set(dbn._pending) == {"two", None}
    dbn.discard("two")
    dbn.commit()
    ref(c)
    ref.commit()
    torch.testing.assert_close(dbn.running_var, ref.running_var)
    assert int(dbn.num_batches_tracked) == 2 and dbn._pending == {}


class _Checkpointed(nn.Module):
    """``inner`` under the user's own torch.utils.checkpoint: recomputed inside the backward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_an_inner_checkpoint_does_not_count_a_micro_batch_twice(checkpoint):
    # The recompute of a torch.utils.checkpoint runs inside the backward, outside fastpipe's own
    # recompute flag; it must not add the micro-batch's statistics a second time.
    def model(wrap):
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh())
        return nn.Sequential(nn.Linear(4, 6), _Checkpointed(block) if wrap else block, nn.Linear(6, 2))

    plain = Pipe(model(False), balance=[1, 2], chunks=4, checkpoint=checkpoint, deferred_batch_norm=True)
    inner = Pipe(model(True), balance=[1, 2], chunks=4, checkpoint=checkpoint, deferred_batch_norm=True)
    for step in range(3):
        x, y = torch.randn(16, 4) * (step + 1), torch.randn(16, 2)
        for pipe in (plain, inner):
            pipe.train_step(x, y, nn.MSELoss())
    want = {k.replace("1.", "", 1): v for k, v in plain.state_dict().items()}
    got = {k.replace("1.inner.", "", 1): v for k, v in inner.state_dict().items()}
    for key, value in want.items():
        if "running" in key or "num_batches" in key:
            assert torch.equal(got[key], value), key
    bn = inner[1].inner[1]
    assert int(bn.num_batches_tracked) == 3 and bn._pending == {}


# -- the bookkeeping: exact statistics without fp64 activation copies or host syncs ---------


class Watch(TorchFunctionMode):
    """Records every torch function called inside it, with its result."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((getattr(func, "__name__", str(func)), out))
        return out


@pytest.mark.parametrize("momentum", [0.1, None])
def test_far_from_zero_inputs_give_full_batch_statistics(momentum):
    # A large mean over a unit variance: E[x^2] - E[x]^2 in fp32 would lose the variance
    # (an ulp of 1e6 is 0.06). The reference is BatchNorm over the very same numbers in
    # fp64; fp32 statistics of values near 3e3 are good to a few ulps of 3e3 (2.4e-4).
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3, momentum=momentum).double()
    dbn = DeferredBatchNorm.convert(nn.BatchNorm1d(3, momentum=momentum))
    for step in range(3):
        x = torch.randn(64, 3) + 1e3 * (step + 1)
        bn(x.double())
        for mb in x.split([7, 20, 37]):  # uneven micro-batches
            dbn(mb)
        dbn.commit()
    torch.testing.assert_close(dbn.running_mean, bn.running_mean.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(dbn.running_var, bn.running_var.float(), rtol=1e-3, atol=1e-5)
    assert int(dbn.num_batches_tracked) == int(bn.num_batches_tracked) == 3


def test_no_host_sync_and_no_activation_sized_fp64_tensor():
    dbn = DeferredBatchNorm.convert(nn.BatchNorm2d(4, momentum=None))
    x = torch.randn(8, 4, 5, 5)
    with Watch() as watch:
        dbn(x)
        dbn(x)
        dbn.commit()
    names = [n for n, _ in watch.calls]
    assert not {"item", "__float__", "__int__", "tolist"} & set(names), names
    big64 = [
        n for n, out in watch.calls if isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel() > 4
    ]
    assert big64 == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_statistics_widen_a_slice_at_a_time(monkeypatch, dtype):
    import fastpipe.model.batchnorm as bn

    x = torch.randn(12, 3, 5, dtype=torch.float32).mul(3).add(1).to(dtype)
    whole = DeferredBatchNorm(3).to(dtype)
    whole(x)
    whole.commit()
    widened: list[int] = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: widened.append(t.numel()) or real_float(t))
    monkeypatch.setattr(bn, "WIDEN_ELEMENTS", 2 * 3 * 5)  # two samples at a time
    sliced = DeferredBatchNorm(3).to(dtype)
    sliced(x)
    sliced.commit()
    assert widened and max(widened) <= 2 * 3 * 5
    ref = x.float().transpose(0, 1).reshape(3, -1)
    torch.testing.assert_close(sliced.running_mean, whole.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sliced.running_var, whole.running_var, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sliced.running_mean.float(), 0.1 * ref.mean(1), rtol=1e-3, atol=1e-3)
